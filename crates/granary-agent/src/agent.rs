//! The agent: turns "load this model" into weights in a tier and a healthy
//! engine, and keeps the gateway told.
//!
//! A load resolves the revision in the registry, fetches the files no tier
//! holds (in parallel, resumable, verified), counts the load for promotion
//! to RAM, lays the revision out as a directory of links and starts an
//! engine on it. One load per model runs at a time; a second caller waits
//! for the first and gets its answer. Background loops read each engine's
//! metrics (idle unload), demote idle RAM copies, refresh the registry's
//! model list and heartbeat to the gateway.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::AgentConfig;
use crate::download::{DownloadStatus, Downloader, FileRequest};
use crate::error::AgentError;
use crate::prefetch::{PrefetchStats, Prefetches};
use crate::profile::{EngineLoadStats, LoadProfile, StartSample};
use crate::registry::Catalog;
use crate::resources::{Reservation, Resources, ResourcesStatus};
use crate::supervisor::{EngineState, EngineStatus, LaunchSpec, Supervisor};
use crate::tiers::{Tier, Tiers, TiersStatus};
use crate::weights::{HeldRevision, Known};

/// `POST /models/{name}/load`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoadResponse {
    pub model: String,
    pub revision: String,
    pub upstream: String,
    pub state: EngineState,
    /// Where the weights came from: `registry` when anything was downloaded,
    /// else the slowest tier the engine reads from.
    pub tier: Tier,
    pub load_ms: u64,
    /// Of `load_ms`: downloading from the registry (0 when every file was in a tier).
    #[serde(default)]
    pub fetch_ms: u64,
    /// Of `load_ms`: from starting the engine's process until its first
    /// healthy `/health` (0 when it was already running).
    #[serde(default)]
    pub engine_ms: u64,
}

/// `GET /status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentStatus {
    pub agent_id: String,
    pub url: String,
    pub engines: Vec<EngineStatus>,
    pub tiers: TiersStatus,
    pub downloads: Vec<DownloadStatus>,
    /// GPUs and memory: totals, what this agent's engines hold, what is free.
    pub resources: ResourcesStatus,
    /// Each model revision laid out here and the tier its weights are in.
    #[serde(default)]
    pub weights: Vec<HeldRevision>,
    /// The answer of the last load that started each model's engine, by model name.
    #[serde(default)]
    pub loads: Vec<LoadResponse>,
    /// Prefetches a gateway asked for: started, done, failed, and loads
    /// that found their weights in RAM because of one.
    #[serde(default)]
    pub prefetch: PrefetchStats,
    /// How fast this node loads, as its loads measured it (what heartbeats
    /// report for placement).
    #[serde(default)]
    pub load_profile: crate::profile::ProfileReport,
}

/// One node's agent.
pub struct Agent {
    cfg: AgentConfig,
    agent_id: String,
    url: String,
    registry: Catalog,
    tiers: Tiers,
    downloader: Downloader,
    sup: Supervisor,
    resources: Resources,
    /// Revisions laid out here, for where their weights are.
    known: Known,
    /// How fast this node loads, learned from its loads.
    profile: LoadProfile,
    /// One load per model at a time.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One download per file at a time.
    fetching: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Model names the registry lists (reported to the gateway).
    catalog: Mutex<Vec<String>>,
    /// The last load that started each model's engine.
    last_loads: Mutex<HashMap<String, LoadResponse>>,
    /// Per gateway, the engines it last said to keep loaded (`min_replicas`).
    kept: Mutex<HashMap<String, Vec<String>>>,
    /// Models staged into RAM at a gateway's word.
    prefetches: Prefetches,
    stop: CancellationToken,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Model names and revisions become file and directory names: the
/// registry's naming rules (`[A-Za-z0-9][A-Za-z0-9._-]*`, at most 128 bytes)
/// apply here too, and `latest` is a revision.
pub fn check_name(field: &str, s: &str) -> Result<(), AgentError> {
    let checked = match field {
        "revision" if s == "latest" => Ok(()),
        "revision" => granary_registry::api::check_revision(s),
        _ => granary_registry::api::check_name(s),
    };
    checked.map_err(|why| AgentError::invalid(field, format!("Invalid `{field}`: {why}.")))
}

impl Agent {
    /// Opens the tiers, takes over engines an earlier run left, and starts
    /// the background loops. Call [`crate::api::serve`] to answer HTTP.
    pub async fn start(cfg: AgentConfig) -> Result<Arc<Agent>, AgentError> {
        cfg.validate().map_err(|m| AgentError::BadRequest { param: None, code: "invalid_config", message: m })?;
        std::fs::create_dir_all(&cfg.cache_dir)
            .map_err(|e| AgentError::io(format!("creating {}", cfg.cache_dir.display()), e))?;
        let tiers = Tiers::open(cfg.tiers.clone(), &cfg.cache_dir)?;
        let downloader = Downloader::new(cfg.download.clone())?;
        let sup = Supervisor::new(cfg.engines.clone(), &cfg.cache_dir)?;
        let resources = Resources::new(cfg.resources.clone())?;
        let registry = Catalog::new(&cfg.registry, cfg.registry_token.clone())?;
        let url = cfg.advertise.clone().unwrap_or_else(|| format!("http://{}", cfg.listen));
        let agent = Arc::new(Agent {
            agent_id: cfg.agent_id(),
            url,
            registry,
            tiers,
            downloader,
            sup,
            resources,
            known: Known::scan(&cfg.cache_dir.join("models")),
            profile: LoadProfile::open(cfg.cache_dir.join("load-profile.json")),
            loading: Mutex::new(HashMap::new()),
            fetching: Mutex::new(HashMap::new()),
            catalog: Mutex::new(Vec::new()),
            last_loads: Mutex::new(HashMap::new()),
            kept: Mutex::new(HashMap::new()),
            prefetches: Prefetches::default(),
            stop: CancellationToken::new(),
            cfg,
        });
        agent.recover().await;
        tokio::spawn(agent.clone().activity_loop());
        tokio::spawn(agent.clone().catalog_loop());
        if !agent.cfg.gateways.is_empty() {
            tokio::spawn(crate::heartbeat::run(agent.clone()));
        }
        Ok(agent)
    }

    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// The URL the gateway reaches this agent at.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn supervisor(&self) -> &Supervisor {
        &self.sup
    }

