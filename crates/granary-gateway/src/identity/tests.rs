use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use tower::ServiceExt as _;

use super::cli::run_admin_to;
use super::*;

const ADMIN: &str = "admin-secret-for-tests";

async fn mem() -> Identity {
    Identity::open("sqlite::memory:", IdentityOptions::default()).await.expect("open sqlite::memory:")
}

async fn tenant(id: &Identity, name: &str) -> Tenant {
    id.create_tenant(NewTenant { name: name.into(), ..Default::default() }).await.expect("create tenant")
}

async fn key(id: &Identity, tenant: &str) -> CreatedKey {
    id.create_key(NewKey { tenant: tenant.into(), ..Default::default() }).await.expect("create key")
}

fn rec(tenant: &str, model: &str, status: u16, prompt: u64, completion: u64, cached: u64, time_ms: i64) -> AuditRecord {
    AuditRecord {
        time_ms,
        request_id: format!("req-{tenant}-{model}-{time_ms}-{status}"),
        tenant: Some(tenant.into()),
        tenant_id: Some(1),
        key_id: Some(1),
        endpoint: "/v1/chat/completions".into(),
        model: Some(model.into()),
        upstream: Some("http://127.0.0.1:9000".into()),
        status,
        error_code: (status >= 400).then(|| "rate_limit_exceeded".to_string()),
        stream: true,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
        latency_ms: 12.5,
        ttft_ms: Some(3.25),
        prompt: None,
    }
}

#[tokio::test]
async fn keys_have_the_documented_format_and_only_their_hash_is_stored() {
    let id = mem().await;
    assert_eq!(id.backend(), "sqlite");
    tenant(&id, "acme").await;
    let k = key(&id, "acme").await;
    assert!(keys::well_formed(&k.secret), "{}", k.secret);
    assert!(k.secret.starts_with("gk_"));
    assert_eq!(k.info.prefix, &k.secret[..11]);

    let row = sqlx::query("SELECT prefix, key_hash, COALESCE(name, ''), COALESCE(models, ''), limits FROM api_keys")
        .fetch_one(id.pool())
        .await
        .unwrap();
    let cols: Vec<String> = (0..5).map(|i| row.try_get::<String, _>(i).unwrap()).collect();
    assert_eq!(cols[0], k.info.prefix);
    assert_eq!(cols[1], blake3::hash(k.secret.as_bytes()).to_hex().to_string());
    let secret_part = &k.secret[12..];
    for c in &cols {
        assert!(!c.contains(secret_part), "a column holds the secret: {c}");
    }
}

#[tokio::test]
async fn authenticate_returns_the_principal_of_a_good_key() {
    let id = mem().await;
    let limits = Limits { requests_per_minute: Some(60), ..Default::default() };
    id.create_tenant(NewTenant {
        name: "acme".into(),
        namespace: Some("shared-ns".into()),
        priority: Some(Priority::Premium),
        limits: Some(limits.clone()),
        log_prompts: Some(true),
    })
    .await
    .unwrap();
    let key_limits = Limits { tokens_per_day: Some(1000), ..Default::default() };
    let k = id
        .create_key(NewKey { tenant: "acme".into(), limits: Some(key_limits.clone()), ..Default::default() })
        .await
        .unwrap();
    for bearer in [format!("Bearer {}", k.secret), k.secret.clone(), format!("bearer  {} ", k.secret)] {
        let p = id.authenticate(&bearer).await.unwrap();
        assert_eq!(p.key_id, k.info.id);
        assert_eq!(p.key_prefix, k.info.prefix);
        assert_eq!(p.tenant, "acme");
        assert_eq!(p.namespace, "shared-ns");
        assert_eq!(p.priority, Priority::Premium);
        assert_eq!(p.tenant_limits, limits);
        assert_eq!(p.key_limits, key_limits);
        assert!(p.log_prompts);
        assert_eq!(p.models, None);
        assert!(p.may_use("anything"));
    }
}

