//! The HTTP server end to end: a real listener on 127.0.0.1, real requests
//! through reqwest, real stores behind it.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use granary_core::{BlockHash, DType, HashChain, KvBlock};
use granary_warehouse::auth::Auth;
use granary_warehouse::config::{DiskConfig, StoreConfig};
use granary_warehouse::{OffloadMode, PolicyKind, ServerCtx, Store, TierKind};
use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::oneshot;

const ADMIN: &str = "admin-secret";
const TOKEN_A: &str = "token-a";
const TOKEN_B: &str = "token-b";

struct Server {
    base: String,
    ctx: Arc<ServerCtx>,
    client: Client,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(store: Store, auth: Auth) -> Server {
        let ctx = Arc::new(ServerCtx::new(store, auth));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(granary_warehouse::http::serve(listener, ctx.clone(), async move {
            let _ = rx.await;
        }));
        Server { base, ctx, client: Client::new(), stop: Some(tx), task }
    }

    async fn open() -> Server {
        Self::start(Store::memory_only(1 << 24), Auth::default()).await
    }

    /// Admin plus namespaces `a` and `b`.
    async fn with_tokens() -> Server {
        Self::start(Store::memory_only(1 << 24), Auth::from_plain(Some(ADMIN), &[("a", TOKEN_A), ("b", TOKEN_B)])).await
    }

    fn req(&self, method: Method, path: &str, token: Option<&str>) -> reqwest::RequestBuilder {
        let r = self.client.request(method, format!("{}{}", self.base, path));
        match token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn put(&self, ns: &str, key: &str, body: Bytes, query: &str, token: Option<&str>) -> reqwest::Response {
        self.req(Method::PUT, &format!("/v1/blocks/{ns}/{key}{query}"), token).body(body).send().await.unwrap()
    }

    async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        self.req(Method::GET, path, token).send().await.unwrap()
    }

    async fn lookup(&self, body: Value, token: Option<&str>) -> reqwest::Response {
        self.req(Method::POST, "/v1/lookup", token).json(&body).send().await.unwrap()
    }

    async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let res = tokio::time::timeout(Duration::from_secs(10), self.task).await;
        assert!(matches!(res, Ok(Ok(Ok(())))), "server did not shut down cleanly: {res:?}");
    }
}

/// Hashes of `n` consecutive blocks of one prompt.
fn hashes(n: usize) -> Vec<String> {
    let tokens: Vec<u32> = (0..(4 * n as u32)).collect();
    HashChain::new("test", b"model", b"layout", 4).hashes(&tokens).iter().map(BlockHash::to_hex).collect()
}

/// A valid f16 KV block (2 layers, 1 head, 4 dims, 3 tokens) whose payload starts at `seed`.
fn block(seed: u8) -> Bytes {
    let payload: Vec<u8> = (0..96u8).map(|i| i.wrapping_add(seed)).collect();
    KvBlock::kv(DType::F16, 0, 2, 1, 4, 3, Bytes::from(payload)).unwrap().encode()
}

async fn error_of(resp: reqwest::Response) -> (StatusCode, Value) {
    let status = resp.status();
    let ct = resp.headers().get("content-type").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    assert!(ct.starts_with("application/json"), "error answers are JSON, got {ct:?} ({status})");
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].is_string() && v["error"]["type"].is_string() && v["error"]["code"].is_string());
    (status, v["error"].clone())
}

