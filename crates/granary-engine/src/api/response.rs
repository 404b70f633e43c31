//! Response bodies: `chat.completion`, `text_completion` and their
//! streaming chunks, in OpenAI's shapes.

use serde::Serialize;

use crate::types::FinishReason;

/// Which endpoint answers: the object names and choice shapes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl UsageBody {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        UsageBody {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// What every response object of one request shares.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Header {
    /// A fresh random id (`chatcmpl-…` or `cmpl-…`) created now.
    pub fn new(endpoint: Endpoint, model: String) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        let id = format!("{prefix}-{:032x}", rand::random::<u128>());
        Header { endpoint, id, created: unix_now(), model }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// The whole answer of a non-streamed request.
    #[cfg(test)]
    pub fn complete(&self, text: &str, reason: FinishReason, usage: UsageBody) -> serde_json::Value {
        self.complete_with(text, reason, usage, None)
    }

    /// The whole answer, with its `logprobs` object when asked for.
    #[cfg(test)]
    pub fn complete_with(
        &self,
        text: &str,
        reason: FinishReason,
        usage: UsageBody,
        logprobs: Option<serde_json::Value>,
    ) -> serde_json::Value {
        self.complete_choices(vec![Answer::text(text.to_string(), reason, logprobs)], usage)
    }

    /// The whole answer with several choices (`n`), indexed in order.
    pub fn complete_choices(&self, answers: Vec<Answer>, usage: UsageBody) -> serde_json::Value {
        let choices = answers
            .iter()
            .enumerate()
            .map(|(i, a)| match self.endpoint {
                Endpoint::Chat => Choice::Message {
                    index: i as u32,
                    message: AssistantMessage {
                        role: "assistant",
                        content: a.content.as_deref(),
                        tool_calls: a.tool_calls.clone(),
                    },
                    logprobs: a.logprobs.clone(),
                    finish_reason: a.reason.as_str(),
                },
                Endpoint::Completion => Choice::Text {
                    index: i as u32,
                    text: a.content.as_deref().unwrap_or(""),
                    logprobs: a.logprobs.clone(),
                    finish_reason: Some(a.reason.as_str()),
                },
            })
            .collect();
        let body = Object {
            id: &self.id,
            object: self.object(false),
            created: self.created,
            model: &self.model,
            choices,
            usage: Some(Some(usage)),
        };
        serde_json::to_value(body).expect("response objects serialize")
    }

    /// Streaming chunks of one request.
    pub fn chunker(self, include_usage: bool) -> Chunker {
        Chunker { header: self, include_usage, index: 0 }
    }
}

/// One choice of a whole answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Answer {
    /// `None`: a chat answer that is only tool calls (`"content": null`).
    pub content: Option<String>,
    pub reason: FinishReason,
    pub logprobs: Option<serde_json::Value>,
    /// OpenAI's `tool_calls` objects.
    pub tool_calls: Vec<serde_json::Value>,
}

impl Answer {
    pub fn text(text: String, reason: FinishReason, logprobs: Option<serde_json::Value>) -> Self {
        Answer { content: Some(text), reason, logprobs, tool_calls: Vec::new() }
    }
}

/// Formats the `data:` payloads of one streamed request.
#[derive(Debug, Clone)]
pub(crate) struct Chunker {
    header: Header,
    include_usage: bool,
    /// The choice the chunks belong to (`n` > 1).
    index: u32,
}

impl Chunker {
    /// The chunk sent before any text: chat announces the assistant role.
    pub fn start(&self) -> Option<String> {
        match self.header.endpoint {
            Endpoint::Chat => Some(self.chunk(vec![Choice::Delta {
                index: self.index,
                delta: Delta { role: Some("assistant"), content: Some(""), tool_calls: None },
                logprobs: None,
                finish_reason: None,
            }])),
            Endpoint::Completion => None,
        }
    }

    #[cfg(test)]
    pub fn text(&self, text: &str) -> String {
        self.chunk(vec![self.choice(Some(text), None)])
    }

    /// A text chunk with the log probabilities of the tokens it carries.
    pub fn text_with(&self, text: &str, logprobs: Option<serde_json::Value>) -> String {
        let mut choice = self.choice(Some(text), None);
        match &mut choice {
            Choice::Delta { logprobs: lp, .. }
            | Choice::Text { logprobs: lp, .. }
            | Choice::Message { logprobs: lp, .. } => *lp = logprobs,
        }
        self.chunk(vec![choice])
    }

