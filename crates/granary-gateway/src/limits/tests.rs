//! In-process limiter: windows, scopes, admission rule and pruning.

use super::*;
use crate::Priority;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;

/// 2025-03-14 15:09:26.500 UTC.
const T0: i64 = 1_741_964_966_500;
const MINUTE: i64 = 60_000;
const DAY: i64 = 86_400_000;

fn principal(key_id: i64, tenant_id: i64, key_limits: Limits, tenant_limits: Limits) -> Principal {
    Principal {
        key_id,
        key_prefix: format!("gk_{key_id}"),
        tenant_id,
        tenant: format!("tenant{tenant_id}"),
        namespace: format!("tenant{tenant_id}"),
        models: None,
        priority: Priority::Standard,
        key_limits,
        tenant_limits,
        log_prompts: false,
    }
}

fn rpm(n: u64) -> Limits {
    Limits { requests_per_minute: Some(n), ..Limits::default() }
}

/// Start of the minute holding `t`.
fn minute_start(t: i64) -> i64 {
    t - t.rem_euclid(MINUTE)
}

fn memory_len(l: &Limiter) -> usize {
    match &*l.backend {
        Backend::Memory(m) => m.len(),
        Backend::Redis(_) => unreachable!("in-process limiter"),
    }
}

#[tokio::test]
async fn requests_per_minute_admits_n_then_one_more_per_sixtieth_of_a_minute_per_request() {
    let l = Limiter::in_process();
    let p = principal(1, 10, rpm(3), Limits::default());
    for _ in 0..3 {
        l.admit_at(&p, 0, T0).await.unwrap();
    }
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    assert_eq!(r.scope, Scope::Key);
    assert_eq!(r.limit, "requests_per_minute");
    assert_eq!((r.max, r.used), (3, 3));
    // A rate, not a calendar minute: each request drains in 20 s.
    assert_eq!(r.retry_after, Duration::from_millis(20_000));

    let e = r.to_api_error();
    assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(e.code, Some("rate_limit_exceeded"));
    assert_eq!(e.message, "key limit requests_per_minute (3) reached; retry after 20 s");
    let resp = e.into_response();
    assert_eq!(resp.headers()[header::RETRY_AFTER], "20");

    // 20 s later one more fits, not three; a minute later all three.
    assert!(l.admit_at(&p, 0, T0 + 19_999).await.is_err());
    l.admit_at(&p, 0, T0 + 20_000).await.unwrap();
    assert!(l.admit_at(&p, 0, T0 + 20_000).await.is_err());
    for _ in 0..3 {
        l.admit_at(&p, 0, T0 + 20_000 + MINUTE).await.unwrap();
    }
}

/// Issue 14, point 1: no 2x burst at a minute's edge. A burst at the end of
/// one wall-clock minute and another at the start of the next together fit
/// the limit, in any 60 s span.
#[tokio::test]
async fn a_burst_across_a_minute_edge_cannot_exceed_the_limit() {
    let l = Limiter::in_process();
    let p = principal(1, 10, rpm(10), Limits { tokens_per_minute: Some(1_000), ..Limits::default() });
    let edge = minute_start(T0) + MINUTE;
    let mut admitted = 0;
    for t in [edge - 500, edge - 1, edge, edge + 1, edge + 500] {
        for _ in 0..20 {
            admitted += u32::from(l.admit_at(&p, 0, t).await.is_ok());
        }
    }
    // 10 at once, and what one second drains (1/6 request): none more.
    assert_eq!(admitted, 10);
    // Tokens: 1000 taken just before the edge leave what one second
    // drained (16 of 1000) just after it, not a fresh 1000.
    let q = principal(2, 20, Limits { tokens_per_minute: Some(1_000), ..Limits::default() }, Limits::default());
    l.reserve_at(&q, 10, 1_000, edge - 500).await.unwrap();
    let quota = l.admit_at(&q, 0, edge + 500).await.unwrap();
    let tokens = quota.tokens.unwrap();
    assert_eq!((tokens.limit, tokens.remaining), (1_000, 16));
    assert_eq!(tokens.reset, Duration::from_millis(59_040));
    let r = l.reserve_at(&q, 10, 1_000, edge + 500).await.unwrap();
    let e = l.admit_at(&q, 0, edge + 500).await.unwrap_err();
    assert_eq!((e.limit, e.used), ("tokens_per_minute", 1_984));
    // A settled reservation gives back what was not used.
    l.settle(&q, &r, 0).await;
    assert_eq!(l.admit_at(&q, 0, edge + 500).await.unwrap().tokens.unwrap().remaining, 16);
}

