//! The gateway's configuration file:
//!
//! ```toml
//! [gateway]
//! listen = "127.0.0.1:8080"
//! database = "sqlite://gateway.db"      # or postgres://user:pass@host/db
//! redis = "redis://127.0.0.1:6379"      # shared limits; in-process when absent
//!
//! [[upstream]]
//! name = "engine-a"
//! url = "http://127.0.0.1:8001"
//! max_active = 64
//!
//! [[pool]]
//! name = "main"
//! upstreams = ["engine-a"]
//! routing = { policy = "kv_aware" }
//! ```
//!
//! Everything but the upstreams has a default. [`GatewayConfig::validate`]
//! checks references between sections and names the field at fault.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::routing::PolicyConfig;

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    #[serde(default)]
    pub gateway: GatewaySection,
    #[serde(default, rename = "upstream")]
    pub upstreams: Vec<UpstreamConfig>,
    /// Pools of upstreams with a routing policy each; when none is given,
    /// every upstream forms one `default` pool routed by `kv_aware`.
    #[serde(default, rename = "pool")]
    pub pools: Vec<PoolConfig>,
}

/// `[gateway]`: the front and its shared state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaySection {
    /// Where clients connect. Loopback unless configured otherwise.
    pub listen: SocketAddr,
    /// Keys, tenants and audit records: `sqlite://PATH`, `sqlite::memory:`
    /// or `postgres://...`.
    pub database: String,
    /// Shared rate-limit counters; in-process counters when absent.
    pub redis: Option<String>,
    /// The environment variable holding the admin token (the token itself
    /// never sits in the file). Without it, the admin API is disabled.
    /// The admin token may do everything the scoped tokens below may.
    pub admin_token_env: String,
    /// The environment variable holding the agent token: node agents'
    /// heartbeats (`POST /admin/v1/agents/heartbeat`) and nothing else.
    /// Unset: agents need the admin token.
    pub agent_token_env: String,
    /// The environment variable holding the metrics token: `GET /metrics`
    /// and nothing else (for the Prometheus scraper). Unset: the scraper
    /// needs the admin token.
    pub metrics_token_env: String,
    /// How long a key's previous secret keeps working after a rotation
    /// (`POST /admin/v1/keys/{id}/rotate` without `grace_s`).
    pub key_rotation_grace_s: u64,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Seconds a client has to send a request's headers, from when the
    /// gateway is ready for them (a new connection, or the end of the
    /// previous answer on a kept-alive one); then the connection is closed
    /// (slowloris, idle keep-alive). 0: no limit.
    pub header_timeout_s: u64,
    /// Most client connections open at once; one more is answered 503
    /// `too_many_connections` and closed (on TLS: closed before the
    /// handshake). Redis's `maxclients` default.
    pub max_connections: usize,
    /// Connecting to an upstream.
    pub connect_timeout_ms: u64,
    /// From sending a request upstream to its first response byte.
    pub first_byte_timeout_s: u64,
    /// Longest silence between two chunks of a response.
    pub idle_timeout_s: u64,
    /// Attempts per request (first try included), on connect errors and
    /// 5xx answers before the first byte.
    pub max_attempts: u32,
    /// Backoff before the second attempt; doubles after each.
    pub retry_backoff_ms: u64,
    /// How long a request may wait for capacity when every upstream is full.
    pub queue_timeout_s: u64,
    /// How long a verified key is remembered before the database is asked again.
    pub key_cache_ms: u64,
    /// Tenants with their own label values in metrics; the rest are `other`.
    pub metrics_max_tenants: usize,
    pub health: HealthConfig,
    pub breaker: BreakerConfig,
    /// TLS on the front; plain HTTP when absent.
    pub tls: Option<ServerTls>,
    /// Node agents: engines they report join the upstream set at runtime.
    pub agents: AgentsConfig,
    /// Model-level fallbacks: `big = ["small"]` sends a request for `big`
    /// to `small`'s pools when no upstream of `big` can take it (none
    /// routable, or every attempt failed before the first byte). Only to
    /// models the key may use; tried in the order listed.
    pub model_fallbacks: BTreeMap<String, Vec<String>>,
    /// The completion tokens reserved against token budgets at admission
    /// for a request that sends no `max_tokens` (its worst case is then
    /// unknown); the unused part is released when it ends.
    pub default_max_tokens: u64,
    /// Whether audit batches the database refuses are kept on disk (a file
    /// per batch) until it takes them again, replayed at start too (default
    /// true). Off: such batches are dropped and counted in
    /// `granary_gateway_audit_dropped_total`.
    pub audit_spool: bool,
    /// Where the spool is. Unset: beside a SQLite database's file
    /// (`gateway.db` spools to `gateway.db.audit-spool/`), or `audit-spool/`
    /// in the working directory for any other database; a SQLite database
    /// in memory has no spool unless one is named.
    pub audit_spool_dir: Option<PathBuf>,
    /// The most the audit spool may hold, in bytes (default 1 GiB).
    pub audit_spool_max_bytes: u64,
    /// How often day and month budgets are reloaded from the usage rollup
    /// into the limiter (raising counters, never lowering them), which
    /// rebuilds Redis counters that were lost; 0: only at start.
    pub budget_reload_s: u64,
    /// Per-model prices, for the cost column of usage reports.
    pub prices: crate::pricing::Prices,
    /// The response cache for deterministic requests (off by default).
    pub response_cache: crate::cache::CacheConfig,
    /// `[gateway.semantic_cache]`: answers to prompts that mean nearly the
    /// same, by embedding similarity (off by default).
    pub semantic_cache: crate::semantic::SemanticConfig,
}

