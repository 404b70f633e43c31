//! OpenAI-compatible HTTP API over a [`crate::Backend`].

mod stop;
