//! `stored` / `removed` events: the broadcast channel routers subscribe to.
//! Tiers announce their own changes through a sink built in
//! [`Store::with_tiers`]; the store announces for tiers that cannot.

use bytes::Bytes;
use tokio::sync::broadcast;

use super::Store;
use crate::tier::TierKind;
use crate::types::{Event, EventKind};

impl Store {
    /// Subscribes to `stored` / `removed` events. A subscriber that falls
    /// more than 8192 events behind loses the oldest (and is told so).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    pub(super) fn emit(&self, kind: EventKind, ns: &str, key: &Bytes, tier: TierKind) {
        emit(&self.inner.events, kind, ns, key, tier);
    }
}

pub(super) fn emit(events: &broadcast::Sender<Event>, kind: EventKind, ns: &str, key: &Bytes, tier: TierKind) {
    if events.receiver_count() > 0 {
        let _ = events.send(Event { kind, namespace: ns.to_string(), key: key.clone(), tier });
    }
}
