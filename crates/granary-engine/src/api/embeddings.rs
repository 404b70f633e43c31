//! `POST /v1/embeddings`: the model's pooled hidden states (mean over the
//! input's positions of the last layer's normed states, L2-normalised).
//! For instruct and base chat models this is a generic text embedding, not
//! one trained for retrieval; it is documented as such.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use base64::Engine as _;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::JsonBody;
use super::error::ApiError;
use super::AppState;

/// Most inputs per request (OpenAI's limit).
const MAX_INPUTS: usize = 2048;

/// The body of `POST /v1/embeddings`; a field not named here is refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EmbeddingsRequest {
    pub model: String,
    pub input: Inputs,
    #[serde(default)]
    pub encoding_format: Option<String>,
    #[serde(default)]
    pub dimensions: Option<u64>,
    /// An end-user identifier; it asks nothing of the model.
    #[serde(default)]
    #[allow(dead_code)]
    pub user: Option<String>,
}

/// `input`: a string, an array of strings, an array of token ids, or an
/// array of arrays of token ids.
#[derive(Debug)]
pub(crate) enum Inputs {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for Inputs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Item {
            Text(String),
            Token(u32),
            Tokens(Vec<u32>),
        }
        impl<'de> Visitor<'de> for V {
            type Value = Inputs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, an array of strings, an array of token ids or an array of arrays of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Inputs, E> {
                Ok(Inputs::Texts(vec![s.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Inputs, A::Error> {
                let mut items = Vec::new();
                while let Some(i) = seq.next_element::<Item>()? {
                    items.push(i);
                }
                if items.iter().all(|i| matches!(i, Item::Token(_))) && !items.is_empty() {
                    return Ok(Inputs::Tokens(vec![items
                        .into_iter()
                        .filter_map(|i| if let Item::Token(t) = i { Some(t) } else { None })
                        .collect()]));
                }
                let mut texts = Vec::new();
                let mut tokens = Vec::new();
                for i in items {
                    match i {
                        Item::Text(t) => texts.push(t),
                        Item::Tokens(t) => tokens.push(t),
                        Item::Token(_) => return Err(de::Error::custom("a mix of token ids and other inputs")),
                    }
                }
                match (texts.is_empty(), tokens.is_empty()) {
                    (false, true) => Ok(Inputs::Texts(texts)),
                    (true, false) => Ok(Inputs::Tokens(tokens)),
                    (true, true) => Err(de::Error::custom("an empty array")),
                    (false, false) => Err(de::Error::custom("a mix of strings and token arrays")),
                }
            }
        }
        d.deserialize_any(V)
    }
}

pub(crate) async fn embeddings(
    State(st): State<AppState>,
    JsonBody(req): JsonBody<EmbeddingsRequest>,
) -> Result<Json<Value>, ApiError> {
    let model = st.model(&req.model)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                "invalid_value",
                format!("Invalid value for `encoding_format`: `{other}`; expected `float` or `base64`."),
            ))
        }
    };
    let tok = model.tokenizer.clone();
    let vocab = tok.vocab_size();
    let inputs: Vec<Vec<u32>> = match req.input {
        Inputs::Texts(texts) => {
            let t = tok.clone();
            tokio::task::spawn_blocking(move || texts.iter().map(|s| t.encode(s, true)).collect::<Result<Vec<_>, _>>())
                .await
                .map_err(|e| ApiError::internal(&e))?
                .map_err(|e| ApiError::internal(&e))?
        }
        Inputs::Tokens(ids) => ids,
    };
    if inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            "input",
            "invalid_value",
            format!("Invalid value for `input`: at most {MAX_INPUTS} inputs, got {}.", inputs.len()),
        ));
    }
    for (i, ids) in inputs.iter().enumerate() {
        if ids.is_empty() {
            return Err(ApiError::invalid(
                format!("input[{i}]"),
                "invalid_value",
                format!("Invalid value for `input[{i}]`: it encodes to no tokens."),
            ));
        }
        if ids.len() > model.context_len {
            return Err(ApiError::invalid(
                format!("input[{i}]"),
                "context_length_exceeded",
                format!(
                    "Invalid value for `input[{i}]`: {} tokens exceed this model's maximum context length of {}.",
                    ids.len(),
                    model.context_len
                ),
            ));
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("input[{i}]"),
                "invalid_value",
                format!("Invalid value for `input[{i}]`: token id {id} is outside the vocabulary of {vocab} tokens."),
            ));
        }
    }
    let backend = Arc::clone(&st.backend);
    let id = model.id.clone();
    let batch = inputs.clone();
    let vectors = st
        .side_pass(move || batch.iter().map(|ids| backend.embed(&id, ids)).collect::<Option<Result<Vec<_>, _>>>())
        .await?;
    let vectors = match vectors {
        None => {
            return Err(ApiError::invalid(
                "model",
                "unsupported_model",
                format!("The model `{}` does not serve embeddings.", model.id),
            ))
        }
        Some(Err(e)) => return Err(ApiError::generation_failed(&e.to_string())),
        Some(Ok(v)) => v,
    };
    if let Some(d) = req.dimensions {
        let have = vectors.first().map_or(0, Vec::len);
        if d as usize != have {
            return Err(ApiError::invalid(
                "dimensions",
                "unsupported_value",
                format!("Invalid value for `dimensions`: this model's embeddings have {have} dimensions, not {d}."),
            ));
        }
    }
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model.id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })))
}
