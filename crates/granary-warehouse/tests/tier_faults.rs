//! Faults the persistent tiers must survive: flipped and truncated files,
//! restarts with torn and foreign files, encryption at rest (nothing in the
//! clear, wrong keys), and two nodes sharing one remote tier.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use granary_core::ByteSize;
use granary_warehouse::config::{DiskConfig, RemoteConfig};
use granary_warehouse::tier::at_rest::AtRest;
use granary_warehouse::tier::disk::{open_disk, DiskTier};
use granary_warehouse::tier::remote::{open_remote, RemoteTier};
use granary_warehouse::{EntryMeta, PolicyKind, PutOptions, Store, StoreConfig, Tier, TierKind};

const MARKER: &[u8] = b"PLAINTEXT-MARKER-7f3a9c";

fn m() -> EntryMeta {
    EntryMeta::default()
}

fn disk_cfg(dir: &Path) -> DiskConfig {
    DiskConfig { dir: dir.to_path_buf(), capacity: ByteSize::mib(256), policy: PolicyKind::Lru }
}

async fn disk_at(dir: &Path, at_rest: AtRest) -> DiskTier {
    open_disk(&disk_cfg(dir), at_rest).await.unwrap()
}

async fn remote_at(dir: &Path, at_rest: AtRest) -> RemoteTier {
    open_remote(&RemoteConfig { url: common::file_url(dir), options: HashMap::new() }, at_rest).await.unwrap()
}

/// The file behind a `file://` remote object.
fn object_file(t: &RemoteTier, ns: &str, key: &[u8]) -> PathBuf {
    PathBuf::from("/").join(t.object_path(ns, key).as_ref())
}

fn flip_byte(path: &Path, at: usize) {
    let mut b = std::fs::read(path).unwrap();
    let at = at.min(b.len() - 1);
    b[at] ^= 0x01;
    std::fs::write(path, b).unwrap();
}

fn truncate(path: &Path) {
    let len = std::fs::metadata(path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len / 2).unwrap();
}

enum Damage {
    Flip,
    Truncate,
}

async fn damaged_entry_is_dropped(t: &dyn Tier, file: PathBuf, damage: Damage) {
    let value = Bytes::from(common::noise(100_000, 3));
    t.put("ns", Bytes::from_static(b"victim"), value.clone(), m()).await.unwrap();
    t.put("ns", Bytes::from_static(b"bystander"), value.clone(), m()).await.unwrap();
    t.flush().await.unwrap();
    assert!(file.is_file(), "expected the entry at {}", file.display());
    match damage {
        Damage::Flip => flip_byte(&file, 50_000),
        Damage::Truncate => truncate(&file),
    }
    assert!(t.get("ns", b"victim").await.unwrap().is_none(), "damaged entry served");
    assert_eq!(t.stats().corrupt_dropped, 1);
    assert!(!file.exists(), "damaged file left behind");
    assert!(!t.contains("ns", b"victim").await.unwrap());
    assert!(t.get("ns", b"victim").await.unwrap().is_none());
    assert_eq!(t.stats().corrupt_dropped, 1, "counted once");
    assert_eq!(t.get("ns", b"bystander").await.unwrap().unwrap().value, value);
}

#[tokio::test]
async fn disk_flipped_byte_is_dropped() {
    for at_rest in [AtRest::default(), AtRest::with_key(Some(1), Some(common::TEST_KEY))] {
        let dir = tempfile::tempdir().unwrap();
        let t = disk_at(dir.path(), at_rest).await;
        let file = t.entry_path("ns", b"victim");
        damaged_entry_is_dropped(&t, file, Damage::Flip).await;
        assert_eq!(t.contains_local("ns", b"victim"), Some(false));
    }
}

#[tokio::test]
async fn disk_truncated_file_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let t = disk_at(dir.path(), AtRest::default()).await;
    let file = t.entry_path("ns", b"victim");
    damaged_entry_is_dropped(&t, file, Damage::Truncate).await;
}

