//! `granary bench coldstart`: time from a chat request for a model no
//! engine serves to its first token, by where the weights are when the
//! request arrives: only in the registry, in the node agent's disk tier, or
//! in its RAM tier.
//!
//! Everything is real and on this host: `granary registry serve` (the
//! default model imported with `dir:`), `granary agent` starting real
//! `granary engine` processes, and `granary gateway` with agents on, which
//! loads the model on demand (`--no-gateway`: the client asks the agent to
//! load, then sends the request to the engine itself). Per tier and run:
//!
//! - **registry**: a fresh agent with empty tiers (promotion off); the load
//!   downloads the file (8 × 16 MiB ranges, sha256 checked) into its disk
//!   tier. The registry's stored copy is dropped from the page cache first.
//! - **disk**: the file in the disk tier, not loaded, its pages dropped
//!   from the page cache (`posix_fadvise(DONTNEED)`), promotion off.
//! - **ram**: an agent that promotes on the first load, warmed once, so the
//!   file sits in the RAM tier (tmpfs); not loaded.
//!
//! The client sends `stream: true` and times the first chunk carrying
//! content. The breakdown comes from the agent's last load answer
//! (`GET /status` → `loads`: `load_ms`, `fetch_ms`, `engine_ms`) and the
//! engine's own start-up lines in its log (`granary: load stats {...}`:
//! weights read and conversion; `granary: startup {"ready_ms"}`: process
//! start to serving). A warm request on the loaded model follows each cold
//! one, for reference.
//!
//! `--fleet` measures placement instead ([`fleet`]): three agents with the
//! weights in RAM (no checkpoint), on disk (with one) and nowhere, locality
//! placement (the estimated time to first token) against fewest-engines
//! placement; then the prefetch prediction's hit rate on a
//! replayed request log ([`replay`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{ensure, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use plotters::prelude::*;
use serde::Serialize;
use serde_json::Value;

use super::warehouse::disk::{drop_from_page_cache, files_under};
use super::warehouse::report::{bar, command_line, utc_timestamp, Host};
use crate::engine::{LoadReport, LOAD_STATS_PREFIX, STARTUP_PREFIX};
use procs::{chat, is_tmpfs, start_gateway, strings, Engines, Proc};
use report::{draw, median_of, median_run, tables, Report, Run, TierResult, PARTS};

mod fleet;
mod procs;
mod replay;
mod report;

const MODEL: &str = "smollm2";
const AGENT_TOKEN: &str = "coldstart-agent-admin-token";
const REG_ADMIN: &str = "coldstart-registry-admin-token";
const REG_READ: &str = "coldstart-registry-read-token";
const GW_ADMIN: &str = "coldstart-gateway-admin-token";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TierName {
    Registry,
    Disk,
    Ram,
}

impl TierName {
    pub(super) fn name(self) -> &'static str {
        match self {
            TierName::Registry => "registry",
            TierName::Disk => "disk",
            TierName::Ram => "ram",
        }
    }
}

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The model: `default` (SmolLM2-135M GGUF) or a GGUF file; imported into the registry as `smollm2`.
    #[arg(long, default_value = "default")]
    model: String,
    /// Tiers to measure, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "registry,disk,ram")]
    tiers: Vec<TierName>,
    /// Cold starts per tier; tables show the median [default: 5, 1 with --quick].
    #[arg(long)]
    runs: Option<usize>,
    /// Send the request to the engine after asking the agent to load,
    /// instead of through a gateway that loads on demand.
    #[arg(long)]
    no_gateway: bool,
    /// The agent's --health-interval (a starting engine is polled every 50 ms at most regardless).
    #[arg(long, default_value = "1s")]
    health_interval: String,
    /// Flags for the engines, as the agent's --engine-arg (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    engine_args: Vec<String>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Where the registry, the agent's disk tier and logs go [default: the system temp directory].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The RAM tier's directory parent [default: /dev/shm, else --dir].
    #[arg(long)]
    ram_dir: Option<PathBuf>,
    /// Directory for the chart.
    #[arg(long, default_value = "bench-out/coldstart")]
    out: PathBuf,
    /// Also write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A smoke run: one run per tier (with --fleet: one round per placement).
    #[arg(long)]
    quick: bool,
    /// Placement on a fleet of three agents (weights in RAM, on disk,
    /// nowhere): locality against fewest engines, then the prefetch
    /// prediction replayed on a synthetic request log. --runs: rounds per
    /// placement [default 6: each tier twice under fewest_engines].
    #[arg(long)]
    fleet: bool,
}

