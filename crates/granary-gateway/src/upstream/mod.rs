//! Upstream engines: their HTTP client, health, circuit breaker, the models
//! they serve, the KV layout they hash blocks with, and the KV events they
//! publish (fed into the shared [`KvIndex`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use futures::StreamExt;
use granary_core::hash::{HashChain, KvLayout};
use parking_lot::{Mutex, RwLock};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::config::{BreakerConfig, GatewaySection, Role, UpstreamConfig, UpstreamTls};
use crate::metrics::GatewayMetrics;
use crate::routing::{KvEventMsg, KvIndex};
use crate::sse::SseParser;

mod wire;

pub use wire::{Answer, BodyError, BodyStream, PlainWire, SendError};

/// The paths of the generation endpoints, the requests' hot path.
const GENERATION_PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// A circuit breaker: closed (traffic flows), open (none, until a pause
/// passes), half-open (one probe decides).
#[derive(Debug)]
pub struct Breaker {
    cfg: BreakerConfig,
    state: Mutex<BreakerState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BreakerState {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probing: bool },
}

/// The breaker's state as exported (0 closed, 1 half-open, 2 open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerView {
    Closed = 0,
    HalfOpen = 1,
    Open = 2,
}

impl Breaker {
    pub fn new(cfg: BreakerConfig) -> Self {
        Breaker { cfg, state: Mutex::new(BreakerState::Closed { failures: 0 }) }
    }

    /// Whether a request may go to this upstream now. In half-open, the
    /// first caller becomes the probe and the others are refused.
    pub fn allow(&self) -> bool {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> bool {
        let mut s = self.state.lock();
        match *s {
            BreakerState::Closed { .. } => true,
            BreakerState::Open { until } if now >= until => {
                *s = BreakerState::HalfOpen { probing: true };
                true
            }
            BreakerState::Open { .. } => false,
            BreakerState::HalfOpen { probing: false } => {
                *s = BreakerState::HalfOpen { probing: true };
                true
            }
            BreakerState::HalfOpen { probing: true } => false,
        }
    }

    /// Whether a request could be sent now (without claiming the probe).
    pub fn is_available(&self) -> bool {
        match *self.state.lock() {
            BreakerState::Closed { .. } | BreakerState::HalfOpen { probing: false } => true,
            BreakerState::Open { until } => Instant::now() >= until,
            BreakerState::HalfOpen { probing: true } => false,
        }
    }

    pub fn success(&self) {
        *self.state.lock() = BreakerState::Closed { failures: 0 };
    }

    pub fn failure(&self) {
        self.failure_at(Instant::now())
    }

    fn failure_at(&self, now: Instant) {
        let mut s = self.state.lock();
        let open = BreakerState::Open { until: now + Duration::from_millis(self.cfg.open_ms) };
        *s = match *s {
            BreakerState::Closed { failures } if failures + 1 >= self.cfg.failures => open,
            BreakerState::Closed { failures } => BreakerState::Closed { failures: failures + 1 },
            BreakerState::HalfOpen { .. } => open,
            BreakerState::Open { until } => BreakerState::Open { until },
        };
    }

    /// A health check failed: counts like a failed request.
    pub fn health_failed(&self) {
        self.failure()
    }

    /// A health check passed: closes an open breaker once its pause is over
    /// (the check was the probe), so traffic returns without risking a
    /// client request on a dead upstream.
    pub fn health_passed(&self) {
        let mut s = self.state.lock();
        match *s {
            BreakerState::Open { until } if Instant::now() < until => {}
            _ => *s = BreakerState::Closed { failures: 0 },
        }
    }

    pub fn view(&self) -> BreakerView {
        match *self.state.lock() {
            BreakerState::Closed { .. } => BreakerView::Closed,
            BreakerState::HalfOpen { .. } => BreakerView::HalfOpen,
            BreakerState::Open { .. } => BreakerView::Open,
        }
    }
}

/// How an upstream names KV blocks (`GET /v1/kv/config` on a Granary engine).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct KvInfo {
    pub model: String,
    pub fingerprint: String,
    pub layout: KvLayout,
    #[serde(default)]
    pub role: Option<String>,
}

