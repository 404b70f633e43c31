//! What the connector counts, for the engine to export.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

/// Live counters of one [`super::Connector`]. Monotonic; read them with
/// [`ConnectorStats::snapshot`]. (Saving in the background, with its queue
/// and its drops, is the engine's save loop; see `granary_engine_kv_block_saves_total`.)
#[derive(Debug, Default)]
pub struct ConnectorStats {
    pub(super) lookups: AtomicU64,
    pub(super) lookup_hashes: AtomicU64,
    pub(super) lookup_matched: AtomicU64,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) corrupt: AtomicU64,
    pub(super) shape_mismatch: AtomicU64,
    pub(super) bytes_loaded: AtomicU64,
    pub(super) blocks_saved: AtomicU64,
    pub(super) bytes_saved: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) timeouts: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    /// `lookup` calls.
    pub lookups: u64,
    /// Hashes asked about by those calls.
    pub lookup_hashes: u64,
    /// Leading hashes found present, summed over calls.
    pub lookup_matched: u64,
    /// Blocks returned by `get_many`.
    pub hits: u64,
    /// Blocks asked for and not returned: absent, corrupt or of another shape
    /// (a call that failed as a whole counts in `errors`, not here).
    pub misses: u64,
    /// Blocks whose frame failed to decode (magic, checksums, lengths).
    pub corrupt: u64,
    /// Blocks that decoded but hold another shape than the one asked for.
    pub shape_mismatch: u64,
    /// KV payload bytes returned (frame headers not included).
    pub bytes_loaded: u64,
    /// Blocks the warehouse acknowledged storing.
    pub blocks_saved: u64,
    /// KV payload bytes of those blocks.
    pub bytes_saved: u64,
    /// Calls that failed (timeouts included).
    pub errors: u64,
    /// Calls that failed because their deadline passed.
    pub timeouts: u64,
}

impl ConnectorStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let r = |c: &AtomicU64| c.load(Relaxed);
        StatsSnapshot {
            lookups: r(&self.lookups),
            lookup_hashes: r(&self.lookup_hashes),
            lookup_matched: r(&self.lookup_matched),
            hits: r(&self.hits),
            misses: r(&self.misses),
            corrupt: r(&self.corrupt),
            shape_mismatch: r(&self.shape_mismatch),
            bytes_loaded: r(&self.bytes_loaded),
            blocks_saved: r(&self.blocks_saved),
            bytes_saved: r(&self.bytes_saved),
            errors: r(&self.errors),
            timeouts: r(&self.timeouts),
        }
    }
}

/// Adds `n` to a counter.
pub(super) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}
