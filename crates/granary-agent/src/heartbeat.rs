//! Heartbeats to the gateway: `POST {gateway}/admin/v1/agents/heartbeat`
//! every `heartbeat_interval`, and at once when an engine changes state (so
//! a crashed engine leaves the gateway's routing within moments, not at the
//! next tick). A failed heartbeat is logged, never fatal: the gateway drops
//! an agent it has not heard from, and the next beat puts it back. With
//! several gateway replicas each gets its own heartbeats (their upstream
//! sets are per process).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::agent::Agent;
use crate::resources::ResourcesStatus;
use crate::supervisor::EngineState;
use crate::weights::HeldRevision;

/// The heartbeat body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Heartbeat {
    pub agent_id: String,
    /// Where the gateway reaches this agent's control API.
    pub url: String,
    /// The control API's admin token, for the gateway's load calls.
    pub token: Option<String>,
    pub engines: Vec<HeartbeatEngine>,
    /// Models this agent can load (the registry's list).
    pub models: Vec<String>,
    /// Free capacity: GPUs (memory held by this agent's engines, free) and
    /// host memory. Gateways that do not read it ignore it.
    #[serde(default)]
    pub resources: Option<ResourcesStatus>,
    /// Each model revision laid out on this node and whether its weights
    /// are in RAM, on disk or gone (for placing loads where they are).
    #[serde(default)]
    pub weights: Vec<HeldRevision>,
    /// Bytes the RAM tier could take for prefetched weights (its budget
    /// less the copies loaded models hold); none without a RAM tier.
    #[serde(default)]
    pub prefetch_room: Option<u64>,
    /// How fast this node loads (read rates per tier, download rate, an
    /// engine start's fixed cost), as measured by its loads.
    #[serde(default)]
    pub load_profile: crate::profile::ProfileReport,
    /// Engines starting now (loads in progress: a new one waits behind them).
    #[serde(default)]
    pub starting: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HeartbeatEngine {
    pub model: String,
    pub upstream: String,
    pub healthy: bool,
    /// Whether it publishes `/v1/kv/events`: the embedded engine does; an
    /// external one (vLLM, SGLang, llama.cpp) is not assumed to.
    pub kv_events: bool,
    /// About to be unloaded for idleness: the gateway routes nothing new to
    /// it and answers with its requests still in flight (see [`crate::drain`]).
    #[serde(default)]
    pub draining: bool,
}

/// What the agent would say now.
pub fn body(agent: &Agent) -> Heartbeat {
    let kv_events = agent.config().engines.command.is_none();
    let engines = agent
        .supervisor()
        .list()
        .into_iter()
        // An engine starting for the first time is not an upstream yet: the
        // load's answer announces it once it is healthy.
        .filter(|e| e.state != EngineState::Stopped && e.ever_ready)
        .map(|e| HeartbeatEngine {
            healthy: e.state == EngineState::Ready,
            draining: e.draining,
            model: e.model,
            upstream: e.upstream,
            kv_events,
        })
        .collect();
    Heartbeat {
        agent_id: agent.agent_id().to_string(),
        url: agent.url().to_string(),
        token: agent.config().admin_token.clone(),
        engines,
        models: agent.catalog(),
        resources: Some(agent.resources().status()),
        weights: agent.weights(),
        prefetch_room: agent.tiers().ram_room(),
        load_profile: agent.profile().report(),
        starting: agent
            .supervisor()
            .list()
            .iter()
            .filter(|e| e.state == EngineState::Starting && !e.ever_ready)
            .count(),
    }
}

/// Beats to every configured gateway until the agent stops.
pub async fn run(agent: Arc<Agent>) {
    let beats: Vec<_> = agent.config().gateways.iter().map(|g| beat(agent.clone(), g.clone())).collect();
    futures::future::join_all(beats).await;
}

