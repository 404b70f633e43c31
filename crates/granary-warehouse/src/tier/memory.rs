//! The memory tier: values as reference-counted [`Bytes`] under a byte budget.
//!
//! A read hands out a clone of the `Bytes` handle, not a copy of the data,
//! so an evicted value stays valid for every reader still holding it; pins
//! additionally keep an entry from being chosen for eviction. The map is
//! split into shards (each with its own lock, policy and share of the
//! budget) once the budget is large enough for sharding not to distort
//! eviction. A shard's share bounds what its own writes evict, not what it
//! may hold: a value larger than one share empties its shard and then takes
//! room from the other shards, so any value up to the whole budget fits and
//! the total stays within the budget.
//!
//! A namespace may have a byte quota of its own. Its writes then evict its
//! own entries first, for the quota and for the tier's budget alike, so a
//! tenant filling its quota pushes out only its own data (others' entries
//! are taken only when it has nothing left to give, which cannot happen
//! while the quotas add up to no more than the budget).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};

use super::keys::{merge_pages, Entry, KeyIndex};
use super::{EventSink, Tier, TierEvents, TierKind};
use crate::error::Result;
use crate::policy::{EntryId, PolicyKind};
use crate::types::{now_ms, EntryMeta, Evicted, ScanPage, Stored, TierStats};

/// Maps keyed by client-chosen bytes: a fast hasher with a random seed per
/// map, so crafted keys cannot force collisions.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Budget per shard below which the tier uses fewer shards.
const MIN_SHARD_BUDGET: u64 = 64 << 20;
const MAX_SHARDS: usize = 16;

/// What a shard keeps beside its index entry.
struct Held {
    /// The store's version of the write (see [`Evicted::seq`]).
    seq: u64,
    value: Bytes,
}

struct Shard {
    budget: u64,
    index: KeyIndex<Held>,
    // Counted under the shard's lock: no shared cache line on the read path.
    hits: u64,
    misses: u64,
    evictions: u64,
    expirations: u64,
}

/// Sizes shared by all shards (changed on writes only).
#[derive(Default)]
struct Counters {
    bytes: AtomicU64,
    entries: AtomicU64,
}

/// A namespace's byte quota and what it holds, across all shards.
struct Quota {
    limit: u64,
    used: AtomicU64,
}

pub struct MemoryTier {
    shards: Box<[Mutex<Shard>]>,
    capacity: u64,
    /// Namespaces with a byte quota of their own (fixed when the tier is built).
    quotas: HashMap<Box<str>, Arc<Quota>>,
    /// The quota of every other namespace (0: none), each counted apart
    /// in `others` from its first write.
    default_quota: u64,
    others: RwLock<HashMap<Box<str>, Arc<Quota>>>,
    policy: PolicyKind,
    c: Counters,
    events: TierEvents,
}

fn entry_size(key: &[u8], value: &[u8]) -> u64 {
    // Keys count too, plus a fixed overhead for the slot and indexes.
    (key.len() + value.len() + 96) as u64
}

impl MemoryTier {
    /// A tier of `capacity` bytes (0 = unbounded) under `policy`.
    pub fn new(capacity: u64, policy: PolicyKind) -> Self {
        // The largest power of two that leaves each shard MIN_SHARD_BUDGET.
        let n =
            if capacity == 0 { MAX_SHARDS as u64 } else { (capacity / MIN_SHARD_BUDGET).clamp(1, MAX_SHARDS as u64) };
        let shards = 1usize << (63 - n.leading_zeros());
        let per = if capacity == 0 { 0 } else { capacity / shards as u64 };
        let shards = (0..shards)
            .map(|_| {
                Mutex::new(Shard {
                    budget: per,
                    index: KeyIndex::new(policy.build(per)),
                    hits: 0,
                    misses: 0,
                    evictions: 0,
                    expirations: 0,
                })
            })
            .collect();
        MemoryTier {
            shards,
            capacity,
            quotas: HashMap::default(),
            default_quota: 0,
            others: RwLock::default(),
            policy,
            c: Counters::default(),
            events: TierEvents::default(),
        }
    }

    /// Gives namespaces byte quotas (namespace, bytes; 0 = none).
    pub fn with_quotas(mut self, quotas: impl IntoIterator<Item = (String, u64)>) -> Self {
        self.quotas = quotas
            .into_iter()
            .filter(|(_, l)| *l != 0)
            .map(|(ns, limit)| (ns.into_boxed_str(), Arc::new(Quota { limit, used: AtomicU64::new(0) })))
            .collect();
        self
    }

