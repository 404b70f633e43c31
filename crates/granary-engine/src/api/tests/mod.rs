//! Handler tests through the router.
//!
//! Refusals that happen before a model is needed run against a scripted
//! backend that serves no model. Generation tests need a real tokenizer
//! (SmolLM2's, from its GGUF) and run against [`ScriptedBackend`], which
//! answers every request with a fixed token sequence; the real engine is
//! tested end to end elsewhere.

mod choices;
mod stopping;

use std::sync::Arc;

use axum::body::{to_bytes, Body, Bytes};
use axum::http::{HeaderMap, HeaderName, Request, StatusCode};
use axum::Router;
use granary_tokenizer::{ChatMessage, Tokenizer};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tower::ServiceExt;

use super::answer::{budget, submit_error};
use super::request::MaxTokens;
use super::*;
use crate::types::{Event, FinishReason, GenerateRequest, ModelInfo, SubmitError, Usage};
use futures::StreamExt;
use std::convert::Infallible;

const MODEL: &str = "smollm2";
const CONTEXT: usize = 64;
/// What the scripted backend generates.
const REPLY: &str = "Hello there! Nice to meet you. Bye.";

/// A backend that answers every request with the tokens of [`REPLY`]
/// (or fewer, at `max_tokens`) and records what it was asked.
struct ScriptedBackend {
    models: Vec<ModelInfo>,
    reply: Vec<u32>,
    /// Event after the tokens; `None` leaves the channel open (a generation
    /// still running).
    end: Option<Event>,
    shutting_down: bool,
    submitted: Mutex<Vec<GenerateRequest>>,
    senders: Mutex<Vec<mpsc::UnboundedSender<Event>>>,
    /// How long a prompt-scoring pass takes, and the most that ran at once.
    side_pass_time: std::time::Duration,
    side_passes: std::sync::atomic::AtomicUsize,
    side_passes_most: std::sync::atomic::AtomicUsize,
}

impl ScriptedBackend {
    fn without_models() -> Self {
        ScriptedBackend {
            models: Vec::new(),
            reply: Vec::new(),
            end: None,
            shutting_down: false,
            submitted: Mutex::default(),
            senders: Mutex::default(),
            side_pass_time: std::time::Duration::ZERO,
            side_passes: Default::default(),
            side_passes_most: Default::default(),
        }
    }

    fn with_tokenizer(tokenizer: Arc<Tokenizer>) -> Self {
        let reply = tokenizer.encode(REPLY, false).unwrap();
        let model = ModelInfo {
            id: MODEL.into(),
            context_len: CONTEXT,
            tokenizer,
            created: 1_700_000_000,
            sampling: crate::SamplingDefaults::default(),
        };
        ScriptedBackend {
            models: vec![model],
            reply,
            end: Some(Event::Finished { reason: FinishReason::Stop, usage: Usage::default() }),
            ..ScriptedBackend::without_models()
        }
    }

    fn last_request(&self) -> GenerateRequest {
        self.submitted.lock().last().cloned().expect("a request was submitted")
    }

    fn all_cancelled(&self) -> bool {
        self.senders.lock().iter().all(|tx| tx.is_closed())
    }
}

impl Backend for ScriptedBackend {
    fn models(&self) -> Vec<ModelInfo> {
        self.models.clone()
    }

    fn health(&self) -> Result<(), String> {
        if self.shutting_down {
            return Err("the step thread stopped".into());
        }
        Ok(())
    }

