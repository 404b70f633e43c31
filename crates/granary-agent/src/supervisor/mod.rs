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
use crate::front::{Front, FrontStats};
use crate::tiers::Tier;

mod command;
mod logs;
mod process;
mod state;

pub use command::{build_command, shell_quote};
pub use logs::tail_lines;
use logs::{open_log, rotate_log};
#[cfg(test)]
use process::signal_group;
use process::{free_port, proc_start_time, process_is, terminate, Proc};
pub use state::Persisted;

/// How engines are started and watched.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisorConfig {
    /// An external engine's command line, run with `sh -c`, with
    /// `{model_path}`, `{model_id}`, `{port}`, `{host}`, `{threads}`,
    /// `{gpus}` (the `CUDA_VISIBLE_DEVICES` list) and `{gpu_count}`
    /// substituted (shell-quoted); e.g. `vllm serve {model_path}
    /// --served-model-name {model_id} --host {host} --port {port}`.
    /// None: the embedded engine (`granary engine`).
    pub command: Option<String>,
    /// The path of the engine's health check: any 2xx answer is healthy
    /// (`/health` for the embedded engine, vLLM, SGLang and `llama-server`;
    /// `/openapi.json` for `llama_cpp.server`, which has no `/health` and
    /// whose model list waits behind a running completion).
    pub health_path: String,
    /// CPU threads per engine, substituted as `{threads}` [default: the
    /// cores this process may use].
    pub threads: Option<usize>,
    /// Put a front (an HTTP proxy on the agent, see [`crate::front`]) before
    /// each engine and report engines at their front: the agent then sees
    /// their requests itself, for engines that publish no request metrics.
    pub proxy: bool,
    /// Request headers a front does not pass on to its engine (e.g.
    /// `x-request-id` for `llama_cpp.server`, which refuses request ids
    /// that are not UUIDs).
    pub proxy_drop_headers: Vec<String>,
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
            health_path: "/health".into(),
            threads: None,
            proxy: false,
            proxy_drop_headers: Vec::new(),
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
    /// The GPUs given to it (`CUDA_VISIBLE_DEVICES`); none: the variable is
    /// left as the agent has it (a node without GPUs).
    #[serde(default)]
    pub gpus: Option<Vec<u32>>,
    /// The memory reserved for it (on each of its GPUs together, or in host
    /// RAM for an engine without GPUs), bytes.
    #[serde(default)]
    pub memory: u64,
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
    /// The engine's own address (`upstream` is its front's, when it has one).
    #[serde(default)]
    pub engine_url: String,
    /// GPUs it was given.
    #[serde(default)]
    pub gpus: Vec<u32>,
    /// Memory reserved for it, bytes.
    #[serde(default)]
    pub memory: u64,
    /// Requests its front is answering now (engines with a front only).
    #[serde(default)]
    pub in_flight: Option<u64>,
    /// Being drained before an idle unload: gateways route no new requests
    /// to it; a load takes it back.
    #[serde(default)]
    pub draining: bool,
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
    draining: bool,
}

struct Engine {
    spec: LaunchSpec,
    live: Mutex<Live>,
    state: watch::Sender<EngineState>,
    stop: CancellationToken,
    /// Its front, with `engines.proxy`; stops when the engine is dropped.
    front: Option<Front>,
}

impl Engine {
    /// The engine's own base URL.
    fn engine_url(&self, host: &str) -> String {
        format!("http://{host}:{}", self.live.lock().port)
    }

