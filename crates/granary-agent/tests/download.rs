//! The downloader against a real nginx (HTTP ranges, access log for
//! counting): parallel ranges reassemble byte-exact; an interrupted
//! download resumes fetching only the chunks it lacks; a sha256 mismatch is
//! refused and leaves nothing; a full filesystem (a real 1 MiB tmpfs, in a
//! user and mount namespace of its own) gives a clean error naming the
//! directory and leaves no partial file.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{data, files_under, sha256_hex, Nginx};
use granary_agent::download::{part_path, sidecar_path, DownloadConfig, Downloader, FileRequest};
use granary_agent::AgentError;

const CHUNK: u64 = 256 << 10;

fn downloader(parallel: usize, preallocate: bool) -> Downloader {
    Downloader::new(DownloadConfig {
        parallel,
        chunk_bytes: CHUNK,
        retries: 2,
        preallocate,
        request_timeout: Duration::from_secs(60),
    })
    .unwrap()
}

fn request(url: String, bytes: &[u8], sha: Option<&str>) -> FileRequest {
    FileRequest {
        url,
        bearer: None,
        size: bytes.len() as u64,
        sha256: sha.map_or_else(|| sha256_hex(bytes), str::to_string),
        label: "weights.bin".into(),
    }
}

fn serve(bytes: &[u8]) -> Option<(tempfile::TempDir, Nginx)> {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("weights.bin"), bytes).unwrap();
    let n = Nginx::start(root.path())?;
    Some((root, n))
}

#[tokio::test]
async fn parallel_ranges_reassemble_byte_exact() {
    // Not a multiple of the chunk: the last range is short.
    let bytes = data(5 * (1 << 20) + 123, 1);
    let Some((_root, nginx)) = serve(&bytes) else { return };
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("blob");
    let stats = downloader(8, true).fetch(&request(nginx.url("/fast/weights.bin"), &bytes, None), &dest).await.unwrap();

    assert!(std::fs::read(&dest).unwrap() == bytes, "the file differs from the served one");
    assert!(!part_path(&dest).exists() && !sidecar_path(&dest).exists());
    let chunks = (bytes.len() as u64).div_ceil(CHUNK);
    let hits = nginx.hits();
    assert_eq!(hits.len() as u64, chunks, "one range request per chunk: {hits:?}");
    assert!(hits.iter().all(|h| h.status == 206), "{hits:?}");
    let served: u64 = hits.iter().map(|h| h.bytes).sum();
    assert_eq!(served, bytes.len() as u64);
    let mut ranges: Vec<&str> = hits.iter().map(|h| h.range.as_str()).collect();
    ranges.sort();
    ranges.dedup();
    assert_eq!(ranges.len() as u64, chunks, "every range asked once");
    assert_eq!(stats.requests, chunks);
    assert_eq!(stats.bytes, bytes.len() as u64);
}

