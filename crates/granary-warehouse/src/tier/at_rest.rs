//! How the disk and remote tiers store a value: one [`KvBlock`] frame per
//! entry, optionally zstd-compressed and AES-256-GCM encrypted.
//!
//! This module owns the stored record format and the key material. Both
//! persistent tiers go through it, so a file written by the disk tier and an
//! object written by the remote tier have the same bytes, and every failure
//! to read one back (torn, flipped, truncated, wrong key, swapped under
//! another name) comes out as one typed [`Corrupt`] outcome instead of bad
//! bytes or a panic.
//!
//! # Record format
//!
//! The block's raw payload is a small *head* (namespace, key, expiry,
//! depth, value length) followed by the value. Head and value are sealed as
//! two sections so that recovery and metadata reads (`contains`, `meta`,
//! `scan`, the disk tier's index rebuild) read and open only the head, a
//! few KiB, instead of the whole value:
//!
//! ```text
//! KvBlock header (64 bytes: dtype Bytes, flags, payload_len, raw_len, xxh3)
//! payload:
//!   u32 LE  sealed head length
//!   sealed head   = [nonce 12 | AES-GCM(head, aad = HEAD_AAD) ]   (encrypted)
//!                 | head                                          (plain)
//!   sealed value  = [nonce 12 | AES-GCM(zstd?(value), aad = identity)] (encrypted)
//!                 | zstd?(value)                                  (plain)
//!
//! head = u8 version(1) | u16 ns_len | ns | u32 key_len | key
//!      | u8 has_expiry | u64 expires_at_ms | u32 depth | u64 value_len
//! ```
//!
//! `raw_len` in the block header is `head.len() + value_len`. The value
//! section's additional authenticated data is the entry's identity
//! (namespace and key), so an encrypted value section spliced onto another
//! entry's head fails its tag. Compression applies to the value only; the
//! head is tiny and must stay cheap to read.

use std::path::Path;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use bytes::{BufMut, Bytes, BytesMut};
use granary_core::block::{BlockError, BlockHeader, KvBlock, FLAG_COMPRESSED, FLAG_ENCRYPTED, HEADER_LEN};
use rand::RngCore;

use crate::config::EncryptionConfig;
use crate::error::{Result, WarehouseError};
use crate::types::EntryMeta;

const HEAD_VERSION: u8 = 1;
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
const HEAD_AAD: &[u8] = b"granary/at-rest/head/v1";
/// Largest namespace and key a head may carry (the store accepts less).
const MAX_NS: usize = 1024;
const MAX_KEY: usize = 64 * 1024;
/// Largest sealed head accepted.
pub const MAX_HEAD: usize = 1 + 2 + MAX_NS + 4 + MAX_KEY + 1 + 8 + 4 + 8 + NONCE_LEN + TAG_LEN;
/// Largest value a record may declare; anything larger is treated as corrupt
/// rather than trusted for an allocation.
pub const MAX_VALUE: u64 = 8 << 30;
/// Bytes from the start of a record that always cover the block header and
/// the head-length field.
pub const PREAMBLE: usize = HEADER_LEN + 4;

/// Why a stored record was refused. Every variant means the same thing to a
/// tier: drop the entry, count it, report it absent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Corrupt {
    #[error("block: {0}")]
    Block(#[from] BlockError),
    #[error("malformed record: {0}")]
    Malformed(&'static str),
    #[error("authentication failed (wrong key or tampered data)")]
    Decrypt,
    #[error("record is encrypted but no encryption key is configured")]
    NoKey,
    #[error("decompression failed: {0}")]
    Decompress(String),
    #[error("declared size {0} is out of bounds")]
    Size(u64),
    #[error("record holds another entry ({found_ns}/{found_key}) than the one asked for")]
    Mismatch { found_ns: String, found_key: String },
}

/// The head of a record: who the entry is and its metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHead {
    pub namespace: String,
    pub key: Bytes,
    pub meta: EntryMeta,
    pub value_len: u64,
}

/// A fully opened and verified record.
#[derive(Debug, Clone)]
pub struct Record {
    pub namespace: String,
    pub key: Bytes,
    pub meta: EntryMeta,
    pub value: Bytes,
}

/// Compression and encryption settings shared by the disk and remote tiers.
#[derive(Clone, Default)]
pub struct AtRest {
    /// zstd level; `None` stores values uncompressed.
    pub compression: Option<i32>,
    cipher: Option<Aes256Gcm>,
}

impl std::fmt::Debug for AtRest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtRest")
            .field("compression", &self.compression)
            .field("encrypted", &self.cipher.is_some())
            .finish()
    }
}

