//! The real `granary agent` between a real registry (`granary registry
//! serve`, the default model imported from its cached directory with
//! `dir:`) and a real gateway (`granary gateway` with agents on), running
//! real `granary engine` processes:
//!
//! - end to end: a chat request through the gateway for a model no engine
//!   serves yet → the gateway asks the agent → the agent downloads it from
//!   the registry and starts an engine → the request succeeds;
//! - kill -9 the engine → restarted after a doubling backoff, reported
//!   unhealthy to the gateway meanwhile; kill -9 the agent → a new one
//!   adopts the running engine (same pid); unload; loads served from disk
//!   then promoted to RAM; bad input on the control API;
//! - an external command template (a shell line running the engine), idle
//!   unload, and a template that fails.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const TOKEN: &str = "agent-admin-token-for-tests";
const READ: &str = "registry-read-token-for-tests";
const REG_ADMIN: &str = "registry-admin-token-for-tests";
const GW_ADMIN: &str = "gateway-admin-token-for-tests";
const MODEL: &str = "smollm2";

fn default_model() -> Option<PathBuf> {
    granary_tokenizer::testing::model_or_skip("agent process test")
}

/// A `granary` subcommand, killed on drop.
struct Proc {
    child: Child,
    /// The `http://HOST:PORT` it printed after `addr_prefix`.
    base: String,
}

impl Proc {
    /// Starts `granary ARGS`, reads the address from the line starting with
    /// `addr_prefix` and waits for the line `ready`.
    fn start(args: &[&str], envs: &[(&str, &str)], addr_prefix: &str, ready: &str) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.args(args).env("GRANARY_LOG", "info").stdout(Stdio::piped()).stderr(Stdio::inherit());
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
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut base = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("granary {args:?} did not print {ready:?} in time")
            });
            if let Some(rest) = line.strip_prefix(addr_prefix) {
                let url = rest.split_whitespace().next().unwrap();
                base = Some(url.trim_end_matches("/v1").to_string());
            } else if line.trim() == ready {
                break;
            }
        }
        Proc { child, base: base.expect("the address line") }
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

/// `granary registry serve` with the default model's cached directory imported.
fn registry(model: &Path, dir: &Path) -> Proc {
    let data = dir.join("registry");
    let reg = Proc::start(
        &[
            "registry",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--admin-token",
            REG_ADMIN,
            "--read-token",
            READ,
        ],
        &[],
        "granary registry: listening on ",
        "granary registry: ready",
    );
    let source = format!("dir:{}", model.parent().unwrap().display());
    let out = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["registry", "import", &source, "--name", MODEL, "--revision", "0.1.2", "--license", "apache-2.0"])
        .args(["--url", &reg.base, "--token", REG_ADMIN])
        .output()
        .unwrap();
    assert!(out.status.success(), "import: {}", String::from_utf8_lossy(&out.stderr));
    reg
}

/// `granary gateway` with agents on and no configured upstream.
struct Gateway {
    proc: Proc,
    key: String,
    http: reqwest::blocking::Client,
    _dir: tempfile::TempDir,
}

impl Gateway {
    fn start() -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        let cfg = format!(
            "[gateway]\nlisten = \"127.0.0.1:0\"\ndatabase = \"sqlite://{}/gateway.db\"\n\
             [gateway.health]\ninterval_ms = 250\ntimeout_ms = 1000\n\
             [gateway.agents]\nenabled = true\nttl_ms = 5000\nload_timeout_ms = 120000\n",
            dir.path().display()
        );
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, cfg).unwrap();
        let proc = Proc::start(
            &["gateway", "--config", path.to_str().unwrap()],
            &[("GRANARY_ADMIN_TOKEN", GW_ADMIN)],
            "granary: gateway on ",
            "granary: ready",
        );
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
        let admin = |path: &str, body: Value| -> Value {
            let r = http.post(format!("{}{path}", proc.base)).bearer_auth(GW_ADMIN).json(&body).send().unwrap();
            assert!(r.status().is_success(), "{path}: {}", r.text().unwrap());
            r.json().unwrap()
        };
        admin("/admin/v1/tenants", json!({"name": "acme"}));
        let key = admin("/admin/v1/keys", json!({"tenant": "acme"}))["key"].as_str().unwrap().to_string();
        Gateway { proc, key, http, _dir: dir }
    }

    /// `GET /admin/v1/agents`: the agent `id` as the gateway sees it.
    fn agent(&self, id: &str) -> Option<Value> {
        let v: Value = self
            .http
            .get(format!("{}/admin/v1/agents", self.proc.base))
            .bearer_auth(GW_ADMIN)
            .send()
            .unwrap()
            .json()
            .unwrap();
        v["data"].as_array().unwrap().iter().find(|a| a["agent_id"] == id).cloned()
    }

    fn chat(&self) -> reqwest::blocking::Response {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0});
        self.http
            .post(format!("{}/v1/chat/completions", self.proc.base))
            .bearer_auth(&self.key)
            .json(&body)
            .send()
            .unwrap()
    }
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Kills, at the end of a test whatever happened, every process whose
/// command line names the test's directory: the engines outlive their
/// agent by design.
struct Reaper(PathBuf);

