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
    cfg.namespaces.insert("short".into(), granary_warehouse::config::NamespaceConfig { ttl_secs: Some(5) });
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
    let e = s.put("n", Bytes::new(), b("v"), PutOptions::default()).await.unwrap_err();
    assert!(e.to_string().contains("key"), "{e}");
    let mut cfg = granary_warehouse::StoreConfig::memory_only(1 << 20);
    cfg.max_value = granary_core::ByteSize(10);
    let s = Store::with_tiers(cfg, None, None);
    let e = s.put("n", b("k"), Bytes::from(vec![0; 11]), PutOptions::default()).await.unwrap_err();
    assert!(e.to_string().contains("exceeds the limit of 10 bytes"), "{e}");
}
