//! One behavioural suite, run unchanged against every tier: memory, disk,
//! disk with zstd + AES-256-GCM, remote over `file://`, and remote over a
//! real S3-compatible server (`s3s-fs`).
//!
//! The cases live once in [`cases`]; [`tier_suite!`] instantiates each of
//! them for a tier constructor.

mod common;

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use bytes::Bytes;
use common::Harness;
use granary_warehouse::types::now_ms;
use granary_warehouse::EntryMeta;

/// Budget of the tiers in the general cases (no eviction expected).
const LARGE: u64 = 256 << 20;
/// Budget of the tiers in the eviction case.
const SMALL: u64 = 64 << 10;

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn m() -> EntryMeta {
    EntryMeta::default()
}

mod cases {
    use super::*;

    pub async fn put_get_overwrite(h: Harness) {
        let t = &h.tier;
        assert!(t.get("ns", b"k").await.unwrap().is_none());
        let meta = EntryMeta { expires_at_ms: None, depth: 5 };
        assert!(t.put("ns", b("k"), b("first"), meta).await.unwrap().is_empty());
        let got = t.get("ns", b"k").await.unwrap().expect("stored value");
        assert_eq!(got.value, b("first"));
        assert_eq!(got.meta.depth, 5);
        assert!(got.hits >= 1);
        t.put("ns", b("k"), b("second, longer than the first"), m()).await.unwrap();
        assert_eq!(t.get("ns", b"k").await.unwrap().unwrap().value, b("second, longer than the first"));
        assert!(t.contains("ns", b"k").await.unwrap());
        assert_ne!(t.contains_local("ns", b"k"), Some(false));
    }

