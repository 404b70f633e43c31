//! The KV block format: the same bytes on every tier and on the wire.
//!
//! A block is a fixed 64-byte little-endian header followed by the stored
//! payload. The header says what the payload holds (dtype, layout, shape,
//! token count), how it is stored (flags: compressed, encrypted), how long
//! it is, and carries a checksum of the stored payload and one of itself.
//! A reader verifies both before using a byte of the block, so a torn write
//! or a flipped bit is found, never served.
//!
//! ```text
//! off size field
//!   0    4 magic "GKVB"
//!   4    2 format version (1)
//!   6    2 flags (bit 0 compressed, bit 1 encrypted)
//!   8    1 dtype
//!   9    1 layout
//!  10    2 reserved (0)
//!  12    4 layers
//!  16    4 kv heads
//!  20    4 head dim
//!  24    4 tokens
//!  28    4 reserved (0)
//!  32    8 stored payload length
//!  40    8 raw payload length (before compression / encryption)
//!  48    8 xxh3-64 of the stored payload
//!  56    8 xxh3-64 of bytes 0..56
//! ```
//!
//! The checksum guards against accidents (torn writes, bad media), not
//! adversaries; encryption (AES-256-GCM, applied by the warehouse) is what
//! authenticates data at rest.

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: [u8; 4] = *b"GKVB";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 64;

pub const FLAG_COMPRESSED: u16 = 1 << 0;
pub const FLAG_ENCRYPTED: u16 = 1 << 1;
const KNOWN_FLAGS: u16 = FLAG_COMPRESSED | FLAG_ENCRYPTED;

/// Element type of the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum DType {
    /// Opaque bytes (values stored by clients that do not use the KV layout).
    Bytes = 0,
    F16 = 1,
    Bf16 = 2,
    F32 = 3,
    F8E4m3 = 4,
    U8 = 5,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::Bytes | DType::F8E4m3 | DType::U8 => 1,
            DType::F16 | DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }

    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => DType::Bytes,
            1 => DType::F16,
            2 => DType::Bf16,
            3 => DType::F32,
            4 => DType::F8E4m3,
            5 => DType::U8,
            _ => return None,
        })
    }
}

/// Why bytes are not a valid block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockError {
    #[error("block is {0} bytes, shorter than the {HEADER_LEN}-byte header")]
    Truncated(usize),
    #[error("bad magic: not a Granary KV block")]
    BadMagic,
    #[error("unsupported block format version {0}")]
    Version(u16),
    #[error("header checksum mismatch (corrupt header)")]
    HeaderChecksum,
    #[error("unknown flags {0:#06x}")]
    Flags(u16),
    #[error("unknown dtype {0}")]
    DType(u8),
    #[error("payload length mismatch: header says {expected} bytes, found {found}")]
    PayloadLength { expected: u64, found: u64 },
    #[error("payload checksum mismatch (corrupt or torn payload)")]
    PayloadChecksum,
    #[error("shape mismatch: {layers} layers x {kv_heads} kv heads x {head_dim} dims x {tokens} tokens of {dtype:?} need {expected} bytes, payload has {found}")]
    Shape { layers: u32, kv_heads: u32, head_dim: u32, tokens: u32, dtype: DType, expected: u64, found: u64 },
}

/// The decoded fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub version: u16,
    pub flags: u16,
    pub dtype: DType,
    pub layout: u8,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub tokens: u32,
    pub payload_len: u64,
    pub raw_len: u64,
    pub checksum: u64,
}

impl BlockHeader {
    /// A header for an opaque payload of `len` bytes.
    pub fn opaque(len: usize) -> Self {
        BlockHeader {
            version: VERSION,
            flags: 0,
            dtype: DType::Bytes,
            layout: 0,
            layers: 0,
            kv_heads: 0,
            head_dim: 0,
            tokens: 0,
            payload_len: len as u64,
            raw_len: len as u64,
            checksum: 0,
        }
    }

