//! Predictive prefetch: which models each agent should stage into its RAM
//! tier before anyone asks it to load them.
//!
//! The gateway keeps, for the last hour ([`WINDOW`]), the times of each
//! tenant's requests per model, and which agents' engines served each
//! tenant (the routing history). An agent's prediction is:
//!
//! 1. its tenants: those whose requests one of its engines served within
//!    the hour (an agent that served nobody gets no prediction);
//! 2. the models those tenants requested within the hour, ranked by how
//!    many requests (summed over its tenants), then by name;
//! 3. less the models it cannot load, runs an engine for, or already holds
//!    in RAM;
//! 4. at most `prefetch_max` of them, and no more bytes than it has room
//!    for: its reported RAM-tier room and free host memory, whichever is
//!    less (a model whose size no agent reported yet counts as 0 bytes:
//!    the agent's own RAM budget still bounds it).
//!
//! The heartbeat's answer carries the list (`prefetch: [{model}]`); the
//! agent stages the weights in the background and its next heartbeats
//! report them in RAM. The clock is an argument (unix ms), so tests and the
//! replay bench run an hour in no time.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Agents;
use crate::proxy::Gateway;
use crate::types::now_ms;

/// How far back the history reaches.
pub const WINDOW: Duration = Duration::from_secs(3600);

/// Request times kept per (tenant, model): more in an hour are folded
/// (the oldest dropped), which only flattens the ranking of the busiest.
const MAX_TIMES: usize = 4096;
/// (tenant, model) and (tenant, agent) pairs kept at most; past that the
/// least recently seen pair is forgotten.
const MAX_KEYS: usize = 50_000;

/// The tenant of requests without one (no keys configured).
const ANONYMOUS: &str = "-";

/// One model an agent is asked to prefetch (a heartbeat answer's `prefetch`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchItem {
    pub model: String,
    /// None: the registry's latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
}

/// What an agent holds and has room for, as the prediction needs it.
pub struct AgentHoldings<'a> {
    /// Models it can load.
    pub loadable: &'a [String],
    /// Models it needs nothing for: in its RAM tier, or running.
    pub held: HashSet<&'a str>,
    /// Bytes it may stage (None: not reported, no bound but the count).
    pub room: Option<u64>,
}

/// The last hour's requests per tenant and model, and who served whom.
pub struct RequestHistory {
    window_ms: u64,
    /// (tenant, model) → request times, unix ms, oldest first.
    requests: HashMap<(String, String), VecDeque<u64>>,
    /// (tenant, agent) → the last time that agent's engine served the tenant.
    served: HashMap<(String, String), u64>,
}

impl Default for RequestHistory {
    fn default() -> Self {
        RequestHistory::new(WINDOW)
    }
}

impl RequestHistory {
    pub fn new(window: Duration) -> RequestHistory {
        RequestHistory { window_ms: window.as_millis() as u64, requests: HashMap::new(), served: HashMap::new() }
    }

    /// A request of `tenant` for `model` at `now_ms`, served by `agent`'s
    /// engine when it was one.
    pub fn record(&mut self, now_ms: u64, tenant: Option<&str>, model: &str, agent: Option<&str>) {
        let tenant = tenant.unwrap_or(ANONYMOUS);
        let key = (tenant.to_string(), model.to_string());
        if !self.requests.contains_key(&key) && self.requests.len() >= MAX_KEYS {
            self.expire(now_ms);
            if self.requests.len() >= MAX_KEYS {
                let oldest = self.requests.iter().min_by_key(|(_, q)| q.back().copied()).map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.requests.remove(&k);
                }
            }
        }
        let q = self.requests.entry(key).or_default();
        q.push_back(now_ms);
        if q.len() > MAX_TIMES {
            q.pop_front();
        }
        if let Some(agent) = agent {
            let key = (tenant.to_string(), agent.to_string());
            if !self.served.contains_key(&key) && self.served.len() >= MAX_KEYS {
                self.expire(now_ms);
                if self.served.len() >= MAX_KEYS {
                    let oldest = self.served.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone());
                    if let Some(k) = oldest {
                        self.served.remove(&k);
                    }
                }
            }
            self.served.insert(key, now_ms);
        }
    }

    /// Forgets what is older than the window.
    pub fn expire(&mut self, now_ms: u64) {
        let cutoff = now_ms.saturating_sub(self.window_ms);
        self.requests.retain(|_, q| {
            while q.front().is_some_and(|&t| t < cutoff) {
                q.pop_front();
            }
            !q.is_empty()
        });
        self.served.retain(|_, t| *t >= cutoff);
    }

    /// The tenants `agent` served within the window.
    pub fn tenants_of(&self, now_ms: u64, agent: &str) -> Vec<String> {
        let cutoff = now_ms.saturating_sub(self.window_ms);
        let mut t: Vec<String> = self
            .served
            .iter()
            .filter(|((_, a), at)| a == agent && **at >= cutoff)
            .map(|((t, _), _)| t.clone())
            .collect();
        t.sort();
        t
    }

    /// The models `agent` should prefetch (see the module's rule), best first.
    pub fn predict(
        &mut self,
        now_ms: u64,
        agent: &str,
        holds: &AgentHoldings<'_>,
        size: impl Fn(&str) -> Option<u64>,
        max: usize,
    ) -> Vec<String> {
        self.expire(now_ms);
        let tenants: HashSet<String> = self.tenants_of(now_ms, agent).into_iter().collect();
        if tenants.is_empty() || max == 0 {
            return Vec::new();
        }
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for ((tenant, model), q) in &self.requests {
            if tenants.contains(tenant) {
                *counts.entry(model.as_str()).or_default() += q.len();
            }
        }
        let mut ranked: Vec<(&str, usize)> = counts
            .into_iter()
            .filter(|(m, _)| !holds.held.contains(m) && holds.loadable.iter().any(|l| l == m))
            .collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let mut room = holds.room;
        let mut out = Vec::new();
        for (model, _) in ranked {
            if out.len() >= max {
                break;
            }
            let bytes = size(model).unwrap_or(0);
            if let Some(r) = room.as_mut() {
                if bytes > *r {
                    continue;
                }
                *r -= bytes;
            }
            out.push(model.to_string());
        }
        out
    }
}

