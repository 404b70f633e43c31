//! The dynamic upstream set as heartbeats drive it: engines join, change,
//! leave; silent agents expire; a loaded engine survives a heartbeat older
//! than its load; what a removed upstream left behind (KV index entries,
//! metric series) goes with it; configured upstreams are never touched.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use granary_core::hash::HashChain;

use super::*;
use crate::config::{GatewayConfig, UpstreamConfig};
use crate::identity::{Identity, IdentityOptions};
use crate::limits::Limiter;
use crate::types::{Limits, Priority};

/// An HTTP server that passes health checks (an engine's `/health`).
async fn healthy_server() -> SocketAddr {
    let app = Router::new().route("/health", get(|| async { "ok" }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

async fn gateway(tweak: impl FnOnce(&mut GatewayConfig)) -> Arc<Gateway> {
    let mut cfg = GatewayConfig::default();
    cfg.gateway.database = "sqlite::memory:".into();
    cfg.gateway.agents.ttl_ms = 1_000;
    tweak(&mut cfg);
    let identity = Identity::open("sqlite::memory:", IdentityOptions::default()).await.unwrap();
    Gateway::new(&cfg, identity, Limiter::in_process()).unwrap()
}

fn hb(agent: &str, engines: &[(&str, String, bool)], models: &[&str]) -> Heartbeat {
    Heartbeat {
        agent_id: agent.into(),
        url: "http://127.0.0.1:9".into(),
        token: None,
        engines: engines
            .iter()
            .map(|(m, u, healthy)| EngineReport {
                model: m.to_string(),
                upstream: u.clone(),
                healthy: *healthy,
                max_active: 0,
                kv_events: false,
                draining: false,
            })
            .collect(),
        models: models.iter().map(|m| m.to_string()).collect(),
        weights: vec![],
        resources: None,
        prefetch_room: None,
        ..Default::default()
    }
}

#[tokio::test]
async fn loads_go_where_the_weights_are_closest() {
    let gw = gateway(|_| {}).await;
    let weights = |tier: &str| {
        vec![WeightsReport {
            model: "m".into(),
            revision: "r1".into(),
            tier: tier.into(),
            bytes: 0,
            checkpoint: None,
            ..Default::default()
        }]
    };
    let free = |mib: u64| Some(ResourcesReport { host_memory_free: mib << 20, gpus: vec![] });
    // far: nothing here, idle, most memory; disk: weights on disk, one
    // engine; ram: weights in RAM, two engines; ram2: the same with less memory.
    gw.heartbeat(Heartbeat { resources: free(64_000), ..hb("far", &[], &["m"]) }).unwrap();
    let one = vec![("x", "http://127.0.0.1:10".to_string(), true)];
    gw.heartbeat(Heartbeat { weights: weights("disk"), resources: free(8_000), ..hb("disk", &one, &["m", "x"]) })
        .unwrap();
    let two = vec![("x", "http://127.0.0.1:11".to_string(), true), ("y", "http://127.0.0.1:12".to_string(), true)];
    gw.heartbeat(Heartbeat { weights: weights("ram"), resources: free(4_000), ..hb("ram", &two, &["m", "x", "y"]) })
        .unwrap();
    let two_more = vec![("x", "http://127.0.0.1:13".to_string(), true), ("y", "http://127.0.0.1:14".to_string(), true)];
    gw.heartbeat(Heartbeat {
        weights: weights("ram"),
        resources: free(2_000),
        ..hb("ram2", &two_more, &["m", "x", "y"])
    })
    .unwrap();
    // disk-ck: weights on disk with the engine's converted-weight
    // checkpoint, but busier than disk: it starts without converting.
    let three = vec![
        ("x", "http://127.0.0.1:15".to_string(), true),
        ("y", "http://127.0.0.1:16".to_string(), true),
        ("z", "http://127.0.0.1:17".to_string(), true),
    ];
    let mut with_checkpoint = weights("disk");
    with_checkpoint[0].checkpoint = Some("disk".into());
    gw.heartbeat(Heartbeat {
        weights: with_checkpoint,
        resources: free(1_000),
        ..hb("disk-ck", &three, &["m", "x", "y", "z"])
    })
    .unwrap();
    let order: Vec<String> = gw.agents.load_targets("m").into_iter().map(|t| t.agent_id).collect();
    assert_eq!(order, ["ram", "ram2", "disk-ck", "disk", "far"]);
    let why = gw.agents.load_targets("m")[0].why.clone();
    // No sizes reported: every estimate is the default start cost, and
    // the tier decides.
    assert_eq!(
        why,
        "ram (est. 200 ms: fetch 0 + read 0 + convert 0 + start 200 + queue 0; weights: ram, 2 engine(s), 4000 MiB free)"
    );
    let why = gw.agents.load_targets("m")[2].why.clone();
    assert!(
        why.starts_with("disk-ck (est. 200 ms")
            && why.ends_with("weights: disk + checkpoint, 3 engine(s), 1000 MiB free)"),
        "{why}"
    );
    // Without locality reports, fewest engines first (then the name).
    let order: Vec<String> = gw.agents.load_targets("x").into_iter().map(|t| t.agent_id).collect();
    assert_eq!(order, ["disk", "ram", "ram2", "disk-ck"]);
}

/// The estimate decides, ServerlessLLM-style: a checkpoint on disk beats
/// weights in RAM that must be converted, a fast network can beat a slow
/// disk, and loads under way on an agent (this gateway's or another's)
/// push it back.
#[tokio::test]
async fn loads_go_where_the_first_token_is_estimated_soonest() {
    const MB: u64 = 1_000_000;
    let gw = gateway(|_| {}).await;
    let profile = |ram: u64, disk: u64, net: u64| estimate::LoadProfileReport {
        ram_read_bps: Some(ram * MB),
        disk_read_bps: Some(disk * MB),
        download_bps: Some(net * MB),
        start_ms: Some(100),
    };
    let held = |tier: &str, checkpoint: Option<&str>, convert_ms: Option<u64>| {
        vec![WeightsReport {
            model: "m".into(),
            revision: "r1".into(),
            tier: tier.into(),
            bytes: 100 * MB,
            checkpoint: checkpoint.map(String::from),
            checkpoint_bytes: if checkpoint.is_some() { 140 * MB } else { 0 },
            convert_ms,
        }]
    };
    // ram: weights in RAM, converted in 1500 ms at its last start.
    gw.heartbeat(Heartbeat {
        weights: held("ram", None, Some(1500)),
        load_profile: profile(1000, 500, 100),
        ..hb("ram", &[], &["m"])
    })
    .unwrap();
    // disk-ck: weights and checkpoint on disk.
    gw.heartbeat(Heartbeat {
        weights: held("disk", Some("disk"), Some(1400)),
        load_profile: profile(1000, 500, 100),
        ..hb("disk-ck", &[], &["m"])
    })
    .unwrap();
    // far: nothing there, but a fast network; no start measured yet.
    gw.heartbeat(Heartbeat {
        load_profile: estimate::LoadProfileReport { download_bps: Some(1000 * MB), ..Default::default() },
        ..hb("far", &[], &["m"])
    })
    .unwrap();
    let targets = gw.agents.load_targets("m");
    let order: Vec<&str> = targets.iter().map(|t| t.agent_id.as_str()).collect();
    assert_eq!(order, ["disk-ck", "ram", "far"]);
    assert_eq!(
        targets[0].why,
        "disk-ck (est. 380 ms: fetch 0 + read 280 + convert 0 + start 100 + queue 0; weights: disk + checkpoint, 0 engine(s), 0 MiB free)"
    );
    assert!(
        targets[1].why.starts_with("ram (est. 1700 ms: fetch 0 + read 100 + convert 1500 + start 100"),
        "{}",
        targets[1].why
    );
    // far measured only its download: it converts as measured elsewhere
    // (disk-ck's 1400 ms, the latest heard), and reads and starts as the
    // fleet does (the median of the others: 0.5 GB/s, 100 ms).
    assert!(
        targets[2].why.starts_with("far (est. 1800 ms: fetch 100 + read 200 + convert 1400 + start 100"),
        "{}",
        targets[2].why
    );

    // Two loads another gateway started on disk-ck: each as long as this
    // one would be (2 x 380), still first; four put it behind ram (an
    // estimate near the best, within 20% + 50 ms, is taken as equal and
    // the closer tier wins).
    let busy = |n: usize| Heartbeat {
        weights: held("disk", Some("disk"), Some(1400)),
        load_profile: profile(1000, 500, 100),
        starting: n,
        ..hb("disk-ck", &[], &["m"])
    };
    gw.heartbeat(busy(2)).unwrap();
    assert_eq!(gw.agents.load_targets("m")[0].agent_id, "disk-ck");
    gw.heartbeat(busy(4)).unwrap();
    let targets = gw.agents.load_targets("m");
    assert_eq!(targets[0].agent_id, "ram");
    assert!(targets[1].why.contains("est. 1900 ms") && targets[1].why.contains("queue 1520"), "{}", targets[1].why);
    // This gateway's own load under way on disk-ck counts once, by what it
    // has left, not again as one of the agent's starting engines.
    gw.heartbeat(busy(1)).unwrap();
    let first = gw.agents.load_targets("m").remove(0);
    let guard = gw.agents.underway(&first);
    let again = gw.agents.load_targets("m");
    let q = again.iter().find(|t| t.agent_id == "disk-ck").unwrap();
    assert!(q.why.contains("queue 38") || q.why.contains("queue 37"), "{}", q.why);
    drop(guard);
    gw.heartbeat(busy(0)).unwrap();
    assert!(gw.agents.load_targets("m")[0].why.contains("queue 0;"));

    // Near the best (450 against 380, within 20% + 50 ms) counts as equal:
    // the checkpoint in RAM wins on its tier; the measurements would not
    // tell the two apart.
    gw.heartbeat(Heartbeat {
        weights: held("ram", Some("ram"), Some(1500)),
        load_profile: profile(400, 500, 100),
        ..hb("ram-ck", &[], &["m"])
    })
    .unwrap();
    let targets = gw.agents.load_targets("m");
    let order: Vec<&str> = targets.iter().map(|t| t.agent_id.as_str()).collect();
    assert_eq!(order, ["ram-ck", "disk-ck", "ram", "far"]);
    assert!(targets[0].why.starts_with("ram-ck (est. 450 ms: fetch 0 + read 350"), "{}", targets[0].why);
}

/// `placement = "fewest_engines"`: the weights' tier is not looked at.
#[tokio::test]
async fn fewest_engines_placement_ignores_the_weights() {
    let gw = gateway(|c| c.gateway.agents.placement = crate::config::Placement::FewestEngines).await;
    let weights = vec![WeightsReport {
        model: "m".into(),
        revision: "r1".into(),
        tier: "ram".into(),
        bytes: 0,
        checkpoint: None,
        ..Default::default()
    }];
    let free = |mib: u64| Some(ResourcesReport { host_memory_free: mib << 20, gpus: vec![] });
    let one = vec![("x", "http://127.0.0.1:10".to_string(), true)];
    gw.heartbeat(Heartbeat { weights, resources: free(8_000), ..hb("ram", &one, &["m", "x"]) }).unwrap();
    gw.heartbeat(Heartbeat { resources: free(4_000), ..hb("far", &[], &["m"]) }).unwrap();
    let targets = gw.agents.load_targets("m");
    let order: Vec<&str> = targets.iter().map(|t| t.agent_id.as_str()).collect();
    assert_eq!(order, ["far", "ram"]);
    assert_eq!((targets[0].tier, targets[1].tier), (2, 0), "the tier is still known, for the header");
}

/// Prefetch through the gateway: requests served by an agent's engine make
/// their tenant its own; the heartbeat answer names the tenant's other
/// models; the next heartbeat showing one in RAM counts it done, and a
/// load there counts a hit, once.
#[tokio::test]
async fn heartbeat_answers_name_the_models_to_prefetch() {
    let gw = gateway(|c| c.gateway.agents.prefetch = true).await;
    let up = healthy_server().await;
    let free = Some(ResourcesReport { host_memory_free: 1 << 30, gpus: vec![] });
    gw.heartbeat(Heartbeat {
        resources: free.clone(),
        ..hb("n1", &[("a", format!("http://{up}"), true)], &["a", "b", "c"])
    })
    .unwrap();
    gw.heartbeat(hb("n2", &[], &["a", "b", "c"])).unwrap();
    assert!(gw.prefetch_for("n1").is_empty(), "no history yet");
    gw.observe_request(Some("t"), Some("a"), Some("agent:n1:a"));
    for _ in 0..3 {
        gw.observe_request(Some("t"), Some("b"), None);
    }
    gw.observe_request(Some("t"), Some("c"), None);
    gw.observe_request(Some("u"), Some("c"), None);
    let asked: Vec<String> = gw.prefetch_for("n1").into_iter().map(|p| p.model).collect();
    assert_eq!(asked, ["b", "c"], "t's models by count; `a` runs there");
    assert!(gw.prefetch_for("n2").is_empty(), "n2 served no tenant");
    let count = |event: &str| gw.metrics.prefetch.get_or_create(&vec![("event", event.to_string())]).get();
    gw.prefetch_for("n1");
    assert_eq!(count("asked"), 2, "asked once per agent and model");
    let in_ram = |m: &str| WeightsReport {
        model: m.into(),
        revision: "r".into(),
        tier: "ram".into(),
        bytes: 100,
        checkpoint: None,
        ..Default::default()
    };
    gw.heartbeat(Heartbeat {
        weights: vec![in_ram("b")],
        resources: free,
        ..hb("n1", &[("a", format!("http://{up}"), true)], &["a", "b", "c"])
    })
    .unwrap();
    assert_eq!(count("done"), 1);
    let asked: Vec<String> = gw.prefetch_for("n1").into_iter().map(|p| p.model).collect();
    assert_eq!(asked, ["c"], "held in RAM now");
    assert_eq!(gw.agents.model_bytes.lock().get("b"), Some(&100));
    assert!(gw.agents.prefetch_hit("n1", "b"));
    assert!(!gw.agents.prefetch_hit("n1", "b"), "one hit per prefetch");
    assert!(!gw.agents.prefetch_hit("n1", "c"), "asked, not yet done");
}

fn anyone() -> Principal {
    Principal {
        key_id: 1,
        key_prefix: "gk_test".into(),
        tenant_id: 1,
        tenant: "t".into(),
        namespace: "t".into(),
        models: None,
        priority: Priority::Standard,
        key_limits: Limits::default(),
        tenant_limits: Limits::default(),
        log_prompts: false,
    }
}

use crate::types::Principal;

fn names(gw: &Gateway) -> Vec<String> {
    gw.upstreams.list().iter().map(|u| u.name().to_string()).collect()
}

#[tokio::test]
async fn heartbeats_add_change_and_drop_engines() {
    let gw = gateway(|_| {}).await;
    let (a, b) = (healthy_server().await, healthy_server().await);
    assert!(!gw.serves("m"));
    gw.heartbeat(hb("node-a", &[("m", format!("http://{a}"), true)], &["m", "n"])).unwrap();
    assert_eq!(names(&gw), vec!["agent:node-a:m"]);
    assert!(gw.serves("m"), "routing follows before the heartbeat returns");
    assert_eq!(gw.models_for(&anyone()), vec!["m", "n"], "served and loadable models");
    let first = gw.upstreams.by_name("agent:node-a:m").unwrap();
    assert!(first.is_routable());
    assert_eq!(first.origin, Origin::Agent { agent_id: "node-a".into(), model: "m".into() });

    // Reported unhealthy: still there, no traffic.
    gw.heartbeat(hb("node-a", &[("m", format!("http://{a}"), false)], &["m"])).unwrap();
    let same = gw.upstreams.by_name("agent:node-a:m").unwrap();
    assert_eq!(same.id, first.id, "an unchanged engine keeps its upstream");
    assert!(!same.is_routable());
    assert!(gw.serves("m"));
    gw.heartbeat(hb("node-a", &[("m", format!("http://{a}"), true)], &["m"])).unwrap();
    assert!(same.is_routable());

    // What the KV index knows of it goes when it moves to another port.
    let chain = HashChain::new("t", b"f", b"l", 4);
    let blocks = chain.hashes(&(0..16).collect::<Vec<u32>>());
    gw.upstreams.index.insert(first.id, &blocks);
    first.export();
    assert!(gw.metrics.render().contains("agent:node-a:m"));
    gw.heartbeat(hb("node-a", &[("m", format!("http://{b}"), true)], &["m"])).unwrap();
    let moved = gw.upstreams.by_name("agent:node-a:m").unwrap();
    assert_ne!(moved.id, first.id, "ids are never reused");
    assert_eq!(moved.cfg.url, format!("http://{b}"));
    assert!(first.is_removed());
    assert_eq!(gw.upstreams.index.blocks(first.id), 0, "the KV index forgot the old engine");
    assert_eq!(names(&gw).len(), 1);

    // A second agent with the same model: two upstreams in the model's pool.
    gw.heartbeat(hb("node-b", &[("m", format!("http://{a}"), true)], &[])).unwrap();
    assert_eq!(names(&gw), vec!["agent:node-a:m", "agent:node-b:m"]);

    // Dropped from the report: gone, series and all.
    gw.heartbeat(hb("node-a", &[], &["m"])).unwrap();
    gw.heartbeat(hb("node-b", &[], &[])).unwrap();
    assert!(names(&gw).is_empty());
    assert!(!gw.serves("m"));
    assert!(gw.agents.can_load("m"), "node-a still lists it");
    assert!(!gw.agents.can_load("n"), "nobody lists it any more");
    let text = gw.metrics.render();
    assert!(!text.contains("agent:node-a:m"), "{text}");
    // A request finishing late on a removed upstream brings nothing back.
    moved.export();
    moved.attempt("ok");
    assert!(!gw.metrics.render().contains("agent:node-a:m"));
}

#[tokio::test]
async fn silent_agents_expire_after_the_ttl() {
    let gw = gateway(|c| c.gateway.agents.ttl_ms = 1_000).await;
    let a = healthy_server().await;
    let t0 = Instant::now();
    gw.heartbeat_at(hb("node-a", &[("m", format!("http://{a}"), true)], &["m", "x"]), t0).unwrap();
    gw.heartbeat_at(hb("node-b", &[], &["y"]), t0 + Duration::from_millis(600)).unwrap();
    assert!(gw.expire_agents_at(t0 + Duration::from_millis(999)).is_empty());
    assert!(gw.serves("m"));
    assert_eq!(gw.expire_agents_at(t0 + Duration::from_millis(1_001)), vec!["node-a".to_string()]);
    assert!(!gw.serves("m"));
    assert!(names(&gw).is_empty());
    let view = gw.agents_view();
    assert_eq!(view.len(), 1);
    assert_eq!(view[0].agent_id, "node-b");
    assert_eq!(gw.expire_agents_at(t0 + Duration::from_millis(1_700)), vec!["node-b".to_string()]);
    assert!(gw.agents_view().is_empty());
}

#[tokio::test]
async fn a_loaded_engine_survives_a_heartbeat_sent_before_the_load() {
    let gw = gateway(|c| c.gateway.agents.ttl_ms = 1_000).await;
    let a = healthy_server().await;
    let t0 = Instant::now();
    gw.heartbeat_at(hb("node-a", &[], &["m"]), t0).unwrap();
    gw.engine_loaded("node-a", "m", &format!("http://{a}"), false).unwrap();
    assert!(gw.serves("m"));
    // A heartbeat from before the load: the engine stays.
    gw.heartbeat_at(hb("node-a", &[], &["m"]), Instant::now()).unwrap();
    assert!(gw.serves("m"));
    // Reported once (as the load answer described it: the same upstream
    // stays, so requests already routed to it are not cut), then missing: it goes.
    let id = |gw: &Gateway| gw.agents.state.lock()["node-a"].engines["m"].upstream.id;
    let loaded = id(&gw);
    gw.heartbeat_at(hb("node-a", &[("m", format!("http://{a}"), true)], &["m"]), Instant::now()).unwrap();
    assert_eq!(id(&gw), loaded, "the heartbeat replaced the engine the load had added");
    gw.heartbeat_at(hb("node-a", &[], &["m"]), Instant::now()).unwrap();
    assert!(!gw.serves("m"));
    // Loaded again and never reported for a ttl: it goes too.
    gw.engine_loaded("node-a", "m", &format!("http://{a}"), false).unwrap();
    gw.heartbeat_at(hb("node-a", &[], &["m"]), Instant::now() + Duration::from_millis(1_100)).unwrap();
    assert!(!gw.serves("m"));
    // An agent that went away cannot take a load answer.
    assert!(gw.engine_loaded("nobody", "m", &format!("http://{a}"), false).is_err());
}

#[tokio::test]
async fn configured_upstreams_stay_whatever_agents_do() {
    let a = healthy_server().await;
    let gw = gateway(|c| {
        let mut u = UpstreamConfig::new("fixed", format!("http://{a}"));
        u.models = vec!["m".into()];
        c.upstreams.push(u);
    })
    .await;
    let fixed = gw.upstreams.by_name("fixed").unwrap();
    assert_eq!(fixed.origin, Origin::Config);
    let t0 = Instant::now();
    gw.heartbeat_at(hb("node-a", &[("m", format!("http://{a}"), true)], &[]), t0).unwrap();
    assert_eq!(names(&gw), vec!["fixed", "agent:node-a:m"]);
    let topo = gw.topology();
    assert_eq!(topo.pool_order("m").len(), 2, "the default pool and the agents' pool for m");
    assert_eq!(topo.pool_order("other").len(), 1, "an agents' pool serves its model only");
    gw.expire_agents_at(t0 + Duration::from_secs(5));
    assert_eq!(names(&gw), vec!["fixed"]);
    assert_eq!(gw.upstreams.by_name("fixed").unwrap().id, fixed.id);
    assert!(gw.serves("m"));
}

#[test]
fn heartbeats_are_checked_field_by_field() {
    let ok = hb("node-a", &[("m", "http://127.0.0.1:1".into(), true)], &["m"]);
    ok.validate().unwrap();
    let param = |f: &dyn Fn(&mut Heartbeat)| {
        let mut h = ok.clone();
        f(&mut h);
        let e = h.validate().unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        e.param.unwrap()
    };
    assert_eq!(param(&|h| h.agent_id = String::new()), "agent_id");
    assert_eq!(param(&|h| h.agent_id = "a:b".into()), "agent_id");
    assert_eq!(param(&|h| h.url = "ftp://x".into()), "url");
    assert_eq!(param(&|h| h.url = "not a url".into()), "url");
    assert_eq!(param(&|h| h.token = Some("a\nb".into())), "token");
    assert_eq!(param(&|h| h.engines[0].upstream = "127.0.0.1:80".into()), "engines[0].upstream");
    assert_eq!(param(&|h| h.engines[0].model = "has space".into()), "engines[0].model");
    assert_eq!(param(&|h| h.engines.push(h.engines[0].clone())), "engines[1].model");
    assert_eq!(param(&|h| h.models.push(String::new())), "models[1]");
    assert_eq!(param(&|h| h.models = vec!["x".into(); MAX_MODELS + 1]), "models");
}

#[test]
fn unknown_heartbeat_fields_are_ignored_and_defaults_filled() {
    let h: Heartbeat = serde_json::from_str(
        r#"{"agent_id":"a","url":"http://h:1","engines":[{"model":"m","upstream":"http://h:2","state":"ready"}],"tiers":{}}"#,
    )
    .unwrap();
    assert!(h.engines[0].healthy && h.engines[0].kv_events);
    assert!(h.models.is_empty() && h.token.is_none());
}
