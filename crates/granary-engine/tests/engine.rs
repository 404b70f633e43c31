//! The step loop with the real default model: batching gives the same
//! tokens as running alone, a dropped receiver cancels and frees KV, and
//! a repeated prompt reuses the engine's cached blocks.

mod common;

use std::sync::Arc;
use std::time::Duration;

use granary_engine::engine::{Engine, EngineConfig};
use granary_engine::model::{LoadOptions, Model};
use granary_engine::{Event, FinishReason, GenerateRequest, SamplingParams};
use granary_tokenizer::Tokenizer;

fn start(cfg: EngineConfig) -> Option<Engine> {
    let path = common::default_model()?;
    let model = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf_path(&path).unwrap());
    Some(Engine::start(cfg, model, tok, None).unwrap())
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        namespace: "test".into(),
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        min_tokens: 0,
        constraint: None,
        priority: 0,
    }
}

async fn collect(rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Event) {
    let (toks, _, end) = collect_logprobs(rx).await;
    (toks, end)
}

/// The tokens, the log-probabilities that came with them, and the end.
async fn collect_logprobs(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, Vec<granary_engine::TokenLogprobs>, Event) {
    let mut toks = Vec::new();
    let mut lps = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("engine stalled") {
            Some(Event::Token(t)) => toks.push(t),
            Some(Event::Logprobs(l)) => lps.push(*l),
            Some(Event::Started { .. }) => assert!(toks.is_empty(), "Started after tokens"),
            Some(end) => return (toks, lps, end),
            None => panic!("stream closed without a final event"),
        }
    }
}

fn metric(engine: &Engine, line_prefix: &str) -> f64 {
    let text = granary_engine::Backend::metrics_text(engine);
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_running_alone() {
    let Some(engine) = start(EngineConfig { max_batch_tokens: 64, ..Default::default() }) else { return };
    let fx = common::fixture();
    // Alone, one after the other.
    let mut alone = Vec::new();
    for c in &fx.generate {
        alone.push(collect(engine.generate(greedy(c.prompt_ids.clone(), 12)).unwrap()).await.0);
    }
    // Together: all four join the same batch; the prefill budget of 64
    // tokens forces the longest prompt to be chunked across steps while the
    // others decode.
    let rxs: Vec<_> = fx.generate.iter().map(|c| engine.generate(greedy(c.prompt_ids.clone(), 12)).unwrap()).collect();
    let together = futures::future::join_all(rxs.into_iter().map(collect)).await;
    for ((toks, end), want) in together.into_iter().zip(&alone) {
        assert_eq!(&toks, want, "batched output differs from running alone");
        match end {
            Event::Finished { reason, usage } => {
                assert_eq!(reason, FinishReason::Length);
                assert_eq!(usage.completion_tokens, 12);
            }
            other => panic!("unexpected end {other:?}"),
        }
    }
    // The first greedy tokens are llama.cpp's (the serving weights part from
    // it at a near tie after five; see tests/model_reference.rs).
    assert_eq!(alone[0][..5], fx.generate[0].greedy_ids[..5]);
}

/// The tensor path through the step loop, on every device
/// [`common::tensor_devices`] lists (the CPU, and CUDA where a GPU is):
/// sequences batched over the device KV pool, greedy choices and seeded
/// sampling made from what the device picks (`device_pick`), give each
/// request the tokens it gets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tensor_path_batches_and_samples_as_requests_alone() {
    let Some(path) = common::default_model() else { return };
    for (name, device) in common::tensor_devices() {
        batches_and_samples_as_alone(&path, name, device).await;
    }
}

