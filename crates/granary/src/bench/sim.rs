//! Trace-driven simulation of the eviction policies on real prefix reuse.
//!
//! Choosing a memory-tier policy needs numbers from real traffic, not from
//! synthetic Zipf keys: KV blocks come in prefix chains, most chains are
//! read once and a few (system prompts, ongoing conversations) many times.
//! This module replays a request trace in the Mooncake format (FAST'25; one
//! JSON object a line with `timestamp`, `input_length`, `output_length` and
//! `hash_ids`, the prefix-chained block ids of the prompt) through a cache of
//! a fixed number of equal-sized blocks under each [`PolicyKind`], and
//! reports the block hit ratio. `granary bench warehouse` and `granary bench routing` build on it.
//!
//! The replay follows the tier: every block of every request, in order, is
//! looked up; a hit is a read ([`Policy::access`]), a miss inserts the block
//! at its depth (its index in the request), evicting first while the cache
//! is full. Nothing is pinned. Two ratios come out: `hit_ratio` counts every
//! block found, `prefix_hit_ratio` only blocks before a request's first miss,
//! which is what an engine that loads the longest cached prefix can use.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use granary_warehouse::policy::{EntryId, Policy, PolicyKind};

/// Tokens per block in the Mooncake traces.
#[cfg(test)]
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// Cache sizes a sweep tries by default, as fractions of the distinct blocks.
pub const SWEEP_FRACTIONS: [f64; 6] = [0.01, 0.02, 0.05, 0.10, 0.20, 0.50];

/// The trace file's path below a `shared/` directory.
const MOONCAKE_REL: &str = "data/mooncake/conversation_trace.jsonl";

/// Environment variable naming the conversation trace explicitly.
pub const TRACE_ENV: &str = "GRANARY_MOONCAKE_TRACE";

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival, in milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    /// Prefix-chained block ids: two requests sharing the first k ids share
    /// k blocks of prompt prefix.
    pub hash_ids: Vec<u64>,
}

/// The outcome of one replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SimResult {
    pub policy: PolicyKind,
    /// Cache size in blocks (0 = unbounded).
    pub capacity_blocks: u64,
    /// Block references (lookups).
    pub refs: u64,
    /// References found in the cache.
    pub hits: u64,
    /// Hits before each request's first miss.
    pub prefix_hits: u64,
    pub evictions: u64,
    /// `hits / refs`.
    pub hit_ratio: f64,
    /// `prefix_hits / refs`.
    pub prefix_hit_ratio: f64,
}

/// Reads a trace in the Mooncake JSON-lines format; blank lines are skipped.
/// A malformed line is an `InvalidData` error naming its line number.
pub fn load_trace(path: impl AsRef<Path>) -> io::Result<Vec<TraceRequest>> {
    let path = path.as_ref();
    let reader = BufReader::new(File::open(path)?);
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let req = serde_json::from_str(&line)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}:{}: {e}", path.display(), i + 1)))?;
        out.push(req);
    }
    Ok(out)
}

/// Finds the Mooncake conversation trace: `$GRANARY_MOONCAKE_TRACE`, else
/// `shared/data/mooncake/` inside or next to the repository root, else
/// `/work/shared/data/mooncake/`. The error lists every place tried.
pub fn locate_mooncake_trace() -> io::Result<PathBuf> {
    let mut tried = Vec::new();
    if let Some(p) = std::env::var_os(TRACE_ENV) {
        tried.push(PathBuf::from(p));
    }
    let repo_root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    tried.push(repo_root.join("shared").join(MOONCAKE_REL));
    tried.push(repo_root.join("../shared").join(MOONCAKE_REL));
    tried.push(Path::new("/work/shared").join(MOONCAKE_REL));
    if let Some(found) = tried.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    let list: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("Mooncake conversation trace not found; set {TRACE_ENV} or place it at one of: {}", list.join(", ")),
    ))
}

/// A trace with block ids renumbered densely (0..distinct), in one flat
/// array, so that the replay indexes vectors instead of hashing.
struct Dense {
    /// Dense block ids, request after request.
    blocks: Vec<u32>,
    /// Each request's range in `blocks`.
    requests: Vec<(usize, usize)>,
    /// The original id of each dense id (the entries' fingerprints).
    original: Vec<u64>,
}

