//! The engine's local KV block cache (exported blocks kept in memory, LRU by
//! bytes), its partial blocks ("tails": the KV of a sequence's last, unfilled
//! block, found by the tokens it holds), and the KV event feed routers
//! subscribe to.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use granary_core::hash::{BlockHash, KvLayout};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::broadcast;

/// A change in where KV blocks are held, for routers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct KvEvent {
    /// `stored` or `removed`.
    pub kind: &'static str,
    pub namespace: String,
    /// `engine` (this engine's memory) or `warehouse`.
    pub tier: &'static str,
    /// Hex block hashes, in prompt order.
    pub hashes: Vec<String>,
}

struct Entry {
    bytes: Bytes,
    tick: u64,
    namespace: Arc<str>,
}

struct Inner {
    map: HashMap<BlockHash, Entry>,
    order: BTreeMap<u64, BlockHash>,
    tick: u64,
    bytes: usize,
    /// What each namespace holds, in its own LRU order.
    by_ns: HashMap<Arc<str>, NsBlocks>,
    tails: Tails,
}

#[derive(Default)]
struct NsBlocks {
    bytes: usize,
    order: BTreeMap<u64, BlockHash>,
}

impl Inner {
    /// Drops block `h`; its namespace and size.
    fn evict(&mut self, h: &BlockHash) -> Option<(Arc<str>, usize)> {
        let e = self.map.remove(h)?;
        self.order.remove(&e.tick);
        self.bytes -= e.bytes.len();
        if let Some(ns) = self.by_ns.get_mut(&e.namespace) {
            ns.order.remove(&e.tick);
            ns.bytes -= e.bytes.len();
            if ns.order.is_empty() {
                self.by_ns.remove(&e.namespace);
            }
        }
        Some((e.namespace, e.bytes.len()))
    }
}

/// A block's worth of KV of which the first `tokens.len()` positions hold
/// the KV of `tokens`, following the full blocks up to `parent`.
struct TailEntry {
    tokens: Arc<[u32]>,
    bytes: Bytes,
    tick: u64,
}

/// Partial blocks by the hash of the full block before them (the chain's
/// root for a sequence shorter than a block): named blocks cover only full
/// blocks, so without these a prompt that was seen whole still computes
/// its last partial block again, up to `block_tokens - 1` tokens against
/// the whole context. LRU by bytes within their own budget.
#[derive(Default)]
struct Tails {
    by_parent: HashMap<BlockHash, Vec<TailEntry>>,
    order: BTreeMap<u64, BlockHash>,
    bytes: usize,
}

/// Partial blocks kept after one parent (a prompt's tail and the answers
/// that followed it, say).
const TAILS_PER_PARENT: usize = 4;

pub struct BlockCache {
    inner: Mutex<Inner>,
    capacity: usize,
    /// The most one namespace may hold (0: no limit but the capacity).
    namespace_quota: usize,
    events: broadcast::Sender<KvEvent>,
}

