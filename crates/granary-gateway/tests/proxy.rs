//! The gateway end to end in one process: its real router, identity store
//! (SQLite in memory), limits and proxy, in front of small HTTP upstreams
//! started by the test that behave like engines — or like broken ones
//! (5xx, garbage, hanging, refusing connections), which a real engine cannot
//! be made to do on cue. The process tests in the `granary` crate put real
//! engines behind the gateway.

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
    bodies: Vec<Value>,
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

async fn up_generate(State(s): State<UpState>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    s.hits.fetch_add(1, Ordering::SeqCst);
    {
        let mut seen = s.seen.lock();
        seen.namespaces
            .push(headers.get("x-granary-namespace").and_then(|v| v.to_str().ok()).unwrap_or("<none>").to_string());
        seen.bodies.push(body.clone());
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
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let gate = Arc::new(Notify::new());
    let st = UpState { mode, name, hits: hits.clone(), seen: seen.clone(), gate: gate.clone(), delay };
    let list: Vec<Value> = models.iter().map(|m| json!({"id": m, "object": "model"})).collect();
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(move || async move { Json(json!({"object": "list", "data": list})) }))
        .route("/v1/chat/completions", post(up_generate))
        .route("/v1/completions", post(up_generate))
        .with_state(st);
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
        let identity = Identity::open("sqlite::memory:", IdentityOptions::default()).await.unwrap();
        let gw = Gateway::new(&cfg, identity.clone(), Limiter::in_process()).unwrap();
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

#[tokio::test]
async fn passes_answers_through_with_the_tenants_namespace_and_audits_them() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let resp = g
        .http
        .post(format!("{}/v1/chat/completions", g.base))
        .bearer_auth(&key)
        .header("x-granary-namespace", "someone-else")
        .header("x-tenant", "someone-else")
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    assert!(rid.starts_with("req_"), "{rid}");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(up.seen.lock().namespaces, vec!["acme".to_string()], "the namespace comes from the key, not the client");

    let audit = g.audit().await;
    let rec = audit.iter().find(|r| r.request_id == rid).expect("an audit record for the request");
    assert_eq!(rec.tenant.as_deref(), Some("acme"));
    assert_eq!(rec.model.as_deref(), Some("m"));
    assert_eq!(rec.upstream.as_deref(), Some("a"));
    assert_eq!(rec.status, 200);
    assert_eq!((rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens), (7, 2, 4));
    assert!(rec.prompt.is_none(), "no prompt text unless the tenant enables it");
    assert!(rec.ttft_ms.is_some() && rec.latency_ms >= rec.ttft_ms.unwrap());

    let m = g.metrics().await;
    assert!(m.contains(r#"inference_requests_total{tenant="acme",model="m",status="200"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_tokens_total{tenant="acme",model="m",kind="cached"} 4"#), "{m}");
}

#[tokio::test]
async fn streams_are_relayed_as_they_come_and_usage_is_metered() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    for include_usage in [false, true] {
        let mut body = chat_body(true);
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let resp = g.chat(&key, body).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let mut stream = resp.bytes_stream();
        // The first chunk arrives while the upstream still holds the second:
        // nothing is buffered.
        let first = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.expect("first chunk").unwrap();
        assert!(String::from_utf8_lossy(&first.unwrap()).contains("Hel"));
        up.gate.notify_one();
        let mut rest = String::new();
        while let Some(c) = stream.next().await {
            rest.push_str(&String::from_utf8_lossy(&c.unwrap()));
        }
        assert!(rest.contains("lo") && rest.ends_with("data: [DONE]\n\n"), "{rest}");
        assert_eq!(rest.contains("\"usage\""), include_usage, "usage only when asked: {rest}");
    }
    assert!(up.seen.lock().bodies.iter().all(|b| b["stream_options"]["include_usage"] == json!(true)));
    let audit = g.audit().await;
    assert_eq!(audit.len(), 2);
    assert!(audit.iter().all(|r| r.stream && r.completion_tokens == 2 && r.status == 200), "{audit:?}");
}

#[tokio::test]
async fn connect_errors_and_5xx_are_retried_on_other_upstreams() {
    let dead = dead_addr().await;
    let bad = start_upstream("bad", Mode::Fail500, &["m"]).await;
    let good = start_upstream("good", Mode::Ok, &["m"]).await;
    let g = Gw::start_opts(&named(&[("dead", dead), ("bad", bad.addr), ("good", good.addr)]), false, |c| {
        c.gateway.max_attempts = 3;
        c.gateway.breaker.failures = 100;
        for u in &mut c.upstreams {
            u.models = vec!["m".into()];
        }
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for _ in 0..6 {
        let resp = g.chat(&key, chat_body(false)).await;
        assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    }
    assert_eq!(good.hits.load(Ordering::SeqCst), 6);
    let m = g.metrics().await;
    assert!(m.contains("granary_gateway_retries_total"), "{m}");
    assert!(!m.contains("granary_gateway_retries_total 0"), "{m}");
}

#[tokio::test]
async fn garbage_and_hanging_upstreams_become_clear_errors() {
    let garbage = start_upstream("g", Mode::Garbage, &["m"]).await;
    let g = Gw::start(&named(&[("g", garbage.addr)]), |c| c.gateway.max_attempts = 2).await;
    let key = g.key("acme", json!({})).await;
    let resp = g.chat(&key, chat_body(false)).await;
    assert_eq!(resp.status(), 502);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    assert!(!v.to_string().contains("127.0.0.1"), "no internal detail leaks: {v}");

    let hang = start_upstream("h", Mode::Hang, &["m"]).await;
    let g = Gw::start(&named(&[("h", hang.addr)]), |c| {
        c.gateway.max_attempts = 1;
        c.gateway.first_byte_timeout_s = 1;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    let t0 = Instant::now();
    let resp = g.chat(&key, chat_body(false)).await;
    assert_eq!(resp.status(), 502);
    assert!(t0.elapsed() < Duration::from_secs(10));
    let audit = g.audit().await;
    assert_eq!(audit.last().unwrap().status, 502, "the failure is audited");
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_are_audited() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.gateway.max_body_bytes = 4096).await;
    let key = g.key("acme", json!({"models": ["m"]})).await;
    let url = format!("{}/v1/chat/completions", g.base);
    let send = |auth: Option<&str>, body: Vec<u8>| {
        let mut r = g.http.post(&url).header("content-type", "application/json").body(body);
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        r.send()
    };
    // (key, body, status, the field the error names)
    type Case<'a> = (Option<&'a str>, Vec<u8>, u16, Option<&'a str>);
    let cases: Vec<Case> = vec![
        (None, chat_body(false).to_string().into_bytes(), 401, None),
        (Some("gk_nope_nope"), chat_body(false).to_string().into_bytes(), 401, None),
        (Some(&key), b"{not json".to_vec(), 400, None),
        (
            Some(&key),
            json!({"messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(),
            400,
            Some("model"),
        ),
        (Some(&key), json!({"model": "m", "messages": 5}).to_string().into_bytes(), 400, Some("messages")),
        (Some(&key), json!({"model": "m", "messages": [], "stream": "yes"}).to_string().into_bytes(), 400, None),
        (
            Some(&key),
            json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(),
            404,
            None,
        ),
        (Some(&key), vec![b' '; 10_000], 413, None),
    ];
    for (auth, body, status, param) in cases {
        let resp = send(auth, body).await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        assert!(resp.headers().contains_key("x-request-id"));
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{v}");
        }
    }
    assert_eq!(up.hits.load(Ordering::SeqCst), 0, "nothing bad reached the upstream");
    let audit = g.audit().await;
    assert_eq!(audit.len(), 8, "every refusal is audited");
    assert!(audit.iter().filter(|r| r.status == 401).all(|r| r.tenant.is_none()));
    // Unknown paths and methods are OpenAI-shaped too.
    let r = g.http.get(format!("{}/v1/nothing", g.base)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"].is_object());
    let r = g.http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 405);
}

#[tokio::test]
async fn limits_answer_429_with_retry_after() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({"limits": {"requests_per_minute": 2}})).await;
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    let resp = g.chat(&key, chat_body(false)).await;
    assert_eq!(resp.status(), 429);
    let after: u64 = resp.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&after), "{after}");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("requests_per_minute"), "{v}");
    assert_eq!(up.hits.load(Ordering::SeqCst), 2);
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_rate_limited_total{scope="key",limit="requests_per_minute"} 1"#), "{m}");
}

