//! The engine-owned KV cache of one sequence, in blocks of `block_tokens`
//! tokens laid out exactly as the warehouse stores them: per layer, K then
//! V, each `[kv_heads, block_tokens, head_dim]` f16 little-endian.
//!
//! On the CPU a block is either owned (being written) or shared: a payload
//! the engine's block cache or the warehouse also holds, read in place by
//! the attention kernel. A prefix loaded from the warehouse or from engine
//! memory is therefore never copied into the sequence, and a full block is
//! handed to the cache and the warehouse without a copy either. Writing
//! into a shared block (a fully cached prompt recomputing its last token)
//! copies that one block first. On an accelerator the sequence holds ids
//! of blocks in the model's device pool ([`KvPool`]); a block taken in
//! from the warehouse waits in host memory and is copied to its pool
//! block layer by layer, as the next forward step reaches each layer, so
//! the first layers compute while the rest are still on their way.

use std::sync::Arc;

use anyhow::{bail, ensure, Result};
use bytes::Bytes;
use half::f16;

use super::pool::KvPool;
use super::simd;
use super::ModelConfig;

enum HostBlock {
    Owned(Vec<f16>),
    /// A block payload (2-byte aligned), shared with whoever else holds it.
    Shared(Bytes),
}

impl HostBlock {
    fn elems(&self) -> &[f16] {
        match self {
            HostBlock::Owned(v) => v,
            // Alignment and length were checked when the block was taken in.
            HostBlock::Shared(b) => bytemuck::cast_slice(b),
        }
    }
}

/// Lets a `Vec<f16>` back a `Bytes` without a copy.
struct F16Bytes(Vec<f16>);

impl AsRef<[u8]> for F16Bytes {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

enum Storage {
    Host(Vec<HostBlock>),
    Pool {
        pool: Arc<KvPool>,
        /// The pool block of each of the sequence's blocks.
        ids: Vec<u32>,
        /// Blocks taken in and not yet on the device: (block index,
        /// payload).
        pending: Vec<(usize, Bytes)>,
    },
}

/// KV of one sequence.
pub struct KvCache {
    storage: Storage,
    len: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_tokens: usize,
    max_len: usize,
}

impl KvCache {
    /// Blocks in host memory, read by the engine's own kernels (CPU).
    pub fn host(cfg: &ModelConfig, block_tokens: usize, max_len: usize) -> Self {
        KvCache {
            storage: Storage::Host(Vec::new()),
            len: 0,
            layers: cfg.layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            block_tokens: block_tokens.max(1),
            max_len,
        }
    }

    /// Blocks of `pool`, read by tensor operations.
    pub fn pooled(pool: Arc<KvPool>, max_len: usize) -> Self {
        KvCache {
            len: 0,
            layers: pool.layers,
            kv_heads: pool.kv_heads,
            head_dim: pool.head_dim,
            block_tokens: pool.block_tokens,
            max_len,
            storage: Storage::Pool { pool, ids: Vec::new(), pending: Vec::new() },
        }
    }

    /// The pool, the pool block of each of the sequence's blocks, and the
    /// blocks still waiting to be copied in (`None` for host caches).
    #[allow(clippy::type_complexity)]
    pub(crate) fn pool_blocks(&self) -> Option<(&Arc<KvPool>, &[u32], &[(usize, Bytes)])> {
        match &self.storage {
            Storage::Pool { pool, ids, pending } => Some((pool, ids, pending)),
            Storage::Host(_) => None,
        }
    }

    /// Called once a forward step has copied every pending block in.
    pub(crate) fn pending_done(&mut self) {
        if let Storage::Pool { pending, .. } = &mut self.storage {
            pending.clear();
        }
    }

    /// Tokens whose K and V are held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Elements of one block.
    fn block_elems(&self) -> usize {
        2 * self.layers * self.kv_heads * self.block_tokens * self.head_dim
    }

    /// Bytes allocated for this sequence (shared blocks included).
    pub fn allocated_bytes(&self) -> usize {
        match &self.storage {
            Storage::Host(blocks) => blocks.len() * self.block_bytes(self.block_tokens),
            Storage::Pool { ids, .. } => ids.len() * self.block_bytes(self.block_tokens),
        }
    }

