//! `granary bench engine`: prefill and decode throughput of the engine
//! against llama.cpp on the same GGUF, the same prompt ids and the same
//! thread count (`--threads`, every core by default: granary's pool is set
//! to it, llama.cpp gets it), in the same run, over `--rounds` alternating
//! rounds (granary, llama.cpp, granary, ...); the figures are each level's
//! median with the spread (lowest to highest) beside it.
//!
//! Granary: for each concurrency level, a fresh engine (no warehouse) gets
//! that many copies of the prompt at once, each in its own tenant namespace
//! so no KV is shared; greedy, end-of-text ignored, `--gen-tokens` each.
//! Prefill tok/s = all prompt tokens / time until every stream had its
//! first token. Decode tok/s = tokens that arrived after the last stream's
//! first token / the time from then to the last token (aggregate over the
//! streams; at concurrency 1, generated tokens after the first / their
//! time).
//!
//! llama.cpp: `scripts/bench/llama_cpp_engine.py` (embedded in this binary)
//! run with `--python`, through llama-cpp-python's low-level API: one
//! context per level with that many sequences, prompts evaluated in
//! `n_batch` chunks, then one batched decode step per token over all
//! sequences, with OpenMP's default wait policy (threads spin a while
//! before sleeping; `OMP_WAIT_POLICY`, if set, is passed on), as granary's
//! thread pool spins briefly too (`CANDLE_BARRIER_POOL_SPIN_LIMIT=2000`,
//! see `main`). Never spinning (`PASSIVE`) costs llama.cpp most of its
//! decode speed: 20 against 150 tok/s at one stream on 2 cores. If the interpreter or
//! `llama_cpp` is missing, granary's figures are printed alone.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::bench::plot::{legend, line_key};
use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::llm::{self, ms, Loaded};
use super::warehouse::report::{command_line, utc_timestamp, Goal, Host, Table};

