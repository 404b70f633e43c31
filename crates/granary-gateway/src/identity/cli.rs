//! The admin command line (`granary gateway admin --database URL <cmd>`):
//! the same operations as the admin HTTP API, straight on the database.

use std::io::Write;

use anyhow::Context as _;

use super::http::{expiry, parse_time};
use super::{
    current_month_ms, usage_csv_priced, AuditQuery, Identity, NewKey, NewTenant, Tenant, TenantUpdate, UsageQuery,
};
use crate::{KeyId, Limits, Priority};

/// Admin commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum AdminCmd {
    /// Create, list, change or disable tenants.
    Tenant {
        #[command(subcommand)]
        cmd: TenantCmd,
    },
    /// Create, list or revoke API keys.
    Key {
        #[command(subcommand)]
        cmd: KeyCmd,
    },
    /// Usage per tenant and model (default: the current UTC month).
    Usage {
        /// Start, RFC 3339 or unix seconds (inclusive).
        #[arg(long)]
        from: Option<String>,
        /// End, RFC 3339 or unix seconds (exclusive).
        #[arg(long)]
        to: Option<String>,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// CSV with a header line instead of a table.
        #[arg(long)]
        csv: bool,
    },
    /// The newest audit records.
    Audit {
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// How many (1 to 1000).
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Limits given as flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LimitArgs {
    /// Requests per minute.
    #[arg(long)]
    pub requests_per_minute: Option<u64>,
    /// Tokens (prompt + completion) per minute.
    #[arg(long)]
    pub tokens_per_minute: Option<u64>,
    /// Tokens per UTC day.
    #[arg(long)]
    pub tokens_per_day: Option<u64>,
    /// Tokens per UTC calendar month.
    #[arg(long)]
    pub tokens_per_month: Option<u64>,
    /// Spend per UTC day, in the currency of `[gateway.prices]` (e.g. 2.5).
    #[arg(long)]
    pub spend_per_day: Option<crate::pricing::Money>,
    /// Spend per UTC calendar month, in the currency of `[gateway.prices]`.
    #[arg(long)]
    pub spend_per_month: Option<crate::pricing::Money>,
}

impl LimitArgs {
    fn any(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_minute.is_some()
            || self.tokens_per_day.is_some()
            || self.tokens_per_month.is_some()
            || self.spend_per_day.is_some()
            || self.spend_per_month.is_some()
    }

    /// `base` with the given flags applied.
    fn apply(&self, mut base: Limits) -> Limits {
        base.requests_per_minute = self.requests_per_minute.or(base.requests_per_minute);
        base.tokens_per_minute = self.tokens_per_minute.or(base.tokens_per_minute);
        base.tokens_per_day = self.tokens_per_day.or(base.tokens_per_day);
        base.tokens_per_month = self.tokens_per_month.or(base.tokens_per_month);
        base.spend_per_day = self.spend_per_day.or(base.spend_per_day);
        base.spend_per_month = self.spend_per_month.or(base.spend_per_month);
        base
    }
}

/// `tenant …` commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum TenantCmd {
    /// Create a tenant.
    Create {
        /// `[a-z0-9][a-z0-9_-]{0,62}`.
        name: String,
        /// KV namespace (default: the name).
        #[arg(long)]
        namespace: Option<String>,
        /// batch, standard or premium.
        #[arg(long)]
        priority: Option<Priority>,
        /// Keep prompt text in audit records.
        #[arg(long)]
        log_prompts: bool,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// List tenants.
    List {
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Change a tenant; limit flags are merged into its current limits.
    Update {
        /// The tenant's name.
        name: String,
        /// batch, standard or premium.
        #[arg(long)]
        priority: Option<Priority>,
        /// true or false.
        #[arg(long)]
        log_prompts: Option<bool>,
        /// true or false.
        #[arg(long)]
        disabled: Option<bool>,
        /// Drop every limit before applying the limit flags.
        #[arg(long)]
        clear_limits: bool,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Disable a tenant and revoke all its keys.
    Disable {
        /// The tenant's name.
        name: String,
    },
}

/// `key …` commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum KeyCmd {
    /// Create a key; its secret is printed once.
    Create {
        /// The tenant's name.
        #[arg(long)]
        tenant: String,
        /// A label for people.
        #[arg(long)]
        name: Option<String>,
        /// Models the key may use, comma-separated (default: all).
        #[arg(long, value_delimiter = ',')]
        models: Option<Vec<String>>,
        /// Expiry, RFC 3339 or unix seconds.
        #[arg(long, conflicts_with = "expires_in")]
        expires_at: Option<String>,
        /// Expiry, seconds from now.
        #[arg(long)]
        expires_in: Option<u64>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// List keys (never their secrets).
    List {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id.
    Revoke {
        /// The key's id (from `key list`).
        id: KeyId,
    },
    /// Give a key a new secret (printed once); the old one keeps working
    /// for the grace period.
    Rotate {
        /// The key's id (from `key list`).
        id: KeyId,
        /// Seconds the old secret keeps working (0: none).
        #[arg(long, default_value_t = 86_400)]
        grace_s: u64,
    },
    /// Change a key's models, limits or expiry (what is not given stays).
    Update {
        /// The key's id (from `key list`).
        id: KeyId,
        /// Models the key may use, comma-separated.
        #[arg(long, value_delimiter = ',', conflicts_with = "all_models")]
        models: Option<Vec<String>>,
        /// Let the key use every model.
        #[arg(long)]
        all_models: bool,
        /// Expiry, RFC 3339 or unix seconds.
        #[arg(long, conflicts_with_all = ["expires_in", "never_expires"])]
        expires_at: Option<String>,
        /// Expiry, seconds from now.
        #[arg(long, conflicts_with = "never_expires")]
        expires_in: Option<u64>,
        /// Remove the expiry.
        #[arg(long)]
        never_expires: bool,
        /// Limits given here change; the others stay.
        #[command(flatten)]
        limits: LimitArgs,
    },
}

/// Runs an admin command, printing to stdout (and warnings to stderr).
pub async fn run_admin(cmd: AdminCmd, identity: &Identity) -> anyhow::Result<()> {
    run_admin_priced(cmd, identity, None).await
}

/// [`run_admin`] with the gateway's prices: `usage` then shows each row's
/// cost (a model without a price: an empty cell). Prices without models
/// are none.
pub async fn run_admin_priced(
    cmd: AdminCmd,
    identity: &Identity,
    prices: Option<&crate::pricing::Prices>,
) -> anyhow::Result<()> {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let r = run_admin_to(cmd, identity, prices, &mut out, &mut err).await;
    std::io::stderr().write_all(&err)?;
    std::io::stdout().write_all(&out)?;
    r
}

/// [`run_admin`] with its output into writers.
pub(super) async fn run_admin_to(
    cmd: AdminCmd,
    identity: &Identity,
    prices: Option<&crate::pricing::Prices>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> anyhow::Result<()> {
    match cmd {
        AdminCmd::Tenant { cmd } => tenant_cmd(cmd, identity, out).await,
        AdminCmd::Key { cmd } => key_cmd(cmd, identity, out, err).await,
        AdminCmd::Usage { from, to, tenant, csv } => {
            let (month_from, month_to) = current_month_ms();
            let from_ms = from.map(|v| parse_time("from", &v)).transpose().map_err(api)?.unwrap_or(month_from);
            let to_ms = to.map(|v| parse_time("to", &v)).transpose().map_err(api)?.unwrap_or(month_to);
            let rows = identity.usage(&UsageQuery { from_ms, to_ms, tenant }).await?;
            let prices = prices.filter(|p| !p.models.is_empty());
            if csv {
                write!(out, "{}", usage_csv_priced(&rows, prices))?;
            } else {
                writeln!(out, "usage from {} to {}", fmt_time(Some(from_ms)), fmt_time(Some(to_ms)))?;
                let body = rows
                    .iter()
                    .map(|r| {
                        let mut row = vec![
                            r.tenant.clone(),
                            r.model.clone(),
                            r.requests.to_string(),
                            r.errors.to_string(),
                            r.prompt_tokens.to_string(),
                            r.completion_tokens.to_string(),
                            r.cached_tokens.to_string(),
                        ];
                        if let Some(p) = prices {
                            let cost = p.cost(&r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens);
                            row.push(cost.map(|c| format!("{c:.6} {}", p.currency)).unwrap_or_else(|| "-".into()));
                        }
                        row
                    })
                    .collect::<Vec<_>>();
                let mut head = vec!["TENANT", "MODEL", "REQUESTS", "ERRORS", "PROMPT", "COMPLETION", "CACHED"];
                if prices.is_some() {
                    head.push("COST");
                }
                write_table(out, &head, &body)?;
            }
            Ok(())
        }
        AdminCmd::Audit { tenant, limit, json } => {
            let recs = identity.audit(&AuditQuery { tenant, limit, since_ms: None }).await?;
            if json {
                for r in &recs {
                    writeln!(out, "{}", serde_json::to_string(r)?)?;
                }
                return Ok(());
            }
            let body = recs
                .iter()
                .map(|r| {
                    vec![
                        fmt_time(Some(r.time_ms)),
                        r.status.to_string(),
                        r.tenant.clone().unwrap_or_default(),
                        r.model.clone().unwrap_or_default(),
                        r.endpoint.clone(),
                        format!("{}+{}", r.prompt_tokens, r.completion_tokens),
                        format!("{:.1}", r.latency_ms),
                        r.request_id.clone(),
                    ]
                })
                .collect::<Vec<_>>();
            write_table(
                out,
                &["TIME", "STATUS", "TENANT", "MODEL", "ENDPOINT", "TOKENS", "LATENCY_MS", "REQUEST"],
                &body,
            )?;
            Ok(())
        }
    }
}

fn api(e: crate::ApiError) -> anyhow::Error {
    anyhow::anyhow!(e.message)
}

async fn tenant_cmd(cmd: TenantCmd, identity: &Identity, out: &mut dyn Write) -> anyhow::Result<()> {
    match cmd {
        TenantCmd::Create { name, namespace, priority, log_prompts, limits } => {
            let t = identity
                .create_tenant(NewTenant {
                    name,
                    namespace,
                    priority,
                    limits: Some(limits.apply(Limits::default())),
                    log_prompts: Some(log_prompts),
                })
                .await?;
            writeln!(out, "{}", serde_json::to_string_pretty(&t)?)?;
        }
        TenantCmd::List { json } => {
            let tenants = identity.list_tenants().await?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&tenants)?)?;
            } else {
                write_tenants(out, &tenants)?;
            }
        }
        TenantCmd::Update { name, priority, log_prompts, disabled, clear_limits, limits } => {
            let new_limits = if clear_limits || limits.any() {
                let base = if clear_limits { Limits::default() } else { identity.get_tenant(&name).await?.limits };
                Some(limits.apply(base))
            } else {
                None
            };
            let t = identity
                .update_tenant(&name, TenantUpdate { priority, limits: new_limits, log_prompts, disabled })
                .await?;
            writeln!(out, "{}", serde_json::to_string_pretty(&t)?)?;
        }
        TenantCmd::Disable { name } => {
            let t = identity.disable_tenant(&name).await?;
            writeln!(out, "tenant {} disabled; its keys are revoked", t.name)?;
        }
    }
    Ok(())
}

async fn key_cmd(cmd: KeyCmd, identity: &Identity, out: &mut dyn Write, err: &mut dyn Write) -> anyhow::Result<()> {
    match cmd {
        KeyCmd::Create { tenant, name, models, expires_at, expires_in, limits } => {
            let expires_ms = expiry(expires_at.as_deref(), expires_in).map_err(api)?;
            let limits = limits.any().then(|| limits.apply(Limits::default()));
            let created = identity.create_key(NewKey { tenant, name, models, expires_ms, limits }).await?;
            let mut v = serde_json::to_value(&created.info).context("printing the key")?;
            if let Some(obj) = v.as_object_mut() {
                obj.insert("key".into(), created.secret.clone().into());
            }
            writeln!(err, "warning: the key below is shown only now; store it, it cannot be recovered")?;
            writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        }
        KeyCmd::List { tenant, json } => {
            let keys = identity.list_keys(tenant.as_deref()).await?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&keys)?)?;
                return Ok(());
            }
            let body = keys
                .iter()
                .map(|k| {
                    vec![
                        k.id.to_string(),
                        k.prefix.clone(),
                        k.tenant.clone(),
                        k.name.clone().unwrap_or_default(),
                        k.models.as_ref().map(|m| m.join(",")).unwrap_or_else(|| "*".into()),
                        fmt_time(k.expires_ms),
                        fmt_time(k.revoked_ms),
                        fmt_time(k.last_used_ms),
                    ]
                })
                .collect::<Vec<_>>();
            write_table(out, &["ID", "PREFIX", "TENANT", "NAME", "MODELS", "EXPIRES", "REVOKED", "LAST_USED"], &body)?;
        }
        KeyCmd::Revoke { id } => {
            identity.revoke_key(id).await?;
            writeln!(out, "key {id} revoked")?;
        }
        KeyCmd::Rotate { id, grace_s } => {
            let rotated = identity.rotate_key(id, std::time::Duration::from_secs(grace_s)).await?;
            let mut v = serde_json::to_value(&rotated.info).context("printing the key")?;
            if let Some(obj) = v.as_object_mut() {
                obj.insert("key".into(), rotated.secret.clone().into());
            }
            writeln!(err, "warning: the key below is shown only now; the old secret works for {grace_s} s")?;
            writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        }
        KeyCmd::Update { id, models, all_models, expires_at, expires_in, never_expires, limits } => {
            let expires_ms = if never_expires {
                Some(None)
            } else {
                expiry(expires_at.as_deref(), expires_in).map_err(api)?.map(Some)
            };
            let limits = if limits.any() { Some(limits.apply(identity.get_key(id).await?.limits)) } else { None };
            let models = if all_models { Some(None) } else { models.map(Some) };
            let u = super::KeyUpdate { name: None, models, limits, expires_ms };
            let info = identity.update_key(id, u).await?;
            writeln!(out, "{}", serde_json::to_string_pretty(&info)?)?;
        }
    }
    Ok(())
}

fn write_tenants(out: &mut dyn Write, tenants: &[Tenant]) -> std::io::Result<()> {
    let body = tenants
        .iter()
        .map(|t| {
            vec![
                t.id.to_string(),
                t.name.clone(),
                t.namespace.clone(),
                t.priority.as_str().to_string(),
                if t.limits.is_unlimited() { "-".into() } else { serde_json::to_string(&t.limits).unwrap_or_default() },
                t.log_prompts.to_string(),
                t.disabled.to_string(),
            ]
        })
        .collect::<Vec<_>>();
    write_table(out, &["ID", "NAME", "NAMESPACE", "PRIORITY", "LIMITS", "LOG_PROMPTS", "DISABLED"], &body)
}

/// Unix ms as RFC 3339 (UTC, seconds), `-` for none.
fn fmt_time(ms: Option<i64>) -> String {
    ms.and_then(chrono::DateTime::from_timestamp_millis)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| "-".into())
}

/// Left-aligned columns, two spaces apart.
fn write_table(out: &mut dyn Write, headers: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s
    };
    writeln!(out, "{}", line(headers.to_vec()))?;
    for row in rows {
        writeln!(out, "{}", line(row.iter().map(String::as_str).collect()))?;
    }
    Ok(())
}
