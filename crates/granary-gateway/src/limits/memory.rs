//! Counters in process: 16 shards, each a mutex over a map of windows
//! (calendar days and months) and rates (per minute, GCRA).
//!
//! A key belongs to exactly one tenant, so the shard is chosen by tenant:
//! every counter one request touches (its key's and its tenant's) lives in
//! the same shard, and one lock makes the admission atomic. Each shard
//! drops the windows that have ended at most every few seconds, so memory
//! is bounded by the keys and tenants active in the current windows.

use std::collections::HashMap;

use parking_lot::Mutex;

use super::{Ask, Check, LimitKind, Scope};
use crate::TenantId;

const SHARDS: usize = 16;
/// How often (at most) a shard looks for ended windows.
const PRUNE_EVERY_MS: i64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct CounterKey {
    scope: Scope,
    id: i64,
    kind: LimitKind,
    start_ms: i64,
}

impl CounterKey {
    fn of(check: &Check) -> Self {
        CounterKey { scope: check.scope, id: check.id, kind: check.kind, start_ms: check.start_ms }
    }
}

/// A calendar window's count, or a rate's theoretical arrival time.
#[derive(Debug, Clone, Copy)]
struct Counter {
    used: u64,
    end_ms: i64,
    /// For a rate (GCRA): when everything counted so far has drained, unix
    /// milliseconds; what is "used" at `now` is `(tat - now) / unit`.
    tat: f64,
}

#[derive(Default)]
struct Shard {
    counters: HashMap<CounterKey, Counter>,
    next_prune_ms: i64,
}

impl Shard {
    fn prune(&mut self, now_ms: i64) {
        if now_ms >= self.next_prune_ms {
            self.counters.retain(|_, c| c.end_ms > now_ms);
            self.next_prune_ms = now_ms.saturating_add(PRUNE_EVERY_MS);
        }
    }

    fn used(&self, check: &Check, now_ms: i64) -> u64 {
        let Some(c) = self.counters.get(&CounterKey::of(check)) else { return 0 };
        if check.kind.is_rate() {
            level(c.tat, check, now_ms)
        } else {
            c.used
        }
    }

    fn add(&mut self, check: &Check, n: u64, now_ms: i64) {
        let c =
            self.counters.entry(CounterKey::of(check)).or_insert(Counter { used: 0, end_ms: check.end_ms, tat: 0.0 });
        if check.kind.is_rate() {
            c.tat = c.tat.max(now_ms as f64) + n as f64 * check.unit_ms();
            c.end_ms = c.tat.ceil() as i64;
        } else {
            c.used = c.used.saturating_add(n);
        }
    }

    fn release(&mut self, check: &Check, n: u64, now_ms: i64) {
        let Some(c) = self.counters.get_mut(&CounterKey::of(check)) else { return };
        if check.kind.is_rate() {
            c.tat = (c.tat - n as f64 * check.unit_ms()).max(now_ms as f64);
            c.end_ms = c.tat.ceil() as i64;
        } else {
            c.used = c.used.saturating_sub(n);
        }
    }
}

/// What a rate holds at `now_ms`, given its theoretical arrival time,
/// rounded up (a part of a request or token still counts).
pub(super) fn level(tat: f64, check: &Check, now_ms: i64) -> u64 {
    let left = tat - now_ms as f64;
    if left <= 0.0 {
        0
    } else {
        (left / check.unit_ms() - 1e-6).ceil().max(0.0) as u64
    }
}

pub(super) struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
}

impl MemoryStore {
    pub(super) fn new() -> Self {
        MemoryStore { shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect() }
    }

    fn shard(&self, tenant: TenantId) -> &Mutex<Shard> {
        // Fibonacci hashing: spreads sequential ids over the shards.
        let h = (tenant as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60;
        &self.shards[h as usize % self.shards.len()]
    }

    /// Checks every window; if all admit, counts the request. Returns the
    /// failed windows as `(index into checks, used)`, and every window's
    /// count after the call.
    pub(super) fn admit(
        &self,
        tenant: TenantId,
        checks: &[Check],
        ask: &Ask,
        now_ms: i64,
    ) -> (Vec<(usize, u64)>, Vec<u64>) {
        let mut shard = self.shard(tenant).lock();
        shard.prune(now_ms);
        let failed: Vec<(usize, u64)> = checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let used = shard.used(c, now_ms);
                (!c.admits(used, ask.estimate_for(c.kind))).then_some((i, used))
            })
            .collect();
        if failed.is_empty() {
            for c in checks {
                let n = ask.reserve_for(c.kind);
                if n > 0 {
                    shard.add(c, n, now_ms);
                }
            }
        }
        let used = checks.iter().map(|c| shard.used(c, now_ms)).collect();
        (failed, used)
    }

    /// Adds `delta` (a release when negative, never below 0) to every
    /// given token or spend window.
    pub(super) fn adjust(&self, tenant: TenantId, checks: &[Check], delta: i64, now_ms: i64) {
        let mut shard = self.shard(tenant).lock();
        shard.prune(now_ms);
        for c in checks.iter().filter(|c| !c.kind.is_requests()) {
            if delta >= 0 {
                shard.add(c, delta.unsigned_abs(), now_ms);
            } else {
                shard.release(c, delta.unsigned_abs(), now_ms);
            }
        }
    }

    /// Raises each counter to at least its value.
    pub(super) fn raise(&self, tenant: TenantId, counters: &[(Check, u64)], now_ms: i64) {
        let mut shard = self.shard(tenant).lock();
        shard.prune(now_ms);
        for (c, value) in counters {
            let counter =
                shard.counters.entry(CounterKey::of(c)).or_insert(Counter { used: 0, end_ms: c.end_ms, tat: 0.0 });
            counter.used = counter.used.max(*value);
        }
    }

    /// How many windows are held (for tests of the pruning).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().counters.len()).sum()
    }
}
