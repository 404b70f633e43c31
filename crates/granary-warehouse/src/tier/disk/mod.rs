//! The local disk tier: one file per entry under a directory, a byte budget,
//! crash safety and recovery on restart.
//!
//! This module owns the tier's directory. Each entry is one file holding an
//! [`AtRest`] record, named by a hash of `(namespace, key)` (keys are
//! arbitrary bytes) and fanned out over 256 subdirectories by the first byte
//! of that hash:
//!
//! ```text
//! <dir>/<h[0..2]>/<h>          h = hex(blake3(u16 ns_len ‖ ns ‖ key)[..16])
//! <dir>/<h[0..2]>/.<h>.<n>.tmp write in progress, or an evicted file about to be unlinked
//! ```
//!
//! Writes go to a temp file in the same subdirectory and are renamed over
//! the entry's name, so a reader sees the old file or the new one, never a
//! mix. [`Tier::flush`] fsyncs the files written since the last flush and
//! the directories whose entries changed; a durable write is `put` then
//! `flush`. Flushes run one at a time: a flush that finds another syncing
//! waits for it and then syncs what is still dirty, so it never returns
//! while a file it must cover (taken by the other flush) is unsynced; a
//! failed sync puts its files back in the dirty set for the next one.
//!
//! The index (per namespace: key → size, metadata; a scan-order set; an
//! eviction [`Policy`]) lives in memory and answers `contains_local`,
//! `meta`, `scan` and `namespaces` without I/O. It is rebuilt on open from
//! the files present:
//!
//! - temp files are leftovers of interrupted writes: removed, `torn_removed`;
//! - a file whose block header, total length or record head fails its checks,
//!   or whose head names an entry that does not hash to the file's name, is
//!   removed and counted in `corrupt_dropped`;
//! - expired entries are removed (`expirations`); the rest are `recovered`,
//!   inserted into the policy oldest-modified first, and evicted down to the
//!   budget if it shrank.
//!
//! Recovery reads only each file's header and record head (a few KiB); the
//! payload checksum, decryption and decompression run on every read, and a
//! file that fails them is deleted, counted and reported absent, never
//! served. Blocking file I/O runs on Tokio's blocking pool.
//!
//! Written here rather than on a hybrid-cache crate (`foyer`) because the
//! tier must share the warehouse's [`Policy`] implementations, pins,
//! namespaces with SCAN-order paging, per-entry expiry, and the
//! [`AtRest`] record the remote tier also stores; one plain file per entry
//! also keeps the data inspectable and recoverable entry by entry.
//!
//! Files are not fsynced before their rename: a crash can leave an entry's
//! name pointing at a short or empty file, which recovery's length check
//! drops. So that this never costs a value already acknowledged durable (a
//! newer write renamed over it between a flush's file syncs and its
//! directory syncs), renames wait while a flush syncs directories, and files
//! renamed in since its file syncs are synced before their directory.
//! Removals are made durable by the next `flush` as well. The tier's own
//! directory, when it has to be created, is synced into its parent.
//! `syncfs` stands in for many fsyncs only where it reaches the filesystem
//! (not on FUSE, where the kernel sends the server no request for it).
//!
//! `tests/crash.rs` runs this tier on a FUSE filesystem that forgets
//! everything unsynced at a simulated power cut, and fails when any of
//! these syncs is removed.
//!
//! The files are indexed in memory by the key index the memory tier uses
//! too (`tier/keys.rs`). Beside this file, by idea: file helpers
//! (`files.rs`), recovery on open (`recover.rs`) and flushing (`sync.rs`).

mod files;
mod recover;
mod sync;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};

use super::{EventSink, Tier, TierEvents, TierKind};
use crate::config::DiskConfig;
use crate::error::{Result, WarehouseError};
use crate::policy::{EntryId, PolicyKind};
use crate::tier::at_rest::{value_offset, AtRest};
use crate::tier::keys::{KeyIndex, Removed};
use crate::types::{now_ms, EntryMeta, Evicted, ScanPage, Stored, TierStats};
use files::{entry_name, read_whole, remove_quiet, write_new};
use sync::Dirty;
#[cfg(test)]
use sync::SyncHook;

/// Evicted values up to this size are read back for the caller (offload on eviction).
const READBACK_MAX: u64 = 1 << 20;
const TMP_SUFFIX: &str = ".tmp";

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    expirations: AtomicU64,
    corrupt_dropped: AtomicU64,
    recovered: AtomicU64,
    torn_removed: AtomicU64,
    errors: AtomicU64,
}

