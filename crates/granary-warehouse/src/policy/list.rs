//! Doubly linked lists threaded through a slab, for O(1) queue policies.
//!
//! LRU, FIFO and S3-FIFO all keep entries in recency or arrival order and
//! need to unlink an arbitrary entry (on access or removal) in constant
//! time. A `BTreeMap` keyed by a tick gives O(log n); this gives O(1) with
//! no per-node allocation: nodes live in one `Vec`, are named by their
//! index (a slot), and freed slots are reused. Several lists may share one
//! slab (S3-FIFO keeps its small and main queues in the same slab), so a
//! node moves between lists without being reallocated.
//!
//! The head of a list is its newest end, the tail its oldest.

use super::{EntryId, IdMap};

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node<T> {
    prev: u32,
    next: u32,
    val: T,
}

/// Storage for nodes of one or more [`List`]s.
pub(crate) struct Slab<T> {
    nodes: Vec<Node<T>>,
    free: Vec<u32>,
}

impl<T: Copy> Default for Slab<T> {
    fn default() -> Self {
        Slab { nodes: Vec::new(), free: Vec::new() }
    }
}

impl<T: Copy> Slab<T> {
    /// Stores `val` in a fresh, unlinked node and returns its slot.
    pub(crate) fn alloc(&mut self, val: T) -> u32 {
        let node = Node { prev: NIL, next: NIL, val };
        match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                let slot = u32::try_from(self.nodes.len()).ok().filter(|&s| s != NIL).expect("slab full");
                self.nodes.push(node);
                slot
            }
        }
    }

    /// Returns an unlinked node's slot to the free list, with its value.
    pub(crate) fn release(&mut self, slot: u32) -> T {
        self.free.push(slot);
        self.nodes[slot as usize].val
    }

    pub(crate) fn get(&self, slot: u32) -> &T {
        &self.nodes[slot as usize].val
    }

    pub(crate) fn get_mut(&mut self, slot: u32) -> &mut T {
        &mut self.nodes[slot as usize].val
    }

    /// Nodes allocated and not released.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}

/// One list over a [`Slab`]: the head is the newest end, the tail the oldest.
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        List { head: NIL, tail: NIL, len: 0 }
    }
}

impl List {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The oldest node.
    pub(crate) fn tail(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The neighbour of `slot` on the head (newer) side; `slot` must be
    /// linked in this list. Walking from the tail with it visits entries
    /// oldest first.
    pub(crate) fn newer<T: Copy>(&self, slab: &Slab<T>, slot: u32) -> Option<u32> {
        let p = slab.nodes[slot as usize].prev;
        (p != NIL).then_some(p)
    }

    /// Links an unlinked node at the head (newest end).
    pub(crate) fn push_head<T: Copy>(&mut self, slab: &mut Slab<T>, slot: u32) {
        let old = self.head;
        {
            let n = &mut slab.nodes[slot as usize];
            n.prev = NIL;
            n.next = old;
        }
        if old == NIL {
            self.tail = slot;
        } else {
            slab.nodes[old as usize].prev = slot;
        }
        self.head = slot;
        self.len += 1;
    }

    /// Unlinks a node that is linked in this list.
    pub(crate) fn unlink<T: Copy>(&mut self, slab: &mut Slab<T>, slot: u32) {
        let Node { prev, next, .. } = slab.nodes[slot as usize];
        if prev == NIL {
            self.head = next;
        } else {
            slab.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            slab.nodes[next as usize].prev = prev;
        }
        let n = &mut slab.nodes[slot as usize];
        n.prev = NIL;
        n.next = NIL;
        self.len -= 1;
    }

    /// Moves a node of this list to its head.
    pub(crate) fn move_to_head<T: Copy>(&mut self, slab: &mut Slab<T>, slot: u32) {
        if self.head != slot {
            self.unlink(slab, slot);
            self.push_head(slab, slot);
        }
    }

    /// The slots from head (newest) to tail, checking every link on the way.
    #[cfg(test)]
    pub(crate) fn check<T: Copy>(&self, slab: &Slab<T>) -> Vec<u32> {
        let mut out = Vec::new();
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let n = &slab.nodes[cur as usize];
            assert_eq!(n.prev, prev, "broken back link at slot {cur}");
            assert!(!slab.free.contains(&cur), "freed slot {cur} still linked");
            out.push(cur);
            assert!(out.len() <= self.len, "list longer than its length (cycle?)");
            prev = cur;
            cur = n.next;
        }
        assert_eq!(self.tail, prev, "tail is not the last node");
        assert_eq!(out.len(), self.len, "length out of date");
        out
    }
}

