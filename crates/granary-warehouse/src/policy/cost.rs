//! Cost-aware eviction: keep what is reused and expensive to recompute.
//!
//! A KV block is worth keeping in proportion to how often it is read and to
//! what it costs to produce again, and in inverse proportion to the memory
//! it occupies. This is GreedyDual-Size-Frequency (Cherkasova, "Improving
//! WWW proxies performance with Greedy-Dual-Size-Frequency caching policy",
//! HP Labs 1998), with the cost of a block taken from its prefix depth:
//!
//! ```text
//! H = L + f × cost(d) / s        cost(d) = 1 + d
//! ```
//!
//! - `f`: reference count (1 on insert, +1 per access);
//! - `d`: the block's index in its prompt (0 = first block). Recomputing
//!   block `d` runs the projections and MLP over its own tokens (a fixed
//!   amount, the `1`) plus attention of its tokens over the `d` blocks
//!   before it (`d` more units, counting one block-against-block attention
//!   as one unit). The real ratio depends on model and block size; the
//!   linear shape is what matters for the ranking;
//! - `s`: size in the tier's unit (bytes; 0 is treated as 1);
//! - `L`: the `H` of the last victim (never decreasing), read whenever `H`
//!   is (re)computed, so entries that stop being read age out.
//!
//! The victim is the lowest `H`, ties to the least recently used.
//! O(log n) per operation.
//!
//! Caveat for prefix caches: a deep block only saves work when every block
//! before it is cached too, and this policy, ranking blocks one by one, may
//! keep a deep block whose ancestors were evicted.

use super::ranked::Ranked;
use super::{EntryId, Policy};

/// Relative cost of recomputing the block at prefix `depth` (0-based).
pub fn recompute_cost(depth: u32) -> f64 {
    1.0 + f64::from(depth)
}

#[derive(Clone, Copy)]
struct Meta {
    freq: u32,
    depth: u32,
    size: u64,
}

#[derive(Default)]
pub struct Cost {
    /// `H` in the order, as the bits of a non-negative f64 (which sort like
    /// the numbers they encode).
    ranked: Ranked<Meta>,
    /// The inflation value `L`.
    age: f64,
}

impl Cost {
    fn rank(&mut self, id: EntryId, m: Meta) {
        let h = self.age + f64::from(m.freq) * recompute_cost(m.depth) / m.size.max(1) as f64;
        debug_assert!(h.is_finite() && h >= 0.0);
        self.ranked.set(id, h.to_bits(), m);
    }
}

impl Policy for Cost {
    fn name(&self) -> &'static str {
        "cost"
    }
    fn insert(&mut self, id: EntryId, _fingerprint: u64, size: u64, depth: u32) {
        self.rank(id, Meta { freq: 1, depth, size });
    }
    fn access(&mut self, id: EntryId) {
        if let Some(mut m) = self.ranked.meta(id) {
            m.freq = m.freq.saturating_add(1);
            self.rank(id, m);
        }
    }
    fn remove(&mut self, id: EntryId) {
        self.ranked.remove(id);
    }
    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        let (id, h) = self.ranked.pop_min(evictable)?;
        self.age = self.age.max(f64::from_bits(h));
        Some(id)
    }
    fn len(&self) -> usize {
        self.ranked.len()
    }
}

#[cfg(test)]
impl super::Check for Cost {
    fn check(&self) {
        assert!(self.age.is_finite() && self.age >= 0.0);
        self.ranked.check();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(p: &mut Cost) -> Vec<EntryId> {
        std::iter::from_fn(|| p.evict(&mut |_| true)).collect()
    }

    #[test]
    fn keeps_deep_blocks_over_shallow_ones() {
        let mut p = Cost::default();
        // Deep blocks first, so recency alone would evict them first.
        p.insert(1, 1, 100, 12);
        p.insert(2, 2, 100, 3);
        p.insert(3, 3, 100, 0);
        for id in 1..=3 {
            p.access(id);
        }
        assert_eq!(drain(&mut p), [3, 2, 1]);
    }

    #[test]
    fn frequency_and_size_count_too() {
        let mut p = Cost::default();
        p.insert(1, 1, 100, 4); // H = 5/100
        p.insert(2, 2, 100, 0);
        for _ in 0..9 {
            p.access(2); // H = 10/100
        }
        p.insert(3, 3, 1000, 4); // same depth as 1, ten times larger: H = 5/1000
        assert_eq!(drain(&mut p), [3, 1, 2]);
    }

    #[test]
    fn aging_lets_new_blocks_displace_stale_deep_ones() {
        let mut p = Cost::default();
        p.insert(0, 0, 1, 9); // H = 10
        let mut victims = Vec::new();
        for id in 1..=4 {
            p.insert(id, id, 1, 3); // H = L + 4
            victims.push(p.evict(&mut |_| true).unwrap());
        }
        // L: 4 → 8 → 10 (block 0 goes once newcomers start at 12) → 12.
        assert_eq!(victims, [1, 2, 0, 3]);
    }

    #[test]
    fn skips_pinned_and_removes() {
        let mut p = Cost::default();
        p.insert(1, 1, 1, 0);
        p.insert(2, 2, 1, 5);
        p.insert(3, 3, 1, 9);
        assert_eq!(p.evict(&mut |id| id != 1), Some(2));
        p.remove(3);
        assert_eq!(p.len(), 1);
        assert_eq!(p.evict(&mut |_| false), None);
        assert_eq!(drain(&mut p), [1]);
    }
}