async fn batches_and_samples_as_alone(path: &std::path::Path, name: &str, device: candle_core::Device) {
    let opts = LoadOptions { device, tensor_ops: true, quantized_decode: false, ..LoadOptions::default() };
    let model = Arc::new(Model::load(path, &opts).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf_path(path).unwrap());
    let cfg = EngineConfig { max_batch_tokens: 64, block_tokens: 16, ..Default::default() };
    let engine = Engine::start(cfg, model.clone(), tok.clone(), None).unwrap();
    let fx = common::fixture();
    let requests: Vec<GenerateRequest> = fx
        .generate
        .iter()
        .enumerate()
        .flat_map(|(i, c)| {
            let sampled = SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                seed: Some(i as u64),
                ..SamplingParams::default()
            };
            [
                greedy(c.prompt_ids.clone(), 10),
                GenerateRequest { sampling: sampled, ..greedy(c.prompt_ids.clone(), 10) },
            ]
        })
        .collect();
    let mut alone = Vec::new();
    for r in &requests {
        alone.push(collect(engine.generate(r.clone()).unwrap()).await.0);
    }
    let rxs: Vec<_> = requests.iter().map(|r| engine.generate(r.clone()).unwrap()).collect();
    let together = futures::future::join_all(rxs.into_iter().map(collect)).await;
    for (i, ((toks, _), want)) in together.into_iter().zip(&alone).enumerate() {
        assert_eq!(toks.len(), 10);
        assert_eq!(&toks, want, "{name}, request {i}: batched output differs from running alone");
    }
    assert_eq!(alone[0][..5], fx.generate[0].greedy_ids[..5], "{name}: greedy on the tensor path follows llama.cpp");
    assert_ne!(alone[0], alone[1], "{name}: sampling at temperature 0.8 left the greedy path");
    // 160 choices; whole rows would have brought 160 times the vocabulary.
    let moved = metric(&engine, "granary_engine_logits_to_host_total");
    let whole = (2 * requests.len() * 10 * model.config().vocab_size) as f64;
    eprintln!("{name}: logits brought to the host: {moved} ({:.2}% of whole rows)", 100.0 * moved / whole);
    assert!(moved > 0.0 && moved < whole / 20.0, "{name}: {moved} logits crossed for {whole} in whole rows");
    // A grammar, `logprobs`, a draw with no cut and `top_p` alone, batched
    // together, each decided on the device.
    let before = metric(&engine, "granary_engine_logits_to_host_total");
    let grammars = granary_engine::constraint::Grammars::new(tok.clone()).unwrap();
    let pattern = "[0-9]{3}-[a-z]{2,6}";
    let regex = || grammars.compile(llguidance::api::TopLevelGrammar::from_regex(pattern)).unwrap();
    let sampled = |t: f32, top_p: f32, logprobs: Option<usize>, seed: u64| SamplingParams {
        temperature: t,
        top_p,
        logprobs,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let prompt = fx.generate[0].prompt_ids.clone();
    let kinds = [
        GenerateRequest { constraint: Some(regex()), ..greedy(prompt.clone(), 12) },
        GenerateRequest {
            constraint: Some(regex()),
            sampling: sampled(0.9, 1.0, None, 1),
            ..greedy(prompt.clone(), 12)
        },
        GenerateRequest { sampling: sampled(0.0, 1.0, Some(3), 2), ..greedy(prompt.clone(), 8) },
        GenerateRequest { sampling: sampled(1.0, 1.0, Some(0), 3), ..greedy(prompt.clone(), 8) },
        GenerateRequest { sampling: sampled(0.7, 0.9, Some(5), 4), ..greedy(prompt.clone(), 8) },
    ];
    let rxs: Vec<_> = kinds.iter().map(|r| engine.generate(r.clone()).unwrap()).collect();
    let outs = futures::future::join_all(rxs.into_iter().map(collect_logprobs)).await;
    let matches = |t: &str| {
        t.split_once('-').is_some_and(|(d, w)| {
            d.len() == 3
                && d.bytes().all(|b| b.is_ascii_digit())
                && (2..=6).contains(&w.len())
                && w.bytes().all(|b| b.is_ascii_lowercase())
        })
    };
    let mut choices = 0;
    for (i, ((toks, lps, end), r)) in outs.into_iter().zip(&kinds).enumerate() {
        assert!(matches!(end, Event::Finished { .. }), "{name}, kind {i}: {end:?}");
        choices += toks.len();
        if r.constraint.is_some() {
            let text = tok.decode(&toks, true).unwrap();
            assert!(matches(&text), "{name}, kind {i}: {text:?} does not match {pattern}");
        }
        match r.sampling.logprobs {
            None => assert!(lps.is_empty(), "{name}, kind {i}: logprobs nobody asked for"),
            Some(top) => {
                assert_eq!(lps.len(), toks.len(), "{name}, kind {i}: a logprob per token");
                for (l, t) in lps.iter().zip(&toks) {
                    assert!(l.logprob <= 1e-4 && l.logprob.is_finite(), "{name}, kind {i}: {l:?}");
                    assert_eq!(l.top.len(), top, "{name}, kind {i}");
                    assert!(l.top.windows(2).all(|w| w[0].1 >= w[1].1), "{name}, kind {i}: {l:?}");
                    if r.sampling.temperature == 0.0 {
                        assert_eq!(l.top[0].0, *t, "{name}, kind {i}: the greedy token is the most likely");
                    }
                }
            }
        }
    }
    let moved = metric(&engine, "granary_engine_logits_to_host_total") - before;
    let whole = (choices * model.config().vocab_size) as f64;
    eprintln!(
        "{name}: grammar, logprobs, no cut, top_p alone: {moved} logits crossed ({:.2}% of whole rows)",
        100.0 * moved / whole
    );
    assert!(moved < whole / 10.0, "{name}: {moved} logits crossed for {whole} in whole rows");
    drop(engine);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_receiver_cancels_and_frees_kv() {
    let Some(engine) = start(EngineConfig::default()) else { return };
    let mut rx = engine.generate(greedy(vec![504, 3575, 282, 4649, 314], 10_000)).unwrap();
    assert!(matches!(rx.recv().await, Some(Event::Started { cached_tokens: 0 })));
    for _ in 0..3 {
        assert!(matches!(rx.recv().await, Some(Event::Token(_))));
    }
    drop(rx);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let cancelled = metric(&engine, "granary_engine_requests_total{outcome=\"cancelled\"}");
        let running = metric(&engine, "granary_engine_running_requests");
        let in_seqs = metric(&engine, "granary_engine_kv_resident_blocks{holder=\"sequences\"}");
        if cancelled == 1.0 && running == 0.0 && in_seqs == 0.0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not cancelled: cancelled={cancelled} running={running}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The engine still serves.
    let (toks, _) = collect(engine.generate(greedy(vec![504, 3575, 282, 4649, 314], 2)).unwrap()).await;
    assert_eq!(toks, vec![7042, 30]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_loads_its_blocks_from_engine_memory() {
    let Some(engine) = start(EngineConfig { block_tokens: 16, ..Default::default() }) else { return };
    let prompt: Vec<u32> = (0..50).map(|i| 1000 + i).collect();
    let (first, end1) = collect(engine.generate(greedy(prompt.clone(), 6)).unwrap()).await;
    let (second, end2) = collect(engine.generate(greedy(prompt.clone(), 6)).unwrap()).await;
    assert_eq!(first, second, "reused KV changed the output");
    let cached = |e: &Event| match e {
        Event::Finished { usage, .. } => usage.cached_tokens,
        other => panic!("{other:?}"),
    };
    assert_eq!(cached(&end1), 0);
    // Three full blocks of 16 and the partial fourth (kept when the first
    // request finished): all but the last token, computed for the logits.
    assert_eq!(cached(&end2), 49, "the prompt should come from memory, full blocks and the partial one");
    assert_eq!(metric(&engine, "granary_engine_prompt_tokens_total{source=\"engine\"}"), 49.0);
    assert_eq!(metric(&engine, "granary_engine_prompt_tokens_total{source=\"computed\"}"), 50.0 + 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_reuses_the_previous_answer() {
    let cfg = EngineConfig { block_tokens: 16, ..Default::default() };
    let Some(engine) = start(cfg.clone()) else { return };
    let prompt: Vec<u32> = (0..40).map(|i| 2000 + i).collect();
    let (answer, _) = collect(engine.generate(greedy(prompt.clone(), 30)).unwrap()).await;
    assert_eq!(answer.len(), 30);
    // Turn 2: the conversation so far, then the next message.
    let mut turn2 = prompt.clone();
    turn2.extend(&answer);
    turn2.extend([504, 3575, 282, 4649, 314]);
    let (second, end) = collect(engine.generate(greedy(turn2.clone(), 6)).unwrap()).await;
    let cached = match end {
        Event::Finished { usage, .. } => usage.cached_tokens,
        other => panic!("{other:?}"),
    };
    // 40 prompt tokens and 29 answer tokens have KV (the last sampled
    // token's is never computed): four full blocks of 16 and five tokens of
    // the partial fifth.
    assert_eq!(cached, 69, "turn 2 should load turn 1's prompt and every answer token with KV");
    // The same turn on an engine that holds nothing gives the same tokens.
    let Some(fresh) = start(EngineConfig { local_cache_bytes: 0, ..cfg }) else { return };
    let (alone, end) = collect(fresh.generate(greedy(turn2, 6)).unwrap()).await;
    assert!(matches!(end, Event::Finished { usage, .. } if usage.cached_tokens == 0));
    assert_eq!(second, alone, "reusing the answer's KV changed the output");

    // Turn 1 again: the block holding the end of its prompt was filled by
    // the answer, and is kept for a prompt that ends inside it.
    let (again, end) = collect(engine.generate(greedy(prompt, 30)).unwrap()).await;
    assert!(matches!(end, Event::Finished { usage, .. } if usage.cached_tokens == 39), "{end:?}");
    assert_eq!(again, answer, "the kept partial block changed the output");
}

/// A token id the fixture's prompts and greedy answers never hold.
const FAULT_TOKEN: u32 = 49_000;

async fn only_the_faulty_request_fails(fault: granary_engine::engine::Fault) {
    let cfg = EngineConfig { max_batch_tokens: 64, fault: Some(fault), ..Default::default() };
    let Some(engine) = start(cfg) else { return };
    let fx = common::fixture();
    let mut alone = Vec::new();
    for c in &fx.generate[..2] {
        alone.push(collect(engine.generate(greedy(c.prompt_ids.clone(), 8)).unwrap()).await.0);
    }
    // Three together in one batch; the third's prompt holds the fault token.
    let mut bad = fx.generate[2].prompt_ids.clone();
    bad.insert(bad.len() / 2, FAULT_TOKEN);
    let mut rxs: Vec<_> =
        fx.generate[..2].iter().map(|c| engine.generate(greedy(c.prompt_ids.clone(), 8)).unwrap()).collect();
    rxs.push(engine.generate(greedy(bad, 8)).unwrap());
    let ends = futures::future::join_all(rxs.into_iter().map(collect)).await;
    for ((toks, end), want) in ends[..2].iter().zip(&alone) {
        assert!(matches!(end, Event::Finished { .. }), "{end:?}");
        assert_eq!(toks, want, "a neighbour's failure changed the output");
    }
    assert!(matches!(&ends[2].1, Event::Failed(m) if m.contains("injected fault")), "{:?}", ends[2].1);
    assert_eq!(metric(&engine, "granary_engine_requests_total{outcome=\"failed\"}"), 1.0);
    assert_eq!(granary_engine::Backend::health(&engine), Ok(()));
    // And the engine goes on serving.
    let (toks, _) = collect(engine.generate(greedy(fx.generate[0].prompt_ids.clone(), 8)).unwrap()).await;
    assert_eq!(toks, alone[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_error_fails_only_its_request() {
    only_the_faulty_request_fails(granary_engine::engine::Fault::StepError(FAULT_TOKEN)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_panic_fails_only_its_request() {
    only_the_faulty_request_fails(granary_engine::engine::Fault::StepPanic(FAULT_TOKEN)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_step_thread_shows_in_health_and_refuses_requests() {
    let cfg =
        EngineConfig { fault: Some(granary_engine::engine::Fault::KillThread(FAULT_TOKEN)), ..Default::default() };
    let Some(engine) = start(cfg) else { return };
    assert_eq!(granary_engine::Backend::health(&engine), Ok(()));
    // The request dies with the thread: its stream ends without a result.
    let mut rx = engine.generate(greedy(vec![504, FAULT_TOKEN, 314], 4)).unwrap();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.expect("stalled") {
        assert!(!matches!(ev, Event::Token(_) | Event::Finished { .. }), "{ev:?}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let why = loop {
        if let Err(why) = granary_engine::Backend::health(&engine) {
            break why;
        }
        assert!(std::time::Instant::now() < deadline, "health never reported the dead thread");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(why.contains("step thread panicked"), "{why}");
    match engine.generate(greedy(vec![504, 3575], 2)) {
        Err(granary_engine::SubmitError::Unavailable(m)) => assert!(m.contains("step thread"), "{m}"),
        other => panic!("a dead engine accepted a request: {:?}", other.map(|_| ())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_kv_memory_wait_their_turn() {
    // A budget of 8 requests' worst case (prompt + max_tokens, in blocks).
    let bt = 16;
    let prompt: Vec<u32> = (0..40).map(|i| 3000 + i).collect();
    let max_tokens = 8;
    let per_request = (prompt.len() + max_tokens).div_ceil(bt);
    let probe = start(EngineConfig { block_tokens: bt, ..Default::default() });
    let Some(probe) = probe else { return };
    let layout = probe.layout();
    let block_bytes = 2 * layout.layers as usize * layout.kv_heads as usize * layout.head_dim as usize * bt * 2;
    let cfg = EngineConfig {
        block_tokens: bt,
        kv_memory_bytes: Some(8 * per_request * block_bytes),
        local_cache_bytes: 0,
        ..Default::default()
    };
    let Some(engine) = start(cfg) else { return };
    // 24 different prompts, alone and then all at once.
    let prompts: Vec<Vec<u32>> = (0..24u32).map(|i| prompt.iter().map(|t| t + 50 * i).collect()).collect();
    let mut alone = Vec::new();
    for p in &prompts[..3] {
        alone.push(collect(engine.generate(greedy(p.clone(), max_tokens)).unwrap()).await.0);
    }
    let watch = engine.clone();
    let peak = tokio::spawn(async move {
        let mut peak = 0.0f64;
        for _ in 0..2000 {
            peak = peak.max(metric(&watch, "granary_engine_kv_reserved_blocks"));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        peak
    });
    let rxs: Vec<_> = prompts.iter().map(|p| engine.generate(greedy(p.clone(), max_tokens)).unwrap()).collect();
    let together = futures::future::join_all(rxs.into_iter().map(collect)).await;
    for (i, (toks, end)) in together.iter().enumerate() {
        assert!(matches!(end, Event::Finished { .. }), "request {i}: {end:?}");
        assert_eq!(toks.len(), max_tokens);
        if i < 3 {
            assert_eq!(toks, &alone[i], "waiting for memory changed request {i}'s output");
        }
    }
    let peak = peak.await.unwrap();
    assert!(
        peak > 0.0 && peak <= (8 * per_request) as f64,
        "reserved {peak} blocks of a budget of {}",
        8 * per_request
    );
    assert_eq!(metric(&engine, "granary_engine_kv_budget_blocks"), (8 * per_request) as f64);
    // A request that could never fit is refused, naming the budget.
    match engine.generate(greedy(prompt.clone(), 9 * per_request * bt)) {
        Err(granary_engine::SubmitError::KvMemory { budget, needed }) => {
            assert_eq!(budget, 8 * per_request * bt);
            assert!(needed > budget);
        }
        other => panic!("an oversized request was accepted: {:?}", other.map(|_| ())),
    }
}

/// `min_tokens`: a stop token the model would choose first is never
/// sampled before `min_tokens` tokens, and ends the answer again after
/// them; on the default path and on the tensor path of every device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_tokens_wait_for_min_tokens() {
    let Some(path) = common::default_model() else { return };
    let mut engines = vec![("default".to_string(), start(EngineConfig::default()).unwrap())];
    for (name, device) in common::tensor_devices() {
        let opts = LoadOptions { device, tensor_ops: true, quantized_decode: false, ..LoadOptions::default() };
        let model = Arc::new(Model::load(&path, &opts).unwrap());
        let tok = Arc::new(Tokenizer::from_gguf_path(&path).unwrap());
        engines.push((format!("tensor {name}"), Engine::start(EngineConfig::default(), model, tok, None).unwrap()));
    }
    let prompt = common::fixture().generate[0].prompt_ids.clone();
    for (name, engine) in &engines {
        let (free, _) = collect(engine.generate(greedy(prompt.clone(), 12)).unwrap()).await;
        // The token greedy decoding picks first, as a stop token: alone it
        // ends the answer before any token.
        let stop = free[0];
        let req = GenerateRequest { stop_token_ids: vec![stop], ..greedy(prompt.clone(), 12) };
        let (toks, end) = collect(engine.generate(req.clone()).unwrap()).await;
        assert!(toks.is_empty(), "{name}: {toks:?}");
        assert!(matches!(end, Event::Finished { reason: FinishReason::Stop, .. }), "{name}: {end:?}");
        // Held back for 6 tokens: never among them.
        let (toks, end) = collect(engine.generate(GenerateRequest { min_tokens: 6, ..req.clone() }).unwrap()).await;
        assert!(toks.len() >= 6, "{name}: {toks:?} {end:?}");
        assert!(!toks[..6].contains(&stop), "{name}: the stop token was sampled early: {toks:?}");
        assert_ne!(toks[0], free[0], "{name}");
        // Afterwards it may end the answer again: if it comes, it ends it.
        match end {
            Event::Finished { reason: FinishReason::Stop, .. } => assert!(toks.len() < 12, "{name}"),
            Event::Finished { reason: FinishReason::Length, .. } => {
                assert_eq!(toks.len(), 12, "{name}");
                assert!(!toks.contains(&stop), "{name}: {toks:?}");
            }
            other => panic!("{name}: unexpected end {other:?}"),
        }
    }
}

/// Issue 40, point 5: on an engine behind a gateway every tenant is its
/// own KV namespace, and they share one block cache. One tenant running
/// many prompts evicted another's blocks (a single LRU). With
/// `namespace_cache_bytes`, the busy tenant evicts its own blocks and the
/// quiet tenant's prompt still comes from engine memory; without it (the
/// control), the same traffic leaves the quiet tenant nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_share_of_engine_memory_evicts_only_its_own_blocks() {
    let Some(path) = common::default_model() else { return };
    let model = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf_path(&path).unwrap());
    let layout = granary_engine::engine::layout_of(&model, 16);
    // A full block's payload, and a little for its header.
    let block = 2 * layout.layers as usize * layout.kv_heads as usize * layout.head_dim as usize * 16 * 2 + 4096;
    let run = |quota: usize| {
        let (model, tok) = (model.clone(), tok.clone());
        async move {
            let cfg = EngineConfig {
                block_tokens: 16,
                local_cache_bytes: 12 * block,
                namespace_cache_bytes: quota,
                ..Default::default()
            };
            let engine = Engine::start(cfg, model, tok, None).unwrap();
            let in_ns = |ns: &str, prompt: Vec<u32>| GenerateRequest { namespace: ns.into(), ..greedy(prompt, 1) };
            let quiet: Vec<u32> = (0..50).map(|i| 3000 + i).collect();
            collect(engine.generate(in_ns("quiet", quiet.clone())).unwrap()).await;
            // The busy tenant: six prompts of three full blocks each.
            for p in 0..6u32 {
                let prompt: Vec<u32> = (0..50).map(|i| 4000 + 100 * p + i).collect();
                collect(engine.generate(in_ns("busy", prompt)).unwrap()).await;
            }
            match collect(engine.generate(in_ns("quiet", quiet)).unwrap()).await.1 {
                Event::Finished { usage, .. } => usage.cached_tokens,
                other => panic!("{other:?}"),
            }
        }
    };
    let shared = run(0).await;
    let capped = run(4 * block).await;
    assert!(
        shared < 48,
        "the control: one LRU for all should have evicted the quiet tenant's blocks ({shared} cached)"
    );
    assert!(capped >= 48, "the quiet tenant's three full blocks were evicted: {capped} cached of 50");
    eprintln!(
        "quiet tenant's repeat: {shared} tokens cached with one LRU for all, {capped} with a share of 4 blocks each"
    );
}