fn parse_hex_key(text: &str) -> Option<[u8; 32]> {
    let t = text.trim();
    if t.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(t, &mut out).ok()?;
    Some(out)
}

fn key_from_file(path: &Path) -> Result<[u8; 32]> {
    let raw = std::fs::read(path)
        .map_err(|e| WarehouseError::Config(format!("encryption key file {}: {e}", path.display())))?;
    if raw.len() == 32 {
        let mut k = [0u8; 32];
        k.copy_from_slice(&raw);
        return Ok(k);
    }
    std::str::from_utf8(&raw).ok().and_then(parse_hex_key).ok_or_else(|| {
        WarehouseError::Config(format!(
            "encryption key file {} must hold 32 raw bytes or 64 hex characters (found {} bytes)",
            path.display(),
            raw.len()
        ))
    })
}

fn key_from_env(var: &str) -> Result<[u8; 32]> {
    let v = std::env::var(var)
        .map_err(|_| WarehouseError::Config(format!("encryption key env var {var} is not set or not UTF-8")))?;
    parse_hex_key(&v)
        .ok_or_else(|| WarehouseError::Config(format!("encryption key env var {var} must hold 64 hex characters")))
}

impl AtRest {
    /// Settings from the store configuration. With `encryption` given, a key
    /// must come from exactly one of its file or env var.
    pub fn from_config(compression: Option<i32>, encryption: Option<&EncryptionConfig>) -> Result<AtRest> {
        if let Some(level) = compression {
            let range = zstd::compression_level_range();
            if !range.contains(&level) {
                return Err(WarehouseError::Config(format!(
                    "compression level {level} is outside zstd's range {}..={}",
                    range.start(),
                    range.end()
                )));
            }
        }
        let key = match encryption {
            None => None,
            Some(EncryptionConfig { key_file: Some(_), key_env: Some(_) }) => {
                return Err(WarehouseError::Config("encryption: set key_file or key_env, not both".into()))
            }
            Some(EncryptionConfig { key_file: Some(f), key_env: None }) => Some(key_from_file(f)?),
            Some(EncryptionConfig { key_file: None, key_env: Some(v) }) => Some(key_from_env(v)?),
            Some(EncryptionConfig { key_file: None, key_env: None }) => {
                return Err(WarehouseError::Config("encryption: key_file or key_env is required".into()))
            }
        };
        Ok(AtRest { compression, cipher: key.map(|k| Aes256Gcm::new(&k.into())) })
    }

    /// Settings with a key given directly (tests, embedding).
    pub fn with_key(compression: Option<i32>, key: Option<[u8; 32]>) -> AtRest {
        AtRest { compression, cipher: key.map(|k| Aes256Gcm::new(&k.into())) }
    }

    pub fn encrypted(&self) -> bool {
        self.cipher.is_some()
    }

