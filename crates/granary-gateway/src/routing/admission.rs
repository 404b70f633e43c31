//! Priority admission: when every upstream of a request is full, it waits;
//! freed capacity goes to premium waiters first, then standard, then
//! batch, first come first served within a tier.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::types::Priority;

struct Waiter {
    id: u64,
    notify: Arc<Notify>,
}

#[derive(Default)]
struct Queues {
    tiers: [VecDeque<Waiter>; 3],
    next_id: u64,
}

/// The queue of requests waiting for an upstream slot.
#[derive(Default)]
pub struct Admission {
    queues: Mutex<Queues>,
}

impl Admission {
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits until `try_take()` returns `Some` (retried each time capacity
    /// is released to this waiter) or `timeout` passes (`None`).
    pub async fn acquire<T>(
        &self,
        priority: Priority,
        timeout: Duration,
        mut try_take: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        let notify = Arc::new(Notify::new());
        let id = {
            let mut q = self.queues.lock();
            let id = q.next_id;
            q.next_id += 1;
            q.tiers[priority.rank()].push_back(Waiter { id, notify: notify.clone() });
            id
        };
        // Capacity may have been freed between the caller's failed try and
        // joining the queue.
        let deadline = Instant::now() + timeout;
        let mut got = try_take();
        while got.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !super::wait(&notify, left).await {
                break;
            }
            got = try_take();
        }
        let mut q = self.queues.lock();
        q.tiers[priority.rank()].retain(|w| w.id != id);
        drop(q);
        if got.is_none() {
            // A release meant for us may have arrived as we gave up: pass it on.
            self.released();
        }
        got
    }

    /// Capacity was released: wake the best waiter.
    pub fn released(&self) {
        let q = self.queues.lock();
        for tier in q.tiers.iter().rev() {
            if let Some(w) = tier.front() {
                w.notify.notify_one();
                return;
            }
        }
    }

    /// Requests waiting in a tier.
    pub fn waiting(&self, priority: Priority) -> usize {
        self.queues.lock().tiers[priority.rank()].len()
    }
}
