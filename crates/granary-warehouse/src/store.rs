//! The store: one API over the tiers.
//!
//! Reads walk memory → disk → remote and promote a hit into memory. Writes
//! land in memory; copies to the slower tiers go through bounded queues
//! (per [`OffloadMode`]) drained by background workers, so a caller never
//! waits on a slow tier unless it asks for durability. A full queue drops
//! the copy and counts it: the warehouse is a cache. Read errors in a lower
//! tier count as misses (and errors), never fail the read.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};

use crate::config::{OffloadMode, StoreConfig};
use crate::error::{Result, WarehouseError};
use crate::tier::memory::{cut_page, MemoryTier};
use crate::tier::{Tier, TierKind};
use crate::types::{now_ms, Condition, EntryMeta, Event, EventKind, Evicted, PutOptions, ScanPage, TierStats, Ttl};

/// Longest accepted namespace name.
pub const MAX_NAMESPACE: usize = 128;
/// Longest accepted key.
pub const MAX_KEY: usize = 4096;
/// Lanes per offload queue (a key always uses the same lane, keeping its writes in order).
const LANES: usize = 4;

/// A value found by [`Store::get`].
#[derive(Debug, Clone)]
pub struct Hit {
    pub value: Bytes,
    /// Where it was found (before promotion).
    pub tier: TierKind,
    pub meta: EntryMeta,
}

/// Result of a longest-prefix lookup.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct LookupResult {
    /// How many leading keys are present.
    pub matched: usize,
    /// Where each of the matched keys was found.
    pub tiers: Vec<TierKind>,
}

/// Offload counters for one lower tier.
#[derive(Debug, Default, Serialize, Clone)]
pub struct OffloadStats {
    pub tier: Option<TierKind>,
    pub queued: u64,
    pub written: u64,
    pub dropped: u64,
    pub errors: u64,
}

/// Everything `/stats` and INFO report.
#[derive(Debug, Default, Serialize, Clone)]
pub struct StoreStats {
    pub tiers: Vec<TierStats>,
    pub offload: Vec<OffloadStats>,
    pub promotions_from_disk: u64,
    pub promotions_from_remote: u64,
    pub offload_mode: Option<OffloadMode>,
}

enum Op {
    Put { ns: String, key: Bytes, value: Bytes, meta: EntryMeta },
    Remove { ns: String, key: Bytes },
}

#[derive(Default)]
struct OffloadCounters {
    queued: AtomicU64,
    written: AtomicU64,
    dropped: AtomicU64,
    errors: AtomicU64,
}

struct Lower {
    tier: Arc<dyn Tier>,
    lanes: Vec<mpsc::Sender<Op>>,
    c: Arc<OffloadCounters>,
}

impl Lower {
    fn offer(&self, op: Op) -> bool {
        let key = match &op {
            Op::Put { key, .. } | Op::Remove { key, .. } => key,
        };
        let lane = (xxhash_rust::xxh3::xxh3_64(key) as usize) % self.lanes.len();
        match self.lanes[lane].try_send(op) {
            Ok(()) => {
                self.c.queued.fetch_add(1, Relaxed);
                true
            }
            Err(_) => {
                self.c.dropped.fetch_add(1, Relaxed);
                false
            }
        }
    }

    fn stats(&self) -> OffloadStats {
        OffloadStats {
            tier: Some(self.tier.kind()),
            queued: self.c.queued.load(Relaxed),
            written: self.c.written.load(Relaxed),
            dropped: self.c.dropped.load(Relaxed),
            errors: self.c.errors.load(Relaxed),
        }
    }
}

struct Inner {
    cfg: StoreConfig,
    memory: Arc<MemoryTier>,
    disk: Option<Lower>,
    remote: Option<Lower>,
    events: broadcast::Sender<Event>,
    promoted_disk: AtomicU64,
    promoted_remote: AtomicU64,
}

/// The tiered store; cheap to clone (all clones share one store).
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

/// Keeps a value's memory entry from eviction while held; derefs to the value.
pub struct Lease {
    store: Store,
    ns: String,
    key: Bytes,
    pub value: Bytes,
    pub tier: TierKind,
}