impl KvInfo {
    pub fn chain(&self, namespace: &str) -> HashChain {
        HashChain::for_layout(namespace, self.fingerprint.as_bytes(), &self.layout)
    }
}

/// Where an upstream came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// An `[[upstream]]` section or `--upstream` flag: there for the gateway's life.
    Config,
    /// An engine a node agent reported (or loaded on request); it leaves when
    /// the agent's report drops it or the agent stops reporting.
    Agent { agent_id: String, model: String },
}

/// One upstream engine.
pub struct Upstream {
    /// A number unique for the gateway's life, never reused after the
    /// upstream leaves: the key of its KV index entries and routing state.
    pub id: usize,
    pub cfg: UpstreamConfig,
    pub origin: Origin,
    pub client: reqwest::Client,
    /// `Authorization` value for requests to it, from `api_key_env`.
    pub auth: Option<String>,
    pub breaker: Breaker,
    pub active: AtomicUsize,
    up: AtomicBool,
    checked: AtomicBool,
    /// What its agent last said of its health (configured upstreams: always true).
    reported_healthy: AtomicBool,
    /// Left the upstream set: its metric series are gone and stay gone.
    removed: AtomicBool,
    /// Answered `GET /v1/kv/config` like a Granary engine (for `granary` absent).
    granary_detected: AtomicBool,
    /// Stops its health checker and KV event follower.
    stop: CancellationToken,
    models: RwLock<Vec<String>>,
    kv: RwLock<Option<KvInfo>>,
    metrics: Arc<GatewayMetrics>,
    /// The generation endpoints' URLs, parsed once (not per request).
    generation_urls: Vec<(&'static str, reqwest::Url)>,
    /// `auth` as a header value, built once (marked sensitive).
    auth_header: Option<axum::http::HeaderValue>,
    /// The plain HTTP pool for generation requests (`http://` upstreams).
    plain: Option<wire::PlainWire>,
    /// Its metric series, looked up once (and again after any series was
    /// removed: one of the same name may have gone with another upstream).
    series: Mutex<Option<(u64, Arc<Series>)>>,
}

/// An upstream's metric series (labelled with its name).
struct Series {
    up: prometheus_client::metrics::gauge::Gauge,
    breaker: prometheus_client::metrics::gauge::Gauge,
    active: prometheus_client::metrics::gauge::Gauge,
    /// One per [`OUTCOMES`] entry, in that order, made at its first use.
    attempts: [std::sync::OnceLock<prometheus_client::metrics::counter::Counter>; OUTCOMES.len()],
}

/// Attempt outcomes, as counted in `granary_gateway_upstream_attempts_total`.
const OUTCOMES: [&str; 6] = ["ok", "connect_error", "timeout", "status_5xx", "status_4xx", "bad_response"];

impl Upstream {
    fn build(
        id: usize,
        cfg: UpstreamConfig,
        origin: Origin,
        section: &GatewaySection,
        metrics: Arc<GatewayMetrics>,
        stop: CancellationToken,
    ) -> Result<Upstream> {
        let auth = match &cfg.api_key_env {
            Some(var) => Some(format!(
                "Bearer {}",
                std::env::var(var)
                    .with_context(|| format!("upstream {}: environment variable {var} is not set", cfg.name))?
            )),
            None => None,
        };
        let client = build_client(section, cfg.tls.as_ref()).with_context(|| format!("upstream {}", cfg.name))?;
        for m in &cfg.models {
            metrics.know_model(m);
        }
        let base = cfg.url.trim_end_matches('/');
        let generation_urls = GENERATION_PATHS
            .into_iter()
            .filter_map(|p| Some((p, reqwest::Url::parse(&format!("{base}{p}")).ok()?)))
            .collect();
        let plain = wire::PlainWire::new(base, &GENERATION_PATHS, section.connect_timeout());
        let auth_header = match &auth {
            Some(a) => {
                let mut v = axum::http::HeaderValue::from_str(a)
                    .with_context(|| format!("upstream {}: the API key is not a valid header value", cfg.name))?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let u = Upstream {
            generation_urls,
            auth_header,
            plain,
            series: Mutex::new(None),
            id,
            client,
            auth,
            origin,
            breaker: Breaker::new(section.breaker.clone()),
            active: AtomicUsize::new(0),
            up: AtomicBool::new(false),
            checked: AtomicBool::new(false),
            reported_healthy: AtomicBool::new(true),
            removed: AtomicBool::new(false),
            granary_detected: AtomicBool::new(false),
            stop,
            models: RwLock::new(cfg.models.clone()),
            kv: RwLock::new(None),
            metrics,
            cfg,
        };
        u.export();
        Ok(u)
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    /// The parsed URL of a generation endpoint (`None`: another path, or a
    /// base URL that does not parse).
    pub fn generation_url(&self, path: &str) -> Option<reqwest::Url> {
        self.generation_urls.iter().find(|(p, _)| *p == path).map(|(_, u)| u.clone())
    }

    /// POSTs `payload` to `path` with `headers` (the API key is added);
    /// the answer's body is left to read.
    pub async fn post(
        &self,
        path: &str,
        mut headers: axum::http::HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<Answer, SendError> {
        if let Some(v) = &self.auth_header {
            headers.insert(axum::http::header::AUTHORIZATION, v.clone());
        }
        if let Some((w, uri)) = self.plain.as_ref().and_then(|w| Some((w, w.uri(path)?))) {
            return w.post(uri, headers, payload).await;
        }
        let url = match self.generation_url(path) {
            Some(u) => u,
            None => reqwest::Url::parse(&self.url(path)).map_err(|e| SendError::Other(format!("bad URL: {e}")))?,
        };
        wire::post_reqwest(&self.client, url, headers, payload).await
    }

    /// `base/path` (path starting with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.cfg.url.trim_end_matches('/'))
    }

    /// Passed its last health check (true until the first check ran).
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed) || !self.checked.load(Ordering::Relaxed)
    }

    /// Can take a request now: up, reported healthy by its agent (if it has
    /// one), and the breaker lets traffic through.
    pub fn is_routable(&self) -> bool {
        self.reported_healthy() && self.is_up() && self.breaker.is_available()
    }

    /// What its agent last reported (configured upstreams: true).
    pub fn reported_healthy(&self) -> bool {
        self.reported_healthy.load(Ordering::Relaxed)
    }

    pub fn set_reported_healthy(&self, healthy: bool) {
        let was = self.reported_healthy.swap(healthy, Ordering::Relaxed);
        if was != healthy {
            tracing::info!(upstream = %self.cfg.name, healthy, "agent reports the engine's health");
        }
    }

    /// Still in the upstream set.
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::SeqCst)
    }

