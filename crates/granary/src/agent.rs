//! `granary agent`: the node agent (weight tiers, engine supervision,
//! heartbeats to the gateway, scale to zero). Defaults come from
//! `granary_agent::AgentConfig`, then the `[agent]` table of `--config`,
//! then flags.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use granary_agent::config::parse_opt_duration;
use granary_agent::AgentConfig;
use granary_core::ByteSize;

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (e.g. 500ms, 2s, 10m)"))
}

/// A duration or `off` (clap reads `Option<Option<_>>` as an optional value, so a newtype).
#[derive(Debug, Clone, Copy)]
pub struct OptDuration(Option<Duration>);

fn opt_duration(s: &str) -> Result<OptDuration, String> {
    parse_opt_duration(s).map(OptDuration)
}

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// TOML config file (table [agent]; see docs/agent.md).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Control API address [default: 127.0.0.1:8500]; beyond loopback only with --admin-token.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Registry base URL [default: http://127.0.0.1:8400].
    #[arg(long)]
    pub registry: Option<String>,
    /// Registry read token (prefer --registry-token-file or the environment: argv is visible in `ps`).
    #[arg(long, env = "GRANARY_REGISTRY_TOKEN", hide_env_values = true)]
    pub registry_token: Option<String>,
    /// A file holding the registry read token.
    #[arg(long, conflicts_with = "registry_token")]
    pub registry_token_file: Option<PathBuf>,
    /// Disk tier, logs, models and the state file [default: the granary cache directory's agent/].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// RAM tier directory, on tmpfs [default: /dev/shm/granary when /dev/shm exists].
    #[arg(long)]
    pub ram_dir: Option<PathBuf>,
    /// RAM tier budget (0 turns the tier off) [default: 2GiB].
    #[arg(long)]
    pub ram_budget: Option<ByteSize>,
    /// Disk tier budget [default: 50GiB].
    #[arg(long)]
    pub disk_budget: Option<ByteSize>,
    /// Loads within --promote-window that promote a model to RAM (0: never) [default: 2].
    #[arg(long)]
    pub promote_after: Option<u32>,
    /// Window of --promote-after [default: 1h].
    #[arg(long, value_parser = duration)]
    pub promote_window: Option<Duration>,
    /// Demote RAM copies unused this long even without pressure [default: off].
    #[arg(long, value_parser = opt_duration)]
    pub demote_after: Option<OptDuration>,
    /// Gateway base URL to register with (heartbeats every 2 s); repeat for gateway replicas.
    #[arg(long = "gateway")]
    pub gateways: Vec<String>,
    /// Time between heartbeats [default: 2s].
    #[arg(long, value_parser = duration)]
    pub heartbeat_interval: Option<Duration>,
    /// The token heartbeats carry: the gateway's agent token (the variable
    /// its `agent_token_env` names), which allows heartbeats and nothing else.
    #[arg(long, env = "GRANARY_GATEWAY_TOKEN", hide_env_values = true)]
    pub gateway_token: Option<String>,
    /// A file holding the gateway's agent token.
    #[arg(long, conflicts_with = "gateway_token")]
    pub gateway_token_file: Option<PathBuf>,
    /// URL the gateway reaches this agent at [default: http://<listen>].
    #[arg(long)]
    pub advertise: Option<String>,
    /// This node's name in the gateway [default: the host name].
    #[arg(long)]
    pub agent_id: Option<String>,
    /// External engine command, run with sh -c: {model_path} {model_id} {port} {host}
    /// are substituted [default: the embedded engine].
    #[arg(long)]
    pub engine_command: Option<String>,
    /// The path of engines' health checks [default: /health; /openapi.json for llama_cpp.server].
    #[arg(long)]
    pub engine_health_path: Option<String>,
    /// CPU threads per engine, substituted as {threads} [default: the cores available].
    #[arg(long)]
    pub engine_threads: Option<usize>,
    /// Put a front (a proxy on the agent) before each engine, so that the agent
    /// sees its requests: idle unload for engines without request metrics.
    #[arg(long)]
    pub engine_proxy: bool,
    /// A request header engines' fronts do not pass on (repeatable), e.g.
    /// x-request-id for llama_cpp.server, which refuses ids that are not UUIDs.
    #[arg(long = "engine-proxy-drop-header")]
    pub engine_proxy_drop_headers: Vec<String>,
    /// GPUs each engine gets, named in CUDA_VISIBLE_DEVICES (0: none) [default: 0].
    #[arg(long)]
    pub gpus_per_engine: Option<u32>,
    /// Memory each engine reserves [default: its weights + --memory-overhead].
    #[arg(long)]
    pub engine_memory: Option<ByteSize>,
    /// Added to an engine's weights in its memory estimate [default: 512MiB].
    #[arg(long)]
    pub memory_overhead: Option<ByteSize>,
    /// Host memory engines without GPUs may reserve [default: the node's total].
    #[arg(long)]
    pub host_memory: Option<ByteSize>,
    /// The address engines listen on and are reported at [default: 127.0.0.1];
    /// this node's address when the gateway runs elsewhere.
    #[arg(long)]
    pub engine_host: Option<String>,
    /// A flag for the embedded engine, e.g. --engine-arg=--kv-cache=1GiB (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Unload an engine idle this long (scale to zero); `off` to keep them [default: off].
    #[arg(long, value_parser = opt_duration)]
    pub idle_unload: Option<OptDuration>,
    /// How often each engine's metrics are read for idleness [default: 5s].
    #[arg(long, value_parser = duration)]
    pub idle_poll: Option<Duration>,
    /// The longest an idle engine drains (no new requests routed to it, those
    /// in flight finishing) before it is stopped anyway [default: 30s].
    #[arg(long, value_parser = duration)]
    pub drain_timeout: Option<Duration>,
    /// Time between an engine's health checks [default: 1s].
    #[arg(long, value_parser = duration)]
    pub health_interval: Option<Duration>,
    /// Time an engine has to become healthy [default: 5m].
    #[arg(long, value_parser = duration)]
    pub start_timeout: Option<Duration>,
    /// Longest wait between restarts of a failing engine [default: 30s].
    #[arg(long, value_parser = duration)]
    pub restart_backoff_max: Option<Duration>,
    /// Range requests in flight per load [default: 8].
    #[arg(long)]
    pub download_parallel: Option<usize>,
    /// Bytes per range request [default: 16MiB].
    #[arg(long)]
    pub download_chunk: Option<ByteSize>,
    /// Admin token of the control API. (`GRANARY_AGENT_TOKEN` is the
    /// gateway's token for agents' heartbeats, a credential every node
    /// holds: never read as this one.)
    #[arg(long, env = "GRANARY_AGENT_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A file holding the control API's admin token.
    #[arg(long, conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
    /// A token that reads `GET /metrics` only (for a Prometheus scraper).
    #[arg(long, env = "GRANARY_AGENT_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,
    /// A file holding the metrics token.
    #[arg(long, conflicts_with = "metrics_token")]
    pub metrics_token_file: Option<PathBuf>,
}

