//! S3-FIFO: three FIFO queues that let one-hit wonders leave early.
//!
//! Most blocks of a KV cache are never read again (a conversation's unique
//! suffix); a few are read many times (system prompts, shared documents,
//! the turns of an ongoing chat). S3-FIFO (Yang et al., "FIFO queues are all
//! you need for cache eviction", SOSP'23) filters the first kind out quickly
//! with plain FIFO queues and no list update on reads:
//!
//! - **small** (S), about 10% of the capacity by bytes: new entries arrive
//!   here. When S is evicted from, its oldest entry moves to main if it was
//!   read while in S, and otherwise leaves the cache; its fingerprint is then
//!   remembered in the ghost queue.
//! - **main** (M), the rest of the capacity: FIFO with reinsertion. Its
//!   oldest entry, if read since it last passed the tail, goes back to the
//!   head with its counter decremented; otherwise it is the victim.
//! - **ghost** (G): fingerprints only (no data), FIFO, as many as main holds
//!   entries (main's byte share divided by the mean entry size). An entry
//!   whose fingerprint is in G was evicted from S too early: it is inserted
//!   straight into M.
//!
//! Reads only bump a 2-bit saturating counter (0..=3). Eviction picks S when
//! S holds at least its share of bytes (or M has nothing to give), else M.
//! Entries moving from S to M keep their counter.
//!
//! Pinned entries: a pinned entry at S's tail is in use, so it is treated as
//! read and moves to M; a pinned entry at M's tail goes back to M's head
//! with its counter unchanged. If a whole pass over M finds only pinned
//! entries, S is drained instead even below its share; if nothing is left,
//! `evict` returns `None`. Every step either shrinks S, lowers a counter or
//! (at most `|M|` times in a row) rotates a pinned entry, so `evict`
//! terminates; apart from pinned entries it is O(1) amortized, since each
//! counter decrement was paid for by a read.

use std::collections::HashMap;

use super::list::{List, Slab};
use super::{EntryId, IdMap, Policy};

/// Small queue share of the capacity, in percent.
const SMALL_PERCENT: u64 = 10;
/// Saturation value of the read counter (two bits).
const FREQ_CAP: u8 = 3;

#[derive(Clone, Copy)]
struct Node {
    id: EntryId,
    fingerprint: u64,
    size: u64,
    freq: u8,
    in_main: bool,
}

/// Fingerprints of entries recently evicted from the small queue.
#[derive(Default)]
struct Ghost {
    slab: Slab<u64>,
    list: List,
    index: HashMap<u64, u32>,
}

impl Ghost {
    /// Forgets `fp`; whether it was remembered.
    fn take(&mut self, fp: u64) -> bool {
        match self.index.remove(&fp) {
            Some(slot) => {
                self.list.unlink(&mut self.slab, slot);
                self.slab.release(slot);
                true
            }
            None => false,
        }
    }

    /// Remembers `fp` as the newest entry, keeping at most `cap`.
    fn push(&mut self, fp: u64, cap: usize) {
        match self.index.get(&fp) {
            Some(&slot) => self.list.move_to_head(&mut self.slab, slot),
            None => {
                let slot = self.slab.alloc(fp);
                self.list.push_head(&mut self.slab, slot);
                self.index.insert(fp, slot);
            }
        }
        while self.index.len() > cap {
            let Some(slot) = self.list.tail() else { break };
            self.list.unlink(&mut self.slab, slot);
            let old = self.slab.release(slot);
            self.index.remove(&old);
        }
    }
}

pub struct S3Fifo {
    /// Byte budget of the tier (0 = unbounded).
    capacity: u64,
    slab: Slab<Node>,
    small: List,
    main: List,
    slots: IdMap<u32>,
    small_bytes: u64,
    main_bytes: u64,
    ghost: Ghost,
}

impl S3Fifo {
    /// A policy for a tier of `capacity` bytes (0 = unbounded: the small
    /// queue's share then follows the bytes currently held).
    pub fn new(capacity: u64) -> Self {
        S3Fifo {
            capacity,
            slab: Slab::default(),
            small: List::default(),
            main: List::default(),
            slots: IdMap::default(),
            small_bytes: 0,
            main_bytes: 0,
            ghost: Ghost::default(),
        }
    }

    fn held(&self) -> u64 {
        self.small_bytes + self.main_bytes
    }

    fn small_target(&self) -> u64 {
        let base = if self.capacity == 0 { self.held() } else { self.capacity };
        (base * SMALL_PERCENT).div_ceil(100)
    }

