//! The real `granary warehouse` process: crash safety under SIGKILL, media
//! faults found by checksum, and two processes sharing one remote tier.

mod common;
#[path = "../../granary-warehouse/tests/common/s3.rs"]
mod s3;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{block, files_under, key, Warehouse};

const ADMIN: &str = "admin-secret";
const TOKENS: u32 = 64;

/// Sums every `field` number anywhere in a JSON document.
fn sum_field(v: &serde_json::Value, field: &str) -> u64 {
    match v {
        serde_json::Value::Object(m) => {
            m.iter().map(|(k, x)| if k == field { x.as_u64().unwrap_or(0) } else { sum_field(x, field) }).sum()
        }
        serde_json::Value::Array(a) => a.iter().map(|x| sum_field(x, field)).sum(),
        _ => 0,
    }
}

async fn stats(w: &Warehouse, c: &reqwest::Client) -> serde_json::Value {
    c.get(w.url("/stats")).bearer_auth(ADMIN).send().await.unwrap().error_for_status().unwrap().json().await.unwrap()
}

async fn get(w: &Warehouse, c: &reqwest::Client, ns: &str, seed: u64) -> (u16, bytes::Bytes) {
    let r = c.get(w.url(&format!("/v1/blocks/{ns}/{}", key(seed)))).bearer_auth(ADMIN).send().await.unwrap();
    (r.status().as_u16(), r.bytes().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_writes_keeps_every_durable_block_and_serves_nothing_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    let disk_s = disk.to_str().unwrap().to_string();
    let args = ["--disk-dir", &disk_s, "--disk", "2GiB", "--memory", "32MiB", "--admin-token", ADMIN];
    let mut w = Warehouse::start(&args, &[]);
    let c = reqwest::Client::new();

    // Writers: half ask for durability, half do not; all are killed mid-flight.
    let acked = Arc::new(Mutex::new(Vec::<u64>::new()));
    let attempted = Arc::new(Mutex::new(Vec::<u64>::new()));
    let mut writers = Vec::new();
    for wid in 0..4u64 {
        let (c, url, acked, attempted) = (c.clone(), w.url(""), acked.clone(), attempted.clone());
        writers.push(tokio::spawn(async move {
            let durable = wid % 2 == 0;
            for i in 0.. {
                let seed = wid << 32 | i;
                attempted.lock().unwrap().push(seed);
                let q = if durable { "?durable=true" } else { "" };
                let r = c
                    .put(format!("{url}/v1/blocks/crash/{}{q}", key(seed)))
                    .bearer_auth(ADMIN)
                    .body(block(seed, TOKENS))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().as_u16() == 201 => {
                        if durable {
                            acked.lock().unwrap().push(seed);
                        }
                    }
                    Ok(r) => panic!("unexpected status {}", r.status()),
                    Err(_) => return, // the server died
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    w.kill9();
    for t in writers {
        t.await.unwrap();
    }
    let acked: Vec<u64> = acked.lock().unwrap().clone();
    let attempted: Vec<u64> = attempted.lock().unwrap().clone();
    assert!(acked.len() >= 20, "too few durable writes acknowledged to mean anything: {}", acked.len());

    // Restart: every acknowledged durable block is back, byte for byte; no
    // other attempted block comes back different from what was sent.
    let w = Warehouse::start(&args, &[]);
    let s = stats(&w, &c).await;
    let recovered = sum_field(&s, "recovered");
    assert!(recovered >= acked.len() as u64, "recovered {recovered} < acknowledged {}", acked.len());
    for &seed in &acked {
        let (status, body) = get(&w, &c, "crash", seed).await;
        assert_eq!(status, 200, "durable block {seed:#x} lost after SIGKILL");
        assert_eq!(body, block(seed, TOKENS), "durable block {seed:#x} changed");
    }
    let acked_set: HashSet<u64> = acked.iter().copied().collect();
    for &seed in attempted.iter().filter(|s| !acked_set.contains(s)) {
        let (status, body) = get(&w, &c, "crash", seed).await;
        assert!(
            status == 404 || (status == 200 && body == block(seed, TOKENS)),
            "block {seed:#x}: status {status}, wrong bytes"
        );
    }
    println!(
        "SIGKILL: {} durable writes acknowledged, all {} readable after restart; {} recovered",
        acked.len(),
        acked.len(),
        recovered
    );
    drop(w);

    // Media faults: flip a byte in one block file and tear another in half.
    let mut files: Vec<_> =
        files_under(&disk).into_iter().filter(|p| std::fs::metadata(p).unwrap().len() > 1024).collect();
    files.sort();
    assert!(files.len() >= 2);
    let flipped = &files[0];
    let mut bytes = std::fs::read(flipped).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(flipped, &bytes).unwrap();
    let torn = &files[1];
    let len = std::fs::metadata(torn).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(torn).unwrap().set_len(len / 2).unwrap();

    let w = Warehouse::start(&args, &[]);
    let mut missing = 0;
    for &seed in &attempted {
        let (status, body) = get(&w, &c, "crash", seed).await;
        match status {
            200 => assert_eq!(body, block(seed, TOKENS), "corrupt block {seed:#x} was served"),
            404 => missing += acked_set.contains(&seed) as usize,
            s => panic!("unexpected status {s}"),
        }
    }
    let s = stats(&w, &c).await;
    let dropped = sum_field(&s, "corrupt_dropped");
    assert!(dropped >= 2, "both damaged files must be found and counted, got {dropped}");
    assert!(missing <= 2, "only the two damaged blocks may be missing, {missing} are");
    println!("media faults: {dropped} damaged blocks dropped and counted, {missing} durable blocks lost to them, nothing corrupt served");
}

/// A and B have their own memory and disk; they share only `remote`.
async fn two_processes_share(remote: &str, envs: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let (da, db) = (dir.path().join("a"), dir.path().join("b"));
    let a =
        Warehouse::start(&["--disk-dir", da.to_str().unwrap(), "--remote-url", remote, "--admin-token", ADMIN], envs);
    let b =
        Warehouse::start(&["--disk-dir", db.to_str().unwrap(), "--remote-url", remote, "--admin-token", ADMIN], envs);
    let c = reqwest::Client::new();
    for seed in 0..8u64 {
        let r = c
            .put(a.url(&format!("/v1/blocks/shared/{}", key(seed))))
            .bearer_auth(ADMIN)
            .body(block(seed, 16))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
    }
    // B has never seen these blocks; it must find them in the shared tier.
    let deadline = Instant::now() + Duration::from_secs(20);
    for seed in 0..8u64 {
        loop {
            let r = c.get(b.url(&format!("/v1/blocks/shared/{}", key(seed)))).bearer_auth(ADMIN).send().await.unwrap();
            if r.status().as_u16() == 200 {
                let tier = r.headers().get("x-granary-tier").map(|v| v.to_str().unwrap().to_string());
                assert_eq!(tier.as_deref(), Some("remote"), "first read on B must come from the remote tier");
                assert_eq!(r.bytes().await.unwrap(), block(seed, 16));
                break;
            }
            assert!(Instant::now() < deadline, "B never saw block {seed} written by A");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // A lookup on B now finds the whole chain locally (promoted on read).
    let keys: Vec<String> = (0..8u64).map(key).collect();
    let r: serde_json::Value = c
        .post(b.url("/v1/lookup"))
        .bearer_auth(ADMIN)
        .json(&serde_json::json!({"namespace": "shared", "keys": keys}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["matched"], 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_one_remote_tier_on_a_shared_filesystem() {
    let dir = tempfile::tempdir().unwrap();
    two_processes_share(&format!("file://{}", dir.path().display()), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_one_remote_tier_on_s3() {
    let Some(server) = s3::start_s3() else { return };
    let url = format!("s3://{}/kv", s3::BUCKET);
    let opts = server.options();
    let envs: Vec<(String, String)> = opts
        .iter()
        .map(|(k, v)| (format!("GRANARY_WAREHOUSE__STORE__REMOTE__OPTIONS__{}", k.to_uppercase()), v.clone()))
        .collect();
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    two_processes_share(&url, &envs).await;
    // The objects really are in the S3 server's bucket.
    assert!(!files_under(&server.bucket_dir()).is_empty());
}

#[test]
fn bad_flags_fail_fast_naming_the_field() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["warehouse", "--memory", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--memory"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["warehouse", "--policy", "random"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("random"));
}

/// LMCache's own connectors (`redis://`, `resp://`, `valkey://`, `lm://`)
/// against the real process, storing and reading back LMCache memory
/// objects byte for byte (`granary-warehouse/tests/python/lmcache_connectors.py`).
/// LMCache and PyPI's torch take about 5.5 GB, so this runs only with
/// `GRANARY_LMCACHE=1` (`GRANARY_LMCACHE=1 scripts/test.sh` installs them in
/// `.venv-lmcache`; `GRANARY_LMCACHE_PYTHON` names another interpreter).
#[test]
fn lmcache_connectors_store_and_read_back_memory_objects() {
    use std::io::BufRead;
    if std::env::var("GRANARY_LMCACHE").as_deref() != Ok("1") {
        eprintln!("skipping LMCache's connectors: set GRANARY_LMCACHE=1 (needs lmcache and torch, about 5.5 GB)");
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var("GRANARY_LMCACHE_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join(".venv-lmcache/bin/python"));
    let probe = std::process::Command::new(&python).args(["-c", "import lmcache, torch, glide_sync"]).output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "GRANARY_LMCACHE=1 but {} cannot import lmcache, torch and glide_sync: {:?}",
        python.display(),
        probe.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
    );
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["warehouse", "--resp", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .env("GRANARY_WAREHOUSE__LM__LISTEN", "127.0.0.1:0")
        .env("GRANARY_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (mut resp, mut lm) = (None, None);
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(a) = line.strip_prefix("granary warehouse: resp listening on ") {
            resp = Some(a.rsplit(':').next().unwrap().to_string());
        } else if let Some(a) = line.strip_prefix("granary warehouse: lm listening on ") {
            lm = Some(a.rsplit(':').next().unwrap().to_string());
        } else if line == "granary warehouse: ready" {
            break;
        }
    }
    let script = root.join("crates/granary-warehouse/tests/python/lmcache_connectors.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .args([resp.expect("a resp port"), lm.expect("an lm port")])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "LMCache's connectors failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr).lines().filter(|l| !l.contains(" INFO:")).collect::<Vec<_>>().join("\n")
    );
    assert!(stdout.contains("all LMCache connectors passed"));
}
