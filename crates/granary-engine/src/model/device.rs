//! The forward pass's attention as candle tensor operations over the
//! device KV pool ([`super::pool`]): accelerators, or
//! [`super::LoadOptions::tensor_ops`] on the CPU.
//!
//! Everything that depends only on the step's sequences, not on the layer,
//! is worked out once per step ([`Plan`]): each new row's rotary angles,
//! where its K and V go in the pool, which pool blocks each sequence
//! reads, and the masks (causal, sliding window, padding), built on the
//! device from positions. Per layer, new K and V are scattered into their
//! pool blocks in one operation, and sequences with the same number of new
//! rows (all decoding sequences, typically) attend together: their blocks
//! are gathered from the pool in f16, shorter block tables padded with
//! block 0 and masked, and Q·Kᵀ and P·V are two batched f16 matmuls.

use std::collections::HashMap;
use std::sync::RwLockReadGuard;

use anyhow::{ensure, Result};
use bytes::Bytes;
use candle_core::{DType, Device, Tensor};

use super::pool::{KvPool, Tensors};
use super::{Chunk, Model, RopeStyle};

/// Sequences attending together: the same number of new rows each.
struct Group {
    /// Rows of the step (in step order) the group's queries are, grouped by
    /// sequence; `None` when the group is the whole step.
    rows: Option<Tensor>,
    seqs: usize,
    /// New rows per sequence.
    n: usize,
    /// Positions gathered per sequence (a multiple of the block size).
    span: usize,
    /// Rows of the pool's `[blocks * kv_heads, block_tokens * head_dim]`
    /// view, sequence by sequence, KV head by KV head, block by block:
    /// `[seqs * kv_heads * blocks]`.
    gather: Tensor,
    /// `[seqs, 1, n, span]` f32: 0 where a query may attend, a huge
    /// negative elsewhere; one per sliding window among the layers.
    masks: HashMap<Option<usize>, Tensor>,
}

/// What a forward step's attention needs, worked out once for every layer.
pub(super) struct Plan<'a> {
    pool: &'a KvPool,
    tensors: RwLockReadGuard<'a, Tensors>,
    /// Per rotary table, cos and sin of each new row's position, `[rows,
    /// head_dim / 2]`.
    rope: Vec<(Tensor, Tensor)>,
    /// For each new row and KV head, its row in the pool's `[blocks *
    /// kv_heads * block_tokens, head_dim]` view, repeated along
    /// `head_dim`: `[rows * kv_heads, head_dim]` u32.
    write_at: Tensor,
    groups: Vec<Group>,
    /// Where each step row is among the groups' concatenated outputs, when
    /// that is not the step order.
    unpermute: Option<Tensor>,
    /// Blocks taken in and not yet on the device: copied layer by layer.
    uploads: Vec<(u32, Bytes)>,
}