    /// Whether it serves `model` (a client's name): it lists the name, or
    /// the name `model_map` gives it for this upstream.
    pub fn serves(&self, model: &str) -> bool {
        let mapped = self.cfg.model_map.get(model);
        self.models.read().iter().any(|m| m == model || mapped == Some(m))
    }

    /// The models it serves, by the names clients use (`model_map` applied
    /// backwards).
    pub fn models(&self) -> Vec<String> {
        self.models
            .read()
            .iter()
            .map(|m| match self.cfg.model_map.iter().find(|(_, to)| *to == m) {
                Some((from, _)) => from.clone(),
                None => m.clone(),
            })
            .collect()
    }

    /// The name of `model` (a client's name) as this upstream knows it.
    pub fn wire_model<'a>(&'a self, model: &'a str) -> &'a str {
        self.cfg.model_map.get(model).map(String::as_str).unwrap_or(model)
    }

    /// A Granary engine: configured as one, or (when not configured either
    /// way) detected as one. Only these get Granary headers and are asked
    /// for KV layouts, events and tokenizers.
    pub fn is_granary(&self) -> bool {
        self.cfg.granary.unwrap_or_else(|| self.granary_detected.load(Ordering::Relaxed))
    }

    /// Passive health only: no probe, the breaker alone decides.
    pub fn passive_health(&self) -> bool {
        self.cfg.health_path.is_empty()
    }

