//! Engine processes as the operating system sees them: our children or
//! adopted pids (checked against their start time in `/proc`), their
//! process groups, signals, and ports.

use std::time::Duration;

use super::SupervisorConfig;
use crate::error::AgentError;

/// A port free now on `host` (the engine binds it a moment later; a clash
/// shows as an engine that fails to start).
pub(super) fn free_port(host: &str) -> Result<u16, AgentError> {
    let l = std::net::TcpListener::bind((host, 0))
        .map_err(|e| AgentError::io(format!("finding a free port on {host}"), e))?;
    Ok(l.local_addr().map_err(|e| AgentError::io("local address", e))?.port())
}

pub(super) enum Proc {
    Child(tokio::process::Child),
    Adopted { pid: u32, start: u64 },
}

impl Proc {
    pub(super) fn pid(&self) -> Option<u32> {
        match self {
            Proc::Child(c) => c.id(),
            Proc::Adopted { pid, .. } => Some(*pid),
        }
    }

    /// Resolves when the process has exited (cancel-safe).
    pub(super) async fn exited(&mut self) -> String {
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

    pub(super) fn is_alive(&mut self) -> bool {
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
pub(super) fn process_is(pid: u32, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return false };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
        return false;
    }
    start == 0 || fields.get(19).and_then(|s| s.parse::<u64>().ok()) == Some(start)
}

pub(super) fn proc_start_time(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 1..].to_string()))
        .and_then(|rest| rest.split_whitespace().nth(19).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

pub(super) fn signal_group(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals the process group; no memory is shared.
    unsafe {
        libc::kill(-(pid as libc::pid_t), sig);
    }
}

/// SIGTERM to the process group, SIGKILL after `stop_timeout`; returns
/// once no process of the group is left (a template's shell may exit
/// before the server it started, which still holds the port and memory).
pub(super) async fn terminate(cfg: &SupervisorConfig, proc: &mut Proc) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
