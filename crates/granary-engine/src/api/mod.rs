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
//! - `GET /health`: `{"status":"ok"}`; `GET /metrics`: the backend's
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
//! - `echo` puts the prompt's text before the answer (not with `logprobs`);
//! - `n` up to 8, not streamed (see `generate_n`); `best_of` only as 1;
//!   `suffix` is refused, and so
//!   are tools, `response_format` other than `text` and other servers'
//!   structured-output fields; `user` and unknown fields are ignored;
//! - a `developer` message is given to the chat template as `system`;
//!   text content parts are joined with newlines;
//! - `usage.prompt_tokens_details.cached_tokens` is the backend's count
//!   when it finishes the request; it is 0 when a stop string ended the
//!   answer first (the backend reports it only at the end).

mod body;
mod embeddings;
pub mod error;
mod generate;
mod request;
mod response;
mod stop;
mod tokenize;

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderName};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use granary_tokenizer::Tokenizer;
use serde_json::json;

use crate::types::{Backend, GenerateRequest, ModelInfo, SubmitError};
use body::JsonBody;
pub use error::{ApiError, ErrorType};
use generate::{collect, sse_data};
use request::{ChatRequest, CompletionRequest, Input, MaxTokens, Validated};
use response::{Endpoint, Header, UsageBody};

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
}

impl AppState {
    fn model(&self, id: &str) -> Result<ModelInfo, ApiError> {
        self.backend.models().into_iter().find(|m| m.id == id).ok_or_else(|| ApiError::model_not_found(id))
    }
}

/// The OpenAI API over `backend`.
pub fn router(backend: Arc<dyn Backend>, opts: ApiOptions) -> Router {
    let body_limit = opts.max_body_bytes;
    let state = AppState { backend, opts: Arc::new(opts) };
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

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
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
        }
        Ok(RequestNamespace(st.opts.default_namespace.clone()))
    }
}

fn valid_namespace(ns: &str) -> bool {
    (1..=MAX_NAMESPACE).contains(&ns.len())
        && ns.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

async fn chat_completions(
    State(st): State<AppState>,
    RequestNamespace(ns): RequestNamespace,
    JsonBody(req): JsonBody<ChatRequest>,
) -> Result<Response, ApiError> {
    generate(&st, ns, req.validate()?, Endpoint::Chat).await
}

async fn completions(
    State(st): State<AppState>,
    RequestNamespace(ns): RequestNamespace,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    generate(&st, ns, req.validate()?, Endpoint::Completion).await
}

/// Tokenizes, checks the context, submits, and answers.
async fn generate(st: &AppState, namespace: String, v: Validated, endpoint: Endpoint) -> Result<Response, ApiError> {
    let model = st.model(&v.model)?;
    let prompt_param = v.prompt_param();
    let tokenizer = model.tokenizer.clone();
    let echoed = match (&v.input, v.echo) {
        (Input::Text(t), true) => Some(t.clone()),
        (Input::Tokens(ids), true) => Some(tokenizer.decode(ids, false).map_err(|e| ApiError::internal(&e))?),
        _ => None,
    };
    let (prompt, stop_token_ids) = tokenize(tokenizer.clone(), v.input).await?;
    let max_tokens = budget(prompt.len(), model.context_len, v.max_tokens, prompt_param)?;
    let prompt_tokens = prompt.len();
    let vocab = tokenizer.vocab_size();
    if let Some(&(id, _)) = v.sampling.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("logit_bias.{id}"),
            "invalid_value",
            format!("Invalid value for `logit_bias`: token id {id} is outside the vocabulary of {vocab} tokens."),
        ));
    }
    let sampling = v.sampling.resolve(&model.sampling);
    let req = GenerateRequest { namespace, prompt, max_tokens, sampling, stop_token_ids };
    if v.n > 1 {
        let how = Choices {
            n: v.n,
            stop: v.stop,
            logprobs: v.sampling.logprobs.is_some(),
            prompt_param,
            endpoint,
            echoed,
            prompt_tokens,
        };
        return generate_n(st, &model.id, req, how).await;
    }
    let rx = st.backend.submit(&model.id, req).map_err(|e| submit_error(e, prompt_param))?;
    let header = Header::new(endpoint, model.id);
    if v.stream {
        let chunker = header.chunker(v.include_usage);
        let first = echoed.filter(|t| !t.is_empty()).map(|t| chunker.text_with(&t, None));
        let data = sse_data(rx, tokenizer, v.stop, chunker, prompt_tokens);
        let events = futures::stream::iter(first).chain(data).map(|d| Ok::<_, Infallible>(SseEvent::default().data(d)));
        return Ok(Sse::new(events).into_response());
    }
    let mut decoder = tokenizer.decode_stream(true);
    let out = collect(rx, &mut decoder, v.stop).await.map_err(|msg| {
        tracing::warn!(error = %msg, "generation failed");
        ApiError::generation_failed(&msg)
    })?;
    let usage = UsageBody::new(prompt_tokens, out.completion_tokens, out.cached_tokens);
    let logprobs = v.sampling.logprobs.map(|_| {
        let name = |id: u32| generate::DecoderSource::token_text(&tokenizer, id);
        response::logprobs_json(endpoint, &out.logprobs, &name, 0)
    });
    let text = match echoed {
        Some(prompt) => prompt + &out.text,
        None => out.text,
    };
    Ok(Json(header.complete_with(&text, out.reason, usage, logprobs)).into_response())
}

/// What [`generate_n`] needs of a validated request.
struct Choices {
    n: usize,
    stop: Vec<String>,
    logprobs: bool,
    prompt_param: &'static str,
    endpoint: Endpoint,
    echoed: Option<String>,
    prompt_tokens: usize,
}

