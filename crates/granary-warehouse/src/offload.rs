//! Offload lanes: the one path from the store to a lower tier.
//!
//! Every operation that reaches a lower tier — a copy, a synchronous or
//! durable write, a delete, an expiry, a stale-copy removal — goes through
//! the key's lane, so the tier applies one key's operations in the order
//! the store decided them (the store decides under the key's lock, see
//! `store/mod.rs`). Each lower tier has [`LANES`] lanes, each drained in order
//! by one worker (`store/lanes.rs`); a key always uses the same lane.
//!
//! Beside the queues, a map of *pending* keys (operations queued, not yet
//! applied) records what the tier will hold once they land. Reads consult
//! it before the tier, so they see the store's latest decision, not the
//! tier's older state: a queued copy is served from the map, a queued
//! delete hides the tier's copy.
//!
//! Each lane keeps its own pending map under its own lock, so writers of
//! keys in different lanes do not contend.
//!
//! Copies are bounded (`queue_depth` per tier, split among the lanes): a
//! copy that finds its lane full is dropped and counted, and replaced by a removal of any
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
    Put {
        value: Bytes,
        meta: EntryMeta,
    },
    Remove,
    Expire {
        at: Option<u64>,
    },
    /// One of a namespace removal's operations, one on every lane of the
    /// tier (see [`NamespaceRemoval`]).
    RemoveNamespace(Arc<NamespaceRemoval>),
}

/// A namespace removal across a tier's lanes. The tier removes the whole
/// namespace at once, so it must happen when every lane has applied what
/// was queued before it and none has applied anything queued after: each
/// lane waits at the first barrier, one of them (the leader) removes, and
/// all wait at the second barrier before going on. Without it a lane that
/// got there last removed values other lanes had stored after theirs.
pub(crate) struct NamespaceRemoval {
    pub arrived: tokio::sync::Barrier,
    pub done: tokio::sync::Barrier,
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

/// The counters of a tier's lanes, also held by the workers.
pub(crate) struct Shared {
    pub c: Counters,
}

/// One lane's bookkeeping, also held by its worker.
#[derive(Default)]
pub(crate) struct LaneState(Mutex<State>);

struct Lane {
    tx: mpsc::UnboundedSender<Op>,
    state: Arc<LaneState>,
}

/// One lower tier and its lanes.
pub(crate) struct Lower {
    pub tier: Arc<dyn Tier>,
    lanes: Vec<Lane>,
    /// Most copies queued per lane.
    depth: usize,
    pub shared: Arc<Shared>,
    /// Whether the tier announces its own events (else the store does).
    pub announces: bool,
}

/// A worker's end of one lane.
pub(crate) type LaneEnd = (mpsc::UnboundedReceiver<Op>, Arc<LaneState>);

fn lane_of(key: &[u8], n: usize) -> usize {
    (xxhash_rust::xxh3::xxh3_64(key) as usize) % n
}

fn worker_gone(reply: Option<Reply>) {
    if let Some(r) = reply {
        let _ = r.send(Err(crate::error::WarehouseError::Config("offload worker stopped".into())));
    }
}

impl Lower {
    /// The lanes of `tier`, bounding queued copies to about `depth`; the
    /// lane ends are for the workers.
    pub fn new(tier: Arc<dyn Tier>, depth: usize, announces: bool) -> (Lower, Vec<LaneEnd>) {
        let mut lanes = Vec::with_capacity(LANES);
        let mut ends = Vec::with_capacity(LANES);
        for _ in 0..LANES {
            let (tx, rx) = mpsc::unbounded_channel();
            let state = Arc::new(LaneState::default());
            lanes.push(Lane { tx, state: state.clone() });
            ends.push((rx, state));
        }
        let shared = Arc::new(Shared { c: Counters::default() });
        (Lower { tier, lanes, depth: (depth / LANES).max(1), shared, announces }, ends)
    }

    fn lane(&self, key: &[u8]) -> &Lane {
        &self.lanes[lane_of(key, self.lanes.len())]
    }

    /// Queues an operation on a key's lane; `st` is that lane's state.
    fn push(&self, lane: &Lane, st: &mut State, op: Op) {
        let p =
            st.pending.entry((op.ns.clone(), op.key.clone())).or_insert(Pending { ops: 0, latest: Latest::Unknown });
        p.ops += 1;
        p.latest = match (&op.action, &p.latest) {
            (Action::Put { value, meta }, _) => Latest::Value(value.clone(), *meta),
            (Action::Remove | Action::RemoveNamespace(_), _) => Latest::Removed,
            (Action::Expire { at }, Latest::Value(v, m)) => {
                Latest::Value(v.clone(), EntryMeta { expires_at_ms: *at, ..*m })
            }
            (Action::Expire { .. }, other) => other.clone(),
        };
        if op.copy {
            st.copies += 1;
        }
        self.shared.c.inflight.fetch_add(1, Relaxed);
        if let Err(mpsc::error::SendError(op)) = lane.tx.send(op) {
            // The worker is gone (runtime shutting down): undo the bookkeeping.
            finish_locked(st, &self.shared, &op.ns, Some(&op.key), op.copy);
            worker_gone(op.reply);
        }
    }