impl BlockCache {
    pub fn new(capacity_bytes: usize) -> Self {
        let (events, _) = broadcast::channel(4096);
        BlockCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: BTreeMap::new(),
                tick: 0,
                bytes: 0,
                by_ns: HashMap::new(),
                tails: Tails::default(),
            }),
            capacity: capacity_bytes,
            namespace_quota: 0,
            events,
        }
    }

    /// Caps what one namespace (a tenant, behind a gateway) holds at
    /// `bytes` (0: no cap): its blocks past that evict its own least
    /// recently used ones, never another namespace's.
    pub fn with_namespace_quota(mut self, bytes: usize) -> Self {
        self.namespace_quota = bytes;
        self
    }

    /// Bytes of blocks `namespace` holds here.
    pub fn namespace_bytes(&self, namespace: &str) -> usize {
        self.inner.lock().by_ns.get(namespace).map_or(0, |n| n.bytes)
    }

    pub fn subscribe(&self) -> broadcast::Receiver<KvEvent> {
        self.events.subscribe()
    }

    pub fn publish(&self, ev: KvEvent) {
        let _ = self.events.send(ev);
    }

    /// Blocks held, and the namespace of each (for a router's first snapshot).
    pub fn snapshot(&self) -> Vec<(String, String)> {
        let g = self.inner.lock();
        g.map.iter().map(|(h, e)| (e.namespace.to_string(), h.to_hex())).collect()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The longest run of `hashes` held here, from the first; touched as used.
    pub fn prefix(&self, hashes: &[BlockHash]) -> Vec<Bytes> {
        let mut g = self.inner.lock();
        let mut out = Vec::new();
        let g = &mut *g;
        for h in hashes {
            g.tick += 1;
            let tick = g.tick;
            let Some(e) = g.map.get_mut(h) else { break };
            let old = std::mem::replace(&mut e.tick, tick);
            let bytes = e.bytes.clone();
            g.order.remove(&old);
            g.order.insert(tick, *h);
            if let Some(ns) = g.by_ns.get_mut(&e.namespace) {
                ns.order.remove(&old);
                ns.order.insert(tick, *h);
            }
            out.push(bytes);
        }
        out
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.inner.lock().map.contains_key(h)
    }

    /// Bytes partial blocks may hold: a quarter of the cache's.
    fn tail_capacity(&self) -> usize {
        self.capacity / 4
    }

    /// Keeps a partial block: `bytes` (a [`compact_tail`]) holds the KV of
    /// `tokens` (fewer than a block's) after the full blocks ending in
    /// `parent`. A tail with the same tokens, or one whose tokens begin
    /// these, is replaced.
    pub fn insert_tail(&self, parent: BlockHash, tokens: &[u32], bytes: Bytes) {
        if tokens.is_empty() || bytes.len() > self.tail_capacity() {
            return;
        }
        let mut g = self.inner.lock();
        g.tick += 1;
        let tick = g.tick;
        let t = &mut g.tails;
        let list = t.by_parent.entry(parent).or_default();
        if list.iter().any(|e| e.tokens.len() >= tokens.len() && e.tokens[..tokens.len()] == *tokens) {
            // Something held already covers these tokens.
            return;
        }
        let mut freed = Vec::new();
        list.retain(|e| {
            let covered = e.tokens.len() < tokens.len() && tokens[..e.tokens.len()] == *e.tokens;
            if covered {
                freed.push((e.tick, e.bytes.len()));
            }
            !covered
        });
        if list.len() >= TAILS_PER_PARENT {
            let oldest = (0..list.len()).min_by_key(|&i| list[i].tick).expect("not empty");
            let e = list.swap_remove(oldest);
            freed.push((e.tick, e.bytes.len()));
        }
        list.push(TailEntry { tokens: tokens.into(), bytes: bytes.clone(), tick });
        for (tick, n) in freed {
            t.order.remove(&tick);
            t.bytes -= n;
        }
        t.order.insert(tick, parent);
        t.bytes += bytes.len();
        let cap = self.tail_capacity();
        while t.bytes > cap {
            let Some((old, p)) = t.order.pop_first() else { break };
            if let Some(list) = t.by_parent.get_mut(&p) {
                if let Some(i) = list.iter().position(|e| e.tick == old) {
                    t.bytes -= list.swap_remove(i).bytes.len();
                }
                if list.is_empty() {
                    t.by_parent.remove(&p);
                }
            }
        }
    }

    /// The partial block after `parent` sharing the longest run of tokens
    /// with `rest` (the tokens that follow the full blocks), and how many
    /// of its positions that run covers; touched as used.
    pub fn tail(&self, parent: &BlockHash, rest: &[u32]) -> Option<(Bytes, usize)> {
        let mut g = self.inner.lock();
        g.tick += 1;
        let tick = g.tick;
        let t = &mut g.tails;
        let list = t.by_parent.get_mut(parent)?;
        let common = |e: &TailEntry| e.tokens.iter().zip(rest).take_while(|(a, b)| a == b).count();
        let best = (0..list.len()).max_by_key(|&i| common(&list[i]))?;
        let n = common(&list[best]);
        if n == 0 {
            return None;
        }
        let e = &mut list[best];
        t.order.remove(&e.tick);
        e.tick = tick;
        t.order.insert(tick, *parent);
        Some((e.bytes.clone(), n))
    }

    /// Keeps `blocks` (in prompt order) and evicts the least recently used
    /// past the capacity; publishes what was stored and removed.
    pub fn insert(&self, namespace: &str, blocks: Vec<(BlockHash, Bytes)>) {
        if self.capacity == 0 || blocks.is_empty() {
            return;
        }
        let ns: Arc<str> = namespace.into();
        let mut stored = Vec::new();
        let mut removed: HashMap<Arc<str>, Vec<String>> = HashMap::new();
        {
            let mut g = self.inner.lock();
            let quota = if self.namespace_quota == 0 { usize::MAX } else { self.namespace_quota };
            for (h, bytes) in blocks {
                if bytes.len() > self.capacity.min(quota) || g.map.contains_key(&h) {
                    continue;
                }
                g.tick += 1;
                let tick = g.tick;
                let size = bytes.len();
                g.bytes += size;
                g.order.insert(tick, h);
                g.map.insert(h, Entry { bytes, tick, namespace: ns.clone() });
                let mine = g.by_ns.entry(ns.clone()).or_default();
                mine.bytes += size;
                mine.order.insert(tick, h);
                stored.push(h.to_hex());
                // Over its quota, a namespace gives up its own blocks.
                while g.by_ns.get(&ns).is_some_and(|n| n.bytes > quota) {
                    let Some(victim) = g.by_ns.get(&ns).and_then(|n| n.order.first_key_value()).map(|(_, v)| *v) else {
                        break;
                    };
                    if let Some((from, _)) = g.evict(&victim) {
                        removed.entry(from).or_default().push(victim.to_hex());
                    }
                }
                while g.bytes > self.capacity {
                    let Some((_, victim)) = g.order.first_key_value().map(|(t, v)| (*t, *v)) else { break };
                    if let Some((from, _)) = g.evict(&victim) {
                        removed.entry(from).or_default().push(victim.to_hex());
                    }
                }
            }
        }
        // A block stored and evicted in the same call is reported both ways.
        if !stored.is_empty() {
            self.publish(KvEvent { kind: "stored", namespace: namespace.into(), tier: "engine", hashes: stored });
        }
        for (ns, hashes) in removed {
            self.publish(KvEvent { kind: "removed", namespace: ns.to_string(), tier: "engine", hashes });
        }
    }
}