#[tokio::test]
async fn block_round_trip_head_and_delete() {
    let s = Server::open().await;
    let key = &hashes(1)[0];
    let body = block(7);
    let path = format!("/v1/blocks/anyns/{key}");

    let r = s.put("anyns", key, body.clone(), "", None).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"stored": true, "bytes": body.len(), "durable": false}));

    let r = s.get(&path, None).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "application/octet-stream");
    assert_eq!(r.headers()["x-granary-tier"], "memory");
    assert_eq!(r.bytes().await.unwrap(), body, "bytes come back exactly as stored");

    let r = s.req(Method::HEAD, &path, None).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-length"], body.len().to_string().as_str());

    // NX on a present key stores nothing.
    let r = s.put("anyns", key, block(9), "?nx=true", None).await;
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!(r.json::<Value>().await.unwrap()["stored"], false);
    assert_eq!(s.get(&path, None).await.bytes().await.unwrap(), body);

    let r = s.req(Method::DELETE, &path, None).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let (status, err) = error_of(s.get(&path, None).await).await;
    assert_eq!((status, err["type"].as_str()), (StatusCode::NOT_FOUND, Some("not_found_error")));
    assert_eq!(s.req(Method::HEAD, &path, None).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(s.req(Method::DELETE, &path, None).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    s.shutdown().await;
}

fn disk_entries(store: &Store) -> u64 {
    store.stats().tiers.iter().find(|t| t.tier == Some(TierKind::Disk)).map(|t| t.entries).unwrap()
}

#[tokio::test]
async fn durable_put_is_on_disk_when_answered() {
    // Write-back mode: a plain put never reaches the disk tier, so a block
    // found there right after the answer got there through `durable`.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::memory_only(1 << 24);
    cfg.offload = OffloadMode::Evicted;
    cfg.disk = Some(DiskConfig {
        dir: dir.path().to_path_buf(),
        capacity: granary_core::ByteSize(1 << 24),
        policy: PolicyKind::Lru,
    });
    let store = Store::open(cfg).await.unwrap();
    let s = Server::start(store.clone(), Auth::default()).await;
    let h = hashes(2);

    let r = s.put("d", &h[0], block(1), "", None).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(disk_entries(&store), 0, "a plain put stays in memory in write-back mode");

    let r = s.put("d", &h[1], block(2), "?durable=true&depth=1", None).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(disk_entries(&store), 1, "a durable put is on disk when answered");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["durable"], true, "{v}");
    let (status, err) = error_of(s.put("d", &h[1], block(2), "?durable=maybe", None).await).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("durable")));
    s.shutdown().await;
}

#[tokio::test]
async fn ttl_expires_blocks() {
    let s = Server::open().await;
    let key = &hashes(1)[0];
    let path = format!("/v1/blocks/t/{key}");
    assert_eq!(s.put("t", key, block(3), "?ttl=1", None).await.status(), StatusCode::CREATED);
    assert_eq!(s.get(&path, None).await.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(s.get(&path, None).await.status(), StatusCode::NOT_FOUND, "expired after its ttl");

    for bad in ["?ttl=0", "?ttl=abc", "?ttl=-5", "?ttl=99999999999999999999"] {
        let (status, err) = error_of(s.put("t", key, block(3), bad, None).await).await;
        assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("ttl")), "{bad}");
    }
    s.shutdown().await;
}

#[tokio::test]
async fn lookup_finds_the_longest_cached_prefix() {
    let s = Server::open().await;
    let h = hashes(5);
    // Blocks 0, 1, 2 and 4 are cached; 3 is not.
    for i in [0, 1, 2, 4] {
        assert_eq!(s.put("p", &h[i], block(i as u8), "", None).await.status(), StatusCode::CREATED);
    }
    let r = s.lookup(json!({"namespace": "p", "keys": h}), None).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"matched": 3, "tiers": ["memory", "memory", "memory"]}),
        "block 4 is cached but lies past the gap at 3"
    );
    let r = s.lookup(json!({"namespace": "p", "keys": &h[..2]}), None).await;
    assert_eq!(r.json::<Value>().await.unwrap()["matched"], 2);
    let r = s.lookup(json!({"namespace": "p", "keys": &h[3..]}), None).await;
    assert_eq!(r.json::<Value>().await.unwrap()["matched"], 0);
    let r = s.lookup(json!({"namespace": "other", "keys": h}), None).await;
    assert_eq!(r.json::<Value>().await.unwrap()["matched"], 0, "namespaces do not share blocks");

    let mut bad = h.clone();
    bad[2] = "XYZ".into();
    let (status, err) = error_of(s.lookup(json!({"namespace": "p", "keys": bad}), None).await).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("keys[2]")));
    let many = vec![h[0].clone(); 4097];
    let (status, err) = error_of(s.lookup(json!({"namespace": "p", "keys": many}), None).await).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("keys")));
    s.shutdown().await;
}

