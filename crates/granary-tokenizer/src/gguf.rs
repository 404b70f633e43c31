//! A `tokenizers::Tokenizer` built from a GGUF file's `tokenizer.ggml.*`
//! metadata, reproducing llama.cpp's tokenization of the same file.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) are
//! supported. llama.cpp cuts text with a list of regexes chosen by
//! `tokenizer.ggml.pre`, each applied to the pieces the previous one left
//! (matches and the text between them both kept); that is a sequence of
//! isolating `Split` pre-tokenizers here, followed by the byte-level mapping
//! without its own regex and without a prefix space.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::{Result, TokenizerError};

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// GPT-2's split regex (without the trailing `|\s+`, as llama.cpp writes
/// it: whitespace it leaves unmatched becomes a piece of its own anyway).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The regexes of the models' own tokenizer.json for these two (llama.cpp
/// rewrites them for std::regex, which lacks the letter subcategories; the
/// regex engine here has them).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's split regexes (its tokenizer.json's `Split` sequence):
/// letters of the Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and
/// other cased scripts with an optional leading space; ASCII and full-width
/// punctuation; CJK ideographs and Hangul.
const DEEPSEEK_LETTERS: &str = r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+";
const DEEPSEEK_PUNCT: &str = r"\s?[!-/:-~！-／：-～‘-‟　-。]+";
const DEEPSEEK_CJK: &str = r"[一-龥ࠀ-一가-퟿]+";
/// DeepSeek V3's: digits in threes, CJK and kana runs, then the rest.
const DEEPSEEK3_CJK: &str = r"[一-龥぀-ゟ゠-ヿ]+";
const DEEPSEEK3_REST: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// Tokens llama.cpp treats as end of generation when present, besides the
/// EOS/EOT/EOM ids the file names.
pub(crate) const END_OF_TURN_TOKENS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
];

/// How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreTokenizerSpec {
    /// The llama.cpp pre-tokenizer family this value maps to.
    pub family: &'static str,
    pub regexes: &'static [&'static str],
    /// Whole words found in the vocabulary skip the merges (llama3 style).
    pub ignore_merges: bool,
    /// BOS is added unless the file says otherwise.
    pub default_add_bos: bool,
}

/// The pre-tokenizer for `pre` (`None` when the key is absent); the
/// returned flag is false when the value is unknown and llama.cpp's
/// default was used.
pub(crate) fn pre_tokenizer_spec(pre: Option<&str>) -> (PreTokenizerSpec, bool) {
    const fn spec(
        family: &'static str,
        regexes: &'static [&'static str],
        ignore_merges: bool,
        default_add_bos: bool,
    ) -> PreTokenizerSpec {
        PreTokenizerSpec { family, regexes, ignore_merges, default_add_bos }
    }
    const DEFAULT: PreTokenizerSpec =
        spec("default", &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], false, false);
    let Some(pre) = pre else {
        return (DEFAULT, false);
    };
    let s = match pre {
        "default" => DEFAULT,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => {
            spec("llama3", &[LLAMA3], true, true)
        }
        "dbrx" | "smaug-bpe" => spec("llama3", &[LLAMA3], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            spec("smollm", &[r"\p{N}", GPT2], false, false)
        }
        "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "exaone4" | "jina-es" | "jina-de"
        | "jina-v2-es" | "jina-v2-de" | "gigachat" | "a.x-4.0" | "mellum" | "granite-docling" => {
            spec("gpt2", &[GPT2], false, false)
        }
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "stablelm2" | "megrez" | "hunyuan" => {
            spec("qwen2", &[QWEN2], false, false)
        }
        "falcon" => spec("falcon", &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"], false, false),
        "gpt-4o" | "llama4" | "minimax-m2" => spec("gpt-4o", &[GPT4O], false, false),
        "tekken" => spec("tekken", &[TEKKEN], true, true),
        "deepseek-llm" => spec(
            "deepseek-llm",
            &[r"[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCT, r"\s+$", DEEPSEEK_CJK, r"\p{N}+"],
            false,
            false,
        ),
        "deepseek-coder" => {
            spec("deepseek-coder", &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"], false, false)
        }
        "deepseek-v3" => spec("deepseek-v3", &[r"\p{N}{1,3}", DEEPSEEK3_CJK, DEEPSEEK3_REST], false, false),
        _ => return (DEFAULT, false),
    };
    (s, true)
}

/// Everything the GGUF header says about the tokenizer.
pub(crate) struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub vocab_size: usize,
    pub tokens: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub eos_ids: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub chat_template: Option<String>,
    pub pre_family: &'static str,
    pub warnings: Vec<String>,
}

fn load_err(msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Load(msg.into())
}

fn as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        Value::Bool(b) => i64::from(*b),
        _ => return None,
    })
}

