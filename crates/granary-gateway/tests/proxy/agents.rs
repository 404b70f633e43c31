//! Engines reported by node agents join and leave routing; models an
//! agent can load are loaded on request.

use super::*;

/// A heartbeat as a node agent sends it.
fn heartbeat(agent: &str, agent_url: &str, engines: &[(&str, SocketAddr, bool)], models: &[&str]) -> Value {
    let engines: Vec<Value> = engines
        .iter()
        .map(|(m, a, healthy)| json!({"model": m, "upstream": format!("http://{a}"), "healthy": healthy, "kv_events": false}))
        .collect();
    json!({"agent_id": agent, "url": agent_url, "token": "agent-secret", "engines": engines, "models": models})
}

/// Agents' engines join routing when reported, get no traffic while
/// reported unhealthy, and leave when dropped from the report or when the
/// agent falls silent for the ttl; nothing needs a restart.
#[tokio::test]
async fn engines_reported_by_agents_join_and_leave_routing() {
    let a = start_upstream("a", Mode::Ok, &["ignored"]).await;
    let b = start_upstream("b", Mode::Ok, &["ignored"]).await;
    let g = Gw::start(&[], |c| c.gateway.agents.ttl_ms = 400).await;
    let key = g.key("acme", json!({})).await;
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 404);

    let beat = |body: Value| {
        let g = &g;
        async move {
            let (s, v) = g.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(body)).await;
            assert_eq!(s, 200, "{v}");
            assert_eq!(v["ok"], true);
        }
    };
    beat(heartbeat("node-a", "http://127.0.0.1:9", &[("m", a.addr, true)], &["m"])).await;
    assert_eq!(model_ids(&g, &key).await, vec!["m"]);
    let v: Value = g.chat(&key, chat_body(false)).await.json().await.unwrap();
    assert_eq!(v["upstream"], "a", "{v}");
    let records = g.audit().await;
    assert_eq!(records[0].upstream.as_deref(), Some("agent:node-a:m"));

    // A second agent: both engines get traffic.
    beat(heartbeat("node-b", "http://127.0.0.1:9", &[("m", b.addr, true)], &[])).await;
    for _ in 0..6 {
        assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    }
    assert!(a.hits.load(Ordering::SeqCst) >= 2 && b.hits.load(Ordering::SeqCst) >= 2);
    let (s, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(s, 200);
    assert_eq!(v["data"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["data"][0]["engines"][0]["name"], "agent:node-a:m");
    assert_eq!(v["data"][0]["has_token"], true);
    assert!(!v.to_string().contains("agent-secret"), "the token is never shown: {v}");

    // node-b reports its engine unhealthy: no traffic to it.
    beat(heartbeat("node-b", "http://127.0.0.1:9", &[("m", b.addr, false)], &[])).await;
    let before = b.hits.load(Ordering::SeqCst);
    for _ in 0..6 {
        assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    }
    assert_eq!(b.hits.load(Ordering::SeqCst), before, "an engine reported unhealthy gets nothing");

    // node-a drops its engine: only b is left, and b is unhealthy.
    beat(heartbeat("node-a", "http://127.0.0.1:9", &[], &[])).await;
    let r = g.chat(&key, chat_body(false)).await;
    assert_eq!(r.status(), 503);
    let m = g.metrics().await;
    assert!(!m.contains("agent:node-a:m"), "a removed upstream's series go: {m}");
    assert!(m.contains(r#"granary_gateway_upstream_up{upstream="agent:node-b:m"}"#), "{m}");

    // Both fall silent: everything is gone within the ttl.
    beat(heartbeat("node-b", "http://127.0.0.1:9", &[("m", b.addr, false)], &[])).await;
    let silent = Instant::now();
    loop {
        let ids = model_ids(&g, &key).await;
        if ids.is_empty() {
            break;
        }
        assert!(silent.elapsed() < Duration::from_millis(1_500), "still listed: {ids:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(silent.elapsed() >= Duration::from_millis(300), "not before the ttl: {:?}", silent.elapsed());
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 404);
    let (_, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(v["data"], json!([]));
}

/// Each load asked for: the model and the `Authorization` header.
type Asked = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// What the test's stand-in agent does when asked to load a model.
#[derive(Clone)]
struct FakeAgent {
    loads: Asked,
    delay: Duration,
}

async fn fake_load(
    State(s): State<FakeAgent>,
    axum::extract::Path(model): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
    s.loads.lock().push((model.clone(), auth));
    match model.as_str() {
        "broken" => {
            (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "disk full"}}))).into_response()
        }
        "slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            StatusCode::OK.into_response()
        }
        "weird" => Json(json!({"model": model, "upstream": "file:///etc/passwd"})).into_response(),
        _ => {
            tokio::time::sleep(s.delay).await;
            let up = start_upstream("loaded", Mode::Ok, &[]).await;
            Json(json!({"model": model, "revision": "1", "upstream": format!("http://{}", up.addr), "state": "ready", "tier": "disk", "load_ms": 1}))
                .into_response()
        }
    }
}

