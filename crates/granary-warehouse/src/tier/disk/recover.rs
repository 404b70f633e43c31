//! Rebuilding the disk tier's index on open from the files present: temp
//! files removed as torn, bad or misnamed files dropped as corrupt, expired
//! ones removed, the rest recovered oldest first and evicted down to the
//! budget.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::time::SystemTime;

use bytes::Bytes;

use super::files::{create_dir_durable, entry_name, is_entry_name, remove_quiet};
use super::{io_err, Shared, TMP_SUFFIX};
use crate::error::Result;
use crate::tier::at_rest::{AtRest, PREAMBLE};
use crate::types::{now_ms, EntryMeta};

/// An entry found while recovering.
struct Found {
    mtime: SystemTime,
    ns: String,
    key: Bytes,
    size: u64,
    meta: EntryMeta,
}

impl Shared {
    pub(super) fn recover(&self) -> Result<()> {
        create_dir_durable(&self.dir).map_err(io_err)?;
        let mut found = Vec::new();
        for b in 0..=255u8 {
            let sub = self.dir.join(format!("{b:02x}"));
            match fs::create_dir(&sub) {
                Ok(()) => continue,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err(e)),
            }
            for entry in fs::read_dir(&sub).map_err(io_err)? {
                let entry = entry.map_err(io_err)?;
                if !entry.file_type().map_err(io_err)?.is_file() {
                    continue;
                }
                let path = entry.path();
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(TMP_SUFFIX) {
                    remove_quiet(&path).map_err(io_err)?;
                    self.c.torn_removed.fetch_add(1, Relaxed);
                    continue;
                }
                match self.probe(&path, &name) {
                    Ok(f) if f.meta.is_expired(now_ms()) => {
                        remove_quiet(&path).map_err(io_err)?;
                        self.c.expirations.fetch_add(1, Relaxed);
                    }
                    Ok(f) => found.push(f),
                    Err(reason) => {
                        tracing::warn!(path = %path.display(), %reason, "disk tier: dropping bad file");
                        remove_quiet(&path).map_err(io_err)?;
                        self.c.corrupt_dropped.fetch_add(1, Relaxed);
                    }
                }
            }
        }
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io_err)?;
        found.sort_by_key(|f| f.mtime);
        let mut ix = self.index.lock();
        self.c.recovered.store(found.len() as u64, Relaxed);
        for f in found {
            ix.insert(&f.ns, f.key, f.size, f.meta, ());
        }
        while self.capacity != 0 && ix.bytes() > self.capacity {
            let Some((ns, key, _)) = ix.evict_one(None, None) else { break };
            let path = self.path_of(&ns, &key);
            remove_quiet(&path).map_err(io_err)?;
            self.mark_dir(&path);
            self.c.evictions.fetch_add(1, Relaxed);
        }
        Ok(())
    }

    /// Checks a file's header, length and head; who it holds.
    fn probe(&self, path: &Path, name: &str) -> std::result::Result<Found, String> {
        if !is_entry_name(name)
            || path.parent().and_then(|p| p.file_name()).and_then(|p| p.to_str()) != Some(&name[..2])
        {
            return Err("not an entry file name".into());
        }
        let mut f = File::open(path).map_err(|e| e.to_string())?;
        let md = f.metadata().map_err(|e| e.to_string())?;
        let len = md.len();
        let mut pre = vec![0u8; PREAMBLE.min(len as usize)];
        f.read_exact(&mut pre).map_err(|e| e.to_string())?;
        let span = AtRest::head_span(&pre, Some(len)).map_err(|e| e.to_string())?;
        pre.resize(span, 0);
        f.read_exact(&mut pre[PREAMBLE..]).map_err(|e| e.to_string())?;
        let head = self.at_rest.open_head(&pre, Some(len)).map_err(|e| e.to_string())?;
        if entry_name(&head.namespace, &head.key) != name {
            return Err("file holds an entry of another name".into());
        }
        Ok(Found {
            mtime: md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            ns: head.namespace,
            key: head.key,
            size: len,
            meta: head.meta,
        })
    }
}