/// `n` choices of one prompt, answered in one body. The first choice is
/// submitted alone; the others once it has produced its first token, so its
/// prompt's full blocks are in engine memory and theirs are loaded, not
/// computed (each choice computes only the prompt's unaligned tail). With
/// a `seed`, choice `i` samples with `seed + i`.
async fn generate_n(st: &AppState, model: &str, req: GenerateRequest, how: Choices) -> Result<Response, ApiError> {
    let Choices { n, stop, logprobs: want_logprobs, prompt_param, endpoint, echoed, prompt_tokens } = how;
    let tokenizer = st.model(model)?.tokenizer;
    let submit = |i: usize| {
        let mut r = req.clone();
        r.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i as u64));
        st.backend.submit(model, r).map_err(|e| submit_error(e, prompt_param))
    };
    let mut first = submit(0)?;
    // Forward the first choice's events, noting when its first token (or its
    // end) has come: its prompt has been computed by then.
    let (tx, rx0) = tokio::sync::mpsc::unbounded_channel();
    loop {
        let Some(ev) = first.recv().await else { break };
        let started = !matches!(ev, crate::Event::Started { .. });
        let _ = tx.send(ev);
        if started {
            break;
        }
    }
    tokio::spawn(async move {
        while let Some(ev) = first.recv().await {
            if tx.send(ev).is_err() {
                break;
            }
        }
    });
    let mut receivers = vec![rx0];
    for i in 1..n {
        receivers.push(submit(i)?);
    }
    let runs = receivers.into_iter().map(|rx| {
        let tokenizer = tokenizer.clone();
        let stop = stop.clone();
        async move {
            let mut decoder = tokenizer.decode_stream(true);
            collect(rx, &mut decoder, stop).await
        }
    });
    let outcomes = futures::future::join_all(runs).await;
    let header = Header::new(endpoint, model.to_string());
    let mut answers = Vec::with_capacity(outcomes.len());
    let (mut completion, mut cached) = (0, 0);
    for (i, out) in outcomes.into_iter().enumerate() {
        let out = out.map_err(|msg| {
            tracing::warn!(error = %msg, "generation failed");
            ApiError::generation_failed(&msg)
        })?;
        completion += out.completion_tokens;
        if i == 0 {
            cached = out.cached_tokens;
        }
        let logprobs = want_logprobs.then(|| {
            let name = |id: u32| generate::DecoderSource::token_text(&tokenizer, id);
            response::logprobs_json(endpoint, &out.logprobs, &name, 0)
        });
        let text = match &echoed {
            Some(prompt) => format!("{prompt}{}", out.text),
            None => out.text,
        };
        answers.push((text, out.reason, logprobs));
    }
    // The prompt is counted once, as OpenAI counts it.
    let usage = UsageBody::new(prompt_tokens, completion, cached);
    Ok(Json(header.complete_choices(answers, usage)).into_response())
}

/// The prompt's tokens and the tokens that end generation. Runs on the
/// blocking pool: templates and long prompts cost CPU time.
async fn tokenize(tokenizer: Arc<Tokenizer>, input: Input) -> Result<(Vec<u32>, Vec<u32>), ApiError> {
    tokio::task::spawn_blocking(move || {
        let tok = &*tokenizer;
        let prompt = match input {
            Input::Chat(messages) => {
                tok.encode_chat(&messages, true).map_err(|e| match e {
                    granary_tokenizer::TokenizerError::Template(_) => {
                        ApiError::invalid("messages", "invalid_value", format!("Invalid value for `messages`: {e}."))
                    }
                    other => ApiError::internal(&other),
                })?
            }
            Input::Text(text) => tok.encode(&text, true).map_err(|e| ApiError::internal(&e))?,
            Input::Tokens(ids) => {
                let vocab = tok.vocab_size();
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        "invalid_value",
                        format!(
                            "Invalid value for `prompt`: token id {id} at position {i} is outside the vocabulary of {vocab} tokens."
                        ),
                    ));
                }
                ids
            }
        };
        Ok((prompt, tok.eos_token_ids().to_vec()))
    })
    .await
    .map_err(|e| ApiError::internal(&e))?
}

/// The completion budget: the request's, or all the context left.
fn budget(
    prompt: usize,
    context: usize,
    requested: Option<MaxTokens>,
    prompt_param: &'static str,
) -> Result<usize, ApiError> {
    if prompt >= context {
        return Err(prompt_too_long(context, prompt, prompt_param));
    }
    let room = context - prompt;
    match requested {
        None => Ok(room),
        Some(m) if m.value <= room => Ok(m.value),
        Some(m) => Err(ApiError::invalid(
            m.param,
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                 ({prompt} in the {prompt_param}, {} in the completion). Please reduce the length of the \
                 {prompt_param} or `{}`.",
                prompt.saturating_add(m.value),
                m.value,
                m.param
            ),
        )),
    }
}

fn prompt_too_long(context: usize, prompt: usize, prompt_param: &'static str) -> ApiError {
    ApiError::invalid(
        prompt_param,
        "context_length_exceeded",
        format!(
            "This model's maximum context length is {context} tokens. However, your {prompt_param} resulted in {prompt} \
             tokens, leaving no room for the completion. Please reduce the length of the {prompt_param}."
        ),
    )
}

fn submit_error(e: SubmitError, prompt_param: &'static str) -> ApiError {
    match e {
        SubmitError::ContextExceeded { limit, prompt } => prompt_too_long(limit, prompt, prompt_param),
        SubmitError::EmptyPrompt => ApiError::invalid(
            prompt_param,
            "empty_prompt",
            format!("Invalid value for `{prompt_param}`: it encodes to no tokens."),
        ),
        SubmitError::ShuttingDown => ApiError::unavailable("The server is shutting down; retry on another."),
    }
}

#[cfg(test)]
mod tests;