#[tokio::test]
async fn missing_malformed_and_unknown_keys_are_401_invalid_api_key() {
    let id = mem().await;
    tenant(&id, "acme").await;
    let k = key(&id, "acme").await;
    let (other, _) = keys::generate();
    let mut wrong_secret = k.secret.clone();
    wrong_secret.replace_range(20..21, if &k.secret[20..21] == "a" { "b" } else { "a" });
    let cases = [
        ("", AuthError::Missing),
        ("Bearer ", AuthError::Missing),
        ("Bearer sk-123", AuthError::Malformed),
        (other.as_str(), AuthError::Unknown),
        (wrong_secret.as_str(), AuthError::Unknown),
    ];
    for (bearer, want) in cases {
        let e = id.authenticate(bearer).await.unwrap_err();
        assert_eq!(e, want, "{bearer:?}");
        let api = e.to_api_error();
        assert_eq!(api.status, StatusCode::UNAUTHORIZED);
        assert_eq!(api.code, Some("invalid_api_key"));
    }
}

#[tokio::test]
async fn revoked_expired_and_disabled_are_refused_with_their_codes() {
    let id = mem().await;
    tenant(&id, "acme").await;
    tenant(&id, "other").await;

    let revoked = key(&id, "acme").await;
    id.revoke_key(revoked.info.id).await.unwrap();
    let e = id.authenticate(&revoked.secret).await.unwrap_err();
    assert!(matches!(e, AuthError::Revoked { .. }));
    let api = e.to_api_error();
    assert_eq!((api.status, api.code), (StatusCode::UNAUTHORIZED, Some("invalid_api_key")));
    assert!(api.message.contains("revoked"), "{}", api.message);
    // Revoking again is fine; an unknown id is 404.
    id.revoke_key(revoked.info.id).await.unwrap();
    assert!(matches!(id.revoke_key(9999).await, Err(AdminError::NotFound(_))));

    let expiring = id
        .create_key(NewKey { tenant: "acme".into(), expires_ms: Some(now_ms() + 1000), ..Default::default() })
        .await
        .unwrap();
    id.authenticate(&expiring.secret).await.expect("not yet expired");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let api = id.authenticate(&expiring.secret).await.unwrap_err().to_api_error();
    assert_eq!((api.status, api.code), (StatusCode::UNAUTHORIZED, Some("expired_api_key")));

    let k = key(&id, "other").await;
    id.authenticate(&k.secret).await.unwrap();
    id.update_tenant("other", TenantUpdate { disabled: Some(true), ..Default::default() }).await.unwrap();
    let api = id.authenticate(&k.secret).await.unwrap_err().to_api_error();
    assert_eq!((api.status, api.code), (StatusCode::FORBIDDEN, Some("tenant_disabled")));
    id.update_tenant("other", TenantUpdate { disabled: Some(false), ..Default::default() }).await.unwrap();
    id.authenticate(&k.secret).await.expect("enabled again");

    // Disabling through disable_tenant also revokes every key of the tenant.
    let t = id.disable_tenant("other").await.unwrap();
    assert!(t.disabled);
    assert!(matches!(id.authenticate(&k.secret).await, Err(AuthError::Revoked { .. })));
    let keys = id.list_keys(Some("other")).await.unwrap();
    assert!(keys.iter().all(|k| k.revoked_ms.is_some()));
}

#[tokio::test]
async fn expiry_in_the_past_is_refused() {
    let id = mem().await;
    tenant(&id, "acme").await;
    let r = id.create_key(NewKey { tenant: "acme".into(), expires_ms: Some(now_ms() - 1), ..Default::default() }).await;
    assert!(matches!(r, Err(AdminError::Invalid { ref field, .. }) if field == "expires_at"), "{r:?}");
    let r = id.create_key(NewKey { tenant: "nobody".into(), ..Default::default() }).await;
    assert!(matches!(r, Err(AdminError::NotFound(_))));
}

