//! Reading what metering and the audit need from a whole (non-streamed)
//! answer, without parsing all of it when that can be avoided.
//!
//! OpenAI-compatible servers write `usage` as one of an answer's last
//! members (OpenAI, vLLM, SGLang, llama.cpp, this project's engine). It is
//! read from the end: the last `"usage":` key in the answer's tail whose
//! object is followed only by top-level members and the closing brace. An
//! answer whose tail does not look so (usage early, no usage, an error, or
//! not JSON at all) is parsed whole, as before.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

/// How far from the end `usage` is looked for.
const TAIL: usize = 4096;

/// The members of a whole answer the gateway reads (any others are skipped).
#[derive(Deserialize, Default)]
pub(super) struct AnswerHead {
    #[serde(default)]
    pub(super) usage: Option<Value>,
    #[serde(default)]
    pub(super) error: Option<Value>,
}

/// Reads an answer: a success from its tail when usage is there, else
/// whole (an error answer is read whole for its error code). `None` when
/// the answer is not a JSON object (read whole to tell).
pub(super) fn read_answer(buf: &[u8], success: bool) -> Option<AnswerHead> {
    if let Some(usage) = usage_from_tail(buf).filter(|_| success) {
        return Some(AnswerHead { usage: Some(usage), error: None });
    }
    serde_json::from_slice(buf).ok()
}

/// The `usage` object of a JSON object `buf` when it is among the object's
/// members in the last [`TAIL`] bytes; `None` when it cannot be told so
/// from the tail.
pub(super) fn usage_from_tail(buf: &[u8]) -> Option<Value> {
    let first = buf.iter().position(|b| !b.is_ascii_whitespace())?;
    if buf[first] != b'{' {
        return None;
    }
    let from = buf.len().saturating_sub(TAIL).max(first + 1);
    let tail = &buf[from..];
    let mut end = tail.len();
    // The last candidate first: it is the top-level one when there is one.
    while let Some(at) = find_last(&tail[..end], b"\"usage\"") {
        end = at;
        let quote = from + at;
        if escaped(buf, quote) {
            continue;
        }
        if let Some(u) = member_at(buf, quote + b"\"usage\"".len()) {
            return Some(u);
        }
    }
    None
}

