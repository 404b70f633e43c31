//! The real `granary agent` with a real registry (in this process, the
//! default model imported into it) and real `granary engine` processes:
//! load → ready → chat; kill -9 the engine → restarted with a doubling
//! backoff, heartbeats say it is down meanwhile; kill -9 the agent → a new
//! one adopts the running engine (same pid); unload; loads served from disk
//! then promoted to RAM; an external command template; idle unload; bad
//! input on the control API.
//!
//! The heartbeat receiver here is a small HTTP server in the test playing
//! the gateway's part (it records what the agent sends); the end-to-end test
//! in `agent_gateway_process.rs` runs the real gateway.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{json, Value};

const TOKEN: &str = "agent-admin-token-for-tests";
const READ: &str = "registry-read-token-for-tests";
const REG_ADMIN: &str = "registry-admin-token-for-tests";
const GW_TOKEN: &str = "gateway-admin-token-for-tests";
const MODEL: &str = "smollm2";

fn default_model() -> Option<PathBuf> {
    granary_tokenizer::testing::model_or_skip("agent process test")
}

/// A registry served by a runtime of its own, with the default model imported.
struct Registry {
    url: String,
    rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start(model: &Path) -> Registry {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = format!("file://{}/store/", dir.path().display());
        let mut cfg =
            granary_registry::RegistryConfig::new(format!("sqlite://{}/registry.db", dir.path().display()), store);
        cfg.admin_token = Some(REG_ADMIN.into());
        cfg.read_tokens = vec![READ.into()];
        let url = rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", l.local_addr().unwrap());
            tokio::spawn(async move {
                granary_registry::server::serve(cfg, l, std::future::pending()).await.expect("registry");
            });
            let admin = granary_registry::RegistryClient::new(&url, Some(REG_ADMIN.into())).unwrap();
            let req = granary_registry::ImportRequest {
                name: MODEL.into(),
                revision: Some("0.1.2".into()),
                source: format!("dir:{}", model.display()),
                license: Some("apache-2.0".into()),
            };
            let rev = admin.import(&req).await.expect("import the default model");
            assert_eq!(rev.format, "gguf");
            url
        });
        Registry { url, rt, _dir: dir }
    }
}

/// An HTTP server standing in for the gateway's heartbeat endpoint: it
/// records each body and the bearer token it came with.
/// When a heartbeat came, its `Authorization` header, its body.
type Beat = (Instant, Option<String>, Value);

#[derive(Clone, Default)]
struct Receiver {
    beats: Arc<Mutex<Vec<Beat>>>,
}

impl Receiver {
    fn start(rt: &tokio::runtime::Runtime) -> (Receiver, String) {
        let r = Receiver::default();
        let beats = r.beats.clone();
        let url = rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", l.local_addr().unwrap());
            let app = axum::Router::new().route(
                "/admin/v1/agents/heartbeat",
                axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::Json<Value>| {
                    let beats = beats.clone();
                    async move {
                        let auth = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
                        beats.lock().push((Instant::now(), auth, body.0));
                        axum::Json(json!({"ok": true}))
                    }
                }),
            );
            tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
            url
        });
        (r, url)
    }

    fn since(&self, t: Instant) -> Vec<Value> {
        self.beats.lock().iter().filter(|(at, _, _)| *at >= t).map(|(_, _, b)| b.clone()).collect()
    }

    fn last(&self) -> Option<(Option<String>, Value)> {
        self.beats.lock().last().map(|(_, a, b)| (a.clone(), b.clone()))
    }
}

/// Engine process groups seen in the test, killed at the end whatever
/// happened (engines outlive their agent by design).
#[derive(Default)]
struct Reaper(Mutex<Vec<u32>>);

