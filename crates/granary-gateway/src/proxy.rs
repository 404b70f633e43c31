//! The request path: key → body → model access → limits → route → attempt
//! (with retries before the first byte) → stream back → audit and metrics.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use serde_json::Value;

use crate::agents::Agents;
use crate::cache::{deterministic, CacheKey, Directives, ResponseCache, CACHE_HEADER};
use crate::config::{GatewayConfig, GatewaySection, PoolConfig, Role};
use crate::error::ApiError;
use crate::identity::{AuditRecord, Identity};
use crate::limits::{Limiter, Quota, Reservation};
use crate::metrics::GatewayMetrics;
use crate::prompt::{jobs_for, PromptBlocks, PromptText, Tokenizers};
use crate::routing::{build_policy_with, Admission, Candidate, Policy, PolicyConfig, PoolSelector, RouteRequest};
use crate::types::Principal;
use crate::upstream::{Origin, Slot, SseParser, Upstream, Upstreams};

/// The header carrying the tenant's KV namespace to engines (set by the
/// gateway from the verified key; a client's own value is dropped).
pub const NAMESPACE_HEADER: &str = "x-granary-namespace";
/// The audit record's upstream for answers the response cache gave (not a
/// valid upstream name, so never one of them).
pub const CACHE_UPSTREAM: &str = "(cache)";
/// The request id header, on every response.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The two generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// A pool's lasting part: its configuration and its policy, whose state
/// (rotation counters, approximate KV index) survives changes of the
/// upstream set.
pub(crate) struct Pool {
    cfg: PoolConfig,
    policy: Arc<dyn Policy>,
    session_header: Option<HeaderName>,
    kv_aware: bool,
}

impl Pool {
    fn new(cfg: PoolConfig, upstreams: &Arc<Upstreams>) -> anyhow::Result<Pool> {
        let index = upstreams.index.clone();
        let session_header = match cfg.routing.session_header() {
            Some(h) => Some(
                HeaderName::try_from(h.to_ascii_lowercase())
                    .map_err(|_| anyhow::anyhow!("pool {}: bad session header {h:?}", cfg.name))?,
            ),
            None => None,
        };
        let kv_aware = matches!(cfg.routing, PolicyConfig::KvAware { .. });
        // Session affinity by the upstream's name, the same on every replica.
        let set = Arc::downgrade(upstreams);
        let affinity: crate::routing::AffinityOf =
            Arc::new(move |id| set.upgrade()?.by_id(id).map(|u| crate::routing::affinity_of(u.name())));
        let policy = build_policy_with(&cfg.routing, index, Some(affinity));
        Ok(Pool { cfg, policy, session_header, kv_aware })
    }
}

/// A pool with its members as they are now.
struct PoolView {
    pool: Arc<Pool>,
    members: Vec<Arc<Upstream>>,
}

/// What routing reads: every pool with its members, rebuilt whole when the
/// upstream set changes and swapped in atomically, so a request sees one
/// consistent picture and never takes a lock to get it.
pub(crate) struct Topology {
    pools: Vec<PoolView>,
    /// Smooth weighted round robin state per model, over the pools that
    /// may serve it (kept only for models with more than one such pool).
    selectors: Mutex<HashMap<String, PoolSelector>>,
}

impl Topology {
    /// Some pool has a member serving `model` (routable or not).
    pub(crate) fn serves(&self, model: &str) -> bool {
        self.pools.iter().any(|p| pool_serves(&p.pool, model) && p.members.iter().any(|u| u.serves(model)))
    }

    /// The pools that may serve `model` with their members (in no order).
    fn pool_members<'a>(&'a self, model: &'a str) -> impl Iterator<Item = (&'a Pool, &'a [Arc<Upstream>])> + 'a {
        self.pools.iter().filter(move |v| pool_serves(&v.pool, model)).map(|v| (&*v.pool, v.members.as_slice()))
    }

    /// The pools that may serve `model`, in the order to try them.
    pub(crate) fn pool_order(&self, model: &str) -> Vec<usize> {
        let eligible: Vec<usize> = (0..self.pools.len()).filter(|&i| pool_serves(&self.pools[i].pool, model)).collect();
        if eligible.len() <= 1 {
            return eligible;
        }
        let mut selectors = self.selectors.lock();
        if !selectors.contains_key(model) {
            let weights: Vec<u32> = eligible.iter().map(|&i| self.pools[i].pool.cfg.weight).collect();
            selectors.insert(model.to_string(), PoolSelector::new(&weights));
        }
        let order = selectors.get(model).map(PoolSelector::order).unwrap_or_default();
        order.into_iter().map(|k| eligible[k]).collect()
    }
}

/// The gateway: everything a request needs, shared by every request.
pub struct Gateway {
    pub cfg: GatewaySection,
    pub identity: Identity,
    pub limiter: Limiter,
    pub upstreams: Arc<Upstreams>,
    pub metrics: Arc<GatewayMetrics>,
    /// Configured pools and the names of their members.
    configured: Vec<(Arc<Pool>, Vec<String>)>,
    /// One pool per model for agents' engines, kept while it has members.
    agent_pools: Mutex<HashMap<String, Arc<Pool>>>,
    topology: ArcSwap<Topology>,
    rebuilding: Mutex<()>,
    pub(crate) agents: Agents,
    admission: Arc<Admission<Slot>>,
    tokenizers: Arc<Tokenizers>,
    /// Whole answers to deterministic requests (`[gateway.response_cache]`).
    cache: Option<ResponseCache>,
    /// The scoped operator tokens read from `agent_token_env` and
    /// `metrics_token_env` (the admin token is the caller's to pass).
    pub(crate) scoped: ScopedTokens,
}

/// Operator tokens narrower than the admin token.
#[derive(Clone, Debug, Default)]
pub struct ScopedTokens {
    /// Node agents' heartbeats only.
    pub agent: Option<crate::identity::AdminToken>,
    /// `GET /metrics` only.
    pub metrics: Option<crate::identity::AdminToken>,
}

impl ScopedTokens {
    /// Reads the variables the configuration names; an unset or empty one
    /// is no token, one shorter than 16 characters an error.
    pub fn from_env(section: &GatewaySection) -> anyhow::Result<ScopedTokens> {
        let read = |var: &str| -> anyhow::Result<Option<crate::identity::AdminToken>> {
            match std::env::var(var) {
                Ok(t) if t.is_empty() => Ok(None),
                Ok(t) if t.len() < 16 => anyhow::bail!("{var} must be at least 16 characters"),
                Ok(t) => Ok(Some(crate::identity::AdminToken::new(&t))),
                Err(_) => Ok(None),
            }
        };
        Ok(ScopedTokens { agent: read(&section.agent_token_env)?, metrics: read(&section.metrics_token_env)? })
    }
}

