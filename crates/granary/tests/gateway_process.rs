//! The real `granary gateway` in front of real `granary engine` processes
//! with the default model: the official `openai` client through it
//! (stream and not, bad key 401, over limit 429), KV-aware routing sending a
//! repeated prompt back to the engine that holds its blocks, and an engine
//! killed under load: no non-streamed request fails, its breaker opens
//! within 5 s, and traffic returns when it is back. Then engines that node
//! agents report at runtime: they join and leave routing with the
//! heartbeats, a killed one fails no request while another serves, and a
//! request for a model nobody serves yet is held while an agent loads it.
//! The node agent is a separate component; here the test itself plays the
//! agent's HTTP role (heartbeats, the `load` call) and starts real engines.

mod common;
use common::Proc;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{json, Value};

const ADMIN: &str = "gateway-admin-token-for-tests";
const MODEL: &str = "SmolLM2-135M-Instruct";

fn default_model() -> Option<std::path::PathBuf> {
    granary_tokenizer::testing::model_or_skip("gateway process test")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn engine(port: u16) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    Proc::start(&["engine", "--listen", &listen, "--block-tokens", "16", "--trust-namespace-header"], &[])
}

/// An engine serving the default model under the name `model_id`, as a
/// node agent starts one.
fn engine_as(port: u16, model_id: &str) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    Proc::start(
        &["engine", "--listen", &listen, "--block-tokens", "16", "--trust-namespace-header", "--model-id", model_id],
        &[],
    )
}

/// Starts several engines at once (each takes seconds to load).
fn engines_as(ports: &[u16], model_id: &str) -> Vec<Proc> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ports.iter().map(|&p| s.spawn(move || engine_as(p, model_id))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Posts a node agent's heartbeat to a gateway every 250 ms (as the agent
/// does every 2 s), with whatever body it holds at the time, until dropped.
struct Beater {
    body: Arc<Mutex<Value>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Beater {
    fn start(gateway: &str, body: Value) -> Beater {
        let body = Arc::new(Mutex::new(body));
        let stop = Arc::new(AtomicBool::new(false));
        let url = format!("{gateway}/admin/v1/agents/heartbeat");
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(5)).build().unwrap();
        let send = {
            let (http, url, body) = (http.clone(), url.clone(), body.clone());
            move || {
                let b = body.lock().clone();
                let r = http.post(&url).bearer_auth(ADMIN).json(&b).send().unwrap();
                assert_eq!(r.status(), 200, "heartbeat refused: {}", r.text().unwrap_or_default());
            }
        };
        send();
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(250));
                    if !stop.load(Ordering::Relaxed) {
                        send();
                    }
                }
            }
        });
        Beater { body, stop, thread: Some(thread) }
    }

    /// Changes what the next heartbeats say, and sends one now.
    fn set(&self, gateway: &str, body: Value) {
        *self.body.lock() = body.clone();
        let r = reqwest::blocking::Client::new()
            .post(format!("{gateway}/admin/v1/agents/heartbeat"))
            .bearer_auth(ADMIN)
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Beater {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn agent_body(agent: &str, url: &str, engines: &[(&str, u16, bool)], models: &[&str]) -> Value {
    let engines: Vec<Value> = engines
        .iter()
        .map(|(m, port, healthy)| json!({"model": m, "upstream": format!("http://127.0.0.1:{port}"), "healthy": healthy}))
        .collect();
    json!({"agent_id": agent, "url": url, "token": null, "engines": engines, "models": models})
}

struct Gateway {
    _proc: Proc,
    base: String,
    _dir: tempfile::TempDir,
    http: reqwest::blocking::Client,
}

impl Gateway {
    fn start(engine_ports: &[u16], extra: &str) -> Gateway {
        Gateway::start_with_db(engine_ports, extra, "")
    }

    /// `db` empty: a fresh SQLite file of its own.
    fn start_with_db(engine_ports: &[u16], extra: &str, db: &str) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let db =
            if db.is_empty() { format!("sqlite://{}", dir.path().join("gateway.db").display()) } else { db.into() };
        let mut cfg = format!("[gateway]\nlisten = \"127.0.0.1:{port}\"\ndatabase = \"{db}\"\n{extra}\n");
        for (i, p) in engine_ports.iter().enumerate() {
            cfg.push_str(&format!("[[upstream]]\nname = \"e{i}\"\nurl = \"http://127.0.0.1:{p}\"\n"));
        }
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, cfg).unwrap();
        let proc = Proc::start(&["gateway", "--config", path.to_str().unwrap()], &[("GRANARY_ADMIN_TOKEN", ADMIN)]);
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
        Gateway { _proc: proc, base: format!("http://127.0.0.1:{port}"), _dir: dir, http }
    }

    fn admin(&self, path: &str, body: Value) -> Value {
        let r = self.http.post(format!("{}{path}", self.base)).bearer_auth(ADMIN).json(&body).send().unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.text().unwrap());
        r.json().unwrap()
    }

    fn key(&self, tenant: &str, limits: Value) -> String {
        let _ = self
            .http
            .post(format!("{}/admin/v1/tenants", self.base))
            .bearer_auth(ADMIN)
            .json(&json!({"name": tenant}))
            .send();
        let v = self.admin("/admin/v1/keys", json!({"tenant": tenant, "limits": limits}));
        v["key"].as_str().unwrap().to_string()
    }

    fn metrics(&self) -> String {
        self.http.get(format!("{}/metrics", self.base)).bearer_auth(ADMIN).send().unwrap().text().unwrap()
    }

    fn completion(&self, key: &str, prompt: &str, max_tokens: u32) -> reqwest::blocking::Response {
        self.completion_for(key, MODEL, prompt, max_tokens)
    }

    fn completion_for(&self, key: &str, model: &str, prompt: &str, max_tokens: u32) -> reqwest::blocking::Response {
        self.http
            .post(format!("{}/v1/completions", self.base))
            .bearer_auth(key)
            .json(&json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
            .send()
            .unwrap()
    }

    fn models(&self, key: &str) -> Vec<String> {
        let v: Value =
            self.http.get(format!("{}/v1/models", self.base)).bearer_auth(key).send().unwrap().json().unwrap();
        v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
    }

    fn get_admin(&self, path: &str) -> Value {
        self.http.get(format!("{}{path}", self.base)).bearer_auth(ADMIN).send().unwrap().json().unwrap()
    }
}

