//! Node agents: what they report becomes part of the upstream set while
//! the gateway runs.
//!
//! An agent (one per node, `granary agent`) posts a heartbeat every few
//! seconds to `POST /admin/v1/agents/heartbeat` ([`Heartbeat`]): the
//! engines it runs, whether each is healthy, and the models it could load.
//! Each engine becomes an upstream named `agent:<agent_id>:<model>`, in an
//! implicit pool per model routed by `[gateway.agents] pool_policy`, with
//! the health checks, breaker and KV-event following of configured
//! upstreams. An engine the agent stops reporting leaves the set; so do all
//! of an agent's engines when its heartbeats stop for `ttl_ms`. An engine
//! reported `healthy: false` stays but gets no traffic.
//!
//! A request for a model no upstream serves, but some live agent lists,
//! makes the gateway ask that agent to load it (`POST
//! {agent}/models/{model}/load`): one load per model at a time, every
//! request for it waiting on that one for up to `load_timeout_ms`. The
//! agent's answer names the new engine, which joins the set at once.
//!
//! Which agent loads it is the one with the lowest estimated time to first
//! token, ServerlessLLM-style ([`estimate`]): the download if no tier there
//! holds the weights, the read of the weights (or of their converted-weight
//! checkpoint) at the rate measured for the tier they are in, the
//! conversion unless a checkpoint is loaded, the engine's fixed start cost,
//! and what the loads already under way there have left
//! ([`Heartbeat::weights`], [`Heartbeat::load_profile`]); among equals the
//! closer tier, then the one running fewest engines, then the one with the
//! most free memory ([`Heartbeat::resources`]). The request that waited on
//! the load is answered with `x-granary-placement` saying which agent
//! loaded the model and why, each estimate's terms included.
//! `placement = "fewest_engines"` ignores the estimate (the baseline the
//! cold-start bench measures placement against).
//!
//! With `prefetch` on, each heartbeat's answer also names the models the
//! agent should stage into its RAM tier, predicted from the last hour's
//! requests of the tenants it served ([`prefetch`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::{AgentsConfig, UpstreamConfig};
use crate::error::ApiError;
use crate::proxy::Gateway;
use crate::types::now_ms;
use crate::upstream::{Origin, Upstream};
use estimate::{Held, Underway};
use load::LoadState;

pub mod estimate;
mod http;
mod load;
pub mod prefetch;
mod scaling;
#[cfg(test)]
mod scaling_tests;
#[cfg(test)]
mod tests;

pub use http::admin_routes;
pub use scaling::ModelScaling;

/// `Retry-After` on 503 `model_loading` and `model_load_failed`; also how
/// long a failed load is remembered (requests meanwhile fail at once
/// instead of asking the agents again).
pub const LOAD_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The longest a load call to an agent may take (it goes on after the
/// requests waiting on it have given up, so that their retries find the
/// model loaded): weights may have to come from far away.
pub const LOAD_CALL_LIMIT: Duration = Duration::from_secs(3600);

/// Limits on a heartbeat's lists.
const MAX_ENGINES: usize = 1_000;
const MAX_MODELS: usize = 10_000;

fn yes() -> bool {
    true
}

/// The body of `POST /admin/v1/agents/heartbeat`. Fields beyond these are
/// ignored, so agents may report more than this gateway reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The agent's name, unique among agents: letters, digits, `-`, `_`, `.`.
    pub agent_id: String,
    /// Where the agent's control API listens (`http://` or `https://`).
    pub url: String,
    /// Bearer token for the agent's control API, if it wants one.
    #[serde(default)]
    pub token: Option<String>,
    /// The engines it runs now.
    #[serde(default)]
    pub engines: Vec<EngineReport>,
    /// The models it can load on request.
    #[serde(default)]
    pub models: Vec<String>,
    /// Model revisions laid out on the node and where their weights are.
    #[serde(default)]
    pub weights: Vec<WeightsReport>,
    /// Free capacity of the node.
    #[serde(default)]
    pub resources: Option<ResourcesReport>,
    /// Bytes the agent's RAM tier could take for prefetched weights (its
    /// budget less the copies running engines hold); absent: unknown.
    #[serde(default)]
    pub prefetch_room: Option<u64>,
    /// How fast the node loads, as its loads measured it (absent figures:
    /// the defaults in [`estimate`]).
    #[serde(default)]
    pub load_profile: estimate::LoadProfileReport,
    /// Engines starting there now (loads under way, whoever asked).
    #[serde(default)]
    pub starting: usize,
}

