//! The running engine: admission with KV reuse, the continuous-batching
//! loop, and saving new blocks.
//!
//! A request goes through two stages. Admission (a tokio task) names the
//! prompt's full blocks with the hash chain, takes the longest prefix held
//! in the engine's memory and then in the warehouse, and fetches those
//! blocks. The step loop (one OS thread; the forward pass is blocking CPU or
//! GPU work) imports them into the sequence's KV and, each step, runs one
//! forward pass over every running sequence: one token for each decoding
//! sequence plus prefill chunks up to a token budget. New requests therefore
//! join between steps, without waiting for running ones to finish.

mod cache;
mod device_pick;
mod health;
pub mod metrics;
mod preempt;
mod sampler;
mod step;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use bytes::Bytes;
use futures::future::BoxFuture;
use granary_core::block::DType as BlockDType;
use granary_core::hash::{BlockHash, HashChain, KvLayout};
use granary_tokenizer::Tokenizer;
use tokio::sync::mpsc;
use tracing::Instrument;

pub use cache::{BlockCache, KvEvent};
pub use health::STALL_AFTER;
pub use metrics::{EngineMetrics, Source};

use crate::model::Model;
use crate::{Backend, Event, GenerateRequest, ModelInfo, SubmitError, TokenLogprobs};

/// What this engine does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill and decode.
    Both,
    /// Compute the prompt's KV, write every full block to the warehouse, return.
    Prefill,
    /// Load the prompt's KV from the warehouse, compute the rest, generate.
    Decode,
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!("unknown role {other:?} (expected both, prefill or decode)")),
        }
    }
}

/// A block fetched from the warehouse.
pub struct FetchedBlock {
    pub payload: Bytes,
    pub source: Source,
}

/// The warehouse as the engine sees it: named KV payloads. Implementations
/// frame and check blocks; errors are turned into misses by the engine.
pub trait BlockStore: Send + Sync + 'static {
    /// How many leading `hashes` are stored.
    fn lookup<'a>(&'a self, hashes: &'a [BlockHash]) -> BoxFuture<'a, Result<usize>>;
    /// The payloads of `hashes`; `None` where missing or unusable.
    fn get_many<'a>(&'a self, hashes: &'a [BlockHash]) -> BoxFuture<'a, Result<Vec<Option<FetchedBlock>>>>;
    /// Stores KV payloads of `tokens` tokens each.
    fn put_many(&self, blocks: Vec<(BlockHash, Bytes)>) -> BoxFuture<'_, Result<()>>;
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The id clients use in `model`.
    pub model_id: String,
    pub block_tokens: usize,
    pub role: Role,
    /// Tokens one step may process (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences in the running batch at most.
    pub max_running: usize,
    /// Bytes of exported blocks kept in engine memory for reuse.
    pub local_cache_bytes: usize,
    /// The most of `local_cache_bytes` one KV namespace may hold (0: no
    /// cap): a tenant past it evicts its own blocks, not another's.
    pub namespace_cache_bytes: usize,
    /// Save batches queued for the warehouse at most; beyond, saves are dropped.
    pub save_queue: usize,
    /// Sampling settings for fields a request leaves out.
    pub sampling: crate::SamplingDefaults,
    /// Memory for running sequences' KV; `None`: [`DEFAULT_KV_MEMORY_SHARE`]
    /// of the host's RAM. A request joins the running batch when its
    /// prompt's blocks fit beside the blocks the running sequences hold (it
    /// waits otherwise); when decoding outgrows the budget, sequences are
    /// set aside through the warehouse and resumed later (see `preempt`).
    /// A request whose prompt and `max_tokens` could never fit is refused.
    pub kv_memory_bytes: Option<usize>,
    /// Longest wait for a prompt's blocks from the warehouse; past it the
    /// prompt is computed instead.
    pub fetch_timeout: std::time::Duration,
    /// A failure injected by tests; `None` in service.
    #[doc(hidden)]
    pub fault: Option<Fault>,
}

/// Failures tests inject, keyed by a token id in a request's input.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A step that holds the token fails with an error.
    StepError(u32),
    /// A step that holds the token panics.
    StepPanic(u32),
    /// The step thread dies when it admits a prompt with the token.
    KillThread(u32),
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model_id: "default".into(),
            block_tokens: 256,
            role: Role::Both,
            max_batch_tokens: 512,
            max_running: 64,
            local_cache_bytes: 512 << 20,
            namespace_cache_bytes: 0,
            save_queue: 64,
            sampling: crate::SamplingDefaults::default(),
            kv_memory_bytes: None,
            fetch_timeout: std::time::Duration::from_secs(30),
            fault: None,
        }
    }
}

