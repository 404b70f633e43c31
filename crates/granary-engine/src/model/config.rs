//! Hyper-parameters of a decoder, read from GGUF metadata or a Hugging Face
//! `config.json`, and the one table ([`ARCHITECTURES`]) saying how each
//! supported family differs: rotary style, extra norms, activation,
//! sliding-window layers, soft-capping, embedding scale, tensor layout.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use serde::Deserialize;

/// How rotary embeddings pair a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: llama.cpp's `NORM`, used by GGUF files
    /// of Llama-family models (their converter permutes Q and K for it).
    Interleaved,
    /// First half with second half `(i, i + d/2)`: llama.cpp's `NEOX` and
    /// every Hugging Face checkpoint.
    Halves,
}

/// The feed-forward activation applied to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// Which layers attend through a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlidingLayers {
    None,
    /// Layer `i` slides when `i % n < n - 1` (Gemma 2: 2, Gemma 3: 6).
    AllBut(usize),
    /// Every layer.
    All,
}

/// What distinguishes one architecture's forward pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArchSpec {
    /// `general.architecture` in GGUF files.
    pub gguf: &'static str,
    /// Hugging Face `model_type` values.
    pub hf: &'static [&'static str],
    /// Rotary style of GGUF files (Hugging Face checkpoints always rotate halves).
    pub gguf_rope: RopeStyle,
    /// Q, K and V projections have biases.
    pub qkv_bias: bool,
    /// RMS norms over each head of Q and K before rotary (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMS norms after attention and after the feed-forward block, before
    /// each residual add (Gemma 2 and 3).
    pub post_norms: bool,
    pub activation: Activation,
    /// Token embeddings are multiplied by sqrt(hidden size) (Gemma).
    pub embed_scale: bool,
    /// Hugging Face norm weights are stored minus one (Gemma's `1 + w`);
    /// GGUF converters add the one back.
    pub hf_norm_offset: bool,
    /// Q|K|V and gate|up are one tensor each (Phi-3).
    pub fused: bool,
    pub sliding: SlidingLayers,
    /// Sliding window when the file names none (llama.cpp's default).
    pub default_window: Option<usize>,
    /// Attention and final logit soft-capping (Gemma 2); 0 is off.
    pub softcap: Option<(f32, f32)>,
    /// Rotary base of sliding layers when it differs from the others (Gemma 3).
    pub local_rope_base: Option<f32>,
}

const LLAMA: ArchSpec = ArchSpec {
    gguf: "llama",
    hf: &["llama"],
    gguf_rope: RopeStyle::Interleaved,
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    activation: Activation::Silu,
    embed_scale: false,
    hf_norm_offset: false,
    fused: false,
    sliding: SlidingLayers::None,
    default_window: None,
    softcap: None,
    local_rope_base: None,
};

/// Every supported architecture.
pub const ARCHITECTURES: &[ArchSpec] = &[
    LLAMA,
    ArchSpec { gguf: "mistral", hf: &["mistral"], ..LLAMA },
    ArchSpec { gguf: "smollm", hf: &[], ..LLAMA },
    ArchSpec { gguf: "qwen2", hf: &["qwen2"], gguf_rope: RopeStyle::Halves, qkv_bias: true, ..LLAMA },
    ArchSpec { gguf: "qwen3", hf: &["qwen3"], gguf_rope: RopeStyle::Halves, qk_norm: true, ..LLAMA },
    ArchSpec {
        gguf: "gemma2",
        hf: &["gemma2"],
        gguf_rope: RopeStyle::Halves,
        post_norms: true,
        activation: Activation::GeluTanh,
        embed_scale: true,
        hf_norm_offset: true,
        sliding: SlidingLayers::AllBut(2),
        default_window: Some(4096),
        softcap: Some((50.0, 30.0)),
        ..LLAMA
    },
    ArchSpec {
        gguf: "gemma3",
        hf: &["gemma3_text"],
        gguf_rope: RopeStyle::Halves,
        qk_norm: true,
        post_norms: true,
        activation: Activation::GeluTanh,
        embed_scale: true,
        hf_norm_offset: true,
        sliding: SlidingLayers::AllBut(6),
        local_rope_base: Some(10_000.0),
        ..LLAMA
    },
    // Phi-3's sliding window is not applied: llama.cpp disables it too
    // (its GGUF files do not say which layers slide).
    ArchSpec { gguf: "phi3", hf: &["phi3"], gguf_rope: RopeStyle::Halves, fused: true, ..LLAMA },
];

