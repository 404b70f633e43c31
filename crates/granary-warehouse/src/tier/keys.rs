//! The key index both local tiers keep in memory: per namespace, key →
//! entry (size, metadata, hits, pins and what the tier keeps for it), the
//! scan order and the bytes held; entry ids for the eviction policy and
//! the expiry order. The memory tier keeps one per shard with the value as
//! payload; the disk tier keeps one for the directory with its files named
//! by the key. Every change to an entry goes through here, so the maps,
//! the orders, the byte counts and the policy cannot drift apart.

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;

use crate::policy::{EntryId, Policy};
use crate::types::{scan_hash, EntryMeta, ScanPage};

/// Maps keyed by client-chosen bytes: a fast hasher with a random seed per
/// map, so crafted keys cannot force collisions.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

pub(crate) struct Entry<P> {
    pub(crate) id: EntryId,
    /// Bytes the tier's budget counts for the entry.
    pub(crate) size: u64,
    pub(crate) meta: EntryMeta,
    pub(crate) hits: u32,
    pub(crate) pins: u32,
    /// What the tier keeps beside the index entry (the memory tier: the value).
    pub(crate) payload: P,
}

struct Space<P> {
    /// Bytes of this namespace's entries (what a quota counts).
    bytes: u64,
    map: HashMap<Bytes, Entry<P>>,
    /// Scan order: (scan hash, key).
    order: BTreeSet<(u64, Bytes)>,
}

impl<P> Default for Space<P> {
    fn default() -> Self {
        Space { bytes: 0, map: HashMap::default(), order: BTreeSet::new() }
    }
}

/// An entry taken out of the index, with its namespace and key.
pub(crate) type Removed<P> = (Arc<str>, Bytes, Entry<P>);

pub(crate) struct KeyIndex<P> {
    bytes: u64,
    entries: u64,
    next_id: EntryId,
    spaces: HashMap<Arc<str>, Space<P>>,
    by_id: HashMap<EntryId, (Arc<str>, Bytes)>,
    /// (expires_at_ms, id) of entries with a TTL.
    expiry: BTreeSet<(u64, EntryId)>,
    policy: Box<dyn Policy>,
}

impl<P> KeyIndex<P> {
    pub(crate) fn new(policy: Box<dyn Policy>) -> Self {
        KeyIndex {
            bytes: 0,
            entries: 0,
            next_id: 1,
            spaces: HashMap::default(),
            by_id: HashMap::default(),
            expiry: BTreeSet::new(),
            policy,
        }
    }

