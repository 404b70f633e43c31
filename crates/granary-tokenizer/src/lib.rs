//! Tokenizers and chat templates shared by the engine and the gateway, so
//! both cut a prompt into the same tokens and therefore the same KV blocks.
//!
//! A [`Tokenizer`] comes either from a GGUF file's embedded vocabulary
//! ([`Tokenizer::from_gguf_path`], reproducing llama.cpp's tokenization) or
//! from a Hugging Face `tokenizer.json` and the config files beside it
//! ([`Tokenizer::from_file`]). Chat templates are rendered the way
//! transformers renders them, with ChatML when the model has none.

use std::path::Path;

use serde::{Deserialize, Serialize};

mod bytes;
mod gguf;
mod hf;
mod template;
pub mod testing;

pub use bytes::TokenBytes;
use template::{ChatTemplate, TemplateTokens};
pub use template::{TemplateKwargs, CHATML_TEMPLATE};

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
    /// An assistant turn's tool calls, as templates read them:
    /// `[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`
    /// with the arguments as an object (transformers' convention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None, name: None }
    }
}

/// How a chat is rendered beyond its messages and tools.
#[derive(Debug, Clone, Copy)]
pub struct ChatOptions<'a> {
    /// End with the opening of the assistant's turn (true by default).
    pub add_generation_prompt: bool,
    /// End inside the last message, so that generation continues it
    /// (vLLM's and transformers' `continue_final_message`).
    pub continue_final_message: bool,
    /// The request's own template variables (vLLM's `chat_template_kwargs`).
    pub kwargs: Option<&'a TemplateKwargs>,
}

impl Default for ChatOptions<'_> {
    fn default() -> Self {
        ChatOptions { add_generation_prompt: true, continue_final_message: false, kwargs: None }
    }
}

/// A special token: its id and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub id: u32,
    pub text: String,
}

/// The model's named special tokens (those it declares; any may be absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<SpecialToken>,
    pub eos: Option<SpecialToken>,
    pub unk: Option<SpecialToken>,
    pub pad: Option<SpecialToken>,
}

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    special: SpecialTokens,
    eos_ids: Vec<u32>,
    /// Prepend BOS / append EOS when encoding with `add_special` (unless the
    /// tokenizer's own post-processor already did).
    add_bos: bool,
    add_eos: bool,
    template: ChatTemplate,
    pre_tokenizer: Option<&'static str>,
    warnings: Vec<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("chat_template", &(!self.template.is_fallback()))
            .field("pre_tokenizer", &self.pre_tokenizer)
            .finish_non_exhaustive()
    }
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