#[tokio::test]
async fn rejected_requests_are_not_counted() {
    let l = Limiter::in_process();
    // Key allows 2, tenant allows 5: three rejected attempts on the key must
    // not use up the tenant's allowance.
    let a = principal(1, 10, rpm(2), rpm(5));
    let b = principal(2, 10, Limits::default(), rpm(5));
    for _ in 0..2 {
        l.admit_at(&a, 0, T0).await.unwrap();
    }
    for _ in 0..3 {
        let r = l.admit_at(&a, 0, T0).await.unwrap_err();
        assert_eq!((r.scope, r.used), (Scope::Key, 2));
    }
    for _ in 0..3 {
        l.admit_at(&b, 0, T0).await.unwrap();
    }
    let r = l.admit_at(&b, 0, T0).await.unwrap_err();
    assert_eq!((r.scope, r.max, r.used), (Scope::Tenant, 5, 5));
}

#[tokio::test]
async fn a_request_must_fit_the_key_and_the_tenant() {
    let l = Limiter::in_process();
    // Tenant limit of 3 shared by two keys.
    let a = principal(1, 10, rpm(100), rpm(3));
    let b = principal(2, 10, rpm(100), rpm(3));
    l.admit_at(&a, 0, T0).await.unwrap();
    l.admit_at(&b, 0, T0).await.unwrap();
    l.admit_at(&a, 0, T0).await.unwrap();
    let r = l.admit_at(&b, 0, T0).await.unwrap_err();
    assert_eq!(r.scope, Scope::Tenant);
    assert_eq!(r.to_api_error().message, "tenant limit requests_per_minute (3) reached; retry after 20 s");
    // Another tenant is untouched.
    l.admit_at(&principal(3, 11, rpm(100), rpm(3)), 0, T0).await.unwrap();
}

#[tokio::test]
async fn key_limits_are_independent_between_keys() {
    let l = Limiter::in_process();
    let a = principal(1, 10, rpm(2), Limits::default());
    let b = principal(2, 10, rpm(2), Limits::default());
    l.admit_at(&a, 0, T0).await.unwrap();
    l.admit_at(&a, 0, T0).await.unwrap();
    assert!(l.admit_at(&a, 0, T0).await.is_err());
    l.admit_at(&b, 0, T0).await.unwrap();
    l.admit_at(&b, 0, T0).await.unwrap();
    assert!(l.admit_at(&b, 0, T0).await.is_err());
}

#[tokio::test]
async fn tokens_per_minute_admit_while_spent_is_under_the_limit() {
    let l = Limiter::in_process();
    let p = principal(1, 10, Limits { tokens_per_minute: Some(1000), ..Limits::default() }, Limits::default());
    l.admit_at(&p, 600, T0).await.unwrap();
    l.charge_at(&p, 600, T0).await;
    // 600 < 1000: admitted even though 600 + 600 is over (the estimate is
    // not reserved).
    l.admit_at(&p, 600, T0).await.unwrap();
    l.charge_at(&p, 500, T0).await;
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    assert_eq!((r.limit, r.max, r.used), ("tokens_per_minute", 1000, 1100));
    assert_eq!(r.to_api_error().code, Some("rate_limit_exceeded"));
    // Next minute: the budget is back.
    l.admit_at(&p, 0, minute_start(T0) + MINUTE).await.unwrap();
}

#[tokio::test]
async fn an_estimate_over_a_token_limit_is_refused_outright() {
    let l = Limiter::in_process();
    let p = principal(1, 10, rpm(10), Limits { tokens_per_minute: Some(1000), ..Limits::default() });
    let r = l.admit_at(&p, 1001, T0).await.unwrap_err();
    assert_eq!((r.scope, r.limit, r.used), (Scope::Tenant, "tokens_per_minute", 0));
    assert!(r.to_api_error().message.contains("estimated tokens of this request exceed the tenant limit"));
    // Not counted against the key's requests: 10 more fit.
    for _ in 0..10 {
        l.admit_at(&p, 1000, T0).await.unwrap();
    }
    assert_eq!(l.admit_at(&p, 0, T0).await.unwrap_err().limit, "requests_per_minute");
}

