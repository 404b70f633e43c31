//! The in-process transport: calls on a [`Store`] handed in by the caller.

use std::sync::Arc;

use bytes::Bytes;
use granary_core::BlockHash;
use granary_warehouse::{PutOptions, Store};

use super::{key_of, ConnectorConfig, Result, Source};

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

    pub(super) async fn get_many(&self, keys: &[BlockHash]) -> Result<Vec<Option<(Bytes, Source)>>> {
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let hit = self.store.get(&self.ns, &key_of(k)).await?;
            out.push(hit.map(|h| (h.value, Source::from(h.tier))));
        }
        Ok(out)
    }

    pub(super) async fn put_many(&self, frames: &[(BlockHash, Bytes)]) -> Result<()> {
        for (hash, frame) in frames {
            self.store.put(&self.ns, key_of(hash), frame.clone(), PutOptions::default()).await?;
        }
        Ok(())
    }
}
