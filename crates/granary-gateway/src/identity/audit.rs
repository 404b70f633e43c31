//! The audit writer: one background task that drains a bounded queue and
//! writes records in batches, one transaction per batch.
//!
//! A batch is written as multi-row `INSERT`s into `audit_log`, and in the
//! same transaction added to `usage_daily` (one row per tenant, key, model
//! and UTC day), from which token budgets are reloaded at start.
//!
//! On a database error the batch is retried with backoff; if it still
//! fails it is spilled to the spool directory (one JSON-lines file per
//! batch, written to a temporary name and renamed, so a file is whole or
//! absent). Spooled batches are replayed oldest first as soon as a write
//! succeeds again, every second while any wait, and at start. While a
//! write runs the queue is still drained: with a spool, what arrives is
//! spilled every 100 ms, and a write still running after 100 ms has its
//! own batch spilled too, so a `kill -9` during a slow database loses at
//! most the last interval or two, not what queued behind the write.
//! (Writes are idempotent, so a batch both committed and spooled counts
//! once.) A record is
//! dropped (and counted) only when the queue is full, or when the batch
//! cannot be written and the spool is full, absent or failing.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};
use tokio::sync::{mpsc, oneshot};

use super::AuditRecord;

/// Most records written in one transaction.
const BATCH_MAX: usize = 512;
/// Rows per `INSERT` statement (17 parameters each: well under SQLite's
/// and PostgreSQL's parameter limits).
const ROWS_PER_INSERT: usize = 128;
/// How long a partial batch waits for more records before it is written.
const BATCH_WAIT: Duration = Duration::from_millis(100);
/// Attempts at a batch while the database is believed up; once a batch has
/// been spilled, new ones get one attempt each until a write succeeds.
const ATTEMPTS: u32 = 4;
/// The first retry's delay; doubled for each further one.
const RETRY_FIRST: Duration = Duration::from_millis(50);
/// How often spooled batches are retried while nothing else happens.
const REPLAY_EVERY: Duration = Duration::from_secs(1);
const DAY_MS: i64 = 86_400_000;

/// What the queue carries.
pub(super) enum Msg {
    Record(Box<AuditRecord>),
    /// Answered once everything queued before it is written (or spooled).
    Flush(oneshot::Sender<()>),
}

/// Counters the writer shares with [`super::Identity`].
#[derive(Default)]
pub(super) struct AuditStats {
    /// Records lost: queue full, or not written with no room to spool.
    pub dropped: AtomicU64,
    /// Records waiting in the spool now.
    pub spooled: AtomicU64,
    /// Database writes that failed (each retried or spooled).
    pub write_errors: AtomicU64,
}

/// Where the spool lives and how big it may grow.
#[derive(Clone, Debug)]
pub(super) struct SpoolConfig {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// The on-disk spool: files `{seq:020}-{records}.jsonl`, one batch each.
struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    next_seq: u64,
}

impl Spool {
    fn open(cfg: &SpoolConfig) -> std::io::Result<Spool> {
        std::fs::create_dir_all(&cfg.dir)?;
        // A `.tmp` file is a batch that was being spilled when the process
        // died: possibly incomplete, so never replayed (whole batches are
        // renamed into place only once synced).
        for e in std::fs::read_dir(&cfg.dir)?.flatten() {
            if e.path().extension().is_some_and(|x| x == "tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let mut spool = Spool { dir: cfg.dir.clone(), max_bytes: cfg.max_bytes, next_seq: 0 };
        spool.next_seq = spool.files()?.iter().filter_map(|p| seq_of(p)).max().map_or(0, |s| s + 1);
        Ok(spool)
    }

    /// The spooled batches, oldest first.
    fn files(&self) -> std::io::Result<Vec<PathBuf>> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(&self.dir)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl") && seq_of(p).is_some())
            .collect();
        out.sort();
        Ok(out)
    }

    fn bytes(&self) -> u64 {
        self.files().unwrap_or_default().iter().filter_map(|p| p.metadata().ok()).map(|m| m.len()).sum()
    }

    /// Writes a batch; its file, or `Ok(None)` when it would not fit.
    fn spill(&mut self, batch: &[AuditRecord]) -> std::io::Result<Option<PathBuf>> {
        let mut text = String::new();
        for r in batch {
            text.push_str(&serde_json::to_string(r).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        if self.bytes() + text.len() as u64 > self.max_bytes {
            return Ok(None);
        }
        let name = format!("{:020}-{}.jsonl", self.next_seq, batch.len());
        let tmp = self.dir.join(format!("{name}.tmp"));
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
        }
        let path = self.dir.join(name);
        std::fs::rename(&tmp, &path)?;
        self.next_seq += 1;
        Ok(Some(path))
    }
}

fn seq_of(p: &Path) -> Option<u64> {
    p.file_stem()?.to_str()?.split_once('-')?.0.parse().ok()
}

/// The records a spool file holds, from its name.
fn records_of(p: &Path) -> u64 {
    p.file_stem().and_then(|s| s.to_str()?.split_once('-')?.1.parse().ok()).unwrap_or(0)
}

fn read_batch(p: &Path) -> std::io::Result<Vec<AuditRecord>> {
    let text = std::fs::read_to_string(p)?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).map_err(std::io::Error::other))
        .collect()
}