    /// A GET to this upstream, with its API key when it has one.
    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let req = self.client.get(self.url(path));
        match &self.auth {
            Some(a) => req.header(reqwest::header::AUTHORIZATION, a),
            None => req,
        }
    }

    /// Its KV events feed the index: a Granary engine's over HTTP (once its
    /// layout is known), or vLLM's over ZeroMQ.
    pub fn publishes_events(&self) -> bool {
        self.cfg.kv_events_zmq.is_some() || (self.cfg.kv_events && self.kv_info().is_some())
    }

    pub fn kv_info(&self) -> Option<KvInfo> {
        self.kv.read().clone()
    }

    pub fn role(&self) -> Role {
        self.cfg.role
    }

    fn labels(&self) -> Vec<(&'static str, String)> {
        vec![("upstream", self.cfg.name.clone())]
    }

    /// Its metric series (see [`Upstream::series`]'s field).
    fn series(&self) -> Arc<Series> {
        let now = self.metrics.removals();
        let mut kept = self.series.lock();
        if let Some((at, series)) = &*kept {
            if *at == now {
                return series.clone();
            }
        }
        let m = &self.metrics;
        let labels = self.labels();
        let series = Arc::new(Series {
            up: m.upstream_up.get_or_create(&labels).clone(),
            breaker: m.breaker_state.get_or_create(&labels).clone(),
            active: m.upstream_active.get_or_create(&labels).clone(),
            attempts: Default::default(),
        });
        *kept = Some((now, series.clone()));
        series
    }

    /// Publishes health, breaker and load gauges (nothing once removed, so
    /// a request finishing late does not bring its series back).
    pub fn export(&self) {
        if self.is_removed() {
            return;
        }
        let s = self.series();
        s.up.set(i64::from(self.up.load(Ordering::Relaxed)));
        s.breaker.set(self.breaker.view() as i64);
        s.active.set(self.active.load(Ordering::Relaxed) as i64);
    }

    /// Counts an attempt's outcome (`ok`, `connect_error`, `timeout`, `status_5xx`, `status_4xx`, `bad_response`).
    pub fn attempt(&self, outcome: &'static str) {
        if self.is_removed() {
            return;
        }
        match OUTCOMES.iter().position(|o| *o == outcome) {
            Some(i) => {
                let labels = || vec![("upstream", self.cfg.name.clone()), ("outcome", outcome.to_string())];
                self.series().attempts[i].get_or_init(|| self.metrics.attempts.get_or_create(&labels()).clone()).inc();
            }
            None => {
                self.metrics
                    .attempts
                    .get_or_create(&vec![("upstream", self.cfg.name.clone()), ("outcome", outcome.into())])
                    .inc();
            }
        }
    }

    /// Drops its metric series (it left the set).
    fn unexport(&self) {
        let labels = self.labels();
        self.metrics.upstream_up.remove(&labels);
        self.metrics.breaker_state.remove(&labels);
        self.metrics.upstream_active.remove(&labels);
        for outcome in OUTCOMES {
            self.metrics.attempts.remove(&vec![("upstream", self.cfg.name.clone()), ("outcome", outcome.to_string())]);
        }
        self.metrics.removed();
    }

    /// Takes a slot if the upstream has room (`max_active` 0: unbounded).
    pub fn try_acquire(self: &Arc<Self>) -> Option<Slot> {
        let max = self.cfg.max_active;
        let mut cur = self.active.load(Ordering::Relaxed);
        loop {
            if max > 0 && cur >= max {
                return None;
            }
            // Sequentially consistent with `removed`: a drain that reads
            // no request in flight after taking the upstream out of routing
            // is sure that any slot taken later sees it removed and gives
            // the slot back (the request is routed again), so an engine is
            // never stopped under a request that was about to be sent.
            match self.active.compare_exchange_weak(cur, cur + 1, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => {
                    if self.removed.load(Ordering::SeqCst) {
                        self.active.fetch_sub(1, Ordering::SeqCst);
                        return None;
                    }
                    self.export();
                    return Some(Slot { upstream: self.clone(), on_release: None });
                }
                Err(now) => cur = now,
            }
        }
    }

    pub fn has_room(&self) -> bool {
        self.cfg.max_active == 0 || self.active.load(Ordering::Relaxed) < self.cfg.max_active
    }

    async fn check_health(&self, timeout: Duration) -> bool {
        if self.passive_health() {
            return true;
        }
        let res = self.get(&self.cfg.health_path).timeout(timeout).send().await;
        matches!(res, Ok(r) if r.status().is_success())
    }

    async fn refresh_models(&self, timeout: Duration) -> Result<()> {
        #[derive(Deserialize)]
        struct List {
            data: Vec<Item>,
        }
        #[derive(Deserialize)]
        struct Item {
            id: String,
        }
        if !self.cfg.models.is_empty() {
            *self.models.write() = self.cfg.models.clone();
        } else {
            let req = self.get("/v1/models").timeout(timeout);
            let list: List = req.send().await?.error_for_status()?.json().await?;
            *self.models.write() = list.data.into_iter().map(|i| i.id).collect();
        }
        for m in self.models.read().iter() {
            self.metrics.know_model(m);
        }
        // Only a Granary engine has a KV layout; one configured as not
        // being one is never asked.
        if self.cfg.granary != Some(false) {
            let info: Option<KvInfo> = match self.get("/v1/kv/config").timeout(timeout).send().await {
                Ok(r) if r.status().is_success() => r.json().await.ok(),
                _ => None,
            };
            self.granary_detected.store(info.is_some(), Ordering::Relaxed);
            if self.cfg.kv_events {
                *self.kv.write() = info;
            }
        }
        Ok(())
    }
}

