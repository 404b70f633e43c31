//! The response cache: a whole answer kept per tenant for requests that ask
//! for determinism (`temperature` 0, or a `seed`), so that the same request
//! again is answered without an engine.
//!
//! The key is a blake3 hash of the tenant, the endpoint and the request
//! body normalized (object keys sorted at every depth; `stream`,
//! `stream_options` and `user` left out, as they do not change the answer),
//! so tenants never see each other's answers and field order does not
//! matter. Only whole (non-streamed) 200 answers are kept, in process memory
//! (bounded, oldest out first) or in Redis (shared by gateway replicas,
//! keys hash-tagged per tenant like the limits'), each for `ttl_s`.
//!
//! Answers carry `x-granary-cache: hit` or `miss`. A request with
//! `cache-control: no-cache` skips the lookup (its answer still refreshes
//! the entry); `no-store` also keeps its answer out.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::metrics::GatewayMetrics;

/// The response header saying whether the cache answered.
pub const CACHE_HEADER: &str = "x-granary-cache";

/// `[gateway.response_cache]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Off by default: a cached answer is not charged tokens, and an
    /// operator decides whether that is wanted.
    pub enabled: bool,
    /// `memory` (this process) or `redis` (the `[gateway] redis` server,
    /// shared by replicas).
    pub backend: CacheBackend,
    /// How long an answer is kept.
    pub ttl_s: u64,
    /// Answers kept in memory at most (the oldest go first).
    pub max_entries: usize,
    /// Larger answers are not kept.
    pub max_answer_bytes: usize,
    /// Redis keys start with this.
    pub redis_prefix: String,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: false,
            backend: CacheBackend::Memory,
            ttl_s: 300,
            max_entries: 10_000,
            max_answer_bytes: 1 << 20,
            redis_prefix: "granary:cache:".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheBackend {
    Memory,
    Redis,
}

/// A request's place in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey {
    tenant: i64,
    hash: [u8; 32],
    /// Keep the answer once it comes (no `cache-control: no-store`).
    pub store: bool,
}

/// What the request's `cache-control` header allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Directives {
    pub lookup: bool,
    pub store: bool,
}

impl Directives {
    pub fn of(headers: &HeaderMap) -> Directives {
        let mut d = Directives { lookup: true, store: true };
        for v in headers.get_all(header::CACHE_CONTROL) {
            for part in v.to_str().unwrap_or("").split(',') {
                match part.trim().to_ascii_lowercase().as_str() {
                    "no-cache" => d.lookup = false,
                    "no-store" => {
                        d.lookup = false;
                        d.store = false;
                    }
                    _ => {}
                }
            }
        }
        d
    }
}

/// Whether a request asks for determinism: `temperature` 0 or a `seed`.
pub fn deterministic(body: &serde_json::Map<String, Value>) -> bool {
    deterministic_fields(body.get("temperature"), body.get("seed"))
}

/// [`deterministic`] from the two fields it reads.
pub fn deterministic_fields(temperature: Option<&Value>, seed: Option<&Value>) -> bool {
    temperature.and_then(Value::as_f64) == Some(0.0) || seed.is_some_and(Value::is_number)
}

/// Object keys sorted at every depth, so that field order does not matter;
/// integral numbers written as integers.
fn canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(k.clone()).to_string().as_bytes());
                out.push(b':');
                canonical(&m[k], out);
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(x, out);
            }
            out.push(b']');
        }
        // `0.0` and `0` ask for the same thing.
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => {
                out.extend_from_slice((f as i64).to_string().as_bytes())
            }
            _ => out.extend_from_slice(n.to_string().as_bytes()),
        },
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

impl CacheKey {
    /// The key of a request by `tenant` to `path` with `body`.
    pub fn new(tenant: i64, path: &str, body: &serde_json::Map<String, Value>, store: bool) -> CacheKey {
        let mut h = blake3::Hasher::new();
        h.update(b"granary/response-cache/v1\0");
        h.update(&tenant.to_le_bytes());
        h.update(path.as_bytes());
        h.update(b"\0");
        let mut norm = body.clone();
        for k in ["stream", "stream_options", "user"] {
            norm.remove(k);
        }
        let mut buf = Vec::new();
        canonical(&Value::Object(norm), &mut buf);
        h.update(&buf);
        CacheKey { tenant, hash: *h.finalize().as_bytes(), store }
    }

    /// The hash naming the entry.
    pub fn digest(&self) -> [u8; 32] {
        self.hash
    }

    fn redis_key(&self, prefix: &str) -> String {
        format!("{prefix}{{t{}}}:{}", self.tenant, hex::encode(self.hash))
    }
}

struct Entry {
    body: Bytes,
    until: Instant,
}

/// An entry's identity: tenant and hash.
type Id = (i64, [u8; 32]);

