//! `granary bench soak`: the conversation replay ([`super::replay`]) for a
//! long time against a running gateway or cluster (`--url`), or against a
//! `granary serve` it starts itself on loopback, sampling as it goes.
//!
//! Every sample window (`--sample-every`, shortened so a run has at least
//! six) records the requests that ended in it (answered, errors, p50/p99
//! TTFT, prompt and cached tokens), RSS and open files of every process it
//! knows (the spawned serve and its children, or the `--pid`s and theirs),
//! and the warehouse's bytes per tier from `/metrics`. The end prints the
//! tables and judges issue 17's goals: no errors, RSS after warm-up growing
//! less than 1% per 10 minutes (least squares), the last window's p99 TTFT
//! within 20% of the first post-warm-up window's. Errors make the command
//! fail; a missed timing goal only with `--strict`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use granary_core::ByteSize;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::replay::{self, Outcome, ReplayConfig, Target};
use super::sim::{load_trace, locate_mooncake_trace};
use super::warehouse::report::{bar, command_line, utc_timestamp, Goal, Host, Table};

mod chart;
mod judge;
pub(super) mod procs;

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (e.g. 60s, 10m)"))
}

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// How long to drive the replay (humantime: 60s, 10m, 1h).
    #[arg(long, default_value = "10m", value_parser = duration)]
    duration: Duration,
    /// Base URL of a running OpenAI-compatible gateway or engine [default:
    /// start `granary serve` on loopback with the default model].
    #[arg(long)]
    url: Option<String>,
    /// Bearer token for `--url`.
    #[arg(long, env = "GRANARY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model requested [default: the first one `/v1/models` lists].
    #[arg(long)]
    model: Option<String>,
    /// Processes to sample with `--url` (repeatable; their children too).
    #[arg(long = "pid")]
    pids: Vec<u32>,
    /// Prometheus pages with `granary_warehouse_tier_bytes` (repeatable,
    /// summed per tier) [default: the spawned serve's /metrics].
    #[arg(long = "metrics-url")]
    metrics_urls: Vec<String>,
    /// Sample window; shortened so the run has at least 6 windows.
    #[arg(long, default_value = "60s", value_parser = duration)]
    sample_every: Duration,
    /// Windows left out of the RSS and TTFT goals [default: a fifth of them].
    #[arg(long)]
    warmup_windows: Option<usize>,
    /// Words per trace block (a trace block is 512 tokens; scaled down for a CPU engine).
    #[arg(long, default_value_t = 24)]
    block_words: usize,
    /// Blocks of a request's prompt kept, from the start (0 = all).
    #[arg(long, default_value_t = 12)]
    max_blocks: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Trace time runs this many times faster (0 = send as fast as slots free).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Requests in all (0 = until --duration).
    #[arg(long, default_value_t = 0)]
    requests: u64,
    /// Mixed into the trace's block ids: runs with different salts send
    /// different text (no KV shared between them), with the same salt the same.
    #[arg(long, default_value_t = 0)]
    salt: u64,
    /// A request not finished after this counts as an error.
    #[arg(long, default_value = "120s", value_parser = duration)]
    request_timeout: Duration,
    /// The trace (Mooncake JSON lines) [default: the conversation trace under shared/data].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// First trace request of the slice replayed.
    #[arg(long, default_value_t = 0)]
    trace_start: usize,
    /// Trace requests in the slice (0 = to the end); the replay loops over it.
    #[arg(long, default_value_t = 2000)]
    trace_len: usize,
    /// Where soak.json and the charts go [default: <temp dir>/granary-soak].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Tokens per KV block of the spawned serve: the prompts are scaled down
    /// about 16x from the trace's 512-token blocks, so the engine's 256 is too.
    #[arg(long, default_value_t = 16)]
    serve_block_tokens: usize,
    /// The spawned serve's engine block cache and warehouse memory tier
    /// (`--kv-cache`, `--warehouse-memory`): small, so both are full after
    /// warm-up and growth past it is not a cache filling up.
    #[arg(long, default_value = "64MiB")]
    serve_cache: ByteSize,
    /// Exit non-zero when a timing goal is missed too (errors always do).
    #[arg(long)]
    strict: bool,
    /// Run nothing: draw the charts of an earlier run's soak.json into
    /// --out (or beside that file).
    #[arg(long, value_name = "SOAK_JSON")]
    replot: Option<PathBuf>,
}

