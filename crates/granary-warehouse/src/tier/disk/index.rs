//! The disk tier's index, kept in memory: per namespace, key → slot (file
//! size, metadata, hits, pins), the scan order and the bytes held; entry
//! ids for the eviction policy and the expiry order. Rebuilt from the files
//! on open (`recover.rs`).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use bytes::Bytes;

use crate::policy::{EntryId, Policy};
use crate::types::{scan_hash, EntryMeta};

pub(super) struct Slot {
    pub(super) id: EntryId,
    /// Bytes of the file (what the budget counts).
    pub(super) size: u64,
    pub(super) meta: EntryMeta,
    pub(super) hits: u32,
    pub(super) pins: u32,
}

#[derive(Default)]
pub(super) struct Space {
    /// Bytes of this namespace's files (what a quota counts).
    pub(super) bytes: u64,
    pub(super) map: HashMap<Bytes, Slot>,
    /// Scan order: (scan hash, key).
    pub(super) order: BTreeSet<(u64, Bytes)>,
}

pub(super) struct Index {
    pub(super) bytes: u64,
    pub(super) next_id: EntryId,
    pub(super) spaces: HashMap<Arc<str>, Space>,
    pub(super) by_id: HashMap<EntryId, (Arc<str>, Bytes)>,
    /// (expires_at_ms, id) of entries with a TTL.
    pub(super) expiry: BTreeSet<(u64, EntryId)>,
    pub(super) policy: Box<dyn Policy>,
}

impl Index {
    pub(super) fn slot(&self, ns: &str, key: &[u8]) -> Option<&Slot> {
        self.spaces.get(ns).and_then(|s| s.map.get(key))
    }

    pub(super) fn slot_mut(&mut self, ns: &str, key: &[u8]) -> Option<&mut Slot> {
        self.spaces.get_mut(ns).and_then(|s| s.map.get_mut(key))
    }

    pub(super) fn insert(&mut self, ns: &str, key: Bytes, size: u64, meta: EntryMeta) -> EntryId {
        let id = self.next_id;
        self.next_id += 1;
        let ns_arc: Arc<str> = match self.spaces.get_key_value(ns) {
            Some((k, _)) => k.clone(),
            None => Arc::from(ns),
        };
        let fp = scan_hash(&key) ^ xxhash_rust::xxh3::xxh3_64(ns.as_bytes());
        self.policy.insert(id, fp, size, meta.depth);
        if let Some(t) = meta.expires_at_ms {
            self.expiry.insert((t, id));
        }
        self.by_id.insert(id, (ns_arc.clone(), key.clone()));
        let space = self.spaces.entry(ns_arc).or_default();
        space.order.insert((scan_hash(&key), key.clone()));
        space.map.insert(key, Slot { id, size, meta, hits: 0, pins: 0 });
        space.bytes += size;
        self.bytes += size;
        id
    }

    /// Unlinks an entry from the maps (not from the policy).
    pub(super) fn take(&mut self, ns: &str, key: &[u8]) -> Option<Slot> {
        let space = self.spaces.get_mut(ns)?;
        let (k, slot) = space.map.remove_entry(key)?;
        space.order.remove(&(scan_hash(&k), k));
        space.bytes -= slot.size;
        if space.map.is_empty() {
            self.spaces.remove(ns);
        }
        self.by_id.remove(&slot.id);
        if let Some(t) = slot.meta.expires_at_ms {
            self.expiry.remove(&(t, slot.id));
        }
        self.bytes -= slot.size;
        Some(slot)
    }

    pub(super) fn remove(&mut self, ns: &str, key: &[u8]) -> Option<Slot> {
        let slot = self.take(ns, key)?;
        self.policy.remove(slot.id);
        Some(slot)
    }

    pub(super) fn space_bytes(&self, ns: &str) -> u64 {
        self.spaces.get(ns).map_or(0, |s| s.bytes)
    }

    /// Evicts one unpinned entry, of namespace `only` if given.
    pub(super) fn evict_one(&mut self, only: Option<&str>) -> Option<(Arc<str>, Bytes, Slot)> {
        let Index { policy, by_id, spaces, .. } = self;
        if only.is_some_and(|ns| !spaces.contains_key(ns)) {
            return None;
        }
        let victim = policy.evict(&mut |id| {
            let Some((ns, key)) = by_id.get(&id) else { return only.is_none() };
            if only.is_some_and(|o| **ns != *o) {
                return false;
            }
            spaces.get(&**ns).and_then(|n| n.map.get(key)).is_none_or(|slot| slot.pins == 0)
        })?;
        let (ns, key) = self.by_id.get(&victim).cloned()?;
        let slot = self.take(&ns, &key)?;
        Some((ns, key, slot))
    }
}
