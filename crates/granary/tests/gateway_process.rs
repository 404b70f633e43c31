//! The real `granary gateway` in front of real `granary engine` processes
//! with the default model: the official `openai` client through it
//! (stream and not, bad key 401, over limit 429), KV-aware routing sending a
//! repeated prompt back to the engine that holds its blocks, and an engine
//! killed under load: no non-streamed request fails, its breaker opens
//! within 5 s, and traffic returns when it is back.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const ADMIN: &str = "gateway-admin-token-for-tests";
const MODEL: &str = "SmolLM2-135M-Instruct";

fn default_model() -> Option<std::path::PathBuf> {
    granary_tokenizer::testing::model_or_skip("gateway process test")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running `granary` subcommand, killed on drop.
struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `granary ARGS` and waits for its `granary: ready` line.
    fn start(args: &[&str], envs: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.args(args).env("GRANARY_LOG", "warn").stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn granary");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.trim() == "granary: ready" => break,
                Ok(_) => {}
                Err(_) => {
                    let _ = child.kill();
                    panic!("granary {args:?} did not get ready in time");
                }
            }
        }
        Proc { child }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn engine(port: u16) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    Proc::start(&["engine", "--listen", &listen, "--block-tokens", "16", "--trust-namespace-header"], &[])
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
        self.http
            .post(format!("{}/v1/completions", self.base))
            .bearer_auth(key)
            .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
            .send()
            .unwrap()
    }
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
    let first: Value = gw.completion(&key, &prompt, 1).json().unwrap();
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
    std::thread::sleep(Duration::from_secs(3));
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