/// The remote tier is shared: an object that fails verification on this
/// node is not served, is counted, and stays where it is, byte for byte.
async fn damaged_object_is_skipped_and_kept(t: &dyn Tier, file: PathBuf, damage: Damage) {
    let value = Bytes::from(common::noise(100_000, 3));
    t.put("ns", Bytes::from_static(b"victim"), value.clone(), m()).await.unwrap();
    t.put("ns", Bytes::from_static(b"bystander"), value.clone(), m()).await.unwrap();
    assert!(file.is_file(), "expected the entry at {}", file.display());
    match damage {
        Damage::Flip => flip_byte(&file, 50_000),
        Damage::Truncate => truncate(&file),
    }
    let damaged = std::fs::read(&file).unwrap();
    assert!(t.get("ns", b"victim").await.unwrap().is_none(), "damaged entry served");
    assert_eq!(t.stats().verify_failed, 1);
    // (`contains` reads the head only, which this damage leaves intact.)
    assert!(t.get("ns", b"victim").await.unwrap().is_none(), "damaged entry served on a second read");
    assert_eq!(t.stats().verify_failed, 2, "each failed read counts");
    assert_eq!(std::fs::read(&file).unwrap(), damaged, "a shared object was deleted or changed");
    assert_eq!(t.stats().corrupt_dropped, 0);
    assert_eq!(t.get("ns", b"bystander").await.unwrap().unwrap().value, value);
}

#[tokio::test]
async fn remote_flipped_byte_is_skipped_not_deleted() {
    for at_rest in [AtRest::default(), AtRest::with_key(None, Some(common::TEST_KEY))] {
        let dir = tempfile::tempdir().unwrap();
        let t = remote_at(dir.path(), at_rest).await;
        let file = object_file(&t, "ns", b"victim");
        damaged_object_is_skipped_and_kept(&t, file, Damage::Flip).await;
    }
}

#[tokio::test]
async fn remote_truncated_object_is_skipped_not_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let t = remote_at(dir.path(), AtRest::default()).await;
    let file = object_file(&t, "ns", b"victim");
    damaged_object_is_skipped_and_kept(&t, file, Damage::Truncate).await;
}

#[tokio::test]
async fn remote_empty_object_reads_as_unverified() {
    let dir = tempfile::tempdir().unwrap();
    let t = remote_at(dir.path(), AtRest::default()).await;
    t.put("ns", Bytes::from_static(b"e"), Bytes::from_static(b"v"), m()).await.unwrap();
    let file = object_file(&t, "ns", b"e");
    std::fs::write(&file, b"").unwrap();
    // The ranged head read of an empty object fails inside the store; the
    // tier recognises it by the object's size, not by the error's text.
    assert!(!t.contains("ns", b"e").await.unwrap());
    assert!(t.meta("ns", b"e").await.unwrap().is_none());
    assert_eq!(t.stats().errors, 0, "an empty object is not an I/O error");
    assert!(t.stats().verify_failed >= 1);
    assert!(file.exists());
}

#[tokio::test]
async fn remote_object_swapped_under_another_name_is_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let t = remote_at(dir.path(), AtRest::default()).await;
    t.put("ns", Bytes::from_static(b"a"), Bytes::from_static(b"value of a"), m()).await.unwrap();
    t.put("ns", Bytes::from_static(b"b"), Bytes::from_static(b"value of b"), m()).await.unwrap();
    std::fs::copy(object_file(&t, "ns", b"a"), object_file(&t, "ns", b"b")).unwrap();
    assert!(t.get("ns", b"b").await.unwrap().is_none(), "a's record served as b");
    assert!(!t.contains("ns", b"b").await.unwrap());
    assert_eq!(t.stats().verify_failed, 2);
    assert!(object_file(&t, "ns", b"b").exists(), "the object was deleted");
    assert_eq!(&t.get("ns", b"a").await.unwrap().unwrap().value[..], b"value of a");
}

