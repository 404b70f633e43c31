//! The store over lower tiers that take their time: a remote tier of 30 ms
//! a call, which multi-key RESP commands reach concurrently and over which
//! conditional writes and GETDEL stay atomic; and a disk tier that holds an
//! eviction back, over which a deleted key stays deleted.

use super::*;

/// A remote tier that answers each read 30 ms after making it, and records
/// how many of its calls ran at once.
struct SlowRemote {
    inner: granary_warehouse::tier::memory::MemoryTier,
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl SlowRemote {
    async fn slow(&self) {
        let n = self.now.fetch_add(1, Relaxed) + 1;
        self.most.fetch_max(n, Relaxed);
        tokio::time::sleep(Duration::from_millis(30)).await;
        self.now.fetch_sub(1, Relaxed);
    }
}

#[async_trait::async_trait]
impl granary_warehouse::Tier for SlowRemote {
    fn kind(&self) -> granary_warehouse::TierKind {
        granary_warehouse::TierKind::Remote
    }
    // Each call reads at once and answers 30 ms later, as a reply in
    // flight would: what it answers may be stale by the time it arrives.
    async fn get(&self, ns: &str, key: &[u8]) -> granary_warehouse::error::Result<Option<granary_warehouse::Stored>> {
        let r = self.inner.get(ns, key).await;
        self.slow().await;
        r
    }
    async fn contains(&self, ns: &str, key: &[u8]) -> granary_warehouse::error::Result<bool> {
        let r = self.inner.contains(ns, key).await;
        self.slow().await;
        r
    }
    fn contains_local(&self, _ns: &str, _key: &[u8]) -> Option<bool> {
        None
    }
    async fn put(
        &self,
        ns: &str,
        key: bytes::Bytes,
        value: bytes::Bytes,
        meta: granary_warehouse::EntryMeta,
    ) -> granary_warehouse::error::Result<Vec<granary_warehouse::types::Evicted>> {
        self.inner.put(ns, key, value, meta).await
    }
    async fn remove(&self, ns: &str, key: &[u8]) -> granary_warehouse::error::Result<bool> {
        let r = self.inner.remove(ns, key).await;
        self.slow().await;
        r
    }
    async fn remove_namespace(&self, ns: &str) -> granary_warehouse::error::Result<u64> {
        self.inner.remove_namespace(ns).await
    }
    async fn set_expiry(&self, ns: &str, key: &[u8], at: Option<u64>) -> granary_warehouse::error::Result<bool> {
        self.inner.set_expiry(ns, key, at).await
    }
    async fn meta(
        &self,
        ns: &str,
        key: &[u8],
    ) -> granary_warehouse::error::Result<Option<granary_warehouse::EntryMeta>> {
        let r = self.inner.meta(ns, key).await;
        self.slow().await;
        r
    }
    async fn scan(
        &self,
        ns: &str,
        cursor: u64,
        count: usize,
    ) -> granary_warehouse::error::Result<granary_warehouse::ScanPage> {
        self.inner.scan(ns, cursor, count).await
    }
    async fn namespaces(&self) -> granary_warehouse::error::Result<Vec<String>> {
        self.inner.namespaces().await
    }
    fn stats(&self) -> granary_warehouse::TierStats {
        granary_warehouse::TierStats { tier: Some(self.kind()), ..self.inner.stats() }
    }
}

/// 64 cold keys on a 30 ms remote tier: MGET, EXISTS and DEL reach it
/// concurrently (at most 16 at once), not in 64 serial round trips.
#[test]
fn multi_key_commands_reach_a_slow_tier_concurrently() {
    use granary_warehouse::Tier;
    let remote = Arc::new(SlowRemote {
        inner: granary_warehouse::tier::memory::MemoryTier::new(0, granary_warehouse::PolicyKind::Lru),
        now: Default::default(),
        most: Default::default(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let r2 = remote.clone();
    let port = rt.block_on(async move {
        let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("cold{i}").into_bytes()).collect();
        for k in &keys {
            r2.inner.put("default", k.clone().into(), "v".into(), Default::default()).await.unwrap();
        }
        let store = Store::with_tiers(StoreConfig::memory_only(1 << 20), None, Some(r2));
        let ctx = Arc::new(ServerCtx::new(store, Auth::default()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(granary_warehouse::resp::serve(listener, ctx, async {
            let _ = stopped.await;
        }));
        port
    });
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("cold{i}").into_bytes()).collect();
    let with = |cmd: &[u8]| {
        let mut args: Vec<&[u8]> = vec![cmd];
        args.extend(keys.iter().map(|k| &k[..]));
        resp(&args)
    };
    let t = std::time::Instant::now();
    let r = read_until(&mut s, &with(b"EXISTS"), b"\r\n");
    assert_eq!(r, b":64\r\n");
    let exists = t.elapsed();
    let t = std::time::Instant::now();
    let r = read_until(&mut s, &with(b"MGET"), b"$1\r\nv\r\n".repeat(64).as_slice());
    assert!(r.starts_with(b"*64\r\n$1\r\nv\r\n"), "{}", String::from_utf8_lossy(&r));
    let mget = t.elapsed();
    let most = remote.most.load(Relaxed);
    assert!((8..=16).contains(&most), "{most} remote calls at once");
    // 64 serial 30 ms round trips would take 1.9 s each.
    assert!(exists < Duration::from_millis(900) && mget < Duration::from_millis(900), "{exists:?} {mget:?}");
    let r = read_until(&mut s, &with(b"DEL"), b"\r\n");
    assert_eq!(r, b":64\r\n");
    let _ = stop.send(());
    rt.shutdown_timeout(Duration::from_secs(2));
}

/// A store over a fresh [`SlowRemote`] (memory 1 MiB), on its own runtime.
fn slow_store() -> (tokio::runtime::Runtime, Store, Arc<SlowRemote>) {
    let remote = Arc::new(SlowRemote {
        inner: granary_warehouse::tier::memory::MemoryTier::new(0, granary_warehouse::PolicyKind::Lru),
        now: Default::default(),
        most: Default::default(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let store = rt.block_on(async { Store::with_tiers(StoreConfig::memory_only(1 << 20), None, Some(remote.clone())) });
    (rt, store, remote)
}

/// Issue 40: eight concurrent `SET lock <i> NX` with a remote tier: one is
/// stored. Before, each checked the (slow) remote tier for the key before
/// taking the key's lock, and all eight were acknowledged.
#[test]
fn concurrent_set_nx_stores_exactly_one() {
    use granary_warehouse::types::{Condition, PutOptions};
    let (rt, store, _remote) = slow_store();
    let stored = rt.block_on(async {
        let tries = (0..8).map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let opts = PutOptions { condition: Condition::IfAbsent, ..Default::default() };
                store.put("default", "lock".into(), format!("v{i}").into(), opts).await.unwrap()
            })
        });
        futures::future::join_all(tries).await.into_iter().filter(|r| *r.as_ref().unwrap()).count()
    });
    assert_eq!(stored, 1, "SET NX acknowledged {stored} times");
    // And XX over a key that is not there stores nothing, however many.
    let stored = rt.block_on(async {
        let tries = (0..8).map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let opts = PutOptions { condition: Condition::IfPresent, ..Default::default() };
                store.put("default", "absent".into(), format!("v{i}").into(), opts).await.unwrap()
            })
        });
        futures::future::join_all(tries).await.into_iter().filter(|r| *r.as_ref().unwrap()).count()
    });
    assert_eq!(stored, 0);
}