#[tokio::test]
async fn invalid_blocks_and_keys_are_refused_and_not_stored() {
    let s = Server::open().await;
    let key = &hashes(1)[0];
    let good = block(5);
    let mut magic = good.to_vec();
    magic[0] = b'X';
    let truncated = good.slice(..40);
    let mut flipped = good.to_vec();
    *flipped.last_mut().unwrap() ^= 0x01;
    let cases: [(&str, Bytes, &str); 3] = [
        ("wrong magic", Bytes::from(magic), "bad magic"),
        ("truncated", truncated, "shorter than the 64-byte header"),
        ("checksum flipped", Bytes::from(flipped), "payload checksum mismatch"),
    ];
    for (what, body, expect) in cases {
        let (status, err) = error_of(s.put("v", key, body, "", None).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{what}");
        assert_eq!(err["param"], "body", "{what}");
        assert!(err["message"].as_str().unwrap().contains(expect), "{what}: {err}");
        assert_eq!(s.get(&format!("/v1/blocks/v/{key}"), None).await.status(), StatusCode::NOT_FOUND, "{what}");
    }
    assert_eq!(s.ctx.store.stats().tiers[0].entries, 0, "nothing was stored");

    for bad in ["abc", &key.to_uppercase(), &format!("{key}0"), &format!("{}g", &key[..63])] {
        let (status, err) = error_of(s.put("v", bad, good.clone(), "", None).await).await;
        assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("key")), "{bad}");
        assert_eq!(err["code"], "invalid_block_hash");
    }
    let (status, err) = error_of(s.put("bad ns!", key, good, "", None).await).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("namespace")));
    s.shutdown().await;
}

#[tokio::test]
async fn oversized_bodies_get_413_json() {
    let mut cfg = StoreConfig::memory_only(1 << 24);
    cfg.max_value = granary_core::ByteSize(4096);
    let s = Server::start(Store::with_tiers(cfg, None, None), Auth::default()).await;
    let key = &hashes(1)[0];
    let big = KvBlock::opaque(Bytes::from(vec![1u8; 8192])).encode();
    let (status, err) = error_of(s.put("o", key, big, "", None).await).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(err["code"], "payload_too_large");
    let fits = KvBlock::opaque(Bytes::from(vec![1u8; 4000])).encode();
    assert_eq!(s.put("o", key, fits, "", None).await.status(), StatusCode::CREATED);
    assert!(s.ctx.http.protocol_errors.load(Relaxed) >= 1);
    s.shutdown().await;
}

