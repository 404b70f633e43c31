//! A completions request with several prompts (`"prompt": ["a", "b"]`, or
//! arrays of token ids), as OpenAI's API takes them: each prompt runs as a
//! request of its own, all at once, and the one answer holds their choices
//! in order (the first prompt's `n` choices, indexed from 0, then the next
//! prompt's), with usage summed over the prompts. A prompt that is refused
//! (too long, say) refuses the whole request and cancels the others.

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::answer;
use super::error::ApiError;
use super::request::Validated;
use super::response::Endpoint;
use super::AppState;

pub(crate) async fn generate_batch(st: &AppState, namespace: String, mut v: Validated) -> Result<Response, ApiError> {
    let rest = std::mem::take(&mut v.batch);
    let n = v.n;
    let mut each = Vec::with_capacity(rest.len() + 1);
    for input in rest {
        let mut one = v.clone();
        one.input = input;
        each.push(one);
    }
    each.insert(0, v);
    let runs = each.into_iter().map(|one| {
        let namespace = namespace.clone();
        async move {
            let answer = answer::generate(st, namespace, one, Endpoint::Completion).await?;
            let bytes =
                axum::body::to_bytes(answer.into_body(), usize::MAX).await.map_err(|e| ApiError::internal(&e))?;
            serde_json::from_slice::<Value>(&bytes).map_err(|e| ApiError::internal(&e))
        }
    });
    let answers = futures::future::try_join_all(runs).await?;
    Ok(Json(merge(answers, n)).into_response())
}

/// One answer of several prompts' answers: the first's id and header, all
/// their choices with prompt `k`'s choice `i` at `k * n + i`, usage summed.
fn merge(answers: Vec<Value>, n: usize) -> Value {
    let mut it = answers.into_iter();
    let Some(mut out) = it.next() else { return Value::Null };
    for (k, answer) in it.enumerate() {
        let k = k + 1;
        let mut choices = match answer.get("choices") {
            Some(Value::Array(c)) => c.clone(),
            _ => Vec::new(),
        };
        for c in &mut choices {
            let i = c["index"].as_u64().unwrap_or(0);
            c["index"] = Value::from(k as u64 * n as u64 + i);
        }
        if let Some(Value::Array(all)) = out.get_mut("choices") {
            all.extend(choices);
        }
        let u = &answer["usage"];
        let total = &mut out["usage"];
        for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            total[field] = Value::from(total[field].as_u64().unwrap_or(0) + u[field].as_u64().unwrap_or(0));
        }
        let cached = &mut total["prompt_tokens_details"]["cached_tokens"];
        *cached = Value::from(
            cached.as_u64().unwrap_or(0) + u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn choices_are_indexed_by_prompt_then_choice_and_usage_is_summed() {
        let answer = |texts: &[&str], prompt: u64, completion: u64, cached: u64| {
            let choices: Vec<Value> = texts.iter().enumerate().map(|(i, t)| json!({"index": i, "text": t})).collect();
            json!({"id": format!("cmpl-{prompt}"), "object": "text_completion", "choices": choices,
                   "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}})
        };
        let m = merge(
            vec![answer(&["a0", "a1"], 5, 4, 1), answer(&["b0", "b1"], 7, 6, 3), answer(&["c0", "c1"], 2, 2, 0)],
            2,
        );
        assert_eq!(m["id"], "cmpl-5");
        let got: Vec<(u64, &str)> = m["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
            .collect();
        assert_eq!(got, [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1"), (4, "c0"), (5, "c1")]);
        assert_eq!(
            m["usage"],
            json!({"prompt_tokens": 14, "completion_tokens": 12, "total_tokens": 26, "prompt_tokens_details": {"cached_tokens": 4}})
        );
    }
}