/// A request slot on an upstream, released when dropped.
pub struct Slot {
    pub upstream: Arc<Upstream>,
    on_release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Slot {
    /// Runs `f` after the slot is released (wakes queued requests).
    pub fn on_release(mut self, f: impl FnOnce() + Send + Sync + 'static) -> Self {
        self.on_release = Some(Box::new(f));
        self
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.upstream.active.fetch_sub(1, Ordering::AcqRel);
        self.upstream.export();
        if let Some(f) = self.on_release.take() {
            f();
        }
    }
}

/// Every upstream, plus the tasks that watch them.
///
/// The set changes at runtime (agents' engines come and go), so readers
/// take a snapshot ([`Upstreams::list`]): an `Arc` of the current list,
/// swapped whole on each change, read without locking. Changes are rare and
/// serialised; each replaces the list.
pub struct Upstreams {
    current: ArcSwap<Vec<Arc<Upstream>>>,
    pub index: Arc<KvIndex>,
    metrics: Arc<GatewayMetrics>,
    section: GatewaySection,
    next_id: AtomicUsize,
    /// Parent of every upstream's own stop token.
    stop: CancellationToken,
    changes: Mutex<()>,
}

fn build_client(section: &GatewaySection, tls: Option<&UpstreamTls>) -> Result<reqwest::Client> {
    let mut b = reqwest::Client::builder()
        .connect_timeout(section.connect_timeout())
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true);
    if let Some(t) = tls {
        let ca = std::fs::read(&t.ca).with_context(|| format!("reading upstream CA {}", t.ca.display()))?;
        b = b.add_root_certificate(reqwest::Certificate::from_pem(&ca).context("parsing upstream CA")?);
        if let (Some(cert), Some(key)) = (&t.cert, &t.key) {
            let mut pem = read(cert)?;
            pem.extend_from_slice(&read(key)?);
            b = b.identity(reqwest::Identity::from_pem(&pem).context("parsing the gateway's client certificate")?);
        }
    }
    Ok(b.build()?)
}

