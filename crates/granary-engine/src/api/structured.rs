//! Structured outputs and tools as requests carry them, validated into
//! what the generation needs: a grammar for constrained decoding
//! ([`OutputGrammar`]) and the tools with the caller's choice
//! ([`ToolsSpec`]).
//!
//! Accepted forms: OpenAI's `response_format` (`text`, `json_object`,
//! `json_schema`), vLLM's `guided_json`, `guided_regex`, `guided_choice`
//! and `guided_grammar` (a Lark grammar in llguidance's dialect),
//! llama.cpp's `json_schema`; `tools`, `tool_choice` and
//! `parallel_tool_calls`. llama.cpp's GBNF `grammar` and the deprecated
//! `functions` / `function_call` are refused by name.

use serde_json::{json, Value};

use super::error::ApiError;

/// A grammar the output must match, and the field it came from (where a
/// grammar that does not compile is blamed).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OutputGrammar {
    pub param: &'static str,
    pub kind: GrammarKind,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum GrammarKind {
    JsonSchema(Value),
    Regex(String),
    Lark(String),
}

impl OutputGrammar {
    /// llguidance's form of it.
    pub fn top_level(&self) -> llguidance::api::TopLevelGrammar {
        use llguidance::api::TopLevelGrammar;
        match &self.kind {
            GrammarKind::JsonSchema(s) => TopLevelGrammar::from_json_schema(json_layout(s.clone())),
            GrammarKind::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarKind::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// `schema` with the JSON layout the output is held to, unless the schema
/// sets its own (llguidance's `x-guidance`): Python's `json.dumps` layout
/// (`", "` and `": "`), with no free whitespace. Free whitespace lets a
/// sampled model wander into endless blank lines inside a JSON value.
pub(crate) fn json_layout(schema: Value) -> Value {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        other => other,
    };
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// The structured-output fields of a request, before validation.
#[derive(Debug, Default)]
pub(crate) struct FormatFields {
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
}

fn set(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, "invalid_value", message)
}

/// A JSON schema given as an object, or as its JSON text.
fn schema_value(param: &str, v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| invalid(param, format!("Invalid value for `{param}`: not a JSON schema ({e})."))),
        _ => Err(invalid(param, format!("Invalid value for `{param}`: a JSON schema object is expected."))),
    }
}

/// One Lark string literal.
pub(crate) fn lark_literal(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

impl FormatFields {
    /// The one grammar these fields ask for (none for `text`); two ways of
    /// asking at once is an error naming the second.
    pub fn validate(self) -> Result<Option<OutputGrammar>, ApiError> {
        let mut found: Option<OutputGrammar> = None;
        let mut put = |g: OutputGrammar| -> Result<(), ApiError> {
            if let Some(first) = &found {
                return Err(invalid(
                    g.param,
                    format!(
                        "Invalid value for `{}`: `{}` already constrains the output; set only one.",
                        g.param, first.param
                    ),
                ));
            }
            found = Some(g);
            Ok(())
        };
        if let Some(rf) = set(&self.response_format) {
            if let Some(g) = response_format(rf)? {
                put(g)?;
            }
        }
        if let Some(v) = set(&self.guided_json) {
            put(OutputGrammar {
                param: "guided_json",
                kind: GrammarKind::JsonSchema(schema_value("guided_json", v)?),
            })?;
        }
        if let Some(v) = set(&self.json_schema) {
            put(OutputGrammar {
                param: "json_schema",
                kind: GrammarKind::JsonSchema(schema_value("json_schema", v)?),
            })?;
        }
        if let Some(v) = set(&self.guided_regex) {
            let Some(rx) = v.as_str() else {
                return Err(invalid("guided_regex", "Invalid value for `guided_regex`: a string is expected."));
            };
            put(OutputGrammar { param: "guided_regex", kind: GrammarKind::Regex(rx.to_string()) })?;
        }
        if let Some(v) = set(&self.guided_choice) {
            let choices: Option<Vec<&str>> = v.as_array().map(|a| a.iter().filter_map(Value::as_str).collect());
            let choices = match choices {
                Some(c) if !c.is_empty() && c.len() == v.as_array().map_or(0, Vec::len) => c,
                _ => {
                    return Err(invalid(
                        "guided_choice",
                        "Invalid value for `guided_choice`: a non-empty array of strings is expected.",
                    ))
                }
            };
            let alts: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
            put(OutputGrammar {
                param: "guided_choice",
                kind: GrammarKind::Lark(format!("start: {}", alts.join(" | "))),
            })?;
        }
        if let Some(v) = set(&self.guided_grammar) {
            let Some(g) = v.as_str() else {
                return Err(invalid("guided_grammar", "Invalid value for `guided_grammar`: a string is expected."));
            };
            put(OutputGrammar { param: "guided_grammar", kind: GrammarKind::Lark(g.to_string()) })?;
        }
        if set(&self.grammar).is_some() {
            return Err(ApiError::invalid(
                "grammar",
                "unsupported_parameter",
                "`grammar` (GBNF) is not supported by this server: send a Lark grammar in `guided_grammar`, \
                 a JSON schema in `response_format`, or a regular expression in `guided_regex`.",
            ));
        }
        Ok(found)
    }
}

/// OpenAI's `response_format`.
fn response_format(rf: &Value) -> Result<Option<OutputGrammar>, ApiError> {
    let Some(obj) = rf.as_object() else {
        return Err(invalid("response_format", "Invalid value for `response_format`: an object is expected."));
    };
    let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            "response_format.type",
            "missing_required_parameter",
            "Missing required parameter: `response_format.type`.",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputGrammar {
            param: "response_format",
            kind: GrammarKind::JsonSchema(json!({"type": "object"})),
        })),
        "json_schema" => {
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "missing_required_parameter",
                    "Missing required parameter: `response_format.json_schema`.",
                ));
            };
            // OpenAI requires a name; the schema itself may be left out
            // (then any JSON value).
            if js.get("name").and_then(Value::as_str).is_none_or(str::is_empty) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "missing_required_parameter",
                    "Missing required parameter: `response_format.json_schema.name`.",
                ));
            }
            let schema = match js.get("schema") {
                Some(s) => schema_value("response_format.json_schema.schema", s)?,
                None => json!({}),
            };
            Ok(Some(OutputGrammar { param: "response_format.json_schema.schema", kind: GrammarKind::JsonSchema(schema) }))
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "Invalid value for `response_format.type`: `{other}`; supported values are `text`, `json_object` and `json_schema`."
            ),
        )),
    }
}

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments object.
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tools of a request and how the model may use them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolsSpec {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call in one answer.
    pub parallel: bool,
}

