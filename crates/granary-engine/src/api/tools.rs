//! Tool calls: how the model is told about tools, the grammar that forces
//! a call (`tool_choice` `required` or named), and the parser that finds
//! calls in the output (streamed or whole).
//!
//! The call syntax is the model's own, read from its chat template:
//! Hermes-style `<tool_call>{"name", "arguments"}</tool_call>` (Qwen 2/2.5/3,
//! Hermes, and the syntax used for templates that know no tools), Llama 3.x
//! JSON `{"name", "parameters"}`, and Mistral's `[TOOL_CALLS][{...}]`.
//! A template that renders `tools` itself gets them; for one that does
//! not, the tools and the syntax are described in the system message, and
//! earlier calls and results are written as text in that syntax.

use granary_tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Value};

use super::structured::{lark_literal, ToolsSpec};

/// The call syntax a model was trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    pub fn of(tokenizer: &Tokenizer) -> Self {
        match tokenizer.chat_template() {
            Some(t) if t.contains(MISTRAL_OPEN) => ToolFormat::Mistral,
            Some(t) if t.contains(HERMES_OPEN) => ToolFormat::Hermes,
            Some(t) if t.contains(PYTHON_TAG) || (t.contains("ipython") && t.contains("parameters")) => {
                ToolFormat::Llama3Json
            }
            _ => ToolFormat::Hermes,
        }
    }

    /// The key holding the arguments object.
    fn args_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// A JSON schema of one call to any of the callable tools.
    fn call_schema(self, spec: &ToolsSpec) -> Value {
        let alts: Vec<Value> = spec
            .callable()
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, (self.args_key()): t.parameters},
                    "required": ["name", self.args_key()],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = if alts.len() == 1 { alts.into_iter().next().expect("one") } else { json!({"anyOf": alts}) };
        super::structured::json_layout(schema)
    }

    /// A Lark grammar whose every output is one call (or, with
    /// `parallel_tool_calls`, one or more) in this syntax. `special` gives
    /// the id of a marker that is a special token in the vocabulary.
    /// A named function is called once.
    pub fn forced_grammar(self, spec: &ToolsSpec, special: &dyn Fn(&str) -> Option<u32>) -> String {
        let parallel = spec.parallel && !matches!(spec.choice, super::structured::ToolChoice::Named(_));
        let marker = |text: &str| match special(text) {
            Some(id) => format!("<[{id}]>"),
            None => lark_literal(text),
        };
        let call = self.call_schema(spec);
        match self {
            ToolFormat::Hermes => {
                let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
                format!(
                    "start: call{repeat}\ncall: {} \"\\n\" %json {} \"\\n\" {}\n",
                    marker(HERMES_OPEN),
                    call,
                    marker(HERMES_CLOSE)
                )
            }
            ToolFormat::Llama3Json => format!("start: %json {call}\n"),
            ToolFormat::Mistral => {
                let mut call = call;
                let layout = call.as_object_mut().and_then(|o| o.remove("x-guidance"));
                let mut arr = json!({"type": "array", "items": call, "minItems": 1, "x-guidance": layout});
                if !parallel {
                    arr["maxItems"] = json!(1);
                }
                format!("start: {} %json {}\n", marker(MISTRAL_OPEN), arr)
            }
        }
    }

    /// Calls written as the model writes them.
    fn write_calls(self, calls: &[(String, Value)]) -> String {
        let key = self.args_key();
        let objs: Vec<Value> = calls.iter().map(|(n, a)| json!({"name": n, (key): a})).collect();
        match self {
            ToolFormat::Hermes => {
                objs.iter().map(|o| format!("{HERMES_OPEN}\n{o}\n{HERMES_CLOSE}")).collect::<Vec<_>>().join("\n")
            }
            ToolFormat::Llama3Json => objs.iter().map(Value::to_string).collect::<Vec<_>>().join("; "),
            ToolFormat::Mistral => format!("{MISTRAL_OPEN}{}", Value::Array(objs)),
        }
    }

    /// The system text describing the tools and the syntax, for templates
    /// that do not render tools.
    fn system_text(self, spec: &ToolsSpec) -> String {
        let mut s = String::from("You can call functions. The available functions, as JSON schemas, are:\n");
        for t in spec.callable() {
            let mut f = json!({"name": t.name, "parameters": t.parameters});
            if let Some(d) = &t.description {
                f["description"] = json!(d);
            }
            s.push_str(&f.to_string());
            s.push('\n');
        }
        let example = self.write_calls(&[("function_name".into(), json!({"argument": "value"}))]);
        s.push_str(&format!(
            "To call a function, reply with the call alone, in this form:\n{example}\n\
             A function's result comes back in the next message; then answer the user."
        ));
        s
    }
}

