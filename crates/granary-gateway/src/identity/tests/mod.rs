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

mod audit;
mod cli;
mod http;