/// Everything the runs share.
struct Setup {
    exe_args: Vec<String>,
    /// Kept running until the end (killed on drop).
    _registry: Proc,
    gateway: Option<(Proc, String)>,
    base: PathBuf,
    ram_parent: PathBuf,
    http: reqwest::Client,
    engines: Engines,
    max_tokens: u32,
}

pub async fn run(args: Args) -> Result<()> {
    let runs = args
        .runs
        .unwrap_or(if args.quick {
            1
        } else if args.fleet {
            6
        } else {
            5
        })
        .max(1);
    ensure!(!args.tiers.is_empty(), "--tiers: give at least one tier");
    humantime::parse_duration(&args.health_interval)
        .map_err(|e| anyhow::anyhow!("--health-interval {:?}: {e}", args.health_interval))?;
    let host = Host::probe();
    let date = utc_timestamp(SystemTime::now());
    let run_with = command_line();
    let release = !cfg!(debug_assertions);
    println!("Run with: {run_with}");
    println!("Date:     {date}");
    println!("Host:     {}", host.describe());
    println!(
        "Build:    {}; {runs} cold start(s) {}{}",
        if release { "release" } else { "debug (figures not representative)" },
        if args.fleet { "per placement" } else { "per tier" },
        if args.quick { "; --quick" } else { "" }
    );
    let resolved = args.model.parse::<granary_engine::source::ModelSource>()?.resolve()?;
    ensure!(resolved.path.is_file(), "--model must be a GGUF file (got {})", resolved.path.display());
    let model_bytes = std::fs::metadata(&resolved.path)?.len();

    let base_parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base_parent)?;
    let base = tempfile::Builder::new().prefix("granary-bench-coldstart-").tempdir_in(&base_parent)?;
    let shm = Path::new("/dev/shm");
    let ram_parent_dir =
        args.ram_dir
            .clone()
            .unwrap_or_else(|| if shm.is_dir() { shm.to_path_buf() } else { base.path().to_path_buf() });
    let ram_root = tempfile::Builder::new().prefix("granary-bench-coldstart-ram-").tempdir_in(&ram_parent_dir)?;
    let tmpfs = is_tmpfs(ram_root.path());
    println!(
        "Model:    {} ({:.1} MB), imported into the registry as `{MODEL}`",
        resolved.path.display(),
        model_bytes as f64 / 1e6
    );
    println!(
        "Tiers:    disk {}, RAM {}{}",
        base.path().display(),
        ram_root.path().display(),
        if tmpfs { " (tmpfs)" } else { " (NOT a tmpfs: the RAM tier is a plain directory here)" }
    );
    println!(
        "Path:     {}; agent --health-interval {}",
        if args.no_gateway {
            "client → agent load → engine"
        } else {
            "client → gateway (load on demand) → agent → engine"
        },
        args.health_interval
    );
    println!();

    let registry = Proc::start(
        "registry",
        &strings(&[
            "registry",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &base.path().join("registry").display().to_string(),
            "--admin-token",
            REG_ADMIN,
            "--read-token",
            REG_READ,
        ]),
        &[],
        "granary registry: listening on ",
        "granary registry: ready",
    )?;
    let exe = std::env::current_exe()?;
    let import = Command::new(&exe)
        .args(["registry", "import", &format!("dir:{}", resolved.path.display()), "--name", MODEL])
        .args(["--url", &registry.base, "--token", REG_ADMIN])
        .env("GRANARY_LOG", "warn")
        .output()
        .context("running granary registry import")?;
    ensure!(import.status.success(), "registry import failed: {}", String::from_utf8_lossy(&import.stderr).trim());

    let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    if args.fleet {
        let rounds = runs;
        let mut engines = Engines { pids: Vec::new(), marker: base.path().display().to_string() };
        let pb = bar((2 * rounds) as u64, "coldstart --fleet");
        let f = fleet::Fleet::start(&args, &registry.base, base.path(), ram_root.path(), &http, &mut engines).await?;
        let r = fleet::run(f, rounds, &pb).await;
        pb.finish_and_clear();
        let r = r?;
        println!("{}", fleet::table(&r).render());
        let (l, f) = (r.summary["locality"].0, r.summary["fewest_engines"].0);
        println!("fewest_engines / locality, median first token: {:.2}x\n", f / l.max(1e-9));
        let replayed = replay::replay(42);
        println!("{}", replay::table(&replayed).render());
        if let Some(path) = &args.json {
            let v = serde_json::json!({"run_with": run_with, "date": date, "host": host, "release_build": release,
                "model_bytes": model_bytes, "fleet": r, "replay": replayed});
            std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
            println!("JSON: {}", path.display());
        }
        drop(engines);
        return Ok(());
    }
    let gateway = if args.no_gateway { None } else { Some(start_gateway(base.path(), &http, "gateway", "").await?) };
    let mut agent_args = strings(&[
        "--registry",
        &registry.base,
        "--registry-token",
        REG_READ,
        "--admin-token",
        AGENT_TOKEN,
        "--agent-id",
        "bench-node",
        "--heartbeat-interval",
        "250ms",
        "--health-interval",
        &args.health_interval,
        "--ram-budget",
        "4GiB",
    ]);
    if let Some((gw, _)) = &gateway {
        agent_args.extend(strings(&["--gateway", &gw.base, "--gateway-token", GW_ADMIN]));
    }
    for a in &args.engine_args {
        agent_args.push(format!("--engine-arg={a}"));
    }
    let mut setup = Setup {
        exe_args: agent_args,
        _registry: registry,
        gateway,
        base: base.path().to_path_buf(),
        ram_parent: ram_root.path().to_path_buf(),
        http,
        engines: Engines { pids: Vec::new(), marker: base.path().display().to_string() },
        max_tokens: args.max_tokens,
    };

    let pb = bar((args.tiers.len() * runs) as u64, "coldstart");
    let mut tiers = Vec::new();
    for &tier in &args.tiers {
        let mut results = Vec::new();
        let phase = tier_phase(&mut setup, tier, runs, &pb, &mut results).await;
        if let Err(e) = phase {
            pb.finish_and_clear();
            return Err(e.context(format!("the {} tier", tier.name())));
        }
        let median = median_run(tier, &results);
        let median_parts =
            (0..PARTS.len()).map(|i| median_of(&results.iter().map(|r| r.parts()[i]).collect::<Vec<_>>())).collect();
        tiers.push(TierResult { tier, runs: results, median, median_parts });
    }
    pb.finish_and_clear();

    let report = Report {
        run_with,
        date,
        host,
        release_build: release,
        quick: args.quick,
        gateway: setup.gateway.is_some(),
        model_path: resolved.path.clone(),
        model_bytes,
        ram_dir: ram_root.path().to_path_buf(),
        ram_dir_is_tmpfs: tmpfs,
        health_interval: args.health_interval.clone(),
        parts: PARTS.iter().map(|p| p.0).collect(),
        tiers,
    };
    for t in tables(&report) {
        println!("{}", t.render());
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let svg = args.out.join("coldstart.svg");
    let png = args.out.join("coldstart.png");
    draw(&report, SVGBackend::new(&svg, (900, 520)).into_drawing_area())
        .with_context(|| format!("drawing {}", svg.display()))?;
    draw(&report, BitMapBackend::new(&png, (900, 520)).into_drawing_area())
        .with_context(|| format!("drawing {}", png.display()))?;
    println!("Chart: {} and {}", svg.display(), png.display());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("JSON: {}", path.display());
    }
    drop(setup);
    Ok(())
}

