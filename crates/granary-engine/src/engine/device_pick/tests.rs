use super::*;
use candle_core::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn params(t: f32, k: usize, p: f32, min_p: f32) -> SamplingParams {
    SamplingParams { temperature: t, top_k: k, top_p: p, min_p, ..SamplingParams::default() }
}

const VOCAB: usize = 20_000;

/// Rows over a long tail: a few raised logits each, and one flat row.
fn rough_rows(seed: u64) -> Vec<Vec<f32>> {
    let mut g = StdRng::seed_from_u64(seed);
    let mut data: Vec<Vec<f32>> = (0..5)
        .map(|r| (0..VOCAB).map(|i| g.random::<f32>() * 4.0 + if i % (3001 + r) == 0 { 6.0 } else { 0.0 }).collect())
        .collect();
    data.push(vec![0.5; VOCAB]);
    data
}

/// Rows of thousands of exact ties at every level.
fn tied_rows() -> Vec<Vec<f32>> {
    vec![(0..VOCAB).map(|i| (i % 7) as f32).collect(), (0..VOCAB).map(|i| (i % 3) as f32 * 0.25).collect()]
}

/// Rows shaped as a model's usually are: a few likely tokens far above a
/// tail of unlikely ones.
fn model_rows(seed: u64) -> Vec<Vec<f32>> {
    let mut g = StdRng::seed_from_u64(seed);
    (0..4)
        .map(|r| {
            (0..VOCAB)
                .map(|i| {
                    let tail = (g.random::<f32>() + g.random::<f32>() + g.random::<f32>() - 1.5) * 2.0;
                    tail + if i % (4001 + 17 * r) == 5 { 16.0 } else { 0.0 }
                })
                .collect()
        })
        .collect()
}

/// Half the tokens of every row, chosen at random, allowed.
fn grammar_masks(rows: usize, seed: u64) -> Vec<Option<Vec<u8>>> {
    let mut g = StdRng::seed_from_u64(seed);
    (0..rows).map(|_| Some((0..VOCAB).map(|_| g.random_bool(0.5) as u8).collect())).collect()
}

