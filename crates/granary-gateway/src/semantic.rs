//! The semantic cache (`[gateway.semantic_cache]`, off by default): a whole
//! answer kept per tenant and handed to a later request whose prompt means
//! nearly the same, judged by the cosine similarity of the prompts'
//! embeddings, which an engine serving `embedding_model` computes
//! (`POST /v1/embeddings`; Granary engines serve it).
//!
//! Only requests the exact cache would take qualify (whole answers, asking
//! for determinism: `temperature` 0 or a `seed`), and only a request whose
//! other fields (model, `max_tokens`, sampling, tools...) are the same as
//! the kept one's: only the prompt may differ. The threshold is per tenant
//! (`tenant_thresholds`, else `threshold`). Hits carry `x-granary-cache:
//! hit` and `x-granary-cache-match: semantic`; `cache-control: no-cache`
//! and `no-store` work as for the exact cache. Entries live in this
//! process, at most `max_entries_per_tenant` per tenant (the oldest go
//! first), each for `ttl_s`; a lookup compares against every live entry of
//! the tenant with the same other fields. An embedding that fails or takes
//! longer than `timeout_ms` is a miss. Counted in
//! `granary_gateway_semantic_cache_total{event}` (`hit`, `miss`, `store`,
//! `too_large`, `error`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::metrics::GatewayMetrics;

/// On hits: which cache answered, `exact` or `semantic`.
pub const MATCH_HEADER: &str = "x-granary-cache-match";

/// `[gateway.semantic_cache]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SemanticConfig {
    /// Off by default: a near match is not the same question, and an
    /// operator decides whether that is wanted (and for which tenants, by
    /// their thresholds).
    pub enabled: bool,
    /// The model whose engines embed prompts (one of the gateway's
    /// upstreams must serve it).
    pub embedding_model: String,
    /// Cosine similarity a kept prompt needs to answer (0 to 1].
    pub threshold: f32,
    /// Per tenant (by name), instead of `threshold`; above 1 turns the
    /// cache off for that tenant.
    pub tenant_thresholds: BTreeMap<String, f32>,
    /// How long an answer is kept.
    pub ttl_s: u64,
    /// Answers kept per tenant at most (the oldest go first).
    pub max_entries_per_tenant: usize,
    /// Larger answers are not kept.
    pub max_answer_bytes: usize,
    /// How long the embedding may take before the request goes on as a miss.
    pub timeout_ms: u64,
}

impl Default for SemanticConfig {
    fn default() -> Self {
        SemanticConfig {
            enabled: false,
            embedding_model: String::new(),
            threshold: 0.95,
            tenant_thresholds: BTreeMap::new(),
            ttl_s: 300,
            max_entries_per_tenant: 1_000,
            max_answer_bytes: 1 << 20,
            timeout_ms: 2_000,
        }
    }
}

impl SemanticConfig {
    /// Checks the section; the error names the field.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let field = |f: &str| format!("gateway.semantic_cache.{f}");
        if !self.enabled {
            return Ok(());
        }
        if self.embedding_model.trim().is_empty() {
            return Err((field("embedding_model"), "must name a model when the semantic cache is enabled".into()));
        }
        let good = |t: f32| t.is_finite() && t > 0.0;
        if !good(self.threshold) || self.threshold > 1.0 {
            return Err((field("threshold"), format!("must be in (0, 1] (not {})", self.threshold)));
        }
        for (tenant, t) in &self.tenant_thresholds {
            if !good(*t) {
                return Err((field(&format!("tenant_thresholds.{tenant}")), format!("must be above 0 (not {t})")));
            }
        }
        if self.ttl_s == 0 || self.max_entries_per_tenant == 0 || self.timeout_ms == 0 {
            return Err((field("ttl_s"), "ttl_s, max_entries_per_tenant and timeout_ms must be at least 1".into()));
        }
        Ok(())
    }
}