/// A running agent over `cache` (and a RAM directory).
struct Agent {
    proc: Proc,
}

impl Setup {
    fn agent(&self, cache: &Path, ram: &Path, promote_after: u32) -> Result<Agent> {
        let mut a = strings(&["agent", "--listen", "127.0.0.1:0"]);
        a.extend(self.exe_args.iter().cloned());
        a.extend(strings(&[
            "--cache-dir",
            &cache.display().to_string(),
            "--ram-dir",
            &ram.display().to_string(),
            "--promote-after",
            &promote_after.to_string(),
        ]));
        let proc = Proc::start("agent", &a, &[], "granary agent: control API on ", "granary: ready")?;
        Ok(Agent { proc })
    }

    async fn agent_call(&self, agent: &Agent, method: reqwest::Method, path: &str) -> Result<Value> {
        let r = self
            .http
            .request(method, format!("{}{path}", agent.proc.base))
            .bearer_auth(AGENT_TOKEN)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await?;
        let status = r.status();
        let text = r.text().await?;
        ensure!(status.is_success(), "agent {path}: {status} {text}");
        serde_json::from_str(&text).with_context(|| format!("agent {path}: not JSON: {text}"))
    }

    /// Unloads the model if loaded; waits until the gateway no longer routes to it.
    async fn unload(&self, agent: &Agent) -> Result<()> {
        let st = self.agent_call(agent, reqwest::Method::GET, "/status").await?;
        let loaded = st["engines"].as_array().is_some_and(|e| e.iter().any(|e| e["model"] == MODEL));
        if loaded {
            self.agent_call(agent, reqwest::Method::POST, &format!("/models/{MODEL}/unload")).await?;
        }
        self.wait_gateway(agent, false).await
    }

