//! A decoder of any family in the architecture table (Llama, Mistral,
//! Qwen2/3, Gemma 2/3, Phi-3, SmolLM2) with the engine's own forward pass: several sequences per step, each with its own KV cache
//! and its own number of new tokens (a prefill chunk or one decode token).
//!
//! On a CPU with AVX-512 VNNI every matmul, prefill and decode alike, runs
//! on int8 weights in the engine's own tiled kernel (`qmatmul`): a quarter
//! of the bytes of f32 to stream per decode step, four times the
//! multiply-adds per instruction for prefill. Elsewhere weights are
//! dequantized to f32 (a Q8_0 copy for few-row matmuls is opt-in:
//! `GRANARY_QUANT_MAX_ROWS`, see `linear`). A GGUF's Q4_0, Q4_1 and Q4_K
//! weights go into 4-bit tiles exactly as stored, and its other K-quants
//! are multiplied as stored by GGML's kernels (`linear::hold`), so none is
//! held twice; every tensor as stored in every matmul is
//! [`LoadOptions::native_quant`]. Q, K and V are one matmul, as are the
//! gate and up projections, when they are held alike.
//!
//! On the CPU, rotary embeddings, the KV write and attention run in the
//! engine's own kernels (`attention`) over the f16 cache in place; on an
//! accelerator they are candle tensor operations.
//!
//! Where things are: `weights` builds a model from its files, `linear`
//! holds the weight matrices and their matmuls, `host` and `device` are
//! the two attention paths, `config` the architecture table.

mod attention;
mod blocks4;
pub mod checkpoint;
mod config;
mod device;
mod host;
pub mod kernels;
mod kv;
mod linear;
pub mod load;
mod paged;
mod pool;
mod qmatmul;
mod simd;
mod weights;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};

use host::silu_mul_host;
use linear::{Linear, Proj};

pub use checkpoint::CheckpointUse;
pub use config::{Activation, ArchSpec, ModelConfig, RopeScaling, RopeStyle, ARCHITECTURES};
pub use kv::KvCache;
pub use load::{Loader, ReadOptions, ReadStats};
pub use pool::KvPool;

/// How to hold the weights.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Multiply by quantized weights on the host: int8 or 4-bit tiles,
    /// GGUF K-quants as stored, or (without AVX-512 VNNI, and only where
    /// `GRANARY_QUANT_MAX_ROWS` asks for it) a Q8_0 copy for few-row
    /// matmuls. On an accelerator: every block-quantized GGUF
    /// weight stays on the device as stored, multiplied by candle's device
    /// kernels ([`linear::Target::DeviceQuantized`]). `false`: dense f32
    /// only.
    pub quantized_decode: bool,
    /// Multiply by the GGUF's tensors as stored, in every matmul (as
    /// llama.cpp does), instead of dequantized copies. Slow on CPU for
    /// formats without SIMD kernels (Q4_1); exact reference behaviour.
    pub native_quant: bool,
    /// Cap the context below the model's own (memory per sequence).
    pub max_context: Option<usize>,
    /// How the weight files are read ([`load`]).
    pub loader: Loader,
    /// Run every step with candle tensor operations and keep the KV as
    /// tensors, as on an accelerator, even on the CPU (where the engine's
    /// own kernels are otherwise used). This is how the accelerator path's
    /// logic is tested on machines without one.
    pub tensor_ops: bool,
    /// A converted-weight checkpoint to load from when it is current, and
    /// to write after a conversion ([`checkpoint`]; `None`: neither).
    pub checkpoint: Option<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            device: Device::Cpu,
            quantized_decode: true,
            native_quant: false,
            max_context: None,
            loader: Loader::default(),
            tensor_ops: false,
            checkpoint: None,
        }
    }
}

/// Where a load's time went.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadStats {
    /// Reading the files into tensors as stored (and the fingerprint).
    pub read: ReadStats,
    /// Building the engine's weights from those tensors: dequantizing,
    /// fusing projections, re-quantizing to int8 tiles, rotary tables.
    #[serde(serialize_with = "duration_ms")]
    pub convert: Duration,
    /// Whether the weights came from a checkpoint, or why not.
    pub checkpoint: CheckpointUse,
}

fn duration_ms<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1e6).round() / 1e3)
}

