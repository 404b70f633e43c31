//! Chat messages as requests carry them (roles, text or content parts, an
//! assistant's earlier tool calls, tool results), and their conversion to
//! what the chat template sees, and the template variables a request adds.

use std::fmt;

use granary_tokenizer::{ChatMessage, ChatOptions, TemplateKwargs};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::super::error::ApiError;

/// One message. A field not named here is refused (`unknown_parameter`);
/// the fields OpenAI's answers carry are named, so that a client can send
/// an earlier answer's message back as it came.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Message {
    pub role: Role,
    /// Optional only for `assistant` messages.
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's tool calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// The call a `tool` message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// An earlier assistant turn's refusal (null unless the model refused):
    /// the turn's text when it has no content.
    #[serde(default)]
    pub refusal: Option<String>,
    /// An earlier answer's citations: nothing the model reads.
    #[serde(default)]
    #[allow(dead_code)]
    pub annotations: Option<serde_json::Value>,
    /// An earlier answer's audio: refused unless null.
    #[serde(default)]
    pub audio: Option<serde_json::Value>,
    /// The deprecated single function call: refused unless null.
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
}

/// One tool call of an earlier assistant turn.
#[derive(Debug, Deserialize)]
pub(crate) struct MessageToolCall {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub function: MessageFunction,
}

#[derive(Debug, Deserialize)]
pub(crate) struct MessageFunction {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
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

/// Message `i` as the chat template sees it.
pub(crate) fn chat_message(i: usize, mut m: Message) -> Result<ChatMessage, ApiError> {
    let role = m.role.template_role().to_string();
    super::refuse_if(
        m.audio.as_ref().is_some_and(|a| !a.is_null()),
        &format!("messages[{i}].audio"),
        "audio is neither read nor produced.",
    )?;
    super::refuse_if(
        m.function_call.as_ref().is_some_and(|f| !f.is_null()),
        &format!("messages[{i}].function_call"),
        "the deprecated `function_call` is not supported; send `tool_calls`.",
    )?;
    if m.content.is_none() && m.role == Role::Assistant {
        m.content = m.refusal.take().map(Content::Text);
    }
    let calls = m.tool_calls.take();
    let (tool_call_id, name) = (m.tool_call_id.take(), m.name.take());
    if m.role == Role::Tool && tool_call_id.is_none() {
        let param = format!("messages[{i}].tool_call_id");
        return Err(ApiError::invalid(
            &param,
            "missing_required_parameter",
            format!("Missing required parameter: `{param}`."),
        ));
    }
    let has_calls = calls.as_ref().is_some_and(|c| !c.is_empty());
    let content = if has_calls && m.content.is_none() { String::new() } else { message_text(i, m)? };
    let tool_calls = match calls {
        Some(calls) if !calls.is_empty() => {
            let mut out = Vec::with_capacity(calls.len());
            for (j, c) in calls.into_iter().enumerate() {
                // Templates take the arguments as an object (transformers' convention).
                let args: serde_json::Value = serde_json::from_str(&c.function.arguments).map_err(|e| {
                    let param = format!("messages[{i}].tool_calls[{j}].function.arguments");
                    ApiError::invalid(&param, "invalid_value", format!("Invalid value for `{param}`: not JSON ({e})."))
                })?;
                if c.kind.as_deref().is_some_and(|k| k != "function") {
                    let param = format!("messages[{i}].tool_calls[{j}].type");
                    return Err(ApiError::invalid(
                        &param,
                        "invalid_value",
                        format!("Invalid value for `{param}`: only `function` calls are supported."),
                    ));
                }
                out.push(serde_json::json!({
                    "id": c.id.unwrap_or_default(),
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": args},
                }));
            }
            Some(serde_json::Value::Array(out))
        }
        _ => None,
    };
    Ok(ChatMessage { role, content, tool_calls, tool_call_id, name })
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

/// The variables a chat template gets from the server, which a request's
/// `chat_template_kwargs` may not replace.
const TEMPLATE_SETS: [&str; 8] =
    ["messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "pad_token"];

/// How a chat request's messages are rendered into its prompt: vLLM's
/// `add_generation_prompt`, `continue_final_message` and
/// `chat_template_kwargs`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChatRender {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub kwargs: Option<TemplateKwargs>,
}

impl Default for ChatRender {
    fn default() -> Self {
        ChatRender { add_generation_prompt: true, continue_final_message: false, kwargs: None }
    }
}

impl ChatRender {
    /// Checks the fields against `messages`. `continue_final_message`
    /// needs an assistant's last message and turns the default
    /// `add_generation_prompt` off; both set true is refused, as vLLM does.
    pub fn new(
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
        kwargs: Option<TemplateKwargs>,
        messages: &[ChatMessage],
    ) -> Result<ChatRender, ApiError> {
        let kwargs = template_kwargs(kwargs)?;
        let continue_final_message = continue_final_message.unwrap_or(false);
        if continue_final_message {
            if add_generation_prompt == Some(true) {
                return Err(ApiError::invalid(
                    "continue_final_message",
                    "invalid_value",
                    "Invalid value for `continue_final_message`: it cannot be true together with `add_generation_prompt`.",
                ));
            }
            if messages.last().is_none_or(|m| m.role != "assistant" || m.content.trim().is_empty()) {
                return Err(ApiError::invalid(
                    "messages",
                    "invalid_value",
                    "Invalid value for `messages`: with `continue_final_message` the last message must be the assistant's, with content to continue.",
                ));
            }
        }
        Ok(ChatRender {
            add_generation_prompt: add_generation_prompt.unwrap_or(!continue_final_message),
            continue_final_message,
            kwargs,
        })
    }

    pub fn options(&self) -> ChatOptions<'_> {
        ChatOptions {
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            kwargs: self.kwargs.as_ref(),
        }
    }
}

/// A request's `chat_template_kwargs`, checked: None when absent or empty;
/// a 400 naming a variable the server sets itself.
fn template_kwargs(kw: Option<TemplateKwargs>) -> Result<Option<TemplateKwargs>, ApiError> {
    let Some(kw) = kw.filter(|k| !k.is_empty()) else { return Ok(None) };
    if let Some(k) = kw.keys().find(|k| TEMPLATE_SETS.contains(&k.as_str())) {
        let param = format!("chat_template_kwargs.{k}");
        return Err(ApiError::invalid(
            &param,
            "invalid_value",
            format!("Invalid value for `{param}`: `{k}` is set by the server and cannot be replaced."),
        ));
    }
    Ok(Some(kw))
}
