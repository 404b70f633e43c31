//! The HTTP transport: the warehouse's block API (`/v1/blocks`, `/v1/lookup`).
//!
//! reqwest keeps idle connections for reuse; a semaphore caps requests in
//! flight (and so connections open) at `max_connections`. System proxy
//! settings are ignored: the warehouse is an internal service reached
//! directly. A request cancelled by the connector's deadline drops its
//! connection. Each request carries the caller's trace context
//! (`traceparent`) when tracing is on; the RESP transport has no headers
//! and carries none.

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use granary_core::BlockHash;
use granary_warehouse::http::MAX_LOOKUP_KEYS;
use reqwest::{Client, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use tokio::sync::{Semaphore, SemaphorePermit};

use super::{ConnectorConfig, ConnectorError, Result, Source};

/// The header naming the tier that served a block.
const TIER_HEADER: &str = "x-granary-tier";

pub(super) struct HttpClient {
    base: String,
    namespace: String,
    token: Option<String>,
    client: Client,
    permits: Semaphore,
    max_connections: usize,
    max_body: u64,
}

#[derive(Deserialize)]
struct LookupAnswer {
    matched: usize,
}

impl HttpClient {
    pub(super) fn new(addr: &str, cfg: &ConnectorConfig) -> Result<Self> {
        let client = Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(cfg.max_connections)
            .build()
            .map_err(|e| ConnectorError::Config(format!("HTTP client: {e}")))?;
        Ok(HttpClient {
            base: format!("http://{addr}"),
            namespace: cfg.namespace.clone(),
            token: cfg.token.clone(),
            client,
            permits: Semaphore::new(cfg.max_connections),
            max_connections: cfg.max_connections,
            max_body: cfg.max_block_bytes,
        })
    }

    fn authorized(&self, r: RequestBuilder) -> RequestBuilder {
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    fn block_url(&self, hash: &BlockHash) -> String {
        format!("{}/v1/blocks/{}/{}", self.base, self.namespace, hash)
    }

    /// A connection slot, held until the answer's body has been read.
    async fn permit(&self) -> SemaphorePermit<'_> {
        self.permits.acquire().await.expect("the semaphore is never closed")
    }

    /// Sends with the token and the current span's `traceparent` (none
    /// with tracing off).
    async fn send(&self, r: RequestBuilder) -> Result<Response> {
        Ok(self.authorized(r).headers(granary_core::trace::current_headers()).send().await?)
    }

    pub(super) async fn lookup(&self, keys: &[BlockHash]) -> Result<usize> {
        let url = format!("{}/v1/lookup", self.base);
        let mut matched = 0;
        for chunk in keys.chunks(MAX_LOOKUP_KEYS) {
            let _permit = self.permit().await;
            let body = serde_json::json!({ "namespace": self.namespace, "keys": chunk });
            let r = self.send(self.client.post(&url).json(&body)).await?;
            if r.status() != StatusCode::OK {
                return Err(refusal("lookup", r).await);
            }
            let answer: LookupAnswer = serde_json::from_slice(&r.bytes().await?)
                .map_err(|e| ConnectorError::Protocol(format!("lookup answer: {e}")))?;
            matched += answer.matched.min(chunk.len());
            if answer.matched < chunk.len() {
                break;
            }
        }
        Ok(matched)
    }

    async fn get_one(&self, hash: &BlockHash) -> Result<Option<(Bytes, Source)>> {
        let _permit = self.permit().await;
        let r = self.send(self.client.get(self.block_url(hash))).await?;
        match r.status() {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => return Ok(None),
            _ => return Err(refusal("get", r).await),
        }
        if let Some(len) = r.content_length().filter(|&l| l > self.max_body) {
            return Err(ConnectorError::Protocol(format!(
                "block of {len} bytes exceeds the limit of {} bytes",
                self.max_body
            )));
        }
        let tier =
            r.headers().get(TIER_HEADER).and_then(|v| v.to_str().ok()).map_or(Source::Unknown, Source::from_name);
        Ok(Some((r.bytes().await?, tier)))
    }

    pub(super) async fn get_many(&self, keys: &[BlockHash]) -> Result<Vec<Option<(Bytes, Source)>>> {
        // The futures are built before streaming: a closure inside the stream
        // type makes the returned future fail the `Send` proof that spawned
        // callers (the saver, the scheduler) need.
        let asks: Vec<_> = keys.iter().map(|k| self.get_one(k)).collect();
        futures::stream::iter(asks).buffered(self.max_connections).try_collect().await
    }

    async fn put_one(&self, hash: &BlockHash, frame: Bytes) -> Result<()> {
        let _permit = self.permit().await;
        let r = self.send(self.client.put(self.block_url(hash)).body(frame)).await?;
        match r.status() {
            StatusCode::CREATED | StatusCode::OK => Ok(()),
            _ => Err(refusal("put", r).await),
        }
    }

    pub(super) async fn put_many(&self, frames: &[(BlockHash, Bytes)]) -> Result<()> {
        let puts: Vec<_> = frames.iter().map(|(h, f)| self.put_one(h, f.clone())).collect();
        futures::stream::iter(puts).buffer_unordered(self.max_connections).try_collect().await
    }
}

/// An error answer as a [`ConnectorError::Refused`]: the status and the
/// warehouse's message (`{"error":{"message":...}}`) when it sent one.
async fn refusal(op: &'static str, r: Response) -> ConnectorError {
    let status = r.status();
    let body = r.bytes().await.unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned());
    ConnectorError::Refused { op, message: format!("HTTP {status}: {message}") }
}
