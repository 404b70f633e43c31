//! Int8 matrix multiplication with AVX-512 VNNI: the CPU engine's matmul for
//! every row count, decode and prefill alike.
//!
//! Weights are quantized like GGML's Q8_0 (blocks of 32 values along the
//! input dimension, one f32 scale per block, values in -127..=127) and laid
//! out in tiles of 16 output rows: for each block, 8 groups of 4 input
//! positions, each group holding 4 bytes for each of the 16 rows. One
//! `vpdpbusd` then multiplies 4 input positions into 16 output rows at once,
//! so an output tile is accumulated in one register and no horizontal sums
//! are needed. Weights are stored offset by +128 (the instruction takes
//! unsigned by signed bytes); the offset is taken back out with each
//! activation block's sum. Activations are quantized per row and block of
//! 32 the same way (what llama.cpp does for its quantized matmuls).
//!
//! Without AVX-512 VNNI the engine keeps candle's kernels instead
//! ([`Q8Matrix::supported`]).

use anyhow::{ensure, Result};

use super::blocks4::Block4;

/// Output rows per tile.
const TILE: usize = 16;
/// Input positions per quantization block.
const BLOCK: usize = super::blocks4::BLOCK;
/// Bytes of one (tile, block): 32 positions × 16 rows.
const TILE_BLOCK_BYTES: usize = BLOCK * TILE;

/// A weight matrix `[n, k]` (output, input) in int8 tiles.
pub(crate) struct Q8Matrix {
    n: usize,
    k: usize,
    /// `[n / 16][k / 32][8 groups][16 rows][4]`, value + 128.
    qs: Vec<u8>,
    /// `[n / 16][k / 32][16 rows]`.
    scales: Vec<f32>,
}

/// Activations `[m, k]` quantized per row and block.
pub(crate) struct Q8Rows {
    m: usize,
    k: usize,
    qs: Vec<i8>,
    scales: Vec<f32>,
    /// Sum of each block's quantized values, times 128 (the weights' offset).
    offsets: Vec<i32>,
}

