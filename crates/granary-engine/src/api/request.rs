//! Request bodies of `/v1/chat/completions` and `/v1/completions`, and their
//! validation into a [`Validated`] request that only needs tokenizing.
//!
//! Type errors are caught while parsing (see [`super::body`]); range and
//! support checks happen in [`ChatRequest::validate`] and
//! [`CompletionRequest::validate`]. Fields this server does not know are
//! ignored, as OpenAI does (`user`, `metadata`, `store`...); fields it knows
//! and cannot honour (`tools`, `response_format` other than text, vLLM's
//! `guided_*`...) are refused with a 400 naming them, never ignored.

use std::fmt;

use granary_tokenizer::ChatMessage;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::error::ApiError;
use crate::types::{SamplingDefaults, SamplingParams};

/// Most stop sequences per request (OpenAI's limit).
pub const MAX_STOP_SEQUENCES: usize = 4;

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub seed: Option<Seed>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string) to a bias in [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM's and llama.cpp's structured-output fields: refused by name.
    #[serde(default)]
    pub guided_json: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_regex: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub functions: Option<serde_json::Value>,
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub modalities: Option<Vec<String>>,
    #[serde(default)]
    pub audio: Option<serde_json::Value>,
    #[serde(default)]
    pub prediction: Option<serde_json::Value>,
    #[serde(default)]
    pub web_search_options: Option<serde_json::Value>,
}

/// Sampling fields beyond OpenAI's that vLLM and llama.cpp servers take,
/// OpenAI's `logit_bias`, and structured-output fields of other servers.
#[derive(Debug, Default)]
struct ExtraSampling {
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// (name, set): fields refused when set.
    refused: Vec<(&'static str, bool)>,
}

macro_rules! extra_of {
    ($r:expr) => {
        ExtraSampling {
            top_k: $r.top_k,
            min_p: $r.min_p,
            repetition_penalty: $r.repetition_penalty,
            logit_bias: $r.logit_bias,
            refused: vec![
                ("guided_json", is_set(&$r.guided_json)),
                ("guided_regex", is_set(&$r.guided_regex)),
                ("guided_choice", is_set(&$r.guided_choice)),
                ("guided_grammar", is_set(&$r.guided_grammar)),
                ("grammar", is_set(&$r.grammar)),
                ("json_schema", is_set(&$r.json_schema)),
            ],
        }
    };
}

fn is_set(v: &Option<serde_json::Value>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_null())
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub seed: Option<Seed>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub best_of: Option<u64>,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string) to a bias in [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM's and llama.cpp's structured-output fields: refused by name.
    #[serde(default)]
    pub guided_json: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_regex: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub guided_grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub grammar: Option<serde_json::Value>,
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Message {
    pub role: Role,
    /// Optional only for `assistant` messages.
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role the chat template sees. Open models' templates know no
    /// `developer` role; OpenAI treats it as the system prompt.
    fn template_role(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A message's content: a string or an array of content parts.
#[derive(Debug, PartialEq)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One content part. Only `{"type": "text", "text": ...}` is supported;
/// the others are refused in validation so the error names the part.
#[derive(Debug, PartialEq, Deserialize)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Content, E> {
                Ok(Content::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Content, E> {
                Ok(Content::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<Part>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// A completions prompt, already reduced to the one prompt it may hold.
#[derive(Debug, PartialEq)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One element of an array `prompt`.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s.to_owned()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::invalid_value(de::Unexpected::Signed(v), &"a token id (0 or more)")),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str =
            "a string, an array of one string, an array of token ids or an array of one array of token ids";
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    items.push(item);
                }
                if items.is_empty() {
                    return Err(de::Error::invalid_length(0, &EXPECTED));
                }
                if items.iter().all(|i| matches!(i, PromptItem::Token(_))) {
                    let ids =
                        items.into_iter().filter_map(|i| if let PromptItem::Token(t) = i { Some(t) } else { None });
                    return Ok(Prompt::Tokens(ids.collect()));
                }
                if items.len() == 1 {
                    match items.pop() {
                        Some(PromptItem::Text(s)) => return Ok(Prompt::Text(s)),
                        Some(PromptItem::Tokens(ids)) => return Ok(Prompt::Tokens(ids)),
                        _ => {}
                    }
                }
                if items.iter().all(|i| matches!(i, PromptItem::Text(_)))
                    || items.iter().all(|i| matches!(i, PromptItem::Tokens(_)))
                {
                    return Err(de::Error::custom("batched prompts are not supported; send one prompt per request"));
                }
                Err(de::Error::custom(format!("expected {EXPECTED}, not a mix of them")))
            }
        }
        d.deserialize_any(V)
    }
}

/// `stop`: one string or an array of strings.
#[derive(Debug, PartialEq)]
pub(crate) struct Stop(pub Vec<String>);

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Stop;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Stop, E> {
                Ok(Stop(vec![s.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stop, A::Error> {
                let mut all = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    all.push(s);
                }
                Ok(Stop(all))
            }
        }
        d.deserialize_any(V)
    }
}

/// `seed`: any JSON integer that fits 64 bits; negative ones are taken
/// as their two's-complement bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Seed(pub u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                Ok(Seed(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// What the request asks to run on, before tokenizing.
#[derive(Debug, PartialEq)]
pub(crate) enum Input {
    Chat(Vec<ChatMessage>),
    Text(String),
    Tokens(Vec<u32>),
}

/// A requested completion budget and the field that carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MaxTokens {
    pub value: usize,
    pub param: &'static str,
}

