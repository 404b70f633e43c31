//! Store configuration: tiers, policies, offload mode, limits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use granary_core::ByteSize;
use serde::{Deserialize, Serialize};

use crate::policy::PolicyKind;

/// When values written to memory are copied to slower tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadMode {
    /// Every write is offloaded (write-through, asynchronously).
    #[default]
    All,
    /// Only values read at least `hot_threshold` times.
    Hot,
    /// Only values evicted from memory (write-back).
    Evicted,
}

impl std::str::FromStr for OffloadMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "all" => Ok(Self::All),
            "hot" => Ok(Self::Hot),
            "evicted" => Ok(Self::Evicted),
            _ => Err(format!("unknown offload mode {s:?} (expected all, hot or evicted)")),
        }
    }
}

/// The local disk tier.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// Directory holding the tier's files (created if missing).
    pub dir: PathBuf,
    /// Byte budget of the tier.
    pub capacity: ByteSize,
    /// Eviction policy of the tier.
    #[serde(default)]
    pub policy: PolicyKind,
}

/// The shared remote tier.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteConfig {
    /// An `object_store` URL: `s3://bucket/prefix`, `gs://`, `az://`, `file:///mnt/shared/kv`.
    pub url: String,
    /// Extra options for the object store (e.g. `aws_endpoint`, `aws_allow_http`,
    /// `aws_access_key_id`); AWS_*/GOOGLE_*/AZURE_* env vars are read too.
    /// Values may be written as strings, numbers or booleans.
    #[serde(default, deserialize_with = "scalar_map")]
    pub options: HashMap<String, String>,
}

/// Encryption at rest for the disk and remote tiers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncryptionConfig {
    /// File holding the 32-byte AES-256 key (raw, or 64 hex chars).
    pub key_file: Option<PathBuf>,
    /// Env var holding the key as 64 hex chars.
    pub key_env: Option<String>,
}

/// Per-namespace settings.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    /// Default time to live of entries in this namespace, in seconds.
    pub ttl_secs: Option<u64>,
    /// Most bytes this namespace may hold in the memory tier; its writes
    /// evict its own entries first. `None`: no quota.
    pub memory_quota: Option<ByteSize>,
    /// Most bytes this namespace may hold on the disk tier, likewise.
    pub disk_quota: Option<ByteSize>,
}

/// Limits of the network front ends against idle or abusive clients.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeLimits {
    /// Most connections open at once, per protocol; one more is answered
    /// `-ERR max number of clients reached` on RESP (Redis's `maxclients`),
    /// a 503 `too_many_connections` on HTTP, and closed.
    pub max_connections: usize,
    /// Seconds a RESP connection may wait between commands before it is
    /// closed; 0 keeps idle connections open (Redis's `timeout`).
    pub idle_timeout_secs: u64,
    /// Seconds a RESP connection to a server with tokens has to pass AUTH,
    /// counted from when it opens; one still unauthenticated then is
    /// closed, so sockets that never authenticate do not keep slots of
    /// `max_connections`. 0: no limit.
    pub auth_timeout_secs: u64,
    /// Seconds a RESP or `lm://` connection may make no progress in the
    /// middle of something: a write of replies the client does not read
    /// (the replies queued for one connection are bounded: it runs no
    /// further command while a write is pending), or a frame (an `lm://`
    /// value) that stops arriving half way. Past it the connection is
    /// closed. 0: no limit.
    pub io_timeout_secs: u64,
    /// Seconds an HTTP client has to send a request's headers, counted from
    /// when the server is ready for them (a new connection, or the end of
    /// the previous answer on a kept-alive one); past it the connection is
    /// closed, so a client trickling headers (slowloris) or holding an idle
    /// connection does not keep a slot of `max_connections`. 0: no limit.
    pub header_timeout_secs: u64,
    /// Where the `lm://` listen address used to be set; now
    /// `[warehouse.lm] listen`. Kept only so that an old file is refused by
    /// [`ServeLimits::validate`] with the new name instead of being read
    /// as something else.
    #[serde(default, skip_serializing)]
    pub lm_listen: Option<String>,
    /// Likewise, now `[warehouse.lm] namespace`.
    #[serde(default, skip_serializing)]
    pub lm_namespace: Option<String>,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_connections: 10_000,
            idle_timeout_secs: 0,
            auth_timeout_secs: 10,
            io_timeout_secs: 30,
            header_timeout_secs: 30,
            lm_listen: None,
            lm_namespace: None,
        }
    }
}

impl ServeLimits {
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_secs != 0).then(|| Duration::from_secs(self.idle_timeout_secs))
    }

    pub fn auth_timeout(&self) -> Option<Duration> {
        (self.auth_timeout_secs != 0).then(|| Duration::from_secs(self.auth_timeout_secs))
    }

    pub fn io_timeout(&self) -> Option<Duration> {
        (self.io_timeout_secs != 0).then(|| Duration::from_secs(self.io_timeout_secs))
    }

    pub fn header_timeout(&self) -> Option<Duration> {
        (self.header_timeout_secs != 0).then(|| Duration::from_secs(self.header_timeout_secs))
    }

    /// Checks what serde cannot; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("warehouse.limits.max_connections must be positive".into());
        }
        if self.lm_listen.is_some() {
            return Err("warehouse.limits.lm_listen has moved: set `listen` under [warehouse.lm] \
                        (GRANARY_WAREHOUSE__LM__LISTEN)"
                .into());
        }
        if self.lm_namespace.is_some() {
            return Err("warehouse.limits.lm_namespace has moved: set `namespace` under [warehouse.lm] \
                        (GRANARY_WAREHOUSE__LM__NAMESPACE)"
                .into());
        }
        Ok(())
    }
}