impl Gateway {
    /// Copies the audit writer's and the limiter's own counters into the
    /// metrics.
    pub fn refresh_counters(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let m = &self.metrics;
        m.audit_dropped.inner().store(self.identity.audit_dropped(), Relaxed);
        m.audit_write_errors.inner().store(self.identity.audit_write_errors(), Relaxed);
        m.audit_spooled.set(i64::try_from(self.identity.audit_spooled()).unwrap_or(i64::MAX));
        m.limiter_errors.inner().store(self.limiter.backend_errors(), Relaxed);
    }

    /// Reloads the day and month token budgets of every tenant and key from
    /// the usage rollup into the limiter (raising counters, never lowering
    /// them). [`Gateway::new`] runs this in the background at start and
    /// every `budget_reload_s`, which also rebuilds Redis counters that
    /// were lost (a flush, a restart without persistence).
    pub async fn restore_budgets(&self) {
        const DAYS_32: i64 = 32 * 86_400_000;
        match self.identity.budget_usage(now_ms() - DAYS_32).await {
            Ok(usage) => {
                self.limiter.restore(&usage).await;
                tracing::info!(rows = usage.len(), "limits: day and month budgets reloaded from usage_daily");
            }
            Err(e) => tracing::warn!(error = %e, "limits: cannot reload budgets from usage_daily"),
        }
    }

    pub fn new(config: &GatewayConfig, identity: Identity, limiter: Limiter) -> anyhow::Result<Arc<Gateway>> {
        config.validate()?;
        let metrics = GatewayMetrics::new(config.gateway.metrics_max_tenants);
        let upstreams = Arc::new(Upstreams::new(&config.gateway, &config.upstreams, metrics.clone())?);
        let mut configured = Vec::new();
        for p in config.effective_pools() {
            let names = p.upstreams.clone();
            configured.push((Arc::new(Pool::new(p, &upstreams)?), names));
        }
        // The agents' pools' policy must build too.
        let agents_cfg = config.gateway.agents.clone();
        Pool::new(agent_pool_config("check", &agents_cfg), &upstreams)?;
        let cache =
            ResponseCache::new(&config.gateway.response_cache, config.gateway.redis.as_deref(), metrics.clone())?;
        let gw = Arc::new(Gateway {
            cfg: config.gateway.clone(),
            identity,
            limiter,
            upstreams,
            agents: Agents::new(agents_cfg),
            metrics,
            configured,
            agent_pools: Mutex::new(HashMap::new()),
            topology: ArcSwap::from_pointee(Topology { pools: vec![], selectors: Mutex::new(HashMap::new()) }),
            rebuilding: Mutex::new(()),
            admission: Arc::new(Admission::new()),
            tokenizers: Arc::new(Tokenizers::load(&config.upstreams)?),
            cache,
            scoped: ScopedTokens::from_env(&config.gateway)?,
        });
        gw.rebuild();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            // At start, then every `budget_reload_s` while the gateway lives.
            let weak = Arc::downgrade(&gw);
            let every = Duration::from_secs(config.gateway.budget_reload_s);
            rt.spawn(async move {
                loop {
                    match weak.upgrade() {
                        Some(g) => g.restore_budgets().await,
                        None => return,
                    }
                    if every.is_zero() {
                        return;
                    }
                    tokio::time::sleep(every).await;
                }
            });
        }
        Ok(gw)
    }

    /// Rebuilds the routing picture from the current upstream set; called
    /// after every change to it.
    pub(crate) fn rebuild(&self) {
        let _g = self.rebuilding.lock();
        let list = self.upstreams.list();
        let by_name: HashMap<&str, &Arc<Upstream>> = list.iter().map(|u| (u.name(), u)).collect();
        let mut pools: Vec<PoolView> = self
            .configured
            .iter()
            .map(|(pool, names)| PoolView {
                pool: pool.clone(),
                members: names.iter().filter_map(|n| by_name.get(n.as_str()).map(|u| (*u).clone())).collect(),
            })
            .collect();
        let mut by_model: BTreeMap<&str, Vec<Arc<Upstream>>> = BTreeMap::new();
        for u in list.iter() {
            if let Origin::Agent { model, .. } = &u.origin {
                by_model.entry(model.as_str()).or_default().push(u.clone());
            }
        }
        let mut agent_pools = self.agent_pools.lock();
        // Pools whose last member left go, forgetting what their policy learnt.
        agent_pools.retain(|m, _| by_model.contains_key(m.as_str()));
        for (model, members) in by_model {
            let pool = match agent_pools.get(model) {
                Some(p) => p.clone(),
                None => {
                    let cfg = agent_pool_config(model, &self.agents.cfg);
                    match Pool::new(cfg, &self.upstreams) {
                        Ok(p) => {
                            let p = Arc::new(p);
                            agent_pools.insert(model.to_string(), p.clone());
                            p
                        }
                        Err(e) => {
                            tracing::error!(model, error = %e, "cannot build the agents' pool");
                            continue;
                        }
                    }
                }
            };
            pools.push(PoolView { pool, members });
        }
        drop(agent_pools);
        self.topology.store(Arc::new(Topology { pools, selectors: Mutex::new(HashMap::new()) }));
    }

    /// The routing picture now.
    pub(crate) fn topology(&self) -> Arc<Topology> {
        self.topology.load_full()
    }

    /// Takes an upstream out of the set and out of routing.
    pub(crate) fn remove_upstream(&self, id: usize) {
        if self.upstreams.remove(id).is_some() {
            for (pool, _) in &self.configured {
                pool.policy.forget(id);
            }
            for pool in self.agent_pools.lock().values() {
                pool.policy.forget(id);
            }
        }
    }

    /// Models a principal may use: the union of what upstreams serve (and
    /// of what live agents can load), filtered by the key's allow-list.
    pub fn models_for(&self, p: &Principal) -> Vec<String> {
        let topo = self.topology();
        let mut all: Vec<String> =
            topo.pools.iter().flat_map(|pool| pool.members.iter()).flat_map(|u| u.models()).collect();
        all.retain(|m| topo.pools.iter().any(|pool| pool_serves(&pool.pool, m)));
        all.extend(self.agents.loadable_models());
        all.sort();
        all.dedup();
        all.retain(|m| p.may_use(m));
        all
    }

    /// Some upstream serves `model` now (routable or not).
    pub fn serves(&self, model: &str) -> bool {
        self.topology().serves(model)
    }
}

