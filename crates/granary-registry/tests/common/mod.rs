//! Helpers for the registry's integration tests: an in-process registry on a
//! port-0 listener, model directories, a Hugging Face cache mirror, wheels,
//! and the external servers (`s3s-fs`, PostgreSQL) some tests drive.

#![allow(dead_code)]

pub mod external;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use granary_registry::{Registry, RegistryClient, RegistryConfig};
use sha2::{Digest, Sha256};

pub const ADMIN: &str = "admin-token-0123456789";
pub const READER: &str = "read-token-0123456789";

/// A registry serving in this process; stopped on drop.
pub struct TestRegistry {
    pub url: String,
    /// A client holding the admin token.
    pub admin: RegistryClient,
    /// A client holding a read token.
    pub reader: RegistryClient,
    pub reg: Arc<Registry>,
    /// Holds `store/` (the `file://` store, unless the config names another)
    /// and the SQLite catalog.
    pub dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl TestRegistry {
    /// Where the `file://` store keeps the blob `sha256`.
    pub fn blob_path(&self, sha256: &str) -> PathBuf {
        self.dir.path().join("store/blobs/sha256").join(sha256)
    }

    /// A client with no token.
    pub fn anonymous(&self) -> RegistryClient {
        RegistryClient::new(&self.url, None).unwrap()
    }

    /// Raw HTTP, for what the client library would not send.
    pub fn http(&self) -> reqwest::Client {
        reqwest::Client::new()
    }
}

/// Starts a registry with a `file://` store and an SQLite catalog in a
/// temp dir, the admin and read tokens, and whatever `tweak` changes.
pub async fn start(tweak: impl FnOnce(&mut RegistryConfig)) -> TestRegistry {
    let dir = tempfile::tempdir().unwrap();
    let store = url::Url::from_directory_path(dir.path().join("store")).unwrap().to_string();
    let mut cfg = RegistryConfig::new(format!("sqlite://{}/registry.db", dir.path().display()), store);
    cfg.admin_token = Some(ADMIN.into());
    cfg.read_tokens = vec![READER.into()];
    tweak(&mut cfg);
    let reg = Arc::new(Registry::open(&cfg).await.expect("open the registry"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let r = reg.clone();
    tokio::spawn(async move {
        granary_registry::server::serve_registry(r, &cfg, listener, async {
            let _ = rx.await;
        })
        .await
        .expect("serve");
    });
    TestRegistry {
        admin: RegistryClient::new(&url, Some(ADMIN.into())).unwrap(),
        reader: RegistryClient::new(&url, Some(READER.into())).unwrap(),
        url,
        reg,
        dir,
        stop: Some(tx),
    }
}

/// Deterministic bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// A GGUF-format model directory: `model.Q8_0.gguf` (`len` bytes seeded by
/// `seed`), `tokenizer.json` and a README with a license; returns the
/// directory and the GGUF's bytes.
pub fn gguf_dir(parent: &Path, name: &str, seed: u64, len: usize) -> (PathBuf, Vec<u8>) {
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut gguf = b"GGUF".to_vec();
    gguf.extend(bytes(seed, len.saturating_sub(4)));
    std::fs::write(dir.join("model.Q8_0.gguf"), &gguf).unwrap();
    std::fs::write(dir.join("tokenizer.json"), br#"{"model":{"type":"BPE"}}"#).unwrap();
    std::fs::write(dir.join("README.md"), "---\nlicense: apache-2.0\n---\n# tiny\n").unwrap();
    (dir, gguf)
}

/// A Hugging Face cache mirror holding `owner/name` at one commit, `main`
/// pointing at it, with the files as the hub's client lays them out: blobs
/// named by etag, and snapshot entries that are symlinks to them.
pub fn hf_mirror(root: &Path, repo: &str, commit: &str, files: &[(&str, &[u8])]) {
    let repo_dir = root.join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), commit).unwrap();
    let snap = repo_dir.join("snapshots").join(commit);
    for (path, data) in files {
        let etag = sha256_hex(data);
        std::fs::write(repo_dir.join("blobs").join(&etag), data).unwrap();
        let link = snap.join(path);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = path.matches('/').count() + 2;
        let target = format!("{}blobs/{etag}", "../".repeat(depth));
        std::os::unix::fs::symlink(target, &link).unwrap();
    }
}

/// A wheel at `dir/file_name`: `entries` plus METADATA, WHEEL and RECORD,
/// deflated as wheel builders write them (by Python's `zipfile`, so this
/// needs `python3`, as pip does).
pub fn wheel(dir: &Path, file_name: &str, entries: &[(&str, &[u8])]) -> PathBuf {
    use base64::Engine as _;
    let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
    let path = dir.join(file_name);
    let mut parts = file_name.split('-');
    let (name, version) = (parts.next().unwrap(), parts.next().unwrap());
    let dist = format!("{name}-{version}.dist-info");
    let mut all: Vec<(String, Vec<u8>)> = entries.iter().map(|(n, d)| (n.to_string(), d.to_vec())).collect();
    all.push((
        format!("{dist}/METADATA"),
        format!("Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nLicense-Expression: MIT\n\nA model.\n")
            .into_bytes(),
    ));
    all.push((
        format!("{dist}/WHEEL"),
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n".to_vec(),
    ));
    let mut record = String::new();
    for (n, d) in &all {
        let h = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(d));
        record.push_str(&format!("{n},sha256={h},{}\n", d.len()));
    }
    record.push_str(&format!("{dist}/RECORD,,\n"));
    all.push((format!("{dist}/RECORD"), record.into_bytes()));
    let manifest: Vec<serde_json::Value> =
        all.iter().map(|(n, d)| serde_json::json!({"name": n, "data": b64(d)})).collect();
    let manifest_path = dir.join(format!("{file_name}.json"));
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let script = "import base64, json, sys, zipfile\n\
                  entries = json.load(open(sys.argv[1]))\n\
                  with zipfile.ZipFile(sys.argv[2], 'w', zipfile.ZIP_DEFLATED) as z:\n\
                  \x20   for e in entries: z.writestr(e['name'], base64.b64decode(e['data']))\n";
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&manifest_path)
        .arg(&path)
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "building a wheel: {}", String::from_utf8_lossy(&out.stderr));
    path
}

/// Whether tests that need a missing external program must fail.
pub fn required() -> bool {
    std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1")
}

/// Whether `python3 -m pip` runs; if not, says so (or fails when required).
pub fn have_pip() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(!required(), "GRANARY_REQUIRE_EXTERNAL=1 but `python3 -m pip` does not run");
        eprintln!("SKIPPED: `python3 -m pip` does not run");
    }
    ok
}

/// Every regular file under `dir`.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}