#[tokio::test]
async fn the_cache_serves_keys_and_revocation_here_invalidates_it_at_once() {
    let id = Identity::open(
        "sqlite::memory:",
        IdentityOptions { key_cache: Duration::from_secs(60), audit_queue: 16, ..IdentityOptions::default() },
    )
    .await
    .unwrap();
    tenant(&id, "acme").await;
    let a = key(&id, "acme").await;
    let b = key(&id, "acme").await;
    id.authenticate(&a.secret).await.unwrap();
    id.authenticate(&b.secret).await.unwrap();

    // Revoked behind the Identity's back: the cached entry still answers.
    sqlx::query("UPDATE api_keys SET revoked_ms = 1 WHERE id = $1").bind(b.info.id).execute(id.pool()).await.unwrap();
    id.authenticate(&b.secret).await.expect("served from the cache");

    // Revoked through the Identity: refused at once.
    id.revoke_key(a.info.id).await.unwrap();
    assert!(matches!(id.authenticate(&a.secret).await, Err(AuthError::Revoked { .. })));
}

#[tokio::test]
async fn revocation_by_another_process_takes_effect_within_the_cache_time() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/nested/gateway.db", dir.path().display());
    let opts =
        IdentityOptions { key_cache: Duration::from_millis(1000), audit_queue: 16, ..IdentityOptions::default() };
    let gateway = Identity::open(&url, opts.clone()).await.unwrap();
    assert!(dir.path().join("nested/gateway.db").exists(), "the database file is created");
    let admin = Identity::open(&url, opts).await.unwrap();
    tenant(&admin, "acme").await;
    let k = key(&admin, "acme").await;
    gateway.authenticate(&k.secret).await.unwrap();
    admin.revoke_key(k.info.id).await.unwrap();
    gateway.authenticate(&k.secret).await.expect("still cached in the other process");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(matches!(gateway.authenticate(&k.secret).await, Err(AuthError::Revoked { .. })));
}

#[tokio::test]
async fn the_models_allow_list_reaches_the_principal() {
    let id = mem().await;
    tenant(&id, "acme").await;
    let models = vec!["llama-3-8b".to_string(), "qwen2-7b".to_string()];
    let k = id
        .create_key(NewKey { tenant: "acme".into(), models: Some(models.clone()), ..Default::default() })
        .await
        .unwrap();
    let p = id.authenticate(&k.secret).await.unwrap();
    assert_eq!(p.models.as_ref(), Some(&models));
    assert!(p.may_use("qwen2-7b"));
    assert!(!p.may_use("gpt-4"));
    let r = id.create_key(NewKey { tenant: "acme".into(), models: Some(vec![]), ..Default::default() }).await;
    assert!(matches!(r, Err(AdminError::Invalid { ref field, .. }) if field == "models"));
}

#[tokio::test]
async fn audit_records_are_written_on_flush_and_aggregated_into_usage() {
    let id = mem().await;
    let t0 = 1_700_000_000_000;
    let recs = [
        rec("acme", "llama", 200, 10, 5, 2, t0),
        rec("acme", "llama", 200, 20, 7, 0, t0 + 1),
        rec("acme", "llama", 429, 0, 0, 0, t0 + 2),
        rec("acme", "qwen", 200, 3, 4, 1, t0 + 3),
        rec("beta", "llama", 500, 8, 0, 0, t0 + 4),
        rec("beta", "llama", 200, 1, 1, 1, t0 + 5),
        // Outside [t0, t0 + 10).
        rec("acme", "llama", 200, 1000, 1000, 0, t0 + 10),
        rec("acme", "llama", 200, 1000, 1000, 0, t0 - 1),
    ];
    for r in &recs {
        id.record(r.clone());
    }
    id.flush().await;
    assert_eq!(id.audit_dropped(), 0);

    let rows = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 10, tenant: None }).await.unwrap();
    let row = |tenant: &str, model: &str, requests, errors, prompt, completion, cached| UsageRow {
        tenant: tenant.into(),
        model: model.into(),
        requests,
        errors,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
    };
    assert_eq!(
        rows,
        vec![
            row("acme", "llama", 3, 1, 30, 12, 2),
            row("acme", "qwen", 1, 0, 3, 4, 1),
            row("beta", "llama", 2, 1, 9, 1, 1)
        ]
    );
    let beta = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 10, tenant: Some("beta".into()) }).await.unwrap();
    assert_eq!(beta, vec![row("beta", "llama", 2, 1, 9, 1, 1)]);
    assert!(id.usage(&UsageQuery { from_ms: t0, to_ms: t0, tenant: None }).await.is_err());

    // The records read back whole, newest first.
    let listed = id.audit(&AuditQuery { limit: 3, ..Default::default() }).await.unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0], recs[6]);
    assert_eq!(listed[1], recs[5]);
    let since = id.audit(&AuditQuery { tenant: Some("beta".into()), limit: 10, since_ms: Some(t0 + 5) }).await.unwrap();
    assert_eq!(since, vec![recs[5].clone()]);
    assert!(id.audit(&AuditQuery { limit: 0, ..Default::default() }).await.is_err());
}

