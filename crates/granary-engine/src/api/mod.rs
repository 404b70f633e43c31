//! OpenAI-compatible HTTP API over a [`crate::Backend`].
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: generate, as one
//!   JSON body or, with `"stream": true`, as Server-Sent Events ending with
//!   `data: [DONE]`;
//! - `GET /v1/models`, `GET /v1/models/{id}`: the backend's models (with
//!   their context length as `max_model_len`);
//! - `POST /v1/embeddings`: the model's mean-pooled, normalised hidden
//!   states (float or base64);
//! - `POST /tokenize`, `POST /detokenize`: the model's tokenizer (and chat
//!   template), in vLLM's shapes;
//! - `GET /health` and `GET /ready`: `{"status":"ok"}`, or 503 with the
//!   reason when the backend cannot serve; `GET /metrics`: the backend's
//!   Prometheus text.
//!
//! Every refusal is an OpenAI-shaped [`ApiError`]. Requests are parsed and
//! validated, tokenized (chat messages through the model's chat template),
//! checked against the context, then submitted; the answer's text comes
//! from the incremental detokenizer, cut at the first stop string. A
//! client that goes away cancels its generation (see [`generate`]).
//!
//! Choices where OpenAI leaves room:
//! - without `max_tokens` a chat request may use the whole remaining
//!   context, a completion request 16 tokens (OpenAI's default); a prompt
//!   that leaves no room, or a `max_tokens` beyond the room left, is
//!   refused with `context_length_exceeded` (never silently clamped);
//! - sampling fields a request leaves out come from the model's defaults
//!   ([`crate::SamplingDefaults`]: its `generation_config.json`, else
//!   llama.cpp server's); vLLM's `top_k`, `min_p` and `repetition_penalty`
//!   are accepted too;
//! - `echo` puts the prompt's text before the answer; with `logprobs` (not
//!   streamed) the prompt is scored too, every token given those before it
//!   (the first `null`), and `max_tokens: 0` scores without generating;
//! - a completions `prompt` may batch up to 64 prompts (strings or token
//!   arrays), not streamed: each runs as its own request, and the choices
//!   come in prompt order (see `batch`);
//! - `n` up to 8, streamed or not, and completions' `best_of` up to 8, not
//!   streamed (see `answer::generate_n`); `suffix` is refused; a field the server does
//!   not know is refused with a 400 naming it (`unknown_parameter`), as
//!   OpenAI's API does, while OpenAI's fields that ask nothing of generation
//!   (`user`, `metadata`, `prompt_cache_key`...) are accepted;
//! - structured outputs (`response_format`, vLLM's `guided_*`) are enforced
//!   by constrained decoding ([`crate::constraint`]); tools are rendered
//!   through the model's chat template and calls parsed from its output in
//!   the model's own syntax (see `tools`); `tool_choice` `required` or a
//!   named function forces a call by grammar;
//! - a `developer` message is given to the chat template as `system`;
//!   text content parts are joined with newlines;
//! - `usage.prompt_tokens_details.cached_tokens` is the backend's count
//!   when it finishes the request; it is 0 when a stop string ended the
//!   answer first (the backend reports it only at the end).

mod answer;
mod batch;
mod body;
mod embeddings;
pub mod error;
mod generate;
mod request;
mod response;
mod stop;
mod structured;
mod tokenize;
mod tools;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tracing::Instrument;

use crate::types::{Backend, ModelInfo};
use body::JsonBody;
pub use error::{ApiError, ErrorType};
use request::{ChatRequest, CompletionRequest};
use response::Endpoint;

/// The header a trusted gateway may use to pick a request's namespace
/// (enabled through [`ApiOptions::namespace_header`]).
pub const NAMESPACE_HEADER: &str = "x-granary-namespace";

/// Longest namespace, as the warehouse allows.
const MAX_NAMESPACE: usize = granary_warehouse::store::MAX_NAMESPACE;

/// How the API behaves.
#[derive(Debug, Clone)]
pub struct ApiOptions {
    /// Largest accepted request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// The namespace of requests that name none (KV blocks are shared only
    /// within a namespace).
    pub default_namespace: String,
    /// When set, a request carrying this header runs in the namespace the
    /// header names. Only for servers reachable through a gateway that sets
    /// (and strips from clients) the header: whoever sets it picks whose
    /// cached prefixes the request may reuse.
    pub namespace_header: Option<HeaderName>,
}

impl Default for ApiOptions {
    fn default() -> Self {
        ApiOptions {
            max_body_bytes: 4 << 20,
            default_namespace: granary_warehouse::auth::DEFAULT_NAMESPACE.to_string(),
            namespace_header: None,
        }
    }
}

/// A request extension naming the request's namespace. A middleware layered
/// over [`router`] (an in-process gateway that authenticated the caller)
/// may insert it; it wins over [`ApiOptions::namespace_header`] and the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace(pub String);

/// What every handler sees.
#[derive(Clone)]
pub(crate) struct AppState {
    backend: Arc<dyn Backend>,
    opts: Arc<ApiOptions>,
    /// Grammar compilers, one per model, built on first use.
    grammars: Arc<answer::GrammarCache>,
    /// Model passes run beside the step loop (embeddings, prompt scores):
    /// one at a time, see [`AppState::side_pass`].
    side_passes: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    fn model(&self, id: &str) -> Result<ModelInfo, ApiError> {
        self.backend.models().into_iter().find(|m| m.id == id).ok_or_else(|| ApiError::model_not_found(id))
    }

