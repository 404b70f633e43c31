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
use granary_warehouse::WarehouseError;
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

/// One tenant's FLUSHDB leaves every other namespace's values alone: in
/// mode `evicted` they are still written down when memory lets them go.
/// Before, a namespace removal moved every key lock's version on, so each
/// value then in memory, of any namespace, failed the write-back's version
/// check and was dropped (lost) when evicted.
#[tokio::test]
async fn a_flush_of_one_namespace_loses_nothing_of_another() {
    let disk = Lower::new(TierKind::Disk, Duration::ZERO);
    let s = Store::with_tiers(cfg(OffloadMode::Evicted, 4 * 205), Some(disk.clone()), None);
    for i in 0..3 {
        s.put("other", k(i), Bytes::from(vec![i as u8; 100]), PutOptions::default()).await.unwrap();
    }
    s.put("flushed", k(9), Bytes::from(vec![9; 100]), PutOptions::default()).await.unwrap();
    s.delete_namespace("flushed").await.unwrap();
    // More of `other` than memory holds: the first three are evicted now.
    for i in 3..10 {
        s.put("other", k(i), Bytes::from(vec![i as u8; 100]), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();
    for i in 0..10 {
        let hit = s.get("other", &k(i)).await.unwrap();
        assert_eq!(hit.map(|h| h.value.to_vec()), Some(vec![i as u8; 100]), "other/{} was lost", i);
    }
    assert_eq!(s.get("flushed", &k(9)).await.unwrap().map(|h| h.value), None);
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

/// Issue 13: a delete waits for the copy queued before it, so the copy can
/// never land after the delete and bring the key back from below.
#[tokio::test]
async fn set_then_del_never_comes_back_from_below() {
    let disk = Lower::new(TierKind::Disk, Duration::from_millis(40));
    let s = Store::with_tiers(cfg(OffloadMode::All, 1 << 20), Some(disk.clone()), None);
    s.put("n", k(1), Bytes::from_static(b"v1"), PutOptions::default()).await.unwrap();
    assert!(s.delete("n", &k(1)).await.unwrap());
    assert!(s.get("n", &k(1)).await.unwrap().is_none(), "deleted key read back");
    s.flush(Duration::from_secs(5)).await.unwrap();
    assert!(!disk.inner.contains_sync("n", &k(1)), "the queued copy landed after the delete");
    assert!(s.get("n", &k(1)).await.unwrap().is_none(), "deleted key came back from below");
}

/// Issue 13: an expiry applies to a copy still queued for a lower tier, so
/// the copy never lands there without its TTL.
#[tokio::test]
async fn expire_applies_to_a_queued_copy() {
    let disk = Lower::new(TierKind::Disk, Duration::from_millis(40));
    let s = Store::with_tiers(cfg(OffloadMode::All, 1 << 20), Some(disk.clone()), None);
    s.put("n", k(1), Bytes::from_static(b"v1"), PutOptions::default()).await.unwrap();
    assert!(s.expire("n", &k(1), Some(Duration::from_millis(60))).await.unwrap());
    s.flush(Duration::from_secs(5)).await.unwrap();
    let below = disk.inner.meta("n", &k(1)).await.unwrap();
    assert!(below.is_none_or(|m| m.expires_at_ms.is_some()), "the copy below lost its TTL: {below:?}");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(s.get("n", &k(1)).await.unwrap().is_none(), "expired key came back from below");
}

/// Issue 13: `flush` past its deadline is an error, never a silent Ok.
#[tokio::test]
async fn flush_past_its_deadline_is_an_error() {
    let disk = Lower::new(TierKind::Disk, Duration::from_millis(200));
    let s = Store::with_tiers(cfg(OffloadMode::All, 1 << 20), Some(disk.clone()), None);
    for i in 0..4 {
        s.put("n", k(i), Bytes::from_static(b"v"), PutOptions::default()).await.unwrap();
    }
    let err = s.flush(Duration::from_millis(20)).await.unwrap_err();
    assert!(matches!(err, WarehouseError::Timeout { .. }), "{err}");
    s.flush(Duration::from_secs(5)).await.unwrap();
}

/// Issue 13: a value memory cannot take is written below before the
/// answer, even when the offload queue is full; one no tier can take is
/// refused, never acknowledged.
#[tokio::test]
async fn a_value_no_tier_can_take_is_refused_never_acknowledged() {
    let s = Store::memory_only(1000);
    let err = s.put("n", k(1), Bytes::from(vec![1; 5000]), PutOptions::default()).await.unwrap_err();
    assert!(matches!(err, WarehouseError::OutOfMemory { size: 5000 }), "{err}");
    assert!(s.get("n", &k(1)).await.unwrap().is_none());

    let disk = Lower::new(TierKind::Disk, Duration::from_millis(20));
    let s = Store::with_tiers(StoreConfig { queue_depth: 1, ..cfg(OffloadMode::All, 1000) }, Some(disk.clone()), None);
    // Fill the queue with small copies, then write values only the disk can hold.
    for i in 0..4 {
        s.put("n", k(100 + i), Bytes::from(vec![0; 10]), PutOptions::default()).await.unwrap();
    }
    for i in 0..4 {
        let v = Bytes::from(vec![i as u8; 5000]);
        s.put("n", k(i), v.clone(), PutOptions::default()).await.unwrap();
        let hit = s.get("n", &k(i)).await.unwrap().expect("acknowledged value is stored somewhere");
        assert_eq!(hit.value, v);
    }
}

/// Issue 13: a value larger than one memory shard's share of the budget
/// is still held in memory.
#[tokio::test]
async fn a_value_larger_than_a_shard_share_stays_in_memory() {
    // 128 MiB: two shards of 64 MiB.
    let s = Store::memory_only(128 << 20);
    let v = Bytes::from(vec![3u8; 80 << 20]);
    s.put("n", k(1), v.clone(), PutOptions::default()).await.unwrap();
    assert_eq!(s.get_cached("n", &k(1)).map(|b| b.len()), Some(v.len()));
    // Room is taken from the other shard, never past the budget.
    for i in 2..40 {
        s.put("n", k(i), Bytes::from(vec![0; 1 << 20]), PutOptions::default()).await.unwrap();
    }
    assert!(s.stats().tiers[0].bytes <= 128 << 20);
}

/// Issue 13: with no memory tier (LMCache's `LMCACHE_LOCAL_CPU=false`) a
/// write is below when acknowledged, so a read right after finds it.
#[tokio::test]
async fn no_memory_tier_writes_straight_to_the_next_tier() {
    let disk = Lower::new(TierKind::Disk, Duration::from_millis(30));
    let c = StoreConfig { memory_tier: false, ..cfg(OffloadMode::All, 1 << 20) };
    let s = Store::with_tiers(c, Some(disk.clone()), None);
    for i in 0..3 {
        s.put("n", k(i), Bytes::from(vec![i as u8; 100]), PutOptions::default()).await.unwrap();
        assert!(disk.inner.contains_sync("n", &k(i)), "acknowledged before the next tier held it");
        let hit = s.get("n", &k(i)).await.unwrap().expect("read right after the write");
        assert_eq!(hit.tier, TierKind::Disk);
    }
    assert_eq!(s.stats().tiers[0].entries, 0, "nothing in memory");
    assert!(s.get_cached("n", &k(0)).is_none());
    let open = Store::open(StoreConfig { memory_tier: false, ..StoreConfig::default() }).await;
    assert!(open.is_err(), "no memory tier and nothing below must not open");
}

/// What a client knows of one of its keys.
#[derive(Clone, Default)]
struct Model {
    value: Option<Bytes>,
    /// Earliest and latest moment the TTL can end (ms, the store's clock).
    expiry: Option<(u64, u64)>,
}

/// Clock slack around TTL edges (a loaded host delays the client's reads).
const SLACK_MS: u64 = 25;

/// One client's random history on the keys it owns, each read checked
/// against the sequential model of its key.
async fn client_history(s: Store, mode: OffloadMode, client: usize, seed: u64) -> (usize, Vec<(Bytes, Model)>) {
    use granary_warehouse::types::now_ms;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut model = vec![Model::default(); 4];
    let mut checked = 0;
    for step in 0..250 {
        let j = rng.random_range(0..model.len());
        let key = Bytes::from(format!("c{client}-k{j}"));
        let m = &mut model[j];
        let ctx = format!("mode {mode:?} client {client} key {j} step {step}");
        match rng.random_range(0..10) {
            0..=3 => {
                let mut v = format!("{client}:{j}:{step}:").into_bytes();
                v.resize(rng.random_range(100..1500), b'.');
                let ttl = rng.random_bool(0.2).then(|| Duration::from_millis(rng.random_range(20..60)));
                let t0 = now_ms();
                s.put("h", key, Bytes::from(v.clone()), PutOptions { ttl, ..Default::default() }).await.unwrap();
                let t1 = now_ms();
                *m = Model {
                    value: Some(Bytes::from(v)),
                    expiry: ttl.map(|d| (t0 + d.as_millis() as u64, t1 + d.as_millis() as u64)),
                };
            }
            4 => {
                s.delete("h", &key).await.unwrap();
                *m = Model::default();
            }
            5 => {
                let d = rng.random_range(20..60u64);
                let t0 = now_ms();
                let found = s.expire("h", &key, Some(Duration::from_millis(d))).await.unwrap();
                let t1 = now_ms();
                let gone = m.value.is_none() || m.expiry.is_some_and(|(_, late)| late + SLACK_MS < t0);
                assert!(!(found && gone), "{ctx}: EXPIRE found a key that was deleted or expired");
                let live = m.value.is_some() && m.expiry.is_none_or(|(early, _)| early > t1 + SLACK_MS);
                assert!(found || !live || mode != OffloadMode::All, "{ctx}: EXPIRE missed a live key in mode all");
                if found {
                    m.expiry = Some((t0 + d, t1 + d));
                } else {
                    *m = Model::default();
                }
            }
            _ => {
                let t0 = now_ms();
                let got = s.get("h", &key).await.unwrap().map(|h| h.value);
                let t1 = now_ms();
                checked += 1;
                match (&m.value, &got) {
                    (None, Some(v)) => {
                        panic!("{ctx}: a deleted or expired key came back: {:?}", String::from_utf8_lossy(&v[..16]))
                    }
                    (Some(want), Some(v)) => {
                        assert!(v == want, "{ctx}: stale read: {:?}", String::from_utf8_lossy(&v[..16]));
                        let late = m.expiry.is_some_and(|(_, late)| late + SLACK_MS < t0);
                        assert!(!late, "{ctx}: read after its TTL ended (TTL lost)");
                    }
                    (Some(_), None) => {
                        let may_have_expired = m.expiry.is_some_and(|(early, _)| early <= t1 + SLACK_MS);
                        if may_have_expired {
                            *m = Model::default();
                        } else {
                            assert!(mode != OffloadMode::All, "{ctx}: acknowledged write lost in mode all");
                        }
                    }
                    (None, None) => {}
                }
            }
        }
    }
    let keys = (0..model.len()).map(|j| Bytes::from(format!("c{client}-k{j}")));
    (checked, keys.zip(model).collect())
}

/// Issue 13: several concurrent clients run random SET/DEL/EXPIRE/GET on a
/// small key set, in every offload mode, over a real disk tier with a
/// memory budget small enough to evict all the time. Checked against a
/// sequential model per key: no key comes back after an acknowledged DEL,
/// no TTL is lost, no read returns an older value than the last write (and
/// in mode `all`, no acknowledged write is lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_history_matches_a_sequential_model() {
    for (round, mode) in [OffloadMode::All, OffloadMode::Hot, OffloadMode::Evicted].into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let c = StoreConfig {
            offload: mode,
            hot_threshold: 1,
            disk: Some(granary_warehouse::config::DiskConfig {
                dir: dir.path().to_path_buf(),
                capacity: granary_core::ByteSize::mib(64),
                policy: PolicyKind::Lru,
            }),
            ..StoreConfig::memory_only(6 * 1024)
        };
        let disk = Arc::new(
            granary_warehouse::tier::disk::open_disk(
                c.disk.as_ref().unwrap(),
                granary_warehouse::tier::at_rest::AtRest::with_key(None, None),
            )
            .await
            .unwrap(),
        );
        let c2 = c.clone();
        let s = Store::with_tiers(c, Some(disk.clone()), None);
        let clients: Vec<_> = (0..4)
            .map(|client| tokio::spawn(client_history(s.clone(), mode, client, 1000 * round as u64 + client as u64)))
            .collect();
        let (mut checked, mut models) = (0, Vec::new());
        for c in clients {
            let (n, m) = c.await.unwrap();
            checked += n;
            models.extend(m);
        }
        // At rest, in mode all, the disk holds exactly what the clients last
        // wrote: no copy landed out of order, none was lost or resurrected.
        s.flush(Duration::from_secs(10)).await.unwrap();
        if mode == OffloadMode::All {
            let now = granary_warehouse::types::now_ms();
            for (key, m) in &models {
                if m.expiry.is_some_and(|(early, _)| early <= now + SLACK_MS) {
                    continue;
                }
                let below = disk.get("h", key).await.unwrap().map(|h| h.value);
                assert_eq!(below, m.value, "disk disagrees with the last write of {key:?}");
            }
        }
        assert!(checked > 300, "too few reads checked: {checked}");
        assert!(s.stats().tiers[0].evictions > 50, "memory pressure expected: {:?}", s.stats().tiers[0]);
        if mode == OffloadMode::All {
            // Restart: a store reopened on the same directory serves each
            // key's last write (or nothing), never an older one.
            drop((s, disk));
            let s = Store::open(c2.clone()).await.unwrap();
            let now = granary_warehouse::types::now_ms();
            for (key, m) in &models {
                if m.expiry.is_some_and(|(early, _)| early <= now + SLACK_MS) {
                    continue;
                }
                let got = s.get("h", key).await.unwrap().map(|h| h.value);
                assert_eq!(got, m.value, "after a restart, {key:?} is not its last write");
            }
        }
    }
}

/// Issue 13: every way an entry leaves a tier publishes `removed` with
/// that tier: expiry, delete, namespace flush, corrupt drop, stale-copy
/// removal and eviction.
#[tokio::test]
async fn every_removal_is_announced_with_its_tier() {
    let dir = tempfile::tempdir().unwrap();
    let dcfg = granary_warehouse::config::DiskConfig {
        dir: dir.path().to_path_buf(),
        capacity: granary_core::ByteSize::mib(64),
        policy: PolicyKind::Lru,
    };
    let disk = Arc::new(
        granary_warehouse::tier::disk::open_disk(&dcfg, granary_warehouse::tier::at_rest::AtRest::with_key(None, None))
            .await
            .unwrap(),
    );
    // Write-back mode: only durable puts reach the disk, so the test decides what is there.
    let s = Store::with_tiers(cfg(OffloadMode::Evicted, 16 * 1024), Some(disk.clone()), None);
    let mut rx = s.subscribe();
    let durable = PutOptions { durable: true, ..Default::default() };
    let v = || Bytes::from(vec![7u8; 100]);

    let ttl = PutOptions { ttl: Some(Duration::from_millis(40)), durable: true, ..Default::default() };
    s.put("n", b_("exp"), v(), ttl).await.unwrap();
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert!(s.get("n", b"exp").await.unwrap().is_none());

    s.put("n", b_("del"), v(), durable.clone()).await.unwrap();
    assert!(s.delete("n", b"del").await.unwrap());

    s.put("other", b_("f1"), v(), durable.clone()).await.unwrap();
    assert_eq!(s.delete_namespace("other").await.unwrap(), 2);

    s.put("n", b_("bad"), v(), durable.clone()).await.unwrap();
    s.memory().remove_sync("n", b"bad");
    let path = disk.entry_path("n", b"bad");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    assert!(s.get("n", b"bad").await.unwrap().is_none());

    s.put("n", b_("stale"), v(), durable.clone()).await.unwrap();
    s.put("n", b_("stale"), Bytes::from_static(b"newer"), PutOptions::default()).await.unwrap();
    s.flush(Duration::from_secs(5)).await.unwrap();

    for i in 0..400 {
        s.put("ev", k(i), v(), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(5)).await.unwrap();

    let mut removed = std::collections::HashSet::new();
    while let Ok(e) = rx.try_recv() {
        if e.kind == EventKind::Removed {
            removed.insert((e.tier, e.namespace, String::from_utf8_lossy(&e.key).into_owned()));
        }
    }
    let want = [
        (TierKind::Memory, "n", "exp"),
        (TierKind::Disk, "n", "exp"),
        (TierKind::Memory, "n", "del"),
        (TierKind::Disk, "n", "del"),
        (TierKind::Memory, "other", "f1"),
        (TierKind::Disk, "other", "f1"),
        (TierKind::Disk, "n", "bad"),
        (TierKind::Disk, "n", "stale"),
        (TierKind::Memory, "ev", "k0000"),
    ];
    for (tier, ns, key) in want {
        assert!(removed.contains(&(tier, ns.to_string(), key.to_string())), "no `removed` for {tier} {ns}/{key}");
    }
}

fn b_(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Issue 13: a copy that expires while queued still removes the older copy
/// below, which would otherwise be read once the newer value expired.
#[tokio::test]
async fn a_copy_expired_in_the_queue_still_clears_the_older_copy() {
    let disk = Lower::new(TierKind::Disk, Duration::from_millis(20));
    let s = Store::with_tiers(cfg(OffloadMode::All, 1 << 20), Some(disk.clone()), None);
    s.put("n", k(1), Bytes::from_static(b"old"), PutOptions::default()).await.unwrap();
    s.flush(Duration::from_secs(5)).await.unwrap();
    // Keep every lane busy for a while (32 keys over 4 lanes, 20 ms each).
    for i in 100..132 {
        s.put("n", k(i), Bytes::from_static(b"x"), PutOptions::default()).await.unwrap();
    }
    let short = PutOptions { ttl: Some(Duration::from_millis(30)), ..Default::default() };
    s.put("n", k(1), Bytes::from_static(b"new"), short).await.unwrap();
    s.flush(Duration::from_secs(5)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(40)).await;
    let got = s.get("n", &k(1)).await.unwrap().map(|h| h.value);
    assert_eq!(got, None, "an older value came back after the newer one expired");
}

/// Issue 13: a subscriber that applies the events in order ends with
/// exactly the store's contents, tier by tier, after concurrent clients
/// wrote, deleted and read a shared key set under memory and disk pressure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribers_view_equals_the_store_after_a_randomized_run() {
    use rand::{Rng, SeedableRng};
    use tokio::sync::broadcast::error::TryRecvError;
    for (round, mode) in [OffloadMode::All, OffloadMode::Hot, OffloadMode::Evicted].into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let dcfg = granary_warehouse::config::DiskConfig {
            dir: dir.path().to_path_buf(),
            capacity: granary_core::ByteSize::kib(5),
            policy: PolicyKind::Lru,
        };
        let at_rest = granary_warehouse::tier::at_rest::AtRest::with_key(None, None);
        let disk = Arc::new(granary_warehouse::tier::disk::open_disk(&dcfg, at_rest).await.unwrap());
        let c = StoreConfig { offload: mode, hot_threshold: 1, ..StoreConfig::memory_only(4 * 1024) };
        let s = Store::with_tiers(c, Some(disk.clone()), None);
        let mut rx = s.subscribe();
        let clients: Vec<_> = (0..4u64)
            .map(|client| {
                let s = s.clone();
                tokio::spawn(async move {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(100 * round as u64 + client);
                    for _ in 0..300 {
                        let key = Bytes::from(format!("k{}", rng.random_range(0..12)));
                        match rng.random_range(0..10) {
                            0..=5 => {
                                let v = Bytes::from(vec![client as u8; rng.random_range(100..1500)]);
                                s.put("v", key, v, PutOptions::default()).await.unwrap();
                            }
                            6 | 7 => {
                                s.delete("v", &key).await.unwrap();
                            }
                            _ => {
                                s.get("v", &key).await.unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        for c in clients {
            c.await.unwrap();
        }
        s.flush(Duration::from_secs(10)).await.unwrap();
        let mut view = std::collections::HashMap::new();
        loop {
            match rx.try_recv() {
                Ok(e) => {
                    view.insert((e.tier, e.key), e.kind == EventKind::Stored);
                }
                Err(TryRecvError::Empty) => break,
                Err(e) => panic!("subscriber fell behind: {e}"),
            }
        }
        let seen: std::collections::BTreeSet<_> =
            view.into_iter().filter(|(_, present)| *present).map(|(k, _)| k).collect();
        let mut held = std::collections::BTreeSet::new();
        for k in s.memory().scan("v", 0, 100_000).await.unwrap().keys {
            held.insert((TierKind::Memory, k));
        }
        for k in disk.scan("v", 0, 100_000).await.unwrap().keys {
            held.insert((TierKind::Disk, k));
        }
        assert_eq!(seen, held, "mode {mode:?}: the event view differs from the store");
        if mode != OffloadMode::Hot {
            assert!(disk.stats().evictions > 20, "disk pressure expected: {:?}", disk.stats());
        }
    }
}
