//! `<cache>/agent-state.json`: the engines an agent runs, so that the next
//! one adopts those still running and starts the others again. Written to
//! a temporary file and renamed, so a crash never leaves half a file.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::LaunchSpec;

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
    /// The port of its front, if it had one.
    #[serde(default)]
    pub front_port: Option<u16>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    engines: Vec<Persisted>,
}

/// The engines recorded at `path` (none when it is missing or unreadable).
pub(super) fn read(path: &Path) -> Vec<Persisted> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
        .map(|s| s.engines)
        .unwrap_or_default()
}

/// Records `engines` at `path`.
pub(super) fn write(path: &Path, engines: Vec<Persisted>) {
    let tmp = path.with_extension("json.tmp");
    let body = serde_json::to_vec_pretty(&StateFile { engines }).expect("the state always serializes");
    let written = std::fs::write(&tmp, body).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        tracing::warn!(error = %e, path = %path.display(), "cannot write the agent's state file");
    }
}
