//! OpenAI-compatible HTTP API over a [`crate::Backend`].

pub mod error;
mod generate;
mod response;
mod stop;

pub use error::{ApiError, ErrorType};
