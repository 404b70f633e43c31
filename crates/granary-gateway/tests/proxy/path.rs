//! The request path end to end: passthrough with the tenant's namespace,
//! streaming, retries, errors, limits, the model list, breakers, the
//! queue, disaggregated pools, metrics, curl and schemathesis.

use super::*;

#[tokio::test]
async fn passes_answers_through_with_the_tenants_namespace_and_audits_them() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.upstreams[0].granary = Some(true)).await;
    let key = g.key("acme", json!({})).await;
    let resp = g
        .http
        .post(format!("{}/v1/chat/completions", g.base))
        .bearer_auth(&key)
        .header("x-granary-namespace", "someone-else")
        .header("x-tenant", "someone-else")
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    assert!(rid.starts_with("req_"), "{rid}");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(up.seen.lock().namespaces, vec!["acme".to_string()], "the namespace comes from the key, not the client");

    let audit = g.audit().await;
    let rec = audit.iter().find(|r| r.request_id == rid).expect("an audit record for the request");
    assert_eq!(rec.tenant.as_deref(), Some("acme"));
    assert_eq!(rec.model.as_deref(), Some("m"));
    assert_eq!(rec.upstream.as_deref(), Some("a"));
    assert_eq!(rec.status, 200);
    assert_eq!((rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens), (7, 2, 4));
    assert!(rec.prompt.is_none(), "no prompt text unless the tenant enables it");
    assert!(rec.ttft_ms.is_some() && rec.latency_ms >= rec.ttft_ms.unwrap());

    let m = g.metrics().await;
    assert!(m.contains(r#"inference_requests_total{tenant="acme",model="m",status="200"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_tokens_total{tenant="acme",model="m",kind="cached"} 4"#), "{m}");
}

#[tokio::test]
async fn streams_are_relayed_as_they_come_and_usage_is_metered() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    for include_usage in [false, true] {
        let mut body = chat_body(true);
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let resp = g.chat(&key, body).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let mut stream = resp.bytes_stream();
        // The first chunk arrives while the upstream still holds the second:
        // nothing is buffered.
        let first = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.expect("first chunk").unwrap();
        assert!(String::from_utf8_lossy(&first.unwrap()).contains("Hel"));
        up.gate.notify_one();
        let mut rest = String::new();
        while let Some(c) = stream.next().await {
            rest.push_str(&String::from_utf8_lossy(&c.unwrap()));
        }
        assert!(rest.contains("lo") && rest.ends_with("data: [DONE]\n\n"), "{rest}");
        assert_eq!(rest.contains("\"usage\""), include_usage, "usage only when asked: {rest}");
    }
    assert!(up.seen.lock().bodies.iter().all(|b| b["stream_options"]["include_usage"] == json!(true)));
    let audit = g.audit().await;
    assert_eq!(audit.len(), 2);
    assert!(audit.iter().all(|r| r.stream && r.completion_tokens == 2 && r.status == 200), "{audit:?}");
}

