//! Store behaviour over the memory tier: TTL, conditions, leases, events, lookup, scan.

use std::time::Duration;

use bytes::Bytes;
use granary_warehouse::{Condition, EventKind, PutOptions, Store, TierKind, Ttl};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

#[tokio::test]
async fn put_get_delete_and_namespaces_are_isolated() {
    let s = Store::memory_only(1 << 20);
    assert!(s.put("a", b("k"), b("va"), PutOptions::default()).await.unwrap());
    s.put("b", b("k"), b("vb"), PutOptions::default()).await.unwrap();
    assert_eq!(s.get("a", b"k").await.unwrap().unwrap().value, b("va"));
    assert_eq!(s.get("b", b"k").await.unwrap().unwrap().value, b("vb"));
    assert!(s.delete("a", b"k").await.unwrap());
    assert!(s.get("a", b"k").await.unwrap().is_none());
    assert!(s.get("b", b"k").await.unwrap().is_some());
    assert_eq!(s.delete_namespace("b").await.unwrap(), 1);
    assert!(!s.exists("b", b"k").await.unwrap());
}

#[tokio::test]
async fn conditions_and_ttl() {
    let s = Store::memory_only(1 << 20);
    let nx = PutOptions { condition: Condition::IfAbsent, ..Default::default() };
    let xx = PutOptions { condition: Condition::IfPresent, ..Default::default() };
    assert!(!s.put("n", b("k"), b("1"), xx.clone()).await.unwrap());
    assert!(s.put("n", b("k"), b("1"), nx.clone()).await.unwrap());
    assert!(!s.put("n", b("k"), b("2"), nx).await.unwrap());
    assert!(s.put("n", b("k"), b("3"), xx).await.unwrap());
    assert_eq!(s.get("n", b"k").await.unwrap().unwrap().value, b("3"));
    assert_eq!(s.ttl("n", b"k").await.unwrap(), Ttl::Persistent);
    assert_eq!(s.ttl("n", b"nope").await.unwrap(), Ttl::Missing);
    s.put("n", b("t"), b("x"), PutOptions { ttl: Some(Duration::from_millis(80)), ..Default::default() })
        .await
        .unwrap();
    assert!(matches!(s.ttl("n", b"t").await.unwrap(), Ttl::Remaining(d) if d <= Duration::from_millis(80)));
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(s.get("n", b"t").await.unwrap().is_none());
    assert!(s.expire("n", b"k", Some(Duration::from_millis(50))).await.unwrap());
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert!(!s.exists("n", b"k").await.unwrap());
}

#[tokio::test]
async fn namespace_default_ttl_applies() {
    let mut cfg = granary_warehouse::StoreConfig::memory_only(1 << 20);
    cfg.namespaces
        .insert("short".into(), granary_warehouse::config::NamespaceConfig { ttl_secs: Some(5), ..Default::default() });
    let s = Store::with_tiers(cfg, None, None);
    s.put("short", b("k"), b("v"), PutOptions::default()).await.unwrap();
    s.put("long", b("k"), b("v"), PutOptions::default()).await.unwrap();
    assert!(
        matches!(s.ttl("short", b"k").await.unwrap(), Ttl::Remaining(d) if d <= Duration::from_secs(5) && d > Duration::from_secs(3))
    );
    assert_eq!(s.ttl("long", b"k").await.unwrap(), Ttl::Persistent);
}

#[tokio::test]
async fn lease_keeps_entry_from_eviction() {
    let s = Store::memory_only(4 * (100 + 2 + 96));
    for i in 0..4 {
        s.put("n", b(&format!("k{i}")), Bytes::from(vec![i; 100]), PutOptions::default()).await.unwrap();
    }
    let lease = s.lease("n", b"k0").await.unwrap().unwrap();
    for i in 4..20 {
        s.put("n", b(&format!("k{i}")), Bytes::from(vec![i; 100]), PutOptions::default()).await.unwrap();
    }
    assert!(s.exists("n", b"k0").await.unwrap(), "leased entry was evicted");
    assert_eq!(&lease[..], &[0u8; 100][..]);
    drop(lease);
    for i in 20..30 {
        s.put("n", b(&format!("k{i}")), Bytes::from(vec![i; 100]), PutOptions::default()).await.unwrap();
    }
    assert!(!s.exists("n", b"k0").await.unwrap(), "released entry should be evictable");
    assert!(s.stats().tiers[0].evictions > 0);
}