/// RSS and open files of one process at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcSample {
    pub pid: u32,
    pub name: String,
    pub rss_bytes: u64,
    pub fds: u64,
}

/// One window, stamped with its end.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds from the start of the replay to the end of the window.
    pub t_s: f64,
    /// Requests that ended in the window, answered or not.
    pub requests: u64,
    pub errors: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub procs: Vec<ProcSample>,
    /// `granary_warehouse_tier_bytes` per tier, summed over the metrics pages.
    pub tier_bytes: BTreeMap<String, u64>,
    /// Why a metrics page could not be read, if one could not.
    pub metrics_error: Option<String>,
}

#[derive(Serialize)]
struct Report {
    run_with: String,
    date: String,
    host: Host,
    release_build: bool,
    target: String,
    model: String,
    trace: PathBuf,
    trace_slice: (usize, usize),
    duration_s: f64,
    sample_every_s: f64,
    warmup_windows: usize,
    block_words: usize,
    max_blocks: usize,
    max_tokens: usize,
    speedup: f64,
    concurrency: usize,
    requests_sent: u64,
    requests_ended: u64,
    errors: u64,
    /// Up to 20 error messages, with when they happened.
    first_errors: Vec<(f64, String)>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// cached / prompt tokens over the run.
    hit_rate: f64,
    samples: Vec<Sample>,
    goals: Vec<Goal>,
    charts: Vec<PathBuf>,
}

/// A `granary serve` this command started: stopped (SIGTERM, then SIGKILL
/// after 15 s) on drop.
struct Serve {
    child: Child,
    base: String,
    _data: tempfile::TempDir,
}

impl Serve {
    fn start(block_tokens: usize, cache: ByteSize) -> Result<Serve> {
        let data = tempfile::Builder::new().prefix("granary-soak-serve-").tempdir()?;
        let exe = std::env::current_exe().context("finding the granary binary")?;
        let mut child = Command::new(&exe)
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data.path())
            .args(["--block-tokens", &block_tokens.to_string()])
            .args(["--kv-cache", &cache.as_u64().to_string(), "--warehouse-memory", &cache.as_u64().to_string()])
            .env("GRANARY_LOG", std::env::var("GRANARY_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} serve", exe.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut addr = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(500))) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("granary: OpenAI API on http://") {
                        addr = rest.split('/').next().map(str::to_string);
                    } else if line.trim() == "granary: ready" {
                        break;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !left.is_zero() => {}
                Err(_) => {
                    let _ = child.kill();
                    let status = child.wait()?;
                    bail!("granary serve did not become ready within 300 s ({status}); its log is above");
                }
            }
        }
        let base = format!("http://{}", addr.context("granary serve printed no address")?);
        Ok(Serve { child, base, _data: data })
    }

    fn stop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// Windows of equal length, at least six and at most `every` long: (count, length).
fn windows(total: Duration, every: Duration) -> (u32, Duration) {
    let every = every.max(Duration::from_millis(100));
    let n = (total.as_secs_f64() / every.as_secs_f64()).ceil().max(6.0) as u32;
    (n, total / n)
}

