//! Least frequently used, with dynamic aging (LFU-DA).
//!
//! Plain LFU keeps yesterday's heavy hitters forever: a block read a
//! thousand times during one burst outranks every block of today's traffic.
//! LFU with dynamic aging (Arlitt et al., "Evaluating content management
//! techniques for Web proxy caches", 2000) fixes this with an inflation
//! value `L`:
//!
//! - an entry's priority is `K = L + f`, where `f` is its reference count
//!   (1 on insert, +1 per access) and `L` is read when `K` is (re)computed;
//! - the victim is the entry with the lowest `K`, ties to the least
//!   recently used; after an eviction `L` becomes the victim's `K`.
//!
//! `L` never decreases, so a new entry starts level with what was just
//! evicted, and an entry that stops being read sinks relative to newcomers:
//! once `L` passes its `K` it goes, however large its old count. With no
//! evictions (`L` = 0) this is exactly LFU with LRU tie-breaking.
//!
//! O(log n) per operation (an ordered set, [`super::ranked::Ranked`]).

use super::ranked::Ranked;
use super::{EntryId, Policy};

#[derive(Default)]
pub struct Lfu {
    /// Priority `K` in the order; reference count as data.
    ranked: Ranked<u64>,
    /// The inflation value `L`.
    age: u64,
}

impl Policy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }
    fn insert(&mut self, id: EntryId, _fingerprint: u64, _size: u64, _depth: u32) {
        self.ranked.set(id, self.age.saturating_add(1), 1);
    }
    fn access(&mut self, id: EntryId) {
        if let Some(f) = self.ranked.meta(id) {
            let f = f.saturating_add(1);
            self.ranked.set(id, self.age.saturating_add(f), f);
        }
    }
    fn remove(&mut self, id: EntryId) {
        self.ranked.remove(id);
    }
    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        let (id, k) = self.ranked.pop_min(evictable)?;
        self.age = self.age.max(k);
        Some(id)
    }
    fn len(&self) -> usize {
        self.ranked.len()
    }
}

#[cfg(test)]
impl super::Check for Lfu {
    fn check(&self) {
        self.ranked.check();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_frequent_keys_ties_to_least_recent() {
        let mut p = Lfu::default();
        for id in 1..=4 {
            p.insert(id, id, 1, 0);
        }
        for _ in 0..3 {
            p.access(1);
        }
        p.access(2);
        // 3 and 4 were read equally often (never); 3 is older.
        let order: Vec<_> = std::iter::from_fn(|| p.evict(&mut |_| true)).collect();
        assert_eq!(order, [3, 4, 2, 1]);
    }

    #[test]
    fn stale_heavy_hitter_ages_out() {
        let mut p = Lfu::default();
        p.insert(0, 0, 1, 0);
        for _ in 0..4 {
            p.access(0); // K = 5
        }
        // Each round a newcomer read twice replaces the last one.
        let mut victims = Vec::new();
        for id in 1..=4 {
            p.insert(id, id, 1, 0);
            p.access(id);
            victims.push(p.evict(&mut |_| true).unwrap());
        }
        // K of newcomers: 2, 4, 6: the third round finds 0 below the newcomer.
        assert_eq!(victims, [1, 2, 0, 3]);
    }

    #[test]
    fn pinned_frequent_and_rare_entries_stay() {
        let mut p = Lfu::default();
        for id in 1..=3 {
            p.insert(id, id, 1, 0);
        }
        p.access(3);
        assert_eq!(p.evict(&mut |id| id != 1), Some(2));
        assert_eq!(p.len(), 2);
        assert_eq!(p.evict(&mut |_| true), Some(1));
        p.remove(3);
        assert_eq!(p.evict(&mut |_| true), None);
        assert!(p.is_empty());
    }
}