/// A tail in the form kept: for each layer K then V, each `[kv_heads,
/// tokens, head_dim]` f16, of a block exported whole (`[kv_heads,
/// block_tokens, head_dim]`), so a tail of a few tokens does not hold a
/// whole block's memory.
pub fn compact_tail(layout: &KvLayout, block: &[u8], tokens: usize) -> Bytes {
    let (rows, bt, row) = tail_shape(layout);
    assert_eq!(block.len(), rows * bt * row, "not a whole block of this layout");
    assert!(tokens <= bt);
    let mut out = Vec::with_capacity(rows * tokens * row);
    for r in 0..rows {
        out.extend_from_slice(&block[r * bt * row..][..tokens * row]);
    }
    out.into()
}

/// A whole block (as exported) from a [`compact_tail`]: positions past the
/// tail's tokens are zero.
pub fn expand_tail(layout: &KvLayout, tail: &[u8]) -> Option<Bytes> {
    let (rows, bt, row) = tail_shape(layout);
    if tail.is_empty() || !tail.len().is_multiple_of(rows * row) {
        return None;
    }
    let tokens = tail.len() / (rows * row);
    if tokens > bt {
        return None;
    }
    let mut out = vec![0u8; rows * bt * row];
    for r in 0..rows {
        out[r * bt * row..][..tokens * row].copy_from_slice(&tail[r * tokens * row..][..tokens * row]);
    }
    Some(out.into())
}