    pub fn tiers(&self) -> &Tiers {
        &self.tiers
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    pub fn prefetches(&self) -> &Prefetches {
        &self.prefetches
    }

    pub(crate) fn registry(&self) -> &Catalog {
        &self.registry
    }

    /// The lock one load (or staging) of `name` holds.
    pub(crate) fn load_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        Self::lock_for(&self.loading, name)
    }

    /// Each model revision laid out here, the tier its weights are in now,
    /// and what a start of it converted here last.
    pub fn weights(&self) -> Vec<HeldRevision> {
        let mut held = self.known.report(&self.tiers);
        for h in &mut held {
            h.convert_ms = self.profile.convert_ms(&h.model, &h.revision);
        }
        held
    }

    /// How fast this node loads, as measured so far.
    pub fn profile(&self) -> &LoadProfile {
        &self.profile
    }

    /// Model names the registry listed at the last refresh.
    pub fn catalog(&self) -> Vec<String> {
        self.catalog.lock().clone()
    }

    /// Records the engines `gateway` last said to keep loaded.
    pub(crate) fn set_kept(&self, gateway: &str, models: &[String]) {
        self.kept.lock().insert(gateway.to_string(), models.to_vec());
    }

    /// Some gateway needs `model`'s engine kept loaded (never unloaded for idleness).
    pub fn is_kept(&self, model: &str) -> bool {
        self.kept.lock().values().any(|ms| ms.iter().any(|m| m == model))
    }

    pub(crate) fn stopping(&self) -> &CancellationToken {
        &self.stop
    }

    /// Ends the background loops and leaves the engines running for the next
    /// agent to adopt.
    pub fn shutdown(&self) {
        self.stop.cancel();
        self.sup.detach();
    }

    /// Engines from the state file: adopted when still running, else loaded again.
    async fn recover(self: &Arc<Self>) {
        for p in self.sup.persisted() {
            if self.sup.adopt(&p).await {
                self.tiers.pin(&p.spec.files);
                self.resources.restore(&p.spec.model, p.spec.gpus.clone(), p.spec.memory);
                continue;
            }
            tracing::info!(model = %p.spec.model, pid = p.pid, "a recorded engine is gone; starting it again");
            let agent = self.clone();
            tokio::spawn(async move {
                if let Err(e) = agent.load(&p.spec.model, Some(&p.spec.revision)).await {
                    tracing::warn!(model = %p.spec.model, error = %e, "restarting a recorded engine failed");
                }
            });
        }
    }

    pub fn status(&self) -> AgentStatus {
        AgentStatus {
            agent_id: self.agent_id.clone(),
            url: self.url.clone(),
            engines: self.sup.list(),
            tiers: self.tiers.status(),
            downloads: self.downloader.downloads().snapshot(),
            resources: self.resources.status(),
            weights: self.weights(),
            loads: {
                let mut v: Vec<LoadResponse> = self.last_loads.lock().values().cloned().collect();
                v.sort_by(|a, b| a.model.cmp(&b.model));
                v
            },
            prefetch: self.prefetches.stats(),
            load_profile: self.profile.report(),
        }
    }