    /// Queues an asynchronous copy; `false` when the lane was full and the
    /// copy was dropped (any older copy in the tier is then removed).
    /// Call with the key's lock held.
    pub fn offer_copy(&self, ns: &str, key: &Bytes, value: Bytes, meta: EntryMeta) -> bool {
        let lane = self.lane(key);
        let mut st = lane.state.0.lock();
        if st.copies < self.depth {
            let op = Op {
                ns: ns.to_string(),
                key: key.clone(),
                action: Action::Put { value, meta },
                reply: None,
                copy: true,
            };
            self.push(lane, &mut st, op);
            self.shared.c.queued.fetch_add(1, Relaxed);
            return true;
        }
        self.shared.c.dropped.fetch_add(1, Relaxed);
        self.invalidate_locked(lane, &mut st, ns, key);
        false
    }

    /// Queues removal of any copy the tier holds or will hold (a stale copy
    /// after a newer write). Call with the key's lock held.
    pub fn invalidate(&self, ns: &str, key: &Bytes) {
        let lane = self.lane(key);
        let mut st = lane.state.0.lock();
        self.invalidate_locked(lane, &mut st, ns, key);
    }

    fn invalidate_locked(&self, lane: &Lane, st: &mut State, ns: &str, key: &Bytes) {
        let pending = st.pending.get(&(ns.to_string(), key.clone())).map(|p| p.latest.clone());
        let may_hold = match pending {
            Some(Latest::Removed) => false,
            Some(_) => true,
            None => self.tier.contains_local(ns, key) != Some(false),
        };
        if may_hold {
            let op = Op { ns: ns.to_string(), key: key.clone(), action: Action::Remove, reply: None, copy: false };
            self.push(lane, st, op);
        }
    }

    /// Queues an operation whose outcome the caller awaits (never dropped).
    /// Call with the key's lock held; await the receiver after releasing it.
    pub fn submit(&self, ns: &str, key: &Bytes, action: Action) -> oneshot::Receiver<Result<Outcome>> {
        let (tx, rx) = oneshot::channel();
        let op = Op { ns: ns.to_string(), key: key.clone(), action, reply: Some(tx), copy: false };
        let lane = self.lane(key);
        self.push(lane, &mut lane.state.0.lock(), op);
        rx
    }

    /// Removes a namespace on every lane (after everything queued before).
    pub fn submit_namespace(&self, ns: &str) -> Vec<oneshot::Receiver<Result<Outcome>>> {
        let mut out = Vec::with_capacity(self.lanes.len());
        let removal = Arc::new(NamespaceRemoval {
            arrived: tokio::sync::Barrier::new(self.lanes.len()),
            done: tokio::sync::Barrier::new(self.lanes.len()),
        });
        for lane in &self.lanes {
            let mut st = lane.state.0.lock();
            // Every pending key of the namespace ends removed.
            for ((pns, _), p) in st.pending.iter_mut() {
                if pns == ns {
                    p.latest = Latest::Removed;
                }
            }
            let (tx, rx) = oneshot::channel();
            // A namespace-wide operation: not in the pending map, its key unused.
            let op = Op {
                ns: ns.to_string(),
                key: Bytes::new(),
                action: Action::RemoveNamespace(removal.clone()),
                reply: Some(tx),
                copy: false,
            };
            self.shared.c.inflight.fetch_add(1, Relaxed);
            if let Err(mpsc::error::SendError(op)) = lane.tx.send(op) {
                self.shared.c.inflight.fetch_sub(1, Relaxed);
                worker_gone(op.reply);
            }
            out.push(rx);
        }
        out
    }

    /// What the tier will hold for a key once queued operations land;
    /// `None` when nothing is queued for it.
    pub fn latest(&self, ns: &str, key: &[u8]) -> Option<Latest> {
        let st = self.lane(key).state.0.lock();
        if st.pending.is_empty() {
            return None;
        }
        st.pending.get(&(ns.to_string(), Bytes::copy_from_slice(key))).map(|p| p.latest.clone())
    }

    /// The keys of `ns` whose queued operations have not landed, with scan
    /// hash at least `cursor`: those that will hold a live value, and those
    /// that will be gone. A scan of the tier alone misses the first (a value
    /// on its way down from memory is in neither) and lists the second.
    pub fn pending_keys(&self, ns: &str, cursor: u64) -> (Vec<Bytes>, Vec<Bytes>) {
        let (mut live, mut gone) = (Vec::new(), Vec::new());
        let now = now_ms();
        for lane in &self.lanes {
            let st = lane.state.0.lock();
            for ((pns, key), p) in &st.pending {
                if pns != ns || crate::types::scan_hash(key) < cursor {
                    continue;
                }
                match &p.latest {
                    Latest::Value(_, m) if !m.is_expired(now) => live.push(key.clone()),
                    Latest::Value(..) | Latest::Removed => gone.push(key.clone()),
                    Latest::Unknown => {}
                }
            }
        }
        (live, gone)
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

/// Bookkeeping after a worker applied an operation of its lane.
/// `key` is `None` for a namespace-wide operation (the empty key is a key).
pub(crate) fn finish(lane: &LaneState, shared: &Shared, ns: &str, key: Option<&Bytes>, copy: bool) {
    finish_locked(&mut lane.0.lock(), shared, ns, key, copy);
}

fn finish_locked(st: &mut State, shared: &Shared, ns: &str, key: Option<&Bytes>, copy: bool) {
    if copy {
        st.copies = st.copies.saturating_sub(1);
    }
    if let Some(key) = key {
        let k = (ns.to_string(), key.clone());
        if let Some(p) = st.pending.get_mut(&k) {
            p.ops -= 1;
            if p.ops == 0 {
                st.pending.remove(&k);
            }
        }
    }
    shared.c.inflight.fetch_sub(1, Relaxed);
}