/// What a gateway answered a heartbeat with.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct BeatAnswer {
    /// Per draining engine, the requests still in flight through that
    /// gateway (absent: a gateway that does not know draining).
    #[serde(default)]
    pub draining: std::collections::BTreeMap<String, u64>,
    /// Engines the gateway needs kept loaded (its `min_replicas`).
    #[serde(default)]
    pub keep: Vec<String>,
    /// Models to stage into the RAM tier ([`crate::prefetch`]).
    #[serde(default)]
    pub prefetch: Vec<crate::prefetch::PrefetchItem>,
}

/// Sends one heartbeat to `gateway` and reads its answer; the models it
/// says to keep are recorded on the agent.
pub async fn send(agent: &Agent, http: &reqwest::Client, gateway: &str) -> Result<BeatAnswer, String> {
    let url = format!("{}/admin/v1/agents/heartbeat", gateway.trim_end_matches('/'));
    let token = agent.config().gateway_token.clone().unwrap_or_default();
    let r = http.post(&url).bearer_auth(&token).json(&body(agent)).send().await.map_err(|e| e.to_string())?;
    let status = r.status();
    let text = r.text().await.unwrap_or_default();
    if !status.is_success() {
        return Err(format!("HTTP {status}: {}", text.chars().take(300).collect::<String>()));
    }
    let answer: BeatAnswer = serde_json::from_str(&text).unwrap_or_default();
    agent.set_kept(gateway, &answer.keep);
    Ok(answer)
}

/// A client for heartbeats.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("an HTTP client")
}

async fn beat(agent: Arc<Agent>, gateway: String) {
    let http = client();
    let mut changed = agent.supervisor().changed_signal();
    let mut failing = false;
    loop {
        let outcome = send(&agent, &http, &gateway).await;
        if let Ok(a) = &outcome {
            agent.prefetch(&a.prefetch);
        }
        match outcome {
            Ok(_) if failing => {
                tracing::info!(%gateway, "heartbeats reach the gateway again");
                failing = false;
            }
            Ok(_) => {}
            Err(e) if !failing => {
                tracing::warn!(%gateway, error = %e, "heartbeat failed (retrying every interval)");
                failing = true;
            }
            Err(e) => tracing::debug!(%gateway, error = %e, "heartbeat failed"),
        }
        tokio::select! {
            _ = agent.stopping().cancelled() => return,
            _ = changed.changed() => {}
            _ = tokio::time::sleep(agent.config().heartbeat_interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use granary_core::ByteSize;

    use super::*;
    use crate::resources::GpuSpec;

    /// What a gateway is told of this node's capacity: its GPUs with what is
    /// free, host memory, and the revisions laid out here.
    #[tokio::test]
    async fn heartbeats_carry_free_capacity_and_weights() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = crate::AgentConfig {
            cache_dir: d.path().to_path_buf(),
            registry: "http://127.0.0.1:9".into(),
            agent_id: Some("node-h".into()),
            ..Default::default()
        };
        cfg.tiers.ram_dir = None;
        cfg.resources.gpus =
            Some(vec![GpuSpec { index: 3, memory: ByteSize::gib(2), name: Some("fake".into()), uuid: None }]);
        cfg.resources.gpus_per_engine = 1;
        cfg.resources.host_memory = Some(ByteSize::gib(4));
        let agent = Agent::start(cfg).await.unwrap();
        agent.resources().reserve("m", 1 << 30).unwrap();
        let v = serde_json::to_value(body(&agent)).unwrap();
        agent.shutdown();
        let gpu = &v["resources"]["gpus"][0];
        assert_eq!((gpu["index"].as_u64(), gpu["memory_total"].as_u64()), (Some(3), Some(2 << 30)), "{v}");
        let reserved = (1u64 << 30) + (512 << 20);
        assert_eq!(gpu["memory_free"].as_u64(), Some((2 << 30) - reserved), "weights + overhead: {v}");
        assert_eq!(gpu["engines"], serde_json::json!(["m"]));
        assert_eq!(v["resources"]["host_memory_total"].as_u64(), Some(4 << 30));
        assert_eq!(v["weights"], serde_json::json!([]), "nothing laid out yet");
        assert_eq!(v["agent_id"], "node-h");
    }
}
