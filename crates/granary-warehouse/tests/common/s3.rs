//! A real S3-compatible server (`s3s-fs`) for tests, one process per test.
//! Shared by the warehouse's tier tests and the binary's process tests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use granary_warehouse::config::RemoteConfig;

pub const BUCKET: &str = "granary-test";

/// A running `s3s-fs` with one bucket; killed on drop.
pub struct S3Server {
    child: Child,
    pub port: u16,
    pub root: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    /// Object-store options pointing at this server.
    pub fn options(&self) -> HashMap<String, String> {
        [
            ("aws_endpoint", format!("http://127.0.0.1:{}", self.port)),
            ("aws_allow_http", "true".into()),
            ("aws_access_key_id", "granary-test-ak".into()),
            ("aws_secret_access_key", "granary-test-sk".into()),
            ("aws_region", "us-east-1".into()),
            ("aws_virtual_hosted_style_request", "false".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    pub fn config(&self, prefix: &str) -> RemoteConfig {
        RemoteConfig { url: format!("s3://{BUCKET}/{prefix}"), options: self.options() }
    }

    /// Where the bucket's objects lie on disk.
    pub fn bucket_dir(&self) -> PathBuf {
        self.root.path().join(BUCKET)
    }
}

fn find_s3s_fs() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GRANARY_S3S_FS") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    if let Some(home) = std::env::var_os("CARGO_HOME").or_else(|| {
        std::env::var_os("HOME").map(|h| {
            let mut p = PathBuf::from(h);
            p.push(".cargo");
            p.into_os_string()
        })
    }) {
        dirs.push(PathBuf::from(home).join("bin"));
    }
    dirs.into_iter().map(|d| d.join("s3s-fs")).find(|p| p.is_file())
}

/// Starts `s3s-fs`, or `None` (after saying so) when it is not installed
/// and `GRANARY_REQUIRE_EXTERNAL` is not `1`.
pub fn start_s3() -> Option<S3Server> {
    let Some(bin) = find_s3s_fs() else {
        if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") {
            panic!("s3s-fs not found (set GRANARY_S3S_FS or put it on PATH) and GRANARY_REQUIRE_EXTERNAL=1");
        }
        eprintln!("skipped: s3s-fs not found (cargo install s3s-fs --version 0.14.1 --locked --features binary)");
        return None;
    };
    let root = tempfile::tempdir().unwrap();
    // s3s-fs serves each directory under its root as a bucket.
    std::fs::create_dir(root.path().join(BUCKET)).unwrap();
    // s3s-fs takes a port number, not a listener: ask the OS for a free one.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(&bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", "granary-test-ak", "--secret-key", "granary-test-sk"])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let mut server = S3Server { child, port, root };
    let deadline = Instant::now() + Duration::from_secs(15);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!("s3s-fs exited early: {status}");
        }
        assert!(Instant::now() < deadline, "s3s-fs did not listen on port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(server)
}
