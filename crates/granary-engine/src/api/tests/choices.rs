//! Choices beyond one answer to one prompt: `echo`, `n`, batched prompts,
//! and the prompt's scores (`echo` with `logprobs`).

use super::*;

#[tokio::test]
async fn echo_puts_the_prompt_before_the_answer() {
    let Some((_, app)) = scripted() else { return };
    let req = json!({"model": MODEL, "prompt": "Say hi:", "echo": true, "max_tokens": 50});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["text"], format!("Say hi:{REPLY}"));
    // Streamed: the prompt comes first, then the answer.
    let req = json!({"model": MODEL, "prompt": "Say hi:", "echo": true, "max_tokens": 50, "stream": true});
    let (status, headers, bytes) = send(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_payloads(&headers, &bytes);
    assert_eq!(chunks[0]["choices"][0]["text"], "Say hi:");
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(text, format!("Say hi:{REPLY}"));
    // Without echo, the answer alone.
    let req = json!({"model": MODEL, "prompt": "Say hi:", "max_tokens": 50});
    let (_, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(body["choices"][0]["text"], REPLY);
}

#[tokio::test]
async fn n_choices_in_one_body() {
    let Some((backend, app)) = scripted() else { return };
    let (status, body) =
        send_json(&app, post("/v1/chat/completions", chat_body(json!({"n": 3, "seed": 40, "temperature": 1})))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], REPLY);
    }
    let reqs: Vec<GenerateRequest> = backend.submitted.lock().iter().rev().take(3).cloned().collect();
    let mut seeds: Vec<Option<u64>> = reqs.iter().map(|r| r.sampling.seed).collect();
    seeds.sort();
    assert_eq!(seeds, [Some(40), Some(41), Some(42)], "each choice samples with its own seed");
    let n = backend.reply.len();
    assert_eq!(body["usage"]["completion_tokens"], 3 * n);
    assert_eq!(body["usage"]["prompt_tokens"], reqs[0].prompt.len(), "the prompt is counted once");
    // Completions too.
    let req = json!({"model": MODEL, "prompt": "a", "n": 2, "max_tokens": 4});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    // Streamed: every choice's chunks carry its index, each ends with its
    // finish reason, and usage counts all of them.
    let body = chat_body(json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}}));
    let (status, headers, bytes) = send(&app, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = sse_payloads(&headers, &bytes);
    for i in 0..2 {
        let mine: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["index"] == i).collect();
        let text: String = mine.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, REPLY, "choice {i}");
        assert_eq!(mine.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).count(), 1, "choice {i}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 2 * n);
}

#[tokio::test]
async fn batched_prompts_answer_each_prompt_in_order() {
    let Some((backend, app)) = scripted() else { return };
    let prompts = ["First:", "Second one:", "Third, longer prompt:"];
    let req = json!({"model": MODEL, "prompt": prompts, "echo": true, "n": 2, "max_tokens": 50});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        // Echo shows which prompt each choice answers: prompt i / n.
        assert_eq!(c["text"], format!("{}{REPLY}", prompts[i / 2]), "choice {i}");
    }
    let submitted: Vec<GenerateRequest> = backend.submitted.lock().clone();
    assert_eq!(submitted.len(), 6);
    let prompt_tokens: usize = prompts.iter().map(|p| backend.models[0].tokenizer.encode(p, true).unwrap().len()).sum();
    assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens, "every prompt counted once");
    assert_eq!(body["usage"]["completion_tokens"], 6 * backend.reply.len());
    // Token-id prompts batch the same way.
    let req = json!({"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 4});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    // One prompt too long refuses the whole request, naming the prompt.
    let long = "word ".repeat(CONTEXT);
    let req = json!({"model": MODEL, "prompt": ["short", long], "max_tokens": 4});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("prompt"));
}

#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt_then_the_answer() {
    let Some((backend, app)) = scripted() else { return };
    let prompt = "Say hi:";
    let ids = backend.models[0].tokenizer.encode(prompt, true).unwrap();
    assert!(ids.len() >= 2, "{ids:?}");
    // max_tokens 0: the prompt alone, scored, nothing generated.
    let req = json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 0});
    let submitted = backend.submitted.lock().len();
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(backend.submitted.lock().len(), submitted, "nothing generated");
    let c = &body["choices"][0];
    assert_eq!(c["text"], prompt);
    assert_eq!(c["finish_reason"], "length");
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len());
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    for i in 1..ids.len() {
        assert_eq!(lp["token_logprobs"][i], -(i as f64), "{lp}");
        assert_eq!(lp["top_logprobs"][i].as_object().unwrap().len(), 1, "{lp}");
    }
    assert_eq!(body["usage"]["completion_tokens"], 0);
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    // With a completion: the prompt's entries, then the answer's, offsets
    // running on from the prompt's text.
    let req = json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 2, "max_tokens": 50});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let c = &body["choices"][0];
    assert_eq!(c["text"], format!("{prompt}{REPLY}"));
    let lp = &c["logprobs"];
    let n = backend.reply.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len() + n);
    assert_eq!(lp["text_offset"][ids.len()], prompt.len());
    assert_eq!(lp["token_logprobs"][ids.len()], -(std::f64::consts::LN_2 as f32) as f64);
    assert_eq!(lp["top_logprobs"][1].as_object().unwrap().len(), 2);
    // n choices each carry the prompt's scores.
    let req = json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 0, "max_tokens": 3, "n": 2});
    let (_, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    for c in body["choices"].as_array().unwrap() {
        assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), ids.len() + 3, "{c}");
    }
    // Not streamed; and max_tokens 0 only with echo.
    let req = json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 1, "stream": true});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("echo"));
    let req = json!({"model": MODEL, "prompt": prompt, "max_tokens": 0});
    let (status, body) = send_json(&app, post("/v1/completions", req.to_string())).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("max_tokens"));
}

/// Prompt-scoring passes (and embeddings, through the same gate) run one
/// at a time however many requests ask at once, and every request is
/// answered.
#[tokio::test]
async fn passes_beside_the_step_loop_run_one_at_a_time() {
    let Some(tok) = tokenizer() else { return };
    let mut b = ScriptedBackend::with_tokenizer(tok);
    b.side_pass_time = std::time::Duration::from_millis(40);
    let backend = Arc::new(b);
    let app = make_app(&backend, ApiOptions::default());
    let req = json!({"model": MODEL, "prompt": "one two three", "echo": true, "logprobs": 1, "max_tokens": 0});
    let answers =
        futures::future::join_all((0..6).map(|_| send_json(&app, post("/v1/completions", req.to_string())))).await;
    for (status, body) in answers {
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body["choices"][0]["logprobs"]["token_logprobs"].is_array(), "{body}");
    }
    assert_eq!(backend.side_passes_most.load(std::sync::atomic::Ordering::SeqCst), 1);
}
