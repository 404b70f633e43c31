//! Entries ordered by (priority, last use), for the priority-based policies.
//!
//! LFU and the cost policy both evict the entry with the lowest priority and
//! break ties by least recent use. An ordered set of
//! `(priority, tick, id)` plus an id → key index gives O(log n) insert,
//! re-rank, remove and eviction; eviction walks past pinned entries in
//! priority order without disturbing them.

use std::collections::BTreeSet;

use super::{EntryId, IdMap};

/// Per-entry ranking state, plus policy data `M`.
#[derive(Clone, Copy)]
struct Rank<M> {
    prio: u64,
    tick: u64,
    meta: M,
}

pub(crate) struct Ranked<M> {
    order: BTreeSet<(u64, u64, EntryId)>,
    entries: IdMap<Rank<M>>,
    tick: u64,
}

impl<M> Default for Ranked<M> {
    fn default() -> Self {
        Ranked { order: BTreeSet::new(), entries: IdMap::default(), tick: 0 }
    }
}

impl<M: Copy> Ranked<M> {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn meta(&self, id: EntryId) -> Option<M> {
        self.entries.get(&id).map(|r| r.meta)
    }

    /// Sets `id`'s priority and data, and marks it as used now.
    pub(crate) fn set(&mut self, id: EntryId, prio: u64, meta: M) {
        self.tick += 1;
        let rank = Rank { prio, tick: self.tick, meta };
        if let Some(old) = self.entries.insert(id, rank) {
            self.order.remove(&(old.prio, old.tick, id));
        }
        self.order.insert((prio, self.tick, id));
    }

    pub(crate) fn remove(&mut self, id: EntryId) {
        if let Some(old) = self.entries.remove(&id) {
            self.order.remove(&(old.prio, old.tick, id));
        }
    }

    /// Takes the lowest-priority (then least recent) evictable entry and
    /// returns it with its priority.
    pub(crate) fn pop_min(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<(EntryId, u64)> {
        let &key = self.order.iter().find(|(_, _, id)| evictable(*id))?;
        self.order.remove(&key);
        self.entries.remove(&key.2);
        Some((key.2, key.0))
    }

    /// Ids from the next victim on, after checking both indexes agree.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Vec<EntryId> {
        assert_eq!(self.order.len(), self.entries.len(), "order and index differ in size");
        self.order
            .iter()
            .map(|&(prio, tick, id)| {
                let r = self.entries.get(&id).expect("ordered id missing from index");
                assert_eq!((r.prio, r.tick), (prio, tick), "stale rank for id {id}");
                assert!(tick <= self.tick);
                id
            })
            .collect()
    }
}
