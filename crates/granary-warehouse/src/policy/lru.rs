//! Least recently used.

use std::collections::{BTreeMap, HashMap};

use super::{EntryId, Policy};

/// LRU over a tick-ordered map: access moves an entry to the newest tick.
#[derive(Default)]
pub struct Lru {
    tick: u64,
    by_tick: BTreeMap<u64, EntryId>,
    ticks: HashMap<EntryId, u64>,
}

impl Lru {
    fn bump(&mut self, id: EntryId) {
        self.tick += 1;
        if let Some(old) = self.ticks.insert(id, self.tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, id);
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn insert(&mut self, id: EntryId, _fingerprint: u64, _size: u64, _depth: u32) {
        self.bump(id);
    }
    fn access(&mut self, id: EntryId) {
        if self.ticks.contains_key(&id) {
            self.bump(id);
        }
    }
    fn remove(&mut self, id: EntryId) {
        if let Some(t) = self.ticks.remove(&id) {
            self.by_tick.remove(&t);
        }
    }
    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        let (&tick, &id) = self.by_tick.iter().find(|(_, id)| evictable(**id))?;
        self.by_tick.remove(&tick);
        self.ticks.remove(&id);
        Some(id)
    }
    fn len(&self) -> usize {
        self.ticks.len()
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
}