/// The implicit pool of agents' engines serving `model`.
fn agent_pool_config(model: &str, cfg: &crate::config::AgentsConfig) -> PoolConfig {
    PoolConfig {
        name: format!("agents:{model}"),
        upstreams: vec![],
        models: vec![model.to_string()],
        routing: cfg.pool_policy.config(),
        weight: 100,
    }
}

fn pool_serves(pool: &Pool, model: &str) -> bool {
    pool.cfg.models.is_empty() || pool.cfg.models.iter().any(|m| m == model)
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// What happened to one request; recorded (audit, metrics, token charge)
/// exactly once, when it is dropped — also when a client goes away
/// mid-stream.
struct Outcome {
    gw: Arc<Gateway>,
    start: Instant,
    rec: AuditRecord,
    principal: Option<Principal>,
    ttft: Option<Duration>,
    armed: bool,
    /// The answer was handed over whole (or the stream ran to its end);
    /// dropped before that, the client went away: status 499.
    done: bool,
    /// The upstream's usage object arrived (then it is the truth).
    usage_seen: bool,
    /// Completion tokens counted from streamed chunks so far.
    streamed: u64,
    /// The prompt's size in tokens (estimated from its bytes unless it was
    /// tokenized for routing), for a stream without a usage chunk.
    prompt_estimate: u64,
    /// What the limits left, for the response's `x-ratelimit-*` headers.
    quota: Quota,
    /// The tokens reserved at admission; settled with the real usage on drop.
    reservation: Option<Reservation>,
    /// Where a deterministic request's answer is kept, once it comes.
    cache_key: Option<CacheKey>,
    /// `hit` or `miss`, for the `x-granary-cache` header.
    cache_state: Option<&'static str>,
}

impl Outcome {
    fn new(gw: Arc<Gateway>, endpoint: Endpoint, request_id: String) -> Outcome {
        gw.metrics.active.inc();
        let rec = AuditRecord {
            time_ms: now_ms(),
            request_id,
            endpoint: endpoint.path().to_string(),
            status: 200,
            ..Default::default()
        };
        Outcome {
            gw,
            start: Instant::now(),
            rec,
            principal: None,
            ttft: None,
            armed: true,
            done: false,
            usage_seen: false,
            streamed: 0,
            prompt_estimate: 0,
            quota: Quota::default(),
            reservation: None,
            cache_key: None,
            cache_state: None,
        }
    }

    /// Moves the record into a new owner (a response stream).
    fn take(&mut self) -> Outcome {
        self.armed = false;
        Outcome {
            gw: self.gw.clone(),
            start: self.start,
            rec: self.rec.clone(),
            principal: self.principal.clone(),
            ttft: self.ttft,
            armed: true,
            done: false,
            usage_seen: self.usage_seen,
            streamed: self.streamed,
            prompt_estimate: self.prompt_estimate,
            quota: self.quota,
            reservation: self.reservation.take(),
            cache_key: None,
            cache_state: self.cache_state,
        }
    }

    fn fail(&mut self, e: &ApiError) {
        self.rec.status = e.status.as_u16();
        self.rec.error_code = e.code.map(str::to_string);
    }

    /// A stream that had started broke: the client saw a 200, the record
    /// says what happened.
    fn broke(&mut self, status: u16, code: &str) {
        self.rec.status = status;
        self.rec.error_code = Some(code.to_string());
    }

    /// The answer is complete (or ended by the upstream): not the client's
    /// hang-up.
    fn finished(&mut self) {
        self.done = true;
    }

    fn first_byte(&mut self) {
        if self.ttft.is_none() {
            self.ttft = Some(self.start.elapsed());
        }
    }

    fn usage(&mut self, v: &Value) {
        let n = |x: &Value| x.as_u64().unwrap_or(0);
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage_seen = true;
            self.rec.prompt_tokens = n(&u["prompt_tokens"]);
            self.rec.completion_tokens = n(&u["completion_tokens"]);
            self.rec.cached_tokens = n(&u["prompt_tokens_details"]["cached_tokens"]);
        }
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if !self.done {
            // The client went away before the answer was complete: the
            // upstream request is already dropped with the future or stream
            // that owned it.
            self.rec.status = 499;
            self.rec.error_code = Some("client_closed_request".into());
        }
        if !self.usage_seen && self.streamed > 0 {
            // A stream cut before its usage chunk: charge what was produced.
            self.rec.completion_tokens = self.streamed;
            self.rec.prompt_tokens = self.prompt_estimate;
        }
        let m = &self.gw.metrics;
        m.active.dec();
        let elapsed = self.start.elapsed();
        self.rec.latency_ms = elapsed.as_secs_f64() * 1e3;
        self.rec.ttft_ms = self.ttft.map(|t| t.as_secs_f64() * 1e3);
        let tenant = m.tenant_label(self.rec.tenant.as_deref());
        let model = m.model_label(self.rec.model.as_deref());
        m.requests
            .get_or_create(&vec![
                ("tenant", tenant.clone()),
                ("model", model.clone()),
                ("status", self.rec.status.to_string()),
            ])
            .inc();
        m.latency.get_or_create(&vec![("model", model.clone())]).observe(elapsed.as_secs_f64());
        if let Some(t) = self.ttft {
            m.ttft.get_or_create(&vec![("model", model.clone())]).observe(t.as_secs_f64());
        }
        for (kind, n) in [
            ("prompt", self.rec.prompt_tokens),
            ("completion", self.rec.completion_tokens),
            ("cached", self.rec.cached_tokens),
        ] {
            if n > 0 {
                m.tokens
                    .get_or_create(&vec![("tenant", tenant.clone()), ("model", model.clone()), ("kind", kind.into())])
                    .inc_by(n);
            }
        }
        let spent = self.rec.prompt_tokens + self.rec.completion_tokens;
        if let Some(p) = self.principal.take() {
            let limiter = self.gw.limiter.clone();
            let reservation = self.reservation.take().unwrap_or_default();
            // Settling releases what was reserved and not used, so it runs
            // also when nothing was spent.
            if spent != reservation.tokens {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move { limiter.settle(&p, &reservation, spent).await });
                }
            }
        }
        self.gw.identity.record(std::mem::take(&mut self.rec));
        self.gw.refresh_counters();
    }
}

