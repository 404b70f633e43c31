//! The next-token choice on the device, for a step's logits that stay there
//! (the tensor path): only what the choice needs crosses to the host, never
//! a whole row.
//!
//! In the order the host applies them to a whole row:
//! - **Grammar**: the tokens the grammar allows go up as one byte each and
//!   forbid the others where the logits are.
//! - **`logprobs`**: taken from the logits as they stand then (a copy on the
//!   device): each row's log-sum-exp, its chosen token's logit, and the
//!   blocks that can hold its `top_logprobs` best.
//! - **`logit_bias` and penalties**: only the logits they change cross, both
//!   ways ([`adjust`]).
//! - **The choice**, from rows cut into blocks of [`BLOCK`] logits whose
//!   maxima come back first:
//!   - greedy: the argmax, one id;
//!   - `min_p` or `top_k`: only the blocks that can hold a survivor follow
//!     (maximum at the `min_p` threshold and among the `top_k` highest block
//!     maxima, ties included), and the host makes the choice it makes from
//!     the whole row ([`sampler::choose_among`], the same survivors in the
//!     same order, the same draw);
//!   - no cut: each block's mass comes back too; the draw picks a block by
//!     mass, then a token in the one block fetched;
//!   - `top_p` alone: the row's mass by likelihood band (tokens within a
//!     factor 2 of each other) says how far down the nucleus reaches; the
//!     blocks above that band follow and the host cuts the nucleus from
//!     them, against the whole row's mass.
//!
//! Greedy, `min_p` and `top_k` rows choose exactly as the host does. No-cut
//! and `top_p`-alone rows sum their mass in another order than the host's
//! walk along the row, so a draw that falls within rounding of a boundary
//! between two tokens may take the other one.

use anyhow::Result;
use candle_core::{DType, Tensor, D};

use super::sampler;
use crate::{SamplingParams, TokenLogprobs};

/// Logits per block.
const BLOCK: usize = 256;

/// Likelihood bands for `top_p` alone: band `b` holds the tokens whose
/// probability is within a factor `(2^-(b+1), 2^-b]` of the row's highest;
/// the last, every token below.
const BANDS: usize = 48;

/// One row of the step's logits to choose the next token of.
pub struct Want<'a> {
    /// Its row in the logits.
    pub row: usize,
    pub sampling: &'a SamplingParams,
    pub history: &'a sampler::History,
    /// The tokens its grammar allows, one byte per id (1 allowed).
    pub allowed: Option<Vec<u8>>,
    /// Its uniform draw in [0, 1) (`temperature > 0`).
    pub uniform: f32,
}

/// What became of one row.
#[derive(Debug)]
pub enum Outcome {
    Token {
        token: u32,
        logprobs: Option<TokenLogprobs>,
    },
    /// The row cannot go on (its grammar allows no token).
    Failed(String),
}