/// Blocks a request holds at most: its prompt and every token it may
/// generate (a prefill-only engine keeps no generated tokens).
pub(crate) fn kv_reservation(block_tokens: usize, req: &GenerateRequest, role: Role) -> usize {
    let generated = if role == Role::Prefill { 0 } else { req.max_tokens };
    (req.prompt.len() + generated).div_ceil(block_tokens.max(1))
}

/// The share of the host's RAM running sequences' KV may use by default.
pub const DEFAULT_KV_MEMORY_SHARE: f64 = 0.4;

/// The host's RAM in bytes (`/proc/meminfo`; 8 GiB where it cannot be read).
fn host_memory_bytes() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map_or(8 << 30, |kib| kib * 1024)
}

/// The KV layout of `model`'s blocks: what the hash chain and block
/// headers record.
pub fn layout_of(model: &Model, block_tokens: usize) -> KvLayout {
    let mc = model.config();
    KvLayout {
        dtype: BlockDType::F16,
        layers: mc.layers as u32,
        kv_heads: mc.kv_heads as u32,
        head_dim: mc.head_dim as u32,
        block_tokens: block_tokens as u32,
    }
}

struct Admitted {
    req: GenerateRequest,
    tx: mpsc::UnboundedSender<Event>,
    hashes: Vec<BlockHash>,
    loaded: Vec<(Bytes, Source)>,
    /// A partial block from engine memory continuing `loaded` (every full
    /// block of the prompt loaded), and the prompt tokens it covers.
    tail: Option<(Bytes, usize)>,
    arrived: Instant,
    spans: RequestSpans,
}

/// The request's trace: its `request` span (the caller's, possibly
/// disabled) and the `first_token` span open since it arrived.
struct RequestSpans {
    request: tracing::Span,
    first_token: tracing::Span,
}

struct Shared {
    cfg: EngineConfig,
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    layout: KvLayout,
    cache: BlockCache,
    metrics: EngineMetrics,
    store: Option<Arc<dyn BlockStore>>,
    runtime: tokio::runtime::Handle,
    created: u64,
    closed: AtomicBool,
    /// Turns true once, on [`Engine::close`]: long-lived streams end on it.
    closing: tokio::sync::watch::Sender<bool>,
    health: health::Health,
    /// KV blocks the budget holds.
    kv_budget_blocks: usize,
}

/// A running engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
    admit: std_mpsc::Sender<Admitted>,
}

struct SaveJob {
    namespace: String,
    blocks: Vec<(BlockHash, Bytes)>,
    /// `kv_save`, under the request that computed the blocks.
    span: tracing::Span,
}

impl Engine {
    /// Starts the step loop and the saver on the current tokio runtime.
    pub fn start(
        cfg: EngineConfig,
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        store: Option<Arc<dyn BlockStore>>,
    ) -> Result<Self> {
        anyhow::ensure!(cfg.block_tokens > 0, "block_tokens must be positive");
        anyhow::ensure!(cfg.max_batch_tokens > 0, "max_batch_tokens must be positive");
        let layout = layout_of(&model, cfg.block_tokens);
        let kv_bytes =
            cfg.kv_memory_bytes.unwrap_or_else(|| (host_memory_bytes() as f64 * DEFAULT_KV_MEMORY_SHARE) as usize);
        let block_bytes =
            2 * layout.layers as usize * layout.kv_heads as usize * layout.head_dim as usize * cfg.block_tokens * 2;
        let kv_budget_blocks = kv_bytes / block_bytes.max(1);
        anyhow::ensure!(
            kv_budget_blocks > 0,
            "the KV memory budget of {kv_bytes} bytes holds no block of {block_bytes} bytes"
        );
        let shared = Arc::new(Shared {
            cache: BlockCache::new(cfg.local_cache_bytes).with_namespace_quota(cfg.namespace_cache_bytes),
            metrics: EngineMetrics::new(),
            runtime: tokio::runtime::Handle::try_current()?,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            closed: AtomicBool::new(false),
            closing: tokio::sync::watch::Sender::new(false),
            health: health::Health::default(),
            kv_budget_blocks,
            cfg,
            model,
            tokenizer,
            layout,
            store,
        });
        let (admit, rx) = std_mpsc::channel();
        let (saver, save_rx) = mpsc::channel(shared.cfg.save_queue.max(1));
        let s = shared.clone();
        std::thread::Builder::new()
            .name("granary-engine".into())
            .spawn(move || step::StepLoop::new(s, rx, saver).run())?;
        shared.runtime.spawn(save_loop(shared.clone(), save_rx));
        Ok(Engine { shared, admit })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.shared.model
    }

