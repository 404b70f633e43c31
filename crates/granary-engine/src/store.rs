//! The engine's [`BlockStore`] over a warehouse [`Connector`] (embedded,
//! RESP or HTTP).

use std::sync::Arc;

use anyhow::Result;
use bytes::Bytes;
use futures::future::BoxFuture;
use granary_core::hash::{BlockHash, KvLayout};

use crate::connector::{self, Connector, KvShape};
use crate::engine::{BlockStore, FetchedBlock, Source};

pub struct ConnectorStore {
    conn: Arc<Connector>,
    shape: KvShape,
}

impl ConnectorStore {
    /// Blocks of `layout` (one shape for every block this engine writes).
    pub fn new(conn: Arc<Connector>, layout: KvLayout) -> Self {
        ConnectorStore { conn, shape: KvShape::of_block(&layout) }
    }

    pub fn connector(&self) -> &Arc<Connector> {
        &self.conn
    }
}

/// The warehouse tier as a prompt-token source. A transport that does not
/// say (RESP) counts as remote: the KV crossed the network from another
/// process.
fn source(t: connector::Source) -> Source {
    match t {
        connector::Source::Memory => Source::Memory,
        connector::Source::Disk => Source::Disk,
        connector::Source::Remote | connector::Source::Unknown => Source::Remote,
    }
}

impl BlockStore for ConnectorStore {
    fn lookup<'a>(&'a self, hashes: &'a [BlockHash]) -> BoxFuture<'a, Result<usize>> {
        Box::pin(async move { Ok(self.conn.lookup(hashes).await?) })
    }

    fn get_many<'a>(&'a self, hashes: &'a [BlockHash]) -> BoxFuture<'a, Result<Vec<Option<FetchedBlock>>>> {
        Box::pin(async move {
            let got = self.conn.get_many(hashes, &self.shape).await?;
            Ok(got
                .into_iter()
                .map(|b| b.map(|l| FetchedBlock { payload: l.payload, source: source(l.tier) }))
                .collect())
        })
    }

    fn put_many(&self, blocks: Vec<(BlockHash, Bytes)>) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let framed: Vec<(BlockHash, KvShape, Bytes)> =
                blocks.into_iter().map(|(h, p)| (h, self.shape, p)).collect();
            Ok(self.conn.put_many(&framed).await?)
        })
    }
}
