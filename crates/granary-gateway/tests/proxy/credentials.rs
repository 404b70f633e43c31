//! Scoped operator tokens and key rotation (issue 14, point 5).

use super::*;

/// Issue 14, point 5: the agent token opens heartbeats only, the metrics
/// token `GET /metrics` only; the admin token keeps everything. With no
/// admin token at all, the scoped tokens still open their routes.
#[tokio::test]
async fn issue_14_agent_and_metrics_tokens_open_only_their_routes() {
    const AGENT: &str = "agent-token-0123456789";
    const METRICS: &str = "metrics-token-0123456789";
    std::env::set_var("GRANARY_TEST_SCOPED_AGENT", AGENT);
    std::env::set_var("GRANARY_TEST_SCOPED_METRICS", METRICS);
    let scoped = |c: &mut GatewayConfig| {
        c.gateway.agent_token_env = "GRANARY_TEST_SCOPED_AGENT".into();
        c.gateway.metrics_token_env = "GRANARY_TEST_SCOPED_METRICS".into();
    };
    let g = Gw::start(&[], scoped).await;
    let beat = json!({"agent_id": "a", "url": "http://127.0.0.1:1", "engines": [], "models": []});
    let call = |method: reqwest::Method, path: &str, token: &str| {
        g.http.request(method, format!("{}{path}", g.base)).bearer_auth(token).json(&beat).send()
    };
    use reqwest::Method as M;
    let routes = [
        (M::POST, "/admin/v1/agents/heartbeat"),
        (M::GET, "/metrics"),
        (M::GET, "/admin/v1/agents"),
        (M::GET, "/admin/v1/tenants"),
        (M::POST, "/admin/v1/keys"),
        (M::GET, "/admin/v1/audit"),
    ];
    // Which routes each token opens (the rest answer 401).
    for (token, opens) in [(AGENT, &[0usize][..]), (METRICS, &[1]), (ADMIN, &[0, 1, 2, 3, 5])] {
        for (i, (method, path)) in routes.iter().enumerate() {
            let status = call(method.clone(), path, token).await.unwrap().status();
            if opens.contains(&i) {
                assert!(status.is_success(), "{token} on {method} {path}: {status}");
            } else if token == ADMIN {
                assert_eq!(status, 400, "admin reaches {method} {path} (the body is wrong for it)");
            } else {
                assert_eq!(status, 401, "{token} on {method} {path}");
            }
        }
    }

    // No admin token: heartbeats and metrics still work with their tokens.
    let mut cfg = GatewayConfig::default();
    cfg.gateway.database = "sqlite::memory:".into();
    scoped(&mut cfg);
    let identity = Identity::open("sqlite::memory:", IdentityOptions::default()).await.unwrap();
    let gw = Gateway::new(&cfg, identity, Limiter::in_process()).unwrap();
    let app = granary_gateway::server::router(gw, None);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    let http = reqwest::Client::new();
    let r = http.post(format!("{base}/admin/v1/agents/heartbeat")).bearer_auth(AGENT).json(&beat).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(format!("{base}/metrics")).bearer_auth(METRICS).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(format!("{base}/admin/v1/tenants")).bearer_auth(AGENT).send().await.unwrap();
    assert_eq!(r.status(), 403, "the admin API stays disabled");
    let r = http.get(format!("{base}/metrics")).bearer_auth(AGENT).send().await.unwrap();
    assert_eq!(r.status(), 401);
}

/// Issue 14, point 5: a rotated key gets a new secret at once, the old one
/// works for the grace period (then answers 401 `expired_api_key`), and
/// `PATCH` changes a key's models, limits and expiry in place.
#[tokio::test]
async fn issue_14_keys_rotate_with_a_grace_period_and_can_be_patched() {
    let up = start_upstream("a", Mode::Ok, &["m", "n"]).await;
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.gateway.key_rotation_grace_s = 1).await;
    let old = g.key("acme", json!({"models": ["m"]})).await;
    let (_, keys) = g.admin(reqwest::Method::GET, "/admin/v1/keys", None).await;
    let id = keys["data"][0]["id"].as_i64().unwrap();
    let (s, v) = g.admin(reqwest::Method::POST, &format!("/admin/v1/keys/{id}/rotate"), None).await;
    assert_eq!(s, 200, "{v}");
    let new = v["key"].as_str().unwrap().to_string();
    assert_ne!(new, old);
    assert!(v["previous_valid_until_ms"].as_i64().is_some(), "{v}");
    assert_eq!(g.chat(&new, chat_for("m")).await.status(), 200, "the new secret works");
    assert_eq!(g.chat(&old, chat_for("m")).await.status(), 200, "the old one, within the grace period");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let r = g.chat(&old, chat_for("m")).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "expired_api_key");
    assert_eq!(g.chat(&new, chat_for("m")).await.status(), 200);
    // Rotating with grace 0 ends the current secret at once.
    let (_, v) =
        g.admin(reqwest::Method::POST, &format!("/admin/v1/keys/{id}/rotate"), Some(json!({"grace_s": 0}))).await;
    let newer = v["key"].as_str().unwrap().to_string();
    assert_eq!(g.chat(&new, chat_for("m")).await.status(), 401);
    let key = newer;

    // PATCH: models, limits, expiry; absent fields stay.
    assert_eq!(g.chat(&key, chat_for("n")).await.status(), 404, "not allowed yet");
    let path = format!("/admin/v1/keys/{id}");
    let (s, v) = g
        .admin(reqwest::Method::PATCH, &path, Some(json!({"models": null, "limits": {"requests_per_minute": 1}})))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["models"], Value::Null, "{v}");
    assert_eq!(g.chat(&key, chat_for("n")).await.status(), 200, "every model now");
    assert_eq!(g.chat(&key, chat_for("n")).await.status(), 429, "the new limit holds");
    let (s, v) = g.admin(reqwest::Method::PATCH, &path, Some(json!({"expires_in_s": 3600}))).await;
    assert_eq!(s, 200, "{v}");
    assert!(v["expires_ms"].as_i64().is_some() && v["limits"]["requests_per_minute"] == 1, "{v}");
    let (s, v) = g.admin(reqwest::Method::PATCH, &path, Some(json!({"expires_at": null}))).await;
    assert_eq!((s, &v["expires_ms"]), (StatusCode::OK, &Value::Null), "{v}");
    let (s, v) = g.admin(reqwest::Method::PATCH, &path, Some(json!({"models": []}))).await;
    assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("models")), "{v}");
    let (s, _) = g.admin(reqwest::Method::PATCH, "/admin/v1/keys/999", Some(json!({"name": "x"}))).await;
    assert_eq!(s, 404);
    let (s, v) = g.admin(reqwest::Method::PATCH, &path, Some(json!({"bogus": 1}))).await;
    assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("bogus")), "{v}");
}