impl Tokenizer {
    /// From a GGUF file's embedded `tokenizer.ggml.*` metadata.
    pub fn from_gguf_path(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| TokenizerError::Load(format!("{}: {e}", path.display())))?;
        let mut reader = std::io::BufReader::new(file);
        let content = candle_core::quantized::gguf_file::Content::read(&mut reader)
            .map_err(|e| TokenizerError::Load(format!("{}: {e}", path.display())))?;
        Self::from_gguf(&content)
    }

    /// From an already-read GGUF header.
    pub fn from_gguf(content: &candle_core::quantized::gguf_file::Content) -> Result<Self> {
        let g = gguf::build(content)?;
        let text_of = |id: Option<u32>| {
            id.map(|id| SpecialToken {
                id,
                text: g.tokenizer.decode(&[id], false).unwrap_or_else(|_| g.tokens[id as usize].clone()),
            })
        };
        let special = SpecialTokens {
            bos: text_of(g.bos_id),
            eos: text_of(g.eos_id),
            unk: text_of(g.unk_id),
            pad: text_of(g.pad_id),
        };
        let tok = Tokenizer {
            vocab_size: g.vocab_size,
            special,
            eos_ids: g.eos_ids,
            add_bos: g.add_bos && g.bos_id.is_some(),
            add_eos: g.add_eos && g.eos_id.is_some(),
            template: ChatTemplate::new(g.chat_template),
            pre_tokenizer: Some(g.pre_family),
            warnings: g.warnings,
            inner: g.tokenizer,
        };
        Ok(tok.warn())
    }

    /// From a `tokenizer.json`, with `tokenizer_config.json` (chat template,
    /// bos/eos) when present in the same directory.
    pub fn from_file(tokenizer_json: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(tokenizer_json)
            .map_err(|e| TokenizerError::Load(format!("{}: {e}", tokenizer_json.display())))?;
        let dir = tokenizer_json.parent().unwrap_or_else(|| Path::new("."));
        let cfg = hf::read_config(dir)?;
        let mut warnings = cfg.warnings;

        let lookup = |text: &Option<String>, what: &str, warnings: &mut Vec<String>| {
            let text = text.as_ref()?;
            match inner.token_to_id(text) {
                Some(id) => Some(SpecialToken { id, text: text.clone() }),
                None => {
                    warnings.push(format!("tokenizer_config.json: {what} {text:?} is not in the vocabulary"));
                    None
                }
            }
        };
        let special = SpecialTokens {
            bos: lookup(&cfg.bos_token, "bos_token", &mut warnings),
            eos: lookup(&cfg.eos_token, "eos_token", &mut warnings),
            unk: lookup(&cfg.unk_token, "unk_token", &mut warnings),
            pad: lookup(&cfg.pad_token, "pad_token", &mut warnings),
        };

        let mut eos_ids = Vec::new();
        if let Some(eos) = &special.eos {
            push_unique(&mut eos_ids, eos.id);
        }
        for id in cfg.generation_eos_ids {
            push_unique(&mut eos_ids, id);
        }
        let added = inner.get_added_tokens_decoder();
        let mut end_of_turn: Vec<u32> = added
            .iter()
            .filter(|(_, t)| t.special && gguf::END_OF_TURN_TOKENS.contains(&t.content.as_str()))
            .map(|(id, _)| *id)
            .collect();
        end_of_turn.sort_unstable();
        for id in end_of_turn {
            push_unique(&mut eos_ids, id);
        }

        let max_added = added.keys().max().map_or(0, |m| *m as usize + 1);
        let vocab_size = inner.get_vocab_size(false).max(max_added);
        let tok = Tokenizer {
            vocab_size,
            add_bos: cfg.add_bos_token.unwrap_or(false) && special.bos.is_some(),
            add_eos: cfg.add_eos_token.unwrap_or(false) && special.eos.is_some(),
            special,
            eos_ids,
            template: ChatTemplate::new(cfg.chat_template),
            pre_tokenizer: None,
            warnings,
            inner,
        };
        Ok(tok.warn())
    }

    /// From a Hugging Face model directory (its `tokenizer.json` and the
    /// config files beside it).
    pub fn from_pretrained_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Writes `tokenizer.json` and a `tokenizer_config.json` (chat template,
    /// bos/eos, BOS/EOS insertion) into `dir`, loadable with
    /// [`Tokenizer::from_pretrained_dir`].
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        let io = |e: std::io::Error| TokenizerError::Load(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        self.inner
            .save(dir.join("tokenizer.json"), false)
            .map_err(|e| TokenizerError::Load(format!("{}: {e}", dir.display())))?;
        let mut cfg = serde_json::Map::new();
        let tok = |t: &Option<SpecialToken>| t.as_ref().map_or(serde_json::Value::Null, |t| t.text.clone().into());
        cfg.insert("bos_token".into(), tok(&self.special.bos));
        cfg.insert("eos_token".into(), tok(&self.special.eos));
        cfg.insert("unk_token".into(), tok(&self.special.unk));
        cfg.insert("pad_token".into(), tok(&self.special.pad));
        cfg.insert("add_bos_token".into(), self.add_bos.into());
        cfg.insert("add_eos_token".into(), self.add_eos.into());
        if let Some(t) = self.chat_template() {
            cfg.insert("chat_template".into(), t.into());
        }
        let text = serde_json::to_string_pretty(&serde_json::Value::Object(cfg))
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        std::fs::write(dir.join("tokenizer_config.json"), text).map_err(io)?;
        let eos: Vec<u32> = self.eos_ids.clone();
        let gen = serde_json::json!({ "eos_token_id": eos });
        std::fs::write(dir.join("generation_config.json"), gen.to_string()).map_err(io)
    }

    fn warn(self) -> Self {
        for w in &self.warnings {
            tracing::warn!(target: "granary_tokenizer", "{w}");
        }
        self
    }

    /// Token ids of `text`. Special-token texts in it (`<|im_start|>`) map
    /// to their ids. `add_special` adds BOS (and EOS) when the model asks
    /// for it.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, add_special).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special {
            if let (true, Some(bos)) = (self.add_bos, &self.special.bos) {
                if ids.first() != Some(&bos.id) {
                    ids.insert(0, bos.id);
                }
            }
            if let (true, Some(eos)) = (self.add_eos, &self.special.eos) {
                if ids.last() != Some(&eos.id) {
                    ids.push(eos.id);
                }
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Tokens that end generation (EOS and the template's end-of-turn).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos.as_ref().map(|t| t.id)
    }

    /// Whether `encode(_, true)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Number of token ids (one more than the largest id).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The vocabulary entry of `id`, as stored (byte-level BPE pieces keep
    /// their byte-to-character mapping: `"Ġthe"` for `" the"`).
    pub fn token_to_piece(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of the vocabulary entry `piece` (a special token's text, or a
    /// piece as [`Tokenizer::token_to_piece`] returns it).
    pub fn id_of(&self, piece: &str) -> Option<u32> {
        self.inner.token_to_id(piece)
    }

    /// The model's chat template; `None` when it has none and ChatML is used.
    pub fn chat_template(&self) -> Option<&str> {
        (!self.template.is_fallback()).then(|| self.template.source())
    }

    /// The llama.cpp pre-tokenizer family used for a GGUF vocabulary
    /// (`"smollm"`, `"llama3"`, `"default"`...); `None` for tokenizer.json.
    pub fn pre_tokenizer(&self) -> Option<&'static str> {
        self.pre_tokenizer
    }

    /// What loading found questionable (unknown pre-tokenizer, dropped
    /// merges...); also logged as warnings.
    pub fn load_warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The prompt text for `messages` under the model's chat template
    /// (ChatML when the model has none).
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// Like [`Tokenizer::apply_chat_template`], with `tools` (OpenAI's
    /// array of `{"type": "function", "function": {...}}`) given to the
    /// template as transformers gives them.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat(messages, tools, add_generation_prompt, None)
    }

    /// Like [`Tokenizer::apply_chat_template_with_tools`], rendered as
    /// `opts` asks: with or without the assistant turn's opening, ending
    /// inside the last message to continue it, with the request's own
    /// template variables.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        opts: &ChatOptions<'_>,
    ) -> Result<String> {
        if !opts.continue_final_message {
            return self.render_chat(messages, tools, opts.add_generation_prompt, opts.kwargs);
        }
        let last = messages.last().ok_or_else(|| TokenizerError::Template("there is no message to continue".into()))?;
        let text = self.render_chat(messages, tools, false, opts.kwargs)?;
        // Cut after the last message's content, as transformers does: where
        // it last occurs whole, else trimmed (templates that trim messages).
        for content in [last.content.as_str(), last.content.trim()] {
            if content.is_empty() {
                break;
            }
            if let Some(at) = text.rfind(content) {
                return Ok(text[..at + content.len()].to_string());
            }
        }
        Err(TokenizerError::Template(
            "the last message cannot be continued: its content is empty or not found in the rendered chat".into(),
        ))
    }

    fn render_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: Option<&TemplateKwargs>,
    ) -> Result<String> {
        fn text(t: &Option<SpecialToken>) -> Option<&str> {
            t.as_ref().map(|t| t.text.as_str())
        }
        self.template.render(
            messages,
            tools,
            add_generation_prompt,
            TemplateTokens {
                bos: text(&self.special.bos),
                eos: text(&self.special.eos),
                unk: text(&self.special.unk),
                pad: text(&self.special.pad),
            },
            kwargs,
        )
    }

    /// The token ids of `messages` rendered with the chat template, encoded
    /// the way transformers' `apply_chat_template(tokenize=True)` does:
    /// without adding special tokens, since the template writes BOS itself
    /// where the model wants one (so a template that starts with
    /// `{{ bos_token }}` never yields two).
    pub fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::encode_chat`] with `tools` given to the template.
    pub fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let opts = ChatOptions { add_generation_prompt, ..ChatOptions::default() };
        self.encode_chat_with(messages, tools, &opts)
    }

    /// [`Tokenizer::encode_chat_with_tools`] rendered as `opts` asks (see
    /// [`Tokenizer::apply_chat_template_with`]).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        opts: &ChatOptions<'_>,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template_with(messages, tools, opts)?;
        self.encode(&text, false)
    }

    /// Whether the model's chat template renders `tools` itself (otherwise
    /// a caller describes them in a system message).
    pub fn template_renders_tools(&self) -> bool {
        !self.template.is_fallback() && self.template.source().contains("tools")
    }

    /// Incremental detokenizer for streaming: push ids, get the newly
    /// completed text (never splits a UTF-8 character).
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream { tok: self, skip_special, ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }
}

/// Streaming detokenizer. Each push decodes a short window of recent ids
/// (so tokenizers whose decoding depends on neighbours, such as a leading
/// space, stay right) and returns the text beyond what was already
/// returned, holding it back while it ends in an incomplete character.
/// The pushed outputs followed by [`DecodeStream::finish`] concatenate to
/// `decode(all ids)`.
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// Ids before this one have had their text returned.
    read_offset: usize,
}

impl DecodeStream<'_> {
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = self.tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = self.tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() <= prefix.len() || full.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let Some(new) = full.get(prefix.len()..).filter(|_| full.starts_with(&prefix)) else {
            // The window's text changed before the returned part: keep
            // accumulating until it settles.
            return Ok(None);
        };
        let new = new.to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Only the last window matters from here on.
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        Ok(Some(new))
    }

    /// The text held back at the end of the stream (an incomplete character
    /// decodes as U+FFFD, as `decode` does).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let prefix = self.tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = self.tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).filter(|rest| !rest.is_empty() && full.starts_with(&prefix)).map(str::to_owned))
    }
}