    /// How many fingerprints the ghost keeps: as many entries as main holds
    /// when full, estimated from the mean size of the entries held now.
    fn ghost_cap(&self) -> usize {
        let n = self.slots.len() as u64;
        if self.capacity == 0 || n == 0 {
            return self.main.len().max(1);
        }
        let mean = (self.held() / n).max(1);
        let main_share = self.capacity.saturating_sub(self.small_target());
        usize::try_from(main_share / mean).unwrap_or(usize::MAX).max(1)
    }

    /// Moves the entry at `slot` from small to the head of main.
    fn promote(&mut self, slot: u32) {
        self.small.unlink(&mut self.slab, slot);
        self.main.push_head(&mut self.slab, slot);
        let n = self.slab.get_mut(slot);
        n.in_main = true;
        let size = n.size;
        self.small_bytes -= size;
        self.main_bytes += size;
    }

    /// Unlinks and frees the entry at `slot`, from whichever queue holds it.
    fn drop_slot(&mut self, slot: u32) -> Node {
        let n = *self.slab.get(slot);
        if n.in_main {
            self.main.unlink(&mut self.slab, slot);
            self.main_bytes -= n.size;
        } else {
            self.small.unlink(&mut self.slab, slot);
            self.small_bytes -= n.size;
        }
        self.slab.release(slot);
        self.slots.remove(&n.id);
        n
    }

    /// Where `id` is: `Some(true)` in main, `Some(false)` in small.
    pub fn in_main(&self, id: EntryId) -> Option<bool> {
        self.slots.get(&id).map(|&s| self.slab.get(s).in_main)
    }

    /// Whether the ghost queue remembers `fingerprint`.
    pub fn in_ghost(&self, fingerprint: u64) -> bool {
        self.ghost.index.contains_key(&fingerprint)
    }
}

impl Policy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn insert(&mut self, id: EntryId, fingerprint: u64, size: u64, _depth: u32) {
        self.remove(id);
        let in_main = self.ghost.take(fingerprint);
        let slot = self.slab.alloc(Node { id, fingerprint, size, freq: 0, in_main });
        if in_main {
            self.main.push_head(&mut self.slab, slot);
            self.main_bytes += size;
        } else {
            self.small.push_head(&mut self.slab, slot);
            self.small_bytes += size;
        }
        self.slots.insert(id, slot);
    }

    fn access(&mut self, id: EntryId) {
        if let Some(&slot) = self.slots.get(&id) {
            let n = self.slab.get_mut(slot);
            n.freq = (n.freq + 1).min(FREQ_CAP);
        }
    }

    fn remove(&mut self, id: EntryId) {
        if let Some(&slot) = self.slots.get(&id) {
            self.drop_slot(slot);
        }
    }

    fn evict(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        // Pinned entries rotated at main's tail since the last progress.
        let mut pinned_run = 0usize;
        loop {
            let main_blocked = pinned_run >= self.main.len();
            if let Some(slot) = self.small.tail() {
                if main_blocked || self.small_bytes >= self.small_target() {
                    let n = *self.slab.get(slot);
                    if n.freq > 0 || !evictable(n.id) {
                        self.promote(slot);
                        continue;
                    }
                    self.drop_slot(slot);
                    let cap = self.ghost_cap();
                    self.ghost.push(n.fingerprint, cap);
                    return Some(n.id);
                }
            }
            if main_blocked {
                return None;
            }
            let slot = self.main.tail()?;
            let n = self.slab.get(slot);
            let (id, freq) = (n.id, n.freq);
            if !evictable(id) {
                self.main.move_to_head(&mut self.slab, slot);
                pinned_run += 1;
            } else if freq > 0 {
                self.slab.get_mut(slot).freq = freq - 1;
                self.main.move_to_head(&mut self.slab, slot);
                pinned_run = 0;
            } else {
                self.drop_slot(slot);
                return Some(id);
            }
        }
    }

    fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