    pub fn compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }

    pub fn encrypted(&self) -> bool {
        self.flags & FLAG_ENCRYPTED != 0
    }

    /// Bytes the raw payload must have for the declared shape (K and V of
    /// every layer), or `None` for opaque payloads.
    pub fn expected_raw_len(&self) -> Option<u64> {
        if self.dtype == DType::Bytes {
            return None;
        }
        Some(
            2 * self.layers as u64
                * self.kv_heads as u64
                * self.head_dim as u64
                * self.tokens as u64
                * self.dtype.size() as u64,
        )
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8] = self.dtype as u8;
        b[9] = self.layout;
        b[12..16].copy_from_slice(&self.layers.to_le_bytes());
        b[16..20].copy_from_slice(&self.kv_heads.to_le_bytes());
        b[20..24].copy_from_slice(&self.head_dim.to_le_bytes());
        b[24..28].copy_from_slice(&self.tokens.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.raw_len.to_le_bytes());
        b[48..56].copy_from_slice(&self.checksum.to_le_bytes());
        let hc = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&hc.to_le_bytes());
        b
    }

    /// Decodes and checks the header alone (magic, version, header
    /// checksum, flags, dtype). The payload is checked by [`KvBlock::decode`].
    pub fn decode(b: &[u8]) -> Result<Self, BlockError> {
        if b.len() < HEADER_LEN {
            return Err(BlockError::Truncated(b.len()));
        }
        if b[0..4] != MAGIC {
            return Err(BlockError::BadMagic);
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let version = u16_at(4);
        if version != VERSION {
            return Err(BlockError::Version(version));
        }
        if xxh3_64(&b[..56]) != u64_at(56) {
            return Err(BlockError::HeaderChecksum);
        }
        let flags = u16_at(6);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(BlockError::Flags(flags));
        }
        let dtype = DType::from_u8(b[8]).ok_or(BlockError::DType(b[8]))?;
        Ok(BlockHeader {
            version,
            flags,
            dtype,
            layout: b[9],
            layers: u32_at(12),
            kv_heads: u32_at(16),
            head_dim: u32_at(20),
            tokens: u32_at(24),
            payload_len: u64_at(32),
            raw_len: u64_at(40),
            checksum: u64_at(48),
        })
    }
}

/// A header and its stored payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBlock {
    pub header: BlockHeader,
    pub payload: Bytes,
}

impl KvBlock {
    /// Frames `payload` (already compressed or encrypted if `header.flags`
    /// say so); fills in lengths and the checksum.
    pub fn new(mut header: BlockHeader, payload: Bytes) -> Self {
        header.version = VERSION;
        header.payload_len = payload.len() as u64;
        if header.flags & (FLAG_COMPRESSED | FLAG_ENCRYPTED) == 0 {
            header.raw_len = payload.len() as u64;
        }
        header.checksum = xxh3_64(&payload);
        KvBlock { header, payload }
    }

    /// A plain block of KV data with the given shape.
    #[allow(clippy::too_many_arguments)]
    pub fn kv(
        dtype: DType,
        layout: u8,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        tokens: u32,
        payload: Bytes,
    ) -> Result<Self, BlockError> {
        let header =
            BlockHeader { dtype, layout, layers, kv_heads, head_dim, tokens, ..BlockHeader::opaque(payload.len()) };
        let block = Self::new(header, payload);
        block.check_shape()?;
        Ok(block)
    }

