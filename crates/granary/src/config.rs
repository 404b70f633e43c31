//! Layered configuration: defaults → TOML file → `LMCACHE_*` env → `GRANARY_*` env → flags.
//!
//! One struct per component, validated at start so a bad value fails with
//! the field's name before anything listens. `GRANARY_` variables use `__`
//! between levels: `GRANARY_WAREHOUSE__STORE__MEMORY=8GiB` sets
//! `[warehouse.store] memory`. LMCache users' variables are mapped onto the
//! same fields (see `docs/configuration.md`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use granary_core::ByteSize;
use granary_warehouse::auth::TokenConfig;
use granary_warehouse::StoreConfig;
use serde::{Deserialize, Serialize};

/// The whole file; each component reads its own section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct GranaryConfig {
    pub warehouse: WarehouseConfig,
}

/// `granary warehouse`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WarehouseConfig {
    /// RESP listen address; `off` disables it.
    pub resp: String,
    /// HTTP listen address; `off` disables it.
    pub http: String,
    /// Tokens per block (LMCache's chunk size); reported to clients.
    pub block_tokens: u32,
    /// The store: tiers, policies, offload, limits.
    pub store: StoreConfig,
    /// Token for admin endpoints and commands (all namespaces).
    pub admin_token: Option<TokenConfig>,
    /// Bearer token per namespace.
    pub tokens: HashMap<String, TokenConfig>,
    /// Token that reads `/metrics` and nothing else (for a scraper).
    pub metrics_token: Option<TokenConfig>,
    /// Connection cap and idle timeout of the RESP front end.
    pub limits: granary_warehouse::config::ServeLimits,
    /// LMCache's `lm://` protocol: listen address and namespace.
    pub lm: granary_warehouse::config::LmConfig,
}

impl Default for WarehouseConfig {
    fn default() -> Self {
        WarehouseConfig {
            resp: "127.0.0.1:6380".into(),
            http: "127.0.0.1:8300".into(),
            block_tokens: 256,
            store: StoreConfig::default(),
            admin_token: None,
            tokens: HashMap::new(),
            metrics_token: None,
            limits: Default::default(),
            lm: Default::default(),
        }
    }
}

impl WarehouseConfig {
    /// A listen address, or `None` when disabled.
    pub fn listen(field: &str, value: &str) -> Result<Option<SocketAddr>> {
        match value.trim() {
            "" | "off" | "none" => Ok(None),
            v => v
                .parse()
                .map(Some)
                .map_err(|e| anyhow!("warehouse.{field}: {v:?} is not an address like 127.0.0.1:6380 ({e})")),
        }
    }

    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<()> {
        Self::listen("resp", &self.resp)?;
        Self::listen("http", &self.http)?;
        if self.block_tokens == 0 {
            bail!("warehouse.block_tokens must be positive");
        }
        self.limits.validate().map_err(|e| anyhow!(e))?;
        self.lm.validate().map_err(|e| anyhow!(e))?;
        let s = &self.store;
        if s.memory.0 == 0 {
            bail!("warehouse.store.memory must be positive");
        }
        if let Some(d) = &s.disk {
            if d.capacity.0 == 0 {
                bail!("warehouse.store.disk.capacity must be positive");
            }
        }
        if let Some(level) = s.compression {
            if !(1..=19).contains(&level) {
                bail!("warehouse.store.compression must be a zstd level from 1 to 19, got {level}");
            }
        }
        if s.queue_depth == 0 {
            bail!("warehouse.store.queue_depth must be positive");
        }
        if let Some(r) = &s.remote {
            let ok = [
                "s3://", "s3a://", "gs://", "az://", "azure://", "abfs://", "abfss://", "file://", "http://",
                "https://",
            ];
            if !ok.iter().any(|p| r.url.starts_with(p)) {
                bail!(
                    "warehouse.store.remote.url {:?} is not an object store URL (s3://, gs://, az://, file://)",
                    r.url
                );
            }
        }
        Ok(())
    }
}