/// What the requests of one window add up to.
#[derive(Default)]
struct Window {
    ttft_ms: Vec<f64>,
    requests: u64,
    errors: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl Window {
    fn add(&mut self, o: &Outcome, errors: &mut Vec<(f64, String)>) {
        self.requests += 1;
        match &o.result {
            Ok(a) => {
                self.ttft_ms.push(a.ttft.as_secs_f64() * 1e3);
                self.prompt_tokens += a.prompt_tokens;
                self.cached_tokens += a.cached_tokens;
            }
            Err(e) => {
                self.errors += 1;
                if errors.len() < 20 {
                    errors.push((o.done.as_secs_f64(), e.clone()));
                }
            }
        }
    }

    fn into_sample(self, t_s: f64) -> Sample {
        Sample {
            t_s,
            requests: self.requests,
            errors: self.errors,
            ttft_p50_ms: judge::percentile(&self.ttft_ms, 0.50),
            ttft_p99_ms: judge::percentile(&self.ttft_ms, 0.99),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            ..Default::default()
        }
    }
}

/// The processes, the tiers and any metrics error, as of now.
async fn observe(http: &reqwest::Client, roots: &[u32], metrics: &[String], s: &mut Sample) {
    s.procs = procs::with_descendants(roots).into_iter().filter_map(procs::sample).collect();
    for url in metrics {
        let page =
            async { http.get(url).timeout(Duration::from_secs(10)).send().await?.error_for_status()?.text().await };
        match page.await {
            Ok(text) => {
                for (tier, b) in procs::tier_bytes(&text) {
                    *s.tier_bytes.entry(tier).or_insert(0) += b;
                }
            }
            Err(e) => s.metrics_error = Some(format!("{url}: {e}")),
        }
    }
}

pub async fn run(args: Args) -> Result<()> {
    if let Some(json) = &args.replot {
        let out = args.out.clone().or_else(|| json.parent().map(PathBuf::from)).unwrap_or_default();
        for chart in replot(json, &out)? {
            println!("wrote {}", chart.display());
        }
        return Ok(());
    }
    anyhow::ensure!(args.duration >= Duration::from_secs(1), "--duration must be at least 1s");
    anyhow::ensure!(args.block_words > 0, "--block-words must be at least 1");
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.speedup >= 0.0 && args.speedup.is_finite(), "--speedup must be 0 or a positive number");
    anyhow::ensure!(
        args.url.is_some() || args.pids.is_empty(),
        "--pid is for --url (the spawned serve is sampled anyway)"
    );
    let trace_path = match &args.trace {
        Some(p) => p.clone(),
        None => locate_mooncake_trace()?,
    };
    let full = load_trace(&trace_path).with_context(|| format!("reading the trace {}", trace_path.display()))?;
    let end = if args.trace_len == 0 { full.len() } else { (args.trace_start + args.trace_len).min(full.len()) };
    anyhow::ensure!(
        args.trace_start < end,
        "--trace-start {} is past the trace's {} requests",
        args.trace_start,
        full.len()
    );
    let slice = Arc::new(full[args.trace_start..end].to_vec());
    drop(full);

    let host = Host::probe();
    let (n, every) = windows(args.duration, args.sample_every);
    let warmup = args.warmup_windows.unwrap_or_else(|| judge::warmup_windows(n as usize));
    println!("Run with: {}", command_line());
    println!("Date:     {}", utc_timestamp(SystemTime::now()));
    println!("Host:     {}", host.describe());