/// What the gateway read from a request body.
struct Parsed {
    body: serde_json::Map<String, Value>,
    model: String,
    stream: bool,
    include_usage: bool,
    estimate: u64,
    /// The prompt alone, estimated (~4 bytes a token).
    prompt_estimate: u64,
    /// `max_tokens` (or `max_completion_tokens`) when the request sets it.
    max_tokens: Option<u64>,
}

fn parse_body(endpoint: Endpoint, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("The request body is not valid JSON: {e}.")))?;
    let Value::Object(body) = v else {
        return Err(ApiError::bad_request("invalid_json", "The request body must be a JSON object."));
    };
    let model = match body.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "model",
                "missing_required_parameter",
                "Missing required parameter: `model`.",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid("model", "invalid_type", "Invalid type for `model`: expected a string."))
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid("stream", "invalid_type", "Invalid type for `stream`: expected a boolean."))
        }
    };
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid(
                    "stream_options.include_usage",
                    "invalid_type",
                    "Invalid type for `stream_options.include_usage`: expected a boolean.",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "invalid_type",
                "Invalid type for `stream_options`: expected an object.",
            ))
        }
    };
    let mut max_tokens = None;
    for field in ["max_tokens", "max_completion_tokens"] {
        match body.get(field) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(n) => max_tokens = Some(n),
                None => {
                    return Err(ApiError::invalid(
                        field,
                        "invalid_type",
                        format!("Invalid type for `{field}`: expected a non-negative integer."),
                    ))
                }
            },
        }
    }
    let (field, ok) = match endpoint {
        Endpoint::Chat => ("messages", matches!(body.get("messages"), Some(Value::Array(a)) if !a.is_empty())),
        Endpoint::Completions => ("prompt", matches!(body.get("prompt"), Some(Value::String(_) | Value::Array(_)))),
    };
    if !ok {
        return Err(match body.get(field) {
            None | Some(Value::Null) => ApiError::invalid(
                field,
                "missing_required_parameter",
                format!("Missing required parameter: `{field}`."),
            ),
            Some(_) => ApiError::invalid(
                field,
                "invalid_type",
                if endpoint == Endpoint::Chat {
                    "Invalid type for `messages`: expected a non-empty array.".to_string()
                } else {
                    "Invalid type for `prompt`: expected a string or an array of token ids.".to_string()
                },
            ),
        });
    }
    // A rough token estimate for token limits: ~4 bytes a token.
    let prompt_estimate = bytes.len() as u64 / 4;
    let estimate = prompt_estimate + max_tokens.unwrap_or(0);
    Ok(Parsed { body, model, stream, include_usage, estimate, prompt_estimate, max_tokens })
}

fn bearer(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).unwrap_or(v).trim())
        .unwrap_or("")
}

/// Serves one generation request.
pub async fn handle(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    request_id: String,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut out = Outcome::new(gw.clone(), endpoint, request_id);
    let mut resp = match serve(&gw, &mut out, endpoint, &headers, body).await {
        Ok(resp) => resp,
        Err(e) => {
            out.fail(&e);
            e.into_response()
        }
    };
    out.done = true;
    out.quota.apply(resp.headers_mut());
    if let Some(state) = out.cache_state {
        resp.headers_mut().insert(CACHE_HEADER, HeaderValue::from_static(state));
    }
    resp
}

