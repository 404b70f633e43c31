//! Loads on demand: which agent is asked (locality first), one load per
//! model at a time with every request for it waiting on that one, and the
//! new engine joining the upstream set from the load's answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use axum::http::StatusCode;
use tokio::sync::watch;

use super::estimate::{estimate, Estimate, LoadProfileReport};
use super::{check_http_url, Agent, Agents, Engine, EngineReport, LOAD_CALL_LIMIT, LOAD_RETRY_AFTER};
use crate::config::Placement;
use crate::error::{ApiError, ErrorType};
use crate::proxy::Gateway;

const TIER_NAMES: [&str; 3] = ["ram", "disk", "none"];

/// How good an agent is for a load, lower first: among the estimates
/// near the best ([`NEAR_BEST`]) or not, the estimate (whole ms; 0 among
/// the near ones), the weights' tier, whether it converts, the engines it
/// runs, its free memory (more first), then the estimate.
type PlacementRank = (bool, u64, u8, bool, usize, std::cmp::Reverse<u64>, u64);

/// Estimates within this much of the best (a fraction of it, plus
/// milliseconds) count as equal: they differ by less than what the
/// measurements behind them vary by, so the closer tier decides among them.
const NEAR_BEST: (f64, f64) = (0.2, 50.0);

/// A load in progress, as its waiters see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LoadState {
    Pending,
    Ready,
    Failed,
}

/// Loads one request waits on at most (see [`Gateway::load_model`]).
const LOAD_ROUNDS: usize = 3;

/// How long a request waits, after a load, for the engine to be routed.
const JOIN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
const JOIN_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Why a load was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoadWhy {
    /// A request for a model nobody serves.
    Request,
    /// Fewer engines than the model's `min_replicas`.
    MinReplicas,
    /// Its engines have more requests in flight each than `scale_out_active`.
    ScaleOut,
}

impl LoadWhy {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            LoadWhy::Request => "request",
            LoadWhy::MinReplicas => "min_replicas",
            LoadWhy::ScaleOut => "scale_out",
        }
    }
}

/// A request's place in the queue of a model being loaded; left when dropped.
struct Queued<'a> {
    agents: &'a Agents,
    model: String,
}

impl<'a> Queued<'a> {
    /// A place, unless `load_queue` requests already wait for `model` (0: no bound).
    fn join(agents: &'a Agents, model: &str) -> Option<Queued<'a>> {
        let mut q = agents.queued.lock();
        let n = q.entry(model.to_string()).or_insert(0);
        let bound = agents.cfg.load_queue;
        if bound > 0 && *n >= bound {
            return None;
        }
        *n += 1;
        Some(Queued { agents, model: model.to_string() })
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let mut q = self.agents.queued.lock();
        if let Some(n) = q.get_mut(&self.model) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                q.remove(&self.model);
            }
        }
    }
}

/// 503 with `Retry-After`: as many requests as `load_queue` already wait
/// for the model's load.
fn queue_full(model: &str, bound: usize) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::ServerError,
        "model_load_queue_full",
        format!(
            "The model `{model}` is being loaded and {bound} requests already wait for it ([gateway.agents] load_queue); try again shortly."
        ),
    )
    .retry_after(LOAD_RETRY_AFTER)
}

/// Where to ask for a load.
pub(super) struct LoadTarget {
    pub(super) agent_id: String,
    url: String,
    token: Option<String>,
    /// Its rank, for the placement header.
    pub(super) why: String,
    /// Where it holds the weights: 0 RAM, 1 disk, 2 elsewhere.
    pub(super) tier: u8,
    /// What a load there takes by the estimate, not counting the loads
    /// under way (which it will run beside, not after), ms.
    pub(super) estimate_ms: f64,
}

/// A load this gateway has under way on an agent, counted in the queue
/// term of the estimates for that agent until dropped.
pub(super) struct UnderwayLoad<'a> {
    agents: &'a Agents,
    agent_id: String,
    id: u64,
}

impl Drop for UnderwayLoad<'_> {
    fn drop(&mut self) {
        let mut u = self.agents.underway.lock();
        if let Some(list) = u.get_mut(&self.agent_id) {
            list.remove(self.id);
            if list.is_empty() {
                u.remove(&self.agent_id);
            }
        }
    }
}

