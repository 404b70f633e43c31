//! Third-party upstreams: Granary headers and upstream keys, health paths,
//! model aliases and fallbacks (issue 14, point 3).

use super::*;

/// Issue 14, point 3: `x-granary-namespace` (the tenant's name) reaches
/// Granary engines only, configured or detected by their `/v1/kv/config`;
/// an upstream's API key replaces the client's `Authorization`, and no
/// upstream ever sees the client's key.
#[tokio::test]
async fn issue_14_granary_headers_only_to_granary_engines_and_upstream_keys_replace_the_clients() {
    let x = |kv_config| Extras { health: true, kv_config };
    let eng = start_upstream_full("eng", Mode::Ok, &["m1"], Duration::ZERO, x(true)).await;
    let third = start_upstream_full("third", Mode::Ok, &["m2"], Duration::ZERO, x(false)).await;
    let off = start_upstream_full("off", Mode::Ok, &["m3"], Duration::ZERO, x(true)).await;
    let marked = start_upstream_full("marked", Mode::Ok, &["m4"], Duration::ZERO, x(false)).await;
    std::env::set_var("GRANARY_TEST_THIRD_PARTY_KEY", "sk-third-party");
    let ups = named(&[("eng", eng.addr), ("third", third.addr), ("off", off.addr), ("marked", marked.addr)]);
    let g = Gw::start(&ups, |c| {
        c.upstreams[1].api_key_env = Some("GRANARY_TEST_THIRD_PARTY_KEY".into());
        c.upstreams[2].granary = Some(false);
        c.upstreams[3].granary = Some(true);
    })
    .await;
    let key = g.key("acme", json!({})).await;
    for model in ["m1", "m2", "m3", "m4"] {
        let r = g.chat(&key, chat_for(model)).await;
        assert_eq!(r.status(), 200, "{model}: {}", r.text().await.unwrap());
    }
    let seen = |u: &Upstream| {
        let s = u.seen.lock();
        (s.namespaces.clone(), s.auths.clone())
    };
    let none = vec!["<none>".to_string()];
    let acme = vec!["acme".to_string()];
    assert_eq!(seen(&eng), (acme.clone(), none.clone()), "a detected Granary engine gets the namespace");
    assert_eq!(
        seen(&third),
        (none.clone(), vec!["Bearer sk-third-party".to_string()]),
        "a third party gets its own key and no namespace"
    );
    assert_eq!(seen(&off), (none.clone(), none.clone()), "granary = false: never, even if it looks like one");
    assert_eq!(seen(&marked), (acme, none), "granary = true: always");
}