#[tokio::test]
async fn an_interrupted_download_fetches_only_what_is_missing() {
    let bytes = data(24 * CHUNK as usize, 2);
    let Some((_root, nginx)) = serve(&bytes) else { return };
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("blob");

    // First try through the throttled path, cut off once a third is on disk.
    let d = downloader(4, true);
    let first = request(nginx.url("/slow/weights.bin"), &bytes, None);
    let watcher = d.clone();
    let third = bytes.len() as u64 / 3;
    let cut = async move {
        loop {
            let done: u64 = watcher.downloads().snapshot().iter().map(|p| p.done).sum();
            if done >= third {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        r = d.fetch(&first, &dest) => panic!("the throttled download finished before the cut: {r:?}"),
        _ = tokio::time::timeout(Duration::from_secs(60), cut) => {}
    }
    assert!(!dest.exists(), "nothing unverified is in place");
    let sidecar: serde_json::Value = serde_json::from_slice(&std::fs::read(sidecar_path(&dest)).unwrap()).unwrap();
    let done_chunks = sidecar["done"].as_array().unwrap().len() as u64;
    assert!((1..24).contains(&done_chunks), "{done_chunks} chunks recorded");

    // Second try, full speed: only the missing chunks are asked for.
    let second = request(nginx.url("/fast/weights.bin"), &bytes, None);
    let stats = downloader(4, true).fetch(&second, &dest).await.unwrap();
    assert!(std::fs::read(&dest).unwrap() == bytes, "the resumed file differs");
    // Chunks in flight at the cut may still land (and be recorded) after
    // the sidecar was read above, so the second try may find more done.
    let resumed = stats.resumed_bytes / CHUNK;
    assert_eq!(stats.resumed_bytes % CHUNK, 0);
    assert!((done_chunks..24).contains(&resumed), "{resumed} chunks resumed, {done_chunks} recorded at the cut");
    // nginx logs a request after its last byte is sent, so the last line
    // may land a moment after the download has finished.
    let fast_hits = || -> Vec<_> { nginx.hits().into_iter().filter(|h| h.uri.starts_with("/fast/")).collect() };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while (fast_hits().len() as u64) < 24 - resumed && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fast = fast_hits();
    assert_eq!(fast.len() as u64, 24 - resumed, "requests after the resume: {fast:?}");
    let fetched: u64 = fast.iter().map(|h| h.bytes).sum();
    assert_eq!(fetched, (24 - resumed) * CHUNK);
    assert!(!part_path(&dest).exists() && !sidecar_path(&dest).exists());
}

/// The agent's path: the disk tier reserves the space, the download is cut
/// off, the agent "restarts" (the tiers are opened again from disk), and the
/// next load resumes the part file the index found.
#[tokio::test]
async fn a_download_cut_off_by_a_restart_resumes_through_the_tiers() {
    use granary_agent::tiers::{TierConfig, Tiers};
    let bytes = data(16 * CHUNK as usize, 6);
    let sha = sha256_hex(&bytes);
    let Some((_root, nginx)) = serve(&bytes) else { return };
    let cache = tempfile::tempdir().unwrap();
    let cfg = TierConfig { ram_dir: None, disk_budget: granary_core::ByteSize::mib(64), ..Default::default() };
    {
        let tiers = Tiers::open(cfg.clone(), cache.path()).unwrap();
        let dest = tiers.begin_download(&sha, bytes.len() as u64, "weights.bin").unwrap();
        let d = downloader(2, true);
        let req = request(nginx.url("/slow/weights.bin"), &bytes, None);
        let watcher = d.clone();
        let quarter = bytes.len() as u64 / 4;
        let cut = async move {
            while watcher.downloads().snapshot().iter().map(|p| p.done).sum::<u64>() < quarter {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            r = d.fetch(&req, &dest) => panic!("finished before the cut: {r:?}"),
            _ = tokio::time::timeout(Duration::from_secs(60), cut) => {}
        }
        // The agent dies here: no end_download.
    }
    let tiers = Tiers::open(cfg, cache.path()).unwrap();
    assert_eq!(tiers.locate(&sha), None, "a part file is not a copy");
    assert_eq!(tiers.status().disk.used, bytes.len() as u64, "the part file's space is counted");
    let dest = tiers.begin_download(&sha, bytes.len() as u64, "weights.bin").unwrap();
    let before = nginx.hits().iter().filter(|h| h.uri.starts_with("/fast/")).count();
    let stats = downloader(2, true).fetch(&request(nginx.url("/fast/weights.bin"), &bytes, None), &dest).await.unwrap();
    tiers.end_download(&sha, true);
    assert!(stats.resumed_bytes >= CHUNK, "resumed {} bytes", stats.resumed_bytes);
    let fetched: u64 = nginx.hits().iter().filter(|h| h.uri.starts_with("/fast/")).skip(before).map(|h| h.bytes).sum();
    assert_eq!(fetched, bytes.len() as u64 - stats.resumed_bytes, "only the missing ranges were fetched");
    assert_eq!(tiers.locate(&sha), Some(granary_agent::tiers::Tier::Disk));
    assert!(std::fs::read(tiers.disk_path(&sha)).unwrap() == bytes);
    assert_eq!(tiers.status().disk.used, bytes.len() as u64);
}

#[tokio::test]
async fn a_sha256_mismatch_is_refused_and_leaves_nothing() {
    let bytes = data(700_000, 3);
    let Some((_root, nginx)) = serve(&bytes) else { return };
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("blob");
    let wrong = sha256_hex(b"something else");
    let err = downloader(4, true)
        .fetch(&request(nginx.url("/fast/weights.bin"), &bytes, Some(&wrong)), &dest)
        .await
        .unwrap_err();
    match &err {
        AgentError::Integrity { expected, actual, .. } => {
            assert_eq!(expected, &wrong);
            assert_eq!(actual, &sha256_hex(&bytes));
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    assert_eq!(err.status().as_u16(), 502);
    assert!(err.to_string().contains("sha256 mismatch"), "{err}");
    assert!(files_under(out.path()).is_empty(), "left behind: {:?}", files_under(out.path()));
}

#[tokio::test]
async fn a_missing_file_is_a_clear_error() {
    let bytes = data(1000, 4);
    let Some((_root, nginx)) = serve(&bytes) else { return };
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("blob");
    let err = downloader(2, true).fetch(&request(nginx.url("/fast/nope.bin"), &bytes, None), &dest).await.unwrap_err();
    assert!(matches!(err, AgentError::Download { .. }), "{err:?}");
    assert!(err.to_string().contains("404"), "{err}");
}

/// Runs `full_filesystem_inner` in a user and mount namespace of its own,
/// with a 1 MiB tmpfs as the download directory: a real full filesystem
/// without touching the host's mounts.
#[test]
fn a_full_disk_gives_a_clean_error_and_no_partial_file() {
    let bytes = data(3 << 20, 5);
    let Some((_root, nginx)) = serve(&bytes) else { return };
    let probe = Command::new("unshare").args(["-Urm", "true"]).status();
    if !probe.is_ok_and(|s| s.success()) {
        assert!(!common::required(), "unshare -Urm (user + mount namespaces) is unavailable");
        eprintln!("skipping: unshare -Urm is unavailable, so no small filesystem can be mounted");
        return;
    }
    let mnt = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["-Urm", "sh", "-c", r#"mount -t tmpfs -o size=1m tmpfs "$FULL_DIR" && exec "$0" "$@""#])
        .arg(&exe)
        .args(["--exact", "full_filesystem_inner", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FULL_DIR", mnt.path())
        .env("FULL_URL", nginx.url("/fast/weights.bin"))
        .env("FULL_SHA", sha256_hex(&bytes))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "the namespaced run failed");
    assert!(text.contains("1 passed"), "the inner test did not run");
    assert!(text.contains("full-disk checks passed"));
}

#[tokio::test]
#[ignore = "run inside a namespace with a 1 MiB tmpfs by a_full_disk_gives_a_clean_error_and_no_partial_file"]
async fn full_filesystem_inner() {
    let dir = std::env::var("FULL_DIR").expect("FULL_DIR");
    let dir = Path::new(&dir);
    let url = std::env::var("FULL_URL").unwrap();
    let sha = std::env::var("FULL_SHA").unwrap();
    let stat = Command::new("df").arg(dir).output().unwrap();
    let df = String::from_utf8_lossy(&stat.stdout).to_string();
    assert!(df.contains("tmpfs"), "{dir:?} is not the small tmpfs: {df}");
    let req = FileRequest { url, bearer: None, size: 3 << 20, sha256: sha, label: "weights.bin".into() };
    // Preallocated: refused before the first byte. Sparse: refused mid-download.
    for prealloc in [true, false] {
        let dest = dir.join("blobs").join("blob");
        let err = downloader(4, prealloc).fetch(&req, &dest).await.unwrap_err();
        match &err {
            AgentError::NoSpace { dir: d, .. } => assert_eq!(d, &dir.join("blobs")),
            other => panic!("preallocate={prealloc}: expected NoSpace, got {other:?}"),
        }
        assert_eq!(err.status().as_u16(), 507);
        assert!(err.to_string().contains(&dir.join("blobs").display().to_string()), "{err}");
        let left = files_under(dir);
        assert!(left.is_empty(), "preallocate={prealloc}: left behind {left:?}");
        eprintln!("preallocate={prealloc}: {err}");
    }
    println!("full-disk checks passed");
}