    /// A chat chunk carrying tool call number `index` whole (its id,
    /// name and arguments in one delta).
    pub fn tool_call(&self, index: usize, call: &serde_json::Value) -> String {
        let mut call = call.clone();
        call["index"] = serde_json::json!(index);
        self.chunk(vec![Choice::Delta {
            index: self.index,
            delta: Delta { role: None, content: None, tool_calls: Some(vec![call]) },
            logprobs: None,
            finish_reason: None,
        }])
    }

    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// The chunker of choice `index` of the same answer.
    pub fn for_choice(&self, index: usize) -> Chunker {
        Chunker { index: index as u32, ..self.clone() }
    }

    pub fn endpoint(&self) -> Endpoint {
        self.header.endpoint
    }

    /// The chunk carrying the finish reason.
    pub fn finish(&self, reason: FinishReason) -> String {
        let text = match self.header.endpoint {
            Endpoint::Chat => None,
            Endpoint::Completion => Some(""),
        };
        self.chunk(vec![self.choice(text, Some(reason.as_str()))])
    }

    /// The last chunk, when the client asked for usage: no choices.
    pub fn usage(&self, usage: UsageBody) -> Option<String> {
        self.include_usage.then(|| self.serialize(Vec::new(), Some(Some(usage))))
    }

    fn choice<'a>(&self, text: Option<&'a str>, finish_reason: Option<&'static str>) -> Choice<'a> {
        match self.header.endpoint {
            Endpoint::Chat => Choice::Delta {
                index: self.index,
                delta: Delta { role: None, content: text, tool_calls: None },
                logprobs: None,
                finish_reason,
            },
            Endpoint::Completion => {
                Choice::Text { index: self.index, text: text.unwrap_or(""), logprobs: None, finish_reason }
            }
        }
    }

    fn chunk(&self, choices: Vec<Choice<'_>>) -> String {
        // With include_usage every chunk but the last says `"usage": null`.
        let usage = self.include_usage.then_some(None);
        self.serialize(choices, usage)
    }

    fn serialize(&self, choices: Vec<Choice<'_>>, usage: Option<Option<UsageBody>>) -> String {
        let h = &self.header;
        let body = Object { id: &h.id, object: h.object(true), created: h.created, model: &h.model, choices, usage };
        serde_json::to_string(&body).expect("chunks serialize")
    }
}

#[derive(Serialize)]
struct Object<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice<'a>>,
    /// Absent, `null` or the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<UsageBody>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Choice<'a> {
    Message {
        index: u32,
        message: AssistantMessage<'a>,
        logprobs: Option<serde_json::Value>,
        finish_reason: &'static str,
    },
    Delta {
        index: u32,
        delta: Delta<'a>,
        logprobs: Option<serde_json::Value>,
        finish_reason: Option<&'static str>,
    },
    Text {
        index: u32,
        text: &'a str,
        logprobs: Option<serde_json::Value>,
        finish_reason: Option<&'static str>,
    },
}

#[derive(Serialize)]
struct AssistantMessage<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<serde_json::Value>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<serde_json::Value>>,
}

