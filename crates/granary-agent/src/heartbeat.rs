//! Heartbeats to the gateway: `POST {gateway}/admin/v1/agents/heartbeat`
//! every `heartbeat_interval`, and at once when an engine changes state (so
//! a crashed engine leaves the gateway's routing within moments, not at the
//! next tick). A failed heartbeat is logged, never fatal: the gateway drops
//! an agent it has not heard from, and the next beat puts it back.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::agent::Agent;
use crate::supervisor::EngineState;

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
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HeartbeatEngine {
    pub model: String,
    pub upstream: String,
    pub healthy: bool,
}

/// What the agent would say now.
pub fn body(agent: &Agent) -> Heartbeat {
    let engines = agent
        .supervisor()
        .list()
        .into_iter()
        .filter(|e| e.state != EngineState::Stopped)
        .map(|e| HeartbeatEngine { healthy: e.state == EngineState::Ready, model: e.model, upstream: e.upstream })
        .collect();
    Heartbeat {
        agent_id: agent.agent_id().to_string(),
        url: agent.url().to_string(),
        token: agent.config().admin_token.clone(),
        engines,
        models: agent.catalog(),
    }
}

/// Beats until the agent stops.
pub async fn run(agent: Arc<Agent>) {
    let Some(gateway) = agent.config().gateway.clone() else { return };
    let url = format!("{}/admin/v1/agents/heartbeat", gateway.trim_end_matches('/'));
    let token = agent.config().gateway_token.clone().unwrap_or_default();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("an HTTP client");
    let changed = agent.supervisor().changed();
    let mut failing = false;
    loop {
        let b = body(&agent);
        let sent = http.post(&url).bearer_auth(&token).json(&b).send().await;
        let outcome = match sent {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => {
                let status = r.status();
                Err(format!(
                    "HTTP {status}: {}",
                    r.text().await.unwrap_or_default().chars().take(300).collect::<String>()
                ))
            }
            Err(e) => Err(e.to_string()),
        };
        match outcome {
            Ok(()) if failing => {
                tracing::info!(%gateway, "heartbeats reach the gateway again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(%gateway, error = %e, "heartbeat failed (retrying every interval)");
                failing = true;
            }
            Err(e) => tracing::debug!(%gateway, error = %e, "heartbeat failed"),
        }
        tokio::select! {
            _ = agent.stopping().cancelled() => return,
            _ = changed.notified() => {}
            _ = tokio::time::sleep(agent.config().heartbeat_interval) => {}
        }
    }
}