/// "llama, mistral, ..." for error messages.
pub fn supported_list() -> String {
    ARCHITECTURES.iter().map(|a| a.gguf).collect::<Vec<_>>().join(", ")
}

fn spec_by_gguf(arch: &str) -> Result<ArchSpec> {
    ARCHITECTURES
        .iter()
        .find(|a| a.gguf == arch)
        .copied()
        .with_context(|| format!("unsupported GGUF architecture {arch:?} (supported: {})", supported_list()))
}

fn spec_by_hf(model_type: &str) -> Result<ArchSpec> {
    ARCHITECTURES.iter().find(|a| a.hf.contains(&model_type)).copied().with_context(|| {
        let known: Vec<&str> = ARCHITECTURES.iter().flat_map(|a| a.hf.iter().copied()).collect();
        format!("config.json: unsupported model_type {model_type:?} (supported: {})", known.join(", "))
    })
}

/// How positions map to rotary angles beyond the plain base.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (llama.cpp `freq_scale = 1 / factor`).
    Linear {
        factor: f32,
    },
    /// Llama 3's per-frequency factors: inverse frequencies are divided by
    /// these (a GGUF's `rope_freqs.weight`, or computed from `config.json`).
    Factors(Vec<f32>),
}

/// What the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `gemma2`, ... (the GGUF architecture name).
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
    /// Maximum positions the model was trained for.
    pub context_len: usize,
    /// Q/K/V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Rotary pairing of Q and K as stored.
    pub rope_style: RopeStyle,
    pub rope_scaling: RopeScaling,
    /// Attention scores are multiplied by this (1/sqrt(head_dim) unless the
    /// model says otherwise).
    pub attn_scale: f32,
    /// Keys a sliding layer's query sees: itself and the `window - 1` before it.
    pub sliding_window: Option<usize>,
    pub arch: ArchSpec,
}

