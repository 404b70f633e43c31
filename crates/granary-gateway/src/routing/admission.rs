//! Priority admission: when every upstream of a request is full, it waits;
//! freed capacity goes to premium waiters first, then standard, then
//! batch, first come first served within a tier.
//!
//! Each waiter names the upstreams it can use (its model's candidates), and
//! capacity freed on an upstream is offered only to waiters that can use it
//! and handed over directly ([`Admission::offer`]): a waiter for another
//! model is never woken for it, and a wake-up is never spent on a waiter
//! that then finds nothing.

use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::types::Priority;

struct Waiter<T> {
    id: u64,
    /// The resources (upstream ids) it can use.
    wants: Vec<usize>,
    /// The slot, with the resource it is on.
    tx: oneshot::Sender<(usize, T)>,
}

struct Queues<T> {
    tiers: [VecDeque<Waiter<T>>; 3],
    next_id: u64,
}

/// The queue of requests waiting for a slot, `T` being the slot.
pub struct Admission<T> {
    queues: Mutex<Queues<T>>,
}

impl<T> Default for Admission<T> {
    fn default() -> Self {
        Admission { queues: Mutex::new(Queues { tiers: Default::default(), next_id: 0 }) }
    }
}

/// Takes a waiter out of the queue when its `acquire` ends in any way,
/// cancellation included; a slot handed over that it did not take (it gave
/// up, or was cancelled, as the slot came) goes on to the next waiter.
struct Leave<'a, T> {
    adm: &'a Admission<T>,
    priority: Priority,
    id: u64,
    rx: oneshot::Receiver<(usize, T)>,
    taken: bool,
}

impl<T> Drop for Leave<'_, T> {
    fn drop(&mut self) {
        self.adm.queues.lock().tiers[self.priority.rank()].retain(|w| w.id != self.id);
        if !self.taken {
            if let Ok((resource, t)) = self.rx.try_recv() {
                self.adm.offer(resource, move || Some(t));
            }
        }
    }
}

impl<T> Admission<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a slot with `try_take` now, or waits (up to `timeout`) for one
    /// on any of `wants` to be handed over by [`offer`](Self::offer).
    pub async fn acquire(
        &self,
        priority: Priority,
        wants: &[usize],
        timeout: Duration,
        try_take: impl FnOnce() -> Option<T>,
    ) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        let id = {
            // Trying under the lock: capacity freed before this point is
            // seen here; freed after, its offer finds this waiter queued.
            let mut q = self.queues.lock();
            if let Some(t) = try_take() {
                return Some(t);
            }
            let id = q.next_id;
            q.next_id += 1;
            q.tiers[priority.rank()].push_back(Waiter { id, wants: wants.to_vec(), tx });
            id
        };
        let mut leave = Leave { adm: self, priority, id, rx, taken: false };
        match tokio::time::timeout(timeout, &mut leave.rx).await {
            Ok(Ok((_, t))) => {
                leave.taken = true;
                Some(t)
            }
            _ => None,
        }
    }

    /// Capacity was freed on `resource`: the best waiter that can use it
    /// gets the slot `take` makes (nothing happens when nobody waits for it,
    /// or when `take` finds the capacity already gone). A waiter that went
    /// away meanwhile passes it to the next.
    pub fn offer(&self, resource: usize, take: impl FnOnce() -> Option<T>) {
        let mut q = self.queues.lock();
        let Some(mut t) = Self::has_waiter(&q, resource).then(take).flatten() else { return };
        loop {
            let Some(w) = Self::pop(&mut q, resource) else {
                drop(q);
                // Nobody left to take it: dropped (outside the lock), the
                // capacity returns.
                drop(t);
                return;
            };
            match w.tx.send((resource, t)) {
                Ok(()) => return,
                Err((_, back)) => t = back,
            }
        }
    }

    fn has_waiter(q: &Queues<T>, resource: usize) -> bool {
        q.tiers.iter().any(|tier| tier.iter().any(|w| w.wants.contains(&resource)))
    }

    fn pop(q: &mut Queues<T>, resource: usize) -> Option<Waiter<T>> {
        for tier in q.tiers.iter_mut().rev() {
            if let Some(i) = tier.iter().position(|w| w.wants.contains(&resource)) {
                return tier.remove(i);
            }
        }
        None
    }

    /// Requests waiting in a tier.
    pub fn waiting(&self, priority: Priority) -> usize {
        self.queues.lock().tiers[priority.rank()].len()
    }

    /// Requests waiting (any tier) that could use one of `resources`.
    pub fn waiting_for(&self, resources: &[usize]) -> usize {
        let q = self.queues.lock();
        q.tiers.iter().flatten().filter(|w| w.wants.iter().any(|r| resources.contains(r))).count()
    }
}
