//! Hyper-parameters of a Llama-family decoder, read from GGUF metadata or a
//! Hugging Face `config.json`.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use serde::Deserialize;

/// What the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `mistral`, ... (informational).
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
    /// GGUF files store Q and K permuted for interleaved rotary embeddings;
    /// Hugging Face checkpoints rotate halves.
    pub rope_interleaved: bool,
}

impl ModelConfig {
    /// Bytes of K and V per token across all layers for `dtype_size`-byte elements.
    pub fn kv_bytes_per_token(&self, dtype_size: usize) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * dtype_size
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
        Ok(())
    }

    /// From a GGUF header (`{arch}.*` keys).
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let md = &ct.metadata;
        let arch = md
            .get("general.architecture")
            .context("GGUF has no general.architecture")?
            .to_string()
            .map_err(anyhow::Error::msg)?
            .clone();
        if !matches!(arch.as_str(), "llama" | "qwen2" | "mistral" | "smollm") {
            bail!("unsupported GGUF architecture {arch:?} (supported: llama, qwen2, mistral)");
        }
        let get = |k: &str| -> Result<&gguf_file::Value> {
            md.get(&format!("{arch}.{k}")).with_context(|| format!("GGUF metadata has no {arch}.{k}"))
        };
        let u = |k: &str| -> Result<usize> { Ok(get(k)?.to_u32().map_err(anyhow::Error::msg)? as usize) };
        let hidden_size = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        let kv_heads = u("attention.head_count_kv").unwrap_or(heads);
        let head_dim = u("attention.key_length").or_else(|_| u("rope.dimension_count")).unwrap_or(hidden_size / heads);
        let vocab_size = match md.get("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec().map_err(anyhow::Error::msg)?.len(),
            None => ct
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .context("GGUF has neither a vocabulary nor token_embd.weight")?,
        };
        let cfg = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads,
            head_dim,
            rope_theta: get("rope.freq_base").and_then(|v| v.to_f32().map_err(anyhow::Error::msg)).unwrap_or(10_000.),
            rms_eps: get("attention.layer_norm_rms_epsilon")?.to_f32().map_err(anyhow::Error::msg)? as f64,
            context_len: u("context_length")?,
            qkv_bias: ct.tensor_infos.contains_key("blk.0.attn_q.bias"),
            rope_interleaved: true,
            architecture: arch,
        };
        cfg.validate()?;
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
            rms_norm_eps: Option<f64>,
            #[serde(default)]
            max_position_embeddings: Option<usize>,
            #[serde(default)]
            rope_scaling: Option<serde_json::Value>,
            #[serde(flatten)]
            _rest: HashMap<String, serde_json::Value>,
        }
        let hf: Hf = serde_json::from_str(text).context("config.json")?;
        if let Some(s) = hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            bail!("config.json: rope_scaling {s} is not supported");
        }
        let arch = hf.model_type.unwrap_or_else(|| "llama".into());
        if !matches!(arch.as_str(), "llama" | "qwen2" | "mistral") {
            bail!("config.json: unsupported model_type {arch:?} (supported: llama, qwen2, mistral)");
        }
        let cfg = ModelConfig {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            layers: hf.num_hidden_layers,
            heads: hf.num_attention_heads,
            kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rope_theta: hf.rope_theta.unwrap_or(10_000.),
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            context_len: hf.max_position_embeddings.unwrap_or(4096),
            qkv_bias: arch == "qwen2",
            rope_interleaved: false,
            architecture: arch,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
