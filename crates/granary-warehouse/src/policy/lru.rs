//! Least recently used: the baseline every other policy is measured against.
//!
//! Entries sit in one recency list ([`super::list::IdQueue`]); insert and
//! access move an entry to the newest end and eviction takes the oldest
//! entry that is not pinned. Every operation is O(1) except that `evict`
//! also walks past the pinned entries at the old end (O(1 + pinned skipped)).

use super::list::IdQueue;
use super::{EntryId, Policy};

#[derive(Default)]
pub struct Lru {
    queue: IdQueue,
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn insert(&mut self, id: EntryId, _fingerprint: u64, _size: u64, _depth: u32) {
        self.queue.push(id);
    }
    fn access(&mut self, id: EntryId) {
        self.queue.touch(id);
    }
    fn remove(&mut self, id: EntryId) {
        self.queue.remove(id);
    }
    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        self.queue.pop_oldest(evictable)
    }
    fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
impl super::Check for Lru {
    fn check(&self) {
        self.queue.check();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent_and_skips_pinned() {
        let mut p = Lru::default();
        for id in 1..=3 {
            p.insert(id, id, 10, 0);
        }
        p.access(1);
        assert_eq!(p.evict(&mut |_| true), Some(2));
        assert_eq!(p.evict(&mut |id| id != 3), Some(1));
        assert_eq!(p.len(), 1);
        assert_eq!(p.evict(&mut |_| false), None);
        p.remove(3);
        assert!(p.is_empty());
    }

    #[test]
    fn order_follows_recency() {
        let mut p = Lru::default();
        for id in 1..=5 {
            p.insert(id, id, 1, 0);
        }
        // Recency, oldest first: 1 2 3 4 5 → 2 4 5 3 1
        p.access(3);
        p.access(1);
        p.access(99); // unknown ids are ignored
        assert_eq!(p.queue.check(), [1, 3, 5, 4, 2]);
        let order: Vec<_> = std::iter::from_fn(|| p.evict(&mut |_| true)).collect();
        assert_eq!(order, [2, 4, 5, 3, 1]);
    }

    #[test]
    fn pinned_entry_keeps_its_place() {
        let mut p = Lru::default();
        for id in 1..=3 {
            p.insert(id, id, 1, 0);
        }
        assert_eq!(p.evict(&mut |id| id != 1), Some(2));
        // Once unpinned, 1 is still the oldest.
        assert_eq!(p.evict(&mut |_| true), Some(1));
        assert_eq!(p.evict(&mut |_| true), Some(3));
        assert_eq!(p.evict(&mut |_| true), None);
    }
}