/// Issue 40: GETDEL is one operation. A key held only by the remote tier
/// (a 30 ms read) gets `GETDEL` and, 5 ms in, a `SET` of a new value.
/// Either order is fine: GETDEL answers the old value and the new one
/// stays, or it answers the new one and the key is gone. Before, it
/// answered the old value and deleted the new one.
#[test]
fn getdel_never_answers_one_value_and_removes_another() {
    let (rt, store, remote) = slow_store();
    let (answered, after) = rt.block_on(async {
        use granary_warehouse::Tier;
        remote.inner.put("default", "k".into(), "old".into(), Default::default()).await.unwrap();
        let s2 = store.clone();
        let take = tokio::spawn(async move { s2.take("default", b"k").await.unwrap().map(|h| h.value.to_vec()) });
        tokio::time::sleep(Duration::from_millis(5)).await;
        store.put("default", "k".into(), "new".into(), Default::default()).await.unwrap();
        let answered = take.await.unwrap();
        (answered, store.get("default", b"k").await.unwrap().map(|h| h.value.to_vec()))
    });
    let ok = matches!((answered.as_deref(), after.as_deref()), (Some(b"old"), Some(b"new")) | (Some(b"new"), None));
    assert!(ok, "GETDEL answered {answered:?} and left {after:?}");
}

/// A "disk" tier (a small memory tier reporting itself as the disk) whose
/// `put` holds its answer back, once, after it evicted something, until
/// the test opens the gate: the moment between the disk letting go of a
/// value and the store copying it on to the remote tier.
struct GatedDisk {
    inner: granary_warehouse::tier::memory::MemoryTier,
    paused: tokio::sync::Notify,
    go: tokio::sync::Notify,
    armed: std::sync::atomic::AtomicBool,
    /// The key the held-back put evicted.
    victim: std::sync::Mutex<Option<bytes::Bytes>>,
}