struct Shared {
    dir: PathBuf,
    at_rest: AtRest,
    capacity: u64,
    /// Byte quotas of namespaces (see [`open_disk_with_quotas`]).
    quotas: HashMap<String, u64>,
    /// The quota of every namespace `quotas` does not name (0: none).
    default_quota: u64,
    policy: PolicyKind,
    /// The files held, by key (the entries' payload is the file itself).
    index: Mutex<KeyIndex<()>>,
    dirty: Mutex<Dirty>,
    /// Held while a flush syncs (see the module docs).
    syncing: Mutex<()>,
    /// Read-held by a write from its rename until its file is in the dirty
    /// set; write-held by a flush while it syncs directories.
    renames: RwLock<()>,
    /// Whether `syncfs` makes this directory's filesystem durable.
    syncfs: std::sync::OnceLock<bool>,
    /// Called after each fsync (tests: slow or observe syncs).
    #[cfg(test)]
    sync_hook: Mutex<Option<SyncHook>>,
    seq: AtomicU64,
    c: Counters,
    events: TierEvents,
}

/// The disk tier; see the module docs.
pub struct DiskTier {
    s: Arc<Shared>,
}

fn io_err(e: io::Error) -> WarehouseError {
    WarehouseError::io(TierKind::Disk, e)
}

fn join_err(e: tokio::task::JoinError) -> WarehouseError {
    WarehouseError::io(TierKind::Disk, io::Error::other(format!("blocking task failed: {e}")))
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(join_err)?
}

/// Opens (creating if missing) the disk tier at `cfg.dir` and rebuilds its
/// index from the files there.
pub async fn open_disk(cfg: &DiskConfig, at_rest: AtRest) -> Result<DiskTier> {
    open_disk_with_quotas(cfg, at_rest, HashMap::new()).await
}

/// [`open_disk`] with byte quotas per namespace (0 = none): a namespace
/// with a quota makes room for its writes by evicting its own files first,
/// for its quota and for the tier's capacity alike. Quotas bind writes;
/// recovery at start enforces only the capacity.
pub async fn open_disk_with_quotas(
    cfg: &DiskConfig,
    at_rest: AtRest,
    quotas: HashMap<String, u64>,
) -> Result<DiskTier> {
    open_disk_with_default_quota(cfg, at_rest, quotas, 0).await
}

/// [`open_disk_with_quotas`], and a quota of `default_quota` bytes (0:
/// none) for each namespace `quotas` does not name, each its own.
pub async fn open_disk_with_default_quota(
    cfg: &DiskConfig,
    at_rest: AtRest,
    quotas: HashMap<String, u64>,
    default_quota: u64,
) -> Result<DiskTier> {
    let capacity = cfg.capacity.as_u64();
    let s = Arc::new(Shared {
        dir: cfg.dir.clone(),
        at_rest,
        capacity,
        quotas: quotas.into_iter().filter(|(_, l)| *l != 0).collect(),
        default_quota,
        policy: cfg.policy,
        index: Mutex::new(KeyIndex::new(cfg.policy.build(capacity))),
        dirty: Mutex::new(Dirty::default()),
        syncing: Mutex::new(()),
        renames: RwLock::new(()),
        syncfs: std::sync::OnceLock::new(),
        #[cfg(test)]
        sync_hook: Mutex::new(None),
        seq: AtomicU64::new(0),
        c: Counters::default(),
        events: TierEvents::default(),
    });
    let s2 = s.clone();
    blocking(move || s2.recover()).await?;
    Ok(DiskTier { s })
}

impl DiskTier {
    /// The directory the tier owns.
    pub fn dir(&self) -> &Path {
        &self.s.dir
    }

    /// Where an entry's file lives (whether or not it exists).
    pub fn entry_path(&self, ns: &str, key: &[u8]) -> PathBuf {
        self.s.path_of(ns, key)
    }
}

impl Shared {
    fn path_of(&self, ns: &str, key: &[u8]) -> PathBuf {
        let name = entry_name(ns, key);
        self.dir.join(&name[..2]).join(name)
    }

