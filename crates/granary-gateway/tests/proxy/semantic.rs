//! The semantic cache's mechanics through the real proxy path (issue 14,
//! point 6): which requests it answers, per-tenant thresholds, opt-out,
//! tenant isolation, metrics, and an embedding engine that fails. The
//! embeddings here come from a test fixture (hashed word counts, so that
//! which prompts are "near" is known exactly), not from an engine.

use super::*;

/// Fixture embedder: word counts hashed into 32 dimensions (lowercase,
/// punctuation dropped), so prompts with the same words embed the same.
async fn start_embedder(fail: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let list = vec![json!({"id": "e", "object": "model"})];
    let app = Router::new()
        .route("/v1/models", get(move || async move { Json(json!({"object": "list", "data": list})) }))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/embeddings",
            post(move |Json(body): Json<Value>| {
                let seen = seen.clone();
                async move {
                    seen.fetch_add(1, Ordering::SeqCst);
                    if fail {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "no").into_response();
                    }
                    let mut v = vec![0f32; 32];
                    let text = body["input"].as_str().unwrap_or("").to_lowercase();
                    for w in text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()) {
                        let h = w.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
                        v[(h % 32) as usize] += 1.0;
                    }
                    Json(json!({"object": "list", "model": body["model"],
                        "data": [{"object": "embedding", "index": 0, "embedding": v}]}))
                    .into_response()
                }
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, calls)
}

fn ask(text: &str) -> Value {
    json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]})
}

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers().get(name).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default()
}

#[tokio::test]
async fn issue_14_the_semantic_cache_answers_near_prompts_per_tenant() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let (emb, calls) = start_embedder(false).await;
    let g = Gw::start(&named(&[("a", up.addr), ("emb", emb)]), |c| {
        let s = &mut c.gateway.semantic_cache;
        s.enabled = true;
        s.embedding_model = "e".into();
        s.threshold = 0.9;
        s.tenant_thresholds.insert("strict".into(), 1.5);
    })
    .await;
    let acme = g.key("acme", json!({})).await;
    let beta = g.key("beta", json!({})).await;
    let strict = g.key("strict", json!({})).await;
    let hits = || up.hits.load(Ordering::SeqCst);

    let r = g.chat(&acme, ask("What is the capital of France?")).await;
    assert_eq!((r.status(), header(&r, "x-granary-cache")), (StatusCode::OK, "miss".into()));
    assert_eq!(hits(), 1);
    // The same words, other case and punctuation: a semantic hit.
    let r = g.chat(&acme, ask("what is the capital of france")).await;
    assert_eq!(header(&r, "x-granary-cache"), "hit");
    assert_eq!(header(&r, "x-granary-cache-match"), "semantic");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello", "the kept answer: {v}");
    assert_eq!(hits(), 1, "no engine worked");
    // Another question, other fields, another tenant, an opt-out: misses.
    let r = g.chat(&acme, ask("List three prime numbers below twenty")).await;
    assert_eq!(header(&r, "x-granary-cache"), "miss");
    let mut longer = ask("what is the capital of france");
    longer["max_tokens"] = json!(50);
    assert_eq!(header(&g.chat(&acme, longer).await, "x-granary-cache"), "miss", "only the prompt may differ");
    assert_eq!(header(&g.chat(&beta, ask("What is the capital of France?")).await, "x-granary-cache"), "miss");
    let r = g
        .http
        .post(format!("{}/v1/chat/completions", g.base))
        .bearer_auth(&acme)
        .header("cache-control", "no-cache")
        .json(&ask("What is the capital of France?"))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "x-granary-cache"), "miss", "cache-control: no-cache skips the lookup");
    assert_eq!(hits(), 5);
    // A tenant whose threshold is above 1 never uses it (nor embeds).
    let before = calls.load(Ordering::SeqCst);
    for _ in 0..2 {
        let r = g.chat(&strict, ask("What is the capital of France?")).await;
        assert_eq!((r.status(), header(&r, "x-granary-cache")), (StatusCode::OK, String::new()));
    }
    assert_eq!((hits(), calls.load(Ordering::SeqCst)), (7, before));
    // Not deterministic (no temperature 0, no seed): not cached.
    let r = g
        .chat(&acme, json!({"model": "m", "messages": [{"role": "user", "content": "what is the capital of france"}]}))
        .await;
    assert_eq!(header(&r, "x-granary-cache"), "");
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_semantic_cache_total{event="hit"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_semantic_cache_total{event="miss"} 4"#), "{m}");
    let audit = g.audit().await;
    assert_eq!(audit.iter().filter(|r| r.upstream.as_deref() == Some("(cache)")).count(), 1);
}

#[tokio::test]
async fn issue_14_a_failing_embedder_makes_misses_not_errors() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let (emb, calls) = start_embedder(true).await;
    let g = Gw::start(&named(&[("a", up.addr), ("emb", emb)]), |c| {
        c.gateway.semantic_cache.enabled = true;
        c.gateway.semantic_cache.embedding_model = "e".into();
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for _ in 0..2 {
        let r = g.chat(&key, ask("What is the capital of France?")).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(up.hits.load(Ordering::SeqCst), 2);
    assert!(calls.load(Ordering::SeqCst) >= 2);
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_semantic_cache_total{event="error"} 2"#), "{m}");
}
