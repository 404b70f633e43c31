//! Offload modes, dropped offloads, promotion and events across tiers.
//!
//! The lower tier here is a real memory tier behind a wrapper that reports
//! itself as the disk tier and can add latency to writes, so a queue can be
//! filled on purpose; the disk and remote tiers themselves are covered by
//! the shared tier suite and the process tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use granary_warehouse::error::Result;
use granary_warehouse::tier::memory::MemoryTier;
use granary_warehouse::types::{Evicted, Stored};
use granary_warehouse::{
    EntryMeta, EventKind, OffloadMode, PolicyKind, PutOptions, ScanPage, Store, StoreConfig, Tier, TierKind, TierStats,
};

struct Lower {
    inner: MemoryTier,
    kind: TierKind,
    write_delay: Duration,
    puts: AtomicU64,
    /// Whether `contains_local` answers (an object store's tier cannot).
    local_index: bool,
}

impl Lower {
    fn new(kind: TierKind, write_delay: Duration) -> Arc<Lower> {
        Arc::new(Lower {
            inner: MemoryTier::new(0, PolicyKind::Lru),
            kind,
            write_delay,
            puts: AtomicU64::new(0),
            local_index: true,
        })
    }
}

#[async_trait]
impl Tier for Lower {
    fn kind(&self) -> TierKind {
        self.kind
    }
    async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Stored>> {
        self.inner.get(ns, key).await
    }
    async fn contains(&self, ns: &str, key: &[u8]) -> Result<bool> {
        self.inner.contains(ns, key).await
    }
    fn contains_local(&self, ns: &str, key: &[u8]) -> Option<bool> {
        if self.local_index {
            self.inner.contains_local(ns, key)
        } else {
            None
        }
    }
    async fn put(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Result<Vec<Evicted>> {
        if !self.write_delay.is_zero() {
            tokio::time::sleep(self.write_delay).await;
        }
        self.puts.fetch_add(1, Ordering::Relaxed);
        self.inner.put(ns, key, value, meta).await
    }
    async fn remove(&self, ns: &str, key: &[u8]) -> Result<bool> {
        self.inner.remove(ns, key).await
    }
    async fn remove_namespace(&self, ns: &str) -> Result<u64> {
        self.inner.remove_namespace(ns).await
    }
    async fn set_expiry(&self, ns: &str, key: &[u8], at: Option<u64>) -> Result<bool> {
        self.inner.set_expiry(ns, key, at).await
    }
    async fn meta(&self, ns: &str, key: &[u8]) -> Result<Option<EntryMeta>> {
        self.inner.meta(ns, key).await
    }
    async fn scan(&self, ns: &str, cursor: u64, count: usize) -> Result<ScanPage> {
        self.inner.scan(ns, cursor, count).await
    }
    async fn namespaces(&self) -> Result<Vec<String>> {
        self.inner.namespaces().await
    }
    fn stats(&self) -> TierStats {
        TierStats { tier: Some(self.kind), ..self.inner.stats() }
    }
}

fn cfg(mode: OffloadMode, memory: u64) -> StoreConfig {
    StoreConfig { offload: mode, queue_depth: 64, ..StoreConfig::memory_only(memory) }
}

fn k(i: usize) -> Bytes {
    Bytes::from(format!("k{i:04}"))
}

#[tokio::test]
async fn mode_all_copies_every_write_down() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    let s = Store::with_tiers(cfg(OffloadMode::All, 1 << 20), Some(disk.clone()), None);
    for i in 0..10 {
        s.put("n", k(i), Bytes::from(vec![1; 100]), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert_eq!(disk.puts.load(Ordering::Relaxed), 10);
    assert_eq!(s.stats().offload[0].written, 10);
}

#[tokio::test]
async fn mode_evicted_copies_only_what_memory_drops_and_reads_promote_back() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    // Room for about 4 entries of 100 bytes.
    let s = Store::with_tiers(cfg(OffloadMode::Evicted, 4 * 205), Some(disk.clone()), None);
    let mut rx = s.subscribe();
    for i in 0..10 {
        s.put("n", k(i), Bytes::from(vec![i as u8; 100]), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    let evictions = s.stats().tiers[0].evictions;
    assert!(evictions >= 6, "evictions {evictions}");
    assert_eq!(disk.puts.load(Ordering::Relaxed), evictions, "exactly the evicted entries go down");
    // The oldest entry now lives only below; a read finds it there and promotes it.
    let hit = s.get("n", &k(0)).await.unwrap().unwrap();
    assert_eq!((hit.tier, &hit.value[..]), (TierKind::Disk, &[0u8; 100][..]));
    assert_eq!(s.get("n", &k(0)).await.unwrap().unwrap().tier, TierKind::Memory);
    assert_eq!(s.stats().promotions_from_disk, 1);
    let mut kinds = Vec::new();
    while let Ok(e) = rx.try_recv() {
        kinds.push((e.kind, e.tier));
    }
    assert!(kinds.contains(&(EventKind::Removed, TierKind::Memory)));
    assert!(kinds.contains(&(EventKind::Stored, TierKind::Disk)));
    assert_eq!(s.lookup_local("n", &[k(0), k(1)]).tiers, vec![TierKind::Memory, TierKind::Disk]);
}

/// A value read from below that is too big for the memory tier is not
/// announced as stored in memory, and not written back to the tier it was
/// just read from.
#[tokio::test]
async fn a_promotion_too_big_for_memory_is_not_written_back() {
    let remote = Arc::new(Lower {
        inner: MemoryTier::new(0, PolicyKind::Lru),
        kind: TierKind::Remote,
        write_delay: Duration::ZERO,
        puts: AtomicU64::new(0),
        local_index: false,
    });
    let s = Store::with_tiers(cfg(OffloadMode::Evicted, 1024), None, Some(remote.clone()));
    let big = Bytes::from(vec![7u8; 4096]);
    remote.inner.put("n", k(1), big.clone(), EntryMeta::default()).await.unwrap();
    let mut rx = s.subscribe();
    for _ in 0..3 {
        let hit = s.get("n", &k(1)).await.unwrap().unwrap();
        assert_eq!((hit.tier, hit.value.len()), (TierKind::Remote, big.len()));
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert_eq!(remote.puts.load(Ordering::Relaxed), 0, "read back from where it came from");
    assert_eq!(s.stats().promotions_from_remote, 3);
    while let Ok(e) = rx.try_recv() {
        assert_ne!((e.kind, e.tier), (EventKind::Stored, TierKind::Memory), "never stored in memory");
    }
}

#[tokio::test]
async fn mode_hot_copies_after_enough_reads() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    let s = Store::with_tiers(cfg(OffloadMode::Hot, 1 << 20), Some(disk.clone()), None);
    s.put("n", k(1), Bytes::from_static(b"v"), PutOptions::default()).await.unwrap();
    s.put("n", k(2), Bytes::from_static(b"v"), PutOptions::default()).await.unwrap();
    for _ in 0..3 {
        s.get("n", &k(1)).await.unwrap();
    }
    s.get("n", &k(2)).await.unwrap();
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert_eq!(disk.puts.load(Ordering::Relaxed), 1, "only the key read twice is hot");
    assert!(disk.inner.contains_sync("n", &k(1)));
}

#[tokio::test]
async fn a_full_queue_drops_offloads_and_counts_them_without_blocking_the_writer() {
    let disk = Lower::new(TierKind::Disk, Duration::from_millis(50));
    let s =
        Store::with_tiers(StoreConfig { queue_depth: 4, ..cfg(OffloadMode::All, 64 << 20) }, Some(disk.clone()), None);
    let t = std::time::Instant::now();
    for i in 0..200 {
        s.put("n", k(i), Bytes::from(vec![0; 64]), PutOptions::default()).await.unwrap();
    }
    assert!(t.elapsed() < Duration::from_secs(2), "writes waited on the slow tier: {:?}", t.elapsed());
    let st = s.stats();
    assert!(st.offload[0].dropped > 150, "dropped {}", st.offload[0].dropped);
    assert_eq!(st.offload[0].queued + st.offload[0].dropped, 200);
    // Everything is still readable from memory.
    for i in 0..200 {
        assert!(s.get_cached("n", &k(i)).is_some());
    }
}

#[tokio::test]
async fn values_too_big_for_memory_go_straight_down() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    let s = Store::with_tiers(cfg(OffloadMode::Evicted, 1000), Some(disk.clone()), None);
    let big = Bytes::from(vec![9; 5000]);
    s.put("n", k(1), big.clone(), PutOptions::default()).await.unwrap();
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert!(s.get_cached("n", &k(1)).is_none());
    let hit = s.get("n", &k(1)).await.unwrap().unwrap();
    assert_eq!((hit.tier, hit.value), (TierKind::Disk, big));
}

#[tokio::test]
async fn overwrite_never_leaves_a_stale_copy_below() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    let s = Store::with_tiers(cfg(OffloadMode::Evicted, 3 * 205), Some(disk.clone()), None);
    s.put("n", k(0), Bytes::from(vec![1; 100]), PutOptions::default()).await.unwrap();
    for i in 1..6 {
        s.put("n", k(i), Bytes::from(vec![0; 100]), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert!(disk.inner.contains_sync("n", &k(0)));
    s.put("n", k(0), Bytes::from(vec![2; 100]), PutOptions::default()).await.unwrap();
    for i in 6..12 {
        s.put("n", k(i), Bytes::from(vec![0; 100]), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert_eq!(&s.get("n", &k(0)).await.unwrap().unwrap().value[..], &[2u8; 100][..]);
}

#[tokio::test]
async fn delete_and_lookup_span_all_tiers() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    let remote = Lower::new(TierKind::Remote, Duration::ZERO);
    let s = Store::with_tiers(cfg(OffloadMode::All, 1 << 20), Some(disk.clone()), Some(remote.clone()));
    let keys: Vec<Bytes> = (0..6).map(k).collect();
    for key in &keys[..4] {
        s.put("n", key.clone(), Bytes::from_static(b"v"), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    // Only the remote tier has keys 4 and 5.
    remote.inner.put_sync("n", keys[4].clone(), Bytes::from_static(b"v"), EntryMeta::default());
    let r = s.lookup("n", &keys).await.unwrap();
    assert_eq!(r.matched, 5);
    assert_eq!(r.tiers[4], TierKind::Remote);
    assert!(s.delete("n", &keys[0]).await.unwrap());
    assert!(!disk.inner.contains_sync("n", &keys[0]) && !remote.inner.contains_sync("n", &keys[0]));
    assert_eq!(s.lookup("n", &keys).await.unwrap().matched, 0);
    assert!(s.expire("n", &keys[1], Some(Duration::from_millis(30))).await.unwrap());
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert!(!s.exists("n", &keys[1]).await.unwrap(), "expiry must apply in every tier");
}
