//! Tokenizers and chat templates shared by the engine and the gateway, so
//! both cut a prompt into the same tokens and therefore the same KV blocks.

use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{0}")]
    Load(String),
    #[error("tokenize: {0}")]
    Encode(String),
    #[error("detokenize: {0}")]
    Decode(String),
    #[error("chat template: {0}")]
    Template(String),
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

/// One chat message as the OpenAI API carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    _private: (),
}

impl Tokenizer {
    /// From a GGUF file's embedded `tokenizer.ggml.*` metadata.
    pub fn from_gguf_path(_path: &Path) -> Result<Self> {
        todo!()
    }

    /// From an already-read GGUF header.
    pub fn from_gguf(_content: &candle_core::quantized::gguf_file::Content) -> Result<Self> {
        todo!()
    }

    /// From a `tokenizer.json`, with `tokenizer_config.json` (chat template,
    /// bos/eos) when present in the same directory.
    pub fn from_file(_tokenizer_json: &Path) -> Result<Self> {
        todo!()
    }

    /// Token ids of `text`. `add_special` adds BOS when the model asks for it.
    pub fn encode(&self, _text: &str, _add_special: bool) -> Result<Vec<u32>> {
        todo!()
    }

    pub fn decode(&self, _ids: &[u32], _skip_special: bool) -> Result<String> {
        todo!()
    }

    /// Tokens that end generation (EOS and the template's end-of-turn).
    pub fn eos_token_ids(&self) -> &[u32] {
        todo!()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        todo!()
    }

    pub fn vocab_size(&self) -> usize {
        todo!()
    }

    /// The prompt text for `messages` under the model's chat template
    /// (ChatML when the model has none).
    pub fn apply_chat_template(&self, _messages: &[ChatMessage], _add_generation_prompt: bool) -> Result<String> {
        todo!()
    }

    /// Incremental detokenizer for streaming: push ids, get the newly
    /// completed text (never splits a UTF-8 character).
    pub fn decode_stream(&self, _skip_special: bool) -> DecodeStream<'_> {
        todo!()
    }
}

pub struct DecodeStream<'a> {
    _tok: &'a Tokenizer,
}

impl DecodeStream<'_> {
    pub fn push(&mut self, _id: u32) -> Result<Option<String>> {
        todo!()
    }
}
