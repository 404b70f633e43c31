//! Eviction policies, shared by every tier that has a byte budget.
//!
//! A policy only orders entries; the tier owns the bytes. Entries are named
//! by an [`EntryId`] the tier assigns (unique while the entry lives) and a
//! `fingerprint` (a hash of namespace and key, stable across re-insertions,
//! for policies that remember evicted keys such as S3-FIFO's ghost queue).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

mod fifo;
mod lru;

pub use fifo::Fifo;
pub use lru::Lru;

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
    pub fn build(self, capacity: u64) -> Box<dyn Policy> {
        let _ = capacity;
        match self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Fifo => Box::new(Fifo::default()),
            // Filled in by their own modules.
            PolicyKind::Lfu | PolicyKind::S3fifo | PolicyKind::Cost => Box::new(Lru::default()),
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