/// Where a model revision's weights are on an agent's node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WeightsReport {
    pub model: String,
    #[serde(default)]
    pub revision: String,
    /// `ram`, `disk` or `none`.
    pub tier: String,
    /// The revision's size (0: not reported).
    #[serde(default)]
    pub bytes: u64,
    /// Where the engine's converted-weight checkpoint of it is (`ram`,
    /// `disk`); absent: none, so a start converts the weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// The checkpoint's size (0: none or not reported).
    #[serde(default)]
    pub checkpoint_bytes: u64,
    /// The conversion (or start work) the last start of it there took, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub convert_ms: Option<u64>,
}

impl WeightsReport {
    /// Lower is closer: RAM, disk, anything else (to be fetched).
    fn rank(&self) -> u8 {
        match self.tier.as_str() {
            "ram" => 0,
            "disk" => 1,
            _ => 2,
        }
    }

    fn held(&self) -> Held {
        let tier = self.rank();
        let checkpoint = match self.checkpoint.as_deref() {
            _ if tier >= 2 => None,
            Some("ram") => Some(0),
            Some(_) => Some(1),
            None => None,
        };
        Held {
            tier,
            bytes: self.bytes,
            checkpoint,
            checkpoint_bytes: if checkpoint.is_some() { self.checkpoint_bytes } else { 0 },
            convert_ms: self.convert_ms,
        }
    }
}

/// A node's free capacity, as its agent reports it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ResourcesReport {
    #[serde(default)]
    pub host_memory_free: u64,
    #[serde(default)]
    pub gpus: Vec<GpuReport>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GpuReport {
    #[serde(default)]
    pub memory_free: u64,
}

impl ResourcesReport {
    /// Memory an engine could use: the GPUs' when the node has some.
    fn free(&self) -> u64 {
        if self.gpus.is_empty() {
            self.host_memory_free
        } else {
            self.gpus.iter().map(|g| g.memory_free).max().unwrap_or(0)
        }
    }
}

/// One engine in a heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineReport {
    /// The model it serves (the `model` clients send).
    pub model: String,
    /// Its base URL (`http://127.0.0.1:41234`).
    pub upstream: String,
    /// The agent's own view of its health; `false`: no traffic.
    #[serde(default = "yes")]
    pub healthy: bool,
    /// Requests in flight at most (0: unbounded).
    #[serde(default)]
    pub max_active: usize,
    /// Whether it publishes `/v1/kv/events` (Granary engines do).
    #[serde(default = "yes")]
    pub kv_events: bool,
    /// The agent is about to unload it: no new requests, those in flight
    /// finish. The heartbeat's answer says how many are still in flight here.
    #[serde(default)]
    pub draining: bool,
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, "invalid_value", message)
}

fn check_http_url(param: &str, url: &str) -> Result<(), ApiError> {
    match url::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Ok(()),
        _ => Err(invalid(param, format!("Invalid `{param}`: {url:?} is not an http:// or https:// URL with a host."))),
    }
}

/// A model name as it appears in requests, URLs and metric labels.
pub fn valid_model_name(m: &str) -> bool {
    !m.is_empty() && m.len() <= 256 && m.chars().all(|c| !c.is_whitespace() && !c.is_control() && c != '"' && c != '\\')
}

impl Heartbeat {
    /// Checks every field, naming the first one at fault.
    pub fn validate(&self) -> Result<(), ApiError> {
        let id_ok = !self.agent_id.is_empty()
            && self.agent_id.len() <= 128
            && self.agent_id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !id_ok {
            return Err(invalid("agent_id", "Invalid `agent_id`: 1 to 128 letters, digits, '-', '_' or '.' expected."));
        }
        check_http_url("url", &self.url)?;
        if let Some(t) = &self.token {
            if t.len() > 4096 || t.chars().any(|c| c.is_control()) {
                return Err(invalid("token", "Invalid `token`: at most 4096 characters, no control characters."));
            }
        }
        if self.engines.len() > MAX_ENGINES {
            return Err(invalid("engines", format!("Too many `engines`: at most {MAX_ENGINES}.")));
        }
        for (i, e) in self.engines.iter().enumerate() {
            let field = |f: &str| format!("engines[{i}].{f}");
            if !valid_model_name(&e.model) {
                return Err(invalid(
                    field("model"),
                    format!("Invalid `{}`: 1 to 256 characters, no spaces, quotes or backslashes.", field("model")),
                ));
            }
            if self.engines[..i].iter().any(|o| o.model == e.model) {
                return Err(invalid(
                    field("model"),
                    format!("Invalid `{}`: {:?} is reported twice.", field("model"), e.model),
                ));
            }
            check_http_url(&field("upstream"), &e.upstream)?;
        }
        if self.models.len() > MAX_MODELS {
            return Err(invalid("models", format!("Too many `models`: at most {MAX_MODELS}.")));
        }
        if self.weights.len() > MAX_MODELS {
            return Err(invalid("weights", format!("Too many `weights`: at most {MAX_MODELS}.")));
        }
        for (i, m) in self.models.iter().enumerate() {
            if !valid_model_name(m) {
                return Err(invalid(
                    format!("models[{i}]"),
                    format!("Invalid `models[{i}]`: 1 to 256 characters, no spaces, quotes or backslashes."),
                ));
            }
        }
        Ok(())
    }
}