    /// A fresh temp name beside `path` (same directory, so renames are atomic).
    fn tmp_beside(&self, path: &Path) -> PathBuf {
        let n = self.seq.fetch_add(1, Relaxed);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("entry");
        path.with_file_name(format!(".{name}.{}.{n}{TMP_SUFFIX}", std::process::id()))
    }

    fn mark_dir(&self, path: &Path) {
        if let Some(d) = path.parent() {
            self.dirty.lock().dirs.insert(d.to_path_buf());
        }
    }

    /// Moves an evicted entry's file aside (under the index lock, so a new
    /// write of the same key cannot be caught); returns where it went.
    fn set_aside(&self, ns: &str, key: &[u8]) -> Option<PathBuf> {
        let path = self.path_of(ns, key);
        let aside = self.tmp_beside(&path);
        match fs::rename(&path, &aside) {
            Ok(()) => {
                self.mark_dir(&path);
                Some(aside)
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "disk tier: eviction failed");
                    self.c.errors.fetch_add(1, Relaxed);
                }
                None
            }
        }
    }

    /// Turns files set aside by eviction into [`Evicted`] (reading small
    /// values back) and unlinks them.
    fn reap(&self, victims: Vec<(Removed<()>, Option<PathBuf>)>) -> Vec<Evicted> {
        victims
            .into_iter()
            .map(|((ns, key, slot), aside)| {
                let mut value = None;
                if let Some(p) = aside {
                    if slot.size <= READBACK_MAX {
                        value = fs::read(&p)
                            .ok()
                            .and_then(|b| self.at_rest.open(Bytes::from(b), Some((&ns, &key))).ok())
                            .map(|r| r.value);
                    }
                    if let Err(e) = remove_quiet(&p) {
                        tracing::warn!(path = %p.display(), error = %e, "disk tier: unlink failed");
                        self.c.errors.fetch_add(1, Relaxed);
                    }
                }
                self.c.evictions.fetch_add(1, Relaxed);
                Evicted { namespace: ns.to_string(), key, value, meta: slot.meta, seq: 0 }
            })
            .collect()
    }

    /// Unlinks an entry's file with the index lock held.
    fn unlink_locked(&self, ns: &str, key: &[u8]) {
        let path = self.path_of(ns, key);
        if let Err(e) = remove_quiet(&path) {
            tracing::warn!(path = %path.display(), error = %e, "disk tier: unlink failed");
            self.c.errors.fetch_add(1, Relaxed);
        }
        self.mark_dir(&path);
    }

    fn put(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Result<Vec<Evicted>> {
        let sealed = self.at_rest.seal(ns, &key, meta, &value)?;
        let size = sealed.len() as u64;
        let path = self.path_of(ns, &key);
        let quota = self.quotas.get(ns).copied().or((self.default_quota != 0).then_some(self.default_quota));
        if (self.capacity != 0 && size > self.capacity) || quota.is_some_and(|q| size > q) {
            // Too big for this tier: drop any older copy, hand the value straight back.
            let mut ix = self.index.lock();
            if ix.remove(ns, &key).is_some() {
                self.unlink_locked(ns, &key);
                self.events.removed(ns, &key);
            }
            return Ok(vec![Evicted { namespace: ns.to_string(), key, value: Some(value), meta, seq: 0 }]);
        }
        let tmp = self.tmp_beside(&path);
        if let Err(e) = write_new(&tmp, &sealed) {
            let _ = remove_quiet(&tmp);
            self.c.errors.fetch_add(1, Relaxed);
            return Err(io_err(e));
        }
        drop(sealed);
        let mut victims = Vec::new();
        // Held until the new name is in the dirty set (see `sync_dirty`).
        let _renaming = self.renames.read();
        let mut ix = self.index.lock();
        // The older copy's file is replaced by the rename below.
        let had_old = ix.remove(ns, &key).is_some();
        let mut fits = true;
        let own = quota.map(|_| ns);
        loop {
            let over_quota = quota.is_some_and(|q| ix.usage(ns).0 + size > q);
            let over_total = self.capacity != 0 && ix.bytes() + size > self.capacity;
            if !over_quota && !over_total {
                break;
            }
            // Over its quota a namespace gives up its own files only; over
            // the capacity too, before anyone else's.
            let victim = match ix.evict_one(own, None) {
                None if !over_quota => ix.evict_one(None, None),
                v => v,
            };
            match victim {
                Some((vns, vkey, slot)) => {
                    let aside = self.set_aside(&vns, &vkey);
                    self.events.removed(&vns, &vkey);
                    victims.push(((vns, vkey, slot), aside));
                }
                None => {
                    fits = false;
                    break;
                }
            }
        }
        if !fits {
            // Everything left is pinned: keep the budget, refuse this value.
            self.unlink_locked(ns, &key);
            if had_old {
                self.events.removed(ns, &key);
            }
            drop(ix);
            let _ = remove_quiet(&tmp);
            let mut out = self.reap(victims);
            out.push(Evicted { namespace: ns.to_string(), key, value: Some(value), meta, seq: 0 });
            return Ok(out);
        }
        if let Err(e) = fs::rename(&tmp, &path) {
            self.unlink_locked(ns, &key);
            if had_old {
                self.events.removed(ns, &key);
            }
            drop(ix);
            let _ = remove_quiet(&tmp);
            self.c.errors.fetch_add(1, Relaxed);
            self.reap(victims);
            return Err(io_err(e));
        }
        self.events.stored(ns, &key);
        ix.insert(ns, key, size, meta, ());
        drop(ix);
        {
            let mut d = self.dirty.lock();
            if let Some(parent) = path.parent() {
                d.dirs.insert(parent.to_path_buf());
            }
            d.files.insert(path);
        }
        Ok(self.reap(victims))
    }

    /// Drops an entry whose file failed verification, if the index still
    /// names the same write (`id`).
    fn drop_corrupt(&self, ns: &str, key: &[u8], id: EntryId, reason: &dyn std::fmt::Display) {
        let mut ix = self.index.lock();
        if ix.get(ns, key).is_some_and(|s| s.id == id) {
            ix.remove(ns, key);
            self.unlink_locked(ns, key);
            drop(ix);
            tracing::warn!(namespace = ns, %reason, "disk tier: dropped a corrupt entry");
            self.c.corrupt_dropped.fetch_add(1, Relaxed);
            self.events.removed(ns, key);
        }
    }

    /// Looks a live entry up; removes it if expired and unpinned.
    fn live(&self, ns: &str, key: &[u8]) -> Option<EntryId> {
        let now = now_ms();
        let mut ix = self.index.lock();
        let (id, expired, pins) = {
            let slot = ix.get(ns, key)?;
            (slot.id, slot.meta.is_expired(now), slot.pins)
        };
        if !expired {
            return Some(id);
        }
        if pins == 0 {
            ix.remove(ns, key);
            self.unlink_locked(ns, key);
            self.c.expirations.fetch_add(1, Relaxed);
            self.events.removed(ns, key);
        }
        None
    }

    /// Reads and verifies an entry's file; `None` (and the entry dropped)
    /// when it is missing or fails verification.
    fn read_verified(&self, ns: &str, key: &[u8], id: EntryId) -> Result<Option<crate::tier::at_rest::Record>> {
        let path = self.path_of(ns, key);
        let bytes = match read_whole(&path, value_offset(ns, key)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.drop_corrupt(ns, key, id, &"file missing");
                return Ok(None);
            }
            Err(e) => {
                self.c.errors.fetch_add(1, Relaxed);
                return Err(io_err(e));
            }
        };
        match self.at_rest.open(bytes, Some((ns, key))) {
            Ok(r) => Ok(Some(r)),
            Err(c) => {
                self.drop_corrupt(ns, key, id, &c);
                Ok(None)
            }
        }
    }

    fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Stored>> {
        let Some(id) = self.live(ns, key) else {
            self.c.misses.fetch_add(1, Relaxed);
            return Ok(None);
        };
        let rec = match self.read_verified(ns, key, id) {
            Ok(Some(r)) => r,
            other => {
                self.c.misses.fetch_add(1, Relaxed);
                return other.map(|_| None);
            }
        };
        let mut ix = self.index.lock();
        let (hits, meta) = match ix.get_mut(ns, key) {
            Some(slot) if slot.id == id => {
                slot.hits = slot.hits.saturating_add(1);
                let out = (slot.hits, slot.meta);
                ix.access(id);
                out
            }
            _ => (1, rec.meta),
        };
        drop(ix);
        self.c.hits.fetch_add(1, Relaxed);
        Ok(Some(Stored { value: rec.value, meta, hits }))
    }

    fn set_expiry(&self, ns: &str, key: &[u8], at: Option<u64>) -> Result<bool> {
        // A concurrent write may replace the file while we rewrite it; retry then.
        for _ in 0..4 {
            let Some(id) = self.live(ns, key) else { return Ok(false) };
            let Some(rec) = self.read_verified(ns, key, id)? else { return Ok(false) };
            let meta = EntryMeta { expires_at_ms: at, ..rec.meta };
            let sealed = self.at_rest.seal(ns, key, meta, &rec.value)?;
            let path = self.path_of(ns, key);
            let tmp = self.tmp_beside(&path);
            if let Err(e) = write_new(&tmp, &sealed) {
                let _ = remove_quiet(&tmp);
                self.c.errors.fetch_add(1, Relaxed);
                return Err(io_err(e));
            }
            let renaming = self.renames.read();
            let mut ix = self.index.lock();
            let same = ix.get(ns, key).is_some_and(|s| s.id == id);
            if !same {
                drop(ix);
                let _ = remove_quiet(&tmp);
                continue;
            }
            if let Err(e) = fs::rename(&tmp, &path) {
                drop(ix);
                let _ = remove_quiet(&tmp);
                self.c.errors.fetch_add(1, Relaxed);
                return Err(io_err(e));
            }
            ix.update(ns, key, sealed.len() as u64, meta);
            drop(ix);
            self.mark_dir(&path);
            self.dirty.lock().files.insert(path);
            drop(renaming);
            return Ok(true);
        }
        Err(WarehouseError::io(TierKind::Disk, io::Error::other("entry kept changing during set_expiry")))
    }
}

