//! The store: one API over the tiers.
//!
//! Reads walk memory → disk → remote and promote a hit into memory. Writes
//! land in memory; copies to the slower tiers go through bounded queues
//! (per [`OffloadMode`]) drained by background workers, so a caller never
//! waits on a slow tier unless it asks for durability. A full queue drops
//! the copy and counts it: the warehouse is a cache. Read errors in a lower
//! tier count as misses (and errors), never fail the read.
//!
//! One order per key: every operation on a key (write, delete, expiry,
//! promotion, the copy of an eviction) is decided under that key's lock,
//! which also numbers it (a version per lock stripe); what it does below
//! memory goes through the key's offload lane ([`crate::offload`]) in that
//! order. A promotion or an eviction's copy carries the version it was
//! read under and is dropped if the key has changed since, so none can
//! bring back a value that a later write or delete replaced.
//!
//! Nothing is acknowledged that is stored nowhere: a value memory cannot
//! take (larger than its budget, or no memory tier) is written to the next
//! tier synchronously, and refused with [`WarehouseError::OutOfMemory`]
//! when no tier takes it.
//!
//! The module is split by idea: this file holds the API; [`lanes`] the
//! workers that apply each lower tier's queued operations, [`events`] the
//! `stored` / `removed` announcements, [`sweeper`] the background expiry.

mod events;
mod flush;
mod lanes;
mod sweeper;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::broadcast;

use crate::config::{OffloadMode, StoreConfig};
use crate::error::{Result, WarehouseError};
use crate::offload::{Action, Latest, Lower, Outcome};
use crate::tier::keys::merge_pages;
use crate::tier::memory::MemoryTier;
use crate::tier::{Tier, TierKind};
pub use crate::types::MAX_NAMESPACE;
use crate::types::{now_ms, Condition, EntryMeta, Event, EventKind, Evicted, PutOptions, ScanPage, TierStats, Ttl};
use events::emit;
use lanes::{offload_stats, offload_worker, wait};
use sweeper::sweeper;
pub use sweeper::REMOTE_SWEEP_PAGE;

/// Longest accepted key.
pub const MAX_KEY: usize = 4096;
/// Key lock stripes (each also holds the version of its keys' last operation).
const STRIPES: usize = 4096;

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

/// What [`Store::put_observed`] reads of the key, atomically with its write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Observe {
    /// The value the key held (`SET … GET`).
    pub old_value: bool,
    /// Its remaining TTL, kept for the new value (`SET … KEEPTTL`).
    pub keep_ttl: bool,
}

/// What [`Store::put_with`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PutOutcome {
    /// False when a condition (NX/XX) kept the value out.
    pub stored: bool,
    /// Whether a tier that survives a crash (the disk, fsynced, or the
    /// remote tier) holds the value: only ever true for a durable put.
    pub durable: bool,
}

struct Inner {
    cfg: StoreConfig,
    memory: Arc<MemoryTier>,
    disk: Option<Lower>,
    remote: Option<Lower>,
    events: broadcast::Sender<Event>,
    promoted_disk: AtomicU64,
    promoted_remote: AtomicU64,
    /// Key locks; each holds the version of the last operation on its keys.
    stripes: Box<[Mutex<u64>]>,
    /// Where versions come from: one clock for every stripe, so a version
    /// read from the clock before some work began is older than any
    /// operation on any key since ([`Inner::changed_since`]).
    clock: AtomicU64,
    /// Namespace flushes (FLUSHDB): how many run now, and the last one's
    /// cut, a version: every write up to it is flushed, every later one
    /// stays ([`Store::delete_namespace`]).
    flushes: Mutex<std::collections::HashMap<String, flush::Flush>>,
    /// The latest cut of any namespace's flush, and how many flushes run:
    /// the checks on the write and read paths skip the lock with them.
    flush_max: AtomicU64,
    flushes_running: std::sync::atomic::AtomicU32,
}