#[tokio::test]
async fn models_are_the_union_the_key_may_use() {
    let a = start_upstream("a", Mode::Ok, &["m", "n"]).await;
    let b = start_upstream("b", Mode::Ok, &["n", "o"]).await;
    let g = Gw::start(&named(&[("a", a.addr), ("b", b.addr)]), |_| {}).await;
    let all = g.key("acme", json!({})).await;
    let some = g.key("acme", json!({"models": ["n", "zzz"]})).await;
    let list = |k: String| {
        let http = g.http.clone();
        let url = format!("{}/v1/models", g.base);
        async move {
            let v: Value = http.get(url).bearer_auth(k).send().await.unwrap().json().await.unwrap();
            v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect::<Vec<_>>()
        }
    };
    assert_eq!(list(all).await, vec!["m", "n", "o"]);
    assert_eq!(list(some).await, vec!["n"]);
    let r = g.http.get(format!("{}/v1/models", g.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
}

#[tokio::test]
async fn a_dead_upstream_opens_its_breaker_and_gets_no_traffic() {
    let dead = dead_addr().await;
    let good = start_upstream("good", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("dead", dead), ("good", good.addr)]), |c| {
        c.upstreams[0].models = vec!["m".into()];
        c.gateway.breaker.failures = 2;
        c.gateway.breaker.open_ms = 60_000;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = g.metrics().await;
        if m.contains(r#"granary_gateway_upstream_breaker_state{upstream="dead"} 2"#) {
            break;
        }
        assert!(Instant::now() < deadline, "the breaker did not open:\n{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..5 {
        assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    }
    let m = g.metrics().await;
    assert!(
        !m.contains(r#"granary_gateway_upstream_attempts_total{upstream="dead""#),
        "no attempt on an open breaker: {m}"
    );
    assert!(m.contains(r#"granary_gateway_upstream_up{upstream="dead"} 0"#), "{m}");
}

#[tokio::test]
async fn full_upstreams_queue_premium_requests_first() {
    let up = start_upstream_with("a", Mode::Ok, &["m"], Duration::from_millis(300)).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.upstreams[0].max_active = 1).await;
    let (s, _) =
        g.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": "gold", "priority": "premium"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _) =
        g.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": "bulk", "priority": "batch"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let gold = g.key("gold", json!({})).await;
    let bulk = g.key("bulk", json!({})).await;
    // One request holds the only slot; then batch requests queue, then a premium one.
    let first = tokio::spawn({
        let (http, url, k) = (g.http.clone(), format!("{}/v1/chat/completions", g.base), bulk.clone());
        async move { http.post(url).bearer_auth(k).json(&chat_body(false)).send().await.unwrap().status() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let finish_order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, k) in [bulk.clone(), bulk.clone(), gold.clone()].into_iter().enumerate() {
        let (http, url, order) = (g.http.clone(), format!("{}/v1/chat/completions", g.base), finish_order.clone());
        tasks.push(tokio::spawn(async move {
            let s = http.post(url).bearer_auth(k).json(&chat_body(false)).send().await.unwrap().status();
            order.lock().push(i);
            s
        }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(first.await.unwrap(), 200);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(
        finish_order.lock()[0],
        2,
        "the premium request, queued last, is served first: {:?}",
        finish_order.lock()
    );
}

#[tokio::test]
async fn admin_and_metrics_refuse_anything_without_the_admin_token() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    for (method, path) in [
        (reqwest::Method::GET, "/metrics"),
        (reqwest::Method::GET, "/admin/v1/tenants"),
        (reqwest::Method::POST, "/admin/v1/tenants"),
        (reqwest::Method::POST, "/admin/v1/keys"),
        (reqwest::Method::GET, "/admin/v1/usage"),
    ] {
        for auth in [None, Some(key.as_str()), Some("wrong-admin-token-xxxxx")] {
            let mut r = g.http.request(method.clone(), format!("{}{path}", g.base)).json(&json!({"name": "evil"}));
            if let Some(a) = auth {
                r = r.bearer_auth(a);
            }
            let resp = r.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{method} {path} with {auth:?}");
        }
    }
    let (s, v) = g.admin(reqwest::Method::GET, "/admin/v1/tenants", None).await;
    assert_eq!(s, 200);
    assert!(!v.to_string().contains("evil"), "nothing was created: {v}");
    let health: HashMap<String, Value> =
        g.http.get(format!("{}/health", g.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok");
    drop(g.gw);
}

/// `promtool check metrics` accepts the exposition after mixed traffic.
#[tokio::test]
async fn metrics_pass_promtool() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({"limits": {"requests_per_minute": 1}})).await;
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 429);
    assert_eq!(g.chat("gk_bad", chat_body(false)).await.status(), 401);
    let text = g.metrics().await;
    use granary_core::metrics::gateway as n;
    // Families without samples yet (queueing, KV routing) are not listed.
    let quiet = [
        n::QUEUE_SECONDS,
        n::ROUTED_BLOCKS,
        n::ROUTED_HIT_BLOCKS,
        n::MODEL_LOAD_REQUESTS,
        n::MODEL_LOADS,
        n::MODEL_LOAD_SECONDS,
    ];
    for name in n::ALL.iter().filter(|x| !quiet.contains(x)) {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
    }
    let run = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    match run {
        Ok(mut child) => {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool rejected /metrics: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(_) if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") => panic!("promtool not found"),
        Err(_) => eprintln!("skipped: promtool not found"),
    }
}

/// `schemathesis` (property-based requests generated from the OpenAPI
/// description) finds no 5xx on the public API (with a tenant key) nor on
/// the admin API (with the admin token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors() {
    if std::process::Command::new("schemathesis").arg("--version").output().is_err() {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "schemathesis not found");
        eprintln!("skipped: schemathesis not found");
        return;
    }
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let spec = format!("{}/openapi.json", g.base);
    for (auth, paths) in [(key.as_str(), "^/(v1|health)"), (ADMIN, "^/(admin|metrics)")] {
        let out = tokio::process::Command::new("schemathesis")
            .args(["run", &spec, "--url", &g.base, "--checks", "not_a_server_error"])
            .args(["--include-path-regex", paths, "--max-examples", "30", "--workers", "1", "--no-color"])
            .args(["--phases", "examples,coverage,fuzzing"])
            .arg("-H")
            .arg(format!("Authorization: Bearer {auth}"))
            .env("SCHEMATHESIS_HOOKS", "")
            .output()
            .await
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "schemathesis found problems on {paths}:\n{text}");
        assert!(text.contains("passed") || text.contains("Passed"), "{text}");
    }
}

/// A disaggregated pool: the prefill engine computes the prompt first (a
/// whole, non-streamed call), then the decode engine answers the client.
#[tokio::test]
async fn disaggregated_pools_prefill_then_decode() {
    let p = start_upstream("prefill", Mode::Ok, &["m"]).await;
    let d = start_upstream("decode", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("p", p.addr), ("d", d.addr)]), |c| {
        c.upstreams[0].role = granary_gateway::config::Role::Prefill;
        c.upstreams[1].role = granary_gateway::config::Role::Decode;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for stream in [false, true] {
        let resp = g.chat(&key, chat_body(stream)).await;
        assert_eq!(resp.status(), 200);
        if stream {
            d.gate.notify_one();
            let text = resp.text().await.unwrap();
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        } else {
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["upstream"], "decode", "the decode engine answers: {v}");
        }
    }
    assert_eq!(p.hits.load(Ordering::SeqCst), 2, "each request was prefilled once");
    assert_eq!(d.hits.load(Ordering::SeqCst), 2);
    let seen = p.seen.lock();
    assert!(seen.bodies.iter().all(|b| b["stream"] == json!(false)), "the prefill call is never a stream");
    assert!(seen.namespaces.iter().all(|n| n == "acme"));
}

/// curl as the client: a whole answer, a stream, and a bad key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_gets_answers_streams_and_errors() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let url = format!("{}/v1/chat/completions", g.base);
    let curl = |key: String, body: Value| {
        let url = url.clone();
        async move {
            tokio::process::Command::new("curl")
                .args(["-s", "-N", "-w", "\n%{http_code}", "-H", "content-type: application/json"])
                .args(["-H", &format!("authorization: Bearer {key}"), "-d", &body.to_string(), &url])
                .output()
                .await
        }
    };
    let Ok(out) = curl(key.clone(), chat_body(false)).await else {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "curl not found");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.ends_with("\n200") && text.contains("\"Hello\""), "{text}");
    up.gate.notify_one();
    let out = curl(key, chat_body(true)).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("data: [DONE]") && text.ends_with("\n200"), "{text}");
    let out = curl("gk_wrong".into(), chat_body(false)).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.ends_with("\n401") && text.contains("authentication_error"), "{text}");
}