struct Layer {
    attn_norm: Tensor,
    /// Output `[rows, (heads + 2 * kv_heads) * head_dim]`: Q | K | V.
    qkv: Proj,
    /// Per-head RMS norm weights of Q and K, `[head_dim]` (Qwen3, Gemma 3).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    wo: Linear,
    /// Norm of the attention output before the residual add (Gemma).
    attn_post_norm: Option<Tensor>,
    ffn_norm: Tensor,
    /// Output `[rows, 2 * intermediate]`: gate | up.
    gate_up: Proj,
    down: Linear,
    /// Norm of the feed-forward output before the residual add (Gemma).
    ffn_post_norm: Option<Tensor>,
    /// Index of the layer's rotary tables in [`Model::ropes`].
    rope: usize,
    /// Keys each query sees on this layer (itself included), when it slides.
    window: Option<usize>,
}

/// Token embeddings: dense rows, or (on the host, for a model stored
/// quantized) the rows as stored, each dequantized when it is looked up.
/// A GGUF's Q4_1 embedding is a seventh of its f32 form (16 of 113 MB for
/// SmolLM2-135M, 0.3 of 2.1 GB for a 128K vocabulary at 4096); a row comes
/// out exactly as dequantizing the whole tensor gives it.
pub(crate) enum Embedding {
    Dense(Tensor),
    Rows(Box<candle_core::quantized::QTensor>),
}

impl Embedding {
    /// `[vocab, hidden]`.
    fn dims(&self) -> &[usize] {
        match self {
            Embedding::Dense(t) => t.dims(),
            Embedding::Rows(q) => q.shape().dims(),
        }
    }

    /// The rows of `ids`, `[ids, hidden]` f32.
    fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => Ok(t.index_select(&Tensor::from_slice(ids, ids.len(), device)?, 0)?),
            Embedding::Rows(q) => {
                let dtype = q.dtype();
                let hidden = q.shape().dims()[1];
                let row_bytes = hidden / dtype.block_size() * dtype.type_size();
                let data = q.data()?;
                let mut rows = Vec::with_capacity(ids.len() * row_bytes);
                for &id in ids {
                    rows.extend_from_slice(&data[id as usize * row_bytes..][..row_bytes]);
                }
                let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
                    dtype,
                    &rows,
                    vec![ids.len(), hidden],
                    &Device::Cpu,
                )?;
                Ok(q.dequantize(device)?)
            }
        }
    }
}

/// cos and sin of every position's rotation angles, `[position, head_dim / 2]`,
/// on the device and on the host.
struct Rope {
    cos: Tensor,
    sin: Tensor,
    cos_host: Vec<f32>,
    sin_host: Vec<f32>,
}

/// New tokens of one sequence for one forward step.
pub struct Chunk<'a> {
    /// Appended after the tokens already in `kv`.
    pub tokens: &'a [u32],
    pub kv: &'a mut KvCache,
    /// Return logits for the chunk's last token.
    pub logits: bool,
}

/// A loaded model.
pub struct Model {
    cfg: ModelConfig,
    device: Device,
    /// The engine's own host kernels (CPU), or candle tensor operations
    /// (accelerators, or [`LoadOptions::tensor_ops`]).
    host: bool,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Rotary tables: one per distinct (base, scale) among the layers.
    ropes: Vec<Rope>,
    context_len: usize,
    fingerprint: String,
    source: PathBuf,
    /// The source files' sizes and times when they were read.
    stamps: Vec<checkpoint::Stamp>,
    /// What a checkpoint of these weights is keyed by (`None`: not on the host).
    checkpoint_key: Option<String>,
    /// Device KV pools, one per block size (tensor operations only).
    pools: std::sync::Mutex<Vec<std::sync::Arc<KvPool>>>,
    /// Per layer, the Q and K head-norm weights as device tensors (tensor
    /// operations only; made on the first step).
    head_norms: std::sync::OnceLock<Vec<device::HeadNorms>>,
}

/// Whether the engine runs its int8 tile kernels (the `avx512vnni` kernel
/// path, [`kernels`]): converted weights are then int8 or 4-bit tiles,
/// multiplied by int8 activations like llama.cpp's; on the other paths
/// they are dense f32, multiplied by f32 activations.
pub fn int8_kernels() -> bool {
    qmatmul::Q8Matrix::supported()
}

impl Model {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether steps run on the engine's own host kernels (logits and KV in
    /// host memory), rather than as tensor operations over the device pool.
    pub fn host_kernels(&self) -> bool {
        self.host
    }

    /// Positions a sequence may use (prompt plus generated tokens).
    pub fn context_len(&self) -> usize {
        self.context_len
    }