impl Inner {
    /// Gives the next operation on a stripe (held, `v`) its version.
    fn bump(&self, v: &mut u64) -> u64 {
        *v = self.clock.fetch_add(1, Relaxed) + 1;
        *v
    }

    /// The version clock now: every operation from here on gets a later one.
    fn now(&self) -> u64 {
        self.clock.load(Relaxed)
    }

    fn stripe(&self, ns: &str, key: &[u8]) -> &Mutex<u64> {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(key, xxhash_rust::xxh3::xxh3_64(ns.as_bytes()));
        &self.stripes[(h as usize) % self.stripes.len()]
    }

    fn lower(&self) -> impl Iterator<Item = &Lower> {
        self.disk.iter().chain(self.remote.iter())
    }
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

/// When an entry given `ttl` now expires, in milliseconds since the epoch;
/// a time past what a signed 64-bit count holds is held at its end (the
/// protocols refuse such TTLs before they get here).
fn expires_at(ttl: Duration) -> u64 {
    let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    now_ms().saturating_add(ms).min(i64::MAX as u64)
}

fn validate(ns: &str, key: &[u8]) -> Result<()> {
    crate::types::check_namespace(ns.as_bytes()).map_err(|e| WarehouseError::invalid("namespace", e))?;
    // The empty key is a key, as in Redis.
    if key.len() > MAX_KEY {
        return Err(WarehouseError::invalid("key", format!("must be at most {MAX_KEY} bytes")));
    }
    Ok(())
}

impl Store {
    /// Opens the store: builds the configured tiers (recovering the disk
    /// tier's index), starts the offload workers and the expiry sweeper.
    /// Must run inside a Tokio runtime.
    pub async fn open(cfg: StoreConfig) -> Result<Store> {
        if !cfg.memory_tier && cfg.disk.is_none() && cfg.remote.is_none() {
            return Err(WarehouseError::Config(
                "memory_tier = false needs a disk or remote tier: nothing could be stored".into(),
            ));
        }
        let at_rest = crate::tier::at_rest::AtRest::from_config(cfg.compression, cfg.encryption.as_ref())?;
        let disk: Option<Arc<dyn Tier>> = match &cfg.disk {
            Some(d) => {
                let (quotas, default) = (cfg.disk_quotas(), cfg.default_disk_quota());
                let tier = crate::tier::disk::open_disk_with_default_quota(d, at_rest.clone(), quotas, default).await?;
                Some(Arc::new(tier))
            }
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
        let memory = Arc::new(
            MemoryTier::new(cfg.memory.as_u64(), cfg.memory_policy)
                .with_quotas(cfg.memory_quotas())
                .with_default_quota(cfg.default_memory_quota()),
        );
        let (events, _) = broadcast::channel(8192);
        // Tiers announce their own changes, under the locks that order them,
        // so a subscriber sees one key's events in one tier in the order they
        // happened; the store announces only for tiers that cannot.
        let sink = |tier: TierKind| -> crate::tier::EventSink {
            let tx = events.clone();
            Arc::new(move |kind: EventKind, ns: &str, key: &[u8]| {
                emit(&tx, kind, ns, &Bytes::copy_from_slice(key), tier)
            })
        };
        memory.set_event_sink(sink(TierKind::Memory));
        let mut workers = Vec::new();
        let mut lower = |tier: Option<Arc<dyn Tier>>| {
            tier.map(|tier| {
                let announces = tier.set_event_sink(sink(tier.kind()));
                let (l, rxs) = Lower::new(tier.clone(), cfg.queue_depth, announces);
                for (rx, lane) in rxs {
                    workers.push((tier.clone(), rx, lane, l.shared.clone(), announces));
                }
                l
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
            stripes: (0..STRIPES).map(|_| Mutex::new(0)).collect(),
            clock: AtomicU64::new(0),
            flushes: Mutex::new(Default::default()),
            flush_max: AtomicU64::new(0),
            flushes_running: Default::default(),
        });
        for (tier, rx, lane, shared, announces) in workers {
            tokio::spawn(offload_worker(Arc::downgrade(&inner), tier, rx, lane, shared, announces));
        }
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(sweeper(Arc::downgrade(&inner)));
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
        let mut t = Vec::new();
        if self.inner.cfg.memory_tier {
            t.push(TierKind::Memory);
        }
        t.extend(self.lower().map(|l| l.tier.kind()));
        t
    }

    fn lower(&self) -> impl Iterator<Item = &Lower> {
        self.inner.lower()
    }

    fn lower_tier(&self, kind: TierKind) -> Option<&Arc<dyn Tier>> {
        self.lower().map(|l| &l.tier).find(|t| t.kind() == kind)
    }

    /// Reads a value in memory only, without an await or a copy.
    pub fn get_cached(&self, ns: &str, key: &[u8]) -> Option<Bytes> {
        self.inner.memory.get_sync(ns, key).map(|s| s.value)
    }

    /// Reads a value, walking the tiers and promoting a hit into memory.
    pub async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Hit>> {
        validate(ns, key)?;
        if let Some((s, seq)) = self.inner.memory.get_versioned(ns, key) {
            if self.inner.cfg.offload == OffloadMode::Hot && s.hits == self.inner.cfg.hot_threshold {
                let key = Bytes::copy_from_slice(key);
                let v = self.inner.stripe(ns, &key).lock();
                // Copied only if no later operation replaced what was read.
                if *v == seq {
                    for l in self.lower() {
                        l.offer_copy(ns, &key, s.value.clone(), s.meta);
                    }
                }
            }
            return Ok(Some(Hit { value: s.value, tier: TierKind::Memory, meta: s.meta }));
        }
        let version = *self.inner.stripe(ns, key).lock();
        let began = self.inner.now();
        for l in self.lower() {
            let kind = l.tier.kind();
            let found = match l.latest(ns, key) {
                // Queued for this tier: what it will hold is the answer.
                Some(Latest::Value(v, m)) => {
                    Latest::Value(v, m).live().map(|(value, meta)| crate::types::Stored { value, meta, hits: 1 })
                }
                Some(Latest::Removed) => None,
                Some(Latest::Unknown) | None => match l.tier.get(ns, key).await {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::warn!(tier = %kind, error = %e, "read failed; counted as a miss");
                        None
                    }
                },
            };
            if let Some(s) = found {
                let key = Bytes::copy_from_slice(key);
                self.promote(ns, key, s.value.clone(), s.meta, kind, version, began);
                return Ok(Some(Hit { value: s.value, tier: kind, meta: s.meta }));
            }
        }
        Ok(None)
    }

    /// Copies a value read from `from` into memory (and from the remote
    /// tier onto disk in mode `all`), unless the key changed since the
    /// read began (`version`, the key's; `began`, the clock's) or its
    /// namespace was flushed meanwhile.
    #[allow(clippy::too_many_arguments)]
    fn promote(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta, from: TierKind, version: u64, began: u64) {
        match from {
            TierKind::Disk => self.inner.promoted_disk.fetch_add(1, Relaxed),
            _ => self.inner.promoted_remote.fetch_add(1, Relaxed),
        };
        let mut evicted = {
            let v = self.inner.stripe(ns, &key).lock();
            if *v != version || self.inner.flushed_since(ns, began) {
                return;
            }
            if from == TierKind::Remote && self.inner.cfg.offload == OffloadMode::All {
                if let Some(d) = &self.inner.disk {
                    d.offer_copy(ns, &key, value.clone(), meta);
                }
            }
            if !self.inner.cfg.memory_tier {
                return;
            }
            self.inner.memory.put_versioned(ns, key.clone(), value, meta, version)
        };
        // A value too big for memory comes straight back: it was never
        // stored there, and it is still in the tier it was read from.
        evicted.retain(|e| !(e.namespace == ns && e.key == key));
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
        Ok(self.put_with(ns, key, value, opts).await?.stored)
    }

    /// Stores a value and says whether it is durable. A value that no tier
    /// can take is refused with [`WarehouseError::OutOfMemory`].
    pub async fn put_with(&self, ns: &str, key: Bytes, value: Bytes, opts: PutOptions) -> Result<PutOutcome> {
        self.put_core(ns, key, value, opts, Observe::default(), &mut None).await
    }

    /// [`Store::put_with`] that also reads what `observe` asks of the key
    /// as it was just before this write, atomically with it: its value
    /// (`SET … GET`, returned even when NX/XX keeps the write out), and its
    /// remaining TTL, kept for the new value (`KEEPTTL`). No other write of
    /// the key comes between the read and the write.
    pub async fn put_observed(
        &self,
        ns: &str,
        key: Bytes,
        value: Bytes,
        opts: PutOptions,
        observe: Observe,
    ) -> Result<(PutOutcome, Option<Bytes>)> {
        let mut old = None;
        let done = self.put_core(ns, key, value, opts, observe, &mut old).await?;
        Ok((done, old))
    }

    async fn put_core(
        &self,
        ns: &str,
        key: Bytes,
        value: Bytes,
        opts: PutOptions,
        observe: Observe,
        old: &mut Option<Bytes>,
    ) -> Result<PutOutcome> {
        validate(ns, &key)?;
        let limit = self.inner.cfg.max_value.as_u64();
        if value.len() as u64 > limit {
            return Err(WarehouseError::TooLarge { size: value.len() as u64, limit });
        }
        let mode = self.inner.cfg.offload;
        let size = value.len() as u64;
        let memory_can = self.inner.cfg.memory_tier && self.inner.memory.could_hold(&key, &value);
        if !memory_can && self.lower().next().is_none() {
            // Refused before anything changes: the key keeps its old value.
            return Err(WarehouseError::OutOfMemory { size });
        }
        let (seq, in_memory, evicted, meta) = loop {
            // NX / XX, GET, KEEPTTL: what the write depends on is read at a
            // version of the key's lock stripe, and the write goes ahead
            // only if nothing changed the stripe since (else it is read
            // again): two `SET k v NX` cannot both store, and two `SET … GET`
            // cannot both return the same old value, whatever the tiers'
            // latency.
            let mut ttl = opts.ttl;
            let expect = if opts.condition != Condition::Always || observe.old_value || observe.keep_ttl {
                let version = *self.inner.stripe(ns, &key).lock();
                let present = if observe.old_value {
                    *old = self.get(ns, &key).await?.map(|h| h.value);
                    old.is_some()
                } else {
                    self.exists(ns, &key).await?
                };
                if present && observe.keep_ttl {
                    if let Ttl::Remaining(d) = self.ttl(ns, &key).await? {
                        ttl = Some(d.max(Duration::from_millis(1)));
                    }
                }
                match opts.condition {
                    Condition::IfAbsent if present => return Ok(PutOutcome::default()),
                    Condition::IfPresent if !present => return Ok(PutOutcome::default()),
                    _ => {}
                }
                Some(version)
            } else {
                None
            };
            let ttl = ttl.or_else(|| self.inner.cfg.namespace_ttl(ns));
            let meta = EntryMeta { expires_at_ms: ttl.map(expires_at), depth: opts.depth };
            let mut v = self.inner.stripe(ns, &key).lock();
            if expect.is_some_and(|e| *v != e) {
                continue;
            }
            let seq = self.inner.bump(&mut v);
            let (evicted, in_memory) = if self.inner.cfg.memory_tier {
                let mut ev = self.inner.memory.put_versioned(ns, key.clone(), value.clone(), meta, seq);
                // A value memory cannot take comes straight back.
                let rejected =
                    ev.iter().position(|e| e.namespace == ns && e.key == key).map(|i| ev.remove(i)).is_some();
                (ev, !rejected)
            } else {
                (Vec::new(), false)
            };
            if in_memory && !opts.durable {
                for l in self.lower() {
                    if mode == OffloadMode::All {
                        l.offer_copy(ns, &key, value.clone(), meta);
                    } else {
                        // An older copy below would be served after this one leaves memory.
                        l.invalidate(ns, &key);
                    }
                }
            }
            break (seq, in_memory, evicted, meta);
        };
        self.handle_evicted(evicted);
        if in_memory && !opts.durable {
            return Ok(PutOutcome { stored: true, durable: false });
        }
        // Synchronously to the first lower tier that takes it: the value
        // must be held somewhere (memory refused it) or durable.
        let lowers: Vec<&Lower> = self.lower().collect();
        for (i, l) in lowers.iter().enumerate() {
            let rx = {
                let v = self.inner.stripe(ns, &key).lock();
                if *v != seq || self.inner.flushed(ns, seq) {
                    // A later operation on the key replaced this write, or
                    // a flush of its namespace removed it.
                    return Ok(PutOutcome { stored: true, durable: false });
                }
                l.submit(ns, &key, Action::Put { value: value.clone(), meta })
            };
            let Outcome::Put(ev) = wait(rx).await? else { continue };
            let kind = l.tier.kind();
            let taken = !ev.iter().any(|e| e.namespace == ns && e.key == key);
            if !taken {
                continue;
            }
            let mut durable = kind == TierKind::Remote;
            if kind == TierKind::Disk && opts.durable {
                l.tier.flush().await?;
                // A value the disk evicted between its write and the flush
                // was never synced (its file was gone): not durable.
                durable = l.tier.contains(ns, &key).await.unwrap_or(false);
            }
            // The tiers below this one: a copy (mode `all`), else no stale copy.
            let v = self.inner.stripe(ns, &key).lock();
            if *v == seq {
                for below in &lowers[i + 1..] {
                    if mode == OffloadMode::All || !in_memory {
                        below.offer_copy(ns, &key, value.clone(), meta);
                    } else {
                        below.invalidate(ns, &key);
                    }
                }
            }
            return Ok(PutOutcome { stored: true, durable: durable && opts.durable });
        }
        if in_memory {
            return Ok(PutOutcome { stored: true, durable: false });
        }
        Err(WarehouseError::OutOfMemory { size })
    }

    /// Memory evictions: announce them, and in `evicted` mode copy them to
    /// the first lower tier that does not hold them yet, unless the key
    /// changed since the evicted value was written.
    fn handle_evicted(&self, evicted: Vec<Evicted>) {
        for e in evicted {
            let Some(value) = e.value else { continue };
            if self.inner.cfg.offload != OffloadMode::Evicted {
                continue;
            }
            let v = self.inner.stripe(&e.namespace, &e.key).lock();
            // Replaced since, or flushed (a value written up to a flush's
            // cut that memory lets go during the flush).
            if *v != e.seq || self.inner.flushed(&e.namespace, e.seq) {
                continue;
            }
            for l in self.lower() {
                if l.holds_local(&e.namespace, &e.key) == Some(true) {
                    break;
                }
                if l.offer_copy(&e.namespace, &e.key, value.clone(), e.meta) {
                    break;
                }
            }
        }
    }

    /// Whether a live entry exists in any tier.
    pub async fn exists(&self, ns: &str, key: &[u8]) -> Result<bool> {
        validate(ns, key)?;
        if self.inner.memory.contains_sync(ns, key) {
            return Ok(true);
        }
        for l in self.lower() {
            let found = match l.holds_local(ns, key) {
                Some(b) => b,
                None => l.tier.contains(ns, key).await.unwrap_or(false),
            };
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Removes a key from every tier; whether it existed anywhere. Returns
    /// once every tier has applied the removal (after anything queued
    /// before it for the key).
    pub async fn delete(&self, ns: &str, key: &[u8]) -> Result<bool> {
        validate(ns, key)?;
        Ok(self.delete_at(ns, key, None).await?.unwrap_or(false))
    }

    /// Reads a value and removes it, as one operation (GETDEL): the value
    /// answered is the one removed, never one a concurrent write put there
    /// between the read and the removal.
    pub async fn take(&self, ns: &str, key: &[u8]) -> Result<Option<Hit>> {
        validate(ns, key)?;
        loop {
            let version = *self.inner.stripe(ns, key).lock();
            let Some(hit) = self.get(ns, key).await? else { return Ok(None) };
            if self.delete_at(ns, key, Some(version)).await?.is_some() {
                return Ok(Some(hit));
            }
        }
    }

    /// [`Store::delete`], only if the key's lock stripe is still at
    /// `version` (when given); `None` when it is not (nothing removed).
    async fn delete_at(&self, ns: &str, key: &[u8], version: Option<u64>) -> Result<Option<bool>> {
        let k = Bytes::copy_from_slice(key);
        let (mut existed, waits) = {
            let mut v = self.inner.stripe(ns, key).lock();
            if version.is_some_and(|e| *v != e) {
                return Ok(None);
            }
            self.inner.bump(&mut v);
            // Queued before memory lets go, so no reader falls through to an older copy below.
            let waits: Vec<_> =
                self.lower().map(|l| (l.tier.kind(), l.announces, l.submit(ns, &k, Action::Remove))).collect();
            (self.inner.memory.remove_sync(ns, key), waits)
        };
        let mut first_err = None;
        for (kind, announces, rx) in waits {
            match wait(rx).await {
                Ok(Outcome::Found(true)) => {
                    existed = true;
                    if !announces {
                        self.emit(EventKind::Removed, ns, &k, kind);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(Some(existed)),
        }
    }

    /// Sets (or with `None`, clears) a key's time to live in every tier,
    /// including a copy still queued for a lower tier.
    pub async fn expire(&self, ns: &str, key: &[u8], ttl: Option<Duration>) -> Result<bool> {
        validate(ns, key)?;
        let at = ttl.map(expires_at);
        let k = Bytes::copy_from_slice(key);
        let waits = {
            let mut v = self.inner.stripe(ns, key).lock();
            self.expire_locked(&mut v, ns, &k, at)
        };
        self.expire_done(waits).await
    }

    /// EXPIRE under a condition on the key's current TTL (`NX`, `XX`, `GT`,
    /// `LT`), atomically: `decide` sees the TTL at one version of the key
    /// and returns the new one (`Some(None)`: no expiry) or `None` to leave
    /// the key; it is set only if nothing wrote the key since, else the TTL
    /// is read again. Whether an expiry was set on a key that was there.
    pub async fn expire_if(
        &self,
        ns: &str,
        key: &[u8],
        decide: impl Fn(Ttl) -> Option<Option<Duration>>,
    ) -> Result<bool> {
        validate(ns, key)?;
        let k = Bytes::copy_from_slice(key);
        loop {
            let version = *self.inner.stripe(ns, key).lock();
            let current = self.ttl(ns, key).await?;
            if current == Ttl::Missing {
                return Ok(false);
            }
            let Some(ttl) = decide(current) else { return Ok(false) };
            let waits = {
                let mut v = self.inner.stripe(ns, key).lock();
                if *v != version {
                    continue;
                }
                self.expire_locked(&mut v, ns, &k, ttl.map(expires_at))
            };
            return self.expire_done(waits).await;
        }
    }

    /// Sets an expiry with the key's stripe held: in memory at once, and
    /// submitted to the lower tiers (their answers are waited for by
    /// [`Store::expire_done`], after the lock is let go).
    fn expire_locked(
        &self,
        v: &mut u64,
        ns: &str,
        k: &Bytes,
        at: Option<u64>,
    ) -> (bool, Vec<tokio::sync::oneshot::Receiver<Result<Outcome>>>) {
        let version = self.inner.bump(v);
        let found = self.inner.memory.set_expiry_versioned(ns, k, at, Some(version));
        let waits: Vec<_> = self.lower().map(|l| l.submit(ns, k, Action::Expire { at })).collect();
        (found, waits)
    }

    async fn expire_done(
        &self,
        (mut found, waits): (bool, Vec<tokio::sync::oneshot::Receiver<Result<Outcome>>>),
    ) -> Result<bool> {
        for rx in waits {
            if let Outcome::Found(f) = wait(rx).await? {
                found |= f;
            }
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
            meta = match l.latest(ns, key) {
                Some(Latest::Value(v, m)) => Latest::Value(v, m).live().map(|(_, m)| m),
                Some(Latest::Removed) => None,
                Some(Latest::Unknown) | None => l.tier.meta(ns, key).await.unwrap_or(None),
            };
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
            } else if self.inner.disk.as_ref().and_then(|d| d.holds_local(ns, k)) == Some(true) {
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
        // Every lower tier, the remote one too: a key only the remote tier
        // holds is still a key (Redis's SCAN, KEYS and DBSIZE count it).
        for l in self.lower() {
            // What is queued for the tier, read before the tier itself: a
            // value that lands in between is then in one or the other.
            let (live, gone) = l.pending_keys(ns, cursor);
            let mut page = l.tier.scan(ns, cursor, count).await?;
            page.keys.retain(|k| !gone.contains(k));
            pages.push(page);
            pages.push(ScanPage { keys: live, next: 0 });
        }
        Ok(merge_pages(pages, count))
    }

    /// Number of distinct keys `ns` holds, in any tier.
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

    /// Waits until queued offloads have drained, then makes the disk tier
    /// durable; an error if they have not drained within `timeout`.
    pub async fn flush(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        for l in self.lower() {
            while !l.idle() {
                if tokio::time::Instant::now() >= deadline {
                    return Err(WarehouseError::Timeout { what: "offload queues to drain", after: timeout });
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            l.tier.flush().await?;
        }
        Ok(())
    }

    /// Writes that have so far failed to reach the tier that makes writes
    /// durable (dropped from a full queue, or failed there); `None` when
    /// writes are not copied to such a tier at all (no disk or remote
    /// tier, or offload mode `hot` / `evicted`). WAITAOF compares two
    /// readings.
    pub fn durability_losses(&self) -> Option<u64> {
        let l = self.lower().next()?;
        if self.inner.cfg.memory_tier && self.inner.cfg.offload != OffloadMode::All {
            return None;
        }
        Some(l.shared.c.dropped.load(Relaxed) + l.shared.c.errors.load(Relaxed))
    }

    /// What namespace `ns` holds in each tier, and its quotas: the figures
    /// a tenant may see (INFO, `/stats`), nothing about other namespaces.
    pub fn namespace_usage(&self, ns: &str) -> Vec<crate::types::NamespaceUsage> {
        // Its own settings, else the defaults of unlisted namespaces.
        let cfg = Some(self.inner.cfg.namespaces.get(ns).unwrap_or(&self.inner.cfg.namespace_defaults));
        let mut out = Vec::new();
        let (bytes, entries) = self.inner.memory.namespace_usage(ns);
        if self.inner.cfg.memory_tier {
            out.push(crate::types::NamespaceUsage {
                tier: TierKind::Memory,
                bytes: Some(bytes),
                entries: Some(entries),
                quota: cfg.and_then(|c| c.memory_quota).map(|q| q.as_u64()),
            });
        }
        for l in self.lower() {
            let kind = l.tier.kind();
            let usage = l.tier.namespace_usage(ns);
            let quota = if kind == TierKind::Disk { cfg.and_then(|c| c.disk_quota).map(|q| q.as_u64()) } else { None };
            out.push(crate::types::NamespaceUsage {
                tier: kind,
                bytes: usage.map(|u| u.0),
                entries: usage.map(|u| u.1),
                quota,
            });
        }
        out
    }

    pub fn stats(&self) -> StoreStats {
        let mut tiers = vec![self.inner.memory.stats()];
        tiers.extend(self.lower().map(|l| l.tier.stats()));
        StoreStats {
            tiers,
            offload: self.lower().map(offload_stats).collect(),
            promotions_from_disk: self.inner.promoted_disk.load(Relaxed),
            promotions_from_remote: self.inner.promoted_remote.load(Relaxed),
            offload_mode: Some(self.inner.cfg.offload),
        }
    }
}