impl std::ops::Deref for Lease {
    type Target = Bytes;
    fn deref(&self) -> &Bytes {
        &self.value
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.store.inner.memory.unpin(&self.ns, &self.key);
    }
}

fn validate(ns: &str, key: &[u8]) -> Result<()> {
    if ns.is_empty() || ns.len() > MAX_NAMESPACE {
        return Err(WarehouseError::invalid("namespace", format!("must be 1 to {MAX_NAMESPACE} bytes")));
    }
    if !ns.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) {
        return Err(WarehouseError::invalid("namespace", "may hold only ASCII letters, digits, '-', '_' and '.'"));
    }
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(WarehouseError::invalid("key", format!("must be 1 to {MAX_KEY} bytes")));
    }
    Ok(())
}

impl Store {
    /// Opens the store: builds the configured tiers (recovering the disk
    /// tier's index), starts the offload workers and the expiry sweeper.
    /// Must run inside a Tokio runtime.
    pub async fn open(cfg: StoreConfig) -> Result<Store> {
        let at_rest = crate::tier::at_rest::AtRest::from_config(cfg.compression, cfg.encryption.as_ref())?;
        let disk: Option<Arc<dyn Tier>> = match &cfg.disk {
            Some(d) => Some(Arc::new(crate::tier::disk::open_disk(d, at_rest.clone()).await?)),
            None => None,
        };
        let remote: Option<Arc<dyn Tier>> = match &cfg.remote {
            Some(r) => Some(Arc::new(crate::tier::remote::open_remote(r, at_rest).await?)),
            None => None,
        };
        Ok(Self::with_tiers(cfg, disk, remote))
    }

