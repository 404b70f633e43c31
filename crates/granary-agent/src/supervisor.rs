//! Engine processes: start, watch, restart, stop, and find again.
//!
//! Each engine is a child process in its own process group, so a signal
//! meant for the agent (Ctrl-C in a terminal, a service manager stopping it)
//! does not reach the engines, and they go on serving while the agent
//! restarts. Their stdout and stderr go straight to `<cache>/logs/<model>.log`
//! (never through a pipe the agent holds, which would break when it exits);
//! the agent rotates that file by size (copy, then truncate: the engine
//! writes with `O_APPEND`).
//!
//! A watcher task per engine checks `GET /health`; one failure marks the
//! engine `unhealthy` (the gateway stops routing to it at the next
//! heartbeat), `health_failures` in a row restart it. An exit restarts it
//! too, after an exponential backoff. An engine that never became healthy
//! is not restarted: the load that started it fails with its log's tail.
//!
//! `<cache>/agent-state.json` lists the engines (pid, its start time in
//! `/proc`, port, command). An agent that starts again adopts an engine
//! whose pid is alive and is the same process (same start time), and
//! watches it by polling; the others are started again by the agent.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use granary_core::ByteSize;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::AgentError;
use crate::tiers::Tier;

/// How engines are started and watched.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisorConfig {
    /// An external engine's command line, run with `sh -c`, with `{model_path}`,
    /// `{model_id}`, `{port}` and `{host}` substituted (shell-quoted); e.g.
    /// `vllm serve {model_path} --served-model-name {model_id} --host {host} --port {port}`.
    /// None: the embedded engine (`granary engine`).
    pub command: Option<String>,
    /// The `granary` executable for the embedded engine [default: the running one].
    pub granary_exe: Option<PathBuf>,
    /// Extra flags passed to `granary engine`.
    pub engine_args: Vec<String>,
    /// The address engines listen on (substituted as `{host}`).
    pub host: String,
    /// Time between health checks of each engine.
    #[serde(with = "crate::config::duration")]
    pub health_interval: Duration,
    /// Time limit of one health check.
    #[serde(with = "crate::config::duration")]
    pub health_timeout: Duration,
    /// Failed health checks in a row that restart a running engine.
    pub health_failures: u32,
    /// Time an engine has to become healthy after it starts.
    #[serde(with = "crate::config::duration")]
    pub start_timeout: Duration,
    /// First wait before a restart; doubled after each restart in a row.
    #[serde(with = "crate::config::duration")]
    pub backoff_initial: Duration,
    /// Longest wait before a restart.
    #[serde(with = "crate::config::duration")]
    pub backoff_max: Duration,
    /// Time an engine has to exit after SIGTERM before SIGKILL.
    #[serde(with = "crate::config::duration")]
    pub stop_timeout: Duration,
    /// Size at which an engine's log is rotated (one old file is kept).
    pub log_max_bytes: ByteSize,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            command: None,
            granary_exe: None,
            engine_args: Vec::new(),
            host: "127.0.0.1".into(),
            health_interval: Duration::from_secs(1),
            health_timeout: Duration::from_secs(2),
            health_failures: 3,
            start_timeout: Duration::from_secs(300),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            stop_timeout: Duration::from_secs(10),
            log_max_bytes: ByteSize::mib(16),
        }
    }
}

/// An engine's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineState {
    Starting,
    Ready,
    Unhealthy,
    Restarting,
    Stopped,
}

/// What to start: a model revision laid out on local disk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LaunchSpec {
    pub model: String,
    pub revision: String,
    /// The GGUF file or the model directory the engine opens.
    pub model_path: PathBuf,
    /// sha256 of every file the engine reads (held in the tiers while it runs).
    pub files: Vec<String>,
    /// Where the weights came from at load.
    pub tier: Tier,
}