/// Whether the quote at `at` is escaped (an odd number of backslashes
/// before it), so inside a string.
fn escaped(buf: &[u8], at: usize) -> bool {
    buf[..at].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

fn skip_ws(buf: &[u8], mut i: usize) -> usize {
    while i < buf.len() && buf[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// One JSON value starting at `at` (after whitespace), and where it ends.
fn value_at<'a, T: Deserialize<'a>>(buf: &'a [u8], at: usize) -> Option<(T, usize)> {
    let mut values = serde_json::Deserializer::from_slice(&buf[at..]).into_iter::<T>();
    let v = values.next()?.ok()?;
    Some((v, at + values.byte_offset()))
}

/// After a `"usage"` key ending at `at`: its value when it is an object
/// followed by nothing but members of the same object and that object's
/// closing brace at the end of `buf`. The object closing at the end of the
/// answer is the top-level one, so the key is a top-level member.
fn member_at(buf: &[u8], at: usize) -> Option<Value> {
    let mut i = skip_ws(buf, at);
    if buf.get(i) != Some(&b':') {
        return None;
    }
    let (usage, next) = value_at::<Value>(buf, i + 1)?;
    if !usage.is_object() {
        return None;
    }
    i = skip_ws(buf, next);
    loop {
        match buf.get(i)? {
            b'}' => return (skip_ws(buf, i + 1) == buf.len()).then_some(usage),
            b',' => {
                let (key, next) = value_at::<&RawValue>(buf, i + 1)?;
                if !key.get().starts_with('"') {
                    return None;
                }
                i = skip_ws(buf, next);
                if buf.get(i) != Some(&b':') {
                    return None;
                }
                let (_, next) = value_at::<IgnoredAny>(buf, i + 1)?;
                i = skip_ws(buf, next);
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tail(s: &str) -> Option<Value> {
        usage_from_tail(s.as_bytes())
    }

    #[test]
    fn usage_is_read_from_the_end_of_real_answer_shapes() {
        let u = json!({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6});
        // Last member (vLLM, llama.cpp, this project's engine).
        let a = json!({"id": "x", "choices": [{"message": {"content": "hi"}}], "usage": u}).to_string();
        assert!(a.ends_with("}}"));
        assert_eq!(tail(&a), Some(u.clone()));
        // Followed by other members (OpenAI: service_tier, system_fingerprint), pretty-printed.
        let b = format!(
            "{{\n  \"id\": \"x\",\n  \"usage\" : {u} ,\n  \"service_tier\": \"default\",\n  \"system_fingerprint\": null,\n  \"n\": [1, {{\"a\": 2}}]\n}}\n"
        );
        assert_eq!(tail(&b), Some(u.clone()));
        assert_eq!(read_answer(b.as_bytes(), true).unwrap().usage, Some(u));
    }

    #[test]
    fn a_usage_that_is_not_a_top_level_member_is_not_taken() {
        // In a string (escaped quotes).
        let s = r#"{"choices": [{"text": "\"usage\": {\"prompt_tokens\": 9}"}]}"#;
        assert_eq!(tail(s), None);
        assert_eq!(read_answer(s.as_bytes(), true).unwrap().usage, None);
        // Nested in another object: the object closing after it is not the last.
        let n = r#"{"choices": [{"usage": {"prompt_tokens": 9}}], "x": 1}"#;
        assert_eq!(tail(n), None);
        let m = r#"{"meta": {"usage": {"prompt_tokens": 9}}}"#;
        assert_eq!(tail(m), None);
        // A nested one after the real one: the real one is found.
        let both = r#"{"usage": {"prompt_tokens": 3}, "meta": {"usage": {"prompt_tokens": 9}}}"#;
        assert_eq!(tail(both), Some(json!({"prompt_tokens": 3})));
        // A string ending in a backslash right before the key.
        let bs = r#"{"a": "x\\", "usage": {"prompt_tokens": 4}}"#;
        assert_eq!(tail(bs), Some(json!({"prompt_tokens": 4})));
        // Not an object, trailing bytes, an array answer, a broken tail.
        for bad in [
            r#"{"usage": 5}"#,
            r#"{"usage": {"prompt_tokens": 4}} x"#,
            r#"[{"usage": {"prompt_tokens": 4}}]"#,
            r#"{"usage": {"prompt_tokens": 4}, "x": }"#,
            r#"{"usage": {"prompt_tokens": 4}, 7: 1}"#,
        ] {
            assert_eq!(tail(bad), None, "{bad}");
        }
    }

    #[test]
    fn usage_far_from_the_end_falls_back_to_reading_the_whole_answer() {
        let long = "y".repeat(2 * TAIL);
        let a = format!(r#"{{"usage": {{"prompt_tokens": 2}}, "choices": [{{"text": "{long}"}}]}}"#);
        assert_eq!(tail(&a), None);
        assert_eq!(read_answer(a.as_bytes(), true).unwrap().usage, Some(json!({"prompt_tokens": 2})));
        // Not JSON at all: no answer.
        assert!(read_answer(b"<html>oops</html>", true).is_none());
        assert!(read_answer(br#"{"usage": {"prompt_tokens": 2}"#, true).is_none());
        // An error answer is read whole, for its error.
        let e = br#"{"error": {"code": "x"}, "usage": {"prompt_tokens": 2}}"#;
        assert_eq!(read_answer(e, false).unwrap().error, Some(json!({"code": "x"})));
        assert_eq!(read_answer(e, true).unwrap().error, None);
    }
}
