//! A Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2) with the engine's
//! own forward pass: several sequences per step, each with its own KV cache
//! and its own number of new tokens (a prefill chunk or one decode token).
//!
//! On a CPU with AVX-512 VNNI every matmul, prefill and decode alike, runs
//! on int8 weights in the engine's own tiled kernel (`qmatmul`): a quarter
//! of the bytes of f32 to stream per decode step, four times the
//! multiply-adds per instruction for prefill. Elsewhere weights are kept
//! twice: dequantized f32 for multi-row matmuls (gemm speed) and Q8_0 for
//! few-row ones (bound by memory bandwidth). Q4_1 and other formats without
//! fast CPU kernels are therefore never multiplied directly, unless asked
//! for ([`LoadOptions::native_quant`]). Q, K and V are one matmul, as are
//! the gate and up projections.
//!
//! On the CPU, rotary embeddings, the KV write and attention run in the
//! engine's own kernels (`attention`) over the f16 cache in place; on an
//! accelerator they are candle tensor operations.

mod attention;
mod config;
mod kv;
pub mod load;
mod qmatmul;
mod simd;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};

pub use config::{Activation, ArchSpec, ModelConfig, RopeScaling, RopeStyle, ARCHITECTURES};
pub use kv::KvCache;
pub use load::{Loader, ReadOptions, ReadStats};

/// Matmuls with at most this many rows use the quantized copy
/// (`GRANARY_QUANT_MAX_ROWS` overrides it).
fn quant_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| std::env::var("GRANARY_QUANT_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(4))
}

/// How to hold the weights.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Keep a Q8_0 copy for few-row matmuls (CPU decode).
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
}

fn duration_ms<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1e6).round() / 1e3)
}

struct Linear {
    dense: Option<Tensor>,
    quant: Option<QMatMul>,
    /// Int8 tiles for every row count (CPUs with AVX-512 VNNI).
    int8: Option<qmatmul::Q8Matrix>,
    /// 4-bit tiles instead of int8 ones, for weights stored as Q4_1 (they
    /// come back exactly): a decode step reads half the bytes (about 20%
    /// faster), prefill is ~5% slower (the nibbles are unpacked). Used for
    /// every row count, so a row's result never depends on what it is
    /// batched with.
    int4: Option<qmatmul::Q4Matrix>,
    bias: Option<Tensor>,
}

impl Linear {
    /// `four_bit`: the weights were stored as Q4_1 (see [`Linear::int4`]).
    fn new(dense: Tensor, bias: Option<Tensor>, quantize: bool, four_bit: bool) -> Result<Self> {
        let (n, k) = dense.dims2()?;
        if quantize && dense.device().is_cpu() && qmatmul::Q8Matrix::supported() && qmatmul::Q8Matrix::fits(n, k) {
            let w = dense.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            if four_bit && int4_enabled() {
                let int4 = Some(qmatmul::Q4Matrix::quantize(&w, n, k)?);
                return Ok(Linear { dense: None, quant: None, int8: None, int4, bias });
            }
            let int8 = Some(qmatmul::Q8Matrix::quantize(&w, n, k)?);
            return Ok(Linear { dense: None, quant: None, int8, int4: None, bias });
        }
        let quant = if quantize && k % GgmlDType::Q8_0.block_size() == 0 {
            Some(QMatMul::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q8_0)?)?)
        } else {
            None
        };
        Ok(Linear { dense: Some(dense), quant, int8: None, int4: None, bias })
    }

    fn native(q: QTensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Linear { dense: None, quant: Some(QMatMul::from_qtensor(q)?), int8: None, int4: None, bias })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let tiles = match (&self.int4, &self.int8) {
            (Some(w4), _) => Some((w4.in_features(), w4.out_features())),
            (None, Some(w8)) => Some((w8.in_features(), w8.out_features())),
            (None, None) => None,
        };
        if let Some((k_in, n_out)) = tiles {
            let (m, k) = x.dims2()?;
            let (storage, lay) = x.storage_and_layout();
            let data: &[f32] = match (&*storage, lay.contiguous_offsets()) {
                (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
                _ => bail!("matmul input is not a contiguous f32 host tensor"),
            };
            ensure!(k == k_in, "matmul input of width {k}, weights take {k_in}");
            let xq = qmatmul::Q8Rows::quantize(data, m, k);
            drop(storage);
            let mut y = vec![0f32; m * n_out];
            match (&self.int4, &self.int8) {
                (Some(w4), _) => w4.matmul(&xq, &mut y),
                (None, Some(w8)) => w8.matmul(&xq, &mut y),
                (None, None) => unreachable!("checked above"),
            }
            let y = Tensor::from_vec(y, (m, n_out), x.device())?;
            return Ok(match &self.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            });
        }
        let y = match (&self.quant, &self.dense) {
            (Some(q), Some(_)) if x.dim(0)? <= quant_max_rows() => q.forward(x)?,
            (_, Some(d)) => x.matmul(&d.t()?)?,
            (Some(q), None) => q.forward(x)?,
            (None, None) => unreachable!("a linear layer holds weights"),
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Projections of the same input whose outputs are used side by side: one
/// matmul over concatenated weights, or (weights kept as stored) several.
enum Proj {
    Fused(Linear),
    Split(Vec<Linear>),
}

impl Proj {
    /// Outputs concatenated along the last dimension.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Fused(l) => l.forward(x),
            Proj::Split(ls) => {
                let outs = ls.iter().map(|l| l.forward(x)).collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&outs, 1)?)
            }
        }
    }
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
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Rotary tables: one per distinct (base, scale) among the layers.
    ropes: Vec<Rope>,
    context_len: usize,
    fingerprint: String,
    source: PathBuf,
}

