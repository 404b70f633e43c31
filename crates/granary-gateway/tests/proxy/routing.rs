//! Session affinity across replicas and admission hand-off (issue 14,
//! point 4).

use super::*;

/// Issue 14, point 4: two gateway replicas whose configurations list the
/// same upstreams in another order send each session to the same upstream.
#[tokio::test]
async fn issue_14_two_replicas_pin_a_session_to_the_same_upstream() {
    let x = start_upstream("x", Mode::Ok, &["m"]).await;
    let y = start_upstream("y", Mode::Ok, &["m"]).await;
    let session_pool = |c: &mut GatewayConfig| {
        c.pools.push(granary_gateway::config::PoolConfig {
            name: "p".into(),
            upstreams: c.upstreams.iter().map(|u| u.name.clone()).collect(),
            models: vec![],
            routing: granary_gateway::routing::PolicyConfig::Session { header: "x-session-id".into() },
            weight: 100,
        });
    };
    let one = Gw::start(&named(&[("x", x.addr), ("y", y.addr)]), session_pool).await;
    let two = Gw::start(&named(&[("y", y.addr), ("x", x.addr)]), session_pool).await;
    let mut placed = HashMap::new();
    for (g, replica) in [(&one, 1), (&two, 2)] {
        let key = g.key("acme", json!({})).await;
        for i in 0..16 {
            let r = g
                .http
                .post(format!("{}/v1/chat/completions", g.base))
                .bearer_auth(&key)
                .header("x-session-id", format!("conversation-{i}"))
                .json(&chat_body(false))
                .send()
                .await
                .unwrap();
            let v: Value = r.json().await.unwrap();
            let up = v["upstream"].as_str().unwrap().to_string();
            match placed.get(&i) {
                None => {
                    placed.insert(i, up);
                }
                Some(first) => assert_eq!(first, &up, "conversation-{i} on replica {replica}"),
            }
        }
    }
    let used: std::collections::HashSet<&String> = placed.values().collect();
    assert_eq!(used.len(), 2, "sessions spread over both upstreams");
}

/// Issue 14, point 4: two models, one slot each, both full. A premium
/// tenant queues two requests for model a, then a batch tenant one for
/// model b. When b's slot frees, the b request gets it at once; it does
/// not wait behind the premium requests of the other model.
#[tokio::test]
async fn issue_14_a_slot_goes_to_a_waiter_for_its_model() {
    let a = start_upstream_with("a", Mode::Ok, &["ma"], Duration::from_millis(400)).await;
    let b = start_upstream_with("b", Mode::Ok, &["mb"], Duration::from_millis(400)).await;
    let g = Gw::start(&named(&[("a", a.addr), ("b", b.addr)]), |c| {
        c.upstreams[0].max_active = 1;
        c.upstreams[1].max_active = 1;
    })
    .await;
    let (s, _) =
        g.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": "gold", "priority": "premium"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _) =
        g.admin(reqwest::Method::POST, "/admin/v1/tenants", Some(json!({"name": "bulk", "priority": "batch"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let gold = g.key("gold", json!({})).await;
    let bulk = g.key("bulk", json!({})).await;
    let t0 = Instant::now();
    let send = |key: &String, model: &str| {
        let (http, url, k, body) =
            (g.http.clone(), format!("{}/v1/chat/completions", g.base), key.clone(), chat_for(model));
        tokio::spawn(async move {
            let s = http.post(url).bearer_auth(k).json(&body).send().await.unwrap().status();
            (s, t0.elapsed())
        })
    };
    // Both slots taken, then the queue: a, a (premium), b (batch).
    let holders = [send(&bulk, "ma"), send(&bulk, "mb")];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a1 = send(&gold, "ma");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let a2 = send(&gold, "ma");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let wb = send(&bulk, "mb");
    for h in holders {
        assert_eq!(h.await.unwrap().0, 200);
    }
    let (sb, tb) = wb.await.unwrap();
    let (s1, t1) = a1.await.unwrap();
    let (s2, t2) = a2.await.unwrap();
    assert_eq!((s1, s2, sb), (StatusCode::OK, StatusCode::OK, StatusCode::OK));
    assert!(tb < t2, "b's slot went to the b request ({tb:?}), not after the a requests ({t1:?}, {t2:?})");
    assert!(tb < Duration::from_millis(1_100), "served as soon as b's slot freed: {tb:?}");
}
