//! Constrained decoding: at each step a grammar (a JSON schema, a regular
//! expression or a Lark grammar, compiled by `llguidance`) says which
//! tokens may come next, and the sampler only sees those.
//!
//! [`Grammars`] holds one model's token trie (built once, from the
//! tokenizer's token bytes) and compiles grammars against it; a
//! [`Constraint`] is one sequence's matcher. The trie is built from
//! [`Tokenizer::token_bytes`] rather than by a second `tokenizers`
//! instance, so the grammar sees exactly the vocabulary the engine decodes.

use std::fmt;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use granary_tokenizer::{TokenBytes, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

/// The tokenizer as llguidance sees it.
struct Env {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.tokenizer.encode(s, false).unwrap_or_default())
    }
}

/// Grammar compiler of one model.
pub struct Grammars {
    factory: ParserFactory,
}

impl fmt::Debug for Grammars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammars").field("vocab_size", &self.factory.tok_env().tok_trie().vocab_size()).finish()
    }
}

impl Grammars {
    /// Builds the token trie of `tokenizer` (tens to hundreds of
    /// milliseconds for large vocabularies: call it off the async threads,
    /// once per model).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self> {
        let words: Vec<Vec<u8>> = tokenizer
            .token_bytes()
            .into_iter()
            .map(|t| match t {
                TokenBytes::Text(b) => b,
                TokenBytes::Special(name) => {
                    let mut b = Vec::with_capacity(name.len() + 1);
                    b.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    b.extend_from_slice(name.as_bytes());
                    b
                }
            })
            .collect();
        let eos = tokenizer.eos_token_ids().to_vec();
        let first = *eos.first().ok_or_else(|| anyhow!("the tokenizer declares no end-of-sequence token"))?;
        let info = TokRxInfo::new(words.len() as u32, first);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        let env: TokEnv = Arc::new(Env { tokenizer, trie });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh matcher for `grammar`; a grammar that does not compile
    /// (unsupported schema keyword, bad regex...) is an error with
    /// llguidance's message.
    pub fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint> {
        let parser = self.factory.create_parser(grammar)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(anyhow!(e));
        }
        Ok(Constraint { matcher })
    }

    /// The id of the special token named `name` (`<tool_call>`,
    /// `[TOOL_CALLS]`...), when the vocabulary has one.
    pub fn special_token(&self, name: &str) -> Option<u32> {
        self.factory.tok_env().tok_trie().get_special_token(name)
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Clone for Constraint {
    /// An independent matcher in the same state (for `n` choices).
    fn clone(&self) -> Self {
        Constraint { matcher: self.matcher.deep_clone() }
    }
}

impl Constraint {
    /// Sets the logits of every token the grammar forbids next to -inf
    /// (ids past the tokenizer's vocabulary included).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.allowed(logits.len())?;
        let mut any = false;
        for (l, &ok) in logits.iter_mut().zip(&allowed) {
            if ok == 1 {
                any |= *l != f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err(anyhow!("the grammar allows no token here"));
        }
        Ok(())
    }

    /// The tokens the grammar allows next, as one byte per id of a `vocab`
    /// long row (1 allowed, 0 forbidden; ids past the tokenizer's
    /// vocabulary forbidden). An error when it allows none.
    pub fn allowed(&mut self, vocab: usize) -> Result<Vec<u8>> {
        let vob = self.matcher.compute_mask_or_eos()?;
        let n = vob.len().min(vocab);
        let mut out = vec![0u8; vocab];
        let mut any = false;
        for (id, o) in out[..n].iter_mut().enumerate() {
            if vob.is_allowed(id as u32) {
                *o = 1;
                any = true;
            }
        }
        if !any {
            return Err(anyhow!("the grammar allows no token here"));
        }
        Ok(out)
    }

    /// Advances past `token` (one the last mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token)
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