/// Issue 14, point 3: an upstream without `GET /health` is down under the
/// default health path, up with another path or with passive health; under
/// passive health the breaker is driven by requests alone.
#[tokio::test]
async fn issue_14_health_path_or_passive_health() {
    let no_health = Extras { health: false, kv_config: false };
    let a = start_upstream_full("a", Mode::Ok, &["n1"], Duration::ZERO, no_health).await;
    let b = start_upstream_full("b", Mode::Ok, &["n2"], Duration::ZERO, no_health).await;
    let c = start_upstream_full("c", Mode::Ok, &["n3"], Duration::ZERO, no_health).await;
    let dead = dead_addr().await;
    let ups = named(&[("a", a.addr), ("b", b.addr), ("c", c.addr), ("dead", dead)]);
    let g = Gw::start(&ups, |cfg| {
        cfg.gateway.max_attempts = 1;
        cfg.gateway.breaker.failures = 2;
        cfg.gateway.breaker.open_ms = 60_000;
        cfg.upstreams[0].models = vec!["n1".into()];
        cfg.upstreams[1].health_path = String::new();
        cfg.upstreams[2].health_path = "/v1/models".into();
        cfg.upstreams[3].health_path = String::new();
        cfg.upstreams[3].models = vec!["n4".into()];
    })
    .await;
    let key = g.key("acme", json!({})).await;
    assert_eq!(g.chat(&key, chat_for("n1")).await.status(), 503, "no /health: down");
    assert_eq!(g.chat(&key, chat_for("n2")).await.status(), 200, "passive: up");
    assert_eq!(g.chat(&key, chat_for("n3")).await.status(), 200, "its own health path");
    // Passive and dead: each request fails until the breaker opens; then no
    // attempt is made.
    assert_eq!(g.chat(&key, chat_for("n4")).await.status(), 502);
    assert_eq!(g.chat(&key, chat_for("n4")).await.status(), 502);
    assert_eq!(g.chat(&key, chat_for("n4")).await.status(), 503);
    let m = g.metrics().await;
    assert!(m.contains(r#"granary_gateway_upstream_breaker_state{upstream="dead"} 2"#), "{m}");
    assert!(m.contains(r#"granary_gateway_upstream_attempts_total{upstream="dead",outcome="connect_error"} 2"#), "{m}");
    assert_eq!(a.hits.load(Ordering::SeqCst), 0);
}

/// Issue 14, point 3: `model_map` renames a model for one upstream, and a
/// model whose upstreams fail falls back to another model by
/// `[gateway.model_fallbacks]` (only for keys that may use it).
#[tokio::test]
async fn issue_14_model_aliases_and_fallbacks() {
    let big = start_upstream("big", Mode::Ok, &["org/big-v2"]).await;
    let small = start_upstream("small", Mode::Ok, &["small"]).await;
    let g = Gw::start(&named(&[("big", big.addr), ("small", small.addr)]), |c| {
        c.upstreams[0].model_map.insert("big".into(), "org/big-v2".into());
        c.gateway.model_fallbacks.insert("big".into(), vec!["small".into()]);
    })
    .await;
    let key = g.key("acme", json!({})).await;
    assert_eq!(model_ids(&g, &key).await, vec!["big", "small"], "clients see the client name");
    let v: Value = g.chat(&key, chat_for("big")).await.json().await.unwrap();
    assert_eq!(v["upstream"], "big", "{v}");
    assert_eq!(big.seen.lock().bodies[0]["model"], "org/big-v2", "the upstream gets its own name");

    // The big model's upstream fails: the fallback answers.
    let broken = start_upstream("big", Mode::Fail500, &["org/big-v2"]).await;
    let small = start_upstream("small", Mode::Ok, &["small"]).await;
    let g = Gw::start(&named(&[("big", broken.addr), ("small", small.addr)]), |c| {
        c.upstreams[0].model_map.insert("big".into(), "org/big-v2".into());
        c.gateway.model_fallbacks.insert("big".into(), vec!["small".into()]);
    })
    .await;
    let key = g.key("acme", json!({})).await;
    let only_big = g.key("acme", json!({"models": ["big"]})).await;
    let r = g.chat(&key, chat_for("big")).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["upstream"], "small", "{v}");
    assert_eq!(small.seen.lock().bodies[0]["model"], "small");
    assert_eq!(g.chat(&only_big, chat_for("big")).await.status(), 502, "no fallback to a model the key may not use");
    let audit = g.audit().await;
    let served: Vec<(u16, Option<String>)> = audit.iter().map(|r| (r.status, r.model.clone())).collect();
    assert!(served.contains(&(200, Some("small".into()))), "the fallback model is what is metered: {served:?}");

    // No upstream serves the model at all: still its fallback, not 404.
    let small = start_upstream("small", Mode::Ok, &["small"]).await;
    let g = Gw::start(&named(&[("small", small.addr)]), |c| {
        c.gateway.model_fallbacks.insert("gone".into(), vec!["small".into()]);
    })
    .await;
    let key = g.key("acme", json!({})).await;
    assert_eq!(g.chat(&key, chat_for("gone")).await.status(), 200);
    assert_eq!(g.chat(&key, chat_for("other")).await.status(), 404);
}
