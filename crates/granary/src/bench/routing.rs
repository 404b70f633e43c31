//! `granary bench routing`: the gateway's routing policies replayed over
//! the Mooncake conversation trace, on SIMULATED engines.
//!
//! The trace (12,031 requests, real arrival times, prompts as prefix-chained
//! 512-token block ids) is replayed in arrival order (times scaled by
//! `--time-scale`) through the gateway's real policy code
//! (`granary_gateway::routing`): each request is ranked by the pool's policy
//! over N simulated engines and sent to the first. A simulated engine has
//! an LRU KV cache of `--capacity-blocks` blocks and publishes `stored` /
//! `removed` events into the gateway's real `KvIndex` as its cache changes
//! (`kv_aware (approx)` instead lets the gateway learn from where it routed).
//! Its service model: one prefill at a time at `--prefill-tok-s` over the
//! uncached tokens (so TTFT = wait for the prefill queue + own prefill),
//! then decode at `--decode-ms` per output token, during which the request
//! counts as in flight (the load policies see).
//!
//! The hit rate is prompt blocks found in the chosen engine's cache as a
//! prefix / all prompt blocks; its ceiling is one unbounded cache shared by
//! everything (`unbounded_ceiling`, 36.64% on this trace).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use granary_core::hash::BlockHash;
use granary_gateway::routing::{build_policy, Candidate, KvIndex, PolicyConfig, RouteRequest};
use plotters::prelude::*;

use super::sim::{load_trace, locate_mooncake_trace, unbounded_ceiling, TraceRequest};
use super::warehouse::report::{bar, command_line, utc_timestamp, Goal, Host, Table};

const BLOCK_TOKENS: u64 = 512;

#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Simulated engines for the policy table.
    #[arg(long, default_value_t = 8)]
    engines: usize,
    /// Engine counts for the sweep (round_robin against kv_aware).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16")]
    sweep: Vec<usize>,
    /// KV capacity of each simulated engine, in 512-token blocks.
    #[arg(long, default_value_t = 16_384)]
    capacity_blocks: usize,
    /// Multiplies the trace's arrival times (0.5 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Simulated prefill throughput per engine, tokens/s.
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tok_s: f64,
    /// Simulated decode time per output token, ms.
    #[arg(long, default_value_t = 20.0)]
    decode_ms: f64,
    /// The trace (default: shared/data/mooncake/conversation_trace.jsonl beside the repository).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Where to write the chart.
    #[arg(long, default_value = "docs/img/routing.svg")]
    chart: PathBuf,
}

/// A simulated engine: LRU KV cache, a prefill queue, decodes in flight.
struct SimEngine {
    lru: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    tick: u64,
    capacity: usize,
    prefill_free_at: f64,
    decode_ends: Vec<f64>,
    requests: u64,
}

impl SimEngine {
    fn new(capacity: usize) -> Self {
        SimEngine {
            lru: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            capacity,
            prefill_free_at: 0.0,
            decode_ends: Vec::new(),
            requests: 0,
        }
    }

    fn active(&mut self, now: f64) -> usize {
        self.decode_ends.retain(|&e| e > now);
        self.decode_ends.len() + usize::from(self.prefill_free_at > now)
    }

    fn prefix_hits(&self, ids: &[u64]) -> usize {
        ids.iter().take_while(|id| self.lru.contains_key(id)).count()
    }

    /// Caches the prompt's blocks; returns (stored, evicted).
    fn store(&mut self, ids: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        for &id in ids {
            self.tick += 1;
            if let Some(old) = self.lru.insert(id, self.tick) {
                self.order.remove(&old);
            } else {
                stored.push(id);
            }
            self.order.insert(self.tick, id);
        }
        while self.lru.len() > self.capacity {
            let Some((_, id)) = self.order.pop_first() else { break };
            self.lru.remove(&id);
            evicted.push(id);
        }
        (stored, evicted)
    }
}

fn block_hash(id: u64) -> BlockHash {
    // Trace ids are already prefix-chained: the id itself names the block.
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&id.to_le_bytes());
    BlockHash(b)
}

struct Outcome {
    policy: String,
    engines: usize,
    hit_rate: f64,
    mean_ttft_s: f64,
    p99_ttft_s: f64,
    min_share: f64,
    max_share: f64,
}

