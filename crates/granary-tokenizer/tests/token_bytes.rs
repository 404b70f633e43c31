//! Token bytes (what constrained decoding matches a grammar on) agree with
//! the decoder on the default model's vocabulary.

use granary_tokenizer::testing::model_or_skip;
use granary_tokenizer::{TokenBytes, Tokenizer};

#[test]
fn token_bytes_concatenate_to_the_decoded_text() {
    let Some(path) = model_or_skip("token_bytes_concatenate_to_the_decoded_text") else { return };
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    let bytes = tok.token_bytes();
    assert_eq!(bytes.len(), tok.vocab_size());
    let texts = [
        "The capital of France is Paris.",
        "  leading spaces, tabs\tand\nnew lines\n\n",
        "Ünïcödé: 日本語のテキスト, emoji 🍹🔴, Ελληνικά.",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    ];
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        let mut joined = Vec::new();
        for &id in &ids {
            match &bytes[id as usize] {
                TokenBytes::Text(b) => joined.extend_from_slice(b),
                TokenBytes::Special(name) => panic!("plain text encoded to special token {name}"),
            }
        }
        assert_eq!(String::from_utf8(joined).unwrap(), tok.decode(&ids, false).unwrap(), "{text:?}");
    }
    // Control tokens are marked special, with their names.
    let eos = tok.eos_token_ids()[0];
    assert!(matches!(&bytes[eos as usize], TokenBytes::Special(n) if n.starts_with("<|")), "{:?}", bytes[eos as usize]);
}
