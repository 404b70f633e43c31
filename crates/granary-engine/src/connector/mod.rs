//! The engine's KV connector: finds, loads and saves KV blocks in the
//! warehouse, with one API over three transports.
//!
//! | spec | transport | lookup | get | put |
//! |---|---|---|---|---|
//! | `embedded` | a [`Store`] in this process | `Store::lookup` | `Store::get` per block | `Store::put` per block |
//! | `resp://HOST:PORT` | the warehouse's RESP server | one pipeline of `EXISTS`, one per hash | one `MGET` | one pipeline of `SET`s |
//! | `http://HOST:PORT` | the warehouse's HTTP server | `POST /v1/lookup` (one per 4096 hashes) | `GET /v1/blocks/{ns}/{hash}` per block, several in flight | `PUT` per block, several in flight |
//!
//! Every transport uses the same keys: the block hash as 64 lowercase hex
//! characters, in the connector's warehouse namespace, so an engine on
//! RESP, one on HTTP and one embedded share one warehouse. The namespace is
//! the engine's warehouse credential, not the tenant: tenants are already
//! kept apart by the hash chain, whose root includes the tenant.
//!
//! Blocks travel in the core block frame ([`KvBlock`]). A block read back
//! is decoded (both checksums) and its header compared with the shape the
//! caller expects; a block that fails either is reported missing and
//! counted, never returned.
//!
//! Every call has a deadline ([`ConnectorConfig`]); a warehouse that is down
//! or slow yields an error within it, which the engine treats as a miss.
//! Remote transports keep at most `max_connections` connections open and
//! reuse them; a connection that failed or timed out is closed, never
//! reused. Nothing connects until the first call, so an engine starts
//! whether or not its warehouse is up.
//!
//! # Which tier served a block
//!
//! [`Loaded::tier`] is the tier the warehouse read the block from (before
//! promoting it). Embedded: the store's own answer. HTTP: the
//! `x-granary-tier` header of the answer. RESP: `GET`/`MGET` replies carry
//! only the value, so the tier is [`Source::Unknown`].

mod embedded;
mod http;
mod resp;
mod spec;
mod stats;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use granary_core::{BlockError, BlockHash, BlockHeader, DType, KvBlock, KvLayout};
use granary_warehouse::{Store, TierKind, WarehouseError};
use serde::{Deserialize, Serialize};

pub use spec::{SpecError, WarehouseSpec};
pub use stats::{ConnectorStats, StatsSnapshot};

use stats::add;

/// The block header's `layout` byte of the KV this connector writes; blocks
/// with another layout are refused on read.
pub const KV_LAYOUT: u8 = 0;

/// What a block's payload holds; a block read back must match it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvShape {
    pub dtype: DType,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Tokens in the block.
    pub tokens: u32,
}

impl KvShape {
    /// The shape of a full block of `layout`.
    pub fn of_block(layout: &KvLayout) -> Self {
        KvShape {
            dtype: layout.dtype,
            layers: layout.layers,
            kv_heads: layout.kv_heads,
            head_dim: layout.head_dim,
            tokens: layout.block_tokens,
        }
    }

    /// Bytes of K and V for every layer and token of the block.
    pub fn payload_len(&self) -> u64 {
        2 * self.layers as u64
            * self.kv_heads as u64
            * self.head_dim as u64
            * self.tokens as u64
            * self.dtype.size() as u64
    }

    /// Frames `payload` as a KV block; fails when its length does not fit the shape.
    pub fn frame(&self, payload: Bytes) -> Result<KvBlock, BlockError> {
        KvBlock::kv(self.dtype, KV_LAYOUT, self.layers, self.kv_heads, self.head_dim, self.tokens, payload)
    }

    /// Whether a decoded header holds exactly this shape, stored plainly.
    pub fn matches(&self, h: &BlockHeader) -> bool {
        h.flags == 0
            && h.layout == KV_LAYOUT
            && h.dtype == self.dtype
            && h.layers == self.layers
            && h.kv_heads == self.kv_heads
            && h.head_dim == self.head_dim
            && h.tokens == self.tokens
    }
}