impl super::Check for S3Fifo {
    fn check(&self) {
        let mut seen = 0;
        for (list, main, bytes) in [(&self.small, false, self.small_bytes), (&self.main, true, self.main_bytes)] {
            let slots = list.check(&self.slab);
            let mut sum = 0;
            for slot in &slots {
                let n = self.slab.get(*slot);
                assert_eq!(n.in_main, main, "id {} in the wrong queue", n.id);
                assert!(n.freq <= FREQ_CAP);
                assert_eq!(self.slots.get(&n.id), Some(slot), "index disagrees for id {}", n.id);
                sum += n.size;
            }
            assert_eq!(sum, bytes, "byte count of a queue is off");
            seen += slots.len();
        }
        assert_eq!(seen, self.slots.len());
        assert_eq!(self.slab.live(), seen);
        let ghost = self.ghost.list.check(&self.ghost.slab);
        assert_eq!(ghost.len(), self.ghost.index.len());
        for slot in ghost {
            assert_eq!(self.ghost.index.get(self.ghost.slab.get(slot)), Some(&slot));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Check;
    use super::*;

    /// A policy for 100 entries of size 1: small holds 10.
    fn hundred() -> S3Fifo {
        S3Fifo::new(100)
    }

    /// Inserts like a tier would: evicting first while full.
    fn put(p: &mut S3Fifo, id: EntryId, fp: u64) -> Vec<EntryId> {
        let mut out = Vec::new();
        while p.held() + 1 > 100 {
            out.push(p.evict(&mut |_| true).expect("something to evict"));
        }
        p.insert(id, fp, 1, 0);
        p.check();
        out
    }

    #[test]
    fn one_hit_wonders_leave_through_small() {
        let mut p = hundred();
        // Fill with 100 entries read once each: they all reach main.
        for id in 0..100 {
            put(&mut p, id, id);
            p.access(id);
        }
        let mut victims = Vec::new();
        for id in 1000..1100 {
            victims.extend(put(&mut p, id, id));
        }
        // 100 one-hit wonders arrived: the first 10 displaced main entries
        // (small was empty), after that every victim came from small.
        assert_eq!(victims.len(), 100);
        assert!(victims[..10].iter().all(|&v| v < 100), "{victims:?}");
        assert_eq!(victims[10..], (1000..1090).collect::<Vec<_>>()[..]);
        assert_eq!(p.main.len(), 90);
        assert!((10..100).all(|id| p.in_main(id) == Some(true)));
        assert!((1000..1090).all(|fp| p.in_ghost(fp)));
        assert!((0..100).all(|fp| !p.in_ghost(fp)), "main victims do not go to the ghost");
    }

    #[test]
    fn read_entries_move_from_small_to_main() {
        let mut p = hundred();
        for id in 0..100 {
            put(&mut p, id, id);
        }
        p.access(5);
        // Small is over its share: evicting walks S, promoting 5.
        let v: Vec<_> = (0..10).map(|_| p.evict(&mut |_| true).unwrap()).collect();
        assert_eq!(v, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]);
        assert_eq!(p.in_main(5), Some(true));
        p.check();
    }

    #[test]
    fn ghost_hits_go_straight_to_main() {
        let mut p = hundred();
        for id in 0..100 {
            put(&mut p, id, 500 + id);
        }
        assert_eq!(put(&mut p, 100, 600), [0]);
        assert!(p.in_ghost(500));
        // Key 500 comes back under a new entry id.
        assert_eq!(put(&mut p, 101, 500), [1]);
        assert_eq!(p.in_main(101), Some(true));
        assert!(!p.in_ghost(500), "a ghost hit is consumed");
        assert_eq!(p.in_main(100), Some(false));
    }

    #[test]
    fn main_reinserts_read_entries_and_decrements() {
        let mut p = S3Fifo::new(10);
        for id in 0..3 {
            // Ghost hits, so these go straight to main.
            p.ghost.push(id, 100);
            p.insert(id, id, 1, 0);
        }
        for _ in 0..5 {
            p.access(0); // saturates at 3
        }
        p.access(1);
        p.check();
        let order: Vec<_> = std::iter::from_fn(|| p.evict(&mut |_| true)).collect();
        assert_eq!(order, [2, 1, 0]);
    }

    #[test]
    fn pinned_entries_are_kept_and_none_when_all_pinned() {
        let mut p = hundred();
        for id in 0..20 {
            put(&mut p, id, id);
        }
        for id in 10..20 {
            p.access(id);
        }
        // Small holds 20 (> 10): 0 is pinned and moves to main, 1 is next.
        assert_eq!(p.evict(&mut |id| id != 0), Some(1));
        assert_eq!(p.in_main(0), Some(true));
        assert_eq!(p.evict(&mut |_| false), None);
        assert_eq!(p.len(), 19);
        p.check();
        // Only 7 is unpinned: whatever the queues, it is found.
        assert_eq!(p.evict(&mut |id| id == 7), Some(7));
        assert_eq!(p.evict(&mut |id| id == 15), Some(15));
        assert_eq!(p.len(), 17);
        p.remove(0);
        p.remove(0);
        assert_eq!(p.len(), 16);
        p.check();
    }
}