#[tokio::test]
async fn disk_recovers_after_restart() {
    for at_rest in [AtRest::default(), AtRest::with_key(Some(3), Some(common::TEST_KEY))] {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<(Bytes, Bytes)> = (0..6u64)
            .map(|i| {
                (Bytes::from(format!("key-{i}\u{00e9}")), Bytes::from(common::noise(1000 + 300_000 * i as usize, i)))
            })
            .collect();
        let soon = granary_warehouse::types::now_ms() + 200;
        let (truncated, swapped) = {
            let t = disk_at(dir.path(), at_rest.clone()).await;
            for (k, v) in &values {
                t.put("ns", k.clone(), v.clone(), EntryMeta { expires_at_ms: None, depth: 3 }).await.unwrap();
            }
            t.put("ns", Bytes::from_static(b"\xffbinary"), Bytes::from_static(b"bin"), m()).await.unwrap();
            t.put(
                "ns",
                Bytes::from_static(b"ttl"),
                Bytes::from_static(b"x"),
                EntryMeta { expires_at_ms: Some(soon), depth: 0 },
            )
            .await
            .unwrap();
            t.flush().await.unwrap();
            // Damage: one entry cut short, one overwritten by another entry's file.
            let truncated = t.entry_path("ns", &values[4].0);
            truncate(&truncated);
            let swapped = t.entry_path("ns", &values[5].0);
            std::fs::copy(t.entry_path("ns", &values[0].0), &swapped).unwrap();
            (truncated, swapped)
        };
        // A torn write and a garbage file under a valid-looking name.
        let sub = dir.path().join("ab");
        let tmp = sub.join(".ab0123456789abcdef0123456789abcd.1.7.tmp");
        std::fs::write(&tmp, b"half a record").unwrap();
        let garbage = sub.join("ab0123456789abcdef0123456789abcd");
        std::fs::write(&garbage, common::noise(5000, 1)).unwrap();
        let empty = dir.path().join("cd").join("cd0123456789abcdef0123456789abcd");
        std::fs::write(&empty, b"").unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;

        let t = disk_at(dir.path(), at_rest.clone()).await;
        let s = t.stats();
        assert_eq!(s.recovered, 5, "{s:?}");
        assert_eq!(s.corrupt_dropped, 4, "truncated, swapped, garbage, empty: {s:?}");
        assert_eq!(s.torn_removed, 1, "{s:?}");
        assert_eq!(s.expirations, 1, "expired entry dropped at start: {s:?}");
        assert_eq!(s.entries, 5);
        for p in [&tmp, &garbage, &empty, &truncated, &swapped] {
            assert!(!p.exists(), "{} left behind", p.display());
        }
        for (k, v) in &values[..4] {
            let got = t.get("ns", k).await.unwrap().unwrap_or_else(|| panic!("{k:?} not recovered"));
            assert!(got.value == *v, "recovered value differs");
            assert_eq!(got.meta.depth, 3);
        }
        assert_eq!(&t.get("ns", b"\xffbinary").await.unwrap().unwrap().value[..], b"bin");
        assert!(t.get("ns", &values[4].0).await.unwrap().is_none());
        assert!(t.get("ns", &values[5].0).await.unwrap().is_none());
        let mut keys = t.scan("ns", 0, 100).await.unwrap().keys;
        keys.sort();
        assert_eq!(keys.len(), 5);
        assert_eq!(t.namespaces().await.unwrap(), vec!["ns".to_string()]);
        // The recovered tier keeps working.
        t.put("ns", values[4].0.clone(), values[4].1.clone(), m()).await.unwrap();
        assert_eq!(t.get("ns", &values[4].0).await.unwrap().unwrap().value, values[4].1);
    }
}

#[tokio::test]
async fn disk_recovery_enforces_a_smaller_budget() {
    let dir = tempfile::tempdir().unwrap();
    {
        let t = disk_at(dir.path(), AtRest::default()).await;
        for i in 0..10u64 {
            t.put("ns", Bytes::from(format!("k{i}")), Bytes::from(common::noise(10_000, i)), m()).await.unwrap();
        }
        t.flush().await.unwrap();
    }
    let cfg = DiskConfig { capacity: ByteSize(45_000), ..disk_cfg(dir.path()) };
    let t = open_disk(&cfg, AtRest::default()).await.unwrap();
    let s = t.stats();
    assert_eq!(s.recovered, 10);
    assert!(s.bytes <= 45_000 && s.entries == 4 && s.evictions == 6, "{s:?}");
    assert_eq!(common::files_under(dir.path()).len(), 4);
}

