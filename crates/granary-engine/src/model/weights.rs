//! Building a [`Model`] from weight files: GGUF and Hugging Face
//! safetensors tensor names, fused projections, rotary tables per layer
//! kind, and the tensor types the loader takes.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::checkpoint::{self, CheckpointUse};
use super::linear::{self, Hold, Linear, Proj, Weights};
use super::{config, load, Embedding, Layer, LoadOptions, LoadStats, Loader, Model, ModelConfig, ReadOptions, Rope};

/// Where weight tensors come from while building a [`Model`].
trait TensorSource {
    fn get(&mut self, name: &str) -> Result<Tensor>;
    fn get_opt(&mut self, name: &str) -> Result<Option<Tensor>>;
    /// The tensor as stored, when the source is quantized.
    fn get_quantized(&mut self, _name: &str) -> Result<Option<QTensor>> {
        Ok(None)
    }
    /// The type and `[rows, columns]` a quantized source stores the tensor
    /// as (without reading it).
    fn stored(&self, _name: &str) -> Option<(GgmlDType, usize, usize)> {
        None
    }
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
    fn stored(&self, name: &str) -> Option<(GgmlDType, usize, usize)> {
        let info = self.ct.tensor_infos.get(name)?;
        let (rows, cols) = info.shape.dims2().ok()?;
        Some((info.ggml_dtype, rows, cols))
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

/// Where a checkpoint keeps its language model, as (prefix of
/// `embed_tokens` and the layers, name of the output head): a causal LM's
/// own layout, then a multimodal checkpoint's as transformers saved it
/// before 4.52 and since.
const LANGUAGE_MODEL_LAYOUTS: [(&str, &str); 3] = [
    ("model.", "lm_head.weight"),
    ("language_model.model.", "language_model.lm_head.weight"),
    ("model.language_model.", "lm_head.weight"),
];

/// The language model's tensors under the names of a causal LM's layout
/// (`model.…`, `lm_head.weight`); anything else in the checkpoint (a
/// multimodal model's vision tower and projector) is dropped.
fn language_model_tensors(mut tensors: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let (prefix, head) = LANGUAGE_MODEL_LAYOUTS
        .iter()
        .find(|(prefix, _)| tensors.contains_key(&format!("{prefix}embed_tokens.weight")))
        .with_context(|| {
            let tried: Vec<String> =
                LANGUAGE_MODEL_LAYOUTS.iter().map(|(p, _)| format!("{p}embed_tokens.weight")).collect();
            format!("the safetensors hold no token embedding (looked for {})", tried.join(", "))
        })?;
    if *prefix == "model." {
        return Ok(tensors);
    }
    let mut out = HashMap::new();
    if let Some(t) = tensors.remove(*head) {
        out.insert("lm_head.weight".to_string(), t);
    }
    for (name, t) in tensors {
        if let Some(rest) = name.strip_prefix(prefix) {
            out.insert(format!("model.{rest}"), t);
        }
    }
    Ok(out)
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
        Ok((model, LoadStats { read: stats, convert: started.elapsed(), checkpoint: CheckpointUse::Off }))
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
        let mut src = SafetensorsSource { tensors: language_model_tensors(w.tensors)? };
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
        Ok((model, LoadStats { read: w.stats, convert: started.elapsed(), checkpoint: CheckpointUse::Off }))
    }

    /// A GGUF file, or a directory with `config.json` and safetensors.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        Ok(Self::load_timed(path, opts)?.0)
    }