    let mut serve = None;
    let (base, roots, metrics_urls, target_desc) = match &args.url {
        Some(u) => {
            let u = u.trim_end_matches('/').trim_end_matches("/v1").to_string();
            (u.clone(), args.pids.clone(), args.metrics_urls.clone(), format!("{u} (given)"))
        }
        None => {
            println!("Target:   starting granary serve with the default model on loopback ...");
            let s = Serve::start(args.serve_block_tokens, args.serve_cache)?;
            let base = s.base.clone();
            let pid = s.child.id();
            let metrics =
                if args.metrics_urls.is_empty() { vec![format!("{base}/metrics")] } else { args.metrics_urls.clone() };
            serve = Some(s);
            (
                base.clone(),
                vec![pid],
                metrics,
                format!(
                    "{base} (granary serve, pid {pid}, {}-token blocks, {} block cache and warehouse memory, started by \
                     the soak)",
                    args.serve_block_tokens, args.serve_cache
                ),
            )
        }
    };
    let http = reqwest::Client::builder().build()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => replay::first_model(&http, &base, args.api_key.as_deref()).await?,
    };
    println!("Target:   {target_desc}, model {model}");
    println!(
        "Replay:   trace {} requests {}..{end} ({} requests), {} words a block, at most {} blocks, {} output tokens, \
         speedup {}, concurrency {}",
        trace_path.display(),
        args.trace_start,
        slice.len(),
        args.block_words,
        args.max_blocks,
        args.max_tokens,
        args.speedup,
        args.concurrency
    );
    println!(
        "Sampling: {n} windows of {:.1} s ({} warm-up), processes {:?}, metrics {:?}",
        every.as_secs_f64(),
        warmup,
        roots,
        metrics_urls
    );

    let cfg = ReplayConfig {
        block_words: args.block_words,
        max_blocks: args.max_blocks,
        max_tokens: args.max_tokens,
        speedup: args.speedup,
        concurrency: args.concurrency,
        requests: args.requests,
        request_timeout: args.request_timeout,
        salt: args.salt,
    };
    let target = Target { base: base.clone(), api_key: args.api_key.clone(), model: model.clone() };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    let deadline = start + args.duration;
    let mut driver = tokio::spawn(replay::drive(http.clone(), target, cfg, slice, deadline, tx));

    let pb = bar(u64::from(n), "soak");
    let mut samples = Vec::new();
    let mut first_errors = Vec::new();
    let (mut ended, mut errors) = (0u64, 0u64);
    let mut sent = None;
    let mut rx_open = true;
    for i in 1..=n {
        let tick = start + every * i;
        let mut w = Window::default();
        loop {
            tokio::select! {
                o = rx.recv(), if rx_open => match o {
                    Some(o) => w.add(&o, &mut first_errors),
                    None => rx_open = false,
                },
                r = &mut driver, if sent.is_none() => sent = Some(r.context("the replay task")??),
                _ = tokio::time::sleep_until(tick.into()) => break,
            }
        }
        let t_s = start.elapsed().as_secs_f64();
        let mut probe = Sample::default();
        observe(&http, &roots, &metrics_urls, &mut probe).await;
        if i == n {
            // Requests in flight at the deadline end in the last window.
            pb.set_message("waiting for requests in flight");
            if sent.is_none() {
                sent = Some((&mut driver).await.context("the replay task")??);
            }
            while let Some(o) = rx.recv().await {
                w.add(&o, &mut first_errors);
            }
        }
        ended += w.requests;
        errors += w.errors;
        let mut s = w.into_sample(t_s);
        s.procs = probe.procs;
        s.tier_bytes = probe.tier_bytes;
        s.metrics_error = probe.metrics_error;
        pb.suspend(|| eprintln!("soak: {}", sample_line(&s)));
        samples.push(s);
        pb.inc(1);
        pb.set_message(format!("{ended} requests, {errors} errors"));
        if sent.is_some() && !rx_open {
            // `--requests` all sent and ended: nothing is left to watch.
            break;
        }
    }
    pb.finish_and_clear();
    let sent = sent.unwrap_or(0);
    if let Some(mut s) = serve.take() {
        s.stop();
    }

    let prompt_tokens: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached_tokens: u64 = samples.iter().map(|s| s.cached_tokens).sum();
    let hit_rate = if prompt_tokens == 0 { 0.0 } else { cached_tokens as f64 / prompt_tokens as f64 };
    let goals = judge::goals(&samples, errors, ended, warmup);
    let out = args.out.clone().unwrap_or_else(|| std::env::temp_dir().join("granary-soak"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let charts = draw_charts(&out, &samples)?;
    let report = Report {
        run_with: command_line(),
        date: utc_timestamp(SystemTime::now()),
        host,
        release_build: !cfg!(debug_assertions),
        target: target_desc,
        model,
        trace: trace_path,
        trace_slice: (args.trace_start, end),
        duration_s: args.duration.as_secs_f64(),
        sample_every_s: every.as_secs_f64(),
        warmup_windows: warmup,
        block_words: args.block_words,
        max_blocks: args.max_blocks,
        max_tokens: args.max_tokens,
        speedup: args.speedup,
        concurrency: args.concurrency,
        requests_sent: sent,
        requests_ended: ended,
        errors,
        first_errors,
        prompt_tokens,
        cached_tokens,
        hit_rate,
        samples,
        goals,
        charts,
    };
    print_report(&report);
    let json = out.join("soak.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", json.display()))?;
    for c in &report.charts {
        println!("Chart:    {}", c.display());
    }
    println!("JSON:     {}", json.display());
    if report.errors > 0 {
        bail!("{} of {} requests failed", report.errors, report.requests_ended);
    }
    if args.strict && report.goals.iter().any(|g| !g.pass) {
        bail!("--strict: a soak goal was missed");
    }
    Ok(())
}

fn opt_ms(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / f64::from(1u32 << 20))
}

fn sample_line(s: &Sample) -> String {
    let procs: Vec<String> =
        s.procs.iter().map(|p| format!("{}[{}] {} MiB {} fds", p.name, p.pid, mib(p.rss_bytes), p.fds)).collect();
    format!(
        "t={:.0}s {} requests, {} errors, TTFT p50 {} p99 {} ms; {}",
        s.t_s,
        s.requests,
        s.errors,
        opt_ms(s.ttft_p50_ms),
        opt_ms(s.ttft_p99_ms),
        procs.join(", ")
    )
}

