//! The disk tier's file-level helpers: entry names, quiet unlinks, durable
//! directory creation, whole-file reads, and whether `syncfs` reaches the
//! filesystem.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::Path;

use bytes::Bytes;

use crate::tier::at_rest::AlignedBuf;

/// The file name of an entry: 32 hex chars of a hash of namespace and key.
pub(super) fn entry_name(ns: &str, key: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&(ns.len() as u16).to_le_bytes());
    h.update(ns.as_bytes());
    h.update(key);
    hex::encode(&h.finalize().as_bytes()[..16])
}

pub(super) fn is_entry_name(name: &str) -> bool {
    name.len() == 32 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

pub(super) fn remove_quiet(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Creates a directory and any missing parents, each entry synced into
/// its parent: a tier directory that a crash can forget would take every
/// durable write in it along.
pub(super) fn create_dir_durable(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    create_dir_durable(parent)?;
    match fs::create_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    File::open(parent)?.sync_all()
}

/// Whether `syncfs(2)` makes the filesystem holding `dir` durable. On FUSE
/// it does not: the kernel writes its own dirty pages back but sends the
/// filesystem no request, so a FUSE server's data stays unsynced.
#[cfg(target_os = "linux")]
pub(super) fn syncfs_reaches(dir: &Path) -> bool {
    const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
    let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str())) else {
        return false;
    };
    // SAFETY: `c` is a NUL-terminated path and `st` a zeroed statfs the call fills.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    st.f_type as i64 != FUSE_SUPER_MAGIC
}

/// Writes a new file and starts its writeback at once, so that the disk
/// works while the next blocks are prepared and a later flush waits for
/// I/O already under way instead of starting all of it. Durability still
/// comes only from the flush's fsync or syncfs.
pub(super) fn write_new(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut f = File::create_new(path)?;
    f.write_all(data)?;
    #[cfg(target_os = "linux")]
    // SAFETY: advisory call on an fd we own; a failure only loses the head start.
    unsafe {
        libc::sync_file_range(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
    Ok(())
}

/// Reads a whole file with one buffer of its exact size, first asking the
/// kernel to fetch all of it (one burst of I/O instead of readahead windows
/// paced by the copy).
/// The whole file, placed so that a plain record's value is aligned
/// (`value_at`: see [`AlignedBuf`]).
pub(super) fn read_whole(path: &Path, value_at: usize) -> io::Result<Bytes> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len() as usize;
    #[cfg(target_os = "linux")]
    {
        // SAFETY: advisory call on an fd we own; failure only loses the hint.
        unsafe {
            libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, len as libc::off_t, libc::POSIX_FADV_WILLNEED)
        };
    }
    let mut buf = AlignedBuf::new(len, value_at);
    f.read_to_end(buf.vec())?;
    Ok(buf.freeze())
}
