//! The contract between the OpenAI layer ([`crate::api`]) and whatever
//! generates tokens ([`Backend`]).

use std::sync::Arc;

use granary_tokenizer::Tokenizer;
use tokio::sync::mpsc;

/// Sampling settings of one request, already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 disables nucleus filtering.
    pub top_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_p: 1.0, seed: None }
    }
}

/// One generation request in tokens.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Tenant namespace: KV blocks are only shared within one namespace.
    pub namespace: String,
    pub prompt: Vec<u32>,
    /// Upper bound on generated tokens (already clamped to the context).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (EOS, end of turn); the stop token is
    /// not returned.
    pub stop_token_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated (or, decided by the API layer, a stop string).
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was loaded instead of computed.
    pub cached_tokens: usize,
}

/// What a running request reports, in order: `Started` once its prompt is
/// admitted (backends may omit it), zero or more `Token`s, then exactly one
/// `Finished` or `Failed`. Dropping the receiver cancels the request and
/// frees its KV.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt was admitted; `cached_tokens` of it were loaded, not computed.
    Started {
        cached_tokens: usize,
    },
    Token(u32),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(String),
}

/// Why a request was refused before it started.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Prompt plus at least one generated token exceed the context.
    #[error("this model's maximum context length is {limit} tokens; the prompt has {prompt} tokens")]
    ContextExceeded { limit: usize, prompt: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// A model the backend serves.
#[derive(Clone)]
pub struct ModelInfo {
    /// The id clients put in `model`.
    pub id: String,
    pub context_len: usize,
    pub tokenizer: Arc<Tokenizer>,
    /// Unix seconds when it was loaded.
    pub created: u64,
}

/// Generates tokens for the API layer.
pub trait Backend: Send + Sync + 'static {
    fn models(&self) -> Vec<ModelInfo>;
    /// Starts a request for model `model` (an id from [`Backend::models`]).
    fn submit(&self, model: &str, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, SubmitError>;
    /// Prometheus text exposition of the backend's metrics.
    fn metrics_text(&self) -> String;
}