async fn serve(
    gw: &Arc<Gateway>,
    out: &mut Outcome,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let reject = |reason: &str| {
        gw.metrics.rejected.get_or_create(&vec![("reason", reason.to_string())]).inc();
    };
    // 1. Who: the key names the tenant; nothing else the client sends does.
    let principal = match gw.identity.authenticate(bearer(headers)).await {
        Ok(p) => p,
        Err(e) => {
            reject("auth");
            return Err(e.to_api_error());
        }
    };
    out.rec.tenant_id = Some(principal.tenant_id);
    out.rec.tenant = Some(principal.tenant.clone());
    out.rec.key_id = Some(principal.key_id);
    // 2. The body, bounded.
    let bytes = axum::body::to_bytes(body, gw.cfg.max_body_bytes).await.map_err(|_| {
        reject("too_large");
        ApiError::too_large(gw.cfg.max_body_bytes)
    })?;
    let mut parsed = parse_body(endpoint, &bytes).inspect_err(|_| reject("bad_request"))?;
    out.prompt_estimate = parsed.prompt_estimate;
    out.rec.model = Some(parsed.model.clone());
    out.rec.stream = parsed.stream;
    if principal.log_prompts {
        out.rec.prompt = Some(match endpoint {
            Endpoint::Chat => parsed.body.get("messages").map(Value::to_string).unwrap_or_default(),
            Endpoint::Completions => parsed.body.get("prompt").map(Value::to_string).unwrap_or_default(),
        });
    }
    // 3. May this key use the model, and does anyone serve it (or can an
    // agent load it)?
    let mut topo = gw.topology();
    let served = topo.serves(&parsed.model);
    let loadable = !served && gw.agents.can_load(&parsed.model);
    // A model nobody serves nor can load may still have a fallback that is.
    let fallback_served = gw
        .cfg
        .model_fallbacks
        .get(&parsed.model)
        .is_some_and(|fs| fs.iter().any(|f| principal.may_use(f) && topo.serves(f)));
    if !principal.may_use(&parsed.model) || (!served && !loadable && !fallback_served) {
        reject("model");
        return Err(ApiError::model_not_found(&parsed.model));
    }
    // 4. Limits.
    // The worst case is reserved against the token budgets now and settled
    // with the real usage when the request ends (`Outcome`'s drop).
    let worst = parsed.prompt_estimate + parsed.max_tokens.unwrap_or(gw.cfg.default_max_tokens);
    match gw.limiter.reserve(&principal, parsed.estimate, worst).await {
        Ok(reservation) => {
            out.quota = reservation.quota;
            out.reservation = Some(reservation);
        }
        Err(r) => {
            gw.metrics
                .rate_limited
                .get_or_create(&vec![("scope", r.scope.as_str().to_string()), ("limit", r.limit.to_string())])
                .inc();
            out.quota = r.quota;
            return Err(r.to_api_error());
        }
    }
    out.principal = Some(principal.clone());
    // 5. The response cache, for whole answers to deterministic requests
    // (after the limits: a hit is a request like any other).
    if let Some(cache) = gw.cache.as_ref().filter(|_| !parsed.stream && deterministic(&parsed.body)) {
        let d = Directives::of(headers);
        let key = CacheKey::new(principal.tenant_id, endpoint.path(), &parsed.body, d.store);
        out.cache_state = Some("miss");
        if d.lookup {
            if let Some(body) = cache.get(&key).await {
                // No engine worked: no tokens are charged.
                out.cache_state = Some("hit");
                out.rec.upstream = Some(CACHE_UPSTREAM.into());
                return Ok(Response::builder()
                    .status(StatusCode::OK)
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(body))
                    .unwrap_or_else(|_| ApiError::bad_gateway("bad cached answer").into_response()));
            }
        }
        out.cache_key = Some(key);
    }
    // 6. Route.
    if parsed.stream {
        // Usage arrives in a last chunk; the client sees it only if it asked.
        let opts = parsed.body.entry("stream_options").or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(o) = opts {
            o.insert("include_usage".into(), Value::Bool(true));
        }
    }
    // Nobody serves it yet: an agent loads it while the request waits.
    if loadable {
        gw.load_model(&parsed.model).await?;
        topo = gw.topology();
    }
    let prompt = PromptText::of(endpoint, &parsed.body);
    let blocks = prompt_blocks(gw, &topo, prompt.as_ref(), &parsed.model, &principal).await;
    if let Some(n) = blocks.prompt_tokens {
        // Tokenized for routing: the count is exact, not estimated.
        out.prompt_estimate = n as u64;
    }
    let mut plan = route(gw, &topo, &blocks, &parsed.model, &principal, headers);
    // Model-level fallbacks: their pools come after the model's own, so
    // they get the request when the model's own upstreams cannot.
    for fallback in gw.cfg.model_fallbacks.get(&parsed.model).into_iter().flatten() {
        if !principal.may_use(fallback) {
            continue;
        }
        let blocks = prompt_blocks(gw, &topo, prompt.as_ref(), fallback, &principal).await;
        for c in route(gw, &topo, &blocks, fallback, &principal, headers) {
            if !plan.iter().any(|p| p.upstream.id == c.upstream.id && p.model == c.model) {
                plan.push(c);
            }
        }
    }
    if plan.is_empty() {
        return Err(ApiError::unavailable(format!("No upstream for model `{}` is available right now.", parsed.model)));
    }
    // Disaggregated pools: a prefill engine computes the prompt's KV first.
    if let Some(first) = plan.iter().find(|c| c.prefill.is_some()) {
        let prefill = first.prefill.clone().unwrap_or_default();
        let model = first.model.clone();
        prefill_first(gw, endpoint, &parsed, &model, &principal, out, &prefill).await;
    }
    attempt_all(gw, out, endpoint, &parsed, &principal, plan).await
}

/// The body to send `up` for `model`: the client's, with the model named as
/// the upstream knows it. Serialized once per distinct name.
fn payload_for(
    cache: &mut Vec<(String, Bytes)>,
    body: &serde_json::Map<String, Value>,
    wire_model: &str,
) -> Result<Bytes, ApiError> {
    if let Some((_, b)) = cache.iter().find(|(m, _)| m == wire_model) {
        return Ok(b.clone());
    }
    let mut body = body.clone();
    body.insert("model".into(), Value::String(wire_model.to_string()));
    let bytes = Bytes::from(serde_json::to_vec(&body).map_err(|e| ApiError::internal(&e))?);
    cache.push((wire_model.to_string(), bytes.clone()));
    Ok(bytes)
}

/// One routing choice: the upstream to try, and for disaggregated pools the
/// prefill engines to run first.
struct Choice {
    upstream: Arc<Upstream>,
    /// The model it serves the request as (the requested one, or a fallback).
    model: String,
    prefill: Option<Vec<Arc<Upstream>>>,
}

/// The upstreams of `list` in the order of `ids` (a policy's ranking).
fn in_order(ids: &[usize], list: &[&Arc<Upstream>]) -> Vec<Arc<Upstream>> {
    ids.iter().filter_map(|id| list.iter().find(|u| u.id == *id).map(|u| (*u).clone())).collect()
}

fn route(
    gw: &Arc<Gateway>,
    topo: &Topology,
    blocks: &PromptBlocks,
    model: &str,
    p: &Principal,
    headers: &HeaderMap,
) -> Vec<Choice> {
    let mut plan: Vec<Choice> = Vec::new();
    for pi in topo.pool_order(model) {
        let Some(view) = topo.pools.get(pi) else { continue };
        let pool = &view.pool;
        let serving: Vec<&Arc<Upstream>> = view.members.iter().filter(|u| u.serves(model) && u.is_routable()).collect();
        let decoders: Vec<&Arc<Upstream>> = serving.iter().copied().filter(|u| u.role() != Role::Prefill).collect();
        let prefillers: Vec<&Arc<Upstream>> = serving.iter().copied().filter(|u| u.role() == Role::Prefill).collect();
        if decoders.is_empty() {
            continue;
        }
        let (granary, by_upstream): (&[_], &[_]) =
            if pool.kv_aware { (&blocks.granary, &blocks.by_upstream) } else { (&[], &[]) };
        let session = pool.session_header.as_ref().and_then(|h| headers.get(h)).and_then(|v| v.to_str().ok());
        let req = RouteRequest { namespace: &p.namespace, session, blocks: granary, by_upstream };
        let cands = |list: &[&Arc<Upstream>]| -> Vec<Candidate> {
            list.iter()
                .map(|u| Candidate {
                    index: u.id,
                    active: u.active.load(std::sync::atomic::Ordering::Relaxed),
                    max_active: u.cfg.max_active,
                    publishes_events: u.publishes_events(),
                })
                .collect()
        };
        let ranked = pool.policy.rank(&req, &cands(&decoders));
        let prefill = if prefillers.is_empty() {
            None
        } else {
            Some(in_order(&pool.policy.rank(&req, &cands(&prefillers)), &prefillers))
        };
        if let Some(&first) = ranked.first() {
            pool.policy.routed(&req, first);
            let policy = pool.policy.name().to_string();
            let blocks = req.blocks_for(first);
            if !blocks.is_empty() {
                let hit = gw.upstreams.index.prefix_match(first, blocks);
                gw.metrics.routed_blocks.get_or_create(&vec![("policy", policy.clone())]).inc_by(blocks.len() as u64);
                gw.metrics.routed_hit_blocks.get_or_create(&vec![("policy", policy)]).inc_by(hit as u64);
            }
        }
        for u in in_order(&ranked, &decoders) {
            if !plan.iter().any(|c| c.upstream.id == u.id) {
                plan.push(Choice { upstream: u, model: model.to_string(), prefill: prefill.clone() });
            }
        }
    }
    plan
}