/// A heartbeat as a node agent sends it.
fn heartbeat(agent: &str, agent_url: &str, engines: &[(&str, SocketAddr, bool)], models: &[&str]) -> Value {
    let engines: Vec<Value> = engines
        .iter()
        .map(|(m, a, healthy)| json!({"model": m, "upstream": format!("http://{a}"), "healthy": healthy, "kv_events": false}))
        .collect();
    json!({"agent_id": agent, "url": agent_url, "token": "agent-secret", "engines": engines, "models": models})
}

async fn model_ids(g: &Gw, key: &str) -> Vec<String> {
    let v: Value =
        g.http.get(format!("{}/v1/models", g.base)).bearer_auth(key).send().await.unwrap().json().await.unwrap();
    v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
}

/// Agents' engines join routing when reported, get no traffic while
/// reported unhealthy, and leave when dropped from the report or when the
/// agent falls silent for the ttl; nothing needs a restart.
#[tokio::test]
async fn engines_reported_by_agents_join_and_leave_routing() {
    let a = start_upstream("a", Mode::Ok, &["ignored"]).await;
    let b = start_upstream("b", Mode::Ok, &["ignored"]).await;
    let g = Gw::start(&[], |c| c.gateway.agents.ttl_ms = 400).await;
    let key = g.key("acme", json!({})).await;
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 404);

    let beat = |body: Value| {
        let g = &g;
        async move {
            let (s, v) = g.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(body)).await;
            assert_eq!(s, 200, "{v}");
            assert_eq!(v["ok"], true);
        }
    };
    beat(heartbeat("node-a", "http://127.0.0.1:9", &[("m", a.addr, true)], &["m"])).await;
    assert_eq!(model_ids(&g, &key).await, vec!["m"]);
    let v: Value = g.chat(&key, chat_body(false)).await.json().await.unwrap();
    assert_eq!(v["upstream"], "a", "{v}");
    let records = g.audit().await;
    assert_eq!(records[0].upstream.as_deref(), Some("agent:node-a:m"));

    // A second agent: both engines get traffic.
    beat(heartbeat("node-b", "http://127.0.0.1:9", &[("m", b.addr, true)], &[])).await;
    for _ in 0..6 {
        assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    }
    assert!(a.hits.load(Ordering::SeqCst) >= 2 && b.hits.load(Ordering::SeqCst) >= 2);
    let (s, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(s, 200);
    assert_eq!(v["data"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["data"][0]["engines"][0]["name"], "agent:node-a:m");
    assert_eq!(v["data"][0]["has_token"], true);
    assert!(!v.to_string().contains("agent-secret"), "the token is never shown: {v}");

    // node-b reports its engine unhealthy: no traffic to it.
    beat(heartbeat("node-b", "http://127.0.0.1:9", &[("m", b.addr, false)], &[])).await;
    let before = b.hits.load(Ordering::SeqCst);
    for _ in 0..6 {
        assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    }
    assert_eq!(b.hits.load(Ordering::SeqCst), before, "an engine reported unhealthy gets nothing");

    // node-a drops its engine: only b is left, and b is unhealthy.
    beat(heartbeat("node-a", "http://127.0.0.1:9", &[], &[])).await;
    let r = g.chat(&key, chat_body(false)).await;
    assert_eq!(r.status(), 503);
    let m = g.metrics().await;
    assert!(!m.contains("agent:node-a:m"), "a removed upstream's series go: {m}");
    assert!(m.contains(r#"granary_gateway_upstream_up{upstream="agent:node-b:m"}"#), "{m}");

    // Both fall silent: everything is gone within the ttl.
    beat(heartbeat("node-b", "http://127.0.0.1:9", &[("m", b.addr, false)], &[])).await;
    let silent = Instant::now();
    loop {
        let ids = model_ids(&g, &key).await;
        if ids.is_empty() {
            break;
        }
        assert!(silent.elapsed() < Duration::from_millis(1_500), "still listed: {ids:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(silent.elapsed() >= Duration::from_millis(300), "not before the ttl: {:?}", silent.elapsed());
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 404);
    let (_, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(v["data"], json!([]));
}

/// Each load asked for: the model and the `Authorization` header.
type Asked = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// What the test's stand-in agent does when asked to load a model.
#[derive(Clone)]
struct FakeAgent {
    loads: Asked,
    delay: Duration,
}

async fn fake_load(
    State(s): State<FakeAgent>,
    axum::extract::Path(model): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
    s.loads.lock().push((model.clone(), auth));
    match model.as_str() {
        "broken" => {
            (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "disk full"}}))).into_response()
        }
        "slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            StatusCode::OK.into_response()
        }
        "weird" => Json(json!({"model": model, "upstream": "file:///etc/passwd"})).into_response(),
        _ => {
            tokio::time::sleep(s.delay).await;
            let up = start_upstream("loaded", Mode::Ok, &[]).await;
            Json(json!({"model": model, "revision": "1", "upstream": format!("http://{}", up.addr), "state": "ready", "tier": "disk", "load_ms": 1}))
                .into_response()
        }
    }
}