/// The warehouse tier that served a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Memory,
    Disk,
    Remote,
    /// The transport does not say (RESP).
    Unknown,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Memory => "memory",
            Source::Disk => "disk",
            Source::Remote => "remote",
            Source::Unknown => "unknown",
        }
    }

    /// Parses the warehouse's tier names (`memory`, `disk`, `remote`);
    /// anything else is [`Source::Unknown`].
    pub fn from_name(name: &str) -> Self {
        match name {
            "memory" => Source::Memory,
            "disk" => Source::Disk,
            "remote" => Source::Remote,
            _ => Source::Unknown,
        }
    }
}

impl From<TierKind> for Source {
    fn from(t: TierKind) -> Self {
        match t {
            TierKind::Memory => Source::Memory,
            TierKind::Disk => Source::Disk,
            TierKind::Remote => Source::Remote,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A block found, checked and unframed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// The KV bytes inside the block (a zero-copy slice of what was read).
    pub payload: Bytes,
    pub tier: Source,
}

/// Why a connector call failed. The engine treats every one as a miss.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    #[error("warehouse {op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    #[error("cannot connect to the warehouse at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("warehouse connection failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("warehouse sent a malformed answer: {0}")]
    Protocol(String),
    #[error("warehouse refused {op}: {message}")]
    Refused { op: &'static str, message: String },
    #[error("warehouse request failed: {}", with_causes(.0))]
    Http(#[from] reqwest::Error),
    #[error("warehouse store: {0}")]
    Store(#[from] WarehouseError),
    #[error("block does not fit its shape: {0}")]
    Block(#[from] BlockError),
    #[error("connector settings: {0}")]
    Config(String),
}

/// An error and its causes on one line (reqwest's own text omits them:
/// "error sending request" says nothing of a refused connection).
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

pub type Result<T, E = ConnectorError> = std::result::Result<T, E>;

/// How a connector talks to its warehouse.
#[derive(Clone)]
pub struct ConnectorConfig {
    /// Warehouse namespace the blocks live in (1 to 128 of `A-Za-z0-9-_.`).
    pub namespace: String,
    /// Token for the namespace (RESP `AUTH`, HTTP bearer); none for an open warehouse.
    pub token: Option<String>,
    /// Deadline of a `lookup` call.
    pub lookup_timeout: Duration,
    /// Deadline of a `get_many` call: this, plus `per_block_timeout` for
    /// every block in the batch.
    pub get_timeout: Duration,
    /// Deadline of a `put_many` call: this, plus `per_block_timeout` for
    /// every block in the batch.
    pub put_timeout: Duration,
    /// What each block adds to a batch's deadline, so that a long prompt's
    /// blocks (an 8K-token prompt of a small model is about 180 MB) are not
    /// abandoned by a deadline sized for one.
    pub per_block_timeout: Duration,
    /// Most connections open at once to a remote warehouse (and blocks in flight over HTTP).
    pub max_connections: usize,
    /// Largest block accepted from a remote warehouse, frame included.
    pub max_block_bytes: u64,
}

impl Default for ConnectorConfig {
    fn default() -> Self {
        ConnectorConfig {
            namespace: granary_warehouse::auth::DEFAULT_NAMESPACE.to_string(),
            token: None,
            lookup_timeout: Duration::from_millis(500),
            get_timeout: Duration::from_secs(2),
            put_timeout: Duration::from_secs(2),
            per_block_timeout: Duration::from_millis(100),
            max_connections: 4,
            max_block_bytes: 512 << 20,
        }
    }
}

impl fmt::Debug for ConnectorConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectorConfig")
            .field("namespace", &self.namespace)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("lookup_timeout", &self.lookup_timeout)
            .field("get_timeout", &self.get_timeout)
            .field("put_timeout", &self.put_timeout)
            .field("per_block_timeout", &self.per_block_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_block_bytes", &self.max_block_bytes)
            .finish()
    }
}

impl ConnectorConfig {
    fn validate(&self) -> Result<()> {
        let ns = &self.namespace;
        if let Err(why) = granary_warehouse::types::check_namespace(ns.as_bytes()) {
            return Err(ConnectorError::Config(format!("namespace {ns:?} {why}")));
        }
        if self.max_connections == 0 {
            return Err(ConnectorError::Config("max_connections must be at least 1".into()));
        }
        for (name, d) in [
            ("lookup_timeout", self.lookup_timeout),
            ("get_timeout", self.get_timeout),
            ("put_timeout", self.put_timeout),
        ] {
            if d.is_zero() {
                return Err(ConnectorError::Config(format!("{name} must be positive")));
            }
        }
        Ok(())
    }

    /// The deadline of a batch of `blocks` blocks starting from `base`.
    fn batch_deadline(&self, base: Duration, blocks: usize) -> Duration {
        base.saturating_add(self.per_block_timeout.saturating_mul(blocks.min(u32::MAX as usize) as u32))
    }
}

/// One transport's raw operations on encoded frames.
enum Transport {
    Embedded(embedded::Embedded),
    Resp(resp::RespClient),
    Http(http::HttpClient),
}

impl Transport {
    async fn lookup(&self, keys: &[BlockHash]) -> Result<usize> {
        match self {
            Transport::Embedded(t) => t.lookup(keys).await,
            Transport::Resp(t) => t.lookup(keys).await,
            Transport::Http(t) => t.lookup(keys).await,
        }
    }

    async fn get_many(&self, keys: &[BlockHash]) -> Result<Vec<Option<(Bytes, Source)>>> {
        match self {
            Transport::Embedded(t) => t.get_many(keys).await,
            Transport::Resp(t) => t.get_many(keys).await,
            Transport::Http(t) => t.get_many(keys).await,
        }
    }

    async fn put_many(&self, frames: &[(BlockHash, Bytes)]) -> Result<()> {
        match self {
            Transport::Embedded(t) => t.put_many(frames).await,
            Transport::Resp(t) => t.put_many(frames).await,
            Transport::Http(t) => t.put_many(frames).await,
        }
    }
}

/// The engine's client of the warehouse. Share it behind an `Arc`.
pub struct Connector {
    spec: WarehouseSpec,
    cfg: ConnectorConfig,
    transport: Transport,
    stats: ConnectorStats,
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connector").field("spec", &self.spec).field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

impl Connector {
    /// A connector for `spec`; `store` is the in-process store an
    /// `embedded` spec needs (ignored otherwise). Connects lazily.
    pub fn new(spec: WarehouseSpec, cfg: ConnectorConfig, store: Option<Arc<Store>>) -> Result<Connector> {
        cfg.validate()?;
        let transport = match &spec {
            WarehouseSpec::Embedded => {
                let store = store.ok_or_else(|| {
                    ConnectorError::Config("warehouse spec `embedded` needs an in-process store".into())
                })?;
                Transport::Embedded(embedded::Embedded::new(store, &cfg))
            }
            WarehouseSpec::Resp { addr } => Transport::Resp(resp::RespClient::new(addr, &cfg)),
            WarehouseSpec::Http { addr } => Transport::Http(http::HttpClient::new(addr, &cfg)?),
        };
        Ok(Connector { spec, cfg, transport, stats: ConnectorStats::default() })
    }

    /// A connector over an in-process store.
    pub fn embedded(store: Arc<Store>, cfg: ConnectorConfig) -> Result<Connector> {
        Self::new(WarehouseSpec::Embedded, cfg, Some(store))
    }

    pub fn spec(&self) -> &WarehouseSpec {
        &self.spec
    }

    pub fn config(&self) -> &ConnectorConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &ConnectorStats {
        &self.stats
    }

    /// Runs one transport call under its deadline, counting failures.
    async fn timed<T>(&self, op: &'static str, after: Duration, call: impl Future<Output = Result<T>>) -> Result<T> {
        let e = match tokio::time::timeout(after, call).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => e,
            Err(_) => {
                add(&self.stats.timeouts, 1);
                ConnectorError::Timeout { op, after }
            }
        };
        add(&self.stats.errors, 1);
        tracing::debug!(warehouse = %self.spec, op, error = %e, "warehouse call failed");
        Err(e)
    }

    /// How many leading `hashes` the warehouse holds (in any tier). One
    /// round trip on every transport (HTTP: one per 4096 hashes).
    pub async fn lookup(&self, hashes: &[BlockHash]) -> Result<usize> {
        add(&self.stats.lookups, 1);
        add(&self.stats.lookup_hashes, hashes.len() as u64);
        if hashes.is_empty() {
            return Ok(0);
        }
        let n = self.timed("lookup", self.cfg.lookup_timeout, self.transport.lookup(hashes)).await?;
        let n = n.min(hashes.len());
        add(&self.stats.lookup_matched, n as u64);
        Ok(n)
    }

    /// Loads blocks of the given shape, one answer per hash in order. A
    /// block that is absent, corrupt or of another shape is `None` (and
    /// counted); the call fails only when the warehouse could not answer.
    pub async fn get_many(&self, hashes: &[BlockHash], shape: &KvShape) -> Result<Vec<Option<Loaded>>> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let after = self.cfg.batch_deadline(self.cfg.get_timeout, hashes.len());
        let raw = self.timed("get", after, self.transport.get_many(hashes)).await?;
        if raw.len() != hashes.len() {
            add(&self.stats.errors, 1);
            return Err(ConnectorError::Protocol(format!(
                "asked for {} blocks, got {} answers",
                hashes.len(),
                raw.len()
            )));
        }
        Ok(hashes.iter().zip(raw).map(|(h, found)| self.check(h, shape, found)).collect())
    }

    /// Loads one block; see [`Connector::get_many`].
    pub async fn get(&self, hash: BlockHash, shape: &KvShape) -> Result<Option<Loaded>> {
        Ok(self.get_many(&[hash], shape).await?.pop().flatten())
    }

    /// Decodes a frame read back and checks its shape; counts the outcome.
    fn check(&self, hash: &BlockHash, shape: &KvShape, found: Option<(Bytes, Source)>) -> Option<Loaded> {
        let Some((frame, tier)) = found else {
            add(&self.stats.misses, 1);
            return None;
        };
        let loaded = match KvBlock::decode(frame) {
            Err(e) => {
                add(&self.stats.corrupt, 1);
                tracing::warn!(warehouse = %self.spec, block = %hash, %tier, error = %e, "corrupt block treated as missing");
                None
            }
            Ok(b) if !shape.matches(&b.header) => {
                add(&self.stats.shape_mismatch, 1);
                tracing::warn!(
                    warehouse = %self.spec, block = %hash, expected = ?shape, found = ?b.header,
                    "block of another shape treated as missing"
                );
                None
            }
            Ok(b) => Some(Loaded { payload: b.payload, tier }),
        };
        match &loaded {
            Some(l) => {
                add(&self.stats.hits, 1);
                add(&self.stats.bytes_loaded, l.payload.len() as u64);
            }
            None => add(&self.stats.misses, 1),
        }
        loaded
    }

    /// Frames `payload` with `shape` and stores it under `hash`.
    pub async fn put(&self, hash: BlockHash, shape: &KvShape, payload: Bytes) -> Result<()> {
        self.put_many(&[(hash, *shape, payload)]).await
    }

    /// Frames and stores every block; returns once the warehouse has
    /// acknowledged all of them (its memory tier holds them), or fails.
    pub async fn put_many(&self, blocks: &[(BlockHash, KvShape, Bytes)]) -> Result<()> {
        if blocks.is_empty() {
            return Ok(());
        }
        let mut frames = Vec::with_capacity(blocks.len());
        let mut payload_bytes = 0u64;
        for (hash, shape, payload) in blocks {
            let block = shape.frame(payload.clone()).inspect_err(|_| add(&self.stats.errors, 1))?;
            payload_bytes += payload.len() as u64;
            frames.push((*hash, block.encode()));
        }
        let after = self.cfg.batch_deadline(self.cfg.put_timeout, frames.len());
        self.timed("put", after, self.transport.put_many(&frames)).await?;
        add(&self.stats.blocks_saved, blocks.len() as u64);
        add(&self.stats.bytes_saved, payload_bytes);
        Ok(())
    }
}

/// The store key of a block: its hash as 64 lowercase hex characters.
fn key_of(hash: &BlockHash) -> Bytes {
    Bytes::from(hash.to_hex())
}