/// The text of a prompt, as the embedding sees it: chat messages as
/// `role: content` lines, a completion prompt as it is. `None` for shapes
/// with no single text (token ids, several prompts).
pub fn prompt_text(chat: bool, body: &serde_json::Map<String, Value>) -> Option<String> {
    if chat {
        let mut out = String::new();
        for m in body.get("messages")?.as_array()? {
            let role = m.get("role")?.as_str()?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    parts.iter().filter_map(|p| p.get("text")?.as_str()).collect::<Vec<_>>().join("\n")
                }
                // Tool calls and the like: not text this cache can compare.
                _ => return None,
            };
            out.push_str(role);
            out.push_str(": ");
            out.push_str(&content);
            out.push('\n');
        }
        Some(out)
    } else {
        match body.get("prompt")? {
            Value::String(s) => Some(s.clone()),
            Value::Array(a) if a.len() == 1 => a[0].as_str().map(str::to_string),
            _ => None,
        }
    }
}

/// A hash of everything but the prompt (and the fields that do not change
/// the answer: `stream`, `stream_options`, `user`): entries answer only
/// requests that agree on it.
pub fn rest_hash(path: &str, body: &serde_json::Map<String, Value>) -> [u8; 32] {
    let mut rest = body.clone();
    for k in ["messages", "prompt", "stream", "stream_options", "user"] {
        rest.remove(k);
    }
    // The exact cache's key of the rest, under another domain.
    let key = crate::cache::CacheKey::new(0, &format!("semantic:{path}"), &rest, false);
    key.digest()
}

/// Scales `v` to length 1 (`None` for an empty or zero vector).
pub fn normalized(mut v: Vec<f32>) -> Option<Vec<f32>> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if v.is_empty() || !norm.is_finite() || norm == 0.0 {
        return None;
    }
    v.iter_mut().for_each(|x| *x /= norm);
    Some(v)
}

/// A request's place in the semantic cache: its tenant, the hash of its
/// other fields and its prompt's embedding (length 1).
#[derive(Debug, Clone)]
pub struct Probe {
    pub tenant: i64,
    pub rest: [u8; 32],
    pub vector: Vec<f32>,
    /// The similarity an entry needs to answer it (the tenant's).
    pub threshold: f32,
    /// Keep the answer once it comes (no `cache-control: no-store`).
    pub store: bool,
}

struct Entry {
    rest: [u8; 32],
    vector: Vec<f32>,
    body: Bytes,
    until: Instant,
}

/// The semantic cache (see the module's documentation).
pub struct SemanticCache {
    pub cfg: SemanticConfig,
    tenants: Mutex<HashMap<i64, VecDeque<Entry>>>,
    metrics: Arc<GatewayMetrics>,
}

impl SemanticCache {
    /// The cache `cfg` describes, or `None` when it is off.
    pub fn new(cfg: &SemanticConfig, metrics: Arc<GatewayMetrics>) -> Option<SemanticCache> {
        cfg.enabled.then(|| SemanticCache { cfg: cfg.clone(), tenants: Mutex::new(HashMap::new()), metrics })
    }

    pub fn count(&self, event: &str) {
        self.metrics.semantic_cache.get_or_create(&vec![("event", event.to_string())]).inc();
    }

    /// The similarity `tenant`'s requests need.
    pub fn threshold(&self, tenant: &str) -> f32 {
        self.cfg.tenant_thresholds.get(tenant).copied().unwrap_or(self.cfg.threshold)
    }

    /// The kept answer most similar to `probe`, if it reaches the threshold,
    /// with its similarity (counted as a hit or a miss).
    pub fn get(&self, probe: &Probe) -> Option<(Bytes, f32)> {
        let now = Instant::now();
        let mut tenants = self.tenants.lock();
        let mut best: Option<(Bytes, f32)> = None;
        if let Some(entries) = tenants.get_mut(&probe.tenant) {
            entries.retain(|e| e.until > now);
            for e in entries.iter().filter(|e| e.rest == probe.rest && e.vector.len() == probe.vector.len()) {
                let sim: f32 = e.vector.iter().zip(&probe.vector).map(|(a, b)| a * b).sum();
                if sim >= probe.threshold && best.as_ref().is_none_or(|(_, s)| sim > *s) {
                    best = Some((e.body.clone(), sim));
                }
            }
        }
        drop(tenants);
        self.count(if best.is_some() { "hit" } else { "miss" });
        best
    }