/// Settings given on the command line (only those present override).
#[derive(Debug, Default, Clone)]
pub struct WarehouseFlags {
    pub resp: Option<String>,
    pub http: Option<String>,
    pub memory: Option<ByteSize>,
    pub disk_dir: Option<PathBuf>,
    pub disk: Option<ByteSize>,
    pub remote_url: Option<String>,
    pub policy: Option<String>,
    pub offload: Option<String>,
    pub compression: Option<i32>,
    pub encryption_key_file: Option<PathBuf>,
    pub admin_token: Option<String>,
    pub metrics_token: Option<String>,
    pub tokens: Vec<(String, String)>,
}

/// Loads `[warehouse]` from every layer. `env` is the process environment
/// (passed in so tests control it).
pub fn load_warehouse(
    file: Option<&Path>,
    env: &HashMap<String, String>,
    flags: &WarehouseFlags,
) -> Result<WarehouseConfig> {
    let mut fig = Figment::from(Serialized::defaults(GranaryConfig::default()));
    if let Some(path) = file {
        if !path.exists() {
            bail!("config file {} does not exist", path.display());
        }
        fig = fig.merge(Toml::file(path));
    }
    fig = fig.merge(lmcache_layer(env)?);
    let granary: Vec<(String, String)> =
        env.iter().filter(|(k, _)| k.starts_with("GRANARY_")).map(|(k, v)| (k.clone(), v.clone())).collect();
    fig = fig.merge(env_provider(granary));
    fig = fig.merge(flag_layer(flags));
    let cfg: GranaryConfig = fig.extract().map_err(|e| anyhow!("configuration: {e}"))?;
    let w = cfg.warehouse;
    w.validate()?;
    Ok(w)
}

/// `GRANARY_A__B__C=v` sets `a.b.c`; values read as integers or booleans
/// when they look like one, else as strings.
fn env_provider(vars: Vec<(String, String)>) -> Figment {
    let mut f = Figment::new();
    for (k, v) in vars {
        let Some(rest) = k.strip_prefix("GRANARY_") else { continue };
        if !rest.contains("__") {
            continue;
        }
        let path = rest.split("__").map(str::to_ascii_lowercase).collect::<Vec<_>>().join(".");
        f = if let Ok(i) = v.parse::<i64>() {
            f.merge(Serialized::default(&path, i))
        } else if let Ok(b) = v.parse::<bool>() {
            f.merge(Serialized::default(&path, b))
        } else {
            f.merge(Serialized::default(&path, v))
        };
    }
    f
}

