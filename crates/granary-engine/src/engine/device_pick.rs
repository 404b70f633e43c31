//! The vocabulary-wide part of the next-token choice on the device, for a
//! step's logits that stay there (the tensor path): only what the choice
//! needs crosses to the host.
//!
//! - Greedy rows: the argmax, one id per row.
//! - Rows whose sampling cuts the distribution with `min_p` or `top_k`:
//!   the row is cut into blocks of [`BLOCK`] logits and each block's
//!   maximum comes back; only the blocks that can hold a survivor follow
//!   (those whose maximum reaches the `min_p` threshold and, with `top_k`,
//!   ranks among the `top_k` highest block maxima, which must hold the
//!   `top_k` best tokens, ties included). The host then makes exactly the
//!   choice it makes from the whole row ([`sampler::choose_among`] on the
//!   same survivors, in the same order, with the same draw).
//! - Rows with `logit_bias` or penalties are changed first where they are
//!   ([`adjust`]): only the logits those change cross, both ways, and the
//!   row then goes on as above.
//! - Every other row (no cut, `top_p` alone, a grammar, `logprobs`) comes
//!   back whole.

use anyhow::Result;
use candle_core::{DType, Tensor, D};

use super::sampler;
use crate::SamplingParams;

/// Logits per block.
pub const BLOCK: usize = 256;

/// One row's share of a step's logits, on the host.
#[derive(Debug)]
pub enum Row {
    /// The whole row.
    Full(Vec<f32>),
    /// The whole row, `logit_bias` and the penalties applied on the device.
    Adjusted(Vec<f32>),
    /// The device's greedy choice.
    Token(u32),
    /// The tokens that can survive the cuts, in id order (those of the
    /// fetched blocks at or above the `min_p` threshold and the k-th highest
    /// block maximum), the row's highest logit, and how many logits crossed
    /// (block maxima included).
    Among { max: f32, cand: Vec<(u32, f32)>, crossed: usize },
}

