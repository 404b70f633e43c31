//! A FUSE filesystem that forgets what was never synced, for crash tests.
//!
//! It keeps two images of every inode. The *live* image is what programs
//! see through the mount. The *durable* image holds what a disk would still
//! have after losing power: a file's data as of its last `fsync` or
//! `fdatasync`, a directory's entries as of its last `fsync` on the
//! directory. Nothing else reaches it: not a write, not a create, not a
//! rename, not an unlink. That is the weakest behaviour POSIX allows, and
//! the one a storage design must survive (ext4 and XFS keep more on some
//! paths, by luck of their journals, not by contract).
//!
//! A power cut happens at a chosen count of changing operations (so it can
//! land between any write, rename and sync of concurrent writers) or on
//! demand. From then on every request fails with `EIO`, and the durable
//! image, pruned to what its root still reaches, is what a remount starts
//! from. A directory entry made durable before its file's data was synced
//! comes back as an empty file, as a real filesystem can leave it.
//!
//! `syncfs(2)` on a FUSE mount never reaches the filesystem (the kernel
//! sends no request for it), so this filesystem cannot honour it; neither
//! can any other FUSE filesystem, which is why the disk tier does not rely
//! on it there.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

const ROOT: u64 = 1;
const TTL: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
enum Body {
    File(Vec<u8>),
    Dir(BTreeMap<OsString, u64>),
}

#[derive(Clone, Debug)]
struct Node {
    body: Body,
    mtime: SystemTime,
    perm: u16,
}

impl Node {
    fn dir() -> Node {
        Node { body: Body::Dir(BTreeMap::new()), mtime: SystemTime::now(), perm: 0o755 }
    }

    /// What a power cut leaves of a node whose contents were never synced.
    fn blank(&self) -> Node {
        let body = match self.body {
            Body::File(_) => Body::File(Vec::new()),
            Body::Dir(_) => Body::Dir(BTreeMap::new()),
        };
        Node { body, ..self.clone() }
    }
}

/// What survived a power cut: the filesystem a remount starts from.
#[derive(Clone, Debug)]
pub struct Image {
    nodes: HashMap<u64, Node>,
}

impl Default for Image {
    fn default() -> Image {
        Image { nodes: HashMap::from([(ROOT, Node::dir())]) }
    }
}

impl Image {
    /// Keeps what the root reaches (an inode no durable entry names is gone).
    fn reachable(mut nodes: HashMap<u64, Node>) -> Image {
        let mut keep = HashMap::new();
        let mut todo = vec![ROOT];
        while let Some(ino) = todo.pop() {
            let Some(node) = nodes.remove(&ino) else { continue };
            if let Body::Dir(entries) = &node.body {
                todo.extend(entries.values().copied());
            }
            keep.insert(ino, node);
        }
        Image { nodes: keep }
    }
}

/// Counts of what the filesystem saw, for the test's own checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// Changing operations (the clock a cut is scheduled on).
    pub ops: u64,
    pub file_syncs: u64,
    pub dir_syncs: u64,
}

struct State {
    live: HashMap<u64, Node>,
    durable: HashMap<u64, Node>,
    next_ino: u64,
    counts: Counts,
    cut_at: Option<u64>,
    /// Set at the power cut: the durable image at that instant.
    survived: Option<Image>,
}

impl State {
    /// One changing operation: false once the power is off (the caller
    /// answers `EIO`), including when this very operation is where it goes.
    fn step(&mut self) -> bool {
        if self.survived.is_some() {
            return false;
        }
        self.counts.ops += 1;
        if self.cut_at.is_some_and(|at| self.counts.ops >= at) {
            self.cut();
            return false;
        }
        true
    }

