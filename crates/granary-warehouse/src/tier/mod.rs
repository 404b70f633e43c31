//! The tiers, behind one trait so the store and the shared test suite treat
//! them alike: [`memory::MemoryTier`] (byte budget), [`disk::DiskTier`]
//! (directory + byte budget, crash-safe) and [`remote::RemoteTier`] (an
//! `object_store` URL).
//!
//! A tier stores `(namespace, key) → value` with [`EntryMeta`]; it enforces
//! its own budget with its own [`crate::policy::Policy`], hides expired
//! entries, verifies what it reads back, and counts what happens in
//! [`TierStats`].

use std::fmt;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;
use serde::Serialize;

use crate::error::Result;
use crate::types::{EntryMeta, EventKind, Evicted, ScanPage, Stored, TierStats};

pub mod at_rest;
pub mod disk;
pub(crate) mod keys;
pub mod memory;
pub mod remote;

/// Which tier, fastest first (also the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    Memory,
    Disk,
    Remote,
}

impl TierKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Memory => "memory",
            TierKind::Disk => "disk",
            TierKind::Remote => "remote",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a tier announces the entries it stores and drops, so the store
/// can publish them as events.
pub type EventSink = Arc<dyn Fn(EventKind, &str, &[u8]) + Send + Sync>;

/// A tier's [`EventSink`], once the store has set it. Tiers call it under
/// the lock that orders the change, so one key's events in one tier come
/// out in the order its entry changed.
#[derive(Default)]
pub struct TierEvents(OnceLock<EventSink>);

impl TierEvents {
    pub fn set(&self, sink: EventSink) {
        let _ = self.0.set(sink);
    }

    pub fn stored(&self, ns: &str, key: &[u8]) {
        if let Some(s) = self.0.get() {
            s(EventKind::Stored, ns, key);
        }
    }

    pub fn removed(&self, ns: &str, key: &[u8]) {
        if let Some(s) = self.0.get() {
            s(EventKind::Removed, ns, key);
        }
    }
}

/// One storage tier.
#[async_trait]
pub trait Tier: Send + Sync + 'static {
    fn kind(&self) -> TierKind;

    /// Where to announce entries. Returns true if the tier announces every
    /// entry it stores or drops (in order, under its own locks); false if it
    /// announces at most what it drops on its own (expiry, corruption), and
    /// the store announces its writes and removals for it.
    fn set_event_sink(&self, _sink: EventSink) -> bool {
        false
    }

    /// The value and metadata, or `None` if absent or expired. Counts a hit
    /// or a miss. A corrupt entry is dropped, counted and reported as absent.
    async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Stored>>;

    /// Whether a live entry exists, without reading its value or counting.
    async fn contains(&self, ns: &str, key: &[u8]) -> Result<bool>;

    /// Answers `contains` without I/O when the tier can (memory, disk
    /// index); `None` when it would have to ask a slower medium.
    fn contains_local(&self, ns: &str, key: &[u8]) -> Option<bool>;

    /// Stores (or replaces) a value; returns what was evicted to make room.
    /// A value larger than the tier's whole budget is not stored and comes
    /// back as the only eviction.
    async fn put(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Result<Vec<Evicted>>;

    /// Removes a key; whether it held a live value (an expired entry is
    /// removed but not counted, as Redis's DEL does not count it).
    async fn remove(&self, ns: &str, key: &[u8]) -> Result<bool>;

    /// Removes every key of a namespace; how many.
    async fn remove_namespace(&self, ns: &str) -> Result<u64>;

    /// Sets or clears a live entry's expiry; whether the key was there.
    async fn set_expiry(&self, ns: &str, key: &[u8], expires_at_ms: Option<u64>) -> Result<bool>;

    /// Metadata of a live entry, without reading the value or counting.
    async fn meta(&self, ns: &str, key: &[u8]) -> Result<Option<EntryMeta>>;

    /// Up to about `count` live keys of `ns` whose scan hash is `>= cursor`,
    /// in scan order ([`crate::types::scan_hash`], then key bytes).
    async fn scan(&self, ns: &str, cursor: u64, count: usize) -> Result<ScanPage>;

    /// Namespaces with at least one entry.
    async fn namespaces(&self) -> Result<Vec<String>>;

    /// Keeps an entry from being evicted until [`Tier::unpin`]; whether it exists.
    fn pin(&self, _ns: &str, _key: &[u8]) -> bool {
        false
    }
    fn unpin(&self, _ns: &str, _key: &[u8]) {}

    /// Drops expired entries (up to `limit`); how many.
    async fn purge_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0)
    }

    /// Waits until writes accepted so far are durable (fsync).
    async fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn stats(&self) -> TierStats;

    /// Bytes and entries namespace `ns` holds here, where the tier knows
    /// without I/O (memory and disk do; the remote tier does not).
    fn namespace_usage(&self, _ns: &str) -> Option<(u64, u64)> {
        None
    }
}