/// What the host chooses from a whole row: the grammar's mask, then
/// `logprobs` from the masked row, then the sampler.
fn on_host(
    row: &[f32],
    allowed: Option<&[u8]>,
    p: &SamplingParams,
    h: &sampler::History,
    seed: u64,
) -> (u32, Option<TokenLogprobs>) {
    let mut row = row.to_vec();
    if let Some(a) = allowed {
        for (l, &ok) in row.iter_mut().zip(a) {
            if ok == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    let tok = sampler::sample(&row, p, h, &mut StdRng::seed_from_u64(seed));
    (tok, p.logprobs.map(|k| sampler::logprobs(&row, tok, k)))
}

/// The device's choices for every row, with the same seed's uniform draw.
fn on_device(
    data: &[Vec<f32>],
    allowed: &[Option<Vec<u8>>],
    p: &SamplingParams,
    hist: &[sampler::History],
    seed: u64,
) -> (Vec<Outcome>, usize) {
    let flat: Vec<f32> = data.iter().flatten().copied().collect();
    let logits = Tensor::from_vec(flat, (data.len(), VOCAB), &Device::Cpu).unwrap();
    let u = StdRng::seed_from_u64(seed).random::<f32>();
    let wants: Vec<Want> = (0..data.len())
        .map(|r| Want {
            row: r,
            sampling: p,
            history: &hist[r],
            allowed: allowed[r].clone(),
            uniform: if p.temperature > 0.0 { u } else { 0.0 },
        })
        .collect();
    choose(&logits, &wants).unwrap()
}

/// Whether the device's choice for `p` is the host's exactly (the others
/// sum their mass in another order).
fn exact(p: &SamplingParams) -> bool {
    p.temperature <= 0.0 || p.min_p > 0.0 || p.top_k > 0
}

/// Compares the device with the host over `seeds` draws of every row;
/// returns (draws, draws that differ).
fn compare(
    data: &[Vec<f32>],
    allowed: &[Option<Vec<u8>>],
    p: &SamplingParams,
    hist: &[sampler::History],
    seeds: u64,
) -> (usize, usize) {
    let (mut draws, mut differ) = (0, 0);
    for seed in 0..seeds {
        let (got, _) = on_device(data, allowed, p, hist, seed);
        for (r, out) in got.into_iter().enumerate() {
            let (want, want_lp) = on_host(&data[r], allowed[r].as_deref(), p, &hist[r], seed);
            let Outcome::Token { token, logprobs } = out else { panic!("{p:?} row {r}: {out:?}") };
            draws += 1;
            if token != want {
                assert!(!exact(p), "{p:?}, row {r}, seed {seed}: {token} where the host chose {want}");
                differ += 1;
                continue;
            }
            match (logprobs, want_lp) {
                (None, None) => {}
                (Some(g), Some(w)) => {
                    assert!((g.logprob - w.logprob).abs() < 1e-3, "{p:?} row {r}: {} vs {}", g.logprob, w.logprob);
                    assert_eq!(g.top.len(), w.top.len(), "{p:?} row {r}");
                    for (a, b) in g.top.iter().zip(&w.top) {
                        assert_eq!(a.0, b.0, "{p:?} row {r}: top tokens {:?} vs {:?}", g.top, w.top);
                        assert!((a.1 - b.1).abs() < 1e-3, "{p:?} row {r}: {:?} vs {:?}", g.top, w.top);
                    }
                }
                (g, w) => panic!("{p:?} row {r}: logprobs {g:?} where the host gave {w:?}"),
            }
        }
    }
    (draws, differ)
}

fn settings() -> Vec<SamplingParams> {
    vec![
        params(0.0, 0, 1.0, 0.0),
        params(0.8, 40, 0.95, 0.05),
        params(1.0, 5, 1.0, 0.0),
        params(0.7, 0, 1.0, 0.1),
        params(0.6, 3, 0.5, 0.02),
        params(1.3, 0, 0.9, 0.0),
        params(1.0, 0, 1.0, 0.0),
        params(0.5, 0, 0.5, 0.0),
        SamplingParams { logprobs: Some(5), ..params(0.0, 0, 1.0, 0.0) },
        SamplingParams { logprobs: Some(3), ..params(0.8, 40, 0.95, 0.05) },
        SamplingParams { logprobs: Some(0), ..params(1.0, 0, 0.9, 0.0) },
        SamplingParams { logprobs: Some(20), ..params(1.0, 0, 1.0, 0.0) },
    ]
}

/// Every kind of row, with and without a grammar and `logprobs`, chooses on
/// the device what the host chooses from the whole row: draw for draw
/// where the cuts bound the row by logit, and all but a rounding's share
/// of draws where its mass decides. Log-probabilities match.
#[test]
fn the_device_chooses_as_the_host_does() {
    // Over thousands of exact ties the edge of the nucleus is itself within
    // rounding: only rows the cuts bound by logit are compared there.
    for (data, ties) in [(rough_rows(3), false), (model_rows(4), false), (tied_rows(), true)] {
        let hist = vec![sampler::History::default(); data.len()];
        for masks in [vec![None; data.len()], grammar_masks(data.len(), 5)] {
            for p in settings().into_iter().filter(|p| !ties || exact(p)) {
                let (draws, differ) = compare(&data, &masks, &p, &hist, 40);
                assert!(differ * 50 <= draws, "{p:?}: {differ} of {draws} draws differ from the host's");
            }
        }
    }
}

/// On rows shaped as a model's, no kind of row brings its logits to the
/// host: what crosses is a small share of the rows, whatever the settings.
#[test]
fn rows_shaped_as_a_models_cross_a_small_share() {
    let data = model_rows(8);
    let hist = vec![sampler::History::default(); data.len()];
    for masks in [vec![None; data.len()], grammar_masks(data.len(), 9)] {
        for p in settings() {
            let (_, crossed) = on_device(&data, &masks, &p, &hist, 1);
            let whole = data.len() * VOCAB;
            let grammar = if masks[0].is_some() { "grammar" } else { "no grammar" };
            eprintln!(
                "T {} top_k {} top_p {} min_p {} logprobs {:?}, {grammar}: {:.2}% of the logits crossed",
                p.temperature,
                p.top_k,
                p.top_p,
                p.min_p,
                p.logprobs,
                100.0 * crossed as f64 / whole as f64
            );
            assert!(crossed * 5 < whole, "{p:?}: {crossed} of {whole} logits crossed");
        }
    }
}

/// A row whose grammar allows only tokens the model rules out fails, as on
/// the host; the other rows go on.
#[test]
fn a_grammar_that_leaves_nothing_fails_its_row_alone() {
    let mut data = model_rows(2);
    let mut allowed = vec![0u8; VOCAB];
    for id in 0..10 {
        data[0][id] = f32::NEG_INFINITY;
        allowed[id] = 1;
    }
    let masks: Vec<_> = (0..data.len()).map(|r| (r == 0).then(|| allowed.clone())).collect();
    let hist = vec![sampler::History::default(); data.len()];
    let p = params(0.8, 40, 0.95, 0.05);
    let (got, _) = on_device(&data, &masks, &p, &hist, 0);
    assert!(matches!(&got[0], Outcome::Failed(e) if e.contains("allows no token")), "{:?}", got[0]);
    assert!(got[1..].iter().all(|o| matches!(o, Outcome::Token { .. })), "{got:?}");
}

/// Rows with `logit_bias` and penalties, changed on the device, choose
/// what the host chooses from the whole row, and their `logprobs` are
/// those of the logits before the change, as on the host.
#[test]
fn rows_adjusted_on_the_device_choose_as_the_host_does() {
    let data = rough_rows(9);
    let prompt: Vec<u32> = (0..50).map(|i| i * 37 % VOCAB as u32).collect();
    let settings = [
        SamplingParams { temperature: 0.0, logit_bias: vec![(7, 100.0)], ..SamplingParams::default() },
        SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.7,
            logit_bias: vec![(3, -100.0), (VOCAB as u32 + 5, 1.0), (11, 2.0), (11, 1.5)],
            logprobs: Some(4),
            ..params(0.8, 40, 0.95, 0.05)
        },
        SamplingParams { frequency_penalty: 1.0, ..params(1.0, 0, 1.0, 0.0) },
        SamplingParams { repetition_penalty: 0.8, ..params(0.7, 0, 1.0, 0.1) },
        SamplingParams { presence_penalty: -2.0, logprobs: Some(2), ..params(0.0, 0, 1.0, 0.0) },
        SamplingParams { presence_penalty: 1.5, ..params(1.2, 0, 0.8, 0.0) },
    ];
    for p in &settings {
        // Each row's history holds its own best tokens, some twice, so that
        // the penalties change the choice.
        let hist: Vec<sampler::History> = data
            .iter()
            .map(|row| {
                let mut h = sampler::History::new(p, &prompt);
                let mut best: Vec<u32> = (0..VOCAB as u32).collect();
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
        let masks = vec![None; data.len()];
        let (draws, differ) = compare(&data, &masks, p, &hist, 40);
        assert!(differ * 50 <= draws, "{p:?}: {differ} of {draws} draws differ from the host's");
        let touched: usize =
            hist.iter().map(|h| sampler::touched(p, h).iter().filter(|&&t| (t as usize) < VOCAB).count()).sum();
        let flat: Vec<f32> = data.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (data.len(), VOCAB), &Device::Cpu).unwrap();
        let adj: Vec<_> = (0..data.len()).map(|r| (r, p, &hist[r])).collect();
        assert_eq!(adjust(&logits, &adj).unwrap(), touched, "{p:?}");
    }
}
