//! Offload lanes: the one path from the store to a lower tier.
//!
//! Every operation that reaches a lower tier — a copy, a synchronous or
//! durable write, a delete, an expiry, a stale-copy removal — goes through
//! the key's lane, so the tier applies one key's operations in the order
//! the store decided them (the store decides under the key's lock, see
//! `store.rs`). Each lower tier has [`LANES`] lanes, each drained in order
//! by one worker; a key always uses the same lane.
//!
//! Beside the queues, a map of *pending* keys (operations queued, not yet
//! applied) records what the tier will hold once they land. Reads consult
//! it before the tier, so they see the store's latest decision, not the
//! tier's older state: a queued copy is served from the map, a queued
//! delete hides the tier's copy.
//!
//! Copies are bounded (`queue_depth` per tier): a copy that finds the
//! queue full is dropped and counted, and replaced by a removal of any
//! older copy in the tier, so a dropped copy can never let an older value
//! be served later. Deletes, expiries and synchronous writes are never
//! dropped, and whoever waits for one gets its result.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::error::Result;
use crate::tier::Tier;
use crate::types::{now_ms, EntryMeta, Evicted};

/// Lanes per lower tier.
pub(crate) const LANES: usize = 4;

/// What an operation does in the tier.
pub(crate) enum Action {
    Put { value: Bytes, meta: EntryMeta },
    Remove,
    Expire { at: Option<u64> },
    RemoveNamespace,
}

/// What an operation found, for a caller that waits for it.
pub(crate) enum Outcome {
    /// The tier's evictions (the value itself among them if it did not fit).
    Put(Vec<Evicted>),
    /// Whether the key was there (remove, expire).
    Found(bool),
    /// Entries removed (namespace removal).
    Count(u64),
}

pub(crate) type Reply = oneshot::Sender<Result<Outcome>>;

pub(crate) struct Op {
    pub ns: String,
    pub key: Bytes,
    pub action: Action,
    pub reply: Option<Reply>,
    /// A bounded copy (counts against the queue depth).
    pub copy: bool,
}

/// What the tier will hold for a key once its queued operations land.
#[derive(Clone)]
pub(crate) enum Latest {
    Value(Bytes, EntryMeta),
    Removed,
    /// Only expiries are queued: the tier itself knows.
    Unknown,
}

impl Latest {
    /// The value, if the tier will hold a live one.
    pub fn live(&self) -> Option<(Bytes, EntryMeta)> {
        match self {
            Latest::Value(v, m) if !m.is_expired(now_ms()) => Some((v.clone(), *m)),
            _ => None,
        }
    }
}

struct Pending {
    ops: u32,
    latest: Latest,
}

#[derive(Default)]
struct State {
    pending: HashMap<(String, Bytes), Pending>,
    /// Copies queued and not yet applied.
    copies: usize,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub queued: AtomicU64,
    pub written: AtomicU64,
    pub dropped: AtomicU64,
    pub errors: AtomicU64,
    /// Operations of any kind queued and not yet applied.
    pub inflight: AtomicU64,
}

/// The lanes' shared state, also held by the workers.
pub(crate) struct Shared {
    state: Mutex<State>,
    pub c: Counters,
}

/// One lower tier and its lanes.
pub(crate) struct Lower {
    pub tier: Arc<dyn Tier>,
    lanes: Vec<mpsc::UnboundedSender<Op>>,
    depth: usize,
    pub shared: Arc<Shared>,
}

fn lane_of(key: &[u8], n: usize) -> usize {
    (xxhash_rust::xxh3::xxh3_64(key) as usize) % n
}