/// The messages and tools to render for a request with tools.
pub(crate) fn prompt_messages(
    tokenizer: &Tokenizer,
    format: ToolFormat,
    mut messages: Vec<ChatMessage>,
    spec: &ToolsSpec,
) -> (Vec<ChatMessage>, Option<Value>) {
    if tokenizer.template_renders_tools() {
        return (messages, spec.active().then(|| spec.as_openai()));
    }
    // Earlier calls and results as text in the model's syntax.
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    for mut m in messages.drain(..) {
        if let Some(calls) = m.tool_calls.take() {
            let calls: Vec<(String, Value)> = calls
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| {
                    let f = c.get("function")?;
                    Some((f.get("name")?.as_str()?.to_string(), f.get("arguments").cloned().unwrap_or(json!({}))))
                })
                .collect();
            let written = format.write_calls(&calls);
            m.content = if m.content.is_empty() { written } else { format!("{}\n{written}", m.content) };
        }
        if m.role == "tool" {
            let text = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                // Several results answer one turn: one user message.
                Some(prev) if prev.role == "user" && prev.content.starts_with("<tool_response>") => {
                    prev.content.push('\n');
                    prev.content.push_str(&text);
                }
                _ => out.push(ChatMessage::new("user", text)),
            }
            continue;
        }
        out.push(m);
    }
    if spec.active() {
        let text = format.system_text(spec);
        match out.first_mut() {
            Some(first) if first.role == "system" => first.content = format!("{}\n\n{text}", first.content),
            _ => out.insert(0, ChatMessage::new("system", text)),
        }
    }
    (out, None)
}

/// A call found in the output.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI's shape).
    pub arguments: String,
}

impl ToolCall {
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What the parser makes of the output.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolEvent {
    Content(String),
    Call(ToolCall),
}

fn call_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect();
    format!("call_{tail}")
}

/// Finds calls in the output as it streams. Text that may start a call is
/// held back until it is known; what is not a call is content.
pub(crate) struct ToolParser {
    format: ToolFormat,
    names: Vec<String>,
    buf: String,
    /// Inside `<tool_call>…` (Hermes) or a held whole-output call.
    in_call: bool,
    /// Nothing but whitespace has been emitted yet.
    at_start: bool,
    calls: usize,
}

impl ToolParser {
    pub fn new(format: ToolFormat, spec: &ToolsSpec) -> Self {
        ToolParser {
            format,
            names: spec.callable().iter().map(|t| t.name.clone()).collect(),
            buf: String::new(),
            in_call: false,
            at_start: true,
            calls: 0,
        }
    }