    /// Gives every namespace [`MemoryTier::with_quotas`] does not name a
    /// quota of `bytes` (0: none), each its own.
    pub fn with_default_quota(mut self, bytes: u64) -> Self {
        self.default_quota = bytes;
        self
    }

    fn quota(&self, ns: &str) -> Option<Arc<Quota>> {
        if let Some(q) = self.quotas.get(ns) {
            return Some(q.clone());
        }
        if self.default_quota == 0 {
            return None;
        }
        if let Some(q) = self.others.read().get(ns) {
            return Some(q.clone());
        }
        let limit = self.default_quota;
        let mut others = self.others.write();
        Some(others.entry(ns.into()).or_insert_with(|| Arc::new(Quota { limit, used: AtomicU64::new(0) })).clone())
    }

    /// Bytes and entries `ns` holds in this tier.
    pub fn namespace_usage(&self, ns: &str) -> (u64, u64) {
        let (mut bytes, mut entries) = (0, 0);
        for s in self.shards.iter() {
            let (b, e) = s.lock().index.usage(ns);
            bytes += b;
            entries += e;
        }
        (bytes, entries)
    }

    fn shard(&self, ns: &str, key: &[u8]) -> &Mutex<Shard> {
        self.shard_in(ns_seed(ns), key)
    }

    fn shard_index(&self, ns: &str, key: &[u8]) -> usize {
        if self.shards.len() == 1 {
            return 0;
        }
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(key, ns_seed(ns));
        (h as usize) & (self.shards.len() - 1)
    }

    /// The shard of `key` in the namespace whose [`ns_seed`] is `seed`.
    fn shard_in(&self, seed: u64, key: &[u8]) -> &Mutex<Shard> {
        if self.shards.len() == 1 {
            return &self.shards[0];
        }
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(key, seed);
        &self.shards[(h as usize) & (self.shards.len() - 1)]
    }

    /// How many of `keys`, from the first, are live in `ns`: one clock read
    /// and one namespace hash for the whole batch.
    pub fn prefix_len(&self, ns: &str, keys: &[impl AsRef<[u8]>]) -> usize {
        let (now, seed) = (now_ms(), ns_seed(ns));
        keys.iter()
            .take_while(|k| {
                let k = k.as_ref();
                self.shard_in(seed, k).lock().index.is_live(ns, k, now)
            })
            .count()
    }

    /// Whether a value of this size could ever be held (within the whole budget).
    pub fn could_hold(&self, key: &[u8], value: &[u8]) -> bool {
        self.capacity == 0 || entry_size(key, value) <= self.capacity
    }

    /// Reads a value without an await: the in-process fast path.
    pub fn get_sync(&self, ns: &str, key: &[u8]) -> Option<Stored> {
        self.get_versioned(ns, key).map(|(s, _)| s)
    }

    /// [`MemoryTier::get_sync`], with the version the entry was written under.
    pub fn get_versioned(&self, ns: &str, key: &[u8]) -> Option<(Stored, u64)> {
        let now = now_ms();
        let mut s = self.shard(ns, key).lock();
        let expired = match s.index.get_mut(ns, key) {
            None => {
                s.misses += 1;
                return None;
            }
            Some(e) if !e.meta.is_expired(now) => {
                e.hits = e.hits.saturating_add(1);
                let out = (Stored { value: e.payload.value.clone(), meta: e.meta, hits: e.hits }, e.payload.seq);
                let id = e.id;
                s.index.access(id);
                s.hits += 1;
                return Some(out);
            }
            Some(e) => e.pins == 0,
        };
        if expired {
            self.remove_locked(&mut s, ns, key);
            s.expirations += 1;
            self.events.removed(ns, key);
        }
        s.misses += 1;
        None
    }

    /// Whether a live entry exists (no counting, no I/O).
    pub fn contains_sync(&self, ns: &str, key: &[u8]) -> bool {
        let now = now_ms();
        self.shard(ns, key).lock().index.is_live(ns, key, now)
    }

