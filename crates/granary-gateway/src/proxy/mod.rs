//! The request path: key → body → model access → limits → route → attempt
//! (with retries before the first byte) → stream back → audit and metrics.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use serde_json::Value;
use tracing::Instrument;

use crate::agents::Agents;
use crate::cache::{CacheKey, Directives, ResponseCache, CACHE_HEADER};
use crate::config::{GatewayConfig, GatewaySection, PoolConfig, Role};
use crate::error::ApiError;
use crate::identity::keys::bearer;
use crate::identity::{AuditRecord, Identity};
use crate::limits::{Ask, Limiter, Quota, Reservation};
use crate::metrics::GatewayMetrics;
use crate::prompt::{jobs_for, PromptBlocks, PromptText, Tokenizers};
use crate::routing::{build_policy_with, Admission, Candidate, Policy, PolicyConfig, PoolSelector, RouteRequest};
use crate::sse::EventFilter;
use crate::types::{now_ms, Principal};
use crate::upstream::{Origin, Slot, Upstream, Upstreams};

mod answer;
mod attempt;
mod outcome;
mod plan;
mod relay;
mod request;
mod similar;

use attempt::{attempt_all, Attempted};
use outcome::Outcome;
use plan::{payload_for, prompt_blocks, route, Choice};
use relay::relay_sse;
use request::{parse_body, Parsed};

/// The header carrying the tenant's KV namespace to engines (set by the
/// gateway from the verified key; a client's own value is dropped).
pub const NAMESPACE_HEADER: &str = "x-granary-namespace";
/// On an answer that waited for a model to load: which agent loaded it and
/// why (weights' tier, engines, free memory, and the agents ranked after).
pub const PLACEMENT_HEADER: &str = "x-granary-placement";
/// The audit record's upstream for answers the response cache gave (not a
/// valid upstream name, so never one of them).
pub const CACHE_UPSTREAM: &str = "(cache)";
/// On answers of disaggregated pools: `ok` (a prefill engine computed the
/// prompt), `failed` or `busy` (it did not; the decode engine served the
/// whole request alone).
pub const PREFILL_HEADER: &str = "x-granary-prefill";
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
    pub(crate) admission: Arc<Admission<Slot>>,
    tokenizers: Arc<Tokenizers>,
    /// Whole answers to deterministic requests (`[gateway.response_cache]`).
    cache: Option<ResponseCache>,
    /// Answers to prompts that mean nearly the same (`[gateway.semantic_cache]`).
    semantic: Option<crate::semantic::SemanticCache>,
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
    /// them). The server runs this once before it takes requests, and
    /// [`Gateway::new`] in the background every `budget_reload_s`, which
    /// also rebuilds Redis counters that were lost (a flush, a restart
    /// without persistence).
    pub async fn restore_budgets(&self) {
        const DAYS_32: i64 = 32 * 86_400_000;
        match self.identity.budget_usage(now_ms() - DAYS_32, &self.cfg.prices).await {
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
        let semantic = crate::semantic::SemanticCache::new(&config.gateway.semantic_cache, metrics.clone());
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
            semantic,
            scoped: ScopedTokens::from_env(&config.gateway)?,
        });
        gw.rebuild();
        let every = Duration::from_secs(config.gateway.budget_reload_s);
        if let (Ok(rt), false) = (tokio::runtime::Handle::try_current(), every.is_zero()) {
            // Every `budget_reload_s` while the gateway lives; the first
            // restore is the caller's, before it takes requests
            // ([`Gateway::restore_budgets`]).
            let weak = Arc::downgrade(&gw);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    match weak.upgrade() {
                        Some(g) => g.restore_budgets().await,
                        None => return,
                    }
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

/// A kept whole answer.
fn cached_answer(body: Bytes) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| ApiError::bad_gateway("bad cached answer").into_response())
}