impl<'a> Plan<'a> {
    /// Room must be reserved in every chunk's KV (this takes the pool's
    /// read lock until dropped).
    pub(super) fn new(model: &Model, pool: &'a KvPool, chunks: &[Chunk<'_>]) -> Result<Self> {
        let cfg = &model.cfg;
        let dev = &model.device;
        let (kvh, bt, d) = (cfg.kv_heads, pool.block_tokens, cfg.head_dim);
        let tensors = pool.read();
        let mut positions = Vec::new();
        let mut write_at = Vec::new();
        let mut uploads = Vec::new();
        // Sequences by number of new rows, in order of first appearance.
        let mut by_n: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut starts = Vec::with_capacity(chunks.len());
        for (ci, c) in chunks.iter().enumerate() {
            let (p, ids, pending) = c.kv.pool_blocks().ok_or_else(|| anyhow::anyhow!("KV cache is in host memory"))?;
            ensure!(std::ptr::eq(&**p, pool), "the step's KV caches are in different pools");
            let (off, n) = (c.kv.len(), c.tokens.len());
            ensure!(off + n <= c.kv.capacity(), "KV write past the reserved capacity");
            starts.push(positions.len());
            for pos in off..off + n {
                positions.push(pos as u32);
                let block = ids[pos / bt] as usize;
                for h in 0..kvh {
                    write_at.push(((block * kvh + h) * bt + pos % bt) as u32);
                }
            }
            uploads.extend(pending.iter().map(|(i, b)| (ids[*i], b.clone())));
            match by_n.iter_mut().find(|(m, _)| *m == n) {
                Some((_, seqs)) => seqs.push(ci),
                None => by_n.push((n, vec![ci])),
            }
        }
        let rows = positions.len();
        let pos_t = Tensor::from_vec(positions, rows, dev)?;
        let rope = model
            .ropes
            .iter()
            .map(|r| Ok((r.cos.index_select(&pos_t, 0)?, r.sin.index_select(&pos_t, 0)?)))
            .collect::<Result<Vec<_>>>()?;
        let write_at = Tensor::from_vec(write_at, (rows * kvh, 1), dev)?.broadcast_as((rows * kvh, d))?.contiguous()?;
        let windows: Vec<Option<usize>> = {
            let mut w: Vec<Option<usize>> = model.layers.iter().map(|l| l.window).collect();
            w.sort_unstable();
            w.dedup();
            w
        };
        let whole = by_n.len() == 1;
        let mut groups = Vec::with_capacity(by_n.len());
        let mut order = Vec::with_capacity(rows);
        for (n, seqs) in by_n {
            let blocks = seqs.iter().map(|&ci| (chunks[ci].kv.len() + n).div_ceil(bt)).max().unwrap_or(1);
            let mut gather = Vec::with_capacity(seqs.len() * kvh * blocks);
            let mut offs = Vec::with_capacity(seqs.len());
            for &ci in &seqs {
                let (_, ids, _) = chunks[ci].kv.pool_blocks().expect("checked above");
                for h in 0..kvh {
                    for b in 0..blocks {
                        let id = ids.get(b).copied().unwrap_or(0) as usize;
                        gather.push((id * kvh + h) as u32);
                    }
                }
                let off = chunks[ci].kv.len();
                offs.push(off as f32);
                order.extend((starts[ci]..starts[ci] + n).map(|r| r as u32));
            }
            let span = blocks * bt;
            let s = seqs.len();
            let gather = Tensor::from_vec(gather, s * kvh * blocks, dev)?;
            let masks =
                windows.iter().map(|&w| Ok((w, mask(&offs, n, span, w, dev)?))).collect::<Result<HashMap<_, _>>>()?;
            let rows =
                if whole { None } else { Some(Tensor::from_vec(order[order.len() - s * n..].to_vec(), s * n, dev)?) };
            groups.push(Group { rows, seqs: s, n, span, gather, masks });
        }
        let unpermute = if order.iter().enumerate().all(|(i, &r)| r as usize == i) {
            None
        } else {
            let mut inv = vec![0u32; rows];
            for (i, &r) in order.iter().enumerate() {
                inv[r as usize] = i as u32;
            }
            Some(Tensor::from_vec(inv, rows, dev)?)
        };
        Ok(Plan { pool, tensors, rope, write_at, groups, unpermute, uploads })
    }
}

/// `[seqs, 1, n, span]`: 0 where query `i` of a sequence (position `off +
/// i`) may attend key `j`: `j <= off + i`, within the sliding `window` when
/// there is one; a huge negative elsewhere, padding included.
fn mask(offs: &[f32], n: usize, span: usize, window: Option<usize>, dev: &Device) -> Result<Tensor> {
    let s = offs.len();
    let keys = Tensor::arange(0u32, span as u32, dev)?.to_dtype(DType::F32)?.reshape((1, 1, span))?;
    let steps = Tensor::arange(0u32, n as u32, dev)?.to_dtype(DType::F32)?.reshape((1, n, 1))?;
    let pos = Tensor::from_slice(offs, (s, 1, 1), dev)?.broadcast_add(&steps)?;
    // Keys at or before the query's position (padding lies past every one).
    let mut ok = keys.broadcast_le(&pos)?.to_dtype(DType::F32)?;
    if let Some(w) = window {
        let first = (pos - (w as f64 - 1.0))?;
        ok = (ok * keys.broadcast_ge(&first)?.to_dtype(DType::F32)?)?;
    }
    // 0 where allowed, -f32::MAX elsewhere (never -inf: no NaN from 0 * inf).
    Ok(((ok - 1.0)? * f32::MAX as f64)?.unsqueeze(1)?)
}

/// A layer's Q and K head-norm weights on the device, `[head_dim]` each.
pub(super) type HeadNorms = (Option<Tensor>, Option<Tensor>);

impl Model {
    /// Per layer, the head-norm weights on the device: uploaded once, not
    /// on every layer of every step.
    fn device_head_norms(&self) -> Result<&[HeadNorms]> {
        if let Some(n) = self.head_norms.get() {
            return Ok(n);
        }
        let up = |w: &Option<Vec<f32>>| w.as_ref().map(|w| Tensor::from_slice(w, w.len(), &self.device)).transpose();
        let built = self.layers.iter().map(|l| Ok((up(&l.q_norm)?, up(&l.k_norm)?))).collect::<Result<Vec<_>>>()?;
        Ok(self.head_norms.get_or_init(|| built))
    }