    /// Waits until the gateway lists this agent (its URL: an agent started
    /// again under the same id replaces the old entry at its first
    /// heartbeat), with the model loadable and (`loaded`) an engine for it
    /// or (not `loaded`) none.
    async fn wait_gateway(&self, agent: &Agent, loaded: bool) -> Result<()> {
        let Some((gw, _)) = &self.gateway else { return Ok(()) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v: Value = self
                .http
                .get(format!("{}/admin/v1/agents", gw.base))
                .bearer_auth(GW_ADMIN)
                .send()
                .await?
                .json()
                .await?;
            let ok =
                v["data"].as_array().and_then(|a| a.iter().find(|a| a["agent_id"] == "bench-node")).is_some_and(|a| {
                    let listed = a["url"] == agent.proc.base.as_str()
                        && a["models"].as_array().is_some_and(|m| m.iter().any(|m| m == MODEL));
                    let engines = a["engines"].as_array().map_or(0, |e| e.len());
                    listed && (engines > 0) == loaded
                });
            if ok {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "the gateway did not see the agent's state within 30 s: {v}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Streams one chat request to `url`; ms to the first content chunk.
    async fn chat(&self, url: &str, key: Option<&str>) -> Result<f64> {
        Ok(chat(&self.http, url, key, self.max_tokens).await?.0)
    }

    /// One cold start: the request, then the warm one, then the breakdown.
    async fn measure(&mut self, agent: &Agent, tier: TierName) -> Result<Run> {
        let mut run = Run { tier: tier.name().into(), ..Default::default() };
        let upstream = match &self.gateway {
            Some((gw, key)) => {
                let (base, key) = (gw.base.clone(), key.clone());
                run.ttft_ms = self.chat(&base, Some(&key)).await?;
                run.warm_ttft_ms = self.chat(&base, Some(&key)).await?;
                None
            }
            None => {
                let t0 = Instant::now();
                let a = self.agent_call(agent, reqwest::Method::POST, &format!("/models/{MODEL}/load")).await?;
                let up = a["upstream"].as_str().context("no upstream in the load answer")?.to_string();
                let load_ms = t0.elapsed().as_secs_f64() * 1e3;
                run.ttft_ms = load_ms + self.chat(&up, None).await?;
                run.warm_ttft_ms = self.chat(&up, None).await?;
                Some(up)
            }
        };
        let st = self.agent_call(agent, reqwest::Method::GET, "/status").await?;
        if let Some(pid) = st["engines"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["model"] == MODEL))
            .and_then(|e| e["pid"].as_u64())
        {
            self.engines.pids.push(pid as u32);
        }
        let load = st["loads"]
            .as_array()
            .and_then(|l| l.iter().find(|l| l["model"] == MODEL))
            .with_context(|| format!("the agent's status has no load of {MODEL}: {st}"))?;
        let got = load["tier"].as_str().unwrap_or_default();
        ensure!(got == tier.name(), "the load was served from the {got} tier, expected {}: {load}", tier.name());
        if let Some(up) = upstream {
            ensure!(load["upstream"] == up.as_str(), "the status's last load is not this one: {load}");
        }
        let num = |k: &str| load[k].as_f64().unwrap_or(0.0);
        run.load_ms = num("load_ms");
        run.fetch_ms = num("fetch_ms");
        run.engine_ms = num("engine_ms");

        let logs = self
            .http
            .get(format!("{}/models/{MODEL}/logs?tail=400", agent.proc.base))
            .bearer_auth(AGENT_TOKEN)
            .send()
            .await?
            .text()
            .await?;
        let stats = logs
            .lines()
            .rev()
            .find_map(|l| l.split_once(LOAD_STATS_PREFIX).map(|(_, j)| j.to_string()))
            .context("the engine's log has no load stats line")?;
        let stats: LoadReport = serde_json::from_str(&stats).context("parsing the engine's load stats")?;
        let ready = logs
            .lines()
            .rev()
            .find_map(|l| l.split_once(STARTUP_PREFIX).map(|(_, j)| j.to_string()))
            .context("the engine's log has no startup line")?;
        let ready: Value = serde_json::from_str(&ready)?;
        run.read_ms = stats.header_ms + stats.read_ms;
        run.convert_ms = stats.convert_ms;
        run.tokenizer_ms = stats.tokenizer_ms;
        run.before_load_ms = stats.before_load_ms;
        run.ready_ms = ready["ready_ms"].as_f64().unwrap_or(0.0);
        run.weights_bytes = stats.weights_bytes;
        run.loader = stats.loader;
        run.checkpoint = stats.checkpoint;
        Ok(run)
    }
}

/// Runs the cold starts of one tier.
async fn tier_phase(
    s: &mut Setup,
    tier: TierName,
    runs: usize,
    pb: &indicatif::ProgressBar,
    out: &mut Vec<Run>,
) -> Result<()> {
    let registry_dir = s.base.join("registry");
    let log = |i: usize, r: &Run| {
        pb.suspend(|| {
            eprintln!(
                "coldstart: {} run {}/{runs}: first token {:.0} ms (load {:.0} ms: fetch {:.0}, engine {:.0}: read {:.0}, conversion {:.0}); warm {:.0} ms",
                tier.name(),
                i + 1,
                r.ttft_ms,
                r.load_ms,
                r.fetch_ms,
                r.engine_ms,
                r.read_ms,
                r.convert_ms,
                r.warm_ttft_ms
            )
        })
    };
    match tier {
        TierName::Registry => {
            for i in 0..runs {
                pb.set_message(format!("registry run {}/{runs}", i + 1));
                let cache = s.base.join(format!("agent-registry-{i}"));
                let ram = s.ram_parent.join(format!("registry-{i}"));
                let agent = s.agent(&cache, &ram, 0)?;
                s.wait_gateway(&agent, false).await?;
                for f in files_under(&registry_dir) {
                    drop_from_page_cache(&f)?;
                }
                let r = s.measure(&agent, tier).await?;
                log(i, &r);
                out.push(r);
                pb.inc(1);
                s.unload(&agent).await?;
                drop(agent);
                std::fs::remove_dir_all(&cache).ok();
                std::fs::remove_dir_all(&ram).ok();
            }
        }
        TierName::Disk | TierName::Ram => {
            let name = tier.name();
            let cache = s.base.join(format!("agent-{name}"));
            let ram = s.ram_parent.join(name);
            // RAM: promote on the first load, which is the warm-up.
            let agent = s.agent(&cache, &ram, if tier == TierName::Ram { 1 } else { 0 })?;
            s.wait_gateway(&agent, false).await?;
            pb.set_message(format!("{name}: warm-up load"));
            s.agent_call(&agent, reqwest::Method::POST, &format!("/models/{MODEL}/load")).await?;
            // The engine writes its converted-weight checkpoint in the
            // background after its first start; the runs measure starts
            // that find it (unless the engines are told not to keep one).
            if !s.exe_args.iter().any(|a| a.starts_with("--engine-arg=--checkpoint")) {
                wait_checkpoint(&cache.join("models"), Duration::from_secs(120)).await?;
            }
            s.unload(&agent).await?;
            for i in 0..runs {
                pb.set_message(format!("{name} run {}/{runs}", i + 1));
                if tier == TierName::Disk {
                    for f in files_under(&cache.join("blobs")) {
                        drop_from_page_cache(&f)?;
                    }
                }
                let r = s.measure(&agent, tier).await?;
                log(i, &r);
                out.push(r);
                pb.inc(1);
                s.unload(&agent).await?;
            }
            drop(agent);
            std::fs::remove_dir_all(&ram).ok();
        }
    }
    Ok(())
}

/// Waits until a model directory under `models` holds the engine's
/// converted-weight checkpoint (`<name>/<revision>/*.ckpt`).
pub(super) async fn wait_checkpoint(models: &Path, limit: Duration) -> Result<()> {
    let until = Instant::now() + limit;
    let found = || {
        std::fs::read_dir(models).into_iter().flatten().flatten().any(|m| {
            std::fs::read_dir(m.path()).into_iter().flatten().flatten().any(|r| {
                std::fs::read_dir(r.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|f| granary_core::is_checkpoint_file(&f.file_name().to_string_lossy()))
            })
        })
    };
    while !found() {
        ensure!(Instant::now() < until, "the engine wrote no checkpoint under {} within {limit:?}", models.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_add_up_to_the_first_token() {
        let r = Run {
            ttft_ms: 2000.0,
            load_ms: 1800.0,
            fetch_ms: 300.0,
            engine_ms: 1400.0,
            read_ms: 60.0,
            convert_ms: 900.0,
            ready_ms: 1300.0,
            ..Default::default()
        };
        let p = r.parts();
        assert_eq!(p, [300.0, 100.0, 60.0, 900.0, 340.0, 100.0, 200.0]);
        assert_eq!(p.iter().sum::<f64>(), r.ttft_ms);
    }

    #[test]
    fn dev_shm_is_a_tmpfs_where_it_exists() {
        if Path::new("/dev/shm").is_dir()
            && std::fs::read_to_string("/proc/mounts").unwrap_or_default().contains(" /dev/shm tmpfs")
        {
            assert!(is_tmpfs(Path::new("/dev/shm")));
        }
        assert!(!is_tmpfs(Path::new("/definitely/not/mounted/here")) || is_tmpfs(Path::new("/")));
    }
}