fn print_report(r: &Report) {
    let tiers: Vec<String> = {
        let mut t: Vec<String> = r.samples.iter().flat_map(|s| s.tier_bytes.keys().cloned()).collect();
        t.sort();
        t.dedup();
        t
    };
    let mut headers = vec!["t (s)", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "hit %"];
    let tier_heads: Vec<String> = tiers.iter().map(|t| format!("{t} MiB")).collect();
    headers.extend(tier_heads.iter().map(String::as_str));
    let mut t = Table::new("soak: per window (requests that ended in it; warehouse bytes at its end)", &headers);
    for s in &r.samples {
        let hit = if s.prompt_tokens == 0 {
            "-".into()
        } else {
            format!("{:.1}", 100.0 * s.cached_tokens as f64 / s.prompt_tokens as f64)
        };
        let mut row = vec![
            format!("{:.0}", s.t_s),
            s.requests.to_string(),
            s.errors.to_string(),
            opt_ms(s.ttft_p50_ms),
            opt_ms(s.ttft_p99_ms),
            hit,
        ];
        row.extend(tiers.iter().map(|k| s.tier_bytes.get(k).map_or_else(|| "-".into(), |b| mib(*b))));
        t.row(row);
    }
    println!("\n{}", t.render());
    let mut p =
        Table::new("soak: processes per window (RSS MiB / open files)", &["t (s)", "process", "RSS MiB", "fds"]);
    for s in &r.samples {
        for x in &s.procs {
            p.row(vec![format!("{:.0}", s.t_s), format!("{}[{}]", x.name, x.pid), mib(x.rss_bytes), x.fds.to_string()]);
        }
    }
    println!("{}", p.render());
    if let Some(e) = r.samples.iter().find_map(|s| s.metrics_error.as_ref()) {
        println!("Metrics:  a scrape failed: {e}");
    }
    for (t, e) in &r.first_errors {
        println!("Error:    at {t:.1} s: {e}");
    }
    println!(
        "Summary:  {} requests sent, {} ended, {} errors; prefix hit rate {:.1}% ({} of {} prompt tokens cached)",
        r.requests_sent,
        r.requests_ended,
        r.errors,
        r.hit_rate * 100.0,
        r.cached_tokens,
        r.prompt_tokens
    );
    println!("\nGoals");
    for g in &r.goals {
        println!("{}", g.render());
    }
    println!();
}

/// The charts of the run recorded in `json` (a soak.json), drawn into `out`.
fn replot(json: &std::path::Path, out: &std::path::Path) -> Result<Vec<PathBuf>> {
    #[derive(Deserialize)]
    struct Recorded {
        samples: Vec<Sample>,
    }
    let text = std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let recorded: Recorded =
        serde_json::from_str(&text).with_context(|| format!("{}: not a soak.json", json.display()))?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    draw_charts(out, &recorded.samples)
}