    fn submit(&self, model: &str, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, SubmitError> {
        assert!(self.models.iter().any(|m| m.id == model), "submit for unknown model {model}");
        if self.shutting_down {
            return Err(SubmitError::ShuttingDown);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let n = self.reply.len().min(req.max_tokens);
        for &id in &self.reply[..n] {
            if let Some(top) = req.sampling.logprobs {
                // The chosen token first among its alternatives, at ln(1/2).
                let lp = -std::f32::consts::LN_2;
                let alts = (0..top as u32).map(|i| (id + i, lp - i as f32)).collect();
                tx.send(Event::Logprobs(Box::new(crate::TokenLogprobs { logprob: lp, top: alts }))).unwrap();
            }
            tx.send(Event::Token(id)).unwrap();
        }
        match &self.end {
            Some(Event::Finished { .. }) => {
                let reason = if n < self.reply.len() { FinishReason::Length } else { FinishReason::Stop };
                let usage = Usage { prompt_tokens: req.prompt.len(), completion_tokens: n, cached_tokens: 5 };
                tx.send(Event::Finished { reason, usage }).unwrap();
            }
            Some(other) => tx.send(other.clone()).unwrap(),
            None => {}
        }
        self.submitted.lock().push(req);
        self.senders.lock().push(tx);
        Ok(rx)
    }

    fn metrics_text(&self) -> String {
        "# TYPE granary_requests counter\ngranary_requests_total 3\n".into()
    }

    /// Prompt token `i` (from 1) at `-i`, its alternatives below it.
    fn prompt_logprobs(
        &self,
        _model: &str,
        tokens: &[u32],
        top: usize,
    ) -> Option<anyhow::Result<Vec<crate::TokenLogprobs>>> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.side_passes.fetch_add(1, SeqCst) + 1;
        self.side_passes_most.fetch_max(now, SeqCst);
        std::thread::sleep(self.side_pass_time);
        self.side_passes.fetch_sub(1, SeqCst);
        let lp = |i: usize| -(i as f32);
        Some(Ok(tokens
            .iter()
            .enumerate()
            .skip(1)
            .map(|(i, &id)| crate::TokenLogprobs {
                logprob: lp(i),
                top: (0..top as u32).map(|k| (id + k, lp(i) - k as f32)).collect(),
            })
            .collect()))
    }
}

fn make_app(backend: &Arc<ScriptedBackend>, opts: ApiOptions) -> Router {
    router(backend.clone(), opts)
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (parts.status, parts.headers, to_bytes(body, usize::MAX).await.unwrap())
}

fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path).header("content-type", "application/json").body(body.into()).unwrap()
}