struct Meta<'a>(&'a HashMap<String, Value>);

impl Meta<'_> {
    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(load_err(format!("gguf: {key} is not a string: {:?}", v.value_type()))),
        }
    }

    fn int(&self, key: &str) -> Result<Option<i64>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(v) => as_i64(v)
                .map(Some)
                .ok_or_else(|| load_err(format!("gguf: {key} is not an integer: {:?}", v.value_type()))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => as_i64(v)
                .map(|x| Some(x != 0))
                .ok_or_else(|| load_err(format!("gguf: {key} is not a bool: {:?}", v.value_type()))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(load_err(format!("gguf: {key} is not an array: {:?}", v.value_type()))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                v => Err(load_err(format!("gguf: {key} holds a {:?}, not strings", v.value_type()))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .map(|v| {
                as_i64(v).ok_or_else(|| load_err(format!("gguf: {key} holds a {:?}, not integers", v.value_type())))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn floats(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .map(|v| match v {
                Value::F32(x) => Ok(*x),
                Value::F64(x) => Ok(*x as f32),
                v => as_i64(v)
                    .map(|x| x as f32)
                    .ok_or_else(|| load_err(format!("gguf: {key} holds a {:?}, not numbers", v.value_type()))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// GGUF token type of byte tokens (`<0x0A>`).
const TOKEN_TYPE_BYTE: i64 = 6;

/// A SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`) as a
/// byte-fallback BPE that tokenizes as llama.cpp's SPM tokenizer does:
/// spaces become `▁` (with one prepended to text at the start or after a
/// special token, when `add_space_prefix`), the text is cut into
/// characters, and the adjacent pair whose concatenation is the
/// highest-scoring vocabulary entry is merged first, again and again;
/// characters that no entry covers become their UTF-8 bytes' `<0xXX>`
/// tokens. The merges are every split of an entry into two entries,
/// ranked by the entry's score (ties: lower id first).
fn sentencepiece(
    tokens: &[String],
    scores: &[f32],
    types: Option<&[i64]>,
    vocab: &Vocab,
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as DecoderSequence;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::normalizers::{Prepend, Replace};
    use tokenizers::{DecoderWrapper, NormalizerWrapper};

    let mut ranked: Vec<(f32, u32, String, String)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        if types.is_some_and(|t| t[id] == TOKEN_TYPE_BYTE) || vocab.get(tok) != Some(&(id as u32)) {
            continue;
        }
        for (pos, _) in tok.char_indices().skip(1) {
            let (a, b) = tok.split_at(pos);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                ranked.push((scores[id], id as u32, a.to_owned(), b.to_owned()));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    let merges: Vec<(String, String)> = ranked.into_iter().map(|(_, _, a, b)| (a, b)).collect();
    let unk = types.and_then(|t| t.iter().position(|&ty| ty == TOKEN_TYPE_UNKNOWN)).map(|i| tokens[i].clone());
    let mut builder = BPE::builder().vocab_and_merges(vocab.clone(), merges).byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk).fuse_unk(true);
    }
    let bpe = builder.build().map_err(|e| load_err(format!("gguf: building the SentencePiece model: {e}")))?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    let replace = Replace::new(" ", "\u{2581}").map_err(|e| load_err(format!("gguf: {e}")))?;
    let mut norms: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        norms.push(Prepend::new("\u{2581}".into()).into());
    }
    norms.push(replace.into());
    tokenizer
        .with_normalizer(Some(tokenizers::normalizers::Sequence::new(norms)))
        .map_err(|e| load_err(format!("gguf: {e}")))?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        tokenizers::decoders::DecoderWrapper::Replace(
            Replace::new("\u{2581}", " ").map_err(|e| load_err(format!("gguf: {e}")))?,
        ),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

pub(crate) fn build(content: &Content) -> Result<GgufTokenizer> {
    let meta = Meta(&content.metadata);
    let model = meta
        .str("tokenizer.ggml.model")?
        .ok_or_else(|| load_err("gguf: no tokenizer.ggml.model; the file has no embedded tokenizer"))?;
    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(load_err(format!(
                "gguf: unsupported tokenizer.ggml.model \"{other}\" (supported: \"gpt2\" byte-level BPE, \
                 \"llama\" SentencePiece); pass --tokenizer with the model's tokenizer.json"
            )))
        }
    };
    let mut warnings = Vec::new();

    let raw_tokens =
        meta.strings("tokenizer.ggml.tokens")?.ok_or_else(|| load_err("gguf: no tokenizer.ggml.tokens"))?;
    let n = raw_tokens.len();
    if n == 0 || n > u32::MAX as usize {
        return Err(load_err(format!("gguf: tokenizer.ggml.tokens has {n} entries")));
    }
    // llama.cpp names empty tokens so that every id keeps a distinct text.
    let tokens: Vec<String> = raw_tokens
        .iter()
        .enumerate()
        .map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { (*t).to_owned() })
        .collect();
    let token_types = meta.ints("tokenizer.ggml.token_type")?;
    if let Some(tt) = &token_types {
        if tt.len() != n {
            return Err(load_err(format!("gguf: {} token types for {n} tokens", tt.len())));
        }
    }

    // Later duplicates win, as in llama.cpp's text-to-id map.
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    if vocab.len() != n {
        warnings.push(format!(
            "gguf: {} duplicate token texts; their earlier ids cannot be produced by tokenization",
            n - vocab.len()
        ));
    }

    let (mut tokenizer, family, default_add_bos) = if spm {
        let scores = meta.floats("tokenizer.ggml.scores")?.unwrap_or_else(|| vec![0.0; n]);
        if scores.len() != n {
            return Err(load_err(format!("gguf: {} scores for {n} tokens", scores.len())));
        }
        let add_space_prefix = meta.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        (sentencepiece(&tokens, &scores, token_types.as_deref(), &vocab, add_space_prefix)?, "spm", true)
    } else {
        let raw_merges =
            meta.strings("tokenizer.ggml.merges")?.ok_or_else(|| load_err("gguf: no tokenizer.ggml.merges"))?;
        let mut merges = Vec::with_capacity(raw_merges.len());
        let mut bad_merges = 0usize;
        for m in raw_merges {
            // llama.cpp splits at the first space after the first byte (so a
            // merge may start with a space); no continuation byte is a space,
            // so that is the first space after the first character.
            let Some(pos) = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(p, _)| p) else {
                bad_merges += 1;
                continue;
            };
            let (a, b) = (&m[..pos], &m[pos + 1..]);
            if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&format!("{a}{b}")) {
                bad_merges += 1;
                continue;
            }
            merges.push((a.to_owned(), b.to_owned()));
        }
        if bad_merges > 0 {
            warnings.push(format!(
                "gguf: ignored {bad_merges} merges that are malformed or name tokens missing from the vocabulary"
            ));
        }

        let pre = meta.str("tokenizer.ggml.pre")?;
        let (spec, known) = pre_tokenizer_spec(pre);
        if !known {
            warnings.push(format!(
                "gguf: {} tokenizer.ggml.pre{}; using llama.cpp's default pre-tokenizer",
                if pre.is_some() { "unknown" } else { "missing" },
                pre.map(|p| format!(" \"{p}\"")).unwrap_or_default()
            ));
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(|e| load_err(format!("gguf: building BPE: {e}")))?;
        let mut tokenizer = tokenizers::Tokenizer::new(bpe);

        let mut pieces: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
        for re in spec.regexes {
            let split = Split::new(SplitPattern::Regex((*re).to_owned()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| load_err(format!("gguf: pre-tokenizer regex {re:?}: {e}")))?;
            pieces.push(split.into());
        }
        pieces.push(ByteLevel::new(false, true, false).into());
        tokenizer.with_pre_tokenizer(Some(Sequence::new(pieces)));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        (tokenizer, spec.family, spec.default_add_bos)
    };

    let id_key = |key: &str| -> Result<Option<u32>> {
        match meta.int(key)? {
            None => Ok(None),
            Some(id) if id >= 0 && (id as usize) < n => Ok(Some(id as u32)),
            Some(id) => Err(load_err(format!("gguf: {key} = {id} is outside the {n}-token vocabulary"))),
        }
    };
    let bos_id = id_key("tokenizer.ggml.bos_token_id")?;
    let eos_id = id_key("tokenizer.ggml.eos_token_id")?;
    let unk_id = id_key("tokenizer.ggml.unknown_token_id")?;
    let pad_id = id_key("tokenizer.ggml.padding_token_id")?;
    let eot_id = id_key("tokenizer.ggml.eot_token_id")?;
    let eom_id = id_key("tokenizer.ggml.eom_token_id")?;

    // Control tokens (and unknown/user-defined ones) are matched in text
    // before the BPE sees it, as llama.cpp does with special parsing on.
    // Control and unknown tokens are dropped when decoding with
    // `skip_special`; user-defined ones are ordinary text.
    let mut end_of_turn: Vec<u32> = Vec::new();
    let mut added = Vec::new();
    for (i, tok) in tokens.iter().enumerate() {
        let ty = token_types.as_ref().map_or(1, |tt| tt[i]);
        let eot_text = END_OF_TURN_TOKENS.contains(&tok.as_str());
        if eot_text {
            end_of_turn.push(i as u32);
        }
        let special = match ty {
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => true,
            TOKEN_TYPE_USER_DEFINED => false,
            // llama.cpp turns end-of-turn-looking tokens into control ones.
            _ if eot_text => true,
            _ => continue,
        };
        added.push(AddedToken::from(tok.clone(), special).normalized(false));
    }
    let specials: Vec<AddedToken> = added.iter().filter(|t| t.special).cloned().collect();
    let plain: Vec<AddedToken> = added.into_iter().filter(|t| !t.special).collect();
    tokenizer
        .add_special_tokens(specials)
        .and_then(|_| tokenizer.add_tokens(plain))
        .map_err(|e| load_err(format!("gguf: adding special tokens: {e}")))?;

    let mut eos_ids: Vec<u32> = Vec::new();
    for id in [eos_id, eot_id, eom_id].into_iter().flatten().chain(end_of_turn) {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }

    let add_bos = meta.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
    let add_eos = meta.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    if add_bos && bos_id.is_none() {
        warnings.push("gguf: add_bos_token is set but the file names no BOS token".to_owned());
    }
    let chat_template = meta.str("tokenizer.chat_template")?.map(str::to_owned);

    Ok(GgufTokenizer {
        tokenizer,
        vocab_size: n,
        tokens,
        bos_id,
        eos_id,
        unk_id,
        pad_id,
        eos_ids,
        add_bos,
        add_eos,
        chat_template,
        pre_family: family,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pre_tokenizer_regex_compiles() {
        let names = [
            None,
            Some("default"),
            Some("llama-bpe"),
            Some("dbrx"),
            Some("smollm"),
            Some("gpt-2"),
            Some("qwen2"),
            Some("falcon"),
            Some("gpt-4o"),
            Some("tekken"),
            Some("deepseek-llm"),
            Some("deepseek-coder"),
            Some("deepseek-v3"),
            Some("something-new"),
        ];
        for name in names {
            let (spec, _) = pre_tokenizer_spec(name);
            for re in spec.regexes {
                Split::new(SplitPattern::Regex((*re).to_owned()), SplitDelimiterBehavior::Isolated, false)
                    .unwrap_or_else(|e| panic!("{name:?} {re}: {e}"));
            }
        }
        assert_eq!(pre_tokenizer_spec(Some("llama-bpe")).0.family, "llama3");
        assert!(pre_tokenizer_spec(Some("llama-bpe")).0.ignore_merges);
        assert_eq!(pre_tokenizer_spec(Some("smollm")), (pre_tokenizer_spec(Some("starcoder")).0, true));
        assert_eq!(pre_tokenizer_spec(Some("something-new")).0.family, "default");
        assert!(!pre_tokenizer_spec(Some("something-new")).1);
        assert!(!pre_tokenizer_spec(None).1);
    }
}
