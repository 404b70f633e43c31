//! Real tiers for the integration tests: memory, disk (plain and with zstd +
//! AES-256-GCM), remote over a `file://` directory, and remote over S3
//! served by a real `s3s-fs` process started per test.

#![allow(dead_code)]

mod s3;
pub use s3::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use granary_core::ByteSize;
use granary_warehouse::config::{DiskConfig, RemoteConfig};
use granary_warehouse::tier::at_rest::AtRest;
use granary_warehouse::tier::disk::open_disk;
use granary_warehouse::tier::memory::MemoryTier;
use granary_warehouse::tier::remote::open_remote;
use granary_warehouse::{PolicyKind, Tier};

pub const TEST_KEY: [u8; 32] = [0x42; 32];

/// A tier under test and what keeps its backing alive.
pub struct Harness {
    pub tier: Arc<dyn Tier>,
    /// Whether the tier enforces a byte budget.
    pub bounded: bool,
    /// Whether the tier reports `bytes` and `entries`.
    pub tracks_size: bool,
    pub keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

pub fn memory(capacity: u64) -> Harness {
    Harness {
        tier: Arc::new(MemoryTier::new(capacity, PolicyKind::Lru)),
        bounded: true,
        tracks_size: true,
        keep: vec![],
    }
}

pub async fn disk_with(capacity: u64, at_rest: AtRest) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let cfg = DiskConfig { dir: dir.path().to_path_buf(), capacity: ByteSize(capacity), policy: PolicyKind::Lru };
    let tier = open_disk(&cfg, at_rest).await.unwrap();
    Harness { tier: Arc::new(tier), bounded: true, tracks_size: true, keep: vec![Box::new(dir)] }
}

pub async fn disk(capacity: u64) -> Harness {
    disk_with(capacity, AtRest::default()).await
}

pub async fn disk_sealed(capacity: u64) -> Harness {
    disk_with(capacity, AtRest::with_key(Some(3), Some(TEST_KEY))).await
}

pub fn file_url(dir: &Path) -> String {
    url::Url::from_directory_path(dir).unwrap().to_string()
}

pub async fn remote_file_with(at_rest: AtRest) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    // A subdirectory that does not exist yet: the tier creates it.
    let cfg = RemoteConfig { url: file_url(&dir.path().join("shared/kv")), options: HashMap::new() };
    let tier = open_remote(&cfg, at_rest).await.unwrap();
    Harness { tier: Arc::new(tier), bounded: false, tracks_size: false, keep: vec![Box::new(dir)] }
}

pub async fn remote_file(_capacity: u64) -> Harness {
    remote_file_with(AtRest::default()).await
}

pub async fn remote_s3_with(at_rest: AtRest) -> Option<Harness> {
    let server = start_s3()?;
    let tier = open_remote(&server.config("kv/cache"), at_rest).await.unwrap();
    Some(Harness { tier: Arc::new(tier), bounded: false, tracks_size: false, keep: vec![Box::new(server)] })
}

pub async fn remote_s3(_capacity: u64) -> Option<Harness> {
    remote_s3_with(AtRest::default()).await
}

/// Every regular file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out
}

/// Deterministic pseudo-random bytes (incompressible enough to test framing).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
