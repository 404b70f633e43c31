//! FLUSHDB: removing a namespace from every tier at one cut, with writes
//! running.

use super::*;

/// A namespace's flushes: how many run now, and the last one's cut.
#[derive(Default)]
pub(super) struct Flush {
    pub(super) running: u32,
    pub(super) cut: u64,
}

impl Inner {
    /// Whether a value of `ns` written at `version` was flushed since (its
    /// version is at or before the namespace's last cut), so must not be
    /// copied anywhere. On the write path: without the lock while `version`
    /// is newer than every cut, as good as always.
    pub(super) fn flushed(&self, ns: &str, version: u64) -> bool {
        if version > self.flush_max.load(Relaxed) {
            return false;
        }
        self.flushes.lock().get(ns).is_some_and(|f| version <= f.cut)
    }

    /// Whether a flush of `ns` runs now or cut at clock reading `since` or
    /// later: what a read or copy that began at `since` found may be
    /// flushed. Without the lock when no flush runs and none cut since.
    pub(super) fn flushed_since(&self, ns: &str, since: u64) -> bool {
        if self.flushes_running.load(Relaxed) == 0 && since > self.flush_max.load(Relaxed) {
            return false;
        }
        self.flushes.lock().get(ns).is_some_and(|f| f.running > 0 || f.cut >= since)
    }
}

impl Store {
    /// Removes every key of a namespace from every tier; how many entries.
    ///
    /// One cut decides what goes: it is taken with every key lock held, so
    /// no write is half done. A write up to the cut queued its copies
    /// before the removals queued here and is removed from every tier; a
    /// later one queues after them and stays whole. Until the flush ends,
    /// nothing of the namespace is promoted or copied down from an eviction
    /// unless it was written after the cut. Other namespaces are untouched.
    pub async fn delete_namespace(&self, ns: &str) -> Result<u64> {
        validate(ns, b"-")?;
        let (cut, waits) = {
            let _all: Vec<_> = self.inner.stripes.iter().map(|s| s.lock()).collect();
            let cut = self.inner.now();
            {
                let mut f = self.inner.flushes.lock();
                let f = f.entry(ns.to_string()).or_default();
                f.running += 1;
                f.cut = cut;
                // Under the map's lock: a checker that reads `flush_max`
                // after this sees the cut, one before it has no value to lose.
                self.inner.flushes_running.fetch_add(1, Relaxed);
                self.inner.flush_max.fetch_max(cut, Relaxed);
            }
            let waits: Vec<_> = self.lower().flat_map(|l| l.submit_namespace(ns)).collect();
            (cut, waits)
        };
        let mut n = 0;
        let mut result = Ok(());
        for rx in waits {
            match wait(rx).await {
                Ok(Outcome::Count(c)) => n += c,
                Ok(_) => {}
                Err(e) => {
                    result = result.and(Err(e));
                }
            }
        }
        n += self.inner.memory.remove_namespace_upto(ns, cut);
        if let Some(f) = self.inner.flushes.lock().get_mut(ns) {
            f.running -= 1;
            self.inner.flushes_running.fetch_sub(1, Relaxed);
        }
        result.map(|()| n)
    }
}