impl ModelConfig {
    /// Bytes of K and V per token across all layers for `dtype_size`-byte elements.
    pub fn kv_bytes_per_token(&self, dtype_size: usize) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * dtype_size
    }

    /// Whether layer `layer` attends through the sliding window.
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && match self.arch.sliding {
                SlidingLayers::None => false,
                SlidingLayers::AllBut(n) => layer % n < n - 1,
                SlidingLayers::All => true,
            }
    }

    /// (base, linear position scale) of layer `layer`'s rotary angles.
    pub fn rope_of(&self, layer: usize) -> (f32, f32) {
        match self.arch.local_rope_base {
            Some(base) if self.is_sliding(layer) => (base, 1.0),
            _ => match self.rope_scaling {
                RopeScaling::Linear { factor } => (self.rope_theta, 1.0 / factor),
                _ => (self.rope_theta, 1.0),
            },
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            bail!("attention heads ({}) must be a positive multiple of KV heads ({})", self.heads, self.kv_heads);
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!("head dimension {} must be even and positive", self.head_dim);
        }
        if self.layers == 0 || self.vocab_size == 0 || self.hidden_size == 0 {
            bail!("model has zero layers, vocabulary or hidden size");
        }
        if let RopeScaling::Factors(f) = &self.rope_scaling {
            if f.len() != self.head_dim / 2 {
                bail!("rope frequency factors: {} values for a head dimension of {}", f.len(), self.head_dim);
            }
        }
        Ok(())
    }

    /// From a GGUF header (`{arch}.*` keys). Llama 3 frequency factors
    /// stored as a tensor are left empty here ([`RopeScaling::Factors`]);
    /// the model loader reads them.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let md = &ct.metadata;
        let arch = md
            .get("general.architecture")
            .context("GGUF has no general.architecture")?
            .to_string()
            .map_err(anyhow::Error::msg)?
            .clone();
        let mut spec = spec_by_gguf(&arch)?;
        let get = |k: &str| -> Result<&gguf_file::Value> {
            md.get(&format!("{arch}.{k}")).with_context(|| format!("GGUF metadata has no {arch}.{k}"))
        };
        let u = |k: &str| -> Result<usize> { Ok(get(k)?.to_u32().map_err(anyhow::Error::msg)? as usize) };
        let f = |k: &str| -> Option<f32> { get(k).ok().and_then(|v| v.to_f32().ok()) };
        let hidden_size = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        let kv_heads = u("attention.head_count_kv").unwrap_or(heads);
        let head_dim = u("attention.key_length").unwrap_or(hidden_size / heads.max(1));
        if let Ok(rot) = u("rope.dimension_count") {
            if rot != head_dim {
                bail!("partial rotary embeddings ({rot} of {head_dim} dimensions) are not supported");
            }
        }
        let vocab_size = match md.get("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec().map_err(anyhow::Error::msg)?.len(),
            None => ct
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .context("GGUF has neither a vocabulary nor token_embd.weight")?,
        };
        let layers = u("block_count")?;
        let scaling_type = get("rope.scaling.type").ok().and_then(|v| v.to_string().ok().cloned());
        let rope_scaling = match scaling_type.as_deref() {
            None | Some("none") => RopeScaling::None,
            Some("linear") => match f("rope.scaling.factor") {
                Some(factor) if factor > 0.0 && factor != 1.0 => RopeScaling::Linear { factor },
                _ => RopeScaling::None,
            },
            Some(other) => bail!("rope scaling {other:?} is not supported (supported: linear, llama3)"),
        };
        let rope_scaling = if ct.tensor_infos.contains_key("rope_freqs.weight") {
            RopeScaling::Factors(Vec::new())
        } else {
            rope_scaling
        };
        if ct.tensor_infos.contains_key("rope_factors_long.weight") {
            bail!("LongRoPE models (rope_factors_long) are not supported");
        }
        let window = match spec.sliding {
            SlidingLayers::None => None,
            _ => u("attention.sliding_window").ok().or(spec.default_window).filter(|&w| w > 0),
        };
        spec.softcap = spec
            .softcap
            .map(|(a, fl)| (f("attn_logit_softcapping").unwrap_or(a), f("final_logit_softcapping").unwrap_or(fl)));
        // Gemma's 27B models scale queries by hidden/heads, the others by
        // head_dim (llama.cpp tells them apart by their layer count).
        let attn_scale = match (spec.gguf, layers) {
            ("gemma2", 46) | ("gemma3", 62) => 1.0 / ((hidden_size / heads) as f32).sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let cfg = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            layers,
            heads,
            kv_heads,
            head_dim,
            rope_theta: f("rope.freq_base").unwrap_or(10_000.),
            rms_eps: get("attention.layer_norm_rms_epsilon")?.to_f32().map_err(anyhow::Error::msg)? as f64,
            context_len: u("context_length")?,
            qkv_bias: spec.qkv_bias || ct.tensor_infos.contains_key("blk.0.attn_q.bias"),
            rope_style: spec.gguf_rope,
            rope_scaling,
            attn_scale,
            sliding_window: window,
            architecture: arch,
            arch: spec,
        };
        if !matches!(cfg.rope_scaling, RopeScaling::Factors(_)) {
            cfg.validate()?;
        }
        Ok(cfg)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Hf {
            #[serde(default)]
            model_type: Option<String>,
            vocab_size: usize,
            hidden_size: usize,
            intermediate_size: usize,
            num_hidden_layers: usize,
            num_attention_heads: usize,
            #[serde(default)]
            num_key_value_heads: Option<usize>,
            #[serde(default)]
            head_dim: Option<usize>,
            #[serde(default)]
            rope_theta: Option<f32>,
            #[serde(default)]
            rope_local_base_freq: Option<f32>,
            #[serde(default)]
            rms_norm_eps: Option<f64>,
            #[serde(default)]
            max_position_embeddings: Option<usize>,
            #[serde(default)]
            rope_scaling: Option<serde_json::Value>,
            #[serde(default)]
            sliding_window: Option<usize>,
            #[serde(default)]
            sliding_window_pattern: Option<usize>,
            #[serde(default)]
            query_pre_attn_scalar: Option<f32>,
            #[serde(default)]
            attn_logit_softcapping: Option<f32>,
            #[serde(default)]
            final_logit_softcapping: Option<f32>,
            #[serde(default)]
            attention_bias: Option<bool>,
            #[serde(default)]
            partial_rotary_factor: Option<f32>,
            #[serde(flatten)]
            _rest: HashMap<String, serde_json::Value>,
        }
        let root: serde_json::Value = serde_json::from_str(text).context("config.json")?;
        let hf: Hf = serde_json::from_value(language_model_config(root)?).context("config.json")?;
        let model_type = hf.model_type.clone().unwrap_or_else(|| "llama".into());
        let mut spec = spec_by_hf(&model_type)?;
        if hf.partial_rotary_factor.is_some_and(|p| p != 1.0) {
            bail!("config.json: partial rotary embeddings (partial_rotary_factor) are not supported");
        }
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let rope_theta = hf.rope_theta.unwrap_or(10_000.);
        let rope_scaling = match hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            None => RopeScaling::None,
            Some(s) => hf_rope_scaling(s, rope_theta, head_dim)?,
        };
        let window = match spec.sliding {
            SlidingLayers::None => None,
            _ => hf.sliding_window.or(spec.default_window),
        };
        if let (SlidingLayers::AllBut(_), Some(n)) = (spec.sliding, hf.sliding_window_pattern) {
            spec.sliding = SlidingLayers::AllBut(n.max(1));
        }
        if let Some(base) = hf.rope_local_base_freq.filter(|_| spec.local_rope_base.is_some()) {
            spec.local_rope_base = Some(base);
        }
        if spec.softcap.is_some() {
            spec.softcap = Some((hf.attn_logit_softcapping.unwrap_or(0.0), hf.final_logit_softcapping.unwrap_or(0.0)));
        }
        let attn_scale = 1.0 / hf.query_pre_attn_scalar.unwrap_or(head_dim as f32).sqrt();
        let cfg = ModelConfig {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            layers: hf.num_hidden_layers,
            heads: hf.num_attention_heads,
            kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            rope_theta,
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            context_len: hf.max_position_embeddings.unwrap_or(4096),
            qkv_bias: spec.qkv_bias || hf.attention_bias == Some(true),
            rope_style: RopeStyle::Halves,
            rope_scaling,
            attn_scale,
            sliding_window: window,
            architecture: spec.gguf.to_string(),
            arch: spec,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The language model's part of a `config.json`. A multimodal checkpoint
/// (Gemma 3 from 4B up: `model_type` `gemma3`) nests it as `text_config`,
/// written as its differences from the text model's defaults, so those
/// defaults are filled in here; its vision tower is not used.
fn language_model_config(root: serde_json::Value) -> Result<serde_json::Value> {
    let model_type = root.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
    let Some((text_type, defaults)) = COMPOSITE.iter().find(|(outer, ..)| *outer == model_type).map(|(_, t, d)| (t, d))
    else {
        return Ok(root);
    };
    let text = root
        .get("text_config")
        .and_then(|v| v.as_object())
        .with_context(|| format!("config.json: model_type {model_type:?} without a text_config object"))?;
    let mut merged: serde_json::Map<String, serde_json::Value> = serde_json::from_str(defaults)?;
    merged.extend(text.iter().map(|(k, v)| (k.clone(), v.clone())));
    merged.insert("model_type".into(), (*text_type).into());
    Ok(serde_json::Value::Object(merged))
}

/// Multimodal `model_type`s served as their language model: the text
/// model's `model_type` and its configuration class's defaults
/// (transformers' `Gemma3TextConfig`).
const COMPOSITE: &[(&str, &str, &str)] = &[(
    "gemma3",
    "gemma3_text",
    r#"{"vocab_size":262208,"hidden_size":2304,"intermediate_size":9216,"num_hidden_layers":26,
        "num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,"max_position_embeddings":131072,
        "rms_norm_eps":1e-6,"rope_theta":1000000.0,"attention_bias":false,"query_pre_attn_scalar":256,
        "sliding_window":4096,"sliding_window_pattern":6,"rope_local_base_freq":10000.0}"#,
)];

