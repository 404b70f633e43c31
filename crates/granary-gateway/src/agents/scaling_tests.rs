//! Loads under pressure, with fake heartbeats and fake agents (HTTP servers
//! answering `POST /models/{model}/load` after a delay): the bounded load
//! queue, draining engines leaving routing before they go, replicas kept
//! warm and added under load.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::{Json, Router};

use super::*;
use crate::config::GatewayConfig;
use crate::identity::{Identity, IdentityOptions};
use crate::limits::Limiter;

async fn serve(app: Router) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// An engine that passes health checks.
async fn engine() -> String {
    format!("http://{}", serve(Router::new().route("/health", get(|| async { "ok" }))).await)
}

/// A fake agent: each load takes `delay`, then names a fresh engine.
struct FakeAgent {
    url: String,
    loads: Arc<AtomicUsize>,
}

async fn fake_agent(delay: Duration) -> FakeAgent {
    let loads = Arc::new(AtomicUsize::new(0));
    async fn load(
        State((loads, delay)): State<(Arc<AtomicUsize>, Duration)>,
        Path(model): Path<String>,
    ) -> Json<serde_json::Value> {
        loads.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        Json(serde_json::json!({"model": model, "upstream": engine().await, "kv_events": false}))
    }
    let app = Router::new().route("/models/{model}/load", post(load)).with_state((loads.clone(), delay));
    FakeAgent { url: format!("http://{}", serve(app).await), loads }
}

async fn gateway(tweak: impl FnOnce(&mut GatewayConfig)) -> Arc<Gateway> {
    let mut cfg = GatewayConfig::default();
    cfg.gateway.database = "sqlite::memory:".into();
    cfg.gateway.agents.ttl_ms = 60_000;
    tweak(&mut cfg);
    let identity = Identity::open("sqlite::memory:", IdentityOptions::default()).await.unwrap();
    Gateway::new(&cfg, identity, Limiter::in_process()).unwrap()
}

/// A gateway whose model `m` has these replica settings.
async fn scaled(min_replicas: usize, max_replicas: usize, scale_out_active: usize) -> Arc<Gateway> {
    let s = ModelScaling { min_replicas, max_replicas, scale_out_active };
    gateway(move |c| {
        c.gateway.agents.models.insert("m".into(), s);
    })
    .await
}

fn report(model: &str, upstream: &str, draining: bool) -> EngineReport {
    EngineReport {
        model: model.into(),
        upstream: upstream.into(),
        healthy: true,
        max_active: 0,
        kv_events: false,
        draining,
    }
}

fn beat(agent: &str, url: &str, engines: Vec<EngineReport>, models: &[&str]) -> Heartbeat {
    Heartbeat {
        agent_id: agent.into(),
        url: url.into(),
        token: None,
        engines,
        models: models.iter().map(|m| m.to_string()).collect(),
        weights: vec![],
        resources: None,
        prefetch_room: None,
        ..Default::default()
    }
}

/// The engine `agent` runs for `model`, as the gateway knows it.
fn engine_of(gw: &Gateway, agent: &str, model: &str) -> Option<(String, bool)> {
    let st = gw.agents.state.lock();
    st.get(agent)?.engines.get(model).map(|e| (e.upstream.cfg.url.clone(), e.draining))
}

