//! Making the disk tier durable: `flush` syncs the files written and the
//! directories changed since the last one, one flush at a time, with
//! renames held off while directories sync (see the module docs of
//! [`super`]).

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
#[cfg(test)]
use std::sync::Arc;

use super::files::syncfs_reaches;
use super::{io_err, Shared};
use crate::error::Result;

/// Files written and directories changed since the last flush.
#[derive(Default)]
pub(super) struct Dirty {
    pub(super) files: HashSet<PathBuf>,
    pub(super) dirs: HashSet<PathBuf>,
}

/// Called after each fsync, in tests.
#[cfg(test)]
pub(super) type SyncHook = Arc<dyn Fn(&Path) + Send + Sync>;

/// Pending files above which `flush` syncs the whole filesystem at once.
#[cfg(target_os = "linux")]
pub(super) const SYNCFS_ABOVE: usize = 16;

impl Shared {
    pub(super) fn flush(&self) -> Result<()> {
        // One flush at a time: one that started earlier may hold files this
        // caller wrote, and must have synced them before this one returns.
        let _one = self.syncing.lock();
        let d = std::mem::take(&mut *self.dirty.lock());
        if d.files.is_empty() && d.dirs.is_empty() {
            return Ok(());
        }
        let r = self.sync_dirty(&d);
        if r.is_err() {
            // Not synced: the next flush must try these again.
            let mut now = self.dirty.lock();
            now.files.extend(d.files);
            now.dirs.extend(d.dirs);
        }
        r
    }

    fn sync_dirty(&self, d: &Dirty) -> Result<()> {
        // Many files: one syncfs does the work of a fsync per file and per
        // directory, with one barrier instead of hundreds.
        #[cfg(target_os = "linux")]
        if d.files.len() + d.dirs.len() > SYNCFS_ABOVE && *self.syncfs.get_or_init(|| syncfs_reaches(&self.dir)) {
            let dir = File::open(&self.dir).map_err(io_err)?;
            // Renames wait here too (see below): one that landed while the
            // filesystem synced could have its name made durable before its
            // data.
            let _no_renames = self.renames.write();
            // SAFETY: syncfs takes any fd on the filesystem; `dir` is open for the call.
            if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) } == 0 {
                self.synced(&self.dir);
                return Ok(());
            }
        }
        for f in &d.files {
            self.sync_file(f)?;
        }
        // A write renamed over an entry after its directory's files were
        // synced would have the directory sync make its name durable while
        // its data is not, losing the value it replaced (which may have been
        // acknowledged durable). So renames wait while directories sync, and
        // files renamed in since are synced first.
        let _no_renames = self.renames.write();
        let late: Vec<PathBuf> = {
            let now = self.dirty.lock();
            now.files.iter().filter(|f| f.parent().is_some_and(|p| d.dirs.contains(p))).cloned().collect()
        };
        for f in &late {
            self.sync_file(f)?;
        }
        for dir in &d.dirs {
            File::open(dir).and_then(|f| f.sync_all()).map_err(io_err)?;
            self.synced(dir);
        }
        Ok(())
    }

    fn sync_file(&self, f: &Path) -> Result<()> {
        match File::open(f) {
            Ok(file) => file.sync_all().map_err(io_err)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(e)),
        }
        self.synced(f);
        Ok(())
    }

    #[cfg(test)]
    fn synced(&self, path: &Path) {
        let hook = self.sync_hook.lock().clone();
        if let Some(h) = hook {
            h(path);
        }
    }

    #[cfg(not(test))]
    fn synced(&self, _path: &Path) {}
}
