//! The local disk tier.

use crate::config::DiskConfig;
use crate::error::{Result, WarehouseError};
use crate::tier::at_rest::AtRest;
use crate::tier::memory::MemoryTier;

pub type DiskTier = MemoryTier;

pub async fn open_disk(_cfg: &DiskConfig, _at_rest: AtRest) -> Result<DiskTier> {
    Err(WarehouseError::Config("the disk tier is not available in this build".into()))
}
