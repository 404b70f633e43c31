//! The engine's HTTP server: the OpenAI API plus the KV event stream routers
//! subscribe to.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::routing::get;
use axum::Router;
use futures::Stream;
use tokio::sync::broadcast::error::RecvError;

use crate::api::{self, ApiOptions};
use crate::engine::{Engine, KvEvent};

/// `/v1/*`, `/health`, `/metrics`, `GET /v1/kv/events` and `GET /v1/kv/config`.
pub fn router(engine: Engine, opts: ApiOptions) -> Router {
    let events = Router::new()
        .route("/v1/kv/events", get(kv_events))
        .route("/v1/kv/config", get(kv_config))
        .with_state(engine.clone());
    events.merge(api::router(Arc::new(engine), opts))
}

/// Server-sent events, one JSON [`KvEvent`] each: first a `stored` event per
/// namespace for what the engine holds now, then changes as they happen. A
/// subscriber that falls behind gets a fresh snapshot (preceded by a `reset`
/// event) instead of a gap.
async fn kv_events(State(engine): State<Engine>) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let mut rx = engine.subscribe_events();
    let stream = async_stream::stream! {
        for ev in snapshot(&engine) {
            yield Ok(to_sse(&ev));
        }
        loop {
            match rx.recv().await {
                Ok(ev) => yield Ok(to_sse(&ev)),
                Err(RecvError::Lagged(_)) => {
                    yield Ok(to_sse(&KvEvent { kind: "reset", namespace: String::new(), tier: "engine", hashes: vec![] }));
                    for ev in snapshot(&engine) {
                        yield Ok(to_sse(&ev));
                    }
                }
                Err(RecvError::Closed) => break,
            }
        }
    };
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// What a router needs to name this engine's blocks itself: with the
/// model's tokenizer, `HashChain::for_layout(namespace, fingerprint, layout)`
/// over the prompt's tokens gives the hashes KV events carry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvConfig {
    pub model: String,
    /// The model fingerprint, hashed into the chain root as its UTF-8 bytes.
    pub fingerprint: String,
    pub layout: granary_core::hash::KvLayout,
    pub role: crate::engine::Role,
}

async fn kv_config(State(engine): State<Engine>) -> axum::Json<KvConfig> {
    axum::Json(KvConfig {
        model: engine.config().model_id.clone(),
        fingerprint: engine.model().fingerprint().to_string(),
        layout: engine.layout(),
        role: engine.config().role,
    })
}

fn snapshot(engine: &Engine) -> Vec<KvEvent> {
    let mut by_ns: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (ns, h) in engine.resident_blocks() {
        by_ns.entry(ns).or_default().push(h);
    }
    by_ns.into_iter().map(|(namespace, hashes)| KvEvent { kind: "stored", namespace, tier: "engine", hashes }).collect()
}

fn to_sse(ev: &KvEvent) -> SseEvent {
    SseEvent::default().event(ev.kind).data(serde_json::to_string(ev).unwrap_or_default())
}