    /// Runs `pass` (a forward pass over a prompt on its own KV) on the
    /// blocking pool once no other such pass runs. Each pass uses every
    /// core the model's kernels use and a KV cache of its own, so a burst of
    /// them run at once would starve the step loop of CPU and could hold
    /// more memory than the machine has; queued, they wait as futures, and
    /// a request dropped while waiting costs nothing.
    async fn side_pass<T: Send + 'static>(&self, pass: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        let permit = self.side_passes.clone().acquire_owned().await.map_err(|e| ApiError::internal(&e))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            pass()
        })
        .await
        .map_err(|e| ApiError::internal(&e))
    }
}

/// The OpenAI API over `backend`.
pub fn router(backend: Arc<dyn Backend>, opts: ApiOptions) -> Router {
    let body_limit = opts.max_body_bytes;
    let state = AppState {
        backend,
        opts: Arc::new(opts),
        grammars: Default::default(),
        side_passes: Arc::new(tokio::sync::Semaphore::new(1)),
    };
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/models", get(list_models))
        // Model ids may hold slashes (`org/name`).
        .route("/v1/models/{*id}", get(get_model))
        .route("/health", get(health))
        .route("/ready", get(health))
        .route("/metrics", get(metrics))
        .fallback(unknown_path)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

async fn unknown_path(req: Request) -> ApiError {
    ApiError::unknown_url(req.method().as_str(), req.uri().path())
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::method_not_allowed(req.method().as_str(), req.uri().path())
}

/// 200 `{"status": "ok"}`, or 503 `{"status": "error", "error": why}`
/// when the backend cannot serve.
async fn health(State(st): State<AppState>) -> Response {
    match st.backend.health() {
        Ok(()) => Json(json!({"status": "ok"})).into_response(),
        Err(why) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "error", "error": why})))
            .into_response(),
    }
}

async fn metrics(State(st): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.backend.metrics_text()).into_response()
}

fn model_object(m: &ModelInfo) -> serde_json::Value {
    json!({
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": "granary",
        "max_model_len": m.context_len,
    })
}

async fn list_models(State(st): State<AppState>) -> Json<serde_json::Value> {
    let data: Vec<_> = st.backend.models().iter().map(model_object).collect();
    Json(json!({"object": "list", "data": data}))
}

async fn get_model(State(st): State<AppState>, Path(id): Path<String>) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(model_object(&st.model(&id)?)))
}

/// The namespace a request runs in.
struct RequestNamespace(String);

impl FromRequestParts<AppState> for RequestNamespace {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, ApiError> {
        if let Some(Namespace(ns)) = parts.extensions.get::<Namespace>() {
            return Ok(RequestNamespace(ns.clone()));
        }
        if let Some(name) = &st.opts.namespace_header {
            if let Some(value) = parts.headers.get(name) {
                return match value.to_str() {
                    Ok(ns) if valid_namespace(ns) => Ok(RequestNamespace(ns.to_string())),
                    _ => Err(ApiError::bad_request(
                        "invalid_namespace",
                        format!(
                            "Invalid `{name}` header: a namespace is 1 to {MAX_NAMESPACE} ASCII letters, digits, '-', '_' or '.'."
                        ),
                    )),
                };
            }
        } else if parts.headers.contains_key(NAMESPACE_HEADER) {
            // Whoever sent it expects the request to run apart from other
            // tenants' KV; served in the default namespace, it would share
            // theirs.
            return Err(ApiError::bad_request(
                "untrusted_namespace_header",
                format!(
                    "This engine does not take the `{NAMESPACE_HEADER}` header: start it with \
                     --trust-namespace-header (only behind a gateway that sets the header), or leave the header out."
                ),
            ));
        }
        Ok(RequestNamespace(st.opts.default_namespace.clone()))
    }
}

fn valid_namespace(ns: &str) -> bool {
    granary_warehouse::types::check_namespace(ns.as_bytes()).is_ok()
}

async fn chat_completions(
    State(st): State<AppState>,
    headers: HeaderMap,
    RequestNamespace(ns): RequestNamespace,
    JsonBody(req): JsonBody<ChatRequest>,
) -> Result<Response, ApiError> {
    let span = request_span(&headers, "chat", &req.model);
    answer::generate(&st, ns, req.validate()?, Endpoint::Chat).instrument(span).await
}

async fn completions(
    State(st): State<AppState>,
    headers: HeaderMap,
    RequestNamespace(ns): RequestNamespace,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let span = request_span(&headers, "text_completion", &req.model);
    let v = req.validate()?;
    if !v.batch.is_empty() {
        return batch::generate_batch(&st, ns, v).instrument(span).await;
    }
    answer::generate(&st, ns, v, Endpoint::Completion).instrument(span).await
}

/// The `request` span of a generation, continuing the caller's trace. It
/// ends with the answer (a stream's last event); the engine's own spans
/// (`prefix_lookup`, `kv_load`, `prefill`, `first_token`) are its children.
fn request_span(headers: &HeaderMap, operation: &'static str, model: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        "otel.kind" = "server",
        "gen_ai.operation.name" = operation,
        "gen_ai.request.model" = model,
        "gen_ai.usage.input_tokens" = tracing::field::Empty,
        "gen_ai.usage.output_tokens" = tracing::field::Empty,
        "granary.cached_tokens" = tracing::field::Empty,
    );
    granary_core::trace::continue_from(&span, headers);
    span
}

#[cfg(test)]
mod tests;