    fn encrypt(&self, cipher: &Aes256Gcm, plain: &[u8], aad: &[u8], out: &mut BytesMut) -> Result<()> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let ct = cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: plain, aad })
            .map_err(|_| WarehouseError::Config("AES-GCM encryption failed".into()))?;
        out.put_slice(&nonce);
        out.put_slice(&ct);
        Ok(())
    }

    fn decrypt(&self, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, Corrupt> {
        let cipher = self.cipher.as_ref().ok_or(Corrupt::NoKey)?;
        if sealed.len() < NONCE_LEN + TAG_LEN {
            return Err(Corrupt::Malformed("encrypted section shorter than nonce and tag"));
        }
        let (nonce, ct) = sealed.split_at(NONCE_LEN);
        cipher.decrypt(Nonce::from_slice(nonce), Payload { msg: ct, aad }).map_err(|_| Corrupt::Decrypt)
    }

    /// Encodes an entry as a stored record (see the module docs).
    pub fn seal(&self, ns: &str, key: &[u8], meta: EntryMeta, value: &[u8]) -> Result<Bytes> {
        if ns.len() > MAX_NS || key.len() > MAX_KEY {
            return Err(WarehouseError::invalid("key", "namespace or key too long for a stored record"));
        }
        let head = encode_head(ns, key, meta, value.len() as u64);
        let compressed;
        let body: &[u8] = match self.compression {
            Some(level) => {
                compressed = zstd::bulk::compress(value, level)
                    .map_err(|e| WarehouseError::Config(format!("zstd compression failed: {e}")))?;
                &compressed
            }
            None => value,
        };
        let mut flags = 0;
        if self.compression.is_some() {
            flags |= FLAG_COMPRESSED;
        }
        let extra = if self.cipher.is_some() { 2 * (NONCE_LEN + TAG_LEN) } else { 0 };
        // The record is built in one buffer, header room first: the value is
        // copied once (a large one is megabytes).
        let mut payload = KvBlock::payload_buffer(4 + head.len() + body.len() + extra);
        let at = payload.len();
        payload.put_u32_le(0);
        match &self.cipher {
            Some(cipher) => {
                flags |= FLAG_ENCRYPTED;
                self.encrypt(cipher, &head, HEAD_AAD, &mut payload)?;
                let head_len = (payload.len() - at - 4) as u32;
                payload[at..at + 4].copy_from_slice(&head_len.to_le_bytes());
                self.encrypt(cipher, body, &identity(ns, key), &mut payload)?;
            }
            None => {
                payload[at..at + 4].copy_from_slice(&(head.len() as u32).to_le_bytes());
                payload.put_slice(&head);
                payload.put_slice(body);
            }
        }
        let mut header = BlockHeader::opaque(0);
        header.flags = flags;
        // The raw length counts head and value only (not the length field or
        // the nonces).
        header.raw_len = (head.len() + value.len()) as u64;
        Ok(KvBlock::encode_in(header, payload))
    }

    /// How many bytes from the start of a record hold its header and head,
    /// from the first [`PREAMBLE`] bytes. Checks the header and that the
    /// record's total length is `total_len` when given.
    pub fn head_span(preamble: &[u8], total_len: Option<u64>) -> Result<usize, Corrupt> {
        let header = BlockHeader::decode(preamble)?;
        if let Some(total) = total_len {
            let found = total.saturating_sub(HEADER_LEN as u64);
            if total < HEADER_LEN as u64 || found != header.payload_len {
                return Err(BlockError::PayloadLength { expected: header.payload_len, found }.into());
            }
        }
        if preamble.len() < PREAMBLE {
            return Err(Corrupt::Malformed("record shorter than its preamble"));
        }
        let head_len = u32::from_le_bytes(preamble[HEADER_LEN..PREAMBLE].try_into().expect("4 bytes")) as usize;
        if head_len > MAX_HEAD || (4 + head_len) as u64 > header.payload_len {
            return Err(Corrupt::Size(head_len as u64));
        }
        Ok(PREAMBLE + head_len)
    }

    /// Opens only the head from the first [`AtRest::head_span`] bytes of a
    /// record (header checksum verified, payload checksum not: use
    /// [`AtRest::open`] before serving a value).
    pub fn open_head(&self, bytes: &[u8], total_len: Option<u64>) -> Result<RecordHead, Corrupt> {
        let span = Self::head_span(bytes, total_len)?;
        if bytes.len() < span {
            return Err(Corrupt::Malformed("record shorter than its head"));
        }
        let header = BlockHeader::decode(bytes)?;
        self.decode_head_section(&header, &bytes[PREAMBLE..span])
    }

    fn decode_head_section(&self, header: &BlockHeader, sealed: &[u8]) -> Result<RecordHead, Corrupt> {
        let head = if header.encrypted() {
            decode_head(&self.decrypt(sealed, HEAD_AAD)?)?
        } else {
            if self.cipher.is_some() {
                // A plain record where encryption is required was not written by us.
                return Err(Corrupt::Malformed("unencrypted record in an encrypted tier"));
            }
            decode_head(sealed)?
        };
        let raw = header.raw_len;
        if head.value_len > MAX_VALUE || raw != head_len_plain(&head) as u64 + head.value_len {
            return Err(Corrupt::Size(raw));
        }
        Ok(head)
    }

    /// Verifies and opens a whole record. With `expect`, the namespace and
    /// key inside must be those.
    pub fn open(&self, bytes: Bytes, expect: Option<(&str, &[u8])>) -> Result<Record, Corrupt> {
        let block = KvBlock::decode(bytes)?;
        let header = block.header;
        let payload = block.payload;
        if payload.len() < 4 {
            return Err(Corrupt::Malformed("payload shorter than its head length"));
        }
        let head_len = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes")) as usize;
        if head_len > MAX_HEAD || 4 + head_len > payload.len() {
            return Err(Corrupt::Size(head_len as u64));
        }
        let head = self.decode_head_section(&header, &payload[4..4 + head_len])?;
        if let Some((ns, key)) = expect {
            if head.namespace != ns || head.key != key {
                return Err(Corrupt::Mismatch {
                    found_ns: head.namespace.clone(),
                    found_key: String::from_utf8_lossy(&head.key).into_owned(),
                });
            }
        }
        let body = payload.slice(4 + head_len..);
        let body = if header.encrypted() {
            Bytes::from(self.decrypt(&body, &identity(&head.namespace, &head.key))?)
        } else {
            body
        };
        let value = if header.compressed() {
            let cap = usize::try_from(head.value_len).map_err(|_| Corrupt::Size(head.value_len))?;
            let out = zstd::bulk::decompress(&body, cap).map_err(|e| Corrupt::Decompress(e.to_string()))?;
            Bytes::from(out)
        } else {
            body
        };
        if value.len() as u64 != head.value_len {
            return Err(Corrupt::Size(value.len() as u64));
        }
        Ok(Record { namespace: head.namespace, key: head.key, meta: head.meta, value })
    }
}