/// An engine of an agent, as an upstream.
struct Engine {
    upstream: Arc<Upstream>,
    /// Seen in a heartbeat. An engine added from a load answer is not yet,
    /// and is kept for a `ttl` even if a heartbeat sent before the load
    /// finished does not list it.
    reported: bool,
    added: Instant,
    /// Reported draining: out of the upstream set (no new requests), kept
    /// here for the requests still in flight on `upstream`.
    draining: bool,
}

struct Agent {
    url: String,
    token: Option<String>,
    models: Vec<String>,
    engines: BTreeMap<String, Engine>,
    last_seen: Instant,
    last_seen_ms: i64,
    /// Per model, the closest tier holding its weights (0 RAM, 1 disk).
    weights: HashMap<String, u8>,
    /// Models whose weights it holds with a converted-weight checkpoint
    /// (a start that converts nothing).
    checkpoints: std::collections::HashSet<String>,
    /// Free memory for an engine, bytes (0: not reported).
    free_memory: u64,
    /// Bytes it may stage for prefetches (its RAM tier's room, free host
    /// memory, whichever is less; None: neither reported).
    prefetch_room: Option<u64>,
    /// Per model, its closest revision there, for the load estimate.
    held: HashMap<String, Held>,
    /// How fast it loads.
    profile: estimate::LoadProfileReport,
    /// Engines starting there, as it last said.
    starting: usize,
}

/// The agents the gateway has heard from and the loads in progress.
pub struct Agents {
    pub(crate) cfg: AgentsConfig,
    state: Mutex<HashMap<String, Agent>>,
    loads: Mutex<HashMap<String, watch::Receiver<LoadState>>>,
    failed: Mutex<HashMap<String, Instant>>,
    /// When a replica load (min_replicas, scale out) of each model last failed.
    replica_failed: Mutex<HashMap<String, Instant>>,
    /// Requests waiting for each model's load (at most `load_queue`).
    queued: Mutex<HashMap<String, usize>>,
    /// Why the last load of each model went where it did.
    placements: Mutex<HashMap<String, String>>,
    /// The last hour's requests and who served them, for prefetch.
    history: Mutex<prefetch::RequestHistory>,
    /// (agent, model) prefetches asked and not yet used by a load.
    prefetch_asked: Mutex<HashMap<(String, String), prefetch::Asked>>,
    /// Each model's size as agents report it (the largest revision seen).
    model_bytes: Mutex<HashMap<String, u64>>,
    /// Each model's conversion as an agent last measured it, ms (for
    /// agents that have not loaded it yet).
    convert_ms: Mutex<HashMap<String, u64>>,
    /// Per agent, the loads this gateway has under way there.
    underway: Mutex<HashMap<String, Underway>>,
    next_load: AtomicU64,
    http: reqwest::Client,
    reaper: AtomicBool,
}

/// An agent as `GET /admin/v1/agents` shows it (never its token).
#[derive(Debug, Clone, Serialize)]
pub struct AgentView {
    pub agent_id: String,
    pub url: String,
    pub has_token: bool,
    /// Last heartbeat, unix milliseconds.
    pub last_seen_ms: i64,
    /// Milliseconds since then.
    pub age_ms: u64,
    pub models: Vec<String>,
    pub engines: Vec<EngineView>,
    /// Per model, where the agent holds its weights (`ram`, `disk`, `none`).
    pub weights: BTreeMap<String, &'static str>,
    /// Models whose converted-weight checkpoint it holds too.
    pub checkpoints: Vec<String>,
    /// How fast it loads, as it reports (what placement estimates from).
    pub load_profile: estimate::LoadProfileReport,
    /// Engines starting there.
    pub starting: usize,
}