/// A prefetch asked of an agent, until a load uses it or it ages out.
pub(super) struct Asked {
    at: Instant,
    /// The agent's heartbeats showed the model in RAM since.
    done: bool,
}

impl Agents {
    /// Marks `agent_id`'s asked prefetches its heartbeat shows in RAM as done.
    pub(super) fn prefetched(&self, agent_id: &str, in_ram: &[&str]) -> usize {
        let mut asked = self.prefetch_asked.lock();
        let mut n = 0;
        for m in in_ram {
            if let Some(a) = asked.get_mut(&(agent_id.to_string(), m.to_string())) {
                if !a.done {
                    a.done = true;
                    n += 1;
                }
            }
        }
        n
    }

    /// Whether a load of `model` on `agent_id` found weights a prefetch put
    /// in RAM (counted once per prefetch).
    pub(super) fn prefetch_hit(&self, agent_id: &str, model: &str) -> bool {
        let key = (agent_id.to_string(), model.to_string());
        let mut asked = self.prefetch_asked.lock();
        match asked.get(&key) {
            Some(a) if a.done => {
                asked.remove(&key);
                true
            }
            _ => false,
        }
    }
}

impl Gateway {
    /// Notes a finished request for the prefetch history: its tenant, the
    /// model asked for, and the upstream that answered (an agent's engine
    /// makes that agent one of the tenant's).
    pub fn observe_request(&self, tenant: Option<&str>, model: Option<&str>, upstream: Option<&str>) {
        if !self.agents.cfg.enabled || !self.agents.cfg.prefetch {
            return;
        }
        let Some(model) = model else { return };
        let agent = upstream.and_then(|u| u.strip_prefix("agent:")).and_then(|rest| rest.split_once(':')).map(|x| x.0);
        self.agents.history.lock().record(now_ms() as u64, tenant, model, agent);
    }