/// The sampling fields a request set; [`SamplingRequest::resolve`] fills
/// in the rest from the model's defaults.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct SamplingRequest {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
    pub logprobs: Option<usize>,
}

impl SamplingRequest {
    pub fn resolve(&self, d: &SamplingDefaults) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            logit_bias: self.logit_bias.clone(),
            seed: self.seed,
            logprobs: self.logprobs,
        }
    }
}

/// A request that passed validation.
#[derive(Debug, PartialEq)]
pub(crate) struct Validated {
    pub model: String,
    pub input: Input,
    pub max_tokens: Option<MaxTokens>,
    pub sampling: SamplingRequest,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Completions: the answer starts with the prompt (OpenAI's `echo`).
    pub echo: bool,
    /// Choices to generate (`n`), 1 to [`MAX_N`].
    pub n: usize,
}

/// Most choices one request may ask for.
pub const MAX_N: u64 = 8;

impl Validated {
    /// The field the prompt came in: where a too-long prompt is blamed.
    pub fn prompt_param(&self) -> &'static str {
        match self.input {
            Input::Chat(_) => "messages",
            Input::Text(_) | Input::Tokens(_) => "prompt",
        }
    }
}

/// The fields both endpoints share.
struct Shared {
    max_tokens: Option<MaxTokens>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    n: Option<u64>,
    seed: Option<Seed>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logprobs: Option<usize>,
    extra: ExtraSampling,
}

/// Most alternatives `top_logprobs` (chat) may ask for, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most alternatives completions' `logprobs` may ask for, as OpenAI allows.
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// A 400 for a field that is known but not supported, when it is set.
fn refuse_if(set: bool, param: &str, why: &str) -> Result<(), ApiError> {
    if set {
        return Err(unsupported(param, format!("`{param}` is not supported by this server: {why}")));
    }
    Ok(())
}

impl ChatRequest {
    pub fn validate(self) -> Result<Validated, ApiError> {
        let structured = "structured outputs and tool calls are not available; the request was not run.";
        refuse_if(
            self.tools.as_ref().is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())),
            "tools",
            structured,
        )?;
        refuse_if(self.tool_choice.as_ref().is_some_and(|t| !t.is_null() && t != "none"), "tool_choice", structured)?;
        refuse_if(is_set(&self.functions), "functions", structured)?;
        refuse_if(
            self.function_call.as_ref().is_some_and(|t| !t.is_null() && t != "none"),
            "function_call",
            structured,
        )?;
        if let Some(rf) = self.response_format.as_ref().filter(|v| !v.is_null()) {
            let kind = rf.get("type").and_then(|t| t.as_str()).unwrap_or("");
            if kind != "text" {
                return Err(unsupported(
                    "response_format",
                    format!(
                        "`response_format` of type `{kind}` is not supported by this server: only `text` is; \
                         the request was not run."
                    ),
                ));
            }
        }
        refuse_if(
            self.modalities.as_ref().is_some_and(|m| m.iter().any(|m| m != "text")),
            "modalities",
            "only text output is produced.",
        )?;
        refuse_if(is_set(&self.audio), "audio", "only text output is produced.")?;
        refuse_if(is_set(&self.prediction), "prediction", "predicted outputs are not used.")?;
        refuse_if(is_set(&self.web_search_options), "web_search_options", "there is no web search.")?;
        let _ = self.parallel_tool_calls;
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (Some(true), top) => {
                let top = top.unwrap_or(0);
                if top > MAX_TOP_LOGPROBS {
                    return Err(out_of_range("top_logprobs", top as f64, "between 0 and 20"));
                }
                Some(top as usize)
            }
            (_, Some(top)) if top > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "invalid_value",
                    "Invalid value for `top_logprobs`: `logprobs` must be true when `top_logprobs` is set.",
                ))
            }
            _ => None,
        };
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "invalid_value",
                "Invalid value for `messages`: it must hold at least one message.",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.into_iter().enumerate() {
            messages.push(chat_message(i, m)?);
        }
        // The newer name wins when a client sends both.
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        let extra = extra_of!(self);
        let shared = Shared {
            max_tokens: max_tokens.map(|(p, v)| max_tokens_value(p, v)).transpose()?,
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            seed: self.seed,
            stop: self.stop,
            stream: self.stream,
            stream_options: self.stream_options,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logprobs,
            extra,
        };
        shared.validate(self.model, Input::Chat(messages))
    }
}