/// An agent's engine as the gateway sees it.
#[derive(Debug, Clone, Serialize)]
pub struct EngineView {
    pub model: String,
    /// The upstream's name (`agent:<agent_id>:<model>`).
    pub name: String,
    pub upstream: String,
    /// As the agent reports it.
    pub healthy: bool,
    /// The gateway's own health check.
    pub up: bool,
    /// `closed`, `half_open` or `open`.
    pub breaker: &'static str,
    /// Gets traffic now.
    pub routable: bool,
    /// Reported draining: no new requests, those in flight finish.
    pub draining: bool,
    pub active_requests: usize,
}

impl Agents {
    pub(crate) fn new(cfg: AgentsConfig) -> Agents {
        Agents {
            cfg,
            state: Mutex::new(HashMap::new()),
            loads: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashMap::new()),
            replica_failed: Mutex::new(HashMap::new()),
            queued: Mutex::new(HashMap::new()),
            placements: Mutex::new(HashMap::new()),
            history: Mutex::new(prefetch::RequestHistory::default()),
            prefetch_asked: Mutex::new(HashMap::new()),
            model_bytes: Mutex::new(HashMap::new()),
            convert_ms: Mutex::new(HashMap::new()),
            underway: Mutex::new(HashMap::new()),
            next_load: AtomicU64::new(0),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .tcp_nodelay(true)
                .build()
                .unwrap_or_default(),
            reaper: AtomicBool::new(false),
        }
    }

    pub fn enabled(&self) -> bool {
        self.cfg.enabled
    }

    fn live(&self, a: &Agent, now: Instant) -> bool {
        now.saturating_duration_since(a.last_seen) <= self.cfg.ttl()
    }

    /// Some live agent lists `model` as loadable.
    pub fn can_load(&self, model: &str) -> bool {
        if !self.cfg.enabled {
            return false;
        }
        let now = Instant::now();
        self.state.lock().values().any(|a| self.live(a, now) && a.models.iter().any(|m| m == model))
    }

    /// Every model some live agent can load.
    pub fn loadable_models(&self) -> Vec<String> {
        let now = Instant::now();
        let st = self.state.lock();
        let mut out: Vec<String> =
            st.values().filter(|a| self.live(a, now)).flat_map(|a| a.models.iter().cloned()).collect();
        out.sort();
        out.dedup();
        out
    }

    /// Live agents.
    pub fn count(&self) -> usize {
        let now = Instant::now();
        self.state.lock().values().filter(|a| self.live(a, now)).count()
    }
}

fn upstream_name(agent_id: &str, model: &str) -> String {
    format!("agent:{agent_id}:{model}")
}

impl Gateway {
    /// Applies an agent's heartbeat: the agent is alive, its engines join,
    /// change or leave the upstream set, routing follows before this
    /// returns. The heartbeat must have passed [`Heartbeat::validate`].
    pub fn heartbeat(&self, hb: Heartbeat) -> Result<(), ApiError> {
        self.heartbeat_at(hb, Instant::now())
    }

