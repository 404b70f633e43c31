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
//! succeeds again, every second while any wait, and at start. A record is
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

    /// Writes a batch; `Ok(false)` when it would not fit.
    fn spill(&mut self, batch: &[AuditRecord]) -> std::io::Result<bool> {
        let mut text = String::new();
        for r in batch {
            text.push_str(&serde_json::to_string(r).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        if self.bytes() + text.len() as u64 > self.max_bytes {
            return Ok(false);
        }
        let name = format!("{:020}-{}.jsonl", self.next_seq, batch.len());
        let tmp = self.dir.join(format!("{name}.tmp"));
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, self.dir.join(name))?;
        self.next_seq += 1;
        Ok(true)
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
    let writer = Writer { pool, stats, spool, down: false, pending: 0, write_timeout };
    tokio::spawn(writer.run(rx));
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
}

impl Writer {
    /// One attempt at a batch, bounded by the write timeout.
    async fn write(&self, batch: &[AuditRecord]) -> Result<(), String> {
        match tokio::time::timeout(self.write_timeout, write_batch(&self.pool, batch)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", self.write_timeout.as_millis())),
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Msg>) {
        self.count_pending();
        self.replay().await;
        let mut batch: Vec<AuditRecord> = Vec::with_capacity(BATCH_MAX);
        let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
        loop {
            // Wait for the first message of a batch (retrying the spool
            // meanwhile), then gather more until the batch is full, a flush
            // asks for it, or BATCH_WAIT has passed.
            let first = if self.pending > 0 {
                match tokio::time::timeout(REPLAY_EVERY, rx.recv()).await {
                    Ok(m) => m,
                    Err(_) => {
                        self.replay().await;
                        continue;
                    }
                }
            } else {
                rx.recv().await
            };
            let Some(first) = first else { break };
            let mut closed = false;
            let deadline = tokio::time::Instant::now() + BATCH_WAIT;
            let mut msg = Some(first);
            loop {
                match msg.take() {
                    Some(Msg::Record(r)) => batch.push(*r),
                    Some(Msg::Flush(w)) => {
                        waiters.push(w);
                        break;
                    }
                    None => {}
                }
                if batch.len() >= BATCH_MAX {
                    break;
                }
                // Take what is already queued without waiting; wait only when
                // nothing is.
                match rx.try_recv() {
                    Ok(m) => msg = Some(m),
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                    Err(mpsc::error::TryRecvError::Empty) => match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(m)) => msg = Some(m),
                        Ok(None) => {
                            closed = true;
                            break;
                        }
                        Err(_) => break,
                    },
                }
            }
            if !batch.is_empty() {
                self.store(&batch).await;
                batch.clear();
            } else if !waiters.is_empty() && self.pending > 0 {
                self.replay().await;
            }
            for w in waiters.drain(..) {
                let _ = w.send(());
            }
            if closed {
                break;
            }
        }
    }

    /// Writes a batch, retrying with backoff; spills it when the database
    /// keeps failing; drops (and counts) it only when it cannot be spilled.
    async fn store(&mut self, batch: &[AuditRecord]) {
        let attempts = if self.down { 1 } else { ATTEMPTS };
        let mut delay = RETRY_FIRST;
        let mut last_error = None;
        for attempt in 1..=attempts {
            match self.write(batch).await {
                Ok(()) => {
                    self.down = false;
                    if self.pending > 0 {
                        self.replay().await;
                    }
                    return;
                }
                Err(e) => {
                    self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                    last_error = Some(e);
                    if attempt < attempts {
                        tokio::time::sleep(delay).await;
                        delay *= 2;
                    }
                }
            }
        }
        let error = last_error.unwrap_or_default();
        if !self.down {
            tracing::error!(error, records = batch.len(), "audit: the database refuses writes; spooling batches");
        }
        self.down = true;
        let spilled = match &mut self.spool {
            Some(spool) => match spool.spill(batch) {
                Ok(true) => true,
                Ok(false) => {
                    tracing::error!(records = batch.len(), "audit: the spool is full; records dropped");
                    false
                }
                Err(e) => {
                    tracing::error!(error = %e, records = batch.len(), "audit: cannot spool; records dropped");
                    false
                }
            },
            None => {
                tracing::error!(error, records = batch.len(), "audit: no spool directory; records dropped");
                false
            }
        };
        if spilled {
            self.pending += 1;
            self.stats.spooled.fetch_add(batch.len() as u64, Ordering::Relaxed);
        } else {
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
            match self.write(&batch).await {
                Ok(()) => {
                    if let Err(e) = std::fs::remove_file(path) {
                        // Would be written twice: stop replaying rather than duplicate.
                        tracing::error!(error = %e, file = %path.display(), "audit: cannot remove a replayed spool file");
                        break;
                    }
                    self.down = false;
                    replayed += batch.len();
                }
                Err(_) => {
                    self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
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
