//! The gateway's Prometheus metrics (names from
//! [`granary_core::metrics::gateway`]).
//!
//! Label cardinality is bounded: tenants get their own label value up to a
//! configured count (later ones are `other`), models only when configured or
//! served by an upstream or loadable by an agent (else `unknown`), statuses
//! are HTTP codes, upstreams come from the configuration or from agents'
//! reports (admin-authenticated), and leave the exposition with the upstream.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use granary_core::metrics::gateway as names;
use granary_core::metrics::warehouse::counter_base as base;
use parking_lot::RwLock;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Predictive prefetch events (counter `granary_gateway_agent_prefetch_total`;
/// label `event`: `asked`, `done`, `hit`), registered without the `_total`.
pub const PREFETCH: &str = "granary_gateway_agent_prefetch_total";
const PREFETCH_BASE: &str = "granary_gateway_agent_prefetch";

type Labels = Vec<(&'static str, String)>;

/// Every metric the gateway exports.
pub struct GatewayMetrics {
    registry: Registry,
    pub requests: Family<Labels, Counter>,
    pub latency: Family<Labels, Histogram>,
    pub ttft: Family<Labels, Histogram>,
    pub active: Gauge,
    pub tokens: Family<Labels, Counter>,
    pub upstream_up: Family<Labels, Gauge>,
    pub breaker_state: Family<Labels, Gauge>,
    pub upstream_active: Family<Labels, Gauge>,
    pub attempts: Family<Labels, Counter>,
    pub retries: Counter,
    pub rate_limited: Family<Labels, Counter>,
    pub rejected: Family<Labels, Counter>,
    pub queue_waiting: Family<Labels, Gauge>,
    pub queue_seconds: Family<Labels, Histogram>,
    pub kv_index_blocks: Gauge,
    pub routed_hit_blocks: Family<Labels, Counter>,
    pub routed_blocks: Family<Labels, Counter>,
    /// vLLM KV events read, by outcome (`stored`, `removed`, `cleared`
    /// blocks; `unknown_parent`, `lora`, `wrong_block_size` blocks not
    /// indexed; `undecodable`, `missed_batches` batches).
    pub vllm_kv_events: Family<Labels, Counter>,
    /// Response cache lookups and writes, by event (`hit`, `miss`, `store`,
    /// `too_large`, `error`).
    pub response_cache: Family<Labels, Counter>,
    /// Prefill calls of disaggregated pairs, by outcome (`ok`, `failed`,
    /// `busy`; the decode engine served the request alone on the last two).
    pub prefill: Family<Labels, Counter>,
    /// Semantic cache lookups and writes, by event (`hit`, `miss`, `store`,
    /// `too_large`, `error`).
    pub semantic_cache: Family<Labels, Counter>,
    /// Spend of answered requests at the configured prices, in currency units.
    pub cost: Family<Labels, Counter<f64, AtomicU64>>,
    pub audit_dropped: Counter,
    /// Audit records waiting in the on-disk spool.
    pub audit_spooled: Gauge,
    /// Audit batch writes the database refused.
    pub audit_write_errors: Counter,
    /// Limiter calls to Redis that failed or timed out (each failed open).
    pub limiter_errors: Counter,
    pub load_requests: Family<Labels, Counter>,
    pub loads: Family<Labels, Counter>,
    pub load_seconds: Family<Labels, Histogram>,
    pub load_waiting: Gauge,
    /// Predictive prefetch, by `event`: `asked` (a model named to an agent),
    /// `done` (its next heartbeats show it in RAM), `hit` (a load found it
    /// there).
    pub prefetch: Family<Labels, Counter>,
    tenants: RwLock<HashSet<String>>,
    max_tenants: usize,
    models: RwLock<HashSet<String>>,
    /// Per tenant label, then model label: the series a finished request
    /// adds to ([`GatewayMetrics::request_series`]).
    request_series: RwLock<HashMap<String, HashMap<String, Arc<RequestSeries>>>>,
    /// Counts removals of series: a handle to a series kept since an
    /// earlier count may point at one no longer exported, and is looked up
    /// again ([`GatewayMetrics::removals`]).
    removals: AtomicU64,
}

/// What a finished request adds to, for one tenant and model label pair:
/// each series looked up in its family the first time it is used.
pub struct RequestSeries {
    tenant: String,
    model: String,
    latency: OnceLock<Histogram>,
    ttft: OnceLock<Histogram>,
    /// Tokens by kind: prompt, completion, cached.
    tokens: [OnceLock<Counter>; 3],
    /// Requests by status, as statuses come.
    statuses: RwLock<Vec<(u16, Counter)>>,
}

/// The kinds of [`RequestSeries::tokens`], in order.
pub const TOKEN_KINDS: [&str; 3] = ["prompt", "completion", "cached"];

impl RequestSeries {
    fn new(tenant: &str, model: &str) -> RequestSeries {
        RequestSeries {
            tenant: tenant.to_string(),
            model: model.to_string(),
            latency: OnceLock::new(),
            ttft: OnceLock::new(),
            tokens: Default::default(),
            statuses: RwLock::new(Vec::new()),
        }
    }

    /// The requests counter of `status`.
    pub fn requests(&self, metrics: &GatewayMetrics, status: u16) -> Counter {
        if let Some((_, c)) = self.statuses.read().iter().find(|(s, _)| *s == status) {
            return c.clone();
        }
        let c = metrics
            .requests
            .get_or_create(&vec![
                ("tenant", self.tenant.clone()),
                ("model", self.model.clone()),
                ("status", status.to_string()),
            ])
            .clone();
        self.statuses.write().push((status, c.clone()));
        c
    }

    pub fn latency(&self, metrics: &GatewayMetrics) -> &Histogram {
        self.latency.get_or_init(|| metrics.latency.get_or_create(&vec![("model", self.model.clone())]).clone())
    }

    pub fn ttft(&self, metrics: &GatewayMetrics) -> &Histogram {
        self.ttft.get_or_init(|| metrics.ttft.get_or_create(&vec![("model", self.model.clone())]).clone())
    }

    /// The token counter of [`TOKEN_KINDS`]`[kind]`.
    pub fn tokens(&self, metrics: &GatewayMetrics, kind: usize) -> &Counter {
        self.tokens[kind].get_or_init(|| {
            let labels = vec![
                ("tenant", self.tenant.clone()),
                ("model", self.model.clone()),
                ("kind", TOKEN_KINDS[kind].to_string()),
            ];
            metrics.tokens.get_or_create(&labels).clone()
        })
    }
}

fn latency_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// 50 ms to about 27 minutes.
fn load_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 16))
}

