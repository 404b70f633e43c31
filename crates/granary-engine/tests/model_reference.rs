//! The forward pass against llama.cpp: first-step logits and 32 greedy
//! tokens for the fixture's prompts (values written by
//! `scripts/reference/llama_cpp_reference.py`, never by this engine).

mod common;

use granary_engine::model::{Chunk, LoadOptions, Model};

/// Largest allowed |engine − llama.cpp| over the reference's 128 highest
/// first-step logits, for the plain-text prompts (measured worst: 0.51).
/// Both sides quantize differently (llama.cpp multiplies Q4_1 weights by
/// Q8-quantized activations; the engine dequantizes for prefill), so they
/// agree closely but not bit for bit.
const LOGIT_TOLERANCE: f32 = 0.75;

/// The chat prompt is ill-conditioned: llama.cpp itself moves some of its
/// top-128 logits by over 2.0 between `n_batch = 512` and `n_batch = 1` on
/// it. There the check is the top token and its logit only.
fn is_chat(prompt: &str) -> bool {
    prompt.starts_with("<|im_start|>")
}

/// Checks logits and returns, per prompt, how many of the 32 greedy tokens
/// agree with llama.cpp before the first difference.
fn check(model: &Model, label: &str) -> Vec<usize> {
    let fx = common::fixture();
    let mut agree = Vec::new();
    let mut worst = 0f32;
    for case in &fx.generate {
        let mut kv = model.new_kv(256);
        let logits = model.forward(&mut [Chunk { tokens: &case.prompt_ids, kv: &mut kv, logits: true }]).unwrap();
        let row = logits.unwrap().to_vec2::<f32>().unwrap().remove(0);
        let first = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        assert_eq!(first, case.top_logits[0].0, "{label} {:?}: top token differs", case.prompt);
        let checked = if is_chat(&case.prompt) { &case.top_logits[..1] } else { &case.top_logits[..] };
        for &(id, want) in checked {
            let d = (row[id as usize] - want).abs();
            worst = worst.max(d);
            assert!(d <= LOGIT_TOLERANCE, "{label} {:?}: logit of {id} is {} vs {want}", case.prompt, row[id as usize]);
        }
        let mut got = vec![first];
        while got.len() < case.greedy_ids.len() {
            let last = [*got.last().unwrap()];
            let l = model.forward(&mut [Chunk { tokens: &last, kv: &mut kv, logits: true }]).unwrap().unwrap();
            got.push(Model::argmax(&l).unwrap()[0]);
        }
        agree.push(got.iter().zip(&case.greedy_ids).take_while(|(a, b)| a == b).count());
    }
    eprintln!("{label}: worst logit difference {worst:.3} (tolerance {LOGIT_TOLERANCE}); greedy tokens agreeing per prompt {agree:?} of 32");
    agree
}

/// With the GGUF's own tensors in every matmul (what llama.cpp multiplies),
/// the continuation of "The capital of France is" is llama.cpp's for all 32
/// tokens; the other prompts agree until a near tie (llama.cpp's own top two
/// there are closer than its batch-size noise).
#[test]
fn native_weights_match_llama_cpp_logits_and_greedy_tokens() {
    let Some(path) = common::default_model() else { return };
    let opts = LoadOptions { native_quant: true, ..LoadOptions::default() };
    let agree = check(&Model::load(&path, &opts).unwrap(), "native");
    assert_eq!(agree[0], 32, "\"The capital of France is\" must continue exactly as llama.cpp");
    assert!(agree.iter().all(|&n| n >= 2), "{agree:?}");
}

/// The serving layout (dequantized prefill, Q8_0 decode) keeps the same
/// logit tolerance; greedy text parts from llama.cpp at the first near tie.
#[test]
fn serving_weights_match_llama_cpp_logits() {
    let Some(path) = common::default_model() else { return };
    let agree = check(&Model::load(&path, &LoadOptions::default()).unwrap(), "serving");
    assert!(agree.iter().all(|&n| n >= 2), "serving weights part from llama.cpp too early: {agree:?}");
}

/// One chunk, token by token, and two chunks give the same last logits
/// (the causal mask, the KV writes and the rotary offsets agree).
#[test]
fn chunked_prefill_and_token_by_token_agree() {
    let Some(path) = common::default_model() else { return };
    let opts = LoadOptions { quantized_decode: false, ..LoadOptions::default() };
    let model = Model::load(&path, &opts).unwrap();
    let ids: Vec<u32> = common::fixture().generate.iter().flat_map(|c| c.prompt_ids.clone()).collect();
    let last = |chunks: &[&[u32]]| {
        let mut kv = model.new_kv(16);
        let mut out = None;
        for (i, c) in chunks.iter().enumerate() {
            let want = i + 1 == chunks.len();
            out = model.forward(&mut [Chunk { tokens: c, kv: &mut kv, logits: want }]).unwrap();
        }
        assert_eq!(kv.len(), ids.len());
        out.unwrap().to_vec2::<f32>().unwrap().remove(0)
    };
    let one = last(&[&ids]);
    let singles: Vec<&[u32]> = ids.chunks(1).collect();
    let halves: Vec<&[u32]> = ids.chunks(ids.len() / 2 + 1).collect();
    for (name, other) in [("token by token", last(&singles)), ("two chunks", last(&halves))] {
        let worst = one.iter().zip(&other).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 0.02, "{name}: logits differ from one chunk by {worst}");
    }
}
