//! Request bodies of `/v1/chat/completions` and `/v1/completions`, and their
//! validation into a [`Validated`] request that only needs tokenizing.
//!
//! Type errors are caught while parsing (see [`super::body`]); range and
//! support checks happen in [`ChatRequest::validate`] and
//! [`CompletionRequest::validate`]. Fields this server does not know are
//! ignored, as OpenAI does; `user` is one of them.

use std::fmt;

use granary_tokenizer::ChatMessage;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::error::ApiError;
use crate::types::SamplingParams;

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

/// A request that passed validation.
#[derive(Debug, PartialEq)]
pub(crate) struct Validated {
    pub model: String,
    pub input: Input,
    pub max_tokens: Option<MaxTokens>,
    pub sampling: SamplingParams,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

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
}

impl ChatRequest {
    pub fn validate(self) -> Result<Validated, ApiError> {
        if self.logprobs == Some(true) {
            return Err(unsupported("logprobs", "`logprobs` is not supported: log probabilities are not returned."));
        }
        if self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(unsupported(
                "top_logprobs",
                "`top_logprobs` is not supported: log probabilities are not returned.",
            ));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "invalid_value",
                "Invalid value for `messages`: it must hold at least one message.",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.into_iter().enumerate() {
            messages.push(ChatMessage { role: m.role.template_role().to_string(), content: message_text(i, m)? });
        }
        // The newer name wins when a client sends both.
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
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
        };
        shared.validate(self.model, Input::Chat(messages))
    }
}

impl CompletionRequest {
    pub fn validate(self) -> Result<Validated, ApiError> {
        if self.logprobs.is_some() {
            return Err(unsupported("logprobs", "`logprobs` is not supported: log probabilities are not returned."));
        }
        if self.echo == Some(true) {
            return Err(unsupported("echo", "`echo` is not supported: the prompt is never echoed."));
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
        let shared = Shared {
            max_tokens: self.max_tokens.map(|v| max_tokens_value("max_tokens", v)).transpose()?,
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            seed: self.seed,
            stop: self.stop,
            stream: self.stream,
            stream_options: self.stream_options,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        };
        shared.validate(self.model, input)
    }
}

impl Shared {
    fn validate(self, model: String, input: Input) -> Result<Validated, ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(unsupported("n", format!("Only `n` = 1 is supported, got {n}.")));
            }
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(out_of_range("temperature", temperature, "between 0 and 2"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(out_of_range("top_p", top_p, "greater than 0 and at most 1"));
        }
        for (param, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            let Some(v) = value else { continue };
            if !(-2.0..=2.0).contains(&v) {
                return Err(out_of_range(param, v, "between -2 and 2"));
            }
            if v != 0.0 {
                return Err(unsupported(param, format!("`{param}` is not supported; only 0 is accepted, got {v}.")));
            }
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
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_p: top_p as f32,
                seed: self.seed.map(|s| s.0),
            },
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
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
        assert_eq!(v.sampling, SamplingParams { temperature: 1.0, top_p: 1.0, seed: None });
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
        assert_eq!(v.sampling, SamplingParams { temperature: 0.0, top_p: 0.5, seed: Some(u64::MAX) });
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
        assert_field_error(chat_with(json!({"n": 2})), "n", "Only `n` = 1");
        assert_field_error(chat_with(json!({"n": 0})), "n", "got 0");
        assert_field_error(chat_with(json!({"logprobs": true})), "logprobs", "not supported");
        assert_field_error(chat_with(json!({"top_logprobs": 3})), "top_logprobs", "not supported");
        assert_field_error(chat_with(json!({"presence_penalty": 0.5})), "presence_penalty", "only 0");
        assert_field_error(chat_with(json!({"frequency_penalty": -1})), "frequency_penalty", "only 0");
        assert_field_error(chat_with(json!({"frequency_penalty": 3})), "frequency_penalty", "between -2 and 2");
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
        assert_eq!(v.sampling, SamplingParams { temperature: 0.8, top_p: 1.0, seed: Some(3) });
        assert_eq!(v.stop, ["\n"]);
        assert!(v.stream && !v.include_usage);
        assert_eq!(v.prompt_param(), "prompt");

        let with = |extra: Value| {
            let mut body = json!({"model": "m", "prompt": "x"});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            completion(body)
        };
        assert_field_error(with(json!({"logprobs": 2})), "logprobs", "not supported");
        assert_field_error(with(json!({"echo": true})), "echo", "not supported");
        assert_field_error(with(json!({"best_of": 3})), "best_of", "best_of");
        assert_field_error(with(json!({"suffix": "tail"})), "suffix", "not supported");
        assert_field_error(with(json!({"n": 3})), "n", "n");
        assert_field_error(with(json!({"temperature": 5})), "temperature", "between 0 and 2");
        assert_field_error(with(json!({"max_tokens": 0})), "max_tokens", "at least 1");
    }
}