/// (K and V rows per block, tokens per block, bytes per token row).
fn tail_shape(layout: &KvLayout) -> (usize, usize, usize) {
    let rows = 2 * layout.layers as usize * layout.kv_heads as usize;
    (rows, layout.block_tokens as usize, layout.head_dim as usize * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compact_tail_expands_to_its_block_up_to_its_tokens() {
        let layout =
            KvLayout { dtype: granary_core::block::DType::F16, layers: 2, kv_heads: 3, head_dim: 4, block_tokens: 5 };
        let block: Vec<u8> = (0..2 * 2 * 3 * 5 * 4 * 2).map(|i| (i % 251) as u8).collect();
        let tail = compact_tail(&layout, &block, 2);
        assert_eq!(tail.len(), block.len() * 2 / 5);
        let back = expand_tail(&layout, &tail).unwrap();
        let (row, bt) = (8, 5);
        for r in 0..12 {
            let (want, got) = (&block[r * bt * row..][..bt * row], &back[r * bt * row..][..bt * row]);
            assert_eq!(got[..2 * row], want[..2 * row], "row {r}: the tail's tokens");
            assert!(got[2 * row..].iter().all(|&b| b == 0), "row {r}: zero past them");
        }
        assert!(expand_tail(&layout, &tail[1..]).is_none(), "a cut tail is refused");
    }

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn prefix_stops_at_a_gap_and_lru_evicts_with_events() {
        let c = BlockCache::new(30);
        let mut rx = c.subscribe();
        let b = |n: u8| -> Bytes { vec![n; 10].into() };
        c.insert("t", vec![(h(1), b(1)), (h(2), b(2)), (h(3), b(3))]);
        assert_eq!(c.prefix(&[h(1), h(2), h(9), h(3)]).len(), 2);
        // 3 is now the least recently used; a fourth block evicts it.
        c.insert("t", vec![(h(4), b(4))]);
        assert!(!c.contains(&h(3)));
        assert!(c.contains(&h(1)) && c.contains(&h(4)));
        let first = rx.try_recv().unwrap();
        assert_eq!((first.kind, first.hashes.len()), ("stored", 3));
        let _stored4 = rx.try_recv().unwrap();
        let removed = rx.try_recv().unwrap();
        assert_eq!(removed.kind, "removed");
        assert_eq!(removed.hashes, vec![h(3).to_hex()]);
    }

    /// Issue 40, point 5: one tenant filling the engine's cache evicted
    /// every other tenant's blocks (one LRU for all). With a namespace
    /// quota, a namespace past it evicts its own least recently used
    /// blocks and leaves the others' alone.
    #[test]
    fn a_namespace_over_its_quota_evicts_only_its_own_blocks() {
        let c = BlockCache::new(100).with_namespace_quota(40);
        let mut rx = c.subscribe();
        let b = |n: u8| -> Bytes { vec![n; 10].into() };
        c.insert("b", vec![(h(1), b(1)), (h(2), b(2))]);
        // Tenant a writes far more than its quota.
        for i in 10..30 {
            c.insert("a", vec![(h(i), b(i))]);
        }
        assert!(c.contains(&h(1)) && c.contains(&h(2)), "the other tenant's blocks were evicted");
        assert_eq!((c.namespace_bytes("a"), c.namespace_bytes("b")), (40, 20));
        // Its newest four stay; touching one keeps it over a newer one.
        assert!((26..30).all(|i| c.contains(&h(i))) && !c.contains(&h(25)));
        assert_eq!(c.prefix(&[h(26)]).len(), 1);
        c.insert("a", vec![(h(30), b(30))]);
        assert!(c.contains(&h(26)) && !c.contains(&h(27)), "LRU within the namespace");
        let removed: Vec<KvEvent> = std::iter::from_fn(|| rx.try_recv().ok()).filter(|e| e.kind == "removed").collect();
        assert!(removed.iter().all(|e| e.namespace == "a"), "{removed:?}");
        // The capacity still binds the total: a third tenant fills what is
        // left; a fourth's block then evicts the oldest of all (b's first),
        // as one LRU does.
        for i in 40..45 {
            c.insert("c", vec![(h(i), b(i))]);
        }
        assert_eq!(c.namespace_bytes("c"), 40);
        c.insert("d", vec![(h(50), b(50))]);
        assert!(!c.contains(&h(1)) && c.contains(&h(2)) && c.contains(&h(50)));
        let held: usize = ["a", "b", "c", "d"].iter().map(|n| c.namespace_bytes(n)).sum();
        assert_eq!(held, 100);
        // Without a quota, one tenant may take the whole cache.
        let open = BlockCache::new(100);
        open.insert("b", vec![(h(1), b(1))]);
        for i in 10..30 {
            open.insert("a", vec![(h(i), b(i))]);
        }
        assert!(!open.contains(&h(1)) && open.namespace_bytes("a") == 100);
    }

    #[test]
    fn tails_match_by_the_longest_common_run_and_stay_within_their_budget() {
        // Tails get a quarter: 40 bytes, four of 10.
        let c = BlockCache::new(160);
        let b = |n: u8| -> Bytes { vec![n; 10].into() };
        c.insert_tail(h(1), &[1, 2, 3], b(1));
        c.insert_tail(h(1), &[1, 2, 7, 8], b(2));
        c.insert_tail(h(2), &[1, 2, 3, 4], b(3));
        // The longest common run wins, and may be shorter than either side.
        assert_eq!(c.tail(&h(1), &[1, 2, 3, 9]).map(|(x, n)| (x[0], n)), Some((1, 3)));
        assert_eq!(c.tail(&h(1), &[1, 2, 7]).map(|(x, n)| (x[0], n)), Some((2, 3)));
        assert_eq!(c.tail(&h(1), &[1]).map(|(_, n)| n), Some(1));
        // Other parents, and no common token, find nothing.
        assert!(c.tail(&h(9), &[1, 2, 3]).is_none());
        assert!(c.tail(&h(1), &[5, 1, 2]).is_none());
        // A longer tail replaces the one it extends.
        c.insert_tail(h(2), &[1, 2, 3, 4, 5], b(4));
        assert_eq!(c.tail(&h(2), &[1, 2, 3, 4, 5]).map(|(x, n)| (x[0], n)), Some((4, 5)));
        // A fifth tail evicts the least recently used (parent 1's [1, 2, 3]
        // was touched before [1, 2, 7, 8]).
        c.insert_tail(h(3), &[7], b(5));
        c.insert_tail(h(4), &[7], b(6));
        assert!(c.tail(&h(1), &[1, 2, 3]).is_some_and(|(x, _)| x[0] == 2), "the older tail of parent 1 stays");
        assert!(c.tail(&h(3), &[7]).is_some() && c.tail(&h(4), &[7]).is_some());
        // A tail over the budget is not kept.
        c.insert_tail(h(5), &[1], vec![0; 41].into());
        assert!(c.tail(&h(5), &[1]).is_none());
    }
}
