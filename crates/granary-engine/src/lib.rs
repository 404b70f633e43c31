//! The embedded engine: loads a Llama-family model, runs its forward pass
//! with an engine-owned KV cache, reuses KV blocks through the warehouse,
//! batches requests continuously and serves the OpenAI API.

pub mod api;
pub mod connector;
pub mod constraint;
pub mod types;

pub use types::*;
pub mod engine;
pub mod model;
mod pypi;
pub mod server;
pub mod source;
pub mod store;
