//! The workers that drain each lower tier's offload lanes: every queued
//! operation on a key (a copy, a delete, an expiry) is applied to the tier
//! in the order the key's lane received it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};

use tokio::sync::{mpsc, oneshot};

use super::events::emit;
use super::{Inner, OffloadStats};
use crate::config::OffloadMode;
use crate::error::{Result, WarehouseError};
use crate::offload::{self, Action, Lower, Op, Outcome};
use crate::tier::{Tier, TierKind};
use crate::types::{now_ms, EventKind, Evicted};

/// Waits for an operation queued on a lane.
pub(super) async fn wait(rx: oneshot::Receiver<Result<Outcome>>) -> Result<Outcome> {
    rx.await.unwrap_or_else(|_| Err(WarehouseError::Config("offload worker stopped".into())))
}

pub(super) fn offload_stats(l: &Lower) -> OffloadStats {
    let c = &l.shared.c;
    OffloadStats {
        tier: Some(l.tier.kind()),
        queued: c.queued.load(Relaxed),
        written: c.written.load(Relaxed),
        dropped: c.dropped.load(Relaxed),
        errors: c.errors.load(Relaxed),
    }
}

/// Evictions from a lower tier: announce; in `evicted` mode, disk
/// evictions go on to the remote tier when the disk still had the bytes,
/// unless the key may have changed since: `began` is the version clock
/// before the write that evicted them. An operation on the key's stripe
/// since then (a DEL landing while the evicted bytes were read back) or a
/// removal still queued for the disk (one submitted before, not applied
/// yet) drops the copy, which would bring a deleted key back.
fn handle_evicted_below(inner: &Inner, tier: TierKind, announces: bool, evicted: Vec<Evicted>, began: u64) {
    for e in evicted {
        if !announces {
            emit(&inner.events, EventKind::Removed, &e.namespace, &e.key, tier);
        }
        if tier == TierKind::Disk && inner.cfg.offload == OffloadMode::Evicted {
            if let (Some(r), Some(value)) = (&inner.remote, e.value) {
                let v = inner.stripe(&e.namespace, &e.key).lock();
                let queued = inner.disk.as_ref().and_then(|d| d.latest(&e.namespace, &e.key));
                if *v > began || queued.is_some() || inner.flushed_since(&e.namespace, began) {
                    r.shared.c.dropped.fetch_add(1, Relaxed);
                    continue;
                }
                r.offer_copy(&e.namespace, &e.key, value, e.meta);
            }
        }
    }
}

pub(super) async fn offload_worker(
    inner: Weak<Inner>,
    tier: Arc<dyn Tier>,
    mut rx: mpsc::UnboundedReceiver<Op>,
    lane: Arc<offload::LaneState>,
    shared: Arc<offload::Shared>,
    // Whether the tier announces its own changes (else this worker does).
    announces: bool,
) {
    let kind = tier.kind();
    while let Some(op) = rx.recv().await {
        let Op { ns, key, action, reply, copy } = op;
        let keyed = !matches!(action, Action::RemoveNamespace(_));
        let result = match action {
            Action::Put { value, meta } => {
                if meta.is_expired(now_ms()) {
                    // Gone already; but an older copy in the tier must not
                    // outlive it (it would be served once memory lets go).
                    let found = tier.remove(&ns, &key).await;
                    if let (Ok(true), Some(inner), false) = (&found, inner.upgrade(), announces) {
                        emit(&inner.events, EventKind::Removed, &ns, &key, kind);
                    }
                    found.map(|_| Outcome::Put(Vec::new()))
                } else {
                    let began = inner.upgrade().map_or(0, |i| i.now());
                    match tier.put(&ns, key.clone(), value, meta).await {
                        Ok(mut evicted) => {
                            // A value the tier cannot take comes back among the evictions.
                            let refused = evicted.iter().position(|e| e.namespace == ns && e.key == key);
                            let refused = refused.map(|i| evicted.remove(i));
                            let stored = refused.is_none();
                            if let Some(inner) = inner.upgrade() {
                                if stored && !announces {
                                    emit(&inner.events, EventKind::Stored, &ns, &key, kind);
                                }
                                handle_evicted_below(&inner, kind, announces, evicted, began);
                            }
                            Ok(Outcome::Put(refused.into_iter().collect()))
                        }
                        Err(e) => Err(e),
                    }
                }
            }
            Action::Remove => {
                let found = tier.remove(&ns, &key).await;
                // A caller waiting for the result (DEL) announces it; a
                // stale copy's removal is announced here.
                if reply.is_none() && !announces && matches!(found, Ok(true)) {
                    if let Some(inner) = inner.upgrade() {
                        emit(&inner.events, EventKind::Removed, &ns, &key, kind);
                    }
                }
                found.map(Outcome::Found)
            }
            Action::Expire { at } => tier.set_expiry(&ns, &key, at).await.map(Outcome::Found),
            Action::RemoveNamespace(removal) => {
                let leader = removal.arrived.wait().await.is_leader();
                let result =
                    if leader { tier.remove_namespace(&ns).await.map(Outcome::Count) } else { Ok(Outcome::Count(0)) };
                removal.done.wait().await;
                result
            }
        };
        offload::finish(&lane, &shared, &ns, keyed.then_some(&key), copy);
        match &result {
            // A copy the tier refused (too big for it) is not there: a loss.
            Ok(Outcome::Put(refused)) if copy && !refused.is_empty() => {
                shared.c.dropped.fetch_add(1, Relaxed);
            }
            Ok(Outcome::Put(_)) => {
                shared.c.written.fetch_add(1, Relaxed);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(tier = %kind, error = %e, "offload failed");
                shared.c.errors.fetch_add(1, Relaxed);
            }
        }
        if let Some(r) = reply {
            let _ = r.send(result);
        }
    }
}
