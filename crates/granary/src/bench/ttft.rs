//! `granary bench ttft`: time to first token with the prompt's KV computed,
//! taken from the engine's memory, from the warehouse's disk tier after a
//! restart, and from its remote tier after a restart; each warm figure next
//! to the time it takes just to read the same bytes from that tier.
//!
//! For every size and run, with a fresh engine and fresh tier directories:
//!
//! 1. **cold**: an engine with an embedded warehouse (1 MiB memory tier, so
//!    every block goes to the lower tiers; a disk tier and a `file://`
//!    remote tier) computes the whole prompt. Its blocks are saved; the run
//!    waits until the warehouse holds them all and has flushed.
//! 2. **warm memory**: the same prompt again on the same engine: the KV
//!    comes from the engine's in-memory block cache.
//! 3. Engine and store are dropped: what a process restart leaves is the
//!    files. The page cache is dropped.
//! 4. **warm disk**: a new `Store` over the disk directory alone (1 MiB
//!    memory) and a new engine with an empty block cache; same prompt.
//! 5. **warm remote**: the same over the remote directory alone.
//!
//! The anchors: for each lower tier, after dropping the page cache again,
//! `Store::get` of every block from a freshly opened store of that tier,
//! and a plain sequential `std::fs::read` of the tier's files (the raw
//! read). For engine memory, one `memcpy` of the KV bytes. Each warm run
//! checks `usage.cached_tokens` and where the engine says the tokens came
//! from; a run that did not reuse what it should is reported and makes the
//! command exit 1.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Args as ClapArgs, ValueEnum};
use granary_core::ByteSize;
use granary_engine::connector::{Connector, ConnectorConfig};
use granary_engine::engine::{BlockStore, Engine, Source};
use granary_engine::store::ConnectorStore;
use granary_warehouse::config::{DiskConfig, RemoteConfig, StoreConfig};
use granary_warehouse::{OffloadMode, Store};
use plotters::prelude::*;
use serde::Serialize;

use super::llm::{self, median, ms, Loaded};
use super::warehouse::disk::{drop_from_page_cache, files_under, resident_share};
use super::warehouse::report::{bar, command_line, utc_timestamp, Goal, Host, Table};

mod remote;
mod report;

use remote::Remote;
use report::{draw, goals, tables};

