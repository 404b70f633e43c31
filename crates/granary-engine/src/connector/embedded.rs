//! The in-process transport: calls on a [`Store`] handed in by the caller.

use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use granary_core::BlockHash;
use granary_warehouse::{PutOptions, Store};

use super::{key_of, ConnectorConfig, Result, Source};

/// Block reads an embedded `get_many` keeps going at once.
const READS_IN_FLIGHT: usize = 4;

pub(super) struct Embedded {
    store: Arc<Store>,
    ns: String,
}

impl Embedded {
    pub(super) fn new(store: Arc<Store>, cfg: &ConnectorConfig) -> Self {
        Embedded { store, ns: cfg.namespace.clone() }
    }

    pub(super) async fn lookup(&self, keys: &[BlockHash]) -> Result<usize> {
        let keys: Vec<Bytes> = keys.iter().map(key_of).collect();
        Ok(self.store.lookup(&self.ns, &keys).await?.matched)
    }

    /// Reads up to [`READS_IN_FLIGHT`] blocks at once (a lower tier's reads
    /// overlap), answers in order.
    pub(super) async fn get_many(&self, keys: &[BlockHash]) -> Result<Vec<Option<(Bytes, Source)>>> {
        let reads: Vec<_> = keys
            .iter()
            .map(|k| {
                let (store, ns, key) = (self.store.clone(), self.ns.clone(), key_of(k));
                async move {
                    let hit = store.get(&ns, &key).await?;
                    Ok(hit.map(|h| (h.value, Source::from(h.tier))))
                }
            })
            .collect();
        futures::stream::iter(reads).buffered(READS_IN_FLIGHT).try_collect().await
    }

    pub(super) async fn put_many(&self, frames: &[(BlockHash, Bytes)]) -> Result<()> {
        for (hash, frame) in frames {
            self.store.put(&self.ns, key_of(hash), frame.clone(), PutOptions::default()).await?;
        }
        Ok(())
    }
}