#[tokio::test]
async fn connect_errors_and_5xx_are_retried_on_other_upstreams() {
    let dead = dead_addr().await;
    let bad = start_upstream("bad", Mode::Fail500, &["m"]).await;
    let good = start_upstream("good", Mode::Ok, &["m"]).await;
    let g = Gw::start_opts(&named(&[("dead", dead), ("bad", bad.addr), ("good", good.addr)]), false, |c| {
        c.gateway.max_attempts = 3;
        c.gateway.breaker.failures = 100;
        for u in &mut c.upstreams {
            u.models = vec!["m".into()];
        }
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for _ in 0..6 {
        let resp = g.chat(&key, chat_body(false)).await;
        assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    }
    assert_eq!(good.hits.load(Ordering::SeqCst), 6);
    let m = g.metrics().await;
    assert!(m.contains("granary_gateway_retries_total"), "{m}");
    assert!(!m.contains("granary_gateway_retries_total 0"), "{m}");
}

#[tokio::test]
async fn garbage_and_hanging_upstreams_become_clear_errors() {
    let garbage = start_upstream("g", Mode::Garbage, &["m"]).await;
    let g = Gw::start(&named(&[("g", garbage.addr)]), |c| c.gateway.max_attempts = 2).await;
    let key = g.key("acme", json!({})).await;
    let resp = g.chat(&key, chat_body(false)).await;
    assert_eq!(resp.status(), 502);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    assert!(!v.to_string().contains("127.0.0.1"), "no internal detail leaks: {v}");

    let hang = start_upstream("h", Mode::Hang, &["m"]).await;
    let g = Gw::start(&named(&[("h", hang.addr)]), |c| {
        c.gateway.max_attempts = 1;
        c.gateway.first_byte_timeout_s = 1;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    let t0 = Instant::now();
    let resp = g.chat(&key, chat_body(false)).await;
    assert_eq!(resp.status(), 502);
    assert!(t0.elapsed() < Duration::from_secs(10));
    let audit = g.audit().await;
    assert_eq!(audit.last().unwrap().status, 502, "the failure is audited");
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_are_audited() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.gateway.max_body_bytes = 4096).await;
    let key = g.key("acme", json!({"models": ["m"]})).await;
    let url = format!("{}/v1/chat/completions", g.base);
    let send = |auth: Option<&str>, body: Vec<u8>| {
        let mut r = g.http.post(&url).header("content-type", "application/json").body(body);
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        r.send()
    };
    // (key, body, status, the field the error names)
    type Case<'a> = (Option<&'a str>, Vec<u8>, u16, Option<&'a str>);
    let cases: Vec<Case> = vec![
        (None, chat_body(false).to_string().into_bytes(), 401, None),
        (Some("gk_nope_nope"), chat_body(false).to_string().into_bytes(), 401, None),
        (Some(&key), b"{not json".to_vec(), 400, None),
        (
            Some(&key),
            json!({"messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(),
            400,
            Some("model"),
        ),
        (Some(&key), json!({"model": "m", "messages": 5}).to_string().into_bytes(), 400, Some("messages")),
        (Some(&key), json!({"model": "m", "messages": [], "stream": "yes"}).to_string().into_bytes(), 400, None),
        (
            Some(&key),
            json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(),
            404,
            None,
        ),
        (Some(&key), vec![b' '; 10_000], 413, None),
    ];
    for (auth, body, status, param) in cases {
        let resp = send(auth, body).await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        assert!(resp.headers().contains_key("x-request-id"));
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{v}");
        }
    }
    assert_eq!(up.hits.load(Ordering::SeqCst), 0, "nothing bad reached the upstream");
    let audit = g.audit().await;
    // Every refusal of an authenticated request is audited; a request no
    // key authenticated is counted in the metrics only (issue 40: the
    // audit log is the billing record, and bad keys must not fill it).
    let unauthenticated = 2;
    assert_eq!(audit.len(), 8 - unauthenticated, "{audit:?}");
    assert!(audit.iter().all(|r| r.status != 401 && r.tenant.is_some()), "{audit:?}");
    let m = g.metrics().await;
    assert!(m.contains(&format!(r#"status="401"}} {unauthenticated}"#)), "{m}");
    // Unknown paths and methods are OpenAI-shaped too.
    let r = g.http.get(format!("{}/v1/nothing", g.base)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"].is_object());
    let r = g.http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 405);
}

#[tokio::test]
async fn limits_answer_429_with_retry_after() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({"limits": {"requests_per_minute": 2}})).await;
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    let resp = g.chat(&key, chat_body(false)).await;
    assert_eq!(resp.status(), 429);
    let after: u64 = resp.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&after), "{after}");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("requests_per_minute"), "{v}");
    assert_eq!(up.hits.load(Ordering::SeqCst), 2);
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_rate_limited_total{scope="key",limit="requests_per_minute"} 1"#), "{m}");
}

#[tokio::test]
async fn models_are_the_union_the_key_may_use() {
    let a = start_upstream("a", Mode::Ok, &["m", "n"]).await;
    let b = start_upstream("b", Mode::Ok, &["n", "o"]).await;
    let g = Gw::start(&named(&[("a", a.addr), ("b", b.addr)]), |_| {}).await;
    let all = g.key("acme", json!({})).await;
    let some = g.key("acme", json!({"models": ["n", "zzz"]})).await;
    let list = |k: String| {
        let http = g.http.clone();
        let url = format!("{}/v1/models", g.base);
        async move {
            let v: Value = http.get(url).bearer_auth(k).send().await.unwrap().json().await.unwrap();
            v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect::<Vec<_>>()
        }
    };
    assert_eq!(list(all).await, vec!["m", "n", "o"]);
    assert_eq!(list(some).await, vec!["n"]);
    let r = g.http.get(format!("{}/v1/models", g.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
}

#[tokio::test]
async fn a_dead_upstream_opens_its_breaker_and_gets_no_traffic() {
    let dead = dead_addr().await;
    let good = start_upstream("good", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("dead", dead), ("good", good.addr)]), |c| {
        c.upstreams[0].models = vec!["m".into()];
        c.gateway.breaker.failures = 2;
        c.gateway.breaker.open_ms = 60_000;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = g.metrics().await;
        if m.contains(r#"granary_gateway_upstream_breaker_state{upstream="dead"} 2"#) {
            break;
        }
        assert!(Instant::now() < deadline, "the breaker did not open:\n{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..5 {
        assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    }
    let m = g.metrics().await;
    assert!(
        !m.contains(r#"granary_gateway_upstream_attempts_total{upstream="dead""#),
        "no attempt on an open breaker: {m}"
    );
    assert!(m.contains(r#"granary_gateway_upstream_up{upstream="dead"} 0"#), "{m}");
}

#[tokio::test]
async fn full_upstreams_queue_premium_requests_first() {
    let up = start_upstream_with("a", Mode::Ok, &["m"], Duration::from_millis(300)).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.upstreams[0].max_active = 1).await;
    let (s, _) =
        g.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": "gold", "priority": "premium"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _) =
        g.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": "bulk", "priority": "batch"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let gold = g.key("gold", json!({})).await;
    let bulk = g.key("bulk", json!({})).await;
    // One request holds the only slot; then batch requests queue, then a premium one.
    let first = tokio::spawn({
        let (http, url, k) = (g.http.clone(), format!("{}/v1/chat/completions", g.base), bulk.clone());
        async move { http.post(url).bearer_auth(k).json(&chat_body(false)).send().await.unwrap().status() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let finish_order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, k) in [bulk.clone(), bulk.clone(), gold.clone()].into_iter().enumerate() {
        let (http, url, order) = (g.http.clone(), format!("{}/v1/chat/completions", g.base), finish_order.clone());
        tasks.push(tokio::spawn(async move {
            let s = http.post(url).bearer_auth(k).json(&chat_body(false)).send().await.unwrap().status();
            order.lock().push(i);
            s
        }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(first.await.unwrap(), 200);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(
        finish_order.lock()[0],
        2,
        "the premium request, queued last, is served first: {:?}",
        finish_order.lock()
    );
}

#[tokio::test]
async fn admin_and_metrics_refuse_anything_without_the_admin_token() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    for (method, path) in [
        (reqwest::Method::GET, "/metrics"),
        (reqwest::Method::GET, "/admin/v1/tenants"),
        (reqwest::Method::POST, "/admin/v1/tenants"),
        (reqwest::Method::POST, "/admin/v1/keys"),
        (reqwest::Method::GET, "/admin/v1/usage"),
    ] {
        for auth in [None, Some(key.as_str()), Some("wrong-admin-token-xxxxx")] {
            let mut r = g.http.request(method.clone(), format!("{}{path}", g.base)).json(&json!({"name": "evil"}));
            if let Some(a) = auth {
                r = r.bearer_auth(a);
            }
            let resp = r.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{method} {path} with {auth:?}");
        }
    }
    let (s, v) = g.admin(reqwest::Method::GET, "/admin/v1/tenants", None).await;
    assert_eq!(s, 200);
    assert!(!v.to_string().contains("evil"), "nothing was created: {v}");
    let health: HashMap<String, Value> =
        g.http.get(format!("{}/health", g.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok");
    drop(g.gw);
}

/// Readiness and liveness apart: with its only upstream down, `/health`
/// answers 503 (route nothing here) while `/livez` answers 200, so a
/// liveness probe does not restart a gateway for an engine outage.
#[tokio::test]
async fn an_engine_outage_fails_readiness_not_liveness() {
    let g = Gw::start(&named(&[("a", dead_addr().await)]), |_| {}).await;
    let get = |path: &'static str| {
        let (http, base) = (g.http.clone(), g.base.clone());
        async move {
            let r = http.get(format!("{base}{path}")).send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }
    };
    let (s, v) = get("/health").await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("no_upstream")), "{v}");
    let (s, v) = get("/livez").await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("ok")), "{v}");
}

/// `promtool check metrics` accepts the exposition after mixed traffic.
#[tokio::test]
async fn metrics_pass_promtool() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({"limits": {"requests_per_minute": 1}})).await;
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 429);
    assert_eq!(g.chat("gk_bad", chat_body(false)).await.status(), 401);
    let text = g.metrics().await;
    use granary_core::metrics::gateway as n;
    // Families without samples yet (queueing, KV routing) are not listed.
    let quiet = [
        n::QUEUE_SECONDS,
        n::ROUTED_BLOCKS,
        n::ROUTED_HIT_BLOCKS,
        n::MODEL_LOAD_REQUESTS,
        n::MODEL_LOADS,
        n::MODEL_LOAD_SECONDS,
        n::RESPONSE_CACHE,
        n::COST,
        n::SEMANTIC_CACHE,
        n::PREFILL,
        n::VLLM_KV_EVENTS,
    ];
    for name in n::ALL.iter().filter(|x| !quiet.contains(x)) {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
    }
    for line in [
        "granary_gateway_audit_spooled_records 0",
        "granary_gateway_audit_write_errors_total 0",
        "granary_gateway_limiter_errors_total 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    let run = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    match run {
        Ok(mut child) => {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool rejected /metrics: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(_) if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") => panic!("promtool not found"),
        Err(_) => eprintln!("skipped: promtool not found"),
    }
}

/// `schemathesis` (property-based requests generated from the OpenAPI
/// description) finds no 5xx on the public API (with a tenant key) nor on
/// the admin API (with the admin token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors() {
    if std::process::Command::new("schemathesis").arg("--version").output().is_err() {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "schemathesis not found");
        eprintln!("skipped: schemathesis not found");
        return;
    }
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let spec = format!("{}/openapi.json", g.base);
    for (auth, paths) in [(key.as_str(), "^/(v1|health)"), (ADMIN, "^/(admin|metrics)")] {
        let out = tokio::process::Command::new("schemathesis")
            .args(["run", &spec, "--url", &g.base, "--checks", "not_a_server_error"])
            .args(["--include-path-regex", paths, "--max-examples", "30", "--workers", "1", "--no-color"])
            .args(["--phases", "examples,coverage,fuzzing"])
            .arg("-H")
            .arg(format!("Authorization: Bearer {auth}"))
            .env("SCHEMATHESIS_HOOKS", "")
            .output()
            .await
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "schemathesis found problems on {paths}:\n{text}");
        assert!(text.contains("passed") || text.contains("Passed"), "{text}");
    }
}

/// A disaggregated pool: the prefill engine computes the prompt first (a
/// whole, non-streamed call), then the decode engine answers the client.
#[tokio::test]
async fn disaggregated_pools_prefill_then_decode() {
    let p = start_upstream("prefill", Mode::Ok, &["m"]).await;
    let d = start_upstream("decode", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("p", p.addr), ("d", d.addr)]), |c| {
        c.upstreams[0].granary = Some(true);
        c.upstreams[0].role = granary_gateway::config::Role::Prefill;
        c.upstreams[1].role = granary_gateway::config::Role::Decode;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for stream in [false, true] {
        let resp = g.chat(&key, chat_body(stream)).await;
        assert_eq!(resp.status(), 200);
        if stream {
            d.gate.notify_one();
            let text = resp.text().await.unwrap();
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        } else {
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["upstream"], "decode", "the decode engine answers: {v}");
        }
    }
    assert_eq!(p.hits.load(Ordering::SeqCst), 2, "each request was prefilled once");
    assert_eq!(d.hits.load(Ordering::SeqCst), 2);
    let seen = p.seen.lock();
    assert!(seen.bodies.iter().all(|b| b["stream"] == json!(false)), "the prefill call is never a stream");
    assert!(seen.namespaces.iter().all(|n| n == "acme"));
}

/// Issue 14, point 4: a disaggregated pair whose prefill engine fails (a
/// 5xx, or nothing listening) still answers: the decode engine serves the
/// whole request alone, the answer says so (`x-granary-prefill: failed`),
/// and the failure counts against the prefill engine's breaker and in the
/// metrics. A working partner is used again once it is back.
#[tokio::test]
async fn issue_14_a_failed_prefill_falls_back_to_the_decode_engine_alone() {
    let broken = start_upstream("prefill", Mode::Fail500, &["m"]).await;
    let gone = dead_addr().await;
    let d = start_upstream("decode", Mode::Ok, &["m"]).await;
    let g = Gw::start_opts(&named(&[("p", broken.addr), ("q", gone), ("d", d.addr)]), false, |c| {
        for u in &mut c.upstreams {
            u.models = vec!["m".into()];
        }
        for u in &mut c.upstreams[..2] {
            u.granary = Some(true);
            u.role = granary_gateway::config::Role::Prefill;
        }
        c.upstreams[2].role = granary_gateway::config::Role::Decode;
        c.gateway.breaker.failures = 100;
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for stream in [false, true, false, true] {
        let resp = g.chat(&key, chat_body(stream)).await;
        assert_eq!(resp.status(), 200, "stream {stream}");
        assert_eq!(resp.headers()["x-granary-prefill"], "failed");
        if stream {
            d.gate.notify_one();
            assert!(resp.text().await.unwrap().ends_with("data: [DONE]\n\n"));
        } else {
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["upstream"], "decode", "{v}");
        }
    }
    assert_eq!(d.hits.load(Ordering::SeqCst), 4, "the decode engine served every request whole");
    let text = g.metrics().await;
    assert!(text.contains(r#"granary_gateway_prefill_total{outcome="failed"} 4"#), "{text}");
    // Each failure was the prefill engine's: a 5xx or a refused connection.
    let failures = |outcome: &str, upstream: &str| {
        text.lines()
            .find(|l| {
                l.contains(&format!(r#"outcome="{outcome}""#)) && l.contains(&format!(r#"upstream="{upstream}""#))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(failures("status_5xx", "p") as usize, broken.hits.load(Ordering::SeqCst), "{text}");
    assert_eq!(failures("status_5xx", "p") + failures("connect_error", "q"), 4, "{text}");
    assert_eq!(failures("ok", "d"), 4, "{text}");
    let audit = g.audit().await;
    assert!(audit.iter().all(|r| r.status == 200 && r.upstream.as_deref() == Some("d")), "{audit:?}");
}

/// curl as the client: a whole answer, a stream, and a bad key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_gets_answers_streams_and_errors() {
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let url = format!("{}/v1/chat/completions", g.base);
    let curl = |key: String, body: Value| {
        let url = url.clone();
        async move {
            tokio::process::Command::new("curl")
                .args(["-s", "-N", "-w", "\n%{http_code}", "-H", "content-type: application/json"])
                .args(["-H", &format!("authorization: Bearer {key}"), "-d", &body.to_string(), &url])
                .output()
                .await
        }
    };
    let Ok(out) = curl(key.clone(), chat_body(false)).await else {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "curl not found");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.ends_with("\n200") && text.contains("\"Hello\""), "{text}");
    up.gate.notify_one();
    let out = curl(key, chat_body(true)).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("data: [DONE]") && text.ends_with("\n200"), "{text}");
    let out = curl("gk_wrong".into(), chat_body(false)).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.ends_with("\n401") && text.contains("authentication_error"), "{text}");
}

/// Issue 14, point 7: the body reaches the upstream as the client sent it
/// (spacing, member order, numbers no parser would keep) unless something
/// in it must change: a stream asks for the usage chunk, a mapped model is
/// renamed. Two `model` members are refused rather than read one way here
/// and another upstream.
#[tokio::test]
async fn bodies_are_forwarded_as_received() {
    let up = start_upstream("a", Mode::Ok, &["m", "other"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| {
        c.upstreams[0].model_map.insert("other".into(), "org/other".into());
    })
    .await;
    let key = g.key("acme", json!({})).await;
    let send = |body: &'static str| {
        g.http
            .post(format!("{}/v1/chat/completions", g.base))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let exact = r#" { "messages" : [ {"role":"user","content":"hi"} ],"model":"m",
        "logit_bias": {"15": 1.000000000000000000001}, "user": 123456789012345678901234567890 }"#;
    let r = send(exact).await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(up.seen.lock().raw[0], exact.as_bytes(), "the body was rewritten on the way");
    assert_eq!(g.audit().await[0].completion_tokens, 2, "usage is read from the answer");

    // A stream without `stream_options`: asked for usage, the rest as sent.
    let r = send(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#).await.unwrap();
    assert_eq!(r.status(), 200);
    up.gate.notify_one();
    let text = r.text().await.unwrap();
    assert!(!text.contains("\"usage\""), "the client did not ask for usage: {text}");
    assert_eq!(
        up.seen.lock().raw[1],
        &br#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#[..]
    );
    // With `stream_options` of its own, the option is set inside it.
    let r = send(r#"{"model":"m","stream":true,"stream_options":{"x":1},"messages":[{"role":"user","content":"hi"}]}"#)
        .await
        .unwrap();
    up.gate.notify_one();
    let _ = r.text().await.unwrap();
    assert_eq!(up.seen.lock().bodies[2]["stream_options"], json!({"x": 1, "include_usage": true}));

    // A mapped model is renamed; everything else is kept.
    let r = send(r#"{"model":"other","messages":[{"role":"user","content":"hi"}],"seed":7}"#).await.unwrap();
    assert_eq!(r.status(), 200);
    let b = up.seen.lock().bodies[3].clone();
    assert_eq!((b["model"].as_str(), b["seed"].as_i64()), (Some("org/other"), Some(7)));

    // Two `model` members: a 400 naming the duplicate, nothing sent upstream.
    let r = send(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"model":"other"}"#).await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("duplicate field `model`"), "{v}");
    assert_eq!(up.hits.load(Ordering::SeqCst), 4);
}