/// Where weight tensors come from while building a [`Model`].
trait TensorSource {
    fn get(&mut self, name: &str) -> Result<Tensor>;
    fn get_opt(&mut self, name: &str) -> Result<Option<Tensor>>;
    /// The tensor as stored, when the source is quantized.
    fn get_quantized(&mut self, _name: &str) -> Result<Option<QTensor>> {
        Ok(None)
    }
    /// Whether the tensor is stored as Q4_1 (without reading it).
    fn stored_q4_1(&self, _name: &str) -> bool {
        false
    }
}

/// 4-bit decode tiles are on unless `GRANARY_INT4=0`.
fn int4_enabled() -> bool {
    std::env::var_os("GRANARY_INT4").is_none_or(|v| v != "0")
}

/// A GGUF's tensors, read up front ([`load`]); each is handed out once
/// (its memory goes with it), one asked for again is read from the file.
struct GgufSource<'a> {
    ct: &'a gguf_file::Content,
    tensors: HashMap<String, QTensor>,
    path: &'a Path,
    device: Device,
}

impl GgufSource<'_> {
    fn take(&mut self, name: &str) -> Result<Option<QTensor>> {
        if !self.ct.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        if let Some(q) = self.tensors.remove(name) {
            return Ok(Some(q));
        }
        let mut file = File::open(self.path).with_context(|| format!("open {}", self.path.display()))?;
        Ok(Some(self.ct.tensor(&mut file, name, &self.device)?))
    }
}

impl TensorSource for GgufSource<'_> {
    fn get(&mut self, name: &str) -> Result<Tensor> {
        self.get_opt(name)?.with_context(|| format!("GGUF has no tensor {name}"))
    }
    fn get_opt(&mut self, name: &str) -> Result<Option<Tensor>> {
        match self.take(name)? {
            Some(q) => Ok(Some(q.dequantize(&self.device)?)),
            None => Ok(None),
        }
    }
    fn get_quantized(&mut self, name: &str) -> Result<Option<QTensor>> {
        self.take(name)
    }
    fn stored_q4_1(&self, name: &str) -> bool {
        self.ct.tensor_infos.get(name).is_some_and(|i| i.ggml_dtype == GgmlDType::Q4_1)
    }
}

/// Safetensors tensors, read up front ([`load`]); each is handed out once.
struct SafetensorsSource {
    tensors: HashMap<String, Tensor>,
}

