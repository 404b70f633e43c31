//! `granary` child processes of a benchmark: started from this executable,
//! their address and readiness read from what they print, killed on drop.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// A `granary` child process, killed on drop.
pub(crate) struct Proc {
    child: Child,
    pub(crate) base: String,
    name: String,
}

/// CPU time (user + system, all threads) process `pid` has used, in
/// seconds (NaN when it cannot be read).
pub(crate) fn process_cpu_s(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return f64::NAN };
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return f64::NAN };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(f64::NAN);
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

impl Proc {
    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts `granary ARGS`, takes the URL from the line starting with
    /// `addr_prefix` and waits for the line `ready`.
    pub(crate) fn start(
        name: &str,
        args: &[String],
        envs: &[(&str, &str)],
        addr_prefix: &str,
        ready: &str,
    ) -> Result<Proc> {
        let exe = std::env::current_exe().context("finding the granary executable")?;
        let mut cmd = Command::new(exe);
        // Their logs go to this process's stderr: errors only, unless
        // GRANARY_BENCH_CHILD_LOG sets another filter (e.g. `info`).
        let log = std::env::var("GRANARY_BENCH_CHILD_LOG").unwrap_or_else(|_| "error".into());
        cmd.args(args).env("GRANARY_LOG", log).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().with_context(|| format!("starting granary {name}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut base = None;
        let mut proc = Proc { child, base: String::new(), name: name.to_string() };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).map_err(|_| match proc.child.try_wait() {
                Ok(Some(status)) => anyhow::anyhow!("granary {name} exited at start ({status})"),
                _ => anyhow::anyhow!("granary {name} did not print {ready:?} within 120 s"),
            })?;
            if let Some(rest) = line.strip_prefix(addr_prefix) {
                let url = rest.split_whitespace().next().unwrap_or_default();
                base = Some(url.trim_end_matches("/v1").to_string());
            } else if line.trim() == ready {
                break;
            }
        }
        proc.base = base.with_context(|| format!("granary {name} printed no address"))?;
        Ok(proc)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        tracing::debug!(name = %self.name, "stopped");
    }
}