/// A small HTTP server in the role of a node agent's control API (the real
/// agent is a separate component; here only its `load` answer matters).
async fn start_fake_agent(delay: Duration) -> (String, FakeAgent) {
    let st = FakeAgent { loads: Arc::new(Mutex::new(Vec::new())), delay };
    let app = Router::new().route("/models/{model}/load", post(fake_load)).with_state(st.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (url, st)
}

/// A request for a model only an agent lists is held while the agent loads
/// it (one load for many requests), then answered by the new engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_an_agent_can_load_is_loaded_on_request() {
    let (agent_url, agent) = start_fake_agent(Duration::from_millis(300)).await;
    let g = Gw::start(&[], |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let (s, _) = g
        .admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(heartbeat("node-l", &agent_url, &[], &["m"])))
        .await;
    assert_eq!(s, 200);
    assert_eq!(model_ids(&g, &key).await, vec!["m"], "loadable models are listed");
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (http, url, k) = (g.http.clone(), format!("{}/v1/chat/completions", g.base), key.clone());
        tasks.push(tokio::spawn(async move {
            let r = http.post(url).bearer_auth(k).json(&chat_body(false)).send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }));
    }
    for t in tasks {
        let (s, v) = t.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["upstream"], "loaded");
    }
    let loads = agent.loads.lock().clone();
    assert_eq!(
        loads,
        vec![("m".to_string(), Some("Bearer agent-secret".to_string()))],
        "one load, with the agent's token"
    );
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_model_load_requests_total{model="m"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_model_loads_total{model="m",outcome="succeeded"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_model_load_seconds_count{model="m"} 1"#), "{m}");
    // Served now: no further load.
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    assert_eq!(agent.loads.lock().len(), 1);
    let (_, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(v["data"][0]["engines"][0]["model"], "m", "{v}");
}

/// A load that takes longer than `load_timeout_ms`, one that fails and one
/// whose answer is unusable: 503 with `Retry-After`, audited; a model no
/// agent lists stays 404.
#[tokio::test]
async fn slow_and_failed_loads_are_503_with_retry_after() {
    let (agent_url, agent) = start_fake_agent(Duration::ZERO).await;
    let g = Gw::start(&[], |c| c.gateway.agents.load_timeout_ms = 300).await;
    let key = g.key("acme", json!({})).await;
    let body = heartbeat("node-l", &agent_url, &[], &["slow", "broken", "weird"]);
    assert_eq!(g.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(body)).await.0, 200);
    let ask = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        g.chat(&key, body)
    };
    let t0 = Instant::now();
    let r = ask("slow").await;
    assert_eq!(r.status(), 503);
    assert!(t0.elapsed() >= Duration::from_millis(300), "held for the load timeout");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(r.headers()["retry-after"], "5");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_loading", "{v}");
    assert_eq!(v["error"]["type"], "server_error");

    for model in ["broken", "weird"] {
        let r = ask(model).await;
        assert_eq!(r.status(), 503, "{model}");
        assert_eq!(r.headers()["retry-after"], "5");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "model_load_failed", "{v}");
        assert!(!v.to_string().contains("disk full") && !v.to_string().contains(&agent_url), "no internals: {v}");
    }
    // Within the retry window a failed model is not asked for again.
    assert_eq!(ask("broken").await.status(), 503);
    let asked: Vec<String> = agent.loads.lock().iter().map(|(m, _)| m.clone()).collect();
    assert_eq!(asked, vec!["slow", "broken", "weird"]);
    assert_eq!(ask("nobody-has-it").await.status(), 404);

    let records = g.audit().await;
    let codes: Vec<(u16, Option<String>)> = records.iter().map(|r| (r.status, r.error_code.clone())).collect();
    assert!(codes.contains(&(503, Some("model_loading".into()))), "{codes:?}");
    assert_eq!(codes.iter().filter(|c| c.1.as_deref() == Some("model_load_failed")).count(), 3, "{codes:?}");
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_model_loads_total{model="broken",outcome="failed"} 1"#), "{m}");
}

