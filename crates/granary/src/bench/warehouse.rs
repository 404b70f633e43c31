//! `granary bench warehouse`: the warehouse measured next to its anchors.
//!
//! Four parts, each measured against an anchor in the same run and printed
//! as a table with the ratio: `resp` (the RESP server vs a real Redis under
//! redis-benchmark), `disk` (the disk tier vs fio on the same filesystem),
//! `inproc` (zero-copy memory-tier reads and prefix lookups vs a locked
//! `HashMap`) and `hitratio` (eviction policies replaying the Mooncake trace
//! vs its unbounded ceiling). Every goal is printed as PASS or MISS with
//! the figures that decided it; `--json` keeps everything, `--out` gets the
//! charts. A tool that is missing (Redis, fio) is reported and its part
//! skipped; a part that fails is reported and makes the command exit 1
//! after the rest have run.

use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::{Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use serde::Serialize;

mod ceiling;
pub(super) mod disk;
mod hitratio;
mod inproc;
mod multi;
pub(super) mod report;
mod resp;

use report::{command_line, utc_timestamp, Goal, Host, Table};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    Resp,
    Disk,
    Inproc,
    Hitratio,
}

impl Part {
    const ALL: [Part; 4] = [Part::Resp, Part::Disk, Part::Inproc, Part::Hitratio];

    fn name(self) -> &'static str {
        match self {
            Part::Resp => "resp",
            Part::Disk => "disk",
            Part::Inproc => "inproc",
            Part::Hitratio => "hitratio",
        }
    }
}

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Parts to run, comma-separated [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Part>,
    /// A smoke run of a few seconds: tiny sizes, figures not representative.
    #[arg(long)]
    quick: bool,
    /// Also write every result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Directory for the charts.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Directory for the disk part's files [default: a temporary directory
    /// under the current one, so on the same filesystem].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Mooncake trace (JSON lines) for the hit-ratio part [default:
    /// shared/data/mooncake/conversation_trace.jsonl beside the repository].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Seed of every random choice (values, access orders).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Threads of the `resp` part's client (`redis-benchmark --threads`);
    /// more than one needs the cores for them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    client_threads: u16,
    /// Serve the `resp` part's zero-work RESP server on `127.0.0.1:0` and
    /// print its address (the benchmark starts itself this way).
    #[arg(long, hide = true)]
    serve_ceiling: bool,
}

/// What the parts read from the command line.
pub struct Ctx {
    pub quick: bool,
    pub client_threads: usize,
    pub seed: u64,
    pub dir: Option<PathBuf>,
    pub out: PathBuf,
    pub trace: Option<PathBuf>,
}

/// A tool or input the part needs is not on this host: skipped, not failed.
#[derive(Debug)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

#[derive(Serialize)]
struct Report {
    run_with: String,
    date: String,
    host: Host,
    release_build: bool,
    seed: u64,
    quick: bool,
    parts: Vec<Part>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resp: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    disk: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inproc: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hitratio: Option<serde_json::Value>,
    goals: Vec<Goal>,
}

/// A part's figures, ready to print and store.
struct Done {
    json: serde_json::Value,
    tables: Vec<Table>,
    goals: Vec<Goal>,
    notes: Vec<String>,
    /// Measured only in part: reported, and the command exits 1.
    failed: bool,
}

impl Done {
    fn new<T: Serialize>(r: &T, tables: Vec<Table>, goals: Vec<Goal>) -> Result<Done> {
        Ok(Done { json: serde_json::to_value(r)?, tables, goals, notes: Vec::new(), failed: false })
    }
}

/// The goals a part would have been judged on, for when it did not run.
fn part_goals(p: Part) -> &'static [&'static str] {
    match p {
        Part::Resp => &[
            "1 MiB GET: granary >= 1.5x Redis req/s, p99 no worse",
            "MSET of 200 x 1 MiB: granary within 2x Redis's time",
            "MGET of 200 x 1 MiB: granary within 2x Redis's time",
        ],
        Part::Disk => &["read >= 85% of raw, every block size", "write >= 70% of raw, every block size"],
        Part::Inproc => &["memory-tier gets >= 1M/s", "64-block lookup < 5 µs (median)"],
        Part::Hitratio => &[],
    }
}