fn get_req(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

async fn send_json(app: &Router, req: Request<Body>) -> (StatusCode, Value) {
    let (status, _, body) = send(app, req).await;
    let v = serde_json::from_slice(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    (status, v)
}

/// Asserts an OpenAI-shaped error and returns its `error` object.
#[track_caller]
fn assert_error(status: StatusCode, body: &Value, want_status: StatusCode, param: Option<&str>) -> Value {
    assert_eq!(status, want_status, "{body}");
    let e = &body["error"];
    assert!(e["message"].is_string() && e["type"].is_string(), "not an OpenAI error: {body}");
    assert!(e.as_object().unwrap().contains_key("code"), "{body}");
    assert_eq!(e["param"].as_str(), param, "{body}");
    e.clone()
}

fn no_models() -> (Arc<ScriptedBackend>, Router) {
    let backend = Arc::new(ScriptedBackend::without_models());
    let app = make_app(&backend, ApiOptions::default());
    (backend, app)
}

#[tokio::test]
async fn health_and_metrics() {
    let (_, app) = no_models();
    assert_eq!(send_json(&app, get_req("/health")).await, (StatusCode::OK, json!({"status": "ok"})));
    assert_eq!(send_json(&app, get_req("/ready")).await, (StatusCode::OK, json!({"status": "ok"})));
    let down = Arc::new(ScriptedBackend { shutting_down: true, ..ScriptedBackend::without_models() });
    let down_app = make_app(&down, ApiOptions::default());
    for path in ["/health", "/ready"] {
        assert_eq!(
            send_json(&down_app, get_req(path)).await,
            (StatusCode::SERVICE_UNAVAILABLE, json!({"status": "error", "error": "the step thread stopped"}))
        );
    }
    let (status, headers, body) = send(&app, get_req("/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/plain; version=0.0.4");
    assert!(std::str::from_utf8(&body).unwrap().contains("granary_requests_total 3"));
}

#[tokio::test]
async fn unknown_paths_and_methods() {
    let (_, app) = no_models();
    let (status, body) = send_json(&app, get_req("/v1/nope")).await;
    let e = assert_error(status, &body, StatusCode::NOT_FOUND, None);
    assert!(e["message"].as_str().unwrap().contains("/v1/nope"));
    let (status, body) = send_json(&app, get_req("/v1/chat/completions")).await;
    let e = assert_error(status, &body, StatusCode::METHOD_NOT_ALLOWED, None);
    assert_eq!(e["code"], "method_not_allowed");
    let (status, body) = send_json(&app, post("/health", "{}")).await;
    assert_error(status, &body, StatusCode::METHOD_NOT_ALLOWED, None);
}

#[tokio::test]
async fn unknown_models() {
    let (_, app) = no_models();
    assert_eq!(send_json(&app, get_req("/v1/models")).await, (StatusCode::OK, json!({"object": "list", "data": []})));
    let (status, body) = send_json(&app, get_req("/v1/models/org/name")).await;
    let e = assert_error(status, &body, StatusCode::NOT_FOUND, Some("model"));
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("org/name"));
    let chat = json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]});
    let (status, body) = send_json(&app, post("/v1/chat/completions", chat.to_string())).await;
    assert_eq!(assert_error(status, &body, StatusCode::NOT_FOUND, Some("model"))["code"], "model_not_found");
    let (status, body) = send_json(&app, post("/v1/completions", r#"{"model":"gpt-4","prompt":"x"}"#)).await;
    assert_eq!(assert_error(status, &body, StatusCode::NOT_FOUND, Some("model"))["code"], "model_not_found");
}

#[tokio::test]
async fn bodies_that_are_not_json() {
    let (_, app) = no_models();
    let req = Request::post("/v1/chat/completions").body(Body::from("{}")).unwrap();
    let (status, body) = send_json(&app, req).await;
    assert_error(status, &body, StatusCode::UNSUPPORTED_MEDIA_TYPE, None);
    let req = Request::post("/v1/completions").header("content-type", "text/plain").body(Body::from("{}")).unwrap();
    let (status, body) = send_json(&app, req).await;
    assert_error(status, &body, StatusCode::UNSUPPORTED_MEDIA_TYPE, None);

    let (status, body) = send_json(&app, post("/v1/chat/completions", "{\"model\": \"m\",\n \"messages\": [}")).await;
    let e = assert_error(status, &body, StatusCode::BAD_REQUEST, None);
    assert_eq!(e["code"], "invalid_json");
    assert!(e["message"].as_str().unwrap().contains("line 2 column 15"), "{e}");
}

#[tokio::test]
async fn field_errors_name_the_field() {
    let (_, app) = no_models();
    let cases = [
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 1}]}),
            "messages[1].content",
        ),
        (json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": 5}), "temperature"),
        (json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "n": 9}), "n"),
        (json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}), "top_logprobs"),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "stop": ["a", "b", "c", "d", "e"]}),
            "stop",
        ),
        (json!({"messages": [{"role": "user", "content": "a"}]}), "model"),
    ];
    for (req, param) in cases {
        let (status, body) = send_json(&app, post("/v1/chat/completions", req.to_string())).await;
        let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some(param));
        assert!(e["message"].as_str().unwrap().contains(param), "{e}");
    }
    let (status, body) = send_json(&app, post("/v1/completions", r#"{"model":"m","prompt":["a",[1]]}"#)).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("prompt"));
    let (status, body) =
        send_json(&app, post("/v1/completions", r#"{"model":"m","prompt":["a","b"],"stream":true}"#)).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("stream"));
}

#[tokio::test]
async fn unknown_fields_are_refused_by_name() {
    let (_, app) = no_models();
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "bogus_field": 1});
    let completion = json!({"model": "m", "prompt": "a", "reasoning_effort": "low"});
    let embeddings = json!({"model": "m", "input": "a", "truncate": true});
    let tokenize = json!({"model": "m", "prompt": "a", "with_spaces": true});
    for (path, req, param) in [
        ("/v1/chat/completions", chat, "bogus_field"),
        ("/v1/completions", completion, "reasoning_effort"),
        ("/v1/embeddings", embeddings, "truncate"),
        ("/tokenize", tokenize, "with_spaces"),
    ] {
        let (status, body) = send_json(&app, post(path, req.to_string())).await;
        let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some(param));
        assert_eq!(e["code"], "unknown_parameter", "{path}: {e}");
        assert!(e["message"].as_str().unwrap().contains(param), "{e}");
    }
}