/// Heartbeats are checked field by field, need the admin token, and are
/// refused when agents are disabled.
#[tokio::test]
async fn heartbeats_are_validated_and_need_the_admin_token() {
    let g = Gw::start(&[], |_| {}).await;
    let url = format!("{}/admin/v1/agents/heartbeat", g.base);
    let good = json!({"agent_id": "a", "url": "http://127.0.0.1:1", "engines": [], "models": []});
    for auth in [None, Some("wrong-admin-token-xxxxx")] {
        let mut r = g.http.post(&url).json(&good);
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        assert_eq!(r.send().await.unwrap().status(), 401);
    }
    let cases = [
        (json!({"url": "http://h:1"}), "agent_id"),
        (json!({"agent_id": "a"}), "url"),
        (json!({"agent_id": 5, "url": "http://h:1"}), "agent_id"),
        (json!({"agent_id": "a", "url": "javascript:alert(1)"}), "url"),
        (json!({"agent_id": "a", "url": "http://h:1", "engines": [{"model": "m"}]}), "engines[0].upstream"),
        (
            json!({"agent_id": "a", "url": "http://h:1", "engines": [{"model": "m", "upstream": "h:2"}]}),
            "engines[0].upstream",
        ),
        (
            json!({"agent_id": "a", "url": "http://h:1", "engines": [{"model": "m", "upstream": "http://h:2", "healthy": "yes"}]}),
            "engines[0].healthy",
        ),
        (json!({"agent_id": "a", "url": "http://h:1", "models": ["ok", 3]}), "models[1]"),
    ];
    for (body, param) in cases {
        let (s, v) = g.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(body.clone())).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (_, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(v["data"], json!([]), "nothing was registered");

    let off = Gw::start(&[], |c| c.gateway.agents.enabled = false).await;
    let (s, v) = off.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(good)).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("agents_disabled")));
}
