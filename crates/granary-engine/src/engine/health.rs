//! Whether the engine can serve: its step thread alive and stepping while
//! there is work, and no KV load stuck past its timeout.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A busy step loop that has not stepped for this long is stalled.
pub const STALL_AFTER: Duration = Duration::from_secs(120);

pub(super) struct Health {
    start: Instant,
    /// Milliseconds since `start` at the step loop's last turn.
    last_beat_ms: AtomicU64,
    /// Why the step thread ended, once it has.
    dead: Mutex<Option<String>>,
    /// KV loads in flight: id to start.
    loads: Mutex<BTreeMap<u64, Instant>>,
    next_load: AtomicU64,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            start: Instant::now(),
            last_beat_ms: AtomicU64::new(0),
            dead: Mutex::new(None),
            loads: Mutex::new(BTreeMap::new()),
            next_load: AtomicU64::new(0),
        }
    }
}

/// One KV load in flight; dropping it ends it.
pub(super) struct Load<'a> {
    health: &'a Health,
    id: u64,
}

impl Drop for Load<'_> {
    fn drop(&mut self) {
        self.health.loads.lock().remove(&self.id);
    }
}

impl Health {
    pub fn beat(&self) {
        self.last_beat_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    pub fn dead(&self, why: &str) {
        *self.dead.lock() = Some(why.to_string());
    }

    pub fn dead_reason(&self) -> Option<String> {
        self.dead.lock().clone()
    }

    pub fn loading(&self) -> Load<'_> {
        let id = self.next_load.fetch_add(1, Ordering::Relaxed);
        self.loads.lock().insert(id, Instant::now());
        Load { health: self, id }
    }

    /// `busy`: requests are running or waiting. A load older than twice
    /// its timeout means the loader itself is wedged (the timeout did not
    /// fire).
    pub fn check(&self, busy: bool, load_timeout: Duration) -> Result<(), String> {
        if let Some(why) = self.dead_reason() {
            return Err(why);
        }
        let since_beat =
            self.start.elapsed().saturating_sub(Duration::from_millis(self.last_beat_ms.load(Ordering::Relaxed)));
        if busy && since_beat > STALL_AFTER {
            return Err(format!("the step loop has not stepped for {} s with requests pending", since_beat.as_secs()));
        }
        let oldest = self.loads.lock().values().min().copied();
        if let Some(t) = oldest.filter(|t| t.elapsed() > load_timeout * 2) {
            return Err(format!("a KV load has been in flight for {} s", t.elapsed().as_secs()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_a_dead_thread_and_a_wedged_load() {
        let h = Health::default();
        h.beat();
        assert_eq!(h.check(true, Duration::from_secs(30)), Ok(()));
        let load = h.loading();
        assert_eq!(h.check(false, Duration::ZERO).map_err(|e| e.contains("KV load")), Err(true));
        drop(load);
        assert_eq!(h.check(false, Duration::ZERO), Ok(()));
        h.dead("the step thread panicked");
        assert_eq!(h.check(false, Duration::from_secs(30)), Err("the step thread panicked".into()));
    }
}
