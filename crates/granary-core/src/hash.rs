//! Block identity: the blake3 hash chain that names KV blocks.
//!
//! A block is named by everything that determines its KV bytes: the
//! namespace (the tenant, so tenants never share KV), the model, the KV
//! layout, and every token from the start of the prompt to the end of the
//! block. Chaining makes a block's name depend on its whole prefix, so two
//! prompts share block `i` exactly when they share all tokens up to it.
//!
//! ```text
//! root = blake3("granary/kv/v1" ‖ len ‖ namespace ‖ len ‖ model_fingerprint ‖ len ‖ kv_layout)
//! h[i] = blake3(h[i-1] ‖ tokens of block i as u32 little-endian)
//! ```
//!
//! Each variable-length field of the root is preceded by its length (u32
//! LE), so `("ab", "c")` and `("a", "bc")` never collide. The result is
//! deterministic across processes and machines.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::block::DType;

/// Domain separator of the root hash; bump the version to change the scheme.
pub const DOMAIN: &[u8] = b"granary/kv/v1";

/// The name of one KV block: 32 bytes, written as 64 lowercase hex chars.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    pub const LEN: usize = 32;

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64-char lowercase hex form used in keys, URLs and logs.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 64];
        hex::encode_to_slice(self.0, &mut buf).expect("64-byte buffer");
        f.write_str(std::str::from_utf8(&buf).expect("hex is ascii"))
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({self})")
    }
}

/// Why a string is not a block hash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseHashError {
    #[error("block hash must be 64 hex characters, got {0}")]
    Length(usize),
    #[error("block hash must be lowercase hex (0-9, a-f)")]
    NotHex,
}

impl FromStr for BlockHash {
    type Err = ParseHashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 64 {
            return Err(ParseHashError::Length(s.len()));
        }
        if !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(ParseHashError::NotHex);
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| ParseHashError::NotHex)?;
        Ok(BlockHash(out))
    }
}

impl Serialize for BlockHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for BlockHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The shape of the KV an engine keeps per token, part of a block's identity:
/// the same tokens under another layout are different bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    pub dtype: DType,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Tokens per block.
    pub block_tokens: u32,
}

impl KvLayout {
    /// Canonical bytes hashed into the chain root.
    pub fn to_bytes(&self) -> [u8; 17] {
        let mut out = [0u8; 17];
        out[0] = self.dtype as u8;
        out[1..5].copy_from_slice(&self.layers.to_le_bytes());
        out[5..9].copy_from_slice(&self.kv_heads.to_le_bytes());
        out[9..13].copy_from_slice(&self.head_dim.to_le_bytes());
        out[13..17].copy_from_slice(&self.block_tokens.to_le_bytes());
        out
    }

    /// Bytes of K and V for one token across all layers.
    pub fn bytes_per_token(&self) -> u64 {
        2 * self.layers as u64 * self.kv_heads as u64 * self.head_dim as u64 * self.dtype.size() as u64
    }
}

/// Computes block names for prompts of one (namespace, model, layout).
#[derive(Debug, Clone)]
pub struct HashChain {
    root: BlockHash,
    block_tokens: usize,
}

impl HashChain {
    /// The chain for `namespace`, a model fingerprint (any stable bytes that
    /// identify the weights, such as their sha256) and a KV layout given as
    /// bytes (see [`KvLayout::to_bytes`]).
    pub fn new(namespace: &str, model_fingerprint: &[u8], kv_layout: &[u8], block_tokens: usize) -> Self {
        assert!(block_tokens > 0, "block_tokens must be positive");
        let mut h = blake3::Hasher::new();
        h.update(DOMAIN);
        for field in [namespace.as_bytes(), model_fingerprint, kv_layout] {
            h.update(&(field.len() as u32).to_le_bytes());
            h.update(field);
        }
        HashChain { root: BlockHash(*h.finalize().as_bytes()), block_tokens }
    }

    /// The chain for a model's [`KvLayout`]; block size is the layout's.
    pub fn for_layout(namespace: &str, model_fingerprint: &[u8], layout: &KvLayout) -> Self {
        Self::new(namespace, model_fingerprint, &layout.to_bytes(), layout.block_tokens as usize)
    }