    pub fn layout(&self) -> KvLayout {
        self.shared.layout
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.shared.tokenizer
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.shared.metrics
    }

    /// The block names of `prompt` for `namespace` (what routers index).
    pub fn block_hashes(&self, namespace: &str, prompt: &[u32]) -> Vec<BlockHash> {
        self.chain(namespace).hashes(prompt)
    }

    fn chain(&self, namespace: &str) -> HashChain {
        HashChain::for_layout(namespace, self.shared.model.fingerprint().as_bytes(), &self.shared.layout)
    }

    /// KV events from now on.
    pub fn subscribe_events(&self) -> tokio::sync::broadcast::Receiver<KvEvent> {
        self.shared.cache.subscribe()
    }

    /// Blocks held in engine memory as (namespace, hex hash).
    pub fn resident_blocks(&self) -> Vec<(String, String)> {
        self.shared.cache.snapshot()
    }

    /// Stops accepting requests.
    /// Stops accepting requests and ends the KV event streams (requests
    /// already running finish).
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.closing.send_replace(true);
    }

    /// Resolves once [`Engine::close`] has been called.
    pub async fn closed(&self) {
        let mut rx = self.shared.closing.subscribe();
        let _ = rx.wait_for(|closed| *closed).await;
    }

    /// Starts a request; see [`Event`] for what the receiver gets.
    pub fn generate(&self, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, SubmitError> {
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        if let Some(why) = self.shared.health.dead_reason() {
            return Err(SubmitError::Unavailable(why));
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let limit = self.shared.model.context_len();
        let needs = req.prompt.len() + usize::from(self.shared.cfg.role != Role::Prefill);
        if needs > limit {
            return Err(SubmitError::ContextExceeded { limit, prompt: req.prompt.len() });
        }
        let bt = self.shared.cfg.block_tokens;
        let needed = kv_reservation(bt, &req, self.shared.cfg.role) * bt;
        let budget = self.shared.kv_budget_blocks * bt;
        if needed > budget {
            return Err(SubmitError::KvMemory { budget, needed });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let chain = self.chain(&req.namespace);
        let hashes = chain.hashes(&req.prompt);
        let root = chain.root();
        self.shared.metrics.waiting.inc();
        let this = self.clone();
        let request = tracing::Span::current();
        let first_token = tracing::info_span!(parent: &request, "first_token");
        let spans = RequestSpans { request, first_token };
        self.shared.runtime.spawn(async move {
            let load = this.shared.health.loading();
            let fetch = this.fetch_prefix(&hashes, &spans.request);
            let loaded = match tokio::time::timeout(this.shared.cfg.fetch_timeout, fetch).await {
                Ok(loaded) => loaded,
                Err(_) => {
                    tracing::warn!(timeout = ?this.shared.cfg.fetch_timeout, "loading KV blocks timed out; computing instead");
                    this.shared.metrics.warehouse_errors.inc();
                    Vec::new()
                }
            };
            drop(load);
            // The rest of the prompt from a partial block, once every full
            // block is here (a prefill engine computes only full blocks).
            let tail = if loaded.len() == hashes.len() && this.shared.cfg.role != Role::Prefill {
                let parent = hashes.last().copied().unwrap_or(root);
                this.shared.cache.tail(&parent, &req.prompt[hashes.len() * bt..])
            } else {
                None
            };
            let a = Admitted { req, tx, hashes, loaded, tail, arrived: Instant::now(), spans };
            if this.admit.send(a).is_err() {
                this.shared.metrics.waiting.dec();
            }
        });
        Ok(rx)
    }

    /// The longest prefix of `hashes` in engine memory, then the warehouse
    /// (spans `prefix_lookup` and `kv_load` under `parent`).
    async fn fetch_prefix(&self, hashes: &[BlockHash], parent: &tracing::Span) -> Vec<(Bytes, Source)> {
        let sh = &self.shared;
        let bt = sh.cfg.block_tokens;
        let lookup = tracing::info_span!(
            parent: parent,
            "prefix_lookup",
            "granary.prefix.blocks" = hashes.len(),
            "granary.prefix.engine_blocks" = tracing::field::Empty,
            "granary.prefix.warehouse_blocks" = tracing::field::Empty,
            "granary.prefix.tokens_found" = tracing::field::Empty,
        );
        let mut loaded: Vec<(Bytes, Source)> =
            lookup.in_scope(|| sh.cache.prefix(hashes).into_iter().map(|b| (b, Source::Engine)).collect());
        lookup.record("granary.prefix.engine_blocks", loaded.len());
        if !loaded.is_empty() {
            // Read with the lookup: the span marks what engine memory gave.
            let _ = tracing::info_span!(parent: parent, "kv_load", "granary.kv.source" = "engine", "granary.kv.blocks" = loaded.len());
        }
        let rest = &hashes[loaded.len()..];
        let Some(store) = sh.store.as_ref().filter(|_| !rest.is_empty()) else {
            lookup.record("granary.prefix.tokens_found", loaded.len() * bt);
            return loaded;
        };
        let n = match store.lookup(rest).instrument(lookup.clone()).await {
            Ok(n) => n.min(rest.len()),
            Err(e) => {
                tracing::warn!(error = %e, "warehouse lookup failed; computing instead");
                sh.metrics.warehouse_errors.inc();
                0
            }
        };
        lookup.record("granary.prefix.warehouse_blocks", n);
        lookup.record("granary.prefix.tokens_found", (loaded.len() + n) * bt);
        drop(lookup);
        if n == 0 {
            return loaded;
        }
        let load = tracing::info_span!(
            parent: parent,
            "kv_load",
            "granary.kv.source" = "warehouse",
            "granary.kv.blocks" = n,
            "granary.kv.blocks_loaded" = tracing::field::Empty,
            "granary.kv.blocks.memory" = tracing::field::Empty,
            "granary.kv.blocks.disk" = tracing::field::Empty,
            "granary.kv.blocks.remote" = tracing::field::Empty,
        );
        match store.get_many(&rest[..n]).instrument(load.clone()).await {
            Ok(blocks) => {
                let before = loaded.len();
                let mut per_tier = [0usize; 3];
                for b in blocks {
                    let Some(b) = b else { break };
                    match b.source {
                        Source::Memory => per_tier[0] += 1,
                        Source::Disk => per_tier[1] += 1,
                        Source::Remote => per_tier[2] += 1,
                        _ => {}
                    }
                    loaded.push((b.payload, b.source));
                }
                load.record("granary.kv.blocks_loaded", loaded.len() - before);
                load.record("granary.kv.blocks.memory", per_tier[0]);
                load.record("granary.kv.blocks.disk", per_tier[1]);
                load.record("granary.kv.blocks.remote", per_tier[2]);
            }
            Err(e) => {
                tracing::warn!(error = %e, "warehouse read failed; computing instead");
                sh.metrics.warehouse_errors.inc();
            }
        }
        loaded
    }
}

impl Backend for Engine {
    fn models(&self) -> Vec<ModelInfo> {
        vec![ModelInfo {
            id: self.shared.cfg.model_id.clone(),
            context_len: self.shared.model.context_len(),
            tokenizer: self.shared.tokenizer.clone(),
            created: self.shared.created,
            sampling: self.shared.cfg.sampling,
        }]
    }

    fn submit(&self, _model: &str, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, SubmitError> {
        self.generate(req)
    }

    fn metrics_text(&self) -> String {
        self.shared.metrics.render()
    }

    fn health(&self) -> Result<(), String> {
        let busy = self.shared.metrics.running.get() > 0 || self.shared.metrics.waiting.get() > 0;
        self.shared.health.check(busy, self.shared.cfg.fetch_timeout)
    }

    fn embed(&self, _model: &str, tokens: &[u32]) -> Option<anyhow::Result<Vec<f32>>> {
        Some(self.shared.model.embed(tokens, self.shared.cfg.max_batch_tokens))
    }

    fn prompt_logprobs(&self, _model: &str, tokens: &[u32], top: usize) -> Option<anyhow::Result<Vec<TokenLogprobs>>> {
        Some(self.shared.model.prompt_logprobs(tokens, top, self.shared.cfg.max_batch_tokens))
    }
}

async fn save_loop(sh: Arc<Shared>, mut rx: mpsc::Receiver<SaveJob>) {
    while let Some(job) = rx.recv().await {
        let n = job.blocks.len() as u64;
        let hashes: Vec<String> = job.blocks.iter().map(|(h, _)| h.to_hex()).collect();
        let ok = match &sh.store {
            Some(store) if n > 0 => match store.put_many(job.blocks).instrument(job.span).await {
                Ok(()) => {
                    sh.metrics.save("saved", n);
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, blocks = n, "saving KV blocks failed");
                    sh.metrics.save("failed", n);
                    sh.metrics.warehouse_errors.inc();
                    false
                }
            },
            _ => false,
        };
        if ok {
            sh.cache.publish(KvEvent { kind: "stored", namespace: job.namespace, tier: "warehouse", hashes });
        }
    }
}