impl ToolsSpec {
    /// Whether the answer may hold calls (and is parsed for them).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None && !self.tools.is_empty()
    }

    /// The tools as OpenAI's array (what chat templates are given).
    pub fn as_openai(&self) -> Value {
        Value::Array(
            self.tools
                .iter()
                .map(|t| {
                    let mut f = json!({"name": t.name, "parameters": t.parameters});
                    if let Some(d) = &t.description {
                        f["description"] = json!(d);
                    }
                    json!({"type": "function", "function": f})
                })
                .collect(),
        )
    }

    /// The tools that may be called under the choice.
    pub fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            ToolChoice::None => Vec::new(),
            _ => self.tools.iter().collect(),
        }
    }
}

fn valid_function_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`.
pub(crate) fn tools_spec(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolsSpec>, ApiError> {
    let tools = tools.filter(|v| !v.is_null());
    let choice = choice.filter(|v| !v.is_null());
    let mut list = Vec::new();
    if let Some(t) = tools {
        let Some(arr) = t.as_array() else {
            return Err(invalid("tools", "Invalid value for `tools`: an array is expected."));
        };
        for (i, item) in arr.iter().enumerate() {
            let kind = item.get("type").and_then(Value::as_str);
            if kind != Some("function") {
                let param = format!("tools[{i}].type");
                return Err(invalid(
                    &param,
                    format!("Invalid value for `{param}`: only `function` tools are supported."),
                ));
            }
            let Some(f) = item.get("function").and_then(Value::as_object) else {
                let param = format!("tools[{i}].function");
                return Err(ApiError::invalid(
                    &param,
                    "missing_required_parameter",
                    format!("Missing required parameter: `{param}`."),
                ));
            };
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if !valid_function_name(name) {
                let param = format!("tools[{i}].function.name");
                return Err(invalid(
                    &param,
                    format!("Invalid value for `{param}`: a name is 1 to 64 letters, digits, '_' or '-'."),
                ));
            }
            if list.iter().any(|t: &Tool| t.name == name) {
                let param = format!("tools[{i}].function.name");
                return Err(invalid(&param, format!("Invalid value for `{param}`: `{name}` is declared twice.")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => {
                    let param = format!("tools[{i}].function.parameters");
                    return Err(invalid(
                        &param,
                        format!("Invalid value for `{param}`: a JSON schema object is expected."),
                    ));
                }
            };
            let description = f.get("description").and_then(Value::as_str).map(str::to_string);
            list.push(Tool { name: name.to_string(), description, parameters });
        }
    }
    let choice = match choice {
        None => {
            if list.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!("Invalid value for `tool_choice`: `{other}`; supported values are `none`, `auto`, `required` or a named function."),
                ))
            }
        },
        Some(v @ Value::Object(_)) => {
            let name = v.pointer("/function/name").and_then(Value::as_str);
            match (v.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        "Invalid value for `tool_choice`: expected {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                    ))
                }
            }
        }
        Some(_) => return Err(invalid("tool_choice", "Invalid value for `tool_choice`: a string or an object is expected.")),
    };
    if choice != ToolChoice::None && list.is_empty() {
        return Err(invalid(
            "tool_choice",
            "Invalid value for `tool_choice`: it is only allowed when `tools` are specified.",
        ));
    }
    if let ToolChoice::Named(n) = &choice {
        if !list.iter().any(|t| &t.name == n) {
            return Err(invalid(
                "tool_choice.function.name",
                format!("Invalid value for `tool_choice.function.name`: no tool named `{n}` is in `tools`."),
            ));
        }
    }
    if list.is_empty() {
        return Ok(None);
    }
    Ok(Some(ToolsSpec { tools: list, choice, parallel: parallel.unwrap_or(true) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(e: &ApiError) -> Value {
        serde_json::to_value(e.body()).unwrap()["error"]["param"].clone()
    }

    fn grammar(f: FormatFields) -> Result<Option<OutputGrammar>, ApiError> {
        f.validate()
    }

    #[test]
    fn response_formats() {
        let text = FormatFields { response_format: Some(json!({"type": "text"})), ..Default::default() };
        assert_eq!(grammar(text).unwrap(), None);
        let obj = FormatFields { response_format: Some(json!({"type": "json_object"})), ..Default::default() };
        assert_eq!(grammar(obj).unwrap().unwrap().kind, GrammarKind::JsonSchema(json!({"type": "object"})));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let js = FormatFields {
            response_format: Some(
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
            ),
            ..Default::default()
        };
        let g = grammar(js).unwrap().unwrap();
        assert_eq!(g.kind, GrammarKind::JsonSchema(schema));
        assert_eq!(g.param, "response_format.json_schema.schema");
    }

    #[test]
    fn format_errors_name_the_field() {
        let e =
            grammar(FormatFields { response_format: Some(json!({"type": "yaml"})), ..Default::default() }).unwrap_err();
        assert_eq!(param_of(&e), "response_format.type");
        let e = grammar(FormatFields { response_format: Some(json!({"type": "json_schema"})), ..Default::default() })
            .unwrap_err();
        assert_eq!(param_of(&e), "response_format.json_schema");
        let e = grammar(FormatFields {
            response_format: Some(json!({"type": "json_object"})),
            guided_regex: Some(json!("a+")),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(param_of(&e), "guided_regex");
        let e = grammar(FormatFields { grammar: Some(json!("root ::= \"a\"")), ..Default::default() }).unwrap_err();
        assert_eq!(param_of(&e), "grammar");
        let e = grammar(FormatFields { guided_choice: Some(json!(["a", 1])), ..Default::default() }).unwrap_err();
        assert_eq!(param_of(&e), "guided_choice");
    }

    #[test]
    fn guided_fields() {
        let g = grammar(FormatFields { guided_choice: Some(json!(["yes", "no \"way\""])), ..Default::default() })
            .unwrap()
            .unwrap();
        assert_eq!(g.kind, GrammarKind::Lark(r#"start: "yes" | "no \"way\"""#.into()));
        let g = grammar(FormatFields { guided_json: Some(json!("{\"type\": \"string\"}")), ..Default::default() })
            .unwrap()
            .unwrap();
        assert_eq!(g.kind, GrammarKind::JsonSchema(json!({"type": "string"})));
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    }

    #[test]
    fn tools_and_choices() {
        let s = tools_spec(Some(&weather()), None, None).unwrap().unwrap();
        assert_eq!(s.choice, ToolChoice::Auto);
        assert!(s.parallel && s.active());
        let s = tools_spec(Some(&weather()), Some(&json!("none")), Some(false)).unwrap().unwrap();
        assert!(!s.active() && !s.parallel);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let s = tools_spec(Some(&weather()), Some(&named), None).unwrap().unwrap();
        assert_eq!(s.choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(s.as_openai()[0]["function"]["name"], "get_weather");
        assert_eq!(tools_spec(None, Some(&json!("none")), None).unwrap(), None);
    }

    #[test]
    fn tool_errors_name_the_field() {
        let param = |r: Result<Option<ToolsSpec>, ApiError>| param_of(&r.unwrap_err());
        assert_eq!(param(tools_spec(None, Some(&json!("required")), None)), "tool_choice");
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(param(tools_spec(Some(&weather()), Some(&other), None)), "tool_choice.function.name");
        let bad = json!([{"type": "retrieval"}]);
        assert_eq!(param(tools_spec(Some(&bad), None, None)), "tools[0].type");
        let bad = json!([{"type": "function", "function": {"name": "a b"}}]);
        assert_eq!(param(tools_spec(Some(&bad), None, None)), "tools[0].function.name");
        let bad = json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]);
        assert_eq!(param(tools_spec(Some(&bad), None, None)), "tools[0].function.parameters");
    }
}