/// LMCache's environment variables, mapped onto ours.
fn lmcache_layer(env: &HashMap<String, String>) -> Result<Figment> {
    let mut f = Figment::new();
    let get = |k: &str| env.get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let gib = |k: &str, v: &str| -> Result<u64> {
        let x: f64 = v.parse().map_err(|_| anyhow!("{k}={v:?}: expected a number of GB, e.g. 5.0"))?;
        if !(x >= 0.0 && x.is_finite()) {
            bail!("{k}={v:?}: must be a non-negative number of GB");
        }
        Ok((x * (1u64 << 30) as f64) as u64)
    };
    if let Some(v) = get("LMCACHE_CHUNK_SIZE") {
        let n: u32 = v.parse().map_err(|_| anyhow!("LMCACHE_CHUNK_SIZE={v:?}: expected a token count"))?;
        f = f.merge(Serialized::default("warehouse.block_tokens", n));
    }
    let cpu_on = match get("LMCACHE_LOCAL_CPU").as_deref().map(str::to_ascii_lowercase).as_deref() {
        None | Some("true") | Some("1") | Some("yes") => true,
        Some("false") | Some("0") | Some("no") => false,
        Some(v) => bail!("LMCACHE_LOCAL_CPU={v:?}: expected true or false"),
    };
    if let Some(v) = get("LMCACHE_MAX_LOCAL_CPU_SIZE") {
        let b = gib("LMCACHE_MAX_LOCAL_CPU_SIZE", &v)?.max(1);
        f = f.merge(Serialized::default("warehouse.store.memory", b));
    }
    if !cpu_on {
        // No CPU tier: writes go straight to the next tier, synchronously.
        f = f.merge(Serialized::default("warehouse.store.memory_tier", false));
    }
    let disk_dir = get("LMCACHE_LOCAL_DISK").map(|v| v.strip_prefix("file://").unwrap_or(&v).to_string());
    if let Some(dir) = disk_dir.filter(|d| !matches!(d.to_ascii_lowercase().as_str(), "none" | "null" | "false")) {
        let cap = match get("LMCACHE_MAX_LOCAL_DISK_SIZE") {
            Some(v) => gib("LMCACHE_MAX_LOCAL_DISK_SIZE", &v)?,
            None => 0,
        };
        f = f.merge(Serialized::default("warehouse.store.disk.dir", dir));
        // LMCache's default disk budget is 0 (no disk); keep ours explicit.
        f = f.merge(Serialized::default("warehouse.store.disk.capacity", if cap == 0 { 100u64 << 30 } else { cap }));
    }
    if let Some(url) = get("LMCACHE_REMOTE_URL") {
        let lower = url.to_ascii_lowercase();
        if ["s3://", "gs://", "az://", "file://"].iter().any(|p| lower.starts_with(p)) {
            f = f.merge(Serialized::default("warehouse.store.remote.url", url));
        } else {
            // redis:// or lm:// point an LMCache client at a cache server (this
            // one); they do not name a tier below it.
            tracing::warn!(
                url,
                "LMCACHE_REMOTE_URL names a cache server, not an object store; ignored by the warehouse"
            );
        }
    }
    if let Some(p) = get("LMCACHE_CACHE_POLICY") {
        let policy = match p.to_ascii_lowercase().as_str() {
            "lru" => "lru",
            "lfu" => "lfu",
            "fifo" => "fifo",
            "s3fifo" | "s3-fifo" => "s3fifo",
            "cost" => "cost",
            other => bail!("LMCACHE_CACHE_POLICY={other:?} is not supported (use LRU, LFU, FIFO, S3FIFO or COST)"),
        };
        f = f.merge(Serialized::default("warehouse.store.memory_policy", policy));
    }
    Ok(f)
}

fn flag_layer(flags: &WarehouseFlags) -> Figment {
    let mut f = Figment::new();
    macro_rules! set {
        ($key:expr, $v:expr) => {
            if let Some(v) = $v {
                f = f.merge(Serialized::default($key, v));
            }
        };
    }
    set!("warehouse.resp", flags.resp.clone());
    set!("warehouse.http", flags.http.clone());
    set!("warehouse.store.memory", flags.memory.map(|b| b.0));
    set!("warehouse.store.disk.dir", flags.disk_dir.as_ref().map(|p| p.display().to_string()));
    set!("warehouse.store.disk.capacity", flags.disk.map(|b| b.0));
    if flags.disk.is_none() && flags.disk_dir.is_some() {
        // A directory with no size: 100 GiB unless the file or env said otherwise.
        f = Figment::from(Serialized::default("warehouse.store.disk.capacity", 100u64 << 30)).merge(f);
    }
    set!("warehouse.store.remote.url", flags.remote_url.clone());
    if let Some(p) = &flags.policy {
        f = f.merge(Serialized::default("warehouse.store.memory_policy", p.to_ascii_lowercase()));
        if flags.disk_dir.is_some() {
            f = f.merge(Serialized::default("warehouse.store.disk.policy", p.to_ascii_lowercase()));
        }
    }
    set!("warehouse.store.offload", flags.offload.as_ref().map(|s| s.to_ascii_lowercase()));
    set!("warehouse.store.compression", flags.compression);
    set!("warehouse.store.encryption.key_file", flags.encryption_key_file.as_ref().map(|p| p.display().to_string()));
    set!("warehouse.admin_token.token", flags.admin_token.clone());
    set!("warehouse.metrics_token.token", flags.metrics_token.clone());
    for (ns, tok) in &flags.tokens {
        f = f.merge(Serialized::default(&format!("warehouse.tokens.{ns}.token"), tok.clone()));
    }
    f
}