impl Dense {
    fn new(trace: &[TraceRequest]) -> Self {
        let total: usize = trace.iter().map(|r| r.hash_ids.len()).sum();
        let mut ids: HashMap<u64, u32> = HashMap::new();
        let mut blocks = Vec::with_capacity(total);
        let mut requests = Vec::with_capacity(trace.len());
        let mut original = Vec::new();
        for req in trace {
            let start = blocks.len();
            for &h in &req.hash_ids {
                let next = u32::try_from(original.len()).expect("fewer than 2^32 distinct blocks");
                let id = *ids.entry(h).or_insert(next);
                if id == next {
                    original.push(h);
                }
                blocks.push(id);
            }
            requests.push((start, blocks.len()));
        }
        Dense { blocks, requests, original }
    }
}

/// Distinct block ids in the trace.
pub fn distinct_blocks(trace: &[TraceRequest]) -> u64 {
    trace.iter().flat_map(|r| &r.hash_ids).collect::<HashSet<_>>().len() as u64
}

/// The hit ratio of an unbounded cache: the share of block references whose
/// block was referenced before. No policy can do better.
pub fn unbounded_ceiling(trace: &[TraceRequest]) -> f64 {
    let mut seen = HashSet::new();
    let mut refs = 0u64;
    let mut hits = 0u64;
    for &h in trace.iter().flat_map(|r| &r.hash_ids) {
        refs += 1;
        if !seen.insert(h) {
            hits += 1;
        }
    }
    ratio(hits, refs)
}

fn ratio(n: u64, d: u64) -> f64 {
    if d == 0 {
        0.0
    } else {
        n as f64 / d as f64
    }
}

/// Replays `trace` through a cache of `capacity_blocks` equal-sized blocks
/// (0 = unbounded) evicting with `policy`.
pub fn replay(trace: &[TraceRequest], policy: PolicyKind, capacity_blocks: u64) -> SimResult {
    replay_dense(&Dense::new(trace), policy, capacity_blocks)
}

fn replay_dense(d: &Dense, kind: PolicyKind, capacity_blocks: u64) -> SimResult {
    // Every block has size 1, so the policy's byte budget is in blocks.
    let mut policy: Box<dyn Policy> = kind.build(capacity_blocks);
    let mut present = vec![false; d.original.len()];
    let mut held = 0u64;
    let (mut refs, mut hits, mut prefix_hits, mut evictions) = (0u64, 0u64, 0u64, 0u64);
    for &(start, end) in &d.requests {
        let mut on_prefix = true;
        for (depth, &b) in d.blocks[start..end].iter().enumerate() {
            refs += 1;
            let id = EntryId::from(b);
            if present[b as usize] {
                hits += 1;
                prefix_hits += u64::from(on_prefix);
                policy.access(id);
                continue;
            }
            on_prefix = false;
            while capacity_blocks != 0 && held >= capacity_blocks {
                let victim = policy.evict(&mut |_| true).expect("a full cache has a victim when nothing is pinned");
                present[victim as usize] = false;
                held -= 1;
                evictions += 1;
            }
            policy.insert(id, d.original[b as usize], 1, u32::try_from(depth).unwrap_or(u32::MAX));
            present[b as usize] = true;
            held += 1;
        }
    }
    debug_assert_eq!(policy.len() as u64, held);
    SimResult {
        policy: kind,
        capacity_blocks,
        refs,
        hits,
        prefix_hits,
        evictions,
        hit_ratio: ratio(hits, refs),
        prefix_hit_ratio: ratio(prefix_hits, refs),
    }
}

/// The cache size for `fraction` of the trace's distinct blocks (at least 1).
pub fn capacity_for(distinct: u64, fraction: f64) -> u64 {
    ((distinct as f64 * fraction).round() as u64).max(1)
}

