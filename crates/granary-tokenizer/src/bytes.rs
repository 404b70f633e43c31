//! What each token adds to the output, in bytes: the view a constrained
//! decoder needs (a grammar is matched on bytes, token by token).

use std::collections::HashMap;

use crate::Tokenizer;

/// One vocabulary entry as output bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    /// The bytes the token appends to the text.
    Text(Vec<u8>),
    /// A special token (BOS, end of turn, tool-call markers declared
    /// special...): it is control, not text. Carries its name.
    Special(String),
}

/// GPT-2's byte-level alphabet: the character each byte is written as in
/// byte-level BPE vocabularies (printable Latin-1 as itself, the other bytes
/// shifted past U+0100).
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for b in 0..=255u8 {
        if printable(b) {
            map.insert(b as char, b);
        } else {
            map.insert(char::from_u32(next).expect("below the surrogates"), b);
            next += 1;
        }
    }
    map
}

/// `<0x0A>`-style byte tokens of SentencePiece vocabularies.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Every token id's output bytes, indexed by id (`vocab_size` entries).
    /// Byte-level BPE pieces are mapped back to bytes; SentencePiece
    /// pieces have `▁` as a space and `<0xNN>` as one byte. An id with no
    /// vocabulary entry is an empty text.
    pub fn token_bytes(&self) -> Vec<TokenBytes> {
        let byte_level = self
            .inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|json| json.contains("\"ByteLevel\""));
        let chars = byte_level.then(byte_level_chars);
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return if t.special {
                        TokenBytes::Special(t.content.clone())
                    } else {
                        TokenBytes::Text(t.content.clone().into_bytes())
                    };
                }
                let Some(piece) = self.inner.id_to_token(id) else { return TokenBytes::Text(Vec::new()) };
                if let Some(map) = &chars {
                    // A piece outside the alphabet is kept as its UTF-8.
                    let mut out = Vec::with_capacity(piece.len());
                    for c in piece.chars() {
                        match map.get(&c) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(c.to_string().as_bytes()),
                        }
                    }
                    return TokenBytes::Text(out);
                }
                if let Some(b) = byte_fallback(&piece) {
                    return TokenBytes::Text(vec![b]);
                }
                TokenBytes::Text(piece.replace('\u{2581}', " ").into_bytes())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_alphabet_is_a_bijection() {
        let map = byte_level_chars();
        assert_eq!(map.len(), 256);
        let mut bytes: Vec<u8> = map.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
        assert_eq!(map[&'\u{120}'], b' ', "Ġ is a space");
        assert_eq!(map[&'\u{10A}'], b'\n', "Ċ is a newline");
        assert_eq!(map[&'a'], b'a');
    }

    #[test]
    fn byte_fallback_pieces() {
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0xFF>"), Some(0xFF));
        assert_eq!(byte_fallback("<0x0>"), None);
        assert_eq!(byte_fallback("<s>"), None);
    }
}