    fn lock_for(map: &Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        map.lock().entry(key.to_string()).or_default().clone()
    }

    /// Loads `name` at `revision` (default `latest`) and returns once its engine is healthy.
    pub async fn load(&self, name: &str, revision: Option<&str>) -> Result<LoadResponse, AgentError> {
        check_name("name", name)?;
        let rev = revision.unwrap_or("latest");
        check_name("revision", rev)?;
        let lock = Self::lock_for(&self.loading, name);
        let _one_at_a_time = lock.lock().await;
        let started = Instant::now();
        if let Some(st) = self.sup.status(name) {
            if st.draining && self.sup.set_draining(name, false) {
                // Requests came back before the idle unload: it stays.
                tracing::info!(model = name, "a load takes the draining engine back");
                self.sup.mark_active(name, now_ms());
            }
            if rev != "latest" && st.revision != rev {
                return Err(AgentError::Conflict(format!(
                    "`{name}` is loaded at revision {}; unload it before loading revision {rev}",
                    st.revision
                )));
            }
            let st = self.sup.ready(name, self.cfg.engines.start_timeout).await?;
            return Ok(LoadResponse {
                model: st.model,
                revision: st.revision,
                upstream: st.upstream,
                state: st.state,
                tier: st.tier,
                load_ms: started.elapsed().as_millis() as u64,
                fetch_ms: 0,
                engine_ms: 0,
            });
        }
        let revision = self.registry.revision(name, rev).await?;
        for f in &revision.files {
            granary_registry::api::check_file_path(&f.path)
                .map_err(|why| AgentError::Registry(format!("{name}@{}: {why}", revision.revision)))?;
        }
        // Admission before anything is downloaded: a model that cannot run
        // here costs no transfer.
        let held = self.resources.reserve(name, revision.size)?;
        let result = self.fetch_and_launch(name, &revision, held, started).await;
        if result.is_err() {
            self.resources.release(name);
        }
        result
    }

    async fn fetch_and_launch(
        &self,
        name: &str,
        revision: &crate::registry::Revision,
        held: Reservation,
        started: Instant,
    ) -> Result<LoadResponse, AgentError> {
        let shas: Vec<String> = revision.files.iter().map(|f| f.sha256.to_ascii_lowercase()).collect();
        let fetching = Instant::now();
        let downloaded = self.fetch_files(name, revision).await? > 0;
        let fetch_ms = if downloaded { fetching.elapsed().as_millis() as u64 } else { 0 };
        // A converted-weight checkpoint an engine left for this revision
        // is used and promoted with its weights.
        let root = self.cfg.cache_dir.join("models").join(name).join(&revision.revision);
        let with_checkpoints: Vec<String> = shas.iter().cloned().chain(self.tiers.checkpoint_shas(&root)).collect();
        self.tiers.touch(&with_checkpoints);
        if self.tiers.record_load(name) {
            self.tiers.promote(&with_checkpoints).await?;
        }
        self.tiers.pin(&shas);
        let result = self.launch(name, revision, &shas, downloaded, held).await;
        if result.is_err() {
            self.tiers.unpin(&shas);
        }
        let (st, engine_ms) = result?;
        if st.tier == Tier::Ram {
            self.prefetches.loaded_from_ram(name, &st.revision);
        }
        tracing::info!(model = name, revision = %st.revision, tier = st.tier.as_str(), ms = started.elapsed().as_millis() as u64, fetch_ms, engine_ms, "loaded");
        let answer = LoadResponse {
            model: st.model,
            revision: st.revision,
            upstream: st.upstream,
            state: st.state,
            tier: st.tier,
            load_ms: started.elapsed().as_millis() as u64,
            fetch_ms,
            engine_ms,
        };
        self.last_loads.lock().insert(name.to_string(), answer.clone());
        Ok(answer)
    }