/// A token from a file: its content, trimmed; an empty file is an error.
fn read_token(flag: &str, path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{flag}: reading {}", path.display()))?;
    let t = text.trim();
    anyhow::ensure!(!t.is_empty(), "{flag}: {} is empty", path.display());
    anyhow::ensure!(!t.contains(['\n', '\r']), "{flag}: {} holds more than one line", path.display());
    Ok(t.to_string())
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    agent: Option<AgentConfig>,
}

/// The agent's config from defaults, the file and the flags.
pub fn config(a: &AgentArgs) -> Result<AgentConfig> {
    let mut c = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            toml::from_str::<File>(&text).with_context(|| format!("in {}", p.display()))?.agent.unwrap_or_default()
        }
        None => AgentConfig::default(),
    };
    macro_rules! set {
        ($flag:expr => $($field:tt)+) => {
            if let Some(v) = $flag.clone() {
                c.$($field)+ = v;
            }
        };
    }
    set!(a.listen => listen);
    set!(a.registry => registry);
    set!(a.cache_dir => cache_dir);
    set!(a.ram_budget => tiers.ram_budget);
    set!(a.disk_budget => tiers.disk_budget);
    set!(a.promote_after => tiers.promote_after);
    set!(a.promote_window => tiers.promote_window);
    if let Some(OptDuration(d)) = a.demote_after {
        c.tiers.demote_after = d;
    }
    if let Some(OptDuration(d)) = a.idle_unload {
        c.idle_unload = d;
    }
    set!(a.idle_poll => idle_poll);
    set!(a.drain_timeout => drain_timeout);
    set!(a.heartbeat_interval => heartbeat_interval);
    set!(a.health_interval => engines.health_interval);
    set!(a.start_timeout => engines.start_timeout);
    set!(a.restart_backoff_max => engines.backoff_max);
    set!(a.download_parallel => download.parallel);
    set!(a.engine_host => engines.host);
    set!(a.engine_health_path => engines.health_path);
    if a.engine_threads.is_some() {
        c.engines.threads = a.engine_threads;
    }
    if a.engine_proxy {
        c.engines.proxy = true;
    }
    if !a.engine_proxy_drop_headers.is_empty() {
        c.engines.proxy_drop_headers = a.engine_proxy_drop_headers.clone();
    }
    set!(a.gpus_per_engine => resources.gpus_per_engine);
    set!(a.memory_overhead => resources.memory_overhead);
    if a.engine_memory.is_some() {
        c.resources.engine_memory = a.engine_memory;
    }
    if a.host_memory.is_some() {
        c.resources.host_memory = a.host_memory;
    }
    if let Some(v) = a.download_chunk {
        c.download.chunk_bytes = v.as_u64();
    }
    if a.ram_dir.is_some() {
        c.tiers.ram_dir = a.ram_dir.clone();
    }
    for (flag, field) in [
        (&a.registry_token, &mut c.registry_token),
        (&a.gateway_token, &mut c.gateway_token),
        (&a.advertise, &mut c.advertise),
        (&a.agent_id, &mut c.agent_id),
        (&a.engine_command, &mut c.engines.command),
        (&a.admin_token, &mut c.admin_token),
        (&a.metrics_token, &mut c.metrics_token),
    ] {
        if flag.is_some() {
            *field = flag.clone();
        }
    }
    for (flag, file, field) in [
        ("--registry-token-file", &a.registry_token_file, &mut c.registry_token),
        ("--gateway-token-file", &a.gateway_token_file, &mut c.gateway_token),
        ("--admin-token-file", &a.admin_token_file, &mut c.admin_token),
        ("--metrics-token-file", &a.metrics_token_file, &mut c.metrics_token),
    ] {
        if let Some(p) = file {
            *field = Some(read_token(flag, p)?);
        }
    }
    if !a.gateways.is_empty() {
        c.gateways = a.gateways.clone();
    }
    if !a.engine_args.is_empty() {
        c.engines.engine_args = a.engine_args.clone();
    }
    c.validate().map_err(|m| anyhow::anyhow!(m))?;
    Ok(c)
}