#[async_trait]
impl Tier for DiskTier {
    fn kind(&self) -> TierKind {
        TierKind::Disk
    }

    fn set_event_sink(&self, sink: EventSink) -> bool {
        self.s.events.set(sink);
        true
    }

    async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Stored>> {
        // An expired entry still goes on: the read drops it (and says so).
        if self.s.index.lock().get(ns, key).is_none() {
            self.s.c.misses.fetch_add(1, Relaxed);
            return Ok(None);
        }
        let (s, ns, key) = (self.s.clone(), ns.to_string(), key.to_vec());
        blocking(move || s.get(&ns, &key)).await
    }

    async fn contains(&self, ns: &str, key: &[u8]) -> Result<bool> {
        Ok(self.contains_local(ns, key).unwrap_or(false))
    }

    fn contains_local(&self, ns: &str, key: &[u8]) -> Option<bool> {
        let now = now_ms();
        Some(self.s.index.lock().get(ns, key).is_some_and(|s| !s.meta.is_expired(now)))
    }

    async fn put(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Result<Vec<Evicted>> {
        let (s, ns) = (self.s.clone(), ns.to_string());
        blocking(move || s.put(&ns, key, value, meta)).await
    }

    async fn remove(&self, ns: &str, key: &[u8]) -> Result<bool> {
        let (s, ns, key) = (self.s.clone(), ns.to_string(), key.to_vec());
        blocking(move || {
            let mut ix = s.index.lock();
            let Some(e) = ix.remove(&ns, &key) else { return Ok(false) };
            s.unlink_locked(&ns, &key);
            s.events.removed(&ns, &key);
            Ok(!e.meta.is_expired(now_ms()))
        })
        .await
    }

    async fn remove_namespace(&self, ns: &str) -> Result<u64> {
        let (s, ns) = (self.s.clone(), ns.to_string());
        blocking(move || {
            let mut ix = s.index.lock();
            let mut n = 0;
            for k in ix.keys(&ns) {
                if ix.remove(&ns, &k).is_some() {
                    s.unlink_locked(&ns, &k);
                    s.events.removed(&ns, &k);
                    n += 1;
                }
            }
            Ok(n)
        })
        .await
    }

    async fn set_expiry(&self, ns: &str, key: &[u8], expires_at_ms: Option<u64>) -> Result<bool> {
        if self.contains_local(ns, key) == Some(false) {
            return Ok(false);
        }
        let (s, ns, key) = (self.s.clone(), ns.to_string(), key.to_vec());
        blocking(move || s.set_expiry(&ns, &key, expires_at_ms)).await
    }

    async fn meta(&self, ns: &str, key: &[u8]) -> Result<Option<EntryMeta>> {
        let now = now_ms();
        Ok(self.s.index.lock().get(ns, key).map(|s| s.meta).filter(|m| !m.is_expired(now)))
    }

    async fn scan(&self, ns: &str, cursor: u64, count: usize) -> Result<ScanPage> {
        Ok(self.s.index.lock().scan(ns, cursor, count, now_ms()))
    }

    async fn namespaces(&self) -> Result<Vec<String>> {
        let mut v: Vec<String> = self.s.index.lock().namespaces().map(str::to_string).collect();
        v.sort();
        Ok(v)
    }

    fn pin(&self, ns: &str, key: &[u8]) -> bool {
        match self.s.index.lock().get_mut(ns, key) {
            Some(slot) => {
                slot.pins += 1;
                true
            }
            None => false,
        }
    }

    fn unpin(&self, ns: &str, key: &[u8]) {
        if let Some(slot) = self.s.index.lock().get_mut(ns, key) {
            slot.pins = slot.pins.saturating_sub(1);
        }
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        let s = self.s.clone();
        blocking(move || {
            let now = now_ms();
            let mut ix = s.index.lock();
            let mut n = 0u64;
            for (ns, key, _) in ix.remove_expired(now, limit) {
                s.unlink_locked(&ns, &key);
                s.events.removed(&ns, &key);
                n += 1;
            }
            drop(ix);
            s.c.expirations.fetch_add(n, Relaxed);
            Ok(n)
        })
        .await
    }

    async fn flush(&self) -> Result<()> {
        let s = self.s.clone();
        blocking(move || s.flush()).await
    }

    fn namespace_usage(&self, ns: &str) -> Option<(u64, u64)> {
        Some(self.s.index.lock().usage(ns))
    }

    fn stats(&self) -> TierStats {
        let (bytes, entries) = {
            let ix = self.s.index.lock();
            (ix.bytes(), ix.len())
        };
        let c = &self.s.c;
        TierStats {
            tier: Some(TierKind::Disk),
            policy: Some(self.s.policy.as_str().to_string()),
            bytes,
            entries,
            capacity: self.s.capacity,
            hits: c.hits.load(Relaxed),
            misses: c.misses.load(Relaxed),
            evictions: c.evictions.load(Relaxed),
            expirations: c.expirations.load(Relaxed),
            corrupt_dropped: c.corrupt_dropped.load(Relaxed),
            recovered: c.recovered.load(Relaxed),
            torn_removed: c.torn_removed.load(Relaxed),
            errors: c.errors.load(Relaxed),
            verify_failed: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DiskConfig;
    use granary_core::ByteSize;
    use std::collections::HashSet;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    /// Issue 13: a second durable flush must not return while the first,
    /// which took its files, is still syncing them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_flushes_never_acknowledge_unsynced_files() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = DiskConfig { dir: dir.path().to_path_buf(), capacity: ByteSize::mib(64), policy: PolicyKind::Lru };
        let t = Arc::new(open_disk(&cfg, AtRest::with_key(None, None)).await.unwrap());
        let synced: Arc<Mutex<HashSet<PathBuf>>> = Arc::default();
        let first = Arc::new(AtomicBool::new(true));
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let started_tx = Mutex::new(started_tx);
        {
            let synced = synced.clone();
            *t.s.sync_hook.lock() = Some(Arc::new(move |p: &Path| {
                synced.lock().insert(p.to_path_buf());
                if first.swap(false, Relaxed) {
                    // The first flush is now mid-sync: let the second one run, and be slow.
                    let _ = started_tx.lock().send(());
                    std::thread::sleep(Duration::from_millis(300));
                }
            }));
        }
        let meta = EntryMeta::default();
        // Writer B's file is dirty before writer A flushes, so A's flush takes it.
        t.put("n", Bytes::from_static(b"b"), Bytes::from_static(b"vb"), meta).await.unwrap();
        t.put("n", Bytes::from_static(b"a"), Bytes::from_static(b"va"), meta).await.unwrap();
        let a = {
            let t = t.clone();
            tokio::spawn(async move { t.flush().await })
        };
        tokio::task::spawn_blocking(move || started_rx.recv().unwrap()).await.unwrap();
        // Writer B's durable flush: must cover B's file and its directory.
        t.flush().await.unwrap();
        let done = synced.lock().clone();
        for key in [&b"a"[..], b"b"] {
            let path = t.entry_path("n", key);
            assert!(done.contains(&path), "flush returned before {} was synced", path.display());
            assert!(done.contains(path.parent().unwrap()), "flush returned before the directory of {key:?} was synced");
        }
        a.await.unwrap().unwrap();
    }
}