/// `max_tokens` of a completion request that sets none, as OpenAI's API has it.
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

impl CompletionRequest {
    pub fn validate(self) -> Result<Validated, ApiError> {
        let logprobs = match self.logprobs {
            Some(n) if n > MAX_COMPLETION_LOGPROBS => {
                return Err(out_of_range("logprobs", n as f64, "between 0 and 5"));
            }
            other => other.map(|n| n as usize),
        };
        let echo = self.echo == Some(true);
        if echo && logprobs.is_some() {
            return Err(unsupported(
                "echo",
                "`echo` with `logprobs` is not supported: log probabilities of the prompt are not computed.",
            ));
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(unsupported("best_of", "Only `best_of` = 1 is supported."));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "`suffix` is not supported: there is no insertion mode."));
        }
        let input = match self.prompt {
            Prompt::Text(s) => Input::Text(s),
            Prompt::Tokens(ids) if ids.is_empty() => {
                return Err(ApiError::invalid(
                    "prompt",
                    "invalid_value",
                    "Invalid value for `prompt`: the token array is empty.",
                ))
            }
            Prompt::Tokens(ids) => Input::Tokens(ids),
        };
        let extra = extra_of!(self);
        let max_tokens = match self.max_tokens {
            Some(v) => max_tokens_value("max_tokens", v)?,
            None => MaxTokens { value: COMPLETION_DEFAULT_MAX_TOKENS, param: "max_tokens" },
        };
        let shared = Shared {
            max_tokens: Some(max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            seed: self.seed,
            stop: self.stop,
            stream: self.stream,
            stream_options: self.stream_options,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logprobs,
            extra,
        };
        let mut v = shared.validate(self.model, input)?;
        v.echo = echo;
        Ok(v)
    }
}

