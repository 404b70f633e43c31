//! Replicas per model, from `[gateway.agents.models.NAME]`:
//!
//! ```toml
//! [gateway.agents.models.smollm2]
//! min_replicas = 1      # engines kept loaded whatever the traffic
//! max_replicas = 3      # at most this many engines, on distinct agents
//! scale_out_active = 4  # another engine once each has more in flight
//! ```
//!
//! On the agents' timer (at most once a second) the gateway looks at every
//! model listed there: one with fewer engines taking requests than
//! `min_replicas` is loaded on the best agent not running it yet (ranked as
//! for loads on demand), and so is one whose engines have more than
//! `scale_out_active` requests each, in flight or waiting in the gateway's
//! admission queue for them, up to `max_replicas`. One
//! load per model at a time, whatever started it; a replica load that
//! failed is tried again after [`LOAD_RETRY_AFTER`].
//!
//! Idle unload is the agents' decision; the answer to an agent's heartbeat
//! lists in `keep` those of its engines the model needs to stay at
//! `min_replicas`, and the agent does not unload them for idleness (nor
//! finishes draining one).

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::load::LoadWhy;
use super::LOAD_RETRY_AFTER;
use crate::proxy::Gateway;

/// How many engines one model gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelScaling {
    /// Engines kept loaded: loaded once an agent can, loaded again when one
    /// goes away, never unloaded for idleness below this count.
    pub min_replicas: usize,
    /// The most engines (each on its own agent).
    pub max_replicas: usize,
    /// Another engine when the engines have more requests in flight each
    /// than this (0: never scale out).
    pub scale_out_active: usize,
}

impl Default for ModelScaling {
    fn default() -> Self {
        ModelScaling { min_replicas: 0, max_replicas: 1, scale_out_active: 0 }
    }
}

/// A model's engines as the gateway sees them now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Replicas {
    /// Engines taking requests (not draining) on live agents.
    pub engines: usize,
    /// Requests in flight on them through this gateway, and those waiting
    /// in its admission queue for one of them (engines with `max_active`
    /// full: the queue grows there, not on the engines).
    pub active: usize,
    /// Some live agent lists the model and does not run it yet.
    pub spare_agent: bool,
}

impl Gateway {
    pub(super) fn replicas(&self, model: &str) -> Replicas {
        let now = Instant::now();
        let st = self.agents.state.lock();
        let mut r = Replicas { engines: 0, active: 0, spare_agent: false };
        let mut ids = Vec::new();
        for a in st.values().filter(|a| self.agents.live(a, now)) {
            match a.engines.get(model).filter(|e| !e.draining) {
                Some(e) => {
                    r.engines += 1;
                    r.active += e.upstream.active.load(std::sync::atomic::Ordering::Acquire);
                    ids.push(e.upstream.id);
                }
                None => r.spare_agent |= a.models.iter().any(|m| m == model),
            }
        }
        drop(st);
        r.active += self.admission.waiting_for(&ids);
        r
    }

    /// One look at every model with a `[gateway.agents.models]` entry:
    /// starts the loads its replicas need; returns them (model, reason).
    pub(crate) fn reconcile_replicas(self: &Arc<Self>) -> Vec<(String, &'static str)> {
        let mut started = Vec::new();
        for (model, s) in &self.agents.cfg.models {
            let r = self.replicas(model);
            if !r.spare_agent {
                continue;
            }
            let max = s.max_replicas.max(s.min_replicas);
            let why = if r.engines < s.min_replicas {
                LoadWhy::MinReplicas
            } else if s.scale_out_active > 0
                && r.engines > 0
                && r.engines < max
                && r.active > s.scale_out_active * r.engines
            {
                LoadWhy::ScaleOut
            } else {
                continue;
            };
            if self.agents.replica_failed.lock().get(model).is_some_and(|at| at.elapsed() < LOAD_RETRY_AFTER) {
                continue;
            }
            let mut loads = self.agents.loads.lock();
            if loads.contains_key(model) {
                continue;
            }
            tracing::info!(model = %model, engines = r.engines, active = r.active, reason = why.as_str(), "adding a replica");
            self.begin_load(&mut loads, model, why);
            started.push((model.clone(), why.as_str()));
        }
        started
    }

    /// The engines of `agent_id` its model needs to stay at `min_replicas`.
    /// One taking requests is kept when the other agents' engines taking
    /// requests are fewer than `min_replicas`. A draining one is kept when
    /// those, plus the draining ones on agents named before it, are
    /// fewer: when several drain at once (their agents saw them idle at the
    /// same moment), the first by agent name are kept and the rest go,
    /// rather than all being kept, or none.
    pub fn keep_warm(&self, agent_id: &str) -> Vec<String> {
        let now = Instant::now();
        let st = self.agents.state.lock();
        let Some(agent) = st.get(agent_id) else { return Vec::new() };
        agent
            .engines
            .iter()
            .filter(|(model, mine)| {
                let min = self.agents.cfg.models.get(*model).map_or(0, |s| s.min_replicas);
                min > 0 && {
                    let others = st
                        .iter()
                        .filter(|(id, a)| id.as_str() != agent_id && self.agents.live(a, now))
                        .filter_map(|(id, a)| a.engines.get(*model).map(|e| (id, e.draining)));
                    let serving = others.clone().filter(|(_, draining)| !draining).count();
                    let before = others.filter(|(id, draining)| *draining && id.as_str() < agent_id).count();
                    if mine.draining {
                        serving + before < min
                    } else {
                        serving < min
                    }
                }
            })
            .map(|(model, _)| model.clone())
            .collect()
    }
}
