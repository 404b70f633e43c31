//! The agent's configuration: one struct, defaults in code, read from the
//! `[agent]` table of a TOML file and overridden by flags (in `granary agent`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use granary_core::ByteSize;
use serde::{Deserialize, Serialize};

use crate::download::DownloadConfig;
use crate::resources::ResourceConfig;
use crate::supervisor::SupervisorConfig;
use crate::tiers::TierConfig;

/// Everything `granary agent` runs with.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Control API address. Anything but loopback needs `admin_token`.
    pub listen: SocketAddr,
    /// This node's name in the gateway [default: the host name].
    pub agent_id: Option<String>,
    /// The URL the gateway reaches this agent at [default: http://<listen>].
    pub advertise: Option<String>,
    /// Registry base URL.
    pub registry: String,
    /// Registry read token.
    pub registry_token: Option<String>,
    /// Disk tier, logs, materialised models and the state file.
    pub cache_dir: PathBuf,
    /// Weight tiers.
    pub tiers: TierConfig,
    /// Downloads.
    pub download: DownloadConfig,
    /// Engine processes.
    pub engines: SupervisorConfig,
    /// GPUs and memory engines may take.
    pub resources: ResourceConfig,
    /// Admin token of the control API (`Authorization: Bearer`); none: open
    /// (allowed on loopback only).
    pub admin_token: Option<String>,
    /// A token that reads `GET /metrics` and nothing else (for a
    /// Prometheus scraper); the admin token reads it too.
    pub metrics_token: Option<String>,
    /// Gateways to heartbeat to (each replica of a gateway keeps its own
    /// upstream set, so each gets heartbeats).
    pub gateways: Vec<String>,
    /// The token heartbeats carry: the gateway's agent token (allowed to
    /// heartbeat and nothing else), or its admin token where it has none.
    pub gateway_token: Option<String>,
    /// Seconds between heartbeats.
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    /// Unload an engine idle longer than this (scale to zero); none: never.
    #[serde(with = "opt_duration")]
    pub idle_unload: Option<Duration>,
    /// How often each engine's `/metrics` is read for activity.
    #[serde(with = "duration")]
    pub idle_poll: Duration,
    /// The longest an idle engine drains (gateways routing nothing new to
    /// it, the requests in flight finishing) before it is stopped anyway.
    #[serde(with = "duration")]
    pub drain_timeout: Duration,
    /// How often the registry's model list (reported to the gateway) is refreshed.
    #[serde(with = "duration")]
    pub catalog_refresh: Duration,
    /// Stage the models a gateway's heartbeat answer names (`prefetch`)
    /// into the RAM tier; off: such answers are ignored. On by default:
    /// the gateway decides whether to ask (`[gateway.agents] prefetch`).
    pub prefetch: bool,
    /// How long a client of the control API has to send a request's
    /// headers; a silent or trickling client is closed after it (`0s`: no
    /// limit). The engines' fronts keep 30 s.
    #[serde(with = "duration")]
    pub header_timeout: Duration,
    /// Most connections the control API holds open at once; one more is
    /// answered 503 `too_many_connections` (the fronts keep 10,000 each).
    pub max_connections: usize,
}

impl AgentConfig {
    /// The control API's limits.
    pub fn http_limits(&self) -> granary_core::serve::HttpLimits {
        granary_core::serve::HttpLimits {
            header_timeout: (!self.header_timeout.is_zero()).then_some(self.header_timeout),
            max_connections: self.max_connections,
        }
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8500)),
            agent_id: None,
            advertise: None,
            registry: "http://127.0.0.1:8400".into(),
            registry_token: None,
            cache_dir: default_cache_dir(),
            tiers: TierConfig::default(),
            download: DownloadConfig::default(),
            engines: SupervisorConfig::default(),
            resources: ResourceConfig::default(),
            admin_token: None,
            metrics_token: None,
            gateways: Vec::new(),
            gateway_token: None,
            heartbeat_interval: Duration::from_secs(2),
            idle_unload: None,
            idle_poll: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            catalog_refresh: Duration::from_secs(30),
            prefetch: true,
            header_timeout: Duration::from_secs(30),
            max_connections: 10_000,
        }
    }
}