    /// Makes room for `new_len` tokens.
    pub fn reserve(&mut self, layers: usize, new_len: usize) -> Result<()> {
        ensure!(layers == self.layers, "KV cache of {} layers asked for {layers}", self.layers);
        ensure!(new_len <= self.max_len, "sequence of {new_len} tokens exceeds the context of {}", self.max_len);
        let want = new_len.div_ceil(self.block_tokens);
        let elems = self.block_elems();
        match &mut self.storage {
            Storage::Host(blocks) => {
                while blocks.len() < want {
                    blocks.push(HostBlock::Owned(vec![f16::ZERO; elems]));
                }
            }
            Storage::Pool { pool, ids, .. } => {
                if ids.len() < want {
                    ids.extend(pool.alloc(want - ids.len())?);
                }
            }
        }
        Ok(())
    }

    /// Positions with room reserved.
    pub(crate) fn capacity(&self) -> usize {
        match &self.storage {
            Storage::Host(blocks) => blocks.len() * self.block_tokens,
            Storage::Pool { ids, .. } => ids.len() * self.block_tokens,
        }
    }

    /// Layer `layer` of every host block: K then V, each `[kv_heads,
    /// block_tokens, head_dim]` (`None` for device caches).
    pub(crate) fn host_layer(&self, layer: usize) -> Option<Vec<&[f16]>> {
        let per_layer = 2 * self.kv_heads * self.block_tokens * self.head_dim;
        match &self.storage {
            Storage::Host(blocks) => {
                Some(blocks.iter().map(|b| &b.elems()[layer * per_layer..(layer + 1) * per_layer]).collect())
            }
            Storage::Pool { .. } => None,
        }
    }

    /// Stores K and V of `layer` for consecutive positions from `offset`;
    /// each row of `rows` is `[K of kv_heads heads | V of kv_heads heads]`
    /// f32. Room must have been reserved.
    pub(crate) fn write_host_rows(&mut self, layer: usize, offset: usize, rows: &[f32]) -> Result<()> {
        let (kvh, d, bt) = (self.kv_heads, self.head_dim, self.block_tokens);
        let width = 2 * kvh * d;
        let n = rows.len() / width;
        ensure!(offset + n <= self.capacity(), "KV write past the reserved capacity");
        let Storage::Host(blocks) = &mut self.storage else { bail!("KV cache is not in host memory") };
        let lv = simd::level();
        let per_layer = 2 * kvh * bt * d;
        for (i, row) in rows.chunks_exact(width).enumerate() {
            let pos = offset + i;
            let block = &mut blocks[pos / bt];
            if let HostBlock::Shared(b) = block {
                // Copy on write: someone else holds these bytes.
                *block = HostBlock::Owned(bytemuck::cast_slice::<u8, f16>(b).to_vec());
            }
            let HostBlock::Owned(data) = block else { unreachable!("made owned above") };
            let layer_data = &mut data[layer * per_layer..(layer + 1) * per_layer];
            let t = pos % bt;
            for h in 0..kvh {
                let k_at = (h * bt + t) * d;
                let v_at = ((kvh + h) * bt + t) * d;
                simd::f32_to_f16(lv, &row[h * d..(h + 1) * d], &mut layer_data[k_at..k_at + d]);
                simd::f32_to_f16(lv, &row[(kvh + h) * d..(kvh + h + 1) * d], &mut layer_data[v_at..v_at + d]);
            }
        }
        Ok(())
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity());
        self.len = len;
    }

    /// Forgets everything after `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The payload of block `index` (`tokens` must be the cache's block
    /// size): for each layer, K then V, each `[kv_heads, tokens, head_dim]`
    /// f16 little-endian. On the CPU the block becomes shared with the
    /// returned bytes (no copy).
    pub fn export_block(&mut self, index: usize, tokens: usize) -> Result<Bytes> {
        ensure!(index * tokens + tokens <= self.len, "block {index} is not complete in this sequence");
        self.export(index, tokens)
    }

