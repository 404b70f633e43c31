//! Saving in the background: a bounded queue drained by one task, so a
//! response never waits on the warehouse.

use std::sync::Arc;

use bytes::Bytes;
use granary_core::BlockHash;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::stats::add;
use super::{Connector, KvShape};

/// Sizes of a [`Saver`].
#[derive(Debug, Clone, Copy)]
pub struct SaverConfig {
    /// Blocks waiting to be saved; past this, new blocks are dropped.
    pub queue: usize,
    /// Most blocks written by one `put_many`.
    pub batch: usize,
}

impl Default for SaverConfig {
    fn default() -> Self {
        SaverConfig { queue: 1024, batch: 32 }
    }
}

/// Queues blocks and writes them with [`Connector::put_many`] from a
/// background task. A full queue drops the block and counts it
/// (`saves_dropped`); a failed write counts its blocks (`saves_failed`).
/// The warehouse is a cache: a block not saved costs a later hit, nothing else.
pub struct Saver {
    tx: mpsc::Sender<(BlockHash, KvShape, Bytes)>,
    connector: Arc<Connector>,
    task: JoinHandle<()>,
}

impl Saver {
    /// Starts the saving task on the current Tokio runtime.
    pub fn spawn(connector: Arc<Connector>, cfg: SaverConfig) -> Saver {
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let task = tokio::spawn(drain(connector.clone(), rx, cfg.batch.max(1)));
        Saver { tx, connector, task }
    }

    /// Queues a block without waiting; `false` when it was dropped (queue full).
    pub fn try_save(&self, hash: BlockHash, shape: &KvShape, payload: Bytes) -> bool {
        let stats = self.connector.stats();
        match self.tx.try_send((hash, *shape, payload)) {
            Ok(()) => {
                add(&stats.saves_queued, 1);
                true
            }
            Err(_) => {
                add(&stats.saves_dropped, 1);
                false
            }
        }
    }

    /// Blocks waiting in the queue.
    pub fn pending(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// Stops taking blocks, writes those already queued, and waits for the task.
    pub async fn close(self) {
        drop(self.tx);
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "warehouse saver task ended abnormally");
        }
    }
}

async fn drain(connector: Arc<Connector>, mut rx: mpsc::Receiver<(BlockHash, KvShape, Bytes)>, batch: usize) {
    let mut buf = Vec::with_capacity(batch);
    while rx.recv_many(&mut buf, batch).await > 0 {
        if connector.put_many(&buf).await.is_err() {
            // The connector has counted and logged the error itself.
            add(&connector.stats().saves_failed, buf.len() as u64);
        }
        buf.clear();
    }
}