impl Row {
    /// Logits that crossed to the host for this row.
    pub fn moved(&self) -> usize {
        match self {
            Row::Full(r) | Row::Adjusted(r) => r.len(),
            Row::Token(_) => 1,
            Row::Among { crossed, .. } => *crossed,
        }
    }
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

/// `logits` `[rows, vocab]`; `how[i]`: the sampling of row `i` when the
/// device may do the vocabulary-wide part of it, `None` for a row wanted
/// whole.
pub fn rows(logits: &Tensor, how: &[Option<&SamplingParams>]) -> Result<Vec<Row>> {
    let (n, vocab) = logits.dims2()?;
    anyhow::ensure!(how.len() == n, "{} sampling settings for {n} rows", how.len());
    let dev = logits.device();
    let mut out: Vec<Option<Row>> = (0..n).map(|_| None).collect();
    let pick = |f: &dyn Fn(&SamplingParams) -> bool| -> Vec<u32> {
        (0..n).filter(|&i| how[i].is_some_and(f)).map(|i| i as u32).collect()
    };
    let greedy = pick(&|p| p.temperature <= 0.0);
    let blocked = pick(&|p| p.temperature > 0.0 && (p.min_p > 0.0 || p.top_k > 0));
    let select = |ids: &[u32]| -> Result<Tensor> {
        Ok(if ids.len() == n {
            logits.clone()
        } else {
            logits.index_select(&Tensor::from_slice(ids, ids.len(), dev)?, 0)?
        })
    };
    if !greedy.is_empty() {
        let ids = select(&greedy)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
        for (&i, id) in greedy.iter().zip(ids) {
            out[i as usize] = Some(Row::Token(id));
        }
    }
    if !blocked.is_empty() {
        let x = select(&blocked)?.to_dtype(DType::F32)?;
        let s = blocked.len();
        let nb = vocab.div_ceil(BLOCK);
        let x = if nb * BLOCK > vocab {
            let pad = Tensor::full(f32::NEG_INFINITY, (s, nb * BLOCK - vocab), dev)?;
            Tensor::cat(&[&x, &pad], 1)?
        } else {
            x
        };
        let blocks = x.reshape((s * nb, BLOCK))?;
        let maxima = blocks.max(D::Minus1)?.reshape((s, nb))?.to_vec2::<f32>()?;
        // Per row: its highest logit, its threshold, and the blocks to fetch.
        let mut wanted: Vec<u32> = Vec::new();
        let mut plans = Vec::with_capacity(s);
        for (r, m) in maxima.iter().enumerate() {
            let p = how[blocked[r] as usize].expect("picked above");
            let max = m.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let threshold = sampler::min_p_threshold(p, max);
            let mut floor = threshold;
            if p.top_k > 0 && p.top_k < nb {
                // The k-th highest block maximum: a block below it cannot
                // hold one of the k best tokens.
                let mut sorted = m.clone();
                sorted.select_nth_unstable_by(p.top_k - 1, |a, b| b.total_cmp(a));
                floor = floor.max(sorted[p.top_k - 1]);
            }
            let take: Vec<u32> = (0..nb).filter(|&b| m[b] >= floor).map(|b| (r * nb + b) as u32).collect();
            plans.push((max, floor, take.len()));
            wanted.extend(take);
        }
        let fetched = if wanted.is_empty() {
            Vec::new()
        } else {
            blocks.index_select(&Tensor::from_slice(&wanted, wanted.len(), dev)?, 0)?.to_vec2::<f32>()?
        };
        let mut at = 0;
        // Below `floor` a token is cut by `min_p`, or cannot be among the
        // `top_k` best: the host's choice never reaches it.
        for (r, (max, floor, count)) in plans.into_iter().enumerate() {
            let mut cand = Vec::new();
            for (row, &flat) in fetched[at..at + count].iter().zip(&wanted[at..at + count]) {
                let first = (flat as usize % nb) * BLOCK;
                for (e, &l) in row.iter().enumerate() {
                    if first + e < vocab && l >= floor {
                        cand.push(((first + e) as u32, l));
                    }
                }
            }
            at += count;
            out[blocked[r] as usize] = Some(if max.is_finite() {
                Row::Among { max, cand, crossed: nb + count * BLOCK }
            } else {
                // Nothing finite to draw from: the host's fallback decides.
                Row::Full(select(&[blocked[r]])?.to_dtype(DType::F32)?.to_vec2::<f32>()?.remove(0))
            });
        }
    }
    let whole: Vec<u32> = (0..n).filter(|&i| out[i].is_none()).map(|i| i as u32).collect();
    if !whole.is_empty() {
        let rows = select(&whole)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (&i, row) in whole.iter().zip(rows) {
            out[i as usize] = Some(Row::Full(row));
        }
    }
    Ok(out.into_iter().map(|r| r.expect("every row is filled")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn params(t: f32, k: usize, p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature: t, top_k: k, top_p: p, min_p, ..SamplingParams::default() }
    }

    /// Every kind of row picks, draw for draw, the token the host picks from
    /// the whole row, while far fewer logits cross for the cut rows.
    #[test]
    fn device_rows_choose_as_the_whole_row_does() {
        let vocab = 20_000;
        let mut g = StdRng::seed_from_u64(3);
        // Peaked rows (a few high logits), a flat one, and exact ties.
        let mut data: Vec<Vec<f32>> = (0..5)
            .map(|r| {
                (0..vocab).map(|i| g.random::<f32>() * 4.0 + if i % (3001 + r) == 0 { 6.0 } else { 0.0 }).collect()
            })
            .collect();
        data.push(vec![0.5; vocab]);
        let settings = [
            params(0.0, 0, 1.0, 0.0),
            params(0.8, 40, 0.95, 0.05),
            params(1.0, 5, 1.0, 0.0),
            params(0.7, 0, 1.0, 0.1),
            params(1.3, 0, 0.9, 0.0),
            params(1.0, 0, 1.0, 0.0),
            params(0.6, 3, 0.5, 0.02),
        ];
        let flat: Vec<f32> = data.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (data.len(), vocab), &Device::Cpu).unwrap();
        for p in &settings {
            let how: Vec<_> = (0..data.len()).map(|_| Some(p)).collect();
            let rows = rows(&logits, &how).unwrap();
            for (r, row) in rows.iter().enumerate() {
                if p.temperature > 0.0 && (p.min_p > 0.0 || p.top_k > 0) && r < 5 {
                    assert!(row.moved() < vocab / 4, "{p:?} row {r}: {} logits crossed", row.moved());
                }
                for seed in 0..40 {
                    let h = sampler::History::default();
                    let want = sampler::sample(&data[r], p, &h, &mut StdRng::seed_from_u64(seed));
                    let mut rng = StdRng::seed_from_u64(seed);
                    let got = match row {
                        Row::Token(t) => *t,
                        Row::Full(l) => sampler::sample(l, p, &h, &mut rng),
                        Row::Adjusted(l) => sampler::choose(l, p, &mut rng),
                        Row::Among { max, cand, .. } => sampler::choose_among(cand.clone(), *max, p, &mut rng),
                    };
                    assert_eq!(got, want, "{p:?}, row {r}, seed {seed}");
                }
            }
        }
        // A row wanted whole comes back whole.
        let how = vec![None; data.len()];
        assert!(rows(&logits, &how).unwrap().iter().all(|r| matches!(r, Row::Full(l) if l.len() == vocab)));
    }

    /// Rows with `logit_bias` and penalties, changed on the device, choose
    /// draw for draw what the host chooses from the whole row, and only
    /// the changed logits cross for them.
    #[test]
    fn rows_adjusted_on_the_device_choose_as_the_host_does() {
        let vocab = 20_000;
        let mut g = StdRng::seed_from_u64(9);
        // Peaked rows: a few high logits, which the histories then hold.
        let data: Vec<Vec<f32>> = (0..4)
            .map(|r| {
                (0..vocab).map(|i| g.random::<f32>() * 4.0 + if i % (1999 + r) == 0 { 6.0 } else { 0.0 }).collect()
            })
            .collect();
        let prompt: Vec<u32> = (0..50).map(|i| i * 37 % vocab as u32).collect();
        let settings = [
            SamplingParams { temperature: 0.0, logit_bias: vec![(7, 100.0)], ..SamplingParams::default() },
            SamplingParams {
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.7,
                logit_bias: vec![(3, -100.0), (vocab as u32 + 5, 1.0), (11, 2.0), (11, 1.5)],
                ..params(0.8, 40, 0.95, 0.05)
            },
            SamplingParams { frequency_penalty: 1.0, ..params(1.0, 0, 1.0, 0.0) },
            SamplingParams { repetition_penalty: 0.8, ..params(0.7, 0, 1.0, 0.1) },
            SamplingParams { presence_penalty: -2.0, ..params(0.0, 0, 1.0, 0.0) },
        ];
        for p in &settings {
            // Each row's history holds its own best tokens, some twice, so
            // that the penalties change the choice.
            let hist: Vec<sampler::History> = data
                .iter()
                .map(|row| {
                    let mut h = sampler::History::new(p, &prompt);
                    let mut best: Vec<u32> = (0..vocab as u32).collect();
                    best.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
                    for (i, &t) in best[..6].iter().enumerate() {
                        h.push(t);
                        if i % 2 == 0 {
                            h.push(t);
                        }
                    }
                    h
                })
                .collect();
            let flat: Vec<f32> = data.iter().flatten().copied().collect();
            let logits = Tensor::from_vec(flat, (data.len(), vocab), &Device::Cpu).unwrap();
            let adj: Vec<_> = (0..data.len()).map(|r| (r, p, &hist[r])).collect();
            let fetched = adjust(&logits, &adj).unwrap();
            let touched: usize =
                hist.iter().map(|h| sampler::touched(p, h).iter().filter(|&&t| (t as usize) < vocab).count()).sum();
            assert_eq!(fetched, touched, "{p:?}");
            let how: Vec<_> = (0..data.len()).map(|_| Some(p)).collect();
            let rows = rows(&logits, &how).unwrap();
            for (r, row) in rows.into_iter().enumerate() {
                if p.temperature > 0.0 && (p.min_p > 0.0 || p.top_k > 0) {
                    assert!(row.moved() < vocab / 4, "{p:?} row {r}: {} logits crossed", row.moved());
                }
                for seed in 0..40 {
                    let want = sampler::sample(&data[r], p, &hist[r], &mut StdRng::seed_from_u64(seed));
                    let mut rng = StdRng::seed_from_u64(seed);
                    let got = match &row {
                        Row::Token(t) => *t,
                        Row::Full(l) | Row::Adjusted(l) => sampler::choose(l, p, &mut rng),
                        Row::Among { max, cand, .. } => sampler::choose_among(cand.clone(), *max, p, &mut rng),
                    };
                    assert_eq!(got, want, "{p:?}, row {r}, seed {seed}");
                }
            }
        }
    }
}