impl Lower {
    /// The lanes of `tier`, bounding queued copies to `depth`; the
    /// receivers are for the workers.
    pub fn new(tier: Arc<dyn Tier>, depth: usize) -> (Lower, Vec<mpsc::UnboundedReceiver<Op>>) {
        let (lanes, rxs) = (0..LANES).map(|_| mpsc::unbounded_channel()).unzip();
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), c: Counters::default() });
        (Lower { tier, lanes, depth: depth.max(1), shared }, rxs)
    }

    fn push(&self, st: &mut State, op: Op) {
        {
            let p = st
                .pending
                .entry((op.ns.clone(), op.key.clone()))
                .or_insert(Pending { ops: 0, latest: Latest::Unknown });
            p.ops += 1;
            p.latest = match (&op.action, &p.latest) {
                (Action::Put { value, meta }, _) => Latest::Value(value.clone(), *meta),
                (Action::Remove | Action::RemoveNamespace, _) => Latest::Removed,
                (Action::Expire { at }, Latest::Value(v, m)) => {
                    Latest::Value(v.clone(), EntryMeta { expires_at_ms: *at, ..*m })
                }
                (Action::Expire { .. }, other) => other.clone(),
            };
        }
        if op.copy {
            st.copies += 1;
        }
        self.shared.c.inflight.fetch_add(1, Relaxed);
        let lane = lane_of(&op.key, self.lanes.len());
        if let Err(mpsc::error::SendError(op)) = self.lanes[lane].send(op) {
            // The worker is gone (runtime shutting down): undo the bookkeeping.
            finish(&self.shared, &op.ns, &op.key, op.copy);
            if let Some(r) = op.reply {
                let _ = r.send(Err(crate::error::WarehouseError::Config("offload worker stopped".into())));
            }
        }
    }

    /// Queues an asynchronous copy; `false` when the queue was full and the
    /// copy was dropped (any older copy in the tier is then removed).
    /// Call with the key's lock held.
    pub fn offer_copy(&self, ns: &str, key: &Bytes, value: Bytes, meta: EntryMeta) -> bool {
        let mut st = self.shared.state.lock();
        if st.copies < self.depth {
            let op = Op {
                ns: ns.to_string(),
                key: key.clone(),
                action: Action::Put { value, meta },
                reply: None,
                copy: true,
            };
            self.push(&mut st, op);
            self.shared.c.queued.fetch_add(1, Relaxed);
            return true;
        }
        self.shared.c.dropped.fetch_add(1, Relaxed);
        self.invalidate_locked(&mut st, ns, key);
        false
    }

    /// Queues removal of any copy the tier holds or will hold (a stale copy
    /// after a newer write). Call with the key's lock held.
    pub fn invalidate(&self, ns: &str, key: &Bytes) {
        let mut st = self.shared.state.lock();
        self.invalidate_locked(&mut st, ns, key);
    }

    fn invalidate_locked(&self, st: &mut State, ns: &str, key: &Bytes) {
        let pending = st.pending.get(&(ns.to_string(), key.clone())).map(|p| p.latest.clone());
        let may_hold = match pending {
            Some(Latest::Removed) => false,
            Some(_) => true,
            None => self.tier.contains_local(ns, key) != Some(false),
        };
        if may_hold {
            self.push(
                st,
                Op { ns: ns.to_string(), key: key.clone(), action: Action::Remove, reply: None, copy: false },
            );
        }
    }

    /// Queues an operation whose outcome the caller awaits (never dropped).
    /// Call with the key's lock held; await the receiver after releasing it.
    pub fn submit(&self, ns: &str, key: &Bytes, action: Action) -> oneshot::Receiver<Result<Outcome>> {
        let (tx, rx) = oneshot::channel();
        let op = Op { ns: ns.to_string(), key: key.clone(), action, reply: Some(tx), copy: false };
        self.push(&mut self.shared.state.lock(), op);
        rx
    }

    /// Removes a namespace on every lane (after everything queued before).
    pub fn submit_namespace(&self, ns: &str) -> Vec<oneshot::Receiver<Result<Outcome>>> {
        let mut st = self.shared.state.lock();
        let mut out = Vec::new();
        for lane in &self.lanes {
            let (tx, rx) = oneshot::channel();
            // An empty key marks a namespace-wide operation.
            let op = Op {
                ns: ns.to_string(),
                key: Bytes::new(),
                action: Action::RemoveNamespace,
                reply: Some(tx),
                copy: false,
            };
            self.push_to(&mut st, lane, op);
            out.push(rx);
        }
        out
    }

    fn push_to(&self, st: &mut State, tx: &mpsc::UnboundedSender<Op>, op: Op) {
        // Every pending key of the namespace ends removed.
        for ((ns, _), p) in st.pending.iter_mut() {
            if *ns == op.ns {
                p.latest = Latest::Removed;
            }
        }
        self.shared.c.inflight.fetch_add(1, Relaxed);
        if let Err(mpsc::error::SendError(op)) = tx.send(op) {
            self.shared.c.inflight.fetch_sub(1, Relaxed);
            if let Some(r) = op.reply {
                let _ = r.send(Err(crate::error::WarehouseError::Config("offload worker stopped".into())));
            }
        }
    }

    /// What the tier will hold for a key once queued operations land;
    /// `None` when nothing is queued for it.
    pub fn latest(&self, ns: &str, key: &[u8]) -> Option<Latest> {
        let st = self.shared.state.lock();
        if st.pending.is_empty() {
            return None;
        }
        st.pending.get(&(ns.to_string(), Bytes::copy_from_slice(key))).map(|p| p.latest.clone())
    }

    /// Whether the tier holds (or will hold) a live copy of the key, as far
    /// as it can tell without I/O (`None`: only the tier can tell).
    pub fn holds_local(&self, ns: &str, key: &[u8]) -> Option<bool> {
        match self.latest(ns, key) {
            Some(Latest::Value(_, m)) => Some(!m.is_expired(now_ms())),
            Some(Latest::Removed) => Some(false),
            Some(Latest::Unknown) | None => self.tier.contains_local(ns, key),
        }
    }

    /// Whether every queued operation has been applied.
    pub fn idle(&self) -> bool {
        self.shared.c.inflight.load(Relaxed) == 0
    }
}

/// Bookkeeping after an operation was applied (or abandoned).
pub(crate) fn finish(shared: &Shared, ns: &str, key: &Bytes, copy: bool) {
    let mut st = shared.state.lock();
    if copy {
        st.copies = st.copies.saturating_sub(1);
    }
    if !key.is_empty() {
        let k = (ns.to_string(), key.clone());
        if let Some(p) = st.pending.get_mut(&k) {
            p.ops -= 1;
            if p.ops == 0 {
                st.pending.remove(&k);
            }
        }
    }
    drop(st);
    shared.c.inflight.fetch_sub(1, Relaxed);
}