/// The prompt's blocks as the routable members of the kv-aware pools
/// serving `model` name them, tokenized off the async workers (empty where
/// no tokenizer or layout is known: the policy then decides by load).
async fn prompt_blocks(
    gw: &Arc<Gateway>,
    topo: &Topology,
    prompt: Option<&PromptText>,
    model: &str,
    p: &Principal,
) -> PromptBlocks {
    let Some(prompt) = prompt else { return PromptBlocks::default() };
    let candidates: Vec<Arc<Upstream>> = topo
        .pool_members(model)
        .filter(|(pool, _)| pool.kv_aware)
        .flat_map(|(_, members)| members.iter())
        .filter(|u| u.serves(model) && u.is_routable() && u.role() != Role::Prefill)
        .cloned()
        .collect();
    let jobs = jobs_for(&gw.tokenizers, model, &p.namespace, &candidates);
    PromptBlocks::compute(prompt.clone(), jobs).await
}

/// Takes a slot on the first upstream of `order` with room; waits (by
/// priority) when all are full.
async fn acquire(gw: &Arc<Gateway>, order: &[Arc<Upstream>], p: &Principal) -> Result<Slot, ApiError> {
    let try_take = || order.iter().find_map(|u| u.try_acquire());
    let slot = match try_take() {
        Some(s) => s,
        None => {
            let prio = vec![("priority", p.priority.as_str().to_string())];
            gw.metrics.queue_waiting.get_or_create(&prio).inc();
            let t0 = Instant::now();
            let wants: Vec<usize> = order.iter().map(|u| u.id).collect();
            let got = gw.admission.acquire(p.priority, &wants, gw.cfg.queue_timeout(), try_take).await;
            gw.metrics.queue_waiting.get_or_create(&prio).dec();
            gw.metrics.queue_seconds.get_or_create(&prio).observe(t0.elapsed().as_secs_f64());
            got.ok_or_else(|| {
                ApiError::unavailable("Every upstream for this model is at capacity; try again later.")
                    .retry_after(Duration::from_secs(1))
            })?
        }
    };
    // Released, the slot's capacity goes straight to the best request
    // waiting for this upstream.
    let admission = gw.admission.clone();
    let up = slot.upstream.clone();
    Ok(slot.on_release(move || admission.offer(up.id, || up.try_acquire())))
}