/// Polls `f` every 50 ms until it holds; panics with `what` after `limit`.
fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

#[test]
fn the_openai_client_works_through_the_gateway_and_kv_aware_routing_finds_the_blocks() {
    if default_model().is_none() {
        return;
    }
    let ports = [free_port(), free_port()];
    let _engines: Vec<Proc> = ports.iter().map(|&p| engine(p)).collect();
    let gw = Gateway::start(&ports, "");
    let key = gw.key("acme", json!({}));
    let limited = gw.key("tight", json!({"requests_per_minute": 1}));

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../granary-gateway/tests/python/test_gateway_openai.py");
    let out = Command::new(std::env::var("GRANARY_PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(script)
        .env("OPENAI_BASE_URL", format!("{}/v1", gw.base))
        .env("OPENAI_API_KEY", &key)
        .env("GRANARY_LIMITED_KEY", &limited)
        .output()
        .expect("run python3");
    eprintln!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No module named 'openai'") {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "the openai package is missing");
        eprintln!("skipping the openai client checks: the openai package is not installed");
    } else {
        assert!(out.status.success(), "the openai client checks through the gateway failed");
    }

    // KV-aware: a long prompt, then the same prompt again: the second time
    // the gateway sends it where its blocks are, and the engine reuses them.
    let prompt = "The history of the lighthouse keepers of the northern coast, told season by season. ".repeat(8);
    let first = gw.completion(&key, &prompt, 1);
    // Generation routes skip the router (front::App): the request id is
    // still set on the answer.
    let rid = first.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert!(rid.starts_with("req_") && rid.len() == 28, "x-request-id {rid:?}");
    let first: Value = first.json().unwrap();
    assert!(first["usage"]["prompt_tokens"].as_u64().unwrap() > 64, "{first}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut cached = 0;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(300));
        let again: Value = gw.completion(&key, &prompt, 1).json().unwrap();
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        if cached > 0 {
            break;
        }
    }
    assert!(cached >= 64, "the repeated prompt was routed to the engine holding its KV: cached {cached}");
    let m = gw.metrics();
    assert!(metric(&m, "granary_gateway_routed_hit_blocks_total") >= 4.0, "{m}");
    assert!(metric(&m, "inference_requests_total{tenant=\"acme\"") >= 4.0, "{m}");
    assert!(
        metric(&m, "inference_requests_total{tenant=\"tight\",model=\"SmolLM2-135M-Instruct\",status=\"429\"}") >= 1.0
    );

    // Usage and audit come back from the admin API.
    let usage = gw.http.get(format!("{}/admin/v1/usage?format=csv", gw.base)).bearer_auth(ADMIN).send().unwrap();
    assert_eq!(usage.status(), 200);
    let csv = usage.text().unwrap();
    assert!(csv.lines().next().unwrap().contains("tenant"), "{csv}");
    assert!(csv.lines().any(|l| l.starts_with("acme,") && l.contains(MODEL)), "{csv}");
}

#[test]
fn an_engine_killed_under_load_fails_no_request_and_comes_back() {
    if default_model().is_none() {
        return;
    }
    let ports = [free_port(), free_port()];
    let mut engines: Vec<Proc> = ports.iter().map(|&p| engine(p)).collect();
    let extra =
        "[gateway.health]\ninterval_ms = 250\ntimeout_ms = 500\n[gateway.breaker]\nfailures = 2\nopen_ms = 1000\n";
    let gw = Arc::new(Gateway::start(&ports, extra));
    let key = gw.key("acme", json!({}));

    // Load: four clients sending short non-streamed requests.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (gw, key, stop, ok, failed) = (gw.clone(), key.clone(), stop.clone(), ok.clone(), failed.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let r = gw.completion(&key, &format!("Client {c} counts: {i}, {}", i + 1), 4);
                    if r.status().is_success() {
                        ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        eprintln!("request failed: {} {}", r.status(), r.text().unwrap_or_default());
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    // Under load first: some requests answered (a slow, shared machine
    // may take a while for the first).
    let deadline = Instant::now() + Duration::from_secs(60);
    while ok.load(Ordering::Relaxed) < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = ok.load(Ordering::Relaxed);
    assert!(before > 0, "no request succeeded before the kill");

    engines[0].kill9();
    let killed = Instant::now();
    let open = r#"granary_gateway_upstream_breaker_state{upstream="e0"} 2"#;
    let mut opened_after = None;
    while killed.elapsed() < Duration::from_secs(5) {
        if gw.metrics().contains(open) {
            opened_after = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let opened_after = opened_after.expect("the dead engine's breaker opened within 5 s");
    eprintln!("breaker opened {opened_after:?} after the kill");
    std::thread::sleep(Duration::from_secs(2));

    // Back on the same port: traffic returns.
    engines[0] = engine(ports[0]);
    let back = Instant::now();
    let attempts_e0 = |m: &str| metric(m, r#"granary_gateway_upstream_attempts_total{upstream="e0",outcome="ok"}"#);
    let base = attempts_e0(&gw.metrics());
    loop {
        let m = gw.metrics();
        if attempts_e0(&m) > base {
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(30), "no traffic reached the restarted engine:\n{m}");
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("{ok} requests succeeded, {failed} failed");
    assert_eq!(failed, 0, "a non-streamed request failed while an engine died");
    assert!(ok > before);
}

/// A throwaway `redis-server` on a free port.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start() -> Option<Redis> {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .spawn();
        let child = match child {
            Ok(c) => c,
            Err(_) => {
                assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "redis-server not found");
                eprintln!("skipped: redis-server not found");
                return None;
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Redis { child, port })
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn two_gateway_processes_enforce_one_limit_through_redis() {
    if default_model().is_none() {
        return;
    }
    let Some(redis) = Redis::start() else { return };
    let port = free_port();
    let _engine = engine(port);
    // Both gateways share the database (keys) and Redis (counters).
    let shared = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", shared.path().join("gateway.db").display());
    let extra = format!("redis = \"redis://127.0.0.1:{}\"\n", redis.port);
    let a = Gateway::start_with_db(&[port], &extra, &db);
    let b = Gateway::start_with_db(&[port], &extra, &db);
    let key = a.key("acme", json!({"requests_per_minute": 6}));
    let mut ok = 0;
    let mut limited = 0;
    for i in 0..12 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let r = gw.completion(&key, "Hello", 1);
        match r.status().as_u16() {
            200 => ok += 1,
            429 => {
                assert!(r.headers().contains_key("retry-after"));
                limited += 1;
            }
            s => panic!("unexpected status {s}: {}", r.text().unwrap()),
        }
    }
    assert_eq!((ok, limited), (6, 6), "one limit of 6/min across both gateways");
}

/// Clients sending short non-streamed requests for `model` until stopped,
/// counting successes and failures.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    clients: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(gw: &Arc<Gateway>, key: &str, model: &'static str, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let clients = (0..clients)
            .map(|c| {
                let (gw, key, stop, ok, failed) =
                    (gw.clone(), key.to_string(), stop.clone(), ok.clone(), failed.clone());
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let r = gw.completion_for(&key, model, &format!("Client {c} counts: {i}, {}", i + 1), 4);
                        if r.status().is_success() {
                            ok.fetch_add(1, Ordering::Relaxed);
                        } else {
                            eprintln!("request failed: {} {}", r.status(), r.text().unwrap_or_default());
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        Load { stop, ok, failed, clients }
    }

    /// Stops the clients: (succeeded, failed).
    fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for c in self.clients {
            c.join().unwrap();
        }
        (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed))
    }
}

/// Engines reported by heartbeats: they appear in `/v1/models` and get
/// traffic; one killed under load fails no request while the other serves
/// (its breaker opens); reported `healthy: false` it gets nothing even once
/// it is back, and traffic returns when it is reported healthy; an agent
/// that stops reporting is gone within its ttl, and with the last one the
/// model is gone too.
#[test]
fn engines_reported_by_agents_join_fail_over_and_leave() {
    if default_model().is_none() {
        return;
    }
    const M: &str = "smollm2";
    let ports = [free_port(), free_port()];
    let mut engines = engines_as(&ports, M);
    let extra =
        "[gateway.health]\ninterval_ms = 250\ntimeout_ms = 500\n[gateway.breaker]\nfailures = 2\nopen_ms = 1000\n\
                 [gateway.agents]\nttl_ms = 1500\n";
    let gw = Arc::new(Gateway::start(&[], extra));
    let key = gw.key("acme", json!({}));
    assert!(gw.models(&key).is_empty());
    let agent_url = "http://127.0.0.1:9";
    let a = Beater::start(&gw.base, agent_body("node-a", agent_url, &[(M, ports[0], true)], &[M]));
    let b = Beater::start(&gw.base, agent_body("node-b", agent_url, &[(M, ports[1], true)], &[M]));
    assert_eq!(gw.models(&key), vec![M], "the model is listed as soon as it is reported");
    let v: Value = gw.completion_for(&key, M, "Hello", 2).json().unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");

    let load = Load::start(&gw, &key, M, 3);
    let ok_for = |m: &str, who: &str| {
        metric(m, &format!(r#"granary_gateway_upstream_attempts_total{{upstream="agent:{who}:{M}",outcome="ok"}}"#))
    };
    wait_until(Duration::from_secs(60), "both engines got traffic", || {
        let m = gw.metrics();
        ok_for(&m, "node-a") > 0.0 && ok_for(&m, "node-b") > 0.0
    });

    // The engine dies; the agent has not noticed yet (still reports it healthy).
    engines[0].kill9();
    let open = format!(r#"granary_gateway_upstream_breaker_state{{upstream="agent:node-a:{M}"}} 2"#);
    let took = wait_until(Duration::from_secs(5), "the dead engine's breaker opened", || gw.metrics().contains(&open));
    eprintln!("breaker opened {took:?} after the kill");
    std::thread::sleep(Duration::from_secs(1));

    // The agent restarts it and says so: no traffic until it reports it healthy.
    a.set(&gw.base, agent_body("node-a", agent_url, &[(M, ports[0], false)], &[M]));
    engines[0] = engine_as(ports[0], M);
    let up = format!(r#"granary_gateway_upstream_up{{upstream="agent:node-a:{M}"}} 1"#);
    wait_until(Duration::from_secs(10), "the gateway's health check passes", || gw.metrics().contains(&up));
    let before = ok_for(&gw.metrics(), "node-a");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(ok_for(&gw.metrics(), "node-a"), before, "an engine reported unhealthy got traffic");
    a.set(&gw.base, agent_body("node-a", agent_url, &[(M, ports[0], true)], &[M]));
    wait_until(Duration::from_secs(30), "traffic returned to the engine", || ok_for(&gw.metrics(), "node-a") > before);

    // node-b's agent goes silent: its engine leaves within the ttl.
    b.stop();
    let gone = wait_until(Duration::from_millis(1500 + 1500), "node-b expired", || {
        gw.get_admin("/admin/v1/agents")["data"].as_array().unwrap().len() == 1
    });
    eprintln!("node-b left {gone:?} after its last heartbeat");
    assert!(!gw.metrics().contains(&format!("agent:node-b:{M}")));
    std::thread::sleep(Duration::from_millis(500));
    let (ok, failed) = load.finish();
    eprintln!("{ok} requests succeeded, {failed} failed");
    assert_eq!(failed, 0, "a non-streamed request failed while engines died, restarted and left");
    assert_eq!(gw.completion_for(&key, M, "Hello", 1).status(), 200, "node-a still serves");

    // The last agent goes: the model is gone too.
    a.stop();
    wait_until(Duration::from_millis(3000), "the model left /v1/models", || gw.models(&key).is_empty());
    let r = gw.completion_for(&key, M, "Hello", 1);
    assert_eq!(r.status(), 404, "{}", r.text().unwrap());
}

/// The test's stand-in for a node agent's control API: `POST
/// /models/{model}/load` starts a real engine for `smollm2` and answers
/// with its address (reporting it in later heartbeats, as an agent does);
/// `stuck` never finishes loading.
struct LoadingAgent {
    url: String,
    loads: Arc<AtomicUsize>,
    engines: Arc<Mutex<Vec<Proc>>>,
    loaded: Arc<Mutex<Vec<(String, u16)>>>,
    _rt: tokio::runtime::Runtime,
}

impl LoadingAgent {
    fn start() -> LoadingAgent {
        use axum::extract::{Path, State};
        use axum::http::{HeaderMap, StatusCode};
        use axum::response::IntoResponse;
        #[derive(Clone)]
        struct St {
            loads: Arc<AtomicUsize>,
            engines: Arc<Mutex<Vec<Proc>>>,
            loaded: Arc<Mutex<Vec<(String, u16)>>>,
        }
        async fn load(State(s): State<St>, Path(model): Path<String>, headers: HeaderMap) -> axum::response::Response {
            if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer agent-secret") {
                return StatusCode::UNAUTHORIZED.into_response();
            }
            s.loads.fetch_add(1, Ordering::SeqCst);
            if model != "smollm2" {
                tokio::time::sleep(Duration::from_secs(600)).await;
                return StatusCode::GATEWAY_TIMEOUT.into_response();
            }
            let t0 = Instant::now();
            let port = free_port();
            let proc = tokio::task::spawn_blocking(move || engine_as(port, "smollm2")).await.unwrap();
            s.engines.lock().push(proc);
            s.loaded.lock().push((model.clone(), port));
            axum::Json(json!({
                "model": model, "revision": "0.1.2", "upstream": format!("http://127.0.0.1:{port}"),
                "state": "ready", "tier": "disk", "load_ms": t0.elapsed().as_millis() as u64,
            }))
            .into_response()
        }
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let st = St { loads: Arc::default(), engines: Arc::default(), loaded: Arc::default() };
        let app = axum::Router::new().route("/models/{model}/load", axum::routing::post(load)).with_state(st.clone());
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        rt.spawn(async move { axum::serve(listener, app).await });
        LoadingAgent { url, loads: st.loads, engines: st.engines, loaded: st.loaded, _rt: rt }
    }

    /// Its heartbeat: the engines it has loaded, and what it can load.
    fn heartbeat(&self, models: &[&str]) -> Value {
        let engines: Vec<Value> = self
            .loaded
            .lock()
            .iter()
            .map(|(m, port)| json!({"model": m, "upstream": format!("http://127.0.0.1:{port}"), "healthy": true}))
            .collect();
        json!({"agent_id": "node-l", "url": self.url, "token": "agent-secret", "engines": engines, "models": models})
    }
}

/// A request for a model no engine serves but an agent lists is held while
/// the agent starts a real engine (one load for all the requests waiting),
/// then answered by it; a load that outlasts `load_timeout_ms` is a 503
/// `model_loading` with `Retry-After`, audited.
#[test]
fn a_model_nobody_serves_is_loaded_by_an_agent_on_request() {
    if default_model().is_none() {
        return;
    }
    let agent = Arc::new(LoadingAgent::start());
    let gw = Arc::new(Gateway::start(&[], "[gateway.agents]\nload_timeout_ms = 180000\n"));
    let key = gw.key("acme", json!({}));
    let beat = Beater::start(&gw.base, agent.heartbeat(&["smollm2", "stuck"]));
    // The stand-in agent's later heartbeats list what it has loaded.
    let refresh = {
        let (agent, body, stop) = (agent.clone(), beat.body.clone(), beat.stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                *body.lock() = agent.heartbeat(&["smollm2", "stuck"]);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    assert_eq!(gw.models(&key), vec!["smollm2", "stuck"], "loadable models are listed");
    assert_eq!(gw.completion_for(&key, "nobody-lists-it", "Hello", 1).status(), 404);

    let t0 = Instant::now();
    let waiting: Vec<_> = (0..2)
        .map(|i| {
            let (gw, key) = (gw.clone(), key.clone());
            std::thread::spawn(move || {
                let r = gw.completion_for(&key, "smollm2", &format!("Say {i}"), 2);
                (r.status().as_u16(), r.text().unwrap())
            })
        })
        .collect();
    for w in waiting {
        let (status, text) = w.join().unwrap();
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    }
    eprintln!("loaded and answered in {:?}", t0.elapsed());
    assert_eq!(agent.loads.load(Ordering::SeqCst), 1, "one load for both requests");
    assert_eq!(agent.engines.lock().len(), 1);
    let m = gw.metrics();
    assert!(m.contains(r#"granary_gateway_model_loads_total{model="smollm2",outcome="succeeded"} 1"#), "{m}");
    // Heartbeats now report the engine: it stays, and serves without a load.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(gw.completion_for(&key, "smollm2", "Again", 1).status(), 200);
    assert_eq!(agent.loads.load(Ordering::SeqCst), 1);
    let agents = gw.get_admin("/admin/v1/agents");
    assert_eq!(agents["data"][0]["engines"][0]["name"], "agent:node-l:smollm2", "{agents}");

    // A second gateway that waits 1.5 s at most, for a model that never loads.
    let short = Gateway::start(&[], "[gateway.agents]\nload_timeout_ms = 1500\n");
    let short_key = short.key("acme", json!({}));
    let _short_beat = Beater::start(&short.base, agent.heartbeat(&["stuck"]));
    let t0 = Instant::now();
    let r = short.completion_for(&short_key, "stuck", "Hello", 1);
    let held = t0.elapsed();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "model_loading", "{v}");
    assert!(held >= Duration::from_millis(1500) && held < Duration::from_secs(10), "held {held:?}");
    wait_until(Duration::from_secs(5), "the 503 was audited", || {
        let recs = short.get_admin("/admin/v1/audit?limit=10");
        recs["data"].as_array().unwrap().iter().any(|r| r["status"] == 503 && r["error_code"] == "model_loading")
    });
    beat.stop();
    refresh.join().unwrap();
}

/// The semantic cache with a real engine embedding the prompts
/// (`/v1/embeddings` of the default model, mean-pooled): a question asked
/// again in other words is answered from the cache, with the first answer;
/// an unrelated one goes to the engine.
#[test]
fn the_semantic_cache_answers_a_rephrased_question_with_a_real_engines_embeddings() {
    if default_model().is_none() {
        return;
    }
    let port = free_port();
    let _engine = engine(port);
    let extra = format!("[gateway.semantic_cache]\nenabled = true\nembedding_model = \"{MODEL}\"\nthreshold = 0.95\n");
    let gw = Gateway::start(&[port], &extra);
    let key = gw.key("acme", json!({}));
    let ask = |question: &str| {
        let r = gw
            .http
            .post(format!("{}/v1/chat/completions", gw.base))
            .bearer_auth(&key)
            .json(&json!({"model": MODEL, "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "user", "content": question}]}))
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
        let header = |n: &str| r.headers().get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let (cache, matched) = (header("x-granary-cache"), header("x-granary-cache-match"));
        let v: Value = r.json().unwrap();
        (cache, matched, v["choices"][0]["message"]["content"].as_str().unwrap().to_string())
    };
    let (cache, _, first) = ask("What is the capital of France?");
    assert_eq!(cache, "miss");
    // The answer is kept before it is sent, so the next request finds it.
    let again = ask("what is the capital of France ?");
    assert_eq!((again.0.as_str(), again.1.as_str()), ("hit", "semantic"), "the rephrased question missed");
    assert_eq!(again.2, first, "a hit gives the kept answer");
    let (cache, _, _) = ask("Write a haiku about autumn leaves.");
    assert_eq!(cache, "miss", "an unrelated question was answered from the cache");
    let m = gw.metrics();
    assert!(metric(&m, "granary_gateway_semantic_cache_total{event=\"hit\"}") >= 1.0, "{m}");
}
