//! Decodes arbitrary bytes as a KV block: never panics, and a block that
//! decodes re-encodes to the same bytes and decodes to the same block.
#![no_main]

use bytes::Bytes;
use granary_core::KvBlock;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let bytes = Bytes::copy_from_slice(data);
    if let Ok(block) = KvBlock::decode(bytes.clone()) {
        let encoded = block.encode();
        assert_eq!(encoded, bytes, "re-encoding a decoded block changed its bytes");
        let again = KvBlock::decode(encoded).expect("a re-encoded block must decode");
        assert_eq!(again, block);
    }
    // Any payload framed as a block must round-trip.
    let framed = KvBlock::opaque(bytes);
    let back = KvBlock::decode(framed.encode()).expect("an encoded opaque block must decode");
    assert_eq!(back, framed);
});