#[tokio::test]
async fn events_report_stores_and_removals() {
    let s = Store::memory_only(1 << 20);
    let mut rx = s.subscribe();
    s.put("n", b("k"), b("v"), PutOptions::default()).await.unwrap();
    s.delete("n", b"k").await.unwrap();
    let e1 = rx.recv().await.unwrap();
    let e2 = rx.recv().await.unwrap();
    assert_eq!(
        (e1.kind, e1.tier, e1.namespace.as_str(), &e1.key[..]),
        (EventKind::Stored, TierKind::Memory, "n", &b"k"[..])
    );
    assert_eq!((e2.kind, e2.tier), (EventKind::Removed, TierKind::Memory));
}

#[tokio::test]
async fn lookup_finds_longest_prefix() {
    let s = Store::memory_only(1 << 20);
    let keys: Vec<Bytes> = (0..8).map(|i| b(&format!("h{i}"))).collect();
    for k in &keys[..5] {
        s.put("n", k.clone(), b("v"), PutOptions::default()).await.unwrap();
    }
    s.put("n", keys[6].clone(), b("v"), PutOptions::default()).await.unwrap();
    let r = s.lookup("n", &keys).await.unwrap();
    assert_eq!(r.matched, 5);
    assert_eq!(r.tiers, vec![TierKind::Memory; 5]);
    assert_eq!(s.lookup("other", &keys).await.unwrap().matched, 0);
}

#[tokio::test]
async fn scan_visits_every_key_once() {
    let s = Store::memory_only(64 << 20);
    for i in 0..1000 {
        s.put("n", b(&format!("key:{i}")), b("v"), PutOptions::default()).await.unwrap();
    }
    let (mut cursor, mut seen) = (0, std::collections::HashSet::new());
    loop {
        let page = s.scan("n", cursor, 37).await.unwrap();
        for k in page.keys {
            assert!(seen.insert(k), "key returned twice");
        }
        if page.next == 0 {
            break;
        }
        cursor = page.next;
    }
    assert_eq!(seen.len(), 1000);
    assert_eq!(s.count("n").await.unwrap(), 1000);
}

#[tokio::test]
async fn bad_input_is_rejected_with_the_field_named() {
    let s = Store::memory_only(1 << 20);
    let e = s.put("bad ns", b("k"), b("v"), PutOptions::default()).await.unwrap_err();
    assert!(e.to_string().contains("namespace"), "{e}");
    // The empty key is a key (as in Redis); one past 4096 bytes is not.
    s.put("n", Bytes::new(), b("v"), PutOptions::default()).await.unwrap();
    let e = s.put("n", Bytes::from(vec![b'k'; 4097]), b("v"), PutOptions::default()).await.unwrap_err();
    assert!(e.to_string().contains("key") && e.to_string().contains("4096"), "{e}");
    let mut cfg = granary_warehouse::StoreConfig::memory_only(1 << 20);
    cfg.max_value = granary_core::ByteSize(10);
    let s = Store::with_tiers(cfg, None, None);
    let e = s.put("n", b("k"), Bytes::from(vec![0; 11]), PutOptions::default()).await.unwrap_err();
    assert!(e.to_string().contains("exceeds the limit of 10 bytes"), "{e}");
}

fn quota_cfg(
    memory: u64,
    tenant: &str,
    mem_quota: Option<u64>,
    disk_quota: Option<u64>,
) -> granary_warehouse::StoreConfig {
    use granary_core::ByteSize;
    let mut cfg = granary_warehouse::StoreConfig::memory_only(memory);
    cfg.namespaces.insert(
        tenant.into(),
        granary_warehouse::config::NamespaceConfig {
            memory_quota: mem_quota.map(ByteSize),
            disk_quota: disk_quota.map(ByteSize),
            ..Default::default()
        },
    );
    cfg
}