    fn status(&self, host: &str) -> EngineStatus {
        let l = self.live.lock();
        let engine_url = format!("http://{host}:{}", l.port);
        EngineStatus {
            model: self.spec.model.clone(),
            revision: self.spec.revision.clone(),
            upstream: match &self.front {
                Some(f) => format!("http://{host}:{}", f.port()),
                None => engine_url.clone(),
            },
            pid: l.pid,
            state: *self.state.borrow(),
            restarts: l.restarts,
            last_request_unix: l.last_activity_ms.map(|ms| ms / 1000),
            tier: self.spec.tier,
            started_unix: l.started_unix,
            adopted: l.adopted,
            ever_ready: l.ever_ready,
            last_error: l.last_error.clone(),
            engine_url,
            gpus: self.spec.gpus.clone().unwrap_or_default(),
            memory: self.spec.memory,
            in_flight: self.front.as_ref().map(|f| f.stats().in_flight()),
            draining: l.draining,
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
        state::read(&self.sh.state_path)
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

    /// Records that `model` served requests at `ms` (unix milliseconds; an
    /// earlier time than the one recorded changes nothing).
    pub fn mark_active(&self, model: &str, ms: u64) {
        if let Some(e) = self.sh.engines.lock().get(model) {
            let mut l = e.live.lock();
            l.last_activity_ms = Some(l.last_activity_ms.map_or(ms, |t| t.max(ms)));
        }
    }

    /// What `model`'s front has seen, when it has one.
    pub fn front_stats(&self, model: &str) -> Option<Arc<FrontStats>> {
        self.sh.engines.lock().get(model).and_then(|e| e.front.as_ref().map(|f| f.stats().clone()))
    }

    /// Marks `model`'s engine draining (or takes it back); true when that
    /// changed anything. A change is heartbeated at once.
    pub fn set_draining(&self, model: &str, draining: bool) -> bool {
        let changed = match self.sh.engines.lock().get(model) {
            Some(e) => {
                let mut l = e.live.lock();
                std::mem::replace(&mut l.draining, draining) != draining
            }
            None => false,
        };
        if changed {
            self.notify_changed();
        }
        changed
    }

    /// Whether `model`'s engine is draining.
    pub fn is_draining(&self, model: &str) -> bool {
        self.sh.engines.lock().get(model).is_some_and(|e| e.live.lock().draining)
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
        let front = self.front(None, port).await?;
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
                    draining: false,
                }),
                state,
                stop: CancellationToken::new(),
                front,
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
    pub async fn adopt(&self, p: &Persisted) -> bool {
        if p.pid == 0 || !process_is(p.pid, p.proc_start) {
            return false;
        }
        let front = match self.front(p.front_port, p.port).await {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(model = %p.spec.model, error = %e, "cannot put a front before an adopted engine");
                return false;
            }
        };
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
                draining: false,
            }),
            state,
            stop: CancellationToken::new(),
            front,
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

    /// A front for the engine on `port`, with `engines.proxy` (on
    /// `want` when that port is free).
    async fn front(&self, want: Option<u16>, port: u16) -> Result<Option<Front>, AgentError> {
        if !self.sh.cfg.proxy {
            return Ok(None);
        }
        let cfg = &self.sh.cfg;
        let engine = format!("http://{}:{port}", cfg.host);
        Front::start(&cfg.host, want, engine, cfg.health_path.clone(), &cfg.proxy_drop_headers).await.map(Some)
    }

    /// Ends the watchers and leaves the engines running (for the next agent to adopt).
    pub fn detach(&self) {
        persist(&self.sh);
        self.sh.detach.cancel();
    }
}

/// Starts the engine's process with its recorded command line.
fn spawn(sh: &Shared, engine: &Engine) -> Result<Proc, AgentError> {
    let command = engine.live.lock().command.clone();
    let mut log = open_log(&sh.logs_dir, &engine.spec.model)?;
    let _ = writeln!(log, "--- granary agent: starting `{}` at unix {}", command.join(" "), now_unix());
    let err = log.try_clone().map_err(|e| AgentError::io("duplicating the log file", e))?;
    let mut cmd = tokio::process::Command::new(&command[0]);
    cmd.args(&command[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(err))
        .process_group(0)
        .kill_on_drop(false);
    if let Some(gpus) = &engine.spec.gpus {
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        cmd.env("CUDA_VISIBLE_DEVICES", list.join(","));
    }
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
                    {
                        let mut l = engine.live.lock();
                        l.restarts += 1;
                        // A full idle window after a restart: the clients
                        // of the requests lost with the old process retry.
                        l.last_activity_ms = Some(now_ms());
                    }
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
    let health_url = format!("{}{}", engine.engine_url(&sh.cfg.host), sh.cfg.health_path);
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
        rotate_log(&sh.logs_dir, &engine.spec.model, sh.cfg.log_max_bytes.as_u64());
        let ok = matches!(sh.http.get(&health_url).send().await, Ok(r) if r.status().is_success());
        let state = *engine.state.borrow();
        if ok {
            failures = 0;
            if state != EngineState::Ready {
                *ever_ready = true;
                {
                    // A full idle window from the moment it can serve: a
                    // slow start (or a spell unhealthy) is not idleness,
                    // and the clients waiting for it send only now.
                    let mut l = engine.live.lock();
                    l.ever_ready = true;
                    l.last_activity_ms = Some(now_ms());
                }
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
                front_port: e.front.as_ref().map(Front::port),
            }
        })
        .collect();
    state::write(&sh.state_path, list);
}
#[cfg(test)]
mod tests;
