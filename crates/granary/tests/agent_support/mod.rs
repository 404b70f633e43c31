//! What the agent's process tests share: `granary` subcommands as child
//! processes (registry, gateway, agent), a reaper for the engines they
//! leave, and small HTTP helpers.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const TOKEN: &str = "agent-admin-token-for-tests";
pub const READ: &str = "registry-read-token-for-tests";
pub const REG_ADMIN: &str = "registry-admin-token-for-tests";
pub const GW_ADMIN: &str = "gateway-admin-token-for-tests";
/// The gateway's agent-scope token: heartbeats and nothing else.
pub const GW_AGENT: &str = "gateway-agent-token-for-tests";
pub const MODEL: &str = "smollm2";

pub fn default_model() -> Option<PathBuf> {
    granary_tokenizer::testing::model_or_skip("agent process test")
}

/// A `granary` subcommand, killed on drop.
pub struct Proc {
    pub child: Child,
    /// The `http://HOST:PORT` it printed after `addr_prefix`.
    pub base: String,
}

impl Proc {
    /// Starts `granary ARGS`, reads the address from the line starting with
    /// `addr_prefix` and waits for the line `ready`.
    pub fn start(args: &[&str], envs: &[(&str, &str)], addr_prefix: &str, ready: &str) -> Proc {
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

    pub fn kill9(&mut self) {
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
pub fn registry(model: &Path, dir: &Path) -> Proc {
    registry_with(model, dir, &[MODEL])
}

/// `granary registry serve` with the default model's directory imported under each of `names`.
pub fn registry_with(model: &Path, dir: &Path, names: &[&str]) -> Proc {
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
    for name in names {
        let out = Command::new(env!("CARGO_BIN_EXE_granary"))
            .args(["registry", "import", &source, "--name", name, "--revision", "0.1.2", "--license", "apache-2.0"])
            .args(["--url", &reg.base, "--token", REG_ADMIN])
            .output()
            .unwrap();
        assert!(out.status.success(), "import: {}", String::from_utf8_lossy(&out.stderr));
    }
    reg
}

/// `granary gateway` with agents on and no configured upstream.
pub struct Gateway {
    pub proc: Proc,
    pub key: String,
    pub http: reqwest::blocking::Client,
    _dir: tempfile::TempDir,
}

impl Gateway {
    pub fn start() -> Gateway {
        Gateway::start_with("")
    }

    /// A gateway whose `[gateway.agents]` table ends with `agents` (more lines).
    pub fn start_with(agents: &str) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        let cfg = format!(
            "[gateway]\nlisten = \"127.0.0.1:0\"\ndatabase = \"sqlite://{}/gateway.db\"\n\
             [gateway.health]\ninterval_ms = 250\ntimeout_ms = 1000\n\
             [gateway.agents]\nenabled = true\nttl_ms = 5000\nload_timeout_ms = 120000\n{agents}",
            dir.path().display()
        );
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, cfg).unwrap();
        let proc = Proc::start(
            &["gateway", "--config", path.to_str().unwrap()],
            &[("GRANARY_ADMIN_TOKEN", GW_ADMIN), ("GRANARY_AGENT_TOKEN", GW_AGENT)],
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

    /// A new tenant `name` and a key of its own.
    pub fn key_for(&self, name: &str) -> String {
        let admin = |path: &str, body: Value| -> Value {
            let r =
                self.http.post(format!("{}{path}", self.proc.base)).bearer_auth(GW_ADMIN).json(&body).send().unwrap();
            assert!(r.status().is_success(), "{path}: {}", r.text().unwrap());
            r.json().unwrap()
        };
        admin("/admin/v1/tenants", json!({"name": name}));
        admin("/admin/v1/keys", json!({"tenant": name}))["key"].as_str().unwrap().to_string()
    }

    /// `GET /admin/v1/agents`: the agent `id` as the gateway sees it.
    pub fn agent(&self, id: &str) -> Option<Value> {
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

    pub fn chat(&self) -> reqwest::blocking::Response {
        self.chat_model(MODEL)
    }

    pub fn chat_model(&self, model: &str) -> reqwest::blocking::Response {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0});
        self.http
            .post(format!("{}/v1/chat/completions", self.proc.base))
            .bearer_auth(&self.key)
            .json(&body)
            .send()
            .unwrap()
    }
}

pub fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Kills, at the end of a test whatever happened, every process whose
/// command line names the test's directory: the engines outlive their
/// agent by design.
pub struct Reaper(pub PathBuf);

/// The processes (pid, arguments) whose command line contains `needle`.
pub fn processes_naming(needle: &str) -> Vec<(u32, Vec<String>)> {
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

pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| !s[i + 1..].trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// A running `granary agent`.
pub struct AgentProc {
    pub proc: Proc,
    pub base: String,
    pub http: reqwest::blocking::Client,
}

impl AgentProc {
    /// An agent `id` of a fleet under `dir` (its own cache and RAM
    /// directories), reading `registry` and beating to `gateway` every
    /// 250 ms with the gateway's agent-scope token, with `extra` flags.
    pub fn in_fleet(registry: &str, gateway: &str, dir: &Path, id: &str, extra: &[&str]) -> AgentProc {
        let cache = dir.join(format!("cache-{id}"));
        let ram = dir.join(format!("ram-{id}"));
        let mut args = vec![
            "--registry",
            registry,
            "--registry-token",
            READ,
            "--cache-dir",
            cache.to_str().unwrap(),
            "--ram-dir",
            ram.to_str().unwrap(),
            "--admin-token",
            TOKEN,
            "--gateway",
            gateway,
            // The agent-scope token: the gateway takes its heartbeats and
            // nothing else from it.
            "--gateway-token",
            GW_AGENT,
            "--agent-id",
            id,
            "--heartbeat-interval",
            "250ms",
            "--health-interval",
            "100ms",
            "--engine-arg=--kv-cache=64MiB",
        ];
        args.extend_from_slice(extra);
        AgentProc::start(&args)
    }

    pub fn start(args: &[&str]) -> AgentProc {
        let mut all = vec!["agent", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let proc = Proc::start(&all, &[], "granary agent: control API on ", "granary: ready");
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
        AgentProc { base: proc.base.clone(), proc, http }
    }

    pub fn call(&self, method: &str, path: &str, body: Option<&str>, token: Option<&str>) -> (u16, String) {
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

    pub fn json(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let (s, text) = self.call(method, path, body, Some(TOKEN));
        (s, serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: not JSON: {text}")))
    }

    pub fn load(&self) -> Value {
        self.load_model(MODEL)
    }

    pub fn load_model(&self, model: &str) -> Value {
        let (s, v) = self.json("POST", &format!("/models/{model}/load"), Some("{}"));
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"], "ready", "{v}");
        v
    }

    pub fn status(&self) -> Value {
        let (s, v) = self.json("GET", "/status", None);
        assert_eq!(s, 200, "{v}");
        v
    }

    pub fn engine(&self) -> Option<Value> {
        self.engine_of(MODEL)
    }

    pub fn engine_of(&self, model: &str) -> Option<Value> {
        self.status()["engines"].as_array().unwrap().iter().find(|e| e["model"] == model).cloned()
    }

    /// Polls the engine's status until `pred` holds.
    pub fn wait_engine(&self, what: &str, limit: Duration, pred: impl Fn(&Value) -> bool) -> Value {
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

    pub fn kill9(&mut self) {
        self.proc.kill9();
    }
}

pub fn chat(upstream: &str) -> Value {
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