impl AgentConfig {
    /// Checks what can be checked before anything starts.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("max_connections: must be at least 1".into());
        }
        if !self.listen.ip().is_loopback() && self.admin_token.as_deref().is_none_or(str::is_empty) {
            return Err(format!(
                "listen: {} is not a loopback address; set an admin token (--admin-token) before exposing the control API",
                self.listen
            ));
        }
        if self.listen.ip().is_unspecified() && self.advertise.is_none() && !self.gateways.is_empty() {
            return Err(format!(
                "advertise: the agent listens on {}, which the gateway cannot dial; set the URL it reaches this agent at (--advertise)",
                self.listen
            ));
        }
        if self.engines.host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
            return Err(format!(
                "engines.host: {} is no address the gateway can reach engines at; give this node's address (--engine-host)",
                self.engines.host
            ));
        }
        if !self.gateways.is_empty() && self.gateway_token.as_deref().is_none_or(str::is_empty) {
            return Err(
                "gateways: heartbeats need the gateway's agent token (--gateway-token or --gateway-token-file)".into(),
            );
        }
        url::Url::parse(&self.registry).map_err(|e| format!("registry: {:?} is not a URL: {e}", self.registry))?;
        for g in &self.gateways {
            url::Url::parse(g).map_err(|e| format!("gateways: {g:?} is not a URL: {e}"))?;
        }
        if self.download.chunk_bytes == 0 {
            return Err("download.chunk_bytes: must be above 0".into());
        }
        if !self.engines.health_path.starts_with('/') {
            return Err(format!("engines.health_path: {:?} must start with '/'", self.engines.health_path));
        }
        if self.engines.threads == Some(0) {
            return Err("engines.threads: must be above 0".into());
        }
        if self.tiers.disk_budget == ByteSize(0) {
            return Err("tiers.disk_budget: must be above 0".into());
        }
        Ok(())
    }

    /// The agent's id: the configured one, else the host name.
    pub fn agent_id(&self) -> String {
        if let Some(id) = &self.agent_id {
            return id.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "granary-agent".into())
    }
}

/// `$GRANARY_CACHE_DIR/agent`, else `$XDG_CACHE_HOME/granary/agent`, else
/// `~/.cache/granary/agent` (beside the engine's model cache).
pub fn default_cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let base = var("GRANARY_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("granary")))
        .unwrap_or_else(|| var("HOME").unwrap_or_else(|| PathBuf::from(".")).join(".cache").join("granary"));
    base.join("agent")
}

/// Durations written as `10m`, `2s`, `500ms` (humantime).
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| serde::de::Error::custom(format!("{s:?}: {e} (e.g. 500ms, 2s, 10m)")))
    }
}

/// An optional [`duration`]; `off`, `none` or `0` mean none.
pub mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
            None => s.serialize_str("off"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_opt_duration(&s).map_err(serde::de::Error::custom)
    }
}

/// `10m` → 10 minutes; `off`, `none`, `0` → none.
pub fn parse_opt_duration(s: &str) -> Result<Option<Duration>, String> {
    match s.trim() {
        "off" | "none" | "0" => Ok(None),
        t => humantime::parse_duration(t).map(Some).map_err(|e| format!("{s:?}: {e} (e.g. 30s, 10m, or off)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_loopback() {
        let c = AgentConfig::default();
        c.validate().unwrap();
        assert!(c.listen.ip().is_loopback());
    }

    #[test]
    fn a_public_listener_needs_an_admin_token() {
        let mut c = AgentConfig { listen: "0.0.0.0:8500".parse().unwrap(), ..Default::default() };
        assert!(c.validate().unwrap_err().contains("admin token"));
        c.admin_token = Some("t".into());
        c.validate().unwrap();
    }

    /// The example in docs/agent.md parses, and says the defaults.
    #[test]
    fn the_documented_file_is_the_defaults() {
        let doc = include_str!("../../../docs/agent.md");
        let start = doc.find("```toml\n[agent]").expect("the example") + "```toml\n".len();
        let end = start + doc[start..].find("```").unwrap();
        #[derive(Deserialize)]
        struct File {
            agent: AgentConfig,
        }
        let f: File = toml::from_str(&doc[start..end]).unwrap();
        f.agent.validate().unwrap();
        let d = AgentConfig::default();
        fn json<T: Serialize>(v: &T) -> serde_json::Value {
            serde_json::to_value(v).unwrap()
        }
        assert_eq!(json(&f.agent.download), json(&d.download));
        assert_eq!(json(&f.agent.engines), json(&d.engines));
        assert_eq!(json(&f.agent.resources), json(&d.resources));
        let (mut a, mut b) = (f.agent.tiers.clone(), d.tiers.clone());
        (a.ram_dir, b.ram_dir) = (None, None);
        assert_eq!(json(&a), json(&b));
        assert_eq!(
            (f.agent.listen, f.agent.heartbeat_interval, f.agent.idle_unload),
            (d.listen, d.heartbeat_interval, d.idle_unload)
        );
        assert_eq!(
            (f.agent.idle_poll, f.agent.catalog_refresh, &f.agent.registry),
            (d.idle_poll, d.catalog_refresh, &d.registry)
        );
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_opt_duration("10m").unwrap(), Some(Duration::from_secs(600)));
        assert_eq!(parse_opt_duration("off").unwrap(), None);
        assert!(parse_opt_duration("ten minutes").is_err());
    }
}