/// LMCache's `lm://` server protocol ([`crate::lm`]): `[warehouse.lm]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LmConfig {
    /// Listen address, e.g. `127.0.0.1:65432`; `off` (the default) serves
    /// none. The protocol has no authentication.
    pub listen: String,
    /// The one namespace `lm://` clients read and write.
    pub namespace: String,
}

impl Default for LmConfig {
    fn default() -> Self {
        LmConfig { listen: "off".into(), namespace: crate::auth::DEFAULT_NAMESPACE.into() }
    }
}

impl LmConfig {
    /// The listen address; `None` when off, an error naming the field
    /// when it is not an address.
    pub fn addr(&self) -> Result<Option<std::net::SocketAddr>, String> {
        match self.listen.trim() {
            "" | "off" | "none" => Ok(None),
            v => v
                .parse()
                .map(Some)
                .map_err(|e| format!("warehouse.lm.listen: {v:?} is not an address like 127.0.0.1:65432 ({e})")),
        }
    }

    /// Checks the address and the namespace; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.addr()?;
        crate::types::check_namespace(self.namespace.as_bytes())
            .map(drop)
            .map_err(|e| format!("warehouse.lm.namespace {:?} {e}", self.namespace))
    }
}

/// Everything the store needs; servers' settings live beside it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Byte budget of the memory tier.
    pub memory: ByteSize,
    /// `false`: no memory tier; writes go straight to the next tier,
    /// synchronously, and reads are not promoted (LMCache's
    /// `LMCACHE_LOCAL_CPU=false`). Needs a disk or remote tier.
    pub memory_tier: bool,
    /// Eviction policy of the memory tier.
    pub memory_policy: PolicyKind,
    pub disk: Option<DiskConfig>,
    pub remote: Option<RemoteConfig>,
    pub offload: OffloadMode,
    /// Reads after which a value counts as hot (offload mode `hot`).
    pub hot_threshold: u32,
    /// Capacity of each offload queue (entries); a full queue drops offloads.
    pub queue_depth: usize,
    /// zstd level for the disk and remote tiers; `None` stores uncompressed.
    pub compression: Option<i32>,
    pub encryption: Option<EncryptionConfig>,
    /// Largest value accepted.
    pub max_value: ByteSize,
    pub namespaces: HashMap<String, NamespaceConfig>,
    /// `[warehouse.namespace_defaults]`: the settings of every namespace
    /// `namespaces` does not list (each tenant's, say): a quota here gives
    /// each such namespace a quota of its own of that size.
    pub namespace_defaults: NamespaceConfig,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            memory: ByteSize::gib(1),
            memory_tier: true,
            memory_policy: PolicyKind::Lru,
            disk: None,
            remote: None,
            offload: OffloadMode::All,
            hot_threshold: 2,
            queue_depth: 1024,
            compression: None,
            encryption: None,
            max_value: ByteSize::mib(512),
            namespaces: HashMap::new(),
            namespace_defaults: NamespaceConfig::default(),
        }
    }
}

impl StoreConfig {
    /// A memory-only store with the given budget.
    pub fn memory_only(budget: u64) -> Self {
        StoreConfig { memory: ByteSize(budget), ..Default::default() }
    }

    /// Memory quotas by namespace (bytes), for those that have one.
    pub fn memory_quotas(&self) -> HashMap<String, u64> {
        self.namespaces.iter().filter_map(|(ns, c)| Some((ns.clone(), c.memory_quota?.as_u64()))).collect()
    }

    /// Disk quotas by namespace (bytes), for those that have one.
    pub fn disk_quotas(&self) -> HashMap<String, u64> {
        self.namespaces.iter().filter_map(|(ns, c)| Some((ns.clone(), c.disk_quota?.as_u64()))).collect()
    }

    pub fn namespace_ttl(&self, ns: &str) -> Option<Duration> {
        let ttl = match self.namespaces.get(ns) {
            Some(n) => n.ttl_secs,
            None => self.namespace_defaults.ttl_secs,
        };
        ttl.map(Duration::from_secs)
    }

    /// The memory quota of each namespace `namespaces` does not list (0: none).
    pub fn default_memory_quota(&self) -> u64 {
        self.namespace_defaults.memory_quota.map_or(0, |q| q.as_u64())
    }

    /// The disk quota of each namespace `namespaces` does not list (0: none).
    pub fn default_disk_quota(&self) -> u64 {
        self.namespace_defaults.disk_quota.map_or(0, |q| q.as_u64())
    }
}

/// A map whose values may be any scalar, kept as their text.
fn scalar_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<HashMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        S(String),
        B(bool),
        I(i64),
        F(f64),
    }
    let raw = HashMap::<String, Scalar>::deserialize(d)?;
    Ok(raw
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Scalar::S(s) => s,
                Scalar::B(b) => b.to_string(),
                Scalar::I(i) => i.to_string(),
                Scalar::F(f) => f.to_string(),
            };
            (k, v)
        })
        .collect())
}
