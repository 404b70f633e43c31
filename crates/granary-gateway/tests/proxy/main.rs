//! The gateway end to end in one process: its real router, identity store
//! (SQLite in memory), limits and proxy, in front of small HTTP upstreams
//! started by the test that behave like engines — or like broken ones
//! (5xx, garbage, hanging, refusing connections), which a real engine cannot
//! be made to do on cue. The process tests in the `granary` crate put real
//! engines behind the gateway.

mod agents;
mod budgets;
mod credentials;
mod durability;
mod metering;
mod path;
mod routing;
mod semantic;
mod spend;
mod upstreams;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use granary_gateway::config::{GatewayConfig, UpstreamConfig};
use granary_gateway::identity::{AdminToken, AuditQuery, Identity, IdentityOptions};
use granary_gateway::limits::Limiter;
use granary_gateway::Gateway;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::Notify;

const ADMIN: &str = "admin-token-0123456789";

/// How a test upstream behaves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Ok,
    Fail500,
    Garbage,
    Hang,
}

#[derive(Default)]
struct Seen {
    namespaces: Vec<String>,
    /// The `Authorization` header of each generation request.
    auths: Vec<String>,
    bodies: Vec<Value>,
    /// The same bodies as they arrived.
    raw: Vec<bytes::Bytes>,
}

struct Upstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Seen>>,
    /// Streams pause after their first chunk until this is notified.
    gate: Arc<Notify>,
}

#[derive(Clone)]
struct UpState {
    mode: Mode,
    name: &'static str,
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Seen>>,
    gate: Arc<Notify>,
    delay: Duration,
}

async fn up_generate(State(s): State<UpState>, headers: HeaderMap, raw: bytes::Bytes) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&raw) else {
        return (StatusCode::BAD_REQUEST, "the body is not JSON").into_response();
    };
    s.hits.fetch_add(1, Ordering::SeqCst);
    {
        let mut seen = s.seen.lock();
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("<none>").to_string();
        seen.namespaces.push(header("x-granary-namespace"));
        seen.auths.push(header("authorization"));
        seen.bodies.push(body.clone());
        seen.raw.push(raw.clone());
    }
    match s.mode {
        Mode::Fail500 => return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        Mode::Garbage => return (StatusCode::OK, "<html>not json").into_response(),
        Mode::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            return StatusCode::OK.into_response();
        }
        Mode::Ok => {}
    }
    tokio::time::sleep(s.delay).await;
    if body["stream"] == json!(true) {
        let gate = s.gate.clone();
        let stream = async_stream::stream! {
            yield Ok::<_, std::io::Error>(format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})));
            gate.notified().await;
            yield Ok(format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": "lo"}}]})));
            if body["stream_options"]["include_usage"] == json!(true) {
                yield Ok(format!("data: {}\n\n", json!({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}})));
            }
            yield Ok("data: [DONE]\n\n".to_string());
        };
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    Json(json!({
        "id": "x", "object": "chat.completion", "model": body["model"], "upstream": s.name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    }))
    .into_response()
}

async fn start_upstream(name: &'static str, mode: Mode, models: &[&str]) -> Upstream {
    start_upstream_with(name, mode, models, Duration::ZERO).await
}

async fn start_upstream_with(name: &'static str, mode: Mode, models: &[&str], delay: Duration) -> Upstream {
    start_upstream_full(name, mode, models, delay, Extras { health: true, kv_config: false }).await
}

/// Routes a test upstream may lack or add.
#[derive(Clone, Copy)]
struct Extras {
    /// `GET /health` answers 200 (else 404, like many OpenAI-compatible servers).
    health: bool,
    /// `GET /v1/kv/config` answers like a Granary engine.
    kv_config: bool,
}

async fn start_upstream_full(name: &'static str, mode: Mode, models: &[&str], delay: Duration, x: Extras) -> Upstream {
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let gate = Arc::new(Notify::new());
    let st = UpState { mode, name, hits: hits.clone(), seen: seen.clone(), gate: gate.clone(), delay };
    let list: Vec<Value> = models.iter().map(|m| json!({"id": m, "object": "model"})).collect();
    let mut app =
        Router::new().route("/v1/models", get(move || async move { Json(json!({"object": "list", "data": list})) }));
    if x.health {
        app = app.route("/health", get(|| async { "ok" }));
    }
    if x.kv_config {
        let layout = granary_core::hash::KvLayout {
            dtype: granary_core::block::DType::F16,
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            block_tokens: 16,
        };
        let info = json!({"model": models.first().copied().unwrap_or("m"), "fingerprint": "fp", "layout": layout});
        app = app.route("/v1/kv/config", get(move || async move { Json(info) }));
    }
    let app =
        app.route("/v1/chat/completions", post(up_generate)).route("/v1/completions", post(up_generate)).with_state(st);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    Upstream { addr, hits, seen, gate }
}