    /// The payload of block `index` when it is the sequence's last and may
    /// be partly filled (positions past the sequence's length hold
    /// whatever they held); importing it and truncating to the length
    /// restores the sequence exactly. Used to set a preempted sequence
    /// aside whole.
    pub fn export_last_block(&mut self, index: usize, tokens: usize) -> Result<Bytes> {
        ensure!(
            index * tokens < self.len && self.len <= (index + 1) * tokens,
            "block {index} is not the last of a sequence of {} tokens",
            self.len
        );
        self.export(index, tokens)
    }

    fn export(&mut self, index: usize, tokens: usize) -> Result<Bytes> {
        ensure!(tokens == self.block_tokens, "blocks of this cache hold {} tokens, not {tokens}", self.block_tokens);
        match &mut self.storage {
            Storage::Host(blocks) => {
                let block = &mut blocks[index];
                let bytes = match std::mem::replace(block, HostBlock::Owned(Vec::new())) {
                    HostBlock::Owned(v) => Bytes::from_owner(F16Bytes(v)),
                    HostBlock::Shared(b) => b,
                };
                *block = HostBlock::Shared(bytes.clone());
                Ok(bytes)
            }
            Storage::Pool { pool, ids, pending } => {
                // Not on the device yet: the payload as it came.
                if let Some((_, b)) = pending.iter().find(|(i, _)| *i == index) {
                    return Ok(b.clone());
                }
                Ok(Bytes::from(pool.get_block(ids[index])?))
            }
        }
    }

    /// Size of one exported block of `tokens` tokens.
    pub fn block_bytes(&self, tokens: usize) -> usize {
        2 * self.layers * self.kv_heads * tokens * self.head_dim * 2
    }

    /// Takes in block `index` (bytes made by [`KvCache::export_block`]);
    /// the block must extend the sequence (`index * tokens == len`). On the
    /// CPU the bytes are used in place.
    pub fn import_block(&mut self, layers: usize, index: usize, tokens: usize, bytes: Bytes) -> Result<()> {
        ensure!(layers == self.layers, "KV cache of {} layers given a block of {layers}", self.layers);
        ensure!(tokens == self.block_tokens, "blocks of this cache hold {} tokens, not {tokens}", self.block_tokens);
        let start = index * tokens;
        ensure!(start == self.len, "block {index} does not continue a sequence of {} tokens", self.len);
        let want = self.block_bytes(tokens);
        if bytes.len() != want {
            bail!("block of {} bytes, expected {want}", bytes.len());
        }
        ensure!(start + tokens <= self.max_len, "block {index} runs past the context of {}", self.max_len);
        match &mut self.storage {
            Storage::Host(blocks) => {
                let block = if (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f16>()) {
                    HostBlock::Shared(bytes)
                } else {
                    HostBlock::Owned(bytemuck::pod_collect_to_vec(&bytes))
                };
                if blocks.len() > index {
                    blocks[index] = block;
                } else {
                    blocks.push(block);
                }
            }
            Storage::Pool { .. } => {
                self.reserve(layers, start + tokens)?;
                let Storage::Pool { pending, .. } = &mut self.storage else { unreachable!() };
                pending.retain(|(i, _)| *i != index);
                pending.push((index, bytes));
            }
        }
        self.len = start + tokens;
        Ok(())
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        if let Storage::Pool { pool, ids, .. } = &self.storage {
            pool.release(ids);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    pub(crate) fn cfg() -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 16,
            hidden_size: 8,
            intermediate_size: 8,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            context_len: 64,
            qkv_bias: false,
            rope_style: crate::model::RopeStyle::Interleaved,
            rope_scaling: crate::model::RopeScaling::None,
            attn_scale: 0.5,
            sliding_window: None,
            arch: crate::model::ARCHITECTURES[0],
        }
    }

    fn row(pos: usize, layer: usize) -> Vec<f32> {
        (0..8).map(|i| (pos * 100 + layer * 10 + i) as f32).collect()
    }

    fn pooled() -> KvCache {
        KvCache::pooled(Arc::new(KvPool::new(&cfg(), &Device::Cpu, 4)), 64)
    }