    fn cut(&mut self) {
        if self.survived.is_none() {
            self.survived = Some(Image::reachable(self.durable.clone()));
        }
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let node = self.live.get(&ino)?;
        let (kind, size, nlink) = match &node.body {
            Body::File(d) => (FileType::RegularFile, d.len() as u64, 1),
            Body::Dir(_) => (FileType::Directory, 0, 2),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: node.mtime,
            mtime: node.mtime,
            ctime: node.mtime,
            crtime: node.mtime,
            kind,
            perm: node.perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn entries(&self, ino: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match self.live.get(&ino).map(|n| &n.body) {
            Some(Body::Dir(e)) => Ok(e),
            Some(Body::File(_)) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn entries_mut(&mut self, ino: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match self.live.get_mut(&ino) {
            Some(node) => {
                node.mtime = SystemTime::now();
                match &mut node.body {
                    Body::Dir(e) => Ok(e),
                    Body::File(_) => Err(Errno::ENOTDIR),
                }
            }
            None => Err(Errno::ENOENT),
        }
    }

    fn add(&mut self, parent: u64, name: &OsStr, node: Node) -> Result<u64, Errno> {
        if self.entries(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.live.insert(ino, node);
        self.entries_mut(parent)?.insert(name.to_os_string(), ino);
        Ok(ino)
    }

    fn sync_file(&mut self, ino: u64) -> Result<(), Errno> {
        let node = self.live.get(&ino).ok_or(Errno::ENOENT)?.clone();
        self.durable.insert(ino, node);
        self.counts.file_syncs += 1;
        Ok(())
    }

    fn sync_dir(&mut self, ino: u64) -> Result<(), Errno> {
        let node = self.live.get(&ino).ok_or(Errno::ENOENT)?;
        let Body::Dir(entries) = &node.body else { return Err(Errno::ENOTDIR) };
        let children: Vec<u64> = entries.values().copied().collect();
        let node = node.clone();
        for child in children {
            if !self.durable.contains_key(&child) {
                let blank = self.live[&child].blank();
                self.durable.insert(child, blank);
            }
        }
        // The directory's own entries, keeping what is durable of any
        // subdirectory's entries (synced separately).
        self.durable.insert(ino, node);
        self.counts.dir_syncs += 1;
        Ok(())
    }
}

/// The filesystem served on the mount.
struct PowerCutFs {
    state: Arc<Mutex<State>>,
}

macro_rules! live {
    ($st:ident, $reply:ident) => {
        if $st.survived.is_some() {
            return $reply.error(Errno::EIO);
        }
    };
}

macro_rules! step {
    ($st:ident, $reply:ident) => {
        if !$st.step() {
            return $reply.error(Errno::EIO);
        }
    };
}

impl Filesystem for PowerCutFs {
    fn init(&mut self, _req: &Request, _config: &mut KernelConfig) -> io::Result<()> {
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let st = self.state.lock();
        live!(st, reply);
        match st.entries(parent.0).map(|e| e.get(name).copied()) {
            Ok(Some(ino)) => reply.entry(&TTL, &st.attr(ino).expect("entries name live nodes"), Generation(0)),
            Ok(None) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let st = self.state.lock();
        live!(st, reply);
        match st.attr(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut st = self.state.lock();
        step!(st, reply);
        let Some(node) = st.live.get_mut(&ino.0) else { return reply.error(Errno::ENOENT) };
        if let Some(m) = mode {
            node.perm = (m & 0o7777) as u16;
        }
        if let Some(len) = size {
            match &mut node.body {
                Body::File(d) => d.resize(len as usize, 0),
                Body::Dir(_) => return reply.error(Errno::EISDIR),
            }
        }
        node.mtime = match mtime {
            Some(TimeOrNow::SpecificTime(t)) => t,
            _ => SystemTime::now(),
        };
        reply.attr(&TTL, &st.attr(ino.0).expect("just changed"));
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, reply: ReplyEntry) {
        let mut st = self.state.lock();
        step!(st, reply);
        let node = Node { perm: (mode & 0o7777) as u16, ..Node::dir() };
        match st.add(parent.0, name, node) {
            Ok(ino) => reply.entry(&TTL, &st.attr(ino).expect("just added"), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = self.state.lock();
        step!(st, reply);
        let ino = match st.entries(parent.0).map(|e| e.get(name).copied()) {
            Ok(Some(ino)) => ino,
            Ok(None) => return reply.error(Errno::ENOENT),
            Err(e) => return reply.error(e),
        };
        if matches!(st.live[&ino].body, Body::Dir(_)) {
            return reply.error(Errno::EISDIR);
        }
        // The inode stays (an open file is still read); only the name goes.
        st.entries_mut(parent.0).expect("checked").remove(name);
        reply.ok();
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = self.state.lock();
        step!(st, reply);
        let ino = match st.entries(parent.0).map(|e| e.get(name).copied()) {
            Ok(Some(ino)) => ino,
            Ok(None) => return reply.error(Errno::ENOENT),
            Err(e) => return reply.error(e),
        };
        match st.entries(ino) {
            Ok(e) if e.is_empty() => {}
            Ok(_) => return reply.error(Errno::ENOTEMPTY),
            Err(e) => return reply.error(e),
        }
        st.entries_mut(parent.0).expect("checked").remove(name);
        reply.ok();
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut st = self.state.lock();
        step!(st, reply);
        if !flags.is_empty() {
            return reply.error(Errno::EINVAL);
        }
        let ino = match st.entries(parent.0).map(|e| e.get(name).copied()) {
            Ok(Some(ino)) => ino,
            Ok(None) => return reply.error(Errno::ENOENT),
            Err(e) => return reply.error(e),
        };
        match st.entries(newparent.0).map(|e| e.get(newname).copied()) {
            Ok(Some(old)) if matches!(st.live[&old].body, Body::Dir(_)) => return reply.error(Errno::EISDIR),
            Ok(_) => {}
            Err(e) => return reply.error(e),
        }
        st.entries_mut(parent.0).expect("checked").remove(name);
        st.entries_mut(newparent.0).expect("checked").insert(newname.to_os_string(), ino);
        reply.ok();
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let st = self.state.lock();
        live!(st, reply);
        match st.live.get(&ino.0) {
            Some(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let st = self.state.lock();
        live!(st, reply);
        match st.live.get(&ino.0).map(|n| &n.body) {
            Some(Body::File(d)) => {
                let start = (offset as usize).min(d.len());
                let end = (start + size as usize).min(d.len());
                reply.data(&d[start..end]);
            }
            Some(Body::Dir(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut st = self.state.lock();
        step!(st, reply);
        let Some(node) = st.live.get_mut(&ino.0) else { return reply.error(Errno::ENOENT) };
        node.mtime = SystemTime::now();
        let Body::File(d) = &mut node.body else { return reply.error(Errno::EISDIR) };
        let end = offset as usize + data.len();
        if d.len() < end {
            d.resize(end, 0);
        }
        d[offset as usize..end].copy_from_slice(data);
        reply.written(data.len() as u32);
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let mut st = self.state.lock();
        step!(st, reply);
        match st.sync_file(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let st = self.state.lock();
        live!(st, reply);
        match st.entries(ino.0) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let st = self.state.lock();
        live!(st, reply);
        let entries = match st.entries(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        let mut all =
            vec![(ino.0, FileType::Directory, OsStr::new(".")), (ROOT, FileType::Directory, OsStr::new(".."))];
        for (name, child) in entries {
            let kind = match st.live[child].body {
                Body::File(_) => FileType::RegularFile,
                Body::Dir(_) => FileType::Directory,
            };
            all.push((*child, kind, name.as_os_str()));
        }
        for (i, (child, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let mut st = self.state.lock();
        step!(st, reply);
        match st.sync_dir(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut st = self.state.lock();
        step!(st, reply);
        let existing = match st.entries(parent.0) {
            Ok(e) => e.get(name).copied(),
            Err(e) => return reply.error(e),
        };
        let ino = match existing {
            Some(_) if flags & libc::O_EXCL != 0 => return reply.error(Errno::EEXIST),
            Some(ino) => {
                if flags & libc::O_TRUNC != 0 {
                    if let Some(Node { body: Body::File(d), .. }) = st.live.get_mut(&ino) {
                        d.clear();
                    }
                }
                ino
            }
            None => {
                let node =
                    Node { body: Body::File(Vec::new()), mtime: SystemTime::now(), perm: (mode & 0o7777) as u16 };
                match st.add(parent.0, name, node) {
                    Ok(ino) => ino,
                    Err(e) => return reply.error(e),
                }
            }
        };
        let attr = st.attr(ino).expect("live");
        reply.created(&TTL, &attr, Generation(0), FileHandle(0), FopenFlags::empty());
    }
}

/// A mounted [`PowerCutFs`].
pub struct Mounted {
    session: Option<BackgroundSession>,
    state: Arc<Mutex<State>>,
    path: PathBuf,
}

impl Mounted {
    /// Mounts a filesystem holding `image` at `path` (an empty directory).
    pub fn mount(path: &Path, image: Image) -> io::Result<Mounted> {
        let next_ino = image.nodes.keys().max().copied().unwrap_or(ROOT) + 1;
        let state = Arc::new(Mutex::new(State {
            live: image.nodes.clone(),
            durable: image.nodes,
            next_ino,
            counts: Counts::default(),
            cut_at: None,
            survived: None,
        }));
        let mut cfg = Config::default();
        cfg.mount_options = vec![MountOption::FSName("granary-powercut".into()), MountOption::RW];
        let session = fuser::spawn_mount(PowerCutFs { state: state.clone() }, path, &cfg)?;
        Ok(Mounted { session: Some(session), state, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Cuts the power when the count of changing operations reaches `ops`.
    pub fn cut_at(&self, ops: u64) {
        let mut st = self.state.lock();
        st.cut_at = Some(ops);
        if st.counts.ops >= ops {
            st.cut();
        }
    }

    /// Cuts the power now (a no-op if it is already off).
    pub fn cut_now(&self) {
        self.state.lock().cut();
    }

    pub fn counts(&self) -> Counts {
        self.state.lock().counts
    }

    /// Unmounts (after a cut: cutting now if none happened) and returns
    /// what survived.
    pub fn unmount(mut self) -> io::Result<Image> {
        self.cut_now();
        if let Some(s) = self.session.take() {
            s.umount_and_join()?;
        }
        Ok(self.state.lock().survived.clone().expect("cut above"))
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}