impl GatewayMetrics {
    pub fn new(max_tenants: usize) -> Arc<Self> {
        let mut registry = Registry::default();
        let m = GatewayMetrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_buckets as fn() -> Histogram),
            ttft: Family::new_with_constructor(latency_buckets as fn() -> Histogram),
            active: Gauge::default(),
            tokens: Family::default(),
            upstream_up: Family::default(),
            breaker_state: Family::default(),
            upstream_active: Family::default(),
            attempts: Family::default(),
            retries: Counter::default(),
            rate_limited: Family::default(),
            rejected: Family::default(),
            queue_waiting: Family::default(),
            queue_seconds: Family::new_with_constructor(latency_buckets as fn() -> Histogram),
            kv_index_blocks: Gauge::default(),
            routed_hit_blocks: Family::default(),
            routed_blocks: Family::default(),
            vllm_kv_events: Family::default(),
            response_cache: Family::default(),
            prefill: Family::default(),
            semantic_cache: Family::default(),
            cost: Family::default(),
            audit_dropped: Counter::default(),
            audit_spooled: Gauge::default(),
            audit_write_errors: Counter::default(),
            limiter_errors: Counter::default(),
            load_requests: Family::default(),
            loads: Family::default(),
            load_seconds: Family::new_with_constructor(load_buckets as fn() -> Histogram),
            load_waiting: Gauge::default(),
            prefetch: Family::default(),
            tenants: RwLock::new(HashSet::new()),
            max_tenants,
            models: RwLock::new(HashSet::new()),
            removals: AtomicU64::new(0),
            request_series: RwLock::new(HashMap::new()),
            registry: Registry::default(),
        };
        registry.register(
            base(names::REQUESTS),
            "Requests answered, by tenant, model and HTTP status",
            m.requests.clone(),
        );
        registry.register(names::LATENCY_SECONDS, "Time from arrival to the last byte sent", m.latency.clone());
        registry.register(names::TTFT_SECONDS, "Time from arrival to the upstream's first body byte", m.ttft.clone());
        registry.register(names::ACTIVE_REQUESTS, "Requests in progress", m.active.clone());
        registry.register(base(names::TOKENS), "Tokens by tenant, model and kind", m.tokens.clone());
        registry.register(
            base(names::COST),
            "Spend of answered requests at the configured per-model prices, by tenant, model and currency",
            m.cost.clone(),
        );
        registry.register(
            names::UPSTREAM_UP,
            "Whether the upstream passed its last health check",
            m.upstream_up.clone(),
        );
        registry.register(
            names::BREAKER_STATE,
            "Circuit breaker per upstream: 0 closed, 1 half-open, 2 open",
            m.breaker_state.clone(),
        );
        registry.register(names::UPSTREAM_ACTIVE, "Requests in flight per upstream", m.upstream_active.clone());
        registry.register(base(names::UPSTREAM_ATTEMPTS), "Upstream attempts by outcome", m.attempts.clone());
        registry.register(base(names::RETRIES), "Attempts that retried on another upstream", m.retries.clone());
        registry.register(base(names::RATE_LIMITED), "Requests refused by a limit", m.rate_limited.clone());
        registry.register(base(names::REJECTED), "Requests refused before routing", m.rejected.clone());
        registry.register(names::QUEUE_WAITING, "Requests waiting for an upstream slot", m.queue_waiting.clone());
        registry.register(names::QUEUE_SECONDS, "Time requests waited for an upstream slot", m.queue_seconds.clone());
        registry.register(
            names::KV_INDEX_BLOCKS,
            "(block, upstream) pairs known from KV events",
            m.kv_index_blocks.clone(),
        );
        registry.register(
            base(names::ROUTED_HIT_BLOCKS),
            "Prompt blocks the chosen upstream held",
            m.routed_hit_blocks.clone(),
        );
        registry.register(base(names::ROUTED_BLOCKS), "Prompt blocks of routed requests", m.routed_blocks.clone());
        registry.register(base(names::AUDIT_DROPPED), "Audit records dropped", m.audit_dropped.clone());
        registry.register(
            base(names::RESPONSE_CACHE),
            "Response cache lookups and writes, by event",
            m.response_cache.clone(),
        );
        registry.register(
            base(names::SEMANTIC_CACHE),
            "Semantic cache lookups and writes, by event",
            m.semantic_cache.clone(),
        );
        registry.register(
            base(names::PREFILL),
            "Prefill calls of disaggregated pairs, by outcome (ok, failed, busy)",
            m.prefill.clone(),
        );
        registry.register(
            base(names::VLLM_KV_EVENTS),
            "vLLM KV event blocks and batches read, by outcome",
            m.vllm_kv_events.clone(),
        );
        registry.register(
            names::AUDIT_SPOOLED,
            "Audit records waiting in the spool for the database",
            m.audit_spooled.clone(),
        );
        registry.register(
            base(names::AUDIT_WRITE_ERRORS),
            "Audit batch writes the database refused (retried or spooled)",
            m.audit_write_errors.clone(),
        );
        registry.register(
            base(names::LIMITER_ERRORS),
            "Limiter calls to Redis that failed or timed out (the request was admitted)",
            m.limiter_errors.clone(),
        );
        registry.register(base(names::MODEL_LOAD_REQUESTS), "Model loads asked of agents", m.load_requests.clone());
        registry.register(base(names::MODEL_LOADS), "Model loads finished, by outcome", m.loads.clone());
        registry.register(
            names::MODEL_LOAD_SECONDS,
            "Time from asking an agent for a model to its engine joining",
            m.load_seconds.clone(),
        );
        registry.register(names::MODEL_LOAD_WAITING, "Requests held while their model loads", m.load_waiting.clone());
        registry.register(
            PREFETCH_BASE,
            "Predictive prefetches, by event: asked of an agent, done (in its RAM tier), hit (a load found it there)",
            m.prefetch.clone(),
        );
        // Queue gauges exist from the start (0 is news too).
        for p in crate::types::Priority::ALL {
            m.queue_waiting.get_or_create(&vec![("priority", p.as_str().to_string())]).set(0);
        }
        Arc::new(GatewayMetrics { registry, ..m })
    }

    /// How many times series were removed so far; handles kept from
    /// `get_or_create` are current while this stays the same.
    pub fn removals(&self) -> u64 {
        self.removals.load(std::sync::atomic::Ordering::Acquire)
    }

    /// To call after removing series (after, so that a handle looked up
    /// meanwhile is looked up again).
    pub fn removed(&self) {
        self.removals.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Declares a model as a label value (configured or served models).
    pub fn know_model(&self, model: &str) {
        if !self.models.read().contains(model) {
            self.models.write().insert(model.to_string());
        }
    }

    /// The label value for a model: itself when known, else `unknown`.
    pub fn model_label(&self, model: Option<&str>) -> String {
        self.model_label_of(model).to_string()
    }

    fn model_label_of<'a>(&self, model: Option<&'a str>) -> &'a str {
        match model {
            Some(m) if self.models.read().contains(m) => m,
            _ => "unknown",
        }
    }

    /// The label value for a tenant: itself while the table has room, else
    /// `other`; `none` for requests without a verified key.
    pub fn tenant_label(&self, tenant: Option<&str>) -> String {
        self.tenant_label_of(tenant).to_string()
    }

    fn tenant_label_of<'a>(&self, tenant: Option<&'a str>) -> &'a str {
        let Some(t) = tenant else { return "none" };
        if self.tenants.read().contains(t) {
            return t;
        }
        let mut w = self.tenants.write();
        if w.contains(t) || w.len() < self.max_tenants {
            w.insert(t.to_string());
            return t;
        }
        "other"
    }

    /// The series a finished request of `tenant` for `model` adds to (their
    /// label values as [`Self::tenant_label`] and [`Self::model_label`] give
    /// them), looked up in the families once per label pair.
    pub fn request_series(&self, tenant: Option<&str>, model: Option<&str>) -> Arc<RequestSeries> {
        let (tenant, model) = (self.tenant_label_of(tenant), self.model_label_of(model));
        if let Some(s) = self.request_series.read().get(tenant).and_then(|m| m.get(model)) {
            return s.clone();
        }
        let series = Arc::new(RequestSeries::new(tenant, model));
        let mut w = self.request_series.write();
        w.entry(tenant.to_string()).or_default().entry(model.to_string()).or_insert(series).clone()
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            tracing::error!("metrics encoding failed");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_labels_are_capped() {
        let m = GatewayMetrics::new(2);
        assert_eq!(m.tenant_label(Some("a")), "a");
        assert_eq!(m.tenant_label(Some("b")), "b");
        assert_eq!(m.tenant_label(Some("c")), "other");
        assert_eq!(m.tenant_label(Some("a")), "a");
        assert_eq!(m.tenant_label(None), "none");
    }

    #[test]
    fn unknown_models_share_one_label() {
        let m = GatewayMetrics::new(2);
        m.know_model("m1");
        assert_eq!(m.model_label(Some("m1")), "m1");
        assert_eq!(m.model_label(Some("typo-model")), "unknown");
        assert_eq!(m.model_label(None), "unknown");
    }

    #[test]
    fn renders_every_catalogued_name() {
        let m = GatewayMetrics::new(2);
        let labels =
            |pairs: &[(&'static str, &str)]| -> Labels { pairs.iter().map(|(k, v)| (*k, v.to_string())).collect() };
        m.requests.get_or_create(&labels(&[("tenant", "a"), ("model", "m"), ("status", "200")])).inc();
        m.latency.get_or_create(&labels(&[("model", "m")])).observe(0.1);
        m.ttft.get_or_create(&labels(&[("model", "m")])).observe(0.01);
        m.tokens.get_or_create(&labels(&[("tenant", "a"), ("model", "m"), ("kind", "prompt")])).inc();
        m.upstream_up.get_or_create(&labels(&[("upstream", "e")])).set(1);
        m.breaker_state.get_or_create(&labels(&[("upstream", "e")])).set(0);
        m.upstream_active.get_or_create(&labels(&[("upstream", "e")])).set(0);
        m.attempts.get_or_create(&labels(&[("upstream", "e"), ("outcome", "ok")])).inc();
        m.rate_limited.get_or_create(&labels(&[("scope", "key"), ("limit", "requests_per_minute")])).inc();
        m.rejected.get_or_create(&labels(&[("reason", "auth")])).inc();
        m.queue_waiting.get_or_create(&labels(&[("priority", "standard")])).set(0);
        m.queue_seconds.get_or_create(&labels(&[("priority", "standard")])).observe(0.0);
        m.routed_hit_blocks.get_or_create(&labels(&[("policy", "kv_aware")])).inc();
        m.routed_blocks.get_or_create(&labels(&[("policy", "kv_aware")])).inc();
        m.load_requests.get_or_create(&labels(&[("model", "m")])).inc();
        m.loads.get_or_create(&labels(&[("model", "m"), ("outcome", "succeeded")])).inc();
        m.load_seconds.get_or_create(&labels(&[("model", "m")])).observe(3.0);
        m.response_cache.get_or_create(&labels(&[("event", "hit")])).inc();
        m.semantic_cache.get_or_create(&labels(&[("event", "hit")])).inc();
        m.cost.get_or_create(&labels(&[("tenant", "a"), ("model", "m"), ("currency", "USD")])).inc_by(0.5);
        m.prefill.get_or_create(&labels(&[("outcome", "ok")])).inc();
        m.vllm_kv_events.get_or_create(&labels(&[("outcome", "stored")])).inc();
        let text = m.render();
        for name in names::ALL {
            assert!(text.contains(&format!("# TYPE {} ", base(name))), "{name} missing from:\n{text}");
        }
    }
}
