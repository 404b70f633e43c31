//! The engine's local KV block cache (exported blocks kept in memory, LRU by
//! bytes) and the KV event feed routers subscribe to.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use granary_core::hash::BlockHash;
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
}

pub struct BlockCache {
    inner: Mutex<Inner>,
    capacity: usize,
    events: broadcast::Sender<KvEvent>,
}

impl BlockCache {
    pub fn new(capacity_bytes: usize) -> Self {
        let (events, _) = broadcast::channel(4096);
        BlockCache {
            inner: Mutex::new(Inner { map: HashMap::new(), order: BTreeMap::new(), tick: 0, bytes: 0 }),
            capacity: capacity_bytes,
            events,
        }
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
        for h in hashes {
            g.tick += 1;
            let tick = g.tick;
            let Some(e) = g.map.get_mut(h) else { break };
            let old = std::mem::replace(&mut e.tick, tick);
            let bytes = e.bytes.clone();
            g.order.remove(&old);
            g.order.insert(tick, *h);
            out.push(bytes);
        }
        out
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.inner.lock().map.contains_key(h)
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
            for (h, bytes) in blocks {
                if bytes.len() > self.capacity || g.map.contains_key(&h) {
                    continue;
                }
                g.tick += 1;
                let tick = g.tick;
                g.bytes += bytes.len();
                g.order.insert(tick, h);
                g.map.insert(h, Entry { bytes, tick, namespace: ns.clone() });
                stored.push(h.to_hex());
                while g.bytes > self.capacity {
                    let Some((_, victim)) = g.order.pop_first() else { break };
                    if let Some(e) = g.map.remove(&victim) {
                        g.bytes -= e.bytes.len();
                        removed.entry(e.namespace).or_default().push(victim.to_hex());
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
