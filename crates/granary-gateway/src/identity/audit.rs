//! The audit writer: one background task that drains a bounded queue and
//! writes records in batches, one transaction per batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};
use tokio::sync::{mpsc, oneshot};

use super::AuditRecord;

/// Most records written in one transaction.
const BATCH_MAX: usize = 512;
/// How long a partial batch waits for more records before it is written.
const BATCH_WAIT: Duration = Duration::from_millis(100);

/// What the queue carries.
pub(super) enum Msg {
    Record(Box<AuditRecord>),
    /// Answered once everything queued before it is written.
    Flush(oneshot::Sender<()>),
}

/// Starts the writer; it ends when every sender is gone.
pub(super) fn spawn_writer(pool: AnyPool, capacity: usize, dropped: Arc<AtomicU64>) -> mpsc::Sender<Msg> {
    let (tx, rx) = mpsc::channel(capacity);
    tokio::spawn(run(pool, rx, dropped));
    tx
}

async fn run(pool: AnyPool, mut rx: mpsc::Receiver<Msg>, dropped: Arc<AtomicU64>) {
    let mut batch: Vec<AuditRecord> = Vec::with_capacity(BATCH_MAX);
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    loop {
        // Wait for the first message of a batch, then gather more until the
        // batch is full, a flush asks for it, or BATCH_WAIT has passed.
        let Some(first) = rx.recv().await else { break };
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
            if let Err(e) = write_batch(&pool, &batch).await {
                tracing::error!(error = %e, records = batch.len(), "writing audit records");
                dropped.fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
            batch.clear();
        }
        for w in waiters.drain(..) {
            let _ = w.send(());
        }
        if closed {
            break;
        }
    }
}

fn clamp_u64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

async fn write_batch(pool: &AnyPool, batch: &[AuditRecord]) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    for r in batch {
        sqlx::query(
            "INSERT INTO audit_log (time_ms, request_id, tenant_id, tenant, key_id, endpoint, model, upstream, \
             status, error_code, stream, prompt_tokens, completion_tokens, cached_tokens, latency_ms, ttft_ms, prompt) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
        )
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
        .bind(r.prompt.as_deref())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
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
