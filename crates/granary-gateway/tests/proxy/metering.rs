//! Metering as tokens stream: a client hanging up is audited as 499 with
//! the tokens produced so far (issue 14, point 1).

use super::*;

/// What a dripping upstream did: chunks written, and whether its response
/// stream was dropped (its connection closed, or the stream ran out).
struct Drip {
    addr: SocketAddr,
    sent: Arc<AtomicUsize>,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

struct SetOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// An upstream that streams `total` one-token chunks, one every `every`,
/// then the usage chunk.
async fn start_drip(total: usize, every: Duration) -> Drip {
    let sent = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s2, c2) = (sent.clone(), closed.clone());
    let generate = move || {
        let (sent, closed) = (s2.clone(), c2.clone());
        async move {
            let stream = async_stream::stream! {
                let _guard = SetOnDrop(closed);
                for i in 0..total {
                    tokio::time::sleep(every).await;
                    sent.fetch_add(1, Ordering::SeqCst);
                    yield Ok::<_, std::io::Error>(format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": format!("t{i} ")}}]})));
                }
                yield Ok(format!("data: {}\n\n", json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": total, "total_tokens": total + 5}})));
                yield Ok("data: [DONE]\n\n".to_string());
            };
            Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
        }
    };
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { Json(json!({"object": "list", "data": [{"id": "m"}]})) }))
        .route("/v1/chat/completions", post(generate));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    Drip { addr, sent, closed }
}

/// Polls the audit log until a record matches.
async fn audited(
    g: &Gw,
    what: impl Fn(&granary_gateway::identity::AuditRecord) -> bool,
) -> granary_gateway::identity::AuditRecord {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(r) = g.audit().await.into_iter().find(|r| what(r)) {
            return r;
        }
        assert!(Instant::now() < deadline, "no such audit record: {:?}", g.audit().await);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Issue 14, point 1: a client that hangs up after 12 chunks of a
/// 2000-token stream closes the upstream request at once, and is audited
/// with status 499 and the tokens produced so far (counted from chunks),
/// which are charged to its token limit.
#[tokio::test]
async fn issue_14_a_client_hanging_up_mid_stream_is_metered_as_499_with_the_tokens_so_far() {
    let drip = start_drip(2000, Duration::from_millis(5)).await;
    let g = Gw::start(&named(&[("drip", drip.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let resp = g.chat(&key, chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    while text.matches("data: ").count() < 12 {
        text.push_str(&String::from_utf8_lossy(&stream.next().await.unwrap().unwrap()));
    }
    let hung_up = Instant::now();
    drop(stream);
    let deadline = hung_up + Duration::from_secs(3);
    while !drip.closed.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the upstream request is still open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sent = drip.sent.load(Ordering::SeqCst);
    assert!(sent < 500, "the upstream stopped soon after the hang-up: {sent} chunks sent");
    let rec = audited(&g, |r| r.stream).await;
    assert_eq!(rec.status, 499, "{rec:?}");
    assert_eq!(rec.error_code.as_deref(), Some("client_closed_request"));
    assert!(
        (12..=sent as u64).contains(&rec.completion_tokens),
        "the tokens relayed so far, not 2000: {} (upstream sent {sent})",
        rec.completion_tokens
    );
    assert!(rec.prompt_tokens > 0, "the prompt is charged too (estimated)");
    let m = g.metrics().await;
    assert!(m.contains(r#"inference_requests_total{tenant="acme",model="m",status="499"} 1"#), "{m}");

    // A whole stream is still metered by its usage chunk.
    let drip = start_drip(30, Duration::ZERO).await;
    let g = Gw::start(&named(&[("drip", drip.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let text = g.chat(&key, chat_body(true)).await.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let rec = audited(&g, |r| r.stream).await;
    assert_eq!((rec.status, rec.prompt_tokens, rec.completion_tokens), (200, 5, 30), "{rec:?}");
}

/// A client that gives up waiting for a whole answer is audited as 499, and
/// the upstream request is dropped with it.
#[tokio::test]
async fn a_client_giving_up_on_a_whole_answer_is_audited_as_499() {
    let up = start_upstream_with("slow", Mode::Ok, &["m"], Duration::from_secs(30)).await;
    let g = Gw::start(&named(&[("slow", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let r = g
        .http
        .post(format!("{}/v1/chat/completions", g.base))
        .bearer_auth(&key)
        .json(&chat_body(false))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(r.is_err(), "the client timed out");
    let rec = audited(&g, |r| r.status == 499).await;
    assert_eq!(rec.error_code.as_deref(), Some("client_closed_request"));
    assert_eq!(rec.completion_tokens, 0);
    // The request reached the engine, which computed its prompt: charged.
    assert!(rec.prompt_tokens > 0, "the prompt is charged: {rec:?}");
}

/// Issue 40, point 4: a client that hangs up on a stream before its first
/// token (during prefill) is charged for the prompt the engine computed,
/// as one that hangs up mid-stream is; before, it was charged nothing.
#[tokio::test]
async fn a_client_hanging_up_during_prefill_is_charged_for_the_prompt() {
    let drip = start_drip(5, Duration::from_secs(2)).await;
    let g = Gw::start(&named(&[("drip", drip.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let r = g
        .http
        .post(format!("{}/v1/chat/completions", g.base))
        .bearer_auth(&key)
        .json(&chat_body(true))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    // The client library may see the headers before giving up; either
    // way it closes the connection by dropping what it has.
    drop(r);
    let rec = audited(&g, |r| r.status == 499).await;
    assert_eq!(rec.error_code.as_deref(), Some("client_closed_request"));
    assert_eq!(rec.completion_tokens, 0, "{rec:?}");
    assert!(rec.prompt_tokens > 0, "the prompt is charged: {rec:?}");
}
