//! vLLM's stopping and text fields through the router: `stop_token_ids`,
//! `min_tokens`, `include_stop_str_in_output` and `skip_special_tokens`.

use super::*;

/// The completion text of a non-streamed answer, and the request the
/// backend was given.
async fn complete(backend: &ScriptedBackend, app: &Router, extra: Value) -> (String, GenerateRequest) {
    let mut req = json!({"model": MODEL, "prompt": "a", "max_tokens": 30});
    req.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (status, body) = send_json(app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    (body["choices"][0]["text"].as_str().unwrap().to_string(), backend.last_request())
}

/// The text of a streamed completion.
async fn stream_text(app: &Router, extra: Value) -> String {
    let mut req = json!({"model": MODEL, "prompt": "a", "max_tokens": 30, "stream": true});
    req.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (status, headers, body) = send(app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_payloads(&headers, &body);
    chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect()
}

#[tokio::test]
async fn include_stop_str_in_output_keeps_the_stop_string() {
    let Some((backend, app)) = scripted() else { return };
    // REPLY is "Hello there! Nice to meet you. Bye."
    let (text, _) = complete(&backend, &app, json!({"stop": ["Nice"]})).await;
    assert_eq!(text, "Hello there! ");
    let (text, _) = complete(&backend, &app, json!({"stop": ["Nice"], "include_stop_str_in_output": true})).await;
    assert_eq!(text, "Hello there! Nice");
    let text = stream_text(&app, json!({"stop": ["Nice"], "include_stop_str_in_output": true})).await;
    assert_eq!(text, "Hello there! Nice");
}

#[tokio::test]
async fn min_tokens_holds_stop_strings_and_reaches_the_engine() {
    let Some((backend, app)) = scripted() else { return };
    let tok = tokenizer().unwrap();
    // The tokens up to and including the "!".
    let upto_bang = (1..=backend.reply.len())
        .find(|&n| tok.decode(&backend.reply[..n], true).unwrap().contains('!'))
        .expect("REPLY has a '!'");
    let (text, _) = complete(&backend, &app, json!({"stop": ["!", "."]})).await;
    assert_eq!(text, "Hello there");
    // Armed at the "!" itself: it stops there.
    let (text, sent) = complete(&backend, &app, json!({"stop": ["!", "."], "min_tokens": upto_bang})).await;
    assert_eq!(text, "Hello there");
    assert_eq!(sent.min_tokens, upto_bang);
    // One token later: the "!" is text, the "." stops.
    let extra = json!({"stop": ["!", "."], "min_tokens": upto_bang + 1});
    let (text, sent) = complete(&backend, &app, extra.clone()).await;
    assert_eq!(text, "Hello there! Nice to meet you");
    assert_eq!(sent.min_tokens, upto_bang + 1);
    assert_eq!(sent.stop_token_ids, tok.eos_token_ids(), "min_tokens keeps the model's stop tokens");
    assert_eq!(stream_text(&app, extra).await, "Hello there! Nice to meet you");
    // Past every stop string's place: the whole reply.
    let (text, _) = complete(&backend, &app, json!({"stop": ["!", "."], "min_tokens": 30})).await;
    assert_eq!(text, REPLY);

    let req = json!({"model": MODEL, "prompt": "a", "max_tokens": 3, "min_tokens": 5});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("min_tokens"));
}

#[tokio::test]
async fn stop_token_ids_join_the_models_own() {
    let Some((backend, app)) = scripted() else { return };
    let tok = tokenizer().unwrap();
    let eos = tok.eos_token_ids().to_vec();
    assert!(!eos.is_empty());
    let (_, sent) = complete(&backend, &app, json!({"stop_token_ids": [7, 9, eos[0]]})).await;
    let mut want: Vec<u32> = eos.clone();
    want.extend([7, 9]);
    assert_eq!(sent.stop_token_ids, want, "each once, the model's first");
    // `ignore_eos` drops the model's own, not the ones asked for.
    let (_, sent) = complete(&backend, &app, json!({"stop_token_ids": [7, 9], "ignore_eos": true})).await;
    assert_eq!(sent.stop_token_ids, [7, 9]);
    let vocab = tok.vocab_size();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let req = if path == "/v1/completions" {
            json!({"model": MODEL, "prompt": "a", "stop_token_ids": [vocab]}).to_string()
        } else {
            chat_body(json!({"stop_token_ids": [1, vocab + 5]}))
        };
        let (status, body) = send_json(&app, post(path, req)).await;
        let e = assert_error(status, &body, StatusCode::BAD_REQUEST, Some("stop_token_ids"));
        assert!(e["message"].as_str().unwrap().contains("outside the vocabulary"), "{e}");
    }
}

#[tokio::test]
async fn skip_special_tokens_false_writes_special_tokens_out() {
    let tok = match tokenizer() {
        Some(t) => t,
        None => return,
    };
    let special = "<|im_start|>";
    let id = tok.id_of(special).expect("SmolLM2 has <|im_start|>");
    let mut b = ScriptedBackend::with_tokenizer(tok);
    b.reply.insert(0, id);
    let backend = Arc::new(b);
    let app = make_app(&backend, ApiOptions::default());
    let (text, _) = complete(&backend, &app, json!({})).await;
    assert_eq!(text, REPLY, "special tokens are skipped by default");
    let (text, _) = complete(&backend, &app, json!({"skip_special_tokens": false})).await;
    assert_eq!(text, format!("{special}{REPLY}"));
    let text = stream_text(&app, json!({"skip_special_tokens": false})).await;
    assert_eq!(text, format!("{special}{REPLY}"));
    let (status, body) = send_json(
        &app,
        post("/v1/chat/completions", chat_body(json!({"skip_special_tokens": false, "max_tokens": 30}))),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], format!("{special}{REPLY}"));
}

#[tokio::test]
async fn ignore_eos_lets_generation_run_past_the_end_of_sequence() {
    let Some((backend, app)) = scripted() else { return };
    for (ignore, want_stops) in [(false, true), (true, false)] {
        let req = json!({"model": MODEL, "prompt": "a", "max_tokens": 4, "ignore_eos": ignore, "best_of": 1});
        let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let sent = backend.submitted.lock().last().cloned().unwrap();
        assert_eq!(!sent.stop_token_ids.is_empty(), want_stops, "ignore_eos {ignore}: {:?}", sent.stop_token_ids);
    }
}