fn replay(trace: &[TraceRequest], label: &str, cfg: &PolicyConfig, events: bool, n: usize, a: &Args) -> Outcome {
    let index = Arc::new(KvIndex::new());
    let policy = build_policy(cfg, index.clone());
    let mut engines: Vec<SimEngine> = (0..n).map(|_| SimEngine::new(a.capacity_blocks)).collect();
    let (mut hits, mut total) = (0u64, 0u64);
    let mut ttfts = Vec::with_capacity(trace.len());
    let pb = bar(trace.len() as u64, &format!("{label} x{n}"));
    for (i, r) in trace.iter().enumerate() {
        let now = r.timestamp as f64 / 1000.0 * a.time_scale;
        let blocks: Vec<BlockHash> = r.hash_ids.iter().map(|&id| block_hash(id)).collect();
        let session = r.hash_ids.get(1).map(u64::to_string);
        let req = RouteRequest { namespace: "bench", session: session.as_deref(), blocks: &blocks, by_upstream: &[] };
        let cands: Vec<Candidate> = engines
            .iter_mut()
            .enumerate()
            .map(|(index, e)| Candidate { index, active: e.active(now), max_active: 0, publishes_events: events })
            .collect();
        let chosen = policy.rank(&req, &cands)[0];
        policy.routed(&req, chosen);
        let e = &mut engines[chosen];
        e.requests += 1;
        let hit = e.prefix_hits(&r.hash_ids);
        hits += hit as u64;
        total += r.hash_ids.len() as u64;
        let uncached = r.input_length.saturating_sub(hit as u64 * BLOCK_TOKENS) as f64;
        let start = e.prefill_free_at.max(now);
        let done = start + uncached / a.prefill_tok_s;
        e.prefill_free_at = done;
        e.decode_ends.push(done + r.output_length as f64 * a.decode_ms / 1000.0);
        ttfts.push(done - now);
        let (stored, evicted) = e.store(&r.hash_ids);
        if events {
            let s: Vec<BlockHash> = stored.into_iter().map(block_hash).collect();
            let ev: Vec<BlockHash> = evicted.into_iter().map(block_hash).collect();
            index.insert(chosen, &s);
            index.remove(chosen, &ev);
        }
        if i % 256 == 0 {
            pb.set_position(i as u64);
        }
    }
    pb.finish_and_clear();
    ttfts.sort_by(f64::total_cmp);
    let mean = ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64;
    let p99 = ttfts.get(ttfts.len() * 99 / 100).copied().unwrap_or(0.0);
    let fair = trace.len() as f64 / n as f64;
    let shares: Vec<f64> = engines.iter().map(|e| e.requests as f64 / fair).collect();
    Outcome {
        policy: label.to_string(),
        engines: n,
        hit_rate: hits as f64 / total.max(1) as f64,
        mean_ttft_s: mean,
        p99_ttft_s: p99,
        min_share: shares.iter().copied().fold(f64::INFINITY, f64::min),
        max_share: shares.iter().copied().fold(0.0, f64::max),
    }
}

fn policies() -> Vec<(&'static str, PolicyConfig, bool)> {
    let kv = PolicyConfig::KvAware { load_penalty: 1.0, approx_capacity_blocks: 0 };
    vec![
        ("round_robin", PolicyConfig::RoundRobin, true),
        ("least_load", PolicyConfig::LeastLoad, true),
        ("session", PolicyConfig::Session { header: "x-session-id".into() }, true),
        ("kv_aware", kv.clone(), true),
        ("kv_aware (approx)", kv, false),
    ]
}