/// A small HTTP server in the role of a node agent's control API (the real
/// agent is a separate component; here only its `load` answer matters).
async fn start_fake_agent(delay: Duration) -> (String, FakeAgent) {
    let st = FakeAgent { loads: Arc::new(Mutex::new(Vec::new())), delay };
    let app = Router::new().route("/models/{model}/load", post(fake_load)).with_state(st.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (url, st)
}

/// A request for a model only an agent lists is held while the agent loads
/// it (one load for many requests), then answered by the new engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_an_agent_can_load_is_loaded_on_request() {
    let (agent_url, agent) = start_fake_agent(Duration::from_millis(300)).await;
    let g = Gw::start(&[], |_| {}).await;
    let key = g.key("acme", json!({})).await;
    let (s, _) = g
        .admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(heartbeat("node-l", &agent_url, &[], &["m"])))
        .await;
    assert_eq!(s, 200);
    assert_eq!(model_ids(&g, &key).await, vec!["m"], "loadable models are listed");
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (http, url, k) = (g.http.clone(), format!("{}/v1/chat/completions", g.base), key.clone());
        tasks.push(tokio::spawn(async move {
            let r = http.post(url).bearer_auth(k).json(&chat_body(false)).send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }));
    }
    for t in tasks {
        let (s, v) = t.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["upstream"], "loaded");
    }
    let loads = agent.loads.lock().clone();
    assert_eq!(
        loads,
        vec![("m".to_string(), Some("Bearer agent-secret".to_string()))],
        "one load, with the agent's token"
    );
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_model_load_requests_total{model="m"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_model_loads_total{model="m",outcome="succeeded"} 1"#), "{m}");
    assert!(m.contains(r#"granary_gateway_model_load_seconds_count{model="m"} 1"#), "{m}");
    // Served now: no further load.
    assert_eq!(g.chat(&key, chat_body(false)).await.status(), 200);
    assert_eq!(agent.loads.lock().len(), 1);
    let (_, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(v["data"][0]["engines"][0]["model"], "m", "{v}");
}

/// A load that takes longer than `load_timeout_ms`, one that fails and one
/// whose answer is unusable: 503 with `Retry-After`, audited; a model no
/// agent lists stays 404.
#[tokio::test]
async fn slow_and_failed_loads_are_503_with_retry_after() {
    let (agent_url, agent) = start_fake_agent(Duration::ZERO).await;
    let g = Gw::start(&[], |c| c.gateway.agents.load_timeout_ms = 300).await;
    let key = g.key("acme", json!({})).await;
    let body = heartbeat("node-l", &agent_url, &[], &["slow", "broken", "weird"]);
    assert_eq!(g.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(body)).await.0, 200);
    let ask = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        g.chat(&key, body)
    };
    let t0 = Instant::now();
    let r = ask("slow").await;
    assert_eq!(r.status(), 503);
    assert!(t0.elapsed() >= Duration::from_millis(300), "held for the load timeout");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(r.headers()["retry-after"], "5");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_loading", "{v}");
    assert_eq!(v["error"]["type"], "server_error");

    for model in ["broken", "weird"] {
        let r = ask(model).await;
        assert_eq!(r.status(), 503, "{model}");
        assert_eq!(r.headers()["retry-after"], "5");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "model_load_failed", "{v}");
        assert!(!v.to_string().contains("disk full") && !v.to_string().contains(&agent_url), "no internals: {v}");
    }
    // Within the retry window a failed model is not asked for again.
    assert_eq!(ask("broken").await.status(), 503);
    let asked: Vec<String> = agent.loads.lock().iter().map(|(m, _)| m.clone()).collect();
    assert_eq!(asked, vec!["slow", "broken", "weird"]);
    assert_eq!(ask("nobody-has-it").await.status(), 404);

    let records = g.audit().await;
    let codes: Vec<(u16, Option<String>)> = records.iter().map(|r| (r.status, r.error_code.clone())).collect();
    assert!(codes.contains(&(503, Some("model_loading".into()))), "{codes:?}");
    assert_eq!(codes.iter().filter(|c| c.1.as_deref() == Some("model_load_failed")).count(), 3, "{codes:?}");
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_model_loads_total{model="broken",outcome="failed"} 1"#), "{m}");
}

/// Heartbeats are checked field by field, need the admin token, and are
/// refused when agents are disabled.
#[tokio::test]
async fn heartbeats_are_validated_and_need_the_admin_token() {
    let g = Gw::start(&[], |_| {}).await;
    let url = format!("{}/admin/v1/agents/heartbeat", g.base);
    let good = json!({"agent_id": "a", "url": "http://127.0.0.1:1", "engines": [], "models": []});
    for auth in [None, Some("wrong-admin-token-xxxxx")] {
        let mut r = g.http.post(&url).json(&good);
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        assert_eq!(r.send().await.unwrap().status(), 401);
    }
    let cases = [
        (json!({"url": "http://h:1"}), "agent_id"),
        (json!({"agent_id": "a"}), "url"),
        (json!({"agent_id": 5, "url": "http://h:1"}), "agent_id"),
        (json!({"agent_id": "a", "url": "javascript:alert(1)"}), "url"),
        (json!({"agent_id": "a", "url": "http://h:1", "engines": [{"model": "m"}]}), "engines[0].upstream"),
        (
            json!({"agent_id": "a", "url": "http://h:1", "engines": [{"model": "m", "upstream": "h:2"}]}),
            "engines[0].upstream",
        ),
        (
            json!({"agent_id": "a", "url": "http://h:1", "engines": [{"model": "m", "upstream": "http://h:2", "healthy": "yes"}]}),
            "engines[0].healthy",
        ),
        (json!({"agent_id": "a", "url": "http://h:1", "models": ["ok", 3]}), "models[1]"),
    ];
    for (body, param) in cases {
        let (s, v) = g.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(body.clone())).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (_, v) = g.admin(reqwest::Method::GET, "/admin/v1/agents", None).await;
    assert_eq!(v["data"], json!([]), "nothing was registered");

    let off = Gw::start(&[], |c| c.gateway.agents.enabled = false).await;
    let (s, v) = off.admin(reqwest::Method::POST, "/admin/v1/agents/heartbeat", Some(good)).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("agents_disabled")));
}
