//! Granary's shared vocabulary, with no I/O.
//!
//! Every component names KV blocks the same way ([`hash`]), frames them the
//! same way on every tier and on the wire ([`block`]), reads sizes the same
//! way ([`size`]) and exports metrics under one catalog of names
//! ([`metrics`]). Keeping these here, free of runtime dependencies, lets the
//! engine, the gateway and the warehouse agree byte for byte.

pub mod block;
pub mod hash;
pub mod metrics;
pub mod size;
pub mod trace;

pub use block::{BlockError, BlockHeader, DType, KvBlock, HEADER_LEN};
pub use hash::{BlockHash, HashChain, KvLayout, ParseHashError};
pub use size::{parse_size, ByteSize, ParseSizeError};