impl Default for GatewaySection {
    fn default() -> Self {
        GatewaySection {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            database: "sqlite://gateway.db".into(),
            redis: None,
            admin_token_env: "GRANARY_ADMIN_TOKEN".into(),
            agent_token_env: "GRANARY_AGENT_TOKEN".into(),
            metrics_token_env: "GRANARY_METRICS_TOKEN".into(),
            key_rotation_grace_s: 86_400,
            max_body_bytes: 4 << 20,
            header_timeout_s: 30,
            max_connections: 10_000,
            connect_timeout_ms: 2_000,
            first_byte_timeout_s: 300,
            idle_timeout_s: 120,
            max_attempts: 3,
            retry_backoff_ms: 25,
            queue_timeout_s: 30,
            key_cache_ms: 2_000,
            metrics_max_tenants: 100,
            health: HealthConfig::default(),
            breaker: BreakerConfig::default(),
            tls: None,
            agents: AgentsConfig::default(),
            model_fallbacks: BTreeMap::new(),
            default_max_tokens: 4_096,
            audit_spool: true,
            audit_spool_dir: None,
            audit_spool_max_bytes: 1 << 30,
            budget_reload_s: 60,
            prices: crate::pricing::Prices::default(),
            response_cache: crate::cache::CacheConfig::default(),
            semantic_cache: crate::semantic::SemanticConfig::default(),
        }
    }
}

impl GatewaySection {
    /// The identity store's options this section sets (key cache, audit
    /// spool).
    pub fn identity_options(&self) -> crate::identity::IdentityOptions {
        crate::identity::IdentityOptions {
            key_cache: Duration::from_millis(self.key_cache_ms),
            audit_spool_dir: self.spool_dir(),
            audit_spool_max_bytes: self.audit_spool_max_bytes,
            ..crate::identity::IdentityOptions::default()
        }
    }

    /// The audit spool's directory, if it is on (see `audit_spool_dir`).
    pub fn spool_dir(&self) -> Option<PathBuf> {
        if !self.audit_spool {
            return None;
        }
        if let Some(dir) = &self.audit_spool_dir {
            return Some(dir.clone());
        }
        let Some(rest) = self.database.strip_prefix("sqlite:") else { return Some(PathBuf::from("audit-spool")) };
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() || path == ":memory:" || query.split('&').any(|kv| kv == "mode=memory") {
            return None;
        }
        let mut dir = PathBuf::from(path).into_os_string();
        dir.push(".audit-spool");
        Some(dir.into())
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn first_byte_timeout(&self) -> Duration {
        Duration::from_secs(self.first_byte_timeout_s)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_s)
    }
    pub fn queue_timeout(&self) -> Duration {
        Duration::from_secs(self.queue_timeout_s)
    }
}

