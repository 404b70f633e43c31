//! Causal attention on the CPU, straight from the engine's f16 KV cache.
//!
//! One call covers every sequence of a forward step (decode rows and
//! prefill chunks alike). Work is cut into items of (sequence, KV head,
//! up to [`ROW_TILE`] query rows) and spread over candle's CPU thread pool.
//! Each item walks the keys in tiles of [`KEY_TILE`]: it converts the tile's
//! K and V to f32 once for all the query heads sharing that KV head, then
//! keeps a running softmax (maximum, sum, weighted values), so the score
//! matrix is never materialised and a long prompt costs memory linear in its
//! length. Nothing is converted for positions a row may not see.

use std::cell::RefCell;

use half::f16;

use super::simd::{self, Level};

/// Query rows one work item handles (prefill); decode items have one.
const ROW_TILE: usize = 16;
/// Keys converted and scored together.
const KEY_TILE: usize = 64;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// How scores are formed: `q·k * scale`, soft-capped (`c tanh(s / c)`)
/// when `softcap` is set, over the keys a sliding `window` leaves (a
/// query at position p sees keys p - window + 1 ..= p).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scores {
    pub scale: f32,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl Scores {
    /// First key a query at position `pos` sees.
    fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// One sequence's rows in a step.
pub(crate) struct SeqRows<'a> {
    /// Rotated queries of the new rows, `[n, heads, head_dim]`.
    pub q: &'a [f32],
    /// The layer's KV per block of `block_tokens` positions: K then V, each
    /// `[kv_heads, block_tokens, head_dim]`; positions `0..off + n` filled
    /// (the new rows already written).
    pub blocks: Vec<&'a [f16]>,
    pub block_tokens: usize,
    /// Positions before the first new row.
    pub off: usize,
    pub n: usize,
    /// Index of the sequence's first row in the output.
    pub out_row: usize,
}

struct OutPtr(*mut f32);
// SAFETY: items write disjoint parts of the output (their own rows' heads).
unsafe impl Sync for OutPtr {}

#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    s: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// A decode row is split across threads (each part a range of at least
/// this many keys, merged after) when a step has too few items to keep
/// every thread busy: one long sequence decoding alone, say.
const SPLIT_KEYS: usize = 512;

/// Work: rows `r0..r1` of sequence `si` for KV head `kh` against keys
/// `k0..k1` (clipped to what each row may see). `part`: where to leave an
/// unnormalised partial result (output, maximum and sum per query head) for
/// [`merge`], or `None` to write the finished rows.
#[derive(Clone, Copy)]
struct Item {
    si: usize,
    kh: usize,
    r0: usize,
    r1: usize,
    k0: usize,
    k1: usize,
    part: Option<usize>,
}