/// One engine in `GET /status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EngineStatus {
    pub model: String,
    pub revision: String,
    pub upstream: String,
    pub pid: Option<u32>,
    pub state: EngineState,
    pub restarts: u32,
    /// When requests were last seen (from the engine's metrics), unix seconds.
    pub last_request_unix: Option<u64>,
    pub tier: Tier,
    pub started_unix: u64,
    /// Whether this agent found the engine running when it started.
    pub adopted: bool,
    /// Whether it has been healthy since its load (an engine still starting
    /// for the first time is not yet anyone's upstream).
    pub ever_ready: bool,
    /// Why the engine last failed, if it did.
    pub last_error: Option<String>,
}

/// One engine in the state file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Persisted {
    #[serde(flatten)]
    pub spec: LaunchSpec,
    /// 0 while it is between two processes (a restart's backoff).
    pub pid: u32,
    /// The process's start time in clock ticks since boot (`/proc/PID/stat`
    /// field 22), so a recycled pid is not mistaken for the engine.
    pub proc_start: u64,
    pub port: u16,
    pub command: Vec<String>,
    pub started_unix: u64,
    pub restarts: u32,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    engines: Vec<Persisted>,
}

struct Live {
    pid: Option<u32>,
    proc_start: u64,
    port: u16,
    command: Vec<String>,
    restarts: u32,
    started_unix: u64,
    /// Unix milliseconds.
    last_activity_ms: Option<u64>,
    last_error: Option<String>,
    adopted: bool,
    ever_ready: bool,
}

struct Engine {
    spec: LaunchSpec,
    live: Mutex<Live>,
    state: watch::Sender<EngineState>,
    stop: CancellationToken,
}

impl Engine {
    fn upstream(&self, host: &str) -> String {
        format!("http://{host}:{}", self.live.lock().port)
    }

    fn status(&self, host: &str) -> EngineStatus {
        let l = self.live.lock();
        EngineStatus {
            model: self.spec.model.clone(),
            revision: self.spec.revision.clone(),
            upstream: format!("http://{host}:{}", l.port),
            pid: l.pid,
            state: *self.state.borrow(),
            restarts: l.restarts,
            last_request_unix: l.last_activity_ms.map(|ms| ms / 1000),
            tier: self.spec.tier,
            started_unix: l.started_unix,
            adopted: l.adopted,
            ever_ready: l.ever_ready,
            last_error: l.last_error.clone(),
        }
    }
}

struct Shared {
    cfg: SupervisorConfig,
    logs_dir: PathBuf,
    state_path: PathBuf,
    engines: Mutex<HashMap<String, Arc<Engine>>>,
    /// Bumped on every state change.
    changed: watch::Sender<u64>,
    http: reqwest::Client,
    /// Cancelled when the agent exits: watchers end, engines keep running.
    detach: CancellationToken,
}

/// The engines of one agent.
pub struct Supervisor {
    sh: Arc<Shared>,
}

