//! Validation of request bodies: fields read, defaults, and errors that
//! name the field.

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
    assert_eq!(v.input, Input::Chat(vec![ChatMessage::new("user", "hi")]));
    assert_eq!(v.max_tokens, None);
    assert_eq!(v.sampling, SamplingRequest::default());
    let d = SamplingDefaults::default();
    assert_eq!(v.sampling.resolve(&d).temperature, d.temperature, "left-out fields take the defaults");
    assert!(v.text.stop.is_empty());
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
        "user": "someone", "tools": [], "metadata": {"team": "a"},
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
    assert_eq!(v.text.stop, ["\n\n"]);
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
    assert_eq!(chat_with(json!({"n": 2, "stream": true})).unwrap().n, 2);
    assert_field_error(chat_with(json!({"n": 0})), "n", "got 0");
    assert_field_error(chat_with(json!({"top_logprobs": 3})), "top_logprobs", "must be true");
    assert_field_error(chat_with(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs", "between 0 and 20");
    assert_field_error(chat_with(json!({"frequency_penalty": 3})), "frequency_penalty", "between -2 and 2");
    // Known fields that cannot be honoured are refused by name, never ignored.
    assert_field_error(chat_with(json!({"functions": [{"name": "f"}]})), "functions", "tools");
    assert_field_error(chat_with(json!({"grammar": "root ::= \"a\""})), "grammar", "GBNF");
    assert_field_error(chat_with(json!({"modalities": ["audio"]})), "modalities", "not supported");
    // Tools and structured outputs are read.
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let v = chat_with(json!({"tools": tool, "tool_choice": "required"})).unwrap();
    assert_eq!(v.tools.unwrap().choice, crate::api::structured::ToolChoice::Required);
    assert_field_error(chat_with(json!({"tool_choice": "required"})), "tool_choice", "only allowed when `tools`");
    let v = chat_with(json!({"response_format": {"type": "json_object"}})).unwrap();
    assert_eq!(v.grammar.unwrap().param, "response_format");
    assert_field_error(
        chat_with(json!({"tools": tool, "response_format": {"type": "json_object"}})),
        "response_format",
        "cannot be combined with tools",
    );
    assert!(
        chat_with(json!({"tools": tool, "tool_choice": "none", "response_format": {"type": "json_object"}})).is_ok()
    );
    // Earlier calls and their results are messages too.
    let v = chat_with(json!({"messages": [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    ]}))
    .unwrap();
    let Input::Chat(m) = v.input else { panic!() };
    assert_eq!(m[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"], json!({"a": 2, "b": 3}));
    assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
    assert_field_error(
        chat_with(
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
        ),
        "messages[0].tool_calls[0].function.arguments",
        "not JSON",
    );
    assert_field_error(
        chat_with(json!({"messages": [{"role": "tool", "content": "5"}]})),
        "messages[0].tool_call_id",
        "Missing",
    );
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
    assert_eq!(chat_with(json!({"stop": ["a", "", "bc"]})).unwrap().text.stop, ["a", "bc"]);
    assert_eq!(chat_with(json!({"stop": []})).unwrap().text.stop, Vec::<String>::new());
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

    // Batches: the first prompt as the input, the others after it.
    let batch = |p: Value| completion(json!({"model": "m", "prompt": p})).map(|v| (v.input, v.batch));
    assert_eq!(
        batch(json!(["a", "b", "c"])).unwrap(),
        (Input::Text("a".into()), vec![Input::Text("b".into()), Input::Text("c".into())])
    );
    assert_eq!(batch(json!([[1], [2, 3]])).unwrap(), (Input::Tokens(vec![1]), vec![Input::Tokens(vec![2, 3])]));
    assert_eq!(batch(json!("a")).unwrap().1, Vec::<Input>::new());
    let many: Vec<String> = (0..65).map(|i| i.to_string()).collect();
    assert_field_error(prompt(json!(many)), "prompt", "at most 64 prompts");
    assert_field_error(prompt(json!([[1], []])), "prompt", "empty");
    assert_field_error(
        completion(json!({"model": "m", "prompt": ["a", "b"], "stream": true})),
        "stream",
        "batched prompts",
    );
    assert_field_error(prompt(json!([1, "a"])), "prompt", "not a mix");
    assert_field_error(prompt(json!(["a", [1]])), "prompt", "not a mix");
    assert_field_error(prompt(json!([])), "prompt", "an array of strings");
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
    assert_eq!(v.text.stop, ["\n"]);
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
    assert!(with(json!({"echo": true, "logprobs": 1})).is_ok());
    assert_field_error(with(json!({"echo": true, "logprobs": 1, "stream": true})), "echo", "not supported");
    assert_eq!(with(json!({"echo": true, "max_tokens": 0})).unwrap().max_tokens.unwrap().value, 0);
    assert_field_error(with(json!({"max_tokens": 0})), "max_tokens", "at least 1");
    assert_field_error(with(json!({"echo": true, "max_tokens": 0, "stream": true})), "max_tokens", "stream");
    assert_eq!(with(json!({"best_of": 3, "n": 2})).unwrap().best_of, 3);
    assert_field_error(with(json!({"best_of": 1, "n": 2})), "best_of", "at least `n`");
    assert_field_error(with(json!({"best_of": 9})), "best_of", "between 1 and 8");
    assert_field_error(with(json!({"best_of": 2, "stream": true})), "best_of", "stream");
    assert_field_error(with(json!({"suffix": "tail"})), "suffix", "not supported");
    assert_field_error(with(json!({"n": 30})), "n", "between 1 and 8");
    assert_field_error(with(json!({"temperature": 5})), "temperature", "between 0 and 2");
    assert_field_error(with(json!({"max_tokens": 0})), "max_tokens", "at least 1");
    assert_field_error(with(json!({"echo": true, "max_tokens": 0, "stream": true})), "max_tokens", "stream");
}

#[test]
fn priority_is_read_as_vllm_has_it() {
    assert_eq!(chat_with(json!({})).unwrap().priority, 0);
    assert_eq!(chat_with(json!({"priority": -3})).unwrap().priority, -3);
    let v = completion(json!({"model": "m", "prompt": "x", "priority": 7})).unwrap();
    assert_eq!(v.priority, 7);
    assert_field_error(chat_with(json!({"priority": 1u64 << 40})), "priority", "between");
    assert_field_error(chat_with(json!({"priority": "high"})), "priority", "invalid type");
}

#[test]
fn a_field_this_server_does_not_know_is_refused_by_name() {
    let e = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "some_future_field": {"x": 1}}))
        .unwrap_err();
    assert_eq!((e.param.as_deref(), e.code), (Some("some_future_field"), Some("unknown_parameter")));
    let e = completion(json!({"model": "m", "prompt": "a", "spaces_between_special_tokens": false})).unwrap_err();
    assert_eq!((e.param.as_deref(), e.code), (Some("spaces_between_special_tokens"), Some("unknown_parameter")));
    // vLLM's `ignore_eos` is known, on both endpoints.
    assert!(completion(json!({"model": "m", "prompt": "a", "ignore_eos": true})).unwrap().ignore_eos);
    assert!(!completion(json!({"model": "m", "prompt": "a", "ignore_eos": false})).unwrap().ignore_eos);
    assert!(
        chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "ignore_eos": true}))
            .unwrap()
            .ignore_eos
    );
    let e = completion(json!({"model": "m", "prompt": "a", "ignore_eos": "yes"})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("ignore_eos"));
}