/// Active health checks (`GET` of each upstream's `health_path`, `/health`
/// unless configured otherwise; none for upstreams with an empty one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    pub interval_ms: u64,
    pub timeout_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig { interval_ms: 1_000, timeout_ms: 1_000 }
    }
}

/// The circuit breaker each upstream has: after `failures` consecutive
/// failures (requests or health checks) it opens and the upstream gets no
/// traffic for `open_ms`; then one probe decides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    pub failures: u32,
    pub open_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig { failures: 3, open_ms: 2_000 }
    }
}

/// `[gateway.agents]`: node agents register with `POST
/// /admin/v1/agents/heartbeat` (admin token) and report the engines they run
/// and the models they can load. Each reported engine becomes an upstream
/// named `agent:<agent_id>:<model>` in an implicit pool per model; a request
/// for a model no upstream serves but an agent can load makes the gateway ask
/// that agent to load it, holding the request meanwhile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentsConfig {
    /// Accept heartbeats (off: the agents API answers 403 `agents_disabled`).
    pub enabled: bool,
    /// An agent not heard from for this long is dropped with its engines.
    pub ttl_ms: u64,
    /// How long a request for a model being loaded is held before it gets
    /// 503 `model_loading` (the load itself goes on).
    pub load_timeout_ms: u64,
    /// The routing policy of each model's pool of agent engines: a name
    /// (`"kv_aware"`) or a table like a pool's `routing`
    /// (`{ policy = "kv_aware", load_penalty = 2.0 }`).
    pub pool_policy: PoolPolicy,
    /// The most requests that may wait for one model's load; more get 503
    /// `model_load_queue_full` with `Retry-After` (0: no bound).
    pub load_queue: usize,
    /// Replicas per model (`[gateway.agents.models.NAME]`): kept warm, and
    /// more under load (see [`crate::agents::ModelScaling`]).
    pub models: BTreeMap<String, crate::agents::ModelScaling>,
    /// Which agent loads a model on demand: `locality` (the lowest
    /// estimated time to first token from where its weights and checkpoint
    /// are and the node's measured rates, see [`crate::agents::estimate`];
    /// near-equal estimates by the closer tier, then fewest engines, then
    /// most free memory) or `fewest_engines` (fewest engines, then most
    /// free memory, wherever the weights are).
    pub placement: Placement,
    /// Predictive prefetch: each heartbeat's answer names the models the
    /// agent should stage into its RAM tier, predicted from the last hour's
    /// requests of the tenants it served (see [`crate::agents::prefetch`]).
    /// Off by default: it downloads and copies weights no request asked
    /// for yet, a cost in registry traffic and node RAM an operator opts into.
    pub prefetch: bool,
    /// The most models one heartbeat answer asks an agent to prefetch.
    pub prefetch_max: usize,
}

/// `[gateway.agents] placement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The lowest estimated time to first token, from where the weights
    /// are (ServerlessLLM-style).
    #[default]
    Locality,
    /// The agent running fewest engines, blind to where the weights are.
    FewestEngines,
}

impl Default for AgentsConfig {
    fn default() -> Self {
        AgentsConfig {
            enabled: true,
            ttl_ms: 10_000,
            load_timeout_ms: 120_000,
            pool_policy: PoolPolicy::Full(PolicyConfig::KvAware { load_penalty: 1.0, approx_capacity_blocks: 0 }),
            load_queue: 256,
            models: BTreeMap::new(),
            placement: Placement::Locality,
            prefetch: false,
            prefetch_max: 2,
        }
    }
}

impl AgentsConfig {
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }
    pub fn load_timeout(&self) -> Duration {
        Duration::from_millis(self.load_timeout_ms)
    }
}

/// A policy given by name or in full.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a policy name (round_robin, least_load, session, kv_aware) or a table such as { policy = \"kv_aware\", load_penalty = 1.0 }"
)]
pub enum PoolPolicy {
    Name(PolicyName),
    Full(PolicyConfig),
}

/// The policies' names, for `pool_policy = "..."`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    RoundRobin,
    LeastLoad,
    Session,
    KvAware,
}