    /// Stores a value without an await.
    pub fn put_sync(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Vec<Evicted> {
        self.put_versioned(ns, key, value, meta, 0)
    }

    /// Stores a value written under version `seq`; returns what was evicted.
    /// A value that cannot fit (larger than the whole budget, or no room
    /// left that is not pinned) is not stored and comes back as an eviction
    /// of itself, any older value of the key removed.
    pub fn put_versioned(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta, seq: u64) -> Vec<Evicted> {
        let size = entry_size(&key, &value);
        let home = self.shard_index(ns, &key);
        let mut s = self.shards[home].lock();
        let quota = self.quota(ns);
        if (self.capacity != 0 && size > self.capacity) || quota.as_ref().is_some_and(|q| size > q.limit) {
            // Too big for this tier: replace nothing, hand it straight back.
            if self.remove_locked(&mut s, ns, &key).is_some() {
                self.events.removed(ns, &key);
            }
            return vec![Evicted { namespace: ns.to_string(), key, value: Some(value), meta, seq }];
        }
        self.remove_locked(&mut s, ns, &key);
        let mut evicted = Vec::new();
        // A namespace with a quota makes room from its own entries; when the
        // shard has none left, the passes below take it from other shards.
        let own = quota.as_ref().map(|_| ns);
        while s.budget != 0 && s.index.bytes() + size > s.budget {
            let Some(v) = self.evict_one(&mut s, None, own) else { break };
            evicted.push(v);
        }
        let id = self.insert_locked(&mut s, ns, key.clone(), value, meta, seq, size);
        drop(s);
        let over_total = || self.capacity != 0 && self.c.bytes.load(Relaxed) > self.capacity;
        let over_quota = || quota.as_ref().is_some_and(|q| q.used.load(Relaxed) > q.limit);
        if !over_total() && !over_quota() {
            return evicted;
        }
        // Over the whole budget (a value larger than its shard's share, or
        // a shard full of pinned entries) or over the namespace's quota:
        // take room from the other shards, then from this one, never
        // evicting the new entry itself; a namespace with a quota gives up
        // its own entries first.
        let n = self.shards.len();
        let order = || (1..=n).map(|d| (home + d) % n);
        if own.is_some() {
            for i in order() {
                let mut s = self.shards[i].lock();
                let skip = (i == home).then_some(id);
                while over_total() || over_quota() {
                    let Some(v) = self.evict_one(&mut s, skip, own) else { break };
                    evicted.push(v);
                }
            }
        }
        if !over_quota() {
            for i in order() {
                if !over_total() {
                    return evicted;
                }
                let mut s = self.shards[i].lock();
                let skip = (i == home).then_some(id);
                while over_total() {
                    let Some(v) = self.evict_one(&mut s, skip, None) else { break };
                    evicted.push(v);
                }
            }
            if !over_total() {
                return evicted;
            }
        }
        // Everything else is pinned: refuse the new value.
        let mut s = self.shards[home].lock();
        if s.index.get(ns, &key).is_some_and(|e| e.id == id) {
            if let Some(e) = self.remove_locked(&mut s, ns, &key) {
                self.events.removed(ns, &key);
                evicted.push(Evicted { namespace: ns.to_string(), key, value: Some(e.payload.value), meta, seq });
            }
        }
        evicted
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_locked(
        &self,
        s: &mut Shard,
        ns: &str,
        key: Bytes,
        value: Bytes,
        meta: EntryMeta,
        seq: u64,
        size: u64,
    ) -> EntryId {
        self.events.stored(ns, &key);
        let id = s.index.insert(ns, key, size, meta, Held { seq, value });
        if let Some(q) = self.quota(ns) {
            q.used.fetch_add(size, Relaxed);
        }
        self.c.bytes.fetch_add(size, Relaxed);
        self.c.entries.fetch_add(1, Relaxed);
        id
    }

    /// Removes a key; whether it was there.
    /// Removes a key; whether it held a live (unexpired) value, as DEL
    /// counts it. An expired entry is removed too.
    pub fn remove_sync(&self, ns: &str, key: &[u8]) -> bool {
        let mut s = self.shard(ns, key).lock();
        let Some(e) = self.remove_locked(&mut s, ns, key) else { return false };
        self.events.removed(ns, key);
        !e.meta.is_expired(now_ms())
    }

    /// Removes every entry of `ns` written at version `upto` or before (a
    /// namespace flush's cut: what was written after it stays); how many.
    pub fn remove_namespace_upto(&self, ns: &str, upto: u64) -> u64 {
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut s = shard.lock();
            for k in s.index.keys(ns) {
                if s.index.get(ns, &k).is_some_and(|e| e.payload.seq > upto) {
                    continue;
                }
                if self.remove_locked(&mut s, ns, &k).is_some() {
                    n += 1;
                    self.events.removed(ns, &k);
                }
            }
        }
        n
    }

    /// Sets or clears a live entry's expiry (and with `seq`, its version);
    /// whether the key was there.
    pub fn set_expiry_versioned(&self, ns: &str, key: &[u8], expires_at_ms: Option<u64>, seq: Option<u64>) -> bool {
        let now = now_ms();
        let mut s = self.shard(ns, key).lock();
        let Some(e) = s.index.get_mut(ns, key) else { return false };
        if e.meta.is_expired(now) {
            return false;
        }
        if let Some(seq) = seq {
            e.payload.seq = seq;
        }
        let (size, meta) = (e.size, EntryMeta { expires_at_ms, ..e.meta });
        s.index.update(ns, key, size, meta)
    }

    /// Evicts one unpinned entry of the shard other than `skip`, of
    /// namespace `only` if given.
    fn evict_one(&self, s: &mut Shard, skip: Option<EntryId>, only: Option<&str>) -> Option<Evicted> {
        let (ns, key, e) = s.index.evict_one(only, skip)?;
        self.unaccount(&ns, e.size);
        s.evictions += 1;
        self.events.removed(&ns, &key);
        Some(Evicted { namespace: ns.to_string(), key, value: Some(e.payload.value), meta: e.meta, seq: e.payload.seq })
    }

    /// Removes an entry with the shard locked.
    fn remove_locked(&self, s: &mut Shard, ns: &str, key: &[u8]) -> Option<Entry<Held>> {
        let e = s.index.remove(ns, key)?;
        self.unaccount(ns, e.size);
        Some(e)
    }

    /// Takes a removed entry's bytes off the tier's and its namespace's counts.
    fn unaccount(&self, ns: &str, size: u64) {
        if let Some(q) = self.quota(ns) {
            q.used.fetch_sub(size, Relaxed);
        }
        self.c.bytes.fetch_sub(size, Relaxed);
        self.c.entries.fetch_sub(1, Relaxed);
    }
}

#[async_trait]
impl Tier for MemoryTier {
    fn kind(&self) -> TierKind {
        TierKind::Memory
    }