fn read(p: &Path) -> Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading {}", p.display()))
}

impl Upstreams {
    pub fn new(section: &GatewaySection, configs: &[UpstreamConfig], metrics: Arc<GatewayMetrics>) -> Result<Self> {
        let stop = CancellationToken::new();
        let mut list = Vec::with_capacity(configs.len());
        for (id, cfg) in configs.iter().enumerate() {
            let u = Upstream::build(id, cfg.clone(), Origin::Config, section, metrics.clone(), stop.child_token())?;
            list.push(Arc::new(u));
        }
        Ok(Upstreams {
            next_id: AtomicUsize::new(list.len()),
            current: ArcSwap::from_pointee(list),
            index: Arc::new(KvIndex::new()),
            metrics,
            section: section.clone(),
            stop,
            changes: Mutex::new(()),
        })
    }

    /// The current set (a snapshot: later changes do not show in it).
    pub fn list(&self) -> Arc<Vec<Arc<Upstream>>> {
        self.current.load_full()
    }

    pub fn by_name(&self, name: &str) -> Option<Arc<Upstream>> {
        self.current.load().iter().find(|u| u.cfg.name == name).cloned()
    }

    pub fn by_id(&self, id: usize) -> Option<Arc<Upstream>> {
        self.current.load().iter().find(|u| u.id == id).cloned()
    }

    /// Adds an upstream at runtime and starts watching it (health checks
    /// from now, KV events); it is routable until a check says otherwise.
    /// Its name must not be taken.
    pub fn add(&self, cfg: UpstreamConfig, origin: Origin) -> Result<Arc<Upstream>> {
        let _g = self.changes.lock();
        let cur = self.current.load_full();
        anyhow::ensure!(!cur.iter().any(|u| u.cfg.name == cfg.name), "upstream {} already exists", cfg.name);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let u =
            Arc::new(Upstream::build(id, cfg, origin, &self.section, self.metrics.clone(), self.stop.child_token())?);
        let mut next = Vec::with_capacity(cur.len() + 1);
        next.extend(cur.iter().cloned());
        next.push(u.clone());
        self.current.store(Arc::new(next));
        self.watch(&u, &self.section, Duration::ZERO);
        tracing::info!(upstream = %u.cfg.name, url = %u.cfg.url, "upstream added");
        Ok(u)
    }

    /// Takes an upstream out of the set: its watchers stop, what the KV
    /// index knew of it is forgotten, its metric series go. Requests already
    /// on it finish.
    pub fn remove(&self, id: usize) -> Option<Arc<Upstream>> {
        let _g = self.changes.lock();
        let cur = self.current.load_full();
        let gone = cur.iter().find(|u| u.id == id)?.clone();
        let next: Vec<Arc<Upstream>> = cur.iter().filter(|u| u.id != id).cloned().collect();
        self.current.store(Arc::new(next));
        gone.removed.store(true, Ordering::SeqCst);
        gone.stop.cancel();
        self.index.forget(id);
        self.metrics.kv_index_blocks.set(self.index.total_blocks() as i64);
        gone.unexport();
        tracing::info!(upstream = %gone.cfg.name, "upstream removed");
        Some(gone)
    }