impl Agents {
    /// Live agents listing `model`, best first: the lowest estimated time
    /// to first token of a load there ([`super::estimate`]), then the
    /// closer tier, a converted-weight checkpoint, fewest engines, most
    /// free memory (`placement = "fewest_engines"`: the estimate and the
    /// tier are not looked at).
    pub(super) fn load_targets(&self, model: &str) -> Vec<LoadTarget> {
        let now = Instant::now();
        let st = self.state.lock();
        let model_bytes = self.model_bytes.lock().get(model).copied().unwrap_or(0);
        let fleet_convert = self.convert_ms.lock().get(model).copied();
        let underway = self.underway.lock();
        let locality = self.cfg.placement == Placement::Locality;
        let live: Vec<(&String, &Agent)> = st.iter().filter(|(_, a)| self.live(a, now)).collect();
        let fleet = LoadProfileReport::median(live.iter().map(|(_, a)| &a.profile));
        let found: Vec<(Estimate, &String, &Agent)> = live
            .into_iter()
            .filter(|(_, a)| a.models.iter().any(|m| m == model))
            .map(|(id, a)| {
                let profile = a.profile.or(&fleet);
                let alone = estimate(a.held.get(model), &profile, model_bytes, fleet_convert, 0.0);
                // Loads under way there: this gateway's by what they have
                // left; others' (another replica's) each as long as this one.
                let mine = underway.get(id.as_str());
                let others = a.starting.saturating_sub(mine.map_or(0, |u| u.len()));
                let queue = mine.map_or(0.0, |u| u.left_ms(now)) + others as f64 * alone.alone();
                (Estimate { queue, ..alone }, id, a)
            })
            .collect();
        let best = found.iter().map(|(e, ..)| e.total()).fold(f64::INFINITY, f64::min);
        let near = best * (1.0 + NEAR_BEST.0) + NEAR_BEST.1;
        let mut found: Vec<(PlacementRank, Estimate, &String, &Agent)> = found
            .into_iter()
            .map(|(est, id, a)| {
                let held = a.held.get(model);
                let tier = held.map_or(2, |h| h.tier.min(2));
                let converts = held.is_none_or(|h| h.checkpoint.is_none());
                let total = est.total().round() as u64;
                let free = std::cmp::Reverse(a.free_memory);
                let rank = if !locality {
                    (false, 0, 0, false, a.engines.len(), free, 0)
                } else if est.total() <= near {
                    (false, 0, tier, converts, a.engines.len(), free, total)
                } else {
                    (true, total, tier, converts, a.engines.len(), free, total)
                };
                (rank, est, id, a)
            })
            .collect();
        found.sort_by(|x, y| x.0.cmp(&y.0).then(x.2.cmp(y.2)));
        found
            .into_iter()
            .map(|((.., engines, free, _), est, id, a)| {
                let tier = a.held.get(model).map_or(2, |h| h.tier.min(2));
                let checkpoint = if a.checkpoints.contains(model) { " + checkpoint" } else { "" };
                LoadTarget {
                    agent_id: id.clone(),
                    url: a.url.clone(),
                    token: a.token.clone(),
                    why: format!(
                        "{id} ({}; weights: {}{checkpoint}, {engines} engine(s), {} MiB free)",
                        est.describe(),
                        TIER_NAMES[tier as usize],
                        free.0 >> 20
                    ),
                    tier,
                    estimate_ms: est.alone(),
                }
            })
            .collect()
    }

    /// Counts a load on `t` in its agent's queue until the guard is dropped.
    pub(super) fn underway(&self, t: &LoadTarget) -> UnderwayLoad<'_> {
        let id = self.next_load.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.underway.lock().entry(t.agent_id.clone()).or_default().add(id, t.estimate_ms);
        UnderwayLoad { agents: self, agent_id: t.agent_id.clone(), id }
    }

    /// Whether `agent_id` runs an engine for `model` that takes requests
    /// (a draining one may be taken back by a load).
    pub(super) fn runs(&self, agent_id: &str, model: &str) -> bool {
        self.state.lock().get(agent_id).and_then(|a| a.engines.get(model)).is_some_and(|e| !e.draining)
    }

    /// Whether some agent runs an engine for `model` that takes requests.
    pub(super) fn runs_anywhere(&self, model: &str) -> bool {
        self.state.lock().values().any(|a| a.engines.get(model).is_some_and(|e| !e.draining))
    }

    /// Requests waiting for `model`'s load now.
    pub fn queued(&self, model: &str) -> usize {
        self.queued.lock().get(model).copied().unwrap_or(0)
    }

    /// Why the last successful load of `model` went where it did.
    pub fn placement(&self, model: &str) -> Option<String> {
        self.placements.lock().get(model).cloned()
    }

    /// Asks an agent to load `model`; the new engine's base URL and
    /// whether it publishes KV events (as its heartbeats will say).
    async fn call_load(&self, t: &LoadTarget, model: &str) -> anyhow::Result<(String, bool)> {
        let mut url = url::Url::parse(&t.url).context("the agent's url")?;
        url.path_segments_mut()
            .map_err(|_| anyhow::anyhow!("the agent's url cannot take a path"))?
            .pop_if_empty()
            .extend(["models", model, "load"]);
        let mut req =
            self.http.post(url).json(&serde_json::json!({})).timeout(LOAD_CALL_LIMIT.max(self.cfg.load_timeout()));
        if let Some(tok) = &t.token {
            req = req.bearer_auth(tok);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            let why = body["error"]["message"].as_str().unwrap_or("no error message");
            anyhow::bail!("the agent answered {status}: {why}");
        }
        let upstream = body["upstream"].as_str().context("no `upstream` in the agent's answer")?;
        check_http_url("upstream", upstream).map_err(|e| anyhow::anyhow!("the agent's answer: {}", e.message))?;
        Ok((upstream.to_string(), body["kv_events"].as_bool().unwrap_or(true)))
    }
}