fn contains_marker(files: &[PathBuf]) -> bool {
    files.iter().any(|f| std::fs::read(f).unwrap().windows(MARKER.len()).any(|w| w == MARKER))
}

async fn store_marked(t: &dyn Tier) {
    for i in 0..4u64 {
        let mut key = MARKER.to_vec();
        key.extend_from_slice(format!("-{i}").as_bytes());
        let mut value = common::noise(50_000, i);
        value[1000..1000 + MARKER.len()].copy_from_slice(MARKER);
        value.extend_from_slice(MARKER);
        t.put("secret", Bytes::from(key), Bytes::from(value), m()).await.unwrap();
    }
    t.flush().await.unwrap();
}

#[tokio::test]
async fn encryption_leaves_no_plaintext_on_disk_or_remote() {
    for encrypted in [false, true] {
        let at_rest = if encrypted { AtRest::with_key(None, Some(common::TEST_KEY)) } else { AtRest::default() };
        let ddir = tempfile::tempdir().unwrap();
        let rdir = tempfile::tempdir().unwrap();
        let d = disk_at(ddir.path(), at_rest.clone()).await;
        let r = remote_at(rdir.path(), at_rest.clone()).await;
        store_marked(&d).await;
        store_marked(&r).await;
        for (name, dir) in [("disk", ddir.path()), ("remote", rdir.path())] {
            let files = common::files_under(dir);
            assert!(files.len() >= 4, "{name}: only {} files", files.len());
            assert_eq!(contains_marker(&files), !encrypted, "{name}, encrypted={encrypted}");
        }
        // And the values still read back.
        let mut key = MARKER.to_vec();
        key.extend_from_slice(b"-2");
        assert!(d.get("secret", &key).await.unwrap().unwrap().value.ends_with(MARKER));
        assert!(r.get("secret", &key).await.unwrap().unwrap().value.ends_with(MARKER));
        if encrypted {
            let mut keys = d.scan("secret", 0, 10).await.unwrap().keys;
            keys.extend(r.scan("secret", 0, 10).await.unwrap().keys);
            assert_eq!(keys.len(), 8);
            assert!(keys.iter().all(|k| k.starts_with(MARKER)), "keys decrypted for scan");
        }
    }
}

#[tokio::test]
async fn wrong_key_yields_absent_and_counts() {
    let right = AtRest::with_key(Some(1), Some([1; 32]));
    let wrong = AtRest::with_key(Some(1), Some([2; 32]));
    // Remote: another node with the wrong key.
    let rdir = tempfile::tempdir().unwrap();
    let r = remote_at(rdir.path(), right.clone()).await;
    r.put("ns", Bytes::from_static(b"k"), Bytes::from_static(b"secret value"), m()).await.unwrap();
    let r2 = remote_at(rdir.path(), wrong.clone()).await;
    assert!(r2.get("ns", b"k").await.unwrap().is_none());
    assert!(!r2.contains("ns", b"k").await.unwrap());
    assert_eq!(r2.stats().verify_failed, 2);
    assert_eq!(r2.stats().hits, 0);
    // The node with the wrong key deleted nothing: the right key still reads it.
    assert_eq!(&r.get("ns", b"k").await.unwrap().unwrap().value[..], b"secret value");
    // Disk: a restart with the wrong key drops what it cannot authenticate.
    let ddir = tempfile::tempdir().unwrap();
    {
        let d = disk_at(ddir.path(), right.clone()).await;
        d.put("ns", Bytes::from_static(b"k"), Bytes::from_static(b"secret value"), m()).await.unwrap();
        d.put("ns", Bytes::from_static(b"k2"), Bytes::from_static(b"other"), m()).await.unwrap();
        d.flush().await.unwrap();
    }
    let d = disk_at(ddir.path(), wrong).await;
    assert_eq!(d.stats().corrupt_dropped, 2);
    assert_eq!(d.stats().recovered, 0);
    assert!(d.get("ns", b"k").await.unwrap().is_none());
    // And a plain (unencrypted) tier cannot read encrypted records either.
    let d2dir = tempfile::tempdir().unwrap();
    let d2 = disk_at(d2dir.path(), right).await;
    d2.put("ns", Bytes::from_static(b"k"), Bytes::from_static(b"secret value"), m()).await.unwrap();
    let file = d2.entry_path("ns", b"k");
    let plain = remote_at(rdir.path(), AtRest::default()).await;
    std::fs::copy(&file, object_file(&plain, "ns", b"k")).unwrap();
    assert!(plain.get("ns", b"k").await.unwrap().is_none());
    assert_eq!(plain.stats().verify_failed, 1);
    assert!(object_file(&plain, "ns", b"k").exists());
}

