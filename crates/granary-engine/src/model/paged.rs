//! One layer's attention for every new row of a step, read where the keys
//! and values are in the device KV pool ([`super::pool`]): through each
//! sequence's block table, with nothing gathered, padded, masked or widened
//! to f32 first.
//!
//! A candle custom operation on the step's queries. On CUDA it is the
//! project's kernel (`kernels/paged_attention.cu`, compiled to PTX by the
//! build with the toolkit candle's kernels use); on the CPU (the tensor
//! path of [`super::LoadOptions::tensor_ops`], which the reference tests
//! run) the same computation in Rust. Both take scores in f32 from the f16
//! keys, apply the model's soft-capping, softmax over the keys row `r` may
//! attend (positions `first..=row_pos[r]`, `first` set by the sliding
//! window when the layer has one), and sum the f16 values in f32.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor};
use half::f16;

/// Inputs besides the queries (`[rows, heads, head_dim]` f32, already
/// scaled), all on the queries' device.
pub(super) struct PagedAttention<'a> {
    /// The layer's keys and values, `[blocks, kv_heads, block_tokens,
    /// head_dim]` f16.
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    /// Per sequence, its pool block ids in position order, `[seqs,
    /// max_blocks]` u32 (entries past a sequence's length are never read).
    pub tables: &'a Tensor,
    /// Per row, its sequence (a row of `tables`), `[rows]` u32.
    pub row_seq: &'a Tensor,
    /// Per row, its position, `[rows]` u32: it attends keys up to and
    /// including this one, which must already be in the pool.
    pub row_pos: &'a Tensor,
    /// The layer's sliding window (keys `pos - window + 1..=pos`).
    pub window: Option<usize>,
    /// `cap * tanh(score / cap)` when set.
    pub softcap: Option<f32>,
}

/// The sizes every implementation works with, checked once.
#[derive(Clone, Copy)]
struct Dims {
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    blocks: usize,
    block_tokens: usize,
    seqs: usize,
    max_blocks: usize,
}

impl PagedAttention<'_> {
    fn dims(&self, q: &Layout) -> candle_core::Result<Dims> {
        let (rows, heads, head_dim) = q.shape().dims3()?;
        let (blocks, kv_heads, block_tokens, kd) = self.k.dims4()?;
        let (seqs, max_blocks) = self.tables.dims2()?;
        let ok = kd == head_dim
            && self.v.dims() == self.k.dims()
            && kv_heads > 0
            && heads % kv_heads == 0
            && self.row_seq.dims1()? == rows
            && self.row_pos.dims1()? == rows;
        if !ok {
            candle_core::bail!(
                "paged attention: queries {:?}, keys {:?}, values {:?}, tables {:?}, rows {:?}/{:?} do not fit",
                q.dims(),
                self.k.dims(),
                self.v.dims(),
                self.tables.dims(),
                self.row_seq.dims(),
                self.row_pos.dims()
            );
        }
        Ok(Dims { rows, heads, kv_heads, head_dim, blocks, block_tokens, seqs, max_blocks })
    }
}

/// A contiguous tensor's elements on the CPU.
fn cpu<'s, T: candle_core::WithDType>(s: &'s CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'s [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle_core::bail!("paged attention: {what} must be contiguous"),
    }
}

/// A tensor's elements, when it is on the CPU and contiguous.
fn cpu_of<'s, T: candle_core::WithDType>(
    (s, l): &'s (candle_core::StorageRef<'_>, &Layout),
    what: &str,
) -> candle_core::Result<&'s [T]> {
    match &**s {
        Storage::Cpu(s) => cpu::<T>(s, l, what),
        _ => candle_core::bail!("paged attention: {what} is not on the CPU"),
    }
}

impl CustomOp1 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "granary-paged-attention"
    }

    fn cpu_fwd(&self, q: &CpuStorage, q_l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dm = self.dims(q_l)?;
        let q = cpu::<f32>(q, q_l, "the queries")?;
        let storage = [self.k, self.v, self.tables, self.row_seq, self.row_pos].map(Tensor::storage_and_layout);
        let [k, v, tables, row_seq, row_pos] = &storage;
        let pool = Pool {
            k: cpu_of(k, "the keys")?,
            v: cpu_of(v, "the values")?,
            tables: cpu_of(tables, "the block tables")?,
            dims: dm,
        };
        let out =
            attend_cpu(self, &pool, q, cpu_of(row_seq, "the row sequences")?, cpu_of(row_pos, "the row positions")?)?;
        Ok((CpuStorage::F32(out), Shape::from((dm.rows, dm.heads, dm.head_dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, self.dims(q_l)?, q, q_l)
    }
}

struct Pool<'a> {
    k: &'a [f16],
    v: &'a [f16],
    tables: &'a [u32],
    dims: Dims,
}

/// The first key a row at `pos` attends.
fn first_key(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) if w > 0 => (pos + 1).saturating_sub(w),
        _ => 0,
    }
}

