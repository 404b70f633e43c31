//! Fields that take more than one JSON shape: a completions `prompt`
//! (text, token ids, or an array of either: a batch), `stop` (a string or
//! an array) and `seed` (signed or not).

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// A completions prompt: one (a one-element array reduced to it), or a
/// batch of several, each answered as its own choices.
#[derive(Debug, PartialEq)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// Two or more prompts, each `Text` or `Tokens`.
    Batch(Vec<Prompt>),
}

/// Most prompts one completions request may batch.
pub(crate) const MAX_BATCH: usize = 64;

/// One element of an array `prompt`.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s.to_owned()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::invalid_value(de::Unexpected::Signed(v), &"a token id (0 or more)")),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str =
            "a string, an array of token ids, an array of strings or an array of arrays of token ids";
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    items.push(item);
                }
                if items.is_empty() {
                    return Err(de::Error::invalid_length(0, &EXPECTED));
                }
                if items.iter().all(|i| matches!(i, PromptItem::Token(_))) {
                    let ids =
                        items.into_iter().filter_map(|i| if let PromptItem::Token(t) = i { Some(t) } else { None });
                    return Ok(Prompt::Tokens(ids.collect()));
                }
                if items.len() == 1 {
                    match items.pop() {
                        Some(PromptItem::Text(s)) => return Ok(Prompt::Text(s)),
                        Some(PromptItem::Tokens(ids)) => return Ok(Prompt::Tokens(ids)),
                        _ => {}
                    }
                }
                if items.iter().all(|i| matches!(i, PromptItem::Text(_)))
                    || items.iter().all(|i| matches!(i, PromptItem::Tokens(_)))
                {
                    if items.len() > MAX_BATCH {
                        return Err(de::Error::custom(format!(
                            "at most {MAX_BATCH} prompts may be batched in one request, got {}",
                            items.len()
                        )));
                    }
                    let one = |i: PromptItem| match i {
                        PromptItem::Text(s) => Prompt::Text(s),
                        PromptItem::Tokens(ids) => Prompt::Tokens(ids),
                        PromptItem::Token(t) => Prompt::Tokens(vec![t]),
                    };
                    return Ok(Prompt::Batch(items.into_iter().map(one).collect()));
                }
                Err(de::Error::custom(format!("expected {EXPECTED}, not a mix of them")))
            }
        }
        d.deserialize_any(V)
    }
}

/// `stop`: one string or an array of strings.
#[derive(Debug, PartialEq)]
pub(crate) struct Stop(pub Vec<String>);

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Stop;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Stop, E> {
                Ok(Stop(vec![s.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stop, A::Error> {
                let mut all = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    all.push(s);
                }
                Ok(Stop(all))
            }
        }
        d.deserialize_any(V)
    }
}

/// `seed`: any JSON integer that fits 64 bits; negative ones are taken
/// as their two's-complement bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Seed(pub u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                Ok(Seed(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}