    /// Keeps an answer for `probe` (unless it is too large).
    pub fn put(&self, probe: Probe, body: Bytes) {
        if body.len() > self.cfg.max_answer_bytes {
            self.count("too_large");
            return;
        }
        let until = Instant::now() + Duration::from_secs(self.cfg.ttl_s.max(1));
        let mut tenants = self.tenants.lock();
        let entries = tenants.entry(probe.tenant).or_default();
        entries.push_back(Entry { rest: probe.rest, vector: probe.vector, body, until });
        while entries.len() > self.cfg.max_entries_per_tenant.max(1) {
            entries.pop_front();
        }
        drop(tenants);
        self.count("store");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn probe(tenant: i64, rest: u8, v: Vec<f32>, threshold: f32) -> Probe {
        Probe { tenant, rest: [rest; 32], vector: normalized(v).unwrap(), threshold, store: true }
    }

    #[test]
    fn the_nearest_entry_over_the_threshold_answers_within_its_tenant_and_fields() {
        let cfg = SemanticConfig { enabled: true, embedding_model: "e".into(), ..SemanticConfig::default() };
        let c = SemanticCache::new(&cfg, GatewayMetrics::new(4)).unwrap();
        c.put(probe(1, 0, vec![1.0, 0.0], 0.9), Bytes::from_static(b"east"));
        c.put(probe(1, 0, vec![0.0, 1.0], 0.9), Bytes::from_static(b"north"));
        // cos = 0.98 to east, 0.2 to north.
        let (body, sim) = c.get(&probe(1, 0, vec![0.98, 0.2], 0.9)).unwrap();
        assert_eq!(body, Bytes::from_static(b"east"));
        assert!((sim - 0.98).abs() < 0.01, "{sim}");
        assert!(c.get(&probe(1, 0, vec![0.98, 0.2], 0.99)).is_none(), "under a stricter threshold");
        assert!(c.get(&probe(2, 0, vec![1.0, 0.0], 0.9)).is_none(), "tenants never share answers");
        assert!(c.get(&probe(1, 7, vec![1.0, 0.0], 0.9)).is_none(), "other fields must agree");
        let small = SemanticConfig { max_entries_per_tenant: 1, ..cfg };
        let c = SemanticCache::new(&small, GatewayMetrics::new(4)).unwrap();
        c.put(probe(1, 0, vec![1.0, 0.0], 0.9), Bytes::from_static(b"east"));
        c.put(probe(1, 0, vec![0.0, 1.0], 0.9), Bytes::from_static(b"north"));
        assert!(c.get(&probe(1, 0, vec![1.0, 0.0], 0.9)).is_none(), "the oldest went first");
    }

    #[test]
    fn prompts_and_the_rest_of_a_request_are_read_apart() {
        let chat = body(serde_json::json!({"model": "m", "temperature": 0, "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]}));
        assert_eq!(prompt_text(true, &chat).as_deref(), Some("system: be brief\nuser: a\nb\n"));
        let mut other = chat.clone();
        other.insert("messages".into(), serde_json::json!([{"role": "user", "content": "x"}]));
        other.insert("stream".into(), false.into());
        assert_eq!(rest_hash("/c", &chat), rest_hash("/c", &other), "only the prompt differs");
        other.insert("max_tokens".into(), 5.into());
        assert_ne!(rest_hash("/c", &chat), rest_hash("/c", &other));
        assert_eq!(prompt_text(false, &body(serde_json::json!({"prompt": ["once"]}))).as_deref(), Some("once"));
        assert_eq!(prompt_text(false, &body(serde_json::json!({"prompt": [1, 2]}))), None);
        assert_eq!(normalized(vec![0.0, 0.0]), None);
    }

    #[test]
    fn the_section_is_checked_naming_the_field() {
        let err = |s: &str| crate::config::GatewayConfig::from_toml(s).unwrap_err().field;
        assert_eq!(err("[gateway.semantic_cache]\nenabled = true\n"), "gateway.semantic_cache.embedding_model");
        assert_eq!(
            err("[gateway.semantic_cache]\nenabled = true\nembedding_model = \"e\"\nthreshold = 1.5\n"),
            "gateway.semantic_cache.threshold"
        );
        assert_eq!(
            err("[gateway.semantic_cache]\nenabled = true\nembedding_model = \"e\"\n[gateway.semantic_cache.tenant_thresholds]\nacme = -1\n"),
            "gateway.semantic_cache.tenant_thresholds.acme"
        );
        let c = crate::config::GatewayConfig::from_toml("[gateway.semantic_cache]\nembedding_model = \"e\"\n").unwrap();
        assert!(!c.gateway.semantic_cache.enabled, "off by default");
    }
}