impl TensorSource for SafetensorsSource {
    fn get(&mut self, name: &str) -> Result<Tensor> {
        self.get_opt(name)?.with_context(|| format!("safetensors have no tensor {name}"))
    }
    fn get_opt(&mut self, name: &str) -> Result<Option<Tensor>> {
        match self.tensors.remove(name) {
            Some(t) => Ok(Some(t.to_dtype(DType::F32)?)),
            None => Ok(None),
        }
    }
}

impl Model {
    /// Loads a GGUF file.
    pub fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<Self> {
        Ok(Self::load_gguf_timed(path, opts)?.0)
    }

    fn load_gguf_timed(path: &Path, opts: &LoadOptions) -> Result<(Self, LoadStats)> {
        let w = match &opts.loader {
            Loader::Parallel(r) => {
                load::read_gguf(path, &opts.device, &ReadOptions { fingerprint: true, ..r.clone() })?
            }
            Loader::Naive => load::naive_gguf(path, &opts.device, true)?,
        };
        let load::GgufWeights { content: ct, tensors, stats } = w;
        let cfg = ModelConfig::from_gguf(&ct)?;
        check_gguf_types(&ct)?;
        let fingerprint = stats.fingerprint.clone().context("the loader computed no fingerprint")?;
        let started = Instant::now();
        let mut src = GgufSource { ct: &ct, tensors, path, device: opts.device.clone() };
        let names = |i: usize, n: &str| format!("blk.{i}.{n}");
        let model = Self::build(cfg, &mut src, opts, fingerprint, path, |i, part| match part {
            Part::Embed => "token_embd.weight".into(),
            Part::Norm => "output_norm.weight".into(),
            Part::LmHead => "output.weight".into(),
            Part::AttnNorm => names(i, "attn_norm.weight"),
            Part::Q => names(i, "attn_q"),
            Part::K => names(i, "attn_k"),
            Part::V => names(i, "attn_v"),
            Part::Qkv => names(i, "attn_qkv"),
            Part::QNorm => names(i, "attn_q_norm.weight"),
            Part::KNorm => names(i, "attn_k_norm.weight"),
            Part::O => names(i, "attn_output"),
            Part::AttnPostNorm => names(i, "post_attention_norm.weight"),
            Part::FfnNorm => names(i, "ffn_norm.weight"),
            Part::Gate => names(i, "ffn_gate"),
            Part::Up => names(i, "ffn_up"),
            // gate|up of Phi-3 is stored as one `ffn_up` twice as tall.
            Part::GateUp => names(i, "ffn_up"),
            Part::Down => names(i, "ffn_down"),
            Part::FfnPostNorm => names(i, "post_ffw_norm.weight"),
            Part::RopeFreqs => "rope_freqs.weight".into(),
        })?;
        Ok((model, LoadStats { read: stats, convert: started.elapsed() }))
    }

    /// Loads a Hugging Face directory: `config.json` and `*.safetensors`.
    pub fn load_safetensors_dir(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        Ok(Self::load_safetensors_dir_timed(dir, opts)?.0)
    }

