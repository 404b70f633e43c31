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
#[cfg(feature = "serve")]
pub mod serve;
pub mod size;
pub mod trace;

pub use block::{BlockError, BlockHeader, DType, KvBlock, HEADER_LEN};
pub use hash::{BlockHash, HashChain, KvLayout, ParseHashError};
pub use size::{parse_size, ByteSize, ParseSizeError};

/// Whether a file name is an engine's converted-weight checkpoint:
/// `<model file>.granary-<kernels>.ckpt` beside a model file, or
/// `granary-<kernels>.ckpt` in a model directory. Such a file is one
/// host's cache of a conversion, never part of the model: imports and
/// uploads to the registry leave it out, and the node agent keeps it in its
/// tiers apart from the weights.
pub fn is_checkpoint_file(name: &str) -> bool {
    name.ends_with(".ckpt") && (name.starts_with("granary-") || name.contains(".granary-"))
}

/// The prefix of the one-line JSON `granary engine` prints to its log
/// after loading: where its start went (`weights_bytes`, `read_ms`,
/// `convert_ms`, `checkpoint`, ...). The node agent learns this host's read
/// bandwidth and each model's conversion time from it; `granary bench
/// coldstart` breaks cold starts down with it.
pub const ENGINE_LOAD_STATS_PREFIX: &str = "granary: load stats ";

#[cfg(test)]
mod tests {
    #[test]
    fn checkpoint_file_names() {
        for yes in ["m.gguf.granary-avx512vnni.ckpt", "granary-portable.ckpt", "a.b.granary-x.ckpt"] {
            assert!(super::is_checkpoint_file(yes), "{yes}");
        }
        for no in ["model.ckpt", "granary.ckpt.json", "m.gguf", "my-granary-notes.txt", "pytorch_model.ckpt"] {
            assert!(!super::is_checkpoint_file(no), "{no}");
        }
    }
}
