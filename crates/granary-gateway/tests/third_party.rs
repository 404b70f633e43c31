//! The gateway in front of engines that are not Granary's (issue 14, point
//! 3): KV-aware routing from the model's own tokenizer (the default model's
//! GGUF), vLLM's KV events from a publisher that speaks vLLM's wire format
//! (Python, pyzmq + msgpack: `python/vllm_kv_publisher.py`), and a real
//! third-party server, llama-cpp-python's `llama_cpp.server`, serving the
//! official `openai` client through the gateway with keys, limits and audit.
//!
//! They need the repository's `.venv` (pyzmq, msgpack, llama-cpp-python's
//! server) and the default model, which `scripts/test.sh` installs; without
//! them the tests say so and pass, unless `GRANARY_REQUIRE_EXTERNAL=1`.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fake_upstream, model_gguf, need, third_party, venv_python, Fake, Gw};
use granary_gateway::config::GatewayConfig;
use granary_gateway::identity::{AuditRecord, Identity};
use granary_gateway::limits::Limiter;
use granary_gateway::Gateway;
use granary_tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

/// A long conversation opening; each differs from the others in its first
/// block (the system message comes first in the chat template).
fn messages(i: usize) -> Value {
    json!([
        {"role": "system", "content": format!(
            "Conversation {i}. You are a careful assistant for a grain cooperative. Summarise the harvest \
             report that follows, listing each field, its yield in tonnes, its moisture content and \
             whether it is ready for storage in the granary before the autumn rains arrive.")},
        {"role": "user", "content": "North field: 41 t at 14% moisture."}
    ])
}

/// Sends conversation `i` `n` times; returns the hits each upstream got.
async fn send(g: &Gw, key: &str, ups: &[&Fake], i: usize, n: usize) -> Vec<usize> {
    let before: Vec<usize> = ups.iter().map(|u| *u.hits.lock()).collect();
    let body = json!({"model": "m", "messages": messages(i), "max_tokens": 4});
    for _ in 0..n {
        let r = g.http.post(format!("{}/v1/chat/completions", g.base)).bearer_auth(key).json(&body);
        assert_eq!(r.send().await.unwrap().status(), 200);
    }
    ups.iter().zip(before).map(|(u, b)| *u.hits.lock() - b).collect()
}

/// Issue 14, point 3: with the model's tokenizer, the approximate index runs
/// through the real proxy path: a prompt goes back to where it went before,
/// while without a tokenizer the same prompts are spread by load.
#[tokio::test]
async fn issue_14_approximate_kv_routing_tokenizes_with_the_models_tokenizer() {
    let Some(gguf) = need(model_gguf(), "the default model's GGUF") else { return };
    let (a, b) = (fake_upstream().await, fake_upstream().await);
    let upstreams = vec![third_party("a", a.addr, Some(&gguf)), third_party("b", b.addr, Some(&gguf))];
    let g = Gw::start(GatewayConfig { upstreams, ..Default::default() }).await;
    let key = g.key("acme", json!({})).await;
    let got = send(&g, &key, &[&a, &b], 0, 6).await;
    assert!(got == [6, 0] || got == [0, 6], "one prompt stays where its blocks are: {got:?}");
    // Conversations that differ from their first block share nothing with
    // it: ties rotate, both upstreams get some.
    let mut spread = [0, 0];
    for i in 1..=6 {
        let got = send(&g, &key, &[&a, &b], i, 1).await;
        spread = [spread[0] + got[0], spread[1] + got[1]];
    }
    assert!(spread[0] > 0 && spread[1] > 0, "{spread:?}");
    let m = g.metrics().await;
    let line = m.lines().find(|l| l.starts_with("granary_gateway_routed_blocks_total{")).expect(&m);
    assert!(!line.ends_with(" 0"), "the prompts were cut into blocks: {line}");

    // The control: no tokenizer, no blocks, and the same prompt alternates.
    let (c, d) = (fake_upstream().await, fake_upstream().await);
    let upstreams = vec![third_party("c", c.addr, None), third_party("d", d.addr, None)];
    let g = Gw::start(GatewayConfig { upstreams, ..Default::default() }).await;
    let key = g.key("acme", json!({})).await;
    assert_eq!(send(&g, &key, &[&c, &d], 0, 6).await, [3, 3]);
}