    /// Checks every upstream once (models, KV config, health), so the
    /// gateway starts knowing what it can route.
    pub async fn probe_all(&self, section: &GatewaySection) {
        let timeout = Duration::from_millis(section.health.timeout_ms);
        let list = self.list();
        futures::future::join_all(list.iter().map(|u| async move {
            let ok = u.check_health(timeout).await;
            // Passive health: never marked down by a check (there is none).
            u.checked.store(!u.passive_health(), Ordering::Relaxed);
            u.up.store(ok, Ordering::Relaxed);
            if ok {
                if let Err(e) = u.refresh_models(timeout).await {
                    tracing::warn!(upstream = %u.cfg.name, error = %e, "model discovery failed");
                }
            } else {
                tracing::warn!(upstream = %u.cfg.name, "upstream not healthy at start");
            }
            u.export();
        }))
        .await;
    }

    /// Starts the health checkers and KV event followers of the upstreams
    /// there now (those added later get theirs when added); all stop with
    /// `stop`.
    pub fn spawn_watchers(self: &Arc<Self>, section: &GatewaySection, stop: CancellationToken) {
        let mine = self.stop.clone();
        tokio::spawn(async move {
            stop.cancelled().await;
            mine.cancel();
        });
        for u in self.list().iter() {
            self.watch(u, section, Duration::from_millis(section.health.interval_ms));
        }
    }

    fn watch(&self, u: &Arc<Upstream>, section: &GatewaySection, first_check: Duration) {
        let interval = Duration::from_millis(section.health.interval_ms);
        let timeout = Duration::from_millis(section.health.timeout_ms);
        tokio::spawn(health_loop(u.clone(), first_check, interval, timeout));
        if let Some(endpoint) = &u.cfg.kv_events_zmq {
            tokio::spawn(crate::routing::vllm::follow(crate::routing::vllm::Follow {
                name: u.cfg.name.clone(),
                upstream: u.id,
                endpoint: endpoint.clone(),
                topic: u.cfg.kv_events_topic.clone(),
                chain: crate::routing::vllm::third_party_chain(u.cfg.kv_block_tokens),
                index: self.index.clone(),
                metrics: self.metrics.clone(),
                stop: u.stop.clone(),
            }));
        } else if u.cfg.kv_events && u.cfg.granary != Some(false) {
            tokio::spawn(follow_events(u.clone(), self.index.clone(), self.metrics.clone()));
        }
    }
}

