//! The real `granary` binary with the default model: `granary serve`
//! answers the official `openai` client, publishes KV events, and two engine
//! processes sharing one warehouse process split prefill from decode.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Warehouse;

fn default_model() -> Option<std::path::PathBuf> {
    granary_tokenizer::testing::model_or_skip("engine process test")
}

/// A running `granary engine|serve` and the address it printed.
struct EngineProc {
    child: Child,
    addr: String,
}

impl EngineProc {
    fn start(args: &[&str]) -> EngineProc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_granary"));
        cmd.args(args).args(["--listen", "127.0.0.1:0"]).env("GRANARY_LOG", "warn");
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn granary");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut addr = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("granary {args:?} did not print `ready` in time")
            });
            if let Some(rest) = line.strip_prefix("granary: OpenAI API on http://") {
                addr = rest.split('/').next().map(str::to_string);
            } else if line.trim() == "granary: ready" {
                break;
            }
        }
        EngineProc { child, addr: addr.expect("address line") }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    fn metric(&self, prefix: &str) -> f64 {
        let text = reqwest::blocking::get(self.url("/metrics")).unwrap().text().unwrap();
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for EngineProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn completion(base: &str, prompt: &[u32], max_tokens: usize) -> serde_json::Value {
    let body = serde_json::json!({"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let r = reqwest::blocking::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(300))
        .send()
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().unwrap());
    r.json().unwrap()
}

#[test]
fn serve_answers_the_openai_client_and_publishes_kv_events() {
    if default_model().is_none() {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let serve = EngineProc::start(&["serve", "--data-dir", data.path().to_str().unwrap(), "--block-tokens", "16"]);

    // KV events: subscribe before the requests.
    let mut events = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
        .get(serve.url("/v1/kv/events"))
        .send()
        .unwrap();
    assert_eq!(events.headers()["content-type"], "text/event-stream");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../granary-engine/tests/python/test_openai_api.py");
    let out = Command::new(std::env::var("GRANARY_PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(script)
        .env("OPENAI_BASE_URL", serve.url("/v1"))
        .env("OPENAI_API_KEY", "unused")
        .env("GRANARY_MODEL_ID", "SmolLM2-135M-Instruct")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No module named 'openai'") {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "the openai package is missing");
        eprintln!("skipping the openai client checks: the openai package is not installed");
    } else {
        assert!(out.status.success(), "the openai client checks failed");
    }

    // A prompt of three blocks was stored: the event stream says so.
    let prompt: Vec<u32> = (0..50).map(|i| 600 + i).collect();
    completion(&serve.url(""), &prompt, 1);
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(seen.contains("event: stored") && seen.contains("\"tier\":\"warehouse\"")) {
        assert!(Instant::now() < deadline, "no stored events: {seen}");
        let n = events.read(&mut buf).unwrap();
        assert!(n > 0, "event stream ended: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(seen.contains("\"namespace\":\"default\""), "{seen}");
    // The second time the prompt's KV comes from memory: three full blocks
    // and the partial fourth, all but the last token (computed for the logits).
    let again = completion(&serve.url(""), &prompt, 1);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 49, "{again}");
    assert!(serve.metric("granary_engine_ttft_seconds_count") >= 2.0);

    // SIGTERM with the event stream still open: the stream ends and the
    // process exits cleanly instead of waiting on the subscriber.
    let mut serve = serve;
    common::sigterm(&serve.child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = serve.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "granary serve still running 10 s after SIGTERM with a KV event subscriber");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit after SIGTERM: {status}");
    let mut rest = Vec::new();
    let _ = events.read_to_end(&mut rest);
}

#[test]
fn a_decode_engine_computes_only_the_tail_a_prefill_engine_left() {
    if default_model().is_none() {
        return;
    }
    let wh = Warehouse::start(&[], &[]);
    let resp = format!("resp://{}", wh.resp.as_ref().unwrap());
    let http = format!("http://{}", wh.http.as_ref().unwrap());
    let prefill = EngineProc::start(&["engine", "--role", "prefill", "--warehouse", &resp]);
    let decode = EngineProc::start(&["engine", "--role", "decode", "--warehouse", &http]);

    // 600 tokens: two full blocks of 256 and a tail of 88.
    let prompt: Vec<u32> = (0..600).map(|i| 1000 + (i * 7) % 20000).collect();
    let p = completion(&prefill.url(""), &prompt, 16);
    assert_eq!(p["usage"]["completion_tokens"], 0, "a prefill engine generates nothing: {p}");
    assert_eq!(prefill.metric("granary_engine_prompt_tokens_total{source=\"computed\"}"), 512.0);
    assert_eq!(prefill.metric("granary_engine_kv_block_saves_total{outcome=\"saved\"}"), 2.0);

    let d = completion(&decode.url(""), &prompt, 8);
    assert_eq!(d["usage"]["completion_tokens"], 8, "{d}");
    assert_eq!(d["usage"]["prompt_tokens_details"]["cached_tokens"], 512, "{d}");
    let computed = decode.metric("granary_engine_prompt_tokens_total{source=\"computed\"}");
    let loaded: f64 = ["memory", "disk", "remote"]
        .iter()
        .map(|s| decode.metric(&format!("granary_engine_prompt_tokens_total{{source=\"{s}\"}}")))
        .sum();
    eprintln!("decode engine: computed {computed} prompt tokens, loaded {loaded}");
    assert_eq!(computed, 88.0, "the decode engine should compute only the unaligned tail");
    assert_eq!(loaded, 512.0);
}

/// Tokens generated so far, from the engine's counter.
fn generated(e: &EngineProc) -> f64 {
    e.metric("granary_engine_generated_tokens_total")
}

/// Waits until a request has generated a few tokens since `before`.
fn wait_generating(e: &EngineProc, before: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while generated(e) - before < 5.0 {
        assert!(Instant::now() < deadline, "the request did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// After a client left (`what`): the tokens generated since `before` at
/// that moment and three seconds later, which may differ by a step or so.
fn assert_generation_stopped(e: &EngineProc, before: f64, what: &str) {
    let at_close = generated(e) - before;
    std::thread::sleep(Duration::from_secs(3));
    let later = generated(e) - before;
    eprintln!("{what}: {at_close} tokens when the client left, {later} three seconds later");
    assert!(later <= at_close + 5.0, "{what}: generation went on after the client left: {at_close} -> {later}");
}

#[test]
fn a_client_hanging_up_stops_its_generation() {
    use std::io::Write;
    if default_model().is_none() {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let serve = EngineProc::start(&["serve", "--data-dir", data.path().to_str().unwrap()]);
    // End-of-text tokens banned: only a hang-up ends these before 2,000 tokens.
    let request = |stream: bool| {
        let body = serde_json::json!({
            "model": "SmolLM2-135M-Instruct", "stream": stream, "max_tokens": 2000, "temperature": 1.0, "seed": 3,
            "logit_bias": {"0": -100, "1": -100, "2": -100},
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
        })
        .to_string();
        let mut s = std::net::TcpStream::connect(&serve.addr).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    };

    // Streamed: hang up after 12 chunks.
    let before = generated(&serve);
    let mut s = request(true);
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < 12 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    drop(s);
    assert_generation_stopped(&serve, before, "streamed");

    // Not streamed: hang up while the answer is being generated.
    let before = generated(&serve);
    let s = request(false);
    wait_generating(&serve, before);
    drop(s);
    assert_generation_stopped(&serve, before, "not streamed");
}

/// HTTP/2 (h2c, prior knowledge): a client that resets its stream (the
/// connection stays open) stops the generation it asked for, streamed or
/// not, and the connection goes on serving.
#[test]
fn an_http2_client_resetting_its_stream_stops_its_generation() {
    if default_model().is_none() {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let serve = EngineProc::start(&["serve", "--data-dir", data.path().to_str().unwrap()]);
    // The connection is driven by the runtime's worker thread; the counters
    // are read from this one.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let _in_runtime = rt.enter();
    let addr = serve.addr.clone();
    let mut client = rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.expect("an HTTP/2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    });
    let request = |client: &mut h2::client::SendRequest<bytes::Bytes>, stream: bool, max_tokens: u32| {
        let body = serde_json::json!({
            "model": "SmolLM2-135M-Instruct", "stream": stream, "max_tokens": max_tokens, "temperature": 1.0, "seed": 3,
            "logit_bias": {"0": -100, "1": -100, "2": -100},
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
        })
        .to_string();
        let req = http::Request::post(format!("http://{}/v1/chat/completions", serve.addr))
            .header("content-type", "application/json")
            .body(())
            .unwrap();
        let (resp, mut send) = client.send_request(req, false).unwrap();
        send.send_data(bytes::Bytes::from(body), true).unwrap();
        (resp, send)
    };

    // Streamed: reset after 12 chunks.
    let before = generated(&serve);
    let (resp, send) = request(&mut client, true, 2000);
    let body = rt.block_on(async {
        let resp = resp.await.expect("response headers over HTTP/2");
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut seen = Vec::new();
        while seen.windows(6).filter(|w| w == b"data: ").count() < 12 {
            let chunk = body.data().await.expect("the stream ended early").unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            seen.extend_from_slice(&chunk);
        }
        body
    });
    drop((body, send));
    rt.block_on(tokio::time::sleep(Duration::from_millis(50)));
    assert_generation_stopped(&serve, before, "HTTP/2 streamed, stream reset");

    // Not streamed: reset while the answer is being generated.
    let before = generated(&serve);
    let (resp, send) = request(&mut client, false, 2000);
    wait_generating(&serve, before);
    drop((resp, send));
    rt.block_on(tokio::time::sleep(Duration::from_millis(50)));
    assert_generation_stopped(&serve, before, "HTTP/2 not streamed, stream reset");

    // The same connection still answers.
    let (resp, _send) = request(&mut client, false, 4);
    let status = rt.block_on(async { resp.await.expect("a response on the same connection").status() });
    assert_eq!(status, 200);
}

/// `--device cuda` on a build without CUDA (and an unknown device) stops
/// with status 1 and one line naming the flag, before any model is read:
/// the model path given does not exist.
#[test]
fn an_unavailable_device_is_one_line_naming_the_flag() {
    let cases: &[(&str, &str)] = if cfg!(feature = "cuda") {
        &[("tpu", "expected cpu or cuda[:N]")]
    } else {
        &[("cuda", "no CUDA support"), ("cuda:1", "no CUDA support"), ("tpu", "expected cpu or cuda[:N]")]
    };
    for (device, want) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_granary"))
            .args(["engine", "--device", device, "--model", "/nonexistent/model.gguf"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--device {device}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "--device {device}: {stderr}");
        assert!(lines[0].contains(&format!("--device {device}")) && lines[0].contains(want), "{stderr}");
    }
}