    /// What `agent_id` should prefetch now (empty with prefetch off).
    pub fn prefetch_for(&self, agent_id: &str) -> Vec<PrefetchItem> {
        if !self.agents.cfg.prefetch {
            return Vec::new();
        }
        let (loadable, held, room) = {
            let st = self.agents.state.lock();
            let Some(a) = st.get(agent_id) else { return Vec::new() };
            let held: Vec<String> = a
                .weights
                .iter()
                .filter(|(_, rank)| **rank == 0)
                .map(|(m, _)| m.clone())
                .chain(a.engines.keys().cloned())
                .collect();
            (a.models.clone(), held, a.prefetch_room)
        };
        let holds = AgentHoldings { loadable: &loadable, held: held.iter().map(String::as_str).collect(), room };
        let sizes = self.agents.model_bytes.lock().clone();
        let models = self.agents.history.lock().predict(
            now_ms() as u64,
            agent_id,
            &holds,
            |m| sizes.get(m).copied(),
            self.agents.cfg.prefetch_max,
        );
        let now = Instant::now();
        let mut asked = self.agents.prefetch_asked.lock();
        asked.retain(|_, a| now.saturating_duration_since(a.at) < WINDOW);
        for m in &models {
            if let std::collections::hash_map::Entry::Vacant(e) = asked.entry((agent_id.to_string(), m.clone())) {
                e.insert(Asked { at: now, done: false });
                self.metrics.prefetch.get_or_create(&vec![("event", "asked".to_string())]).inc();
            }
        }
        models.into_iter().map(|model| PrefetchItem { model, revision: None }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60_000;

    fn holds<'a>(loadable: &'a [String], held: &[&'a str], room: Option<u64>) -> AgentHoldings<'a> {
        AgentHoldings { loadable, held: held.iter().copied().collect(), room }
    }

    fn models(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    /// History in, list out: the agent's tenants' models by request count,
    /// less what it holds or cannot load, bounded by count and room.
    #[test]
    fn predicts_the_tenants_models_by_request_count() {
        let mut h = RequestHistory::default();
        let t0 = 1_000_000_000;
        // Tenant a: served by node-1; asks for m1 ×3, m2 ×2, m3 ×1.
        for (i, m) in ["m1", "m1", "m1", "m2", "m2", "m3"].iter().enumerate() {
            h.record(t0 + i as u64, Some("a"), m, Some("node-1"));
        }
        // Tenant b: served by node-2 only; its model is not node-1's concern.
        for i in 0..10 {
            h.record(t0 + i, Some("b"), "m9", Some("node-2"));
        }
        // Tenant a also asked for m4 (an upstream that is no agent's).
        h.record(t0 + 7, Some("a"), "m4", None);
        let all = models(&["m1", "m2", "m3", "m4", "m9"]);
        let now = t0 + MIN;
        assert_eq!(h.predict(now, "node-1", &holds(&all, &[], None), |_| None, 10), ["m1", "m2", "m3", "m4"]);
        assert_eq!(h.predict(now, "node-1", &holds(&all, &[], None), |_| None, 2), ["m1", "m2"], "bounded by count");
        assert_eq!(
            h.predict(now, "node-1", &holds(&all, &["m1"], None), |_| None, 2),
            ["m2", "m3"],
            "held in RAM or running: skipped"
        );
        let some = models(&["m2", "m3"]);
        assert_eq!(
            h.predict(now, "node-1", &holds(&some, &[], None), |_| None, 10),
            ["m2", "m3"],
            "only loadable ones"
        );
        // Room: m1 (60) fits in 100, m2 (50) does not after it, m3 (30) does.
        let size = |m: &str| {
            Some(match m {
                "m1" => 60,
                "m2" => 50,
                _ => 30,
            })
        };
        assert_eq!(h.predict(now, "node-1", &holds(&all, &[], Some(100)), size, 10), ["m1", "m3"]);
        assert_eq!(h.predict(now, "node-2", &holds(&all, &[], None), |_| None, 10), ["m9"]);
        assert!(h.predict(now, "node-3", &holds(&all, &[], None), |_| None, 10).is_empty(), "served nobody");
        assert_eq!(h.tenants_of(now, "node-1"), ["a"]);
    }

    /// An hour later (the clock is an argument) the history is gone; a
    /// request within the hour keeps its tenant and model alive.
    #[test]
    fn history_expires_after_an_hour() {
        let mut h = RequestHistory::default();
        let t0 = 5_000_000_000;
        let all = models(&["m1", "m2"]);
        h.record(t0, Some("a"), "m1", Some("node-1"));
        h.record(t0 + 30 * MIN, Some("a"), "m2", Some("node-1"));
        let p = |h: &mut RequestHistory, at| h.predict(at, "node-1", &holds(&all, &[], None), |_| None, 10);
        assert_eq!(p(&mut h, t0 + 59 * MIN), ["m1", "m2"]);
        assert_eq!(p(&mut h, t0 + 61 * MIN), ["m2"], "m1's only request is over an hour old");
        assert_eq!(p(&mut h, t0 + 91 * MIN), Vec::<String>::new(), "and the routing history with it");
        assert!(h.requests.is_empty() && h.served.is_empty(), "expired entries are dropped, not kept");
    }

    /// The history stays bounded however many requests come.
    #[test]
    fn history_is_bounded() {
        let mut h = RequestHistory::default();
        for i in 0..(MAX_TIMES as u64 + 100) {
            h.record(1_000 + i, Some("a"), "m", Some("n"));
        }
        assert_eq!(h.requests[&("a".to_string(), "m".to_string())].len(), MAX_TIMES);
        for i in 0..(MAX_KEYS as u64 + 10) {
            h.record(10_000 + i, Some(&format!("t{i}")), "m", None);
        }
        assert!(h.requests.len() <= MAX_KEYS);
    }
}