#[tokio::test]
async fn fields_that_ask_nothing_are_accepted_and_those_that_ask_too_much_refused() {
    let Some((_, app)) = scripted() else { return };
    let no_action = json!({"user": "u-1", "metadata": {"team": "a"}, "store": false, "service_tier": "auto",
                           "prompt_cache_key": "k", "safety_identifier": "s"});
    let (status, body) = send_json(&app, post("/v1/chat/completions", chat_body(no_action.clone()))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mut completion = json!({"model": MODEL, "prompt": "Hi"});
    completion.as_object_mut().unwrap().extend(no_action.as_object().unwrap().clone());
    let (status, body) = send_json(&app, post("/v1/completions", completion.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let embeddings = json!({"model": MODEL, "input": "Hi", "user": "u-1"});
    let (status, body) = send_json(&app, post("/v1/embeddings", embeddings.to_string())).await;
    assert_ne!(body["error"]["code"], "unknown_parameter", "{status} {body}");

    let metadata: serde_json::Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (extra, param) in [
        (json!({"store": true}), "store"),
        (json!({"service_tier": "flex"}), "service_tier"),
        (json!({"metadata": metadata}), "metadata"),
    ] {
        let (status, body) = send_json(&app, post("/v1/chat/completions", chat_body(extra))).await;
        let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some(param));
        assert!(e["message"].as_str().unwrap().contains(param), "{e}");
    }
}

#[tokio::test]
async fn bodies_over_the_limit() {
    let backend = Arc::new(ScriptedBackend::without_models());
    let app = make_app(&backend, ApiOptions { max_body_bytes: 100, ..ApiOptions::default() });
    let big = json!({"model": "m", "prompt": "x".repeat(200)}).to_string();
    let (status, body) = send_json(&app, post("/v1/completions", big.clone())).await;
    let e = assert_error(status, &body, StatusCode::PAYLOAD_TOO_LARGE, None);
    assert!(e["message"].as_str().unwrap().contains("100 bytes"), "{e}");
    // Also without a Content-Length (chunked).
    let chunks =
        futures::stream::iter(big.into_bytes().chunks(50).map(|c| Ok::<_, Infallible>(c.to_vec())).collect::<Vec<_>>());
    let (status, body) = send_json(&app, post("/v1/completions", Body::from_stream(chunks))).await;
    assert_error(status, &body, StatusCode::PAYLOAD_TOO_LARGE, None);
}

#[tokio::test]
async fn namespaces_come_from_the_header_only_when_enabled() {
    let opts =
        ApiOptions { namespace_header: Some(HeaderName::from_static(NAMESPACE_HEADER)), ..ApiOptions::default() };
    let app = make_app(&Arc::new(ScriptedBackend::without_models()), opts);
    let req = |ns: &str| {
        Request::post("/v1/completions")
            .header("content-type", "application/json")
            .header(NAMESPACE_HEADER, ns)
            .body(Body::from(r#"{"model":"m","prompt":"x"}"#))
            .unwrap()
    };
    for bad in ["", "a/b", "spaces here", &"n".repeat(129)] {
        let (status, body) = send_json(&app, req(bad)).await;
        let e = assert_error(status, &body, StatusCode::BAD_REQUEST, None);
        assert_eq!(e["code"], "invalid_namespace");
    }
    // A valid namespace gets as far as the model lookup.
    let (status, _) = send_json(&app, req("tenant-1.prod")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// An engine not told to trust the namespace header refuses a request
/// carrying one, instead of running it in the namespace every tenant
/// shares.
#[tokio::test]
async fn an_untrusted_namespace_header_is_refused_not_ignored() {
    let app = make_app(&Arc::new(ScriptedBackend::without_models()), ApiOptions::default());
    let req = Request::post("/v1/completions")
        .header("content-type", "application/json")
        .header(NAMESPACE_HEADER, "tenant-b")
        .body(Body::from(r#"{"model":"m","prompt":"x"}"#))
        .unwrap();
    let (status, body) = send_json(&app, req).await;
    let e = assert_error(status, &body, StatusCode::BAD_REQUEST, None);
    assert_eq!(e["code"], "untrusted_namespace_header", "{body}");
    assert!(e["message"].as_str().unwrap().contains("--trust-namespace-header"), "{body}");
    // Without the header the request goes on (to the model lookup).
    let (status, _) = send_json(&app, post("/v1/completions", r#"{"model":"m","prompt":"x"}"#.to_string())).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[test]
fn the_budget_is_the_context_left_unless_asked() {
    assert_eq!(budget(10, 64, None, "messages").unwrap(), 54);
    let m = |value, param| Some(MaxTokens { value, param });
    assert_eq!(budget(10, 64, m(54, "max_tokens"), "prompt").unwrap(), 54);
    assert_eq!(budget(63, 64, None, "prompt").unwrap(), 1);

    let e = budget(10, 64, m(55, "max_completion_tokens"), "messages").unwrap_err();
    assert_eq!(
        (e.status, e.param.as_deref(), e.code),
        (StatusCode::BAD_REQUEST, Some("max_completion_tokens"), Some("context_length_exceeded"))
    );
    assert!(
        e.message.contains("64 tokens")
            && e.message.contains("65 tokens")
            && e.message.contains("`max_completion_tokens`"),
        "{}",
        e.message
    );

    for prompt in [64, 100] {
        let e = budget(prompt, 64, None, "prompt").unwrap_err();
        assert_eq!((e.param.as_deref(), e.code), (Some("prompt"), Some("context_length_exceeded")));
        assert!(e.message.contains("maximum context length is 64 tokens"), "{}", e.message);
        assert!(e.message.contains(&format!("{prompt} tokens")), "{}", e.message);
    }
}

#[test]
fn submit_errors() {
    let e = submit_error(SubmitError::ContextExceeded { limit: 2048, prompt: 2048 }, "messages");
    assert_eq!(
        (e.status, e.param.as_deref(), e.code),
        (StatusCode::BAD_REQUEST, Some("messages"), Some("context_length_exceeded"))
    );
    assert!(e.message.contains("2048 tokens"));
    let e = submit_error(SubmitError::EmptyPrompt, "prompt");
    assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("prompt")));
    let e = submit_error(SubmitError::ShuttingDown, "prompt");
    assert_eq!((e.status, e.kind), (StatusCode::SERVICE_UNAVAILABLE, ErrorType::ServerError));
}

// ---- generation, with the real tokenizer ----

/// The SmolLM2 tokenizer, or `None` (the test skips) when the model is absent.
fn tokenizer() -> Option<Arc<Tokenizer>> {
    let path = granary_tokenizer::testing::model_or_skip("api handler test")?;
    Some(Arc::new(Tokenizer::from_gguf_path(&path).expect("SmolLM2 tokenizer")))
}

fn scripted() -> Option<(Arc<ScriptedBackend>, Router)> {
    let backend = Arc::new(ScriptedBackend::with_tokenizer(tokenizer()?));
    let app = make_app(&backend, ApiOptions::default());
    Some((backend, app))
}

fn chat_body(extra: Value) -> String {
    let mut body = json!({"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body.to_string()
}

/// The JSON payloads of an SSE body, checking the framing and the final `[DONE]`.
fn sse_payloads(headers: &HeaderMap, body: &[u8]) -> Vec<Value> {
    assert_eq!(headers["content-type"], "text/event-stream");
    let text = std::str::from_utf8(body).unwrap();
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str(e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e}"))).unwrap()
        })
        .collect()
}

#[tokio::test]
async fn models_are_listed() {
    let Some((_, app)) = scripted() else { return };
    let (status, body) = send_json(&app, get_req("/v1/models")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body["data"],
        json!([{"id": MODEL, "object": "model", "created": 1_700_000_000, "owned_by": "granary", "max_model_len": CONTEXT}])
    );
    let (status, body) = send_json(&app, get_req(&format!("/v1/models/{MODEL}"))).await;
    assert_eq!((status, body["id"].as_str()), (StatusCode::OK, Some(MODEL)));
}

#[tokio::test]
async fn chat_completion_in_one_body() {
    let Some((backend, app)) = scripted() else { return };
    let (status, body) =
        send_json(&app, post("/v1/chat/completions", chat_body(json!({"temperature": 0.5, "seed": 9})))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["model"], MODEL);
    let choice = &body["choices"][0];
    assert_eq!(choice["message"], json!({"role": "assistant", "content": REPLY}));
    assert_eq!(choice["finish_reason"], "stop");

    // What the backend was asked: the templated prompt, EOS as stop tokens.
    let Some(tok) = tokenizer() else { return };
    let req = backend.last_request();
    let messages = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")];
    let text = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(req.prompt, tok.encode(&text, false).unwrap());
    assert_eq!(req.stop_token_ids, tok.eos_token_ids());
    assert_eq!(req.namespace, "default");
    assert_eq!(req.max_tokens, CONTEXT - req.prompt.len());
    assert_eq!((req.sampling.temperature, req.sampling.seed), (0.5, Some(9)));

    let n = backend.reply.len();
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": req.prompt.len(), "completion_tokens": n, "total_tokens": req.prompt.len() + n,
               "prompt_tokens_details": {"cached_tokens": 5}})
    );
}

#[tokio::test]
async fn sampling_defaults_fill_what_the_request_leaves_out() {
    let Some((backend, app)) = scripted() else { return };
    let (status, _) = send_json(&app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::OK);
    let p = backend.last_request().sampling;
    let d = crate::SamplingDefaults::default();
    assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p), (d.temperature, d.top_p, d.top_k, d.min_p));
    assert_eq!((d.temperature, d.top_k), (0.8, 40), "llama.cpp server's defaults");
    let body = chat_body(json!({"temperature": 0, "top_k": 5, "logit_bias": {"7": 3}, "presence_penalty": 1}));
    let (status, _) = send_json(&app, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK);
    let p = backend.last_request().sampling;
    assert_eq!((p.temperature, p.top_k, p.presence_penalty), (0.0, 5, 1.0));
    assert_eq!(p.logit_bias, [(7, 3.0)]);
    // A bias for a token the vocabulary lacks names the key.
    let (status, body) =
        send_json(&app, post("/v1/chat/completions", chat_body(json!({"logit_bias": {"9999999": 1}})))).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("logit_bias.9999999"));
    // Completions default to 16 tokens.
    let (status, _) =
        send_json(&app, post("/v1/completions", json!({"model": MODEL, "prompt": "a"}).to_string())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(backend.last_request().max_tokens, 16);
}

#[tokio::test]
async fn logprobs_in_both_shapes() {
    let Some((backend, app)) = scripted() else { return };
    let Some(tok) = tokenizer() else { return };
    let n = backend.reply.len();
    let body = chat_body(json!({"logprobs": true, "top_logprobs": 2}));
    let (status, body) = send_json(&app, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let content = body["choices"][0]["logprobs"]["content"].as_array().expect("logprobs.content");
    assert_eq!(content.len(), n);
    let first = &content[0];
    assert_eq!(first["token"], tok.decode(&backend.reply[..1], false).unwrap());
    assert!((first["logprob"].as_f64().unwrap() + std::f64::consts::LN_2).abs() < 1e-6);
    assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(first["bytes"].as_array().unwrap().len(), first["token"].as_str().unwrap().len());
    // Without logprobs: null.
    let (_, body) = send_json(&app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(body["choices"][0]["logprobs"], Value::Null);
    // Streamed: every token's entry arrives once, in order.
    let (status, headers, bytes) =
        send(&app, post("/v1/chat/completions", chat_body(json!({"logprobs": true, "stream": true})))).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_payloads(&headers, &bytes);
    let streamed: Vec<String> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["logprobs"]["content"].as_array().cloned())
        .flatten()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    let want: Vec<String> = backend.reply.iter().map(|&id| tok.decode(&[id], false).unwrap()).collect();
    assert_eq!(streamed, want);
    // Completions: tokens, token_logprobs, top_logprobs, text_offset.
    let req = json!({"model": MODEL, "prompt": "a", "logprobs": 1, "max_tokens": 4});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let lp = &body["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
}

#[tokio::test]
async fn chat_completion_streamed() {
    let Some((backend, app)) = scripted() else { return };
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (status, headers, bytes) = send(&app, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_payloads(&headers, &bytes);
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str()).collect();
    assert_eq!(text, REPLY);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage["completion_tokens"], backend.reply.len());
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 5);
}

#[tokio::test]
async fn completions_stop_at_max_tokens_and_stop_strings() {
    let Some((backend, app)) = scripted() else { return };
    let (status, body) = send_json(
        &app,
        post("/v1/completions", json!({"model": MODEL, "prompt": "Say hi", "max_tokens": 3}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    let Some(tok) = tokenizer() else { return };
    assert_eq!(body["choices"][0]["text"], tok.decode(&backend.reply[..3], true).unwrap());
    assert_eq!(backend.last_request().prompt, tok.encode("Say hi", true).unwrap());

    // "meet" spans tokens or not; either way the text ends before it and the generation is cancelled.
    let req = json!({"model": MODEL, "prompt": [[1, 2, 3]], "stop": ["meet", "zzz"]});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["text"], "Hello there! Nice to ");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(backend.last_request().prompt, [1, 2, 3]);
    assert!(backend.all_cancelled());

    let req = json!({"model": MODEL, "prompt": "x", "stop": "Nice", "stream": true});
    let (_, headers, bytes) = send(&app, post("/v1/completions", req.to_string())).await;
    let chunks = sse_payloads(&headers, &bytes);
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(text, "Hello there! ");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn context_limits() {
    let Some((_, app)) = scripted() else { return };
    let long = "word ".repeat(CONTEXT * 2);
    let (status, body) =
        send_json(&app, post("/v1/completions", json!({"model": MODEL, "prompt": long}).to_string())).await;
    let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some("prompt"));
    assert_eq!(e["code"], "context_length_exceeded");
    assert!(e["message"].as_str().unwrap().contains(&format!("{CONTEXT} tokens")), "{e}");

    let (status, body) = send_json(&app, post("/v1/chat/completions", chat_body(json!({"max_tokens": CONTEXT})))).await;
    let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some("max_tokens"));
    assert_eq!(e["code"], "context_length_exceeded");
    assert!(e["message"].as_str().unwrap().contains(&format!("{CONTEXT} tokens")), "{e}");

    let ids: Vec<u32> = vec![1, 2, u32::MAX];
    let (status, body) =
        send_json(&app, post("/v1/completions", json!({"model": MODEL, "prompt": ids}).to_string())).await;
    let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some("prompt"));
    assert!(e["message"].as_str().unwrap().contains("vocabulary"), "{e}");
}

#[tokio::test]
async fn backend_failures_and_shutdown() {
    let Some(tok) = tokenizer() else { return };
    let failing = Arc::new(ScriptedBackend {
        end: Some(Event::Failed("kv pool exhausted".into())),
        ..ScriptedBackend::with_tokenizer(tok.clone())
    });
    let app = make_app(&failing, ApiOptions::default());
    let (status, body) = send_json(&app, post("/v1/chat/completions", chat_body(json!({})))).await;
    let e = assert_error(status, &body, StatusCode::INTERNAL_SERVER_ERROR, None);
    assert!(e["message"].as_str().unwrap().contains("kv pool exhausted"), "{e}");
    let (status, headers, bytes) = send(&app, post("/v1/chat/completions", chat_body(json!({"stream": true})))).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_payloads(&headers, &bytes);
    assert!(chunks.last().unwrap()["error"]["message"].as_str().unwrap().contains("kv pool exhausted"));

    let closing = Arc::new(ScriptedBackend { shutting_down: true, ..ScriptedBackend::with_tokenizer(tok) });
    let app = make_app(&closing, ApiOptions::default());
    let (status, body) = send_json(&app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_error(status, &body, StatusCode::SERVICE_UNAVAILABLE, None);
}

#[tokio::test]
async fn a_client_leaving_mid_stream_cancels_the_generation() {
    let Some(tok) = tokenizer() else { return };
    // The generation never finishes on its own.
    let backend = Arc::new(ScriptedBackend { end: None, ..ScriptedBackend::with_tokenizer(tok) });
    let app = make_app(&backend, ApiOptions::default());
    let resp = app.oneshot(post("/v1/chat/completions", chat_body(json!({"stream": true})))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert!(!backend.all_cancelled());
    drop(body);
    assert!(backend.all_cancelled());
}

#[tokio::test]
async fn the_namespace_reaches_the_backend() {
    let Some(tok) = tokenizer() else { return };
    let backend = Arc::new(ScriptedBackend::with_tokenizer(tok));
    let opts = ApiOptions {
        default_namespace: "shared".into(),
        namespace_header: Some(HeaderName::from_static(NAMESPACE_HEADER)),
        ..ApiOptions::default()
    };
    let app = make_app(&backend, opts);
    send_json(&app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(backend.last_request().namespace, "shared");
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header(NAMESPACE_HEADER, "team-a")
        .body(Body::from(chat_body(json!({}))))
        .unwrap();
    send_json(&app, req).await;
    assert_eq!(backend.last_request().namespace, "team-a");
    let mut req = post("/v1/chat/completions", chat_body(json!({})));
    req.extensions_mut().insert(Namespace("from-gateway".into()));
    send_json(&app, req).await;
    assert_eq!(backend.last_request().namespace, "from-gateway");
}

#[tokio::test]
async fn tokenize_and_detokenize_use_the_models_tokenizer() {
    let Some((_, app)) = scripted() else { return };
    let Some(tok) = tokenizer() else { return };
    let req = json!({"model": MODEL, "prompt": "Hello there!", "return_token_strs": true});
    let (status, body) = send_json(&app, post("/tokenize", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let ids = tok.encode("Hello there!", true).unwrap();
    assert_eq!(body["tokens"], json!(ids));
    assert_eq!(body["count"], ids.len());
    assert_eq!(body["max_model_len"], CONTEXT);
    assert_eq!(body["token_strs"].as_array().unwrap().len(), ids.len());
    // Chat messages go through the template, as the chat endpoint does.
    let req = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]});
    let (_, body) = send_json(&app, post("/tokenize", req.to_string())).await;
    let want = tok.encode_chat(&[ChatMessage::new("user", "Hi!")], true).unwrap();
    assert_eq!(body["tokens"], json!(want));
    let (status, body) = send_json(&app, post("/detokenize", json!({"model": MODEL, "tokens": ids}).to_string())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["prompt"], "Hello there!");
    // Errors name the field.
    let (status, body) =
        send_json(&app, post("/detokenize", json!({"model": MODEL, "tokens": [1, 99999999]}).to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("tokens[1]"));
    let (status, body) = send_json(&app, post("/tokenize", json!({"model": MODEL}).to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("prompt"));
    let (status, body) = send_json(&app, post("/tokenize", json!({"model": "nope", "prompt": "a"}).to_string())).await;
    assert_error(status, &body, StatusCode::NOT_FOUND, Some("model"));
}

/// vLLM's `chat_template_kwargs` reach the model's chat template (here a
/// template that closes the thinking block when `enable_thinking` is
/// false, as Qwen 3's does), on `/v1/chat/completions` and `/tokenize`;
/// the variables the server sets cannot be replaced.
#[tokio::test]
async fn chat_template_kwargs_reach_the_template() {
    let Some(base) = tokenizer() else { return };
    let dir = tempfile::tempdir().unwrap();
    base.save_pretrained(dir.path()).unwrap();
    let cfg_path = dir.path().join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = json!(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n\
         {% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    );
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let tok = Arc::new(Tokenizer::from_pretrained_dir(dir.path()).unwrap());
    let backend = Arc::new(ScriptedBackend::with_tokenizer(tok.clone()));
    let app = make_app(&backend, ApiOptions::default());

    let prompt_of = |extra: Value| {
        let (app, backend, tok) = (app.clone(), backend.clone(), tok.clone());
        async move {
            let (status, body) = send_json(&app, post("/v1/chat/completions", chat_body(extra))).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            tok.decode(&backend.last_request().prompt, false).unwrap()
        }
    };
    let plain = prompt_of(json!({})).await;
    assert!(plain.ends_with("<|im_start|>assistant\n"), "{plain:?}");
    assert_eq!(prompt_of(json!({"chat_template_kwargs": {"enable_thinking": true}})).await, plain);
    let off = prompt_of(json!({"chat_template_kwargs": {"enable_thinking": false}})).await;
    assert_eq!(off, format!("{plain}<think>\n\n</think>\n\n"));

    let req = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}],
        "chat_template_kwargs": {"enable_thinking": false}});
    let (status, body) = send_json(&app, post("/tokenize", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let ids: Vec<u32> = serde_json::from_value(body["tokens"].clone()).unwrap();
    assert!(tok.decode(&ids, false).unwrap().ends_with("<think>\n\n</think>\n\n"), "{body}");

    for (kw, param) in [
        (json!({"add_generation_prompt": false}), "chat_template_kwargs.add_generation_prompt"),
        (json!({"messages": []}), "chat_template_kwargs.messages"),
        (json!("enable_thinking"), "chat_template_kwargs"),
    ] {
        let body = chat_body(json!({"chat_template_kwargs": kw}));
        let (status, body) = send_json(&app, post("/v1/chat/completions", body)).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, Some(param));
    }
    let req = json!({"model": MODEL, "prompt": "a", "chat_template_kwargs": {"x": 1}});
    let (status, body) = send_json(&app, post("/tokenize", req.to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("chat_template_kwargs"));
}

/// vLLM's `continue_final_message` ends the prompt inside the assistant's
/// last message, so the answer continues it; `add_generation_prompt:
/// false` leaves the assistant's turn unopened; what cannot be honoured is
/// refused by name.
#[tokio::test]
async fn the_final_assistant_message_can_be_continued() {
    let Some((backend, app)) = scripted() else { return };
    let tok = tokenizer().unwrap();
    let prefill = json!([{"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "The capital is"}]);
    let prompt_of = |extra: Value| {
        let (app, backend, tok) = (app.clone(), backend.clone(), tok.clone());
        async move {
            let mut body = json!({"model": MODEL, "max_tokens": 4});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let (status, body) = send_json(&app, post("/v1/chat/completions", body.to_string())).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            tok.decode(&backend.last_request().prompt, false).unwrap()
        }
    };
    let cont = prompt_of(json!({"messages": prefill, "continue_final_message": true})).await;
    assert!(cont.ends_with("<|im_start|>assistant\nThe capital is"), "{cont:?}");
    let same = prompt_of(json!({"messages": prefill, "continue_final_message": true, "add_generation_prompt": false}));
    assert_eq!(same.await, cont);
    let closed = prompt_of(json!({"messages": prefill, "add_generation_prompt": false})).await;
    assert!(closed.ends_with("The capital is<|im_end|>\n"), "{closed:?}");
    let opened = prompt_of(json!({"messages": prefill})).await;
    assert!(opened.ends_with("The capital is<|im_end|>\n<|im_start|>assistant\n"), "{opened:?}");

    let req = json!({"model": MODEL, "messages": prefill, "continue_final_message": true});
    let (status, body) = send_json(&app, post("/tokenize", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let ids: Vec<u32> = serde_json::from_value(body["tokens"].clone()).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), cont);

    let user_last = json!([{"role": "user", "content": "Hi"}]);
    for (body, param) in [
        (
            json!({"messages": prefill, "continue_final_message": true, "add_generation_prompt": true}),
            "continue_final_message",
        ),
        (json!({"messages": user_last, "continue_final_message": true}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}],
            "continue_final_message": true}),
            "messages",
        ),
    ] {
        let mut req = json!({"model": MODEL});
        req.as_object_mut().unwrap().extend(body.as_object().unwrap().clone());
        let (status, body) = send_json(&app, post("/v1/chat/completions", req.to_string())).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, Some(param));
    }
}