/// The tenant namespace of every prompt (each run has its own engine and
/// directories, so nothing leaks between runs).
const TENANT: &str = "bench";
/// Memory tier of every warehouse here: below one block, so blocks live in
/// the lower tiers only.
const TINY_MEMORY: ByteSize = ByteSize::mib(1);
/// Size at which the goals are judged (else the largest size run).
const GOAL_SIZE: usize = 4096;
const RAW_GOAL: f64 = 1.5;
const COLD_GOAL: f64 = 20.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DropCaches {
    /// `echo 1 > /proc/sys/vm/drop_caches` (root), else per file.
    Global,
    /// `posix_fadvise(DONTNEED)` on the tier's files only.
    Files,
}

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Model: `default`, a GGUF file, a Hugging Face directory or hf:owner/name.
    #[arg(long, default_value = "default")]
    model: String,
    /// Prompt sizes in tokens (above the context less one token: clamped).
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,8192")]
    sizes: Vec<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 256)]
    block_tokens: usize,
    /// Device of the engine: cpu, or cuda[:N] in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Directory for ttft.json and the charts.
    #[arg(long, default_value = "bench-out/ttft")]
    out: PathBuf,
    /// Runs per size; tables show the median [default: 3, 1 with --quick].
    #[arg(long)]
    repeats: Option<usize>,
    /// A smoke run: one run per size, page cache dropped per file only.
    #[arg(long)]
    quick: bool,
    /// Where the tiers' scratch directories go [default: the system temp directory].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// How the page cache is kept from serving tier reads [default: global, files with --quick].
    #[arg(long, value_enum)]
    drop_caches: Option<DropCaches>,
    /// The remote tier: a `file://` directory, or an `s3s-fs` process (an
    /// S3 server over HTTP on this host); `auto` takes s3s-fs when it is on PATH.
    #[arg(long, value_enum, default_value = "auto")]
    remote: RemoteKind,
    /// Deadline of the engine's warehouse reads (one `get_many` per
    /// prompt), in ms [default: the connector's, as `granary engine` runs].
    /// Past it the engine computes the prompt instead.
    #[arg(long)]
    get_timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RemoteKind {
    Auto,
    File,
    S3sFs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Tier {
    Memory,
    Disk,
    Remote,
}

impl Tier {
    const ALL: [Tier; 3] = [Tier::Memory, Tier::Disk, Tier::Remote];

    fn name(self) -> &'static str {
        match self {
            Tier::Memory => "memory",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }

    fn source(self) -> Source {
        match self {
            Tier::Memory => Source::Memory,
            Tier::Disk => Source::Disk,
            Tier::Remote => Source::Remote,
        }
    }
}

/// One warm run and its anchors.
#[derive(Debug, Clone, Serialize)]
struct TierRun {
    tier: Tier,
    ttft_ms: f64,
    cached_tokens: usize,
    /// Prompt tokens the engine counted as loaded from this tier.
    loaded_tokens: u64,
    /// `Store::get` of every block from a fresh store (lower tiers only).
    store_get_ms: Option<f64>,
    /// The engine's client on a fresh store: `lookup` then `get_many` of
    /// every block, frames decoded and checked (lower tiers only).
    connector_get_ms: Option<f64>,
    /// Plain reads of the tier's files (memory: one memcpy of the KV bytes).
    raw_read_ms: f64,
    raw_bytes: u64,
    /// Share of the tier's file pages in the page cache when the warm run
    /// and the raw read started (lower tiers only).
    cached_at_ttft: Option<f64>,
    cached_at_raw: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
struct Run {
    run: usize,
    cold_ms: f64,
    cold_cached_tokens: usize,
    /// From the end of the cold run until every block was in the warehouse.
    save_ms: f64,
    tiers: Vec<TierRun>,
    /// What did not behave as expected (reuse missing, wrong source).
    problems: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
struct SizeResult {
    requested: usize,
    tokens: usize,
    blocks: usize,
    expected_cached: usize,
    kv_bytes: u64,
    runs: Vec<Run>,
    median: Medians,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Medians {
    cold_ms: f64,
    memory_ms: f64,
    disk_ms: f64,
    remote_ms: f64,
    raw_memory_ms: f64,
    raw_disk_ms: f64,
    raw_remote_ms: f64,
    store_get_disk_ms: f64,
    store_get_remote_ms: f64,
    connector_get_disk_ms: f64,
    connector_get_remote_ms: f64,
}

impl Medians {
    fn of(runs: &[Run]) -> Medians {
        let col = |f: &dyn Fn(&Run) -> Option<f64>| median(&runs.iter().filter_map(f).collect::<Vec<_>>());
        let tier = |t: Tier, f: fn(&TierRun) -> Option<f64>| {
            col(&move |r: &Run| r.tiers.iter().find(|x| x.tier == t).and_then(f))
        };
        Medians {
            cold_ms: col(&|r| Some(r.cold_ms)),
            memory_ms: tier(Tier::Memory, |x| Some(x.ttft_ms)),
            disk_ms: tier(Tier::Disk, |x| Some(x.ttft_ms)),
            remote_ms: tier(Tier::Remote, |x| Some(x.ttft_ms)),
            raw_memory_ms: tier(Tier::Memory, |x| Some(x.raw_read_ms)),
            raw_disk_ms: tier(Tier::Disk, |x| Some(x.raw_read_ms)),
            raw_remote_ms: tier(Tier::Remote, |x| Some(x.raw_read_ms)),
            store_get_disk_ms: tier(Tier::Disk, |x| x.store_get_ms),
            store_get_remote_ms: tier(Tier::Remote, |x| x.store_get_ms),
            connector_get_disk_ms: tier(Tier::Disk, |x| x.connector_get_ms),
            connector_get_remote_ms: tier(Tier::Remote, |x| x.connector_get_ms),
        }
    }

    fn warm(&self, t: Tier) -> f64 {
        match t {
            Tier::Memory => self.memory_ms,
            Tier::Disk => self.disk_ms,
            Tier::Remote => self.remote_ms,
        }
    }

    fn raw(&self, t: Tier) -> f64 {
        match t {
            Tier::Memory => self.raw_memory_ms,
            Tier::Disk => self.raw_disk_ms,
            Tier::Remote => self.raw_remote_ms,
        }
    }

    fn store_get(&self, t: Tier) -> Option<f64> {
        match t {
            Tier::Memory => None,
            Tier::Disk => Some(self.store_get_disk_ms),
            Tier::Remote => Some(self.store_get_remote_ms),
        }
    }

    fn connector_get(&self, t: Tier) -> Option<f64> {
        match t {
            Tier::Memory => None,
            Tier::Disk => Some(self.connector_get_disk_ms),
            Tier::Remote => Some(self.connector_get_remote_ms),
        }
    }
}

#[derive(Serialize)]
struct Report {
    run_with: String,
    date: String,
    host: Host,
    release_build: bool,
    quick: bool,
    model: String,
    model_path: PathBuf,
    /// granary's engine's `--device`.
    device: String,
    block_tokens: usize,
    kv_bytes_per_token: usize,
    context_len: usize,
    repeats: usize,
    drop_caches: DropCaches,
    /// The remote tier used: `file` or `s3s-fs`.
    remote: RemoteKind,
    remote_described: String,
    /// How the page cache was actually dropped (and why not globally).
    drop_caches_done: String,
    sizes: Vec<SizeResult>,
    goals: Vec<Goal>,
    notes: Vec<String>,
}

/// Everything a run needs besides the model.
struct Ctx {
    block_tokens: usize,
    dir: PathBuf,
    drop: DropCaches,
    /// Set once a global drop failed: per file from then on.
    global_failed: Option<String>,
    remote: Remote,
    /// The engine's warehouse client settings (and the connector anchor's).
    conn: ConnectorConfig,
}

/// Tokens a warm run takes from the warehouse: every full block (partial
/// blocks stay in engine memory), except that a prompt of whole blocks
/// recomputes its last token (the engine needs one computed token for the
/// logits).
fn expected_cached(tokens: usize, block_tokens: usize) -> usize {
    let full = tokens / block_tokens * block_tokens;
    if full == tokens {
        tokens - 1
    } else {
        full
    }
}

pub async fn run(args: Args) -> Result<()> {
    anyhow::ensure!(args.block_tokens > 0, "--block-tokens must be positive");
    anyhow::ensure!(!args.sizes.is_empty(), "--sizes: give at least one size");
    let repeats = args.repeats.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let drop = args.drop_caches.unwrap_or(if args.quick { DropCaches::Files } else { DropCaches::Global });
    let host = Host::probe();
    let date = utc_timestamp(SystemTime::now());
    let run_with = command_line();
    let release = !cfg!(debug_assertions);
    println!("Run with: {run_with}");
    println!("Date:     {date}");
    println!("Host:     {}", host.describe());
    println!(
        "Build:    {}; {repeats} run(s) per size{}",
        if release { "release" } else { "debug (figures not representative)" },
        if args.quick { "; --quick (smoke-test, figures not representative)" } else { "" }
    );

    let m = llm::load(&args.model, &args.device)?;
    println!("Device:   {} (granary's engine)", args.device);
    let context = m.model.context_len();
    println!(
        "Model:    {} ({}), context {context}, KV {} B/token (f16), {}-token blocks ({:.1} MiB)",
        m.id,
        m.path.display(),
        m.kv_bytes_per_token,
        args.block_tokens,
        (m.kv_bytes_per_token * args.block_tokens) as f64 / (1u64 << 20) as f64
    );
    let mut notes = Vec::new();
    let mut sizes = Vec::new();
    for &s in &args.sizes {
        anyhow::ensure!(s >= 2, "--sizes: {s} is too small (at least 2 tokens)");
        // The request needs room for its one generated token.
        let t = s.min(context - 1);
        if t != s {
            notes.push(format!(
                "{s} tokens clamped to {t}: the context is {context} and the request generates one token"
            ));
        }
        sizes.push((s, t));
    }
    for n in &notes {
        println!("Note:     {n}");
    }
    println!();

    let base = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir(),
    };
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let base = base.canonicalize().with_context(|| format!("resolving {}", base.display()))?;
    let remote = Remote::open(args.remote, &base)?;
    println!("Remote:   {}", remote.describe());
    let mut conn = ConnectorConfig::default();
    if let Some(t) = args.get_timeout_ms {
        conn.get_timeout = Duration::from_millis(t.max(1));
    }
    println!(
        "Engine:   warehouse reads time out after {} ms{}",
        conn.get_timeout.as_millis(),
        if args.get_timeout_ms.is_some() { " (--get-timeout-ms)" } else { " (the connector's default)" }
    );
    let mut ctx = Ctx { block_tokens: args.block_tokens, dir: base, drop, global_failed: None, remote, conn };

    warm_up(&m, &ctx).await.context("warm-up request")?;

    let pb = bar((sizes.len() * repeats) as u64, "ttft");
    let mut results = Vec::new();
    for &(requested, tokens) in &sizes {
        let mut runs = Vec::new();
        for r in 0..repeats {
            pb.set_message(format!("{tokens} tokens, run {}/{repeats}", r + 1));
            let one = one_run(&m, &mut ctx, tokens, r, &pb)
                .await
                .with_context(|| format!("{tokens}-token prompt, run {}", r + 1))?;
            pb.suspend(|| {
                let warm: Vec<String> =
                    one.tiers.iter().map(|t| format!("{} {:.1} ms", t.tier.name(), t.ttft_ms)).collect();
                eprintln!(
                    "ttft: {tokens} tokens, run {}/{repeats}: cold {:.1} ms, {}",
                    r + 1,
                    one.cold_ms,
                    warm.join(", ")
                );
            });
            runs.push(one);
            pb.inc(1);
        }
        let blocks = tokens / args.block_tokens;
        let expected = expected_cached(tokens, args.block_tokens);
        results.push(SizeResult {
            requested,
            tokens,
            blocks,
            expected_cached: expected,
            kv_bytes: (blocks * args.block_tokens * m.kv_bytes_per_token) as u64,
            median: Medians::of(&runs),
            runs,
        });
    }
    pb.finish_and_clear();

    let done = match &ctx.global_failed {
        None if drop == DropCaches::Global => "global: /proc/sys/vm/drop_caches (after sync)".to_string(),
        None => "per file: posix_fadvise(DONTNEED) on the tier's files (after fsync)".to_string(),
        Some(e) => format!(
            "per file: posix_fadvise(DONTNEED) on the tier's files; writing /proc/sys/vm/drop_caches failed: {e}"
        ),
    };
    let goals = goals(&results);
    let report = Report {
        run_with,
        date,
        host,
        release_build: release,
        quick: args.quick,
        model: m.id.clone(),
        model_path: m.path.clone(),
        device: args.device.clone(),
        block_tokens: args.block_tokens,
        kv_bytes_per_token: m.kv_bytes_per_token,
        context_len: context,
        repeats,
        drop_caches: drop,
        remote: ctx.remote.kind,
        remote_described: ctx.remote.describe(),
        drop_caches_done: done.clone(),
        sizes: results,
        goals,
        notes,
    };
    for t in tables(&report) {
        println!("{}", t.render());
    }
    println!("Page cache: {done}");
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let svg = args.out.join("ttft.svg");
    let png = args.out.join("ttft.png");
    draw(&report, SVGBackend::new(&svg, (900, 560)).into_drawing_area())
        .with_context(|| format!("drawing {}", svg.display()))?;
    draw(&report, BitMapBackend::new(&png, (900, 560)).into_drawing_area())
        .with_context(|| format!("drawing {}", png.display()))?;
    println!("Chart: {} and {}", svg.display(), png.display());
    let json = args.out.join("ttft.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", json.display()))?;
    println!("JSON: {}\n", json.display());
    println!("Goals");
    for g in &report.goals {
        println!("{}", g.render());
    }
    let problems: Vec<String> = report
        .sizes
        .iter()
        .flat_map(|s| s.runs.iter().flat_map(move |r| r.problems.iter().map(move |p| (s.tokens, r.run, p))))
        .map(|(t, r, p)| format!("{t} tokens, run {}: {p}", r + 1))
        .collect();
    if !problems.is_empty() {
        println!("\nFAILED: warm runs did not reuse what they should have:");
        for p in &problems {
            println!("  {p}");
        }
        bail!("{} warm run(s) did not reuse the cached KV as expected", problems.len());
    }
    Ok(())
}

/// A first request on a throwaway engine, so one-time costs (allocator
/// growth, first touches of the weights) land in no measured run.
async fn warm_up(m: &Loaded, ctx: &Ctx) -> Result<()> {
    let engine = llm::start(m, llm::engine_config(&m.id, ctx.block_tokens, 512, 64 << 20), None)?;
    let prompt = llm::prompt(&m.tokenizer, 600.min(m.model.context_len() - 1), u64::MAX)?;
    llm::run(&engine, llm::request(TENANT, prompt, 2), Instant::now()).await?;
    Ok(())
}

fn start_engine(m: &Loaded, ctx: &Ctx, store: Option<&Arc<Store>>, local_cache: usize) -> Result<Engine> {
    let cfg = llm::engine_config(&m.id, ctx.block_tokens, 512, local_cache);
    let blocks = match store {
        Some(s) => {
            let conn = Connector::embedded(s.clone(), ctx.conn.clone())?;
            let layout = granary_engine::engine::layout_of(&m.model, ctx.block_tokens);
            Some(Arc::new(ConnectorStore::new(Arc::new(conn), layout)) as Arc<dyn BlockStore>)
        }
        None => None,
    };
    llm::start(m, cfg, blocks)
}

async fn open_store(disk: Option<&Path>, remote: Option<RemoteConfig>) -> Result<Arc<Store>> {
    let cfg = StoreConfig {
        memory: TINY_MEMORY,
        disk: disk.map(|d| DiskConfig {
            dir: d.to_path_buf(),
            capacity: ByteSize::gib(64),
            policy: Default::default(),
        }),
        remote,
        offload: OffloadMode::All,
        ..Default::default()
    };
    Ok(Arc::new(Store::open(cfg).await.context("opening the warehouse")?))
}

/// Drops our handle once the engine's last one is gone (the engine's
/// threads and tasks end shortly after it is dropped), so the next store
/// opens the directories alone, as after a process restart.
async fn release(store: Arc<Store>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Arc::strong_count(&store) > 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(store);
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Keeps the page cache from serving `dir`'s files.
fn drop_page_cache(ctx: &mut Ctx, dir: &Path) -> Result<()> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    if ctx.drop == DropCaches::Global && ctx.global_failed.is_none() {
        match std::fs::write("/proc/sys/vm/drop_caches", "1\n") {
            Ok(()) => return Ok(()),
            Err(e) => {
                eprintln!("ttft: cannot write /proc/sys/vm/drop_caches ({e}); dropping the tier's files one by one");
                ctx.global_failed = Some(e.to_string());
            }
        }
    }
    for f in files_under(dir) {
        drop_from_page_cache(&f)?;
    }
    Ok(())
}

fn hex_keys(engine: &Engine, prompt: &[u32], blocks: usize) -> Vec<Bytes> {
    engine.block_hashes(TENANT, prompt).iter().take(blocks).map(|h| Bytes::from(h.to_hex())).collect()
}

async fn one_run(m: &Loaded, ctx: &mut Ctx, tokens: usize, run: usize, pb: &indicatif::ProgressBar) -> Result<Run> {
    let bt = ctx.block_tokens;
    let blocks = tokens / bt;
    let expected = expected_cached(tokens, bt);
    let prompt = llm::prompt(&m.tokenizer, tokens, (tokens as u64) << 16 | run as u64)?;
    let scratch = tempfile::Builder::new()
        .prefix("granary-bench-ttft-")
        .tempdir_in(&ctx.dir)
        .with_context(|| format!("creating a scratch directory under {}", ctx.dir.display()))?;
    let disk_dir = scratch.path().join("disk");
    let prefix = format!("run-{tokens}-{run}");
    let remote_cfg = ctx.remote.config(&prefix);
    let remote_dir = ctx.remote.files(&prefix);
    let ns = granary_warehouse::auth::DEFAULT_NAMESPACE;
    let mut problems = Vec::new();
    let mut tiers = Vec::new();
    let req = || llm::request(TENANT, prompt.clone(), 1);

    // 1-2: cold, then warm from engine memory.
    pb.set_message(format!("{tokens} tokens, run {}: cold", run + 1));
    let store = open_store(Some(&disk_dir), Some(remote_cfg.clone())).await?;
    let engine = start_engine(m, ctx, Some(&store), 1 << 30)?;
    let keys = hex_keys(&engine, &prompt, blocks);
    let hashes: Vec<_> = engine.block_hashes(TENANT, &prompt).into_iter().take(blocks).collect();
    let layout = engine.layout();
    let t0 = Instant::now();
    let cold = llm::run(&engine, req(), t0).await?;
    let cold_done = Instant::now();
    if cold.usage.cached_tokens != 0 {
        problems.push(format!("the cold run reused {} tokens", cold.usage.cached_tokens));
    }
    pb.set_message(format!("{tokens} tokens, run {}: saving", run + 1));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let held = store.lookup(ns, &keys).await?.matched;
        if held == keys.len() {
            break;
        }
        if Instant::now() > deadline {
            bail!("after 120 s the warehouse holds {held} of the prompt's {} blocks", keys.len());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let save_ms = ms(cold_done.elapsed());
    store.flush(Duration::from_secs(120)).await?;
    let stats = store.stats();
    for o in &stats.offload {
        if o.dropped > 0 || o.errors > 0 {
            problems.push(format!("offload to {:?}: {} dropped, {} failed", o.tier, o.dropped, o.errors));
        }
    }

    pb.set_message(format!("{tokens} tokens, run {}: warm memory", run + 1));
    let before = engine.metrics().prompt_tokens_by_source();
    let warm = llm::run(&engine, req(), Instant::now()).await?;
    let after = engine.metrics().prompt_tokens_by_source();
    // Engine memory first; a block it lacks may come from the warehouse's.
    let loaded = [Source::Engine, Source::Memory].iter().map(|&s| after[s as usize] - before[s as usize]).sum::<u64>();
    // Engine memory keeps the prompt's last, partial block too: all but the
    // last token (computed for the logits) comes from it.
    check(&mut problems, Tier::Memory, warm.usage.cached_tokens, loaded, tokens - 1);
    drop(engine);
    release(store).await;
    // The engine takes whole blocks (then drops a fully cached prompt's last token).
    let kv_bytes = (blocks * bt * m.kv_bytes_per_token) as u64;
    let raw = memcpy_ms(kv_bytes as usize);
    tiers.push(TierRun {
        tier: Tier::Memory,
        ttft_ms: ms(warm.ttft()),
        cached_tokens: warm.usage.cached_tokens,
        loaded_tokens: loaded,
        store_get_ms: None,
        connector_get_ms: None,
        raw_read_ms: raw,
        raw_bytes: kv_bytes,
        cached_at_ttft: None,
        cached_at_raw: None,
    });

    // 3-5: a restarted process over one lower tier, then its anchors.
    for tier in [Tier::Disk, Tier::Remote] {
        pb.set_message(format!("{tokens} tokens, run {}: warm {}", run + 1, tier.name()));
        let dir = if tier == Tier::Disk { &disk_dir } else { &remote_dir };
        let open = || {
            if tier == Tier::Disk {
                open_store(Some(dir), None)
            } else {
                open_store(None, Some(remote_cfg.clone()))
            }
        };
        drop_page_cache(ctx, dir)?;
        let store = open().await?;
        let engine = start_engine(m, ctx, Some(&store), 512 << 20)?;
        let cached_at_ttft = resident_share(&files_under(dir));
        let before = engine.metrics().prompt_tokens_by_source();
        let warm = llm::run(&engine, req(), Instant::now()).await?;
        let after = engine.metrics().prompt_tokens_by_source();
        let src = tier.source() as usize;
        let loaded = after[src] - before[src];
        check(&mut problems, tier, warm.usage.cached_tokens, loaded, expected);
        drop(engine);
        release(store).await;

        drop_page_cache(ctx, dir)?;
        let store = open().await?;
        let t0 = Instant::now();
        let mut got = 0usize;
        for k in &keys {
            if store.get(ns, k).await?.is_some() {
                got += 1;
            }
        }
        let store_get = ms(t0.elapsed());
        if got != keys.len() {
            problems.push(format!("{}: Store::get found {got} of {} blocks", tier.name(), keys.len()));
        }
        release(store).await;

        // What the engine's warehouse client does before importing: lookup
        // and get_many through the same connector, blocks decoded and checked.
        drop_page_cache(ctx, dir)?;
        let store = open().await?;
        let conn = ConnectorStore::new(Arc::new(Connector::embedded(store.clone(), ctx.conn.clone())?), layout);
        let t0 = Instant::now();
        let fetched = match conn.lookup(&hashes).await {
            Ok(n) => conn.get_many(&hashes[..n]).await.map(|b| b.iter().filter(|b| b.is_some()).count()),
            Err(e) => Err(e),
        };
        let connector_get = ms(t0.elapsed());
        // A timeout here is what made the engine compute instead: say so, go on.
        let connector_get = match fetched {
            Ok(n) if n == keys.len() => Some(connector_get),
            Ok(n) => {
                problems.push(format!("{}: the connector fetched {n} of {} blocks", tier.name(), keys.len()));
                Some(connector_get)
            }
            Err(e) => {
                problems.push(format!("{}: the connector failed after {connector_get:.0} ms: {e:#}", tier.name()));
                None
            }
        };
        drop(conn);
        release(store).await;

        drop_page_cache(ctx, dir)?;
        let files = files_under(dir);
        let cached_at_raw = resident_share(&files);
        let (raw_ms, raw_bytes) = tokio::task::block_in_place(|| read_files(&files))?;
        tiers.push(TierRun {
            tier,
            ttft_ms: ms(warm.ttft()),
            cached_tokens: warm.usage.cached_tokens,
            loaded_tokens: loaded,
            store_get_ms: Some(store_get),
            connector_get_ms: connector_get,
            raw_read_ms: raw_ms,
            raw_bytes,
            cached_at_ttft: Some(cached_at_ttft),
            cached_at_raw: Some(cached_at_raw),
        });
    }
    drop(scratch);
    if remote_dir.exists() {
        std::fs::remove_dir_all(&remote_dir).with_context(|| format!("removing {}", remote_dir.display()))?;
    }
    Ok(Run { run, cold_ms: ms(cold.ttft()), cold_cached_tokens: cold.usage.cached_tokens, save_ms, tiers, problems })
}

fn check(problems: &mut Vec<String>, tier: Tier, cached: usize, loaded: u64, expected: usize) {
    if cached != expected {
        problems.push(format!("warm {}: usage.cached_tokens = {cached}, expected {expected}", tier.name()));
    }
    if loaded != expected as u64 {
        problems.push(format!(
            "warm {}: the engine loaded {loaded} prompt tokens from {0}, expected {expected}",
            tier.name()
        ));
    }
}

/// Reads every file whole, one after the other; (ms, bytes).
fn read_files(files: &[PathBuf]) -> Result<(f64, u64)> {
    let t0 = Instant::now();
    let mut bytes = 0u64;
    for f in files {
        bytes += std::fs::read(f).with_context(|| format!("reading {}", f.display()))?.len() as u64;
    }
    Ok((ms(t0.elapsed()), bytes))
}

/// One copy of `n` bytes between two buffers already in memory.
fn memcpy_ms(n: usize) -> f64 {
    let src = vec![0x5au8; n];
    let mut dst = vec![0xa5u8; n];
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    let t = ms(t0.elapsed());
    std::hint::black_box(&dst);
    t
}

#[cfg(test)]
mod tests {
    use super::expected_cached;

    #[test]
    fn a_fully_cached_prompt_recomputes_its_last_token() {
        assert_eq!(expected_cached(4096, 256), 4095);
        assert_eq!(expected_cached(8191, 256), 7936);
        assert_eq!(expected_cached(300, 256), 256);
        assert_eq!(expected_cached(200, 256), 0);
    }
}
