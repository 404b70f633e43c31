//! Real external servers, one per test: an S3-compatible server
//! (`s3s-fs`, installed by scripts/test.sh) and a throwaway PostgreSQL
//! (scripts/pg-test-server.sh). Each helper returns `None` after a notice
//! when the program is missing, or fails when GRANARY_REQUIRE_EXTERNAL=1.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::required;

pub const BUCKET: &str = "granary-registry-test";
pub const ACCESS_KEY: &str = "granary-test-ak";
pub const SECRET_KEY: &str = "granary-test-sk";

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
    /// Object-store options for this server.
    pub fn options(&self) -> Vec<(String, String)> {
        [
            ("aws_endpoint", format!("http://127.0.0.1:{}", self.port)),
            ("aws_allow_http", "true".into()),
            ("aws_access_key_id", ACCESS_KEY.into()),
            ("aws_secret_access_key", SECRET_KEY.into()),
            ("aws_region", "us-east-1".into()),
            ("aws_virtual_hosted_style_request", "false".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
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
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        dirs.push(PathBuf::from(home).join("bin"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join("s3s-fs")).find(|p| p.is_file())
}

/// Starts `s3s-fs`, or `None` (after saying so) when it is not installed.
pub fn start_s3() -> Option<S3Server> {
    let Some(bin) = find_s3s_fs() else {
        assert!(!required(), "s3s-fs not found (set GRANARY_S3S_FS or put it on PATH) and GRANARY_REQUIRE_EXTERNAL=1");
        eprintln!("SKIPPED: s3s-fs not found (cargo install s3s-fs --version 0.14.1 --locked --features binary)");
        return None;
    };
    let root = tempfile::tempdir().unwrap();
    // s3s-fs serves each directory under its root as a bucket.
    std::fs::create_dir(root.path().join(BUCKET)).unwrap();
    // s3s-fs takes a port number, not a listener: ask the OS for a free one.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(&bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
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

fn pg_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg-test-server.sh")
}

/// A PostgreSQL server for one test; stopped (and its files removed) on drop.
pub struct Postgres {
    pub url: String,
    dir: Option<String>,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = Command::new("bash").arg(pg_script()).arg("stop").arg(dir).status();
        }
    }
}

/// The server `GRANARY_TEST_POSTGRES_URL` names, or one started by
/// scripts/pg-test-server.sh, or `None` (after a notice) to skip.
pub fn start_postgres() -> Option<Postgres> {
    if let Ok(url) = std::env::var("GRANARY_TEST_POSTGRES_URL") {
        return Some(Postgres { url, dir: None });
    }
    let installed = std::env::var_os("PG_BIN").is_some()
        || std::fs::read_dir("/usr/lib/postgresql")
            .map(|dirs| dirs.flatten().any(|d| d.path().join("bin/initdb").exists()))
            .unwrap_or(false);
    if !installed {
        assert!(!required(), "GRANARY_REQUIRE_EXTERNAL=1 but PostgreSQL is not installed");
        eprintln!("SKIPPED: PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)");
        return None;
    }
    let out = Command::new("bash").arg(pg_script()).arg("start").output().expect("running pg-test-server.sh");
    assert!(out.status.success(), "pg-test-server.sh start failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut lines = stdout.lines();
    let url = lines.next().expect("a URL line").to_string();
    let dir = lines.next().expect("a directory line").to_string();
    Some(Postgres { url, dir: Some(dir) })
}
