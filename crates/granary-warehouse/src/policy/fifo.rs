//! First in, first out: reads do not change the order.

use std::collections::{BTreeMap, HashMap};

use super::{EntryId, Policy};

#[derive(Default)]
pub struct Fifo {
    seq: u64,
    by_seq: BTreeMap<u64, EntryId>,
    seqs: HashMap<EntryId, u64>,
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn insert(&mut self, id: EntryId, _fingerprint: u64, _size: u64, _depth: u32) {
        self.seq += 1;
        if let Some(old) = self.seqs.insert(id, self.seq) {
            self.by_seq.remove(&old);
        }
        self.by_seq.insert(self.seq, id);
    }
    fn access(&mut self, _id: EntryId) {}
    fn remove(&mut self, id: EntryId) {
        if let Some(s) = self.seqs.remove(&id) {
            self.by_seq.remove(&s);
        }
    }
    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        let (&seq, &id) = self.by_seq.iter().find(|(_, id)| evictable(**id))?;
        self.by_seq.remove(&seq);
        self.seqs.remove(&id);
        Some(id)
    }
    fn len(&self) -> usize {
        self.seqs.len()
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
        assert_eq!(p.evict(&mut |_| true), Some(1));
        assert_eq!(p.evict(&mut |_| true), Some(2));
    }
}