/// TTFT, requests and errors, RSS and open files per process, and the
/// warehouse's bytes per tier, each over time.
fn draw_charts(out: &std::path::Path, samples: &[Sample]) -> Result<Vec<PathBuf>> {
    use chart::{time_chart, Series};
    let pick = |f: fn(&Sample) -> Option<f64>| samples.iter().filter_map(|s| f(s).map(|v| (s.t_s, v))).collect();
    let requests = out.join("soak-requests.png");
    time_chart(
        &requests,
        "Requests ended per window",
        "requests",
        &[
            Series { name: "all".into(), points: pick(|s| Some(s.requests as f64)) },
            Series { name: "errors".into(), points: pick(|s| Some(s.errors as f64)) },
        ],
    )?;
    let ttft = out.join("soak-ttft.png");
    time_chart(
        &ttft,
        "TTFT per window",
        "ms",
        &[
            Series { name: "p50".into(), points: pick(|s| s.ttft_p50_ms) },
            Series { name: "p99".into(), points: pick(|s| s.ttft_p99_ms) },
        ],
    )?;
    let per_proc = |f: fn(&ProcSample) -> f64| -> Vec<Series> {
        let mut by_proc: BTreeMap<(u32, String), Vec<(f64, f64)>> = BTreeMap::new();
        for s in samples {
            for p in &s.procs {
                by_proc.entry((p.pid, p.name.clone())).or_default().push((s.t_s, f(p)));
            }
        }
        by_proc.into_iter().map(|((pid, name), points)| Series { name: format!("{name}[{pid}]"), points }).collect()
    };
    let rss = out.join("soak-rss.png");
    time_chart(&rss, "RSS per process", "MiB", &per_proc(|p| p.rss_bytes as f64 / f64::from(1u32 << 20)))?;
    let fds = out.join("soak-fds.png");
    time_chart(&fds, "Open files per process", "open files", &per_proc(|p| p.fds as f64))?;
    let mut by_tier: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for s in samples {
        for (t, b) in &s.tier_bytes {
            by_tier.entry(t.clone()).or_default().push((s.t_s, *b as f64 / f64::from(1u32 << 20)));
        }
    }
    let tiers = out.join("soak-warehouse.png");
    let series: Vec<Series> = by_tier.into_iter().map(|(name, points)| Series { name, points }).collect();
    time_chart(&tiers, "Warehouse bytes per tier", "MiB", &series)?;
    Ok(vec![ttft, requests, rss, fds, tiers])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_get_at_least_six_windows() {
        assert_eq!(windows(Duration::from_secs(600), Duration::from_secs(60)), (10, Duration::from_secs(60)));
        let (n, w) = windows(Duration::from_secs(20), Duration::from_secs(60));
        assert_eq!(n, 6);
        assert!((w.as_secs_f64() - 20.0 / 6.0).abs() < 1e-6);
        assert_eq!(windows(Duration::from_secs(60), Duration::from_secs(60)), (6, Duration::from_secs(10)));
        assert_eq!(windows(Duration::from_secs(90), Duration::from_secs(10)).0, 9);
    }

    #[test]
    fn windows_count_errors_and_percentiles() {
        let mut w = Window::default();
        let mut errs = Vec::new();
        for ms in [10u64, 20, 30] {
            let a = replay::Answer {
                ttft: Duration::from_millis(ms),
                prompt_tokens: 100,
                cached_tokens: 50,
                completion_tokens: 8,
            };
            w.add(&Outcome { done: Duration::from_secs(1), result: Ok(a) }, &mut errs);
        }
        w.add(&Outcome { done: Duration::from_secs(2), result: Err("503".into()) }, &mut errs);
        let s = w.into_sample(5.0);
        assert_eq!((s.requests, s.errors, s.prompt_tokens, s.cached_tokens), (4, 1, 300, 150));
        assert_eq!((s.ttft_p50_ms, s.ttft_p99_ms), (Some(20.0), Some(30.0)));
        assert_eq!(errs, vec![(2.0, "503".to_string())]);
    }

    #[test]
    fn charts_are_pngs() {
        let dir = tempfile::tempdir().unwrap();
        let samples: Vec<Sample> = (1..=6)
            .map(|i| Sample {
                t_s: f64::from(i) * 10.0,
                ttft_p50_ms: Some(40.0),
                ttft_p99_ms: Some(90.0),
                procs: vec![ProcSample { pid: 1, name: "granary".into(), rss_bytes: 200 << 20, fds: 30 }],
                tier_bytes: [("memory".to_string(), 5u64 << 20)].into(),
                ..Default::default()
            })
            .collect();
        let charts = draw_charts(dir.path(), &samples).unwrap();
        let names: Vec<_> = charts.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["soak-ttft.png", "soak-requests.png", "soak-rss.png", "soak-fds.png", "soak-warehouse.png"]);
        for p in &charts {
            let b = std::fs::read(p).unwrap();
            assert!(b.len() > 1000 && b.starts_with(b"\x89PNG"), "{}", p.display());
        }
        // An earlier run's soak.json draws the same charts again.
        let json = dir.path().join("soak.json");
        std::fs::write(&json, serde_json::to_vec(&serde_json::json!({"date": "x", "samples": samples})).unwrap())
            .unwrap();
        let again = dir.path().join("again");
        let redrawn = replot(&json, &again).unwrap();
        assert_eq!(redrawn.len(), 5);
        assert!(redrawn.iter().all(|p| p.starts_with(&again) && p.exists()));
        std::fs::write(&json, b"{\"samples\": 3}").unwrap();
        let err = format!("{:#}", replot(&json, &again).unwrap_err());
        assert!(err.contains("not a soak.json"), "{err}");
    }
}
