//! First in, first out: reads do not change the order.
//!
//! The simplest policy and the building block of S3-FIFO; kept as its own
//! policy because it costs nothing on the read path (no list update under
//! the shard lock). O(1) per operation, plus the pinned entries `evict`
//! walks past at the old end.

use super::list::IdQueue;
use super::{EntryId, Policy};

#[derive(Default)]
pub struct Fifo {
    queue: IdQueue,
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn insert(&mut self, id: EntryId, _fingerprint: u64, _size: u64, _depth: u32) {
        // A re-inserted id is a new arrival: remove, then push at the head.
        self.queue.remove(id);
        self.queue.push(id);
    }
    fn access(&mut self, _id: EntryId) {}
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
impl super::Check for Fifo {
    fn check(&self) {
        self.queue.check();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_does_not_reorder() {
        let mut p = Fifo::default();
        for id in 1..=3 {
            p.insert(id, id, 1, 0);
        }
        p.access(1);
        p.access(1);
        assert_eq!(p.evict(&mut |_| true), Some(1));
        assert_eq!(p.evict(&mut |_| true), Some(2));
    }

    #[test]
    fn skips_pinned_and_removes() {
        let mut p = Fifo::default();
        for id in 1..=4 {
            p.insert(id, id, 1, 0);
        }
        p.remove(2);
        assert_eq!(p.len(), 3);
        assert_eq!(p.evict(&mut |id| id != 1), Some(3));
        assert_eq!(p.evict(&mut |_| true), Some(1));
        assert_eq!(p.evict(&mut |_| true), Some(4));
        assert!(p.is_empty());
    }
}