#[test]
fn an_earlier_answers_message_goes_back_as_it_came_and_unknown_message_fields_are_refused() {
    // The shape of `choices[0].message` in an OpenAI answer, sent back.
    let echoed = json!({"role": "assistant", "content": "Paris.", "refusal": null, "annotations": [],
                        "audio": null, "function_call": null, "tool_calls": null});
    let v = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}, echoed]})).unwrap();
    let Input::Chat(msgs) = &v.input else { panic!() };
    assert_eq!((msgs[1].role.as_str(), msgs[1].content.as_str()), ("assistant", "Paris."));

    // A refusal with no content is the turn's text.
    let refused = json!({"role": "assistant", "content": null, "refusal": "I can't help with that."});
    let v = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}, refused]})).unwrap();
    let Input::Chat(msgs) = &v.input else { panic!() };
    assert_eq!(msgs[1].content, "I can't help with that.");

    for (field, value, code) in [
        ("reasoning_content", json!("thinking"), "unknown_parameter"),
        ("audio", json!({"id": "audio_1"}), "unsupported_parameter"),
        ("function_call", json!({"name": "f", "arguments": "{}"}), "unsupported_parameter"),
    ] {
        let mut m = json!({"role": "assistant", "content": "x"});
        m[field] = value;
        let e = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}, m]})).unwrap_err();
        let param = format!("messages[1].{field}");
        assert_eq!((e.param.as_deref(), e.code), (Some(param.as_str()), Some(code)), "{}", e.message);
    }
}

