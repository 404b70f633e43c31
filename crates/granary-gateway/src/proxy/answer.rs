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
    pub(super) usage: Option<Lenient<Usage>>,
    #[serde(default)]
    pub(super) error: Option<Value>,
}

/// An answer's token counts, read without building a JSON tree. A count
/// that is not a non-negative integer reads as 0, as a missing one does.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    #[serde(default)]
    pub(crate) prompt_tokens: Count,
    #[serde(default)]
    pub(crate) completion_tokens: Count,
    #[serde(default)]
    pub(crate) prompt_tokens_details: Lenient<Details>,
}

/// `usage.prompt_tokens_details`: the prompt tokens served from a cache.
#[derive(Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Details {
    #[serde(default)]
    pub(crate) cached_tokens: Count,
}

/// A token count: the value when it is a non-negative integer, else 0.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Count(pub(crate) u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Count, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_u64<E>(self, n: u64) -> Result<Count, E> {
                Ok(Count(n))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_str<E>(self, _: &str) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_unit<E>(self) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_none<E>(self) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Count, D::Error> {
                Count::deserialize(d)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Count, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Count(0))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Count, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Count(0))
            }
        }
        d.deserialize_any(V)
    }
}

/// An object read as `T`; any other JSON value reads as `None` (a `usage`
/// that is not an object is no usage).
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lenient<T>(pub(crate) Option<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Lenient<T>, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
            type Value = Lenient<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, a: A) -> Result<Lenient<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(a)).map(|t| Lenient(Some(t)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Lenient<T>, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Lenient(None))
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Lenient<T>, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_none<E>(self) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
            fn visit_unit<E>(self) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Lenient<T>, E> {
                Ok(Lenient(None))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl Usage {
    /// (prompt, completion, cached) tokens.
    pub(crate) fn counts(&self) -> (u64, u64, u64) {
        let cached = self.prompt_tokens_details.0.map_or(0, |d| d.cached_tokens.0);
        (self.prompt_tokens.0, self.completion_tokens.0, cached)
    }
}

/// Reads an answer: a success from its tail when usage is there, else
/// whole (an error answer is read whole for its error code). `None` when
/// the answer is not a JSON object (read whole to tell).
pub(super) fn read_answer(buf: &[u8], success: bool) -> Option<AnswerHead> {
    if let Some(usage) = usage_from_tail(buf).filter(|_| success) {
        return Some(AnswerHead { usage: Some(Lenient(Some(usage))), error: None });
    }
    match serde_json::from_slice(buf) {
        Ok(head) => Some(head),
        // Valid JSON the typed reading refuses (a member twice): an
        // object still, read without its usage.
        Err(_) => match serde_json::from_slice::<Value>(buf) {
            Ok(Value::Object(o)) => Some(AnswerHead { usage: None, error: o.get("error").cloned() }),
            _ => None,
        },
    }
}

/// The `usage` object of a JSON object `buf` when it is among the object's
/// members in the last [`TAIL`] bytes; `None` when it cannot be told so
/// from the tail.
pub(super) fn usage_from_tail(buf: &[u8]) -> Option<Usage> {
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
fn member_at(buf: &[u8], at: usize) -> Option<Usage> {
    let mut i = skip_ws(buf, at);
    if buf.get(i) != Some(&b':') {
        return None;
    }
    let (Lenient(usage), next) = value_at::<Lenient<Usage>>(buf, i + 1)?;
    let usage = usage?;
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
        usage_from_tail(s.as_bytes()).map(as_json)
    }

    /// The counts as the JSON object they came from (the members read).
    fn as_json(u: Usage) -> Value {
        let (p, c, cached) = u.counts();
        json!({"prompt_tokens": p, "completion_tokens": c, "prompt_tokens_details": {"cached_tokens": cached}})
    }

    fn counts(p: u64, c: u64, cached: u64) -> Value {
        as_json(Usage {
            prompt_tokens: Count(p),
            completion_tokens: Count(c),
            prompt_tokens_details: Lenient(Some(Details { cached_tokens: Count(cached) })),
        })
    }

    fn whole(buf: &[u8], success: bool) -> Option<Value> {
        read_answer(buf, success).unwrap().usage.and_then(|l| l.0).map(as_json)
    }

    #[test]
    fn usage_is_read_from_the_end_of_real_answer_shapes() {
        let u = json!({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}});
        // Last member (vLLM, llama.cpp, this project's engine).
        let a = json!({"id": "x", "choices": [{"message": {"content": "hi"}}], "usage": u}).to_string();
        assert!(a.ends_with("}}"));
        assert_eq!(tail(&a), Some(u.clone()));
        // Followed by other members (OpenAI: service_tier, system_fingerprint), pretty-printed.
        let b = format!(
            "{{\n  \"id\": \"x\",\n  \"usage\" : {u} ,\n  \"service_tier\": \"default\",\n  \"system_fingerprint\": null,\n  \"n\": [1, {{\"a\": 2}}]\n}}\n"
        );
        assert_eq!(tail(&b), Some(u.clone()));
        assert_eq!(whole(b.as_bytes(), true), Some(u));
    }

    #[test]
    fn a_usage_that_is_not_a_top_level_member_is_not_taken() {
        // In a string (escaped quotes).
        let s = r#"{"choices": [{"text": "\"usage\": {\"prompt_tokens\": 9}"}]}"#;
        assert_eq!(tail(s), None);
        assert_eq!(whole(s.as_bytes(), true), None);
        // Nested in another object: the object closing after it is not the last.
        let n = r#"{"choices": [{"usage": {"prompt_tokens": 9}}], "x": 1}"#;
        assert_eq!(tail(n), None);
        let m = r#"{"meta": {"usage": {"prompt_tokens": 9}}}"#;
        assert_eq!(tail(m), None);
        // A nested one after the real one: the real one is found.
        let both = r#"{"usage": {"prompt_tokens": 3}, "meta": {"usage": {"prompt_tokens": 9}}}"#;
        assert_eq!(tail(both), Some(counts(3, 0, 0)));
        // A string ending in a backslash right before the key.
        let bs = r#"{"a": "x\\", "usage": {"prompt_tokens": 4}}"#;
        assert_eq!(tail(bs), Some(counts(4, 0, 0)));
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
        assert_eq!(whole(a.as_bytes(), true), Some(counts(2, 0, 0)));
        // Not JSON at all: no answer.
        assert!(read_answer(b"<html>oops</html>", true).is_none());
        assert!(read_answer(br#"{"usage": {"prompt_tokens": 2}"#, true).is_none());
        // An error answer is read whole, for its error.
        let e = br#"{"error": {"code": "x"}, "usage": {"prompt_tokens": 2}}"#;
        assert_eq!(read_answer(e, false).unwrap().error, Some(json!({"code": "x"})));
        assert_eq!(read_answer(e, true).unwrap().error, None);
    }

    #[test]
    fn counts_that_are_not_integers_read_as_zero() {
        let a = r#"{"id": "x", "usage": {"prompt_tokens": "5", "completion_tokens": 2.5, "prompt_tokens_details": null, "total_tokens": [1]}}"#;
        assert_eq!(tail(a), Some(counts(0, 0, 0)));
        let b = r#"{"usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0}}}"#;
        assert_eq!(tail(b), Some(counts(7, 3, 4)));
        assert_eq!(whole(b.as_bytes(), true), Some(counts(7, 3, 4)));
        // A usage that is not an object is no usage; a member twice is
        // still an object (read whole, without usage).
        assert_eq!(whole(br#"{"choices": [], "usage": [1, 2]}"#, true), None);
        let twice = br#"{"usage": {"prompt_tokens": 1, "prompt_tokens": 2}, "error": {"code": "y"}}"#;
        let head = read_answer(twice, false).unwrap();
        assert_eq!(head.error, Some(json!({"code": "y"})));
    }
}