/// Answers kept in this process, and their arrival order.
struct Memory {
    max_entries: usize,
    inner: Mutex<(HashMap<Id, Entry>, VecDeque<Id>)>,
}

impl Memory {
    fn get(&self, k: &CacheKey) -> Option<Bytes> {
        let mut g = self.inner.lock();
        let id = (k.tenant, k.hash);
        match g.0.get(&id) {
            Some(e) if e.until > Instant::now() => Some(e.body.clone()),
            Some(_) => {
                g.0.remove(&id);
                None
            }
            None => None,
        }
    }

    fn put(&self, k: &CacheKey, body: Bytes, ttl: Duration) {
        let mut g = self.inner.lock();
        let (map, order) = &mut *g;
        let id = (k.tenant, k.hash);
        if map.insert(id, Entry { body, until: Instant::now() + ttl }).is_none() {
            order.push_back(id);
        }
        while map.len() > self.max_entries {
            match order.pop_front() {
                Some(old) => {
                    map.remove(&old);
                }
                None => break,
            }
        }
        // Entries replaced or expired leave stale ids behind: trim them.
        if order.len() > 2 * self.max_entries.max(1) {
            order.retain(|id| map.contains_key(id));
        }
    }
}

enum Store {
    Memory(Memory),
    /// Filled by a background task once connected; until then, misses.
    Redis(Arc<RwLock<Option<ConnectionManager>>>),
}

/// The response cache (see the module's documentation).
pub struct ResponseCache {
    cfg: CacheConfig,
    store: Store,
    metrics: Arc<GatewayMetrics>,
}

impl ResponseCache {
    /// The cache `cfg` describes, or `None` when it is off. A Redis one
    /// connects in the background (needs a Tokio runtime).
    pub fn new(
        cfg: &CacheConfig,
        redis_url: Option<&str>,
        metrics: Arc<GatewayMetrics>,
    ) -> anyhow::Result<Option<ResponseCache>> {
        if !cfg.enabled {
            return Ok(None);
        }
        let store = match cfg.backend {
            CacheBackend::Memory => Store::Memory(Memory {
                max_entries: cfg.max_entries.max(1),
                inner: Mutex::new((HashMap::new(), VecDeque::new())),
            }),
            CacheBackend::Redis => {
                let Some(url) = redis_url else {
                    anyhow::bail!("gateway.response_cache.backend: \"redis\" needs gateway.redis");
                };
                if url.contains(',') {
                    anyhow::bail!(
                        "gateway.response_cache.backend: \"redis\" needs a single Redis server; with a Redis Cluster, use \"memory\""
                    );
                }
                let client = redis::Client::open(url)
                    .map_err(|_| anyhow::anyhow!("gateway.response_cache: the Redis URL is not valid"))?;
                let slot = Arc::new(RwLock::new(None));
                let weak = Arc::downgrade(&slot);
                tokio::runtime::Handle::try_current()
                    .map_err(|_| anyhow::anyhow!("gateway.response_cache: Redis needs a Tokio runtime"))?
                    .spawn(async move {
                        let mut delay = Duration::from_millis(100);
                        loop {
                            match ConnectionManager::new(client.clone()).await {
                                Ok(c) => {
                                    if let Some(s) = weak.upgrade() {
                                        *s.write() = Some(c);
                                        tracing::info!("response cache: connected to Redis");
                                    }
                                    return;
                                }
                                Err(e) => {
                                    if weak.strong_count() == 0 {
                                        return;
                                    }
                                    tracing::warn!(error = %e, "response cache: cannot reach Redis yet");
                                    tokio::time::sleep(delay).await;
                                    delay = (delay * 2).min(Duration::from_secs(5));
                                }
                            }
                        }
                    });
                Store::Redis(slot)
            }
        };
        Ok(Some(ResponseCache { cfg: cfg.clone(), store, metrics }))
    }

    fn count(&self, event: &str) {
        self.metrics.response_cache.get_or_create(&vec![("event", event.to_string())]).inc();
    }

    /// The kept answer for `key` (counted as a hit or a miss).
    pub async fn get(&self, key: &CacheKey) -> Option<Bytes> {
        let found = match &self.store {
            Store::Memory(m) => m.get(key),
            Store::Redis(slot) => {
                let conn = slot.read().clone();
                match conn {
                    Some(mut c) => {
                        let k = key.redis_key(&self.cfg.redis_prefix);
                        let got = tokio::time::timeout(
                            Duration::from_millis(200),
                            redis::cmd("GET").arg(&k).query_async::<Option<Vec<u8>>>(&mut c),
                        )
                        .await;
                        match got {
                            Ok(Ok(v)) => v.map(Bytes::from),
                            Ok(Err(e)) => {
                                self.count("error");
                                tracing::debug!(error = %e, "response cache: Redis GET failed");
                                None
                            }
                            Err(_) => {
                                self.count("error");
                                None
                            }
                        }
                    }
                    None => None,
                }
            }
        };
        self.count(if found.is_some() { "hit" } else { "miss" });
        found
    }