#[tokio::test]
async fn requests_wait_for_a_load_and_a_full_queue_turns_the_rest_away() {
    let gw = gateway(|c| c.gateway.agents.load_queue = 3).await;
    let agent = fake_agent(Duration::from_millis(400)).await;
    gw.heartbeat(beat("node-a", &agent.url, vec![], &["m"])).unwrap();
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let gw = gw.clone();
            tokio::spawn(async move { gw.load_model("m").await })
        })
        .collect();
    let mut ok = 0;
    let mut full = Vec::new();
    for c in calls {
        match c.await.unwrap() {
            Ok(()) => ok += 1,
            Err(e) => full.push(e),
        }
    }
    assert_eq!(ok, 3, "the queue's three wait for the load and get the model: {full:?}");
    assert_eq!(full.len(), 2);
    for e in &full {
        assert_eq!(e.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, Some("model_load_queue_full"));
        assert_eq!(e.retry_after, Some(LOAD_RETRY_AFTER));
        assert!(e.message.contains("`m`") && e.message.contains("load_queue"), "{}", e.message);
    }
    assert_eq!(agent.loads.load(Ordering::SeqCst), 1, "one load for all of them");
    assert_eq!(gw.agents.queued("m"), 0, "the queue empties as its requests go");
    assert!(gw.serves("m"));
    // Served now: nobody queues.
    gw.load_model("m").await.unwrap();
}

#[tokio::test]
async fn a_draining_engine_leaves_routing_and_its_requests_are_counted_until_done() {
    let gw = gateway(|_| {}).await;
    let agent = fake_agent(Duration::ZERO).await;
    let e = engine().await;
    gw.heartbeat(beat("node-a", &agent.url, vec![report("m", &e, false)], &["m"])).unwrap();
    let u = gw.upstreams.by_name("agent:node-a:m").unwrap();
    let slot = u.try_acquire().unwrap();
    assert!(gw.draining_active("node-a").is_empty());

    // Draining: out of routing before the heartbeat returns, its request
    // in flight still counted for the agent.
    gw.heartbeat(beat("node-a", &agent.url, vec![report("m", &e, true)], &["m"])).unwrap();
    assert!(!gw.serves("m"), "no new request goes to a draining engine");
    assert!(gw.agents.can_load("m"), "a request for it asks for a load instead");
    assert_eq!(gw.draining_active("node-a"), BTreeMap::from([("m".to_string(), 1)]));
    let view = &gw.agents_view()[0].engines[0];
    assert!(view.draining && !view.routable, "{view:?}");
    drop(slot);
    assert_eq!(gw.draining_active("node-a"), BTreeMap::from([("m".to_string(), 0)]));

    // A load answer naming it takes it back (the agent stopped the drain).
    gw.engine_loaded("node-a", "m", &e, false).unwrap();
    assert!(gw.serves("m"));
    assert_eq!(engine_of(&gw, "node-a", "m"), Some((e.clone(), false)));
    assert!(gw.draining_active("node-a").is_empty());
    // So does a heartbeat no longer saying draining.
    gw.heartbeat(beat("node-a", &agent.url, vec![report("m", &e, true)], &["m"])).unwrap();
    assert!(!gw.serves("m"));
    gw.heartbeat(beat("node-a", &agent.url, vec![report("m", &e, false)], &["m"])).unwrap();
    assert!(gw.serves("m"));
    // Drained and stopped: it leaves for good.
    gw.heartbeat(beat("node-a", &agent.url, vec![report("m", &e, true)], &["m"])).unwrap();
    gw.heartbeat(beat("node-a", &agent.url, vec![], &["m"])).unwrap();
    assert_eq!(engine_of(&gw, "node-a", "m"), None);
    assert!(gw.draining_active("node-a").is_empty());
    // An engine first heard of as draining is never routed.
    gw.heartbeat(beat("node-a", &agent.url, vec![report("m", &e, true)], &["m"])).unwrap();
    assert!(!gw.serves("m"));
}

