//! The real `granary registry serve` process driven by the real
//! `granary registry` command line (import, list, show, delete, gc) and by
//! HTTP: defaults under a data directory, tokens, clean exit on SIGTERM.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const ADMIN: &str = "registry-admin-token-for-tests";
const READER: &str = "registry-read-token-for-tests";
const OTHER_READER: &str = "registry-second-read-token-for-tests";

/// `granary registry serve`, killed on drop.
struct Registry {
    child: Child,
    url: String,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Registry {
    /// Starts it on port 0 with `data_dir` and waits for its `ready` line
    /// (tokens from the command line and the environment).
    fn start(data_dir: &Path) -> Registry {
        Registry::start_with(data_dir, &["--read-token", READER], Some(ADMIN))
    }

    /// The same with its tokens read from files: the admin token's, and
    /// one read token per line (`#` comments) of the other.
    fn start_with_token_files(data_dir: &Path, dir: &Path) -> Registry {
        let (admin, read) = (dir.join("admin-token"), dir.join("read-tokens"));
        std::fs::write(&admin, format!("{ADMIN}\n")).unwrap();
        std::fs::write(&read, format!("# who may read\n{READER}\n\n{OTHER_READER}\n")).unwrap();
        let args = ["--admin-token-file", admin.to_str().unwrap(), "--read-token-file", read.to_str().unwrap()];
        Registry::start_with(data_dir, &args, None)
    }

    fn start_with(data_dir: &Path, args: &[&str], admin_env: Option<&str>) -> Registry {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.args(["registry", "serve", "--listen", "127.0.0.1:0"]).args(args);
        match admin_env {
            Some(t) => cmd.env("GRANARY_REGISTRY_ADMIN_TOKEN", t),
            None => cmd.env_remove("GRANARY_REGISTRY_ADMIN_TOKEN"),
        };
        let mut child = cmd
            .arg("--data-dir")
            .arg(data_dir)
            .env_remove("GRANARY_REGISTRY_DATABASE")
            .env_remove("GRANARY_REGISTRY_STORE")
            .env("GRANARY_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn granary registry serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut url = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.trim() == "granary registry: ready" => break,
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("granary registry: listening on ") {
                        url = rest.split_whitespace().next().map(str::to_string);
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    panic!("granary registry serve did not get ready in time");
                }
            }
        }
        Registry { child, url: url.expect("a `listening on` line") }
    }

    /// Runs `granary registry ARGS --url URL` with `token` in the environment.
    fn cli(&self, args: &[&str], token: Option<&str>) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.arg("registry").args(args).args(["--url", &self.url]).env_remove("GRANARY_REGISTRY_TOKEN");
        if let Some(t) = token {
            cmd.env("GRANARY_REGISTRY_TOKEN", t);
        }
        cmd.output().expect("run granary registry")
    }
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn serve_and_the_command_line() {
    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start(data.path());

    // A model directory (the command line sends a plain path as dir:).
    let src = tempfile::tempdir().unwrap();
    let weights: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(src.path().join("tiny.Q8_0.gguf"), &weights).unwrap();
    std::fs::write(src.path().join("tokenizer.json"), b"{}").unwrap();

    let out =
        ok(&reg.cli(&["import", src.path().to_str().unwrap(), "--name", "tiny", "--revision", "v1"], Some(ADMIN)));
    assert!(out.contains("imported tiny@v1"), "{out}");
    // Stored under the data directory's defaults.
    assert!(data.path().join("registry/registry.db").exists());
    let blobs = data.path().join("registry/blobs/blobs/sha256");
    assert_eq!(std::fs::read_dir(&blobs).unwrap().count(), 2);

    // A second import of the same revision: refused, with the reason.
    let out = reg.cli(&["import", src.path().to_str().unwrap(), "--name", "tiny", "--revision", "v1"], Some(ADMIN));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("409") && err.contains("exists already"), "{err}");
    // The read token cannot import.
    let out = reg.cli(&["import", "dir:/tmp", "--name", "x"], Some(READER));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("403"), "{}", String::from_utf8_lossy(&out.stderr));
    // No token cannot even list.
    let out = reg.cli(&["list"], None);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));

    let out = ok(&reg.cli(&["list"], Some(READER)));
    assert!(out.lines().any(|l| l.starts_with("tiny") && l.contains("v1")), "{out}");
    let out = ok(&reg.cli(&["show", "tiny@latest", "--json"], Some(READER)));
    let rev: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rev["revision"], "v1");
    assert_eq!(rev["format"], "gguf");
    let gguf = rev["files"].as_array().unwrap().iter().find(|f| f["path"] == "tiny.Q8_0.gguf").unwrap();
    assert_eq!(gguf["size"], weights.len() as u64);

    // Fetch the bytes over HTTP with the read token.
    let sha = gguf["sha256"].as_str().unwrap();
    let body = reqwest::blocking::Client::new()
        .get(format!("{}/v1/blobs/{sha}", reg.url))
        .bearer_auth(READER)
        .send()
        .unwrap()
        .bytes()
        .unwrap();
    assert_eq!(body.as_ref(), weights.as_slice());

    let out = ok(&reg.cli(&["delete", "tiny"], Some(ADMIN)));
    assert!(out.contains("deleted tiny"), "{out}");
    assert_eq!(std::fs::read_dir(&blobs).map(|d| d.count()).unwrap_or(0), 0, "blobs collected");
    let out = ok(&reg.cli(&["list"], Some(READER)));
    assert!(out.contains("no models"), "{out}");
    let out = ok(&reg.cli(&["gc", "--grace-s", "0"], Some(ADMIN)));
    assert!(out.contains("deleted 0 blobs"), "{out}");

    // SIGTERM: a clean exit.
    let mut reg = reg;
    // SAFETY: kill(2) on a child this test started and has not reaped.
    let rc = unsafe { libc::kill(reg.child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "SIGTERM: {}", std::io::Error::last_os_error());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = reg.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit within 10 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(b))
}