/// Additional authenticated data binding a value section to its entry.
fn identity(ns: &str, key: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(26 + ns.len() + key.len());
    v.extend_from_slice(b"granary/at-rest/value/v1");
    v.extend_from_slice(&(ns.len() as u16).to_le_bytes());
    v.extend_from_slice(ns.as_bytes());
    v.extend_from_slice(key);
    v
}

fn head_len_plain(h: &RecordHead) -> usize {
    head_len_of(h.namespace.len(), h.key.len())
}

fn head_len_of(ns_len: usize, key_len: usize) -> usize {
    1 + 2 + ns_len + 4 + key_len + 1 + 8 + 4 + 8
}

/// Where the value starts in a plain (neither compressed nor encrypted)
/// record of `ns` and `key`.
pub fn value_offset(ns: &str, key: &[u8]) -> usize {
    PREAMBLE + head_len_of(ns.len(), key.len())
}

/// Alignment [`AlignedBuf`] gives a record's value.
pub const VALUE_ALIGN: usize = 64;

/// A read buffer placed so that byte `value_at` of what is read into it
/// lands on a [`VALUE_ALIGN`] boundary. Values are usually KV block frames
/// (a 64-byte header, then f16 K and V): aligned, the engine uses them in
/// place instead of copying a misaligned payload.
pub struct AlignedBuf {
    buf: Vec<u8>,
    pad: usize,
}

impl AlignedBuf {
    /// Room for `len` bytes, the value of the record at `value_at`.
    pub fn new(len: usize, value_at: usize) -> Self {
        let mut buf = Vec::with_capacity(len + VALUE_ALIGN);
        let addr = buf.as_ptr() as usize + value_at;
        let pad = (VALUE_ALIGN - addr % VALUE_ALIGN) % VALUE_ALIGN;
        buf.resize(pad, 0);
        AlignedBuf { buf, pad }
    }