/// Waits until no load of `model` is in progress.
async fn loads_done(gw: &Gateway, model: &str) {
    for _ in 0..400 {
        if !gw.agents.loads.lock().contains_key(model) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the load of {model} did not end");
}

#[tokio::test]
async fn min_replicas_are_loaded_on_distinct_agents_and_kept_warm() {
    let gw = scaled(2, 2, 0).await;
    let (a, b, c) =
        (fake_agent(Duration::ZERO).await, fake_agent(Duration::ZERO).await, fake_agent(Duration::ZERO).await);
    assert!(gw.reconcile_replicas().is_empty(), "no agent can load it yet");
    gw.heartbeat(beat("node-a", &a.url, vec![], &["m"])).unwrap();
    gw.heartbeat(beat("node-b", &b.url, vec![], &["m", "x"])).unwrap();
    assert_eq!(gw.reconcile_replicas(), vec![("m".to_string(), "min_replicas")]);
    assert!(gw.reconcile_replicas().is_empty(), "one load per model at a time");
    loads_done(&gw, "m").await;
    assert_eq!(gw.reconcile_replicas(), vec![("m".to_string(), "min_replicas")]);
    loads_done(&gw, "m").await;
    assert!(gw.reconcile_replicas().is_empty(), "two engines: enough");
    assert_eq!((a.loads.load(Ordering::SeqCst), b.loads.load(Ordering::SeqCst)), (1, 1), "one on each agent");
    assert_eq!(gw.replicas("m").engines, 2);
    // Each is needed for the count: neither agent may unload its engine for idleness.
    assert_eq!(gw.keep_warm("node-a"), vec!["m".to_string()]);
    assert_eq!(gw.keep_warm("node-b"), vec!["m".to_string()]);

    // A third agent with an engine of its own: any one of them may go, but
    // once one drains, the other two are kept.
    let e = engine().await;
    gw.heartbeat(beat("node-c", &c.url, vec![report("m", &e, false)], &["m"])).unwrap();
    assert!(gw.keep_warm("node-c").is_empty() && gw.keep_warm("node-a").is_empty());
    gw.heartbeat(beat("node-c", &c.url, vec![report("m", &e, true)], &["m"])).unwrap();
    assert_eq!(gw.keep_warm("node-a"), vec!["m".to_string()]);
    assert!(gw.keep_warm("node-c").is_empty(), "two others serve: the draining one goes");
    // A model without an entry is never kept.
    let e2 = engine().await;
    gw.heartbeat(beat("node-c", &c.url, vec![report("x", &e2, false)], &["m", "x"])).unwrap();
    assert!(gw.keep_warm("node-c").is_empty());

    // All three draining at once (their agents saw them idle together):
    // the first two by name are kept, the third goes; none kept would fall
    // under min_replicas, all kept would never scale in.
    let a_engine = engine_of(&gw, "node-a", "m").unwrap().0;
    let b_engine = engine_of(&gw, "node-b", "m").unwrap().0;
    let e3 = engine().await;
    gw.heartbeat(beat("node-c", &c.url, vec![report("m", &e3, true)], &["m"])).unwrap();
    gw.heartbeat(beat("node-a", &a.url, vec![report("m", &a_engine, true)], &["m"])).unwrap();
    gw.heartbeat(beat("node-b", &b.url, vec![report("m", &b_engine, true)], &["m"])).unwrap();
    let kept: Vec<bool> = ["node-a", "node-b", "node-c"].iter().map(|n| !gw.keep_warm(n).is_empty()).collect();
    assert_eq!(kept, [true, true, false]);
    gw.heartbeat(beat("node-a", &a.url, vec![report("m", &a_engine, false)], &["m"])).unwrap();
    gw.heartbeat(beat("node-b", &b.url, vec![report("m", &b_engine, false)], &["m"])).unwrap();
    gw.heartbeat(beat("node-c", &c.url, vec![], &["m"])).unwrap();

    // An engine that goes away is replaced.
    let a_engine = engine_of(&gw, "node-a", "m").unwrap().0;
    gw.heartbeat(beat("node-a", &a.url, vec![report("m", &a_engine, false)], &["m"])).unwrap();
    gw.heartbeat(beat("node-a", &a.url, vec![], &["m"])).unwrap();
    assert_eq!(gw.replicas("m").engines, 1);
    assert_eq!(gw.reconcile_replicas(), vec![("m".to_string(), "min_replicas")]);
    loads_done(&gw, "m").await;
    assert_eq!(gw.replicas("m").engines, 2);
}

#[tokio::test]
async fn busy_engines_scale_out_to_another_agent_up_to_max_replicas() {
    let gw = scaled(0, 2, 2).await;
    let (a, b) = (fake_agent(Duration::ZERO).await, fake_agent(Duration::ZERO).await);
    let e = engine().await;
    gw.heartbeat(beat("node-a", &a.url, vec![report("m", &e, false)], &["m"])).unwrap();
    gw.heartbeat(beat("node-b", &b.url, vec![], &["m"])).unwrap();
    let u = gw.upstreams.by_name("agent:node-a:m").unwrap();
    let mut slots: Vec<_> = (0..2).map(|_| u.try_acquire().unwrap()).collect();
    assert!(gw.reconcile_replicas().is_empty(), "2 in flight on 1 engine: not over 2 each");
    slots.push(u.try_acquire().unwrap());
    assert_eq!(gw.reconcile_replicas(), vec![("m".to_string(), "scale_out")]);
    loads_done(&gw, "m").await;
    assert_eq!(a.loads.load(Ordering::SeqCst), 0, "not on the agent that runs it already");
    assert_eq!(b.loads.load(Ordering::SeqCst), 1);
    assert_eq!(gw.replicas("m"), scaling::Replicas { engines: 2, active: 3, spare_agent: false });
    slots.extend((0..5).map(|_| u.try_acquire().unwrap()));
    assert!(gw.reconcile_replicas().is_empty(), "max_replicas reached");
    assert!(gw.keep_warm("node-a").is_empty(), "min_replicas 0: nothing kept");
    drop(slots);
    // With no agent to spare, nothing is tried either.
    let gw1 = scaled(0, 3, 1).await;
    gw1.heartbeat(beat("node-a", &a.url, vec![report("m", &e, false)], &["m"])).unwrap();
    let u1 = gw1.upstreams.by_name("agent:node-a:m").unwrap();
    let _busy: Vec<_> = (0..4).map(|_| u1.try_acquire().unwrap()).collect();
    assert!(gw1.reconcile_replicas().is_empty());
}

/// Engines with `max_active`: once full, requests wait in the gateway's
/// admission queue, not on the engines; those waiting count toward
/// `scale_out_active` as much as those in flight.
#[tokio::test]
async fn requests_queued_at_the_gateway_for_full_engines_scale_out_too() {
    let gw = scaled(0, 2, 2).await;
    let (a, b) = (fake_agent(Duration::ZERO).await, fake_agent(Duration::ZERO).await);
    let e = engine().await;
    let full = EngineReport { max_active: 2, ..report("m", &e, false) };
    gw.heartbeat(beat("node-a", &a.url, vec![full], &["m"])).unwrap();
    gw.heartbeat(beat("node-b", &b.url, vec![], &["m"])).unwrap();
    let u = gw.upstreams.by_name("agent:node-a:m").unwrap();
    let _slots: Vec<_> = (0..2).map(|_| u.try_acquire().unwrap()).collect();
    assert!(u.try_acquire().is_none(), "the engine takes two at a time");
    assert!(gw.reconcile_replicas().is_empty(), "2 on 1 engine: not over 2");
    // A request waits at the gateway for that engine.
    let (gw2, id) = (gw.clone(), u.id);
    let waiter = tokio::spawn(async move {
        gw2.admission.acquire(crate::types::Priority::Standard, &[id], Duration::from_secs(30), || None).await
    });
    while gw.admission.waiting_for(&[id]) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(gw.replicas("m").active, 3);
    assert_eq!(gw.reconcile_replicas(), vec![("m".to_string(), "scale_out")]);
    loads_done(&gw, "m").await;
    assert_eq!(b.loads.load(Ordering::SeqCst), 1);
    waiter.abort();
}