/// Decrements a gauge when dropped (a waiting client may go away).
struct Waiting<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Gateway {
    /// Gets `model` loaded by an agent, waiting up to `load_timeout`: one
    /// load per model at a time, every request for it waiting on that one,
    /// at most `load_queue` of them. Errors are what the client gets: 503
    /// `model_load_queue_full` (the queue is full), `model_loading` (still
    /// loading when the wait ended) or `model_load_failed`, all with
    /// `Retry-After`.
    pub async fn load_model(self: &Arc<Self>, model: &str) -> Result<(), ApiError> {
        let failed = |m: &str| ApiError::model_load_failed(m, LOAD_RETRY_AFTER);
        // A place in the model's queue first: a full one turns the request
        // away at once rather than piling it up behind the load.
        let Some(_queued) = Queued::join(&self.agents, model) else {
            return Err(queue_full(model, self.agents.cfg.load_queue));
        };
        self.metrics.load_waiting.inc();
        let _waiting = Waiting(&self.metrics.load_waiting);
        let deadline = tokio::time::Instant::now() + self.agents.cfg.load_timeout();
        // The engine a load named may be out of routing again when the
        // request comes to route (a heartbeat its agent sent while draining
        // it, arriving after the load's answer): another load takes it back.
        for _ in 0..LOAD_ROUNDS {
            let mut rx = {
                let mut loads = self.agents.loads.lock();
                match loads.get(model) {
                    Some(rx) => rx.clone(),
                    None => {
                        // Loaded meanwhile?
                        if self.serves(model) {
                            return Ok(());
                        }
                        if let Some(at) = self.agents.failed.lock().get(model) {
                            if at.elapsed() < LOAD_RETRY_AFTER {
                                return Err(failed(model));
                            }
                        }
                        self.begin_load(&mut loads, model, LoadWhy::Request)
                    }
                }
            };
            let waited = tokio::time::timeout_at(deadline, rx.wait_for(|s| *s != LoadState::Pending))
                .await
                .map(|r| r.map(|state| *state == LoadState::Ready));
            match waited {
                Err(_) => return Err(ApiError::model_loading(model, LOAD_RETRY_AFTER)),
                Ok(Ok(true)) => {
                    if self.joined(model, deadline).await {
                        return Ok(());
                    }
                }
                Ok(_) => return Err(failed(model)),
            }
        }
        Err(ApiError::model_loading(model, LOAD_RETRY_AFTER))
    }

