//! Helpers for tests that run the real `granary` binary.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `granary warehouse` process and the addresses it printed.
pub struct Warehouse {
    pub child: Child,
    pub http: Option<String>,
    pub resp: Option<String>,
}

impl Warehouse {
    /// Starts `granary warehouse` with `args` (listeners on port 0 unless given)
    /// and waits for its `ready` line.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Warehouse {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.arg("warehouse");
        if !args.contains(&"--http") {
            cmd.args(["--http", "127.0.0.1:0"]);
        }
        if !args.contains(&"--resp") {
            cmd.args(["--resp", "127.0.0.1:0"]);
        }
        cmd.args(args).env("GRANARY_LOG", "warn").stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn granary");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let (mut http, mut resp) = (None, None);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("granary warehouse did not print `ready` in time")
            });
            if let Some(a) = line.strip_prefix("granary warehouse: http listening on ") {
                http = Some(a.trim().to_string());
            } else if let Some(a) = line.strip_prefix("granary warehouse: resp listening on ") {
                resp = Some(a.trim().to_string());
            } else if line.trim() == "granary warehouse: ready" {
                break;
            }
        }
        Warehouse { child, http, resp }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.http.as_ref().expect("http listener"), path)
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        sigterm(&self.child);
        self.child.wait().unwrap()
    }
}

impl Drop for Warehouse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every regular file under `dir`, recursively, but engines' converted-weight checkpoints.
pub fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if !granary_core::is_checkpoint_file(&e.file_name().to_string_lossy()) {
                // (An engine's converted-weight checkpoint beside a model is
                // a cache, left out of imports as here.)
                out.push(p);
            }
        }
    }
    out
}

/// A valid encoded KV block whose payload is derived from `seed`.
pub fn block(seed: u64, tokens: u32) -> bytes::Bytes {
    // 2 layers x 2 kv heads x 16 dims x f16 per token.
    let len = (2 * 2 * 2 * 16 * 2 * tokens) as usize;
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let payload: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    granary_core::KvBlock::kv(granary_core::DType::F16, 0, 2, 2, 16, tokens, payload.into()).unwrap().encode()
}

/// The 64-hex block name used for `seed` in tests.
pub fn key(seed: u64) -> String {
    granary_core::HashChain::next(&granary_core::BlockHash([7; 32]), &[seed as u32, (seed >> 32) as u32]).to_hex()
}

/// A running `granary` subcommand (its stdout read for `granary: ready`,
/// logs at `warn`), SIGKILLed on drop unless stopped.
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `granary ARGS` and waits (up to 180 s) for its `granary: ready` line.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Proc {
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
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
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

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait; asserts a clean exit (spans and logs flushed on the way out).
    pub fn terminate(&mut self) {
        sigterm(&self.child);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "granary exited with {status}");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends SIGTERM to a child (a system call, not the `kill` program, which a
/// minimal system may lack); panics if it could not be sent.
pub fn sigterm(child: &std::process::Child) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
    // SAFETY: kill(2) on a child this test started and has not reaped.
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(rc, 0, "SIGTERM to {pid}: {}", std::io::Error::last_os_error());
}