/// Parses `NAMESPACE=TOKEN`.
pub fn parse_token_flag(s: &str) -> Result<(String, String), String> {
    let (ns, tok) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAMESPACE=TOKEN"))?;
    if ns.is_empty() || tok.is_empty() {
        return Err(format!("{s:?}: namespace and token must not be empty"));
    }
    Ok((ns.to_string(), tok.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use granary_warehouse::{OffloadMode, PolicyKind};

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_listen_on_loopback() {
        let c = load_warehouse(None, &env(&[]), &WarehouseFlags::default()).unwrap();
        assert!(c.resp.starts_with("127.0.0.1:") && c.http.starts_with("127.0.0.1:"));
        assert!(c.store.disk.is_none() && c.store.remote.is_none());
        assert_eq!(c.store.memory, ByteSize::gib(1));
    }

    #[test]
    fn layers_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("g.toml");
        std::fs::write(
            &file,
            r#"
[warehouse]
resp = "127.0.0.1:7000"
[warehouse.store]
memory = "2GiB"
memory_policy = "lfu"
offload = "evicted"
[warehouse.store.disk]
dir = "/tmp/x"
capacity = "10GiB"
policy = "s3fifo"
"#,
        )
        .unwrap();
        let e = env(&[("LMCACHE_MAX_LOCAL_CPU_SIZE", "3.0"), ("GRANARY_WAREHOUSE__STORE__MEMORY", "4GiB")]);
        let c = load_warehouse(Some(&file), &e, &WarehouseFlags::default()).unwrap();
        assert_eq!(c.resp, "127.0.0.1:7000");
        assert_eq!(c.store.memory, ByteSize::gib(4), "GRANARY_ env beats LMCACHE_ env beats file");
        assert_eq!(c.store.memory_policy, PolicyKind::Lfu);
        assert_eq!(c.store.offload, OffloadMode::Evicted);
        let d = c.store.disk.as_ref().unwrap();
        assert_eq!((d.capacity, d.policy), (ByteSize::gib(10), PolicyKind::S3fifo));
        let flags =
            WarehouseFlags { memory: Some(ByteSize::mib(512)), policy: Some("COST".into()), ..Default::default() };
        let c = load_warehouse(Some(&file), &e, &flags).unwrap();
        assert_eq!(c.store.memory, ByteSize::mib(512), "flags win");
        assert_eq!(c.store.memory_policy, PolicyKind::Cost);
    }

    #[test]
    fn lmcache_variables_map_onto_ours() {
        let e = env(&[
            ("LMCACHE_CHUNK_SIZE", "512"),
            ("LMCACHE_MAX_LOCAL_CPU_SIZE", "5"),
            ("LMCACHE_LOCAL_DISK", "file:///data/lmcache/"),
            ("LMCACHE_MAX_LOCAL_DISK_SIZE", "20"),
            ("LMCACHE_REMOTE_URL", "s3://bucket/kv"),
            ("LMCACHE_CACHE_POLICY", "LFU"),
        ]);
        let c = load_warehouse(None, &e, &WarehouseFlags::default()).unwrap();
        assert_eq!(c.block_tokens, 512);
        assert_eq!(c.store.memory, ByteSize::gib(5));
        let d = c.store.disk.unwrap();
        assert_eq!((d.dir.to_str().unwrap(), d.capacity), ("/data/lmcache/", ByteSize::gib(20)));
        assert_eq!(c.store.remote.unwrap().url, "s3://bucket/kv");
        assert_eq!(c.store.memory_policy, PolicyKind::Lfu);
        // LMCache's redis:// remote points clients at a server like this one: not a tier.
        let c = load_warehouse(None, &env(&[("LMCACHE_REMOTE_URL", "redis://h:6379")]), &WarehouseFlags::default())
            .unwrap();
        assert!(c.store.remote.is_none());
        let c = load_warehouse(None, &env(&[("LMCACHE_LOCAL_CPU", "False")]), &WarehouseFlags::default()).unwrap();
        assert!(!c.store.memory_tier, "LMCACHE_LOCAL_CPU=false means no memory tier");
    }

    #[test]
    fn bad_values_name_the_field() {
        let bad =
            |e: &[(&str, &str)], flags: WarehouseFlags| load_warehouse(None, &env(e), &flags).unwrap_err().to_string();
        assert!(bad(&[("LMCACHE_CACHE_POLICY", "MRU")], Default::default()).contains("LMCACHE_CACHE_POLICY"));
        assert!(
            bad(&[("LMCACHE_MAX_LOCAL_CPU_SIZE", "lots")], Default::default()).contains("LMCACHE_MAX_LOCAL_CPU_SIZE")
        );
        assert!(bad(&[("GRANARY_WAREHOUSE__STORE__MEMORY", "12 parsecs")], Default::default()).contains("memory"));
        assert!(
            bad(&[], WarehouseFlags { resp: Some("nowhere".into()), ..Default::default() }).contains("warehouse.resp")
        );
        assert!(bad(&[], WarehouseFlags { policy: Some("random".into()), ..Default::default() }).contains("random"));
        assert!(bad(&[], WarehouseFlags { remote_url: Some("redis://x".into()), ..Default::default() })
            .contains("remote.url"));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("g.toml");
        std::fs::write(&file, "[warehouse.store]\nmemroy = \"1GiB\"\n").unwrap();
        let e = load_warehouse(Some(&file), &env(&[]), &Default::default()).unwrap_err().to_string();
        assert!(e.contains("memroy"), "{e}");
    }

    /// `lm://` lives under `[warehouse.lm]`; its old keys under
    /// `[warehouse.limits]` stop the start with the new place's name.
    #[test]
    fn lm_settings_and_their_old_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("g.toml");
        std::fs::write(&file, "[warehouse.lm]\nlisten = \"127.0.0.1:65432\"\nnamespace = \"kv\"\n").unwrap();
        let c = load_warehouse(Some(&file), &env(&[]), &Default::default()).unwrap();
        assert_eq!((c.lm.addr().unwrap().unwrap().port(), c.lm.namespace.as_str()), (65432, "kv"));
        let c = load_warehouse(None, &env(&[("GRANARY_WAREHOUSE__LM__LISTEN", "127.0.0.1:7")]), &Default::default());
        assert_eq!(c.unwrap().lm.listen, "127.0.0.1:7");
        std::fs::write(&file, "[warehouse.limits]\nlm_listen = \"127.0.0.1:65432\"\n").unwrap();
        let e = load_warehouse(Some(&file), &env(&[]), &Default::default()).unwrap_err().to_string();
        assert!(e.contains("warehouse.limits.lm_listen") && e.contains("[warehouse.lm]"), "{e}");
        let e = load_warehouse(None, &env(&[("GRANARY_WAREHOUSE__LM__LISTEN", "nowhere")]), &Default::default());
        assert!(e.unwrap_err().to_string().contains("warehouse.lm.listen"));
    }

    #[test]
    fn env_options_keep_their_text() {
        let e = env(&[
            ("GRANARY_WAREHOUSE__STORE__REMOTE__URL", "s3://b/p"),
            ("GRANARY_WAREHOUSE__STORE__REMOTE__OPTIONS__AWS_ALLOW_HTTP", "true"),
            ("GRANARY_WAREHOUSE__STORE__REMOTE__OPTIONS__AWS_ENDPOINT", "http://127.0.0.1:9000"),
        ]);
        let c = load_warehouse(None, &e, &WarehouseFlags::default()).unwrap();
        let o = c.store.remote.unwrap().options;
        assert_eq!(o["aws_allow_http"], "true");
        assert_eq!(o["aws_endpoint"], "http://127.0.0.1:9000");
    }

    #[test]
    fn flags_for_disk_and_tokens() {
        let flags = WarehouseFlags {
            disk_dir: Some("/tmp/d".into()),
            tokens: vec![("t1".into(), "s1".into())],
            admin_token: Some("root".into()),
            ..Default::default()
        };
        let c = load_warehouse(None, &env(&[]), &flags).unwrap();
        assert_eq!(c.store.disk.unwrap().capacity, ByteSize::gib(100));
        assert_eq!(c.tokens["t1"].token.as_deref(), Some("s1"));
        assert_eq!(c.admin_token.unwrap().token.as_deref(), Some("root"));
        assert_eq!(parse_token_flag("a=b").unwrap(), ("a".into(), "b".into()));
        assert!(parse_token_flag("ab").is_err());
    }
}