pub async fn run(a: AgentArgs) -> Result<()> {
    let cfg = config(&a)?;
    if cfg.admin_token.is_none() && std::env::var_os("GRANARY_AGENT_TOKEN").is_some() {
        tracing::warn!(
            "GRANARY_AGENT_TOKEN is set but is the gateway's heartbeat token, not read by the agent; \
             the control API's admin token is GRANARY_AGENT_ADMIN_TOKEN (or --admin-token-file)"
        );
    }
    let listener =
        tokio::net::TcpListener::bind(cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let mut cfg = cfg;
    // With port 0 the advertised URL needs the bound port.
    cfg.listen = addr;
    let agent = granary_agent::Agent::start(cfg).await?;
    println!(
        "granary agent: control API on http://{addr} (agent id {}, registry {})",
        agent.agent_id(),
        agent.config().registry
    );
    println!("granary: ready");
    let _ = std::io::stdout().flush();
    granary_agent::api::serve(agent, listener, crate::warehouse::shutdown_signal()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentArgs,
    }

    fn parse(args: &[&str]) -> Result<AgentConfig> {
        let mut all = vec!["agent"];
        all.extend_from_slice(args);
        config(&Cli::try_parse_from(all).map_err(|e| anyhow::anyhow!("{e}"))?.agent)
    }

    #[test]
    fn tokens_come_from_files_and_never_from_both_places() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("t");
        std::fs::write(&f, "gateway-agent-token-0123456789\n").unwrap();
        let c = parse(&["--gateway", "http://gw:8080", "--gateway-token-file", f.to_str().unwrap()]).unwrap();
        assert_eq!(c.gateway_token.as_deref(), Some("gateway-agent-token-0123456789"));
        let c =
            parse(&["--registry-token-file", f.to_str().unwrap(), "--admin-token-file", f.to_str().unwrap()]).unwrap();
        assert_eq!(
            (c.registry_token.as_deref(), c.admin_token.is_some()),
            (Some("gateway-agent-token-0123456789"), true)
        );
        assert!(parse(&["--gateway-token", "x", "--gateway-token-file", f.to_str().unwrap()]).is_err());
        std::fs::write(&f, "  \n").unwrap();
        let e = parse(&["--admin-token-file", f.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains("--admin-token-file") && e.contains("is empty"), "{e}");
        std::fs::write(&f, "a\nb\n").unwrap();
        assert!(parse(&["--admin-token-file", f.to_str().unwrap()])
            .unwrap_err()
            .to_string()
            .contains("more than one line"));
        let e = parse(&["--admin-token-file", "/nonexistent/t"]).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/t"), "{e}");
    }

    #[test]
    fn no_agent_flag_reads_the_gateways_heartbeat_token() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        let env_of = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
        };
        assert_eq!(env_of("admin_token").as_deref(), Some("GRANARY_AGENT_ADMIN_TOKEN"));
        assert_eq!(env_of("gateway_token").as_deref(), Some("GRANARY_GATEWAY_TOKEN"));
        let readers: Vec<String> = cmd
            .get_arguments()
            .filter(|a| a.get_env().is_some_and(|e| e == "GRANARY_AGENT_TOKEN"))
            .map(|a| a.get_id().to_string())
            .collect();
        assert!(readers.is_empty(), "agent flags read the gateway's GRANARY_AGENT_TOKEN: {readers:?}");
    }

    #[test]
    fn engine_and_resource_flags_reach_the_config() {
        let c = parse(&[
            "--engine-proxy",
            "--engine-proxy-drop-header",
            "x-request-id",
            "--engine-health-path",
            "/openapi.json",
            "--engine-threads",
            "3",
            "--gpus-per-engine",
            "0",
            "--host-memory",
            "1GiB",
        ])
        .unwrap();
        assert!(c.engines.proxy);
        assert_eq!(c.engines.proxy_drop_headers, ["x-request-id"]);
        assert_eq!((c.engines.health_path.as_str(), c.engines.threads), ("/openapi.json", Some(3)));
        assert_eq!(c.resources.host_memory, Some(ByteSize::gib(1)));
        let e = parse(&["--engine-health-path", "health"]).unwrap_err().to_string();
        assert!(e.contains("must start with '/'"), "{e}");
    }
}