    /// A call object (`{"name", "arguments"|"parameters"}`) of a known tool.
    fn call_of(&mut self, v: &Value) -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(json!({}));
        let arguments = match args {
            Value::String(s) => s,
            other => other.to_string(),
        };
        Some(ToolCall { id: call_id(), name: name.to_string(), arguments })
    }

    /// Calls in `text`: one object, an array of them, or several objects
    /// separated by whitespace or `;`. `None` unless all of it is calls.
    fn calls_in(&mut self, text: &str) -> Option<Vec<ToolCall>> {
        let mut values = Vec::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            let v = it.next()?.ok()?;
            rest = rest[it.byte_offset()..].trim_start().trim_start_matches(';').trim_start();
            match v {
                Value::Array(items) => values.extend(items),
                v => values.push(v),
            }
        }
        if values.is_empty() {
            return None;
        }
        values.iter().map(|v| self.call_of(v)).collect()
    }

    fn emit_content(&mut self, out: &mut Vec<ToolEvent>, text: String) {
        if text.is_empty() {
            return;
        }
        if !text.trim().is_empty() {
            self.at_start = false;
        }
        out.push(ToolEvent::Content(text));
    }

    /// Takes newly decoded text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                if self.format != ToolFormat::Hermes {
                    return out; // held until the end
                }
                let Some(end) = self.buf.find(HERMES_CLOSE) else { return out };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + HERMES_CLOSE.len());
                self.in_call = false;
                match self.calls_in(&body) {
                    Some(calls) => {
                        self.calls += calls.len();
                        self.at_start = false;
                        out.extend(calls.into_iter().map(ToolEvent::Call));
                    }
                    None => self.emit_content(&mut out, format!("{HERMES_OPEN}{body}{HERMES_CLOSE}")),
                }
                // Whitespace between calls is not content.
                let trimmed = self.buf.trim_start().len();
                if trimmed == 0 && self.calls > 0 {
                    self.buf.clear();
                    return out;
                }
                continue;
            }
            // Looking for the start of a call.
            let open = match self.format {
                ToolFormat::Hermes => HERMES_OPEN,
                ToolFormat::Mistral => MISTRAL_OPEN,
                ToolFormat::Llama3Json => PYTHON_TAG,
            };
            if let Some(p) = self.buf.find(open) {
                let before = self.buf[..p].to_string();
                // Whitespace between calls is not content.
                if !(self.calls > 0 && before.trim().is_empty()) {
                    self.emit_content(&mut out, before);
                }
                self.buf.drain(..p + open.len());
                self.in_call = true;
                continue;
            }
            // A whole-output JSON call (Llama 3, Mistral without its marker,
            // Hermes models that leave the tags out) starts the answer.
            let lead = self.buf.trim_start();
            if self.at_start && (lead.starts_with('{') || lead.starts_with('[')) {
                self.in_call = true;
                self.format = match self.format {
                    ToolFormat::Hermes => ToolFormat::Llama3Json, // held to the end like it
                    f => f,
                };
                return out;
            }
            if (self.at_start || self.calls > 0) && lead.is_empty() {
                return out; // whitespace: content or a gap between calls
            }
            // Hold back a tail that may be the start of the marker.
            let keep = (1..open.len().min(self.buf.len() + 1))
                .rev()
                .find(|&k| {
                    self.buf.is_char_boundary(self.buf.len() - k) && open.starts_with(&self.buf[self.buf.len() - k..])
                })
                .unwrap_or(0);
            let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
            self.emit_content(&mut out, emit);
            return out;
        }
    }

    /// The end of the output: whatever is held is a call if it parses as
    /// one, else content.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            match self.calls_in(&rest) {
                Some(calls) => {
                    self.calls += calls.len();
                    out.extend(calls.into_iter().map(ToolEvent::Call));
                }
                None => {
                    let marker = match self.format {
                        ToolFormat::Hermes => HERMES_OPEN,
                        ToolFormat::Mistral if !rest.trim_start().starts_with('[') => MISTRAL_OPEN,
                        ToolFormat::Llama3Json if !rest.trim_start().starts_with(['{', '[']) => PYTHON_TAG,
                        _ => "",
                    };
                    self.emit_content(&mut out, format!("{marker}{rest}"));
                }
            }
        } else if !(self.calls > 0 && rest.trim().is_empty()) {
            self.emit_content(&mut out, rest);
        }
        out
    }
}