impl PoolPolicy {
    /// The policy with its defaults filled in.
    pub fn config(&self) -> PolicyConfig {
        match self {
            PoolPolicy::Full(c) => c.clone(),
            PoolPolicy::Name(PolicyName::RoundRobin) => PolicyConfig::RoundRobin,
            PoolPolicy::Name(PolicyName::LeastLoad) => PolicyConfig::LeastLoad,
            PoolPolicy::Name(PolicyName::Session) => PolicyConfig::Session { header: "x-session-id".into() },
            PoolPolicy::Name(PolicyName::KvAware) => {
                PolicyConfig::KvAware { load_penalty: 1.0, approx_capacity_blocks: 0 }
            }
        }
    }
}

/// Certificate and key (PEM) for the front; with `client_ca`, clients must
/// present a certificate signed by it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

/// How the gateway talks TLS to an upstream: the CA that signs its
/// certificate, and for mTLS the gateway's own certificate and key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTls {
    pub ca: PathBuf,
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
}

/// What an upstream does in a disaggregated pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

/// `[[upstream]]`: one OpenAI-compatible engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    /// Base URL (`http://host:port` or `https://...`); `/v1/...` is appended.
    pub url: String,
    /// Models it serves; discovered from its `/v1/models` when empty.
    #[serde(default)]
    pub models: Vec<String>,
    /// Requests in flight at most (0: unbounded). When every upstream of a
    /// request is full, the request waits (premium first).
    #[serde(default)]
    pub max_active: usize,
    #[serde(default)]
    pub role: Role,
    /// Follow its `/v1/kv/events` stream (Granary engines publish one).
    #[serde(default = "yes")]
    pub kv_events: bool,
    /// Send the tenant's KV namespace in `x-granary-namespace` (to Granary
    /// engines only; see `granary`).
    #[serde(default = "yes")]
    pub send_namespace: bool,
    /// Whether this is a Granary engine. Only Granary engines get Granary
    /// headers (`x-granary-namespace`: a tenant's name never reaches a third
    /// party) and are asked for their KV layout, KV events and tokenizer.
    /// Absent: detected, an upstream that answers `GET /v1/kv/config` in
    /// Granary's format is one (until then it is treated as not one).
    #[serde(default)]
    pub granary: Option<bool>,
    /// The environment variable holding this upstream's API key, sent as
    /// `Authorization: Bearer <key>` on every request to it (the client's
    /// own `Authorization` is never forwarded).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The path of the active health check (`GET`, any 2xx passes). Empty:
    /// passive health only, no probe; the breaker is driven by the outcomes
    /// of requests alone.
    #[serde(default = "default_health_path")]
    pub health_path: String,
    /// Model names as this upstream knows them: the name clients ask for →
    /// the name sent to it (`{ "llama-3-8b" = "meta-llama/Meta-Llama-3-8B-Instruct" }`).
    /// The upstream serves a client name when it lists either name; clients
    /// see the client name in `/v1/models`.
    #[serde(default)]
    pub model_map: BTreeMap<String, String>,
    #[serde(default)]
    pub tls: Option<UpstreamTls>,
    /// The model's tokenizer, for KV-aware routing to an engine that is not
    /// a Granary engine (Granary engines serve theirs): a `tokenizer.json`
    /// (with `tokenizer_config.json` beside it for the chat template), a
    /// directory holding one, or a GGUF file. Prompts are tokenized as the
    /// engine will, cut into blocks of `kv_block_tokens`, and routed to the
    /// engine holding the longest prefix — known from its KV events
    /// (`kv_events_zmq`) or, without them, remembered from where earlier
    /// prompts went.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block of a third-party engine (vLLM's `--block-size`).
    #[serde(default = "default_kv_block_tokens")]
    pub kv_block_tokens: usize,
    /// vLLM's KV event publisher (`--kv-events-config`'s `endpoint`), e.g.
    /// `tcp://10.0.0.5:5557`: its `BlockStored`, `BlockRemoved` and
    /// `AllBlocksCleared` events feed the KV index. Needs `tokenizer`.
    #[serde(default)]
    pub kv_events_zmq: Option<String>,
    /// The ZeroMQ topic vLLM publishes on (its `topic`; empty: every topic).
    #[serde(default)]
    pub kv_events_topic: String,
}