#[tokio::test]
async fn tokens_per_day_is_a_utc_day_and_answers_quota_exceeded() {
    let l = Limiter::in_process();
    let p = principal(1, 10, Limits { tokens_per_day: Some(100_000), ..Limits::default() }, Limits::default());
    l.charge_at(&p, 100_000, T0).await;
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    let day_end = T0 - T0.rem_euclid(DAY) + DAY;
    assert_eq!(r.retry_after, Duration::from_millis((day_end - T0) as u64));
    let e = r.to_api_error();
    assert_eq!(e.code, Some("quota_exceeded"));
    assert_eq!(e.kind, crate::error::ErrorType::RateLimitError);
    let secs = ((day_end - T0) as u64).div_ceil(1000);
    assert_eq!(e.message, format!("key limit tokens_per_day (100000) reached; retry after {secs} s"));
    // Still blocked one millisecond before midnight UTC, free at midnight.
    assert!(l.admit_at(&p, 0, day_end - 1).await.is_err());
    l.admit_at(&p, 0, day_end).await.unwrap();
}

#[tokio::test]
async fn tokens_per_month_follows_the_calendar_month() {
    // 2024-02-10 00:00 UTC; February 2024 has 29 days.
    let feb10 = 1_707_523_200_000;
    let mar1 = 1_709_251_200_000;
    let l = Limiter::in_process();
    let p = principal(1, 10, Limits::default(), Limits { tokens_per_month: Some(5_000), ..Limits::default() });
    l.charge_at(&p, 3_000, feb10).await;
    l.admit_at(&p, 0, feb10 + DAY).await.unwrap();
    l.charge_at(&p, 2_000, feb10 + DAY).await;
    let r = l.admit_at(&p, 0, mar1 - 1).await.unwrap_err();
    assert_eq!((r.scope, r.limit, r.used), (Scope::Tenant, "tokens_per_month", 5_000));
    assert_eq!(r.retry_after, Duration::from_millis(1));
    assert_eq!(r.to_api_error().code, Some("quota_exceeded"));
    l.admit_at(&p, 0, mar1).await.unwrap();
}

#[tokio::test]
async fn charge_adds_to_every_token_window_of_key_and_tenant() {
    let l = Limiter::in_process();
    let all = Limits { tokens_per_minute: Some(100), tokens_per_day: Some(1000), ..Limits::default() };
    let a = principal(1, 10, all.clone(), Limits { tokens_per_month: Some(150), ..Limits::default() });
    let b = principal(2, 10, Limits::default(), Limits { tokens_per_month: Some(150), ..Limits::default() });
    l.charge_at(&a, 100, T0).await;
    // Key's minute is spent; its day is not.
    let r = l.admit_at(&a, 0, T0).await.unwrap_err();
    assert_eq!((r.limit, r.used), ("tokens_per_minute", 100));
    // The tenant's month counted the same tokens: 100 of 150.
    l.admit_at(&b, 0, T0).await.unwrap();
    l.charge_at(&b, 50, T0).await;
    let r = l.admit_at(&b, 0, T0).await.unwrap_err();
    assert_eq!((r.scope, r.limit, r.used), (Scope::Tenant, "tokens_per_month", 150));
}

#[tokio::test]
async fn the_rejection_names_the_window_that_resets_last() {
    let l = Limiter::in_process();
    let p = principal(1, 10, rpm(1), Limits { tokens_per_day: Some(10), ..Limits::default() });
    l.admit_at(&p, 0, T0).await.unwrap();
    l.charge_at(&p, 10, T0).await;
    // Both the key's minute and the tenant's day block: the day decides.
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    assert_eq!((r.scope, r.limit), (Scope::Tenant, "tokens_per_day"));
}

#[tokio::test]
async fn unlimited_principals_are_never_counted() {
    let l = Limiter::in_process();
    let p = principal(1, 10, Limits::default(), Limits::default());
    for _ in 0..10_000 {
        l.admit_at(&p, 1_000_000, T0).await.unwrap();
    }
    l.charge_at(&p, u64::MAX, T0).await;
    assert_eq!(memory_len(&l), 0);
    assert_eq!(l.backend(), "memory");
    assert_eq!(l.backend_errors(), 0);
}