/// vLLM's stopping and text fields, on both endpoints: what they set, and
/// the values refused by name.
#[test]
fn vllm_stopping_fields_are_read_and_checked() {
    let v = completion(json!({
        "model": "m", "prompt": "a", "max_tokens": 10, "min_tokens": 4, "stop": ["."],
        "stop_token_ids": [7, 9], "include_stop_str_in_output": true, "skip_special_tokens": false
    }))
    .unwrap();
    assert_eq!(v.text, TextRules { stop: vec![".".into()], include_stop: true, min_tokens: 4, keep_special: true });
    assert_eq!(v.stop_token_ids, [7, 9]);
    let v = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "min_tokens": 2})).unwrap();
    assert_eq!(v.text, TextRules { min_tokens: 2, ..TextRules::default() });
    assert!(v.stop_token_ids.is_empty());

    // More than max_tokens (or max_completion_tokens) can never be generated.
    let e = completion(json!({"model": "m", "prompt": "a", "max_tokens": 3, "min_tokens": 4})).unwrap_err();
    assert_eq!((e.param.as_deref(), e.code), (Some("min_tokens"), Some("invalid_value")));
    assert!(e.message.contains("max_tokens"), "{}", e.message);
    let e = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 1, "min_tokens": 2}))
        .unwrap_err();
    assert!(e.message.contains("max_completion_tokens"), "{}", e.message);
    // A grammar decides where a structured answer ends.
    let e = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "min_tokens": 2,
        "response_format": {"type": "json_object"}}))
    .unwrap_err();
    assert_eq!((e.param.as_deref(), e.code), (Some("min_tokens"), Some("unsupported_parameter")));
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let e = chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "min_tokens": 2,
        "tools": tools, "tool_choice": "required"}))
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("min_tokens"));
    assert!(chat(
        json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "min_tokens": 2, "tools": tools})
    )
    .is_ok());
    // Types are checked while parsing, naming the field.
    for bad in [
        json!({"stop_token_ids": [-1]}),
        json!({"stop_token_ids": 5}),
        json!({"min_tokens": -1}),
        json!({"include_stop_str_in_output": "yes"}),
        json!({"skip_special_tokens": 1}),
    ] {
        let field = bad.as_object().unwrap().keys().next().unwrap().clone();
        let mut body = json!({"model": "m", "prompt": "a"});
        body.as_object_mut().unwrap().extend(bad.as_object().unwrap().clone());
        let e = completion(body).unwrap_err();
        // The field, or the element of it (`stop_token_ids[0]`).
        assert!(e.param.as_deref().is_some_and(|p| p.starts_with(field.as_str())), "{field}: {e:?}");
    }
}
