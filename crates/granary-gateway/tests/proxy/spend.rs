//! Budgets in currency (issue 14, point 2): admission reserves a request's
//! worst-case cost at the model's price, the real cost replaces it when the
//! request ends, and a spent budget is a 429 `insufficient_quota` naming it.

use super::budgets::start_spender;
use super::*;

/// One token of `m` costs 0.001 (1000 per million), in and out.
fn priced(c: &mut GatewayConfig) {
    c.gateway.prices.models.insert(
        "m".into(),
        granary_gateway::pricing::ModelPrice {
            input_per_million: 1000.0,
            cached_input_per_million: None,
            output_per_million: 1000.0,
        },
    );
}

/// Micro-units of currency `tokens` of `m` cost.
fn micros(tokens: u64) -> u64 {
    tokens * 1000
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_concurrent_requests_overshoot_a_spend_budget_by_at_most_one_reservation() {
    let addr = start_spender(5, Duration::from_millis(300)).await;
    let g = Gw::start(&named(&[("a", addr)]), priced).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100});
    // The worst case: the prompt estimate (~4 bytes a token) and max_tokens.
    let reservation = micros(serde_json::to_vec(&body).unwrap().len() as u64 / 4 + 100);
    let cost_each = micros(5 + 100);
    assert!(cost_each <= reservation);
    let budget = 10 * reservation;
    let units = budget as f64 / 1e6;
    let key = g.key("acme", json!({"limits": {"spend_per_day": units}})).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (http, base, key, body) = (g.http.clone(), g.base.clone(), key.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let r = http.post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(&body).send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }));
    }
    let mut ok = 0u64;
    let mut refusal = None;
    for t in tasks {
        let (status, v) = t.await.unwrap();
        assert!(status == 200 || status == 429, "{status} {v}");
        if status == 200 {
            ok += 1;
        } else {
            refusal = Some(v);
        }
    }
    let spent = ok * cost_each;
    assert!(ok >= 1 && spent <= budget + reservation, "{ok} admitted: {spent} µ spent against a budget of {budget}");
    assert!(ok < 50, "the budget must refuse some of 50");
    // OpenAI's shape for a spent quota, naming the budget.
    let v = refusal.unwrap();
    assert_eq!(v["error"]["type"], "insufficient_quota", "{v}");
    assert_eq!(v["error"]["code"], "insufficient_quota", "{v}");
    assert_eq!(v["error"]["param"], "key.spend_per_day", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("spend_per_day"), "{v}");
    // The unused part of each reservation is released: another request fits.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(g.chat(&key, body.clone()).await.status(), 200, "released spend admits another after {ok}");
    let audited: u64 = g.audit().await.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    assert_eq!(audited, (ok + 1) * (5 + 100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_a_request_whose_worst_case_is_over_the_budget_is_refused_outright() {
    let addr = start_spender(5, Duration::ZERO).await;
    let g = Gw::start(&named(&[("a", addr)]), priced).await;
    // 0.05 is 50 tokens of `m`: 1000 max_tokens can never fit.
    let key = g.key("acme", json!({"limits": {"spend_per_month": 0.05}})).await;
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000});
    let r = g.chat(&key, big).await;
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "insufficient_quota", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("worst-case cost"), "{v}");
    // A small one fits; a model without a price costs nothing.
    let small = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
    assert_eq!(g.chat(&key, small).await.status(), 200);
    // A bad amount is refused, naming the field.
    let (s, v) =
        g.admin(reqwest::Method::PATCH, "/admin/v1/tenants/acme", Some(json!({"limits": {"spend_per_day": -2}}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v.to_string().contains("spend_per_day"), "{v}");
}

/// The spend of the month is reloaded from the usage rollup (priced per
/// model) at start: a restart does not give a tenant its money back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_a_restart_keeps_the_month_spend() {
    let addr = start_spender(5, Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("gateway.db").display());
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100});
    let setup = |c: &mut GatewayConfig| {
        priced(c);
        c.gateway.database = db.clone();
    };
    let key = {
        let g = Gw::start(&named(&[("a", addr)]), setup).await;
        let key = g.key("acme", json!({})).await;
        // 0.105 a request; a budget of 0.25 admits three (0, 0.105, 0.21 spent before each).
        let (s, _) = g
            .admin(reqwest::Method::PATCH, "/admin/v1/tenants/acme", Some(json!({"limits": {"spend_per_month": 0.25}})))
            .await;
        assert_eq!(s, StatusCode::OK);
        for _ in 0..3 {
            assert_eq!(g.chat(&key, body.clone()).await.status(), 200);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(g.chat(&key, body.clone()).await.status(), 429);
        g.identity.flush().await;
        key
    };
    let g = Gw::start(&named(&[("a", addr)]), setup).await;
    g.gw.restore_budgets().await;
    let r = g.chat(&key, body.clone()).await;
    assert_eq!(r.status(), 429, "a restart must not reset the month's spend");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "tenant.spend_per_month", "{v}");
    // Without prices the same usage costs nothing: the rollup is priced.
    let g = Gw::start(&named(&[("a", addr)]), |c| c.gateway.database = db.clone()).await;
    g.gw.restore_budgets().await;
    assert_eq!(g.chat(&key, body).await.status(), 200);
}
