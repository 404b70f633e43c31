//! KV memory preemption with the real default model: many long requests
//! under a budget for a few all finish with the greedy output they have
//! without the budget, the sequences set aside coming back through the
//! warehouse (no token computed again), or, without a warehouse, by
//! computing their KV again.

mod common;

use std::sync::Arc;
use std::time::Duration;

use granary_engine::connector::{Connector, ConnectorConfig};
use granary_engine::engine::{layout_of, BlockStore, Engine, EngineConfig};
use granary_engine::model::{LoadOptions, Model};
use granary_engine::store::ConnectorStore;
use granary_engine::{Event, FinishReason, GenerateRequest, SamplingParams};
use granary_tokenizer::Tokenizer;
use granary_warehouse::config::StoreConfig;
use granary_warehouse::Store;

const BT: usize = 16;
const PROMPT: usize = 12;
const MAX_TOKENS: usize = 20;
/// Blocks one request holds at its end (prompt and answer).
const PER_REQUEST: usize = (PROMPT + MAX_TOKENS).div_ceil(BT);

struct Loaded {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
}

fn load() -> Option<Loaded> {
    let path = common::default_model()?;
    let model = Arc::new(Model::load(&path, &LoadOptions::default()).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_gguf_path(&path).unwrap());
    Some(Loaded { model, tokenizer })
}

/// An engine whose KV budget holds `blocks` blocks.
fn engine(m: &Loaded, blocks: usize, store: Option<Arc<dyn BlockStore>>) -> Engine {
    let layout = layout_of(&m.model, BT);
    let block_bytes = 2 * layout.layers as usize * layout.kv_heads as usize * layout.head_dim as usize * BT * 2;
    let cfg = EngineConfig {
        block_tokens: BT,
        kv_memory_bytes: Some(blocks * block_bytes),
        max_batch_tokens: 256,
        ..Default::default()
    };
    Engine::start(cfg, m.model.clone(), m.tokenizer.clone(), store).unwrap()
}

fn request(i: usize, priority: i32) -> GenerateRequest {
    // Real text ids, a different run of them for each request after a
    // token of its own (no two prompts share a block).
    let fx = common::fixture();
    let text: Vec<u32> = fx.generate.iter().flat_map(|c| c.prompt_ids.clone()).collect();
    let own = 1000 + 17 * i as u32;
    let prompt = std::iter::once(own).chain(text.iter().cycle().skip(i * 7).take(PROMPT - 1).copied()).collect();
    GenerateRequest {
        namespace: "preempt".into(),
        prompt,
        max_tokens: MAX_TOKENS,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        min_tokens: 0,
        constraint: None,
        priority,
    }
}

/// An embedded warehouse (memory tier only).
async fn warehouse(m: &Loaded) -> Arc<dyn BlockStore> {
    let store = Arc::new(Store::open(StoreConfig::memory_only(1 << 30)).await.unwrap());
    let conn = Arc::new(Connector::embedded(store, ConnectorConfig::default()).unwrap());
    Arc::new(ConnectorStore::new(conn, layout_of(&m.model, BT)))
}

async fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Vec<u32> {
    let mut toks = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("engine stalled") {
            Some(Event::Token(t)) => toks.push(t),
            Some(Event::Started { .. }) => {}
            Some(Event::Finished { reason, usage }) => {
                assert_eq!(reason, FinishReason::Length);
                assert_eq!(usage.completion_tokens, MAX_TOKENS);
                return toks;
            }
            other => panic!("unexpected event {other:?}"),
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

/// Runs `n` requests at once; returns their outputs and the most blocks
/// the running sequences held at any sample.
async fn run_all(engine: &Engine, n: usize) -> (Vec<Vec<u32>>, f64) {
    let watch = engine.clone();
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let peak = tokio::spawn(async move {
        let mut peak = 0.0f64;
        loop {
            peak = peak.max(metric(&watch, "granary_engine_kv_resident_blocks{holder=\"sequences\"}"));
            tokio::select! {
                _ = &mut stop_rx => return peak,
                _ = tokio::time::sleep(Duration::from_millis(2)) => {}
            }
        }
    });
    let rxs: Vec<_> = (0..n).map(|i| engine.generate(request(i, 0)).unwrap()).collect();
    let outs = futures::future::join_all(rxs.into_iter().map(collect)).await;
    let _ = stop_tx.send(());
    (outs, peak.await.unwrap())
}

/// Each request's output with memory to spare, and a few run alone.
async fn reference(m: &Loaded, n: usize) -> Vec<Vec<u32>> {
    let roomy = engine(m, 4 * n * PER_REQUEST, None);
    let (outs, _) = run_all(&roomy, n).await;
    assert_eq!(metric(&roomy, "granary_engine_preemptions_total{kv=\"recompute\"}"), 0.0);
    for i in [0, n / 2, n - 1] {
        let alone = collect(roomy.generate(request(i, 0)).unwrap()).await;
        assert_eq!(alone, outs[i], "request {i}: batched output differs from running alone");
    }
    outs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_requests_under_a_budget_for_eight_resume_from_the_warehouse() {
    let Some(m) = load() else { return };
    let want = reference(&m, 64).await;
    let engine = engine(&m, 8 * PER_REQUEST, Some(warehouse(&m).await));
    let (outs, peak) = run_all(&engine, 64).await;
    for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "request {i}: preemption changed the output");
    }
    let budget = (8 * PER_REQUEST) as f64;
    assert_eq!(metric(&engine, "granary_engine_kv_budget_blocks"), budget);
    assert!(peak > 0.0 && peak <= budget, "sequences held {peak} blocks of a budget of {budget}");
    let preempted = metric(&engine, "granary_engine_preemptions_total{kv=\"warehouse\"}");
    let loaded = metric(&engine, "granary_engine_resumed_kv_tokens_total{how=\"loaded\"}");
    let recomputed = metric(&engine, "granary_engine_resumed_kv_tokens_total{how=\"recomputed\"}");
    eprintln!("preemptions {preempted}, KV tokens loaded back {loaded}, recomputed {recomputed}, peak {peak} blocks");
    assert!(preempted > 0.0, "no sequence was set aside");
    assert!(loaded > 0.0);
    assert_eq!(recomputed, 0.0, "a resumed sequence computed KV again");
    assert_eq!(metric(&engine, "granary_engine_preemptions_total{kv=\"recompute\"}"), 0.0);
    assert_eq!(metric(&engine, "granary_engine_preempted_requests"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_warehouse_set_aside_sequences_compute_their_kv_again() {
    let Some(m) = load() else { return };
    let want = reference(&m, 16).await;
    let engine = engine(&m, 4 * PER_REQUEST, None);
    let (outs, peak) = run_all(&engine, 16).await;
    for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "request {i}: preemption changed the output");
    }
    let budget = (4 * PER_REQUEST) as f64;
    assert!(peak > 0.0 && peak <= budget, "sequences held {peak} blocks of a budget of {budget}");
    let preempted = metric(&engine, "granary_engine_preemptions_total{kv=\"recompute\"}");
    let recomputed = metric(&engine, "granary_engine_resumed_kv_tokens_total{how=\"recomputed\"}");
    eprintln!("preemptions {preempted}, KV tokens recomputed {recomputed}");
    assert!(preempted > 0.0, "no sequence was set aside");
    // What is recomputed depends on timing: a sequence set aside while the
    // engine's block cache still holds all its full blocks, at a block
    // boundary, has nothing to compute again (seen in a CI run: 8
    // preemptions, 0 tokens recomputed). The outputs above are the check.
    let _ = recomputed;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lower_priority_sequence_is_set_aside_first_even_when_older() {
    let Some(m) = load() else { return };
    let want = reference(&m, 2).await;
    // Room for both prompts (2 blocks each) but not for both answers
    // (3 blocks each): one of the two is set aside once they grow.
    let engine = engine(&m, 2 * PER_REQUEST - 1, Some(warehouse(&m).await));
    let mut low = engine.generate(request(0, 5)).unwrap();
    assert!(matches!(low.recv().await, Some(Event::Started { .. })));
    let normal = engine.generate(request(1, 0)).unwrap();
    let stamp = |rx| async move { (collect(rx).await, std::time::Instant::now()) };
    let ((low_out, low_done), (normal_out, normal_done)) = tokio::join!(stamp(low), stamp(normal));
    assert_eq!(low_out, want[0]);
    assert_eq!(normal_out, want[1]);
    assert!(metric(&engine, "granary_engine_preemptions_total{kv=\"warehouse\"}") >= 1.0);
    // The newer request would have been set aside by age alone; the older
    // one, of lower priority, was, and came back only after it finished.
    assert!(normal_done < low_done, "the priority-0 request finished after the priority-5 one");
}