enum AttemptError {
    /// Worth trying elsewhere: nothing reached the client.
    Retryable(&'static str, String),
    /// A final answer to pass on.
    Final(Response),
}

fn request_to(
    up: &Upstream,
    path: &str,
    p: &Principal,
    request_id: &str,
    payload: Bytes,
    timeout: Duration,
) -> reqwest::RequestBuilder {
    let mut req =
        up.client.post(up.url(path)).header(header::CONTENT_TYPE, "application/json").timeout(timeout).body(payload);
    // Granary headers go to Granary engines only: a tenant's namespace is
    // its name by default, and must not reach a third party; and servers
    // may read `x-request-id` their own way (llama-cpp-python's answers a
    // bare 400 to any id that is not a UUID).
    if up.is_granary() {
        req = req.header(REQUEST_ID_HEADER, request_id);
        if up.cfg.send_namespace {
            req = req.header(NAMESPACE_HEADER, &p.namespace);
        }
    }
    if let Some(a) = &up.auth {
        req = req.header(header::AUTHORIZATION, a);
    }
    req
}

async fn prefill_first(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    parsed: &Parsed,
    model: &str,
    p: &Principal,
    out: &Outcome,
    order: &[Arc<Upstream>],
) {
    let Ok(slot) = acquire(gw, order, p).await else { return };
    let up = slot.upstream.clone();
    let mut body = parsed.body.clone();
    body.insert("stream".into(), Value::Bool(false));
    body.insert("model".into(), Value::String(up.wire_model(model).to_string()));
    body.remove("stream_options");
    let Ok(payload) = serde_json::to_vec(&body) else { return };
    let res = request_to(&up, endpoint.path(), p, &out.rec.request_id, payload.into(), gw.cfg.first_byte_timeout())
        .send()
        .await;
    match res {
        Ok(r) if r.status().is_success() => {
            let _ = r.bytes().await;
            up.attempt("ok");
            up.breaker.success();
        }
        Ok(r) => {
            up.attempt(if r.status().is_server_error() { "status_5xx" } else { "status_4xx" });
            tracing::warn!(upstream = %up.name(), status = %r.status(), "prefill failed; decoding computes the prompt");
        }
        Err(e) => {
            up.attempt("connect_error");
            up.breaker.failure();
            tracing::warn!(upstream = %up.name(), error = %e, "prefill failed; decoding computes the prompt");
        }
    }
}

async fn attempt_all(
    gw: &Arc<Gateway>,
    out: &mut Outcome,
    endpoint: Endpoint,
    parsed: &Parsed,
    p: &Principal,
    plan: Vec<Choice>,
) -> Result<Response, ApiError> {
    let mut payloads: Vec<(String, Bytes)> = Vec::new();
    // The model each upstream serves the request as (the first choice
    // naming it: the requested model before fallbacks).
    let mut order: Vec<Arc<Upstream>> = Vec::new();
    let mut models: HashMap<usize, String> = HashMap::new();
    for c in plan {
        if let std::collections::hash_map::Entry::Vacant(e) = models.entry(c.upstream.id) {
            e.insert(c.model);
            order.push(c.upstream);
        }
    }
    let mut tried: Vec<usize> = Vec::new();
    let mut backoff = Duration::from_millis(gw.cfg.retry_backoff_ms);
    let mut last = String::new();
    for attempt in 0..gw.cfg.max_attempts {
        // Prefer upstreams not tried yet; come back to tried ones only when
        // nothing else is left.
        let fresh: Vec<Arc<Upstream>> = order.iter().filter(|u| !tried.contains(&u.id)).cloned().collect();
        let candidates: Vec<Arc<Upstream>> = if fresh.is_empty() { order.clone() } else { fresh };
        let candidates: Vec<Arc<Upstream>> =
            candidates.into_iter().filter(|u| u.breaker.is_available() && !u.is_removed()).collect();
        if candidates.is_empty() {
            break;
        }
        if attempt > 0 {
            gw.metrics.retries.inc();
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
        let slot = acquire(gw, &candidates, p).await?;
        let up = slot.upstream.clone();
        if !up.breaker.allow() {
            continue;
        }
        tried.push(up.id);
        out.rec.upstream = Some(up.name().to_string());
        let model = models.get(&up.id).cloned().unwrap_or_else(|| parsed.model.clone());
        let payload = payload_for(&mut payloads, &parsed.body, up.wire_model(&model))?;
        out.rec.model = Some(model);
        match attempt_one(gw, out, endpoint, parsed, p, slot, payload).await {
            Ok(resp) => return Ok(resp),
            Err(AttemptError::Final(resp)) => return Ok(resp),
            Err(AttemptError::Retryable(outcome, why)) => {
                up.attempt(outcome);
                up.breaker.failure();
                tracing::warn!(upstream = %up.name(), request_id = %out.rec.request_id, attempt, error = %why, "upstream attempt failed");
                last = why;
            }
        }
    }
    let _ = last;
    Err(ApiError::bad_gateway("The upstream engines failed to answer this request; try again."))
}

async fn attempt_one(
    gw: &Arc<Gateway>,
    out: &mut Outcome,
    endpoint: Endpoint,
    parsed: &Parsed,
    p: &Principal,
    slot: Slot,
    payload: Bytes,
) -> Result<Response, AttemptError> {
    let up = slot.upstream.clone();
    let first_byte = gw.cfg.first_byte_timeout();
    // No total timeout on the request: streams may run long; silence is
    // bounded per chunk instead.
    let send = request_to(&up, endpoint.path(), p, &out.rec.request_id, payload, Duration::from_secs(24 * 3600)).send();
    let resp = match tokio::time::timeout(first_byte, send).await {
        Err(_) => return Err(AttemptError::Retryable("timeout", "no response headers in time".into())),
        Ok(Err(e)) if e.is_connect() => return Err(AttemptError::Retryable("connect_error", e.to_string())),
        Ok(Err(e)) => return Err(AttemptError::Retryable("connect_error", e.to_string())),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    if status.is_server_error() {
        return Err(AttemptError::Retryable("status_5xx", format!("status {status}")));
    }
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let is_sse =
        content_type.as_ref().and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    let mut body = resp.bytes_stream();
    // The first body byte: until it arrives, a failure is retried elsewhere.
    let first = match tokio::time::timeout(first_byte, body.next()).await {
        Err(_) => return Err(AttemptError::Retryable("timeout", "no first byte in time".into())),
        Ok(Some(Err(e))) => return Err(AttemptError::Retryable("bad_response", e.to_string())),
        Ok(None) => Bytes::new(),
        Ok(Some(Ok(b))) => b,
    };
    out.first_byte();
    let code = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    out.rec.status = code.as_u16();
    if parsed.stream && is_sse && code.is_success() {
        up.attempt("ok");
        up.breaker.success();
        let owned = out.take();
        let stream = relay_sse(first, body, owned, slot, parsed.include_usage, gw.cfg.idle_timeout());
        return Ok(Response::builder()
            .status(code)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| ApiError::bad_gateway("bad upstream response").into_response()));
    }
    // Whole answers: read to the end (a failure here is still retryable:
    // the client has received nothing).
    let mut buf = first.to_vec();
    loop {
        match tokio::time::timeout(gw.cfg.idle_timeout(), body.next()).await {
            Err(_) => return Err(AttemptError::Retryable("timeout", "upstream went silent".into())),
            Ok(Some(Err(e))) => return Err(AttemptError::Retryable("bad_response", e.to_string())),
            Ok(Some(Ok(b))) => {
                if buf.len() + b.len() > 64 << 20 {
                    return Err(AttemptError::Retryable("bad_response", "answer over 64 MiB".into()));
                }
                buf.extend_from_slice(&b);
            }
            Ok(None) => break,
        }
    }
    let json: Option<Value> = serde_json::from_slice(&buf).ok();
    if code.is_success() && json.as_ref().is_none_or(|v| !v.is_object()) {
        return Err(AttemptError::Retryable("bad_response", "the upstream's answer is not a JSON object".into()));
    }
    up.attempt(if code.is_success() { "ok" } else { "status_4xx" });
    up.breaker.success();
    drop(slot);
    if let Some(key) = out.cache_key.take().filter(|k| code == StatusCode::OK && k.store) {
        if let Some(cache) = &gw.cache {
            cache.put(&key, Bytes::from(buf.clone()));
        }
    }
    if let Some(v) = &json {
        out.usage(v);
        if !code.is_success() {
            out.rec.error_code = v["error"]["code"].as_str().map(str::to_string);
        }
    }
    let mut r = Response::builder().status(code);
    r = r.header(header::CONTENT_TYPE, content_type.unwrap_or(HeaderValue::from_static("application/json")));
    Err(AttemptError::Final(
        r.body(Body::from(buf)).unwrap_or_else(|_| ApiError::bad_gateway("bad upstream response").into_response()),
    ))
}

/// Passes an SSE answer through event by event (never the whole answer),
/// counting completion tokens as chunks pass (one per choice with new
/// content: engines stream a token a chunk), taking usage from the last
/// chunk as the truth and hiding that chunk when the client did not ask for
/// it. A failure mid-stream ends it with an error event: a stream that has
/// started is never retried. When the client goes away the stream is
/// dropped where it waits, and with it the upstream request; the record
/// says 499 with the tokens counted so far.
fn relay_sse(
    first: Bytes,
    mut body: impl Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static,
    mut out: Outcome,
    slot: Slot,
    include_usage: bool,
    idle: Duration,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
    async_stream::stream! {
        let _slot = slot;
        let mut filter = EventFilter::default();
        // The last chunk, whose id, model and object a usage chunk copies.
        let mut last: Option<Value> = None;
        let mut next = Some(first);
        loop {
            let chunk = match next.take() {
                Some(c) => c,
                None => match tokio::time::timeout(idle, body.next()).await {
                    Ok(Some(Ok(c))) => c,
                    Ok(None) => {
                        out.finished();
                        break;
                    }
                    // After `[DONE]` the answer is whole: how the upstream
                    // closes the connection then does not matter.
                    Ok(Some(Err(_))) | Err(_) if out.done => break,
                    Ok(Some(Err(e))) => {
                        tracing::warn!(request_id = %out.rec.request_id, error = %e, "upstream stream broke");
                        out.done = true;
                        out.broke(502, "upstream_error");
                        yield Ok(error_event("The upstream engine failed mid-stream."));
                        break;
                    }
                    Err(_) => {
                        out.done = true;
                        out.broke(504, "upstream_timeout");
                        yield Ok(error_event("The upstream engine went silent mid-stream."));
                        break;
                    }
                },
            };
            let mut pass = Vec::with_capacity(chunk.len());
            for ev in filter.push(&chunk) {
                if let Some(data) = ev.data.as_deref() {
                    if data.trim() == "[DONE]" {
                        out.done = true;
                        if include_usage && !out.usage_seen {
                            // The upstream ignores `stream_options` (llama.cpp's
                            // Python server does): the client asked for usage,
                            // so it gets the gateway's count.
                            if let Some(last) = &last {
                                pass.extend_from_slice(&usage_event(last, out.prompt_estimate, out.streamed));
                            }
                        }
                    }
                    if let Ok(v) = serde_json::from_str::<Value>(data) {
                        out.streamed += content_choices(&v);
                        if include_usage && !out.usage_seen {
                            last = Some(v.clone());
                        }
                        if v.get("usage").is_some_and(|u| u.is_object()) {
                            out.usage(&v);
                            let usage_only = v["choices"].as_array().is_some_and(|c| c.is_empty());
                            if usage_only && !include_usage {
                                continue;
                            }
                        }
                    }
                }
                pass.extend_from_slice(&ev.raw);
            }
            if !pass.is_empty() {
                yield Ok(Bytes::from(pass));
            }
        }
        let rest = filter.finish();
        if !rest.is_empty() {
            yield Ok(Bytes::from(rest));
        }
    }
}

/// Choices of a streamed chunk that carry new output (text, reasoning or a
/// tool call): a token each.
fn content_choices(v: &Value) -> u64 {
    let some = |x: &Value| x.as_str().is_some_and(|s| !s.is_empty());
    let Some(choices) = v.get("choices").and_then(Value::as_array) else { return 0 };
    choices
        .iter()
        .filter(|c| {
            let d = &c["delta"];
            some(&d["content"]) || some(&d["reasoning_content"]) || d["tool_calls"].is_array() || some(&c["text"])
        })
        .count() as u64
}

/// A final usage chunk as OpenAI sends it (no choices), counted here.
fn usage_event(last: &Value, prompt: u64, completion: u64) -> Vec<u8> {
    let v = serde_json::json!({
        "id": last["id"],
        "object": last["object"],
        "created": last["created"],
        "model": last["model"],
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    });
    format!("data: {v}\n\n").into_bytes()
}

fn error_event(message: &str) -> Bytes {
    let e = ApiError::bad_gateway(message);
    Bytes::from(format!("data: {}\n\n", e.body()))
}

/// Splits an SSE byte stream into whole events (raw bytes kept for
/// passthrough, `data` extracted for inspection).
#[derive(Default)]
struct EventFilter {
    pending: Vec<u8>,
}

struct RawEvent {
    raw: Vec<u8>,
    data: Option<String>,
}

impl EventFilter {
    fn push(&mut self, chunk: &[u8]) -> Vec<RawEvent> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(end) = find_event_end(&self.pending) {
            let raw: Vec<u8> = self.pending.drain(..end).collect();
            let mut parser = SseParser::default();
            let data = parser.push(&raw).into_iter().next();
            out.push(RawEvent { raw, data });
        }
        out
    }

    fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// The end (exclusive) of the first complete event: after `\n\n` or `\r\n\r\n`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some(i + 2);
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_checked_field_by_field() {
        let err = |e: Endpoint, s: &str| parse_body(e, s.as_bytes()).err().unwrap();
        let e = err(Endpoint::Chat, "{");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        assert_eq!(err(Endpoint::Chat, "[1]").code, Some("invalid_json"));
        assert_eq!(
            err(Endpoint::Chat, r#"{"messages": [{"role":"user","content":"x"}]}"#).param.as_deref(),
            Some("model")
        );
        assert_eq!(err(Endpoint::Chat, r#"{"model": 5, "messages": []}"#).param.as_deref(), Some("model"));
        assert_eq!(err(Endpoint::Chat, r#"{"model": "m"}"#).param.as_deref(), Some("messages"));
        assert_eq!(err(Endpoint::Chat, r#"{"model": "m", "messages": "hi"}"#).param.as_deref(), Some("messages"));
        assert_eq!(err(Endpoint::Completions, r#"{"model": "m"}"#).param.as_deref(), Some("prompt"));
        let m = r#""model": "m", "prompt": "x""#;
        assert_eq!(err(Endpoint::Completions, &format!("{{{m}, \"stream\": 1}}")).param.as_deref(), Some("stream"));
        assert_eq!(
            err(Endpoint::Completions, &format!("{{{m}, \"max_tokens\": -1}}")).param.as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            err(Endpoint::Completions, &format!("{{{m}, \"stream_options\": {{\"include_usage\": \"y\"}}}}"))
                .param
                .as_deref(),
            Some("stream_options.include_usage")
        );
        let ok =
            parse_body(Endpoint::Completions, format!("{{{m}, \"stream\": true, \"max_tokens\": 100}}").as_bytes())
                .ok()
                .unwrap();
        assert!(ok.stream && !ok.include_usage);
        assert_eq!(ok.model, "m");
        assert!(ok.estimate >= 100);
    }

    #[test]
    fn event_filter_splits_whole_events_only() {
        let mut f = EventFilter::default();
        assert!(f.push(b"data: {\"a\"").is_empty());
        let evs = f.push(b":1}\n\ndata: [DONE]\r\n\r\ndata: tail");
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].raw, b"data: {\"a\":1}\n\n");
        assert_eq!(evs[0].data.as_deref(), Some("{\"a\":1}"));
        assert_eq!(evs[1].data.as_deref(), Some("[DONE]"));
        assert_eq!(f.finish(), b"data: tail");
    }

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_header() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), "");
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer gk_abc"));
        assert_eq!(bearer(&h), "gk_abc");
    }
}
