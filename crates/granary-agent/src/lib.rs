//! Granary's node agent: one per node, between the registry and the engines.
//!
//! - [`tiers`]: weight cache tiers (RAM on tmpfs, local disk, the registry
//!   below), by sha256, with budgets, LRU, promotion and demotion;
//! - [`download`]: parallel range downloads, resumable, sha256-verified,
//!   clean on a full disk;
//! - [`supervisor`]: engine processes (the embedded `granary engine` or a
//!   command template for vLLM, SGLang, llama.cpp), health checks, restart
//!   with backoff, logs, adoption after an agent restart;
//! - [`front`]: a proxy before an engine, so the agent sees its requests;
//! - [`resources`]: GPUs and memory, who holds what, admission;
//! - [`weights`]: which tier holds each revision laid out here;
//! - [`profile`]: how fast this node loads (read rates, conversions),
//!   learned from its loads, for the gateway's placement;
//! - [`agent`]: loads and unloads, idle unload (scale to zero);
//! - [`drain`]: an idle engine leaves the gateways' routing and finishes
//!   its requests before it is stopped;
//! - [`prefetch`]: stages the models a gateway predicts into the RAM tier;
//! - [`api`]: the control API; [`heartbeat`]: reports to the gateway.
//!
//! `granary agent` runs it; tests start it in-process with
//! [`Agent::start`] and [`api::serve`].

pub mod activity;
pub mod agent;
pub mod api;
pub mod config;
pub mod download;
pub mod drain;
pub mod error;
pub mod front;
pub mod heartbeat;
pub mod metrics;
pub mod prefetch;
pub mod profile;
pub mod registry;
pub mod resources;
pub mod supervisor;
pub mod tiers;
pub mod weights;

pub use agent::{Agent, AgentStatus, LoadResponse};
pub use config::AgentConfig;
pub use error::AgentError;