    /// Values come back 16-byte aligned whatever the key's length (the
    /// lower tiers place their read buffers so; the engine then uses a KV
    /// payload in place instead of copying it).
    pub async fn values_are_aligned(h: Harness) {
        let t = &h.tier;
        let value = Bytes::from((0..8192u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
        for len in 1..=9 {
            let key = Bytes::from("k".repeat(len));
            t.put("aligned", key.clone(), value.clone(), m()).await.unwrap();
            let got = t.get("aligned", &key).await.unwrap().expect("stored value").value;
            assert_eq!(got, value);
            assert_eq!(got.as_ptr() as usize % 16, 0, "value of a {len}-byte key at {:p}", got.as_ptr());
        }
    }

    pub async fn remove(h: Harness) {
        let t = &h.tier;
        t.put("ns", b("k"), b("v"), m()).await.unwrap();
        t.put("ns", b("other"), b("w"), m()).await.unwrap();
        assert!(t.remove("ns", b"k").await.unwrap());
        assert!(t.get("ns", b"k").await.unwrap().is_none());
        assert!(!t.contains("ns", b"k").await.unwrap());
        assert!(!t.remove("ns", b"k").await.unwrap(), "second remove finds nothing");
        assert_eq!(t.get("ns", b"other").await.unwrap().unwrap().value, b("w"));
    }

    pub async fn namespace_isolation(h: Harness) {
        let t = &h.tier;
        t.put("tenant-a", b("shared-key"), b("from a"), m()).await.unwrap();
        t.put("tenant-b", b("shared-key"), b("from b"), m()).await.unwrap();
        assert_eq!(t.get("tenant-a", b"shared-key").await.unwrap().unwrap().value, b("from a"));
        assert_eq!(t.get("tenant-b", b"shared-key").await.unwrap().unwrap().value, b("from b"));
        assert!(t.get("tenant-c", b"shared-key").await.unwrap().is_none());
        assert!(t.remove("tenant-a", b"shared-key").await.unwrap());
        assert_eq!(t.get("tenant-b", b"shared-key").await.unwrap().unwrap().value, b("from b"));
    }

    pub async fn remove_namespace(h: Harness) {
        let t = &h.tier;
        for i in 0..5 {
            t.put("gone", Bytes::from(format!("k{i}")), b("v"), m()).await.unwrap();
        }
        for i in 0..2 {
            t.put("kept", Bytes::from(format!("k{i}")), b("v"), m()).await.unwrap();
        }
        assert_eq!(t.remove_namespace("gone").await.unwrap(), 5);
        for i in 0..5 {
            assert!(!t.contains("gone", format!("k{i}").as_bytes()).await.unwrap());
        }
        assert!(t.contains("kept", b"k1").await.unwrap());
        assert_eq!(t.namespaces().await.unwrap(), vec!["kept".to_string()]);
        assert_eq!(t.remove_namespace("gone").await.unwrap(), 0);
    }

    pub async fn non_utf8_keys(h: Harness) {
        let t = &h.tier;
        let keys: Vec<Bytes> = vec![
            Bytes::from_static(b"\xff\xfe\x00\x01"),
            Bytes::from_static(b"\x80"),
            Bytes::from_static(b"/../etc/passwd"),
            Bytes::from_static(b"a\nb\r\0c"),
            Bytes::from(vec![0u8; 300]),
        ];
        for (i, k) in keys.iter().enumerate() {
            t.put("bin", k.clone(), Bytes::from(vec![i as u8; 10 + i]), m()).await.unwrap();
        }
        for (i, k) in keys.iter().enumerate() {
            let got = t.get("bin", k).await.unwrap().unwrap_or_else(|| panic!("key {k:?} lost"));
            assert_eq!(got.value, Bytes::from(vec![i as u8; 10 + i]));
        }
        let page = t.scan("bin", 0, 100).await.unwrap();
        assert_eq!(page.next, 0);
        let found: BTreeSet<Bytes> = page.keys.into_iter().collect();
        assert_eq!(found, keys.into_iter().collect::<BTreeSet<_>>());
    }

    pub async fn large_values(h: Harness) {
        let t = &h.tier;
        let big = Bytes::from(common::noise(4 << 20, 7));
        let mut zeros = vec![0u8; 4 << 20];
        zeros[12345] = 1;
        let zeros = Bytes::from(zeros);
        t.put("big", b("noise"), big.clone(), m()).await.unwrap();
        t.put("big", b("zeros"), zeros.clone(), m()).await.unwrap();
        let got = t.get("big", b"noise").await.unwrap().unwrap().value;
        assert!(got.len() == big.len() && got == big, "4 MiB random value not byte-exact");
        let got = t.get("big", b"zeros").await.unwrap().unwrap().value;
        assert!(got.len() == zeros.len() && got == zeros, "4 MiB sparse value not byte-exact");
    }

    pub async fn expiry(h: Harness) {
        let t = &h.tier;
        let soon = now_ms() + 300;
        t.put("ttl", b("short"), b("v"), EntryMeta { expires_at_ms: Some(soon), depth: 1 }).await.unwrap();
        t.put("ttl", b("long"), b("v"), m()).await.unwrap();
        assert_eq!(t.meta("ttl", b"short").await.unwrap(), Some(EntryMeta { expires_at_ms: Some(soon), depth: 1 }));
        assert!(t.get("ttl", b"short").await.unwrap().is_some());
        // set_expiry on a live key, then clear it.
        let later = now_ms() + 60_000;
        assert!(t.set_expiry("ttl", b"long", Some(later)).await.unwrap());
        assert_eq!(t.meta("ttl", b"long").await.unwrap().unwrap().expires_at_ms, Some(later));
        assert!(t.set_expiry("ttl", b"long", None).await.unwrap());
        assert_eq!(t.meta("ttl", b"long").await.unwrap().unwrap().expires_at_ms, None);
        assert_eq!(t.get("ttl", b"long").await.unwrap().unwrap().value, b("v"), "value survives set_expiry");
        assert!(!t.set_expiry("ttl", b"missing", Some(later)).await.unwrap());
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(t.get("ttl", b"short").await.unwrap().is_none(), "expired entry served");
        assert!(!t.contains("ttl", b"short").await.unwrap());
        assert!(t.meta("ttl", b"short").await.unwrap().is_none());
        assert!(!t.set_expiry("ttl", b"short", None).await.unwrap(), "expired entries cannot be revived");
        let page = t.scan("ttl", 0, 100).await.unwrap();
        assert_eq!(page.keys, vec![b("long")], "scan hides expired keys");
        // Expiry set into the past hides a live entry at once.
        assert!(t.set_expiry("ttl", b"long", Some(now_ms() - 1)).await.unwrap());
        assert!(t.get("ttl", b"long").await.unwrap().is_none());
        let _ = t.purge_expired(100).await.unwrap();
        assert!(t.stats().expirations >= 1 || !h.tracks_size, "{:?}", t.stats());
    }

    pub async fn scan_pages(h: Harness) {
        let t = &h.tier;
        let n = 137;
        let mut want = BTreeSet::new();
        for i in 0..n {
            let k = Bytes::from(format!("key-{i:04}"));
            t.put("scan", k.clone(), b("v"), m()).await.unwrap();
            want.insert(k);
        }
        t.put("elsewhere", b("key-0001"), b("v"), m()).await.unwrap();
        let (mut cursor, mut seen, mut pages) = (0u64, Vec::new(), 0);
        loop {
            let page = t.scan("scan", cursor, 10).await.unwrap();
            pages += 1;
            assert!(page.keys.len() <= 20, "page of {} keys for count 10", page.keys.len());
            seen.extend(page.keys);
            if page.next == 0 {
                break;
            }
            assert!(page.next > cursor, "cursor must advance");
            cursor = page.next;
            assert!(pages < 1000, "scan does not terminate");
        }
        assert!(pages >= n / 20, "expected several pages, got {pages}");
        let unique: HashSet<&Bytes> = seen.iter().collect();
        assert_eq!(unique.len(), seen.len(), "a key was returned twice");
        assert_eq!(seen.into_iter().collect::<BTreeSet<_>>(), want);
        assert!(t.scan("no-such-ns", 0, 10).await.unwrap().keys.is_empty());
    }

    pub async fn namespaces(h: Harness) {
        let t = &h.tier;
        assert!(t.namespaces().await.unwrap().is_empty());
        t.put("beta", b("k"), b("v"), m()).await.unwrap();
        t.put("alpha", b("k1"), b("v"), m()).await.unwrap();
        t.put("alpha", b("k2"), b("v"), m()).await.unwrap();
        assert_eq!(t.namespaces().await.unwrap(), vec!["alpha".to_string(), "beta".to_string()]);
        t.remove("beta", b"k").await.unwrap();
        assert_eq!(t.namespaces().await.unwrap(), vec!["alpha".to_string()]);
    }

    pub async fn stats_counters(h: Harness) {
        let t = &h.tier;
        let s0 = t.stats();
        assert_eq!(s0.tier, Some(t.kind()));
        assert!(t.get("st", b"absent").await.unwrap().is_none());
        let s1 = t.stats();
        assert_eq!(s1.misses, s0.misses + 1);
        assert_eq!(s1.hits, s0.hits);
        t.put("st", b("a"), Bytes::from(vec![1u8; 1000]), m()).await.unwrap();
        t.put("st", b("b"), Bytes::from(vec![2u8; 1000]), m()).await.unwrap();
        t.get("st", b"a").await.unwrap().unwrap();
        t.get("st", b"b").await.unwrap().unwrap();
        let s2 = t.stats();
        assert_eq!(s2.hits, s1.hits + 2);
        assert_eq!(s2.corrupt_dropped, 0);
        if h.tracks_size {
            assert_eq!(s2.entries, s1.entries + 2);
            // Compressing tiers may store less than the 2000 value bytes.
            assert!(s2.bytes > s1.bytes + 100, "bytes {} -> {}", s1.bytes, s2.bytes);
            t.remove("st", b"a").await.unwrap();
            let s3 = t.stats();
            assert_eq!(s3.entries, s2.entries - 1);
            assert!(s3.bytes < s2.bytes);
        } else {
            assert_eq!((s2.entries, s2.bytes, s2.capacity), (0, 0, 0), "an untracked tier reports no totals");
        }
    }

    /// Bounded tiers stay within budget and evict (never a pinned entry);
    /// unbounded ones keep everything.
    pub async fn budget(h: Harness) {
        let t = &h.tier;
        let n = 64;
        let mut evicted = Vec::new();
        t.put("pin", b("pinned"), Bytes::from(vec![9u8; 2000]), m()).await.unwrap();
        assert_eq!(t.pin("pin", b"pinned"), h.bounded);
        for i in 0..n {
            let v = Bytes::from(common::noise(4000, i));
            evicted.extend(t.put("bud", Bytes::from(format!("k{i}")), v, m()).await.unwrap());
            let s = t.stats();
            if h.bounded {
                assert!(s.bytes <= s.capacity, "over budget after put {i}: {} > {}", s.bytes, s.capacity);
            }
        }
        let s = t.stats();
        if h.bounded {
            assert_eq!(s.capacity, super::SMALL);
            assert!(!evicted.is_empty() && s.evictions >= evicted.len() as u64, "{s:?}");
            assert!(s.entries < n + 1);
            assert!(evicted.iter().all(|e| e.key != b("pinned")), "pinned entry evicted");
            assert!(t.get("pin", b"pinned").await.unwrap().is_some());
            // The newest value is always kept; evicted values that come back are the right ones.
            assert_eq!(t.get("bud", format!("k{}", n - 1).as_bytes()).await.unwrap().unwrap().value.len(), 4000);
            for e in &evicted {
                assert!(!t.contains("bud", &e.key).await.unwrap(), "evicted key still present");
                if let Some(v) = &e.value {
                    let i: u64 = std::str::from_utf8(&e.key[1..]).unwrap().parse().unwrap();
                    assert_eq!(v, &Bytes::from(common::noise(4000, i)));
                }
            }
            t.unpin("pin", b"pinned");
            // A value larger than the whole budget is refused and handed back.
            // (Random bytes, so that a compressing tier cannot shrink it into the budget.)
            let huge = Bytes::from(common::noise((super::SMALL + 1) as usize, 99));
            let back = t.put("bud", b("huge"), huge.clone(), m()).await.unwrap();
            assert_eq!(back.len(), 1);
            assert_eq!(back[0].value.as_ref(), Some(&huge));
            assert!(!t.contains("bud", b"huge").await.unwrap());
        } else {
            assert!(evicted.is_empty());
            assert_eq!(s.capacity, 0);
            for i in 0..n {
                assert!(t.contains("bud", format!("k{i}").as_bytes()).await.unwrap());
            }
        }
    }

    pub async fn concurrent(h: Harness) {
        let tasks = 8;
        let per = 16;
        let mut joins = Vec::new();
        for w in 0..tasks {
            let t = h.tier.clone();
            joins.push(tokio::spawn(async move {
                for i in 0..per {
                    let key = Bytes::from(format!("w{w}-k{i}"));
                    let val = Bytes::from(common::noise(3000 + i, (w * 1000 + i) as u64));
                    t.put("conc", key.clone(), val.clone(), m()).await.unwrap();
                    assert_eq!(t.get("conc", &key).await.unwrap().expect("own write").value, val);
                    // Everyone also writes one shared key; any complete value may win.
                    t.put("conc", b("shared"), Bytes::from(vec![w as u8; 5000]), m()).await.unwrap();
                }
            }));
        }
        for j in joins {
            j.await.unwrap();
        }
        for w in 0..tasks {
            for i in 0..per {
                let got = h.tier.get("conc", format!("w{w}-k{i}").as_bytes()).await.unwrap().unwrap();
                assert_eq!(got.value, Bytes::from(common::noise(3000 + i, (w * 1000 + i) as u64)));
            }
        }
        let shared = h.tier.get("conc", b"shared").await.unwrap().unwrap().value;
        assert_eq!(shared.len(), 5000);
        assert!(shared.iter().all(|&x| x == shared[0]), "shared key holds a mix of writes");
        if h.tracks_size {
            assert_eq!(h.tier.stats().entries, (tasks * per + 1) as u64);
        }
    }
}

/// Instantiates every case for one tier; `$make` is an async fn of the
/// budget returning `Option<Harness>` (`None`: the tier is not available here).
macro_rules! tier_suite {
    ($name:ident, $make:expr) => {
        mod $name {
            use super::*;

            async fn tier(capacity: u64) -> Option<Harness> {
                #[allow(clippy::redundant_closure_call)]
                ($make)(capacity).await
            }

            tier_suite!(@cases LARGE; put_get_overwrite, remove, namespace_isolation, remove_namespace,
                non_utf8_keys, large_values, expiry, scan_pages, namespaces, stats_counters, concurrent,
                values_are_aligned);
            tier_suite!(@cases SMALL; budget);
        }
    };
    (@cases $cap:expr; $($case:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(h) = tier($cap).await else { return };
                cases::$case(h).await;
            }
        )*
    };
}

tier_suite!(memory, |c| async move { Some(common::memory(c)) });
tier_suite!(disk, |c| async move { Some(common::disk(c).await) });
tier_suite!(disk_zstd_aes, |c| async move { Some(common::disk_sealed(c).await) });
tier_suite!(remote_file, |c| async move { Some(common::remote_file(c).await) });
tier_suite!(remote_s3, common::remote_s3);
