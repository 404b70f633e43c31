//! Granary's KV-cache warehouse: a tiered block store and its servers.
//!
//! Values live in up to three tiers (memory → local disk → a shared object
//! store or filesystem), keyed by `(namespace, opaque key bytes)`. Reads
//! walk the tiers fastest first and promote hits; writes land in memory and
//! are offloaded to slower tiers through bounded queues, so a caller never
//! waits on a slow tier. [`Store`] is the in-process API; [`resp`] and
//! [`http`] put it on the network for Redis tooling, LMCache and Granary
//! engines.

pub mod auth;
pub mod config;
pub mod error;
pub mod http;
pub mod lm;
pub mod metrics;
mod offload;
pub mod policy;
pub mod resp;
pub mod server;
pub mod store;
pub mod tier;
pub mod types;

pub use config::{OffloadMode, StoreConfig};
pub use error::WarehouseError;
pub use policy::PolicyKind;
pub use server::ServerCtx;
pub use store::{Lease, LookupResult, Observe, PutOutcome, Store};
pub use tier::{Tier, TierKind};
pub use types::{Condition, EntryMeta, Event, EventKind, PutOptions, ScanPage, Stored, TierStats, Ttl};
