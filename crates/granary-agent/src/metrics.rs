//! `GET /metrics`: the agent's state in Prometheus text, read from its
//! status at each scrape (the same figures `GET /status` gives).
//!
//! | metric | labels | what |
//! | --- | --- | --- |
//! | `granary_agent_engines` | `model`, `state` | 1 for each engine, by its state |
//! | `granary_agent_engine_restarts_total` | `model` | times the engine was restarted |
//! | `granary_agent_tier_used_bytes`, `granary_agent_tier_budget_bytes`, `granary_agent_tier_files` | `tier` (`ram`, `disk`) | the weight tiers |
//! | `granary_agent_downloads`, `granary_agent_download_done_bytes`, `granary_agent_download_total_bytes` | | downloads in progress |
//! | `granary_agent_prefetches_total` | `outcome` (`asked`, `done`, `failed`, `hit`) | gateway-asked prefetches |

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::agent::AgentStatus;

type Labels = Vec<(&'static str, String)>;

fn gauge(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, Gauge> {
    let f = Family::<Labels, Gauge>::default();
    reg.register(name, help, f.clone());
    f
}

fn counter(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, Counter> {
    let f = Family::<Labels, Counter>::default();
    reg.register(name, help, f.clone());
    f
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The Prometheus text exposition of `s`.
pub fn render(s: &AgentStatus) -> String {
    let mut reg = Registry::with_prefix("granary_agent");
    let engines = gauge(&mut reg, "engines", "Engines on this node by model and state (1 each).");
    let restarts = counter(&mut reg, "engine_restarts", "Times each model's engine was restarted.");
    for e in &s.engines {
        let state = serde_json::to_value(e.state).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        engines.get_or_create(&vec![("model", e.model.clone()), ("state", state)]).inc();
        restarts.get_or_create(&vec![("model", e.model.clone())]).inc_by(u64::from(e.restarts));
    }
    let used = gauge(&mut reg, "tier_used_bytes", "Bytes of model weights held in each tier.");
    let budget = gauge(&mut reg, "tier_budget_bytes", "Each weight tier's budget in bytes.");
    let files = gauge(&mut reg, "tier_files", "Files held in each weight tier.");
    for (tier, t) in [("ram", s.tiers.ram.as_ref()), ("disk", Some(&s.tiers.disk))] {
        let Some(t) = t else { continue };
        let l = vec![("tier", tier.to_string())];
        used.get_or_create(&l).set(int(t.used));
        budget.get_or_create(&l).set(int(t.budget));
        files.get_or_create(&l).set(int(t.files));
    }
    let none: Labels = Vec::new();
    gauge(&mut reg, "downloads", "Weight downloads in progress.").get_or_create(&none).set(s.downloads.len() as i64);
    let done: u64 = s.downloads.iter().map(|d| d.done).sum();
    let total: u64 = s.downloads.iter().map(|d| d.total).sum();
    gauge(&mut reg, "download_done_bytes", "Bytes downloaded so far by the downloads in progress.")
        .get_or_create(&none)
        .set(int(done));
    gauge(&mut reg, "download_total_bytes", "Bytes the downloads in progress will have.")
        .get_or_create(&none)
        .set(int(total));
    let prefetches = counter(
        &mut reg,
        "prefetches",
        "Prefetches gateways asked for, by outcome (hit: a load found its weights in RAM).",
    );
    let p = &s.prefetch;
    for (outcome, n) in [("asked", p.asked), ("done", p.done), ("failed", p.failed), ("hit", p.hits)] {
        prefetches.get_or_create(&vec![("outcome", outcome.to_string())]).inc_by(n);
    }
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}