/// Computes softmax(scores) v for every row of every sequence into `out`
/// (`[rows, heads, head_dim]`, rows in `out_row` order).
pub(crate) fn attend(h: Heads, seqs: &[SeqRows<'_>], how: Scores, out: &mut [f32]) {
    attend_with(h, seqs, how, out, candle_core::utils::get_num_threads());
}

fn attend_with(h: Heads, seqs: &[SeqRows<'_>], how: Scores, out: &mut [f32], threads: usize) {
    let row_len = h.heads * h.head_dim;
    assert!(h.heads.is_multiple_of(h.kv_heads));
    for s in seqs {
        assert_eq!(s.q.len(), s.n * row_len);
        assert!(s.off + s.n <= s.blocks.len() * s.block_tokens);
        assert!(s.blocks.iter().all(|b| b.len() == 2 * h.kv_heads * s.block_tokens * h.head_dim));
        assert!(out.len() >= (s.out_row + s.n) * row_len);
    }
    let mut items: Vec<Item> = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        let tile = if s.n == 1 { 1 } else { ROW_TILE };
        let mut r = 0;
        while r < s.n {
            let end = (r + tile).min(s.n);
            let k0 = how.first_key(s.off + r);
            for kh in 0..h.kv_heads {
                items.push(Item { si, kh, r0: r, r1: end, k0, k1: s.off + end, part: None });
            }
            r = end;
        }
    }
    // Too few items for the threads: cut long single-row items by keys.
    let g = h.heads / h.kv_heads;
    let part_len = g * (h.head_dim + 2);
    let mut groups: Vec<(Item, std::ops::Range<usize>)> = Vec::new();
    let want = 4 * threads;
    if threads > 1 && items.len() < want {
        let per_item = want.div_ceil(items.len());
        let mut split = Vec::with_capacity(want);
        let mut parts = 0;
        for it in items {
            let n = ((it.k1 - it.k0) / SPLIT_KEYS).min(per_item);
            if it.r1 - it.r0 != 1 || n < 2 {
                split.push(it);
                continue;
            }
            // Part boundaries on key-tile multiples.
            let step = (it.k1 - it.k0).div_ceil(n).div_ceil(KEY_TILE) * KEY_TILE;
            let first = parts;
            let mut k0 = it.k0;
            while k0 < it.k1 {
                let k1 = (k0 + step).min(it.k1);
                split.push(Item { k0, k1, part: Some(parts * part_len), ..it });
                parts += 1;
                k0 = k1;
            }
            groups.push((it, first..parts));
        }
        items = split;
    }
    // Longest first, so that the long items start early and short ones
    // fill the gaps.
    items.sort_by_key(|it| std::cmp::Reverse((it.k1 - it.k0) * (it.r1 - it.r0)));
    let mut partials = vec![0f32; items.iter().filter(|it| it.part.is_some()).count() * part_len];
    let lv = simd::level();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let part_ptr = OutPtr(partials.as_mut_ptr());
    let run = |i: usize| {
        let it = items[i];
        SCRATCH.with(|sc| tile(lv, h, &seqs[it.si], it, how, &out_ptr, &part_ptr, &mut sc.borrow_mut()));
    };
    if items.len() == 1 {
        run(0);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| range.for_each(run));
    }
    if !groups.is_empty() {
        merge(h, seqs, &groups, &partials, out);
    }
}

