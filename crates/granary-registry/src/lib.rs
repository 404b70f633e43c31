//! Granary's model registry.
//!
//! A catalog of models and revisions (name, revision, files with sizes and
//! sha256, format, license) in SQLite or PostgreSQL, with the files stored
//! content-addressed (`blobs/sha256/<hex>`) in an object store. Revisions
//! are imported from a local directory, a PyPI package or the Hugging Face
//! cache; sha256 is checked on import and on every fetch.
//!
//! - [`api`]: the wire types and the naming rules.
//! - [`client`]: [`RegistryClient`], the HTTP API from Rust.
//! - [`server`]: the HTTP API ([`server::serve`] starts one on a listener).
//! - [`Registry`] and [`RegistryConfig`]: the operations behind it.
//! - [`catalog`], [`blobs`], [`import`]: the catalog database, the
//!   content-addressed store, the import sources; [`upload`]: files pushed
//!   over HTTP.

pub mod api;
pub mod blobs;
pub mod catalog;
pub mod client;
pub mod error;
pub mod import;
pub mod metrics;
pub mod server;
mod service;
pub mod upload;

pub use api::{
    FileEntry, FileUrl, GcReport, ImportRequest, Model, ModelList, ModelSummary, Revision, RevisionRequest,
    UploadStatus,
};
pub use client::{ClientError, RegistryClient};
pub use error::{ApiError, RegistryError};
pub use import::ImportOptions;
pub use service::{content_revision, Registry, RegistryConfig};