pub async fn run(args: Args) -> Result<()> {
    let started = SystemTime::now();
    let path = match &args.trace {
        Some(p) => p.clone(),
        None => locate_mooncake_trace().context("locating the Mooncake trace (or pass --trace)")?,
    };
    let trace = load_trace(&path).with_context(|| format!("reading {}", path.display()))?;
    let ceiling = unbounded_ceiling(&trace);
    let results: Vec<Outcome> = tokio::task::spawn_blocking({
        let (trace, a) = (trace.clone(), args.clone());
        move || {
            let mut out = Vec::new();
            for (label, cfg, events) in policies() {
                out.push(replay(&trace, label, &cfg, events, a.engines, &a));
            }
            for &n in a.sweep.iter().filter(|&&n| n != a.engines) {
                for (label, cfg, events) in policies().into_iter().filter(|p| matches!(p.0, "round_robin" | "kv_aware"))
                {
                    out.push(replay(&trace, label, &cfg, events, n, &a));
                }
            }
            out
        }
    })
    .await?;
    let main: Vec<&Outcome> = results.iter().filter(|r| r.engines == args.engines).collect();
    let rr = main.iter().find(|r| r.policy == "round_robin").map_or(0.0, |r| r.hit_rate);

    println!("granary bench routing — {}", utc_timestamp(started));
    println!("host: {}", Host::probe().describe());
    println!("command: {}", command_line());
    println!(
        "trace: {} ({} requests); SIMULATED engines: LRU KV cache of {} blocks each (512 tokens/block), prefill {:.0} tok/s one at a time, decode {:.0} ms/token; arrivals x{}",
        path.display(),
        trace.len(),
        args.capacity_blocks,
        args.prefill_tok_s,
        args.decode_ms,
        args.time_scale
    );
    println!("unbounded ceiling (one shared unbounded cache): {:.2}%", ceiling * 100.0);
    println!();
    let mut t = Table::new(
        format!("Routing policies over {} simulated engines", args.engines),
        &["policy", "hit rate", "vs ceiling", "vs round_robin", "mean TTFT s", "p99 TTFT s", "share min..max"],
    );
    for r in &main {
        t.row(vec![
            r.policy.clone(),
            format!("{:.2}%", r.hit_rate * 100.0),
            format!("{:.2}", r.hit_rate / ceiling),
            format!("{:.2}x", r.hit_rate / rr.max(1e-9)),
            format!("{:.3}", r.mean_ttft_s),
            format!("{:.3}", r.p99_ttft_s),
            format!("{:.2}..{:.2}", r.min_share, r.max_share),
        ]);
    }
    println!("{}", t.render());
    let mut sweep = Table::new("Engines sweep", &["engines", "round_robin hit", "kv_aware hit", "ratio"]);
    let mut counts: Vec<usize> = results.iter().map(|r| r.engines).collect();
    counts.sort_unstable();
    counts.dedup();
    for n in counts {
        let get = |p: &str| results.iter().find(|r| r.engines == n && r.policy == p).map(|r| r.hit_rate);
        if let (Some(a), Some(b)) = (get("round_robin"), get("kv_aware")) {
            sweep.row(vec![
                n.to_string(),
                format!("{:.2}%", a * 100.0),
                format!("{:.2}%", b * 100.0),
                format!("{:.2}x", b / a.max(1e-9)),
            ]);
        }
    }
    println!("{}", sweep.render());
    if let Some(kv) = main.iter().find(|r| r.policy == "kv_aware") {
        for g in [
            Goal::new(
                "routing",
                "kv_aware hit rate >= 90% of the unbounded ceiling",
                kv.hit_rate >= 0.9 * ceiling,
                format!("{:.2}% of {:.2}% ({:.2})", kv.hit_rate * 100.0, ceiling * 100.0, kv.hit_rate / ceiling),
            ),
            Goal::new(
                "routing",
                "kv_aware hit rate >= 2x round_robin",
                kv.hit_rate >= 2.0 * rr,
                format!("{:.2}x", kv.hit_rate / rr.max(1e-9)),
            ),
            Goal::new(
                "routing",
                "no engine starved (each >= 25% of a fair share)",
                kv.min_share >= 0.25,
                format!("min share {:.2}", kv.min_share),
            ),
        ] {
            println!("{}", g.render());
        }
    }
    draw(&main, ceiling, &args.chart)?;
    println!("chart: {}", args.chart.display());
    Ok(())
}

fn draw(results: &[&Outcome], ceiling: f64, path: &std::path::Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(path, (760, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = results.len();
    let mut chart = ChartBuilder::on(&root)
        .caption("Prefix hit rate by routing policy (Mooncake trace, simulated engines)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0..n).into_segmented(), 0.0..(ceiling * 110.0).max(1.0))?;
    let names: Vec<String> = results.iter().map(|r| r.policy.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc("prompt blocks hit, %")
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(results.iter().enumerate().map(|(i, r)| {
        let color = if r.policy.starts_with("kv_aware") { BLUE.mix(0.7) } else { BLACK.mix(0.35) };
        Rectangle::new(
            [(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), r.hit_rate * 100.0)],
            color.filled(),
        )
    }))?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(SegmentValue::Exact(0), ceiling * 100.0), (SegmentValue::Exact(n), ceiling * 100.0)],
            RED,
        )))?
        .label(format!("unbounded ceiling {:.2}%", ceiling * 100.0))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw()?;
    root.present()?;
    Ok(())
}