    /// Keeps an answer (unless it is too large): at once in memory, in the
    /// background in Redis (the answer does not wait for it).
    pub fn put(&self, key: &CacheKey, body: Bytes) {
        if body.len() > self.cfg.max_answer_bytes {
            self.count("too_large");
            return;
        }
        let ttl = Duration::from_secs(self.cfg.ttl_s.max(1));
        match &self.store {
            Store::Memory(m) => {
                m.put(key, body, ttl);
                self.count("store");
            }
            Store::Redis(slot) => {
                let conn = slot.read().clone();
                let Some(mut c) = conn else { return };
                let k = key.redis_key(&self.cfg.redis_prefix);
                let metrics = self.metrics.clone();
                tokio::spawn(async move {
                    let set =
                        redis::cmd("SET").arg(&k).arg(body.as_ref()).arg("PX").arg(ttl.as_millis() as u64).to_owned();
                    let ok = matches!(
                        tokio::time::timeout(Duration::from_millis(500), set.query_async::<()>(&mut c)).await,
                        Ok(Ok(()))
                    );
                    let event = if ok { "store" } else { "error" };
                    metrics.response_cache.get_or_create(&vec![("event", event.to_string())]).inc();
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn keys_ignore_field_order_and_stream_flags_but_not_tenants_or_content() {
        let a =
            body(serde_json::json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}));
        let b = body(
            serde_json::json!({"messages": [{"content": "x", "role": "user"}], "stream": false, "model": "m", "temperature": 0, "user": "u1"}),
        );
        let k = |t, b: &serde_json::Map<String, Value>| CacheKey::new(t, "/v1/chat/completions", b, true).hash;
        assert_eq!(k(1, &a), k(1, &b));
        assert_ne!(k(1, &a), k(2, &a), "tenants never share entries");
        let mut c = a.clone();
        c.insert("max_tokens".into(), 5.into());
        assert_ne!(k(1, &a), k(1, &c));
        assert_ne!(k(1, &a), CacheKey::new(1, "/v1/completions", &a, true).hash);
    }

    #[test]
    fn only_deterministic_requests_qualify() {
        assert!(deterministic(&body(serde_json::json!({"temperature": 0}))));
        assert!(deterministic(&body(serde_json::json!({"temperature": 0.0}))));
        assert!(deterministic(&body(serde_json::json!({"temperature": 0.9, "seed": 7}))));
        assert!(!deterministic(&body(serde_json::json!({"temperature": 0.2}))));
        assert!(!deterministic(&body(serde_json::json!({}))), "engines' default temperature is not 0");
    }

    #[test]
    fn cache_control_turns_lookup_and_storing_off() {
        let d = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CACHE_CONTROL, v.parse().unwrap());
            Directives::of(&h)
        };
        assert_eq!(Directives::of(&HeaderMap::new()), Directives { lookup: true, store: true });
        assert_eq!(d("No-Cache"), Directives { lookup: false, store: true });
        assert_eq!(d("max-age=0, no-store"), Directives { lookup: false, store: false });
    }

    #[test]
    fn the_section_parses_and_is_checked() {
        use crate::config::GatewayConfig;
        let c = GatewayConfig::from_toml("[gateway.response_cache]\nenabled = true\nttl_s = 60\n").unwrap();
        assert!(c.gateway.response_cache.enabled);
        assert_eq!((c.gateway.response_cache.ttl_s, c.gateway.response_cache.backend), (60, CacheBackend::Memory));
        let err = |s: &str| GatewayConfig::from_toml(s).unwrap_err().field;
        assert_eq!(
            err("[gateway.response_cache]\nenabled = true\nbackend = \"redis\"\n"),
            "gateway.response_cache.backend"
        );
        assert_eq!(err("[gateway.response_cache]\nbackend = \"disk\"\n"), "gateway.response_cache.backend");
        assert_eq!(err("[gateway.response_cache]\nenabled = true\nttl_s = 0\n"), "gateway.response_cache");
    }

    #[test]
    fn memory_entries_expire_and_the_oldest_go_first() {
        let m = Memory { max_entries: 2, inner: Mutex::new((HashMap::new(), VecDeque::new())) };
        let key = |i: i64| CacheKey { tenant: i, hash: [0; 32], store: true };
        m.put(&key(1), Bytes::from_static(b"1"), Duration::from_secs(60));
        m.put(&key(2), Bytes::from_static(b"2"), Duration::from_secs(60));
        m.put(&key(3), Bytes::from_static(b"3"), Duration::from_secs(60));
        assert_eq!((m.get(&key(1)), m.get(&key(3))), (None, Some(Bytes::from_static(b"3"))));
        m.put(&key(4), Bytes::from_static(b"4"), Duration::ZERO);
        assert_eq!(m.get(&key(4)), None, "expired");
    }
}