    /// Whether `model`'s engine joins routing soon after its load: the
    /// upstream is added with the load's answer and routed once its first
    /// health check passes, which may come a moment later.
    async fn joined(&self, model: &str, deadline: tokio::time::Instant) -> bool {
        let until = deadline.min(tokio::time::Instant::now() + JOIN_WAIT);
        loop {
            if self.serves(model) {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(JOIN_POLL).await;
        }
    }

    /// Starts a load of `model` (none may be in progress: `loads` holds the
    /// lock on the loads in progress) and returns what its waiters watch.
    pub(super) fn begin_load(
        self: &Arc<Self>,
        loads: &mut HashMap<String, watch::Receiver<LoadState>>,
        model: &str,
        why: LoadWhy,
    ) -> watch::Receiver<LoadState> {
        let (tx, rx) = watch::channel(LoadState::Pending);
        loads.insert(model.to_string(), rx.clone());
        tokio::spawn(self.clone().run_load(model.to_string(), why, tx));
        rx
    }

    async fn run_load(self: Arc<Self>, model: String, why: LoadWhy, tx: watch::Sender<LoadState>) {
        let label = vec![("model", self.metrics.model_label(Some(&model)))];
        self.metrics.load_requests.get_or_create(&label).inc();
        let started = Instant::now();
        if why == LoadWhy::Request && self.agents.runs_anywhere(&model) {
            // An engine for it runs already and takes requests (one that
            // just loaded and is not routed yet, or one a heartbeat named):
            // nothing to load, and not a failure; the waiters look again.
            self.agents.loads.lock().remove(&model);
            let _ = tx.send(LoadState::Ready);
            return;
        }
        let mut targets = self.agents.load_targets(&model);
        // Another replica goes to an agent that does not run one yet.
        targets.retain(|t| !self.agents.runs(&t.agent_id, &model));
        let mut ok = false;
        if targets.is_empty() {
            tracing::warn!(model = %model, "no live agent can load the model any more");
        }
        let ranked: Vec<String> = targets.iter().map(|t| t.why.clone()).collect();
        for (i, t) in targets.iter().enumerate() {
            tracing::info!(agent = %t.agent_id, model = %model, rank = %t.why, reason = why.as_str(), "asking the agent to load the model");
            let underway = self.agents.underway(t);
            let called = self.agents.call_load(t, &model).await;
            drop(underway);
            match called {
                Ok((upstream, kv_events)) => match self.engine_loaded(&t.agent_id, &model, &upstream, kv_events) {
                    Ok(()) => {
                        ok = true;
                        if t.tier == 0 && self.agents.prefetch_hit(&t.agent_id, &model) {
                            self.metrics.prefetch.get_or_create(&vec![("event", "hit".to_string())]).inc();
                        }
                        let mut why = format!("loaded on {}", t.why);
                        let others: Vec<&str> =
                            ranked.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, r)| r.as_str()).collect();
                        if !others.is_empty() {
                            why.push_str(&format!("; ranked after: {}", others.join(", ")));
                        }
                        self.agents.placements.lock().insert(model.clone(), why);
                        break;
                    }
                    Err(e) => tracing::warn!(agent = %t.agent_id, model = %model, error = %e, "load answer not usable"),
                },
                Err(e) => tracing::warn!(agent = %t.agent_id, model = %model, error = %format!("{e:#}"), "load failed"),
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let mut outcome = label.clone();
        outcome.push(("outcome", if ok { "succeeded" } else { "failed" }.to_string()));
        self.metrics.loads.get_or_create(&outcome).inc();
        if ok {
            self.metrics.load_seconds.get_or_create(&label).observe(secs);
            tracing::info!(model = %model, seconds = secs, "model loaded");
        }
        {
            let mut loads = self.agents.loads.lock();
            loads.remove(&model);
            let mut failed = self.agents.failed.lock();
            if ok {
                failed.remove(&model);
            } else if why != LoadWhy::Request {
                // A replica that could not be added: requests still have
                // the engines there are; the next try waits a while.
                self.agents.replica_failed.lock().insert(model.clone(), Instant::now());
            } else {
                failed.retain(|_, at| at.elapsed() < LOAD_RETRY_AFTER);
                failed.insert(model.clone(), Instant::now());
            }
        }
        let _ = tx.send(if ok { LoadState::Ready } else { LoadState::Failed });
    }

    /// An agent answered a load: its engine joins now rather than at the
    /// next heartbeat.
    pub(super) fn engine_loaded(
        &self,
        agent_id: &str,
        model: &str,
        upstream: &str,
        kv_events: bool,
    ) -> Result<(), ApiError> {
        let now = Instant::now();
        let mut changed = false;
        let result = {
            let mut st = self.agents.state.lock();
            let Some(agent) = st.get_mut(agent_id) else {
                return Err(ApiError::unavailable("The agent went away during the load."));
            };
            let report = EngineReport {
                model: model.to_string(),
                upstream: upstream.to_string(),
                healthy: true,
                max_active: 0,
                kv_events,
                draining: false,
            };
            match agent.engines.get(model) {
                Some(cur) if cur.upstream.cfg.url == upstream && !cur.draining => {
                    cur.upstream.set_reported_healthy(true);
                    Ok(())
                }
                other => {
                    if let Some(old) = other {
                        self.remove_upstream(old.upstream.id);
                    }
                    agent.engines.remove(model);
                    changed = true;
                    self.add_engine(agent_id, &report).map(|u| {
                        agent.engines.insert(
                            model.to_string(),
                            Engine { upstream: u, reported: false, added: now, draining: false },
                        );
                    })
                }
            }
        };
        if changed {
            self.rebuild();
        }
        result
    }
}