    pub(crate) fn heartbeat_at(&self, hb: Heartbeat, now: Instant) -> Result<(), ApiError> {
        let ttl = self.agents.cfg.ttl();
        let mut changed = false;
        let result = {
            let mut st = self.agents.state.lock();
            let agent = st.entry(hb.agent_id.clone()).or_insert_with(|| {
                tracing::info!(agent = %hb.agent_id, url = %hb.url, "agent registered");
                Agent {
                    url: hb.url.clone(),
                    token: None,
                    models: vec![],
                    engines: BTreeMap::new(),
                    last_seen: now,
                    last_seen_ms: now_ms(),
                    weights: HashMap::new(),
                    checkpoints: Default::default(),
                    free_memory: 0,
                    prefetch_room: None,
                    held: HashMap::new(),
                    profile: Default::default(),
                    starting: 0,
                }
            });
            agent.weights.clear();
            agent.checkpoints.clear();
            agent.held.clear();
            for w in &hb.weights {
                let r = agent.weights.entry(w.model.clone()).or_insert(u8::MAX);
                *r = (*r).min(w.rank());
                if w.rank() < 2 && w.checkpoint.is_some() {
                    agent.checkpoints.insert(w.model.clone());
                }
                let h = w.held();
                match agent.held.get(&w.model) {
                    Some(cur) if !h.better_than(cur) => {}
                    _ => {
                        agent.held.insert(w.model.clone(), h);
                    }
                }
            }
            {
                let mut sizes = self.agents.model_bytes.lock();
                let mut converts = self.agents.convert_ms.lock();
                for w in &hb.weights {
                    if w.bytes > 0 {
                        let n = sizes.entry(w.model.clone()).or_insert(0);
                        *n = (*n).max(w.bytes);
                    }
                    if let Some(c) = w.convert_ms {
                        converts.insert(w.model.clone(), c);
                    }
                }
            }
            agent.profile = hb.load_profile.clone();
            agent.starting = hb.starting;
            agent.free_memory = hb.resources.as_ref().map_or(0, ResourcesReport::free);
            let host_free = hb.resources.as_ref().map(|r| r.host_memory_free).filter(|&n| n > 0);
            agent.prefetch_room = match (hb.prefetch_room, host_free) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if self.agents.cfg.prefetch {
                let in_ram: Vec<&str> =
                    agent.weights.iter().filter(|(_, r)| **r == 0).map(|(m, _)| m.as_str()).collect();
                let done = self.agents.prefetched(&hb.agent_id, &in_ram);
                if done > 0 {
                    self.metrics.prefetch.get_or_create(&vec![("event", "done".to_string())]).inc_by(done as u64);
                }
            }
            agent.url = hb.url.clone();
            agent.token = hb.token.clone().filter(|t| !t.is_empty());
            agent.last_seen = now;
            agent.last_seen_ms = now_ms();
            let mut models = hb.models.clone();
            models.sort();
            models.dedup();
            for m in &models {
                self.metrics.know_model(m);
            }
            agent.models = models;
            // Engines no longer reported leave (unless just loaded and the
            // heartbeat may predate the load).
            let reported: Vec<&str> = hb.engines.iter().map(|e| e.model.as_str()).collect();
            let mut leaving = Vec::new();
            agent.engines.retain(|model, e| {
                let keep =
                    reported.contains(&model.as_str()) || (!e.reported && now.saturating_duration_since(e.added) < ttl);
                if !keep {
                    leaving.push(e.upstream.id);
                }
                keep
            });
            for id in leaving {
                self.remove_upstream(id);
                changed = true;
            }
            let mut result = Ok(());
            for e in &hb.engines {
                match agent.engines.get_mut(&e.model) {
                    Some(cur)
                        if cur.upstream.cfg.url == e.upstream
                            && cur.upstream.cfg.max_active == e.max_active
                            && cur.upstream.cfg.kv_events == e.kv_events =>
                    {
                        cur.reported = true;
                        if e.draining && !cur.draining {
                            // Out of routing before this returns; the agent
                            // waits for what is in flight, then stops it.
                            tracing::info!(agent = %hb.agent_id, model = %e.model, "engine draining: no new requests");
                            self.remove_upstream(cur.upstream.id);
                            cur.draining = true;
                            changed = true;
                        } else if !e.draining && cur.draining {
                            // Taken back (a load came during the drain).
                            match self.add_engine(&hb.agent_id, e) {
                                Ok(u) => cur.upstream = u,
                                Err(err) => {
                                    result = Err(err);
                                    break;
                                }
                            }
                            cur.draining = false;
                            changed = true;
                        }
                        cur.upstream.set_reported_healthy(e.healthy);
                    }
                    other => {
                        // New, or moved (an engine restarted on another port).
                        if let Some(old) = other {
                            self.remove_upstream(old.upstream.id);
                        }
                        agent.engines.remove(&e.model);
                        changed = true;
                        if e.draining {
                            // Never routed: it is on its way out.
                            continue;
                        }
                        match self.add_engine(&hb.agent_id, e) {
                            Ok(u) => {
                                agent.engines.insert(
                                    e.model.clone(),
                                    Engine { upstream: u, reported: true, added: now, draining: false },
                                );
                            }
                            Err(err) => {
                                result = Err(err);
                                break;
                            }
                        }
                    }
                }
            }
            result
        };
        if changed {
            self.rebuild();
        }
        result
    }