/// `granary registry push`: a local directory uploaded over HTTP into a
/// running registry, resuming an upload an earlier attempt left half done;
/// the registry checks every file's sha256 and records the revision.
#[test]
fn push_uploads_a_directory_resumably_and_checked() {
    let Some(model) = granary_tokenizer::testing::model_or_skip("registry push") else { return };
    let data = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tokens = tempfile::tempdir().unwrap();
    let reg = Registry::start_with_token_files(data.path(), tokens.path());
    let gguf = std::fs::read(&model).unwrap();
    std::fs::write(dir.path().join("model.gguf"), &gguf).unwrap();
    std::fs::write(dir.path().join("config.json"), br#"{"note":"pushed"}"#).unwrap();
    std::fs::write(dir.path().join(".hidden"), b"not pushed").unwrap();
    let (sha, size) = (sha256_hex(&gguf), gguf.len());
    let http = reqwest::blocking::Client::new();
    let patch = |sha: &str, size: usize, offset: usize, body: Vec<u8>, token: &str| {
        http.patch(format!("{}/v1/uploads/{sha}?size={size}", reg.url))
            .bearer_auth(token)
            .header("upload-offset", offset)
            .body(body)
            .send()
            .unwrap()
    };

    // An earlier attempt that broke off after 1 MiB.
    let r = patch(&sha, size, 0, gguf[..1 << 20].to_vec(), ADMIN);
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!((v["offset"].as_u64(), v["complete"].as_bool()), (Some(1 << 20), Some(false)), "{v}");
    // Not with a read token; not at another offset than the one held.
    assert_eq!(patch(&sha, size, 1 << 20, vec![0; 10], READER).status(), 403);
    let r = patch(&sha, size, 0, vec![0; 10], ADMIN);
    assert_eq!((r.status().as_u16(), r.headers()["upload-offset"].to_str().unwrap()), (409, "1048576"));
    // Bytes that do not hash to the name they are sent under: refused, nothing kept.
    let r = patch(&sha256_hex(b"abc"), 3, 0, b"abd".to_vec(), ADMIN);
    assert_eq!(r.status(), 400);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "checksum_mismatch", "{v}");
    let v: Value = http
        .get(format!("{}/v1/uploads/{}", reg.url, sha256_hex(b"abc")))
        .bearer_auth(ADMIN)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!((v["offset"].as_u64(), v["complete"].as_bool()), (Some(0), Some(false)), "{v}");

    // The push resumes the GGUF from 1 MiB and sends the rest.
    let d = dir.path().to_str().unwrap();
    let out =
        ok(&reg.cli(&["push", d, "--name", "pushed", "--revision", "r1", "--license", "apache-2.0"], Some(ADMIN)));
    assert!(out.contains("pushed pushed@r1: 2 files sent"), "{out}");
    assert!(out.contains(&format!("({} bytes, 1048576 resumed", size - (1 << 20) + 17)), "{out}");
    let shown: Value = serde_json::from_str(&ok(&reg.cli(&["show", "pushed@r1", "--json"], Some(READER)))).unwrap();
    let files: Vec<(&str, &str)> = shown["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["sha256"].as_str().unwrap()))
        .collect();
    let config_sha = sha256_hex(br#"{"note":"pushed"}"#);
    assert_eq!(files, [("config.json", config_sha.as_str()), ("model.gguf", sha.as_str())], "{shown}");
    assert_eq!((shown["format"].as_str(), shown["license"].as_str()), (Some("gguf"), Some("apache-2.0")));
    // The second read token of the file reads too; a token not in it does not.
    assert!(ok(&reg.cli(&["show", "pushed@r1"], Some(OTHER_READER))).contains("pushed"));
    assert!(!reg.cli(&["show", "pushed@r1"], Some("not-a-token-0123456789")).status.success());
    // The stored bytes are the file's.
    let back = http.get(format!("{}/v1/blobs/{sha}", reg.url)).bearer_auth(READER).send().unwrap().bytes().unwrap();
    assert_eq!(sha256_hex(&back), sha);

    // Pushed again: nothing to send.
    let out = ok(&reg.cli(&["push", d, "--name", "pushed", "--revision", "r2"], Some(ADMIN)));
    assert!(out.contains("0 files sent (0 bytes, 0 resumed from an earlier push), 2 already stored"), "{out}");
    // A revision naming a blob nobody uploaded is refused by name.
    let r = http
        .post(format!("{}/v1/models/pushed/revisions", reg.url))
        .bearer_auth(ADMIN)
        .json(&serde_json::json!({"files": [{"path": "x.gguf", "size": 3, "sha256": sha256_hex(b"xyz")}]}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "blob_missing", "{v}");
    // And a push without the admin token fails with one line, no upload recorded.
    let out = reg.cli(&["push", d, "--name", "pushed", "--revision", "r3"], Some(READER));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("403") && !err.contains("panicked"), "{err}");
}