    async fn launch(
        &self,
        name: &str,
        revision: &crate::registry::Revision,
        shas: &[String],
        downloaded: bool,
        held: Reservation,
    ) -> Result<(EngineStatus, u64), AgentError> {
        let (root, slowest) = self.lay_out(name, revision, shas)?;
        let model_path = model_path(name, revision, &root)?;
        let spec = LaunchSpec {
            model: name.to_string(),
            revision: revision.revision.clone(),
            model_path,
            files: shas.to_vec(),
            tier: if downloaded { Tier::Registry } else { slowest },
            gpus: held.gpus,
            memory: held.memory,
        };
        let weights_tier = spec.tier;
        let checkpoint_tier = self.tiers.checkpoint_shas(&root).iter().filter_map(|s| self.tiers.locate(s)).min();
        // The engine's load stats are the lines its log gains from here on.
        let log = self.sup.log_path(name);
        let log_from = std::fs::metadata(&log).map_or(0, |m| m.len());
        let started = Instant::now();
        let st = self.sup.start(spec).await?;
        let ready = started.elapsed();
        self.profile.record_start(&StartSample {
            model: name.to_string(),
            revision: revision.revision.clone(),
            weights_tier,
            checkpoint_tier,
            weights_bytes: revision.size,
            ready,
            stats: EngineLoadStats::read_log(&log, log_from),
        });
        Ok((st, ready.as_millis() as u64))
    }

    /// Lays `revision` out as links into the tiers (what an engine opens,
    /// and how a restarted agent finds it); its directory and slowest tier.
    pub(crate) fn lay_out(
        &self,
        name: &str,
        revision: &crate::registry::Revision,
        shas: &[String],
    ) -> Result<(PathBuf, Tier), AgentError> {
        let root = self.cfg.cache_dir.join("models").join(name).join(&revision.revision);
        let files: Vec<(String, String)> =
            revision.files.iter().zip(shas).map(|(f, s)| (f.path.clone(), s.clone())).collect();
        let slowest = self.tiers.materialise(&root, &files)?;
        self.known.record(name, &revision.revision, shas);
        Ok((root, slowest))
    }

    /// Fetches every file of `revision` no tier holds; the bytes downloaded
    /// (their rate is learned for placement).
    pub(crate) async fn fetch_files(
        &self,
        name: &str,
        revision: &crate::registry::Revision,
    ) -> Result<u64, AgentError> {
        let started = Instant::now();
        let jobs = revision.files.iter().map(|f| async move {
            let sha = f.sha256.to_ascii_lowercase();
            let lock = Self::lock_for(&self.fetching, &sha);
            let _one = lock.lock().await;
            if self.tiers.locate(&sha).is_some() {
                return Ok(0);
            }
            let (url, bearer) = self.registry.file_source(name, &revision.revision, &f.path).await?;
            let dest = self.tiers.begin_download(&sha, f.size, &f.path)?;
            let req = FileRequest { url, bearer, size: f.size, sha256: sha.clone(), label: f.path.clone() };
            let r = self.downloader.fetch(&req, &dest).await;
            self.tiers.end_download(&sha, r.is_ok());
            let stats = r?;
            tracing::info!(file = %f.path, bytes = stats.bytes, resumed = stats.resumed_bytes, requests = stats.requests, "downloaded");
            Ok::<u64, AgentError>(stats.bytes)
        });
        let results = futures::future::join_all(jobs).await;
        let mut bytes = 0;
        for r in results {
            bytes += r?;
        }
        self.profile.record_download(bytes, started.elapsed());
        Ok(bytes)
    }

    /// Stops `name`'s engine, once the gateways route nothing more to it
    /// and its requests have finished (see [`crate::drain`]).
    pub async fn unload(&self, name: &str) -> Result<(), AgentError> {
        check_name("name", name)?;
        let lock = Self::lock_for(&self.loading, name);
        let _one_at_a_time = lock.lock().await;
        self.drain_before_unload(name).await;
        self.stop_engine(name).await
    }

    /// Stops `name`'s drained engine unless a load took it back meanwhile;
    /// whether it was stopped.
    pub(crate) async fn unload_drained(&self, name: &str) -> Result<bool, AgentError> {
        let lock = Self::lock_for(&self.loading, name);
        let _one_at_a_time = lock.lock().await;
        if !self.sup.is_draining(name) {
            return Ok(false);
        }
        self.stop_engine(name).await.map(|()| true)
    }

    async fn stop_engine(&self, name: &str) -> Result<(), AgentError> {
        let spec = self.sup.stop(name).await?;
        self.tiers.unpin(&spec.files);
        self.resources.release(name);
        tracing::info!(model = name, "unloaded");
        Ok(())
    }