#[tokio::test]
async fn malformed_requests_name_the_field() {
    let s = Server::open().await;
    let raw = |body: &'static str| {
        s.req(Method::POST, "/v1/lookup", None).header("content-type", "application/json").body(body).send()
    };
    let (status, err) = error_of(raw("{not json").await.unwrap()).await;
    assert_eq!((status, err["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_json")));
    let (status, err) = error_of(raw(r#"{"namespace": 5, "keys": []}"#).await.unwrap()).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("namespace")));
    let (status, err) = error_of(raw(r#"{"namespace": "n", "keys": "abc"}"#).await.unwrap()).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("keys")));
    let (status, err) = error_of(raw(r#"{"keys": []}"#).await.unwrap()).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("namespace")));
    let (status, err) = error_of(raw(r#"{"namespace": "n", "keys": [], "extra": 1}"#).await.unwrap()).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("extra")));

    let key = &hashes(1)[0];
    let (status, err) = error_of(s.put("n", key, block(1), "?depth=x", None).await).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("depth")));

    let (status, err) = error_of(s.get("/v2/nothing", None).await).await;
    assert_eq!((status, err["type"].as_str()), (StatusCode::NOT_FOUND, Some("not_found_error")));
    let (status, err) = error_of(s.req(Method::POST, &format!("/v1/blocks/n/{key}"), None).send().await.unwrap()).await;
    assert_eq!((status, err["code"].as_str()), (StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed")));
    let (status, _) = error_of(s.get("/v1/lookup", None).await).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    s.shutdown().await;
}

#[tokio::test]
async fn namespace_tokens_are_isolated() {
    let s = Server::with_tokens().await;
    let h = hashes(1);
    let key = &h[0];
    let path_b = format!("/v1/blocks/b/{key}");
    assert_eq!(s.put("b", key, block(2), "", Some(TOKEN_B)).await.status(), StatusCode::CREATED);
    assert_eq!(s.put("a", key, block(1), "", Some(TOKEN_A)).await.status(), StatusCode::CREATED);

    // Token of `a` on namespace `b`: refused for every verb.
    let (status, err) = error_of(s.put("b", key, block(3), "", Some(TOKEN_A)).await).await;
    assert_eq!((status, err["type"].as_str()), (StatusCode::FORBIDDEN, Some("permission_error")));
    assert_eq!(s.get(&path_b, Some(TOKEN_A)).await.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.req(Method::HEAD, &path_b, Some(TOKEN_A)).send().await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(s.req(Method::DELETE, &path_b, Some(TOKEN_A)).send().await.unwrap().status(), StatusCode::FORBIDDEN);
    let (status, _) = error_of(s.lookup(json!({"namespace": "b", "keys": h}), Some(TOKEN_A)).await).await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // No token, a wrong token, or another scheme: 401.
    let (status, err) = error_of(s.get(&path_b, None).await).await;
    assert_eq!((status, err["type"].as_str()), (StatusCode::UNAUTHORIZED, Some("authentication_error")));
    assert_eq!(s.get(&path_b, Some("nope")).await.status(), StatusCode::UNAUTHORIZED);
    let basic = s.req(Method::GET, &path_b, None).header("authorization", "Basic YTpi").send().await.unwrap();
    assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(s.lookup(json!({"namespace": "a", "keys": h}), None).await.status(), StatusCode::UNAUTHORIZED);

    // Each token reads its own; the admin reads both; b's block is untouched.
    assert_eq!(s.get(&format!("/v1/blocks/a/{key}"), Some(TOKEN_A)).await.bytes().await.unwrap(), block(1));
    assert_eq!(s.get(&path_b, Some(TOKEN_B)).await.bytes().await.unwrap(), block(2));
    assert_eq!(s.get(&path_b, Some(ADMIN)).await.status(), StatusCode::OK);
    let r = s.lookup(json!({"namespace": "a", "keys": h}), Some(TOKEN_A)).await;
    assert_eq!(r.json::<Value>().await.unwrap()["matched"], 1);
    s.shutdown().await;
}

#[tokio::test]
async fn admin_endpoints_need_the_admin_token() {
    let s = Server::with_tokens().await;
    let key = &hashes(1)[0];
    assert_eq!(s.put("a", key, block(4), "?ttl=100&depth=3", Some(TOKEN_A)).await.status(), StatusCode::CREATED);
    for path in ["/metrics", "/stats", "/cache/list?namespace=a", &format!("/cache/get?namespace=a&key={key}")] {
        let (status, err) = error_of(s.get(path, None).await).await;
        assert_eq!((status, err["type"].as_str()), (StatusCode::UNAUTHORIZED, Some("authentication_error")), "{path}");
        // A tenant's /stats is about its own namespace only (tenant_views_show_only_their_namespace).
        if path != "/stats" {
            let (status, err) = error_of(s.get(path, Some(TOKEN_A)).await).await;
            assert_eq!((status, err["type"].as_str()), (StatusCode::FORBIDDEN, Some("permission_error")), "{path}");
        }
        assert_eq!(s.get(path, Some(ADMIN)).await.status(), StatusCode::OK, "{path}");
    }

    let stats: Value = s.get("/stats", Some(ADMIN)).await.json().await.unwrap();
    assert_eq!(stats["store"]["tiers"][0]["entries"], 1);
    assert!(stats["protocols"]["http"]["requests_ok"].as_u64().unwrap() >= 1);
    assert!(stats["uptime_seconds"].as_f64().unwrap() >= 0.0);

    let list: Value = s.get("/cache/list?namespace=a&count=10", Some(ADMIN)).await.json().await.unwrap();
    assert_eq!(list["keys"], json!([key]));
    assert_eq!(list["next_cursor"], 0);
    let (status, err) = error_of(s.get("/cache/list", Some(ADMIN)).await).await;
    assert_eq!((status, err["param"].as_str()), (StatusCode::BAD_REQUEST, Some("namespace")));

    let meta: Value = s.get(&format!("/cache/get?namespace=a&key={key}"), Some(ADMIN)).await.json().await.unwrap();
    assert_eq!((meta["found"].as_bool(), meta["tier"].as_str()), (Some(true), Some("memory")));
    assert_eq!(meta["size"], block(4).len());
    assert_eq!(meta["depth"], 3);
    let ttl = meta["ttl_seconds"].as_f64().unwrap();
    assert!(ttl > 90.0 && ttl <= 100.0, "{ttl}");
    let raw = s.get(&format!("/cache/get?namespace=a&key={key}&raw=1"), Some(ADMIN)).await;
    assert_eq!(raw.bytes().await.unwrap(), block(4));
    let missing = s.get("/cache/get?namespace=a&key=nope", Some(ADMIN)).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    s.shutdown().await;

    // Namespace tokens but no admin token: admin endpoints are closed to everyone.
    let s = Server::start(Store::memory_only(1 << 20), Auth::from_plain(None, &[("a", TOKEN_A)])).await;
    let (status, err) = error_of(s.get("/metrics", Some(TOKEN_A)).await).await;
    assert_eq!((status, err["message"].as_str()), (StatusCode::FORBIDDEN, Some("no admin token configured")));
    s.shutdown().await;
    // An open server serves data but not admin endpoints.
    let s = Server::open().await;
    assert_eq!(s.get("/stats", None).await.status(), StatusCode::FORBIDDEN);
    s.shutdown().await;
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn metrics_are_valid_and_move_with_traffic() {
    let s = Server::with_tokens().await;
    let om = s.req(Method::GET, "/metrics", Some(ADMIN)).header("accept", "application/openmetrics-text").send();
    let om = om.await.unwrap();
    assert!(om.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    assert!(om.text().await.unwrap().ends_with("# EOF\n"));
    let before = s.get("/metrics", Some(ADMIN)).await;
    assert!(before.headers()["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    let before = before.text().await.unwrap();
    let hits = r#"granary_warehouse_hits_total{tier="memory"}"#;
    let ok = r#"granary_warehouse_requests_total{protocol="http",outcome="ok"}"#;
    let errors = r#"granary_warehouse_requests_total{protocol="http",outcome="error"}"#;

    let key = &hashes(1)[0];
    s.put("a", key, block(1), "", Some(TOKEN_A)).await;
    for _ in 0..3 {
        assert_eq!(s.get(&format!("/v1/blocks/a/{key}"), Some(TOKEN_A)).await.status(), StatusCode::OK);
    }
    assert_eq!(s.get("/v1/blocks/a/nope", Some(TOKEN_A)).await.status(), StatusCode::BAD_REQUEST);
    let after = s.get("/metrics", Some(ADMIN)).await.text().await.unwrap();

    assert_eq!(metric(&after, hits) - metric(&before, hits), 3.0, "three GETs, three memory hits");
    assert!(metric(&after, ok) >= metric(&before, ok) + 4.0);
    assert!(metric(&after, errors) >= metric(&before, errors) + 1.0);
    assert_eq!(metric(&after, r#"granary_warehouse_tier_entries{tier="memory"}"#), 1.0);
    assert!(metric(&after, r#"granary_warehouse_read_bytes_total{protocol="http"}"#) > 0.0);
    assert!(metric(&after, r#"granary_warehouse_connections_accepted_total{protocol="http"}"#) >= 1.0);
    assert!(after.contains(
        r#"granary_warehouse_http_request_seconds_count{method="GET",route="/v1/blocks/{namespace}/{key}",status="2xx"} 3"#
    ));

    match Command::new("promtool").args(["check", "metrics"]).stdin(Stdio::piped()).output_with_stdin(&after) {
        Some(out) => {
            assert!(out.status.success(), "promtool rejected /metrics: {}{}", out.stdout_text(), out.stderr_text());
        }
        None if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") => {
            panic!("promtool not found and GRANARY_REQUIRE_EXTERNAL=1")
        }
        None => eprintln!("skipped: promtool not found, /metrics text not checked by promtool"),
    }
    s.shutdown().await;
}

/// Runs a command with `input` on stdin; `None` when it cannot be started.
trait RunWithStdin {
    fn output_with_stdin(&mut self, input: &str) -> Option<std::process::Output>;
}

impl RunWithStdin for Command {
    fn output_with_stdin(&mut self, input: &str) -> Option<std::process::Output> {
        let mut child = self.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().ok()?;
        child.stdin.take()?.write_all(input.as_bytes()).ok()?;
        child.wait_with_output().ok()
    }
}

trait OutputText {
    fn stdout_text(&self) -> String;
    fn stderr_text(&self) -> String;
}

impl OutputText for std::process::Output {
    fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// Reads SSE `data:` lines until one satisfies `done` (or the deadline);
/// returns every data payload seen.
async fn read_events(resp: &mut reqwest::Response, done: impl Fn(&Value) -> bool) -> Vec<Value> {
    let mut seen = Vec::new();
    let mut buf = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let chunk = tokio::time::timeout_at(deadline, resp.chunk()).await.expect("event within 10 s").unwrap();
        let Some(chunk) = chunk else { return seen };
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            for line in frame.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    let v: Value = serde_json::from_str(data.trim()).unwrap();
                    let stop = done(&v);
                    seen.push(v);
                    if stop {
                        return seen;
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn events_stream_only_the_principals_namespace() {
    let s = Server::with_tokens().await;
    let h = hashes(2);
    let (status, _) = error_of(s.get("/v1/events?namespace=b", Some(TOKEN_A)).await).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(s.get("/v1/events", None).await.status(), StatusCode::UNAUTHORIZED);

    let mut stream = s.get("/v1/events", Some(TOKEN_A)).await;
    assert_eq!(stream.status(), StatusCode::OK);
    assert!(stream.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));

    // A write in `b` first: were it delivered, it would arrive before a's.
    assert_eq!(s.put("b", &h[0], block(1), "", Some(TOKEN_B)).await.status(), StatusCode::CREATED);
    assert_eq!(s.put("a", &h[1], block(2), "", Some(TOKEN_A)).await.status(), StatusCode::CREATED);
    let seen = read_events(&mut stream, |v| v["key"] == h[1].as_str()).await;
    let last = seen.last().unwrap();
    assert_eq!((last["kind"].as_str(), last["namespace"].as_str()), (Some("stored"), Some("a")));
    assert_eq!(last["tier"], "memory");
    assert!(seen.iter().all(|v| v["namespace"] == "a"), "events of another namespace leaked: {seen:?}");
    drop(stream);
    // Shutdown must not hang on open event streams.
    let _open = s.get("/v1/events", Some(ADMIN)).await;
    s.shutdown().await;
}

#[tokio::test]
async fn health_and_ready_need_no_auth() {
    let s = Server::with_tokens().await;
    assert_eq!(s.get("/health", None).await.status(), StatusCode::OK);
    assert_eq!(s.get("/ready", None).await.status(), StatusCode::OK);
    s.ctx.ready.store(false, Relaxed);
    assert_eq!(s.get("/ready", None).await.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(s.get("/health", None).await.status(), StatusCode::OK, "alive while not ready");
    s.ctx.ready.store(true, Relaxed);
    assert_eq!(s.get("/ready", None).await.status(), StatusCode::OK);
    s.shutdown().await;
}

#[tokio::test]
async fn a_lagging_event_subscriber_is_told_how_many_it_missed() {
    let s = Server::open().await;
    let mut stream = s.get("/v1/events?namespace=lag", None).await;
    assert_eq!(stream.status(), StatusCode::OK);
    // The store keeps 8192 events per subscriber; write far more before the
    // stream gets a chance to drain (the test runtime has one thread).
    for i in 0..20_000u32 {
        let key = Bytes::from(format!("k{i}"));
        s.ctx.store.put("lag", key, Bytes::from_static(b"v"), Default::default()).await.unwrap();
    }
    let seen = read_events(&mut stream, |v| v.get("missed").is_some()).await;
    let missed = seen.last().unwrap()["missed"].as_u64().unwrap();
    assert!(missed >= 20_000 - 8192, "missed {missed}");
    drop(stream);
    s.shutdown().await;
}

/// Issue 13: `?durable=true` on a store with nothing durable below memory
/// answers `"durable": false`; a block no tier can hold gets 507.
#[tokio::test]
async fn durable_tells_the_truth_and_no_tier_means_507() {
    let s = Server::start(Store::memory_only(1 << 24), Auth::default()).await;
    let h = hashes(1);
    let r = s.put("d", &h[0], block(1), "?durable=true", None).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["stored"].clone(), v["durable"].clone()), (Value::Bool(true), Value::Bool(false)), "{v}");
    s.shutdown().await;

    let s = Server::start(Store::memory_only(200), Auth::default()).await;
    let (status, err) = error_of(s.put("d", &h[0], block(1), "", None).await).await;
    assert_eq!((status, err["code"].as_str()), (StatusCode::INSUFFICIENT_STORAGE, Some("insufficient_storage")));
    assert_eq!(s.get(&format!("/v1/blocks/d/{}", h[0]), None).await.status(), StatusCode::NOT_FOUND);
    s.shutdown().await;
}

/// Issue 13: a PUT without a valid token is refused before its body is
/// read: a client announcing 100 MiB and sending none gets its 401 at once.
#[tokio::test]
async fn put_checks_the_token_before_reading_the_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Server::with_tokens().await;
    let addr = s.base.trim_start_matches("http://").to_string();
    for auth in ["", "Authorization: Bearer wrong\r\n"] {
        let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "PUT /v1/blocks/a/{} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\n\r\n",
            hashes(1)[0],
            100 << 20
        );
        c.write_all(head.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(3), c.read(&mut buf))
            .await
            .expect("no answer until the body arrives: the body was read before the token was checked")
            .unwrap();
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    }
    s.shutdown().await;
}

/// Issue 13: a metrics-only token reads `/metrics` and nothing else.
#[tokio::test]
async fn metrics_token_reads_metrics_and_nothing_else() {
    let auth = Auth::from_plain(Some(ADMIN), &[("a", TOKEN_A)]).with_metrics_plain("scrape");
    let s = Server::start(Store::memory_only(1 << 24), auth).await;
    assert_eq!(s.get("/metrics", Some("scrape")).await.status(), StatusCode::OK);
    assert_eq!(s.get("/metrics", Some(ADMIN)).await.status(), StatusCode::OK);
    assert_eq!(s.get("/metrics", Some(TOKEN_A)).await.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.get("/stats", Some("scrape")).await.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.get("/cache/list", Some("scrape")).await.status(), StatusCode::FORBIDDEN);
    let h = hashes(1);
    assert_eq!(s.put("a", &h[0], block(1), "", Some("scrape")).await.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.get(&format!("/v1/blocks/a/{}", h[0]), Some("scrape")).await.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.get("/v1/events", Some("scrape")).await.status(), StatusCode::FORBIDDEN);
    s.shutdown().await;
}

#[tokio::test]
async fn tenant_views_show_only_their_namespace() {
    let s = Server::with_tokens().await;
    for (i, key) in hashes(3).iter().enumerate() {
        assert_eq!(s.put("b", key, block(8), "", Some(TOKEN_B)).await.status(), StatusCode::CREATED, "{i}");
    }
    let key = &hashes(1)[0];
    assert_eq!(s.put("a", key, block(4), "", Some(TOKEN_A)).await.status(), StatusCode::CREATED);
    let r = s.get("/stats", Some(TOKEN_A)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["namespace"], "a");
    assert_eq!(v["keys"], 1);
    assert_eq!(v["tiers"][0]["entries"], 1, "{v}");
    // Nothing server-wide: no store totals, protocol counters or uptime.
    let text = v.to_string();
    for global in ["store", "protocols", "uptime_seconds", "hits", "evictions"] {
        assert!(!text.contains(global), "tenant /stats shows {global}: {text}");
    }
    let admin: Value = s.get("/stats", Some(ADMIN)).await.json().await.unwrap();
    assert_eq!(admin["store"]["tiers"][0]["entries"], 4);
}

/// Issue 13, point 6: an object in a shared S3 bucket (a real `s3s-fs`)
/// that fails verification is a miss on this node, counted in `/metrics`,
/// and stays in the bucket byte for byte for the nodes that can read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_verify_failure_is_a_counted_miss_that_keeps_the_object() {
    let Some(s3) = common::start_s3() else { return };
    let cfg = StoreConfig {
        memory: granary_core::ByteSize::mib(16),
        remote: Some(s3.config("shared")),
        ..Default::default()
    };
    let key = &hashes(1)[0];
    let bystander = &hashes(2)[1];
    // Another node writes both blocks durably to the bucket.
    let writer = Store::open(cfg.clone()).await.unwrap();
    let durable = granary_warehouse::PutOptions { durable: true, ..Default::default() };
    writer.put("a", Bytes::from(key.clone()), block(1), durable.clone()).await.unwrap();
    writer.put("a", Bytes::from(bystander.clone()), block(2), durable).await.unwrap();
    let objects: Vec<_> = common::files_under(&s3.bucket_dir().join("shared"))
        .into_iter()
        .filter(|p| !p.to_string_lossy().contains(".s3s"))
        .collect();
    assert_eq!(objects.len(), 2, "{objects:?}");

    // This node starts cold: its reads go to the bucket.
    let s = Server::start(Store::open(cfg).await.unwrap(), Auth::from_plain(Some(ADMIN), &[("a", TOKEN_A)])).await;
    let counter = "granary_warehouse_remote_verify_failed_total";
    let before = s.get("/metrics", Some(ADMIN)).await.text().await.unwrap();
    assert_eq!(metric(&before, counter), 0.0);
    // Damage the victim's value: flip its last byte in the bucket's file.
    let victim = objects
        .iter()
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name == hex::encode(&blake3::hash(key.as_bytes()).as_bytes()[..16])
        })
        .expect("the victim's object");
    let mut bytes = std::fs::read(victim).unwrap();
    *bytes.last_mut().unwrap() ^= 0x01;
    std::fs::write(victim, &bytes).unwrap();

    let r = s.get(&format!("/v1/blocks/a/{key}"), Some(TOKEN_A)).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND, "a block that fails verification was served");
    let r = s.get(&format!("/v1/blocks/a/{bystander}"), Some(TOKEN_A)).await;
    assert_eq!((r.status(), r.bytes().await.unwrap()), (StatusCode::OK, block(2)));
    let after = s.get("/metrics", Some(ADMIN)).await.text().await.unwrap();
    assert_eq!(metric(&after, counter), 1.0, "one failed verification, counted once");
    assert_eq!(metric(&after, r#"granary_warehouse_corrupt_dropped_total{tier="remote"}"#), 0.0);
    assert_eq!(std::fs::read(victim).unwrap(), bytes, "the shared object was deleted or changed");
    s.shutdown().await;
}

/// Issue 13, point 4: past `max_connections` an HTTP client gets a 503
/// with the usual JSON error and a closed connection; the clients inside
/// the cap are still served, and a slot frees when one of them leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_get_503() {
    use granary_warehouse::config::ServeLimits;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = ServeLimits { max_connections: 2, ..Default::default() };
    let ctx = ServerCtx::new(Store::memory_only(1 << 20), Auth::default()).with_limits(limits);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ctx = Arc::new(ctx);
    tokio::spawn(granary_warehouse::http::serve(listener, ctx.clone(), std::future::pending()));
    let get_health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(get_health).await.unwrap();
        let mut buf = [0u8; 12];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
        held.push(c);
    }
    let mut extra = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), extra.read_to_end(&mut answer)).await.unwrap().unwrap();
    let answer = String::from_utf8(answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "too_many_connections");
    // The held clients keep working; once one leaves, a new one gets in.
    let mut first = held.remove(0);
    first.write_all(get_health).await.unwrap();
    // What is left of the first answer, then the second one.
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while got.windows(12).filter(|w| w == b"HTTP/1.1 200").count() < 1 {
        let n = tokio::time::timeout(Duration::from_secs(5), first.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "the held connection was closed");
        got.extend_from_slice(&buf[..n]);
    }
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ctx.http.connections_open.load(Relaxed) > 1 {
        assert!(std::time::Instant::now() < deadline, "the closed connection still counts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = reqwest::get(format!("http://{addr}/health")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

/// Issue 13, point 4: a client that trickles its request headers and never
/// ends them (slowloris), and one that connects and sends nothing, are
/// closed once `header_timeout_secs` passes, giving their slots back; while
/// they hold both slots a third client is refused, and afterwards served.
/// Trickling does not extend the time: it counts to the end of the headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_cut_off_and_give_their_slot_back() {
    use granary_warehouse::config::ServeLimits;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = ServeLimits { max_connections: 2, header_timeout_secs: 2, ..Default::default() };
    let ctx = Arc::new(ServerCtx::new(Store::memory_only(1 << 20), Auth::default()).with_limits(limits));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(granary_warehouse::http::serve(listener, ctx.clone(), std::future::pending()));

    let started = std::time::Instant::now();
    let slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut slow_rx, mut slow_tx) = slow.into_split();
    slow_tx.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
    let trickling = tokio::spawn(async move {
        let mut sent = 0;
        for i in 0..100 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if slow_tx.write_all(format!("x-{i}: y\r\n").as_bytes()).await.is_err() {
                break;
            }
            sent += 1;
        }
        sent
    });
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ctx.http.connections_open.load(Relaxed) < 2 {
        assert!(std::time::Instant::now() < deadline, "the two clients were not both accepted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = reqwest::get(format!("http://{addr}/health")).await;
    assert!(r.map_or(true, |r| r.status() == StatusCode::SERVICE_UNAVAILABLE), "a third client got in");

    // Both are closed after the timeout, without an answer to either.
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), idle.read_to_end(&mut got)).await.unwrap().ok();
    assert!(!String::from_utf8_lossy(&got).contains(" 200 "), "{}", String::from_utf8_lossy(&got));
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), slow_rx.read_to_end(&mut got)).await.unwrap().ok();
    assert!(!String::from_utf8_lossy(&got).contains(" 200 "), "{}", String::from_utf8_lossy(&got));
    let closed_after = started.elapsed();
    assert!(closed_after >= Duration::from_millis(1900), "closed before the timeout: {closed_after:?}");
    let sent = trickling.await.unwrap();
    assert!(sent >= 5, "the trickle was cut after {sent} lines, before the timeout");
    assert!(sent < 100, "the trickling client was never cut off");
    eprintln!("slowloris and idle clients closed after {closed_after:?} ({sent} header lines trickled)");

    // Their slots are free again: a well-behaved client is served.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ctx.http.connections_open.load(Relaxed) > 0 {
        assert!(std::time::Instant::now() < deadline, "the closed connections still count");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = reqwest::get(format!("http://{addr}/health")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}
