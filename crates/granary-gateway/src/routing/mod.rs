//! Routing: which upstream of a pool gets a request.
//!
//! Every policy implements [`Policy`]: given the request (its tenant
//! namespace, session, and the hash chain of its prompt blocks) and the
//! routable candidates, rank them best first. The proxy tries them in that
//! order. Policies are chosen per pool: `round_robin`, `least_load`,
//! `session` (affinity by a header) and `kv_aware` (most prefix blocks
//! held, minus a load penalty).
//!
//! [`KvIndex`] holds what engines' KV events say they hold; engines that
//! publish no events are tracked approximately, from where the gateway sent
//! earlier prompts. [`Admission`] queues requests by priority when every
//! upstream is full; [`PoolSelector`] orders weighted pools.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use granary_core::hash::BlockHash;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::types::Priority;

mod admission;
#[cfg(test)]
mod tests;
pub mod vllm;

pub use admission::Admission;

/// One upstream as a policy sees it at the moment of the decision.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The upstream's id (never reused, also after it leaves the set).
    pub index: usize,
    /// Requests in flight.
    pub active: usize,
    /// Most requests in flight (0: unbounded).
    pub max_active: usize,
    /// Whether its KV events feed the index (else it is tracked approximately).
    pub publishes_events: bool,
}

/// An upstream's identity for session affinity, from its `index`: a hash of
/// its name, the same on every gateway replica (unlike `index`, which is
/// this process's). `None`: the index itself.
pub type AffinityOf = Arc<dyn Fn(usize) -> Option<u64> + Send + Sync>;

impl Candidate {
    fn full(&self) -> bool {
        self.max_active > 0 && self.active >= self.max_active
    }

    /// Load relative to capacity when bounded, else requests in flight.
    fn load(&self) -> f64 {
        if self.max_active > 0 {
            self.active as f64 / self.max_active as f64
        } else {
            self.active as f64
        }
    }
}

/// What a policy knows about a request.
pub struct RouteRequest<'a> {
    pub namespace: &'a str,
    /// The session header's value, for `session` pools.
    pub session: Option<&'a str>,
    /// The prompt's block hashes (empty when the tokenizer or layout is not known).
    pub blocks: &'a [BlockHash],
    /// The prompt's blocks as some upstreams name them, where that differs
    /// from `blocks` (third-party engines: [`vllm::third_party_chain`]).
    pub by_upstream: &'a [(usize, Arc<[BlockHash]>)],
}

impl RouteRequest<'_> {
    /// The prompt's blocks as `upstream` names them.
    pub fn blocks_for(&self, upstream: usize) -> &[BlockHash] {
        match self.by_upstream.iter().find(|(u, _)| *u == upstream) {
            Some((_, b)) => b,
            None => self.blocks,
        }
    }
}

/// A routing policy.
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Every candidate's `index`, best first (none dropped).
    fn rank(&self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> Vec<usize>;
    /// The request was sent to `upstream` (feeds approximate indexes).
    fn routed(&self, req: &RouteRequest<'_>, upstream: usize) {
        let _ = (req, upstream);
    }
    /// The upstream left the set: drop what is remembered of it.
    fn forget(&self, upstream: usize) {
        let _ = upstream;
    }
}

fn default_session_header() -> String {
    "x-session-id".into()
}

fn default_load_penalty() -> f64 {
    1.0
}

fn default_approx_capacity() -> usize {
    1_000_000
}

/// A pool's policy in the configuration (`routing = { policy = "kv_aware" }`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, Default)]
#[serde(tag = "policy", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    RoundRobin,
    #[default]
    LeastLoad,
    Session {
        #[serde(default = "default_session_header")]
        header: String,
    },
    KvAware {
        /// Blocks of prefix one request in flight is worth: a candidate's
        /// score is matched blocks − `load_penalty` × requests in flight.
        #[serde(default = "default_load_penalty")]
        load_penalty: f64,
        /// Blocks remembered per upstream that publishes no KV events
        /// (0: the default, 1,000,000).
        #[serde(default)]
        approx_capacity_blocks: usize,
    },
}