    /// [`Model::load`], with where the time went. With
    /// [`LoadOptions::checkpoint`] set, a current checkpoint there is loaded
    /// instead of the model's files (and [`LoadStats::checkpoint`] says
    /// what became of it); writing a fresh one is the caller's choice
    /// ([`Model::save_checkpoint`]).
    pub fn load_timed(path: &Path, opts: &LoadOptions) -> Result<(Self, LoadStats)> {
        // Stamped before reading: a file replaced during the load makes
        // the stamps disagree and no checkpoint is written from it.
        let stamps = checkpoint::stamps(path).unwrap_or_default();
        let mut used = CheckpointUse::Off;
        // Weights off the host (an accelerator) are not checkpointed.
        if let Some(ck) = opts.checkpoint.as_ref().filter(|_| checkpoint::key(opts).is_some()) {
            match checkpoint::load(path, ck, opts, &stamps) {
                Ok(loaded) => return Ok(loaded),
                Err(miss) => used = miss.into(),
            }
        }
        let (mut model, mut stats) = if path.is_dir() {
            Self::load_safetensors_dir_timed(path, opts)?
        } else {
            Self::load_gguf_timed(path, opts)?
        };
        model.stamps = stamps;
        stats.checkpoint = used;
        Ok((model, stats))
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
        let target = match (opts.quantized_decode, host, opts.device.is_cpu()) {
            (true, true, _) => linear::Target::HostQuantized,
            (true, false, false) => linear::Target::DeviceQuantized,
            _ => linear::Target::Dense,
        };
        let quantize = target == linear::Target::HostQuantized;
        let native = opts.native_quant;
        // How each stored weight is held (`linear::hold`).
        let hold_of = |src: &dyn TensorSource, name: &str| {
            src.stored(name).map(|(dtype, n, k)| linear::hold(dtype, n, k, target))
        };
        // One weight matrix by its full name, with its bias.
        let weight = |src: &mut dyn TensorSource, name: &str, b: Option<Tensor>| -> Result<Linear> {
            if native {
                if let Some(q) = src.get_quantized(name)? {
                    return Linear::native(q, b);
                }
            }
            match hold_of(src, name) {
                Some(Hold::Int4Exact) => Linear::int4_exact(&[src.get_quantized(name)?.context("stored weight")?], b),
                Some(Hold::Stored) => Linear::native(src.get_quantized(name)?.context("stored weight")?, b),
                Some(Hold::Convert) | None => Linear::new(src.get(name)?, b, quantize),
            }
        };
        // Linear weights: `base` is the stem, ".weight"/".bias" follow.
        let linear = |src: &mut dyn TensorSource, base: String, bias: bool| -> Result<Linear> {
            let b = if bias { src.get_opt(&format!("{base}.bias"))? } else { None };
            weight(src, &format!("{base}.weight"), b)
        };
        // Weights of several projections stacked into one matrix (dense or
        // 4-bit tiles), or kept apart when any is multiplied as stored.
        let proj = |src: &mut dyn TensorSource, bases: Vec<String>, bias: bool| -> Result<Proj> {
            let holds: Vec<_> = bases.iter().map(|b| hold_of(src, &format!("{b}.weight"))).collect();
            if native || holds.contains(&Some(Hold::Stored)) {
                return Ok(Proj::Split(bases.into_iter().map(|b| linear(src, b, bias)).collect::<Result<Vec<_>>>()?));
            }
            let mut bs = Vec::new();
            for b in &bases {
                let rows = src.stored(&format!("{b}.weight")).map(|(_, n, _)| n);
                let bv = if bias { src.get_opt(&format!("{b}.bias"))? } else { None };
                bs.push((rows, bv));
            }
            let stack_bias = |bs: Vec<(usize, Option<Tensor>)>| -> Result<Option<Tensor>> {
                if bs.iter().all(|(_, b)| b.is_none()) {
                    return Ok(None);
                }
                let parts = bs
                    .into_iter()
                    .map(|(n, b)| match b {
                        Some(b) => Ok(b),
                        None => Tensor::zeros(n, DType::F32, &opts.device),
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Some(Tensor::cat(&parts, 0)?))
            };
            if holds.iter().all(|h| *h == Some(Hold::Int4Exact)) {
                let mut qs = Vec::new();
                for b in &bases {
                    qs.push(src.get_quantized(&format!("{b}.weight"))?.context("stored weight")?);
                }
                let bias = stack_bias(bs.into_iter().map(|(n, b)| (n.unwrap_or(0), b)).collect())?;
                return Ok(Proj::Fused(Linear::int4_exact(&qs, bias)?));
            }
            let mut ws = Vec::new();
            let mut sized = Vec::new();
            for (b, (_, bv)) in bases.iter().zip(bs) {
                let w = src.get(&format!("{b}.weight"))?;
                sized.push((w.dim(0)?, bv));
                ws.push(w);
            }
            let bias = stack_bias(sized)?;
            Ok(Proj::Fused(Linear::new(Tensor::cat(&ws, 0)?, bias, quantize)?))
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
        let (ropes, rope_of) = ropes(&cfg, context_len, &opts.device)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        let head_norm = |src: &mut dyn TensorSource, part: Part, i: usize| -> Result<Option<Vec<f32>>> {
            if !cfg.arch.qk_norm {
                return Ok(None);
            }
            let w = src.get(&name(i, part))?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            ensure!(w.len() == cfg.head_dim, "{} has {} values for a head of {}", name(i, part), w.len(), cfg.head_dim);
            Ok(Some(w))
        };
        for (i, &rope) in rope_of.iter().enumerate() {
            let qkv = if cfg.arch.fused {
                Proj::Fused(linear(src, name(i, Part::Qkv), cfg.qkv_bias)?)
            } else {
                proj(src, vec![name(i, Part::Q), name(i, Part::K), name(i, Part::V)], cfg.qkv_bias)?
            };
            let wo = linear(src, name(i, Part::O), false)?;
            let gate_up = if cfg.arch.fused {
                Proj::Fused(linear(src, name(i, Part::GateUp), false)?)
            } else {
                proj(src, vec![name(i, Part::Gate), name(i, Part::Up)], false)?
            };
            let down = linear(src, name(i, Part::Down), false)?;
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
        // On the host a quantized embedding stays as stored (rows are
        // dequantized as they are looked up), unless the output head is
        // the dense embedding itself.
        let embed_rows = if host { src.get_quantized(&name(0, Part::Embed))? } else { None };
        let embed_rows = embed_rows.filter(|q| {
            q.dtype() != GgmlDType::F32
                && q.shape().dims().len() == 2
                && q.shape().dims()[1] % q.dtype().block_size() == 0
        });
        let embed = match &embed_rows {
            Some(q) => q.dequantize(&opts.device)?,
            None => src.get(&name(0, Part::Embed))?,
        };
        check_embedding(&cfg, embed.dims())?;
        let head = name(0, Part::LmHead);
        let embed_name = name(0, Part::Embed);
        let lm_head = if src.stored(&head).is_some() {
            weight(src, &head, None)?
        } else if let Some(w) = src.get_opt(&head)? {
            Linear::new(w, None, quantize)?
        } else if src.stored(&embed_name).is_some() && (native || hold_of(src, &embed_name) != Some(Hold::Convert)) {
            // Tied to the embedding, read again as stored.
            weight(src, &embed_name, None)?
        } else {
            Linear::new(embed.clone(), None, quantize)?
        };
        let norm = src.get(&name(0, Part::Norm))?;
        let head_is_embed = matches!(&lm_head.w, Weights::Dense { dense, .. } if dense.id() == embed.id());
        let embed = match embed_rows {
            Some(q) if !head_is_embed => Embedding::Rows(Box::new(q)),
            _ => Embedding::Dense(embed),
        };
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
            stamps: Vec::new(),
            checkpoint_key: checkpoint::key(opts),
            pools: Default::default(),
            head_norms: Default::default(),
        })
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

/// An embedding table must be `[vocab, hidden]`.
pub(super) fn check_embedding(cfg: &ModelConfig, dims: &[usize]) -> Result<()> {
    ensure!(
        dims == [cfg.vocab_size, cfg.hidden_size],
        "embedding shape {dims:?} does not match vocab {} x hidden {}",
        cfg.vocab_size,
        cfg.hidden_size
    );
    Ok(())
}

/// The rotary tables (one per distinct base and scale among the layers)
/// and each layer's index into them.
pub(super) fn ropes(cfg: &ModelConfig, context_len: usize, device: &Device) -> Result<(Vec<Rope>, Vec<usize>)> {
    let half = cfg.head_dim / 2;
    let mut keys: Vec<(u32, u32)> = Vec::new();
    let mut ropes = Vec::new();
    let mut of = Vec::with_capacity(cfg.layers);
    for i in 0..cfg.layers {
        let (base, scale) = cfg.rope_of(i);
        let key = (base.to_bits(), scale.to_bits());
        let r = match keys.iter().position(|k| *k == key) {
            Some(r) => r,
            None => {
                let (cos_host, sin_host) = rope_tables(cfg, base, scale, context_len);
                let cos = Tensor::from_slice(&cos_host, (context_len, half), device)?;
                let sin = Tensor::from_slice(&sin_host, (context_len, half), device)?;
                ropes.push(Rope { cos, sin, cos_host, sin_host });
                keys.push(key);
                ropes.len() - 1
            }
        };
        of.push(r);
    }
    Ok((ropes, of))
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