/// Replays `trace` under every policy in `policies` at every cache size in
/// `fractions` (of the distinct blocks, see [`SWEEP_FRACTIONS`]); results in
/// policy-major order. (The bench walks its own budgets; tests use this.)
#[cfg(test)]
pub fn sweep(trace: &[TraceRequest], policies: &[PolicyKind], fractions: &[f64]) -> Vec<SimResult> {
    let d = Dense::new(trace);
    let distinct = d.original.len() as u64;
    policies
        .iter()
        .flat_map(|&p| fractions.iter().map(move |&f| (p, capacity_for(distinct, f))))
        .map(|(p, cap)| replay_dense(&d, p, cap))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Instant;

    use super::*;

    fn req(ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length: ids.len() as u64 * u64::from(TRACE_BLOCK_TOKENS),
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    fn real_trace() -> Vec<TraceRequest> {
        let path = locate_mooncake_trace().unwrap_or_else(|e| panic!("{e}"));
        load_trace(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    }

    #[test]
    fn counts_hits_and_prefix_hits() {
        // Blocks 10, 11 shared by the first two; the third request finds all of
        // its blocks, seen in different requests.
        let trace = vec![req(&[10, 11, 12]), req(&[10, 11, 13]), req(&[10, 13, 12])];
        let r = replay(&trace, PolicyKind::Lru, 0);
        assert_eq!((r.refs, r.hits, r.prefix_hits, r.evictions), (9, 5, 5, 0));
        assert!((unbounded_ceiling(&trace) - 5.0 / 9.0).abs() < 1e-12);
        assert_eq!(distinct_blocks(&trace), 4);

        let trace = vec![req(&[1, 2, 3]), req(&[1, 4, 3])];
        let r = replay(&trace, PolicyKind::Fifo, 0);
        assert_eq!((r.hits, r.prefix_hits), (2, 1), "3 hits after the miss on 4");
    }

    #[test]
    fn bounded_cache_evicts_by_policy() {
        // Capacity 2: block 1 is read again before 3 arrives.
        let trace = vec![req(&[1]), req(&[2]), req(&[1]), req(&[3]), req(&[1])];
        let lru = replay(&trace, PolicyKind::Lru, 2);
        let fifo = replay(&trace, PolicyKind::Fifo, 2);
        assert_eq!((lru.hits, lru.evictions), (2, 1), "LRU evicts 2 and keeps 1");
        assert_eq!((fifo.hits, fifo.evictions), (1, 2), "FIFO evicts 1, the oldest, then misses it");
        for kind in PolicyKind::ALL {
            let r = replay(&trace, kind, 1);
            assert_eq!(r.hits, 0, "{kind}: one slot never holds 1 across another block");
            assert_eq!(r.evictions, 4);
        }
    }

    #[test]
    fn load_trace_reads_and_reports_bad_lines() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, r#"{{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [3, 9]}}"#).unwrap();
        writeln!(f).unwrap();
        writeln!(f, r#"{{"timestamp": 6, "input_length": 10, "output_length": 1, "hash_ids": [3]}}"#).unwrap();
        let t = load_trace(f.path()).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0], TraceRequest { timestamp: 5, input_length: 600, output_length: 7, hash_ids: vec![3, 9] });
        writeln!(f, r#"{{"timestamp": "x"}}"#).unwrap();
        let e = load_trace(f.path()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(":4:"), "{e}");
    }

    #[test]
    fn sweep_is_policy_major_and_sized_by_fraction() {
        let trace: Vec<_> = (0..50).map(|i| req(&[0, 1 + i % 7, 100 + i])).collect();
        let fr = [0.1, 0.5];
        let rows = sweep(&trace, &[PolicyKind::Lru, PolicyKind::Cost], &fr);
        let distinct = distinct_blocks(&trace);
        assert_eq!(distinct, 58);
        let got: Vec<_> = rows.iter().map(|r| (r.policy, r.capacity_blocks)).collect();
        assert_eq!(got, [(PolicyKind::Lru, 6), (PolicyKind::Lru, 29), (PolicyKind::Cost, 6), (PolicyKind::Cost, 29)]);
        for r in &rows {
            assert_eq!(*r, replay(&trace, r.policy, r.capacity_blocks));
        }
    }

    /// The published figure for this trace, from the real file.
    #[test]
    fn mooncake_unbounded_ceiling_is_36_64_percent() {
        let trace = real_trace();
        assert_eq!(trace.len(), 12_031);
        for r in &trace {
            assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(u64::from(TRACE_BLOCK_TOKENS)));
        }
        let ceiling = unbounded_ceiling(&trace);
        assert_eq!(format!("{:.2}", ceiling * 100.0), "36.64");
        // An unbounded replay finds exactly the blocks seen before, whatever
        // the policy; a cache as large as the distinct blocks never evicts.
        let distinct = distinct_blocks(&trace);
        for kind in [PolicyKind::Lru, PolicyKind::S3fifo] {
            let r = replay(&trace, kind, 0);
            assert_eq!(r.hit_ratio, ceiling, "{kind}");
            assert_eq!(replay(&trace, kind, distinct), SimResult { capacity_blocks: distinct, ..r });
        }
    }

    /// LRU is a stack algorithm: a larger cache always holds what a smaller
    /// one holds, so its hit ratio cannot fall as capacity grows.
    #[test]
    fn mooncake_lru_is_monotone_in_capacity() {
        let trace = real_trace();
        let rows = sweep(&trace, &[PolicyKind::Lru], &[0.01, 0.05, 0.2]);
        assert!(rows.windows(2).all(|w| w[0].hits <= w[1].hits), "{rows:?}");
        assert!(rows[0].hits > 0 && rows[2].hit_ratio < unbounded_ceiling(&trace));
    }

    /// The full policy × capacity table. Slow in debug builds; run with
    /// `cargo test --release -p granary --bin granary bench::sim:: -- --ignored --nocapture`.
    #[test]
    #[ignore = "full sweep; run in release"]
    fn mooncake_sweep_table() {
        let trace = real_trace();
        let ceiling = unbounded_ceiling(&trace);
        let distinct = distinct_blocks(&trace);
        let refs: usize = trace.iter().map(|r| r.hash_ids.len()).sum();
        println!(
            "Mooncake conversation trace: {} requests, {refs} block refs, {distinct} distinct blocks, \
             unbounded ceiling {:.2}%",
            trace.len(),
            ceiling * 100.0
        );
        let mut header = format!("{:<8}", "policy");
        for f in SWEEP_FRACTIONS {
            header += &format!(" {:>15}", format!("{:.0}% ({})", f * 100.0, capacity_for(distinct, f)));
        }
        println!("block hit ratio % (prefix hit ratio % in brackets), capacity as % of distinct blocks");
        println!("{header}");
        let mut table = Vec::new();
        for kind in PolicyKind::ALL {
            let mut line = format!("{:<8}", kind.as_str());
            let mut row = Vec::new();
            for f in SWEEP_FRACTIONS {
                let t = Instant::now();
                let r = replay(&trace, kind, capacity_for(distinct, f));
                let ms = t.elapsed().as_secs_f64() * 1e3;
                assert!(r.hit_ratio <= ceiling && r.prefix_hit_ratio <= r.hit_ratio, "{r:?}");
                assert!(r.hits > 0, "{r:?}");
                line += &format!(" {:>6.2} ({:>5.2})", r.hit_ratio * 100.0, r.prefix_hit_ratio * 100.0);
                eprintln!("{kind} {f}: {ms:.0} ms");
                row.push(r);
            }
            println!("{line}");
            table.push(row);
        }
        let lru = &table[0];
        assert!(lru.windows(2).all(|w| w[0].hits <= w[1].hits));
        for (i, f) in SWEEP_FRACTIONS.iter().enumerate() {
            let best = table.iter().map(|row| row[i]).max_by(|a, b| a.hit_ratio.total_cmp(&b.hit_ratio)).unwrap();
            let best_prefix = table
                .iter()
                .map(|row| row[i])
                .max_by(|a, b| a.prefix_hit_ratio.total_cmp(&b.prefix_hit_ratio))
                .unwrap();
            println!(
                "{:>3.0}%: best block hit ratio {} ({:.2}%), best prefix hit ratio {} ({:.2}%)",
                f * 100.0,
                best.policy,
                best.hit_ratio * 100.0,
                best_prefix.policy,
                best_prefix.prefix_hit_ratio * 100.0
            );
        }
    }
}