impl PolicyConfig {
    pub fn session_header(&self) -> Option<&str> {
        match self {
            PolicyConfig::Session { header } => Some(header),
            _ => None,
        }
    }
}

/// The policy a configuration names, sharing the gateway's [`KvIndex`].
pub fn build_policy(cfg: &PolicyConfig, index: Arc<KvIndex>) -> Arc<dyn Policy> {
    build_policy_with(cfg, index, None)
}

/// [`build_policy`], with the upstreams' affinity identities for `session`
/// (the gateway passes their names' hashes, so replicas agree).
pub fn build_policy_with(cfg: &PolicyConfig, index: Arc<KvIndex>, affinity: Option<AffinityOf>) -> Arc<dyn Policy> {
    match cfg {
        PolicyConfig::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyConfig::LeastLoad => Arc::new(LeastLoad::default()),
        PolicyConfig::Session { .. } => Arc::new(Session { affinity, ..Session::default() }),
        PolicyConfig::KvAware { load_penalty, approx_capacity_blocks } => Arc::new(KvAware::new(
            index,
            *load_penalty,
            if *approx_capacity_blocks == 0 { default_approx_capacity() } else { *approx_capacity_blocks },
        )),
    }
}

/// Candidates with room first, keeping each group's order.
fn room_first(mut ranked: Vec<&Candidate>) -> Vec<usize> {
    ranked.sort_by_key(|c| c.full());
    ranked.into_iter().map(|c| c.index).collect()
}

/// Rotates a list by a counter: ties between equals move on each call.
fn rotated<'a>(candidates: &'a [Candidate], counter: &AtomicUsize) -> Vec<&'a Candidate> {
    let n = candidates.len().max(1);
    let start = counter.fetch_add(1, Ordering::Relaxed) % n;
    candidates.iter().cycle().skip(start).take(candidates.len()).collect()
}

/// Each candidate in turn.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn rank(&self, _req: &RouteRequest<'_>, candidates: &[Candidate]) -> Vec<usize> {
        room_first(rotated(candidates, &self.next))
    }
}

/// Fewest requests in flight (relative to capacity); ties rotate.
#[derive(Default)]
pub struct LeastLoad {
    next: AtomicUsize,
}

fn by_load<'a>(candidates: &'a [Candidate], counter: &AtomicUsize) -> Vec<&'a Candidate> {
    let mut list = rotated(candidates, counter);
    list.sort_by(|a, b| a.full().cmp(&b.full()).then(a.load().total_cmp(&b.load())));
    list
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }
    fn rank(&self, _req: &RouteRequest<'_>, candidates: &[Candidate]) -> Vec<usize> {
        by_load(candidates, &self.next).into_iter().map(|c| c.index).collect()
    }
}

/// Affinity by session: rendezvous (highest random weight) hashing of the
/// session value over the candidates, so a session stays on one upstream
/// while it is routable and only the sessions of a leaving upstream move.
/// Requests without a session go by load.
#[derive(Default)]
pub struct Session {
    next: AtomicUsize,
    /// Stable identities of the upstreams (else their indexes).
    affinity: Option<AffinityOf>,
}

impl Session {
    /// A session policy hashing the identities `affinity` gives.
    pub fn with_affinity(affinity: AffinityOf) -> Self {
        Session { affinity: Some(affinity), ..Session::default() }
    }

    fn identity(&self, c: &Candidate) -> u64 {
        self.affinity.as_ref().and_then(|f| f(c.index)).unwrap_or(c.index as u64)
    }
}

/// The weight of (session, upstream): blake3, so that every replica (and
/// every build) ranks a session's upstreams alike.
fn rendezvous(session: &str, affinity: u64) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(&affinity.to_le_bytes());
    h.update(session.as_bytes());
    let out = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&out.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// An upstream's affinity identity ([`AffinityOf`]) from its name.