    /// The buffer to append the read to (it already holds the padding).
    pub fn vec(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// What was read (still aligned unless it outgrew the room asked for).
    pub fn freeze(self) -> Bytes {
        Bytes::from(self.buf).slice(self.pad..)
    }
}

fn encode_head(ns: &str, key: &[u8], meta: EntryMeta, value_len: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(28 + ns.len() + key.len());
    v.push(HEAD_VERSION);
    v.extend_from_slice(&(ns.len() as u16).to_le_bytes());
    v.extend_from_slice(ns.as_bytes());
    v.extend_from_slice(&(key.len() as u32).to_le_bytes());
    v.extend_from_slice(key);
    v.push(meta.expires_at_ms.is_some() as u8);
    v.extend_from_slice(&meta.expires_at_ms.unwrap_or(0).to_le_bytes());
    v.extend_from_slice(&meta.depth.to_le_bytes());
    v.extend_from_slice(&value_len.to_le_bytes());
    v
}

/// A bounds-checked reader over a head.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if self.0.len() < n {
            return Err(Corrupt::Malformed("head truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Corrupt> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Corrupt> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, Corrupt> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, Corrupt> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

fn decode_head(b: &[u8]) -> Result<RecordHead, Corrupt> {
    let mut c = Cursor(b);
    if c.u8()? != HEAD_VERSION {
        return Err(Corrupt::Malformed("unknown record head version"));
    }
    let ns_len = c.u16()? as usize;
    if ns_len > MAX_NS {
        return Err(Corrupt::Size(ns_len as u64));
    }
    let namespace =
        std::str::from_utf8(c.take(ns_len)?).map_err(|_| Corrupt::Malformed("namespace not UTF-8"))?.to_string();
    let key_len = c.u32()? as usize;
    if key_len > MAX_KEY {
        return Err(Corrupt::Size(key_len as u64));
    }
    let key = Bytes::copy_from_slice(c.take(key_len)?);
    let has_expiry = match c.u8()? {
        0 => false,
        1 => true,
        _ => return Err(Corrupt::Malformed("bad expiry flag")),
    };
    let at = c.u64()?;
    let depth = c.u32()?;
    let value_len = c.u64()?;
    if !c.0.is_empty() {
        return Err(Corrupt::Malformed("trailing bytes after head"));
    }
    Ok(RecordHead { namespace, key, meta: EntryMeta { expires_at_ms: has_expiry.then_some(at), depth }, value_len })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<AtRest> {
        vec![
            AtRest::default(),
            AtRest::with_key(Some(3), None),
            AtRest::with_key(None, Some([7; 32])),
            AtRest::with_key(Some(1), Some([9; 32])),
        ]
    }

    #[test]
    fn round_trip_and_head() {
        let meta = EntryMeta { expires_at_ms: Some(12345), depth: 7 };
        let value: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for a in all() {
            let sealed = a.seal("ns", b"\xffkey", meta, &value).unwrap();
            let r = a.open(sealed.clone(), Some(("ns", b"\xffkey"))).unwrap();
            assert_eq!((r.namespace.as_str(), &r.key[..], r.meta), ("ns", &b"\xffkey"[..], meta));
            assert_eq!(&r.value[..], &value[..]);
            let span = AtRest::head_span(&sealed[..PREAMBLE], Some(sealed.len() as u64)).unwrap();
            let h = a.open_head(&sealed[..span], Some(sealed.len() as u64)).unwrap();
            assert_eq!((h.meta, h.value_len), (meta, value.len() as u64));
            let block = KvBlock::decode(sealed.clone()).unwrap();
            assert_eq!(block.header.compressed(), a.compression.is_some());
            assert_eq!(block.header.encrypted(), a.encrypted());
            assert!(matches!(a.open(sealed, Some(("ns", b"other"))), Err(Corrupt::Mismatch { .. })));
        }
    }

    #[test]
    fn every_flip_and_cut_is_refused() {
        for a in all() {
            let sealed = a.seal("n", b"k", EntryMeta::default(), b"some value bytes").unwrap();
            for i in 0..sealed.len() {
                let mut v = sealed.to_vec();
                v[i] ^= 0x40;
                assert!(a.open(Bytes::from(v), Some(("n", b"k"))).is_err(), "flip at {i}");
                assert!(a.open(sealed.slice(..i), Some(("n", b"k"))).is_err(), "cut at {i}");
            }
        }
    }

    #[test]
    fn wrong_or_missing_key_is_corrupt() {
        let a = AtRest::with_key(None, Some([1; 32]));
        let sealed = a.seal("n", b"k", EntryMeta::default(), b"secret").unwrap();
        let wrong = AtRest::with_key(None, Some([2; 32]));
        assert_eq!(wrong.open(sealed.clone(), None).unwrap_err(), Corrupt::Decrypt);
        assert_eq!(AtRest::default().open(sealed, None).unwrap_err(), Corrupt::NoKey);
    }

    #[test]
    fn key_sources() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("raw");
        std::fs::write(&raw, [5u8; 32]).unwrap();
        let hexf = dir.path().join("hex");
        std::fs::write(&hexf, format!("{}\n", hex::encode([5u8; 32]))).unwrap();
        let bad = dir.path().join("bad");
        std::fs::write(&bad, b"short").unwrap();
        let cfg = |f: &Path| EncryptionConfig { key_file: Some(f.to_path_buf()), key_env: None };
        let a = AtRest::from_config(None, Some(&cfg(&raw))).unwrap();
        let b = AtRest::from_config(None, Some(&cfg(&hexf))).unwrap();
        let sealed = a.seal("n", b"k", EntryMeta::default(), b"v").unwrap();
        assert_eq!(&b.open(sealed, None).unwrap().value[..], b"v");
        let err = AtRest::from_config(None, Some(&cfg(&bad))).unwrap_err().to_string();
        assert!(err.contains("bad") && err.contains("64 hex"), "{err}");
        let env = EncryptionConfig { key_file: None, key_env: Some("GRANARY_TEST_UNSET_KEY_VAR".into()) };
        let err = AtRest::from_config(None, Some(&env)).unwrap_err().to_string();
        assert!(err.contains("GRANARY_TEST_UNSET_KEY_VAR"), "{err}");
        assert!(AtRest::from_config(Some(1000), None).is_err());
    }
}