    pub fn root(&self) -> BlockHash {
        self.root
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The hash of the block after `parent` holding `tokens`.
    pub fn next(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
        let mut h = blake3::Hasher::new();
        h.update(&parent.0);
        // Tokens as u32 LE; on little-endian hosts this is a plain byte view,
        // but building it explicitly keeps the hash portable.
        let mut buf = [0u8; 4 * 64];
        for chunk in tokens.chunks(64) {
            for (i, t) in chunk.iter().enumerate() {
                buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        BlockHash(*h.finalize().as_bytes())
    }

    /// Hashes of every *full* block of `tokens`; a trailing partial block has
    /// no name (it is recomputed, never stored).
    pub fn hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_tokens);
        let mut parent = self.root;
        for block in tokens.chunks_exact(self.block_tokens) {
            parent = Self::next(&parent, block);
            out.push(parent);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ns: &str) -> HashChain {
        HashChain::new(ns, b"model-a", b"layout-1", 4)
    }

    #[test]
    fn hex_round_trip_and_errors() {
        let h = chain("t").hashes(&[1, 2, 3, 4])[0];
        let s = h.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(s, h.to_hex());
        assert_eq!(s.parse::<BlockHash>().unwrap(), h);
        assert_eq!("abc".parse::<BlockHash>(), Err(ParseHashError::Length(3)));
        assert_eq!(s.to_uppercase().parse::<BlockHash>(), Err(ParseHashError::NotHex));
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, format!("\"{s}\""));
        assert_eq!(serde_json::from_str::<BlockHash>(&json).unwrap(), h);
    }

    #[test]
    fn only_full_blocks_are_named() {
        let c = chain("t");
        assert_eq!(c.hashes(&[1, 2, 3]).len(), 0);
        assert_eq!(c.hashes(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(c.hashes(&[1, 2, 3, 4, 5, 6, 7, 8]).len(), 2);
    }

    #[test]
    fn shared_prefix_shares_hashes_and_divergence_propagates() {
        let c = chain("t");
        let a = c.hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let b = c.hashes(&[1, 2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12]);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Same tokens in block 2, different parent: different name.
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn root_depends_on_every_field_without_ambiguity() {
        let base = HashChain::new("ab", b"c", b"l", 4).root();
        assert_ne!(base, HashChain::new("a", b"bc", b"l", 4).root());
        assert_ne!(base, HashChain::new("ab", b"c", b"m", 4).root());
        assert_ne!(base, HashChain::new("ab", b"d", b"l", 4).root());
        assert_ne!(chain("tenant-1").hashes(&[1, 2, 3, 4]), chain("tenant-2").hashes(&[1, 2, 3, 4]));
    }

    #[test]
    fn matches_the_documented_formula() {
        // Recompute by hand from the spec in the module docs.
        let mut h = blake3::Hasher::new();
        h.update(b"granary/kv/v1");
        for f in [&b"ns"[..], b"fp", b"kv"] {
            h.update(&(f.len() as u32).to_le_bytes());
            h.update(f);
        }
        let root = *h.finalize().as_bytes();
        let mut h = blake3::Hasher::new();
        h.update(&root);
        for t in [7u32, 8, 0x01020304] {
            h.update(&t.to_le_bytes());
        }
        let expect = BlockHash(*h.finalize().as_bytes());
        assert_eq!(HashChain::new("ns", b"fp", b"kv", 3).hashes(&[7, 8, 0x01020304]), vec![expect]);
    }

    #[test]
    fn long_blocks_hash_like_one_update() {
        let tokens: Vec<u32> = (0..300).collect();
        let c = HashChain::new("ns", b"fp", b"kv", 300);
        let mut h = blake3::Hasher::new();
        h.update(&c.root().0);
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        h.update(&bytes);
        assert_eq!(c.hashes(&tokens)[0], BlockHash(*h.finalize().as_bytes()));
    }

    #[test]
    fn layout_bytes_and_sizes() {
        let l = KvLayout { dtype: DType::F16, layers: 30, kv_heads: 3, head_dim: 64, block_tokens: 256 };
        // SmolLM2-135M: 30 layers, 3 KV heads, 64 dims, f16: 23,040 bytes per token.
        assert_eq!(l.bytes_per_token(), 23_040);
        let other = KvLayout { dtype: DType::F32, ..l };
        assert_ne!(l.to_bytes(), other.to_bytes());
        assert_ne!(HashChain::for_layout("t", b"m", &l).root(), HashChain::for_layout("t", b"m", &other).root());
    }
}
