//! `granary gateway`: the OpenAI-compatible, multi-tenant front door, and
//! `granary gateway admin ...` to manage its tenants and keys.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use granary_gateway::config::UpstreamConfig;
use granary_gateway::identity::{AdminCmd, AdminToken, Identity, IdentityOptions};
use granary_gateway::limits::{Limiter, RedisOptions};
use granary_gateway::routing::PolicyConfig;
use granary_gateway::{Gateway, GatewayConfig};
use tokio_util::sync::CancellationToken;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct GatewayArgs {
    #[command(subcommand)]
    pub sub: Option<GatewaySub>,
    /// TOML config file: [gateway] (with [gateway.agents]), [[upstream]], [[pool]].
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Listen address [default: 127.0.0.1:8080].
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// An upstream engine's base URL (repeatable); adds to the file's.
    #[arg(long = "upstream")]
    pub upstreams: Vec<String>,
    /// Keys, tenants and audit: sqlite://PATH or postgres://... [default: sqlite://gateway.db].
    #[arg(long)]
    pub database: Option<String>,
    /// Redis URL for limits shared by several gateways.
    #[arg(long)]
    pub redis: Option<String>,
    /// Routing policy of the default pool: round_robin, least_load, session, kv_aware.
    #[arg(long)]
    pub policy: Option<String>,
}

#[derive(Subcommand)]
pub enum GatewaySub {
    /// Manage tenants, keys, usage and audit records in the gateway's database.
    Admin(AdminArgs),
}

#[derive(Args)]
pub struct AdminArgs {
    /// The gateway's config file (for its database URL).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Database URL (overrides the config file's).
    #[arg(long, env = "GRANARY_GATEWAY_DATABASE")]
    pub database: Option<String>,
    #[command(subcommand)]
    pub cmd: AdminCmd,
}

fn load(config: Option<&PathBuf>) -> Result<GatewayConfig> {
    match config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            GatewayConfig::from_toml(&text).with_context(|| format!("in {}", path.display()))
        }
        None => Ok(GatewayConfig::default()),
    }
}

fn parse_policy(name: &str) -> Result<PolicyConfig> {
    let text = format!("policy = {name:?}");
    toml::from_str(&text).map_err(|_| {
        anyhow::anyhow!("--policy: unknown policy {name:?} (round_robin, least_load, session or kv_aware)")
    })
}

pub async fn run(args: GatewayArgs) -> Result<()> {
    if let Some(GatewaySub::Admin(a)) = args.sub {
        let cfg = load(a.config.as_ref())?;
        let url = a.database.unwrap_or(cfg.gateway.database);
        let identity = Identity::open(&url, IdentityOptions::default()).await?;
        let res = granary_gateway::identity::run_admin_priced(a.cmd, &identity, Some(&cfg.gateway.prices)).await;
        identity.flush().await;
        return res;
    }
    let mut cfg = load(args.config.as_ref())?;
    if let Some(l) = args.listen {
        cfg.gateway.listen = l;
    }
    if let Some(d) = args.database {
        cfg.gateway.database = d;
    }
    if let Some(r) = args.redis {
        cfg.gateway.redis = Some(r);
    }
    for (i, url) in args.upstreams.iter().enumerate() {
        cfg.upstreams.push(UpstreamConfig::new(format!("upstream-{}", i + 1), url.clone()));
        if !cfg.pools.is_empty() {
            anyhow::bail!("--upstream adds to the default pool; with [[pool]] sections, list upstreams in the file");
        }
    }
    if let Some(p) = &args.policy {
        let policy = parse_policy(p)?;
        if !cfg.pools.is_empty() {
            anyhow::bail!("--policy sets the default pool's policy; with [[pool]] sections, set `routing` in the file");
        }
        let mut pools = cfg.effective_pools();
        pools[0].routing = policy;
        cfg.pools = pools;
    }
    if cfg.upstreams.is_empty() && !cfg.gateway.agents.enabled {
        anyhow::bail!(
            "no upstreams: pass --upstream URL, list [[upstream]] sections in --config, or let node agents report engines ([gateway.agents] enabled)"
        );
    }
    cfg.validate()?;
    serve(cfg).await
}

async fn serve(cfg: GatewayConfig) -> Result<()> {
    let g = &cfg.gateway;
    let identity =
        Identity::open(&g.database, g.identity_options()).await.with_context(|| "opening the gateway database")?;
    let limiter = match &g.redis {
        Some(url) => Limiter::redis(url, RedisOptions::default()).await?,
        None => Limiter::in_process(),
    };
    let admin = match std::env::var(&g.admin_token_env) {
        Ok(t) if t.len() >= 16 => Some(AdminToken::new(&t)),
        Ok(_) => anyhow::bail!("{} must be at least 16 characters", g.admin_token_env),
        Err(_) => {
            eprintln!("granary: {} is not set: the admin API and /metrics are disabled", g.admin_token_env);
            None
        }
    };
    let agent_token = std::env::var(&g.agent_token_env).ok().filter(|t| !t.is_empty());
    if cfg.upstreams.is_empty() && admin.is_none() && agent_token.is_none() {
        anyhow::bail!(
            "no upstreams, and node agents cannot report engines without a token: set {} (agents only) or {}",
            g.agent_token_env,
            g.admin_token_env
        );
    }
    let gw = Gateway::new(&cfg, identity.clone(), limiter)?;
    // Day and month budgets from the usage rollup before the listener
    // takes a request: a restarted gateway must not admit, in its first
    // moments, what a tenant's spent budget no longer allows.
    gw.restore_budgets().await;
    gw.upstreams.probe_all(g).await;
    let stop = CancellationToken::new();
    gw.upstreams.spawn_watchers(g, stop.clone());
    let agents_on = g.agents.enabled && admin.is_some();
    let app = granary_gateway::server::app(gw.clone(), admin);
    let listener = tokio::net::TcpListener::bind(g.listen).await.with_context(|| format!("binding {}", g.listen))?;
    let addr = listener.local_addr()?;
    let scheme = if g.tls.is_some() { "https" } else { "http" };
    println!(
        "granary: gateway on {scheme}://{addr}/v1 ({} upstreams, agents {}, database {}, limits {})",
        cfg.upstreams.len(),
        if agents_on { "on" } else { "off" },
        identity.backend(),
        gw.limiter.backend()
    );
    println!("granary: ready");
    let _ = std::io::stdout().flush();
    let limits = granary_core::serve::HttpLimits::new(g.header_timeout_s, g.max_connections);
    match &g.tls {
        Some(tls) => {
            let server = granary_gateway::tls::server_config(tls)?;
            granary_gateway::tls::serve(listener, app, server, limits, crate::warehouse::shutdown_signal()).await?;
        }
        None => {
            granary_gateway::front::serve_plain(listener, app, limits, crate::warehouse::shutdown_signal()).await?;
        }
    }
    stop.cancel();
    identity.flush().await;
    Ok(())
}
