//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: what a
//! client needs to count tokens or render ids with the served model's own
//! tokenizer and chat template.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::JsonBody;
use super::error::ApiError;
use super::request::{ChatRender, Message};
use super::AppState;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenizeRequest {
    pub model: String,
    /// Plain text (completions style).
    #[serde(default)]
    pub prompt: Option<String>,
    /// Chat messages, rendered with the model's template.
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    /// Plain text only: add BOS/EOS as the model asks (default true).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Chat only: end with the assistant's turn opening (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's text.
    #[serde(default)]
    pub return_token_strs: Option<bool>,
    /// Chat only: the request's own chat-template variables.
    #[serde(default)]
    pub chat_template_kwargs: Option<granary_tokenizer::TemplateKwargs>,
    /// Chat only: end inside the last (assistant's) message.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DetokenizeRequest {
    pub model: String,
    pub tokens: Vec<u32>,
}

pub(crate) async fn tokenize(
    State(st): State<AppState>,
    JsonBody(req): JsonBody<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let model = st.model(&req.model)?;
    let tok = model.tokenizer.clone();
    for (param, set) in [
        ("chat_template_kwargs", req.chat_template_kwargs.is_some()),
        ("continue_final_message", req.continue_final_message.is_some()),
        ("add_generation_prompt", req.add_generation_prompt.is_some()),
    ] {
        if set && req.messages.is_none() {
            return Err(ApiError::invalid(
                param,
                "invalid_value",
                format!("Invalid value for `{param}`: it applies to `messages` only."),
            ));
        }
    }
    let ids = match (req.prompt, req.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request("invalid_value", "Send either `prompt` or `messages`, not both."))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "missing_required_parameter",
                "Missing required parameter: `prompt` (or `messages`).",
            ))
        }
        (Some(text), None) => {
            let special = req.add_special_tokens.unwrap_or(true);
            tokio::task::spawn_blocking(move || tok.encode(&text, special))
                .await
                .map_err(|e| ApiError::internal(&e))?
                .map_err(|e| ApiError::internal(&e))?
        }
        (None, Some(messages)) => {
            let mut chat = Vec::with_capacity(messages.len());
            for (i, m) in messages.into_iter().enumerate() {
                chat.push(super::request::chat_message(i, m)?);
            }
            let render = ChatRender::new(
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                &chat,
            )?;
            tokio::task::spawn_blocking(move || tok.encode_chat_with(&chat, None, &render.options()))
                .await
                .map_err(|e| ApiError::internal(&e))?
                .map_err(|e| {
                    ApiError::invalid("messages", "invalid_value", format!("Invalid value for `messages`: {e}."))
                })?
        }
    };
    let strs = req
        .return_token_strs
        .unwrap_or(false)
        .then(|| ids.iter().map(|&id| model.tokenizer.token_to_piece(id).unwrap_or_default()).collect::<Vec<_>>());
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": model.context_len,
        "tokens": ids,
        "token_strs": strs,
    })))
}

pub(crate) async fn detokenize(
    State(st): State<AppState>,
    JsonBody(req): JsonBody<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let model = st.model(&req.model)?;
    let vocab = model.tokenizer.vocab_size();
    if let Some((i, id)) = req.tokens.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("tokens[{i}]"),
            "invalid_value",
            format!("Invalid value for `tokens[{i}]`: token id {id} is outside the vocabulary of {vocab} tokens."),
        ));
    }
    let text = model.tokenizer.decode(&req.tokens, false).map_err(|e| ApiError::internal(&e))?;
    Ok(Json(json!({ "prompt": text })))
}
