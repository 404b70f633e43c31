//! Idle unload under a trickle of requests, with the real `granary agent`,
//! gateway, registry and engines: the agent takes an idle engine out of the
//! gateway's routing and lets its requests finish before it stops it, so a
//! request arriving just as the engine goes idle is served (by the engine
//! taken back, or by a new one), never failed. An unload someone asks for
//! drains the same way: a request in flight finishes first.

mod agent_support;
mod common;

use std::time::{Duration, Instant};

use agent_support::*;

#[test]
fn no_request_fails_across_idle_unloads() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let gw = Gateway::start();
    let cache_dir = dir.path().join("cache");
    let args: Vec<String> = [
        "--registry",
        &registry.base,
        "--registry-token",
        READ,
        "--cache-dir",
        cache_dir.to_str().unwrap(),
        "--ram-budget",
        "0",
        "--admin-token",
        TOKEN,
        "--gateway",
        &gw.proc.base,
        "--gateway-token",
        GW_ADMIN,
        "--agent-id",
        "node-d",
        "--heartbeat-interval",
        "500ms",
        "--health-interval",
        "100ms",
        "--idle-unload",
        "1s",
        "--idle-poll",
        "50ms",
        "--drain-timeout",
        "10s",
        "--engine-arg=--kv-cache=64MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = AgentProc::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_until("the gateway lists the agent's models", Duration::from_secs(15), || {
        gw.agent("node-d").is_some_and(|a| a["models"].as_array().unwrap().iter().any(|m| m == MODEL))
    });

    // Gaps around the idle window (1 s, read every 50 ms): some requests
    // come well before it ends, some just as the engine is found idle
    // (while it drains or stops), some after it is gone.
    let gaps_ms = [0u64, 1150, 1000, 1075, 1050, 1100, 1025, 1125, 1060, 1090, 1040, 1110, 1500];
    let mut failed = Vec::new();
    let mut loads = 0;
    let started = Instant::now();
    for (i, gap) in gaps_ms.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(*gap));
        let r = gw.chat();
        let status = r.status().as_u16();
        let waited_on_load = r.headers().contains_key("x-granary-placement");
        let body = r.text().unwrap();
        if status != 200 {
            failed.push(format!("request {i} after {gap} ms: {status} {body}"));
        }
        loads += waited_on_load as usize;
    }
    eprintln!(
        "{} requests in {:?}: {} failed, {loads} waited on a load (first one included)",
        gaps_ms.len(),
        started.elapsed(),
        failed.len()
    );
    assert!(failed.is_empty(), "failed across idle unloads: {failed:#?}");
    // The trickle did cross idle unloads: the model was loaded again.
    assert!(loads >= 3, "only {loads} loads: the engine was hardly ever unloaded");
    // Once the trickle ends it goes, drained, for good.
    wait_until("the idle engine is unloaded", Duration::from_secs(20), || agent.engine().is_none());
    wait_until("the gateway drops it", Duration::from_secs(10), || {
        gw.agent("node-d").is_some_and(|a| a["engines"].as_array().unwrap().is_empty())
    });

    // An unload asked for while a long request runs: the engine leaves
    // routing, the request finishes, then the engine stops.
    let (base, key) = (gw.proc.base.clone(), gw.key.clone());
    let long = std::thread::spawn(move || {
        let body = serde_json::json!({"model": MODEL, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 300, one number per line."}]});
        let r = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()
            .unwrap()
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<serde_json::Value>().unwrap())
    });
    wait_until("the long request runs on the engine", Duration::from_secs(60), || {
        gw.agent("node-d").is_some_and(|a| a["engines"][0]["active_requests"].as_u64() >= Some(1))
    });
    let asked = Instant::now();
    let unload = {
        let base = agent.base.clone();
        std::thread::spawn(move || {
            let r = reqwest::blocking::Client::new()
                .post(format!("{base}/models/{MODEL}/unload"))
                .bearer_auth(TOKEN)
                .send()
                .unwrap();
            (r.status().as_u16(), asked.elapsed())
        })
    };
    // Out of the gateway's routing (draining) while the request still runs.
    wait_until("the gateway sees the engine draining", Duration::from_secs(5), || {
        gw.agent("node-d").is_some_and(|a| a["engines"][0]["draining"] == true)
    });
    assert!(!long.is_finished(), "the request was still running when the engine left routing");
    let (s, took) = unload.join().unwrap();
    assert_eq!(s, 200);
    let (status, v) = long.join().unwrap();
    assert_eq!(status, 200, "the request in flight finished: {v}");
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    eprintln!("explicit unload waited {took:?} for a request of {tokens} tokens");
    assert!(tokens > 0, "{v}");
    assert!(agent.engine().is_none(), "unloaded once the request was done");
}