    /// blake3 of the weight files: part of every KV block's name.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Bytes the matmul weights (every layer's projections and the output
    /// head) are held in: as stored for GGUF types multiplied as they are,
    /// else the engine's converted form.
    pub fn matmul_weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.held_bytes() + l.wo.held_bytes() + l.gate_up.held_bytes() + l.down.held_bytes())
            .sum();
        layers + self.lm_head.held_bytes()
    }

    pub fn source(&self) -> &Path {
        &self.source
    }

    /// An empty KV cache for one sequence, in blocks of `block_tokens`: in
    /// host memory, or in the model's device pool for that block size.
    pub fn new_kv(&self, block_tokens: usize) -> KvCache {
        if self.host {
            return KvCache::host(&self.cfg, block_tokens, self.context_len);
        }
        KvCache::pooled(self.kv_pool(block_tokens), self.context_len)
    }

    /// The device KV pool for blocks of `block_tokens` (made on first use).
    pub fn kv_pool(&self, block_tokens: usize) -> std::sync::Arc<KvPool> {
        let bt = block_tokens.max(1);
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pools.iter().find(|p| p.block_tokens == bt) {
            return p.clone();
        }
        let p = std::sync::Arc::new(KvPool::new(&self.cfg, &self.device, bt));
        pools.push(p.clone());
        p
    }

    /// Runs one step over several sequences. Each chunk's tokens are appended
    /// to its KV; returns `[chunks wanting logits, vocab]` f32 logits, in
    /// chunk order.
    pub fn forward(&self, chunks: &mut [Chunk<'_>]) -> Result<Option<Tensor>> {
        let x = self.hidden(chunks)?;
        let cfg = &self.cfg;
        let mut rows = Vec::new();
        let mut row = 0u32;
        for c in chunks.iter() {
            row += c.tokens.len() as u32;
            if c.logits {
                rows.push(row - 1);
            }
        }
        if rows.is_empty() {
            return Ok(None);
        }
        let n = rows.len();
        let last = x.index_select(&Tensor::from_vec(rows, n, &self.device)?, 0)?;
        let h = candle_nn::ops::rms_norm(&last, &self.norm, cfg.rms_eps as f32)?;
        let logits = self.lm_head.forward(&h)?.to_dtype(DType::F32)?;
        Ok(Some(match cfg.arch.softcap {
            Some((_, cap)) if cap > 0.0 => ((logits / cap as f64)?.tanh()? * cap as f64)?,
            _ => logits,
        }))
    }

    /// The sentence embedding of `tokens`: the mean over positions of the
    /// last layer's normed hidden states, L2-normalised (mean pooling, as
    /// sentence-transformers pools decoder models). Runs on its own KV,
    /// `chunk` tokens at a time.
    pub fn embed(&self, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "nothing to embed");
        ensure!(tokens.len() <= self.context_len, "{} tokens exceed the context of {}", tokens.len(), self.context_len);
        let mut kv = self.new_kv(256);
        let mut sum = vec![0f64; self.cfg.hidden_size];
        for part in tokens.chunks(chunk.max(1)) {
            let x = self.hidden(&mut [Chunk { tokens: part, kv: &mut kv, logits: false }])?;
            let h = candle_nn::ops::rms_norm(&x, &self.norm, self.cfg.rms_eps as f32)?;
            for row in h.to_dtype(DType::F32)?.to_vec2::<f32>()? {
                for (s, v) in sum.iter_mut().zip(row) {
                    *s += v as f64;
                }
            }
        }
        let n = tokens.len() as f64;
        let norm = sum.iter().map(|v| (v / n).powi(2)).sum::<f64>().sqrt().max(1e-12);
        Ok(sum.iter().map(|v| (v / n / norm) as f32).collect())
    }

    /// The log probability of each prompt token after the first, given the
    /// tokens before it, with the `top` most likely tokens at that position
    /// (most likely first): the model's distribution before any sampling
    /// setting, as generation reports it. Runs on its own KV, `chunk`
    /// tokens at a time, like [`Model::embed`].
    pub fn prompt_logprobs(&self, tokens: &[u32], top: usize, chunk: usize) -> Result<Vec<crate::TokenLogprobs>> {
        ensure!(!tokens.is_empty(), "no prompt tokens");
        ensure!(tokens.len() <= self.context_len, "{} tokens exceed the context of {}", tokens.len(), self.context_len);
        let chunk = chunk.clamp(1, 256);
        let mut kv = self.new_kv(256);
        let mut out = Vec::with_capacity(tokens.len() - 1);
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            let x = self.hidden(&mut [Chunk { tokens: part, kv: &mut kv, logits: false }])?;
            let h = candle_nn::ops::rms_norm(&x, &self.norm, self.cfg.rms_eps as f32)?;
            let mut logits = self.lm_head.forward(&h)?.to_dtype(DType::F32)?;
            if let Some((_, cap)) = self.cfg.arch.softcap.filter(|&(_, cap)| cap > 0.0) {
                logits = ((logits / cap as f64)?.tanh()? * cap as f64)?;
            }
            for (ri, row) in logits.to_vec2::<f32>()?.iter().enumerate() {
                let Some(&next) = tokens.get(ci * chunk + ri + 1) else { break };
                out.push(row_logprobs(row, next, top));
            }
        }
        Ok(out)
    }

    /// The layers over every chunk's tokens: `[rows, hidden]` before the
    /// final norm; each chunk's KV grows by its tokens.
    fn hidden(&self, chunks: &mut [Chunk<'_>]) -> Result<Tensor> {
        let cfg = &self.cfg;
        let mut ids = Vec::new();
        for c in chunks.iter_mut() {
            if c.tokens.is_empty() {
                bail!("empty chunk");
            }
            let end = c.kv.len() + c.tokens.len();
            if end > self.context_len {
                bail!("sequence of {end} tokens exceeds the context of {}", self.context_len);
            }
            c.kv.reserve(cfg.layers, end)?;
            ids.extend_from_slice(c.tokens);
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            bail!("token id {bad} is outside the vocabulary of {}", cfg.vocab_size);
        }
        let mut x = self.embed.lookup(&ids, &self.device)?;
        if cfg.arch.embed_scale {
            x = (x * (cfg.hidden_size as f64).sqrt())?;
        }
        let eps = cfg.rms_eps as f32;
        let inter = cfg.intermediate_size;
        let pool = match self.host {
            true => None,
            false => Some(chunks[0].kv.pool_blocks().map(|p| p.0.clone()).context("KV cache is in host memory")?),
        };
        let plan = match &pool {
            Some(p) => Some(device::Plan::new(self, p, chunks)?),
            None => None,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let qkv = layer.qkv.forward(&h)?;
            let attn = match &plan {
                None => self.attention_host(li, &qkv, chunks)?,
                Some(plan) => self.attention_device(li, &qkv, plan)?,
            };
            let mut o = layer.wo.forward(&attn)?;
            if let Some(w) = &layer.attn_post_norm {
                o = candle_nn::ops::rms_norm(&o, w, eps)?;
            }
            x = (x + o)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gu = layer.gate_up.forward(&h)?;
            let act = match (cfg.arch.activation, self.host) {
                (Activation::Silu, true) => silu_mul_host(&gu, inter)?,
                (Activation::Silu, false) => (gu.narrow(1, 0, inter)?.silu()? * gu.narrow(1, inter, inter)?)?,
                (Activation::GeluTanh, _) => (gu.narrow(1, 0, inter)?.gelu()? * gu.narrow(1, inter, inter)?)?,
            };
            let mut d = layer.down.forward(&act)?;
            if let Some(w) = &layer.ffn_post_norm {
                d = candle_nn::ops::rms_norm(&d, w, eps)?;
            }
            x = (x + d)?;
        }
        drop(plan);
        for c in chunks.iter_mut() {
            let new_len = c.kv.len() + c.tokens.len();
            c.kv.set_len(new_len);
            c.kv.pending_done();
        }
        Ok(x)
    }

    /// The id with the highest logit (for greedy checks).
    pub fn argmax(logits: &Tensor) -> Result<Vec<u32>> {
        Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
    }
}

