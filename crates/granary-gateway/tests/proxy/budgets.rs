//! Rate-limit headers, token reservations and durable budgets (issue 14,
//! points 1 and 2).

use super::*;

/// Issue 14, point 1: responses and 429s carry OpenAI's
/// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers.
#[tokio::test]
async fn issue_14_responses_carry_openai_rate_limit_headers() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({"limits": {"requests_per_minute": 2, "tokens_per_minute": 1000}})).await;
    let header = |r: &reqwest::Response, name: &str| {
        r.headers().get(name).map(|v| v.to_str().unwrap().to_string()).unwrap_or_else(|| panic!("no {name}"))
    };
    let is_duration = |s: &str| {
        let n = s.trim_end_matches("ms").trim_end_matches('s');
        s.ends_with('s') && n.split('m').all(|p| p.parse::<f64>().is_ok())
    };
    // Admission reserves the worst case (prompt estimate, ~4 bytes a token,
    // plus max_tokens) in the token window; the answer's 9 real tokens
    // replace it once the request is recorded.
    let mut body = chat_body(false);
    body["max_tokens"] = json!(10);
    let reserved = serde_json::to_vec(&body).unwrap().len() as u64 / 4 + 10;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-limit-requests"), "2");
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), "1");
    assert_eq!(header(&r, "x-ratelimit-limit-tokens"), "1000");
    assert_eq!(header(&r, "x-ratelimit-remaining-tokens"), (1000 - reserved).to_string());
    assert!(is_duration(&header(&r, "x-ratelimit-reset-requests")), "{}", header(&r, "x-ratelimit-reset-requests"));
    assert!(is_duration(&header(&r, "x-ratelimit-reset-tokens")));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), "0");
    // The rate drains meanwhile (1000 a minute: ~1.7 tokens per 100 ms).
    let remaining: u64 = header(&r, "x-ratelimit-remaining-tokens").parse().unwrap();
    assert!((1000 - 9 - reserved..=1000 - 9 - reserved + 5).contains(&remaining), "{remaining}");
    let r = g.chat(&key, chat_body(false)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), "0");
    assert_eq!(header(&r, "x-ratelimit-limit-requests"), "2");
    assert!(r.headers().contains_key("retry-after"));
    // A key without limits gets none of these headers.
    let free = g.key("acme", json!({})).await;
    let r = g.chat(&free, chat_body(false)).await;
    assert!(!r.headers().contains_key("x-ratelimit-limit-requests"));
}

/// Issue 14, point 1: the worst case counts every completion a request may
/// generate: `n` choices reserve `n` times `max_tokens`, and a request whose
/// worst case exceeds the budget is refused at admission.
#[tokio::test]
async fn issue_14_the_reservation_counts_every_choice() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({"limits": {"tokens_per_minute": 1000}})).await;
    let mut body = chat_body(false);
    body["max_tokens"] = json!(10);
    body["n"] = json!(3);
    let reserved = serde_json::to_vec(&body).unwrap().len() as u64 / 4 + 3 * 10;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(r.status(), 200);
    let remaining = r.headers()["x-ratelimit-remaining-tokens"].to_str().unwrap().to_string();
    assert_eq!(remaining, (1000 - reserved).to_string());
    // 200 choices of 10 tokens cannot fit a budget of 1000.
    body["n"] = json!(200);
    let r = g.chat(&key, body).await;
    assert_eq!(r.status(), 429);
}