impl Reaper {
    fn watch(&self, pid: u32) {
        self.0.lock().push(pid);
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for &pid in self.0.lock().iter() {
            // SAFETY: kill(2) on a process group the test started.
            unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
        }
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| !s[i + 1..].trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// A running `granary agent`.
struct AgentProc {
    child: Child,
    base: String,
    http: reqwest::blocking::Client,
}

impl AgentProc {
    fn start(args: &[&str]) -> AgentProc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.arg("agent").args(["--listen", "127.0.0.1:0"]).args(args);
        cmd.env("GRANARY_LOG", "info,granary_agent=debug").stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn granary agent");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut base = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("granary agent did not print `ready` in time")
            });
            if let Some(rest) = line.strip_prefix("granary agent: control API on ") {
                base = rest.split_whitespace().next().map(str::to_string);
            } else if line.trim() == "granary: ready" {
                break;
            }
        }
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
        AgentProc { child, base: base.expect("the address line"), http }
    }

    fn call(&self, method: &str, path: &str, body: Option<&str>, token: Option<&str>) -> (u16, String) {
        let mut r = self.http.request(method.parse().unwrap(), format!("{}{path}", self.base));
        if let Some(b) = body {
            r = r.header("content-type", "application/json").body(b.to_string());
        }
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let resp = r.send().unwrap();
        (resp.status().as_u16(), resp.text().unwrap())
    }

    fn json(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let (s, text) = self.call(method, path, body, Some(TOKEN));
        (s, serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: not JSON: {text}")))
    }

    fn load(&self, reaper: &Reaper) -> Value {
        let (s, v) = self.json("POST", &format!("/models/{MODEL}/load"), Some("{}"));
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"], "ready", "{v}");
        if let Some(e) = self.engine() {
            reaper.watch(e["pid"].as_u64().unwrap() as u32);
        }
        v
    }

    fn status(&self) -> Value {
        let (s, v) = self.json("GET", "/status", None);
        assert_eq!(s, 200, "{v}");
        v
    }

    fn engine(&self) -> Option<Value> {
        self.status()["engines"].as_array().unwrap().iter().find(|e| e["model"] == MODEL).cloned()
    }

    /// Polls the engine's status until `pred` holds.
    fn wait_engine(&self, what: &str, limit: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(e) = self.engine() {
                if pred(&e) {
                    return e;
                }
            }
            assert!(Instant::now() < deadline, "{what}: {:?}", self.engine());
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn chat(upstream: &str) -> Value {
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0});
    let r = reqwest::blocking::Client::new()
        .post(format!("{upstream}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{v}");
    v
}

#[test]
fn the_agent_loads_restarts_adopts_unloads_and_promotes() {
    let Some(model) = default_model() else { return };
    let reaper = Reaper::default();
    let registry = Registry::start(&model);
    let (receiver, gateway) = Receiver::start(&registry.rt);
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().join("cache");
    let ram_dir = cache.path().join("ram");
    let args: Vec<String> = [
        "--registry",
        &registry.url,
        "--registry-token",
        READ,
        "--cache-dir",
        cache_dir.to_str().unwrap(),
        "--ram-dir",
        ram_dir.to_str().unwrap(),
        "--ram-budget",
        "512MiB",
        "--promote-after",
        "2",
        "--admin-token",
        TOKEN,
        "--gateway",
        &gateway,
        "--gateway-token",
        GW_TOKEN,
        "--agent-id",
        "node-a",
        "--health-interval",
        "100ms",
        "--engine-arg=--kv-cache=64MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = AgentProc::start(&args);

    // Bad input first: no token, a wrong token, bad JSON, an unknown model, a bad name.
    let (s, body) = agent.call("GET", "/status", None, None);
    assert_eq!(s, 401, "{body}");
    assert!(body.contains("invalid_admin_token"), "{body}");
    assert_eq!(agent.call("POST", &format!("/models/{MODEL}/load"), Some("{}"), Some("wrong")).0, 401);
    assert_eq!(agent.call("GET", "/health", None, None).0, 200, "health needs no token");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), Some(r#"{"revision": 12}"#));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("revision")), "{v}");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), Some("{oops"));
    assert_eq!((s, v["error"]["code"].as_str()), (400, Some("invalid_request_body")), "{v}");
    let (s, v) = agent.json("POST", "/models/no-such-model/load", None);
    assert_eq!(
        (s, v["error"]["code"].as_str(), v["error"]["param"].as_str()),
        (404, Some("model_not_found"), Some("name")),
        "{v}"
    );
    let (s, v) = agent.json("POST", "/models/.hidden/load", None);
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("name")), "{v}");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/unload"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("model_not_loaded")), "{v}");

    // Load: downloaded from the registry, engine healthy, answers chat.
    let loaded = agent.load(&reaper);
    assert_eq!(loaded["tier"], "registry", "{loaded}");
    assert_eq!(loaded["revision"], "0.1.2");
    let upstream = loaded["upstream"].as_str().unwrap().to_string();
    chat(&upstream);
    let st = agent.status();
    let size = std::fs::metadata(&model).unwrap().len();
    assert_eq!(st["tiers"]["disk"]["used"], size, "{st}");
    assert_eq!(st["tiers"]["disk"]["files"], 1, "{st}");
    let e = agent.engine().unwrap();
    assert_eq!((e["state"].as_str(), e["restarts"].as_u64()), (Some("ready"), Some(0)), "{e}");
    let (s, logs) = agent.call("GET", &format!("/models/{MODEL}/logs?tail=50"), None, Some(TOKEN));
    assert_eq!(s, 200);
    assert!(logs.contains("granary: ready"), "{logs}");
    assert_eq!(agent.call("GET", &format!("/models/{MODEL}/logs?tail=x"), None, Some(TOKEN)).0, 400);

    // The heartbeat carries the engine, the registry's models and the agent's token.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some((auth, b)) = receiver.last() {
            if b["engines"].as_array().is_some_and(|e| e.iter().any(|e| e["model"] == MODEL && e["healthy"] == true)) {
                assert_eq!(auth.as_deref(), Some(format!("Bearer {GW_TOKEN}").as_str()));
                assert_eq!(b["agent_id"], "node-a");
                assert_eq!(b["url"], agent.base.as_str());
                assert_eq!(b["token"], TOKEN);
                assert_eq!(b["engines"][0]["upstream"], upstream.as_str());
                assert!(b["models"].as_array().unwrap().iter().any(|m| m == MODEL), "{b}");
                break;
            }
        }
        assert!(Instant::now() < deadline, "no heartbeat with the ready engine: {:?}", receiver.last());
        std::thread::sleep(Duration::from_millis(50));
    }

    // kill -9 the engine, twice: restarted each time, after 0.5 s then 1 s
    // (the backoff doubles); heartbeats report it down in between.
    let mut waits = Vec::new();
    for round in 1..=2u64 {
        let pid = agent.engine().unwrap()["pid"].as_u64().unwrap() as u32;
        let killed = Instant::now();
        // SAFETY: the engine the agent started for this test.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let down = agent.wait_engine("seen restarting", Duration::from_secs(10), |e| e["state"] == "restarting");
        assert!(down["pid"].is_null(), "{down}");
        agent.wait_engine("a new process", Duration::from_secs(10), |e| {
            e["pid"].as_u64().is_some_and(|p| p as u32 != pid)
        });
        waits.push(killed.elapsed());
        let e = agent.wait_engine("ready again", Duration::from_secs(60), |e| e["state"] == "ready");
        reaper.watch(e["pid"].as_u64().unwrap() as u32);
        assert_eq!(e["restarts"], round, "{e}");
        assert!(e["last_error"].as_str().unwrap().contains("signal 9"), "{e}");
        assert!(!alive(pid));
        let beats = receiver.since(killed);
        assert!(
            beats.iter().any(|b| b["engines"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["model"] == MODEL && e["healthy"] == false)),
            "no heartbeat reported the engine down: {beats:?}"
        );
        chat(e["upstream"].as_str().unwrap());
    }
    assert!(waits[0] >= Duration::from_millis(500), "first restart after {:?}", waits[0]);
    assert!(waits[1] >= Duration::from_millis(1000), "second restart after {:?} (backoff doubled)", waits[1]);

    // kill -9 the agent; the engine keeps serving; a new agent adopts it.
    let before = agent.engine().unwrap();
    agent.kill9();
    let pid = before["pid"].as_u64().unwrap() as u32;
    assert!(alive(pid), "the engine outlives its agent");
    chat(before["upstream"].as_str().unwrap());
    let agent = AgentProc::start(&args);
    let e = agent.wait_engine("adopted and ready", Duration::from_secs(30), |e| e["state"] == "ready");
    assert_eq!(e["pid"], before["pid"], "the same process, adopted: {e}");
    assert_eq!(e["adopted"], true, "{e}");
    assert_eq!(e["restarts"], before["restarts"]);
    let again = agent.load(&reaper);
    assert_eq!(again["upstream"], before["upstream"], "loading a loaded model answers at once");
    chat(e["upstream"].as_str().unwrap());

    // Unload: the process group is gone, the port closed; a second unload is 404.
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/unload"), None);
    assert_eq!((s, v["state"].as_str()), (200, Some("unloaded")), "{v}");
    assert!(!alive(pid), "the engine was stopped");
    assert!(std::net::TcpStream::connect(before["upstream"].as_str().unwrap().trim_start_matches("http://")).is_err());
    assert!(agent.engine().is_none());
    assert_eq!(agent.json("POST", &format!("/models/{MODEL}/unload"), None).0, 404);

    // Load again: from the disk tier this time (no download). Then again:
    // the second load within the window promotes it to RAM.
    let v = agent.load(&reaper);
    assert_eq!(v["tier"], "disk", "{v}");
    assert_eq!(agent.json("POST", &format!("/models/{MODEL}/unload"), None).0, 200);
    let v = agent.load(&reaper);
    assert_eq!(v["tier"], "ram", "{v}");
    chat(v["upstream"].as_str().unwrap());
    let st = agent.status();
    assert_eq!(st["tiers"]["ram"]["used"], size, "{st}");
    let link = cache_dir.join("models").join(MODEL).join("0.1.2").join(model.file_name().unwrap());
    assert!(std::fs::read_link(&link).unwrap().starts_with(&ram_dir), "{link:?} points into the RAM tier");
}

