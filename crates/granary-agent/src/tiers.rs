//! Weight cache tiers on one node: RAM (a directory on tmpfs), disk (a
//! directory on local NVMe), and the registry below both.
//!
//! Files are stored by sha256 (`<dir>/blobs/sha256/<hex>`), so two models
//! sharing a file store it once and a file is never trusted under a name it
//! does not hash to (it is renamed into place only after verification). A
//! model revision is *materialised* as a directory of symlinks named by the
//! files' paths, pointing into the fastest tier holding each file; that
//! directory is what an engine opens.
//!
//! The RAM tier holds copies of disk files (RAM ⊆ disk), so demoting a file
//! from RAM is deleting its copy. Both tiers have a byte budget and evict
//! least-recently-used files that no loaded model holds (a *pin*): a new
//! download evicts from disk, a promotion demotes from RAM. A model is
//! promoted to RAM after `promote_after` loads within `promote_window`; a
//! RAM copy unused for `demote_after` is demoted even without pressure.
//!
//! Recency survives restarts as file modification times; the index is
//! rebuilt from a directory scan at start.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use granary_core::ByteSize;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::AgentError;

/// Tier budgets and the promotion and demotion rules.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// The RAM tier's directory, on tmpfs; none: no RAM tier [default:
    /// `/dev/shm/granary` where `/dev/shm` exists].
    pub ram_dir: Option<PathBuf>,
    /// Bytes the RAM tier may hold.
    pub ram_budget: ByteSize,
    /// Bytes the disk tier may hold (partial downloads included).
    pub disk_budget: ByteSize,
    /// Loads of a model within `promote_window` that promote its files to
    /// RAM (0: never promote).
    pub promote_after: u32,
    /// The window `promote_after` counts loads in.
    #[serde(with = "crate::config::duration")]
    pub promote_window: Duration,
    /// Demote a RAM copy no loaded model holds after this long unused, even
    /// without pressure (none: only under pressure).
    #[serde(with = "crate::config::opt_duration")]
    pub demote_after: Option<Duration>,
}

impl Default for TierConfig {
    fn default() -> Self {
        let shm = Path::new("/dev/shm");
        TierConfig {
            ram_dir: shm.is_dir().then(|| shm.join("granary")),
            ram_budget: ByteSize::gib(2),
            disk_budget: ByteSize::gib(50),
            promote_after: 2,
            promote_window: Duration::from_secs(3600),
            demote_after: None,
        }
    }
}

/// Where a model's weights came from for a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Ram,
    Disk,
    Registry,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Ram => "ram",
            Tier::Disk => "disk",
            Tier::Registry => "registry",
        }
    }
}

/// One tier in `GET /status`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct TierStatus {
    pub budget: u64,
    pub used: u64,
    pub files: u64,
}

/// Both tiers in `GET /status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TiersStatus {
    pub ram: Option<TierStatus>,
    pub disk: TierStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    No,
    /// An interrupted download's part file (disk only): resumable, evictable.
    Partial,
    /// Being written now: counted, never evicted.
    Filling,
    Yes,
}

#[derive(Debug, Clone)]
struct Blob {
    size: u64,
    last_used_ms: u64,
    disk: Presence,
    ram: Presence,
    pins: u32,
}

#[derive(Default)]
struct State {
    blobs: HashMap<String, Blob>,
    /// Load times (unix ms) per model key, for promotion.
    loads: HashMap<String, VecDeque<u64>>,
}

impl State {
    fn used(&self, ram: bool) -> (u64, u64) {
        let mut bytes = 0;
        let mut files = 0;
        for b in self.blobs.values() {
            let p = if ram { b.ram } else { b.disk };
            if p != Presence::No {
                bytes += b.size;
                files += u64::from(p == Presence::Yes);
            }
        }
        (bytes, files)
    }

    fn pinned(&self, ram: bool) -> u64 {
        self.blobs
            .values()
            .filter(|b| b.pins > 0 && (if ram { b.ram } else { b.disk }) != Presence::No)
            .map(|b| b.size)
            .sum()
    }
}