/// Starts the writer; it ends when every sender is gone.
pub(super) fn spawn_writer(
    pool: AnyPool,
    capacity: usize,
    stats: Arc<AuditStats>,
    spool: Option<SpoolConfig>,
    write_timeout: Duration,
) -> mpsc::Sender<Msg> {
    let (tx, rx) = mpsc::channel(capacity);
    let spool = spool.and_then(|cfg| match Spool::open(&cfg) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(error = %e, dir = %cfg.dir.display(), "audit: cannot open the spool directory; spooling is off");
            None
        }
    });
    let writer = Writer {
        pool,
        stats,
        spool,
        down: false,
        pending: 0,
        write_timeout,
        rx,
        arrived: Vec::new(),
        waiters: Vec::new(),
        closed: false,
    };
    tokio::spawn(writer.run());
    tx
}

struct Writer {
    pool: AnyPool,
    stats: Arc<AuditStats>,
    spool: Option<Spool>,
    /// A batch has failed every attempt since the last successful write.
    down: bool,
    /// Spooled files waiting.
    pending: usize,
    /// The most one batch write may take.
    write_timeout: Duration,
    rx: mpsc::Receiver<Msg>,
    /// Records taken off the queue while a write was running and not
    /// spooled: the start of the next batch.
    arrived: Vec<AuditRecord>,
    /// Flushes taken off the queue while a write was running.
    waiters: Vec<oneshot::Sender<()>>,
    /// Every sender is gone.
    closed: bool,
}

impl Writer {
    /// Up to `attempts` writes of `batch` (each bounded by the write
    /// timeout, backing off between them), owning what it needs so that
    /// the queue is drained while it runs ([`Writer::drive`]).
    fn attempts(
        &self,
        batch: Vec<AuditRecord>,
        attempts: u32,
    ) -> impl std::future::Future<Output = Result<(), String>> + Send + 'static {
        let (pool, stats, timeout) = (self.pool.clone(), self.stats.clone(), self.write_timeout);
        async move {
            let mut delay = RETRY_FIRST;
            let mut last = String::new();
            for attempt in 1..=attempts {
                match tokio::time::timeout(timeout, write_batch(&pool, &batch)).await {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(e)) => last = e.to_string(),
                    Err(_) => last = format!("no answer within {} ms", timeout.as_millis()),
                }
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                if attempt < attempts {
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
            Err(last)
        }
    }

    /// Runs a database write to its end while taking what the queue
    /// brings. With a spool, what arrives meanwhile is spilled to it every
    /// [`BATCH_WAIT`] (and at [`BATCH_MAX`] records), and a write still
    /// running after one interval has its own `batch` spilled too
    /// (`ahead`), so that a `kill -9` during a slow commit loses at most
    /// the records of the last interval or two, not everything that queued
    /// up behind the commit. Without a spool, arrivals wait in memory for
    /// the next batch (at most [`BATCH_MAX`]; then the queue fills).
    async fn drive(
        &mut self,
        write: impl std::future::Future<Output = Result<(), String>>,
        batch: &[AuditRecord],
        ahead: bool,
    ) -> (Result<(), String>, Option<PathBuf>) {
        tokio::pin!(write);
        let mut spilled = None;
        let mut tick = tokio::time::Instant::now() + BATCH_WAIT;
        loop {
            let room = !self.closed && self.arrived.len() < BATCH_MAX;
            tokio::select! {
                r = &mut write => return (r, spilled),
                _ = tokio::time::sleep_until(tick) => {
                    tick += BATCH_WAIT;
                    if ahead && spilled.is_none() && self.spool.is_some() {
                        spilled = self.spill_counted(batch);
                    }
                    self.spill_arrived();
                }
                m = self.rx.recv(), if room => match m {
                    Some(Msg::Record(r)) => {
                        self.arrived.push(*r);
                        if self.arrived.len() >= BATCH_MAX {
                            self.spill_arrived();
                        }
                    }
                    Some(Msg::Flush(w)) => self.waiters.push(w),
                    None => self.closed = true,
                },
            }
        }
    }

