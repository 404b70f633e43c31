//! The background sweep that drops expired entries so they stop taking
//! budget: memory and disk every tick, the remote tier a page at a time.

use std::sync::Weak;
use std::time::Duration;

use super::Inner;
use crate::tier::Tier;

/// Drops expired entries in the background so they stop taking budget.
/// Ticks of the sweeper between two pages of the remote tier's TTL sweep.
const REMOTE_SWEEP_TICKS: u64 = 10;
/// Objects one page of the remote TTL sweep examines: with a tick of 500 ms,
/// at most about 50 listed objects and head reads a second per node.
pub const REMOTE_SWEEP_PAGE: usize = 256;

pub(super) async fn sweeper(inner: Weak<Inner>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut n = 0u64;
    loop {
        tick.tick().await;
        n += 1;
        let Some(inner) = inner.upgrade() else { return };
        let _ = inner.memory.purge_expired(10_000).await;
        if let Some(d) = &inner.disk {
            let _ = d.tier.purge_expired(10_000).await;
        }
        if n.is_multiple_of(REMOTE_SWEEP_TICKS) {
            if let Some(r) = &inner.remote {
                // Apart from the tick loop, so a slow bucket never delays the
                // memory and disk sweeps; a pass still running skips the next.
                let r = r.tier.clone();
                tokio::spawn(async move {
                    if let Err(e) = r.purge_expired(REMOTE_SWEEP_PAGE).await {
                        tracing::debug!(error = %e, "remote TTL sweep failed");
                    }
                });
            }
        }
    }
}
