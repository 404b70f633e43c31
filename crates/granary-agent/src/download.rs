//! Parallel, resumable, verified downloads of weight files.
//!
//! A file is cut into fixed chunks (16 MiB by default) fetched with HTTP
//! range requests, several at once, each written at its offset into
//! `<dest>.part`. A sidecar, `<dest>.part.json`, lists the chunks that are
//! on disk (each is `fdatasync`ed before it is listed), so a download that
//! was interrupted — a dropped connection, a killed agent — fetches only the
//! chunks it lacks when it runs again. When every chunk is there the file is
//! hashed; only a sha256 equal to the registry's lets it be renamed into
//! place. A mismatch removes the part file and its sidecar. So does a full
//! filesystem: `ENOSPC` is reported naming the directory, and nothing
//! partial stays behind to hold the space.
//!
//! The part file is preallocated (`posix_fallocate`) by default, so a file
//! that cannot fit fails before the first byte is fetched.
//!
//! Progress goes to an `indicatif` bar per file on stderr (drawn only when
//! stderr is a terminal) and to [`Downloads`], which `GET /status` shows.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::AgentError;

/// How downloads are cut and retried.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DownloadConfig {
    /// Range requests in flight at once, across all files of one load.
    pub parallel: usize,
    /// Bytes per range request.
    pub chunk_bytes: u64,
    /// Tries per chunk before the download fails (network errors, 5xx, 429).
    pub retries: u32,
    /// Reserve the whole file's blocks before fetching (`posix_fallocate`),
    /// so a file that cannot fit fails at once.
    pub preallocate: bool,
    /// Time limit of one range request, headers to last byte.
    #[serde(with = "crate::config::duration")]
    pub request_timeout: Duration,
}

impl Default for DownloadConfig {
    fn default() -> Self {
        DownloadConfig {
            parallel: 8,
            chunk_bytes: 16 << 20,
            retries: 4,
            preallocate: true,
            request_timeout: Duration::from_secs(300),
        }
    }
}

/// One file to fetch.
#[derive(Debug, Clone)]
pub struct FileRequest {
    /// Where the bytes are: a presigned object-store URL or the registry's blob URL.
    pub url: String,
    /// Sent as `Authorization: Bearer` (only to the registry itself: a
    /// presigned URL carries its own signature).
    pub bearer: Option<String>,
    /// Size the registry lists.
    pub size: u64,
    /// sha256 the registry lists, lowercase hex.
    pub sha256: String,
    /// Name shown in progress and errors (the file's path in its model).
    pub label: String,
}

/// What one [`Downloader::fetch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Range requests sent (retries included).
    pub requests: u64,
    /// Body bytes received.
    pub bytes: u64,
    /// Bytes already on disk from an earlier, interrupted try.
    pub resumed_bytes: u64,
}

/// Progress of one file, shared with `GET /status`.
#[derive(Debug)]
pub struct Progress {
    pub file: String,
    pub total: u64,
    done: AtomicU64,
}

impl Progress {
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

/// Downloads in progress, for `GET /status`.
#[derive(Debug, Default, Clone)]
pub struct Downloads {
    active: Arc<Mutex<Vec<Arc<Progress>>>>,
}

/// One row of `GET /status`'s `downloads`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DownloadStatus {
    pub file: String,
    pub done: u64,
    pub total: u64,
}

impl Downloads {
    pub fn snapshot(&self) -> Vec<DownloadStatus> {
        self.active
            .lock()
            .iter()
            .map(|p| DownloadStatus { file: p.file.clone(), done: p.done(), total: p.total })
            .collect()
    }

    fn add(&self, p: Arc<Progress>) {
        self.active.lock().push(p);
    }

    fn remove(&self, p: &Arc<Progress>) {
        self.active.lock().retain(|x| !Arc::ptr_eq(x, p));
    }
}

/// The sidecar: which chunks of the part file are on disk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Sidecar {
    size: u64,
    chunk_bytes: u64,
    sha256: String,
    done: BTreeSet<u64>,
}