/// Combines the key-range parts of each split row (`groups`: the row and
/// its part slots, in key order): rescales every part to the largest
/// maximum, adds outputs and sums, and writes output / sum.
fn merge(h: Heads, seqs: &[SeqRows<'_>], groups: &[(Item, std::ops::Range<usize>)], partials: &[f32], out: &mut [f32]) {
    let (d, g) = (h.head_dim, h.heads / h.kv_heads);
    let part_len = g * (d + 2);
    let mut acc = vec![0f32; d];
    for (it, slots) in groups {
        let parts: Vec<&[f32]> =
            partials[slots.start * part_len..slots.end * part_len].chunks_exact(part_len).collect();
        let s = &seqs[it.si];
        for qi in 0..g {
            let (m_at, l_at) = (g * d + qi, g * d + g + qi);
            let m = parts.iter().map(|p| p[m_at]).fold(f32::NEG_INFINITY, f32::max);
            acc.iter_mut().for_each(|x| *x = 0.0);
            let mut l = 0f32;
            for p in &parts {
                if p[l_at] == 0.0 {
                    continue;
                }
                let c = (p[m_at] - m).exp2();
                l += p[l_at] * c;
                for (a, o) in acc.iter_mut().zip(&p[qi * d..(qi + 1) * d]) {
                    *a += o * c;
                }
            }
            let dst = ((s.out_row + it.r0) * h.heads + it.kh * g + qi) * d;
            let inv = 1.0 / l;
            for (o, a) in out[dst..dst + d].iter_mut().zip(&acc) {
                *o = a * inv;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn tile(
    lv: Level,
    h: Heads,
    s: &SeqRows<'_>,
    it: Item,
    how: Scores,
    out: &OutPtr,
    partials: &OutPtr,
    sc: &mut Scratch,
) {
    let Item { kh, r0, r1, k0, k1, part, .. } = it;
    let d = h.head_dim;
    let g = h.heads / h.kv_heads;
    let rows = r1 - r0;
    let nq = rows * g;
    // Scores are kept in base 2: q is scaled by log2(e) so exp becomes exp2
    // (after the soft cap, when there is one).
    let qscale = if how.softcap.is_some() { how.scale } else { how.scale * std::f32::consts::LOG2_E };
    sc.q.clear();
    for r in r0..r1 {
        let base = (r * h.heads + kh * g) * d;
        sc.q.extend(s.q[base..base + g * d].iter().map(|x| x * qscale));
    }
    sc.o.clear();
    sc.o.resize(nq * d, 0.0);
    sc.m.clear();
    sc.m.resize(nq, f32::NEG_INFINITY);
    sc.l.clear();
    sc.l.resize(nq, 0.0);
    sc.k.resize(KEY_TILE * d, 0.0);
    sc.v.resize(KEY_TILE * d, 0.0);
    sc.s.resize(KEY_TILE, 0.0);
    // Keys up to `last` are visible to the item's last row.
    let last = (s.off + r1).min(k1);
    let bt = s.block_tokens;
    let mut t0 = k0;
    while t0 < last {
        // A tile never spans two blocks.
        let (blk, w) = (s.blocks[t0 / bt], t0 % bt);
        let tl = KEY_TILE.min(last - t0).min(bt - w);
        let k_at = (kh * bt + w) * d;
        let v_at = ((h.kv_heads + kh) * bt + w) * d;
        simd::f16_to_f32(lv, &blk[k_at..k_at + tl * d], &mut sc.k[..tl * d]);
        simd::f16_to_f32(lv, &blk[v_at..v_at + tl * d], &mut sc.v[..tl * d]);
        for qi in 0..nq {
            let pos = s.off + r0 + qi / g;
            if pos < t0 {
                continue;
            }
            let vis = tl.min(pos + 1 - t0);
            // Keys of the tile before the row's window start.
            let lo = how.first_key(pos).saturating_sub(t0).min(vis);
            if lo == vis {
                continue;
            }
            let scores = &mut sc.s[lo..vis];
            simd::dots(lv, &sc.q[qi * d..(qi + 1) * d], &sc.k[lo * d..vis * d], scores);
            if let Some(c) = how.softcap {
                for x in scores.iter_mut() {
                    *x = c * (*x / c).tanh() * std::f32::consts::LOG2_E;
                }
            }
            let m_old = sc.m[qi];
            let m_new = m_old.max(simd::max(scores));
            let sum = simd::exp2_shifted_sum(lv, scores, m_new);
            let o = &mut sc.o[qi * d..(qi + 1) * d];
            if m_old != f32::NEG_INFINITY && m_old != m_new {
                let c = (m_old - m_new).exp2();
                sc.l[qi] *= c;
                o.iter_mut().for_each(|x| *x *= c);
            }
            sc.l[qi] += sum;
            sc.m[qi] = m_new;
            simd::weighted_sum(lv, scores, &sc.v[lo * d..vis * d], o);
        }
        t0 += tl;
    }
    if let Some(at) = part {
        // SAFETY: every part has its own slot of `g * (d + 2)` floats inside
        // `partials` (single-row items: nq == g).
        let slot = unsafe { std::slice::from_raw_parts_mut(partials.0.add(at), g * (d + 2)) };
        slot[..nq * d].copy_from_slice(&sc.o);
        slot[g * d..g * d + g].copy_from_slice(&sc.m);
        slot[g * d + g..].copy_from_slice(&sc.l);
        return;
    }
    for qi in 0..nq {
        let r = r0 + qi / g;
        let head = kh * g + qi % g;
        let inv = 1.0 / sc.l[qi];
        let dst = ((s.out_row + r) * h.heads + head) * d;
        for c in 0..d {
            // SAFETY: (row, head) pairs are unique to this item; `attend`
            // checked that the rows lie inside `out`.
            unsafe { *out.0.add(dst + c) = sc.o[qi * d + c] * inv };
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
                ((s >> 11) % 20001) as f32 / 5000.0 - 2.0
            })
            .collect()
    }

    /// Plain f64 attention for one sequence: the reference.
    fn reference(h: Heads, s: &SeqRows<'_>, how: Scores) -> Vec<f64> {
        let scale = how.scale as f64;
        let (q, off, n, bt) = (s.q, s.off, s.n, s.block_tokens);
        let kv_at = |j: usize, kind: usize, kh: usize, c: usize| -> f64 {
            s.blocks[j / bt][((kind * h.kv_heads + kh) * bt + j % bt) * h.head_dim + c].to_f64()
        };
        let (d, g) = (h.head_dim, h.heads / h.kv_heads);
        let mut out = vec![0.0; n * h.heads * d];
        for r in 0..n {
            for hd in 0..h.heads {
                let kh = hd / g;
                let qv = &q[(r * h.heads + hd) * d..][..d];
                let vis = off + r + 1;
                let first = how.window.map_or(0, |w| vis.saturating_sub(w));
                let scores: Vec<f64> = (0..vis)
                    .map(|j| {
                        let s = qv.iter().enumerate().map(|(c, a)| *a as f64 * kv_at(j, 0, kh, c)).sum::<f64>() * scale;
                        let s = how.softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh());
                        if j < first {
                            f64::NEG_INFINITY
                        } else {
                            s
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    out[(r * h.heads + hd) * d + c] = (0..vis).map(|j| e[j] * kv_at(j, 1, kh, c)).sum::<f64>() / z;
                }
            }
        }
        out
    }

    #[test]
    fn matches_plain_attention_for_decode_and_prefill_rows() {
        // (heads, kv_heads, head_dim, block_tokens, [(off, n)]): GQA and MHA,
        // decode rows, chunks crossing key tiles and blocks (blocks smaller
        // than, equal to and larger than a key tile), several sequences in
        // one call.
        type Case = (usize, usize, usize, usize, Vec<(usize, usize)>);
        let cases: Vec<Case> = vec![
            (9, 3, 64, 256, vec![(0, 1)]),
            (9, 3, 64, 256, vec![(300, 1), (0, 70), (130, 33)]),
            (4, 4, 32, 16, vec![(63, 2), (64, 1), (5, 17)]),
            (8, 2, 16, 64, vec![(0, 200)]),
            (6, 3, 12, 24, vec![(10, 9), (0, 1), (47, 50)]),
            // Long decode rows, split by keys when threads outnumber items.
            (9, 3, 64, 256, vec![(2100, 1)]),
            (9, 3, 64, 256, vec![(1500, 1), (3000, 1), (20, 30)]),
            (4, 1, 32, 100, vec![(1023, 1)]),
        ];
        for (heads, kv_heads, head_dim, bt, shapes) in cases {
            let h = Heads { heads, kv_heads, head_dim };
            let scale = 1.0 / (head_dim as f32).sqrt();
            let seeds: Vec<(Vec<f32>, Vec<Vec<f16>>)> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(off, n))| {
                    let blocks = (off + n).div_ceil(bt) + 1;
                    let per = 2 * kv_heads * bt * head_dim;
                    let kv = (0..blocks)
                        .map(|b| data(per, 20 + (i * 31 + b) as u64).into_iter().map(f16::from_f32).collect())
                        .collect();
                    (data(n * heads * head_dim, 10 + i as u64), kv)
                })
                .collect();
            let mut out_row = 0;
            let seqs: Vec<SeqRows> = shapes
                .iter()
                .zip(&seeds)
                .map(|(&(off, n), (q, kv))| {
                    let blocks = kv.iter().map(Vec::as_slice).collect();
                    let s = SeqRows { q, blocks, block_tokens: bt, off, n, out_row };
                    out_row += n;
                    s
                })
                .collect();
            // Plain scores, a sliding window (narrower and wider than a
            // key tile), and Gemma 2's soft cap with a window.
            let variants = [
                Scores { scale, window: None, softcap: None },
                Scores { scale, window: Some(37), softcap: None },
                Scores { scale, window: Some(700), softcap: None },
                Scores { scale, window: Some(100), softcap: Some(2.0) },
            ];
            for how in variants {
                for threads in [1, 2, 8] {
                    let mut out = vec![f32::NAN; out_row * heads * head_dim];
                    attend_with(h, &seqs, how, &mut out, threads);
                    check(h, &seqs, how, &out, threads);
                }
            }
        }
    }

    fn check(h: Heads, seqs: &[SeqRows<'_>], how: Scores, out: &[f32], threads: usize) {
        let Heads { heads, kv_heads, head_dim } = h;
        for s in seqs {
            let want = reference(h, s, how);
            let got = &out[s.out_row * heads * head_dim..][..want.len()];
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() < 2e-4,
                    "heads {heads}/{kv_heads} d {head_dim} blocks of {} off {} n {}, {how:?}, {threads} threads: element {i}: {g} vs {w}",
                    s.block_tokens,
                    s.off,
                    s.n
                );
            }
        }
    }
}