/// A weight matrix `[n, k]` in 4-bit tiles, for few-row (decode) steps,
/// where a step is bound by reading the weights: half the bytes of
/// [`Q8Matrix`]. Blocks of 32 inputs per row hold `d · q + m` with `q` in
/// 0..=15 (GGML's Q4_1 form: weights stored that way come back exactly).
/// Layout as [`Q8Matrix`], with two 4-position groups per byte: for each
/// pair of groups, 64 bytes of 16 rows × 4 positions, the first group in
/// the low nibbles. Unsigned nibbles times signed int8 activations is what
/// `vpdpbusd` multiplies, so no offset is needed; `m` is added back with
/// each activation block's sum.
pub(crate) struct Q4Matrix {
    n: usize,
    k: usize,
    /// `[n / 16][k / 32][4 pairs][16 rows][4]`.
    qs: Vec<u8>,
    /// `[n / 16][k / 32][16 rows]` scales `d`, then the same for `m`.
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Q4Matrix {
    #[cfg(test)]
    /// Quantizes a row-major f32 matrix (see [`Q8Matrix::fits`]): each block
    /// of 32 as `d · q + m` from its lowest and highest value (GGML's Q4_1).
    pub(crate) fn quantize(w: &[f32], n: usize, k: usize) -> Result<Self> {
        ensure!(w.len() == n * k, "matrix data of {} values, expected {n}x{k}", w.len());
        let blocks: Vec<Block4> = w
            .chunks_exact(BLOCK)
            .map(|vals| {
                let lo = vals.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = vals.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (hi - lo) / 15.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                let mut q = [0u8; BLOCK];
                for (q, v) in q.iter_mut().zip(vals) {
                    *q = ((v - lo) * inv).round().clamp(0.0, 15.0) as u8;
                }
                Block4 { d, m: lo, q }
            })
            .collect();
        Self::from_blocks(&blocks, n, k)
    }

    /// The matrix from 4-bit blocks in row-major order (`k / 32` per row),
    /// as [`super::blocks4::blocks`] reads them from a GGUF: the weights
    /// are held exactly as stored.
    pub(crate) fn from_blocks(blocks: &[Block4], n: usize, k: usize) -> Result<Self> {
        ensure!(Q8Matrix::fits(n, k), "a {n}x{k} matrix does not fit 16-row 4-bit tiles");
        ensure!(blocks.len() * BLOCK == n * k, "{} blocks of 32 for a {n}x{k} matrix", blocks.len());
        let kb = k / BLOCK;
        let tiles = n / TILE;
        let mut qs = vec![0u8; tiles * kb * TILE_BLOCK_BYTES / 2];
        let mut ds = vec![0f32; tiles * kb * TILE];
        let mut ms = vec![0f32; tiles * kb * TILE];
        for row in 0..n {
            let (t, r) = (row / TILE, row % TILE);
            for b in 0..kb {
                let block = &blocks[row * kb + b];
                ds[(t * kb + b) * TILE + r] = block.d;
                ms[(t * kb + b) * TILE + r] = block.m;
                let base = (t * kb + b) * TILE_BLOCK_BYTES / 2;
                for (i, &q) in block.q.iter().enumerate() {
                    debug_assert!(q < 16);
                    let (g, j) = (i / 4, i % 4);
                    let at = base + (g / 2) * TILE * 4 + r * 4 + j;
                    qs[at] |= if g % 2 == 0 { q } else { q << 4 };
                }
            }
        }
        Ok(Q4Matrix { n, k, qs, d: ds, m: ms })
    }

    /// The matrix from the buffers [`Q4Matrix::parts`] gave (a checkpoint).
    pub(crate) fn from_parts(n: usize, k: usize, qs: Vec<u8>, d: Vec<f32>, m: Vec<f32>) -> Result<Self> {
        ensure!(Q8Matrix::fits(n, k), "a {n}x{k} matrix does not fit 16-row 4-bit tiles");
        ensure!(qs.len() == n * k / 2, "4-bit tiles of {} bytes for a {n}x{k} matrix", qs.len());
        ensure!(d.len() == n * k / BLOCK && m.len() == d.len(), "4-bit tile scales of the wrong length");
        Ok(Q4Matrix { n, k, qs, d, m })
    }

    /// Shape and buffers: `(n, k, qs, d, m)`.
    pub(crate) fn parts(&self) -> (usize, usize, &[u8], &[f32], &[f32]) {
        (self.n, self.k, &self.qs, &self.d, &self.m)
    }

    pub(crate) fn out_features(&self) -> usize {
        self.n
    }

    pub(crate) fn in_features(&self) -> usize {
        self.k
    }

    /// `y = x wᵀ` for `x` quantized by [`Q8Rows::quantize`]; `y` is `[m, n]`.
    pub(crate) fn matmul(&self, x: &Q8Rows, y: &mut [f32]) {
        assert_eq!(x.k, self.k, "activation width {} vs weight input {}", x.k, self.k);
        assert_eq!(y.len(), x.m * self.n);
        assert!(Q8Matrix::supported(), "4-bit matmul without AVX-512 VNNI");
        for_each_tile(self.n / TILE, x.m, y, |t, out| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `Q8Matrix::matmul`.
            unsafe {
                x86::tile4(self, x, t, out)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (t, out);
        });
    }
}

impl Q8Matrix {
    /// Whether this CPU runs the kernel.
    pub(crate) fn supported() -> bool {
        super::kernels::kernel_path() == super::kernels::KernelPath::Avx512Vnni
    }

    /// Whether a `[n, k]` matrix fits the tile layout.
    pub(crate) fn fits(n: usize, k: usize) -> bool {
        n > 0 && k > 0 && n.is_multiple_of(TILE) && k.is_multiple_of(BLOCK)
    }