#[tokio::test]
async fn a_full_audit_queue_drops_and_counts_instead_of_waiting() {
    let id = Identity::open(
        "sqlite::memory:",
        IdentityOptions { key_cache: Duration::from_secs(2), audit_queue: 4, ..IdentityOptions::default() },
    )
    .await
    .unwrap();
    // Hold the only connection so the writer cannot drain the queue.
    let conn = id.pool().acquire().await.unwrap();
    let started = std::time::Instant::now();
    for i in 0..20 {
        id.record(rec("acme", "llama", 200, 1, 1, 0, i));
    }
    assert!(started.elapsed() < Duration::from_millis(500), "record() must not wait");
    let dropped = id.audit_dropped();
    // The queue holds 4, the writer at most one batch in hand.
    assert!(dropped >= 20 - 4 - 4 - 1, "dropped {dropped}");
    drop(conn);
    id.flush().await;
    let n: i64 = sqlx::query("SELECT COUNT(*) FROM audit_log").fetch_one(id.pool()).await.unwrap().try_get(0).unwrap();
    assert_eq!(n as u64 + dropped, 20);
}

#[test]
fn usage_csv_has_a_header_and_quotes_when_needed() {
    let rows = vec![
        UsageRow { tenant: "acme".into(), model: "llama".into(), requests: 3, errors: 1, ..Default::default() },
        UsageRow { tenant: "b".into(), model: "odd,\"name\"".into(), prompt_tokens: 7, ..Default::default() },
    ];
    assert_eq!(
        usage_csv(&rows),
        "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens\n\
         acme,llama,3,1,0,0,0\n\
         b,\"odd,\"\"name\"\"\",0,0,7,0,0\n"
    );
}

/// Issue 14, point 2: usage reports with cost, and cells that start like a
/// formula (model names come from clients) made inert.
#[test]
fn usage_csv_prices_rows_and_neutralises_formulas() {
    let mut prices = crate::pricing::Prices::default();
    prices.models.insert(
        "llama".into(),
        crate::pricing::ModelPrice { input_per_million: 1.0, cached_input_per_million: None, output_per_million: 2.0 },
    );
    let rows = vec![
        UsageRow {
            tenant: "acme".into(),
            model: "llama".into(),
            prompt_tokens: 1_000,
            completion_tokens: 500,
            ..Default::default()
        },
        UsageRow { tenant: "acme".into(), model: "=HYPERLINK(\"http://x\")".into(), requests: 1, ..Default::default() },
        UsageRow { tenant: "acme".into(), model: "+1".into(), ..Default::default() },
        UsageRow { tenant: "acme".into(), model: "@sum".into(), ..Default::default() },
        UsageRow { tenant: "acme".into(), model: "-2".into(), ..Default::default() },
    ];
    let csv = usage_csv_priced(&rows, Some(&prices));
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens,cost,currency");
    assert_eq!(lines[1], "acme,llama,0,0,1000,500,0,0.002000,USD");
    assert_eq!(lines[2], "acme,\"'=HYPERLINK(\"\"http://x\"\")\",1,0,0,0,0,,USD", "no price: an empty cost");
    assert_eq!(&lines[3..], ["acme,'+1,0,0,0,0,0,,USD", "acme,'@sum,0,0,0,0,0,,USD", "acme,'-2,0,0,0,0,0,,USD"]);
}