#[test]
fn an_external_command_template_runs_and_an_idle_engine_is_unloaded() {
    let Some(model) = default_model() else { return };
    let reaper = Reaper::default();
    let registry = Registry::start(&model);
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().join("cache");
    // A real external command: a shell line that echoes, then runs the
    // engine (as one would vLLM), with the agent's placeholders.
    let template = format!(
        "echo external engine for {{model_id}}; '{}' engine --model {{model_path}} --model-id {{model_id}} --listen {{host}}:{{port}} --kv-cache 64MiB",
        env!("CARGO_BIN_EXE_granary")
    );
    let agent = AgentProc::start(&[
        "--registry",
        &registry.url,
        "--registry-token",
        READ,
        "--cache-dir",
        cache_dir.to_str().unwrap(),
        "--ram-budget",
        "0",
        "--admin-token",
        TOKEN,
        "--engine-command",
        &template,
        "--idle-unload",
        "2s",
        "--idle-poll",
        "200ms",
        "--health-interval",
        "100ms",
    ]);
    let v = agent.load(&reaper);
    let upstream = v["upstream"].as_str().unwrap().to_string();
    let pid = agent.engine().unwrap()["pid"].as_u64().unwrap() as u32;
    let (_, logs) = agent.call("GET", &format!("/models/{MODEL}/logs"), None, Some(TOKEN));
    assert!(logs.contains(&format!("external engine for {MODEL}")), "{logs}");
    assert!(logs.contains("sh -c echo external engine"), "{logs}");

    // Requests keep it loaded; once they stop it goes after 2 s idle.
    let mut last_request = Instant::now();
    for _ in 0..3 {
        last_request = Instant::now();
        chat(&upstream);
        std::thread::sleep(Duration::from_millis(700));
        assert!(agent.engine().is_some(), "unloaded while in use");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while agent.engine().is_some() {
        assert!(Instant::now() < deadline, "the idle engine was not unloaded: {:?}", agent.engine());
        std::thread::sleep(Duration::from_millis(50));
    }
    let idle_for = last_request.elapsed();
    assert!(idle_for >= Duration::from_secs(2), "unloaded after only {idle_for:?} idle");
    assert!(!alive(pid), "the shell is gone");
    // The whole process group went: nothing still runs on that model path.
    let path = cache_dir.display().to_string();
    let survivors: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).split('\0').map(str::to_string).collect::<Vec<_>>())
        // The shell (`sh -c ...`) or the engine it ran, not the agent.
        .filter(|args| args.get(1).is_some_and(|a| a == "engine" || a == "-c") && args.join(" ").contains(&path))
        .map(|args| args.join(" "))
        .collect();
    assert!(survivors.is_empty(), "left running: {survivors:?}");
    assert!(std::net::TcpStream::connect(upstream.trim_start_matches("http://")).is_err());
}
