//! Predictive prefetch end to end: a real gateway with `prefetch = true`,
//! a real registry and two real agents running real engines.
//!
//! Tenant `acme` asks for `smollm2` (loaded on node-a, the first by name)
//! and `smollm2-b` (loaded on node-b, which runs fewer engines): both
//! nodes served acme. node-a's heartbeat answers then name `smollm2-b`,
//! and node-a stages it into its RAM tier (node-b has no RAM tier). Once
//! node-b unloads it, the next request loads it on node-a, from RAM: a
//! prefetch hit, counted by the agent and by the gateway.

mod agent_support;
mod common;

use std::time::Duration;

use agent_support::*;
use serde_json::Value;

const B: &str = "smollm2-b";

fn agent(registry: &str, gw: &str, dir: &std::path::Path, id: &str, ram_budget: &str) -> AgentProc {
    AgentProc::in_fleet(registry, gw, dir, id, &["--ram-budget", ram_budget, "--promote-after", "0"])
}

fn prefetch_count(gw: &Gateway, event: &str) -> u64 {
    let text = gw.http.get(format!("{}/metrics", gw.proc.base)).bearer_auth(GW_ADMIN).send().unwrap().text().unwrap();
    let series = format!("granary_gateway_agent_prefetch_total{{event=\"{event}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&series)).map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

fn tier_of(agent: &AgentProc, model: &str) -> Option<String> {
    let st = agent.status();
    st["weights"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["model"] == model)
        .map(|w| w["tier"].as_str().unwrap().to_string())
}

#[test]
fn a_model_the_nodes_tenants_use_is_prefetched_and_its_next_load_reads_from_ram() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry_with(&model, dir.path(), &[MODEL, B]);
    let gw = Gateway::start_with("prefetch = true\n");
    let a = agent(&registry.base, &gw.proc.base, dir.path(), "node-a", "2GiB");
    let b = agent(&registry.base, &gw.proc.base, dir.path(), "node-b", "0");
    wait_until("the gateway lists both agents' models", Duration::from_secs(20), || {
        ["node-a", "node-b"]
            .iter()
            .all(|id| gw.agent(id).is_some_and(|a| a["models"].as_array().unwrap().iter().any(|m| m == B)))
    });

    let r = gw.chat_model(MODEL);
    assert_eq!(r.status(), 200);
    assert!(a.engine_of(MODEL).is_some(), "all equal: the first agent by name");
    let r = gw.chat_model(B);
    assert_eq!(r.status(), 200);
    assert!(b.engine_of(B).is_some(), "locality equal (none): the agent with fewer engines");

    // node-a served acme, who asked for B: node-a stages it into RAM.
    wait_until("node-a prefetches smollm2-b into RAM", Duration::from_secs(60), || {
        tier_of(&a, B).as_deref() == Some("ram")
    });
    // Staging also converts the weights into a checkpoint, kept in RAM too.
    wait_until("node-a's prefetch ends", Duration::from_secs(60), || a.status()["prefetch"]["done"] == 1);
    let st = a.status();
    let staged = st["weights"].as_array().unwrap().iter().find(|w| w["model"] == B).cloned().unwrap();
    assert_eq!((staged["tier"].as_str(), staged["checkpoint"].as_str()), (Some("ram"), Some("ram")), "{st}");
    assert!(a.engine_of(B).is_none(), "staged, not loaded");
    wait_until("the gateway counts the prefetch done", Duration::from_secs(10), || prefetch_count(&gw, "done") >= 1);
    assert!(prefetch_count(&gw, "asked") >= 1);
    assert_eq!(b.status()["prefetch"]["done"], 0, "node-b has no RAM tier: {}", b.status()["prefetch"]);

    wait_until("the gateway hears of node-a's checkpoint of B", Duration::from_secs(10), || {
        gw.agent("node-a").is_some_and(|x| x["checkpoints"].as_array().unwrap().iter().any(|m| m == B))
    });

    // B leaves node-b, and node-b is rebuilt with an empty disk: B's next
    // load goes where its weights are, node-a's RAM. (Left on node-b's
    // disk, B would be a near tie here: on one host a "disk" read is a page
    // cache read, as fast as the RAM tier's, and which node then wins turns
    // on the engine start times each measured. The choice between RAM and
    // disk by their rates is `agents::estimate`'s unit tests.)
    let (s, v) = b.json("POST", &format!("/models/{B}/unload"), None);
    assert_eq!(s, 200, "{v}");
    let mut b = b;
    b.kill9();
    std::fs::remove_dir_all(dir.path().join("cache-node-b")).unwrap();
    let b = agent(&registry.base, &gw.proc.base, dir.path(), "node-b", "0");
    wait_until("the gateway hears from the rebuilt node-b", Duration::from_secs(20), || {
        gw.agent("node-b").is_some_and(|x| {
            x["url"] == b.base.as_str()
                && x["engines"].as_array().unwrap().is_empty()
                && x["weights"].get(B).is_none_or(|w| w == "none")
        })
    });
    let r = gw.chat_model(B);
    let placement = r.headers().get("x-granary-placement").map(|v| v.to_str().unwrap().to_string());
    let v: Value = r.json().unwrap();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    let placement = placement.expect("the answer that waited on the load says where it went");
    assert!(placement.starts_with("loaded on node-a (est. "), "{placement}: {}", a.status());
    assert!(placement.contains("; weights: ram + checkpoint"), "{placement}: {}", a.status());
    let (_, logs) = a.call("GET", &format!("/models/{B}/logs"), None, Some(TOKEN));
    assert!(logs.lines().any(|l| l.contains("granary: loaded") && l.ends_with("checkpoint loaded")), "{logs}");
    let load = a.status()["loads"].as_array().unwrap().iter().find(|l| l["model"] == B).cloned().unwrap();
    assert_eq!(load["tier"], "ram", "{load}");
    assert_eq!(a.status()["prefetch"]["hits"], 1);
    assert_eq!(prefetch_count(&gw, "hit"), 1);
}
