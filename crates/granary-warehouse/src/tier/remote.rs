//! The local remote tier.

use crate::config::RemoteConfig;
use crate::error::{Result, WarehouseError};
use crate::tier::at_rest::AtRest;
use crate::tier::memory::MemoryTier;

pub type RemoteTier = MemoryTier;

pub async fn open_remote(_cfg: &RemoteConfig, _at_rest: AtRest) -> Result<RemoteTier> {
    Err(WarehouseError::Config("the remote tier is not available in this build".into()))
}