/// A tenant writing far past its memory quota evicts only its own keys:
/// every key of the other tenant stays, and the tenant stays within its
/// quota. Run on a single-shard memory tier under every policy and on a
/// sharded (256 MiB) one.
#[tokio::test]
async fn a_tenant_filling_its_memory_quota_evicts_only_its_own_keys() {
    use granary_warehouse::PolicyKind::*;
    let cases = [Lru, Lfu, Fifo, S3fifo, Cost].map(|p| (4u64 << 20, 10 << 10, p));
    for (budget, value, policy) in cases.into_iter().chain([(256 << 20, 512 << 10, Lru)]) {
        let quota = budget / 4;
        let mut cfg = quota_cfg(budget, "a", Some(quota), None);
        cfg.memory_policy = policy;
        let s = Store::with_tiers(cfg, None, None);
        // One shared buffer: the tier counts its length, nothing is copied.
        let v = Bytes::from(vec![7u8; value]);
        let b_keys = (budget / 2) as usize / value;
        for i in 0..b_keys {
            s.put("b", format!("b{i}").into(), v.clone(), PutOptions::default()).await.unwrap();
        }
        let a_keys = 6 * budget as usize / value;
        for i in 0..a_keys {
            s.put("a", format!("a{i}").into(), v.clone(), PutOptions::default()).await.unwrap();
        }
        for i in 0..b_keys {
            assert!(
                s.exists("b", format!("b{i}").as_bytes()).await.unwrap(),
                "budget {budget} {policy:?}: b{i} was evicted"
            );
        }
        let (used, entries) = s.memory().namespace_usage("a");
        assert!(
            used <= quota && entries > 0,
            "budget {budget} {policy:?}: a holds {used} bytes over its quota {quota}"
        );
        assert!(s.exists("a", format!("a{}", a_keys - 1).as_bytes()).await.unwrap(), "the newest write was dropped");
        // A value larger than the quota is refused outright (no lower tier: OOM).
        let big = Bytes::from(vec![1u8; quota as usize + 1]);
        assert!(s.put("a", b("big"), big, PutOptions::default()).await.is_err());
        assert_eq!(s.count("b").await.unwrap(), b_keys as u64);
    }
}

/// Issue 40, point 5: quotas were given by namespace name only, so the
/// tenants a gateway creates at run time (each its own namespace) had none,
/// and one of them could fill the tiers. `namespace_defaults` gives every
/// unlisted namespace a quota of its own: each tenant flooding the store
/// evicts its own keys only, on the memory tier and on the disk tier.
#[tokio::test]
async fn every_unlisted_namespace_gets_the_default_quota_of_its_own() {
    use granary_core::ByteSize;
    use granary_warehouse::config::{DiskConfig, NamespaceConfig};
    let dir = tempfile::tempdir().unwrap();
    let budget = 4u64 << 20;
    let mut cfg = granary_warehouse::StoreConfig::memory_only(budget);
    cfg.disk = Some(DiskConfig { dir: dir.path().into(), capacity: ByteSize(8 << 20), policy: Default::default() });
    cfg.namespace_defaults = NamespaceConfig {
        memory_quota: Some(ByteSize(budget / 4)),
        disk_quota: Some(ByteSize(2 << 20)),
        ..Default::default()
    };
    cfg.namespaces.insert("tenant-listed".into(), NamespaceConfig::default());
    // Room to queue every offload of this burst (a full queue drops them).
    cfg.queue_depth = 8192;
    let s = Store::open(cfg).await.unwrap();
    let v = Bytes::from(vec![7u8; 10 << 10]);
    let quiet: Vec<String> = (0..60).map(|i| format!("q{i}")).collect();
    for k in &quiet {
        s.put("tenant-quiet", k.clone().into(), v.clone(), PutOptions::default()).await.unwrap();
    }
    for noisy in ["tenant-noisy", "tenant-loud"] {
        for i in 0..2000 {
            s.put(noisy, format!("n{i}").into(), v.clone(), PutOptions::default()).await.unwrap();
        }
    }
    s.flush(Duration::from_secs(10)).await.unwrap();
    for k in &quiet {
        assert!(s.exists("tenant-quiet", k.as_bytes()).await.unwrap(), "{k} of the quiet tenant was evicted");
    }
    assert_eq!(s.count("tenant-quiet").await.unwrap(), quiet.len() as u64);
    for noisy in ["tenant-noisy", "tenant-loud"] {
        let usage = s.namespace_usage(noisy);
        let (mem, disk) = (&usage[0], &usage[1]);
        assert_eq!((mem.quota, disk.quota), (Some(budget / 4), Some(2 << 20)), "{usage:?}");
        assert!(mem.bytes.unwrap() <= budget / 4 && disk.bytes.unwrap() <= 2 << 20, "{noisy}: {usage:?}");
        assert!(mem.entries.unwrap() > 0 && disk.entries.unwrap() > 0, "{noisy}: {usage:?}");
        assert!(s.exists(noisy, b"n1999").await.unwrap(), "{noisy}'s newest write was dropped");
    }
    // A listed namespace keeps its own settings (here: no quota at all).
    let listed = s.namespace_usage("tenant-listed");
    assert_eq!((listed[0].quota, listed[1].quota), (None, None), "{listed:?}");
}