    /// Writes `row`s `from..to` into a pooled cache as a forward step does.
    fn fill_pooled(kv: &mut KvCache, from: usize, to: usize) {
        kv.reserve(2, to).unwrap();
        let (pool, ids, _) = kv.pool_blocks().unwrap();
        let (pool, ids) = (pool.clone(), ids.to_vec());
        let n = to - from;
        // One KV head: row (block * 1 + 0) * 4 + slot of the pool's [.., 4] view.
        let at: Vec<u32> = (from..to).map(|p| (ids[p / 4] as usize * 4 + p % 4) as u32).collect();
        let at =
            Tensor::from_vec(at, (n, 1), &Device::Cpu).unwrap().broadcast_as((n, 4)).unwrap().contiguous().unwrap();
        let t = pool.read();
        for l in 0..2 {
            // A row is [K of the one KV head | V of it], 4 dims each.
            let part = |r: std::ops::Range<usize>| -> Tensor {
                let vals: Vec<f32> = (from..to).flat_map(|p| row(p, l)[r.clone()].to_vec()).collect();
                Tensor::from_vec(vals, (n, 1, 4), &Device::Cpu).unwrap()
            };
            crate::model::device::write_rows(&t, l, &at, &part(0..4), &part(4..8)).unwrap();
        }
        drop(t);
        kv.set_len(to);
    }

    fn fill(kv: &mut KvCache, from: usize, to: usize) {
        kv.reserve(2, to).unwrap();
        for l in 0..2 {
            let rows: Vec<f32> = (from..to).flat_map(|p| row(p, l)).collect();
            kv.write_host_rows(l, from, &rows).unwrap();
        }
        kv.set_len(to);
    }

    #[test]
    fn exported_blocks_are_shared_and_import_without_a_copy() {
        let mut kv = KvCache::host(&cfg(), 4, 64);
        fill(&mut kv, 0, 10);
        let b0 = kv.export_block(0, 4).unwrap();
        let b1 = kv.export_block(1, 4).unwrap();
        assert!(kv.export_block(2, 4).is_err(), "block 2 is not complete");
        assert!(kv.export_block(0, 8).is_err(), "wrong block size");
        // Layout: layer 0 K (head 0, tokens 0..4, 4 dims) starts the block.
        let vals: &[f16] = bytemuck::cast_slice(&b0);
        assert_eq!(vals.len(), 2 * 2 * 4 * 4);
        assert_eq!(vals[4 * 3 + 2].to_f32(), 302.0, "K of position 3, dim 2");
        assert_eq!(vals[16 + 4].to_f32(), 104.0, "V of position 1, dim 0 (row value 4)");
        // Exporting again gives the same memory.
        assert_eq!(kv.export_block(0, 4).unwrap().as_ptr(), b0.as_ptr());

        let mut other = KvCache::host(&cfg(), 4, 64);
        other.import_block(2, 0, 4, b0.clone()).unwrap();
        other.import_block(2, 1, 4, b1.clone()).unwrap();
        assert!(other.import_block(2, 3, 4, b1.clone()).is_err(), "a gap");
        assert_eq!(other.len(), 8);
        assert_eq!(other.host_layer(0).unwrap()[0].as_ptr() as *const u8, b0.as_ptr(), "used in place");
        // Writing into a shared block copies it; the exported bytes stay.
        other.truncate(7);
        let before = b1.to_vec();
        other.write_host_rows(1, 7, &[-1.0; 8]).unwrap();
        assert_eq!(b1.to_vec(), before, "the shared payload is untouched");
        let l1 = other.host_layer(1).unwrap();
        assert_eq!(l1[1][3 * 4].to_f32(), -1.0, "K of position 7 in the copy");
        assert_eq!(l1[0].as_ptr() as *const u8, b0.as_ptr().wrapping_add(2 * 16 * 2), "block 0 still shared");
    }

