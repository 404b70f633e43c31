//! Next-token choice from logits (see [`SamplingParams`] for the order in
//! which the settings apply).
//!
//! The cuts never sort or exponentiate the whole vocabulary when they can
//! avoid it (150k-token vocabularies): `min_p` is a threshold on logits
//! (`p >= min_p * p_max` is `l >= l_max + T ln(min_p)`), `top_k` a
//! partial selection, and `top_p` sorts only the candidates left (or, on
//! its own, grows a partial selection until it holds the mass).

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::Rng;

use crate::{SamplingParams, TokenLogprobs};

/// What a sequence has seen, for the penalties.
#[derive(Debug, Default, Clone)]
pub struct History {
    /// Occurrences of each token in the output so far.
    output: HashMap<u32, u32>,
    /// Tokens of the prompt (repetition penalty only).
    prompt: std::collections::HashSet<u32>,
}

impl History {
    pub fn new(p: &SamplingParams, prompt: &[u32]) -> Self {
        let prompt = if p.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { Default::default() };
        History { output: HashMap::new(), prompt }
    }

    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }
}

/// Whether `p` changes any logit before the choice.
pub fn adjusts(p: &SamplingParams) -> bool {
    !p.logit_bias.is_empty() || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 || p.repetition_penalty != 1.0
}

/// Applies `logit_bias` and the penalties in place.
fn adjust(logits: &mut [f32], p: &SamplingParams, h: &History) {
    adjust_each(p, h, |t, f| {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f(*l);
        }
    });
}

/// The tokens whose logits `logit_bias` and the penalties change, sorted,
/// once each.
pub fn touched(p: &SamplingParams, h: &History) -> Vec<u32> {
    let mut ids: Vec<u32> = p.logit_bias.iter().map(|&(id, _)| id).collect();
    if p.repetition_penalty != 1.0 {
        ids.extend(h.prompt.iter().copied());
    }
    if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        ids.extend(h.output.keys().copied());
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// `logit_bias`, then the repetition penalty, then the presence and
/// frequency penalties: `apply(token, change)` for every change, in the
/// order they apply. The host applies them to a whole row, the device path
/// to the [`touched`] logits it fetched ([`super::device_pick::adjust`]):
/// the same operations, so the same values.
pub fn adjust_each(p: &SamplingParams, h: &History, mut apply: impl FnMut(u32, &dyn Fn(f32) -> f32)) {
    for &(id, bias) in &p.logit_bias {
        apply(id, &|l| l + bias);
    }
    if p.repetition_penalty != 1.0 {
        let r = p.repetition_penalty;
        let seen = h.prompt.iter().chain(h.output.keys().filter(|t| !h.prompt.contains(t)));
        for &t in seen {
            apply(t, &|l| if l > 0.0 { l / r } else { l * r });
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for (&t, &n) in &h.output {
            let by = p.presence_penalty + p.frequency_penalty * n as f32;
            apply(t, &|l| l - by);
        }
    }
}

/// Chooses the next token.
pub fn sample(logits: &[f32], p: &SamplingParams, h: &History, rng: &mut StdRng) -> u32 {
    if !adjusts(p) {
        return choose(logits, p, rng);
    }
    let mut adjusted = logits.to_vec();
    adjust(&mut adjusted, p, h);
    choose(&adjusted, p, rng)
}

/// Chooses the next token from logits `logit_bias` and the penalties were
/// already applied to.
pub fn choose(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> u32 {
    if p.temperature <= 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return argmax(logits);
    }
    let t = p.temperature;
    if !cuts(p) {
        // No cut: draw from the whole distribution.
        let inv_t = 1.0 / t;
        let total: f32 = logits.iter().map(|&l| ((l - max) * inv_t).exp()).sum();
        let weights = logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l - max) * inv_t).exp()));
        return walk(rng.random::<f32>() * total, weights).unwrap_or_else(|| argmax(logits));
    }
    let threshold = min_p_threshold(p, max);
    let cand: Vec<(u32, f32)> =
        logits.iter().enumerate().filter(|(_, &l)| l >= threshold).map(|(i, &l)| (i as u32, l)).collect();
    choose_among(cand, max, p, None, rng.random::<f32>())
}

/// The token at `r` along `weights` (`r` a uniform draw times their sum):
/// the first whose weight exceeds what is left of `r`. `None` when
/// rounding leaves `r` past the end.
pub fn walk(mut r: f32, weights: impl IntoIterator<Item = (u32, f32)>) -> Option<u32> {
    for (id, w) in weights {
        if r < w {
            return Some(id);
        }
        r -= w;
    }
    None
}