fn now_unix() -> u64 {
    now_ms() / 1000
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Supervisor {
    /// A supervisor keeping logs and its state file under `cache_dir`.
    pub fn new(cfg: SupervisorConfig, cache_dir: &Path) -> Result<Supervisor, AgentError> {
        let logs_dir = cache_dir.join("logs");
        std::fs::create_dir_all(&logs_dir)
            .map_err(|e| AgentError::io(format!("creating {}", logs_dir.display()), e))?;
        let http = reqwest::Client::builder()
            .timeout(cfg.health_timeout)
            .build()
            .map_err(|e| AgentError::io("HTTP client", std::io::Error::other(e.to_string())))?;
        Ok(Supervisor {
            sh: Arc::new(Shared {
                cfg,
                logs_dir,
                state_path: cache_dir.join("agent-state.json"),
                engines: Mutex::new(HashMap::new()),
                changed: watch::channel(0).0,
                http,
                detach: CancellationToken::new(),
            }),
        })
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.sh.cfg
    }

    /// Signals a change worth an immediate heartbeat (the registry's list moved).
    pub fn notify_changed(&self) {
        self.sh.changed.send_modify(|n| *n += 1);
    }

    /// Changes on every engine state change (for an immediate heartbeat).
    pub fn changed_signal(&self) -> watch::Receiver<u64> {
        self.sh.changed.subscribe()
    }

    /// The log file of `model`'s engine.
    pub fn log_path(&self, model: &str) -> PathBuf {
        self.sh.logs_dir.join(format!("{model}.log"))
    }

    /// Engines listed in the state file of an earlier run.
    pub fn persisted(&self) -> Vec<Persisted> {
        std::fs::read(&self.sh.state_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
            .map(|s| s.engines)
            .unwrap_or_default()
    }

    pub fn status(&self, model: &str) -> Option<EngineStatus> {
        let e = self.sh.engines.lock().get(model).cloned()?;
        Some(e.status(&self.sh.cfg.host))
    }

    pub fn list(&self) -> Vec<EngineStatus> {
        let engines: Vec<Arc<Engine>> = self.sh.engines.lock().values().cloned().collect();
        let mut v: Vec<EngineStatus> = engines.iter().map(|e| e.status(&self.sh.cfg.host)).collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }

    /// The spec `model` was started with.
    pub fn spec(&self, model: &str) -> Option<LaunchSpec> {
        self.sh.engines.lock().get(model).map(|e| e.spec.clone())
    }

    /// Records that `model` served requests at `ms` (unix milliseconds).
    pub fn mark_active(&self, model: &str, ms: u64) {
        if let Some(e) = self.sh.engines.lock().get(model) {
            e.live.lock().last_activity_ms = Some(ms);
        }
    }

    /// When `model` was last seen serving (or started), unix milliseconds.
    pub fn last_active_ms(&self, model: &str) -> Option<u64> {
        self.sh.engines.lock().get(model).and_then(|e| e.live.lock().last_activity_ms)
    }

    /// Starts an engine for `spec` and waits until it is healthy. On failure
    /// nothing keeps running and the error carries the log's tail.
    pub async fn start(&self, spec: LaunchSpec) -> Result<EngineStatus, AgentError> {
        let model = spec.model.clone();
        let port = free_port(&self.sh.cfg.host)?;
        let command = build_command(&self.sh.cfg, &spec, port)?;
        let engine = {
            let mut engines = self.sh.engines.lock();
            if engines.contains_key(&model) {
                return Err(AgentError::Conflict(format!("an engine for `{model}` is already running")));
            }
            let (state, _) = watch::channel(EngineState::Starting);
            let e = Arc::new(Engine {
                spec,
                live: Mutex::new(Live {
                    pid: None,
                    proc_start: 0,
                    port,
                    command,
                    restarts: 0,
                    started_unix: now_unix(),
                    last_activity_ms: Some(now_ms()),
                    last_error: None,
                    adopted: false,
                    ever_ready: false,
                }),
                state,
                stop: CancellationToken::new(),
            });
            engines.insert(model.clone(), e.clone());
            e
        };
        let proc = match spawn(&self.sh, &engine) {
            Ok(p) => p,
            Err(e) => {
                self.sh.engines.lock().remove(&model);
                return Err(e);
            }
        };
        persist(&self.sh);
        self.sh.changed.send_modify(|n| *n += 1);
        tokio::spawn(supervise(self.sh.clone(), engine.clone(), proc, false));
        let ready = self.wait_ready(&engine).await;
        if ready.is_err() {
            engine.stop.cancel();
            let mut engines = self.sh.engines.lock();
            if engines.get(&model).is_some_and(|e| Arc::ptr_eq(e, &engine)) {
                engines.remove(&model);
            }
            drop(engines);
            persist(&self.sh);
            self.sh.changed.send_modify(|n| *n += 1);
        }
        ready
    }

    async fn wait_ready(&self, engine: &Arc<Engine>) -> Result<EngineStatus, AgentError> {
        let mut rx = engine.state.subscribe();
        loop {
            let s = *rx.borrow_and_update();
            match s {
                EngineState::Ready => return Ok(engine.status(&self.sh.cfg.host)),
                EngineState::Stopped => {
                    let why = engine.live.lock().last_error.clone().unwrap_or_else(|| "stopped".into());
                    let tail = tail_lines(&self.log_path(&engine.spec.model), 20).unwrap_or_default();
                    return Err(AgentError::Engine {
                        model: engine.spec.model.clone(),
                        message: format!("{why}; the end of its log:\n{tail}"),
                    });
                }
                _ => {}
            }
            if rx.changed().await.is_err() {
                return Err(AgentError::Engine { model: engine.spec.model.clone(), message: "watcher ended".into() });
            }
        }
    }

    /// Stops `model`'s engine (SIGTERM, then SIGKILL) and returns its spec.
    pub async fn stop(&self, model: &str) -> Result<LaunchSpec, AgentError> {
        let engine = self.sh.engines.lock().get(model).cloned().ok_or_else(|| AgentError::NotLoaded(model.into()))?;
        engine.stop.cancel();
        let mut rx = engine.state.subscribe();
        let limit = self.sh.cfg.stop_timeout + Duration::from_secs(5);
        let _ = tokio::time::timeout(limit, rx.wait_for(|s| *s == EngineState::Stopped)).await;
        self.sh.engines.lock().remove(model);
        persist(&self.sh);
        self.sh.changed.send_modify(|n| *n += 1);
        Ok(engine.spec.clone())
    }

    /// Takes over an engine an earlier agent started, if its process is
    /// still the same one. Returns false when it is gone (start it again).
    pub fn adopt(&self, p: &Persisted) -> bool {
        if p.pid == 0 || !process_is(p.pid, p.proc_start) {
            return false;
        }
        let (state, _) = watch::channel(EngineState::Starting);
        let engine = Arc::new(Engine {
            spec: p.spec.clone(),
            live: Mutex::new(Live {
                pid: Some(p.pid),
                proc_start: p.proc_start,
                port: p.port,
                command: p.command.clone(),
                restarts: p.restarts,
                started_unix: p.started_unix,
                last_activity_ms: Some(now_ms()),
                last_error: None,
                adopted: true,
                ever_ready: true,
            }),
            state,
            stop: CancellationToken::new(),
        });
        self.sh.engines.lock().insert(p.spec.model.clone(), engine.clone());
        tracing::info!(model = %p.spec.model, pid = p.pid, "adopted a running engine");
        persist(&self.sh);
        tokio::spawn(supervise(self.sh.clone(), engine, Proc::Adopted { pid: p.pid, start: p.proc_start }, true));
        true
    }

    /// Waits until `model` is ready (an adopted or restarting engine).
    pub async fn ready(&self, model: &str, limit: Duration) -> Result<EngineStatus, AgentError> {
        let engine = self.sh.engines.lock().get(model).cloned().ok_or_else(|| AgentError::NotLoaded(model.into()))?;
        match tokio::time::timeout(limit, self.wait_ready(&engine)).await {
            Ok(r) => r,
            Err(_) => Err(AgentError::Engine { model: model.into(), message: format!("not ready within {limit:?}") }),
        }
    }

    /// Ends the watchers and leaves the engines running (for the next agent to adopt).
    pub fn detach(&self) {
        persist(&self.sh);
        self.sh.detach.cancel();
    }
}

/// A port free now on `host` (the engine binds it a moment later; a clash
/// shows as an engine that fails to start).
fn free_port(host: &str) -> Result<u16, AgentError> {
    let l = std::net::TcpListener::bind((host, 0))
        .map_err(|e| AgentError::io(format!("finding a free port on {host}"), e))?;
    Ok(l.local_addr().map_err(|e| AgentError::io("local address", e))?.port())
}

/// Quotes `s` for `sh`.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=@%+,".contains(&b)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The command line for `spec` on `port`.
pub fn build_command(cfg: &SupervisorConfig, spec: &LaunchSpec, port: u16) -> Result<Vec<String>, AgentError> {
    let path = spec.model_path.to_string_lossy().into_owned();
    match &cfg.command {
        Some(t) => {
            let line = t
                .replace("{model_path}", &shell_quote(&path))
                .replace("{model_id}", &shell_quote(&spec.model))
                .replace("{port}", &port.to_string())
                .replace("{host}", &shell_quote(&cfg.host));
            Ok(vec!["sh".into(), "-c".into(), line])
        }
        None => {
            let exe = match &cfg.granary_exe {
                Some(p) => p.clone(),
                None => std::env::current_exe().map_err(|e| AgentError::io("finding the granary executable", e))?,
            };
            let mut v = vec![
                exe.to_string_lossy().into_owned(),
                "engine".into(),
                "--model".into(),
                path,
                "--model-id".into(),
                spec.model.clone(),
                "--listen".into(),
                format!("{}:{port}", cfg.host),
            ];
            v.extend(cfg.engine_args.iter().cloned());
            Ok(v)
        }
    }
}

enum Proc {
    Child(tokio::process::Child),
    Adopted { pid: u32, start: u64 },
}

impl Proc {
    fn pid(&self) -> Option<u32> {
        match self {
            Proc::Child(c) => c.id(),
            Proc::Adopted { pid, .. } => Some(*pid),
        }
    }

    /// Resolves when the process has exited (cancel-safe).
    async fn exited(&mut self) -> String {
        match self {
            Proc::Child(c) => match c.wait().await {
                Ok(s) => describe_exit(s),
                Err(e) => format!("wait failed: {e}"),
            },
            Proc::Adopted { pid, start } => loop {
                if !process_is(*pid, *start) {
                    return "exited".into();
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            },
        }
    }

    fn is_alive(&mut self) -> bool {
        match self {
            Proc::Child(c) => matches!(c.try_wait(), Ok(None)),
            Proc::Adopted { pid, start } => process_is(*pid, *start),
        }
    }
}

fn describe_exit(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "exited".into(),
    }
}

/// Whether `pid` is alive (not a zombie) and, when `start` is not 0, started at `start`.
fn process_is(pid: u32, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return false };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
        return false;
    }
    start == 0 || fields.get(19).and_then(|s| s.parse::<u64>().ok()) == Some(start)
}