#[async_trait::async_trait]
impl granary_warehouse::Tier for GatedDisk {
    fn kind(&self) -> granary_warehouse::TierKind {
        granary_warehouse::TierKind::Disk
    }
    async fn get(&self, ns: &str, key: &[u8]) -> granary_warehouse::error::Result<Option<granary_warehouse::Stored>> {
        self.inner.get(ns, key).await
    }
    async fn contains(&self, ns: &str, key: &[u8]) -> granary_warehouse::error::Result<bool> {
        self.inner.contains(ns, key).await
    }
    fn contains_local(&self, ns: &str, key: &[u8]) -> Option<bool> {
        self.inner.contains_local(ns, key)
    }
    async fn put(
        &self,
        ns: &str,
        key: bytes::Bytes,
        value: bytes::Bytes,
        meta: granary_warehouse::EntryMeta,
    ) -> granary_warehouse::error::Result<Vec<granary_warehouse::types::Evicted>> {
        let evicted = self.inner.put(ns, key, value, meta).await?;
        if !evicted.is_empty() && self.armed.swap(false, Relaxed) {
            *self.victim.lock().unwrap() = Some(evicted[0].key.clone());
            self.paused.notify_one();
            self.go.notified().await;
        }
        Ok(evicted)
    }
    async fn remove(&self, ns: &str, key: &[u8]) -> granary_warehouse::error::Result<bool> {
        self.inner.remove(ns, key).await
    }
    async fn remove_namespace(&self, ns: &str) -> granary_warehouse::error::Result<u64> {
        self.inner.remove_namespace(ns).await
    }
    async fn set_expiry(&self, ns: &str, key: &[u8], at: Option<u64>) -> granary_warehouse::error::Result<bool> {
        self.inner.set_expiry(ns, key, at).await
    }
    async fn meta(
        &self,
        ns: &str,
        key: &[u8],
    ) -> granary_warehouse::error::Result<Option<granary_warehouse::EntryMeta>> {
        self.inner.meta(ns, key).await
    }
    async fn scan(
        &self,
        ns: &str,
        cursor: u64,
        count: usize,
    ) -> granary_warehouse::error::Result<granary_warehouse::ScanPage> {
        self.inner.scan(ns, cursor, count).await
    }
    async fn namespaces(&self) -> granary_warehouse::error::Result<Vec<String>> {
        self.inner.namespaces().await
    }
    fn stats(&self) -> granary_warehouse::TierStats {
        granary_warehouse::TierStats { tier: Some(self.kind()), ..self.inner.stats() }
    }
}

/// Issue 40: in offload mode `evicted`, a key deleted while the disk's
/// eviction of it is on its way to the remote tier stays deleted. Before,
/// the copy to the remote tier took the key's lock without comparing
/// versions, landed after the DEL's removal there, and brought the key back.
#[test]
fn a_key_deleted_while_its_disk_eviction_is_copied_down_stays_deleted() {
    use granary_warehouse::config::OffloadMode;
    use granary_warehouse::Tier;
    let disk = Arc::new(GatedDisk {
        inner: granary_warehouse::tier::memory::MemoryTier::new(2_500, granary_warehouse::PolicyKind::Lru),
        paused: Default::default(),
        go: Default::default(),
        armed: std::sync::atomic::AtomicBool::new(true),
        victim: Default::default(),
    });
    let remote = Arc::new(SlowRemote {
        inner: granary_warehouse::tier::memory::MemoryTier::new(0, granary_warehouse::PolicyKind::Lru),
        now: Default::default(),
        most: Default::default(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let found = rt.block_on(async {
        let cfg = StoreConfig { offload: OffloadMode::Evicted, ..StoreConfig::memory_only(1_500) };
        let store = Store::with_tiers(cfg, Some(disk.clone()), Some(remote.clone()));
        let value = bytes::Bytes::from(vec![b'v'; 1_000]);
        // Each write evicts the one before from memory onto the disk, which
        // holds two: a later copy there evicts one of the first keys.
        let paused = disk.paused.notified();
        tokio::pin!(paused);
        for i in 0..4 {
            store.put("default", format!("k{i}").into(), value.clone(), Default::default()).await.unwrap();
        }
        tokio::time::timeout(Duration::from_secs(10), &mut paused).await.expect("the disk never evicted");
        let victim = disk.victim.lock().unwrap().clone().unwrap();
        assert!(!disk.inner.contains("default", &victim).await.unwrap(), "the disk let {victim:?} go");
        // DEL lands while the eviction's copy is held back.
        let (s2, v2) = (store.clone(), victim.clone());
        let del = tokio::spawn(async move { s2.delete("default", &v2).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(300)).await;
        disk.go.notify_one();
        tokio::time::timeout(Duration::from_secs(10), del).await.expect("DEL did not finish").unwrap();
        store.flush(Duration::from_secs(10)).await.unwrap();
        (
            store.get("default", &victim).await.unwrap().is_some(),
            remote.inner.contains("default", &victim).await.unwrap(),
        )
    });
    assert_eq!(found, (false, false), "(found by GET, held by the remote tier) after DEL");
}