/// Whether `p` cuts the distribution (`top_k`, `top_p` or `min_p`).
pub fn cuts(p: &SamplingParams) -> bool {
    p.top_k > 0 || p.min_p > 0.0 || p.top_p < 1.0
}

/// The lowest logit `min_p` keeps, given the row's highest (`-inf`
/// without `min_p`): `p >= min_p * p_max` is `l >= l_max + T ln(min_p)`.
pub fn min_p_threshold(p: &SamplingParams, max: f32) -> f32 {
    if p.min_p > 0.0 {
        max + p.temperature * p.min_p.ln()
    } else {
        f32::NEG_INFINITY
    }
}

/// The choice among `cand`: every token whose logit is at or above
/// [`min_p_threshold`], in id order, with `max` the row's highest logit
/// (`temperature > 0` and [`cuts`]); with `top_k`, tokens that cannot be
/// among the `top_k` best may be left out. The result depends only on
/// that, not on how the set was found: the host passes a whole row's
/// survivors, the device path ([`super::device_pick`]) those of the blocks
/// that can hold one. With `top_p` alone, `cand` may leave out tokens the
/// nucleus cannot hold if `mass` is then the whole row's (the sum of
/// `exp((l - max) / T)` over every token). `u`: the uniform draw.
pub fn choose_among(mut cand: Vec<(u32, f32)>, max: f32, p: &SamplingParams, mass: Option<f32>, u: f32) -> u32 {
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && cand.len() > p.top_k {
        cand.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
        cand.truncate(p.top_k);
    }
    let inv_t = 1.0 / p.temperature;
    if p.top_p < 1.0 {
        let total: f32 = mass.unwrap_or_else(|| cand.iter().map(|&(_, l)| ((l - max) * inv_t).exp()).sum());
        let want = p.top_p * total;
        // Grow a sorted prefix until it holds `top_p` of the mass.
        let mut k = cand.len().min(64);
        loop {
            if k < cand.len() {
                cand.select_nth_unstable_by(k - 1, by_logit_desc);
            }
            cand[..k].sort_unstable_by(by_logit_desc);
            let mut acc = 0.0;
            let mut keep = None;
            for (i, &(_, l)) in cand[..k].iter().enumerate() {
                acc += ((l - max) * inv_t).exp();
                if acc >= want {
                    keep = Some(i + 1);
                    break;
                }
            }
            match keep {
                Some(n) => {
                    cand.truncate(n);
                    break;
                }
                None if k >= cand.len() => break,
                None => k = (k * 4).min(cand.len()),
            }
        }
    }
    // The draw walks the survivors in id order, whatever order the cuts
    // left them in.
    if !cand.is_sorted_by_key(|c| c.0) {
        cand.sort_unstable_by_key(|c| c.0);
    }
    let weights: Vec<f32> = cand.iter().map(|&(_, l)| ((l - max) * inv_t).exp()).collect();
    let total: f32 = weights.iter().sum();
    walk(u * total, cand.iter().zip(&weights).map(|(&(id, _), &w)| (id, w)))
        .unwrap_or_else(|| cand.iter().max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0))).map_or(0, |c| c.0))
}

/// Log probabilities of `chosen` and the `top` most likely tokens, from the
/// raw logits (log-softmax).
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let at = logits.get(chosen as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let all = if top > 0 { logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect() } else { Vec::new() };
    logprobs_among(lse, at, all, top)
}

