//! Granary's gateway: one OpenAI-compatible endpoint in front of many
//! engines, for many tenants.
//!
//! A request passes, in order: the API key ([`identity`]) which names the
//! tenant and with it the KV namespace sent upstream; the key's and the
//! tenant's limits ([`limits`]); a routing policy ([`routing`]) that ranks
//! the healthy upstreams of the model's pools, KV-aware where engines
//! publish their blocks; the proxy, which streams the answer back without
//! buffering and retries only before the first byte; and last an audit
//! record and the metrics.
//!
//! The upstream set is not fixed: node agents ([`agents`]) report engines
//! that join and leave it while the gateway runs, and load models on
//! request.

pub mod agents;
pub mod cache;
pub mod config;
pub mod error;
pub mod front;
pub mod identity;
pub mod limits;
pub mod metrics;
pub mod pricing;
pub mod prompt;
pub mod proxy;
pub mod routing;
pub mod semantic;
pub mod server;
pub mod sse;
pub mod tls;
pub mod types;
pub mod upstream;

pub use config::GatewayConfig;
pub use error::ApiError;
pub use proxy::Gateway;
pub use types::{KeyId, Limits, Principal, Priority, TenantId};