/// Entry ids in one list with an id → slot index: the core of LRU and FIFO.
#[derive(Default)]
pub(crate) struct IdQueue {
    slab: Slab<EntryId>,
    list: List,
    slots: IdMap<u32>,
}

impl IdQueue {
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Adds `id` at the head; an id already present is moved there.
    pub(crate) fn push(&mut self, id: EntryId) {
        match self.slots.get(&id) {
            Some(&slot) => self.list.move_to_head(&mut self.slab, slot),
            None => {
                let slot = self.slab.alloc(id);
                self.list.push_head(&mut self.slab, slot);
                self.slots.insert(id, slot);
            }
        }
    }

    /// Moves `id` to the head if present.
    pub(crate) fn touch(&mut self, id: EntryId) {
        if let Some(&slot) = self.slots.get(&id) {
            self.list.move_to_head(&mut self.slab, slot);
        }
    }

    pub(crate) fn remove(&mut self, id: EntryId) {
        if let Some(slot) = self.slots.remove(&id) {
            self.list.unlink(&mut self.slab, slot);
            self.slab.release(slot);
        }
    }

    /// Takes the oldest id for which `evictable` is true; entries skipped
    /// keep their place.
    pub(crate) fn pop_oldest(&mut self, evictable: &mut dyn FnMut(EntryId) -> bool) -> Option<EntryId> {
        let mut cur = self.list.tail();
        while let Some(slot) = cur {
            let id = *self.slab.get(slot);
            if evictable(id) {
                self.list.unlink(&mut self.slab, slot);
                self.slab.release(slot);
                self.slots.remove(&id);
                return Some(id);
            }
            cur = self.list.newer(&self.slab, slot);
        }
        None
    }

    /// Ids from newest to oldest, after checking links and the index.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Vec<EntryId> {
        let order = self.list.check(&self.slab);
        assert_eq!(order.len(), self.slots.len());
        assert_eq!(self.slab.live(), self.slots.len());
        order
            .into_iter()
            .map(|slot| {
                let id = *self.slab.get(slot);
                assert_eq!(self.slots.get(&id), Some(&slot), "index disagrees with list for id {id}");
                id
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(l: &List, s: &Slab<u64>) -> Vec<u64> {
        l.check(s).into_iter().map(|i| *s.get(i)).collect()
    }

    #[test]
    fn push_unlink_move_and_reuse() {
        let mut s = Slab::default();
        let mut a = List::default();
        let mut b = List::default();
        let slots: Vec<u32> = (1..=4).map(|v| s.alloc(v)).collect();
        for &x in &slots {
            a.push_head(&mut s, x);
        }
        assert_eq!(vals(&a, &s), [4, 3, 2, 1]);
        a.move_to_head(&mut s, slots[0]);
        assert_eq!(vals(&a, &s), [1, 4, 3, 2]);
        assert_eq!(a.tail().map(|t| *s.get(t)), Some(2));
        assert_eq!(a.newer(&s, slots[2]).map(|t| *s.get(t)), Some(4));
        assert_eq!(a.newer(&s, slots[0]), None);
        // Move the tail to another list sharing the slab.
        a.unlink(&mut s, slots[1]);
        b.push_head(&mut s, slots[1]);
        assert_eq!(vals(&a, &s), [1, 4, 3]);
        assert_eq!(vals(&b, &s), [2]);
        b.unlink(&mut s, slots[1]);
        assert_eq!(s.release(slots[1]), 2);
        assert_eq!(b.tail(), None);
        assert_eq!(s.live(), 3);
        assert_eq!(s.alloc(9), slots[1], "freed slot is reused");
    }
}