    fn set_event_sink(&self, sink: EventSink) -> bool {
        self.events.set(sink);
        true
    }

    async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Stored>> {
        Ok(self.get_sync(ns, key))
    }

    async fn contains(&self, ns: &str, key: &[u8]) -> Result<bool> {
        Ok(self.contains_sync(ns, key))
    }

    fn contains_local(&self, ns: &str, key: &[u8]) -> Option<bool> {
        Some(self.contains_sync(ns, key))
    }

    async fn put(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Result<Vec<Evicted>> {
        Ok(self.put_sync(ns, key, value, meta))
    }

    async fn remove(&self, ns: &str, key: &[u8]) -> Result<bool> {
        Ok(self.remove_sync(ns, key))
    }

    async fn remove_namespace(&self, ns: &str) -> Result<u64> {
        Ok(self.remove_namespace_upto(ns, u64::MAX))
    }

    async fn set_expiry(&self, ns: &str, key: &[u8], expires_at_ms: Option<u64>) -> Result<bool> {
        Ok(self.set_expiry_versioned(ns, key, expires_at_ms, None))
    }

    async fn meta(&self, ns: &str, key: &[u8]) -> Result<Option<EntryMeta>> {
        let now = now_ms();
        let s = self.shard(ns, key).lock();
        Ok(s.index.get(ns, key).map(|e| e.meta).filter(|m| !m.is_expired(now)))
    }

    async fn scan(&self, ns: &str, cursor: u64, count: usize) -> Result<ScanPage> {
        let now = now_ms();
        // A page from every shard, each complete up to its own cursor.
        Ok(merge_pages(self.shards.iter().map(|s| s.lock().index.scan(ns, cursor, count, now)), count))
    }

    async fn namespaces(&self) -> Result<Vec<String>> {
        let mut out = BTreeSet::new();
        for shard in self.shards.iter() {
            out.extend(shard.lock().index.namespaces().map(str::to_string));
        }
        Ok(out.into_iter().collect())
    }

    fn pin(&self, ns: &str, key: &[u8]) -> bool {
        let mut s = self.shard(ns, key).lock();
        match s.index.get_mut(ns, key) {
            Some(e) => {
                e.pins += 1;
                true
            }
            None => false,
        }
    }

    fn unpin(&self, ns: &str, key: &[u8]) {
        let mut s = self.shard(ns, key).lock();
        if let Some(e) = s.index.get_mut(ns, key) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        let now = now_ms();
        let mut n = 0u64;
        for shard in self.shards.iter() {
            let mut s = shard.lock();
            for (ns, key, e) in s.index.remove_expired(now, limit.saturating_sub(n as usize)) {
                self.unaccount(&ns, e.size);
                n += 1;
                s.expirations += 1;
                self.events.removed(&ns, &key);
            }
        }
        Ok(n)
    }

    fn namespace_usage(&self, ns: &str) -> Option<(u64, u64)> {
        Some(MemoryTier::namespace_usage(self, ns))
    }

    fn stats(&self) -> TierStats {
        let mut t = TierStats {
            tier: Some(TierKind::Memory),
            policy: Some(self.policy.as_str().to_string()),
            bytes: self.c.bytes.load(Relaxed),
            entries: self.c.entries.load(Relaxed),
            capacity: self.capacity,
            ..Default::default()
        };
        for shard in self.shards.iter() {
            let s = shard.lock();
            t.hits += s.hits;
            t.misses += s.misses;
            t.evictions += s.evictions;
            t.expirations += s.expirations;
        }
        t
    }
}

/// Hash of a namespace name, seeding the shard choice of its keys.
fn ns_seed(ns: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(ns.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_count_follows_budget() {
        assert_eq!(MemoryTier::new(1000, PolicyKind::Lru).shards.len(), 1);
        assert_eq!(MemoryTier::new(128 << 20, PolicyKind::Lru).shards.len(), 2);
        assert_eq!(MemoryTier::new(1 << 30, PolicyKind::Lru).shards.len(), 16);
        assert_eq!(MemoryTier::new(0, PolicyKind::Lru).shards.len(), 16);
    }

    #[tokio::test]
    async fn scan_finds_every_live_key_behind_runs_of_expired_ones() {
        // 16 shards; nine keys in ten have expired, so most shards begin
        // their part of a page with a run of expired keys.
        let t = MemoryTier::new(0, PolicyKind::Lru);
        let past = EntryMeta { expires_at_ms: Some(1), ..EntryMeta::default() };
        let mut live = Vec::new();
        for i in 0..2000 {
            let key = Bytes::from(format!("key-{i}"));
            let meta = if i % 10 == 0 { EntryMeta::default() } else { past };
            t.put_sync("n", key.clone(), Bytes::from_static(b"v"), meta);
            if i % 10 == 0 {
                live.push(key);
            }
        }
        let (mut seen, mut cursor) = (Vec::new(), 0);
        loop {
            let page = t.scan("n", cursor, 5).await.unwrap();
            assert!(page.keys.len() <= 6, "a page of 5 came back with {}", page.keys.len());
            seen.extend(page.keys);
            if page.next == 0 {
                break;
            }
            cursor = page.next;
        }
        seen.sort();
        live.sort();
        assert_eq!(seen.len(), live.len(), "SCAN lost or repeated keys");
        assert_eq!(seen, live);
    }

    #[test]
    fn budget_is_enforced_and_pins_hold() {
        let t = MemoryTier::new(3 * entry_size(b"k0", &[0; 100]), PolicyKind::Lru);
        for i in 0..3 {
            assert!(t
                .put_sync("n", Bytes::from(format!("k{i}")), Bytes::from(vec![i as u8; 100]), EntryMeta::default())
                .is_empty());
        }
        assert!(t.pin("n", b"k0"));
        let ev = t.put_sync("n", Bytes::from_static(b"k3"), Bytes::from(vec![3; 100]), EntryMeta::default());
        assert_eq!(ev.len(), 1);
        assert_eq!(&ev[0].key[..], b"k1", "pinned k0 must be skipped");
        assert!(t.get_sync("n", b"k0").is_some());
        t.unpin("n", b"k0");
        assert!(t.stats().bytes <= t.capacity);
    }
}