fn default_kv_block_tokens() -> usize {
    16
}

fn yes() -> bool {
    true
}

fn default_health_path() -> String {
    "/health".into()
}

impl UpstreamConfig {
    /// An upstream with defaults (for flags and tests).
    pub fn new(name: impl Into<String>, url: impl Into<String>) -> Self {
        UpstreamConfig {
            name: name.into(),
            url: url.into(),
            models: vec![],
            max_active: 0,
            role: Role::Both,
            kv_events: true,
            send_namespace: true,
            granary: None,
            api_key_env: None,
            health_path: default_health_path(),
            model_map: BTreeMap::new(),
            tls: None,
            tokenizer: None,
            kv_block_tokens: default_kv_block_tokens(),
            kv_events_zmq: None,
            kv_events_topic: String::new(),
        }
    }
}

/// `[[pool]]`: upstreams routed together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub name: String,
    pub upstreams: Vec<String>,
    /// Models this pool serves (empty: whatever its upstreams serve).
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub routing: PolicyConfig,
    /// Share of the pool's models' traffic it gets first (e.g. primary 80,
    /// failover 15, burst 5); the others are tried in descending weight
    /// when it fails.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    100
}

/// A configuration error, naming the field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

impl GatewayConfig {
    /// Parses TOML, naming the offending field on error.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let de = toml::Deserializer::new(text);
        let cfg: GatewayConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            bad(if path == "." { "config".to_string() } else { path }, e.into_inner().message().trim().to_string())
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The pools to route with: the configured ones, or one `default` pool
    /// of every upstream.
    pub fn effective_pools(&self) -> Vec<PoolConfig> {
        if !self.pools.is_empty() {
            return self.pools.clone();
        }
        vec![PoolConfig {
            name: "default".into(),
            upstreams: self.upstreams.iter().map(|u| u.name.clone()).collect(),
            models: vec![],
            routing: PolicyConfig::KvAware { load_penalty: 1.0, approx_capacity_blocks: 0 },
            weight: default_weight(),
        }]
    }