#[tokio::test]
async fn ended_windows_are_pruned() {
    let l = Limiter::in_process();
    for id in 0..100 {
        l.admit_at(&principal(id, id, rpm(5), Limits::default()), 0, T0).await.unwrap();
    }
    assert_eq!(memory_len(&l), 100);
    // Two minutes later every shard that is touched again drops the old
    // windows; touch all of them through many tenants.
    let later = T0 + 2 * MINUTE;
    for id in 0..100 {
        l.admit_at(&principal(id, id, rpm(5), Limits::default()), 0, later).await.unwrap();
    }
    assert_eq!(memory_len(&l), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_admissions_never_exceed_the_limit() {
    let l = Limiter::in_process();
    let p = principal(1, 10, Limits::default(), rpm(50));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (l, p) = (l.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..20 {
                if l.admit_at(&p, 0, T0).await.is_ok() {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 50);
}

#[test]
fn windows_start_and_end_where_the_calendar_says() {
    // 2024-12-31 23:59:59.999 UTC: the month window is December.
    let t = 1_735_689_599_999;
    let (start, end) = LimitKind::TokensPerMonth.window(t);
    assert_eq!(start, 1_733_011_200_000); // 2024-12-01
    assert_eq!(end, 1_735_689_600_000); // 2025-01-01
    assert_eq!(LimitKind::TokensPerDay.window(t), (1_735_603_200_000, 1_735_689_600_000));
    // The per-minute limits are rates: one counter, not calendar minutes.
    assert_eq!(LimitKind::TokensPerMinute.window(t), (0, t + 60_000));
    assert_eq!(LimitKind::RequestsPerMinute.window(-1), (0, 59_999));
}

#[test]
fn scope_names() {
    assert_eq!(Scope::Key.as_str(), "key");
    assert_eq!(Scope::Tenant.as_str(), "tenant");
}

#[tokio::test]
async fn redis_rejects_a_malformed_url_and_a_zero_timeout() {
    let err = Limiter::redis("not a url", RedisOptions::default()).await.unwrap_err();
    assert!(err.to_string().contains("Redis URL"), "{err}");
    let opts = RedisOptions { timeout_ms: 0, ..RedisOptions::default() };
    let err = Limiter::redis("redis://127.0.0.1:1/", opts).await.unwrap_err();
    assert!(err.to_string().contains("timeout_ms"), "{err}");
}

#[test]
fn redis_options_default_and_deserialize() {
    let d = RedisOptions::default();
    assert_eq!((d.prefix.as_str(), d.timeout_ms), ("granary:limits:", 50));
    let o: RedisOptions = toml::from_str("timeout_ms = 20").unwrap();
    assert_eq!((o.prefix.as_str(), o.timeout_ms), ("granary:limits:", 20));
    assert!(toml::from_str::<RedisOptions>("timeout = 20").is_err());
}

#[test]
fn reset_durations_are_written_as_openai_writes_them() {
    let t = |ms: u64| super::duration_text(Duration::from_millis(ms));
    assert_eq!(t(250), "250ms");
    assert_eq!(t(1_000), "1s");
    assert_eq!(t(17_500), "17.5s");
    assert_eq!(t(17_280), "17.28s");
    assert_eq!(t(360_000), "6m0s");
    assert_eq!(t(61_050), "1m1.05s");
    assert_eq!(t(0), "0ms");
    assert_eq!(t(7), "7ms");
    assert_eq!(t(1_001), "1.001s");
    assert_eq!(t(10_000), "10s");
    assert_eq!(t(59_990), "59.99s");
}

/// Issue 14, point 1: concurrent admissions see each other's reservations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_bound_concurrent_overshoot_and_settle_releases_the_rest() {
    let l = Limiter::in_process();
    let budget = Limits { tokens_per_day: Some(1_000), ..Limits::default() };
    let p = principal(1, 10, budget, Limits::default());
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (l, p) = (l.clone(), p.clone());
        tasks.push(tokio::spawn(async move { l.reserve_at(&p, 10, 100, T0).await.ok() }));
    }
    let mut admitted = Vec::new();
    for t in tasks {
        admitted.extend(t.await.unwrap());
    }
    assert_eq!(admitted.len(), 10);
    // 150 reserved where 1000 fit: admitted while under the budget, so at
    // most one reservation over it.
    let q = principal(2, 20, Limits { tokens_per_day: Some(1_000), ..Limits::default() }, Limits::default());
    let mut n = 0;
    while l.reserve_at(&q, 10, 150, T0).await.is_ok() {
        n += 1;
    }
    assert_eq!(n, 7, "0, 150, ..., 900 are under 1000: 7 admitted, 1050 reserved");
    // Settling: each used 40 of its 100; 600 come back.
    for r in &admitted {
        l.settle(&p, r, 40).await;
    }
    let mut more = 0;
    while let Ok(r) = l.reserve_at(&p, 10, 100, T0).await {
        assert_eq!(r.tokens, 100);
        more += 1;
    }
    assert_eq!(more, 6, "400 used: 400, 500, ..., 900 are under 1000");
    // Without any token limit nothing is reserved.
    let free = principal(3, 30, rpm(10), Limits::default());
    assert_eq!(l.reserve_at(&free, 10, 100, T0).await.unwrap().tokens, 0);
}
