//! The forward pass's attention as candle tensor operations (accelerators,
//! or [`super::LoadOptions::tensor_ops`] on the CPU).

use anyhow::Result;
use candle_core::{Device, Tensor};

use super::{Chunk, KvCache, Model, RopeStyle};

impl Model {
    /// The same as [`Model::attention_host`] with tensor operations, one
    /// sequence at a time (accelerators).
    pub(super) fn attention_device(&self, layer: usize, qkv: &Tensor, chunks: &mut [Chunk<'_>]) -> Result<Tensor> {
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
