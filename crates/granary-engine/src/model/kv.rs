//! The engine-owned KV cache of one sequence: per layer, K and V as
//! `[kv_heads, capacity, head_dim]` f16, grown a block at a time, with whole
//! blocks exported to and imported from the warehouse's byte layout (per
//! layer, K then V, each `[kv_heads, tokens, head_dim]` f16 little-endian).
//!
//! On the CPU the cache is plain memory that the attention kernel reads in
//! place and that blocks are copied in and out of head by head; on an
//! accelerator it is a pair of device tensors per layer.

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;

use super::simd;
use super::ModelConfig;

enum Storage {
    Host { k: Vec<Vec<f16>>, v: Vec<Vec<f16>> },
    Device { k: Vec<Tensor>, v: Vec<Tensor> },
}

/// KV of one sequence.
pub struct KvCache {
    storage: Storage,
    len: usize,
    cap: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Capacity grows in multiples of this many tokens.
    granule: usize,
    max_len: usize,
    device: Device,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig, device: &Device, granule: usize, max_len: usize) -> Self {
        let storage = if device.is_cpu() {
            Storage::Host { k: Vec::new(), v: Vec::new() }
        } else {
            Storage::Device { k: Vec::new(), v: Vec::new() }
        };
        KvCache {
            storage,
            len: 0,
            cap: 0,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            granule: granule.max(1),
            max_len,
            device: device.clone(),
        }
    }

    /// Tokens whose K and V are held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions allocated per head.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    fn layers(&self) -> usize {
        match &self.storage {
            Storage::Host { k, .. } => k.len(),
            Storage::Device { k, .. } => k.len(),
        }
    }

    /// Bytes allocated for this sequence.
    pub fn allocated_bytes(&self) -> usize {
        2 * self.layers() * self.kv_heads * self.cap * self.head_dim * 2
    }

    /// Elements of one layer's K (or V) for `tokens` tokens.
    fn layer_block_elems(&self, tokens: usize) -> usize {
        self.kv_heads * tokens * self.head_dim
    }

    /// Makes room for `new_len` tokens over `layers` layers.
    pub fn reserve(&mut self, layers: usize, new_len: usize) -> Result<()> {
        ensure!(new_len <= self.max_len, "sequence of {new_len} tokens exceeds the context of {}", self.max_len);
        if new_len <= self.cap && self.layers() == layers {
            return Ok(());
        }
        let want = new_len.div_ceil(self.granule) * self.granule;
        let new_cap = want.max(self.cap.saturating_mul(2)).min(self.max_len.div_ceil(self.granule) * self.granule);
        let (old_cap, len, kvh, d) = (self.cap, self.len, self.kv_heads, self.head_dim);
        match &mut self.storage {
            Storage::Host { k, v } => {
                let grow = |old: Option<&Vec<f16>>| {
                    let mut n = vec![f16::ZERO; kvh * new_cap * d];
                    if let Some(old) = old {
                        for h in 0..kvh {
                            n[h * new_cap * d..][..len * d].copy_from_slice(&old[h * old_cap * d..][..len * d]);
                        }
                    }
                    n
                };
                *k = (0..layers).map(|l| grow(k.get(l))).collect();
                *v = (0..layers).map(|l| grow(v.get(l))).collect();
            }
            Storage::Device { k, v } => {
                let shape = (kvh, new_cap, d);
                let mut nk = Vec::with_capacity(layers);
                let mut nv = Vec::with_capacity(layers);
                for l in 0..layers {
                    let tk = Tensor::zeros(shape, DType::F16, &self.device)?;
                    let tv = Tensor::zeros(shape, DType::F16, &self.device)?;
                    if len > 0 && l < k.len() {
                        tk.slice_set(&k[l].narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                        tv.slice_set(&v[l].narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                    }
                    nk.push(tk);
                    nv.push(tv);
                }
                *k = nk;
                *v = nv;
            }
        }
        self.cap = new_cap;
        Ok(())
    }

    /// The host buffers of `layer` (`[kv_heads, capacity, head_dim]`).
    pub(crate) fn host(&self, layer: usize) -> Option<(&[f16], &[f16])> {
        match &self.storage {
            Storage::Host { k, v } => Some((&k[layer], &v[layer])),
            Storage::Device { .. } => None,
        }
    }

    /// Stores K and V of `layer` for the rows of `kv`, each row `[K of
    /// kv_heads heads | V of kv_heads heads]` f32, at positions `offset..`.
    pub(crate) fn write_host_rows(&mut self, layer: usize, offset: usize, rows: &[f32]) -> Result<()> {
        let (kvh, d, cap) = (self.kv_heads, self.head_dim, self.cap);
        let width = 2 * kvh * d;
        let n = rows.len() / width;
        ensure!(offset + n <= cap, "KV write past the reserved capacity");
        let Storage::Host { k, v } = &mut self.storage else { bail!("KV cache is not in host memory") };
        let lv = simd::level();
        for (i, row) in rows.chunks_exact(width).enumerate() {
            for h in 0..kvh {
                let dst = (h * cap + offset + i) * d;
                simd::f32_to_f16(lv, &row[h * d..(h + 1) * d], &mut k[layer][dst..dst + d]);
                simd::f32_to_f16(lv, &row[(kvh + h) * d..(kvh + h + 1) * d], &mut v[layer][dst..dst + d]);
            }
        }
        Ok(())
    }

    /// Stores K and V (`[kv_heads, n, head_dim]`, any float dtype) of `layer`
    /// at positions `offset..offset + n` (device caches). Capacity must have
    /// been reserved.
    pub(crate) fn write(&self, layer: usize, offset: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(1)?;
        ensure!(offset + n <= self.cap, "KV write past the reserved capacity");
        let Storage::Device { k: ks, v: vs } = &self.storage else { bail!("KV cache is in host memory") };
        ks[layer].slice_set(&k.to_dtype(DType::F16)?.contiguous()?, 1, offset)?;
        vs[layer].slice_set(&v.to_dtype(DType::F16)?.contiguous()?, 1, offset)?;
        Ok(())
    }

    /// K and V of `layer` for positions `0..len` in `dtype` (device caches).
    pub(crate) fn read(&self, layer: usize, len: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
        let Storage::Device { k, v } = &self.storage else { bail!("KV cache is in host memory") };
        Ok((k[layer].narrow(1, 0, len)?.to_dtype(dtype)?, v[layer].narrow(1, 0, len)?.to_dtype(dtype)?))
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.cap);
        self.len = len;
    }

    /// Forgets everything after `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes of block `index` (`tokens` per block): for each layer, K then V,
    /// each `[kv_heads, tokens, head_dim]` f16 little-endian.
    pub fn export_block(&self, index: usize, tokens: usize) -> Result<Vec<u8>> {
        let start = index * tokens;
        ensure!(start + tokens <= self.len, "block {index} is not complete in this sequence");
        let (kvh, d, cap) = (self.kv_heads, self.head_dim, self.cap);
        let mut out: Vec<u8> = Vec::with_capacity(self.block_bytes(tokens));
        match &self.storage {
            Storage::Host { k, v } => {
                for l in 0..k.len() {
                    for t in [&k[l], &v[l]] {
                        for h in 0..kvh {
                            out.extend_from_slice(bytemuck::cast_slice(&t[(h * cap + start) * d..][..tokens * d]));
                        }
                    }
                }
            }
            Storage::Device { k, v } => {
                for l in 0..k.len() {
                    for t in [&k[l], &v[l]] {
                        let part = t.narrow(1, start, tokens)?.flatten_all()?.to_vec1::<f16>()?;
                        out.extend_from_slice(bytemuck::cast_slice(&part));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Size of one exported block.
    pub fn block_bytes(&self, tokens: usize) -> usize {
        2 * self.layers().max(1) * self.layer_block_elems(tokens) * 2
    }

    /// Loads block `index` from bytes made by [`KvCache::export_block`]; the
    /// block must extend the sequence (`index * tokens == len`).
    pub fn import_block(&mut self, layers: usize, index: usize, tokens: usize, bytes: &[u8]) -> Result<()> {
        let start = index * tokens;
        ensure!(start == self.len, "block {index} does not continue a sequence of {} tokens", self.len);
        let per = self.layer_block_elems(tokens) * 2;
        if bytes.len() != 2 * layers * per {
            bail!("block of {} bytes, expected {}", bytes.len(), 2 * layers * per);
        }
        self.reserve(layers, start + tokens)?;
        let (kvh, d, cap) = (self.kv_heads, self.head_dim, self.cap);
        let head_bytes = tokens * d * 2;
        match &mut self.storage {
            Storage::Host { k, v } => {
                for l in 0..layers {
                    for (j, dst) in [&mut k[l], &mut v[l]].into_iter().enumerate() {
                        let part = &bytes[(2 * l + j) * per..][..per];
                        for h in 0..kvh {
                            let dst: &mut [u8] =
                                bytemuck::cast_slice_mut(&mut dst[(h * cap + start) * d..][..tokens * d]);
                            dst.copy_from_slice(&part[h * head_bytes..][..head_bytes]);
                        }
                    }
                }
            }
            Storage::Device { k, v } => {
                let shape = (kvh, tokens, d);
                for l in 0..layers {
                    for (j, dst) in [&k[l], &v[l]].into_iter().enumerate() {
                        let off = (2 * l + j) * per;
                        let vals: Vec<f16> = bytemuck::pod_collect_to_vec(&bytes[off..off + per]);
                        dst.slice_set(&Tensor::from_vec(vals, shape, &self.device)?, 1, start)?;
                    }
                }
            }
        }
        self.len = start + tokens;
        Ok(())
    }
}