    /// Bytes of every entry.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn len(&self) -> u64 {
        self.entries
    }

    pub(crate) fn get(&self, ns: &str, key: &[u8]) -> Option<&Entry<P>> {
        self.spaces.get(ns).and_then(|s| s.map.get(key))
    }

    /// The entry, for its hits, pins and payload (its size, metadata and id
    /// change through [`KeyIndex::update`] only).
    pub(crate) fn get_mut(&mut self, ns: &str, key: &[u8]) -> Option<&mut Entry<P>> {
        self.spaces.get_mut(ns).and_then(|s| s.map.get_mut(key))
    }

    /// Whether `key` has an entry that has not expired at `now`.
    pub(crate) fn is_live(&self, ns: &str, key: &[u8], now: u64) -> bool {
        self.get(ns, key).is_some_and(|e| !e.meta.is_expired(now))
    }

    /// Tells the policy the entry was read.
    pub(crate) fn access(&mut self, id: EntryId) {
        self.policy.access(id);
    }

    /// Adds an entry (the key must have none: remove the old one first).
    pub(crate) fn insert(&mut self, ns: &str, key: Bytes, size: u64, meta: EntryMeta, payload: P) -> EntryId {
        let id = self.next_id;
        self.next_id += 1;
        let ns_arc: Arc<str> = match self.spaces.get_key_value(ns) {
            Some((k, _)) => k.clone(),
            None => Arc::from(ns),
        };
        let h = scan_hash(&key);
        self.policy.insert(id, h ^ xxhash_rust::xxh3::xxh3_64(ns.as_bytes()), size, meta.depth);
        if let Some(t) = meta.expires_at_ms {
            self.expiry.insert((t, id));
        }
        self.by_id.insert(id, (ns_arc.clone(), key.clone()));
        let space = self.spaces.entry(ns_arc).or_default();
        space.order.insert((h, key.clone()));
        let old = space.map.insert(key, Entry { id, size, meta, hits: 0, pins: 0, payload });
        debug_assert!(old.is_none(), "insert over a live entry");
        space.bytes += size;
        self.bytes += size;
        self.entries += 1;
        id
    }

    /// Changes an entry's size and metadata in place (its id, hits and
    /// pins stay); whether it was there.
    pub(crate) fn update(&mut self, ns: &str, key: &[u8], size: u64, meta: EntryMeta) -> bool {
        let Some(space) = self.spaces.get_mut(ns) else { return false };
        let Some(e) = space.map.get_mut(key) else { return false };
        if e.meta.expires_at_ms != meta.expires_at_ms {
            if let Some(t) = e.meta.expires_at_ms {
                self.expiry.remove(&(t, e.id));
            }
            if let Some(t) = meta.expires_at_ms {
                self.expiry.insert((t, e.id));
            }
        }
        e.meta = meta;
        space.bytes = space.bytes - e.size + size;
        self.bytes = self.bytes - e.size + size;
        e.size = size;
        true
    }

    /// Unlinks an entry from the maps and orders (not from the policy).
    fn take(&mut self, ns: &str, key: &[u8]) -> Option<(Bytes, Entry<P>)> {
        let space = self.spaces.get_mut(ns)?;
        let (k, e) = space.map.remove_entry(key)?;
        space.order.remove(&(scan_hash(&k), k.clone()));
        space.bytes -= e.size;
        if space.map.is_empty() {
            self.spaces.remove(ns);
        }
        self.by_id.remove(&e.id);
        if let Some(t) = e.meta.expires_at_ms {
            self.expiry.remove(&(t, e.id));
        }
        self.bytes -= e.size;
        self.entries -= 1;
        Some((k, e))
    }

    /// Removes an entry, policy included.
    pub(crate) fn remove(&mut self, ns: &str, key: &[u8]) -> Option<Entry<P>> {
        let (_, e) = self.take(ns, key)?;
        self.policy.remove(e.id);
        Some(e)
    }

    /// Evicts the entry the policy picks among the unpinned ones other than
    /// `skip`, of namespace `only` if given.
    pub(crate) fn evict_one(&mut self, only: Option<&str>, skip: Option<EntryId>) -> Option<Removed<P>> {
        let KeyIndex { policy, by_id, spaces, .. } = self;
        if only.is_some_and(|ns| !spaces.contains_key(ns)) {
            return None;
        }
        let victim = policy.evict(&mut |id| {
            if Some(id) == skip {
                return false;
            }
            let Some((ns, key)) = by_id.get(&id) else { return only.is_none() };
            if only.is_some_and(|o| **ns != *o) {
                return false;
            }
            spaces.get(&**ns).and_then(|n| n.map.get(key)).is_none_or(|e| e.pins == 0)
        })?;
        let (ns, key) = self.by_id.get(&victim).cloned()?;
        let (key, e) = self.take(&ns, &key)?;
        Some((ns, key, e))
    }

    /// Removes up to `limit` unpinned entries expired at `now`, earliest first.
    pub(crate) fn remove_expired(&mut self, now: u64, limit: usize) -> Vec<Removed<P>> {
        let due: Vec<EntryId> = self.expiry.range(..(now + 1, 0)).map(|(_, id)| *id).collect();
        let mut out = Vec::new();
        for id in due {
            if out.len() >= limit {
                break;
            }
            let Some((ns, key)) = self.by_id.get(&id).cloned() else { continue };
            if self.get(&ns, &key).is_some_and(|e| e.pins == 0) {
                if let Some(e) = self.remove(&ns, &key) {
                    out.push((ns, key, e));
                }
            }
        }
        out
    }

    /// The keys of `ns`.
    pub(crate) fn keys(&self, ns: &str) -> Vec<Bytes> {
        self.spaces.get(ns).map(|s| s.map.keys().cloned().collect()).unwrap_or_default()
    }

    /// Namespaces with at least one entry.
    pub(crate) fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.spaces.keys().map(|k| &**k)
    }

    /// Bytes and entries of `ns`.
    pub(crate) fn usage(&self, ns: &str) -> (u64, u64) {
        self.spaces.get(ns).map_or((0, 0), |s| (s.bytes, s.map.len() as u64))
    }

    /// A page of the live keys of `ns` from scan hash `cursor` on, in scan
    /// order: `count` of them or a few more, never cut between keys of one
    /// scan hash (a cursor could not resume between them); `next` is the
    /// scan hash to resume from, 0 at the end. Expired keys are skipped
    /// without counting toward the page.
    pub(crate) fn scan(&self, ns: &str, cursor: u64, count: usize, now: u64) -> ScanPage {
        let Some(space) = self.spaces.get(ns) else { return ScanPage::default() };
        let count = count.max(1);
        let mut keys: Vec<Bytes> = Vec::with_capacity(count);
        let mut last = None;
        for (h, k) in space.order.range((cursor, Bytes::new())..) {
            if space.map.get(k).is_none_or(|e| e.meta.is_expired(now)) {
                continue;
            }
            if keys.len() >= count && last != Some(*h) {
                return ScanPage { keys, next: *h };
            }
            keys.push(k.clone());
            last = Some(*h);
        }
        ScanPage { keys, next: 0 }
    }
}