/// The whole output split into content and calls.
pub(crate) fn parse_output(parser: &mut ToolParser, text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut events = parser.push(text);
    events.extend(parser.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for e in events {
        match e {
            ToolEvent::Content(c) => content.push_str(&c),
            ToolEvent::Call(c) => calls.push(c),
        }
    }
    let content = if calls.is_empty() || !content.trim().is_empty() { Some(content) } else { None };
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::super::structured::{tools_spec, ToolChoice};
    use super::*;

    fn spec(choice: &str) -> ToolsSpec {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
        ]);
        tools_spec(Some(&tools), Some(&json!(choice)), None).unwrap().unwrap()
    }

    fn parse(format: ToolFormat, pieces: &[&str]) -> Vec<ToolEvent> {
        let mut p = ToolParser::new(format, &spec("auto"));
        let mut out: Vec<ToolEvent> = pieces.iter().flat_map(|t| p.push(t)).collect();
        out.extend(p.finish());
        // Join adjacent content for comparison.
        let mut joined: Vec<ToolEvent> = Vec::new();
        for e in out {
            match (joined.last_mut(), e) {
                (Some(ToolEvent::Content(a)), ToolEvent::Content(b)) => a.push_str(&b),
                (_, e) => joined.push(e),
            }
        }
        joined
    }

    fn call(e: &ToolEvent) -> (&str, Value) {
        match e {
            ToolEvent::Call(c) => (c.name.as_str(), serde_json::from_str(&c.arguments).unwrap()),
            other => panic!("not a call: {other:?}"),
        }
    }

    #[test]
    fn hermes_calls_across_pieces_with_content_before() {
        let ev = parse(
            ToolFormat::Hermes,
            &["Let me check.", " <tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"],
        );
        assert_eq!(ev[0], ToolEvent::Content("Let me check. ".into()));
        assert_eq!(call(&ev[1]), ("get_weather", json!({"city": "Paris"})));
        assert_eq!(call(&ev[2]), ("add", json!({"a": 1, "b": 2})));
        assert_eq!(ev.len(), 3);
    }

    #[test]
    fn plain_text_streams_and_lookalikes_stay_content() {
        let ev = parse(ToolFormat::Hermes, &["The answer is <b>42</b>", " and a <tool"]);
        assert_eq!(ev, vec![ToolEvent::Content("The answer is <b>42</b> and a <tool".into())]);
        // A call of an unknown function is content.
        let ev = parse(ToolFormat::Hermes, &["<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>"]);
        assert_eq!(ev, vec![ToolEvent::Content("<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>".into())]);
        // An unclosed call that parses is still a call.
        let ev = parse(ToolFormat::Hermes, &["<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}"]);
        assert_eq!(call(&ev[0]), ("add", json!({"a": 1})));
    }

    #[test]
    fn llama3_and_mistral_outputs() {
        let ev = parse(ToolFormat::Llama3Json, &["{\"name\": \"add\", ", "\"parameters\": {\"a\": 3, \"b\": 4}}"]);
        assert_eq!(call(&ev[0]), ("add", json!({"a": 3, "b": 4})));
        let ev = parse(ToolFormat::Llama3Json, &["<|python_tag|>{\"name\": \"add\", \"parameters\": {}}"]);
        assert_eq!(call(&ev[0]), ("add", json!({})));
        let ev = parse(ToolFormat::Mistral, &["[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]"]);
        assert_eq!(call(&ev[0]).0, "add");
        assert_eq!(call(&ev[1]), ("get_weather", json!({"city": "Oslo"})));
        // JSON that is not a call is content.
        let ev = parse(ToolFormat::Llama3Json, &["{\"answer\": 42}"]);
        assert_eq!(ev, vec![ToolEvent::Content("{\"answer\": 42}".into())]);
    }

    #[test]
    fn forced_grammars_name_only_the_callable_tools() {
        let named = {
            let mut s = spec("auto");
            s.choice = ToolChoice::Named("add".into());
            s
        };
        let g = ToolFormat::Hermes.forced_grammar(&named, &|_| None);
        assert!(g.contains("\"<tool_call>\"") && g.contains("\"const\":\"add\"") && !g.contains("get_weather"), "{g}");
        assert!(!g.contains("call)*"), "a named function is called once: {g}");
        let g = ToolFormat::Hermes.forced_grammar(&spec("required"), &|t| (t == "<tool_call>").then_some(7));
        assert!(g.contains("<[7]>") && g.contains("get_weather") && g.contains("(\"\\n\" call)*"), "{g}");
        let g = ToolFormat::Llama3Json.forced_grammar(&spec("required"), &|_| None);
        assert!(g.contains("\"parameters\""), "{g}");
    }

    #[test]
    fn templates_without_tools_get_them_described() {
        let tok = granary_tokenizer::testing::default_model_path().and_then(|p| Tokenizer::from_gguf_path(&p).ok());
        let Some(tok) = tok else { return };
        let msgs = vec![
            ChatMessage::new("user", "Weather in Paris?"),
            ChatMessage {
                tool_calls: Some(
                    json!([{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]),
                ),
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "18C") },
        ];
        let (out, tools) = prompt_messages(&tok, ToolFormat::Hermes, msgs, &spec("auto"));
        assert_eq!(tools, None);
        assert_eq!(out[0].role, "system");
        assert!(out[0].content.contains("get_weather") && out[0].content.contains("<tool_call>"));
        assert!(
            out[2].content.contains("<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}"),
            "{}",
            out[2].content
        );
        assert_eq!(out[3].role, "user");
        assert_eq!(out[3].content, "<tool_response>\n18C\n</tool_response>");
    }
}