fn attend_cpu(
    op: &PagedAttention<'_>,
    pool: &Pool<'_>,
    q: &[f32],
    row_seq: &[u32],
    row_pos: &[u32],
) -> candle_core::Result<Vec<f32>> {
    let Dims { rows, heads, kv_heads, head_dim: d, blocks, block_tokens: bt, seqs, max_blocks } = pool.dims;
    let group = heads / kv_heads;
    let mut out = vec![0f32; rows * heads * d];
    let mut scores = Vec::new();
    let mut bases = Vec::new();
    for r in 0..rows {
        let (seq, pos) = (row_seq[r] as usize, row_pos[r] as usize);
        if seq >= seqs || pos >= max_blocks * bt {
            candle_core::bail!("paged attention: row {r} (sequence {seq}, position {pos}) is outside the block tables");
        }
        let table = &pool.tables[seq * max_blocks..(seq + 1) * max_blocks];
        let first = first_key(pos, op.window);
        // Each key's offset in the pool, without its KV head.
        bases.clear();
        for t in first..=pos {
            let block = table[t / bt] as usize;
            if block >= blocks {
                candle_core::bail!("paged attention: block {block} is outside the pool ({blocks} blocks)");
            }
            bases.push((block * kv_heads * bt + t % bt) * d);
        }
        for h in 0..heads {
            let head_off = (h / group) * bt * d;
            let qr = &q[(r * heads + h) * d..][..d];
            scores.clear();
            let mut top = f32::NEG_INFINITY;
            for &b in &bases {
                let k = &pool.k[b + head_off..][..d];
                let mut s: f32 = qr.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum();
                if let Some(c) = op.softcap.filter(|&c| c > 0.0) {
                    s = c * (s / c).tanh();
                }
                top = top.max(s);
                scores.push(s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - top).exp();
                sum += *s;
            }
            let o = &mut out[(r * heads + h) * d..][..d];
            for (&b, &e) in bases.iter().zip(&scores) {
                let w = e / sum;
                for (o, v) in o.iter_mut().zip(&pool.v[b + head_off..][..d]) {
                    *o += w * v.to_f32();
                }
            }
        }
    }
    Ok(out)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaStorage, WrapErr};
    use candle_core::{Layout, Shape, Storage, Tensor};
    use half::f16;

    use super::{Dims, PagedAttention};

    mod ptx {
        include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
    }

    /// Warps per thread block and the largest head the kernel holds
    /// (`WARPS`, `LANES * PER_LANE` in the kernel).
    const WARPS: u32 = 8;
    const MAX_HEAD_DIM: usize = 256;

    fn view<'s, T: candle_core::cuda_backend::CudaDType>(
        s: &'s CudaStorage,
        l: &Layout,
        what: &str,
    ) -> candle_core::Result<CudaView<'s, T>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
            None => candle_core::bail!("paged attention: {what} must be contiguous"),
        }
    }

    fn storage<'t>(t: &'t Tensor, what: &str) -> candle_core::Result<(candle_core::StorageRef<'t>, &'t Layout)> {
        let (s, l) = t.storage_and_layout();
        if !matches!(&*s, Storage::Cuda(_)) {
            candle_core::bail!("paged attention: {what} is not on the GPU");
        }
        Ok((s, l))
    }

    fn cuda(s: &Storage) -> &CudaStorage {
        match s {
            Storage::Cuda(s) => s,
            _ => unreachable!("checked by storage()"),
        }
    }

    pub(super) fn forward(
        op: &PagedAttention<'_>,
        dm: Dims,
        q: &CudaStorage,
        q_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        if dm.head_dim > MAX_HEAD_DIM {
            candle_core::bail!("paged attention: head_dim {} is over the kernel's {MAX_HEAD_DIM}", dm.head_dim);
        }
        let dev = q.device().clone();
        let qv = view::<f32>(q, q_l, "the queries")?;
        let (k_s, k_l) = storage(op.k, "the keys")?;
        let (v_s, v_l) = storage(op.v, "the values")?;
        let (t_s, t_l) = storage(op.tables, "the block tables")?;
        let (s_s, s_l) = storage(op.row_seq, "the row sequences")?;
        let (p_s, p_l) = storage(op.row_pos, "the row positions")?;
        let k = view::<f16>(cuda(&k_s), k_l, "the keys")?;
        let v = view::<f16>(cuda(&v_s), v_l, "the values")?;
        let tables = view::<u32>(cuda(&t_s), t_l, "the block tables")?;
        let row_seq = view::<u32>(cuda(&s_s), s_l, "the row sequences")?;
        let row_pos = view::<u32>(cuda(&p_s), p_l, "the row positions")?;
        let n = dm.rows * dm.heads * dm.head_dim;
        let out = dev.alloc_zeros::<f32>(n)?;
        if dm.rows > 0 {
            let func = dev.get_or_load_custom_func(
                "granary_paged_attention",
                "granary_paged_attention",
                ptx::PAGED_ATTENTION,
            )?;
            let mut b = func.builder();
            b.arg(&out);
            b.arg(&qv);
            b.arg(&k);
            b.arg(&v);
            b.arg(&tables);
            b.arg(&row_seq);
            b.arg(&row_pos);
            let ints = [dm.heads, dm.kv_heads, dm.head_dim, dm.block_tokens, dm.max_blocks, op.window.unwrap_or(0)]
                .map(|x| x as i32);
            for x in &ints {
                b.arg(x);
            }
            let softcap = op.softcap.filter(|&c| c > 0.0).unwrap_or(0.0);
            b.arg(&softcap);
            let cfg = LaunchConfig {
                grid_dim: (dm.rows as u32, dm.heads as u32, 1),
                block_dim: (WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments are the kernel's, in its order, and
            // every index it forms is inside the buffers: the engine builds
            // block tables from ids the pool handed out and positions below
            // what each sequence reserved (`device::Plan::new` checks both).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((dm.rows, dm.heads, dm.head_dim))))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::PagedAttention;

    /// The operation against attention written out with tensor operations
    /// over gathered, widened keys and an explicit mask, on a pool whose
    /// blocks are out of order and shared by two sequences of different
    /// lengths, with a sliding window, soft-capping and grouped heads.
    #[test]
    fn matches_masked_attention_over_gathered_blocks() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (blocks, kvh, bt, d, heads) = (7usize, 2usize, 4usize, 8usize, 4usize);
        let n = blocks * kvh * bt * d;
        let vals = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2654435761u32).wrapping_add(seed) >> 7) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        };
        let k = Tensor::from_vec(vals(1), (blocks, kvh, bt, d), &dev)?.to_dtype(DType::F16)?;
        let v = Tensor::from_vec(vals(2), (blocks, kvh, bt, d), &dev)?.to_dtype(DType::F16)?;
        // Sequence 0: blocks 5, 2, 6 (11 positions used); sequence 1: 3, 1.
        let tables = Tensor::from_vec(vec![5u32, 2, 6, 3, 1, 0], (2, 3), &dev)?;
        let rows: Vec<(u32, u32)> = vec![(0, 10), (1, 0), (0, 3), (1, 7), (0, 9)];
        let row_seq = Tensor::from_vec(rows.iter().map(|r| r.0).collect(), rows.len(), &dev)?;
        let row_pos = Tensor::from_vec(rows.iter().map(|r| r.1).collect(), rows.len(), &dev)?;
        let qv: Vec<f32> = (0..rows.len() * heads * d).map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0).collect();
        let q = Tensor::from_vec(qv, (rows.len(), heads, d), &dev)?;
        for (window, softcap) in [(None, None), (Some(3), None), (None, Some(5.0f32)), (Some(6), Some(2.0))] {
            let op =
                PagedAttention { k: &k, v: &v, tables: &tables, row_seq: &row_seq, row_pos: &row_pos, window, softcap };
            let got = q.apply_op1_no_bwd(&op)?.to_vec3::<f32>()?;
            let table = tables.to_vec2::<u32>()?;
            for (r, &(seq, pos)) in rows.iter().enumerate() {
                // Keys 0..=pos of the sequence, gathered and widened.
                let ids = Tensor::from_vec(table[seq as usize].clone(), 3, &dev)?;
                let kg = k.index_select(&ids, 0)?.to_dtype(DType::F32)?; // [3, kvh, bt, d]
                let vg = v.index_select(&ids, 0)?.to_dtype(DType::F32)?;
                for (h, got) in got[r].iter().enumerate() {
                    let kh = kg.narrow(1, h / (heads / kvh), 1)?.reshape((3 * bt, d))?;
                    let vh = vg.narrow(1, h / (heads / kvh), 1)?.reshape((3 * bt, d))?;
                    let qr = q.get(r)?.get(h)?.reshape((1, d))?;
                    let mut s = qr.matmul(&kh.t()?)?;
                    if let Some(c) = softcap {
                        s = ((s / c as f64)?.tanh()? * c as f64)?;
                    }
                    let first = window.map_or(0, |w| (pos as usize + 1).saturating_sub(w));
                    let mask: Vec<f32> = (0..3 * bt)
                        .map(|j| if j >= first && j <= pos as usize { 0.0 } else { f32::NEG_INFINITY })
                        .collect();
                    let s = s.broadcast_add(&Tensor::from_vec(mask, (1, 3 * bt), &dev)?)?;
                    let want = candle_nn::ops::softmax_last_dim(&s)?.matmul(&vh)?.flatten_all()?.to_vec1::<f32>()?;
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "row {r} head {h} window {window:?} softcap {softcap:?}: {a} vs {b}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_row_outside_its_table_is_an_error() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let k = Tensor::zeros((2, 1, 4, 8), DType::F16, &dev)?;
        let tables = Tensor::from_vec(vec![1u32], (1, 1), &dev)?;
        let row_seq = Tensor::from_vec(vec![0u32], 1, &dev)?;
        let row_pos = Tensor::from_vec(vec![4u32], 1, &dev)?;
        let op = PagedAttention {
            k: &k,
            v: &k,
            tables: &tables,
            row_seq: &row_seq,
            row_pos: &row_pos,
            window: None,
            softcap: None,
        };
        let err = Tensor::zeros((1, 2, 8), DType::F32, &dev)?.apply_op1_no_bwd(&op).unwrap_err();
        assert!(err.to_string().contains("outside the block tables"), "{err}");
        Ok(())
    }
}
