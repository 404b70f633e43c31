//! `inproc`: the in-process fast path an engine uses on the same host.
//!
//! Measures memory-tier reads that hand out `Bytes` handles without copying
//! (`Store::get_cached`) on one thread and on every core, and the latency
//! of a 64-block longest-prefix lookup (`Store::lookup_local`). The anchor,
//! measured in the same run over the same keys and the same access order,
//! is a plain `HashMap<Vec<u8>, Bytes>` behind one `parking_lot::Mutex`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use bytes::Bytes;
use granary_core::HashChain;
use granary_warehouse::Store;
use hdrhistogram::Histogram;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use super::report::{bar, Goal, Table};
use super::Ctx;

const NS: &str = "bench";
const VALUE: usize = 64 << 10;
const PREFIX: usize = 64;
/// Lookups timed together: one `Instant` pair per batch keeps the clock's
/// own cost (tens of ns) out of a µs-scale figure.
const BATCH: u64 = 16;

#[derive(Debug, Serialize)]
pub struct GetsRow {
    pub threads: usize,
    pub granary_gets_per_s: f64,
    pub anchor_gets_per_s: f64,
    pub ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct LookupRow {
    pub impl_name: &'static str,
    pub median_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

#[derive(Debug, Serialize)]
pub struct InprocReport {
    pub blocks: usize,
    pub value_bytes: usize,
    pub prefix_blocks: usize,
    pub lookups: u64,
    pub gets: Vec<GetsRow>,
    pub lookup: Vec<LookupRow>,
    /// Granary's median lookup time over the anchor's (above 1: slower).
    pub lookup_ratio: f64,
}

/// Something that answers gets and prefix lookups over the benchmark's keys.
trait Reader: Sync {
    fn get(&self, key: &[u8]) -> Option<Bytes>;
    fn lookup(&self, keys: &[Vec<u8>]) -> usize;
}

struct Granary(Store);

impl Reader for Granary {
    fn get(&self, key: &[u8]) -> Option<Bytes> {
        self.0.get_cached(NS, key)
    }
    fn lookup(&self, keys: &[Vec<u8>]) -> usize {
        self.0.lookup_local(NS, keys).matched
    }
}

struct Anchor(Mutex<HashMap<Vec<u8>, Bytes>>);

impl Reader for Anchor {
    fn get(&self, key: &[u8]) -> Option<Bytes> {
        self.0.lock().get(key).cloned()
    }
    fn lookup(&self, keys: &[Vec<u8>]) -> usize {
        // The natural baseline: one lock, walk until the first absent key.
        let map = self.0.lock();
        keys.iter().take_while(|k| map.contains_key(k.as_slice())).count()
    }
}

pub fn run(ctx: &Ctx) -> Result<InprocReport> {
    let blocks = if ctx.quick { 2_000 } else { 10_000 };
    let window = if ctx.quick { Duration::from_millis(150) } else { Duration::from_secs(2) };
    let lookups: u64 = if ctx.quick { 20_000 } else { 400_000 };
    let mut rng = StdRng::seed_from_u64(ctx.seed);

    // Keys are a real hash chain in text form, as engines and LMCache send them.
    let mut parent = HashChain::new(NS, b"bench-model", b"bench-layout", 256).root();
    let keys: Vec<Vec<u8>> = (0..blocks as u32)
        .map(|i| {
            parent = HashChain::next(&parent, &[i, i ^ 0x5bd1_e995]);
            parent.to_hex().into_bytes()
        })
        .collect();
    let values: Vec<Bytes> = (0..blocks)
        .map(|_| {
            let mut v = vec![0u8; VALUE];
            rng.fill_bytes(&mut v);
            Bytes::from(v)
        })
        .collect();
    // Twice the data, so that no shard of the memory tier has to evict.
    let store = Store::memory_only(2 * (blocks * (VALUE + 256)) as u64);
    let mut map = HashMap::with_capacity(blocks);
    for (k, v) in keys.iter().zip(&values) {
        store.memory().put_sync(NS, Bytes::copy_from_slice(k), v.clone(), Default::default());
        map.insert(k.clone(), v.clone());
    }
    let granary = Granary(store);
    let anchor = Anchor(Mutex::new(map));
    for k in &keys {
        ensure!(granary.get(k).is_some(), "block {} missing from the memory tier", String::from_utf8_lossy(k));
    }

    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut thread_counts = vec![1];
    if cores > 1 {
        thread_counts.push(cores);
    }
    // One seeded access order per thread, shared by both implementations.
    let orders: Vec<Vec<u32>> = (0..cores)
        .map(|_| {
            let mut o: Vec<u32> = (0..blocks as u32).collect();
            o.shuffle(&mut rng);
            o
        })
        .collect();

    let pb = bar((thread_counts.len() * 2 + 2) as u64, "inproc");
    let mut gets = Vec::new();
    for &threads in &thread_counts {
        pb.set_message(format!("gets, {threads} thread(s)"));
        let g = gets_per_s(&granary, &keys, &orders[..threads], window);
        pb.inc(1);
        let a = gets_per_s(&anchor, &keys, &orders[..threads], window);
        pb.inc(1);
        gets.push(GetsRow { threads, granary_gets_per_s: g, anchor_gets_per_s: a, ratio: g / a });
    }

    let prefix = &keys[..PREFIX];
    pb.set_message("64-block lookups");
    let g = lookup_latency("granary", &granary, prefix, lookups)?;
    pb.inc(1);
    let a = lookup_latency("HashMap+Mutex", &anchor, prefix, lookups)?;
    pb.inc(1);
    pb.finish_and_clear();
    let lookup_ratio = g.median_us / a.median_us;
    Ok(InprocReport {
        blocks,
        value_bytes: VALUE,
        prefix_blocks: PREFIX,
        lookups,
        gets,
        lookup: vec![g, a],
        lookup_ratio,
    })
}

/// Gets per second over `window`, one thread per access order.
fn gets_per_s(r: &dyn Reader, keys: &[Vec<u8>], orders: &[Vec<u32>], window: Duration) -> f64 {
    let start = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = orders
            .iter()
            .map(|order| {
                s.spawn(move || {
                    let mut n = 0u64;
                    let deadline = start + window;
                    'outer: loop {
                        for chunk in order.chunks(1024) {
                            for &i in chunk {
                                black_box(r.get(&keys[i as usize]));
                            }
                            n += chunk.len() as u64;
                            if Instant::now() >= deadline {
                                break 'outer;
                            }
                        }
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reader thread")).sum()
    });
    total as f64 / start.elapsed().as_secs_f64()
}

fn lookup_latency(name: &'static str, r: &dyn Reader, prefix: &[Vec<u8>], lookups: u64) -> Result<LookupRow> {
    ensure!(r.lookup(prefix) == prefix.len(), "{name}: the {}-block prefix is not fully present", prefix.len());
    // Warm caches and branch predictors before timing.
    for _ in 0..lookups / 20 {
        black_box(r.lookup(black_box(prefix)));
    }
    let mut h = Histogram::<u64>::new(3).expect("histogram precision");
    let mut total = Duration::ZERO;
    for _ in 0..lookups / BATCH {
        let t = Instant::now();
        for _ in 0..BATCH {
            black_box(r.lookup(black_box(prefix)));
        }
        let e = t.elapsed();
        total += e;
        h.record((e.as_nanos() as u64 / BATCH).max(1))?;
    }
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(LookupRow {
        impl_name: name,
        median_us: us(h.value_at_quantile(0.5)),
        p99_us: us(h.value_at_quantile(0.99)),
        mean_us: total.as_secs_f64() * 1e6 / (lookups / BATCH * BATCH) as f64,
    })
}

pub fn tables(r: &InprocReport) -> Vec<Table> {
    let mut t = Table::new(
        format!(
            "inproc: memory-tier gets of {} blocks of {} (Bytes handles, no copy); anchor: HashMap<Vec<u8>, Bytes> behind one Mutex",
            r.blocks,
            super::report::size_label(r.value_bytes as u64)
        ),
        &["threads", "granary gets/s", "anchor gets/s", "ratio"],
    );
    for g in &r.gets {
        t.row(vec![
            g.threads.to_string(),
            format!("{:.0}", g.granary_gets_per_s),
            format!("{:.0}", g.anchor_gets_per_s),
            format!("{:.2}x", g.ratio),
        ]);
    }
    let mut l = Table::new(
        format!(
            "inproc: {}-block longest-prefix lookup, all present ({} lookups, per-lookup time over batches of {BATCH})",
            r.prefix_blocks, r.lookups
        ),
        &["impl", "median µs", "p99 µs", "mean µs", "ratio (median)"],
    );
    for row in &r.lookup {
        l.row(vec![
            row.impl_name.to_string(),
            format!("{:.3}", row.median_us),
            format!("{:.3}", row.p99_us),
            format!("{:.3}", row.mean_us),
            if row.impl_name == "granary" { format!("{:.2}x", r.lookup_ratio) } else { "anchor".into() },
        ]);
    }
    vec![t, l]
}

pub fn goals(r: &InprocReport) -> Vec<Goal> {
    let best = r.gets.iter().max_by(|a, b| a.granary_gets_per_s.total_cmp(&b.granary_gets_per_s));
    let figures: Vec<String> =
        r.gets.iter().map(|g| format!("{} thread(s): {:.2}M gets/s", g.threads, g.granary_gets_per_s / 1e6)).collect();
    let gets = Goal::new(
        "inproc",
        "memory-tier gets >= 1M/s",
        best.is_some_and(|b| b.granary_gets_per_s >= 1e6),
        figures.join(", "),
    );
    let g = &r.lookup[0];
    let lookup = Goal::new(
        "inproc",
        format!("{}-block lookup < 5 µs (median)", r.prefix_blocks),
        g.median_us < 5.0,
        format!("median {:.2} µs, p99 {:.2} µs", g.median_us, g.p99_us),
    );
    vec![gets, lookup]
}