/// Merges pages that each hold every key of their source from one cursor
/// up to their own `next`, into one page of about `count` keys.
pub(crate) fn merge_pages(pages: impl IntoIterator<Item = ScanPage>, count: usize) -> ScanPage {
    let pages: Vec<ScanPage> = pages.into_iter().collect();
    // Keys below `bound` are complete in every page.
    let bound = pages.iter().map(|p| p.next).filter(|&n| n != 0).min();
    let mut cand: Vec<(u64, Bytes)> = pages
        .into_iter()
        .flat_map(|p| p.keys)
        .map(|k| (scan_hash(&k), k))
        .filter(|(h, _)| bound.is_none_or(|b| *h < b))
        .collect();
    cand.sort();
    let mut page = cut_page(cand, count);
    if page.next == 0 {
        page.next = bound.unwrap_or(0);
    }
    page
}

/// Cuts a sorted candidate list to a page of about `count` keys without
/// splitting keys that share a scan hash (a cursor could not resume between them).
pub(crate) fn cut_page(mut cand: Vec<(u64, Bytes)>, count: usize) -> ScanPage {
    let count = count.max(1);
    cand.dedup();
    if cand.len() <= count {
        return ScanPage { keys: cand.into_iter().map(|(_, k)| k).collect(), next: 0 };
    }
    let mut end = count;
    while end < cand.len() && cand[end].0 == cand[end - 1].0 {
        end += 1;
    }
    let next = cand.get(end).map(|(h, _)| *h).unwrap_or(0);
    cand.truncate(end);
    ScanPage { keys: cand.into_iter().map(|(_, k)| k).collect(), next }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;

    fn meta(expires_at_ms: Option<u64>) -> EntryMeta {
        EntryMeta { expires_at_ms, ..EntryMeta::default() }
    }

    #[test]
    fn counts_follow_every_change() {
        let mut ix: KeyIndex<()> = KeyIndex::new(PolicyKind::Lru.build(0));
        ix.insert("a", Bytes::from_static(b"k1"), 10, meta(None), ());
        ix.insert("a", Bytes::from_static(b"k2"), 20, meta(Some(5)), ());
        ix.insert("b", Bytes::from_static(b"k1"), 30, meta(None), ());
        assert_eq!((ix.bytes(), ix.len()), (60, 3));
        assert_eq!(ix.usage("a"), (30, 2));
        // A rewrite of another size moves the namespace's bytes too.
        assert!(ix.update("a", b"k2", 25, meta(None)));
        assert_eq!((ix.bytes(), ix.usage("a")), (65, (35, 2)));
        assert!(ix.remove_expired(100, 10).is_empty(), "the TTL was cleared");
        assert!(ix.update("a", b"k1", 10, meta(Some(7))));
        let gone = ix.remove_expired(100, 10);
        assert_eq!(gone.len(), 1);
        assert_eq!(&gone[0].1[..], b"k1");
        assert_eq!((ix.bytes(), ix.len(), ix.usage("a")), (55, 2, (25, 1)));
        let (ns, _, e) = ix.evict_one(Some("b"), None).expect("b has an entry");
        assert_eq!((&*ns, e.size), ("b", 30));
        assert_eq!(ix.namespaces().collect::<Vec<_>>(), vec!["a"]);
        assert!(ix.remove("a", b"k2").is_some());
        assert_eq!((ix.bytes(), ix.len()), (0, 0));
        assert!(ix.evict_one(None, None).is_none());
    }

    #[test]
    fn pinned_and_skipped_entries_are_not_evicted() {
        let mut ix: KeyIndex<()> = KeyIndex::new(PolicyKind::Lru.build(0));
        let a = ix.insert("n", Bytes::from_static(b"a"), 1, meta(None), ());
        ix.insert("n", Bytes::from_static(b"b"), 1, meta(Some(1)), ());
        ix.get_mut("n", b"b").unwrap().pins = 1;
        assert!(ix.evict_one(None, Some(a)).is_none());
        assert!(ix.remove_expired(10, 10).is_empty(), "a pinned entry outlives its TTL until unpinned");
        assert_eq!(&ix.evict_one(None, None).unwrap().1[..], b"a");
    }

    #[test]
    fn a_scan_page_skips_expired_keys_without_counting_them() {
        let mut ix: KeyIndex<()> = KeyIndex::new(PolicyKind::Lru.build(0));
        let keys: Vec<Bytes> = (0..40).map(|i| Bytes::from(format!("key{i}"))).collect();
        for (i, k) in keys.iter().enumerate() {
            ix.insert("n", k.clone(), 1, meta((i % 4 != 0).then_some(5)), ());
        }
        // Three in four have expired at 10: a page of 3 still holds 3 live keys.
        let page = ix.scan("n", 0, 3, 10);
        assert_eq!(page.keys.len(), 3, "{page:?}");
        assert!(page.keys.iter().all(|k| ix.is_live("n", k, 10)));
        let (mut all, mut cursor) = (Vec::new(), 0);
        loop {
            let page = ix.scan("n", cursor, 3, 10);
            all.extend(page.keys);
            if page.next == 0 {
                break;
            }
            cursor = page.next;
        }
        all.sort();
        let mut live: Vec<Bytes> = keys.iter().step_by(4).cloned().collect();
        live.sort();
        assert_eq!(all, live);
    }

    #[test]
    fn merged_pages_lose_no_key_of_a_source_that_stopped_early() {
        // Two sources (as the memory tier's shards): the first has many
        // expired keys before a live one, the second only live keys.
        let (mut a, mut b): (KeyIndex<()>, KeyIndex<()>) =
            (KeyIndex::new(PolicyKind::Lru.build(0)), KeyIndex::new(PolicyKind::Lru.build(0)));
        let mut live = Vec::new();
        for i in 0..200 {
            let k = Bytes::from(format!("k{i}"));
            if i % 2 == 0 {
                let expired = i % 20 != 0;
                a.insert("n", k.clone(), 1, meta(expired.then_some(5)), ());
                if !expired {
                    live.push(k);
                }
            } else {
                b.insert("n", k.clone(), 1, meta(None), ());
                live.push(k);
            }
        }
        let (mut all, mut cursor) = (Vec::new(), 0);
        loop {
            let page = merge_pages([a.scan("n", cursor, 4, 10), b.scan("n", cursor, 4, 10)], 4);
            assert!(page.keys.len() <= 5, "{page:?}");
            all.extend(page.keys);
            if page.next == 0 {
                break;
            }
            cursor = page.next;
        }
        all.sort();
        live.sort();
        assert_eq!(all, live);
    }
}