/// [`logprobs`] from the row's log-sum-exp `lse`, the chosen token's logit
/// and `cand`: tokens that hold the `top` most likely (ties included).
pub fn logprobs_among(lse: f32, chosen: f32, mut cand: Vec<(u32, f32)>, top: usize) -> TokenLogprobs {
    let by = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = top.min(cand.len());
    if k < cand.len() {
        if k > 0 {
            cand.select_nth_unstable_by(k - 1, by);
        }
        cand.truncate(k);
    }
    cand.sort_unstable_by(by);
    TokenLogprobs { logprob: chosen - lse, top: cand.into_iter().map(|(i, l)| (i, l - lse)).collect() }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    fn draws(logits: &[f32], p: &SamplingParams, n: usize, seed: u64) -> Vec<u32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let h = History::new(p, &[]);
        (0..n).map(|_| sample(logits, p, &h, &mut rng)).collect()
    }

    #[test]
    fn greedy_takes_the_highest_logit() {
        let p = SamplingParams::greedy();
        assert_eq!(draws(&[0.1, 3.0, -1.0, 2.9], &p, 1, 0), [1]);
    }

    #[test]
    fn top_p_excludes_the_tail_and_seed_repeats() {
        // Token 0 holds ~88% of the mass: top_p 0.5 must always pick it.
        let logits = [4.0, 2.0, 0.0, 0.0];
        let p = params(|p| p.top_p = 0.5);
        assert!(draws(&logits, &p, 200, 7).iter().all(|&t| t == 0));
        let p = params(|p| p.temperature = 1.5);
        assert_eq!(draws(&logits, &p, 64, 1), draws(&logits, &p, 64, 1));
        assert_ne!(draws(&logits, &p, 64, 1), draws(&logits, &p, 64, 2));
        assert!(draws(&logits, &p, 64, 3).iter().any(|&t| t != 0), "temperature sampling never left the mode");
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let logits: Vec<f32> = (0..1000).map(|i| (i % 97) as f32 * 0.01).collect();
        // The three highest logits are 0.96 (ids 96, 193, 290, ...): top_k 3
        // keeps the three lowest ids among them (ties by id).
        let p = params(|p| p.top_k = 3);
        let got = draws(&logits, &p, 500, 5);
        assert!(got.iter().all(|t| [96, 193, 290].contains(t)), "{:?}", &got[..20]);
        assert!([96, 193, 290].iter().all(|t| got.contains(t)), "every kept token is drawn sometimes");
    }

    #[test]
    fn min_p_drops_the_unlikely() {
        // p(1)/p(0) = e^-3 ~ 0.05 < 0.1: token 1 never survives min_p 0.1;
        // token 2 (e^-0.5 ~ 0.6) does.
        let logits = [5.0, 2.0, 4.5];
        let p = params(|p| p.min_p = 0.1);
        let got = draws(&logits, &p, 500, 9);
        assert!(!got.contains(&1));
        assert!(got.contains(&0) && got.contains(&2));
        // The same cut at temperature 2: the threshold scales with T.
        let p = params(|p| {
            p.min_p = 0.1;
            p.temperature = 2.0
        });
        assert!(draws(&logits, &p, 2000, 9).contains(&1), "at T=2, p(1)/p(0) = e^-1.5 > 0.1");
    }

    #[test]
    fn top_p_alone_grows_its_selection_over_a_large_vocabulary() {
        // A flat vocabulary of 10,000: top_p 0.5 keeps about half of it
        // (ids 0..5000 rank first among equal logits).
        let logits = vec![0.0f32; 10_000];
        let p = params(|p| p.top_p = 0.5);
        let got = draws(&logits, &p, 2000, 11);
        assert!(got.iter().all(|&t| t < 5001), "{:?}", got.iter().max());
        assert!(got.iter().any(|&t| t > 4000), "the selection grew past its first 64");
    }

    #[test]
    fn logit_bias_and_penalties_move_the_choice() {
        let logits = [1.0, 0.9, 0.0];
        let greedy_with = |f: &dyn Fn(&mut SamplingParams), out: &[u32]| {
            let mut p = SamplingParams::greedy();
            f(&mut p);
            let mut h = History::new(&p, &[]);
            for &t in out {
                h.push(t);
            }
            sample(&logits, &p, &h, &mut StdRng::seed_from_u64(0))
        };
        assert_eq!(greedy_with(&|_| {}, &[]), 0);
        assert_eq!(greedy_with(&|p| p.logit_bias = vec![(2, 100.0)], &[]), 2);
        assert_eq!(greedy_with(&|p| p.logit_bias = vec![(0, -100.0)], &[]), 1);
        assert_eq!(greedy_with(&|p| p.presence_penalty = 0.2, &[0]), 1);
        assert_eq!(greedy_with(&|p| p.presence_penalty = 0.2, &[1]), 0);
        // Frequency: 0.05 per occurrence; two occurrences of 0 cost 0.1 > 0.1 - eps.
        assert_eq!(greedy_with(&|p| p.frequency_penalty = 0.06, &[0]), 0);
        assert_eq!(greedy_with(&|p| p.frequency_penalty = 0.06, &[0, 0]), 1);
        assert_eq!(greedy_with(&|p| p.repetition_penalty = 1.2, &[0]), 1);
        // The repetition penalty also covers the prompt.
        let mut p = SamplingParams::greedy();
        p.repetition_penalty = 1.2;
        let h = History::new(&p, &[0]);
        assert_eq!(sample(&logits, &p, &h, &mut StdRng::seed_from_u64(0)), 1);
    }

    #[test]
    fn logprobs_are_a_log_softmax() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let lp = logprobs(&logits, 1, 2);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (1.0f32.exp() / z).ln()).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
        assert!((lp.top[0].1 - (2.0f32.exp() / z).ln()).abs() < 1e-5);
        assert!(logprobs(&logits, 3, 0).top.is_empty());
    }
}
