//! The engine-owned KV cache of one sequence: per layer, K and V as
//! `[kv_heads, capacity, head_dim]` tensors in f16, grown a block at a time,
//! with whole blocks exported to and imported from the warehouse's byte
//! layout.

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;

use super::ModelConfig;

/// KV of one sequence.
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
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
        KvCache {
            k: Vec::new(),
            v: Vec::new(),
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

    /// Bytes allocated for this sequence.
    pub fn allocated_bytes(&self) -> usize {
        2 * self.k.len() * self.kv_heads * self.cap * self.head_dim * 2
    }

    /// Bytes of K and V per token of one layer's K (or V).
    fn layer_block_elems(&self, tokens: usize) -> usize {
        self.kv_heads * tokens * self.head_dim
    }

    /// Makes room for `new_len` tokens over `layers` layers.
    pub fn reserve(&mut self, layers: usize, new_len: usize) -> Result<()> {
        ensure!(new_len <= self.max_len, "sequence of {new_len} tokens exceeds the context of {}", self.max_len);
        if new_len <= self.cap && self.k.len() == layers {
            return Ok(());
        }
        let want = new_len.div_ceil(self.granule) * self.granule;
        let new_cap = want.max(self.cap.saturating_mul(2)).min(self.max_len.div_ceil(self.granule) * self.granule);
        let shape = (self.kv_heads, new_cap, self.head_dim);
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for l in 0..layers {
            let nk = Tensor::zeros(shape, DType::F16, &self.device)?;
            let nv = Tensor::zeros(shape, DType::F16, &self.device)?;
            if self.len > 0 && l < self.k.len() {
                nk.slice_set(&self.k[l].narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                nv.slice_set(&self.v[l].narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
            }
            k.push(nk);
            v.push(nv);
        }
        self.k = k;
        self.v = v;
        self.cap = new_cap;
        Ok(())
    }

    /// Stores K and V (`[kv_heads, n, head_dim]`, any float dtype) of `layer`
    /// at positions `offset..offset + n`. Capacity must have been reserved.
    pub(crate) fn write(&self, layer: usize, offset: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(1)?;
        ensure!(offset + n <= self.cap, "KV write past the reserved capacity");
        self.k[layer].slice_set(&k.to_dtype(DType::F16)?.contiguous()?, 1, offset)?;
        self.v[layer].slice_set(&v.to_dtype(DType::F16)?.contiguous()?, 1, offset)?;
        Ok(())
    }

    /// K and V of `layer` for positions `0..len` in `dtype`.
    pub(crate) fn read(&self, layer: usize, len: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
        let k = self.k[layer].narrow(1, 0, len)?.to_dtype(dtype)?;
        let v = self.v[layer].narrow(1, 0, len)?.to_dtype(dtype)?;
        Ok((k, v))
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
        let mut out = Vec::with_capacity(self.block_bytes(tokens));
        for l in 0..self.k.len() {
            for t in [&self.k[l], &self.v[l]] {
                let part = t.narrow(1, start, tokens)?.flatten_all()?.to_vec1::<f16>()?;
                out.extend_from_slice(bytemuck::cast_slice(&part));
            }
        }
        Ok(out)
    }

    /// Size of one exported block.
    pub fn block_bytes(&self, tokens: usize) -> usize {
        2 * self.k.len().max(1) * self.layer_block_elems(tokens) * 2
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
        let shape = (self.kv_heads, tokens, self.head_dim);
        for l in 0..layers {
            for (j, dst) in [&self.k[l], &self.v[l]].into_iter().enumerate() {
                let off = (2 * l + j) * per;
                let vals: Vec<f16> = bytemuck::pod_collect_to_vec(&bytes[off..off + per]);
                let src = Tensor::from_vec(vals, shape, &self.device)?;
                dst.slice_set(&src, 1, start)?;
            }
        }
        self.len = start + tokens;
        Ok(())
    }
}