/// The `logprobs` object of `tokens` (each id with its log probabilities)
/// in `endpoint`'s shape; `name` gives a token's text. `offset` is the
/// text length before the first token (completions' `text_offset`).
pub(crate) fn logprobs_json(
    endpoint: Endpoint,
    tokens: &[(u32, crate::TokenLogprobs)],
    name: &dyn Fn(u32) -> String,
    offset: usize,
) -> serde_json::Value {
    use serde_json::json;
    let finite = |x: f32| if x.is_finite() { x as f64 } else { -9999.0 };
    match endpoint {
        Endpoint::Chat => {
            let entry = |id: u32, lp: f32| {
                let t = name(id);
                json!({"token": t, "logprob": finite(lp), "bytes": t.as_bytes()})
            };
            let content: Vec<serde_json::Value> = tokens
                .iter()
                .map(|(id, lp)| {
                    let mut e = entry(*id, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
                    e
                })
                .collect();
            json!({ "content": content })
        }
        Endpoint::Completion => {
            let mut off = offset;
            let (mut toks, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
            for (id, lp) in tokens {
                let t = name(*id);
                offs.push(off);
                off += t.len();
                toks.push(t);
                lps.push(finite(lp.logprob));
                let top: serde_json::Map<String, serde_json::Value> =
                    lp.top.iter().map(|&(t, l)| (name(t), json!(finite(l)))).collect();
                tops.push(serde_json::Value::Object(top));
            }
            json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
        }
    }
}

/// Completions' `logprobs` for an echoed prompt and its completion: every
/// prompt token (the first with `null`, as it has no context), then the
/// generated ones, offsets running on from the echoed text's length.
pub(crate) fn echoed_logprobs_json(
    prompt: &[u32],
    prompt_lps: &[crate::TokenLogprobs],
    generated: &[(u32, crate::TokenLogprobs)],
    name: &dyn Fn(u32) -> String,
    echoed_len: usize,
) -> serde_json::Value {
    let none = crate::TokenLogprobs { logprob: 0.0, top: Vec::new() };
    let entries: Vec<(u32, crate::TokenLogprobs)> =
        prompt.iter().copied().zip(std::iter::once(none).chain(prompt_lps.iter().cloned())).collect();
    let mut v = logprobs_json(Endpoint::Completion, &entries, name, 0);
    if !entries.is_empty() {
        v["token_logprobs"][0] = serde_json::Value::Null;
        v["top_logprobs"][0] = serde_json::Value::Null;
    }
    let g = logprobs_json(Endpoint::Completion, generated, name, echoed_len);
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(all), Some(more)) = (v[key].as_array_mut(), g[key].as_array()) {
            all.extend(more.iter().cloned());
        }
    }
    v
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn header(endpoint: Endpoint) -> Header {
        Header { endpoint, id: "id-1".into(), created: 7, model: "m".into() }
    }

    fn parse(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn ids_are_prefixed_and_random() {
        let a = Header::new(Endpoint::Chat, "m".into());
        let b = Header::new(Endpoint::Chat, "m".into());
        assert!(a.id.starts_with("chatcmpl-") && a.id.len() == 9 + 32, "{}", a.id);
        assert_ne!(a.id, b.id);
        assert!(Header::new(Endpoint::Completion, "m".into()).id.starts_with("cmpl-"));
        assert!(a.created > 1_600_000_000);
    }

    #[test]
    fn non_streamed_objects() {
        let usage = UsageBody::new(10, 3, 4);
        let chat = header(Endpoint::Chat).complete("hi", FinishReason::Stop, usage);
        assert_eq!(
            chat,
            json!({
                "id": "id-1", "object": "chat.completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": null, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 4}},
            })
        );
        let text = header(Endpoint::Completion).complete("hi", FinishReason::Length, usage);
        assert_eq!(text["object"], "text_completion");
        assert_eq!(text["choices"], json!([{"index": 0, "text": "hi", "logprobs": null, "finish_reason": "length"}]));
        assert_eq!(text["usage"]["total_tokens"], 13);
    }

    #[test]
    fn chat_chunks() {
        let c = header(Endpoint::Chat).chunker(false);
        let start = parse(&c.start().unwrap());
        assert_eq!(
            start,
            json!({"id": "id-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]})
        );
        assert_eq!(
            parse(&c.text("yo"))["choices"],
            json!([{"index": 0, "delta": {"content": "yo"}, "logprobs": null, "finish_reason": null}])
        );
        assert_eq!(
            parse(&c.finish(FinishReason::Stop))["choices"],
            json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}])
        );
        assert!(parse(&c.text("yo")).get("usage").is_none());
        assert_eq!(c.usage(UsageBody::new(1, 2, 0)), None);
    }

    #[test]
    fn chunks_with_usage() {
        let c = header(Endpoint::Chat).chunker(true);
        assert_eq!(parse(&c.text("yo"))["usage"], Value::Null);
        assert!(parse(&c.text("yo")).as_object().unwrap().contains_key("usage"));
        let last = parse(&c.usage(UsageBody::new(5, 2, 1)).unwrap());
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["object"], "chat.completion.chunk");
        assert_eq!(
            last["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 1}})
        );
    }

    #[test]
    fn completion_chunks() {
        let c = header(Endpoint::Completion).chunker(true);
        assert_eq!(c.start(), None);
        let t = parse(&c.text("yo"));
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"], json!([{"index": 0, "text": "yo", "logprobs": null, "finish_reason": null}]));
        assert_eq!(
            parse(&c.finish(FinishReason::Length))["choices"],
            json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}])
        );
        assert_eq!(parse(&c.usage(UsageBody::new(5, 2, 0)).unwrap())["choices"], json!([]));
    }
}