/// `token`'s log probability under one row of logits, and the `top` most
/// likely tokens (most likely first).
fn row_logprobs(row: &[f32], token: u32, top: usize) -> crate::TokenLogprobs {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|&v| ((v - max) as f64).exp()).sum::<f64>().ln() as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &v) in row.iter().enumerate() {
            if best.len() < top || v > best[best.len() - 1].1 {
                let at = best.partition_point(|&(_, b)| b >= v);
                best.insert(at, (id as u32, v));
                best.truncate(top);
            }
        }
    }
    crate::TokenLogprobs {
        logprob: row.get(token as usize).map_or(f32::NEG_INFINITY, |&v| v - lse),
        top: best.into_iter().map(|(id, v)| (id, v - lse)).collect(),
    }
}

#[cfg(test)]
mod prompt_logprob_tests {
    use super::*;

    #[test]
    fn a_row_gives_the_tokens_log_softmax_and_the_most_likely() {
        let row = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lse = row.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln() as f32;
        let lp = row_logprobs(&row, 2, 3);
        assert!((lp.logprob - (2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "most likely first, ties in id order");
        assert!((lp.top[0].1 - (3.0 - lse)).abs() < 1e-6);
        assert!(row_logprobs(&row, 0, 0).top.is_empty());
        let total: f64 = row.iter().map(|v| ((*v - lse) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