/// An address nothing listens on.
async fn dead_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

struct Gw {
    base: String,
    gw: Arc<Gateway>,
    identity: Identity,
    http: reqwest::Client,
}

impl Gw {
    async fn start(upstreams: &[(String, SocketAddr)], tweak: impl FnOnce(&mut GatewayConfig)) -> Gw {
        Gw::start_opts(upstreams, true, tweak).await
    }

    /// `probe: false` starts without health checks, so upstreams count as
    /// up until a request finds otherwise.
    async fn start_opts(upstreams: &[(String, SocketAddr)], probe: bool, tweak: impl FnOnce(&mut GatewayConfig)) -> Gw {
        Gw::start_limited(upstreams, probe, Limiter::in_process(), tweak).await
    }

    async fn start_limited(
        upstreams: &[(String, SocketAddr)],
        probe: bool,
        limiter: Limiter,
        tweak: impl FnOnce(&mut GatewayConfig),
    ) -> Gw {
        let mut cfg = GatewayConfig::default();
        cfg.gateway.database = "sqlite::memory:".into();
        cfg.gateway.retry_backoff_ms = 1;
        cfg.gateway.health.interval_ms = 100;
        cfg.gateway.health.timeout_ms = 200;
        for (name, addr) in upstreams {
            let mut u = UpstreamConfig::new(name.clone(), format!("http://{addr}"));
            u.kv_events = false;
            cfg.upstreams.push(u);
        }
        tweak(&mut cfg);
        cfg.validate().unwrap();
        let identity = Identity::open(&cfg.gateway.database, cfg.gateway.identity_options()).await.unwrap();
        let gw = Gateway::new(&cfg, identity.clone(), limiter).unwrap();
        if probe {
            gw.upstreams.probe_all(&cfg.gateway).await;
            gw.upstreams.spawn_watchers(&cfg.gateway, tokio_util::sync::CancellationToken::new());
        }
        let app = granary_gateway::server::router(gw.clone(), Some(AdminToken::new(ADMIN)));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        Gw { base, gw, identity, http: reqwest::Client::new() }
    }

    async fn admin(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut r = self.http.request(method, format!("{}{path}", self.base)).bearer_auth(ADMIN);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// A tenant with one key; returns the key.
    async fn key(&self, tenant: &str, key_body: Value) -> String {
        let (s, _) = self.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": tenant}))).await;
        assert!(s == StatusCode::CREATED || s == StatusCode::CONFLICT, "{s}");
        let mut body = key_body;
        body["tenant"] = json!(tenant);
        let (s, v) = self.admin(reqwest::Method::POST, "/admin/v1/keys", Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["key"].as_str().unwrap().to_string()
    }

    async fn chat(&self, key: &str, body: Value) -> reqwest::Response {
        self.http.post(format!("{}/v1/chat/completions", self.base)).bearer_auth(key).json(&body).send().await.unwrap()
    }

    async fn audit(&self) -> Vec<granary_gateway::identity::AuditRecord> {
        self.identity.flush().await;
        self.identity.audit(&AuditQuery { limit: 1000, ..Default::default() }).await.unwrap()
    }

    async fn metrics(&self) -> String {
        self.http.get(format!("{}/metrics", self.base)).bearer_auth(ADMIN).send().await.unwrap().text().await.unwrap()
    }
}

fn chat_body(stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
}

fn named(list: &[(&str, SocketAddr)]) -> Vec<(String, SocketAddr)> {
    list.iter().map(|(n, a)| (n.to_string(), *a)).collect()
}

fn chat_for(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

async fn model_ids(g: &Gw, key: &str) -> Vec<String> {
    let v: Value =
        g.http.get(format!("{}/v1/models", g.base)).bearer_auth(key).send().await.unwrap().json().await.unwrap();
    v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
}