/// Chooses the next token of every row of `logits` `[rows, vocab]` that
/// `wants` names, changing those rows in place (grammar, `logit_bias`,
/// penalties). Returns one outcome per want and how many values crossed to
/// the host.
pub fn choose(logits: &Tensor, wants: &[Want]) -> Result<(Vec<Outcome>, usize)> {
    let (n, vocab) = logits.dims2()?;
    anyhow::ensure!(logits.is_contiguous(), "the logits are not contiguous");
    anyhow::ensure!(n * vocab <= u32::MAX as usize, "{n} rows of {vocab} logits are past u32 indices");
    let mut out: Vec<Option<Outcome>> = wants.iter().map(|_| None).collect();
    let mut crossed = 0;
    let masked: Vec<(usize, &[u8])> = wants.iter().filter_map(|w| w.allowed.as_deref().map(|a| (w.row, a))).collect();
    if !masked.is_empty() {
        let finite = forbid(logits, &masked)?;
        crossed += masked.len();
        let mut finite = finite.into_iter();
        for (k, w) in wants.iter().enumerate() {
            if w.allowed.is_some() && !finite.next().expect("one per masked row") {
                out[k] = Some(Outcome::Failed("the grammar allows no token here".into()));
            }
        }
    }
    let live: Vec<usize> = (0..wants.len()).filter(|&k| out[k].is_none()).collect();
    let lp: Vec<usize> = live.iter().copied().filter(|&k| wants[k].sampling.logprobs.is_some()).collect();
    // A copy: `logit_bias` and the penalties change the logits next.
    let before = if lp.is_empty() {
        None
    } else {
        let ids: Vec<u32> = lp.iter().map(|&k| wants[k].row as u32).collect();
        Some(logits.index_select(&Tensor::from_slice(&ids, ids.len(), logits.device())?, 0)?.to_dtype(DType::F32)?)
    };
    let adj: Vec<_> = live
        .iter()
        .filter(|&&k| sampler::adjusts(wants[k].sampling))
        .map(|&k| (wants[k].row, wants[k].sampling, wants[k].history))
        .collect();
    crossed += adjust(logits, &adj)?;
    let how: Vec<_> = live.iter().map(|&k| (wants[k].row, wants[k].sampling, wants[k].uniform)).collect();
    let (tokens, c) = pick(logits, &how)?;
    crossed += c;
    let mut tops = Vec::new();
    if let Some(before) = before {
        let at = |k: usize| tokens[live.binary_search(&k).expect("a live row")];
        let asked: Vec<_> = lp.iter().map(|&k| (at(k), wants[k].sampling.logprobs.expect("asked"))).collect();
        let (l, c) = logprobs(&before, &asked)?;
        crossed += c;
        tops = l;
    }
    let mut tops = lp.into_iter().zip(tops).peekable();
    for (&k, token) in live.iter().zip(tokens) {
        let logprobs = tops.next_if(|(j, _)| *j == k).map(|(_, l)| l);
        out[k] = Some(Outcome::Token { token, logprobs });
    }
    Ok((out.into_iter().map(|o| o.expect("every want has an outcome")).collect(), crossed))
}

/// The rows `ids` of `t`, a copy (or `t` itself when that is every row in
/// order).
fn rows_of(t: &Tensor, ids: &[usize]) -> Result<Tensor> {
    if ids.len() == t.dim(0)? && ids.iter().enumerate().all(|(i, &r)| i == r) {
        return Ok(t.clone());
    }
    let ids: Vec<u32> = ids.iter().map(|&r| r as u32).collect();
    Ok(t.index_select(&Tensor::from_slice(&ids, ids.len(), t.device())?, 0)?)
}

