//! The forward pass's attention on the CPU: rotary embeddings, Q/K norms,
//! the KV write and the engine's own attention kernel over the f16 cache.

use anyhow::{bail, Context, Result};
use candle_core::Tensor;

use super::{attention, simd, Chunk, Model, RopeStyle};

impl Model {
    /// Rotary embeddings, the KV write and attention for every chunk, on the
    /// host: `qkv` is `[rows, (heads + 2 kv_heads) head_dim]`, the result
    /// `[rows, heads head_dim]`.
    pub(super) fn attention_host(&self, layer: usize, qkv: &Tensor, chunks: &mut [Chunk<'_>]) -> Result<Tensor> {
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
pub(super) fn silu_mul_host(gu: &Tensor, inter: usize) -> Result<Tensor> {
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
