//! Chat templates and tokenizer.json loading on a small tokenizer built in
//! the test (no model file needed).

use std::path::Path;

use granary_tokenizer::{ChatMessage, ChatOptions, Tokenizer, TokenizerError};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::AddedToken;

/// A tokenizer.json with a four-letter vocabulary, ChatML's tokens and
/// `config` (if any) as tokenizer_config.json.
fn write_tokenizer(dir: &Path, config: Option<serde_json::Value>) {
    let vocab: Vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "\n", " ", "u", "s", "e", "r"]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, vec![("a".into(), "b".into())]).build().unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(|t| AddedToken::from(t, true))).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    if let Some(config) = config {
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

#[test]
fn chatml_fallback_without_template() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path(), None);
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(tok.chat_template(), None);
    let m = msgs(&[("system", "S"), ("user", "ab")]);
    assert_eq!(
        tok.apply_chat_template(&m, true).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        tok.apply_chat_template(&m, false).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
    );
    // Special tokens in text map to their ids; no BOS configured.
    assert_eq!(tok.encode("<|im_start|>ab<|im_end|>", true).unwrap(), [1, 5, 2]);
    assert_eq!(tok.bos_token_id(), None);
    // End-of-turn tokens end generation even without an eos_token.
    assert_eq!(tok.eos_token_ids(), [0, 2]);
}

#[test]
fn template_that_raises_gives_template_error() {
    let dir = tempfile::tempdir().unwrap();
    let template = "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}\
                    {{ raise_exception('Conversation roles must be user or assistant, not ' + m['role']) }}\
                    {% endif %}{{ m['content'] }}{% endfor %}";
    write_tokenizer(dir.path(), Some(serde_json::json!({ "chat_template": template })));
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(tok.apply_chat_template(&msgs(&[("user", "ok")]), true).unwrap(), "ok");
    match tok.apply_chat_template(&msgs(&[("tool", "x")]), true) {
        Err(TokenizerError::Template(msg)) => {
            assert!(msg.contains("Conversation roles must be user or assistant, not tool"), "{msg}")
        }
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn template_syntax_error_is_reported_on_use() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path(), Some(serde_json::json!({ "chat_template": "{% for m in messages %}" })));
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    assert!(matches!(tok.apply_chat_template(&msgs(&[("user", "x")]), true), Err(TokenizerError::Template(_))));
}

#[test]
fn hf_template_features() {
    let dir = tempfile::tempdir().unwrap();
    // trim_blocks/lstrip_blocks, bos_token, python string methods,
    // namespace, loop controls, tojson and `tools` being none.
    let template = "{{ bos_token }}\n\
        {% set ns = namespace(n=0) %}\n\
        {% for m in messages %}\n\
            {% if m.role == 'skip' %}{% continue %}{% endif %}\n\
            {% set ns.n = ns.n + 1 %}\n\
            [{{ m['role'] | upper }}] {{ m['content'].strip() }}{% if m.content.startswith(' ') %}*{% endif %}\n\
        {% endfor %}\n\
        {% if tools is not none %}tools!{% endif %}\n\
        {{ ns.n }} {{ messages[0] | tojson }}\n\
        {% if add_generation_prompt %}{{ eos_token }}{% endif %}";
    write_tokenizer(
        dir.path(),
        Some(serde_json::json!({
            "chat_template": template,
            "bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>", "special": true},
            "add_bos_token": true,
        })),
    );
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let out = tok.apply_chat_template(&msgs(&[("user", " hi "), ("skip", "no"), ("assistant", "yo")]), true).unwrap();
    assert_eq!(
        out,
        // What Python jinja2, configured as transformers does, renders.
        "<|im_start|>\n[USER] hi*[ASSISTANT] yo2 {\"role\": \"user\", \"content\": \" hi \"}\n<|im_end|>"
    );
    // add_bos_token prepends BOS once.
    assert_eq!(tok.encode("ab", true).unwrap(), [1, 5]);
    assert_eq!(tok.encode("<|im_start|>ab", true).unwrap(), [1, 5]);
    assert_eq!(tok.encode("ab", false).unwrap(), [5]);
    assert_eq!(tok.eos_token_ids()[0], 2);
}

#[test]
fn missing_tokenizer_json_is_a_load_error() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(Tokenizer::from_pretrained_dir(dir.path()), Err(TokenizerError::Load(_))));
}

#[test]
fn a_template_that_writes_bos_is_encoded_with_one_bos() {
    // A Llama-2-style tokenizer.json: its post-processor adds `<s>` to
    // every encoding made with special tokens, and its chat template
    // writes `{{ bos_token }}` too.
    let dir = tempfile::tempdir().unwrap();
    let vocab: Vocab = ["<s>", "</s>", "[INST]", "[/INST]", "a", "b", " "]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, vec![]).build().unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.add_special_tokens(["<s>", "</s>", "[INST]", "[/INST]"].map(|t| AddedToken::from(t, true))).unwrap();
    let post = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single("<s> $A")
        .unwrap()
        .special_tokens(vec![("<s>", 0)])
        .build()
        .unwrap();
    tok.with_post_processor(Some(post));
    tok.save(dir.path().join("tokenizer.json"), false).unwrap();
    let template = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]\
                    {% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}";
    let config =
        serde_json::json!({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let m = msgs(&[("user", "ab"), ("assistant", "b"), ("user", "a")]);
    assert_eq!(tok.apply_chat_template(&m, true).unwrap(), "<s>[INST]ab[/INST]b</s>[INST]a[/INST]");
    // <s> [INST] a b [/INST] b </s> [INST] a [/INST]: one BOS, as
    // transformers encodes it.
    assert_eq!(tok.encode_chat(&m, true).unwrap(), [0, 2, 4, 5, 3, 5, 1, 2, 4, 3]);
    // Plain text still gets the BOS the tokenizer adds.
    assert_eq!(tok.encode("ab", true).unwrap(), [0, 4, 5]);
}

/// `continue_final_message` ends the prompt inside the last message, as
/// transformers renders it (also for a template that trims contents), and
/// a message the rendered chat does not hold cannot be continued.
#[test]
fn the_final_message_can_be_continued() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path(), None);
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let cont = ChatOptions { add_generation_prompt: false, continue_final_message: true, kwargs: None };
    let m = msgs(&[("user", "ab"), ("assistant", "ba b")]);
    assert_eq!(
        tok.apply_chat_template_with(&m, None, &cont).unwrap(),
        "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nba b"
    );
    // Without it, the assistant's message is closed and none is opened.
    let closed = ChatOptions { add_generation_prompt: false, ..ChatOptions::default() };
    assert!(tok.apply_chat_template_with(&m, None, &closed).unwrap().ends_with("ba b<|im_end|>\n"));

    let trims = serde_json::json!({"chat_template":
        "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"});
    write_tokenizer(dir.path(), Some(trims));
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let m = msgs(&[("user", "ab"), ("assistant", " ba ")]);
    assert_eq!(tok.apply_chat_template_with(&m, None, &cont).unwrap(), "[user] ab\n[assistant] ba");
    let m = msgs(&[("user", "ab"), ("assistant", "")]);
    assert!(matches!(tok.apply_chat_template_with(&m, None, &cont), Err(TokenizerError::Template(_))));
}