/// The RAM and disk tiers of one agent.
pub struct Tiers {
    cfg: TierConfig,
    disk_dir: PathBuf,
    ram_dir: Option<PathBuf>,
    state: Mutex<State>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn mtime_ms(m: &std::fs::Metadata) -> u64 {
    m.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_millis() as u64)
}

impl Tiers {
    /// Opens the tiers under `cache_dir` (and the RAM directory), rebuilding
    /// the index from what is on disk.
    pub fn open(cfg: TierConfig, cache_dir: &Path) -> Result<Tiers, AgentError> {
        let disk_dir = cache_dir.join("blobs").join("sha256");
        std::fs::create_dir_all(&disk_dir)
            .map_err(|e| AgentError::io(format!("creating {}", disk_dir.display()), e))?;
        let ram_dir = match (&cfg.ram_dir, cfg.ram_budget.as_u64()) {
            (Some(d), b) if b > 0 => {
                let d = d.join("blobs").join("sha256");
                std::fs::create_dir_all(&d).map_err(|e| AgentError::io(format!("creating {}", d.display()), e))?;
                Some(d)
            }
            _ => None,
        };
        let mut st = State::default();
        for e in read_dir(&disk_dir)? {
            let Ok(m) = e.metadata() else { continue };
            let name = e.file_name().to_string_lossy().into_owned();
            if is_sha256_hex(&name) {
                let b = st.blobs.entry(name).or_insert_with(|| Blob::new(m.len()));
                b.disk = Presence::Yes;
                b.size = m.len();
                b.last_used_ms = b.last_used_ms.max(mtime_ms(&m));
            } else if let Some(sha) = name.strip_suffix(".part").filter(|s| is_sha256_hex(s)) {
                let b = st.blobs.entry(sha.to_string()).or_insert_with(|| Blob::new(m.len()));
                if b.disk == Presence::No {
                    b.disk = Presence::Partial;
                    b.size = m.len();
                    b.last_used_ms = mtime_ms(&m);
                }
            }
        }
        if let Some(rd) = &ram_dir {
            for e in read_dir(rd)? {
                let name = e.file_name().to_string_lossy().into_owned();
                let Ok(m) = e.metadata() else { continue };
                if is_sha256_hex(&name) {
                    let b = st.blobs.entry(name).or_insert_with(|| Blob::new(m.len()));
                    b.ram = Presence::Yes;
                    b.size = m.len();
                    b.last_used_ms = b.last_used_ms.max(mtime_ms(&m));
                } else if name.ends_with(".tmp") {
                    // A promotion cut short.
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(Tiers { cfg, disk_dir, ram_dir, state: Mutex::new(st) })
    }

    pub fn config(&self) -> &TierConfig {
        &self.cfg
    }

    /// Where the disk tier keeps a file.
    pub fn disk_path(&self, sha: &str) -> PathBuf {
        self.disk_dir.join(sha)
    }

    /// Where the RAM tier keeps a file (none without a RAM tier).
    pub fn ram_path(&self, sha: &str) -> Option<PathBuf> {
        self.ram_dir.as_ref().map(|d| d.join(sha))
    }

    /// The directory downloads land in.
    pub fn disk_dir(&self) -> &Path {
        &self.disk_dir
    }

    /// The fastest tier holding a complete copy of `sha`. A copy deleted
    /// behind the agent's back (a cleaned cache, a tmpfs lost at reboot) is
    /// forgotten here rather than linked.
    pub fn locate(&self, sha: &str) -> Option<Tier> {
        let mut st = self.state.lock();
        let b = st.blobs.get_mut(sha)?;
        if b.ram == Presence::Yes && !self.ram_path(sha).is_some_and(|p| p.is_file()) {
            tracing::warn!(sha256 = sha, "a RAM copy disappeared");
            b.ram = Presence::No;
        }
        if b.disk == Presence::Yes && !self.disk_path(sha).is_file() {
            tracing::warn!(sha256 = sha, "a disk copy disappeared");
            b.disk = Presence::No;
        }
        if b.ram == Presence::Yes {
            Some(Tier::Ram)
        } else if b.disk == Presence::Yes {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// Makes room for `size` bytes of `sha` on disk, evicting the least
    /// recently used files no model holds, and marks it as being written.
    /// Returns the path to download into.
    pub fn begin_download(&self, sha: &str, size: u64, label: &str) -> Result<PathBuf, AgentError> {
        let mut st = self.state.lock();
        let budget = self.cfg.disk_budget.as_u64();
        if let Some(b) = st.blobs.get(sha) {
            if b.disk == Presence::Filling {
                return Err(AgentError::Conflict(format!("{label} is already being downloaded")));
            }
        }
        // A part file left by an earlier try is reused: its bytes are already counted.
        let already = st.blobs.get(sha).filter(|b| b.disk == Presence::Partial).map_or(0, |b| b.size);
        let (used, _) = st.used(false);
        let mut need = (used - already + size).saturating_sub(budget);
        if need > 0 {
            let mut victims: Vec<(u64, String)> = st
                .blobs
                .iter()
                .filter(|(k, b)| {
                    k.as_str() != sha
                        && b.pins == 0
                        && matches!(b.disk, Presence::Yes | Presence::Partial)
                        && b.ram != Presence::Filling
                })
                .map(|(k, b)| (b.last_used_ms, k.clone()))
                .collect();
            victims.sort();
            let freeable: u64 = victims.iter().map(|(_, k)| st.blobs[k].size).sum();
            if freeable < need {
                return Err(AgentError::OverBudget {
                    tier: "disk",
                    file: label.to_string(),
                    needed: size,
                    budget,
                    pinned: st.pinned(false),
                });
            }
            for (_, k) in victims {
                if need == 0 {
                    break;
                }
                let b = st.blobs.get_mut(&k).expect("a victim is in the index");
                need = need.saturating_sub(b.size);
                tracing::info!(sha256 = %k, bytes = b.size, "evicting from the disk tier");
                if b.disk == Presence::Partial {
                    crate::download::remove_partial(&self.disk_dir.join(&k));
                } else {
                    let _ = std::fs::remove_file(self.disk_dir.join(&k));
                }
                b.disk = Presence::No;
                // RAM holds copies of disk files only.
                if b.ram == Presence::Yes {
                    if let Some(p) = self.ram_path(&k) {
                        let _ = std::fs::remove_file(p);
                    }
                    b.ram = Presence::No;
                }
                st.blobs.remove(&k);
            }
        }
        let b = st.blobs.entry(sha.to_string()).or_insert_with(|| Blob::new(size));
        b.size = size;
        b.disk = Presence::Filling;
        b.last_used_ms = now_ms();
        Ok(self.disk_path(sha))
    }

    /// Ends a download begun with [`Tiers::begin_download`].
    pub fn end_download(&self, sha: &str, ok: bool) {
        let mut st = self.state.lock();
        let Some(b) = st.blobs.get_mut(sha) else { return };
        let dest = self.disk_dir.join(sha);
        if ok {
            b.disk = Presence::Yes;
            b.last_used_ms = now_ms();
        } else if let Ok(m) = std::fs::metadata(crate::download::part_path(&dest)) {
            b.disk = Presence::Partial;
            b.size = m.len();
        } else {
            b.disk = Presence::No;
            if b.ram == Presence::No && b.pins == 0 {
                st.blobs.remove(sha);
            }
        }
    }

    /// Holds files for a loaded model: never evicted or demoted while held.
    pub fn pin(&self, shas: &[String]) {
        let mut st = self.state.lock();
        for s in shas {
            if let Some(b) = st.blobs.get_mut(s) {
                b.pins += 1;
            }
        }
    }

    pub fn unpin(&self, shas: &[String]) {
        let mut st = self.state.lock();
        for s in shas {
            if let Some(b) = st.blobs.get_mut(s) {
                b.pins = b.pins.saturating_sub(1);
            }
        }
    }

    /// Marks files as used now (recency for LRU; kept as the file's mtime).
    pub fn touch(&self, shas: &[String]) {
        let now = now_ms();
        let mut paths = Vec::new();
        {
            let mut st = self.state.lock();
            for s in shas {
                if let Some(b) = st.blobs.get_mut(s) {
                    b.last_used_ms = now;
                    if b.disk == Presence::Yes {
                        paths.push(self.disk_path(s));
                    }
                    if b.ram == Presence::Yes {
                        paths.extend(self.ram_path(s));
                    }
                }
            }
        }
        for p in paths {
            if let Ok(f) = std::fs::File::options().write(true).open(&p) {
                let _ = f.set_modified(SystemTime::now());
            }
        }
    }

    /// A file's size, if some tier holds or expects it.
    pub fn size(&self, sha: &str) -> Option<u64> {
        self.state.lock().blobs.get(sha).map(|b| b.size)
    }

    /// Bytes the RAM tier could hold for a promotion now: its budget less
    /// the copies loaded models hold (the rest may be demoted); None
    /// without a RAM tier.
    pub fn ram_room(&self) -> Option<u64> {
        self.ram_dir.as_ref()?;
        Some(self.cfg.ram_budget.as_u64().saturating_sub(self.state.lock().pinned(true)))
    }

    /// Counts a load of `model`; true when it should be promoted to RAM now.
    pub fn record_load(&self, model: &str) -> bool {
        if self.ram_dir.is_none() || self.cfg.promote_after == 0 {
            return false;
        }
        let now = now_ms();
        let window = self.cfg.promote_window.as_millis() as u64;
        let mut st = self.state.lock();
        let q = st.loads.entry(model.to_string()).or_default();
        q.push_back(now);
        while q.front().is_some_and(|&t| now.saturating_sub(t) > window) {
            q.pop_front();
        }
        q.len() >= self.cfg.promote_after as usize
    }

    /// Copies `shas` (all on disk) into the RAM tier, demoting least recently
    /// used copies no model holds to make room. All or nothing: a model that
    /// cannot fit stays on disk (`Ok(false)`).
    pub async fn promote(&self, shas: &[String]) -> Result<bool, AgentError> {
        let Some(ram_dir) = self.ram_dir.clone() else { return Ok(false) };
        let budget = self.cfg.ram_budget.as_u64();
        let todo: Vec<(String, u64)> = {
            let mut st = self.state.lock();
            let wanted: HashSet<&String> = shas.iter().collect();
            let todo: Vec<(String, u64)> = shas
                .iter()
                .filter_map(|s| st.blobs.get(s).map(|b| (s, b)))
                .filter(|(_, b)| b.ram == Presence::No && b.disk == Presence::Yes)
                .map(|(s, b)| (s.clone(), b.size))
                .collect();
            if todo.is_empty() {
                return Ok(shas.iter().all(|s| st.blobs.get(s).is_some_and(|b| b.ram == Presence::Yes)));
            }
            let need_total: u64 = todo.iter().map(|(_, n)| n).sum();
            let (used, _) = st.used(true);
            let mut need = (used + need_total).saturating_sub(budget);
            let mut victims: Vec<(u64, String)> = st
                .blobs
                .iter()
                .filter(|(k, b)| b.ram == Presence::Yes && b.pins == 0 && !wanted.contains(k))
                .map(|(k, b)| (b.last_used_ms, k.clone()))
                .collect();
            victims.sort();
            let freeable: u64 = victims.iter().map(|(_, k)| st.blobs[k].size).sum();
            if freeable < need {
                tracing::info!(need = need_total, budget, "the model does not fit the RAM tier; it stays on disk");
                return Ok(false);
            }
            for (_, k) in victims {
                if need == 0 {
                    break;
                }
                let b = st.blobs.get_mut(&k).expect("a victim is in the index");
                need = need.saturating_sub(b.size);
                tracing::info!(sha256 = %k, bytes = b.size, "demoting from the RAM tier");
                let _ = std::fs::remove_file(ram_dir.join(&k));
                b.ram = Presence::No;
            }
            for (s, _) in &todo {
                if let Some(b) = st.blobs.get_mut(s) {
                    b.ram = Presence::Filling;
                }
            }
            todo
        };
        let mut failed = None;
        for (sha, _) in &todo {
            let (from, to) = (self.disk_path(sha), ram_dir.join(sha));
            let tmp = ram_dir.join(format!("{sha}.tmp"));
            let copied = if failed.is_some() {
                Err(AgentError::Conflict("skipped".into()))
            } else {
                let (f, t) = (from.clone(), tmp.clone());
                let r =
                    tokio::task::spawn_blocking(move || std::fs::copy(&f, &t).and_then(|_| std::fs::rename(&t, &to)))
                        .await
                        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
                r.map_err(|e| {
                    let _ = std::fs::remove_file(&tmp);
                    if AgentError::is_no_space(&e) {
                        AgentError::no_space(&ram_dir, sha, 0)
                    } else {
                        AgentError::io(format!("copying {} to {}", from.display(), tmp.display()), e)
                    }
                })
            };
            let mut st = self.state.lock();
            if let Some(b) = st.blobs.get_mut(sha) {
                b.ram = if copied.is_ok() { Presence::Yes } else { Presence::No };
            }
            if let (Err(e), None) = (copied, &failed) {
                failed = Some(e);
            }
        }
        match failed {
            Some(e) => {
                tracing::warn!(error = %e, "promotion to the RAM tier failed; the model stays on disk");
                Ok(false)
            }
            None => Ok(true),
        }
    }

    /// Demotes RAM copies no model holds that went unused for `demote_after`.
    /// Returns how many were demoted.
    pub fn demote_idle(&self) -> usize {
        let (Some(after), Some(ram_dir)) = (self.cfg.demote_after, &self.ram_dir) else { return 0 };
        let cutoff = now_ms().saturating_sub(after.as_millis() as u64);
        let mut st = self.state.lock();
        let mut n = 0;
        for (k, b) in st.blobs.iter_mut() {
            if b.ram == Presence::Yes && b.pins == 0 && b.last_used_ms < cutoff {
                tracing::info!(sha256 = %k, "demoting an idle file from the RAM tier");
                let _ = std::fs::remove_file(ram_dir.join(k));
                b.ram = Presence::No;
                n += 1;
            }
        }
        n
    }

    /// Budgets and use, for `GET /status`.
    pub fn status(&self) -> TiersStatus {
        let st = self.state.lock();
        let (used, files) = st.used(false);
        let disk = TierStatus { budget: self.cfg.disk_budget.as_u64(), used, files };
        let ram = self.ram_dir.as_ref().map(|_| {
            let (used, files) = st.used(true);
            TierStatus { budget: self.cfg.ram_budget.as_u64(), used, files }
        });
        TiersStatus { ram, disk }
    }

    /// Lays out a model revision under `root` as symlinks named by the files'
    /// paths, each pointing into the fastest tier that holds it.
    pub fn materialise(&self, root: &Path, files: &[(String, String)]) -> Result<Tier, AgentError> {
        let checkpoints = self.adopt_checkpoints(root);
        let _ = std::fs::remove_dir_all(root);
        std::fs::create_dir_all(root).map_err(|e| AgentError::io(format!("creating {}", root.display()), e))?;
        let mut slowest = Tier::Ram;
        for (path, sha) in files {
            let rel = safe_relative(path)?;
            let (tier, target) = match self.locate(sha) {
                Some(Tier::Ram) => (Tier::Ram, self.ram_path(sha).expect("RAM files need a RAM tier")),
                Some(_) => (Tier::Disk, self.disk_path(sha)),
                None => return Err(AgentError::Conflict(format!("{path} ({sha}) is in no tier; it was evicted"))),
            };
            slowest = slowest.max(tier);
            let link = root.join(rel);
            if let Some(parent) = link.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| AgentError::io(format!("creating {}", parent.display()), e))?;
            }
            std::os::unix::fs::symlink(&target, &link)
                .map_err(|e| AgentError::io(format!("linking {} to {}", link.display(), target.display()), e))?;
        }
        // Checkpoints come back linked to their fastest tier; one evicted
        // meanwhile is left out (the engine converts and writes a new one).
        for (name, sha) in checkpoints {
            let target = match self.locate(&sha) {
                Some(Tier::Ram) => self.ram_path(&sha).expect("RAM files need a RAM tier"),
                Some(_) => self.disk_path(&sha),
                None => continue,
            };
            let link = root.join(&name);
            if !link.exists() {
                std::os::unix::fs::symlink(&target, &link)
                    .map_err(|e| AgentError::io(format!("linking {} to {}", link.display(), target.display()), e))?;
            }
        }
        Ok(slowest)
    }

    /// The sha256 of each converted-weight checkpoint linked in a
    /// revision's directory (to touch and promote with its weights).
    pub fn checkpoint_shas(&self, root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !is_checkpoint_name(&name) {
                continue;
            }
            out.extend(linked_sha(&e.path()));
        }
        out
    }

    /// Converted-weight checkpoints (`*.ckpt`) in a revision's directory:
    /// a regular file (what an engine wrote there) is taken into the disk
    /// tier like a downloaded file (hashed, moved in under its sha256,
    /// evicting least recently used files as a download does) and replaced
    /// by a link to it; one that does not fit is deleted. Returns each
    /// checkpoint's file name and sha256. Checkpoints are never pinned: an
    /// engine reads one only while it starts, and one evicted costs only a
    /// conversion.
    pub fn adopt_checkpoints(&self, root: &Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !is_checkpoint_name(&name) {
                continue;
            }
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            if meta.file_type().is_symlink() {
                if let Some(sha) = linked_sha(&path) {
                    out.push((name, sha));
                }
                continue;
            }
            if !meta.is_file() {
                continue;
            }
            match self.adopt_file(&path, &name, meta.len()) {
                Ok(sha) => {
                    tracing::info!(file = %path.display(), sha256 = %sha, bytes = meta.len(), "took a checkpoint into the disk tier");
                    out.push((name, sha));
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "a checkpoint was not kept");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        out
    }

    fn adopt_file(&self, path: &Path, name: &str, size: u64) -> Result<String, AgentError> {
        use sha2::{Digest, Sha256};
        use std::io::Read;
        let io = |what: &str, e: std::io::Error| AgentError::io(format!("{what} {}", path.display()), e);
        let mut f = std::fs::File::open(path).map_err(|e| io("opening", e))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).map_err(|e| io("reading", e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let sha = hex::encode(h.finalize());
        if self.locate(&sha).is_some() {
            std::fs::remove_file(path).map_err(|e| io("removing", e))?;
        } else {
            let dest = self.begin_download(&sha, size, name)?;
            let moved = std::fs::rename(path, &dest);
            self.end_download(&sha, moved.is_ok());
            moved.map_err(|e| io("moving", e))?;
        }
        // The link replaces the file in one rename: an engine opening the
        // name meanwhile sees one or the other, both whole.
        let tmp = path.with_file_name(format!(".{name}.link"));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(self.disk_path(&sha), &tmp).map_err(|e| io("linking", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("linking", e))?;
        Ok(sha)
    }
}

/// The sha256 a link points at (its target's name), if it is one into the tiers.
fn linked_sha(link: &Path) -> Option<String> {
    let target = std::fs::read_link(link).ok()?;
    let name = target.file_name()?.to_string_lossy().into_owned();
    is_sha256_hex(&name).then_some(name)
}

/// Whether a file in a model's directory is a converted-weight checkpoint
/// (`granary engine --checkpoint auto` writes `<model>.granary-<cpu>.ckpt`
/// there; its temporary files start with a dot).
pub fn is_checkpoint_name(name: &str) -> bool {
    !name.starts_with('.') && granary_core::is_checkpoint_file(name)
}

impl Blob {
    fn new(size: u64) -> Blob {
        Blob { size, last_used_ms: now_ms(), disk: Presence::No, ram: Presence::No, pins: 0 }
    }
}

fn read_dir(dir: &Path) -> Result<Vec<std::fs::DirEntry>, AgentError> {
    Ok(std::fs::read_dir(dir)
        .map_err(|e| AgentError::io(format!("reading {}", dir.display()), e))?
        .filter_map(Result::ok)
        .collect())
}

/// A registry file path as a relative path with plain components only (no
/// `..`, no root), so a catalog entry cannot place a link outside its model.
pub fn safe_relative(path: &str) -> Result<&Path, AgentError> {
    let p = Path::new(path);
    if path.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(AgentError::Registry(format!("the registry lists an unsafe file path {path:?}")));
    }
    Ok(p)
}

#[cfg(test)]
mod tests;