/// Two stores with their own memory and disk share one remote tier: what A
/// writes and flushes, B reads from the remote tier.
async fn two_nodes_share_remote(remote: impl Fn() -> RemoteConfig, at_rest: AtRest) {
    let mut stores = Vec::new();
    let mut dirs = Vec::new();
    for _ in 0..2 {
        let dir = tempfile::tempdir().unwrap();
        let disk: Arc<dyn Tier> = Arc::new(disk_at(dir.path(), at_rest.clone()).await);
        let remote: Arc<dyn Tier> = Arc::new(open_remote(&remote(), at_rest.clone()).await.unwrap());
        let cfg = StoreConfig { memory: ByteSize::mib(64), ..Default::default() };
        stores.push(Store::with_tiers(cfg, Some(disk), Some(remote)));
        dirs.push(dir);
    }
    let (a, b) = (&stores[0], &stores[1]);
    let value = Bytes::from(common::noise(2 << 20, 11));
    assert!(a.put("shared", Bytes::from_static(b"block-1"), value.clone(), PutOptions::default()).await.unwrap());
    a.flush(Duration::from_secs(10)).await.unwrap();
    assert!(b.exists("shared", b"block-1").await.unwrap());
    let hit = b.get("shared", b"block-1").await.unwrap().expect("B finds A's block");
    assert_eq!(hit.tier, TierKind::Remote);
    assert!(hit.value == value, "value differs across nodes");
    // Promoted into B's memory.
    let again = b.get("shared", b"block-1").await.unwrap().unwrap();
    assert_eq!(again.tier, TierKind::Memory);
    // A durable write reaches A's disk before put returns.
    let durable = PutOptions { durable: true, ..Default::default() };
    a.put("shared", Bytes::from_static(b"block-2"), Bytes::from_static(b"v2"), durable).await.unwrap();
    assert_eq!(a.stats().tiers[1].entries, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_share_a_file_remote() {
    let shared = tempfile::tempdir().unwrap();
    let url = common::file_url(shared.path());
    two_nodes_share_remote(|| RemoteConfig { url: url.clone(), options: HashMap::new() }, AtRest::default()).await;
    assert!(!common::files_under(shared.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_share_an_s3_bucket() {
    let Some(server) = common::start_s3() else { return };
    let at_rest = AtRest::with_key(Some(1), Some(common::TEST_KEY));
    two_nodes_share_remote(|| server.config("nodes"), at_rest).await;
    let objects = common::files_under(&server.bucket_dir());
    assert!(!objects.is_empty(), "nothing reached the bucket");
    assert!(!contains_marker(&objects));
}

/// `Store::open` builds both persistent tiers from configuration, with the
/// key read from a file, and a reopened store finds durable writes on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_open_builds_configured_tiers() {
    let root = tempfile::tempdir().unwrap();
    let key_file = root.path().join("kv.key");
    std::fs::write(&key_file, hex::encode([7u8; 32])).unwrap();
    let cfg = StoreConfig {
        memory: ByteSize::mib(16),
        disk: Some(disk_cfg(&root.path().join("disk"))),
        remote: Some(RemoteConfig { url: common::file_url(&root.path().join("remote")), options: HashMap::new() }),
        compression: Some(3),
        encryption: Some(granary_warehouse::config::EncryptionConfig { key_file: Some(key_file), key_env: None }),
        ..Default::default()
    };
    {
        let s = Store::open(cfg.clone()).await.unwrap();
        assert_eq!(s.tiers(), vec![TierKind::Memory, TierKind::Disk, TierKind::Remote]);
        let durable = PutOptions { durable: true, ..Default::default() };
        s.put("ns", Bytes::from_static(b"k"), Bytes::from(common::noise(70_000, 5)), durable).await.unwrap();
        s.flush(Duration::from_secs(10)).await.unwrap();
    }
    let s = Store::open(cfg.clone()).await.unwrap();
    assert_eq!(s.stats().tiers[1].recovered, 1);
    let hit = s.get("ns", b"k").await.unwrap().unwrap();
    assert_eq!((hit.tier, hit.value), (TierKind::Disk, Bytes::from(common::noise(70_000, 5))));
    // A missing key file is a configuration error naming the file.
    let mut bad = cfg;
    bad.encryption = Some(granary_warehouse::config::EncryptionConfig {
        key_file: Some(root.path().join("missing.key")),
        key_env: None,
    });
    let err = Store::open(bad).await.err().expect("missing key file must fail").to_string();
    assert!(err.contains("missing.key"), "{err}");
}

/// The remote TTL sweep pages through the prefix (at most `limit` objects a
/// pass), deletes verified expired objects only, and leaves live objects and
/// objects it cannot verify in place.
async fn remote_sweep_removes_only_verified_expired(
    r: &dyn Tier,
    other_node: &dyn Tier,
    objects_now: impl Fn() -> usize,
) {
    let soon = granary_warehouse::types::now_ms() + 300;
    let short = EntryMeta { expires_at_ms: Some(soon), depth: 0 };
    for i in 0..60 {
        r.put(if i % 2 == 0 { "n1" } else { "n2" }, Bytes::from(format!("exp{i}")), Bytes::from_static(b"v"), short)
            .await
            .unwrap();
    }
    for i in 0..30 {
        r.put("n1", Bytes::from(format!("live{i}")), Bytes::from_static(b"v"), m()).await.unwrap();
    }
    // Written by a node with another key: this node cannot verify it.
    other_node.put("n1", Bytes::from_static(b"foreign"), Bytes::from_static(b"v"), short).await.unwrap();
    assert_eq!(objects_now(), 91);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut removed = Vec::new();
    for _ in 0..12 {
        let n = r.purge_expired(16).await.unwrap();
        assert!(n <= 16, "a pass examined more than its page");
        removed.push(n);
    }
    assert_eq!(removed.iter().sum::<u64>(), 60, "passes: {removed:?}");
    assert!(removed.iter().filter(|&&n| n > 0).count() >= 4, "one pass did it all: {removed:?}");
    assert_eq!(objects_now(), 31, "live and unverifiable objects stay");
    for i in 0..30 {
        assert!(r.contains("n1", format!("live{i}").as_bytes()).await.unwrap());
    }
    assert!(other_node.get("n1", b"foreign").await.unwrap().is_none(), "expired on its own node too");
    assert_eq!(r.stats().expirations, 60);
}

#[tokio::test]
async fn remote_ttl_sweep_over_a_file_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let r = remote_at(dir.path(), AtRest::default()).await;
    let other = remote_at(dir.path(), AtRest::with_key(None, Some(common::TEST_KEY))).await;
    remote_sweep_removes_only_verified_expired(&r, &other, || common::files_under(dir.path()).len()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_ttl_sweep_over_an_s3_bucket() {
    let Some(server) = common::start_s3() else { return };
    let r = open_remote(&server.config("sweep"), AtRest::default()).await.unwrap();
    let other = open_remote(&server.config("sweep"), AtRest::with_key(None, Some(common::TEST_KEY))).await.unwrap();
    let bucket = server.bucket_dir();
    let count = move || common::files_under(&bucket).iter().filter(|p| !p.to_string_lossy().contains(".s3s")).count();
    remote_sweep_removes_only_verified_expired(&r, &other, count).await;
}
