//! The device-side KV block pool: one per block size, shared by every
//! sequence of a model whose attention runs as tensor operations (an
//! accelerator, or [`super::LoadOptions::tensor_ops`] on the CPU).
//!
//! Per layer, K and V are each one f16 tensor `[blocks, kv_heads,
//! block_tokens, head_dim]`, so a block's share of a layer is laid out
//! exactly as that layer's part of a warehouse block payload: a block goes
//! in and out with one copy per layer half, no reshuffle. A sequence holds
//! block ids ([`super::KvCache`]); attention gathers them straight from the
//! pool, several sequences at a time ([`super::device`]). Block 0 is never
//! handed out: batched attention pads shorter block tables with it.
//!
//! The pool grows by doubling when a reservation does not fit (block ids
//! stay valid), and never shrinks: its size is the peak of what the
//! engine's KV budget let sequences hold.

use std::sync::{Mutex, RwLock, RwLockReadGuard};

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;

use super::ModelConfig;

/// The pool's tensors, read-locked for a whole forward step (growth takes
/// the write lock, between steps).
pub(crate) struct Tensors {
    /// Per layer `[blocks, kv_heads, block_tokens, head_dim]` f16.
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Blocks the tensors hold (block 0 included).
    pub blocks: usize,
}

struct Free {
    /// Ids given back.
    ids: Vec<u32>,
    /// The first id never handed out.
    next: u32,
}

pub struct KvPool {
    tensors: RwLock<Tensors>,
    free: Mutex<Free>,
    pub(crate) layers: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) block_tokens: usize,
    device: Device,
}

impl KvPool {
    /// An empty pool: device memory is taken by the first reservation.
    pub fn new(cfg: &ModelConfig, device: &Device, block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        KvPool {
            tensors: RwLock::new(Tensors { k: Vec::new(), v: Vec::new(), blocks: 0 }),
            free: Mutex::new(Free { ids: Vec::new(), next: 1 }),
            layers: cfg.layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            block_tokens,
            device: device.clone(),
        }
    }

    /// Blocks the pool's tensors hold (block 0 included).
    pub fn capacity(&self) -> usize {
        self.read().blocks
    }

    /// Blocks handed out and not given back.
    pub fn in_use(&self) -> usize {
        let f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        f.next as usize - 1 - f.ids.len()
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Tensors> {
        self.tensors.read().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` block ids, growing the pool when they do not fit. Must not be
    /// called while this thread holds [`KvPool::read`].
    pub(crate) fn alloc(&self, n: usize) -> Result<Vec<u32>> {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let reuse = n.min(f.ids.len());
        let at = f.ids.len() - reuse;
        let mut ids = f.ids.split_off(at);
        let fresh = n - reuse;
        if fresh > 0 {
            let end = f.next as usize + fresh;
            ensure!(end <= u32::MAX as usize, "KV pool of {end} blocks is past its id space");
            if end > self.capacity() {
                self.grow(end)?;
            }
            ids.extend(f.next..end as u32);
            f.next = end as u32;
        }
        Ok(ids)
    }

    /// Gives blocks back.
    pub(crate) fn release(&self, ids: &[u32]) {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        f.ids.extend_from_slice(ids);
    }

    /// Makes room for `blocks` blocks at least (doubling), copying what the
    /// pool holds.
    fn grow(&self, blocks: usize) -> Result<()> {
        let mut t = self.tensors.write().unwrap_or_else(|e| e.into_inner());
        if blocks <= t.blocks {
            return Ok(());
        }
        // What the reservation needs, or twice what the pool held: a pool
        // used once (embeddings, a short test) stays small, a busy one
        // grows a logarithmic number of times.
        let cap = blocks.max(t.blocks * 2);
        let shape = (cap, self.kv_heads, self.block_tokens, self.head_dim);
        let fresh = |old: Option<&Tensor>| -> Result<Tensor> {
            let bigger = Tensor::zeros(shape, DType::F16, &self.device)?;
            if let Some(old) = old {
                bigger.slice_set(old, 0, 0)?;
            }
            Ok(bigger)
        };
        let k = (0..self.layers).map(|l| fresh(t.k.get(l))).collect::<Result<Vec<_>>>()?;
        let v = (0..self.layers).map(|l| fresh(t.v.get(l))).collect::<Result<Vec<_>>>()?;
        *t = Tensors { k, v, blocks: cap };
        Ok(())
    }

    /// f16 elements of one layer half (K or V) of one block.
    pub(crate) fn half_elems(&self) -> usize {
        self.kv_heads * self.block_tokens * self.head_dim
    }

    /// Bytes of a whole block payload (every layer, K and V).
    pub fn block_bytes(&self) -> usize {
        2 * self.layers * self.half_elems() * 2
    }

    /// Copies layer `layer` of a block payload (every layer's K then V) into
    /// block `id`: one upload, then two copies on the device.
    pub(crate) fn put_layer(&self, t: &Tensors, id: u32, layer: usize, payload: &[u8]) -> Result<()> {
        let per = self.half_elems();
        let part = &payload[2 * layer * per * 2..2 * (layer + 1) * per * 2];
        let vals: Vec<f16> = match bytemuck::try_cast_slice::<u8, f16>(part) {
            Ok(v) => v.to_vec(),
            Err(_) => bytemuck::pod_collect_to_vec(part),
        };
        let both = Tensor::from_vec(vals, (2, 1, self.kv_heads, self.block_tokens, self.head_dim), &self.device)?;
        t.k[layer].slice_set(&both.get(0)?, 0, id as usize)?;
        t.v[layer].slice_set(&both.get(1)?, 0, id as usize)?;
        Ok(())
    }

    /// The payload of block `id` (every layer's K then V, f16
    /// little-endian).
    pub(crate) fn get_block(&self, id: u32) -> Result<Vec<u8>> {
        let t = self.read();
        let mut out: Vec<u8> = Vec::with_capacity(self.block_bytes());
        for l in 0..self.layers {
            for half in [&t.k[l], &t.v[l]] {
                let vals = half.get(id as usize)?.flatten_all()?.to_vec1::<f16>()?;
                out.extend_from_slice(bytemuck::cast_slice(&vals));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_reused_and_growth_keeps_what_blocks_hold() {
        let mut cfg = crate::model::kv::tests::cfg();
        cfg.layers = 2;
        let pool = KvPool::new(&cfg, &Device::Cpu, 4);
        assert_eq!(pool.capacity(), 0, "no device memory before the first reservation");
        let a = pool.alloc(3).unwrap();
        assert_eq!(a, [1, 2, 3], "block 0 is the padding block");
        let payload: Vec<u8> =
            (0..pool.block_bytes() / 2).flat_map(|i| f16::from_f32(i as f32).to_bits().to_le_bytes()).collect();
        {
            let t = pool.read();
            for l in 0..2 {
                pool.put_layer(&t, a[1], l, &payload).unwrap();
            }
        }
        assert_eq!(pool.get_block(a[1]).unwrap(), payload);
        let many = pool.alloc(40).unwrap();
        assert!(pool.capacity() >= 44, "grew to {}", pool.capacity());
        assert_eq!(pool.get_block(a[1]).unwrap(), payload, "a block survives growth");
        pool.release(&many);
        pool.release(&a[..1]);
        assert_eq!(pool.in_use(), 2);
        let again = pool.alloc(2).unwrap();
        assert!(again.iter().all(|i| many.contains(i) || *i == a[0]), "{again:?} are reused ids");
        assert!(!again.contains(&0));
    }
}
