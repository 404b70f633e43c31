//! The prefetch prediction replayed over a stated synthetic request log,
//! on a simulated clock (no processes): the gateway's own predictor
//! ([`granary_gateway::agents::prefetch::RequestHistory`]) fed every
//! request, asked for each agent's list every heartbeat, and a model of the
//! agents' engines and RAM tiers.
//!
//! The log: 3 agents, 6 tenants (tenant `t` routed to agent `t % 3`), 12
//! models of equal size; tenant `t` uses models `2t`, `2t + 1`, `2t + 2`
//! (mod 12, so neighbours share one) with weights 6 : 3 : 1, one request
//! every 5 to 120 s (uniform, seeded xorshift), for 2 simulated hours.
//! Agents: an engine is started by the first request for a model it does
//! not run (a *load*) and unloaded after 5 minutes without requests; the
//! RAM tier holds 4 models, least recently used first out, never a running
//! model's; a model is promoted to RAM on its 2nd load within an hour (the
//! agent's default). With prefetch, every 30 s each agent stages what the
//! predictor names (`prefetch_max` 2, room = free RAM slots).
//!
//! Printed: per mode (prefetch off, on), the loads, the share whose weights
//! were in RAM, and the share pre-staged by a prefetch (the first load
//! after it).

use std::collections::{HashMap, HashSet};

use granary_gateway::agents::prefetch::{AgentHoldings, RequestHistory};
use serde::Serialize;

use super::super::warehouse::report::Table;

