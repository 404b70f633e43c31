//! Replicas through real processes: a gateway with
//! `[gateway.agents.models.smollm2]` `min_replicas = 1`, `max_replicas = 2`,
//! `scale_out_active = 2`, a real registry and two real agents running real
//! engines, unloading engines idle for 3 s.
//!
//! - With no request at all, the model is loaded on one agent (min_replicas).
//! - Under load (more than two requests in flight on that engine) the
//!   gateway loads a second engine on the other agent; no request fails.
//! - Once the load stops, one engine is unloaded for idleness and the other
//!   stays (the gateway's `keep`), answering at once.

mod agent_support;
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_support::*;
use serde_json::{json, Value};

fn engines(agents: &[&AgentProc]) -> Vec<bool> {
    agents.iter().map(|a| a.engine().is_some_and(|e| e["state"] == "ready")).collect()
}

#[test]
fn a_model_is_kept_at_min_replicas_scales_out_under_load_and_back_in_when_idle() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let gw = Gateway::start_with(&format!(
        "[gateway.agents.models.{MODEL}]\nmin_replicas = 1\nmax_replicas = 2\nscale_out_active = 2\n"
    ));
    let idle = ["--idle-unload", "3s", "--idle-poll", "250ms", "--drain-timeout", "10s"];
    let a = AgentProc::in_fleet(&registry.base, &gw.proc.base, dir.path(), "node-a", &idle);
    let b = AgentProc::in_fleet(&registry.base, &gw.proc.base, dir.path(), "node-b", &idle);

    // The agents beat with the agent-scope token, which opens nothing else.
    let r = gw.http.get(format!("{}/admin/v1/agents", gw.proc.base)).bearer_auth(GW_AGENT).send().unwrap();
    assert!(matches!(r.status().as_u16(), 401 | 403), "{}", r.status());

    // min_replicas: loaded with no request asking.
    wait_until("min_replicas loads the model on one agent", Duration::from_secs(90), || {
        engines(&[&a, &b]).iter().any(|&e| e)
    });
    assert_eq!(engines(&[&a, &b]).iter().filter(|&&e| e).count(), 1, "one replica, not two");

    // Load: six clients in a loop until the second engine is up (and a
    // little longer, so that some requests reach it).
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
            let (base, key) = (gw.proc.base.clone(), gw.key.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({"model": MODEL, "max_tokens": 32, "temperature": 0,
                        "messages": [{"role": "user", "content": format!("Count from {i} to 40.")}]});
                    let r = http.post(format!("{base}/v1/chat/completions")).bearer_auth(&key).json(&body).send();
                    match r {
                        Ok(r) if r.status() == 200 => ok.fetch_add(1, Ordering::Relaxed),
                        Ok(r) => {
                            eprintln!("request failed: {} {}", r.status(), r.text().unwrap_or_default());
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => {
                            eprintln!("request failed: {e}");
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            })
        })
        .collect();
    let started = Instant::now();
    wait_until("the gateway scales out to the second agent", Duration::from_secs(90), || {
        engines(&[&a, &b]) == [true, true]
    });
    let scaled_after = started.elapsed();
    wait_until("both engines are routed", Duration::from_secs(10), || {
        ["node-a", "node-b"].iter().all(|id| gw.agent(id).is_some_and(|x| x["engines"][0]["routable"] == true))
    });
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("scaled out after {scaled_after:?}; {ok} requests answered, {failed} failed");
    assert_eq!(failed, 0, "no request fails while a replica is added");
    assert!(ok >= 6, "{ok}");

    // Idle: one engine goes, the other is kept for min_replicas.
    wait_until("one replica is unloaded for idleness", Duration::from_secs(60), || {
        engines(&[&a, &b]).iter().filter(|&&e| e).count() == 1
    });
    std::thread::sleep(Duration::from_secs(5));
    let left = engines(&[&a, &b]);
    assert_eq!(left.iter().filter(|&&e| e).count(), 1, "the last replica stays: {left:?}");
    let r = gw.chat();
    assert!(r.headers().get("x-granary-placement").is_none(), "answered by the kept engine, with no load");
    let v: Value = r.json().unwrap();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
}