    /// Spills the records gathered during a write, when there is a spool
    /// that takes them; otherwise they stay for the next batch.
    fn spill_arrived(&mut self) {
        if self.arrived.is_empty() || self.spool.is_none() {
            return;
        }
        let batch = std::mem::take(&mut self.arrived);
        if self.spill_counted(&batch).is_none() {
            self.arrived = batch;
        }
    }

    /// Writes `batch` to the spool and counts it there: its file, or `None`
    /// (logged) when there is no spool or it is full or failing.
    fn spill_counted(&mut self, batch: &[AuditRecord]) -> Option<PathBuf> {
        let spool = self.spool.as_mut()?;
        match spool.spill(batch) {
            Ok(Some(path)) => {
                self.pending += 1;
                self.stats.spooled.fetch_add(batch.len() as u64, Ordering::Relaxed);
                Some(path)
            }
            Ok(None) => {
                tracing::error!(records = batch.len(), "audit: the spool is full");
                None
            }
            Err(e) => {
                tracing::error!(error = %e, records = batch.len(), "audit: cannot spool");
                None
            }
        }
    }

    async fn run(mut self) {
        self.count_pending();
        self.replay().await;
        loop {
            // What arrived during the last write comes first.
            let mut batch = std::mem::take(&mut self.arrived);
            if batch.is_empty() && self.waiters.is_empty() {
                if self.closed {
                    break;
                }
                // Wait for the first message of a batch (retrying the
                // spool meanwhile).
                let first = if self.pending > 0 {
                    match tokio::time::timeout(REPLAY_EVERY, self.rx.recv()).await {
                        Ok(m) => m,
                        Err(_) => {
                            self.replay().await;
                            continue;
                        }
                    }
                } else {
                    self.rx.recv().await
                };
                match first {
                    None => break,
                    Some(Msg::Record(r)) => batch.push(*r),
                    Some(Msg::Flush(w)) => self.waiters.push(w),
                }
            }
            // Gather more until the batch is full, a flush asks for it, or
            // BATCH_WAIT has passed; take what is already queued without
            // waiting, wait only when nothing is.
            let deadline = tokio::time::Instant::now() + BATCH_WAIT;
            while self.waiters.is_empty() && !self.closed && batch.len() < BATCH_MAX {
                let m = match self.rx.try_recv() {
                    Ok(m) => m,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                    Err(mpsc::error::TryRecvError::Empty) => {
                        match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                            Ok(Some(m)) => m,
                            Ok(None) => {
                                self.closed = true;
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                };
                match m {
                    Msg::Record(r) => batch.push(*r),
                    Msg::Flush(w) => self.waiters.push(w),
                }
            }
            // Everything queued before these flushes is in `batch` (or
            // spooled): they are answered once it is written or spooled.
            let waiters = std::mem::take(&mut self.waiters);
            if !batch.is_empty() {
                self.store(batch).await;
            } else if !waiters.is_empty() && self.pending > 0 {
                self.replay().await;
            }
            for w in waiters {
                let _ = w.send(());
            }
        }
    }

    /// Writes a batch, retrying with backoff; spills it when the database
    /// keeps failing; drops (and counts) it only when it cannot be spilled.
    async fn store(&mut self, batch: Vec<AuditRecord>) {
        let attempts = if self.down { 1 } else { ATTEMPTS };
        let write = self.attempts(batch.clone(), attempts);
        let (result, ahead) = self.drive(write, &batch, true).await;
        let error = match result {
            Ok(()) => {
                self.down = false;
                if let Some(path) = ahead {
                    // Written: its copy in the spool goes. (Were it replayed
                    // after all, its rows would be skipped as already there.)
                    let _ = std::fs::remove_file(&path);
                    self.count_pending();
                }
                if self.pending > 0 {
                    self.replay().await;
                }
                return;
            }
            Err(e) => e,
        };
        if !self.down {
            tracing::error!(error, records = batch.len(), "audit: the database refuses writes; spooling batches");
        }
        self.down = true;
        if ahead.is_some() {
            // Already in the spool, spilled while the write was running.
            return;
        }
        if self.spool.is_none() {
            tracing::error!(error, records = batch.len(), "audit: no spool directory; records dropped");
        }
        if self.spill_counted(&batch).is_none() {
            self.stats.dropped.fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
    }

    /// Counts the spooled batches and records from the directory.
    fn count_pending(&mut self) {
        let Some(spool) = &self.spool else { return };
        let files = spool.files().unwrap_or_default();
        self.pending = files.len();
        self.stats.spooled.store(files.iter().map(|p| records_of(p)).sum(), Ordering::Relaxed);
    }

    /// Writes spooled batches, oldest first, until one fails.
    async fn replay(&mut self) {
        let Some(spool) = &self.spool else { return };
        let files = match spool.files() {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, "audit: cannot read the spool directory");
                return;
            }
        };
        let mut replayed = 0usize;
        for path in &files {
            let batch = match read_batch(path) {
                Ok(b) => b,
                Err(e) => {
                    // Kept aside for a person to look at, never replayed twice.
                    tracing::error!(error = %e, file = %path.display(), "audit: a spool file cannot be read; set aside");
                    let _ = std::fs::rename(path, path.with_extension("bad"));
                    continue;
                }
            };
            let n = batch.len();
            let write = self.attempts(batch, 1);
            let (result, _) = self.drive(write, &[], false).await;
            match result {
                Ok(()) => {
                    if let Err(e) = std::fs::remove_file(path) {
                        // Would be written twice: stop replaying rather than duplicate.
                        tracing::error!(error = %e, file = %path.display(), "audit: cannot remove a replayed spool file");
                        break;
                    }
                    self.down = false;
                    replayed += n;
                }
                Err(_) => {
                    self.down = true;
                    break;
                }
            }
        }
        self.count_pending();
        if replayed > 0 {
            tracing::info!(records = replayed, "audit: spooled records written");
        }
    }
}

fn clamp_u64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The UTC day holding `time_ms`, as the unix milliseconds of its start.
pub(super) fn day_of(time_ms: i64) -> i64 {
    time_ms.div_euclid(DAY_MS) * DAY_MS
}

/// One `usage_daily` row's increments.
#[derive(Default)]
struct Rollup {
    requests: i64,
    errors: i64,
    prompt: i64,
    completion: i64,
    cached: i64,
}

/// Writes a batch in one transaction: its audit rows, and their sums into
/// `usage_daily`. Idempotent: a record whose request id is there already
/// (the same batch written again after a commit whose answer was lost, or
/// a spool replayed) is skipped, and only the rows inserted are summed.
pub(super) async fn write_batch(pool: &AnyPool, batch: &[AuditRecord]) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let numbered = numbered_parameters(&tx);
    let mut inserted: HashSet<String> = HashSet::with_capacity(batch.len());
    for chunk in batch.chunks(ROWS_PER_INSERT) {
        let mut sql = String::from(
            "INSERT INTO audit_log (time_ms, request_id, tenant_id, tenant, key_id, endpoint, model, upstream, \
             status, error_code, stream, prompt_tokens, completion_tokens, cached_tokens, latency_ms, ttft_ms, prompt) \
             VALUES ",
        );
        push_values(&mut sql, chunk.len(), 17, numbered);
        sql.push_str(" ON CONFLICT (request_id) DO NOTHING RETURNING request_id");
        let mut q = sqlx::query(&sql);
        for r in chunk {
            q = q
                .bind(r.time_ms)
                .bind(r.request_id.as_str())
                .bind(r.tenant_id)
                .bind(r.tenant.as_deref())
                .bind(r.key_id)
                .bind(r.endpoint.as_str())
                .bind(r.model.as_deref())
                .bind(r.upstream.as_deref())
                .bind(i64::from(r.status))
                .bind(r.error_code.as_deref())
                .bind(i64::from(r.stream))
                .bind(clamp_u64(r.prompt_tokens))
                .bind(clamp_u64(r.completion_tokens))
                .bind(clamp_u64(r.cached_tokens))
                .bind(r.latency_ms)
                .bind(r.ttft_ms)
                .bind(r.prompt.as_deref());
        }
        for row in q.fetch_all(&mut *tx).await? {
            inserted.insert(row.try_get::<String, _>(0)?);
        }
    }
    // The daily rollup of the rows inserted (each id once), summed per row
    // first: one statement may not update a row twice (PostgreSQL).
    let mut rollup: BTreeMap<(i64, i64, String, i64), Rollup> = BTreeMap::new();
    for r in batch {
        if !inserted.remove(&r.request_id) {
            continue;
        }
        let Some(tenant_id) = r.tenant_id else { continue };
        let k = (tenant_id, r.key_id.unwrap_or(0), r.model.clone().unwrap_or_default(), day_of(r.time_ms));
        let e = rollup.entry(k).or_default();
        e.requests += 1;
        e.errors += i64::from(r.status >= 400);
        e.prompt = e.prompt.saturating_add(clamp_u64(r.prompt_tokens));
        e.completion = e.completion.saturating_add(clamp_u64(r.completion_tokens));
        e.cached = e.cached.saturating_add(clamp_u64(r.cached_tokens));
    }
    let rows: Vec<_> = rollup.into_iter().collect();
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let mut sql = String::from(
            "INSERT INTO usage_daily (tenant_id, key_id, model, day_ms, requests, errors, prompt_tokens, \
             completion_tokens, cached_tokens) VALUES ",
        );
        push_values(&mut sql, chunk.len(), 9, numbered);
        sql.push_str(
            " ON CONFLICT (tenant_id, key_id, model, day_ms) DO UPDATE SET \
             requests = usage_daily.requests + excluded.requests, \
             errors = usage_daily.errors + excluded.errors, \
             prompt_tokens = usage_daily.prompt_tokens + excluded.prompt_tokens, \
             completion_tokens = usage_daily.completion_tokens + excluded.completion_tokens, \
             cached_tokens = usage_daily.cached_tokens + excluded.cached_tokens",
        );
        let mut q = sqlx::query(&sql);
        for ((tenant, key, model, day), v) in chunk {
            q = q
                .bind(*tenant)
                .bind(*key)
                .bind(model.as_str())
                .bind(*day)
                .bind(v.requests)
                .bind(v.errors)
                .bind(v.prompt)
                .bind(v.completion)
                .bind(v.cached);
        }
        q.execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// PostgreSQL needs `$N` parameters; SQLite is given plain `?`: it looks a
/// named parameter up by a linear scan of the statement's names, once per
/// parameter bound, so a statement of 2,000 `$N` parameters cost more than
/// everything else the gateway did per request (`granary bench gateway`).
fn numbered_parameters(conn: &sqlx::AnyConnection) -> bool {
    conn.backend_name() != "SQLite"
}

/// Appends `($1, ..., $cols), (...)` (or `(?, ...)`) for `rows` rows.
fn push_values(sql: &mut String, rows: usize, cols: usize, numbered: bool) {
    use std::fmt::Write;
    let mut n = 0;
    for row in 0..rows {
        sql.push_str(if row == 0 { "(" } else { ", (" });
        for col in 0..cols {
            n += 1;
            let sep = if col == 0 { "" } else { ", " };
            if numbered {
                let _ = write!(sql, "{sep}${n}");
            } else {
                let _ = write!(sql, "{sep}?");
            }
        }
        sql.push(')');
    }
}

/// A record read back (the columns of [`super::Identity::audit`]'s query).
pub(super) fn from_row(r: &AnyRow) -> Result<AuditRecord, sqlx::Error> {
    let nonneg = |i: usize| -> Result<u64, sqlx::Error> { Ok(r.try_get::<i64, _>(i)?.max(0) as u64) };
    Ok(AuditRecord {
        time_ms: r.try_get(0)?,
        request_id: r.try_get(1)?,
        tenant_id: r.try_get(2)?,
        tenant: r.try_get(3)?,
        key_id: r.try_get(4)?,
        endpoint: r.try_get(5)?,
        model: r.try_get(6)?,
        upstream: r.try_get(7)?,
        status: u16::try_from(r.try_get::<i64, _>(8)?).unwrap_or(0),
        error_code: r.try_get(9)?,
        stream: r.try_get::<i64, _>(10)? != 0,
        prompt_tokens: nonneg(11)?,
        completion_tokens: nonneg(12)?,
        cached_tokens: nonneg(13)?,
        latency_ms: r.try_get(14)?,
        ttft_ms: r.try_get(15)?,
        prompt: r.try_get(16)?,
    })
}