impl Shared {
    fn validate(self, model: String, input: Input) -> Result<Validated, ApiError> {
        for (param, set) in &self.extra.refused {
            refuse_if(*set, param, "structured outputs are not available; the request was not run.")?;
        }
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(out_of_range("n", n as f64, "between 1 and 8"));
        }
        if n > 1 && self.stream == Some(true) {
            return Err(unsupported(
                "n",
                "`n` greater than 1 is not supported with `stream`; send n requests instead.",
            ));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(out_of_range("temperature", t, "between 0 and 2"));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(out_of_range("top_p", p, "greater than 0 and at most 1"));
            }
        }
        // vLLM's convention: -1 (or 0) disables top_k.
        let top_k = match self.extra.top_k {
            Some(k) if k < -1 => return Err(out_of_range("top_k", k as f64, "-1 (off), 0 (off) or a positive count")),
            Some(k) => Some(k.max(0) as usize),
            None => None,
        };
        if let Some(p) = self.extra.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(out_of_range("min_p", p, "between 0 and 1"));
            }
        }
        if let Some(r) = self.extra.repetition_penalty {
            if !(r > 0.0 && r <= 2.0) {
                return Err(out_of_range("repetition_penalty", r, "greater than 0 and at most 2"));
            }
        }
        for (param, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            let Some(v) = value else { continue };
            if !(-2.0..=2.0).contains(&v) {
                return Err(out_of_range(param, v, "between -2 and 2"));
            }
        }
        let mut logit_bias = Vec::new();
        for (k, &v) in self.extra.logit_bias.iter().flatten() {
            let param = format!("logit_bias.{k}");
            let Ok(id) = k.parse::<u32>() else {
                return Err(ApiError::invalid(
                    &param,
                    "invalid_value",
                    format!("Invalid value for `{param}`: `{k}` is not a token id."),
                ));
            };
            if !(-100.0..=100.0).contains(&v) {
                return Err(out_of_range(&param, v, "between -100 and 100"));
            }
            logit_bias.push((id, v as f32));
        }
        let stop = self.stop.map(|s| s.0).unwrap_or_default();
        if stop.len() > MAX_STOP_SEQUENCES {
            return Err(ApiError::invalid(
                "stop",
                "invalid_value",
                format!(
                    "Invalid value for `stop`: at most {MAX_STOP_SEQUENCES} sequences are allowed, got {}.",
                    stop.len()
                ),
            ));
        }
        let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
        Ok(Validated {
            model,
            input,
            max_tokens: self.max_tokens,
            sampling: SamplingRequest {
                temperature: self.temperature.map(|t| t as f32),
                top_p: self.top_p.map(|p| p as f32),
                top_k,
                min_p: self.extra.min_p.map(|p| p as f32),
                presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
                repetition_penalty: self.extra.repetition_penalty.map(|r| r as f32),
                logit_bias,
                seed: self.seed.map(|s| s.0),
                logprobs: self.logprobs,
            },
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
            echo: false,
            n: n as usize,
        })
    }
}

fn max_tokens_value(param: &'static str, v: u64) -> Result<MaxTokens, ApiError> {
    if v == 0 {
        return Err(ApiError::invalid(
            param,
            "invalid_value",
            format!("Invalid value for `{param}`: it must be at least 1."),
        ));
    }
    Ok(MaxTokens { value: usize::try_from(v).unwrap_or(usize::MAX), param })
}

/// Message `i` as the chat template sees it.
pub(crate) fn chat_message(i: usize, m: Message) -> Result<ChatMessage, ApiError> {
    Ok(ChatMessage { role: m.role.template_role().to_string(), content: message_text(i, m)? })
}

/// The text of message `i`; content parts are joined with newlines.
fn message_text(i: usize, m: Message) -> Result<String, ApiError> {
    let content = match m.content {
        Some(c) => c,
        None if m.role == Role::Assistant => return Ok(String::new()),
        None => {
            let param = format!("messages[{i}].content");
            return Err(ApiError::invalid(
                &param,
                "missing_required_parameter",
                format!("Missing required parameter: `{param}`."),
            ));
        }
    };
    match content {
        Content::Text(s) => Ok(s),
        Content::Parts(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.into_iter().enumerate() {
                if p.kind != "text" {
                    let param = format!("messages[{i}].content[{j}].type");
                    return Err(ApiError::invalid(
                        &param,
                        "unsupported_value",
                        format!("Invalid value for `{param}`: content parts of type `{}` are not supported; only `text` is.", p.kind),
                    ));
                }
                let Some(text) = p.text else {
                    let param = format!("messages[{i}].content[{j}].text");
                    return Err(ApiError::invalid(
                        &param,
                        "missing_required_parameter",
                        format!("Missing required parameter: `{param}`."),
                    ));
                };
                texts.push(text);
            }
            Ok(texts.join("\n"))
        }
    }
}

fn unsupported(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, "unsupported_parameter", message)
}