    /// Checks what serde cannot: names unique, references resolve, numbers
    /// in range, URLs parse.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let g = &self.gateway;
        if g.max_body_bytes < 1024 {
            return Err(bad("gateway.max_body_bytes", "must be at least 1024"));
        }
        if !g.audit_spool && g.audit_spool_dir.is_some() {
            return Err(bad("gateway.audit_spool_dir", "is set while gateway.audit_spool = false; remove one of them"));
        }
        if g.max_connections == 0 {
            return Err(bad("gateway.max_connections", "must be at least 1"));
        }
        if g.max_attempts == 0 || g.max_attempts > 10 {
            return Err(bad("gateway.max_attempts", "must be between 1 and 10"));
        }
        if g.breaker.failures == 0 {
            return Err(bad("gateway.breaker.failures", "must be at least 1"));
        }
        if g.health.interval_ms < 50 {
            return Err(bad("gateway.health.interval_ms", "must be at least 50"));
        }
        if g.metrics_max_tenants == 0 {
            return Err(bad("gateway.metrics_max_tenants", "must be at least 1"));
        }
        g.prices.validate().map_err(|(field, message)| bad(field, message))?;
        let rc = &g.response_cache;
        if rc.enabled && rc.backend == crate::cache::CacheBackend::Redis && g.redis.is_none() {
            return Err(bad("gateway.response_cache.backend", "\"redis\" needs gateway.redis"));
        }
        if rc.enabled && (rc.ttl_s == 0 || rc.max_entries == 0) {
            return Err(bad("gateway.response_cache", "ttl_s and max_entries must be at least 1"));
        }
        g.semantic_cache.validate().map_err(|(field, message)| bad(field, message))?;
        if g.database.trim().is_empty() {
            return Err(bad("gateway.database", "must not be empty"));
        }
        let a = &g.agents;
        if !(100..=86_400_000).contains(&a.ttl_ms) {
            return Err(bad("gateway.agents.ttl_ms", "must be between 100 and 86400000 (a day)"));
        }
        if !(100..=86_400_000).contains(&a.load_timeout_ms) {
            return Err(bad("gateway.agents.load_timeout_ms", "must be between 100 and 86400000 (a day)"));
        }
        if let PolicyConfig::KvAware { load_penalty, .. } = a.pool_policy.config() {
            if !load_penalty.is_finite() || load_penalty < 0.0 {
                return Err(bad("gateway.agents.pool_policy.load_penalty", "must be a finite number, 0 or more"));
            }
        }
        if let Some(h) = a.pool_policy.config().session_header() {
            if axum::http::HeaderName::try_from(h.to_ascii_lowercase()).is_err() {
                return Err(bad("gateway.agents.pool_policy.header", format!("{h:?} is not a header name")));
            }
        }
        let mut names = HashSet::new();
        for (i, u) in self.upstreams.iter().enumerate() {
            let field = |f: &str| format!("upstream[{i}].{f}");
            if u.name.is_empty() || !u.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return Err(bad(field("name"), "letters, digits, '-', '_' and '.' only, not empty"));
            }
            if !names.insert(u.name.as_str()) {
                return Err(bad(field("name"), format!("duplicate upstream name {:?}", u.name)));
            }
            match url::Url::parse(&u.url) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
                Ok(_) => return Err(bad(field("url"), "must be an http:// or https:// URL with a host")),
                Err(e) => return Err(bad(field("url"), e.to_string())),
            }
            if u.tls.is_some() && !u.url.starts_with("https://") {
                return Err(bad(field("tls"), "needs an https:// url"));
            }
            if let Some(t) = &u.tls {
                if t.cert.is_some() != t.key.is_some() {
                    return Err(bad(field("tls"), "cert and key go together"));
                }
            }
            if !u.health_path.is_empty() && !u.health_path.starts_with('/') {
                return Err(bad(field("health_path"), "must start with '/' (or be empty: passive health only)"));
            }
            if let Some((from, to)) = u.model_map.iter().find(|(k, v)| k.is_empty() || v.is_empty()) {
                return Err(bad(field("model_map"), format!("empty model name in {from:?} = {to:?}")));
            }
            if !(1..=4096).contains(&u.kv_block_tokens) {
                return Err(bad(field("kv_block_tokens"), "must be between 1 and 4096"));
            }
            if let Some(ep) = &u.kv_events_zmq {
                if ep.strip_prefix("tcp://").is_none_or(|rest| rest.rsplit_once(':').is_none()) {
                    return Err(bad(field("kv_events_zmq"), "must be a tcp://host:port endpoint"));
                }
                if u.tokenizer.is_none() {
                    return Err(bad(
                        field("kv_events_zmq"),
                        "needs `tokenizer`: prompts must be tokenized as the engine does to meet its blocks",
                    ));
                }
                if u.granary == Some(true) {
                    return Err(bad(
                        field("kv_events_zmq"),
                        "is for vLLM engines; a Granary engine's events come over HTTP",
                    ));
                }
            }
        }
        for (model, to) in &g.model_fallbacks {
            if let Some(i) = to.iter().position(|m| m.is_empty() || m == model) {
                return Err(bad(
                    format!("gateway.model_fallbacks.{model}[{i}]"),
                    "must name another model, not empty nor the model itself",
                ));
            }
        }
        let mut pool_names = HashSet::new();
        for (i, p) in self.pools.iter().enumerate() {
            let field = |f: &str| format!("pool[{i}].{f}");
            if !pool_names.insert(p.name.as_str()) {
                return Err(bad(field("name"), format!("duplicate pool name {:?}", p.name)));
            }
            if p.upstreams.is_empty() {
                return Err(bad(field("upstreams"), "a pool needs at least one upstream"));
            }
            for (j, name) in p.upstreams.iter().enumerate() {
                if !names.contains(name.as_str()) {
                    return Err(bad(format!("pool[{i}].upstreams[{j}]"), format!("no upstream named {name:?}")));
                }
            }
            if p.weight == 0 {
                return Err(bad(field("weight"), "must be at least 1"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