/// An upstream that answers after `delay` with usage `prompt` + the
/// request's `max_tokens` (a request that uses its whole allowance).
pub(super) async fn start_spender(prompt: u64, delay: Duration) -> SocketAddr {
    let list = vec![json!({"id": "m", "object": "model"})];
    let app = Router::new()
        .route("/v1/models", get(move || async move { Json(json!({"object": "list", "data": list})) }))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/chat/completions",
            post(move |Json(body): Json<Value>| async move {
                tokio::time::sleep(delay).await;
                let completion = body["max_tokens"].as_u64().unwrap_or(0);
                Json(json!({
                    "id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
                }))
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// Issue 14, point 1: admission reserves each request's worst case
/// against the token budgets, so 50 concurrent requests against a budget
/// that fits 10 overshoot it by at most one request's reservation; when
/// they end, the unused part of each reservation is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_concurrent_requests_overshoot_a_token_budget_by_at_most_one_reservation() {
    let addr = start_spender(5, Duration::from_millis(300)).await;
    let g = Gw::start(&named(&[("a", addr)]), |_| {}).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100});
    let reservation = serde_json::to_vec(&body).unwrap().len() as u64 / 4 + 100;
    let used_each = 5 + 100;
    assert!(used_each <= reservation);
    let budget = 10 * reservation;
    let key = g.key("acme", json!({"limits": {"tokens_per_day": budget}})).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (http, base, key, body) = (g.http.clone(), g.base.clone(), key.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            http.post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(&body).send().await.unwrap().status()
        }));
    }
    let mut ok = 0u64;
    for t in tasks {
        let status = t.await.unwrap();
        assert!(status == 200 || status == 429, "{status}");
        ok += u64::from(status == 200);
    }
    let spent = ok * used_each;
    assert!(ok >= 1 && spent <= budget + reservation, "{ok} admitted: {spent} tokens against a budget of {budget}");
    // What the requests did not use of their reservations is released.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(r.status(), 200, "the released tokens admit another request after {ok}");
    let audited: u64 = g.audit().await.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    assert_eq!(audited, (ok + 1) * used_each);
}

/// Issue 14, point 2: day and month budgets are reloaded from the usage
/// rollup at start, so a restarted gateway (fresh in-process counters)
/// still refuses a tenant whose month is spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_a_restart_keeps_the_month_budget_spent() {
    let addr = start_spender(5, Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("gateway.db").display());
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100});
    let key = {
        let g = Gw::start(&named(&[("a", addr)]), |c| c.gateway.database = db.clone()).await;
        let key = g.key("acme", json!({})).await;
        let (s, _) = g
            .admin(reqwest::Method::PATCH, "/admin/v1/tenants/acme", Some(json!({"limits": {"tokens_per_month": 250}})))
            .await;
        assert_eq!(s, StatusCode::OK);
        // 105 tokens each: 0 and 105 are under 250, 210 too; 315 is not.
        for _ in 0..3 {
            assert_eq!(g.chat(&key, body.clone()).await.status(), 200);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(g.chat(&key, body.clone()).await.status(), 429);
        g.identity.flush().await;
        key
    };
    // A new process: the same database, counters starting from nothing.
    let g = Gw::start(&named(&[("a", addr)]), |c| c.gateway.database = db.clone()).await;
    g.gw.restore_budgets().await;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(r.status(), 429, "a restart must not reset the month");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "quota_exceeded", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("tokens_per_month"), "{v}");
}

/// Issue 14, point 2: Redis counters that were lost (here `FLUSHALL`) are
/// rebuilt from the usage rollup within `budget_reload_s`, so a tenant whose
/// month is spent stays refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_lost_redis_counters_are_rebuilt_from_the_rollup() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let spawned = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn();
    /// Stops the server also when an assertion fails.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let Ok(child) = spawned else {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "redis-server is not installed");
        eprintln!("SKIPPED: redis-server is not installed");
        return;
    };
    let _redis_server = KillOnDrop(child);
    let url = format!("redis://127.0.0.1:{port}/");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let limiter = Limiter::redis(&url, granary_gateway::limits::RedisOptions::default()).await.unwrap();
    let addr = start_spender(5, Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("gateway.db").display());
    let g = Gw::start_limited(&named(&[("a", addr)]), true, limiter.clone(), |c| {
        c.gateway.database = db.clone();
        c.gateway.budget_reload_s = 1;
    })
    .await;
    let key = g.key("acme", json!({"limits": {"tokens_per_month": 250}})).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100});
    for _ in 0..3 {
        assert_eq!(g.chat(&key, body.clone()).await.status(), 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(g.chat(&key, body.clone()).await.status(), 429);
    g.identity.flush().await;
    let mut c = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(r.status(), 429, "the month must come back after a flush");
    assert_eq!(limiter.backend_errors(), 0);
}
