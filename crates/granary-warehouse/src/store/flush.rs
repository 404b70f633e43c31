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
    /// The last flush cut of `ns` (0: never flushed): a value written at
    /// that version or before was flushed and must not be copied anywhere.
    pub(super) fn flush_cut(&self, ns: &str) -> u64 {
        self.flushes.lock().get(ns).map_or(0, |f| f.cut)
    }

    /// Whether a flush of `ns` runs now or cut at clock reading `since` or
    /// later: what a read or copy that began at `since` found may be flushed.
    pub(super) fn flushed_since(&self, ns: &str, since: u64) -> bool {
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
        }
        result.map(|()| n)
    }
}