async fn health_loop(u: Arc<Upstream>, first: Duration, interval: Duration, timeout: Duration) {
    let mut since_refresh = Duration::MAX;
    let mut wait = first;
    loop {
        tokio::select! {
            _ = u.stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = interval;
        let ok = u.check_health(timeout).await;
        let was_up = u.up.swap(ok, Ordering::Relaxed);
        u.checked.store(!u.passive_health(), Ordering::Relaxed);
        if ok {
            // Without a probe, only requests' outcomes move the breaker.
            if !u.passive_health() {
                u.breaker.health_passed();
            }
            // Models and KV layout can change when an engine restarts.
            since_refresh = since_refresh.saturating_add(interval);
            if !was_up || since_refresh >= Duration::from_secs(30) || u.models.read().is_empty() {
                match u.refresh_models(timeout).await {
                    Ok(()) => since_refresh = Duration::ZERO,
                    Err(e) => tracing::warn!(upstream = %u.cfg.name, error = %e, "model discovery failed"),
                }
            }
            if !was_up {
                tracing::info!(upstream = %u.cfg.name, "upstream is up");
            }
        } else {
            u.breaker.health_failed();
            if was_up {
                tracing::warn!(upstream = %u.cfg.name, "upstream failed its health check");
            }
        }
        u.export();
    }
}

/// Follows `GET /v1/kv/events` (SSE), applying events to the index. When
/// the stream drops, what the index knew of this upstream is forgotten
/// (it may have restarted empty) and the follower reconnects with backoff;
/// the engine sends a snapshot of its blocks on connect. When the upstream
/// leaves the set the follower stops and forgets it too.
async fn follow_events(u: Arc<Upstream>, index: Arc<KvIndex>, metrics: Arc<GatewayMetrics>) {
    let stop = u.stop.clone();
    let mut backoff = Duration::from_millis(200);
    loop {
        let started = Instant::now();
        let run = async {
            let resp = u.get("/v1/kv/events").send().await?.error_for_status()?;
            let mut body = resp.bytes_stream();
            let mut parser = SseParser::default();
            while let Some(chunk) = body.next().await {
                for data in parser.push(&chunk?) {
                    match serde_json::from_str::<KvEventMsg>(&data) {
                        Ok(ev) => index.apply(u.id, &ev),
                        Err(e) => tracing::debug!(upstream = %u.cfg.name, error = %e, "unreadable KV event"),
                    }
                }
                metrics.kv_index_blocks.set(index.total_blocks() as i64);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            _ = stop.cancelled() => {
                index.forget(u.id);
                return;
            }
            r = run => {
                if let Err(e) = r {
                    tracing::debug!(upstream = %u.cfg.name, error = %e, "KV event stream ended");
                }
            }
        }
        index.forget(u.id);
        if started.elapsed() > Duration::from_secs(10) {
            backoff = Duration::from_millis(200);
        }
        tokio::select! {
            _ = stop.cancelled() => {
                index.forget(u.id);
                return;
            }
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig { failures: 3, open_ms: 1_000 })
    }

    #[test]
    fn breaker_opens_after_consecutive_failures_and_probes_once() {
        let b = breaker();
        let t0 = Instant::now();
        b.failure_at(t0);
        b.failure_at(t0);
        assert!(b.allow_at(t0), "two failures keep it closed");
        b.failure_at(t0);
        assert_eq!(b.view(), BreakerView::Open);
        assert!(!b.allow_at(t0 + Duration::from_millis(500)));
        let later = t0 + Duration::from_millis(1_001);
        assert!(b.allow_at(later), "the first caller after the pause is the probe");
        assert!(!b.allow_at(later), "only one probe");
        b.failure_at(later);
        assert_eq!(b.view(), BreakerView::Open, "a failed probe reopens");
        assert!(b.allow_at(later + Duration::from_millis(1_001)));
        b.success();
        assert_eq!(b.view(), BreakerView::Closed);
        assert!(b.allow_at(later));
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let b = breaker();
        b.failure();
        b.failure();
        b.success();
        b.failure();
        b.failure();
        assert_eq!(b.view(), BreakerView::Closed);
    }

    #[test]
    fn health_checks_open_and_close_it() {
        let b = Breaker::new(BreakerConfig { failures: 2, open_ms: 0 });
        b.health_failed();
        b.health_failed();
        assert_eq!(b.view(), BreakerView::Open);
        b.health_passed();
        assert_eq!(b.view(), BreakerView::Closed, "a passing check after the pause closes it");
        let b = Breaker::new(BreakerConfig { failures: 1, open_ms: 60_000 });
        b.health_failed();
        b.health_passed();
        assert_eq!(b.view(), BreakerView::Open, "not before the pause is over");
    }

    /// A drain reads no request in flight once the engine is out of routing;
    /// a request routed before that must then not take a slot on it (it is
    /// routed again instead), or the engine is stopped under it.
    #[test]
    fn no_slot_is_taken_on_an_upstream_that_left() {
        let section = crate::config::GatewaySection::default();
        let cfgs = vec![UpstreamConfig::new("e", "http://127.0.0.1:9")];
        let set = Upstreams::new(&section, &cfgs, crate::metrics::GatewayMetrics::new(8)).unwrap();
        let routed = set.list()[0].clone();
        let held = routed.try_acquire().expect("a slot while it is routed");
        assert_eq!(routed.active.load(Ordering::SeqCst), 1);
        drop(held);
        set.remove(routed.id).unwrap();
        assert!(routed.try_acquire().is_none(), "a slot on an upstream that left");
        assert_eq!(routed.active.load(Ordering::SeqCst), 0, "what a drain reads stays 0");
    }
}