/// `rope_scaling` of a `config.json`: `linear`, or `llama3` turned into
/// per-frequency factors the way transformers computes them.
fn hf_rope_scaling(s: &serde_json::Value, theta: f32, head_dim: usize) -> Result<RopeScaling> {
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(|v| v.as_str()).unwrap_or("");
    let num = |k: &str| s.get(k).and_then(|v| v.as_f64()).map(|x| x as f32);
    if kind == "default" {
        return Ok(RopeScaling::None);
    }
    let factor = num("factor").with_context(|| format!("config.json: rope_scaling {s} has no factor"))?;
    match kind {
        "linear" => Ok(RopeScaling::Linear { factor }),
        "llama3" => {
            let low = num("low_freq_factor").context("config.json: rope_scaling has no low_freq_factor")?;
            let high = num("high_freq_factor").context("config.json: rope_scaling has no high_freq_factor")?;
            let old = num("original_max_position_embeddings")
                .context("config.json: rope_scaling has no original_max_position_embeddings")?;
            Ok(RopeScaling::Factors(llama3_factors(theta, head_dim, factor, low, high, old)))
        }
        other => bail!("config.json: rope_scaling type {other:?} is not supported (supported: linear, llama3)"),
    }
}

/// Llama 3's frequency factors (what its GGUF files store as
/// `rope_freqs.weight`): inverse frequency `i` is divided by factor `i`.
pub fn llama3_factors(theta: f32, head_dim: usize, factor: f32, low: f32, high: f32, old_ctx: f32) -> Vec<f32> {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    (0..head_dim / 2)
        .map(|i| {
            let inv = 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / inv;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                // new_inv = (1 - smooth) inv / factor + smooth inv = inv / f
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_architecture_is_named_once() {
        let mut names: Vec<&str> = ARCHITECTURES.iter().map(|a| a.gguf).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ARCHITECTURES.len());
        let err = spec_by_gguf("mamba").unwrap_err().to_string();
        assert!(err.contains("\"mamba\"") && err.contains("gemma3") && err.contains("qwen3"), "{err}");
        let err = spec_by_hf("falcon").unwrap_err().to_string();
        assert!(err.contains("falcon") && err.contains("phi3"), "{err}");
    }

    #[test]
    fn sliding_layers_follow_the_pattern() {
        let base = ModelConfig::from_hf_json(
            r#"{"model_type":"gemma3_text","vocab_size":10,"hidden_size":8,"intermediate_size":16,
                "num_hidden_layers":12,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,
                "sliding_window":4,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
                "rope_scaling":{"rope_type":"linear","factor":8.0}}"#,
        )
        .unwrap();
        let sliding: Vec<usize> = (0..12).filter(|&l| base.is_sliding(l)).collect();
        assert_eq!(sliding, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]);
        assert_eq!(base.rope_of(0), (10_000.0, 1.0));
        assert_eq!(base.rope_of(5), (1_000_000.0, 0.125));
        assert_eq!(base.attn_scale, 0.5);
    }

    #[test]
    fn a_multimodal_gemma3_config_is_read_as_its_text_model_with_its_defaults() {
        // The shape of google/gemma-3-4b-it's config.json: the text model
        // nested, with only what differs from Gemma3TextConfig's defaults.
        let cfg = ModelConfig::from_hf_json(
            r#"{"architectures":["Gemma3ForConditionalGeneration"],"model_type":"gemma3",
                "text_config":{"hidden_size":2560,"intermediate_size":10240,"model_type":"gemma3_text",
                    "num_hidden_layers":34,"rope_scaling":{"factor":8.0,"rope_type":"linear"},"sliding_window":1024},
                "vision_config":{"model_type":"siglip_vision_model","hidden_size":1152}}"#,
        )
        .unwrap();
        assert_eq!(cfg.architecture, "gemma3");
        assert_eq!((cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size), (262208, 2560, 10240));
        assert_eq!((cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim), (34, 8, 4, 256));
        assert_eq!((cfg.sliding_window, cfg.context_len, cfg.rms_eps), (Some(1024), 131072, 1e-6));
        assert_eq!(cfg.rope_of(0), (10_000.0, 1.0));
        assert_eq!(cfg.rope_of(5), (1_000_000.0, 0.125));
        assert_eq!(cfg.attn_scale, 1.0 / 16.0);
        let e = ModelConfig::from_hf_json(r#"{"model_type":"gemma3"}"#).unwrap_err().to_string();
        assert!(e.contains("text_config"), "{e}");
    }

    #[test]
    fn llama3_factors_match_the_published_rule() {
        // Llama 3.1 8B: theta 500000, head_dim 128, factor 8, low 1, high 4, 8192.
        let f = llama3_factors(500_000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0, "high frequencies keep their rate");
        assert_eq!(f[63], 8.0, "low frequencies are slowed by the factor");
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "factors grow with wavelength");
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "a smooth band in between");
    }

    #[test]
    fn unsupported_scalings_are_refused_by_name() {
        let cfg = |scaling: &str| {
            ModelConfig::from_hf_json(&format!(
                r#"{{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
                    "num_attention_heads":2,"rope_scaling":{scaling}}}"#
            ))
        };
        let e = cfg(r#"{"rope_type":"yarn","factor":4.0}"#).unwrap_err().to_string();
        assert!(e.contains("yarn"), "{e}");
        assert!(cfg(r#"{"rope_type":"linear","factor":2.0}"#).is_ok());
        let c = cfg(r#"{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                "original_max_position_embeddings":8192}"#)
        .unwrap();
        assert!(matches!(c.rope_scaling, RopeScaling::Factors(ref f) if f.len() == 2));
    }
}