pub async fn run(args: Args) -> Result<()> {
    if args.serve_ceiling {
        // A runtime of its own (one thread, as Redis serves), outside this one.
        return std::thread::spawn(ceiling::serve)
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the zero-work server panicked")));
    }
    let host = Host::probe();
    let date = utc_timestamp(SystemTime::now());
    let run_with = command_line();
    let release = !cfg!(debug_assertions);
    println!("Run with: {run_with}");
    println!("Date:     {date}");
    println!("Host:     {}", host.describe());
    println!(
        "Build:    {}; seed {}{}",
        if release { "release" } else { "debug (figures not representative)" },
        args.seed,
        if args.quick { "; --quick (smoke-test sizes, figures not representative)" } else { "" }
    );
    println!();

    let parts: Vec<Part> = if args.only.is_empty() {
        Part::ALL.to_vec()
    } else {
        Part::ALL.into_iter().filter(|p| args.only.contains(p)).collect()
    };
    let ctx = Ctx {
        quick: args.quick,
        client_threads: args.client_threads as usize,
        seed: args.seed,
        dir: args.dir,
        out: args.out,
        trace: args.trace,
    };
    let mut report = Report {
        run_with,
        date,
        host,
        release_build: release,
        seed: args.seed,
        quick: args.quick,
        parts: parts.clone(),
        resp: None,
        disk: None,
        inproc: None,
        hitratio: None,
        goals: Vec::new(),
    };
    let mut failed = Vec::new();
    for &part in &parts {
        let outcome: Result<Done> = match part {
            Part::Resp => resp::run(&ctx).and_then(|r| {
                let mut d = Done::new(&r, resp::tables(&r), resp::goals(&r))?;
                if let Some(e) = &r.granary_error {
                    d.notes.push(format!("resp: FAILED for granary (Redis rows stand alone): {e}"));
                    d.failed = true;
                }
                if let Some(e) = &r.ceiling_error {
                    d.notes.push(format!("resp: the zero-work server (the client's ceiling) not measured: {e}"));
                }
                Ok(d)
            }),
            Part::Disk => disk::run(&ctx).await.and_then(|r| Done::new(&r, disk::tables(&r), disk::goals(&r))),
            Part::Inproc => inproc::run(&ctx).and_then(|r| Done::new(&r, inproc::tables(&r), inproc::goals(&r))),
            Part::Hitratio => hitratio::run(&ctx).and_then(|r| {
                let mut d = Done::new(&r, hitratio::tables(&r), hitratio::goals(&r))?;
                d.notes = hitratio::notes(&r);
                Ok(d)
            }),
        };
        let json = match outcome {
            Ok(done) => {
                for t in &done.tables {
                    println!("{}", t.render());
                }
                for n in &done.notes {
                    println!("{n}");
                }
                if !done.notes.is_empty() {
                    println!();
                }
                if done.failed {
                    failed.push(part.name());
                }
                report.goals.extend(done.goals);
                done.json
            }
            Err(e) => {
                let skipped = e.downcast_ref::<Unavailable>().is_some();
                let why = format!("{e:#}");
                if skipped {
                    println!("{}: SKIPPED: {why}\n", part.name());
                } else {
                    println!("{}: FAILED: {why}\n", part.name());
                    failed.push(part.name());
                }
                report.goals.extend(part_goals(part).iter().map(|g| Goal::unmeasured(part.name(), *g, &why)));
                serde_json::json!({ if skipped { "skipped" } else { "error" }: why })
            }
        };
        match part {
            Part::Resp => report.resp = Some(json),
            Part::Disk => report.disk = Some(json),
            Part::Inproc => report.inproc = Some(json),
            Part::Hitratio => report.hitratio = Some(json),
        }
    }

    if !report.goals.is_empty() {
        println!("Goals");
        for g in &report.goals {
            println!("{}", g.render());
        }
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        println!("\nJSON: {}", path.display());
    }
    if !failed.is_empty() {
        anyhow::bail!("part(s) failed: {}", failed.join(", "));
    }
    Ok(())
}