/// The disk tier's quota, through the tier itself.
#[tokio::test]
async fn a_tenant_filling_its_disk_quota_evicts_only_its_own_files() {
    use granary_warehouse::config::DiskConfig;
    use granary_warehouse::tier::at_rest::AtRest;
    use granary_warehouse::{EntryMeta, Tier};
    let dir = tempfile::tempdir().unwrap();
    let cfg =
        DiskConfig { dir: dir.path().into(), capacity: granary_core::ByteSize(4 << 20), policy: Default::default() };
    let quotas = [("a".to_string(), 1u64 << 20)].into_iter().collect();
    let t =
        granary_warehouse::tier::disk::open_disk_with_quotas(&cfg, AtRest::with_key(None, None), quotas).await.unwrap();
    let v = Bytes::from(vec![3u8; 10 << 10]);
    for i in 0..200 {
        t.put("b", format!("b{i}").into(), v.clone(), EntryMeta::default()).await.unwrap();
    }
    for i in 0..1000 {
        t.put("a", format!("a{i}").into(), v.clone(), EntryMeta::default()).await.unwrap();
    }
    for i in 0..200 {
        assert!(t.contains("b", format!("b{i}").as_bytes()).await.unwrap(), "b{i} was evicted from disk");
    }
    let (used, _) = t.namespace_usage("a").unwrap();
    assert!(used <= 1 << 20, "a holds {used} bytes on disk");
    assert!(t.contains("a", b"a999").await.unwrap());
}

/// The quotas given in the store config reach the tiers `Store::open` builds.
#[tokio::test]
async fn configured_quotas_bind_the_tiers_store_open_builds() {
    use granary_warehouse::config::DiskConfig;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = quota_cfg(2 << 20, "a", Some(256 << 10), Some(512 << 10));
    cfg.disk = Some(DiskConfig {
        dir: dir.path().into(),
        capacity: granary_core::ByteSize(2 << 20),
        policy: Default::default(),
    });
    let s = Store::open(cfg).await.unwrap();
    let v = Bytes::from(vec![9u8; 8 << 10]);
    for i in 0..100 {
        s.put("b", format!("b{i}").into(), v.clone(), PutOptions::default()).await.unwrap();
    }
    for i in 0..600 {
        s.put("a", format!("a{i}").into(), v.clone(), PutOptions::default()).await.unwrap();
    }
    s.flush(Duration::from_secs(10)).await.unwrap();
    let usage = s.namespace_usage("a");
    let (mem, disk) = (&usage[0], &usage[1]);
    assert_eq!((mem.quota, disk.quota), (Some(256 << 10), Some(512 << 10)));
    assert!(mem.bytes.unwrap() <= 256 << 10 && disk.bytes.unwrap() <= 512 << 10, "{usage:?}");
    let b = s.namespace_usage("b");
    assert_eq!((b[0].entries, b[1].entries), (Some(100), Some(100)), "b lost entries: {b:?}");
}