pub fn affinity_of(name: &str) -> u64 {
    let out = blake3::hash(name.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&out.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

impl Policy for Session {
    fn name(&self) -> &'static str {
        "session"
    }
    fn rank(&self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> Vec<usize> {
        match req.session {
            Some(s) if !s.is_empty() => {
                let mut list: Vec<&Candidate> = candidates.iter().collect();
                list.sort_by_cached_key(|c| std::cmp::Reverse(rendezvous(s, self.identity(c))));
                room_first(list)
            }
            _ => by_load(candidates, &self.next).into_iter().map(|c| c.index).collect(),
        }
    }
}

/// Most prefix blocks held, minus a load penalty; as routers that follow
/// engines' KV events do. Upstreams without events are scored from
/// [`ApproxIndex`], which learns from where requests were sent.
pub struct KvAware {
    index: Arc<KvIndex>,
    approx: ApproxIndex,
    load_penalty: f64,
    next: AtomicUsize,
}

impl KvAware {
    pub fn new(index: Arc<KvIndex>, load_penalty: f64, approx_capacity_blocks: usize) -> Self {
        KvAware { index, approx: ApproxIndex::new(approx_capacity_blocks), load_penalty, next: AtomicUsize::new(0) }
    }

    /// Leading blocks of the prompt `c` holds.
    pub fn matched(&self, c: &Candidate, req: &RouteRequest<'_>) -> usize {
        let blocks = req.blocks_for(c.index);
        if blocks.is_empty() {
            0
        } else if c.publishes_events {
            self.index.prefix_match(c.index, blocks)
        } else {
            self.approx.prefix_match(c.index, blocks)
        }
    }
}

impl Policy for KvAware {
    fn name(&self) -> &'static str {
        "kv_aware"
    }
    fn rank(&self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> Vec<usize> {
        let mut scored: Vec<(&Candidate, f64)> = rotated(candidates, &self.next)
            .into_iter()
            .map(|c| (c, self.matched(c, req) as f64 - self.load_penalty * c.active as f64))
            .collect();
        scored.sort_by(|(a, sa), (b, sb)| {
            a.full().cmp(&b.full()).then(sb.total_cmp(sa)).then(a.load().total_cmp(&b.load()))
        });
        scored.into_iter().map(|(c, _)| c.index).collect()
    }
    fn routed(&self, req: &RouteRequest<'_>, upstream: usize) {
        let blocks = req.blocks_for(upstream);
        if !blocks.is_empty() {
            self.approx.insert(upstream, blocks);
        }
    }
    fn forget(&self, upstream: usize) {
        self.approx.forget(upstream);
    }
}

/// A KV event as engines publish it on `GET /v1/kv/events`.
#[derive(Clone, Debug, Deserialize)]
pub struct KvEventMsg {
    /// `stored`, `removed` or `reset`.
    pub kind: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub tier: String,
    /// Hex block hashes.
    #[serde(default)]
    pub hashes: Vec<String>,
}

/// Which blocks each upstream holds, from its KV events. Block hashes
/// include the namespace, so one set per upstream serves every tenant.
#[derive(Default)]
pub struct KvIndex {
    held: RwLock<HashMap<usize, HashSet<BlockHash>>>,
    bad_hashes: AtomicUsize,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies an event: `stored` adds, `removed` drops, `reset` forgets
    /// everything known of the upstream (a snapshot follows). Unreadable
    /// hashes are skipped and counted.
    pub fn apply(&self, upstream: usize, ev: &KvEventMsg) {
        let parse = |h: &String| match h.parse::<BlockHash>() {
            Ok(b) => Some(b),
            Err(_) => {
                self.bad_hashes.fetch_add(1, Ordering::Relaxed);
                None
            }
        };
        match ev.kind.as_str() {
            "stored" => {
                let hashes: Vec<BlockHash> = ev.hashes.iter().filter_map(parse).collect();
                self.insert(upstream, &hashes);
            }
            "removed" => {
                let hashes: Vec<BlockHash> = ev.hashes.iter().filter_map(parse).collect();
                self.remove(upstream, &hashes);
            }
            "reset" => self.forget(upstream),
            _ => {}
        }
    }

    /// The event stream dropped: what we knew may be stale.
    pub fn forget(&self, upstream: usize) {
        self.held.write().remove(&upstream);
    }

    pub fn insert(&self, upstream: usize, hashes: &[BlockHash]) {
        self.held.write().entry(upstream).or_default().extend(hashes.iter().copied());
    }

    pub fn remove(&self, upstream: usize, hashes: &[BlockHash]) {
        if let Some(set) = self.held.write().get_mut(&upstream) {
            for h in hashes {
                set.remove(h);
            }
        }
    }

    /// Leading blocks of `blocks` that `upstream` holds.
    pub fn prefix_match(&self, upstream: usize, blocks: &[BlockHash]) -> usize {
        let held = self.held.read();
        match held.get(&upstream) {
            Some(set) => blocks.iter().take_while(|b| set.contains(b)).count(),
            None => 0,
        }
    }

    /// Blocks known for `upstream`.
    pub fn blocks(&self, upstream: usize) -> usize {
        self.held.read().get(&upstream).map_or(0, HashSet::len)
    }

    /// (block, upstream) pairs known, over every upstream.
    pub fn total_blocks(&self) -> usize {
        self.held.read().values().map(HashSet::len).sum()
    }

    /// Upstreams with entries.
    pub fn upstreams(&self) -> usize {
        self.held.read().len()
    }

    /// Event hashes that could not be read.
    pub fn bad_hashes(&self) -> usize {
        self.bad_hashes.load(Ordering::Relaxed)
    }
}

/// One upstream's remembered blocks, and their arrival order.
type Remembered = (HashSet<BlockHash>, VecDeque<BlockHash>);

/// Where the gateway sent prompts, per upstream, bounded (oldest
/// forgotten first): a guess of what upstreams without KV events hold.
pub struct ApproxIndex {
    capacity: usize,
    inner: Mutex<HashMap<usize, Remembered>>,
}

impl ApproxIndex {
    pub fn new(capacity_blocks: usize) -> Self {
        ApproxIndex { capacity: capacity_blocks.max(1), inner: Mutex::new(HashMap::new()) }
    }

    pub fn insert(&self, upstream: usize, blocks: &[BlockHash]) {
        let mut inner = self.inner.lock();
        let (set, order) = inner.entry(upstream).or_default();
        for b in blocks {
            if set.insert(*b) {
                order.push_back(*b);
            }
        }
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
    }

    pub fn prefix_match(&self, upstream: usize, blocks: &[BlockHash]) -> usize {
        let inner = self.inner.lock();
        inner.get(&upstream).map_or(0, |(set, _)| blocks.iter().take_while(|b| set.contains(b)).count())
    }

    /// Drops everything remembered of `upstream`.
    pub fn forget(&self, upstream: usize) {
        self.inner.lock().remove(&upstream);
    }
}

/// Weighted pools in the order to try: smooth weighted round robin picks
/// the first (so 80/15/5 pools get 80%, 15% and 5% of first picks), the
/// others follow by descending weight as failover.
pub struct PoolSelector {
    weights: Vec<i64>,
    current: Mutex<Vec<i64>>,
}

impl PoolSelector {
    pub fn new(weights: &[u32]) -> Self {
        PoolSelector {
            weights: weights.iter().map(|&w| i64::from(w.max(1))).collect(),
            current: Mutex::new(vec![0; weights.len()]),
        }
    }

    pub fn order(&self) -> Vec<usize> {
        let n = self.weights.len();
        if n <= 1 {
            return (0..n).collect();
        }
        let first = {
            let mut cur = self.current.lock();
            let total: i64 = self.weights.iter().sum();
            for (c, w) in cur.iter_mut().zip(&self.weights) {
                *c += w;
            }
            let best = (0..n).max_by_key(|&i| (cur[i], std::cmp::Reverse(i))).unwrap_or(0);
            cur[best] -= total;
            best
        };
        let mut rest: Vec<usize> = (0..n).filter(|&i| i != first).collect();
        rest.sort_by_key(|&i| (std::cmp::Reverse(self.weights[i]), i));
        std::iter::once(first).chain(rest).collect()
    }
}

/// Waits for a notification or a timeout; used by [`Admission`].
impl Priority {
    fn rank(self) -> usize {
        self as usize
    }
}