#[test]
fn admin_token_verifies_only_its_secret() {
    let t = AdminToken::new("s3cret");
    assert!(t.verify("s3cret"));
    assert!(!t.verify("s3cret "));
    assert!(!t.verify(""));
    assert!(!AdminToken::new("").verify(""));
}

#[test]
fn tenant_names_follow_the_pattern() {
    for ok in ["a", "acme", "0x", "a-b_c", &"a".repeat(63)] {
        assert!(check_name("name", ok).is_ok(), "{ok}");
    }
    for bad in ["", "-a", "_a", "Acme", "a b", "a.b", "é", &"a".repeat(64)] {
        assert!(check_name("name", bad).is_err(), "{bad}");
    }
}

// ---- admin HTTP API ----

async fn call(
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

async fn router() -> (Identity, axum::Router) {
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

// ---- admin CLI ----

#[derive(clap::Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: AdminCmd,
}

async fn cli(id: &Identity, args: &[&str]) -> anyhow::Result<(String, String)> {
    cli_priced(id, args, None).await
}

async fn cli_priced(
    id: &Identity,
    args: &[&str],
    prices: Option<&crate::pricing::Prices>,
) -> anyhow::Result<(String, String)> {
    use clap::Parser as _;
    let cmd = Cli::try_parse_from(std::iter::once("admin").chain(args.iter().copied()))?.cmd;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    run_admin_to(cmd, id, prices, &mut out, &mut err).await?;
    Ok((String::from_utf8(out)?, String::from_utf8(err)?))
}

/// Issue 14, point 2: budgets in currency set from the command line, and
/// the usage report with each row's cost.
#[tokio::test]
async fn the_cli_sets_spend_budgets_and_prices_usage() {
    let id = mem().await;
    cli(&id, &["tenant", "create", "acme", "--spend-per-month", "12.5", "--spend-per-day", "0.75"]).await.unwrap();
    let t = id.get_tenant("acme").await.unwrap();
    use crate::pricing::Money;
    assert_eq!((t.limits.spend_per_day, t.limits.spend_per_month), (Some(Money(750_000)), Some(Money(12_500_000))));
    let err = cli(&id, &["tenant", "update", "acme", "--spend-per-day=-1"]).await.unwrap_err().to_string();
    assert!(err.contains("--spend-per-day") && err.contains("0 or more"), "{err}");
    let (out, _) = cli(&id, &["tenant", "list"]).await.unwrap();
    assert!(out.contains(r#""spend_per_day":0.75"#), "{out}");

    let mut prices = crate::pricing::Prices::default();
    prices.models.insert(
        "llama".into(),
        crate::pricing::ModelPrice { input_per_million: 1.0, cached_input_per_million: None, output_per_million: 2.0 },
    );
    id.record(rec("acme", "llama", 200, 1_000, 500, 0, now_ms()));
    id.record(rec("acme", "=cmd", 200, 5, 5, 0, now_ms()));
    id.flush().await;
    let (out, _) = cli_priced(&id, &["usage", "--csv"], Some(&prices)).await.unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens,cost,currency");
    assert!(lines.contains(&"acme,llama,1,0,1000,500,0,0.002000,USD"), "{out}");
    assert!(lines.contains(&"acme,'=cmd,1,0,5,5,0,,USD"), "a formula made inert: {out}");
    let (out, _) = cli_priced(&id, &["usage"], Some(&prices)).await.unwrap();
    assert!(out.contains("COST") && out.contains("0.002000 USD"), "{out}");
    let (out, _) = cli_priced(&id, &["usage", "--csv"], Some(&crate::pricing::Prices::default())).await.unwrap();
    assert!(!out.contains("cost"), "prices without models: no cost column: {out}");
}

#[tokio::test]
async fn the_cli_manages_tenants_and_keys() {
    let id = mem().await;
    cli(&id, &["tenant", "create", "acme", "--priority", "premium", "--requests-per-minute", "10"]).await.unwrap();
    let t = id.get_tenant("acme").await.unwrap();
    assert_eq!(t.priority, Priority::Premium);
    assert_eq!(t.limits.requests_per_minute, Some(10));

    cli(&id, &["tenant", "update", "acme", "--tokens-per-day", "500", "--log-prompts", "true"]).await.unwrap();
    let t = id.get_tenant("acme").await.unwrap();
    assert_eq!((t.limits.requests_per_minute, t.limits.tokens_per_day, t.log_prompts), (Some(10), Some(500), true));

    let (out, _) = cli(&id, &["tenant", "list"]).await.unwrap();
    assert!(out.starts_with("ID"), "{out}");
    assert!(out.lines().nth(1).unwrap().contains("acme"), "{out}");

    let (out, err) = cli(&id, &["key", "create", "--tenant", "acme", "--models", "a,b"]).await.unwrap();
    assert!(err.contains("shown only now"), "{err}");
    let created: serde_json::Value = serde_json::from_str(&out).unwrap();
    let secret = created["key"].as_str().unwrap();
    let p = id.authenticate(secret).await.unwrap();
    assert_eq!(p.models, Some(vec!["a".to_string(), "b".to_string()]));

    let (out, _) = cli(&id, &["key", "list", "--tenant", "acme"]).await.unwrap();
    assert!(out.contains(created["prefix"].as_str().unwrap()));
    assert!(!out.contains(&secret[12..]));

    let key_id = created["id"].to_string();
    // Update and rotate, before revoking.
    let (out, _) =
        cli(&id, &["key", "update", &key_id, "--all-models", "--requests-per-minute", "7", "--expires-in", "60"])
            .await
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((v["models"].is_null(), &v["limits"]["requests_per_minute"]), (true, &serde_json::json!(7)), "{v}");
    assert!(v["expires_ms"].is_i64(), "{v}");
    let (out, _) = cli(&id, &["key", "update", &key_id, "--never-expires"]).await.unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["expires_ms"].is_null());
    let (out, err) = cli(&id, &["key", "rotate", &key_id, "--grace-s", "0"]).await.unwrap();
    assert!(err.contains("shown only now"), "{err}");
    let rotated: serde_json::Value = serde_json::from_str(&out).unwrap();
    let new_secret = rotated["key"].as_str().unwrap();
    assert!(id.authenticate(new_secret).await.is_ok());
    cli(&id, &["key", "revoke", &key_id]).await.unwrap();
    assert!(id.authenticate(secret).await.is_err());

    id.record(rec("acme", "llama", 200, 4, 2, 0, now_ms()));
    id.flush().await;
    let (out, _) = cli(&id, &["usage", "--csv"]).await.unwrap();
    assert_eq!(out.lines().nth(1), Some("acme,llama,1,0,4,2,0"), "{out}");
    let (out, _) = cli(&id, &["audit", "--tenant", "acme", "--limit", "5"]).await.unwrap();
    assert_eq!(out.lines().count(), 2, "{out}");

    cli(&id, &["tenant", "disable", "acme"]).await.unwrap();
    assert!(id.get_tenant("acme").await.unwrap().disabled);
    assert!(cli(&id, &["tenant", "create", "Bad Name"]).await.is_err());
    assert!(cli(&id, &["key", "create", "--tenant", "nobody"]).await.is_err());
}

#[tokio::test]
async fn last_use_is_recorded_lazily() {
    let id = mem().await;
    tenant(&id, "acme").await;
    let k = key(&id, "acme").await;
    assert_eq!(id.get_key(k.info.id).await.unwrap().last_used_ms, None);
    let before = now_ms();
    id.authenticate(&k.secret).await.unwrap();
    let mut seen = None;
    for _ in 0..50 {
        seen = id.get_key(k.info.id).await.unwrap().last_used_ms;
        if seen.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first = seen.expect("last_used_ms written");
    assert!(first >= before);
    // Within the minute, a second use writes nothing.
    tokio::time::sleep(Duration::from_millis(5)).await;
    id.authenticate(&k.secret).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(id.get_key(k.info.id).await.unwrap().last_used_ms, Some(first));
}

#[tokio::test]
async fn a_database_failure_is_503_without_detail() {
    let id = Identity::open(
        "sqlite::memory:",
        IdentityOptions { key_cache: Duration::ZERO, audit_queue: 16, ..IdentityOptions::default() },
    )
    .await
    .unwrap();
    tenant(&id, "acme").await;
    let k = key(&id, "acme").await;
    id.authenticate(&k.secret).await.unwrap();
    id.pool().close().await;
    let e = id.authenticate(&k.secret).await.unwrap_err();
    assert_eq!(e, AuthError::Unavailable);
    let api = e.to_api_error();
    assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(api.retry_after.is_some());
    let api = ApiError::from(id.list_tenants().await.unwrap_err());
    assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!api.message.to_lowercase().contains("pool"), "{}", api.message);
    // Records that cannot be written are counted, and flush still returns.
    id.record(rec("acme", "llama", 200, 1, 1, 0, 1));
    id.flush().await;
    assert_eq!(id.audit_dropped(), 1);
}

async fn audit_count(id: &Identity) -> i64 {
    sqlx::query("SELECT COUNT(*) FROM audit_log").fetch_one(id.pool()).await.map(|r| r.get::<i64, _>(0)).unwrap_or(-1)
}

async fn spooling(dir: &std::path::Path) -> Identity {
    let opts = IdentityOptions {
        audit_spool_dir: Some(dir.join("spool")),
        audit_write_timeout: Duration::from_millis(500),
        ..IdentityOptions::default()
    };
    Identity::open(&format!("sqlite://{}", dir.join("g.db").display()), opts).await.unwrap()
}

/// Issue 14, point 2: while the database refuses audit writes (here its
/// `audit_log` table is renamed away) under load, batches are retried and
/// spooled to disk; when it takes writes again every record arrives, once,
/// and the daily rollup counts them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_audit_records_survive_a_database_outage_under_load() {
    let dir = tempfile::tempdir().unwrap();
    let id = spooling(dir.path()).await;
    const TOTAL: i64 = 3_000;
    let loader = {
        let id = id.clone();
        tokio::spawn(async move {
            for i in 0..TOTAL {
                id.record(rec("acme", "llama", 200, 3, 4, 0, 1_741_964_966_500 + i));
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("ALTER TABLE audit_log RENAME TO audit_log_away").execute(id.pool()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while id.audit_spooled() == 0 {
        assert!(std::time::Instant::now() < deadline, "nothing was spooled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    sqlx::query("ALTER TABLE audit_log_away RENAME TO audit_log").execute(id.pool()).await.unwrap();
    loader.await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        id.flush().await;
        if audit_count(&id).await == TOTAL && id.audit_spooled() == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {TOTAL} records arrived, {} spooled, {} dropped",
            audit_count(&id).await,
            id.audit_spooled(),
            id.audit_dropped()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(id.audit_dropped(), 0);
    assert!(id.audit_write_errors() > 0);
    let distinct: i64 =
        sqlx::query("SELECT COUNT(DISTINCT request_id) FROM audit_log").fetch_one(id.pool()).await.unwrap().get(0);
    assert_eq!(distinct, TOTAL);
    let (requests, tokens): (i64, i64) = sqlx::query(
        "SELECT CAST(SUM(requests) AS BIGINT), CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT) FROM usage_daily",
    )
    .fetch_one(id.pool())
    .await
    .map(|r| (r.get(0), r.get(1)))
    .unwrap();
    assert_eq!((requests, tokens), (TOTAL, TOTAL * 7));
    let files = std::fs::read_dir(dir.path().join("spool")).unwrap().count();
    assert_eq!(files, 0, "replayed spool files are removed");
}

/// Batches spooled before a restart are written by the next process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_spooled_audit_batches_are_replayed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let id = spooling(dir.path()).await;
    sqlx::query("ALTER TABLE audit_log RENAME TO audit_log_away").execute(id.pool()).await.unwrap();
    for i in 0..10 {
        id.record(rec("acme", "llama", 200, 1, 1, 0, i));
    }
    id.flush().await;
    assert_eq!((id.audit_spooled(), id.audit_dropped()), (10, 0));
    drop(id);
    // The writer ends with its last sender; the database comes back.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = format!("sqlite://{}", dir.path().join("g.db").display());
    let raw = sqlx::AnyPool::connect(&url).await.unwrap();
    sqlx::query("ALTER TABLE audit_log_away RENAME TO audit_log").execute(&raw).await.unwrap();
    raw.close().await;
    let again = spooling(dir.path()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Committed first, then the file is removed and the count updated.
    while audit_count(&again).await != 10 || again.audit_spooled() != 0 {
        assert!(std::time::Instant::now() < deadline, "the spool was not replayed at start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(audit_count(&again).await, 10, "replayed once");
    // Without a spool, a batch the database refuses is dropped and counted.
    sqlx::query("ALTER TABLE audit_log RENAME TO audit_log_away").execute(again.pool()).await.unwrap();
    let plain = Identity::open(
        &format!("sqlite://{}", dir.path().join("g.db").display()),
        IdentityOptions { audit_write_timeout: Duration::from_millis(500), ..IdentityOptions::default() },
    )
    .await
    .unwrap();
    plain.record(rec("acme", "llama", 200, 1, 1, 0, 99));
    plain.flush().await;
    assert_eq!(plain.audit_dropped(), 1);
}

/// Issue 14, point 2: with prices configured, the usage report gives each
/// row's cost and the currency; a model without a price has none.
#[tokio::test]
async fn usage_reports_cost_when_prices_are_configured() {
    let id = mem().await;
    tenant(&id, "acme").await;
    id.record(rec("acme", "llama", 200, 2_000_000, 1_000_000, 1_000_000, 1_700_000_000_000));
    id.record(rec("acme", "free", 200, 10, 10, 0, 1_700_000_000_001));
    id.flush().await;
    let mut prices = crate::pricing::Prices { currency: "EUR".into(), ..Default::default() };
    prices.models.insert(
        "llama".into(),
        crate::pricing::ModelPrice {
            input_per_million: 1.0,
            cached_input_per_million: Some(0.5),
            output_per_million: 3.0,
        },
    );
    let r = admin_router_with(id, AdminToken::new(ADMIN), AdminOptions { prices, ..Default::default() });
    let uri = "/admin/v1/usage?from=2023-11-14T00:00:00Z&to=2023-11-15T00:00:00Z";
    let (status, _, json, _) = call(&r, Method::GET, uri, Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["currency"], "EUR");
    let cost =
        |model: &str| json["data"].as_array().unwrap().iter().find(|r| r["model"] == model).unwrap()["cost"].clone();
    // 1M fresh × 1 + 1M cached × 0.5 + 1M out × 3.
    assert_eq!(cost("llama"), serde_json::json!(4.5));
    assert_eq!(cost("free"), serde_json::Value::Null);
    let (_, _, _, text) = call(&r, Method::GET, &format!("{uri}&format=csv"), Some(ADMIN), None).await;
    assert!(text.contains("acme,llama,1,0,2000000,1000000,1000000,4.500000,EUR\n"), "{text}");
}
