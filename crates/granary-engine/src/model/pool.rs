//! The device-side KV block pool: one per block size, shared by every
//! sequence of a model whose attention runs as tensor operations (an
//! accelerator, or [`super::LoadOptions::tensor_ops`] on the CPU).
//!
//! Per layer, K and V are each one f16 tensor `[blocks, kv_heads,
//! block_tokens, head_dim]`, so a block's share of a layer is laid out
//! exactly as that layer's part of a warehouse block payload: a block goes
//! in and out with one copy per layer half, no reshuffle. A sequence holds
//! block ids ([`super::KvCache`]); attention reads them in place in the
//! pool, every sequence of a step in one call ([`super::paged`]). Block 0
//! is never handed out: it pads the step's shorter block tables.
//!
//! The pool grows by doubling when a reservation does not fit (block ids
//! stay valid), and never shrinks: its size is the peak of what the
//! engine's KV budget let sequences hold.

use std::sync::{Mutex, RwLock, RwLockReadGuard};

use anyhow::{ensure, Result};
use bytes::Bytes;
use candle_core::{DType, Device, Tensor};
use half::f16;

use super::ModelConfig;

#[cfg(feature = "cuda")]
mod copy;

/// The pool's tensors, read-locked for a whole forward step (growth takes
/// the write lock, between steps).
pub(crate) struct Tensors {
    /// Per layer `[blocks, kv_heads, block_tokens, head_dim]` f16.
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Blocks the tensors hold (block 0 included).
    pub blocks: usize,
}

/// Blocks on their way into the pool for one forward step
/// ([`KvPool::stage`]).
pub(crate) struct Staged {
    /// Written layer by layer as the step reaches each layer.
    blocks: Vec<(u32, Bytes)>,
    /// Every layer's copies are queued on the CUDA copy stream.
    #[cfg(feature = "cuda")]
    queued: bool,
}

#[cfg(feature = "cuda")]
type Copier = copy::CopyStream;
/// Without CUDA there is no copy stream.
#[cfg(not(feature = "cuda"))]
enum Copier {}

/// Writes blocks' values (f16 little-endian bytes, one layer half each)
/// into one layer half of the pool, in place: on the CPU a copy, on CUDA
/// asynchronous copies from host memory on the pool's copy stream.
struct PutBlocks<'a> {
    /// f16 elements of one block's layer half.
    per: usize,
    blocks: &'a [(u32, &'a [u8])],
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    copy: Option<&'a Copier>,
}