    /// A store over tiers built elsewhere (tests, custom tiers). Must run
    /// inside a Tokio runtime when a lower tier is given.
    pub fn with_tiers(cfg: StoreConfig, disk: Option<Arc<dyn Tier>>, remote: Option<Arc<dyn Tier>>) -> Store {
        let memory = Arc::new(MemoryTier::new(cfg.memory.as_u64(), cfg.memory_policy));
        let (events, _) = broadcast::channel(8192);
        let depth = (cfg.queue_depth / LANES).max(1);
        let mut workers = Vec::new();
        let mut lower = |tier: Option<Arc<dyn Tier>>| {
            tier.map(|tier| {
                let c = Arc::new(OffloadCounters::default());
                let lanes = (0..LANES)
                    .map(|_| {
                        let (tx, rx) = mpsc::channel(depth);
                        workers.push((tier.clone(), rx, c.clone()));
                        tx
                    })
                    .collect();
                Lower { tier, lanes, c }
            })
        };
        let disk = lower(disk);
        let remote = lower(remote);
        let inner = Arc::new(Inner {
            cfg,
            memory,
            disk,
            remote,
            events,
            promoted_disk: AtomicU64::new(0),
            promoted_remote: AtomicU64::new(0),
        });
        for (tier, rx, c) in workers {
            tokio::spawn(offload_worker(Arc::downgrade(&inner), tier, rx, c));
        }
        if inner.disk.is_some() || inner.remote.is_some() || tokio::runtime::Handle::try_current().is_ok() {
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(sweeper(Arc::downgrade(&inner)));
            }
        }
        Store { inner }
    }

    /// A memory-only store (no runtime needed).
    pub fn memory_only(budget: u64) -> Store {
        Self::with_tiers(StoreConfig::memory_only(budget), None, None)
    }

    pub fn config(&self) -> &StoreConfig {
        &self.inner.cfg
    }

    /// The memory tier, for the zero-copy in-process path.
    pub fn memory(&self) -> &MemoryTier {
        &self.inner.memory
    }

    /// Tiers present, fastest first.
    pub fn tiers(&self) -> Vec<TierKind> {
        let mut t = vec![TierKind::Memory];
        t.extend(self.inner.disk.as_ref().map(|l| l.tier.kind()));
        t.extend(self.inner.remote.as_ref().map(|l| l.tier.kind()));
        t
    }

    fn lower(&self) -> impl Iterator<Item = &Lower> {
        self.inner.disk.iter().chain(self.inner.remote.iter())
    }

    fn lower_tier(&self, kind: TierKind) -> Option<&Arc<dyn Tier>> {
        self.lower().map(|l| &l.tier).find(|t| t.kind() == kind)
    }

    /// Subscribes to `stored` / `removed` events. A subscriber that falls
    /// more than 8192 events behind loses the oldest (and is told so).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    fn emit(&self, kind: EventKind, ns: &str, key: &Bytes, tier: TierKind) {
        emit(&self.inner.events, kind, ns, key, tier);
    }

    /// Reads a value in memory only, without an await or a copy.
    pub fn get_cached(&self, ns: &str, key: &[u8]) -> Option<Bytes> {
        self.inner.memory.get_sync(ns, key).map(|s| s.value)
    }

    /// Reads a value, walking the tiers and promoting a hit into memory.
    pub async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Hit>> {
        validate(ns, key)?;
        if let Some(s) = self.inner.memory.get_sync(ns, key) {
            if self.inner.cfg.offload == OffloadMode::Hot && s.hits == self.inner.cfg.hot_threshold {
                self.offload_all(ns, Bytes::copy_from_slice(key), s.value.clone(), s.meta);
            }
            return Ok(Some(Hit { value: s.value, tier: TierKind::Memory, meta: s.meta }));
        }
        for l in self.lower() {
            let kind = l.tier.kind();
            let found = match l.tier.get(ns, key).await {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(tier = %kind, error = %e, "read failed; counted as a miss");
                    None
                }
            };
            if let Some(s) = found {
                let key = Bytes::copy_from_slice(key);
                self.promote(ns, key, s.value.clone(), s.meta, kind);
                return Ok(Some(Hit { value: s.value, tier: kind, meta: s.meta }));
            }
        }
        Ok(None)
    }

    fn promote(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta, from: TierKind) {
        match from {
            TierKind::Disk => self.inner.promoted_disk.fetch_add(1, Relaxed),
            _ => self.inner.promoted_remote.fetch_add(1, Relaxed),
        };
        if from == TierKind::Remote && self.inner.cfg.offload == OffloadMode::All {
            if let Some(d) = &self.inner.disk {
                d.offer(Op::Put { ns: ns.to_string(), key: key.clone(), value: value.clone(), meta });
            }
        }
        let mut evicted = self.inner.memory.put_sync(ns, key.clone(), value, meta);
        // A value too big for memory comes straight back: it was never
        // stored there, and it is still in the tier it was read from.
        let before = evicted.len();
        evicted.retain(|e| !(e.namespace == ns && e.key == key));
        if evicted.len() == before {
            self.emit(EventKind::Stored, ns, &key, TierKind::Memory);
        }
        self.handle_evicted(evicted);
    }

    /// Reads a value and pins it in memory until the lease is dropped.
    pub async fn lease(&self, ns: &str, key: &[u8]) -> Result<Option<Lease>> {
        let Some(hit) = self.get(ns, key).await? else { return Ok(None) };
        if !self.inner.memory.pin(ns, key) {
            // Too large for memory (never promoted): the lease holds the bytes alone.
        }
        Ok(Some(Lease {
            store: self.clone(),
            ns: ns.to_string(),
            key: Bytes::copy_from_slice(key),
            value: hit.value,
            tier: hit.tier,
        }))
    }

    /// Stores a value; `Ok(false)` when a condition (NX/XX) kept it out.
    pub async fn put(&self, ns: &str, key: Bytes, value: Bytes, opts: PutOptions) -> Result<bool> {
        validate(ns, &key)?;
        let limit = self.inner.cfg.max_value.as_u64();
        if value.len() as u64 > limit {
            return Err(WarehouseError::TooLarge { size: value.len() as u64, limit });
        }
        match opts.condition {
            Condition::Always => {}
            Condition::IfAbsent if self.exists(ns, &key).await? => return Ok(false),
            Condition::IfPresent if !self.exists(ns, &key).await? => return Ok(false),
            _ => {}
        }
        let ttl = opts.ttl.or_else(|| self.inner.cfg.namespace_ttl(ns));
        let meta = EntryMeta { expires_at_ms: ttl.map(|t| now_ms() + t.as_millis() as u64), depth: opts.depth };
        let mut evicted = self.inner.memory.put_sync(ns, key.clone(), value.clone(), meta);
        // A value larger than the memory budget comes straight back: it goes to the lower tiers only.
        let rejected =
            evicted.iter().position(|e| e.namespace == ns && e.key == key).map(|i| evicted.remove(i)).is_some();
        if !rejected {
            self.emit(EventKind::Stored, ns, &key, TierKind::Memory);
        }
        // An older copy below would be served after this one leaves memory.
        if self.inner.cfg.offload != OffloadMode::All || rejected {
            self.drop_stale_below(ns, &key).await;
        }
        self.handle_evicted(evicted);
        if opts.durable {
            if let Some(d) = &self.inner.disk {
                let ev = d.tier.put(ns, key.clone(), value.clone(), meta).await?;
                d.tier.flush().await?;
                self.emit(EventKind::Stored, ns, &key, TierKind::Disk);
                self.handle_evicted_below(TierKind::Disk, ev);
                if self.inner.cfg.offload == OffloadMode::All || rejected {
                    if let Some(r) = &self.inner.remote {
                        r.offer(Op::Put { ns: ns.to_string(), key, value, meta });
                    }
                }
                return Ok(true);
            }
            if let Some(r) = &self.inner.remote {
                r.tier.put(ns, key.clone(), value, meta).await?;
                self.emit(EventKind::Stored, ns, &key, TierKind::Remote);
                return Ok(true);
            }
        }
        if self.inner.cfg.offload == OffloadMode::All || rejected {
            self.offload_all(ns, key, value, meta);
        }
        Ok(true)
    }

    async fn drop_stale_below(&self, ns: &str, key: &[u8]) {
        for l in self.lower() {
            match l.tier.contains_local(ns, key) {
                Some(false) => {}
                // The tier's index knows it has the key: drop it now.
                Some(true) => {
                    let _ = l.tier.remove(ns, key).await;
                }
                // Only the tier itself can tell: queue the removal behind earlier writes.
                None => {
                    l.offer(Op::Remove { ns: ns.to_string(), key: Bytes::copy_from_slice(key) });
                }
            }
        }
    }

    fn offload_all(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) {
        for l in self.lower() {
            l.offer(Op::Put { ns: ns.to_string(), key: key.clone(), value: value.clone(), meta });
        }
    }

    /// Memory evictions: announce them, and in `evicted` mode copy them to
    /// the first lower tier that does not hold them yet.
    fn handle_evicted(&self, evicted: Vec<Evicted>) {
        for e in evicted {
            self.emit(EventKind::Removed, &e.namespace, &e.key, TierKind::Memory);
            let Some(value) = e.value else { continue };
            if self.inner.cfg.offload != OffloadMode::Evicted {
                continue;
            }
            for l in self.lower() {
                if l.tier.contains_local(&e.namespace, &e.key) == Some(true) {
                    break;
                }
                if l.offer(Op::Put { ns: e.namespace.clone(), key: e.key.clone(), value: value.clone(), meta: e.meta })
                {
                    break;
                }
            }
        }
    }

    /// Evictions from a lower tier: announce; in `evicted` mode, disk
    /// evictions go on to the remote tier when the disk still had the bytes.
    fn handle_evicted_below(&self, tier: TierKind, evicted: Vec<Evicted>) {
        handle_evicted_below(&self.inner, tier, evicted);
    }

    /// Whether a live entry exists in any tier.
    pub async fn exists(&self, ns: &str, key: &[u8]) -> Result<bool> {
        validate(ns, key)?;
        if self.inner.memory.contains_sync(ns, key) {
            return Ok(true);
        }
        for l in self.lower() {
            let found = match l.tier.contains_local(ns, key) {
                Some(b) => b,
                None => l.tier.contains(ns, key).await.unwrap_or(false),
            };
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Removes a key from every tier; whether it existed anywhere.
    pub async fn delete(&self, ns: &str, key: &[u8]) -> Result<bool> {
        validate(ns, key)?;
        let k = Bytes::copy_from_slice(key);
        let mut existed = self.inner.memory.remove(ns, key).await?;
        if existed {
            self.emit(EventKind::Removed, ns, &k, TierKind::Memory);
        }
        for l in self.lower() {
            if l.tier.remove(ns, key).await? {
                existed = true;
                self.emit(EventKind::Removed, ns, &k, l.tier.kind());
            }
        }
        Ok(existed)
    }

    /// Removes every key of a namespace from every tier; how many entries.
    pub async fn delete_namespace(&self, ns: &str) -> Result<u64> {
        validate(ns, b"-")?;
        let mut n = self.inner.memory.remove_namespace(ns).await?;
        for l in self.lower() {
            n += l.tier.remove_namespace(ns).await?;
        }
        Ok(n)
    }

    /// Sets (or with `None`, clears) a key's time to live in every tier.
    pub async fn expire(&self, ns: &str, key: &[u8], ttl: Option<Duration>) -> Result<bool> {
        validate(ns, key)?;
        let at = ttl.map(|t| now_ms() + t.as_millis() as u64);
        let mut found = self.inner.memory.set_expiry(ns, key, at).await?;
        for l in self.lower() {
            found |= l.tier.set_expiry(ns, key, at).await?;
        }
        Ok(found)
    }

    /// A key's remaining time to live.
    pub async fn ttl(&self, ns: &str, key: &[u8]) -> Result<Ttl> {
        validate(ns, key)?;
        let mut meta = self.inner.memory.meta(ns, key).await?;
        for l in self.lower() {
            if meta.is_some() {
                break;
            }
            meta = l.tier.meta(ns, key).await.unwrap_or(None);
        }
        Ok(match meta {
            None => Ttl::Missing,
            Some(EntryMeta { expires_at_ms: None, .. }) => Ttl::Persistent,
            Some(EntryMeta { expires_at_ms: Some(t), .. }) => {
                Ttl::Remaining(Duration::from_millis(t.saturating_sub(now_ms())))
            }
        })
    }

    /// Longest prefix of `keys` present in memory or on disk, without I/O.
    pub fn lookup_local(&self, ns: &str, keys: &[impl AsRef<[u8]>]) -> LookupResult {
        let in_memory = self.inner.memory.prefix_len(ns, keys);
        let mut out = LookupResult { matched: in_memory, tiers: vec![TierKind::Memory; in_memory] };
        // Past the memory prefix, a block may still be on disk (then memory
        // may hold more of the chain again, having promoted a later block).
        for k in &keys[in_memory..] {
            let k = k.as_ref();
            let tier = if self.inner.memory.contains_sync(ns, k) {
                TierKind::Memory
            } else if self.inner.disk.as_ref().and_then(|d| d.tier.contains_local(ns, k)) == Some(true) {
                TierKind::Disk
            } else {
                break;
            };
            out.tiers.push(tier);
            out.matched += 1;
        }
        out
    }

    /// Longest prefix of `keys` present in any tier; the remote tier is
    /// asked only for keys past the local prefix, several at a time.
    pub async fn lookup(&self, ns: &str, keys: &[impl AsRef<[u8]>]) -> Result<LookupResult> {
        if let Some(k) = keys.first() {
            validate(ns, k.as_ref())?;
        }
        let mut out = self.lookup_local(ns, keys);
        let Some(remote) = self.lower_tier(TierKind::Remote) else { return Ok(out) };
        let rest = &keys[out.matched..];
        // Built before streaming: a closure inside the stream type makes the
        // returned future fail the `Send` proof that servers (axum handlers) need.
        let asks: Vec<_> = rest.iter().map(|k| remote.contains(ns, k.as_ref())).collect();
        let mut answers = futures::stream::iter(asks).buffered(16);
        while let Some(found) = answers.next().await {
            if !found.unwrap_or(false) {
                break;
            }
            out.tiers.push(TierKind::Remote);
            out.matched += 1;
        }
        Ok(out)
    }

    /// One page of keys held locally (memory and disk) in `ns`; start with
    /// cursor 0 and stop when the returned cursor is 0.
    pub async fn scan(&self, ns: &str, cursor: u64, count: usize) -> Result<ScanPage> {
        let count = count.clamp(1, 100_000);
        let mut pages = vec![self.inner.memory.scan(ns, cursor, count).await?];
        if let Some(d) = &self.inner.disk {
            pages.push(d.tier.scan(ns, cursor, count).await?);
        }
        // Keys below `bound` are complete in every page.
        let bound = pages.iter().map(|p| p.next).filter(|&n| n != 0).min();
        let mut cand: Vec<(u64, Bytes)> = pages
            .into_iter()
            .flat_map(|p| p.keys)
            .map(|k| (crate::types::scan_hash(&k), k))
            .filter(|(h, _)| bound.is_none_or(|b| *h < b))
            .collect();
        cand.sort();
        let mut page = cut_page(cand, count);
        if page.next == 0 {
            page.next = bound.unwrap_or(0);
        }
        Ok(page)
    }

    /// Number of distinct keys held locally in `ns`.
    pub async fn count(&self, ns: &str) -> Result<u64> {
        let (mut cursor, mut n) = (0, 0u64);
        loop {
            let page = self.scan(ns, cursor, 10_000).await?;
            n += page.keys.len() as u64;
            if page.next == 0 {
                return Ok(n);
            }
            cursor = page.next;
        }
    }

    /// Namespaces with keys held locally.
    pub async fn namespaces(&self) -> Result<Vec<String>> {
        let mut all = self.inner.memory.namespaces().await?;
        if let Some(d) = &self.inner.disk {
            all.extend(d.tier.namespaces().await?);
        }
        all.sort();
        all.dedup();
        Ok(all)
    }

    /// Waits until queued offloads have drained (or `timeout`), then makes
    /// the disk tier durable. For shutdown and tests.
    pub async fn flush(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        for l in self.lower() {
            while l.lanes.iter().any(|tx| tx.capacity() < tx.max_capacity())
                || l.c.written.load(Relaxed) + l.c.errors.load(Relaxed) < l.c.queued.load(Relaxed)
            {
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            l.tier.flush().await?;
        }
        Ok(())
    }

    pub fn stats(&self) -> StoreStats {
        let mut tiers = vec![self.inner.memory.stats()];
        tiers.extend(self.lower().map(|l| l.tier.stats()));
        StoreStats {
            tiers,
            offload: self.lower().map(Lower::stats).collect(),
            promotions_from_disk: self.inner.promoted_disk.load(Relaxed),
            promotions_from_remote: self.inner.promoted_remote.load(Relaxed),
            offload_mode: Some(self.inner.cfg.offload),
        }
    }
}

fn emit(events: &broadcast::Sender<Event>, kind: EventKind, ns: &str, key: &Bytes, tier: TierKind) {
    if events.receiver_count() > 0 {
        let _ = events.send(Event { kind, namespace: ns.to_string(), key: key.clone(), tier });
    }
}

fn handle_evicted_below(inner: &Inner, tier: TierKind, evicted: Vec<Evicted>) {
    for e in evicted {
        emit(&inner.events, EventKind::Removed, &e.namespace, &e.key, tier);
        if tier == TierKind::Disk && inner.cfg.offload == OffloadMode::Evicted {
            if let (Some(r), Some(value)) = (&inner.remote, e.value) {
                r.offer(Op::Put { ns: e.namespace, key: e.key, value, meta: e.meta });
            }
        }
    }
}

async fn offload_worker(inner: Weak<Inner>, tier: Arc<dyn Tier>, mut rx: mpsc::Receiver<Op>, c: Arc<OffloadCounters>) {
    let kind = tier.kind();
    while let Some(op) = rx.recv().await {
        let result = match op {
            Op::Put { ns, key, value, meta } => {
                if meta.is_expired(now_ms()) {
                    Ok(())
                } else {
                    match tier.put(&ns, key.clone(), value, meta).await {
                        Ok(evicted) => {
                            if let Some(inner) = inner.upgrade() {
                                emit(&inner.events, EventKind::Stored, &ns, &key, kind);
                                handle_evicted_below(&inner, kind, evicted);
                            }
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                }
            }
            Op::Remove { ns, key } => tier.remove(&ns, &key).await.map(|_| ()),
        };
        match result {
            Ok(()) => c.written.fetch_add(1, Relaxed),
            Err(e) => {
                tracing::warn!(tier = %kind, error = %e, "offload failed");
                c.errors.fetch_add(1, Relaxed)
            }
        };
    }
}

/// Drops expired entries in the background so they stop taking budget.
async fn sweeper(inner: Weak<Inner>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let _ = inner.memory.purge_expired(10_000).await;
        if let Some(d) = &inner.disk {
            let _ = d.tier.purge_expired(10_000).await;
        }
    }
}