    /// The same as [`Model::attention_host`] with tensor operations over the
    /// device KV pool, for every chunk of the step ([`Plan`]).
    pub(super) fn attention_device(&self, layer: usize, qkv: &Tensor, plan: &Plan<'_>) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (h, kvh, d) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let (q_w, kv_w) = (h * d, kvh * d);
        let rows = qkv.dim(0)?;
        let l = &self.layers[layer];
        let eps = cfg.rms_eps as f32;
        let head_norm = |x: Tensor, w: &Option<Tensor>| -> Result<Tensor> {
            Ok(match w {
                Some(w) => candle_nn::ops::rms_norm(&x, w, eps)?,
                None => x,
            })
        };
        let (q_norm, k_norm) = &self.device_head_norms()?[layer];
        let q = head_norm(qkv.narrow(1, 0, q_w)?.reshape((rows, h, d))?, q_norm)?;
        let k = head_norm(qkv.narrow(1, q_w, kv_w)?.reshape((rows, kvh, d))?, k_norm)?;
        let v = qkv.narrow(1, q_w + kv_w, kv_w)?.reshape((rows, kvh, d))?;
        // [1, heads, rows, d] for the rotary kernels.
        let q = q.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let k = k.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let (cos, sin) = &plan.rope[l.rope];
        let (q, k) = if cfg.rope_style == RopeStyle::Interleaved {
            (candle_nn::rotary_emb::rope_i(&q, cos, sin)?, candle_nn::rotary_emb::rope_i(&k, cos, sin)?)
        } else {
            (candle_nn::rotary_emb::rope(&q, cos, sin)?, candle_nn::rotary_emb::rope(&k, cos, sin)?)
        };
        // Blocks taken in since the last step arrive layer by layer.
        for (id, bytes) in &plan.uploads {
            plan.pool.put_layer(&plan.tensors, *id, layer, bytes)?;
        }
        let k = k.squeeze(0)?.transpose(0, 1)?; // [rows, kvh, d]
        write_rows(&plan.tensors, layer, &plan.write_at, &k, &v)?;
        // [rows, h, d], scaled here so that the f16 scores stay small.
        let q = (q.squeeze(0)?.transpose(0, 1)? * cfg.attn_scale as f64)?;
        let t = &plan.tensors;
        let per_block = plan.pool.block_tokens * d;
        let k_pool = t.k[layer].reshape((t.blocks * kvh, per_block))?;
        let v_pool = t.v[layer].reshape((t.blocks * kvh, per_block))?;
        let g = h / kvh;
        let mut outs = Vec::with_capacity(plan.groups.len());
        for gr in &plan.groups {
            let (s, n, span) = (gr.seqs, gr.n, gr.span);
            let qg = match &gr.rows {
                Some(r) => q.index_select(r, 0)?,
                None => q.clone(),
            };
            // Query heads sharing a KV head are adjacent: [s * kvh, g * n, d].
            let qg =
                qg.reshape((s, n, kvh, g, d))?.permute((0, 2, 3, 1, 4))?.contiguous()?.reshape((s * kvh, g * n, d))?;
            let kg = k_pool.index_select(&gr.gather, 0)?.reshape((s * kvh, span, d))?;
            let vg = v_pool.index_select(&gr.gather, 0)?.reshape((s * kvh, span, d))?;
            let mut att = qg.matmul(&kg.to_dtype(DType::F32)?.t()?)?;
            if let Some(cap) = cfg.arch.softcap.map(|c| c.0 as f64).filter(|&c| c > 0.0) {
                att = ((att / cap)?.tanh()? * cap)?;
            }
            let mask = &gr.masks[&l.window];
            let att = att.reshape((s, kvh * g, n, span))?.broadcast_add(mask)?.reshape((s * kvh, g * n, span))?;
            let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(DType::F16)?;
            let o = att.matmul(&vg)?.to_dtype(DType::F32)?;
            outs.push(o.reshape((s, kvh, g, n, d))?.permute((0, 3, 1, 2, 4))?.reshape((s * n, h * d))?);
        }
        let out = if outs.len() == 1 { outs.pop().expect("one group") } else { Tensor::cat(&outs, 0)? };
        Ok(match &plan.unpermute {
            Some(p) => out.index_select(p, 0)?,
            None => out,
        })
    }
}

/// Scatters `k` and `v` (`[rows, kv_heads, head_dim]`, any float dtype)
/// into layer `layer` of the pool at `at` ([`Plan::write_at`]).
pub(crate) fn write_rows(t: &Tensors, layer: usize, at: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let (rows, kvh, d) = k.dims3()?;
    for (pool, x) in [(&t.k[layer], k), (&t.v[layer], v)] {
        let flat = pool.reshape((pool.elem_count() / d, d))?;
        let src = x.to_dtype(DType::F16)?.contiguous()?.reshape((rows * kvh, d))?;
        flat.scatter_set(at, &src, 0)?;
    }
    Ok(())
}
