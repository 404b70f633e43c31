//! KV reuse is exact from every warehouse tier: blocks an engine saved are
//! read back from memory, from disk after the store is reopened, and from a
//! remote (object store) tier; the first token's logits match a full
//! recomputation and greedy text is identical.

mod common;

use std::sync::Arc;
use std::time::Duration;

use granary_core::ByteSize;
use granary_engine::connector::{Connector, ConnectorConfig, KvShape};
use granary_engine::engine::{layout_of, Engine, EngineConfig};
use granary_engine::model::{Chunk, LoadOptions, Model};
use granary_engine::store::ConnectorStore;
use granary_engine::{Event, GenerateRequest, SamplingParams};
use granary_tokenizer::Tokenizer;
use granary_warehouse::config::{DiskConfig, RemoteConfig, StoreConfig};
use granary_warehouse::Store;

const BT: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tier {
    Memory,
    Disk,
    Remote,
}

fn store_config(tier: Tier, dir: &std::path::Path) -> StoreConfig {
    match tier {
        Tier::Memory => StoreConfig::memory_only(1 << 30),
        // A memory tier too small for one block: everything lives below it.
        Tier::Disk => StoreConfig {
            memory: ByteSize(1024),
            disk: Some(DiskConfig { dir: dir.join("disk"), capacity: ByteSize::gib(1), policy: Default::default() }),
            ..Default::default()
        },
        Tier::Remote => {
            std::fs::create_dir_all(dir.join("remote")).unwrap();
            StoreConfig {
                memory: ByteSize(1024),
                remote: Some(RemoteConfig {
                    url: format!("file://{}", dir.join("remote").display()),
                    options: Default::default(),
                }),
                ..Default::default()
            }
        }
    }
}

fn prompt() -> Vec<u32> {
    // 100 tokens of real text ids: three full blocks of 32 and a tail of 4.
    let fx = common::fixture();
    fx.generate.iter().flat_map(|c| c.prompt_ids.clone()).cycle().take(100).collect()
}

async fn run(engine: &Engine, prompt: Vec<u32>) -> (Vec<u32>, usize) {
    let req = GenerateRequest {
        namespace: "reuse".into(),
        prompt,
        max_tokens: 8,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        min_tokens: 0,
        constraint: None,
        priority: 0,
    };
    let mut rx = engine.generate(req).unwrap();
    let mut toks = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.unwrap() {
            Some(Event::Token(t)) => toks.push(t),
            Some(Event::Started { .. }) => {}
            Some(Event::Finished { usage, .. }) => return (toks, usage.cached_tokens),
            other => panic!("{other:?}"),
        }
    }
}

fn prompt_tokens(engine: &Engine, source: &str) -> u64 {
    let i = granary_core::metrics::engine::SOURCES.iter().position(|s| *s == source).unwrap();
    engine.metrics().prompt_tokens_by_source()[i]
}

async fn check_tier(tier: Tier) {
    check_tier_with(tier, LoadOptions::default()).await;
}

async fn check_tier_with(tier: Tier, opts: LoadOptions) {
    let Some(path) = common::default_model() else { return };
    let model = Arc::new(Model::load(&path, &opts).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf_path(&path).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig { block_tokens: BT, local_cache_bytes: 0, ..Default::default() };
    let layout = layout_of(&model, BT);
    let prompt = prompt();

    // Cold: computes everything and saves three blocks.
    let store = Arc::new(Store::open(store_config(tier, dir.path())).await.unwrap());
    let conn = Arc::new(Connector::embedded(store.clone(), ConnectorConfig::default()).unwrap());
    let cold = Engine::start(
        cfg.clone(),
        model.clone(),
        tok.clone(),
        Some(Arc::new(ConnectorStore::new(conn.clone(), layout))),
    )
    .unwrap();
    let (cold_toks, cold_cached) = run(&cold, prompt.clone()).await;
    assert_eq!(cold_cached, 0);
    let hashes = cold.block_hashes("reuse", &prompt);
    assert_eq!(hashes.len(), 3);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while conn.lookup(&hashes).await.unwrap() < 3 {
        assert!(std::time::Instant::now() < deadline, "blocks were not saved");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    store.flush(Duration::from_secs(10)).await.unwrap();
    drop(cold);

    // Warm: a new engine; for disk and remote also a new store on the same
    // directories (what a restart leaves).
    let store = if tier == Tier::Memory {
        store
    } else {
        drop(conn);
        drop(store);
        Arc::new(Store::open(store_config(tier, dir.path())).await.unwrap())
    };
    let conn = Arc::new(Connector::embedded(store.clone(), ConnectorConfig::default()).unwrap());
    let warm =
        Engine::start(cfg, model.clone(), tok, Some(Arc::new(ConnectorStore::new(conn.clone(), layout)))).unwrap();
    let (warm_toks, warm_cached) = run(&warm, prompt.clone()).await;
    assert_eq!(warm_cached, 96, "{tier:?}: three blocks should be reused");
    assert_eq!(warm_toks, cold_toks, "{tier:?}: reused KV changed the greedy text");
    let source = match tier {
        Tier::Memory => "memory",
        Tier::Disk => "disk",
        Tier::Remote => "remote",
    };
    assert_eq!(prompt_tokens(&warm, source), 96, "{tier:?}: tokens not counted under {source}");
    assert_eq!(prompt_tokens(&warm, "computed"), 4);

    // Logits: the first token's logits with the tier's KV equal those of a
    // full recomputation.
    let shape = KvShape::of_block(&layout);
    let got = conn.get_many(&hashes, &shape).await.unwrap();
    let mut kv = model.new_kv(BT);
    for (i, b) in got.into_iter().enumerate() {
        let b = b.unwrap_or_else(|| panic!("{tier:?}: block {i} missing"));
        kv.import_block(model.config().layers, i, BT, b.payload.clone()).unwrap();
    }
    let reused = model.forward(&mut [Chunk { tokens: &prompt[96..], kv: &mut kv, logits: true }]).unwrap().unwrap();
    // Recomputed: the prefix from scratch, then the same tail step.
    let mut full_kv = model.new_kv(BT);
    model.forward(&mut [Chunk { tokens: &prompt[..96], kv: &mut full_kv, logits: false }]).unwrap();
    let full = model.forward(&mut [Chunk { tokens: &prompt[96..], kv: &mut full_kv, logits: true }]).unwrap().unwrap();
    let (a, b) = (reused.to_vec2::<f32>().unwrap().remove(0), full.to_vec2::<f32>().unwrap().remove(0));
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    eprintln!("{tier:?}: max |logit difference| reused vs recomputed {worst:.5}");
    assert!(worst <= 1e-4, "{tier:?}: logits with reused KV differ by {worst}");
    // The bytes themselves round-trip exactly.
    let again = full_kv.export_block(1, BT).unwrap();
    let stored = conn.get_many(&hashes[1..2], &shape).await.unwrap().remove(0).unwrap();
    assert_eq!(again, stored.payload, "{tier:?}: stored block differs from the computed KV");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_from_memory_is_exact() {
    check_tier(Tier::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_from_disk_after_reopen_is_exact() {
    check_tier(Tier::Disk).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_from_remote_tier_is_exact() {
    check_tier(Tier::Remote).await;
}

/// The accelerator path (KV as tensors, exported and imported by copies)
/// reuses blocks from disk as exactly: on the CPU, and on a GPU where one
/// is visible ([`common::tensor_devices`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_on_the_tensor_path_is_exact() {
    for (_, device) in common::tensor_devices() {
        check_tier_with(Tier::Disk, LoadOptions { device, tensor_ops: true, ..LoadOptions::default() }).await;
    }
}