fn proc_start_time(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 1..].to_string()))
        .and_then(|rest| rest.split_whitespace().nth(19).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn signal_group(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals the process group; no memory is shared.
    unsafe {
        libc::kill(-(pid as libc::pid_t), sig);
    }
}

fn open_log(sh: &Shared, model: &str) -> Result<std::fs::File, AgentError> {
    let path = sh.logs_dir.join(format!("{model}.log"));
    std::fs::File::options()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| AgentError::io(format!("opening {}", path.display()), e))
}

/// Starts the engine's process with its recorded command line.
fn spawn(sh: &Shared, engine: &Engine) -> Result<Proc, AgentError> {
    let command = engine.live.lock().command.clone();
    let mut log = open_log(sh, &engine.spec.model)?;
    let _ = writeln!(log, "--- granary agent: starting `{}` at unix {}", command.join(" "), now_unix());
    let err = log.try_clone().map_err(|e| AgentError::io("duplicating the log file", e))?;
    let mut cmd = tokio::process::Command::new(&command[0]);
    cmd.args(&command[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(err))
        .process_group(0)
        .kill_on_drop(false);
    let child = cmd.spawn().map_err(|e| AgentError::Engine {
        model: engine.spec.model.clone(),
        message: format!("cannot run `{}`: {e}", command[0]),
    })?;
    let pid = child.id();
    {
        let mut l = engine.live.lock();
        l.pid = pid;
        l.proc_start = pid.map_or(0, proc_start_time);
        l.started_unix = now_unix();
        l.adopted = false;
    }
    tracing::info!(model = %engine.spec.model, pid, "started an engine");
    Ok(Proc::Child(child))
}

enum Outcome {
    Stop,
    Detach,
    Failed(String),
}

/// Watches one engine until it is stopped, restarting it as needed.
async fn supervise(sh: Arc<Shared>, engine: Arc<Engine>, mut proc: Proc, mut ever_ready: bool) {
    let model = engine.spec.model.clone();
    let mut backoff = sh.cfg.backoff_initial;
    loop {
        let since = Instant::now();
        let outcome = watch_proc(&sh, &engine, &mut proc, &mut ever_ready).await;
        match outcome {
            Outcome::Detach => return,
            Outcome::Stop => {
                terminate(&sh.cfg, &mut proc).await;
                engine.live.lock().pid = None;
                engine.state.send_replace(EngineState::Stopped);
                tracing::info!(%model, "stopped an engine");
                return;
            }
            Outcome::Failed(why) => {
                terminate(&sh.cfg, &mut proc).await;
                engine.live.lock().last_error = Some(why.clone());
                if !ever_ready {
                    tracing::warn!(%model, "the engine failed to start: {why}");
                    engine.live.lock().pid = None;
                    engine.state.send_replace(EngineState::Stopped);
                    return;
                }
                // Healthy for long enough since the last restart: start the backoff over.
                if since.elapsed() > sh.cfg.backoff_max * 2 {
                    backoff = sh.cfg.backoff_initial;
                }
                tracing::warn!(%model, ?backoff, "the engine failed ({why}); restarting");
                engine.live.lock().pid = None;
                engine.state.send_replace(EngineState::Restarting);
                persist(&sh);
                sh.changed.send_modify(|n| *n += 1);
                loop {
                    tokio::select! {
                        _ = engine.stop.cancelled() => {
                            engine.state.send_replace(EngineState::Stopped);
                            return;
                        }
                        _ = sh.detach.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(sh.cfg.backoff_max);
                    engine.live.lock().restarts += 1;
                    match spawn(&sh, &engine) {
                        Ok(p) => {
                            proc = p;
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(%model, error = %e, "restart failed");
                            engine.live.lock().last_error = Some(e.to_string());
                        }
                    }
                }
                engine.state.send_replace(EngineState::Starting);
                persist(&sh);
                sh.changed.send_modify(|n| *n += 1);
            }
        }
    }
}

/// How often a starting engine's `/health` is tried (at most the
/// configured interval): a load waits for the first healthy answer, so a
/// slow poll would add up to a whole interval to every cold start.
const STARTING_POLL: Duration = Duration::from_millis(50);

/// Runs health checks until the process exits, fails them, or the engine is stopped.
async fn watch_proc(sh: &Shared, engine: &Engine, proc: &mut Proc, ever_ready: &mut bool) -> Outcome {
    let started = Instant::now();
    let mut failures = 0u32;
    let period = |s: EngineState| {
        if s == EngineState::Starting {
            sh.cfg.health_interval.min(STARTING_POLL)
        } else {
            sh.cfg.health_interval
        }
    };
    let mut every = period(*engine.state.borrow());
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let health_url = format!("{}/health", engine.upstream(&sh.cfg.host));
    loop {
        let want = period(*engine.state.borrow());
        if want != every {
            every = want;
            tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        tokio::select! {
            _ = engine.stop.cancelled() => return Outcome::Stop,
            _ = sh.detach.cancelled() => return Outcome::Detach,
            why = proc.exited() => return Outcome::Failed(why),
            _ = tick.tick() => {}
        }
        rotate_log(sh, &engine.spec.model);
        let ok = matches!(sh.http.get(&health_url).send().await, Ok(r) if r.status().is_success());
        let state = *engine.state.borrow();
        if ok {
            failures = 0;
            if state != EngineState::Ready {
                *ever_ready = true;
                engine.live.lock().ever_ready = true;
                engine.state.send_replace(EngineState::Ready);
                persist(sh);
                sh.changed.send_modify(|n| *n += 1);
            }
            continue;
        }
        match state {
            EngineState::Ready | EngineState::Unhealthy => {
                failures += 1;
                if state == EngineState::Ready {
                    // Out of routing at once; restarted only if it stays down.
                    engine.state.send_replace(EngineState::Unhealthy);
                    sh.changed.send_modify(|n| *n += 1);
                }
                if failures >= sh.cfg.health_failures.max(1) {
                    return Outcome::Failed(format!("{failures} health checks failed in a row"));
                }
            }
            _ if started.elapsed() > sh.cfg.start_timeout => {
                return Outcome::Failed(format!("not healthy within {:?} of starting", sh.cfg.start_timeout));
            }
            _ => {}
        }
        if !proc.is_alive() {
            return Outcome::Failed(proc.exited().await);
        }
    }
}

/// SIGTERM to the process group, SIGKILL after `stop_timeout`; returns
/// once no process of the group is left (a template's shell may exit
/// before the server it started, which still holds the port and memory).
async fn terminate(cfg: &SupervisorConfig, proc: &mut Proc) {
    let Some(pid) = proc.pid() else { return };
    if !proc.is_alive() {
        // It exited by itself: nothing of its group may outlive it.
        signal_group(pid, libc::SIGKILL);
        let _ = tokio::time::timeout(Duration::from_secs(5), group_gone(pid, proc)).await;
        return;
    }
    signal_group(pid, libc::SIGTERM);
    if tokio::time::timeout(cfg.stop_timeout, group_gone(pid, proc)).await.is_err() {
        tracing::warn!(pid, "the engine ignored SIGTERM; killing it");
        signal_group(pid, libc::SIGKILL);
        let _ = tokio::time::timeout(Duration::from_secs(5), group_gone(pid, proc)).await;
    }
}

/// Resolves once process group `pgid` has no live (non-zombie) member,
/// reaping our own child on the way.
async fn group_gone(pgid: u32, proc: &mut Proc) {
    loop {
        let _ = proc.is_alive();
        if !group_alive(pgid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether any process of group `pgid` is alive (zombies excluded: they
/// hold no memory or sockets, and an orphan's may wait on a lax init).
fn group_alive(pgid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else { return false };
    dir.flatten().filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit())).any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { return false };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return false };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // f[0] is field 3 (state), f[2] field 5 (process group).
        f.first().is_some_and(|s| !matches!(*s, "Z" | "X"))
            && f.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
    })
}

fn persist(sh: &Shared) {
    let engines: Vec<Arc<Engine>> = sh.engines.lock().values().cloned().collect();
    // Engines between two processes (in a restart's backoff) are kept with
    // pid 0: an agent starting from this file starts them again.
    let list: Vec<Persisted> = engines
        .iter()
        .filter(|e| *e.state.borrow() != EngineState::Stopped)
        .map(|e| {
            let l = e.live.lock();
            Persisted {
                spec: e.spec.clone(),
                pid: l.pid.unwrap_or(0),
                proc_start: l.proc_start,
                port: l.port,
                command: l.command.clone(),
                started_unix: l.started_unix,
                restarts: l.restarts,
            }
        })
        .collect();
    let tmp = sh.state_path.with_extension("json.tmp");
    let body = serde_json::to_vec_pretty(&StateFile { engines: list }).expect("the state always serializes");
    let written = std::fs::write(&tmp, body).and_then(|()| std::fs::rename(&tmp, &sh.state_path));
    if let Err(e) = written {
        tracing::warn!(error = %e, path = %sh.state_path.display(), "cannot write the agent's state file");
    }
}

fn rotate_log(sh: &Shared, model: &str) {
    let path = sh.logs_dir.join(format!("{model}.log"));
    let Ok(m) = std::fs::metadata(&path) else { return };
    if m.len() <= sh.cfg.log_max_bytes.as_u64() {
        return;
    }
    let old = sh.logs_dir.join(format!("{model}.log.1"));
    if std::fs::copy(&path, &old).is_ok() {
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_len(0);
        }
    }
}

/// The last `n` lines of a file (reading at most its last 4 MiB).
pub fn tail_lines(path: &Path, n: usize) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let from = len.saturating_sub(4 << 20);
    f.seek(SeekFrom::Start(from))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    let mut out = lines[start..].join("\n");
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            model: "smol lm".into(),
            revision: "1".into(),
            model_path: PathBuf::from("/m/it's here.gguf"),
            files: vec![],
            tier: Tier::Disk,
        }
    }

    #[test]
    fn templates_substitute_shell_quoted_values() {
        let cfg = SupervisorConfig {
            command: Some("vllm serve {model_path} --served-model-name {model_id} --host {host} --port {port}".into()),
            ..Default::default()
        };
        let c = build_command(&cfg, &spec(), 4242).unwrap();
        assert_eq!(c[..2], ["sh", "-c"]);
        assert_eq!(
            c[2],
            r"vllm serve '/m/it'\''s here.gguf' --served-model-name 'smol lm' --host 127.0.0.1 --port 4242"
        );
        // What sh makes of it: the path comes back whole.
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("printf %s {}", shell_quote("/m/it's here.gguf"))])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "/m/it's here.gguf");
    }

    #[test]
    fn the_embedded_engine_gets_its_flags() {
        let cfg = SupervisorConfig {
            granary_exe: Some("/bin/granary".into()),
            engine_args: vec!["--block-tokens".into(), "16".into()],
            ..Default::default()
        };
        let c = build_command(&cfg, &spec(), 7).unwrap();
        assert_eq!(
            c,
            [
                "/bin/granary",
                "engine",
                "--model",
                "/m/it's here.gguf",
                "--model-id",
                "smol lm",
                "--listen",
                "127.0.0.1:7",
                "--block-tokens",
                "16"
            ]
        );
    }

    #[test]
    fn a_recycled_pid_is_not_the_engine() {
        let me = std::process::id();
        let start = proc_start_time(me);
        assert!(start > 0);
        assert!(process_is(me, start));
        assert!(process_is(me, 0));
        assert!(!process_is(me, start + 1));
        assert!(!process_is(u32::MAX - 1, 0));
    }

    /// A real HTTP server as the engine (python's, serving a directory with
    /// a `health` file): killed, it is restarted after the backoff; an agent
    /// that goes away during the backoff leaves it in the state file with
    /// pid 0, so the next one starts it again instead of forgetting it.
    #[tokio::test]
    async fn a_killed_engine_restarts_and_one_between_processes_is_not_forgotten() {
        if std::process::Command::new("python3").arg("--version").output().is_err() {
            eprintln!("skipping: python3 is not installed");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let www = d.path().join("www");
        std::fs::create_dir_all(&www).unwrap();
        std::fs::write(www.join("health"), "ok").unwrap();
        let cfg = SupervisorConfig {
            command: Some(format!("cd {} && exec python3 -m http.server {{port}} --bind {{host}}", www.display())),
            health_interval: Duration::from_millis(50),
            backoff_initial: Duration::from_millis(300),
            start_timeout: Duration::from_secs(20),
            ..Default::default()
        };
        let sup = Supervisor::new(cfg.clone(), d.path()).unwrap();
        let spec = LaunchSpec {
            model: "m".into(),
            revision: "1".into(),
            model_path: www.clone(),
            files: vec![],
            tier: Tier::Disk,
        };
        let st = sup.start(spec.clone()).await.unwrap();
        assert_eq!(st.state, EngineState::Ready);
        let pid = st.pid.unwrap();
        assert_eq!(sup.persisted()[0].pid, pid);

        signal_group(pid, libc::SIGKILL);
        let mut rx = sup.changed_signal();
        while sup.status("m").unwrap().state != EngineState::Restarting {
            rx.changed().await.unwrap();
        }
        assert_eq!(sup.persisted()[0].pid, 0, "between processes");
        let st = sup.ready("m", Duration::from_secs(20)).await.unwrap();
        assert_eq!(st.restarts, 1);
        assert_ne!(st.pid, Some(pid));
        assert!(st.last_error.unwrap().contains("signal 9"));

        // Gone during a backoff: the next supervisor does not adopt pid 0.
        signal_group(st.pid.unwrap(), libc::SIGKILL);
        while sup.status("m").unwrap().state != EngineState::Restarting {
            rx.changed().await.unwrap();
        }
        sup.detach();
        let next = Supervisor::new(cfg, d.path()).unwrap();
        let p = next.persisted();
        assert_eq!((p.len(), p[0].pid), (1, 0), "{p:?}");
        assert!(!next.adopt(&p[0]));
        assert!(next.list().is_empty());
    }

    #[test]
    fn tail_returns_the_last_lines() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.log");
        std::fs::write(&p, "a\nb\nc\nd\n").unwrap();
        assert_eq!(tail_lines(&p, 2).unwrap(), "c\nd\n");
        assert_eq!(tail_lines(&p, 10).unwrap(), "a\nb\nc\nd\n");
    }
}
