//! The admin HTTP API.

use super::*;

pub(super) async fn call(
    router: &axum::Router,
    method: Method,
    uri: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (StatusCode, axum::http::HeaderMap, serde_json::Value, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req.body(body.map(|b| Body::from(b.to_string())).unwrap_or_else(Body::empty)).unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
    let text = String::from_utf8_lossy(&bytes).to_string();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, headers, json, text)
}

pub(super) async fn router() -> (Identity, axum::Router) {
    let id = mem().await;
    (id.clone(), admin_router(id, AdminToken::new(ADMIN)))
}

#[tokio::test]
async fn every_admin_route_needs_the_token() {
    let (_, r) = router().await;
    let routes = [
        (Method::POST, "/admin/v1/tenants", Some(r#"{"name":"x"}"#)),
        (Method::GET, "/admin/v1/tenants", None),
        (Method::GET, "/admin/v1/tenants/x", None),
        (Method::PATCH, "/admin/v1/tenants/x", Some("{}")),
        (Method::DELETE, "/admin/v1/tenants/x", None),
        (Method::POST, "/admin/v1/keys", Some(r#"{"tenant":"x"}"#)),
        (Method::GET, "/admin/v1/keys?tenant=x", None),
        (Method::DELETE, "/admin/v1/keys/1", None),
        (Method::GET, "/admin/v1/usage", None),
        (Method::GET, "/admin/v1/audit", None),
        (Method::GET, "/admin/v1/nothing-here", None),
    ];
    for (method, uri, body) in routes {
        for token in [None, Some("wrong"), Some("")] {
            let (status, _, json, _) = call(&r, method.clone(), uri, token, body).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri} {token:?}");
            assert_eq!(json["error"]["type"], "authentication_error", "{method} {uri}");
            assert_eq!(json["error"]["code"], "invalid_admin_token");
        }
    }
    // The tenant was never created.
    let (status, _, json, _) = call(&r, Method::GET, "/admin/v1/tenants", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json["data"], serde_json::json!([]));
}

#[tokio::test]
async fn tenant_and_key_created_over_http_authenticate() {
    let (id, r) = router().await;
    let (status, _, t, _) = call(
        &r,
        Method::POST,
        "/admin/v1/tenants",
        Some(ADMIN),
        Some(r#"{"name":"acme","priority":"batch","limits":{"requests_per_minute":5},"log_prompts":true}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{t}");
    assert_eq!(t["name"], "acme");
    assert_eq!(t["namespace"], "acme");
    assert_eq!(t["priority"], "batch");
    assert_eq!(t["limits"]["requests_per_minute"], 5);

    let (status, _, dup, _) =
        call(&r, Method::POST, "/admin/v1/tenants", Some(ADMIN), Some(r#"{"name":"acme"}"#)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{dup}");
    assert_eq!(dup["error"]["code"], "conflict");

    let (status, _, k, _) = call(
        &r,
        Method::POST,
        "/admin/v1/keys",
        Some(ADMIN),
        Some(r#"{"tenant":"acme","name":"ci","models":["llama"],"expires_in_s":3600}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{k}");
    let secret = k["key"].as_str().unwrap().to_string();
    assert_eq!(k["prefix"].as_str().unwrap(), &secret[..11]);
    assert!(k["expires_ms"].as_i64().unwrap() > now_ms() + 3_500_000);
    let p = id.authenticate(&format!("Bearer {secret}")).await.unwrap();
    assert_eq!(p.tenant, "acme");
    assert_eq!(p.priority, Priority::Batch);
    assert_eq!(p.models, Some(vec!["llama".to_string()]));
    assert!(p.log_prompts);

    // Listings carry neither the secret nor its hash.
    let (status, _, _, text) = call(&r, Method::GET, "/admin/v1/keys?tenant=acme", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains(&k["prefix"].as_str().unwrap().to_string()));
    assert!(!text.contains(&secret[12..]));
    assert!(!text.contains(&keys::hash(&secret)));
    let (status, _, _, _) = call(&r, Method::GET, "/admin/v1/keys?tenant=nobody", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Unknown tenant for a key: 404.
    let (status, _, _, _) = call(&r, Method::POST, "/admin/v1/keys", Some(ADMIN), Some(r#"{"tenant":"nobody"}"#)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Revoke over HTTP.
    let uri = format!("/admin/v1/keys/{}", k["id"]);
    let (status, _, revoked, _) = call(&r, Method::DELETE, &uri, Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK, "{revoked}");
    assert!(revoked["revoked_ms"].is_i64());
    assert!(matches!(id.authenticate(&secret).await, Err(AuthError::Revoked { .. })));
    let (status, _, e, _) = call(&r, Method::DELETE, "/admin/v1/keys/abc", Some(ADMIN), None).await;
    assert_eq!((status, e["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("id")));
    let (status, _, _, _) = call(&r, Method::DELETE, "/admin/v1/keys/12345", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // PATCH, GET one, DELETE (disable).
    let (status, _, t, _) =
        call(&r, Method::PATCH, "/admin/v1/tenants/acme", Some(ADMIN), Some(r#"{"priority":"premium"}"#)).await;
    assert_eq!((status, t["priority"].as_str()), (StatusCode::OK, Some("premium")));
    let (status, _, t, _) = call(&r, Method::GET, "/admin/v1/tenants/acme", Some(ADMIN), None).await;
    assert_eq!((status, t["priority"].as_str()), (StatusCode::OK, Some("premium")));
    let (status, _, _, _) = call(&r, Method::GET, "/admin/v1/tenants/nobody", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let live = key(&id, "acme").await;
    let (status, _, t, _) = call(&r, Method::DELETE, "/admin/v1/tenants/acme", Some(ADMIN), None).await;
    assert_eq!((status, t["disabled"].as_bool()), (StatusCode::OK, Some(true)));
    assert!(id.authenticate(&live.secret).await.is_err());
}

#[tokio::test]
async fn bad_bodies_are_400_naming_the_field() {
    let (_, r) = router().await;
    let cases = [
        (r#"{"name": 5}"#, Some("name")),
        (r#"{"name": "a", "bogus": 1}"#, Some("bogus")),
        (r#"{"name": "a", "limits": {"rpm": 1}}"#, Some("limits.rpm")),
        (r#"{"name": "a", "limits": {"requests_per_minute": "many"}}"#, Some("limits.requests_per_minute")),
        (r#"{"name": "a", "priority": "ultra"}"#, Some("priority")),
        (r#"{"namespace": "a"}"#, Some("name")),
        (r#"{"name": "Not Valid"}"#, Some("name")),
        (r#"{"name": "ok", "namespace": "../x"}"#, Some("namespace")),
        ("not json", None),
    ];
    for (body, field) in cases {
        let (status, _, json, _) = call(&r, Method::POST, "/admin/v1/tenants", Some(ADMIN), Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {json}");
        assert_eq!(json["error"]["type"], "invalid_request_error");
        assert_eq!(json["error"]["param"].as_str(), field, "{body}: {json}");
        if let Some(f) = field {
            let last = f.rsplit('.').next().unwrap();
            assert!(json["error"]["message"].as_str().unwrap().contains(last), "{body}: {json}");
        }
    }
    let (status, _, json, _) =
        call(&r, Method::PATCH, "/admin/v1/tenants/x", Some(ADMIN), Some(r#"{"disabled": "yes"}"#)).await;
    assert_eq!((status, json["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("disabled")));
    let (status, _, json, _) =
        call(&r, Method::POST, "/admin/v1/keys", Some(ADMIN), Some(r#"{"tenant": "x", "expires_at": "tomorrow"}"#))
            .await;
    assert_eq!((status, json["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("expires_at")));
    let (status, _, json, _) = call(
        &r,
        Method::POST,
        "/admin/v1/keys",
        Some(ADMIN),
        Some(r#"{"tenant": "x", "expires_at": "2030-01-01T00:00:00Z", "expires_in_s": 5}"#),
    )
    .await;
    assert_eq!((status, json["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("expires_in_s")));
}

#[tokio::test]
async fn usage_and_audit_over_http() {
    let (id, r) = router().await;
    let t0 = 1_700_000_000_000; // 2023-11-14T22:13:20Z
    id.record(rec("acme", "llama", 200, 10, 5, 0, t0));
    id.record(rec("acme", "llama", 503, 1, 0, 0, t0 + 1000));
    id.record(rec("beta", "qwen", 200, 2, 2, 2, t0 + 2000));
    id.flush().await;

    let (status, _, json, _) =
        call(&r, Method::GET, "/admin/v1/usage?from=1700000000&to=1700000003", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["data"].as_array().unwrap().len(), 2);
    assert_eq!(json["data"][0]["tenant"], "acme");
    assert_eq!(json["data"][0]["requests"], 2);
    assert_eq!(json["data"][0]["errors"], 1);

    let (status, headers, _, text) = call(
        &r,
        Method::GET,
        "/admin/v1/usage?from=2023-11-14T22:13:20Z&to=2023-11-14T22:13:23Z&tenant=beta&format=csv",
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers[header::CONTENT_TYPE].to_str().unwrap().starts_with("text/csv"));
    assert_eq!(
        text,
        "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens\nbeta,qwen,1,0,2,2,2\n"
    );

    // The default period is the current month: these 2023 records are outside it.
    let (status, _, json, _) = call(&r, Method::GET, "/admin/v1/usage", Some(ADMIN), None).await;
    assert_eq!((status, json["data"].as_array().map(Vec::len)), (StatusCode::OK, Some(0)));

    for (uri, field) in [
        ("/admin/v1/usage?from=yesterday", "from"),
        ("/admin/v1/usage?format=xml", "format"),
        ("/admin/v1/usage?color=red", "color"),
        ("/admin/v1/usage?from=1700000003&to=1700000000", "to"),
        ("/admin/v1/audit?limit=0", "limit"),
        ("/admin/v1/audit?limit=1001", "limit"),
        ("/admin/v1/audit?since=soon", "since"),
    ] {
        let (status, _, json, _) = call(&r, Method::GET, uri, Some(ADMIN), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {json}");
        assert_eq!(json["error"]["param"].as_str(), Some(field), "{uri}: {json}");
    }

    let (status, _, json, _) = call(&r, Method::GET, "/admin/v1/audit?tenant=acme&limit=1", Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK);
    let data = json["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["status"], 503);
    let (_, _, json, _) = call(&r, Method::GET, "/admin/v1/audit?since=1700000001", Some(ADMIN), None).await;
    assert_eq!(json["data"].as_array().unwrap().len(), 2);
}