/// Sets every logit of `rows` (a row, its allowed tokens) that the grammar
/// forbids to -inf, in place. Returns, per row, whether a finite logit is
/// left.
fn forbid(logits: &Tensor, rows: &[(usize, &[u8])]) -> Result<Vec<bool>> {
    let (_, vocab) = logits.dims2()?;
    let dev = logits.device();
    let mut mask = Vec::with_capacity(rows.len() * vocab);
    for (r, a) in rows {
        anyhow::ensure!(a.len() == vocab, "row {r}: a grammar mask of {} ids for {vocab} logits", a.len());
        mask.extend_from_slice(a);
    }
    let mask = Tensor::from_vec(mask, (rows.len(), vocab), dev)?;
    let sel = rows_of(logits, &rows.iter().map(|r| r.0).collect::<Vec<_>>())?;
    let none = Tensor::full(f32::NEG_INFINITY, (rows.len(), vocab), dev)?.to_dtype(logits.dtype())?;
    let masked = mask.where_cond(&sel, &none)?;
    let flat = logits.flatten_all()?;
    for (k, &(r, _)) in rows.iter().enumerate() {
        flat.slice_set(&masked.get(k)?, 0, r * vocab)?;
    }
    let best = masked.max(D::Minus1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(best.into_iter().map(f32::is_finite).collect())
}

/// Applies `logit_bias` and the penalties of `rows` (a row of `logits`
/// `[rows, vocab]`, its sampling, its history) in place on the device, as
/// [`sampler::sample`] applies them to a whole row: the logits they change
/// are fetched, changed on the host and written back. Returns how many
/// logits crossed, each way.
pub fn adjust(logits: &Tensor, rows: &[(usize, &SamplingParams, &sampler::History)]) -> Result<usize> {
    let (n, vocab) = logits.dims2()?;
    anyhow::ensure!(logits.is_contiguous(), "the logits are not contiguous");
    anyhow::ensure!(n * vocab <= u32::MAX as usize, "{n} rows of {vocab} logits are past u32 indices");
    let touched: Vec<(usize, Vec<u32>)> = rows
        .iter()
        .map(|&(r, p, h)| (r, sampler::touched(p, h).into_iter().filter(|&t| (t as usize) < vocab).collect()))
        .collect();
    let at: Vec<u32> = touched.iter().flat_map(|(r, ids)| ids.iter().map(move |&t| (r * vocab) as u32 + t)).collect();
    if at.is_empty() {
        return Ok(0);
    }
    let dev = logits.device();
    let at_t = Tensor::from_slice(&at, at.len(), dev)?;
    let flat = logits.flatten_all()?;
    let now = flat.index_select(&at_t, 0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut new = Vec::with_capacity(at.len());
    let mut cur = now.iter();
    for ((_, ids), &(_, p, h)) in touched.iter().zip(rows) {
        let mut vals: std::collections::HashMap<u32, f32> =
            ids.iter().map(|&t| (t, *cur.next().expect("one value per index"))).collect();
        sampler::adjust_each(p, h, |t, f| {
            if let Some(l) = vals.get_mut(&t) {
                *l = f(*l);
            }
        });
        new.extend(ids.iter().map(|t| vals[t]));
    }
    let src = Tensor::from_vec(new, at.len(), dev)?.to_dtype(logits.dtype())?;
    flat.scatter_set(&at_t, &src, 0)?;
    Ok(at.len())
}

/// Rows of logits cut into blocks of `size`, in f32, the last block of
/// each row padded with -inf: `[rows * blocks, size]`.
struct Blocks {
    t: Tensor,
    size: usize,
    per_row: usize,
    vocab: usize,
}

impl Blocks {
    fn new(x: &Tensor, size: usize) -> Result<Self> {
        let (s, vocab) = x.dims2()?;
        let x = x.to_dtype(DType::F32)?;
        let nb = vocab.div_ceil(size);
        let x = if nb * size > vocab {
            let pad = Tensor::full(f32::NEG_INFINITY, (s, nb * size - vocab), x.device())?;
            Tensor::cat(&[&x, &pad], 1)?
        } else {
            x
        };
        Ok(Blocks { t: x.reshape((s * nb, size))?, size, per_row: nb, vocab })
    }

    /// Each row's block maxima, `[rows][blocks]`.
    fn maxima(&self) -> Result<Vec<Vec<f32>>> {
        let s = self.t.dim(0)? / self.per_row;
        Ok(self.t.max(D::Minus1)?.reshape((s, self.per_row))?.to_vec2::<f32>()?)
    }

    /// The blocks `ids` (row * blocks per row + block), on the host.
    fn fetch(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.t.index_select(&Tensor::from_slice(ids, ids.len(), self.t.device())?, 0)?.to_vec2::<f32>()?)
    }

    /// Appends the tokens of fetched block `id` at or above `floor`.
    fn tokens(&self, id: u32, block: &[f32], floor: f32, out: &mut Vec<(u32, f32)>) {
        let first = (id as usize % self.per_row) * self.size;
        for (e, &l) in block.iter().enumerate() {
            if first + e < self.vocab && l >= floor {
                out.push(((first + e) as u32, l));
            }
        }
    }
}

/// The `k`-th highest of a row's block maxima (-inf when there are no more
/// than `k` blocks): a block below it cannot hold one of the `k` best
/// tokens, ties included.
fn kth_block_max(maxima: &[f32], k: usize) -> f32 {
    if k == 0 || k >= maxima.len() {
        return f32::NEG_INFINITY;
    }
    let mut sorted = maxima.to_vec();
    sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    sorted[k - 1]
}

/// How one sampled row is finished on the host.
enum Plan {
    /// `min_p` or `top_k`: the survivors of the blocks fetched.
    Cut { floor: f32 },
    /// No cut: the token at `rest` along the one block fetched.
    Draw { rest: f32 },
    /// `top_p` alone: the nucleus among the tokens at or above `floor`,
    /// against the row's whole `mass`.
    Nucleus { floor: f32, mass: f32 },
    /// No finite logit: the host's fallback, the first id.
    Nothing,
}

/// The token of each of `rows` (a row of `logits`, its sampling, its
/// uniform draw), `logit_bias` and penalties already applied. Returns them
/// and how many values crossed.
fn pick(logits: &Tensor, rows: &[(usize, &SamplingParams, f32)]) -> Result<(Vec<u32>, usize)> {
    let mut out = vec![0u32; rows.len()];
    let mut crossed = 0;
    let (greedy, drawn): (Vec<usize>, Vec<usize>) = (0..rows.len()).partition(|&k| rows[k].1.temperature <= 0.0);
    if !greedy.is_empty() {
        let ids = rows_of(logits, &greedy.iter().map(|&k| rows[k].0).collect::<Vec<_>>())?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        crossed += ids.len();
        for (&k, id) in greedy.iter().zip(ids) {
            out[k] = id;
        }
    }
    if drawn.is_empty() {
        return Ok((out, crossed));
    }
    let b = Blocks::new(&rows_of(logits, &drawn.iter().map(|&k| rows[k].0).collect::<Vec<_>>())?, BLOCK)?;
    let nb = b.per_row;
    let maxima = b.maxima()?;
    crossed += maxima.len() * nb;
    let max: Vec<f32> = maxima.iter().map(|m| m.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
    // Rows the cuts do not bound by logit: their mass decides.
    let massed: Vec<usize> = (0..drawn.len())
        .filter(|&r| {
            let p = rows[drawn[r]].1;
            max[r].is_finite() && p.min_p <= 0.0 && p.top_k == 0
        })
        .collect();
    let Masses { blocks: sums, bands } = masses(&b, &massed, &max, &|r| rows[drawn[r]].1)?;
    crossed += sums.len() * nb + bands.iter().flatten().count() * BANDS;
    let mut plans = Vec::with_capacity(drawn.len());
    let mut wanted: Vec<u32> = Vec::new();
    let mut counts = Vec::with_capacity(drawn.len());
    let mut massed_at = massed.iter().zip(sums.iter().zip(&bands)).peekable();
    for (r, m) in maxima.iter().enumerate() {
        let (_, p, u) = rows[drawn[r]];
        let first = wanted.len();
        let block = |j: usize| (r * nb + j) as u32;
        let plan = if !max[r].is_finite() {
            Plan::Nothing
        } else if let Some((_, (sums, bands))) = massed_at.next_if(|(j, _)| **j == r) {
            let mass: f32 = sums.iter().sum();
            match bands {
                None => {
                    // The block the draw falls in, then what is left of it.
                    let mut rest = u * mass;
                    let mut at = sums.iter().rposition(|&s| s > 0.0).unwrap_or(0);
                    for (j, &s) in sums.iter().enumerate() {
                        if rest < s {
                            at = j;
                            break;
                        }
                        rest -= s;
                    }
                    wanted.push(block(at));
                    Plan::Draw { rest }
                }
                Some(bands) => {
                    // The band where the nucleus ends, and one more for
                    // rounding at the band's edges.
                    let want = p.top_p * mass;
                    let mut acc = 0.0;
                    let end = bands.iter().position(|&w| {
                        acc += w;
                        acc >= want
                    });
                    let floor = match end {
                        Some(e) if e + 2 < BANDS => max[r] - p.temperature * std::f32::consts::LN_2 * (e + 2) as f32,
                        _ => f32::NEG_INFINITY,
                    };
                    wanted.extend((0..nb).filter(|&j| m[j] >= floor).map(block));
                    Plan::Nucleus { floor, mass }
                }
            }
        } else {
            // Below `floor` a token is cut by `min_p`, or cannot be among
            // the `top_k` best.
            let floor = sampler::min_p_threshold(p, max[r]).max(kth_block_max(m, p.top_k));
            wanted.extend((0..nb).filter(|&j| m[j] >= floor).map(block));
            Plan::Cut { floor }
        };
        plans.push(plan);
        counts.push(first..wanted.len());
    }
    let fetched = b.fetch(&wanted)?;
    crossed += fetched.len() * BLOCK;
    for (r, (plan, range)) in plans.into_iter().zip(counts).enumerate() {
        let (_, p, u) = rows[drawn[r]];
        let mut cand = Vec::new();
        let gather = |floor: f32, cand: &mut Vec<(u32, f32)>| {
            for (block, &id) in fetched[range.clone()].iter().zip(&wanted[range.clone()]) {
                b.tokens(id, block, floor, cand);
            }
        };
        out[drawn[r]] = match plan {
            Plan::Nothing => 0,
            Plan::Cut { floor } => {
                gather(floor, &mut cand);
                sampler::choose_among(cand, max[r], p, None, u)
            }
            Plan::Nucleus { floor, mass } => {
                gather(floor, &mut cand);
                sampler::choose_among(cand, max[r], p, Some(mass), u)
            }
            Plan::Draw { rest } => {
                gather(f32::NEG_INFINITY, &mut cand);
                let inv_t = 1.0 / p.temperature;
                let weights = cand.iter().map(|&(id, l)| (id, ((l - max[r]) * inv_t).exp()));
                sampler::walk(rest, weights).unwrap_or_else(|| {
                    // Rounding left the draw past the block: its best token.
                    cand.iter().max_by(|a, c| a.1.total_cmp(&c.1).then(c.0.cmp(&a.0))).map_or(0, |c| c.0)
                })
            }
        };
    }
    Ok((out, crossed))
}

/// The mass of rows, with the weights the host gives a token,
/// `exp((l - max) / T)`.
struct Masses {
    /// Each row's, by block.
    blocks: Vec<Vec<f32>>,
    /// Each `top_p` row's, by likelihood band.
    bands: Vec<Option<Vec<f32>>>,
}

/// The [`Masses`] of the rows `massed` of `b`, whose highest logits are
/// `max`.
fn masses<'a>(
    b: &Blocks,
    massed: &[usize],
    max: &[f32],
    sampling: &dyn Fn(usize) -> &'a SamplingParams,
) -> Result<Masses> {
    if massed.is_empty() {
        return Ok(Masses { blocks: Vec::new(), bands: Vec::new() });
    }
    let dev = b.t.device();
    let (m, nb) = (massed.len(), b.per_row);
    let width = nb * BLOCK;
    let x = b.t.reshape((b.t.dim(0)? / nb, width))?;
    let x = rows_of(&x, massed)?;
    let top: Vec<f32> = massed.iter().map(|&r| max[r]).collect();
    let inv_t: Vec<f32> = massed.iter().map(|&r| 1.0 / sampling(r).temperature).collect();
    let z =
        x.broadcast_sub(&Tensor::from_vec(top, (m, 1), dev)?)?.broadcast_mul(&Tensor::from_vec(inv_t, (m, 1), dev)?)?;
    let w = z.exp()?;
    let sums = w.reshape((m * nb, BLOCK))?.sum(D::Minus1)?.reshape((m, nb))?.to_vec2::<f32>()?;
    let nucleus: Vec<usize> = (0..m).filter(|&k| sampling(massed[k]).top_p < 1.0).collect();
    let mut bands = vec![None; m];
    if !nucleus.is_empty() {
        let q = nucleus.len();
        let ids: Vec<usize> = nucleus.clone();
        let (z, w) = (rows_of(&z, &ids)?, rows_of(&w, &ids)?);
        // Band of each token: floor(-z / ln 2), the last band past it.
        let band = z.affine(-1.0 / std::f64::consts::LN_2, 0.0)?.floor()?.clamp(0f32, (BANDS - 1) as f32)?;
        let offsets: Vec<f32> = (0..q).map(|k| (k * BANDS) as f32).collect();
        let at = band.broadcast_add(&Tensor::from_vec(offsets, (q, 1), dev)?)?.to_dtype(DType::U32)?.flatten_all()?;
        let per = Tensor::zeros(q * BANDS, DType::F32, dev)?.index_add(&at, &w.flatten_all()?, 0)?;
        let per = per.reshape((q, BANDS))?.to_vec2::<f32>()?;
        for (k, v) in nucleus.into_iter().zip(per) {
            bands[k] = Some(v);
        }
    }
    Ok(Masses { blocks: sums, bands })
}

/// Log-probabilities from `before` `[rows, vocab]` (the logits as they stood
/// before `logit_bias` and the penalties), a row each for `rows` (its
/// chosen token, how many of the most likely it wants). Returns them and
/// how many values crossed.
fn logprobs(before: &Tensor, rows: &[(u32, usize)]) -> Result<(Vec<TokenLogprobs>, usize)> {
    let (n, vocab) = before.dims2()?;
    let dev = before.device();
    let lse = before.log_sum_exp(1)?.to_vec1::<f32>()?;
    let at: Vec<u32> = rows.iter().enumerate().map(|(r, &(c, _))| (r * vocab) as u32 + c).collect();
    let chosen = before.flatten_all()?.index_select(&Tensor::from_slice(&at, n, dev)?, 0)?.to_vec1::<f32>()?;
    let mut crossed = 2 * n;
    let tops: Vec<usize> = (0..n).filter(|&r| rows[r].1 > 0).collect();
    let mut cands: Vec<Vec<(u32, f32)>> = vec![Vec::new(); n];
    if !tops.is_empty() {
        // Blocks of about sqrt(vocab / top) balance the maxima against the
        // blocks fetched.
        let most = tops.iter().map(|&r| rows[r].1).max().unwrap_or(1);
        let size = ((vocab / most) as f64).sqrt().max(1.0) as usize;
        let b = Blocks::new(&rows_of(before, &tops)?, size.next_power_of_two().clamp(16, BLOCK))?;
        let nb = b.per_row;
        let maxima = b.maxima()?;
        crossed += maxima.len() * nb;
        let floors: Vec<f32> = tops.iter().zip(&maxima).map(|(&r, m)| kth_block_max(m, rows[r].1)).collect();
        let wanted: Vec<u32> = floors
            .iter()
            .zip(&maxima)
            .enumerate()
            .flat_map(|(k, (&f, m))| (0..nb).filter(move |&j| m[j] >= f).map(move |j| (k * nb + j) as u32))
            .collect();
        let fetched = b.fetch(&wanted)?;
        crossed += fetched.len() * b.size;
        for (block, &id) in fetched.iter().zip(&wanted) {
            let k = id as usize / nb;
            b.tokens(id, block, floors[k], &mut cands[tops[k]]);
        }
    }
    let out = rows
        .iter()
        .zip(lse.into_iter().zip(chosen))
        .zip(cands)
        .map(|((&(_, top), (lse, c)), cand)| sampler::logprobs_among(lse, c, cand, top))
        .collect();
    Ok((out, crossed))
}

#[cfg(test)]
mod tests;