/// The processes (pid, arguments) whose command line contains `needle`.
fn processes_naming(needle: &str) -> Vec<(u32, Vec<String>)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = String::from_utf8_lossy(&cmd).split('\0').map(str::to_string).collect();
            args.iter().any(|a| a.contains(needle)).then_some((pid, args))
        })
        .collect()
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for (pid, _) in processes_naming(&self.0.display().to_string()) {
            // SAFETY: kill(2) on a process this test started (it names the test's directory).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
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
    proc: Proc,
    base: String,
    http: reqwest::blocking::Client,
}

impl AgentProc {
    fn start(args: &[&str]) -> AgentProc {
        let mut all = vec!["agent", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let proc = Proc::start(&all, &[], "granary agent: control API on ", "granary: ready");
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
        AgentProc { base: proc.base.clone(), proc, http }
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

    fn load(&self) -> Value {
        let (s, v) = self.json("POST", &format!("/models/{MODEL}/load"), Some("{}"));
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"], "ready", "{v}");
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
        self.proc.kill9();
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
fn through_the_gateway_on_demand_then_restarts_adoption_unload_and_promotion() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let gw = Gateway::start();
    // A second replica: each gets the agent's heartbeats.
    let replica = Gateway::start();
    let cache_dir = dir.path().join("cache");
    let ram_dir = dir.path().join("ram");
    let args: Vec<String> = [
        "--registry",
        &registry.base,
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
        &gw.proc.base,
        "--gateway",
        &replica.proc.base,
        "--gateway-token",
        GW_ADMIN,
        "--agent-id",
        "node-a",
        "--heartbeat-interval",
        "500ms",
        "--health-interval",
        "100ms",
        "--engine-arg=--kv-cache=64MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = AgentProc::start(&args);

    // Bad input: no token, a wrong token, bad JSON, an unknown model, a bad name.
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
    let got = (s, v["error"]["code"].as_str(), v["error"]["param"].as_str());
    assert_eq!(got, (404, Some("model_not_found"), Some("name")), "{v}");
    let (s, v) = agent.json("POST", "/models/.hidden/load", None);
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("name")), "{v}");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/unload"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("model_not_loaded")), "{v}");

    // The gateway hears of the agent and what it can load.
    wait_until("the gateway lists the agent's models", Duration::from_secs(15), || {
        gw.agent("node-a").is_some_and(|a| a["models"].as_array().unwrap().iter().any(|m| m == MODEL))
    });
    let seen = gw.agent("node-a").unwrap();
    assert_eq!(seen["url"], agent.base.as_str(), "{seen}");
    assert_eq!(seen["has_token"], true, "{seen}");
    assert!(seen["engines"].as_array().unwrap().is_empty(), "{seen}");

    // End to end: a chat request for the model no engine serves yet.
    let r = gw.chat();
    let status = r.status();
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{v}");
    let e = agent.engine().expect("the gateway had the agent load the model");
    assert_eq!((e["state"].as_str(), e["tier"].as_str()), (Some("ready"), Some("registry")), "{e}");
    let upstream = e["upstream"].as_str().unwrap().to_string();
    let seen = gw.agent("node-a").unwrap();
    assert_eq!(seen["engines"][0]["name"], format!("agent:node-a:{MODEL}"), "{seen}");
    assert_eq!(seen["engines"][0]["upstream"], upstream.as_str());
    assert_eq!(seen["engines"][0]["routable"], true, "{seen}");
    wait_until("the replica hears of the engine too", Duration::from_secs(10), || {
        replica.agent("node-a").is_some_and(|a| a["engines"][0]["upstream"] == upstream.as_str())
    });
    let st = agent.status();
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(st["tiers"]["disk"]["used"].as_u64().unwrap() >= size, "{st}");
    // The load the gateway asked for, broken down: a download, then the engine's start.
    let last = &st["loads"][0];
    assert_eq!((last["model"].as_str(), last["tier"].as_str()), (Some(MODEL), Some("registry")), "{st}");
    let (load_ms, fetch_ms, engine_ms) =
        (last["load_ms"].as_u64().unwrap(), last["fetch_ms"].as_u64().unwrap(), last["engine_ms"].as_u64().unwrap());
    assert!(fetch_ms > 0 && engine_ms > 0 && fetch_ms + engine_ms <= load_ms, "{last}");
    let (s, logs) = agent.call("GET", &format!("/models/{MODEL}/logs?tail=50"), None, Some(TOKEN));
    assert_eq!(s, 200);
    assert!(logs.contains("granary: ready"), "{logs}");
    assert_eq!(agent.call("GET", &format!("/models/{MODEL}/logs?tail=x"), None, Some(TOKEN)).0, 400);

    // kill -9 the engine, twice: restarted after 0.5 s, then 1 s (the
    // backoff doubles); meanwhile the gateway is told it is unhealthy and
    // does not route to it.
    let mut waits = Vec::new();
    for round in 1..=2u64 {
        let pid = agent.engine().unwrap()["pid"].as_u64().unwrap() as u32;
        let killed = Instant::now();
        // SAFETY: the engine the agent started for this test.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let down = agent.wait_engine("seen restarting", Duration::from_secs(10), |e| e["state"] == "restarting");
        assert!(down["pid"].is_null(), "{down}");
        wait_until("the gateway takes it out of routing", Duration::from_secs(5), || {
            gw.agent("node-a")
                .is_some_and(|a| a["engines"][0]["healthy"] == false && a["engines"][0]["routable"] == false)
        });
        agent.wait_engine("a new process", Duration::from_secs(10), |e| {
            e["pid"].as_u64().is_some_and(|p| p as u32 != pid)
        });
        waits.push(killed.elapsed());
        let e = agent.wait_engine("ready again", Duration::from_secs(60), |e| e["state"] == "ready");
        assert_eq!(e["restarts"], round, "{e}");
        assert!(e["last_error"].as_str().unwrap().contains("signal 9"), "{e}");
        assert!(!alive(pid));
        wait_until("routable again", Duration::from_secs(10), || {
            gw.agent("node-a").is_some_and(|a| a["engines"][0]["routable"] == true)
        });
        assert_eq!(gw.chat().status(), 200);
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
    let again = agent.load();
    assert_eq!(again["upstream"], before["upstream"], "loading a loaded model answers at once");
    assert_eq!(gw.chat().status(), 200);

    // Unload: the process group is gone, the port closed, the gateway
    // drops the upstream; a second unload is 404.
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/unload"), None);
    assert_eq!((s, v["state"].as_str()), (200, Some("unloaded")), "{v}");
    assert!(!alive(pid), "the engine was stopped");
    assert!(std::net::TcpStream::connect(before["upstream"].as_str().unwrap().trim_start_matches("http://")).is_err());
    assert!(agent.engine().is_none());
    assert_eq!(agent.json("POST", &format!("/models/{MODEL}/unload"), None).0, 404);
    wait_until("the gateway drops the engine", Duration::from_secs(10), || {
        gw.agent("node-a").is_some_and(|a| a["engines"].as_array().unwrap().is_empty())
    });

    // Load again: from the disk tier this time (no download). Then again:
    // the second load within the window promotes it to RAM.
    let v = agent.load();
    assert_eq!(v["tier"], "disk", "{v}");
    assert_eq!(v["fetch_ms"], 0, "nothing to download: {v}");
    assert!(v["engine_ms"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(agent.status()["loads"][0]["upstream"], v["upstream"], "status keeps the last load");
    assert_eq!(agent.json("POST", &format!("/models/{MODEL}/unload"), None).0, 200);
    let v = agent.load();
    assert_eq!(v["tier"], "ram", "{v}");
    chat(v["upstream"].as_str().unwrap());
    let st = agent.status();
    assert!(st["tiers"]["ram"]["used"].as_u64().unwrap() >= size, "{st}");
    let gguf = model.file_name().unwrap();
    let link = cache_dir.join("models").join(MODEL).join("0.1.2").join(gguf);
    assert!(std::fs::read_link(&link).unwrap().starts_with(&ram_dir), "{link:?} points into the RAM tier");
}

#[test]
fn an_external_command_template_runs_and_an_idle_engine_is_unloaded() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let cache_dir = dir.path().join("cache");
    let common = |template: &str| -> Vec<String> {
        [
            "--registry",
            &registry.base,
            "--registry-token",
            READ,
            "--cache-dir",
            cache_dir.to_str().unwrap(),
            "--ram-budget",
            "0",
            "--admin-token",
            TOKEN,
            "--engine-command",
            template,
            "--idle-unload",
            "2s",
            "--idle-poll",
            "200ms",
            "--health-interval",
            "100ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    // Nothing listens beyond loopback without an admin token.
    let out = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["agent", "--listen", "0.0.0.0:0", "--cache-dir", cache_dir.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--admin-token"), "{err}");

    // Weights whose sha256 does not match: one byte flipped in the
    // registry's stored copy. Refused, nothing kept, nothing started.
    let failing = common("echo cannot start {model_id} >&2; exit 3");
    let agent = AgentProc::start(&failing.iter().map(String::as_str).collect::<Vec<_>>());
    let size = std::fs::metadata(&model).unwrap().len();
    let stored = common::files_under(&dir.path().join("registry"))
        .into_iter()
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.len() == size))
        .expect("the registry's copy of the weights");
    let original = std::fs::read(&stored).unwrap();
    let mut corrupt = original.clone();
    corrupt[size as usize / 2] ^= 0xff;
    std::fs::write(&stored, &corrupt).unwrap();
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (502, Some("checksum_mismatch")), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("sha256 mismatch") && msg.contains(".gguf"), "{msg}");
    assert!(agent.engine().is_none());
    let big: Vec<_> = common::files_under(&cache_dir.join("blobs"))
        .into_iter()
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.len() >= size / 2))
        .collect();
    assert!(big.is_empty(), "nothing of the bad download is kept: {big:?}");
    std::fs::write(&stored, &original).unwrap();

    // A template that cannot start: the load fails with the log's tail, nothing keeps running.
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (503, Some("engine_failed")), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("exited with status 3") && msg.contains(&format!("cannot start {MODEL}")), "{msg}");
    assert!(agent.engine().is_none());
    drop(agent);

    // A real external command: a shell line that echoes, then runs the
    // engine (as one would vLLM), with the agent's placeholders.
    let template = format!(
        "echo external engine for {{model_id}}; '{}' engine --model {{model_path}} --model-id {{model_id}} --listen {{host}}:{{port}} --kv-cache 64MiB",
        env!("CARGO_BIN_EXE_granary")
    );
    let args = common(&template);
    let agent = AgentProc::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let v = agent.load();
    assert_eq!(v["tier"], "disk", "the failed load above had downloaded it: {v}");
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
    wait_until("the idle engine is unloaded", Duration::from_secs(20), || agent.engine().is_none());
    let idle_for = last_request.elapsed();
    assert!(idle_for >= Duration::from_secs(2), "unloaded after only {idle_for:?} idle");
    assert!(!alive(pid), "the shell is gone");
    // The whole process group went: nothing still runs on that model path.
    let survivors: Vec<String> = processes_naming(&cache_dir.display().to_string())
        .into_iter()
        // The shell (`sh -c ...`) or the engine it ran, not the agent.
        .filter(|(_, args)| args.get(1).is_some_and(|a| a == "engine" || a == "-c"))
        .map(|(_, args)| args.join(" "))
        .collect();
    assert!(survivors.is_empty(), "left running: {survivors:?}");
    assert!(std::net::TcpStream::connect(upstream.trim_start_matches("http://")).is_err());
}