    /// A cache of tensors (the accelerator layout, here on the CPU) exports
    /// the same bytes as a host cache holding the same K and V, and takes
    /// host blocks in: engines on either path share warehouse blocks.
    #[test]
    fn tensor_and_host_caches_share_one_block_layout() {
        let mut host = KvCache::host(&cfg(), 4, 64);
        fill(&mut host, 0, 8);
        let mut dev = pooled();
        assert!(dev.host_layer(0).is_none(), "tensor storage");
        fill_pooled(&mut dev, 0, 5);
        fill_pooled(&mut dev, 5, 8);
        for b in 0..2 {
            assert_eq!(dev.export_block(b, 4).unwrap(), host.export_block(b, 4).unwrap(), "block {b}");
        }
        // Taken in, a block waits in host memory, then goes to the device
        // layer by layer (as a forward step copies it).
        let pool = dev.pool_blocks().unwrap().0.clone();
        let mut back = KvCache::pooled(pool.clone(), 64);
        for b in 0..2 {
            back.import_block(2, b, 4, host.export_block(b, 4).unwrap()).unwrap();
        }
        assert_eq!(back.len(), 8);
        let (_, ids, pending) = back.pool_blocks().unwrap();
        assert_eq!(pending.len(), 2);
        let uploads: Vec<(u32, Bytes)> = pending.iter().map(|(i, b)| (ids[*i], b.clone())).collect();
        assert_eq!(back.export_block(1, 4).unwrap().as_ptr(), host.export_block(1, 4).unwrap().as_ptr(), "as it came");
        {
            let t = pool.read();
            let staged = pool.stage(&t, uploads).unwrap();
            for l in 0..2 {
                pool.layer_ready(&t, &staged, l).unwrap();
            }
        }
        back.pending_done();
        assert_eq!(pool.in_use(), 4);
        for b in 0..2 {
            assert_eq!(back.export_block(b, 4).unwrap(), host.export_block(b, 4).unwrap(), "block {b} from the device");
        }
        drop(back);
        assert_eq!(pool.in_use(), 2, "a dropped cache gives its blocks back");
    }

    #[test]
    fn a_misaligned_payload_is_copied_and_a_short_one_refused() {
        let mut kv = KvCache::host(&cfg(), 4, 64);
        fill(&mut kv, 0, 4);
        let b = kv.export_block(0, 4).unwrap();
        let mut buf = vec![0u8; b.len() + 1];
        buf[1..].copy_from_slice(&b);
        let odd = Bytes::from(buf).slice(1..);
        let mut other = KvCache::host(&cfg(), 4, 64);
        if (odd.as_ptr() as usize) % 2 == 1 {
            other.import_block(2, 0, 4, odd).unwrap();
            assert_eq!(other.export_block(0, 4).unwrap(), b);
        }
        let mut third = KvCache::host(&cfg(), 4, 64);
        assert!(third.import_block(2, 0, 4, b.slice(2..)).is_err());
    }

    /// A partly filled last block goes out and comes back: the sequence is
    /// whole again (both storages), and only the last block may be partial.
    #[test]
    fn a_partial_last_block_round_trips() {
        for host in [true, false] {
            let mut kv = if host { KvCache::host(&cfg(), 4, 64) } else { pooled() };
            if host {
                fill(&mut kv, 0, 6);
            } else {
                fill_pooled(&mut kv, 0, 6);
            }
            assert!(kv.export_last_block(0, 4).is_err(), "block 0 is full, not the last");
            assert!(kv.export_block(1, 4).is_err(), "block 1 is not complete");
            let b0 = kv.export_block(0, 4).unwrap();
            let b1 = kv.export_last_block(1, 4).unwrap();
            let mut back = KvCache::host(&cfg(), 4, 64);
            back.import_block(2, 0, 4, b0).unwrap();
            back.import_block(2, 1, 4, b1).unwrap();
            back.truncate(6);
            assert_eq!(back.len(), 6);
            let l1 = back.host_layer(1).unwrap();
            for p in 4..6 {
                let k: Vec<f32> = l1[1][(p - 4) * 4..(p - 3) * 4].iter().map(|x| x.to_f32()).collect();
                assert_eq!(k, row(p, 1)[..4], "K of position {p} (host storage: {host})");
            }
        }
    }
}
