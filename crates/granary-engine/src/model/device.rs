//! The forward pass's attention as candle tensor operations over the
//! device KV pool ([`super::pool`]): accelerators, or
//! [`super::LoadOptions::tensor_ops`] on the CPU.
//!
//! Everything that depends only on the step's sequences, not on the layer,
//! is worked out once per step ([`Plan`]): each new row's rotary angles,
//! where its K and V go in the pool, each sequence's block table and each
//! row's sequence and position. Per layer, new K and V are scattered into
//! their pool blocks in one operation, and every row of every sequence
//! attends in one [`PagedAttention`] call that reads the pool in place.

use std::sync::RwLockReadGuard;

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};

use super::paged::PagedAttention;
use super::pool::{KvPool, Staged, Tensors};
use super::{Chunk, Model, RopeStyle};

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
    /// Per chunk, its pool block ids, padded with block 0: `[chunks,
    /// max_blocks]` u32.
    tables: Tensor,
    /// Per new row, its chunk and its position: `[rows]` u32 each.
    row_seq: Tensor,
    row_pos: Tensor,
    /// Blocks taken in and not yet on the device: copied layer by layer.
    staged: Staged,
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
        let mut row_seq = Vec::new();
        let mut write_at = Vec::new();
        let mut uploads = Vec::new();
        let max_blocks = chunks.iter().map(|c| (c.kv.len() + c.tokens.len()).div_ceil(bt)).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; chunks.len() * max_blocks];
        for (ci, c) in chunks.iter().enumerate() {
            let (p, ids, pending) = c.kv.pool_blocks().ok_or_else(|| anyhow::anyhow!("KV cache is in host memory"))?;
            ensure!(std::ptr::eq(&**p, pool), "the step's KV caches are in different pools");
            let (off, n) = (c.kv.len(), c.tokens.len());
            ensure!(off + n <= c.kv.capacity(), "KV write past the reserved capacity");
            let used = (off + n).div_ceil(bt);
            ensure!(
                ids.len() >= used && ids[..used].iter().all(|&id| (id as usize) < tensors.blocks),
                "KV blocks outside the pool"
            );
            tables[ci * max_blocks..ci * max_blocks + used].copy_from_slice(&ids[..used]);
            for pos in off..off + n {
                positions.push(pos as u32);
                row_seq.push(ci as u32);
                let block = ids[pos / bt] as usize;
                for h in 0..kvh {
                    write_at.push(((block * kvh + h) * bt + pos % bt) as u32);
                }
            }
            uploads.extend(pending.iter().map(|(i, b)| (ids[*i], b.clone())));
        }
        let rows = positions.len();
        let row_pos = Tensor::from_vec(positions, rows, dev)?;
        let rope = model
            .ropes
            .iter()
            .map(|r| Ok((r.cos.index_select(&row_pos, 0)?, r.sin.index_select(&row_pos, 0)?)))
            .collect::<Result<Vec<_>>>()?;
        let write_at = Tensor::from_vec(write_at, (rows * kvh, 1), dev)?.broadcast_as((rows * kvh, d))?.contiguous()?;
        let tables = Tensor::from_vec(tables, (chunks.len(), max_blocks), dev)?;
        let row_seq = Tensor::from_vec(row_seq, rows, dev)?;
        let staged = pool.stage(&tensors, uploads)?;
        Ok(Plan { pool, tensors, rope, write_at, tables, row_seq, row_pos, staged })
    }
}

impl Drop for Plan<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.pool.settle(&self.staged) {
            tracing::error!("the KV pool's copies did not settle: {e:#}");
        }
    }
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
        plan.pool.layer_ready(&plan.tensors, &plan.staged, layer)?;
        let k = k.squeeze(0)?.transpose(0, 1)?; // [rows, kvh, d]
        write_rows(&plan.tensors, layer, &plan.write_at, &k, &v)?;
        // [rows, h, d], scaled.
        let q = (q.squeeze(0)?.transpose(0, 1)? * cfg.attn_scale as f64)?.contiguous()?;
        let op = PagedAttention {
            k: &plan.tensors.k[layer],
            v: &plan.tensors.v[layer],
            tables: &plan.tables,
            row_seq: &plan.row_seq,
            row_pos: &plan.row_pos,
            window: l.window,
            softcap: cfg.arch.softcap.map(|c| c.0).filter(|&c| c > 0.0),
        };
        Ok(q.apply_op1_no_bwd(&op)?.reshape((rows, h * d))?)
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