#[tokio::test]
async fn an_unreadable_tokenizer_stops_the_gateway_at_start() {
    let mut cfg = GatewayConfig::default();
    cfg.gateway.database = "sqlite::memory:".into();
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("tokenizer.json");
    std::fs::write(&bad, "{not a tokenizer").unwrap();
    cfg.upstreams = vec![third_party("a", "127.0.0.1:9".parse().unwrap(), Some(&bad))];
    let identity = Identity::open(&cfg.gateway.database, cfg.gateway.identity_options()).await.unwrap();
    let err = Gateway::new(&cfg, identity, Limiter::in_process()).err().expect("a bad tokenizer is an error");
    assert!(err.to_string().starts_with("upstream a: tokenizer "), "{err}");
}

/// A `vllm_kv_publisher.py` process (killed when dropped).
struct Publisher {
    _child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    port: u16,
}

impl Publisher {
    async fn start(py: &PathBuf, int_hashes: bool) -> Publisher {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/vllm_kv_publisher.py");
        let mut cmd = tokio::process::Command::new(py);
        cmd.arg(script).args(["--topic", "kv@test"]).stdin(Stdio::piped()).stdout(Stdio::piped()).kill_on_drop(true);
        if int_hashes {
            cmd.arg("--int-hashes");
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut p = Publisher { _child: child, stdin, stdout, port: 0 };
        let line = p.line().await;
        p.port = line.strip_prefix("port ").and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{line}"));
        p
    }

    async fn line(&mut self) -> String {
        let next = tokio::time::timeout(Duration::from_secs(30), self.stdout.next_line()).await;
        next.expect("the publisher answers").unwrap().expect("the publisher is running")
    }

    /// Sends a command; the publisher's answer.
    async fn send(&mut self, cmd: Value) -> String {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
        self.line().await
    }
}

/// Waits until the index holds `n` blocks for `upstream`.
async fn index_holds(g: &Gw, upstream: usize, n: usize) {
    let t0 = Instant::now();
    while g.gw.upstreams.index.blocks(upstream) != n {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "index holds {} blocks, not {n}",
            g.gw.upstreams.index.blocks(upstream)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Issue 14, point 3: vLLM's own KV events (ZeroMQ, msgpack `KVEventBatch`
/// with `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, byte and integer
/// block hashes) make routing precise between two vLLM-like upstreams.
#[tokio::test]
async fn issue_14_vllm_kv_events_drive_precise_routing() {
    let Some(gguf) = need(model_gguf(), "the default model's GGUF") else { return };
    let Some(py) = need(venv_python("zmq, msgpack"), ".venv with pyzmq and msgpack") else { return };
    let (a, b) = (fake_upstream().await, fake_upstream().await);
    let (mut pa, mut pb) = (Publisher::start(&py, false).await, Publisher::start(&py, true).await);
    let mut cfg = GatewayConfig::default();
    for (name, fake, publisher) in [("a", &a, &pa), ("b", &b, &pb)] {
        let mut u = third_party(name, fake.addr, Some(&gguf));
        u.kv_events_zmq = Some(format!("tcp://127.0.0.1:{}", publisher.port));
        u.kv_events_topic = "kv@test".into();
        cfg.upstreams.push(u);
    }
    let g = Gw::start(cfg).await;
    assert_eq!((pa.line().await, pb.line().await), ("subscribed".into(), "subscribed".into()));
    let key = g.key("acme", json!({})).await;
    let (ia, ib) = (g.gw.upstreams.by_name("a").unwrap().id, g.gw.upstreams.by_name("b").unwrap().id);

    // The prompt's tokens as vLLM would see them: the chat template applied.
    let tok = Tokenizer::from_gguf_path(&gguf).unwrap();
    let tokens = |i: usize| {
        let m = messages(i);
        let chat: Vec<ChatMessage> = m
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        tok.encode_chat(&chat, true).unwrap()
    };
    let t0 = tokens(0);
    let full = t0.len() / 16;
    assert!(full >= 4, "{} tokens", t0.len());

    // b holds the prompt: every request goes there, though ties would rotate.
    assert_eq!(pb.send(json!({"store": t0, "block_size": 16})).await, "sent 0");
    index_holds(&g, ib, full).await;
    assert_eq!(send(&g, &key, &[&a, &b], 0, 4).await, [0, 4]);
    let m = g.metrics().await;
    assert!(
        m.contains(&format!(r#"granary_gateway_routed_hit_blocks_total{{policy="kv_aware"}} {}"#, 4 * full)),
        "{m}"
    );

    // b loses all but the first block, a gets the whole prompt: a wins.
    assert_eq!(pb.send(json!({"remove": t0, "block_size": 16, "from_block": 1})).await, "sent 1");
    assert_eq!(pa.send(json!({"store": t0, "block_size": 16})).await, "sent 0");
    index_holds(&g, ib, 1).await;
    index_holds(&g, ia, full).await;
    assert_eq!(send(&g, &key, &[&a, &b], 0, 3).await, [3, 0]);

    // a clears its cache; b restarts (its sequence starts again) with
    // another prompt: what was known of b before is gone.
    assert_eq!(pa.send(json!({"clear": true})).await, "sent 1");
    index_holds(&g, ia, 0).await;
    assert_eq!(pb.send(json!({"restart": true})).await, "restarted");
    let t1 = tokens(1);
    assert_eq!(pb.send(json!({"store": t1, "block_size": 16})).await, "sent 0");
    index_holds(&g, ib, t1.len() / 16).await;
    assert_eq!(send(&g, &key, &[&a, &b], 1, 2).await, [0, 2]);

    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_vllm_kv_events_total{outcome="cleared"} 1"#), "{m}");
    assert!(m.contains(&format!(r#"granary_gateway_vllm_kv_events_total{{outcome="removed"}} {}"#, full - 1)), "{m}");
}

/// A `llama_cpp.server` process (killed when dropped).
struct LlamaServer {
    _child: tokio::process::Child,
    addr: SocketAddr,
}

const LLAMA_KEY_ENV: &str = "GRANARY_TEST_LLAMA_UPSTREAM_KEY";
const LLAMA_KEY: &str = "llama-upstream-secret";

async fn start_llama(py: &PathBuf, gguf: &PathBuf) -> LlamaServer {
    // The server takes a port number, not a listener: a free one is found
    // by binding port 0 and letting it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = tokio::process::Command::new(py)
        .args(["-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--model")
        .arg(gguf)
        .args(["--model_alias", "smollm2-local", "--api_key", LLAMA_KEY, "--n_ctx", "2048"])
        .args(["--n_threads", "1", "--verbose", "False"])
        // The gateway's model discovery must not end a stream (see below).
        .args(["--interrupt_requests", "False"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let http = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        let r = http.get(format!("http://{addr}/v1/models")).bearer_auth(LLAMA_KEY).send().await;
        if r.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "llama_cpp.server did not start");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    LlamaServer { _child: child, addr }
}

/// Issue 14, point 3: a real third-party server, llama-cpp-python's
/// `llama_cpp.server`, behind the gateway: the official `openai` client
/// gets chat and streamed answers through it with a gateway key, a limited
/// key gets 429, and every request is audited with its tokens. The server
/// demands its own API key (the gateway sends it, never the client's),
/// knows the model by another name (`model_map`), has no `/health` (its
/// FastAPI `/openapi.json` is the probe), and the prompt is tokenized with
/// the same GGUF for KV-aware routing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_llama_cpp_server_behind_the_gateway_serves_the_openai_client() {
    let Some(gguf) = need(model_gguf(), "the default model's GGUF") else { return };
    let Some(py) = need(venv_python("llama_cpp.server.app"), ".venv with llama-cpp-python[server]") else { return };
    let openai_ok = Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    let Some(()) = need(openai_ok.then_some(()), "the openai Python client") else { return };
    let llama = start_llama(&py, &gguf).await;
    std::env::set_var(LLAMA_KEY_ENV, LLAMA_KEY);
    let mut cfg = GatewayConfig::default();
    // Any request that takes the server's model lock (`/v1/models` does)
    // ends a running stream early (`interrupt_requests`, on by default;
    // docs/gateway.md), so the probe is `/openapi.json`, which answers at
    // once and never touches the model, and model discovery runs against
    // a server started with that setting off. Probes come every 50 ms, so
    // one that ended streams would fail the streamed check every time.
    cfg.gateway.health.interval_ms = 50;
    let mut u = third_party("llama", llama.addr, Some(&gguf));
    u.models = vec![];
    u.health_path = "/openapi.json".into();
    u.api_key_env = Some(LLAMA_KEY_ENV.into());
    u.model_map = [("smollm2".to_string(), "smollm2-local".to_string())].into();
    cfg.upstreams.push(u);
    let g = Gw::start(cfg).await;
    let key = g.key("acme", json!({})).await;
    let limited = g.key("acme", json!({"limits": {"requests_per_minute": 1}})).await;

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/test_gateway_openai.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .env("OPENAI_BASE_URL", format!("{}/v1", g.base))
        .env("OPENAI_API_KEY", &key)
        .env("GRANARY_LIMITED_KEY", &limited)
        .env("GRANARY_TEST_TIMEOUT", "120")
        .output()
        .await
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    for check in ["check_chat", "check_stream", "check_stream_without_usage", "check_bad_key", "check_rate_limit"] {
        assert!(text.contains(&format!("ok   {check}")), "{check}: {text}");
    }

    let audit = g.audit().await;
    let served: Vec<&AuditRecord> = audit.iter().filter(|r| r.status == 200).collect();
    assert!(served.len() >= 4, "{audit:?}");
    for r in &served {
        assert_eq!((r.upstream.as_deref(), r.model.as_deref()), (Some("llama"), Some("smollm2")), "{r:?}");
        assert!(r.prompt_tokens > 0 && r.completion_tokens > 0, "{r:?}");
        assert_eq!(r.tenant.as_deref(), Some("acme"));
    }
    assert!(served.iter().any(|r| r.stream), "the streamed answers are audited too");
    assert_eq!(audit.iter().filter(|r| r.status == 429).count(), 1, "{audit:?}");
    // The bad key is counted in the metrics, not audited (issue 40).
    assert_eq!(audit.iter().filter(|r| r.status == 401).count(), 0, "{audit:?}");
    let m = g.metrics().await;
    assert!(m.contains(r#"status="401"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_upstream_attempts_total{upstream="llama",outcome="ok"}"#), "{m}");
    assert!(!m.contains(r#"outcome="status_4xx""#), "the upstream never refused the gateway's key: {m}");
}

/// An upstream that streams `parts` as chat chunks, several tokens each,
/// and never a usage chunk, whatever `stream_options` asks.
async fn start_packing(parts: &'static [&'static str]) -> SocketAddr {
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move || async move {
            let mut body = String::new();
            for p in parts {
                let chunk = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": null}]});
                body.push_str(&format!("data: {chunk}\n\n"));
            }
            body.push_str("data: [DONE]\n\n");
            ([("content-type", "text/event-stream")], body)
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// Issue 40, point 4: a third-party stream without a usage chunk was
/// billed one token per chunk, while an upstream may pack several tokens
/// into one. With the upstream's tokenizer configured, the relayed text is
/// tokenized: the audit record and the usage chunk the client asked for
/// carry the text's token count (before: the chunk count, 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_usage_is_billed_by_tokenizing_the_relayed_text() {
    let Some(gguf) = need(model_gguf(), "the default model's GGUF") else { return };
    const PARTS: &[&str] = &["The capital of", " France is Paris,", " a city of light", " and of bread."];
    let addr = start_packing(PARTS).await;
    let g =
        Gw::start(GatewayConfig { upstreams: vec![third_party("packing", addr, Some(&gguf))], ..Default::default() })
            .await;
    let key = g.key("acme", json!({})).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,
        "stream_options": {"include_usage": true}});
    let r = g.http.post(format!("{}/v1/chat/completions", g.base)).bearer_auth(&key).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let tok = Tokenizer::from_gguf_path(&gguf).unwrap();
    let want = tok.encode(&PARTS.concat(), false).unwrap().len() as u64;
    assert!(want > PARTS.len() as u64, "the test needs chunks of several tokens: {want}");
    let usage: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|v| v["usage"].is_object())
        .collect();
    assert_eq!(usage.len(), 1, "one usage chunk for the client that asked: {text}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], want, "{}", usage[0]);
    let rec = loop {
        if let Some(r) = g.audit().await.into_iter().find(|r| r.stream) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!((rec.status, rec.completion_tokens), (200, want), "{rec:?}");
}