/// Fetches files; cheap to clone.
#[derive(Clone)]
pub struct Downloader {
    http: reqwest::Client,
    cfg: DownloadConfig,
    slots: Arc<tokio::sync::Semaphore>,
    downloads: Downloads,
    bars: MultiProgress,
}

/// `<dest>.part`
pub fn part_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_owned();
    s.push(".part");
    PathBuf::from(s)
}

/// `<dest>.part.json`
pub fn sidecar_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_owned();
    s.push(".part.json");
    PathBuf::from(s)
}

/// Removes the part file and its sidecar (either may be missing).
pub fn remove_partial(dest: &Path) {
    let _ = std::fs::remove_file(part_path(dest));
    let side = sidecar_path(dest);
    let _ = std::fs::remove_file(side.with_extension("json.tmp"));
    let _ = std::fs::remove_file(side);
}

enum ChunkError {
    /// Worth another try: connection, timeout, 5xx, 429, short body.
    Transient(String),
    /// Not worth another try.
    Fatal(AgentError),
    /// Another chunk failed for good; this one stopped without finishing.
    Aborted,
}

impl Downloader {
    pub fn new(cfg: DownloadConfig) -> Result<Self, AgentError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| AgentError::Download { file: String::new(), message: format!("HTTP client: {e}") })?;
        let slots = Arc::new(tokio::sync::Semaphore::new(cfg.parallel.max(1)));
        Ok(Downloader {
            http,
            cfg,
            slots,
            downloads: Downloads::default(),
            bars: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
        })
    }

    pub fn config(&self) -> &DownloadConfig {
        &self.cfg
    }

    /// Downloads in progress.
    pub fn downloads(&self) -> &Downloads {
        &self.downloads
    }

    /// Fetches `req` into `dest` (resuming a part file left by an earlier
    /// try), verifies its sha256 and renames it into place.
    pub async fn fetch(&self, req: &FileRequest, dest: &Path) -> Result<FetchStats, AgentError> {
        let dir = dest.parent().unwrap_or(Path::new(".")).to_path_buf();
        let sidecar = self.prepare(req, dest, &dir).await?;
        let chunk = sidecar.chunk_bytes;
        let chunks = req.size.div_ceil(chunk);
        let resumed: u64 = sidecar.done.iter().map(|&i| chunk_len(i, chunk, req.size)).sum();
        let pending: Vec<u64> = (0..chunks).filter(|i| !sidecar.done.contains(i)).collect();

        let progress = Arc::new(Progress { file: req.label.clone(), total: req.size, done: AtomicU64::new(resumed) });
        self.downloads.add(progress.clone());
        let bar = self.bars.add(ProgressBar::new(req.size));
        bar.set_style(
            ProgressStyle::with_template("{msg:30!} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(req.label.clone());
        bar.set_position(resumed);

        let result = self.fetch_chunks(req, dest, &dir, sidecar, pending, &progress, &bar).await;
        self.downloads.remove(&progress);
        bar.finish_and_clear();
        self.bars.remove(&bar);
        let mut stats = result?;
        stats.resumed_bytes = resumed;
        self.finish(req, dest, &dir).await?;
        Ok(stats)
    }

    /// Opens (or resumes) the part file and returns its sidecar.
    async fn prepare(&self, req: &FileRequest, dest: &Path, dir: &Path) -> Result<Sidecar, AgentError> {
        let (req, dest, dir, cfg) = (req.clone(), dest.to_path_buf(), dir.to_path_buf(), self.cfg.clone());
        blocking(move || {
            std::fs::create_dir_all(&dir)
                .map_err(|e| no_space_or(e, &dir, &req, || format!("creating {}", dir.display())))?;
            let part = part_path(&dest);
            let side = sidecar_path(&dest);
            let existing: Option<Sidecar> = std::fs::read(&side).ok().and_then(|b| serde_json::from_slice(&b).ok());
            let fresh = Sidecar {
                size: req.size,
                chunk_bytes: cfg.chunk_bytes.max(1),
                sha256: req.sha256.clone(),
                done: BTreeSet::new(),
            };
            let part_len = std::fs::metadata(&part).map(|m| m.len()).ok();
            match existing {
                Some(s)
                    if s.size == req.size
                        && s.sha256 == req.sha256
                        && s.chunk_bytes > 0
                        && part_len == Some(req.size) =>
                {
                    tracing::info!(file = %req.label, chunks_done = s.done.len(), "resuming a partial download");
                    Ok(s)
                }
                _ => {
                    remove_partial(&dest);
                    let f = File::options()
                        .write(true)
                        .create_new(true)
                        .open(&part)
                        .map_err(|e| no_space_or(e, &dir, &req, || format!("creating {}", part.display())))?;
                    let reserved = if cfg.preallocate { preallocate(&f, req.size) } else { Ok(()) };
                    let sized = reserved.and_then(|()| f.set_len(req.size));
                    if let Err(e) = sized {
                        remove_partial(&dest);
                        return Err(no_space_or(e, &dir, &req, || format!("sizing {}", part.display())));
                    }
                    write_sidecar(&side, &fresh).map_err(|e| {
                        remove_partial(&dest);
                        no_space_or(e, &dir, &req, || format!("writing {}", side.display()))
                    })?;
                    Ok(fresh)
                }
            }
        })
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn fetch_chunks(
        &self,
        req: &FileRequest,
        dest: &Path,
        dir: &Path,
        sidecar: Sidecar,
        pending: Vec<u64>,
        progress: &Arc<Progress>,
        bar: &ProgressBar,
    ) -> Result<FetchStats, AgentError> {
        let part = part_path(dest);
        let file = Arc::new(
            File::options()
                .write(true)
                .open(&part)
                .map_err(|e| AgentError::io(format!("opening {}", part.display()), e))?,
        );
        let chunk = sidecar.chunk_bytes;
        let sidecar = Arc::new(Mutex::new(sidecar));
        let side_path = sidecar_path(dest);
        let requests = AtomicU64::new(0);
        let bytes = AtomicU64::new(0);
        // Set by the first chunk that fails for good: the others stop early,
        // and every one has finished its file work before this returns.
        let abort = std::sync::atomic::AtomicBool::new(false);
        let results: Vec<Result<(), AgentError>> = futures::stream::iter(pending)
            .map(|i| {
                let (file, sidecar, side_path) = (file.clone(), sidecar.clone(), side_path.clone());
                let (requests, bytes, abort) = (&requests, &bytes, &abort);
                async move {
                    let _slot = self.slots.acquire().await.expect("the semaphore is never closed");
                    let start = i * chunk;
                    let len = chunk_len(i, chunk, req.size);
                    let mut tries = 0;
                    loop {
                        if abort.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        tries += 1;
                        requests.fetch_add(1, Ordering::Relaxed);
                        match self.fetch_range(req, dir, &file, start, len, bytes, abort, progress, bar).await {
                            Ok(()) => break,
                            Err(ChunkError::Aborted) => return Ok(()),
                            Err(ChunkError::Transient(msg)) if tries < self.cfg.retries.max(1) => {
                                tracing::warn!(file = %req.label, chunk = i, attempt = tries, "range request failed: {msg}");
                                tokio::time::sleep(Duration::from_millis(200 << tries.min(6))).await;
                            }
                            Err(ChunkError::Transient(message)) => {
                                abort.store(true, Ordering::Relaxed);
                                return Err(AgentError::Download { file: req.label.clone(), message });
                            }
                            Err(ChunkError::Fatal(e)) => {
                                abort.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                        }
                    }
                    // On disk first, then listed: the sidecar never claims bytes a crash could lose.
                    let (dir2, req2) = (dir.to_path_buf(), req.clone());
                    let written = blocking(move || {
                        file.sync_data().map_err(|e| no_space_or(e, &dir2, &req2, || "syncing the part file".into()))?;
                        // Held while writing, so sidecar snapshots land in order.
                        let mut s = sidecar.lock();
                        s.done.insert(i);
                        write_sidecar(&side_path, &s)
                            .map_err(|e| no_space_or(e, &dir2, &req2, || format!("writing {}", side_path.display())))
                    })
                    .await;
                    if written.is_err() {
                        abort.store(true, Ordering::Relaxed);
                    }
                    written
                }
            })
            .buffer_unordered(self.cfg.parallel.max(1))
            .collect()
            .await;
        let errors: Vec<AgentError> = results.into_iter().filter_map(Result::err).collect();
        if let Some(e) = errors.iter().position(|e| matches!(e, AgentError::NoSpace { .. })) {
            // A full disk: nothing partial stays to hold the space.
            remove_partial(dest);
            return Err(errors.into_iter().nth(e).expect("the index is in range"));
        }
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        Ok(FetchStats {
            requests: requests.load(Ordering::Relaxed),
            bytes: bytes.load(Ordering::Relaxed),
            resumed_bytes: 0,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn fetch_range(
        &self,
        req: &FileRequest,
        dir: &Path,
        file: &Arc<File>,
        start: u64,
        len: u64,
        bytes: &AtomicU64,
        abort: &std::sync::atomic::AtomicBool,
        progress: &Progress,
        bar: &ProgressBar,
    ) -> Result<(), ChunkError> {
        let end = start + len - 1;
        let mut r = self
            .http
            .get(&req.url)
            .header(reqwest::header::RANGE, format!("bytes={start}-{end}"))
            .timeout(self.cfg.request_timeout);
        if let Some(t) = &req.bearer {
            r = r.bearer_auth(t);
        }
        let resp = r.send().await.map_err(|e| ChunkError::Transient(e.to_string()))?;
        let status = resp.status();
        let whole_file = start == 0 && len == req.size;
        match status.as_u16() {
            206 => {
                let want = format!("bytes {start}-{end}/");
                let got =
                    resp.headers().get(reqwest::header::CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("");
                if !got.starts_with(&want) {
                    return Err(ChunkError::Fatal(AgentError::Download {
                        file: req.label.clone(),
                        message: format!("asked for bytes {start}-{end}, the server sent Content-Range {got:?}"),
                    }));
                }
            }
            200 if whole_file => {}
            200 => {
                return Err(ChunkError::Fatal(AgentError::Download {
                    file: req.label.clone(),
                    message: "the server ignores Range requests (answered 200 to a range)".into(),
                }))
            }
            408 | 429 | 500..=599 => return Err(ChunkError::Transient(format!("HTTP {status}"))),
            _ => {
                let body = resp.text().await.unwrap_or_default();
                let body: String = body.chars().take(300).collect();
                return Err(ChunkError::Fatal(AgentError::Download {
                    file: req.label.clone(),
                    message: format!("HTTP {status} from {}: {body}", redact(&req.url)),
                }));
            }
        }
        let dir = dir.to_path_buf();
        let mut stream = resp.bytes_stream();
        let mut offset = start;
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
        let flush = |buf: Vec<u8>, at: u64| {
            let f = file.clone();
            let req = req.clone();
            let dir = dir.clone();
            async move {
                blocking(move || f.write_all_at(&buf, at).map_err(|e| no_space_or(e, &dir, &req, || "writing".into())))
                    .await
            }
        };
        let mut counted = 0u64;
        let result = async {
            while let Some(piece) = stream.next().await {
                if abort.load(Ordering::Relaxed) {
                    return Err(ChunkError::Aborted);
                }
                let piece = piece.map_err(|e| ChunkError::Transient(format!("reading the body: {e}")))?;
                if offset - start + (buf.len() + piece.len()) as u64 > len {
                    return Err(ChunkError::Transient(format!("the server sent more than the {len} bytes asked for")));
                }
                bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
                buf.extend_from_slice(&piece);
                if buf.len() >= 1 << 20 {
                    let n = buf.len() as u64;
                    let full = std::mem::replace(&mut buf, Vec::with_capacity(1 << 20));
                    flush(full, offset).await.map_err(ChunkError::Fatal)?;
                    offset += n;
                    counted += n;
                    progress.done.fetch_add(n, Ordering::Relaxed);
                    bar.inc(n);
                }
            }
            if !buf.is_empty() {
                let n = buf.len() as u64;
                flush(std::mem::take(&mut buf), offset).await.map_err(ChunkError::Fatal)?;
                offset += n;
                counted += n;
                progress.done.fetch_add(n, Ordering::Relaxed);
                bar.inc(n);
            }
            if offset - start != len {
                return Err(ChunkError::Transient(format!("short body: {} of {len} bytes", offset - start)));
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            // This try's bytes count again when the range is fetched again.
            progress.done.fetch_sub(counted, Ordering::Relaxed);
            bar.set_position(progress.done());
        }
        result
    }

    /// Hashes the complete part file and renames it into place, or removes it.
    async fn finish(&self, req: &FileRequest, dest: &Path, dir: &Path) -> Result<(), AgentError> {
        let (req, dest, dir) = (req.clone(), dest.to_path_buf(), dir.to_path_buf());
        blocking(move || {
            let part = part_path(&dest);
            let actual = sha256_file(&part).map_err(|e| AgentError::io(format!("hashing {}", part.display()), e))?;
            if actual != req.sha256.to_ascii_lowercase() {
                remove_partial(&dest);
                return Err(AgentError::Integrity { file: req.label.clone(), expected: req.sha256.clone(), actual });
            }
            std::fs::rename(&part, &dest).map_err(|e| AgentError::io(format!("renaming {}", part.display()), e))?;
            let _ = std::fs::remove_file(sidecar_path(&dest));
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
            Ok(())
        })
        .await
    }
}

fn chunk_len(i: u64, chunk: u64, size: u64) -> u64 {
    chunk.min(size - i * chunk)
}

/// The URL without its query (a presigned URL's signature stays out of errors and logs).
fn redact(url: &str) -> &str {
    url.split('?').next().unwrap_or(url)
}

fn write_sidecar(path: &Path, s: &Sidecar) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(s).expect("a sidecar always serializes"))?;
    std::fs::rename(&tmp, path)
}

fn preallocate(f: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if len == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: a valid open descriptor; posix_fallocate reads no memory of ours.
    match unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        // Filesystems without fallocate: the file is sized sparsely instead.
        libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
        err => Err(std::io::Error::from_raw_os_error(err)),
    }
}

/// sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// ENOSPC becomes [`AgentError::NoSpace`] naming `dir`; anything else an I/O error.
fn no_space_or(e: std::io::Error, dir: &Path, req: &FileRequest, context: impl FnOnce() -> String) -> AgentError {
    if AgentError::is_no_space(&e) {
        AgentError::no_space(dir, &req.label, req.size)
    } else {
        AgentError::io(context(), e)
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, AgentError> + Send + 'static,
) -> Result<T, AgentError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| AgentError::io("a file task", std::io::Error::other(e.to_string())))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_file_exactly() {
        let (size, chunk) = (10 * 1024 + 7, 1024);
        let n = u64::div_ceil(size, chunk);
        assert_eq!(n, 11);
        let total: u64 = (0..n).map(|i| chunk_len(i, chunk, size)).sum();
        assert_eq!(total, size);
        assert_eq!(chunk_len(10, chunk, size), 7);
    }

    #[test]
    fn presigned_signatures_stay_out_of_messages() {
        assert_eq!(redact("https://s3.example/b/k?X-Amz-Signature=abc"), "https://s3.example/b/k");
    }
}
