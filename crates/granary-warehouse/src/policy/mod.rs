//! Eviction policies, shared by every tier that has a byte budget.
//!
//! A policy only orders entries; the tier owns the bytes. Entries are named
//! by an [`EntryId`] the tier assigns (unique while the entry lives) and a
//! `fingerprint` (a hash of namespace and key, stable across re-insertions,
//! for policies that remember evicted keys such as S3-FIFO's ghost queue).
//!
//! | policy   | keeps                                   | cost per operation |
//! |----------|-----------------------------------------|--------------------|
//! | `lru`    | recently read entries                   | O(1)               |
//! | `fifo`   | recently written entries                | O(1)               |
//! | `lfu`    | often read entries, aged (LFU-DA)       | O(log n)           |
//! | `s3fifo` | entries read again soon after arrival   | O(1) amortized     |
//! | `cost`   | reused entries that are costly to redo  | O(log n)           |
//!
//! `evict` additionally walks past pinned entries, which keep their place
//! (S3-FIFO moves them, see its module).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

mod cost;
mod fifo;
mod lfu;
mod list;
mod lru;
mod ranked;
mod s3fifo;

pub use cost::{recompute_cost, Cost};
pub use fifo::Fifo;
pub use lfu::Lfu;
pub use lru::Lru;
pub use s3fifo::S3Fifo;

/// Names an entry inside one tier.
pub type EntryId = u64;

/// Orders a tier's entries for eviction.
pub trait Policy: Send + Sync {
    /// The policy's name as configured (`lru`, `lfu`, ...).
    fn name(&self) -> &'static str;
    /// A new entry of `size` bytes at prefix `depth`.
    fn insert(&mut self, id: EntryId, fingerprint: u64, size: u64, depth: u32);
    /// The entry was read.
    fn access(&mut self, id: EntryId);
    /// The entry left the tier for another reason (delete, expiry, overwrite).
    fn remove(&mut self, id: EntryId);
    /// Chooses the next victim among entries for which `evictable` is true
    /// (pinned entries are not), and forgets it. `None` if no entry qualifies.
    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId>;
    /// Entries tracked.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The policies a tier can be configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    #[default]
    Lru,
    Lfu,
    Fifo,
    S3fifo,
    /// Reuse frequency × recompute cost (which grows with prefix depth).
    Cost,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 5] =
        [PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::Fifo, PolicyKind::S3fifo, PolicyKind::Cost];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::Fifo => "fifo",
            PolicyKind::S3fifo => "s3fifo",
            PolicyKind::Cost => "cost",
        }
    }

    /// A fresh policy of this kind for a tier of `capacity` bytes (0 = unbounded).
    /// Sizes passed to [`Policy::insert`] must be in the same unit.
    pub fn build(self, capacity: u64) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Lfu => Box::new(Lfu::default()),
            PolicyKind::Fifo => Box::new(Fifo::default()),
            PolicyKind::S3fifo => Box::new(S3Fifo::new(capacity)),
            PolicyKind::Cost => Box::new(Cost::default()),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown policy {s:?} (expected lru, lfu, fifo, s3fifo or cost)"))
    }
}

/// Hashes entry ids, which tiers hand out sequentially: one multiply and a
/// fold instead of SipHash on every read. Fingerprints derive from client
/// keys, so maps keyed by them keep the standard, randomly seeded hasher.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        let m = u128::from(self.0 ^ n) * 0x9E37_79B9_7F4A_7C15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

/// A map keyed by entry id.
pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Internal consistency checks the policy tests run after every operation.
#[cfg(test)]
pub(crate) trait Check: Policy {
    /// Panics if the policy's indexes disagree with each other.
    fn check(&self);
}

#[cfg(test)]
mod tests;