const AGENTS: usize = 3;
const TENANTS: usize = 6;
const MODELS: usize = 12;
const HOURS: u64 = 2;
const IDLE_MS: u64 = 5 * 60_000;
const RAM_SLOTS: usize = 4;
const BEAT_MS: u64 = 30_000;
const PREFETCH_MAX: usize = 2;
const MODEL_BYTES: u64 = 1 << 30;
const PROMOTE_WINDOW_MS: u64 = 3_600_000;

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct ReplayMode {
    pub(super) requests: u64,
    pub(super) loads: u64,
    pub(super) from_ram: u64,
    pub(super) prestaged: u64,
    pub(super) prefetches: u64,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct ReplayReport {
    pub(super) off: ReplayMode,
    pub(super) on: ReplayMode,
}

/// A request of the log: (time ms, tenant, model).
pub(super) fn request_log(seed: u64) -> Vec<(u64, usize, usize)> {
    let mut x = seed.max(1);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut log = Vec::new();
    for t in 0..TENANTS {
        let mut at = next() % 60_000;
        while at < HOURS * 3_600_000 {
            let pick = next() % 10;
            let j = if pick < 6 {
                0
            } else if pick < 9 {
                1
            } else {
                2
            };
            log.push((at, t, (2 * t + j) % MODELS));
            at += 5_000 + next() % 115_000;
        }
    }
    log.sort();
    log
}

#[derive(Default)]
struct Node {
    /// Running engines: model → last request.
    running: HashMap<usize, u64>,
    /// RAM tier: model → (last use, staged by a prefetch and not loaded since).
    ram: HashMap<usize, (u64, bool)>,
    /// Load times per model, for promotion.
    loads: HashMap<usize, Vec<u64>>,
}

impl Node {
    /// Puts `m` in RAM, evicting the least recently used model not running.
    fn stage(&mut self, m: usize, now: u64, prefetched: bool) -> bool {
        if let Some(e) = self.ram.get_mut(&m) {
            e.0 = now;
            return true;
        }
        if self.ram.len() >= RAM_SLOTS {
            let victim = self
                .ram
                .iter()
                .filter(|(k, _)| !self.running.contains_key(k))
                .min_by_key(|(_, v)| v.0)
                .map(|(k, _)| *k);
            match victim {
                Some(v) => {
                    self.ram.remove(&v);
                }
                None => return false,
            }
        }
        self.ram.insert(m, (now, prefetched));
        true
    }
}

fn name(m: usize) -> String {
    format!("model-{m:02}")
}

fn replay_mode(log: &[(u64, usize, usize)], prefetch: bool) -> ReplayMode {
    let mut out = ReplayMode::default();
    let mut nodes: Vec<Node> = (0..AGENTS).map(|_| Node::default()).collect();
    let mut history = RequestHistory::default();
    let all: Vec<String> = (0..MODELS).map(name).collect();
    let mut next_beat = 0;
    for &(at, tenant, m) in log {
        // Heartbeats (and idle unloads) up to this request.
        while next_beat <= at {
            for (i, n) in nodes.iter_mut().enumerate() {
                n.running.retain(|_, last| next_beat.saturating_sub(*last) < IDLE_MS);
                if !prefetch {
                    continue;
                }
                let held: Vec<String> = n.ram.keys().chain(n.running.keys()).map(|m| name(*m)).collect();
                let pinned = n.ram.keys().filter(|k| n.running.contains_key(k)).count();
                let holds = AgentHoldings {
                    loadable: &all,
                    held: held.iter().map(String::as_str).collect::<HashSet<_>>(),
                    room: Some((RAM_SLOTS - pinned) as u64 * MODEL_BYTES),
                };
                let agent = format!("agent-{i}");
                for p in history.predict(next_beat, &agent, &holds, |_| Some(MODEL_BYTES), PREFETCH_MAX) {
                    let m: usize = p.trim_start_matches("model-").parse().expect("a model of the log");
                    if n.stage(m, next_beat, true) {
                        out.prefetches += 1;
                    }
                }
            }
            next_beat += BEAT_MS;
        }
        out.requests += 1;
        let agent = tenant % AGENTS;
        let n = &mut nodes[agent];
        if let Some(last) = n.running.get_mut(&m) {
            *last = at;
        } else {
            out.loads += 1;
            if let Some((_, staged)) = n.ram.get(&m).copied() {
                out.from_ram += 1;
                out.prestaged += u64::from(staged);
            }
            n.running.insert(m, at);
            let q = n.loads.entry(m).or_default();
            q.push(at);
            q.retain(|t| at - t <= PROMOTE_WINDOW_MS);
            if n.ram.contains_key(&m) || q.len() >= 2 {
                n.stage(m, at, false);
            }
            if let Some(e) = n.ram.get_mut(&m) {
                *e = (at, false);
            }
        }
        history.record(at, Some(&format!("tenant-{tenant}")), &name(m), Some(&format!("agent-{agent}")));
    }
    out
}

pub(super) fn replay(seed: u64) -> ReplayReport {
    let log = request_log(seed);
    ReplayReport { off: replay_mode(&log, false), on: replay_mode(&log, true) }
}

pub(super) fn table(r: &ReplayReport) -> Table {
    let mut t = Table::new(
        format!(
            "coldstart --fleet: prefetch prediction replayed on a synthetic log ({TENANTS} tenants, {MODELS} models, {AGENTS} agents, {HOURS} simulated hours, {} requests; RAM tier {RAM_SLOTS} models, idle unload 5 min)",
            r.on.requests
        ),
        &["prefetch", "loads", "weights in RAM", "pre-staged by a prefetch", "prefetches"],
    );
    let pct = |a: u64, b: u64| format!("{:.0}% ({a})", 100.0 * a as f64 / b.max(1) as f64);
    for (label, m) in [("off", &r.off), ("on", &r.on)] {
        t.row(vec![
            label.into(),
            m.loads.to_string(),
            pct(m.from_ram, m.loads),
            pct(m.prestaged, m.loads),
            m.prefetches.to_string(),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replay is deterministic, and prefetch puts more loads' weights
    /// in RAM than promotion alone on this log.
    #[test]
    fn prefetch_raises_the_share_of_loads_from_ram() {
        let a = replay(42);
        let b = replay(42);
        assert_eq!((a.on.loads, a.on.prestaged), (b.on.loads, b.on.prestaged));
        assert_eq!(a.off.requests, a.on.requests);
        assert_eq!(a.off.prestaged, 0);
        assert!(a.on.loads > 20, "{a:?}");
        assert!(a.on.prestaged > 0 && a.on.from_ram > a.off.from_ram, "{a:?}");
    }
}
