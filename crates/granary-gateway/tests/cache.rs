//! The response cache (issue 14, point 6): whole answers to deterministic
//! requests, per tenant, in memory and in a real `redis-server` shared by
//! two gateways.

mod common;

use std::time::Duration;

use common::{fake_upstream, third_party, Gw};
use granary_gateway::config::GatewayConfig;
use granary_gateway::proxy::CACHE_UPSTREAM;
use serde_json::{json, Value};

/// (status, `x-granary-cache`, body)
async fn ask(g: &Gw, key: &str, body: &Value, cache_control: Option<&str>) -> (u16, Option<String>, Value) {
    let mut r = g.http.post(format!("{}/v1/chat/completions", g.base)).bearer_auth(key).json(body);
    if let Some(cc) = cache_control {
        r = r.header("cache-control", cc);
    }
    let resp = r.send().await.unwrap();
    let state = resp.headers().get("x-granary-cache").map(|v| v.to_str().unwrap().to_string());
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (status, state, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn cached_config(addr: std::net::SocketAddr) -> GatewayConfig {
    let mut cfg = GatewayConfig::default();
    cfg.gateway.response_cache.enabled = true;
    cfg.upstreams.push(third_party("a", addr, None));
    cfg
}

#[tokio::test]
async fn issue_14_deterministic_answers_are_cached_per_tenant() {
    let up = fake_upstream().await;
    let g = Gw::start(cached_config(up.addr)).await;
    let (acme, other) = (g.key("acme", json!({})).await, g.key("other", json!({})).await);
    let body =
        json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let (s, state, first) = ask(&g, &acme, &body, None).await;
    assert_eq!((s, state.as_deref()), (200, Some("miss")));
    assert_eq!(*up.hits.lock(), 1);
    // The same request, its fields in another order: the kept answer.
    let reordered = json!({"max_tokens": 3, "messages": [{"content": "hi", "role": "user"}], "temperature": 0.0, "model": "m", "stream": false});
    let (s, state, again) = ask(&g, &acme, &reordered, None).await;
    assert_eq!((s, state.as_deref(), &again), (200, Some("hit"), &first));
    assert_eq!(*up.hits.lock(), 1, "no engine was asked");
    // Another tenant never sees it.
    assert_eq!(ask(&g, &other, &body, None).await.1.as_deref(), Some("miss"));
    assert_eq!(*up.hits.lock(), 2);
    // no-cache: asked again (and kept); no-store: asked again.
    assert_eq!(ask(&g, &acme, &body, Some("no-cache")).await.1.as_deref(), Some("miss"));
    assert_eq!(ask(&g, &acme, &body, Some("no-store")).await.1.as_deref(), Some("miss"));
    assert_eq!(*up.hits.lock(), 4);
    // Not deterministic, or streamed: never cached, no header.
    let warm = json!({"model": "m", "temperature": 0.7, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(ask(&g, &acme, &warm, None).await.1, None);
    assert_eq!(ask(&g, &acme, &warm, None).await.1, None);
    let seeded = json!({"model": "m", "temperature": 0.7, "seed": 5, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(ask(&g, &acme, &seeded, None).await.1.as_deref(), Some("miss"));
    assert_eq!(ask(&g, &acme, &seeded, None).await.1.as_deref(), Some("hit"));
    assert_eq!(*up.hits.lock(), 7);

    let audit = g.audit().await;
    let hits: Vec<_> = audit.iter().filter(|r| r.upstream.as_deref() == Some(CACHE_UPSTREAM)).collect();
    assert_eq!(hits.len(), 2, "{audit:?}");
    assert!(hits.iter().all(|r| r.status == 200 && r.prompt_tokens == 0 && r.completion_tokens == 0), "{hits:?}");
    let m = g.metrics().await;
    // Lookups: no-cache and no-store skip them; writes: no-store skips them.
    assert!(m.contains(r#"granary_gateway_response_cache_total{event="hit"} 2"#), "{m}");
    assert!(m.contains(r#"granary_gateway_response_cache_total{event="miss"} 3"#), "{m}");
    assert!(m.contains(r#"granary_gateway_response_cache_total{event="store"} 4"#), "{m}");
}

#[tokio::test]
async fn cached_answers_expire() {
    let up = fake_upstream().await;
    let mut cfg = cached_config(up.addr);
    cfg.gateway.response_cache.ttl_s = 1;
    let g = Gw::start(cfg).await;
    let key = g.key("acme", json!({})).await;
    let body = json!({"model": "m", "seed": 1, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(ask(&g, &key, &body, None).await.1.as_deref(), Some("miss"));
    assert_eq!(ask(&g, &key, &body, None).await.1.as_deref(), Some("hit"));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(ask(&g, &key, &body, None).await.1.as_deref(), Some("miss"));
}

/// Waits until `g`'s cache writes to Redis (it connects in the background).
async fn connected(g: &Gw, key: &str) {
    for i in 0..200 {
        let probe =
            json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": format!("probe {i}")}]});
        ask(g, key, &probe, None).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if g.metrics().await.contains(r#"granary_gateway_response_cache_total{event="store"}"#) {
            return;
        }
    }
    panic!("the gateway's cache never wrote to Redis");
}

/// Two gateways on one Redis: what one kept, the other answers with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cache_is_shared_by_replicas() {
    let Some(redis) = common::RedisServer::start() else { return };
    let up = fake_upstream().await;
    let start = || async {
        let mut cfg = cached_config(up.addr);
        cfg.gateway.redis = Some(redis.url());
        cfg.gateway.response_cache.backend = granary_gateway::cache::CacheBackend::Redis;
        Gw::start(cfg).await
    };
    let (g1, g2) = (start().await, start().await);
    // Both gateways share the identity only through their own stores: the
    // same tenant id (1) in each.
    let (k1, k2) = (g1.key("acme", json!({})).await, g2.key("acme", json!({})).await);
    connected(&g1, &k1).await;
    connected(&g2, &k2).await;
    let body = json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "shared"}]});
    assert_eq!(ask(&g1, &k1, &body, None).await.1.as_deref(), Some("miss"));
    // The write is in the background: the second gateway's lookup may come first.
    let mut state = None;
    for _ in 0..50 {
        state = ask(&g2, &k2, &body, Some("no-store")).await.1;
        state = match state.as_deref() {
            Some("miss") => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                ask(&g2, &k2, &body, None).await.1
            }
            _ => state,
        };
        if state.as_deref() == Some("hit") {
            break;
        }
    }
    assert_eq!(state.as_deref(), Some("hit"), "the second gateway answers from Redis");
    let keys: Vec<String> =
        redis::cmd("KEYS").arg("granary:cache:*").query_async(&mut redis.client().await).await.unwrap();
    assert!(!keys.is_empty() && keys.iter().all(|k| k.starts_with("granary:cache:{t1}:")), "{keys:?}");
}
