//! The GGUF tokenizer against llama.cpp's outputs on the same model file
//! (crates/granary-engine/tests/fixtures/llama_cpp_smollm2.json, written by
//! scripts/reference/llama_cpp_reference.py).

use std::path::{Path, PathBuf};

use granary_tokenizer::testing::model_or_skip;
use granary_tokenizer::{ChatMessage, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    model_file: String,
    tokenize: Vec<TokenizeCase>,
    chat: Vec<ChatCase>,
    generate: Vec<GenerateCase>,
}

#[derive(Deserialize)]
struct TokenizeCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: String,
}

#[derive(Deserialize)]
struct GenerateCase {
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    greedy_text: String,
}

fn fixture() -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../granary-engine/tests/fixtures/llama_cpp_smollm2.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn gguf_tokenizer(test: &str) -> Option<(Tokenizer, PathBuf)> {
    let path = model_or_skip(test)?;
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    Some((tok, path))
}

#[test]
fn gguf_special_tokens_and_pre_tokenizer() {
    let Some((tok, path)) = gguf_tokenizer("gguf_special_tokens_and_pre_tokenizer") else {
        return;
    };
    assert_eq!(path.file_name().unwrap().to_str().unwrap(), fixture().model_file);
    assert_eq!(tok.pre_tokenizer(), Some("smollm"));
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_token_id(), Some(1));
    assert!(!tok.adds_bos(), "SmolLM2 sets add_bos_token = false");
    let special = tok.special_tokens();
    assert_eq!(special.bos.as_ref().unwrap().text, "<|im_start|>");
    assert_eq!(special.eos.as_ref().unwrap().text, "<|im_end|>");
    assert_eq!(tok.eos_token_ids()[0], 2, "EOS first");
    assert!(tok.eos_token_ids().contains(&0), "<|endoftext|> ends generation too");
    assert_eq!(tok.id_of("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_piece(2).as_deref(), Some("<|im_end|>"));
    assert!(tok.load_warnings().is_empty(), "{:?}", tok.load_warnings());
    assert!(tok.chat_template().is_some());
    assert_eq!(tok.encode("Hi", true).unwrap(), tok.encode("Hi", false).unwrap());
}

#[test]
fn gguf_tokenize_matches_llama_cpp() {
    let Some((tok, _)) = gguf_tokenizer("gguf_tokenize_matches_llama_cpp") else {
        return;
    };
    let fx = fixture();
    assert!(fx.tokenize.len() >= 20);
    let mut failures = Vec::new();
    for case in &fx.tokenize {
        let ids = tok.encode(&case.text, false).unwrap();
        if ids != case.ids {
            failures.push(format!("{:?}\n  llama.cpp: {:?}\n  granary:   {:?}", case.text, case.ids, ids));
        }
    }
    assert!(failures.is_empty(), "{} cases differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn gguf_prompt_ids_and_greedy_text_match_llama_cpp() {
    let Some((tok, _)) = gguf_tokenizer("gguf_prompt_ids_and_greedy_text_match_llama_cpp") else {
        return;
    };
    let fx = fixture();
    let france = &fx.generate[0];
    assert_eq!(france.prompt, "The capital of France is");
    assert_eq!(france.prompt_ids, [504, 3575, 282, 4649, 314]);
    for case in &fx.generate {
        assert_eq!(tok.encode(&case.prompt, false).unwrap(), case.prompt_ids, "{:?}", case.prompt);
        // llama.cpp detokenized with control tokens rendered.
        assert_eq!(tok.decode(&case.greedy_ids, false).unwrap(), case.greedy_text);
    }
}

#[test]
fn gguf_chat_template_matches_jinja2() {
    let Some((tok, _)) = gguf_tokenizer("gguf_chat_template_matches_jinja2") else {
        return;
    };
    let fx = fixture();
    for case in &fx.chat {
        let text = tok.apply_chat_template(&case.messages, case.add_generation_prompt).unwrap();
        assert_eq!(text, case.text, "{:?}", case.messages);
    }
    // The chat prompt of the generate cases is the rendered template too.
    let last = fx.generate.last().unwrap();
    let rendered =
        tok.apply_chat_template(&[ChatMessage::new("user", "What is 2 + 2? Answer briefly.")], true).unwrap();
    assert_eq!(rendered, last.prompt);
}

#[test]
fn decode_inverts_encode() {
    let Some((tok, _)) = gguf_tokenizer("decode_inverts_encode") else {
        return;
    };
    for case in &fixture().tokenize {
        let ids = tok.encode(&case.text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), case.text);
        // llama.cpp's ids decode to the text as well.
        assert_eq!(tok.decode(&case.ids, false).unwrap(), case.text);
    }
    // Skipping special tokens drops the control tokens only.
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi\n");
}

fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (String, Vec<String>) {
    let mut s = tok.decode_stream(skip_special);
    let mut pieces = Vec::new();
    for &id in ids {
        if let Some(p) = s.push(id).unwrap() {
            pieces.push(p);
        }
    }
    if let Some(p) = s.finish().unwrap() {
        pieces.push(p);
    }
    (pieces.concat(), pieces)
}

#[test]
fn decode_stream_equals_decode() {
    let Some((tok, _)) = gguf_tokenizer("decode_stream_equals_decode") else {
        return;
    };
    let emoji = "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done";
    let ids = tok.encode(emoji, false).unwrap();
    // Some emoji are cut across tokens: the stream must hold their bytes back.
    let pieces: Vec<String> = ids.iter().map(|&id| tok.decode(&[id], false).unwrap()).collect();
    assert!(pieces.iter().any(|p| p.contains(char::REPLACEMENT_CHARACTER)));
    let (text, streamed) = stream(&tok, &ids, false);
    assert_eq!(text, emoji);
    assert!(streamed.iter().all(|p| !p.contains(char::REPLACEMENT_CHARACTER)), "{streamed:?}");

    for case in &fixture().tokenize {
        for skip in [false, true] {
            let (text, _) = stream(&tok, &case.ids, skip);
            assert_eq!(text, tok.decode(&case.ids, skip).unwrap(), "{:?}", case.text);
        }
    }
    for case in &fixture().generate {
        let (text, _) = stream(&tok, &case.greedy_ids, true);
        assert_eq!(text, tok.decode(&case.greedy_ids, true).unwrap());
    }

    // A stream cut inside a character ends like decode: with U+FFFD.
    let bytes_of_emoji = tok.encode("😀", false).unwrap();
    assert!(bytes_of_emoji.len() > 1, "😀 is several byte tokens");
    let cut = &bytes_of_emoji[..bytes_of_emoji.len() - 1];
    let (text, _) = stream(&tok, cut, false);
    assert_eq!(text, tok.decode(cut, false).unwrap());
}

#[test]
fn tokenizer_json_from_gguf_loads_with_from_file() {
    let Some((tok, _)) = gguf_tokenizer("tokenizer_json_from_gguf_loads_with_from_file") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    tok.inner().save(dir.path().join("tokenizer.json"), false).unwrap();
    // The list form of chat_template and AddedToken-object special tokens.
    let config = serde_json::json!({
        "chat_template": [
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
            {"name": "default", "template": tok.chat_template().unwrap()},
        ],
        "bos_token": {"content": "<|im_start|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false},
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": 2}"#).unwrap();

    let loaded = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(loaded.vocab_size(), tok.vocab_size());
    assert_eq!(loaded.bos_token_id(), Some(1));
    assert_eq!(loaded.eos_token_ids(), tok.eos_token_ids());
    assert_eq!(loaded.chat_template(), tok.chat_template());
    let fx = fixture();
    for case in &fx.tokenize {
        assert_eq!(loaded.encode(&case.text, false).unwrap(), case.ids, "{:?}", case.text);
        assert_eq!(loaded.decode(&case.ids, false).unwrap(), case.text);
    }
    for case in &fx.chat {
        let text = loaded.apply_chat_template(&case.messages, case.add_generation_prompt).unwrap();
        assert_eq!(text, case.text);
    }
}

#[test]
fn save_pretrained_roundtrips() {
    let Some((tok, _)) = gguf_tokenizer("save_pretrained_roundtrips") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    tok.save_pretrained(dir.path()).unwrap();
    let loaded = Tokenizer::from_pretrained_dir(dir.path()).unwrap();
    assert_eq!(loaded.special_tokens(), tok.special_tokens());
    assert_eq!(loaded.eos_token_ids(), tok.eos_token_ids());
    assert_eq!(loaded.adds_bos(), tok.adds_bos());
    let fx = fixture();
    for case in &fx.tokenize {
        assert_eq!(loaded.encode(&case.text, true).unwrap(), tok.encode(&case.text, true).unwrap());
    }
    let msgs = &fx.chat[0].messages;
    assert_eq!(loaded.apply_chat_template(msgs, true).unwrap(), tok.apply_chat_template(msgs, true).unwrap());
}

#[test]
fn gguf_unknown_pre_tokenizer_warns_and_uses_default() {
    let Some(path) = model_or_skip("gguf_unknown_pre_tokenizer_warns_and_uses_default") else {
        return;
    };
    let mut reader = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let mut content = candle_core::quantized::gguf_file::Content::read(&mut reader).unwrap();
    use candle_core::quantized::gguf_file::Value;
    content.metadata.insert("tokenizer.ggml.pre".into(), Value::String("no-such-pre".into()));
    let tok = Tokenizer::from_gguf(&content).unwrap();
    assert_eq!(tok.pre_tokenizer(), Some("default"));
    assert!(tok.load_warnings().iter().any(|w| w.contains("no-such-pre")), "{:?}", tok.load_warnings());
    // llama.cpp's default splits punctuation runs and digit groups of three.
    let text = "Hello, world! 12345";
    assert_eq!(tok.decode(&tok.encode(text, false).unwrap(), false).unwrap(), text);

    content.metadata.insert("tokenizer.ggml.model".into(), Value::String("rwkv".into()));
    let err = Tokenizer::from_gguf(&content).unwrap_err().to_string();
    assert!(err.contains("unsupported") && err.contains("\"rwkv\"") && err.contains("--tokenizer"), "{err}");

    content.metadata.remove("tokenizer.chat_template");
    content.metadata.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    let tok = Tokenizer::from_gguf(&content).unwrap();
    assert_eq!(tok.chat_template(), None);
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("user", "Hi")], true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}