/// Serves one generation request.
pub async fn handle(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    request_id: String,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let span = tracing::info_span!(
        "request",
        "otel.kind" = "server",
        "http.route" = endpoint.path(),
        "granary.request_id" = request_id.as_str(),
        "http.response.status_code" = tracing::field::Empty,
    );
    granary_core::trace::continue_from(&span, &headers);
    let mut out = Outcome::new(gw.clone(), endpoint, request_id, span.clone());
    let served = serve(&gw, &mut out, endpoint, &headers, body).instrument(span.clone()).await;
    let mut resp = match served {
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
    if let Some(kind) = out.cache_match {
        resp.headers_mut().insert(crate::semantic::MATCH_HEADER, HeaderValue::from_static(kind));
    }
    if let Some(prefill) = out.prefill {
        resp.headers_mut().insert(PREFILL_HEADER, HeaderValue::from_static(prefill));
    }
    if let Some(why) = out.placement.as_deref().and_then(|w| HeaderValue::from_str(w).ok()) {
        resp.headers_mut().insert(PLACEMENT_HEADER, why);
    }
    span.record("http.response.status_code", resp.status().as_u16());
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
    // 1-4 (the `admission` span): key, body, model access, limits.
    let admission = tracing::info_span!("admission", "gen_ai.request.model" = tracing::field::Empty);
    let admitted = async {
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
        let parsed = parse_body(endpoint, &bytes).inspect_err(|_| reject("bad_request"))?;
        out.prompt_estimate = parsed.prompt_estimate;
        out.rec.model = Some(parsed.model.clone());
        out.rec.stream = parsed.stream;
        tracing::Span::current().record("gen_ai.request.model", parsed.model.as_str());
        if principal.log_prompts {
            out.rec.prompt = Some(match endpoint {
                Endpoint::Chat => parsed.body().get("messages").map(Value::to_string).unwrap_or_default(),
                Endpoint::Completions => parsed.body().get("prompt").map(Value::to_string).unwrap_or_default(),
            });
        }
        // 3. May this key use the model, and does anyone serve it (or can an
        // agent load it)?
        let topo = gw.topology();
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
        // The worst case is reserved against the token and spend budgets now
        // and settled with the real usage when the request ends (`Outcome`'s
        // drop). Its cost is the prompt at the input price (none of it cached)
        // and every completion it may generate (`n`, batched prompts) at the
        // output price of the model asked for.
        let max_tokens = parsed.max_tokens.unwrap_or(gw.cfg.default_max_tokens).saturating_mul(parsed.completions);
        let worst = parsed.prompt_estimate + max_tokens;
        let prices = &gw.cfg.prices;
        let asked = parsed.max_tokens.unwrap_or(0).saturating_mul(parsed.completions);
        let ask = Ask {
            estimate: parsed.estimate,
            tokens: worst,
            spend_estimate: prices.spend(&parsed.model, parsed.prompt_estimate, 0, asked),
            spend: prices.spend(&parsed.model, parsed.prompt_estimate, 0, max_tokens),
        };
        match gw.limiter.reserve_ask(&principal, ask).await {
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
        Ok::<_, ApiError>((principal, parsed, topo, loadable))
    };
    let (principal, parsed, mut topo, loadable) = admitted.instrument(admission).await?;
    // 5. The response cache, for whole answers to deterministic requests
    // (after the limits: a hit is a request like any other).
    if let Some(cache) = gw.cache.as_ref().filter(|_| !parsed.stream && parsed.deterministic) {
        let d = Directives::of(headers);
        let key = CacheKey::new(principal.tenant_id, endpoint.path(), parsed.body(), d.store);
        out.cache_state = Some("miss");
        if d.lookup {
            if let Some(body) = cache.get(&key).await {
                // No engine worked: no tokens are charged.
                out.cache_state = Some("hit");
                out.cache_match = Some("exact");
                out.rec.upstream = Some(CACHE_UPSTREAM.into());
                return Ok(cached_answer(body));
            }
        }
        out.cache_key = Some(key);
    }
    // 5b. The semantic cache: a kept answer to a prompt that means nearly
    // the same (the same requests qualify as for the exact cache).
    if let Some(sem) = gw.semantic.as_ref().filter(|_| !parsed.stream && parsed.deterministic) {
        let d = Directives::of(headers);
        if d.lookup || d.store {
            let id = out.rec.request_id.clone();
            if let Some(probe) = similar::probe(gw, sem, &principal, endpoint, parsed.body(), d.store, &id).await {
                if let Some((body, _)) = d.lookup.then(|| sem.get(&probe)).flatten() {
                    out.cache_state = Some("hit");
                    out.cache_match = Some("semantic");
                    out.rec.upstream = Some(CACHE_UPSTREAM.into());
                    return Ok(cached_answer(body));
                }
                out.cache_state = Some("miss");
                out.semantic = probe.store.then_some(probe);
            }
        }
    }
    // 6. Route. (Streams ask for the usage chunk: `Parsed::payload`; the
    // client sees it only if it asked.)
    // Routed again (once) when every engine the plan named left routing
    // before the request took a slot on one: drained for an idle unload.
    let mut loadable = loadable;
    for round in 0..2 {
        let routing = tracing::info_span!(
            "routing",
            "granary.routing.policy" = tracing::field::Empty,
            "granary.routing.upstream" = tracing::field::Empty,
            "granary.routing.candidates" = tracing::field::Empty,
            "granary.routing.predicted_cached_tokens" = tracing::field::Empty,
            "gen_ai.usage.input_tokens" = tracing::field::Empty,
        );
        let plan = async {
            // Nobody serves it yet: an agent loads it while the request waits.
            if loadable {
                gw.load_model(&parsed.model).await?;
                out.placement = gw.agents.placement(&parsed.model);
                topo = gw.topology();
            }
            // The prompt, read only for pools that route by its KV blocks.
            let prompt_text = std::sync::OnceLock::new();
            let prompt = || prompt_text.get_or_init(|| PromptText::of(endpoint, parsed.body())).as_ref();
            let blocks = prompt_blocks(gw, &topo, prompt, &parsed.model, &principal).await;
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
                let blocks = prompt_blocks(gw, &topo, prompt, fallback, &principal).await;
                for c in route(gw, &topo, &blocks, fallback, &principal, headers) {
                    if !plan.iter().any(|p| p.upstream.id == c.upstream.id && p.model == c.model) {
                        plan.push(c);
                    }
                }
            }
            let span = tracing::Span::current();
            span.record("granary.routing.candidates", plan.len());
            if let Some(first) = plan.first() {
                span.record("granary.routing.upstream", first.upstream.name());
            }
            if let Some(n) = blocks.prompt_tokens {
                span.record("gen_ai.usage.input_tokens", n);
            }
            if plan.is_empty() {
                return Err(ApiError::unavailable(format!(
                    "No upstream for model `{}` is available right now.",
                    parsed.model
                )));
            }
            Ok(plan)
        };
        let plan = plan.instrument(routing).await?;
        // Disaggregated pools: each decode engine's prefill partner computes
        // the prompt's KV first (`attempt_all`, once the decode slot is held).
        match attempt_all(gw, out, endpoint, &parsed, &principal, plan).await? {
            Attempted::Done(resp) => return Ok(resp),
            Attempted::Replan if round == 0 => {
                tracing::info!(request_id = %out.rec.request_id, "every routed engine left routing; routing again");
                topo = gw.topology();
                loadable = !topo.serves(&parsed.model) && gw.agents.can_load(&parsed.model);
            }
            Attempted::Replan => break,
        }
    }
    Err(ApiError::unavailable(format!("No upstream for model `{}` is available right now.", parsed.model)))
}