    fn add_engine(&self, agent_id: &str, e: &EngineReport) -> Result<Arc<Upstream>, ApiError> {
        let mut cfg = UpstreamConfig::new(upstream_name(agent_id, &e.model), e.upstream.clone());
        cfg.models = vec![e.model.clone()];
        cfg.max_active = e.max_active;
        cfg.kv_events = e.kv_events;
        let origin = Origin::Agent { agent_id: agent_id.to_string(), model: e.model.clone() };
        let u = self.upstreams.add(cfg, origin).map_err(|err| ApiError::internal(&format!("{err:#}")))?;
        u.set_reported_healthy(e.healthy);
        Ok(u)
    }

    /// Drops agents not heard from for `ttl`, with their engines. The
    /// gateway calls this on a timer once agents exist.
    pub fn expire_agents(&self) -> Vec<String> {
        self.expire_agents_at(Instant::now())
    }

    pub(crate) fn expire_agents_at(&self, now: Instant) -> Vec<String> {
        let ttl = self.agents.cfg.ttl();
        let mut gone = Vec::new();
        {
            let mut st = self.agents.state.lock();
            let expired: Vec<String> = st
                .iter()
                .filter(|(_, a)| now.saturating_duration_since(a.last_seen) > ttl)
                .map(|(id, _)| id.clone())
                .collect();
            for id in expired {
                if let Some(a) = st.remove(&id) {
                    for e in a.engines.values() {
                        self.remove_upstream(e.upstream.id);
                    }
                    tracing::warn!(agent = %id, "agent expired: no heartbeat for {ttl:?}");
                    gone.push(id);
                }
            }
        }
        if !gone.is_empty() {
            self.rebuild();
        }
        gone
    }

    /// Requests in flight through this gateway on each of `agent_id`'s
    /// draining engines (the heartbeat's answer: the agent stops an engine
    /// once no gateway has any left on it).
    pub fn draining_active(&self, agent_id: &str) -> BTreeMap<String, usize> {
        let st = self.agents.state.lock();
        let Some(a) = st.get(agent_id) else { return BTreeMap::new() };
        a.engines
            .iter()
            .filter(|(_, e)| e.draining)
            .map(|(m, e)| (m.clone(), e.upstream.active.load(Ordering::SeqCst)))
            .collect()
    }

    /// Starts the timer that expires silent agents and keeps each model's
    /// replicas ([`scaling`]) (once; it ends with the gateway).
    pub(crate) fn start_reaper(self: &Arc<Self>) {
        if self.agents.reaper.swap(true, Ordering::AcqRel) {
            return;
        }
        let tick = (self.agents.cfg.ttl() / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(gw) = weak.upgrade() else { return };
                gw.expire_agents();
                gw.reconcile_replicas();
            }
        });
    }

    /// The agents, for `GET /admin/v1/agents`.
    pub fn agents_view(&self) -> Vec<AgentView> {
        let now = Instant::now();
        let st = self.agents.state.lock();
        let mut out: Vec<AgentView> = st
            .iter()
            .map(|(id, a)| AgentView {
                agent_id: id.clone(),
                url: a.url.clone(),
                has_token: a.token.is_some(),
                last_seen_ms: a.last_seen_ms,
                age_ms: now.saturating_duration_since(a.last_seen).as_millis() as u64,
                models: a.models.clone(),
                engines: a
                    .engines
                    .iter()
                    .map(|(model, e)| {
                        let u = &e.upstream;
                        EngineView {
                            model: model.clone(),
                            name: u.name().to_string(),
                            upstream: u.cfg.url.clone(),
                            healthy: u.reported_healthy(),
                            up: u.is_up(),
                            breaker: match u.breaker.view() {
                                crate::upstream::BreakerView::Closed => "closed",
                                crate::upstream::BreakerView::HalfOpen => "half_open",
                                crate::upstream::BreakerView::Open => "open",
                            },
                            routable: !e.draining && u.is_routable(),
                            draining: e.draining,
                            active_requests: u.active.load(Ordering::Relaxed),
                        }
                    })
                    .collect(),
                weights: a
                    .weights
                    .iter()
                    .map(|(m, &r)| (m.clone(), ["ram", "disk", "none"][usize::from(r.min(2))]))
                    .collect(),
                checkpoints: {
                    let mut v: Vec<String> = a.checkpoints.iter().cloned().collect();
                    v.sort();
                    v
                },
                load_profile: a.profile.clone(),
                starting: a.starting,
            })
            .collect();
        out.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
        out
    }
}