fn out_of_range(param: &str, value: f64, range: &str) -> ApiError {
    ApiError::invalid(param, "invalid_value", format!("Invalid value for `{param}`: it must be {range}, got {value}."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::body::parse_json;
    use axum::http::StatusCode;
    use serde_json::{json, Value};

    fn chat(body: Value) -> Result<Validated, ApiError> {
        parse_json::<ChatRequest>(body.to_string().as_bytes())?.validate()
    }

    fn completion(body: Value) -> Result<Validated, ApiError> {
        parse_json::<CompletionRequest>(body.to_string().as_bytes())?.validate()
    }

    fn chat_with(extra: Value) -> Result<Validated, ApiError> {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        chat(body)
    }

    /// Asserts a 400 whose `param` is `param` and whose message names it
    /// (and `also`, when given).
    #[track_caller]
    fn assert_field_error<T: std::fmt::Debug>(r: Result<T, ApiError>, param: &str, also: &str) {
        let e = r.expect_err("expected an error");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{e:?}");
        assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
        assert!(e.message.contains(param), "message does not name {param}: {}", e.message);
        assert!(e.message.contains(also), "message does not say {also}: {}", e.message);
    }

    #[test]
    fn a_minimal_chat_request_gets_the_defaults() {
        let v = chat_with(json!({})).unwrap();
        assert_eq!(v.model, "m");
        assert_eq!(v.input, Input::Chat(vec![ChatMessage { role: "user".into(), content: "hi".into() }]));
        assert_eq!(v.max_tokens, None);
        assert_eq!(v.sampling, SamplingRequest::default());
        let d = SamplingDefaults::default();
        assert_eq!(v.sampling.resolve(&d).temperature, d.temperature, "left-out fields take the defaults");
        assert!(v.stop.is_empty());
        assert!(!v.stream && !v.include_usage);
        assert_eq!(v.prompt_param(), "messages");
    }

    #[test]
    fn chat_fields_are_read() {
        let v = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null},
                {"role": "tool", "content": "42", "tool_call_id": "x"},
            ],
            "max_tokens": 9, "temperature": 0, "top_p": 0.5, "n": 1, "seed": -1,
            "stop": "\n\n", "stream": true, "stream_options": {"include_usage": true},
            "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": false,
            "user": "someone", "tools": [], "some_future_field": {"x": 1},
        }))
        .unwrap();
        let Input::Chat(msgs) = &v.input else { panic!() };
        let got: Vec<(&str, &str)> = msgs.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(got, [("system", "be brief"), ("user", "a\nb"), ("assistant", ""), ("tool", "42")]);
        assert_eq!(v.max_tokens, Some(MaxTokens { value: 9, param: "max_tokens" }));
        assert_eq!(
            v.sampling,
            SamplingRequest { temperature: Some(0.0), top_p: Some(0.5), seed: Some(u64::MAX), ..Default::default() }
        );
        assert_eq!(v.stop, ["\n\n"]);
        assert!(v.stream && v.include_usage);
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let v = chat_with(json!({"max_tokens": 5, "max_completion_tokens": 7})).unwrap();
        assert_eq!(v.max_tokens, Some(MaxTokens { value: 7, param: "max_completion_tokens" }));
        assert_field_error(chat_with(json!({"max_completion_tokens": 0})), "max_completion_tokens", "at least 1");
        assert_field_error(chat_with(json!({"max_tokens": 0})), "max_tokens", "at least 1");
        assert_field_error(chat_with(json!({"max_tokens": -3})), "max_tokens", "-3");
        assert_field_error(chat_with(json!({"max_tokens": "5"})), "max_tokens", "invalid type");
    }

    #[test]
    fn missing_and_mistyped_top_level_fields() {
        assert_field_error(chat(json!({"messages": []})), "model", "Missing");
        assert_field_error(chat(json!({"model": "m"})), "messages", "Missing");
        assert_field_error(chat(json!({"model": 5, "messages": []})), "model", "invalid type");
        assert_field_error(chat(json!({"model": "m", "messages": "hi"})), "messages", "invalid type");
        assert_field_error(chat(json!({"model": "m", "messages": []})), "messages", "at least one");
        assert_field_error(chat_with(json!({"stream": "yes"})), "stream", "invalid type");
        assert_field_error(
            chat_with(json!({"stream_options": {"include_usage": 1}})),
            "stream_options.include_usage",
            "invalid type",
        );
    }

    #[test]
    fn message_errors_name_the_message() {
        let with = |m: Value| chat(json!({"model": "m", "messages": [{"role": "user", "content": "ok"}, m]}));
        assert_field_error(
            with(json!({"role": "user", "content": 5})),
            "messages[1].content",
            "a string or an array of content parts",
        );
        assert_field_error(with(json!({"role": "user"})), "messages[1].content", "Missing");
        assert_field_error(with(json!({"role": "user", "content": null})), "messages[1].content", "Missing");
        assert_field_error(with(json!({"content": "x"})), "messages[1].role", "Missing");
        assert_field_error(with(json!({"role": "robot", "content": "x"})), "messages[1].role", "robot");
        assert_field_error(
            with(
                json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}),
            ),
            "messages[1].content[1].type",
            "image_url",
        );
        assert_field_error(
            with(json!({"role": "user", "content": [{"type": "text"}]})),
            "messages[1].content[0].text",
            "Missing",
        );
        assert_field_error(
            with(json!({"role": "user", "content": [{"type": "text", "text": 3}]})),
            "messages[1].content[0].text",
            "invalid type",
        );
        assert_field_error(with(json!({"role": "user", "content": ["a"]})), "messages[1].content[0]", "invalid type");
        assert_field_error(with(json!("just text")), "messages[1]", "invalid type");
    }

    #[test]
    fn sampling_ranges() {
        assert_field_error(chat_with(json!({"temperature": 5})), "temperature", "between 0 and 2");
        assert_field_error(chat_with(json!({"temperature": -0.1})), "temperature", "between 0 and 2");
        assert_field_error(chat_with(json!({"temperature": "hot"})), "temperature", "invalid type");
        assert!(chat_with(json!({"temperature": 2})).is_ok());
        assert_field_error(chat_with(json!({"top_p": 0})), "top_p", "greater than 0");
        assert_field_error(chat_with(json!({"top_p": 1.5})), "top_p", "at most 1");
        assert!(chat_with(json!({"top_p": 1})).is_ok());
        assert!(chat_with(json!({"temperature": null, "top_p": null, "seed": null, "stop": null})).is_ok());
        assert_field_error(chat_with(json!({"seed": 1.5})), "seed", "an integer");
        assert_eq!(chat_with(json!({"seed": 7})).unwrap().sampling.seed, Some(7));
    }

    #[test]
    fn unsupported_parameters() {
        assert_eq!(chat_with(json!({"n": 8})).unwrap().n, 8);
        assert_field_error(chat_with(json!({"n": 9})), "n", "between 1 and 8");
        assert_field_error(chat_with(json!({"n": 2, "stream": true})), "n", "stream");
        assert_field_error(chat_with(json!({"n": 0})), "n", "got 0");
        assert_field_error(chat_with(json!({"top_logprobs": 3})), "top_logprobs", "must be true");
        assert_field_error(
            chat_with(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
            "between 0 and 20",
        );
        assert_field_error(chat_with(json!({"frequency_penalty": 3})), "frequency_penalty", "between -2 and 2");
        // Known fields that cannot be honoured are refused by name, never ignored.
        let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        assert_field_error(chat_with(json!({"tools": tool})), "tools", "not supported");
        assert_field_error(chat_with(json!({"tool_choice": "required"})), "tool_choice", "not supported");
        assert_field_error(
            chat_with(json!({"response_format": {"type": "json_object"}})),
            "response_format",
            "json_object",
        );
        assert_field_error(chat_with(json!({"guided_json": {"type": "object"}})), "guided_json", "not supported");
        assert_field_error(chat_with(json!({"modalities": ["audio"]})), "modalities", "not supported");
        assert!(chat_with(json!({"response_format": {"type": "text"}, "tool_choice": "none", "tools": []})).is_ok());
    }

    #[test]
    fn sampling_fields_are_read_and_checked() {
        let v = chat_with(json!({
            "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": -1, "logit_bias": {"15": -100, "7": 2.5}, "logprobs": true, "top_logprobs": 3,
        }))
        .unwrap();
        assert_eq!(
            v.sampling,
            SamplingRequest {
                top_k: Some(20),
                min_p: Some(0.1),
                repetition_penalty: Some(1.1),
                presence_penalty: 0.5,
                frequency_penalty: -1.0,
                logit_bias: vec![(15, -100.0), (7, 2.5)],
                logprobs: Some(3),
                ..Default::default()
            }
        );
        assert_eq!(chat_with(json!({"top_k": -1})).unwrap().sampling.top_k, Some(0));
        assert_eq!(chat_with(json!({"logprobs": true})).unwrap().sampling.logprobs, Some(0));
        assert_field_error(chat_with(json!({"top_k": -2})), "top_k", "positive count");
        assert_field_error(chat_with(json!({"min_p": 1.5})), "min_p", "between 0 and 1");
        assert_field_error(chat_with(json!({"repetition_penalty": 0})), "repetition_penalty", "greater than 0");
        assert_field_error(chat_with(json!({"logit_bias": {"x": 1}})), "logit_bias.x", "not a token id");
        assert_field_error(chat_with(json!({"logit_bias": {"5": 101}})), "logit_bias.5", "between -100 and 100");
        // Request fields win over the model's defaults; the rest come from them.
        let d = SamplingDefaults { temperature: 0.3, top_p: 0.9, top_k: 50, min_p: 0.0, repetition_penalty: 1.05 };
        let p = chat_with(json!({"temperature": 1.2, "min_p": 0.2})).unwrap().sampling.resolve(&d);
        assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty), (1.2, 0.9, 50, 0.2, 1.05));
    }

    #[test]
    fn stop_sequences() {
        assert_eq!(chat_with(json!({"stop": ["a", "", "bc"]})).unwrap().stop, ["a", "bc"]);
        assert_eq!(chat_with(json!({"stop": []})).unwrap().stop, Vec::<String>::new());
        assert_field_error(chat_with(json!({"stop": ["a", "b", "c", "d", "e"]})), "stop", "at most 4");
        assert_field_error(chat_with(json!({"stop": 4})), "stop", "a string or an array of strings");
        assert_field_error(chat_with(json!({"stop": ["a", 4]})), "stop[1]", "invalid type");
    }

    #[test]
    fn completion_prompt_forms() {
        let prompt = |p: Value| completion(json!({"model": "m", "prompt": p})).map(|v| v.input);
        assert_eq!(prompt(json!("hi")).unwrap(), Input::Text("hi".into()));
        assert_eq!(prompt(json!(["hi"])).unwrap(), Input::Text("hi".into()));
        assert_eq!(prompt(json!([1, 2, 3])).unwrap(), Input::Tokens(vec![1, 2, 3]));
        assert_eq!(prompt(json!([[1, 2, 3]])).unwrap(), Input::Tokens(vec![1, 2, 3]));
        assert_eq!(prompt(json!("")).unwrap(), Input::Text(String::new()));

        assert_field_error(prompt(json!(["a", "b"])), "prompt", "batched prompts are not supported");
        assert_field_error(prompt(json!([[1], [2]])), "prompt", "batched prompts are not supported");
        assert_field_error(prompt(json!([1, "a"])), "prompt", "not a mix");
        assert_field_error(prompt(json!([])), "prompt", "array of one string");
        assert_field_error(prompt(json!([[]])), "prompt", "empty");
        assert_field_error(prompt(json!(5)), "prompt", "array of token ids");
        assert_field_error(prompt(json!([1, -2])), "prompt[1]", "-2");
        assert_field_error(prompt(json!([1, 5_000_000_000u64])), "prompt[1]", "5000000000");
        assert_field_error(prompt(json!([[1, 2.5]])), "prompt[0][1]", "invalid type");
        assert_field_error(completion(json!({"model": "m"})), "prompt", "Missing");
    }

    #[test]
    fn completion_fields() {
        let v = completion(json!({
            "model": "m", "prompt": "x", "max_tokens": 8, "temperature": 0.8, "seed": 3,
            "stop": ["\n"], "stream": true, "echo": false, "best_of": 1, "suffix": null, "logprobs": null,
        }))
        .unwrap();
        assert_eq!(v.max_tokens, Some(MaxTokens { value: 8, param: "max_tokens" }));
        assert_eq!(v.sampling, SamplingRequest { temperature: Some(0.8), seed: Some(3), ..Default::default() });
        assert_eq!(v.stop, ["\n"]);
        assert!(v.stream && !v.include_usage);
        assert_eq!(v.prompt_param(), "prompt");
        let v = completion(json!({"model": "m", "prompt": "x"})).unwrap();
        assert_eq!(v.max_tokens, Some(MaxTokens { value: 16, param: "max_tokens" }), "OpenAI's default of 16");

        let with = |extra: Value| {
            let mut body = json!({"model": "m", "prompt": "x"});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            completion(body)
        };
        assert_eq!(with(json!({"logprobs": 2})).unwrap().sampling.logprobs, Some(2));
        assert_field_error(with(json!({"logprobs": 6})), "logprobs", "between 0 and 5");
        assert!(with(json!({"echo": true})).unwrap().echo);
        assert_field_error(with(json!({"echo": true, "logprobs": 1})), "echo", "not supported");
        assert_field_error(with(json!({"best_of": 3})), "best_of", "best_of");
        assert_field_error(with(json!({"suffix": "tail"})), "suffix", "not supported");
        assert_field_error(with(json!({"n": 30})), "n", "between 1 and 8");
        assert_field_error(with(json!({"temperature": 5})), "temperature", "between 0 and 2");
        assert_field_error(with(json!({"max_tokens": 0})), "max_tokens", "at least 1");
    }
}