    /// Opaque bytes framed as a block.
    pub fn opaque(payload: Bytes) -> Self {
        Self::new(BlockHeader::opaque(payload.len()), payload)
    }

    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }

    /// A buffer for [`KvBlock::encode_in`]: room for the header, then the
    /// payload's `capacity` bytes, which the caller appends.
    pub fn payload_buffer(capacity: usize) -> BytesMut {
        let mut b = BytesMut::with_capacity(HEADER_LEN + capacity);
        b.resize(HEADER_LEN, 0);
        b
    }

    /// Encodes a block whose payload was written into `buf` after its
    /// header's room ([`KvBlock::payload_buffer`]): the same bytes as
    /// [`KvBlock::new`] then [`KvBlock::encode`], without copying the
    /// payload. Version, payload length and checksum are set here; the
    /// other fields (`raw_len` too) are taken as given.
    pub fn encode_in(mut header: BlockHeader, mut buf: BytesMut) -> Bytes {
        assert!(buf.len() >= HEADER_LEN, "the buffer lacks the header's room");
        let payload = &buf[HEADER_LEN..];
        header.version = VERSION;
        header.payload_len = payload.len() as u64;
        header.checksum = xxh3_64(payload);
        buf[..HEADER_LEN].copy_from_slice(&header.encode());
        buf.freeze()
    }

    /// Header then payload, in one buffer.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        out.put_slice(&self.header.encode());
        out.put_slice(&self.payload);
        out.freeze()
    }

    /// Decodes `bytes` (exactly one block) and verifies both checksums and,
    /// for plain KV blocks, that the payload length matches the shape. The
    /// payload is a zero-copy slice of `bytes`.
    pub fn decode(bytes: Bytes) -> Result<Self, BlockError> {
        let header = BlockHeader::decode(&bytes)?;
        let found = (bytes.len() - HEADER_LEN) as u64;
        if found != header.payload_len {
            return Err(BlockError::PayloadLength { expected: header.payload_len, found });
        }
        let payload = bytes.slice(HEADER_LEN..);
        if xxh3_64(&payload) != header.checksum {
            return Err(BlockError::PayloadChecksum);
        }
        let block = KvBlock { header, payload };
        block.check_shape()?;
        Ok(block)
    }

    fn check_shape(&self) -> Result<(), BlockError> {
        let h = &self.header;
        if let Some(expected) = h.expected_raw_len() {
            if expected != h.raw_len {
                return Err(BlockError::Shape {
                    layers: h.layers,
                    kv_heads: h.kv_heads,
                    head_dim: h.head_dim,
                    tokens: h.tokens,
                    dtype: h.dtype,
                    expected,
                    found: h.raw_len,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KvBlock {
        // 2 layers x 1 kv head x 4 dims x 3 tokens x f16 x (K,V) = 96 bytes.
        let payload: Vec<u8> = (0..96u8).collect();
        KvBlock::kv(DType::F16, 0, 2, 1, 4, 3, Bytes::from(payload)).unwrap()
    }

    #[test]
    fn round_trip() {
        let b = sample();
        let enc = b.encode();
        assert_eq!(enc.len(), HEADER_LEN + 96);
        assert_eq!(&enc[..4], b"GKVB");
        let d = KvBlock::decode(enc).unwrap();
        assert_eq!(d, b);
        assert_eq!(d.header.tokens, 3);
        assert_eq!(d.header.raw_len, 96);
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let enc = sample().encode();
        for i in 0..enc.len() {
            for bit in 0..8 {
                let mut v = enc.to_vec();
                v[i] ^= 1 << bit;
                assert!(KvBlock::decode(Bytes::from(v)).is_err(), "flip at byte {i} bit {bit} went unnoticed");
            }
        }
    }

    #[test]
    fn truncation_and_extension_are_detected() {
        let enc = sample().encode();
        for n in 0..enc.len() {
            assert!(KvBlock::decode(enc.slice(..n)).is_err(), "truncated to {n} accepted");
        }
        let mut longer = enc.to_vec();
        longer.push(0);
        assert_eq!(KvBlock::decode(Bytes::from(longer)), Err(BlockError::PayloadLength { expected: 96, found: 97 }));
    }

    #[test]
    fn specific_errors() {
        let enc = sample().encode();
        assert_eq!(KvBlock::decode(enc.slice(..10)), Err(BlockError::Truncated(10)));
        let mut v = enc.to_vec();
        v[0] = b'X';
        assert_eq!(KvBlock::decode(Bytes::from(v)), Err(BlockError::BadMagic));
        let mut v = enc.to_vec();
        v[HEADER_LEN + 5] ^= 0xff;
        assert_eq!(KvBlock::decode(Bytes::from(v)), Err(BlockError::PayloadChecksum));
    }

    #[test]
    fn shape_must_match_payload() {
        let err = KvBlock::kv(DType::F16, 0, 2, 1, 4, 3, Bytes::from(vec![0u8; 95])).unwrap_err();
        assert!(matches!(err, BlockError::Shape { expected: 96, found: 95, .. }), "{err}");
        assert!(err.to_string().contains("need 96 bytes"));
    }

    #[test]
    fn opaque_blocks_carry_any_bytes() {
        let b = KvBlock::opaque(Bytes::from_static(b"\xff\x00not utf8"));
        let d = KvBlock::decode(b.encode()).unwrap();
        assert_eq!(d.header.dtype, DType::Bytes);
        assert_eq!(&d.payload[..], b"\xff\x00not utf8");
    }

    #[test]
    fn encoding_in_place_gives_the_same_bytes() {
        let payload = Bytes::from_static(b"some payload bytes");
        let mut h = BlockHeader::opaque(payload.len());
        h.flags = FLAG_COMPRESSED;
        h.raw_len = 1000;
        let mut buf = KvBlock::payload_buffer(payload.len());
        buf.extend_from_slice(&payload);
        let mut expected = KvBlock::new(h, payload);
        expected.header.raw_len = 1000;
        assert_eq!(KvBlock::encode_in(h, buf), expected.encode());
    }

    #[test]
    fn stored_flags_keep_raw_len() {
        let mut h = BlockHeader::opaque(1000);
        h.flags = FLAG_COMPRESSED;
        let b = KvBlock::new(h, Bytes::from_static(b"tiny"));
        let d = KvBlock::decode(b.encode()).unwrap();
        assert!(d.header.compressed() && !d.header.encrypted());
        assert_eq!((d.header.payload_len, d.header.raw_len), (4, 1000));
    }
}