/// The anchor script, shipped inside the binary so the benchmark runs from
/// anywhere; its source is `scripts/bench/llama_cpp_engine.py`.
const SCRIPT: &str = include_str!("../../../../scripts/bench/llama_cpp_engine.py");
const PREFILL_GOAL: f64 = 1.0;
const DECODE_GOAL: f64 = 1.0;
/// Aggregate decode against llama.cpp's at [`MANY_STREAMS`] streams.
const MANY_DECODE_GOAL: f64 = 1.5;
const MANY_STREAMS: usize = 16;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Model: `default`, or a GGUF file (llama.cpp needs a GGUF).
    #[arg(long, default_value = "default")]
    model: String,
    /// Concurrent streams, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Device of granary's engine (the llama.cpp anchor runs on the CPU): cpu, or cuda[:N] in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tokens generated per stream.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Python interpreter with llama-cpp-python (the anchor).
    #[arg(long, default_value = "python3")]
    python: String,
    /// Threads of both engines [default: every core].
    #[arg(long)]
    threads: Option<usize>,
    /// Alternating rounds (granary, llama.cpp, granary, ...).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Prompt tokens per step: granary's `--max-batch-tokens`, llama.cpp's `n_batch`.
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Directory for engine.json and the charts.
    #[arg(long, default_value = "bench-out/engine")]
    out: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Level {
    concurrency: usize,
    prefill_s: f64,
    prefill_tok_s: f64,
    decode_tokens: usize,
    decode_s: f64,
    decode_tok_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
struct GranaryLevel {
    #[serde(flatten)]
    level: Level,
    /// Time to first token of each stream, ms.
    ttft_ms: Vec<f64>,
    /// From submission to the last token, s.
    total_s: f64,
    /// The tokens the first stream generated.
    first_stream_ids: Vec<u32>,
    /// Concurrency 1: the two most likely tokens (id, log probability) at
    /// each step.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    first_stream_top2: Vec<Vec<(u32, f32)>>,
}

#[derive(Debug, Clone, Deserialize)]
struct AnchorLevel {
    #[serde(flatten)]
    level: Level,
    #[serde(default)]
    tokens: Vec<Vec<u32>>,
    /// Concurrency 1: the two highest (id, logit) at each step.
    #[serde(default)]
    top2: Vec<Vec<(u32, f32)>>,
    #[serde(default)]
    perf: serde_json::Value,
}

#[derive(Debug, Deserialize)]
struct AnchorOut {
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    llama_cpp_python: Option<String>,
    #[serde(default)]
    system_info: Option<String>,
    #[serde(default)]
    results: Vec<AnchorLevel>,
    #[serde(default)]
    errors: Vec<serde_json::Value>,
}

#[derive(Debug, Serialize)]
struct Anchor {
    python: String,
    /// Why there are no llama.cpp figures (or only some).
    #[serde(skip_serializing_if = "Option::is_none")]
    unavailable: Option<String>,
    llama_cpp_python: Option<String>,
    system_info: Option<String>,
    omp_wait_policy: String,
    threads: usize,
    levels: Vec<serde_json::Value>,
    errors: Vec<serde_json::Value>,
}

/// One engine's figures at one level, every round.
#[derive(Debug, Clone, Serialize)]
struct Spread {
    engine: &'static str,
    concurrency: usize,
    prefill_tok_s: Vec<f64>,
    decode_tok_s: Vec<f64>,
}

impl Spread {
    fn of(engine: &'static str, levels: &[&Level]) -> Spread {
        Spread {
            engine,
            concurrency: levels.first().map_or(0, |l| l.concurrency),
            prefill_tok_s: levels.iter().map(|l| l.prefill_tok_s).collect(),
            decode_tok_s: levels.iter().filter_map(|l| l.decode_tok_s).collect(),
        }
    }

    fn line(&self) -> String {
        let fmt = |xs: &[f64], prec: usize| {
            if xs.is_empty() {
                return "-".to_string();
            }
            let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{:.prec$} ({lo:.prec$}-{hi:.prec$})", llm::median(xs))
        };
        format!(
            "  {:<9} c={:<3} prefill tok/s {:<24} decode tok/s {}",
            self.engine,
            self.concurrency,
            fmt(&self.prefill_tok_s, 0),
            fmt(&self.decode_tok_s, 1)
        )
    }
}

/// `levels` (one per round) as one, prefill and decode each the median.
fn median_level(levels: &[&Level]) -> Level {
    let mut l = levels[0].clone();
    let prefill: Vec<f64> = levels.iter().map(|l| l.prefill_tok_s).collect();
    let decode: Vec<f64> = levels.iter().filter_map(|l| l.decode_tok_s).collect();
    l.prefill_tok_s = llm::median(&prefill);
    l.decode_tok_s = (!decode.is_empty()).then(|| llm::median(&decode));
    l
}

#[derive(Serialize)]
struct Report {
    run_with: String,
    date: String,
    host: Host,
    release_build: bool,
    model: String,
    model_path: PathBuf,
    /// granary's engine's `--device`.
    device: String,
    prompt_tokens: usize,
    gen_tokens: usize,
    max_batch_tokens: usize,
    threads: usize,
    rounds: usize,
    /// Every round's figures per engine and level.
    spread: Vec<Spread>,
    /// Per level: the median round's figures (prefill and decode are each
    /// the median over the rounds).
    granary: Vec<GranaryLevel>,
    llama_cpp: Anchor,
    /// Leading greedy tokens granary and llama.cpp agree on at concurrency 1.
    greedy_agreement: Option<usize>,
    /// The prompt's token ids (both engines got these).
    prompt: Vec<u32>,
    /// llama.cpp's greedy tokens at concurrency 1.
    anchor_first_stream_ids: Option<Vec<u32>>,
    goals: Vec<Goal>,
}

pub async fn run(mut args: Args) -> Result<()> {
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    anyhow::ensure!(threads >= 1, "--threads must be at least 1");
    args.threads = Some(threads);
    // Granary's pool (candle's and rayon's) gets the same threads as
    // llama.cpp; set before the model loads, when the pools start.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    anyhow::ensure!(args.prompt_tokens >= 1, "--prompt-tokens must be at least 1");
    anyhow::ensure!(args.gen_tokens >= 2, "--gen-tokens must be at least 2 (decode is timed after the first)");
    anyhow::ensure!(!args.concurrency.is_empty(), "--concurrency: give at least one level");
    anyhow::ensure!(args.concurrency.iter().all(|&c| c >= 1), "--concurrency: levels must be at least 1");
    let host = Host::probe();
    let date = utc_timestamp(SystemTime::now());
    let run_with = command_line();
    let release = !cfg!(debug_assertions);
    println!("Run with: {run_with}");
    println!("Date:     {date}");
    println!("Host:     {}", host.describe());
    println!("Build:    {}", if release { "release" } else { "debug (figures not representative)" });
    println!("Threads:  {threads} for each engine; {} alternating rounds", args.rounds);
    let m = llm::load(&args.model, &args.device)?;
    println!("Device:   {} (granary's engine)", args.device);
    let context = m.model.context_len();
    anyhow::ensure!(
        args.prompt_tokens + args.gen_tokens <= context,
        "--prompt-tokens + --gen-tokens exceed the model's context of {context}"
    );
    println!(
        "Model:    {} ({}); prompt {} tokens, {} generated per stream, greedy",
        m.id,
        m.path.display(),
        args.prompt_tokens,
        args.gen_tokens
    );
    println!();
    let prompt = llm::prompt(&m.tokenizer, args.prompt_tokens, 7)?;

    // Rounds alternate granary and llama.cpp, one after the other, so
    // neither competes with the other and drifts in the machine hit both.
    warm_up(&m, &args).await?;
    let mut granary_rounds: Vec<Vec<GranaryLevel>> = Vec::new();
    let mut anchor_rounds: Vec<Vec<AnchorLevel>> = Vec::new();
    let mut anchor = None;
    for round in 1..=args.rounds {
        let mut levels = Vec::new();
        for &c in &args.concurrency {
            eprintln!("engine: round {round}/{}, granary, concurrency {c} ...", args.rounds);
            let g =
                granary_level(&m, &args, &prompt, c).await.with_context(|| format!("granary at concurrency {c}"))?;
            eprintln!(
                "engine: round {round}, granary, concurrency {c}: prefill {:.0} tok/s, decode {} tok/s",
                g.level.prefill_tok_s,
                g.level.decode_tok_s.map_or("-".into(), |d| format!("{d:.1}"))
            );
            levels.push(g);
        }
        granary_rounds.push(levels);
        let (a, levels) = run_anchor(&m, &args, &prompt);
        let stop = a.unavailable.is_some();
        anchor = Some(a);
        anchor_rounds.push(levels);
        if stop {
            break; // no anchor: the other rounds would time granary alone
        }
    }
    let anchor = anchor.expect("at least one round");
    let mut spread = Vec::new();
    let mut granary = Vec::new();
    let mut anchor_levels = Vec::new();
    for &c in &args.concurrency {
        let g: Vec<&GranaryLevel> =
            granary_rounds.iter().filter_map(|r| r.iter().find(|g| g.level.concurrency == c)).collect();
        let gl: Vec<&Level> = g.iter().map(|g| &g.level).collect();
        if let Some(first) = g.first() {
            spread.push(Spread::of("granary", &gl));
            let mut one = (*first).clone();
            one.level = median_level(&gl);
            granary.push(one);
        }
        let a: Vec<&AnchorLevel> =
            anchor_rounds.iter().filter_map(|r| r.iter().find(|a| a.level.concurrency == c)).collect();
        let al: Vec<&Level> = a.iter().map(|a| &a.level).collect();
        if let Some(first) = a.first() {
            spread.push(Spread::of("llama.cpp", &al));
            let mut one = (*first).clone();
            one.level = median_level(&al);
            anchor_levels.push(one);
        }
    }
    let greedy_agreement = match (
        granary.iter().find(|g| g.level.concurrency == 1),
        anchor_levels.iter().find(|a| a.level.concurrency == 1),
    ) {
        (Some(g), Some(a)) => {
            a.tokens.first().map(|t| t.iter().zip(&g.first_stream_ids).take_while(|(x, y)| x == y).count())
        }
        _ => None,
    };
    let goals = goals(&granary, &anchor_levels, anchor.unavailable.as_deref());
    let anchor_first_stream_ids =
        anchor_levels.iter().find(|a| a.level.concurrency == 1).and_then(|a| a.tokens.first().cloned());
    let report = Report {
        run_with,
        date,
        host,
        release_build: release,
        model: m.id.clone(),
        model_path: m.path.clone(),
        device: args.device.clone(),
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        max_batch_tokens: args.max_batch_tokens,
        threads: args.threads.unwrap_or(1),
        rounds: granary_rounds.len(),
        spread: spread.clone(),
        granary,
        llama_cpp: anchor,
        greedy_agreement,
        prompt: prompt.clone(),
        anchor_first_stream_ids,
        goals,
    };
    println!("{}", table(&report, &anchor_levels).render());
    println!("Median (lowest-highest) over {} rounds:", report.rounds);
    for row in &spread {
        println!("{}", row.line());
    }
    if let Some(why) = &report.llama_cpp.unavailable {
        println!("llama.cpp anchor unavailable: {why}");
    }
    for e in &report.llama_cpp.errors {
        println!("llama.cpp error: {e}");
    }
    if let Some(n) = report.greedy_agreement {
        println!(
            "Greedy output, concurrency 1: granary and llama.cpp agree on the first {n} of {} tokens",
            args.gen_tokens
        );
        if n < args.gen_tokens {
            println!("{}", divergence(&report, &anchor_levels, n, &m));
        }
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let svg = args.out.join("engine.svg");
    let png = args.out.join("engine.png");
    draw(&report, &anchor_levels, SVGBackend::new(&svg, (1000, 480)).into_drawing_area())
        .with_context(|| format!("drawing {}", svg.display()))?;
    draw(&report, &anchor_levels, BitMapBackend::new(&png, (1000, 480)).into_drawing_area())
        .with_context(|| format!("drawing {}", png.display()))?;
    println!("Chart: {} and {}", svg.display(), png.display());
    let json = args.out.join("engine.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", json.display()))?;
    println!("JSON: {}\n", json.display());
    println!("Goals");
    for g in &report.goals {
        println!("{}", g.render());
    }
    Ok(())
}

/// Where the greedy outputs part: both engines' two most likely tokens at
/// that step, so a near tie (both sides quantize activations) is visible.
fn divergence(r: &Report, anchor: &[AnchorLevel], n: usize, m: &Loaded) -> String {
    let text = |id: u32| format!("{:?}", m.tokenizer.decode(&[id], false).unwrap_or_default());
    let g = r.granary.iter().find(|g| g.level.concurrency == 1).and_then(|g| g.first_stream_top2.get(n));
    let a = anchor.iter().find(|a| a.level.concurrency == 1).and_then(|a| a.top2.get(n));
    let mut out = format!("  step {n}:");
    if let Some([(t1, l1), (t2, l2)]) = g.map(|v| v.as_slice()) {
        out.push_str(&format!(
            " granary {} {l1:.3}, {} {l2:.3} (log probs, margin {:.3});",
            text(*t1),
            text(*t2),
            l1 - l2
        ));
    }
    if let Some([(t1, l1), (t2, l2)]) = a.map(|v| v.as_slice()) {
        out.push_str(&format!(
            " llama.cpp {} {l1:.3}, {} {l2:.3} (logits, margin {:.3})",
            text(*t1),
            text(*t2),
            l1 - l2
        ));
    }
    out
}

async fn warm_up(m: &Loaded, args: &Args) -> Result<()> {
    let engine = llm::start(m, llm::engine_config(&m.id, 256, args.max_batch_tokens, 0), None)?;
    let p = llm::prompt(&m.tokenizer, 64.min(args.prompt_tokens), u64::MAX)?;
    llm::run(&engine, llm::request("warm-up", p, 4), Instant::now()).await.context("warm-up request")?;
    Ok(())
}

async fn granary_level(m: &Loaded, args: &Args, prompt: &[u32], c: usize) -> Result<GranaryLevel> {
    let mut cfg = llm::engine_config(&m.id, 256, args.max_batch_tokens, 512 << 20);
    cfg.max_running = cfg.max_running.max(c);
    let engine = llm::start(m, cfg, None)?;
    let t0 = Instant::now();
    let streams: Vec<_> = (0..c)
        .map(|i| {
            let engine = engine.clone();
            let mut req = llm::request(&format!("stream-{i}"), prompt.to_vec(), args.gen_tokens);
            if c == 1 {
                req.sampling.logprobs = Some(2);
            }
            tokio::spawn(async move { llm::run(&engine, req, t0).await })
        })
        .collect();
    let mut lines = Vec::with_capacity(c);
    for s in streams {
        lines.push(s.await.context("stream task")??);
    }
    for l in &lines {
        if l.tokens.len() != args.gen_tokens {
            bail!("a stream generated {} tokens, expected {}", l.tokens.len(), args.gen_tokens);
        }
        if l.usage.cached_tokens != 0 {
            bail!("a stream reused {} cached tokens; every stream must compute its prompt", l.usage.cached_tokens);
        }
    }
    let all_first = lines.iter().map(|l| l.ttft()).max().unwrap_or_default();
    let last = lines.iter().filter_map(|l| l.tokens.last().map(|t| t.1)).max().unwrap_or_default();
    let decode_tokens = lines.iter().flat_map(|l| l.tokens.iter()).filter(|t| t.1 > all_first).count();
    let decode = last.saturating_sub(all_first);
    let prefill_s = all_first.as_secs_f64();
    Ok(GranaryLevel {
        level: Level {
            concurrency: c,
            prefill_s,
            prefill_tok_s: (c * prompt.len()) as f64 / prefill_s,
            decode_tokens,
            decode_s: decode.as_secs_f64(),
            decode_tok_s: (decode > Duration::ZERO).then(|| decode_tokens as f64 / decode.as_secs_f64()),
        },
        ttft_ms: lines.iter().map(|l| ms(l.ttft())).collect(),
        total_s: last.as_secs_f64(),
        first_stream_ids: lines.first().map(|l| l.ids()).unwrap_or_default(),
        first_stream_top2: if c == 1 { lines.first().map(|l| l.top.clone()).unwrap_or_default() } else { Vec::new() },
    })
}

/// Runs the llama.cpp script; never fails the command: a missing
/// interpreter or module, or a failing script, is reported instead.
fn run_anchor(m: &Loaded, args: &Args, prompt: &[u32]) -> (Anchor, Vec<AnchorLevel>) {
    // llama.cpp runs as its users run it: OpenMP's default wait policy
    // (spin a while, then sleep) unless the caller set one.
    let wait = std::env::var("OMP_WAIT_POLICY").ok();
    let mut anchor = Anchor {
        python: args.python.clone(),
        unavailable: None,
        llama_cpp_python: None,
        system_info: None,
        omp_wait_policy: wait.clone().unwrap_or_else(|| "default".into()),
        threads: args.threads.unwrap_or(1),
        levels: Vec::new(),
        errors: Vec::new(),
    };
    let is_gguf = m.path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !is_gguf {
        anchor.unavailable = Some(format!("llama.cpp needs a GGUF file; the model is {}", m.path.display()));
        return (anchor, Vec::new());
    }
    match Command::new(&args.python).args(["-c", "import llama_cpp"]).output() {
        Err(e) => {
            anchor.unavailable = Some(format!("cannot run {}: {e}", args.python));
            return (anchor, Vec::new());
        }
        Ok(o) if !o.status.success() => {
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or("").trim().to_string();
            anchor.unavailable = Some(format!(
                "{} cannot import llama_cpp ({last}); install it with `pip install llama-cpp-python==0.3.16` \
                 or pass --python",
                args.python
            ));
            return (anchor, Vec::new());
        }
        Ok(_) => {}
    }
    eprintln!("engine: llama.cpp ({}) ...", args.python);
    match anchor_subprocess(m, args, prompt, wait.as_deref()) {
        Ok(out) => {
            if let Some(e) = out.error {
                anchor.unavailable = Some(format!("the llama.cpp script failed: {e}"));
            }
            anchor.llama_cpp_python = out.llama_cpp_python;
            anchor.system_info = out.system_info;
            anchor.errors = out.errors;
            anchor.levels = out
                .results
                .iter()
                .map(|a| {
                    let mut v = serde_json::to_value(&a.level).unwrap_or_default();
                    v["perf"] = a.perf.clone();
                    v
                })
                .collect();
            (anchor, out.results)
        }
        Err(e) => {
            anchor.unavailable = Some(format!("{e:#}"));
            (anchor, Vec::new())
        }
    }
}

fn anchor_subprocess(m: &Loaded, args: &Args, prompt: &[u32], wait: Option<&str>) -> Result<AnchorOut> {
    let dir = tempfile::Builder::new().prefix("granary-bench-engine-").tempdir()?;
    let script = dir.path().join("llama_cpp_engine.py");
    std::fs::write(&script, SCRIPT)?;
    let input = serde_json::json!({
        "model": m.path,
        "prompt": prompt,
        "gen_tokens": args.gen_tokens,
        "concurrency": args.concurrency,
        "threads": args.threads.unwrap_or(1),
        "batch": args.max_batch_tokens,
    });
    let mut cmd = Command::new(&args.python);
    if let Some(w) = wait {
        cmd.env("OMP_WAIT_POLICY", w);
    }
    let mut child = cmd
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", args.python))?;
    child.stdin.take().expect("piped").write_all(input.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let parsed: Option<AnchorOut> = stdout.lines().rev().find_map(|l| serde_json::from_str(l).ok());
    match parsed {
        Some(a) => Ok(a),
        None => {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect();
            bail!("the llama.cpp script exited with {} and printed no result: {}", out.status, tail.join(" | "))
        }
    }
}

fn goals(granary: &[GranaryLevel], anchor: &[AnchorLevel], unavailable: Option<&str>) -> Vec<Goal> {
    let mut out = Vec::new();
    let g1 = granary.iter().find(|g| g.level.concurrency == 1);
    let a1 = anchor.iter().find(|a| a.level.concurrency == 1);
    let why = unavailable.unwrap_or("no concurrency-1 run of both");
    match (g1, a1) {
        (Some(g), Some(a)) => {
            let r = g.level.prefill_tok_s / a.level.prefill_tok_s;
            out.push(Goal::new(
                "engine",
                format!("prefill >= {PREFILL_GOAL}x llama.cpp at concurrency 1"),
                r >= PREFILL_GOAL,
                format!("{:.0} vs {:.0} tok/s ({r:.2}x)", g.level.prefill_tok_s, a.level.prefill_tok_s),
            ));
            match (g.level.decode_tok_s, a.level.decode_tok_s) {
                (Some(gd), Some(ad)) => {
                    let r = gd / ad;
                    out.push(Goal::new(
                        "engine",
                        format!("decode >= {DECODE_GOAL}x llama.cpp at concurrency 1"),
                        r >= DECODE_GOAL,
                        format!("{gd:.1} vs {ad:.1} tok/s ({r:.2}x)"),
                    ));
                }
                _ => out.push(Goal::unmeasured(
                    "engine",
                    format!("decode >= {DECODE_GOAL}x llama.cpp at concurrency 1"),
                    "no decode time",
                )),
            }
        }
        _ => {
            out.push(Goal::unmeasured("engine", format!("prefill >= {PREFILL_GOAL}x llama.cpp at concurrency 1"), why));
            out.push(Goal::unmeasured("engine", format!("decode >= {DECODE_GOAL}x llama.cpp at concurrency 1"), why));
        }
    }
    let gm = granary.iter().find(|g| g.level.concurrency == MANY_STREAMS).and_then(|g| g.level.decode_tok_s);
    let am = anchor.iter().find(|a| a.level.concurrency == MANY_STREAMS).and_then(|a| a.level.decode_tok_s);
    let name = format!("aggregate decode >= {MANY_DECODE_GOAL}x llama.cpp at {MANY_STREAMS} streams");
    match (gm, am) {
        (Some(g), Some(a)) => out.push(Goal::new(
            "engine",
            name,
            g / a >= MANY_DECODE_GOAL,
            format!("{g:.1} vs {a:.1} tok/s ({:.2}x)", g / a),
        )),
        _ => out.push(Goal::unmeasured("engine", name, "no level of 16 streams on both")),
    }
    let mut levels: Vec<(usize, f64)> =
        granary.iter().map(|g| (g.level.concurrency, g.level.decode_tok_s.unwrap_or(0.0))).collect();
    levels.sort_by_key(|l| l.0);
    let figures = levels.iter().map(|(c, d)| format!("{c}: {d:.1}")).collect::<Vec<_>>().join(", ");
    if levels.len() < 2 {
        out.push(Goal::unmeasured("engine", "aggregate decode tok/s rises with concurrency", "one level only"));
    } else {
        let rising = levels.windows(2).all(|w| w[1].1 > w[0].1);
        out.push(Goal::new(
            "engine",
            "aggregate decode tok/s rises with concurrency",
            rising,
            format!("granary decode tok/s by concurrency {figures}"),
        ));
    }
    out
}

fn table(r: &Report, anchor: &[AnchorLevel]) -> Table {
    let mut t = Table::new(
        format!(
            "engine: {}-token prompt, {} tokens generated per stream, greedy; llama.cpp {} with {} threads \
             (OMP_WAIT_POLICY={})",
            r.prompt_tokens,
            r.gen_tokens,
            r.llama_cpp.llama_cpp_python.as_deref().unwrap_or("-"),
            r.llama_cpp.threads,
            r.llama_cpp.omp_wait_policy
        ),
        &[
            "streams",
            "granary prefill tok/s",
            "llama.cpp prefill tok/s",
            "ratio",
            "granary decode tok/s",
            "llama.cpp decode tok/s",
            "ratio",
            "granary TTFT ms (max)",
        ],
    );
    let opt = |x: Option<f64>, p: usize| x.map_or_else(|| "-".to_string(), |v| format!("{v:.p$}"));
    let ratio = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.2}x"));
    for g in &r.granary {
        let a = anchor.iter().find(|a| a.level.concurrency == g.level.concurrency);
        let ap = a.map(|a| a.level.prefill_tok_s);
        let ad = a.and_then(|a| a.level.decode_tok_s);
        t.row(vec![
            g.level.concurrency.to_string(),
            format!("{:.0}", g.level.prefill_tok_s),
            opt(ap, 0),
            ratio(ap.map(|a| g.level.prefill_tok_s / a)),
            opt(g.level.decode_tok_s, 1),
            opt(ad, 1),
            ratio(g.level.decode_tok_s.zip(ad).map(|(g, a)| g / a)),
            format!("{:.0}", g.ttft_ms.iter().copied().fold(0.0, f64::max)),
        ]);
    }
    t
}

fn draw<DB: DrawingBackend>(
    r: &Report,
    anchor: &[AnchorLevel],
    area: DrawingArea<DB, plotters::coord::Shift>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e}");
    area.fill(&WHITE).map_err(e)?;
    let area = area
        .titled(
            &format!(
                "Engine throughput vs llama.cpp ({}-token prompt, {} generated per stream)",
                r.prompt_tokens, r.gen_tokens
            ),
            ("sans-serif", 20),
        )
        .map_err(e)?;
    let (left, right) = area.split_horizontally(500);
    let levels: Vec<usize> = r.granary.iter().map(|g| g.level.concurrency).collect();
    type Pick = fn(&Level) -> Option<f64>;
    let panels: [(&str, Pick, DrawingArea<DB, plotters::coord::Shift>); 2] =
        [("prefill tok/s", |l| Some(l.prefill_tok_s), left), ("decode tok/s (aggregate)", |l| l.decode_tok_s, right)];
    for (name, pick, panel) in panels {
        let g: Vec<(f64, f64)> =
            r.granary.iter().enumerate().filter_map(|(i, x)| pick(&x.level).map(|v| (i as f64, v))).collect();
        let a: Vec<(f64, f64)> = levels
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                anchor.iter().find(|a| a.level.concurrency == *c).and_then(|a| pick(&a.level)).map(|v| (i as f64, v))
            })
            .collect();
        let ymax = g.iter().chain(&a).map(|p| p.1).fold(1.0, f64::max) * 1.2;
        let labels = levels.clone();
        let label = move |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].to_string()
            } else {
                String::new()
            }
        };
        let mut chart = ChartBuilder::on(&panel)
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.25..(levels.len() as f64 - 0.75), 0.0..ymax)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_labels(levels.len())
            .x_desc("concurrent streams")
            .y_desc(name)
            .x_label_formatter(&label)
            .light_line_style(RGBColor(240, 240, 240))
            .draw()
            .map_err(e)?;
        let blue = RGBColor(31, 119, 180);
        let orange = RGBColor(255, 127, 14);
        chart
            .draw_series(LineSeries::new(g, blue.stroke_width(2)).point_size(4))
            .map_err(e)?
            .label("granary")
            .legend(line_key(blue));
        if !a.is_empty() {
            chart
                .draw_series(LineSeries::new(a, orange.stroke_width(2)).point_size(4))
                .map_err(e)?
                .label("llama.cpp")
                .legend(line_key(orange));
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    area.present().map_err(e)?;
    Ok(())
}