    /// Quantizes a row-major f32 matrix of `n` rows and `k` columns.
    pub(crate) fn quantize(w: &[f32], n: usize, k: usize) -> Result<Self> {
        ensure!(Self::fits(n, k), "a {n}x{k} matrix does not fit 16-row int8 tiles");
        ensure!(w.len() == n * k, "matrix data of {} values, expected {n}x{k}", w.len());
        let kb = k / BLOCK;
        let tiles = n / TILE;
        let mut qs = vec![0u8; tiles * kb * TILE_BLOCK_BYTES];
        let mut scales = vec![0f32; tiles * kb * TILE];
        for row in 0..n {
            let (t, r) = (row / TILE, row % TILE);
            for b in 0..kb {
                let vals = &w[row * k + b * BLOCK..][..BLOCK];
                let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                scales[(t * kb + b) * TILE + r] = d;
                let base = (t * kb + b) * TILE_BLOCK_BYTES;
                for (i, v) in vals.iter().enumerate() {
                    let q = (v * inv).round().clamp(-127.0, 127.0) as i32;
                    let (g, j) = (i / 4, i % 4);
                    qs[base + g * TILE * 4 + r * 4 + j] = (q + 128) as u8;
                }
            }
        }
        Ok(Q8Matrix { n, k, qs, scales })
    }

    /// The matrix from the buffers [`Q8Matrix::parts`] gave (a checkpoint).
    pub(crate) fn from_parts(n: usize, k: usize, qs: Vec<u8>, scales: Vec<f32>) -> Result<Self> {
        ensure!(Self::fits(n, k), "a {n}x{k} matrix does not fit 16-row int8 tiles");
        ensure!(qs.len() == n * k, "int8 tiles of {} bytes for a {n}x{k} matrix", qs.len());
        ensure!(scales.len() == n * k / BLOCK, "int8 tile scales of the wrong length");
        Ok(Q8Matrix { n, k, qs, scales })
    }

    /// Shape and buffers: `(n, k, qs, scales)`.
    pub(crate) fn parts(&self) -> (usize, usize, &[u8], &[f32]) {
        (self.n, self.k, &self.qs, &self.scales)
    }

    pub(crate) fn out_features(&self) -> usize {
        self.n
    }

    pub(crate) fn in_features(&self) -> usize {
        self.k
    }

    /// `y = x wᵀ` for `x` quantized by [`Q8Rows::quantize`]; `y` is `[m, n]`.
    pub(crate) fn matmul(&self, x: &Q8Rows, y: &mut [f32]) {
        assert_eq!(x.k, self.k, "activation width {} vs weight input {}", x.k, self.k);
        assert_eq!(y.len(), x.m * self.n);
        assert!(Self::supported(), "int8 matmul without AVX-512 VNNI");
        for_each_tile(self.n / TILE, x.m, y, |t, out| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `supported()` checked the CPU; each tile writes only
            // its own 16 columns of every output row.
            unsafe {
                x86::tile(self, x, t, out)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (t, out);
        });
    }
}

/// Runs `tile(t, out)` for every output tile of an `[m, tiles * 16]`
/// result `y` on the thread pool: several tiles per work unit for few rows
/// (decode), one otherwise.
fn for_each_tile(tiles: usize, m: usize, y: &mut [f32], tile: impl Fn(usize, &OutPtr) + Sync) {
    let per_unit = if m < 8 { 8 } else { 1 };
    let units = tiles.div_ceil(per_unit);
    let out = OutPtr(y.as_mut_ptr());
    let run = |u: usize| (u * per_unit..((u + 1) * per_unit).min(tiles)).for_each(|t| tile(t, &out));
    if units == 1 {
        run(0);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(units, |r| r.for_each(run));
    }
}

struct OutPtr(*mut f32);
// SAFETY: work units write disjoint columns of the output.
unsafe impl Sync for OutPtr {}

impl Q8Rows {
    /// Quantizes `m` rows of `k` values.
    pub(crate) fn quantize(x: &[f32], m: usize, k: usize) -> Self {
        assert_eq!(x.len(), m * k);
        assert!(k.is_multiple_of(BLOCK));
        let kb = k / BLOCK;
        let mut qs = vec![0i8; m * k];
        let mut scales = vec![0f32; m * kb];
        let mut offsets = vec![0i32; m * kb];
        for (bi, (vals, q)) in x.chunks_exact(BLOCK).zip(qs.chunks_exact_mut(BLOCK)).enumerate() {
            let amax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (o, v) in q.iter_mut().zip(vals) {
                let v = (v * inv).round().clamp(-127.0, 127.0) as i8;
                *o = v;
                sum += v as i32;
            }
            scales[bi] = d;
            offsets[bi] = 128 * sum;
        }
        Q8Rows { m, k, qs, scales, offsets }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{OutPtr, Q4Matrix, Q8Matrix, Q8Rows, BLOCK, TILE, TILE_BLOCK_BYTES};

    /// Rows of activations sharing each load of a weight tile.
    const ROWS: usize = 4;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile(w: &Q8Matrix, x: &Q8Rows, t: usize, out: &OutPtr) {
        let kb = w.k / BLOCK;
        let wq = w.qs.as_ptr().add(t * kb * TILE_BLOCK_BYTES);
        let ws = w.scales.as_ptr().add(t * kb * TILE);
        let mut r0 = 0;
        while r0 < x.m {
            let rows = ROWS.min(x.m - r0);
            let mut acc = [_mm512_setzero_ps(); ROWS];
            for b in 0..kb {
                let wb = wq.add(b * TILE_BLOCK_BYTES);
                let scale_w = _mm512_loadu_ps(ws.add(b * TILE));
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    let row = r0 + r;
                    let xq = x.qs.as_ptr().add(row * x.k + b * BLOCK) as *const i32;
                    let mut s = _mm512_setzero_si512();
                    for g in 0..BLOCK / 4 {
                        let wv = _mm512_loadu_si512(wb.add(g * TILE * 4) as *const _);
                        s = _mm512_dpbusd_epi32(s, wv, _mm512_set1_epi32(xq.add(g).read_unaligned()));
                    }
                    let s = _mm512_sub_epi32(s, _mm512_set1_epi32(x.offsets[row * kb + b]));
                    let scale = _mm512_mul_ps(scale_w, _mm512_set1_ps(x.scales[row * kb + b]));
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, *a);
                }
            }
            for (r, a) in acc.iter().enumerate().take(rows) {
                _mm512_storeu_ps(out.0.add((r0 + r) * w.n + t * TILE), *a);
            }
            r0 += rows;
        }
    }

