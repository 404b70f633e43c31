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

/// `/v1/*`, `/health`, `/metrics`, `GET /v1/kv/events`, `GET /v1/kv/config`
/// and `GET /v1/kv/tokenizer`.
pub fn router(engine: Engine, opts: ApiOptions) -> Router {
    let events = Router::new()
        .route("/v1/kv/events", get(kv_events))
        .route("/v1/kv/config", get(kv_config))
        .route("/v1/kv/tokenizer", get(kv_tokenizer))
        .with_state(engine.clone());
    events.merge(api::router(Arc::new(engine), opts))
}

/// Server-sent events, one JSON [`KvEvent`] each: first a `stored` event per
/// namespace for what the engine holds now, then changes as they happen. A
/// subscriber that falls behind gets a fresh snapshot (preceded by a `reset`
/// event) instead of a gap. The stream ends when the engine closes, so a
/// graceful shutdown does not wait on subscribers.
async fn kv_events(State(engine): State<Engine>) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let mut rx = engine.subscribe_events();
    let stream = async_stream::stream! {
        for ev in snapshot(&engine) {
            yield Ok(to_sse(&ev));
        }
        let closed = engine.closed();
        tokio::pin!(closed);
        loop {
            let got = tokio::select! {
                biased;
                _ = &mut closed => break,
                got = rx.recv() => got,
            };
            match got {
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

/// The model's tokenizer as Hugging Face files (`tokenizer.json`,
/// `tokenizer_config.json` with the chat template, `generation_config.json`),
/// keyed by file name: a router loads them to cut prompts into the same
/// tokens, and so the same block hashes, as this engine.
async fn kv_tokenizer(State(engine): State<Engine>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let tok = engine.tokenizer().clone();
    let files = tokio::task::spawn_blocking(move || -> anyhow::Result<std::collections::BTreeMap<String, String>> {
        let dir =
            std::env::temp_dir().join(format!("granary-tokenizer-{}-{}", std::process::id(), rand::random::<u64>()));
        let res = (|| {
            tok.save_pretrained(&dir)?;
            let mut files = std::collections::BTreeMap::new();
            for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
                files.insert(name.to_string(), std::fs::read_to_string(dir.join(name))?);
            }
            anyhow::Ok(files)
        })();
        let _ = std::fs::remove_dir_all(&dir);
        res
    })
    .await;
    match files {
        Ok(Ok(files)) => axum::Json(files).into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "exporting the tokenizer failed");
            (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "tokenizer export failed").into_response()
        }
        Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "tokenizer export failed").into_response(),
    }
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