    /// Takes the checkpoints ready engines wrote beside their weights into
    /// the disk tier.
    async fn adopt_checkpoints(self: &Arc<Self>) {
        for st in self.sup.list() {
            if st.state != EngineState::Ready {
                continue;
            }
            let root = self.cfg.cache_dir.join("models").join(&st.model).join(&st.revision);
            let has_file = std::fs::read_dir(&root).into_iter().flatten().flatten().any(|e| {
                crate::tiers::is_checkpoint_name(&e.file_name().to_string_lossy())
                    && e.file_type().is_ok_and(|t| t.is_file())
            });
            if has_file {
                let me = self.clone();
                let _ = tokio::task::spawn_blocking(move || me.tiers.adopt_checkpoints(&root)).await;
            }
        }
    }

    /// Reads each ready engine's metrics for activity, unloads idle ones,
    /// demotes idle RAM copies, keeps engines' new checkpoints.
    async fn activity_loop(self: Arc<Self>) {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(3)).build().expect("an HTTP client");
        let mut seen: HashMap<String, f64> = HashMap::new();
        let mut warned: std::collections::HashSet<String> = Default::default();
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(self.cfg.idle_poll) => {}
            }
            self.tiers.demote_idle();
            self.adopt_checkpoints().await;
            for st in self.sup.list() {
                if st.state != EngineState::Ready || st.draining {
                    continue;
                }
                let now = now_ms();
                if let Some(front) = self.sup.front_stats(&st.model) {
                    // Requests seen by the engine's front: in flight now, or
                    // the last one's end.
                    if front.in_flight() > 0 {
                        self.sup.mark_active(&st.model, now);
                    } else if front.last_activity_ms() > 0 {
                        self.sup.mark_active(&st.model, front.last_activity_ms());
                    }
                    self.unload_if_idle(&st.model, now, &mut seen).await;
                    continue;
                }
                let text = match http.get(format!("{}/metrics", st.upstream)).send().await {
                    Ok(r) if r.status().is_success() => r.text().await.unwrap_or_default(),
                    _ => continue,
                };
                let Some(a) = crate::activity::parse(&text) else {
                    if warned.insert(st.model.clone()) && self.cfg.idle_unload.is_some() {
                        tracing::warn!(model = %st.model, "its metrics show no known request series; it is never unloaded for idleness");
                    }
                    continue;
                };
                // A first scrape that already counts requests saw them since
                // the engine started (or since this agent adopted it): they
                // are activity too, or a request served before the first
                // scrape would go unnoticed.
                let moved = match seen.insert(st.model.clone(), a.requests) {
                    Some(before) => before != a.requests,
                    None => a.requests > 0.0,
                };
                if moved || a.in_flight > 0.0 {
                    self.sup.mark_active(&st.model, now);
                }
                self.unload_if_idle(&st.model, now, &mut seen).await;
            }
        }
    }

    /// Unloads `model` when it has been idle for `idle_unload` and no
    /// gateway keeps it: drained first ([`crate::drain`]), in the background.
    async fn unload_if_idle(self: &Arc<Self>, model: &str, now: u64, seen: &mut HashMap<String, f64>) {
        let Some(idle) = self.cfg.idle_unload else { return };
        let last = self.sup.last_active_ms(model).unwrap_or(now);
        if now.saturating_sub(last) >= idle.as_millis() as u64 && !self.is_kept(model) {
            tracing::info!(model, idle_ms = now.saturating_sub(last), "unloading an idle model");
            seen.remove(model);
            self.start_drain(model);
        }
    }

    async fn catalog_loop(self: Arc<Self>) {
        loop {
            match self.registry.names().await {
                Ok(names) => {
                    let moved = *self.catalog.lock() != names;
                    *self.catalog.lock() = names;
                    if moved {
                        self.sup.notify_changed();
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot list the registry's models"),
            }
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(self.cfg.catalog_refresh) => {}
            }
        }
    }
}

/// What an engine opens of a revision laid out at `root`: its `.gguf` file,
/// or the directory.
pub(crate) fn model_path(
    name: &str,
    revision: &crate::registry::Revision,
    root: &std::path::Path,
) -> Result<PathBuf, AgentError> {
    Ok(match revision.format.as_str() {
        "gguf" => {
            let f = revision.files.iter().find(|f| f.path.ends_with(".gguf")).ok_or_else(|| {
                AgentError::Registry(format!("{name}@{}: format gguf but no .gguf file", revision.revision))
            })?;
            root.join(&f.path)
        }
        _ => root.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain() {
        check_name("name", "SmolLM2-135M-Instruct").unwrap();
        check_name("revision", "0.1.2").unwrap();
        check_name("revision", "latest").unwrap();
        for bad in ["", "..", ".hidden", "a/b", "a b", &"x".repeat(129)] {
            let e = check_name("name", bad).unwrap_err();
            assert_eq!(e.body()["error"]["param"], "name", "{bad:?}");
        }
    }
}