    /// [`tile`] for 4-bit weights: two nibble groups per load.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile4(w: &Q4Matrix, x: &Q8Rows, t: usize, out: &OutPtr) {
        let kb = w.k / BLOCK;
        let half = TILE_BLOCK_BYTES / 2;
        let wq = w.qs.as_ptr().add(t * kb * half);
        let wd = w.d.as_ptr().add(t * kb * TILE);
        let wm = w.m.as_ptr().add(t * kb * TILE);
        let low = _mm512_set1_epi8(0x0F);
        let mut r0 = 0;
        while r0 < x.m {
            let rows = ROWS.min(x.m - r0);
            let mut acc = [_mm512_setzero_ps(); ROWS];
            for b in 0..kb {
                let wb = wq.add(b * half);
                let d_w = _mm512_loadu_ps(wd.add(b * TILE));
                let m_w = _mm512_loadu_ps(wm.add(b * TILE));
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    let row = r0 + r;
                    let xq = x.qs.as_ptr().add(row * x.k + b * BLOCK) as *const i32;
                    let mut s = _mm512_setzero_si512();
                    for p in 0..BLOCK / 8 {
                        let v = _mm512_loadu_si512(wb.add(p * TILE * 4) as *const _);
                        let lo = _mm512_and_si512(v, low);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        s = _mm512_dpbusd_epi32(s, lo, _mm512_set1_epi32(xq.add(2 * p).read_unaligned()));
                        s = _mm512_dpbusd_epi32(s, hi, _mm512_set1_epi32(xq.add(2 * p + 1).read_unaligned()));
                    }
                    let dx = x.scales[row * kb + b];
                    // Σ q_x of the block (the stored offsets are 128 times it).
                    let sum_x = (x.offsets[row * kb + b] / 128) as f32;
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d_w, _mm512_set1_ps(dx)), *a);
                    *a = _mm512_fmadd_ps(m_w, _mm512_set1_ps(dx * sum_x), *a);
                }
            }
            for (r, a) in acc.iter().enumerate().take(rows) {
                _mm512_storeu_ps(out.0.add((r0 + r) * w.n + t * TILE), *a);
            }
            r0 += rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) % 20001) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn int8_matmul_matches_f64_within_quantization_error() {
        if !Q8Matrix::supported() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI (the engine uses candle's kernels here)");
            return;
        }
        for (m, n, k) in [(1, 16, 32), (3, 48, 96), (4, 32, 576), (9, 64, 64), (17, 160, 1536)] {
            let w = data(n * k, 1 + m as u64);
            let x = data(m * k, 2 + n as u64);
            let q = Q8Matrix::quantize(&w, n, k).unwrap();
            let xq = Q8Rows::quantize(&x, m, k);
            let mut y = vec![f32::NAN; m * n];
            q.matmul(&xq, &mut y);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                    // Each product carries up to ~1/127 relative error from
                    // each side; the sum's error grows with sqrt(k).
                    let tol = 0.02 * (k as f64).sqrt();
                    assert!(
                        (y[i * n + j] as f64 - want).abs() < tol,
                        "m={m} n={n} k={k} ({i},{j}): {} vs {want}",
                        y[i * n + j]
                    );
                }
            }
        }
    }

    #[test]
    fn exact_on_values_that_quantize_exactly() {
        if !Q8Matrix::supported() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        // Integers in -127..=127 with a 127 in every block quantize without
        // error, so the product is exact: checks the layout and the offset.
        let (m, n, k) = (5, 32, 64);
        let int = |i: usize, salt: usize| -> f32 {
            if i.is_multiple_of(32) {
                127.0
            } else {
                ((i * 37 + salt * 11) % 255) as f32 - 127.0
            }
        };
        let w: Vec<f32> = (0..n * k).map(|i| int(i, 1)).collect();
        let x: Vec<f32> = (0..m * k).map(|i| int(i, 2)).collect();
        let q = Q8Matrix::quantize(&w, n, k).unwrap();
        let mut y = vec![0.0; m * n];
        q.matmul(&Q8Rows::quantize(&x, m, k), &mut y);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|c| x[i * k + c] * w[j * k + c]).sum();
                assert_eq!(y[i * n + j], want, "({i},{j})");
            }
        }
    }

    #[test]
    fn int4_matmul_is_exact_on_4bit_weights_and_close_on_others() {
        if !Q8Matrix::supported() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        // Weights already of the form d·q + m (q in 0..=15, every block
        // using 0 and 15) come back exactly; activations that are integers
        // with a 127 in every block quantize exactly: the product is exact.
        let (m, n, k) = (3, 48, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| {
                let (row, b) = (i / k, (i % k) / 32);
                let q = match i % 32 {
                    0 => 0,
                    1 => 15,
                    j => (j * 7 + row * 3 + b) % 16,
                };
                0.5 * q as f32 - 2.0 + row as f32 * 0.25
            })
            .collect();
        let x: Vec<f32> =
            (0..m * k).map(|i| if i % 32 == 5 { 127.0 } else { ((i * 37) % 255) as f32 - 127.0 }).collect();
        let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
        let xq = Q8Rows::quantize(&x, m, k);
        let mut y = vec![f32::NAN; m * n];
        q4.matmul(&xq, &mut y);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                assert!(
                    (y[i * n + j] as f64 - want).abs() < 1e-6 * want.abs().max(1.0),
                    "({i},{j}) {} vs {want}",
                    y[i * n + j]
                );
            }
        }
        // Arbitrary weights: within 4-bit quantization error.
        for (m, n, k) in [(1, 16, 32), (4, 32, 576), (7, 160, 1536)] {
            let w = data(n * k, 3 + m as u64);
            let x = data(m * k, 4 + n as u64);
            let q4 = Q4Matrix::quantize(&w, n, k).unwrap();
            let mut y = vec![f32::NAN; m * n];
            q4.matmul(&Q8Rows::quantize(&x, m, k), &mut y);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                    // Each weight is off by up to 1/30 of its block's range (2).
                    let tol = 0.08 * (k as f64).sqrt();
                    assert!(
                        (y[i * n + j] as f64 - want).abs() < tol,
                        "m={m} n={n} k={k} ({i},{j}): {} vs {want}",
                        y[i * n + j]
                    );
                }
            }
        }
    }

    #[test]
    fn refuses_shapes_outside_the_tiles() {
        assert!(!Q8Matrix::fits(15, 32));
        assert!(!Q8Matrix::fits(16, 33));
        assert!(Q8Matrix::quantize(&[0.0; 16 * 33], 16, 33).is_err());
    }
}