    fn load_safetensors_dir_timed(dir: &Path, opts: &LoadOptions) -> Result<(Self, LoadStats)> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).with_context(|| format!("read {}", cfg_path.display()))?;
        let cfg = ModelConfig::from_hf_json(&text)?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{} has no .safetensors files", dir.display());
        }
        // The fingerprint covers config.json, then the weight files in order.
        let w = match &opts.loader {
            Loader::Parallel(r) => load::read_safetensors(
                &files,
                text.as_bytes(),
                &opts.device,
                &ReadOptions { fingerprint: true, ..r.clone() },
            )?,
            Loader::Naive => load::naive_safetensors(&files, text.as_bytes(), &opts.device, true)?,
        };
        let fingerprint = w.stats.fingerprint.clone().context("the loader computed no fingerprint")?;
        let started = Instant::now();
        let mut src = SafetensorsSource { tensors: w.tensors };
        let names = |i: usize, n: &str| format!("model.layers.{i}.{n}");
        let post_norms = cfg.arch.post_norms;
        if cfg.arch.hf_norm_offset {
            // Gemma checkpoints store norm weights as `w` for `x * (1 + w)`.
            for (name, t) in src.tensors.iter_mut() {
                if name.ends_with("norm.weight") {
                    *t = (t.to_dtype(DType::F32)? + 1.0)?;
                }
            }
        }
        let model = Self::build(cfg, &mut src, opts, fingerprint, dir, |i, part| match part {
            Part::Embed => "model.embed_tokens.weight".into(),
            Part::Norm => "model.norm.weight".into(),
            Part::LmHead => "lm_head.weight".into(),
            Part::AttnNorm => names(i, "input_layernorm.weight"),
            Part::Q => names(i, "self_attn.q_proj"),
            Part::K => names(i, "self_attn.k_proj"),
            Part::V => names(i, "self_attn.v_proj"),
            Part::Qkv => names(i, "self_attn.qkv_proj"),
            Part::QNorm => names(i, "self_attn.q_norm.weight"),
            Part::KNorm => names(i, "self_attn.k_norm.weight"),
            Part::O => names(i, "self_attn.o_proj"),
            // Gemma's `post_attention_layernorm` follows attention; the
            // norm before its feed-forward block is `pre_feedforward_layernorm`.
            Part::AttnPostNorm => names(i, "post_attention_layernorm.weight"),
            Part::FfnNorm if post_norms => names(i, "pre_feedforward_layernorm.weight"),
            Part::FfnNorm => names(i, "post_attention_layernorm.weight"),
            Part::Gate => names(i, "mlp.gate_proj"),
            Part::Up => names(i, "mlp.up_proj"),
            Part::GateUp => names(i, "mlp.gate_up_proj"),
            Part::Down => names(i, "mlp.down_proj"),
            Part::FfnPostNorm => names(i, "post_feedforward_layernorm.weight"),
            Part::RopeFreqs => "rope_freqs.weight".into(),
        })?;
        Ok((model, LoadStats { read: w.stats, convert: started.elapsed() }))
    }

    /// A GGUF file, or a directory with `config.json` and safetensors.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        Ok(Self::load_timed(path, opts)?.0)
    }

    /// [`Model::load`], with where the time went.
    pub fn load_timed(path: &Path, opts: &LoadOptions) -> Result<(Self, LoadStats)> {
        if path.is_dir() {
            Self::load_safetensors_dir_timed(path, opts)
        } else {
            Self::load_gguf_timed(path, opts)
        }
    }

    fn build(
        cfg: ModelConfig,
        src: &mut dyn TensorSource,
        opts: &LoadOptions,
        fingerprint: String,
        source: &Path,
        name: impl Fn(usize, Part) -> String,
    ) -> Result<Self> {
        let host = opts.device.is_cpu() && !opts.tensor_ops;
        let quantize = opts.quantized_decode && host;
        // Linear weights: `name` gives the stem, ".weight"/".bias" follow.
        let native = opts.native_quant;
        let linear = |src: &mut dyn TensorSource, base: String, bias: bool, quantize: bool| -> Result<Linear> {
            let b = if bias { src.get_opt(&format!("{base}.bias"))? } else { None };
            if native {
                if let Some(q) = src.get_quantized(&format!("{base}.weight"))? {
                    return Linear::native(q, b);
                }
            }
            let name = format!("{base}.weight");
            let four_bit = src.stored_q4_1(&name);
            let w = src.get(&name)?;
            Linear::new(w, b, quantize, four_bit)
        };
        // Weights of several projections stacked into one matrix (dense), or
        // kept apart when multiplying the stored quantized tensors.
        let proj = |src: &mut dyn TensorSource, bases: Vec<String>, bias: bool| -> Result<Proj> {
            if native {
                return Ok(Proj::Split(
                    bases.into_iter().map(|b| linear(src, b, bias, quantize)).collect::<Result<Vec<_>>>()?,
                ));
            }
            let four_bit = bases.iter().all(|b| src.stored_q4_1(&format!("{b}.weight")));
            let mut ws = Vec::new();
            let mut bs = Vec::new();
            for b in &bases {
                let w = src.get(&format!("{b}.weight"))?;
                let bv = if bias { src.get_opt(&format!("{b}.bias"))? } else { None };
                bs.push((w.dim(0)?, bv));
                ws.push(w);
            }
            let bias = if bs.iter().any(|(_, b)| b.is_some()) {
                let parts = bs
                    .into_iter()
                    .map(|(n, b)| match b {
                        Some(b) => Ok(b),
                        None => Tensor::zeros(n, DType::F32, &opts.device),
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Some(Tensor::cat(&parts, 0)?)
            } else {
                None
            };
            Ok(Proj::Fused(Linear::new(Tensor::cat(&ws, 0)?, bias, quantize, four_bit)?))
        };
        let mut cfg = cfg;
        if let config::RopeScaling::Factors(f) = &cfg.rope_scaling {
            if f.is_empty() {
                let t = src.get(&name(0, Part::RopeFreqs))?;
                cfg.rope_scaling = config::RopeScaling::Factors(t.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        cfg.validate()?;
        let context_len = opts.max_context.map_or(cfg.context_len, |m| m.min(cfg.context_len));
        let mut rope_keys: Vec<(u32, u32)> = Vec::new();
        let mut ropes = Vec::new();
        let half = cfg.head_dim / 2;
        let mut layers = Vec::with_capacity(cfg.layers);
        let head_norm = |src: &mut dyn TensorSource, part: Part, i: usize| -> Result<Option<Vec<f32>>> {
            if !cfg.arch.qk_norm {
                return Ok(None);
            }
            let w = src.get(&name(i, part))?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            ensure!(w.len() == cfg.head_dim, "{} has {} values for a head of {}", name(i, part), w.len(), cfg.head_dim);
            Ok(Some(w))
        };
        for i in 0..cfg.layers {
            let qkv = if cfg.arch.fused {
                Proj::Fused(linear(src, name(i, Part::Qkv), cfg.qkv_bias, quantize)?)
            } else {
                proj(src, vec![name(i, Part::Q), name(i, Part::K), name(i, Part::V)], cfg.qkv_bias)?
            };
            let wo = linear(src, name(i, Part::O), false, quantize)?;
            let gate_up = if cfg.arch.fused {
                Proj::Fused(linear(src, name(i, Part::GateUp), false, quantize)?)
            } else {
                proj(src, vec![name(i, Part::Gate), name(i, Part::Up)], false)?
            };
            let down = linear(src, name(i, Part::Down), false, quantize)?;
            let (base, scale) = cfg.rope_of(i);
            let key = (base.to_bits(), scale.to_bits());
            let rope = match rope_keys.iter().position(|k| *k == key) {
                Some(r) => r,
                None => {
                    let (cos_host, sin_host) = rope_tables(&cfg, base, scale, context_len);
                    let cos = Tensor::from_slice(&cos_host, (context_len, half), &opts.device)?;
                    let sin = Tensor::from_slice(&sin_host, (context_len, half), &opts.device)?;
                    ropes.push(Rope { cos, sin, cos_host, sin_host });
                    rope_keys.push(key);
                    ropes.len() - 1
                }
            };
            let post = |src: &mut dyn TensorSource, part: Part| -> Result<Option<Tensor>> {
                if cfg.arch.post_norms {
                    Ok(Some(src.get(&name(i, part))?))
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: src.get(&name(i, Part::AttnNorm))?,
                ffn_norm: src.get(&name(i, Part::FfnNorm))?,
                q_norm: head_norm(src, Part::QNorm, i)?,
                k_norm: head_norm(src, Part::KNorm, i)?,
                attn_post_norm: post(src, Part::AttnPostNorm)?,
                ffn_post_norm: post(src, Part::FfnPostNorm)?,
                qkv,
                wo,
                gate_up,
                down,
                rope,
                window: if cfg.is_sliding(i) { cfg.sliding_window } else { None },
            });
        }
        let embed = src.get(&name(0, Part::Embed))?;
        if embed.dims() != [cfg.vocab_size, cfg.hidden_size] {
            bail!(
                "embedding shape {:?} does not match vocab {} x hidden {}",
                embed.dims(),
                cfg.vocab_size,
                cfg.hidden_size
            );
        }
        let head = name(0, Part::LmHead);
        let head_q4 = src.stored_q4_1(&head);
        let embed_q4 = src.stored_q4_1(&name(0, Part::Embed));
        let head_native = if native { src.get_quantized(&head)? } else { None };
        let lm_head = match (head_native, src.get_opt(&head)?) {
            (Some(q), _) => Linear::native(q, None)?,
            (None, Some(w)) => Linear::new(w, None, quantize, head_q4)?,
            (None, None) if native => match src.get_quantized(&name(0, Part::Embed))? {
                Some(q) => Linear::native(q, None)?,
                None => Linear::new(embed.clone(), None, quantize, embed_q4)?,
            },
            (None, None) => Linear::new(embed.clone(), None, quantize, embed_q4)?,
        };
        let norm = src.get(&name(0, Part::Norm))?;
        Ok(Model {
            cfg,
            device: opts.device.clone(),
            host,
            embed,
            layers,
            norm,
            lm_head,
            ropes,
            context_len,
            fingerprint,
            source: source.to_path_buf(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Positions a sequence may use (prompt plus generated tokens).
    pub fn context_len(&self) -> usize {
        self.context_len
    }

    /// blake3 of the weight files: part of every KV block's name.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn source(&self) -> &Path {
        &self.source
    }

    /// An empty KV cache for one sequence, in blocks of `block_tokens`.
    pub fn new_kv(&self, block_tokens: usize) -> KvCache {
        KvCache::new(&self.cfg, &self.device, self.host, block_tokens, self.context_len)
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
        let n_rows = ids.len();
        let ids = Tensor::from_vec(ids, n_rows, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        if cfg.arch.embed_scale {
            x = (x * (cfg.hidden_size as f64).sqrt())?;
        }
        let eps = cfg.rms_eps as f32;
        let inter = cfg.intermediate_size;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let qkv = layer.qkv.forward(&h)?;
            let attn = if self.host {
                self.attention_host(li, &qkv, chunks)?
            } else {
                self.attention_device(li, &qkv, chunks)?
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
        for c in chunks.iter_mut() {
            let new_len = c.kv.len() + c.tokens.len();
            c.kv.set_len(new_len);
        }
        Ok(x)
    }

    /// Rotary embeddings, the KV write and attention for every chunk, on the
    /// host: `qkv` is `[rows, (heads + 2 kv_heads) head_dim]`, the result
    /// `[rows, heads head_dim]`.
    fn attention_host(&self, layer: usize, qkv: &Tensor, chunks: &mut [Chunk<'_>]) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, kvh, d) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let (q_w, kv_w) = (nh * d, 2 * kvh * d);
        let rows = qkv.dim(0)?;
        let (storage, lay) = qkv.storage_and_layout();
        let data: &[f32] = match (&*storage, lay.contiguous_offsets()) {
            (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
            _ => bail!("QKV projection is not a contiguous f32 host tensor"),
        };
        let mut q = vec![0f32; rows * q_w];
        let mut kv_rows = Vec::new();
        let mut row = 0;
        for c in chunks.iter_mut() {
            let n = c.tokens.len();
            let off = c.kv.len();
            kv_rows.clear();
            kv_rows.resize(n * kv_w, 0.0);
            let l = &self.layers[layer];
            let eps = cfg.rms_eps as f32;
            for i in 0..n {
                let src = &data[(row + i) * (q_w + kv_w)..][..q_w + kv_w];
                let qr = &mut q[(row + i) * q_w..][..q_w];
                qr.copy_from_slice(&src[..q_w]);
                let kr = &mut kv_rows[i * kv_w..][..kv_w];
                kr.copy_from_slice(&src[q_w..]);
                let pos = off + i;
                for hd in 0..nh {
                    if let Some(w) = &l.q_norm {
                        rms_norm_in_place(&mut qr[hd * d..][..d], w, eps);
                    }
                    self.rotate(layer, &mut qr[hd * d..][..d], pos);
                }
                for hd in 0..kvh {
                    if let Some(w) = &l.k_norm {
                        rms_norm_in_place(&mut kr[hd * d..][..d], w, eps);
                    }
                    self.rotate(layer, &mut kr[hd * d..][..d], pos);
                }
            }
            c.kv.write_host_rows(layer, off, &kv_rows)?;
            row += n;
        }
        drop(storage);
        let mut out = vec![0f32; rows * q_w];
        let mut seqs = Vec::with_capacity(chunks.len());
        let mut row = 0;
        for c in chunks.iter() {
            let n = c.tokens.len();
            seqs.push(attention::SeqRows {
                q: &q[row * q_w..(row + n) * q_w],
                blocks: c.kv.host_layer(layer).context("KV cache is not in host memory")?,
                block_tokens: c.kv.block_tokens(),
                off: c.kv.len(),
                n,
                out_row: row,
            });
            row += n;
        }
        let heads = attention::Heads { heads: nh, kv_heads: kvh, head_dim: d };
        let how = attention::Scores {
            scale: cfg.attn_scale,
            window: self.layers[layer].window,
            softcap: cfg.arch.softcap.map(|c| c.0).filter(|&c| c > 0.0),
        };
        attention::attend(heads, &seqs, how, &mut out);
        Ok(Tensor::from_vec(out, (rows, q_w), &self.device)?)
    }

    /// Rotates one head's vector for position `pos` in place, with layer
    /// `layer`'s tables.
    fn rotate(&self, layer: usize, x: &mut [f32], pos: usize) {
        let half = x.len() / 2;
        let rope = &self.ropes[self.layers[layer].rope];
        let cos = &rope.cos_host[pos * half..][..half];
        let sin = &rope.sin_host[pos * half..][..half];
        if self.cfg.rope_style == RopeStyle::Interleaved {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        } else {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// The same as [`Model::attention_host`] with tensor operations, one
    /// sequence at a time (accelerators).
    fn attention_device(&self, layer: usize, qkv: &Tensor, chunks: &mut [Chunk<'_>]) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (q_w, kv_w) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let q = qkv.narrow(1, 0, q_w)?;
        let k = qkv.narrow(1, q_w, kv_w)?;
        let v = qkv.narrow(1, q_w + kv_w, kv_w)?;
        let mut outs = Vec::with_capacity(chunks.len());
        let mut row = 0;
        for c in chunks.iter() {
            let n = c.tokens.len();
            outs.push(self.attention_one(
                layer,
                &q.narrow(0, row, n)?.contiguous()?,
                &k.narrow(0, row, n)?.contiguous()?,
                &v.narrow(0, row, n)?.contiguous()?,
                c.kv,
            )?);
            row += n;
        }
        Ok(if outs.len() == 1 { outs.pop().unwrap() } else { Tensor::cat(&outs, 0)? })
    }

    /// Attention of one sequence's `n` new rows against its whole KV, with
    /// tensor operations.
    fn attention_one(&self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, kv: &KvCache) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (h, kvh, d) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let n = q.dim(0)?;
        let off = kv.len();
        let total = off + n;
        let l = &self.layers[layer];
        let eps = cfg.rms_eps as f32;
        let head_norm = |x: &Tensor, w: &Option<Vec<f32>>| -> Result<Tensor> {
            Ok(match w {
                Some(w) => candle_nn::ops::rms_norm(x, &Tensor::from_slice(w, d, x.device())?, eps)?,
                None => x.clone(),
            })
        };
        let q = head_norm(&q.reshape((n, h, d))?, &l.q_norm)?;
        let k = head_norm(&k.reshape((n, kvh, d))?, &l.k_norm)?;
        let q = q.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let k = k.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let v = v.reshape((n, kvh, d))?.transpose(0, 1)?.contiguous()?;
        let rope = &self.ropes[l.rope];
        let cos = rope.cos.narrow(0, off, n)?;
        let sin = rope.sin.narrow(0, off, n)?;
        let (q, k) = if cfg.rope_style == RopeStyle::Interleaved {
            (candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?, candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?)
        } else {
            (candle_nn::rotary_emb::rope(&q, &cos, &sin)?, candle_nn::rotary_emb::rope(&k, &cos, &sin)?)
        };
        kv.write(layer, off, &k.squeeze(0)?, &v)?;
        let (kc, vc) = kv.read(layer, total, q.dtype())?;
        let g = h / kvh;
        // Query heads sharing a KV head are adjacent: [kvh, g * n, d].
        let q = q.squeeze(0)?.reshape((kvh, g * n, d))?;
        let mut att = (q.matmul(&kc.t()?)? * cfg.attn_scale as f64)?;
        if let Some(cap) = cfg.arch.softcap.map(|c| c.0 as f64).filter(|&c| c > 0.0) {
            att = ((att / cap)?.tanh()? * cap)?;
        }
        let window = l.window.filter(|&w| w < total);
        if n > 1 || window.is_some() {
            let mask = causal_mask(n, off, window, &self.device)?;
            att = att.reshape((kvh, g, n, total))?.broadcast_add(&mask)?.reshape((kvh, g * n, total))?;
        }
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let o = att.matmul(&vc)?;
        Ok(o.reshape((h, n, d))?.transpose(0, 1)?.reshape((n, h * d))?)
    }

    /// The id with the highest logit (for greedy checks).
    pub fn argmax(logits: &Tensor) -> Result<Vec<u32>> {
        Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
    }
}

#[derive(Clone, Copy)]
enum Part {
    Embed,
    Norm,
    LmHead,
    AttnNorm,
    Q,
    K,
    V,
    /// Q|K|V in one tensor (Phi-3).
    Qkv,
    QNorm,
    KNorm,
    O,
    AttnPostNorm,
    FfnNorm,
    Gate,
    Up,
    /// gate|up in one tensor (Phi-3).
    GateUp,
    Down,
    FfnPostNorm,
    /// Llama 3's rotary frequency factors (GGUF).
    RopeFreqs,
}

/// cos and sin of every position's rotation angles, `[len, head_dim / 2]`,
/// for rotary base `base` and linear position scale `scale`, with Llama 3's
/// frequency factors when the model has them.
fn rope_tables(cfg: &ModelConfig, base: f32, scale: f32, len: usize) -> (Vec<f32>, Vec<f32>) {
    let half = cfg.head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            let f = 1.0 / base.powf(2.0 * i as f32 / cfg.head_dim as f32);
            match &cfg.rope_scaling {
                config::RopeScaling::Factors(factors) => f / factors[i],
                _ => f,
            }
        })
        .collect();
    let mut cos = Vec::with_capacity(len * half);
    let mut sin = Vec::with_capacity(len * half);
    for p in 0..len {
        for f in &inv {
            let a = p as f32 * scale * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// Tensor types the loader can take, as llama.cpp's CPU builds ship them.
fn check_gguf_types(ct: &gguf_file::Content) -> Result<()> {
    const SUPPORTED: &[GgmlDType] = &[
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];
    for (name, info) in &ct.tensor_infos {
        if !SUPPORTED.contains(&info.ggml_dtype) {
            bail!(
                "tensor {name} has type {:?}, which is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)",
                info.ggml_dtype
            );
        }
    }
    Ok(())
}

/// RMS-normalises `x` in place and multiplies by `w`.
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v *= inv * w;
    }
}

/// silu(gate) * up for `[rows, 2 * inter]` laid out gate | up, on the host.
fn silu_mul_host(gu: &Tensor, inter: usize) -> Result<Tensor> {
    let rows = gu.dim(0)?;
    let (storage, lay) = gu.storage_and_layout();
    let data: &[f32] = match (&*storage, lay.contiguous_offsets()) {
        (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
        _ => bail!("gate/up projection is not a contiguous f32 host tensor"),
    };
    let lv = simd::level();
    let mut out = vec![0f32; rows * inter];
    for (o, row) in out.chunks_exact_mut(inter).zip(data.chunks_exact(2 * inter)) {
        o.copy_from_slice(&row[..inter]);
        simd::silu_mul(lv, o, &row[inter..]);
    }
    drop(storage);
    Ok(Tensor::from_vec(out, (rows, inter), gu.device())?)
}

/// `[n, off + n]`: 0 where query `i` (position `off + i`) may attend, -inf
/// after it and, with a sliding `window`, `window` or more positions before.
fn causal_mask(n: usize, off: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    let total = off + n;
    let mut m = vec![0f32; n * total];
    for i in 0..n {
        for j in (off + i + 1)..total {
            m[i * total + j] = f32::NEG_INFINITY;
        }
        if let Some(w) = window {
            for j in 0..(off + i + 1).saturating_sub(w) {
                m[i * total + j] = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Tensor::from_vec(m, (n, total), device)?)
}
