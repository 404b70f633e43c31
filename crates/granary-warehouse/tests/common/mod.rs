//! Real tiers for the integration tests: memory, disk (plain and with zstd +
//! AES-256-GCM), remote over a `file://` directory, and remote over S3
//! served by a real `s3s-fs` process started per test.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use granary_core::ByteSize;
use granary_warehouse::config::{DiskConfig, RemoteConfig};
use granary_warehouse::tier::at_rest::AtRest;
use granary_warehouse::tier::disk::open_disk;
use granary_warehouse::tier::memory::MemoryTier;
use granary_warehouse::tier::remote::open_remote;
use granary_warehouse::{PolicyKind, Tier};

pub const BUCKET: &str = "granary-test";
pub const TEST_KEY: [u8; 32] = [0x42; 32];

/// A tier under test and what keeps its backing alive.
pub struct Harness {
    pub tier: Arc<dyn Tier>,
    /// Whether the tier enforces a byte budget.
    pub bounded: bool,
    /// Whether the tier reports `bytes` and `entries`.
    pub tracks_size: bool,
    pub keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

pub fn memory(capacity: u64) -> Harness {
    Harness {
        tier: Arc::new(MemoryTier::new(capacity, PolicyKind::Lru)),
        bounded: true,
        tracks_size: true,
        keep: vec![],
    }
}

pub async fn disk_with(capacity: u64, at_rest: AtRest) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let cfg = DiskConfig { dir: dir.path().to_path_buf(), capacity: ByteSize(capacity), policy: PolicyKind::Lru };
    let tier = open_disk(&cfg, at_rest).await.unwrap();
    Harness { tier: Arc::new(tier), bounded: true, tracks_size: true, keep: vec![Box::new(dir)] }
}

pub async fn disk(capacity: u64) -> Harness {
    disk_with(capacity, AtRest::default()).await
}

pub async fn disk_sealed(capacity: u64) -> Harness {
    disk_with(capacity, AtRest::with_key(Some(3), Some(TEST_KEY))).await
}

pub fn file_url(dir: &Path) -> String {
    url::Url::from_directory_path(dir).unwrap().to_string()
}

pub async fn remote_file_with(at_rest: AtRest) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    // A subdirectory that does not exist yet: the tier creates it.
    let cfg = RemoteConfig { url: file_url(&dir.path().join("shared/kv")), options: HashMap::new() };
    let tier = open_remote(&cfg, at_rest).await.unwrap();
    Harness { tier: Arc::new(tier), bounded: false, tracks_size: false, keep: vec![Box::new(dir)] }
}

pub async fn remote_file(_capacity: u64) -> Harness {
    remote_file_with(AtRest::default()).await
}

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

pub async fn remote_s3_with(at_rest: AtRest) -> Option<Harness> {
    let server = start_s3()?;
    let tier = open_remote(&server.config("kv/cache"), at_rest).await.unwrap();
    Some(Harness { tier: Arc::new(tier), bounded: false, tracks_size: false, keep: vec![Box::new(server)] })
}

pub async fn remote_s3(_capacity: u64) -> Option<Harness> {
    remote_s3_with(AtRest::default()).await
}

/// Every regular file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out
}

/// Deterministic pseudo-random bytes (incompressible enough to test framing).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
