//! The few vector primitives the CPU forward pass spends its time in, with
//! an AVX2/FMA/F16C path chosen once at run time and a portable path for
//! everything else. Both paths compute the same thing; tests check them
//! against each other and against plain `f64` arithmetic.

use half::f16;

/// Which implementation runs on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

pub(crate) fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // `avx2` and `avx512vnni` both imply AVX2, FMA and F16C.
            if super::kernels::kernel_path() >= super::kernels::KernelPath::Avx2 {
                return Level::Avx2;
            }
        }
        Level::Portable
    })
}

/// `dst[i] = f32(src[i])`.
pub(crate) fn f16_to_f32(lv: Level, src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    match lv {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Level::Avx2` is only chosen when the CPU has AVX2, FMA and F16C.
        Level::Avx2 => unsafe { x86::f16_to_f32(src, dst) },
        Level::Portable => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }
}

/// `dst[i] = f16(src[i])`, rounding to nearest.
pub(crate) fn f32_to_f16(lv: Level, src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len());
    match lv {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx2 => unsafe { x86::f32_to_f16(src, dst) },
        Level::Portable => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = f16::from_f32(*s);
            }
        }
    }
}

/// `out[j] = q · keys[j]` for `keys` stored as rows of `q.len()` floats.
pub(crate) fn dots(lv: Level, q: &[f32], keys: &[f32], out: &mut [f32]) {
    let d = q.len();
    assert_eq!(keys.len(), out.len() * d);
    match lv {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx2 if d.is_multiple_of(8) => unsafe { x86::dots(q, keys, out) },
        _ => {
            for (o, k) in out.iter_mut().zip(keys.chunks_exact(d)) {
                *o = q.iter().zip(k).map(|(a, b)| a * b).sum();
            }
        }
    }
}

/// `acc += Σ_j p[j] * values[j]` for `values` stored as rows of `acc.len()` floats.
pub(crate) fn weighted_sum(lv: Level, p: &[f32], values: &[f32], acc: &mut [f32]) {
    let d = acc.len();
    assert_eq!(values.len(), p.len() * d);
    match lv {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx2 if d.is_multiple_of(8) => unsafe { x86::weighted_sum(p, values, acc) },
        _ => {
            for (w, v) in p.iter().zip(values.chunks_exact(d)) {
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += w * x;
                }
            }
        }
    }
}

/// `x[i] = 2^(x[i] - shift)`, returns the sum. Inputs are at most `shift`
/// (softmax scores against their running maximum).
pub(crate) fn exp2_shifted_sum(lv: Level, x: &mut [f32], shift: f32) -> f32 {
    match lv {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx2 => unsafe { x86::exp2_shifted_sum(x, shift) },
        Level::Portable => {
            let mut s = 0.0;
            for v in x.iter_mut() {
                *v = (*v - shift).exp2();
                s += *v;
            }
            s
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub(crate) fn silu_mul(lv: Level, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    match lv {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx2 => unsafe { x86::silu_mul(gate, up) },
        Level::Portable => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        }
    }
}

/// The largest element (`-inf` for an empty slice).
pub(crate) fn max(x: &[f32]) -> f32 {
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            let f = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            i += 8;
        }
        for j in i..n {
            dst[j] = f16::from_f32(src[j]);
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `d` is a multiple of 8. Four keys at a time share each load of `q`;
    /// their four sums are reduced together.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let d = q.len();
        let n = out.len();
        let qp = q.as_ptr();
        let kp = keys.as_ptr();
        let mut j = 0;
        // Eight keys at a time: eight independent FMA chains, one load of q
        // per eight products.
        while j + 8 <= n {
            let k = kp.add(j * d);
            let mut a = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < d {
                let qc = _mm256_loadu_ps(qp.add(c));
                a[0] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(c)), a[0]);
                a[1] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(d + c)), a[1]);
                a[2] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(2 * d + c)), a[2]);
                a[3] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(3 * d + c)), a[3]);
                a[4] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(4 * d + c)), a[4]);
                a[5] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(5 * d + c)), a[5]);
                a[6] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(6 * d + c)), a[6]);
                a[7] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k.add(7 * d + c)), a[7]);
                c += 8;
            }
            // Pairwise sums leave (s0..s3) and (s4..s7) split over the two
            // 128-bit halves; adding the halves finishes them.
            let h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            let h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            let lo = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
            let hi = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
            _mm256_storeu_ps(out.as_mut_ptr().add(j), _mm256_add_ps(lo, hi));
            j += 8;
        }
        while j + 4 <= n {
            let (k0, k1, k2, k3) = (kp.add(j * d), kp.add((j + 1) * d), kp.add((j + 2) * d), kp.add((j + 3) * d));
            let mut a0 = _mm256_setzero_ps();
            let mut a1 = _mm256_setzero_ps();
            let mut a2 = _mm256_setzero_ps();
            let mut a3 = _mm256_setzero_ps();
            let mut c = 0;
            while c < d {
                let qc = _mm256_loadu_ps(qp.add(c));
                a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0.add(c)), a0);
                a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k1.add(c)), a1);
                a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k2.add(c)), a2);
                a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k3.add(c)), a3);
                c += 8;
            }
            // [a0 a1 a2 a3] pairwise: lanes end up as (s0 s1 s2 s3) per 128-bit half.
            let h01 = _mm256_hadd_ps(a0, a1);
            let h23 = _mm256_hadd_ps(a2, a3);
            let h = _mm256_hadd_ps(h01, h23);
            let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            _mm_storeu_ps(out.as_mut_ptr().add(j), s);
            j += 4;
        }
        while j < n {
            let k = kp.add(j * d);
            let mut a = _mm256_setzero_ps();
            let mut c = 0;
            while c < d {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(k.add(c)), a);
                c += 8;
            }
            out[j] = hsum(a);
            j += 1;
        }
    }

    /// `d` is a multiple of 8. Each 8-wide slice of the accumulator stays in
    /// a register across all rows.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum(p: &[f32], values: &[f32], acc: &mut [f32]) {
        let d = acc.len();
        let n = p.len();
        let vp = values.as_ptr();
        let mut c = 0;
        // Eight independent accumulators (64 columns) hide the FMA latency;
        // fewer leave each chain waiting on the previous row.
        while c + 64 <= d {
            let ap = acc.as_mut_ptr().add(c);
            let mut o = [_mm256_setzero_ps(); 8];
            for (i, o) in o.iter_mut().enumerate() {
                *o = _mm256_loadu_ps(ap.add(8 * i));
            }
            for (j, &w) in p.iter().enumerate().take(n) {
                let w = _mm256_set1_ps(w);
                let row = vp.add(j * d + c);
                o[0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), o[0]);
                o[1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8)), o[1]);
                o[2] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(16)), o[2]);
                o[3] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(24)), o[3]);
                o[4] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(32)), o[4]);
                o[5] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(40)), o[5]);
                o[6] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(48)), o[6]);
                o[7] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(56)), o[7]);
            }
            for (i, o) in o.iter().enumerate() {
                _mm256_storeu_ps(ap.add(8 * i), *o);
            }
            c += 64;
        }
        while c + 16 <= d {
            let mut o0 = _mm256_loadu_ps(acc.as_ptr().add(c));
            let mut o1 = _mm256_loadu_ps(acc.as_ptr().add(c + 8));
            for (j, &w) in p.iter().enumerate().take(n) {
                let w = _mm256_set1_ps(w);
                let row = vp.add(j * d + c);
                o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), o0);
                o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8)), o1);
            }
            _mm256_storeu_ps(acc.as_mut_ptr().add(c), o0);
            _mm256_storeu_ps(acc.as_mut_ptr().add(c + 8), o1);
            c += 16;
        }
        while c < d {
            let mut o = _mm256_loadu_ps(acc.as_ptr().add(c));
            for (j, &w) in p.iter().enumerate().take(n) {
                o = _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(vp.add(j * d + c)), o);
            }
            _mm256_storeu_ps(acc.as_mut_ptr().add(c), o);
            c += 8;
        }
    }

    /// 2^x for x in [-126, 126] (smaller gives 0): x = n + f with n an integer
    /// and |f| <= 1/2, 2^f = e^(f ln 2) by its Taylor series to the 6th power
    /// (relative error below 2e-7), 2^n put into the exponent bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp2(x: __m256) -> __m256 {
        let lo = _mm256_set1_ps(-126.0);
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo);
        let x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(126.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let y = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(std::f32::consts::LN_2));
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0 / 120.0));
        p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0 / 24.0));
        p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0 / 6.0));
        p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5));
        p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0));
        p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0));
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        let r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_andnot_ps(under, r)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
        let n = x.len();
        let sh = _mm256_set1_ps(shift);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let p = x.as_mut_ptr().add(i);
            let e = exp2(_mm256_sub_ps(_mm256_loadu_ps(p), sh));
            _mm256_storeu_ps(p, e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        let mut s = hsum(acc);
        for v in &mut x[i..] {
            *v = (*v - shift).exp2();
            s += *v;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let one = _mm256_set1_ps(1.0);
        let neg_log2e = _mm256_set1_ps(-std::f32::consts::LOG2_E);
        let mut i = 0;
        while i + 8 <= n {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = exp2(_mm256_mul_ps(g, neg_log2e));
            let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
            i += 8;
        }
        for j in i..n {
            gate[j] = gate[j] / (1.0 + (-gate[j]).exp()) * up[j];
        }
    }
}

#[cfg(test)]
mod tests {

    /// The wrappers check the lengths the unsafe kernels rely on, in
    /// release builds too.
    #[test]
    #[should_panic(expected = "assertion `left == right` failed")]
    fn mismatched_lengths_are_refused() {
        let q = [0.0f32; 8];
        let keys = [0.0f32; 8 * 3];
        let mut out = [0.0f32; 4];
        dots(level(), &q, &keys, &mut out);
    }

    use super::*;

    fn levels() -> Vec<Level> {
        let mut v = vec![Level::Portable];
        if level() != Level::Portable {
            v.push(level());
        }
        v
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 20001) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn dots_and_weighted_sums_match_f64() {
        for lv in levels() {
            for (d, n) in [(64, 13), (128, 4), (8, 1), (24, 9), (6, 5), (64, 64), (80, 17), (96, 8), (32, 23)] {
                let q = data(d, 1);
                let k = data(d * n, 2);
                let mut out = vec![0.0; n];
                dots(lv, &q, &k, &mut out);
                for j in 0..n {
                    let want: f64 = (0..d).map(|c| q[c] as f64 * k[j * d + c] as f64).sum();
                    assert!((out[j] as f64 - want).abs() < 1e-4, "{lv:?} d={d} j={j}: {} vs {want}", out[j]);
                }
                let p = data(n, 3);
                let mut acc = data(d, 4);
                let before = acc.clone();
                weighted_sum(lv, &p, &k, &mut acc);
                for c in 0..d {
                    let want = before[c] as f64 + (0..n).map(|j| p[j] as f64 * k[j * d + c] as f64).sum::<f64>();
                    assert!((acc[c] as f64 - want).abs() < 1e-4, "{lv:?} d={d} c={c}");
                }
            }
        }
    }

    #[test]
    fn exp2_is_accurate_and_underflows_to_zero() {
        for lv in levels() {
            let mut x: Vec<f32> = (0..400).map(|i| -(i as f32) * 0.37 + 3.0).collect();
            x.push(f32::NEG_INFINITY);
            x.push(-1000.0);
            let orig = x.clone();
            let s = exp2_shifted_sum(lv, &mut x, 3.0);
            let mut want_sum = 0.0f64;
            for (v, o) in x.iter().zip(&orig) {
                let want = 2f64.powf(*o as f64 - 3.0);
                want_sum += want;
                if want < 1e-36 {
                    assert!(*v == 0.0 || (*v as f64) < 1e-36, "{lv:?}: 2^{o} gave {v}");
                } else {
                    assert!(((*v as f64) - want).abs() <= want * 1e-6, "{lv:?}: 2^({o}-3) = {v}, want {want}");
                }
            }
            assert!((s as f64 - want_sum).abs() < want_sum * 1e-5);
        }
    }

    #[test]
    fn silu_and_conversions_match_scalar_math() {
        for lv in levels() {
            let g0: Vec<f32> = data(37, 5).iter().map(|v| v * 12.0).collect();
            let u = data(37, 6);
            let mut g = g0.clone();
            silu_mul(lv, &mut g, &u);
            for i in 0..37 {
                let x = g0[i] as f64;
                let want = x / (1.0 + (-x).exp()) * u[i] as f64;
                assert!((g[i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "{lv:?} silu({x})");
            }
            let f = data(21, 7);
            let mut h = vec![f16::ZERO; 21];
            f32_to_f16(lv, &f, &mut h);
            let mut back = vec![0.0; 21];
            f16_to_f32(lv, &h, &mut back);
            for i in 0..21 {
                assert_eq!(h[i], f16::from_f32(f[i]), "{lv:?} rounding of {}", f[i]);
                assert_eq!(back[i], h[i].to_f32());
            }
        }
    }
}