impl candle_core::InplaceOp1 for PutBlocks<'_> {
    fn name(&self) -> &'static str {
        "granary-put-blocks"
    }

    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F16(all) = s else { candle_core::bail!("the KV pool is not f16") };
        let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("the KV pool is not contiguous") };
        let dst = &mut all[start..end];
        for &(id, bytes) in self.blocks {
            let at = id as usize * self.per;
            let Some(out) = dst.get_mut(at..at + self.per) else {
                candle_core::bail!("block {id} is outside the KV pool")
            };
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]);
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &candle_core::Layout) -> candle_core::Result<()> {
        let Some(copy) = self.copy else { candle_core::bail!("no copy stream for the KV pool") };
        let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("the KV pool is not contiguous") };
        copy.put(s.as_cuda_slice_mut::<f16>()?, start, end, self.per, self.blocks)
    }
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
    /// The stream blocks taken in are copied on (CUDA), made at the first.
    #[cfg(feature = "cuda")]
    copy: std::sync::OnceLock<copy::CopyStream>,
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
            #[cfg(feature = "cuda")]
            copy: std::sync::OnceLock::new(),
        }
    }

    /// The pool's copy stream on CUDA (`None` on other devices).
    #[cfg(feature = "cuda")]
    fn copy_stream(&self) -> Result<Option<&copy::CopyStream>> {
        let Device::Cuda(dev) = &self.device else { return Ok(None) };
        if let Some(c) = self.copy.get() {
            return Ok(Some(c));
        }
        let made = copy::CopyStream::new(dev, self.layers)?;
        // A racing caller's stream is dropped; both are idle.
        let _ = self.copy.set(made);
        Ok(self.copy.get())
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

    /// Starts bringing blocks taken in (id, whole payload: every layer's K
    /// then V, f16 little-endian) into the pool for a forward step. On CUDA
    /// every layer's copies are queued now on the pool's copy stream,
    /// behind the work already queued (which may still read blocks being
    /// reused) and beside this step's layers, which wait only for their
    /// own layer's copies ([`KvPool::layer_ready`]). Elsewhere each layer is
    /// written when the step reaches it.
    pub(crate) fn stage(&self, t: &Tensors, blocks: Vec<(u32, Bytes)>) -> Result<Staged> {
        for (id, p) in &blocks {
            ensure!((*id as usize) < t.blocks, "block {id} is outside the pool of {}", t.blocks);
            ensure!(p.len() == self.block_bytes(), "a block payload of {} bytes, not {}", p.len(), self.block_bytes());
        }
        #[cfg(feature = "cuda")]
        if !blocks.is_empty() {
            if let Some(copy) = self.copy_stream()? {
                copy.begin()?;
                for layer in 0..self.layers {
                    self.put_layer(t, layer, &blocks, Some(copy))?;
                    copy.layer_done(layer)?;
                }
                return Ok(Staged { blocks: Vec::new(), queued: true });
            }
        }
        Ok(Staged {
            blocks,
            #[cfg(feature = "cuda")]
            queued: false,
        })
    }

    /// Makes layer `layer` of the staged blocks ready for the step's next
    /// operations on the pool.
    pub(crate) fn layer_ready(&self, t: &Tensors, staged: &Staged, layer: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if staged.queued {
            let copy = self.copy_stream()?.ok_or_else(|| anyhow::anyhow!("blocks queued with no copy stream"))?;
            return copy.wait(layer);
        }
        if staged.blocks.is_empty() {
            return Ok(());
        }
        self.put_layer(t, layer, &staged.blocks, None)
    }

    /// The compute stream waits for every copy `staged` queued, whatever
    /// layers the step reached: nothing may read, copy or free the pool's
    /// tensors while a copy into them is in flight (a step that failed
    /// half way, then the pool's growth).
    pub(crate) fn settle(&self, staged: &Staged) -> Result<()> {
        #[cfg(feature = "cuda")]
        if staged.queued && self.layers > 0 {
            if let Some(copy) = self.copy_stream()? {
                return copy.wait(self.layers - 1);
            }
        }
        let _ = staged;
        Ok(())
    }

    /// Writes layer `layer` of `blocks` into the pool: the K half and the V
    /// half, each one in-place operation over every block.
    fn put_layer(&self, t: &Tensors, layer: usize, blocks: &[(u32, Bytes)], copy: Option<&Copier>) -> Result<()> {
        let per = self.half_elems();
        for (half, tensor) in [&t.k[layer], &t.v[layer]].into_iter().enumerate() {
            let at = (2 * layer + half) * per * 2;
            let parts: Vec<(u32, &[u8])> = blocks.iter().map(|(id, p)| (*id, &p[at..at + per * 2])).collect();
            tensor.inplace_op1(&PutBlocks { per, blocks: &parts, copy })?;
        }
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
            let staged = pool.stage(&t, vec![(a[1], Bytes::from(payload.clone()))]).unwrap();
            for l in 0..2 {
                pool.layer_ready(&t, &staged, l).unwrap();
            }
            assert!(pool.stage(&t, vec![(a[1], Bytes::from(vec![0u8; 6]))]).is_err(), "a short payload");
            assert!(
                pool.stage(&t, vec![(t.blocks as u32, Bytes::from(payload.clone()))]).is_err(),
                "a block past the pool"
            );
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
