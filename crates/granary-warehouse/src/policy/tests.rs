//! Properties every policy must keep, checked over seeded random operations.

use std::collections::{BTreeMap, BTreeSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const BUDGET: u64 = 200;

/// Drives `p` like a tier with a `BUDGET`-byte budget through random
/// inserts, reads, removals, pins and forced evictions, checking after each
/// step that the policy agrees with a model of what is live.
fn fuzz<P: Check>(mut p: P, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut live: BTreeMap<EntryId, u64> = BTreeMap::new(); // id → size
    let mut pinned: BTreeSet<EntryId> = BTreeSet::new();
    let mut gone: BTreeSet<EntryId> = BTreeSet::new(); // evicted or removed
    let mut bytes = 0u64;
    let mut next_id: EntryId = 1;
    let mut evictions = 0;

    // One eviction under the current pins, checked against the model.
    let evict_one = |p: &mut P,
                     live: &mut BTreeMap<EntryId, u64>,
                     pinned: &BTreeSet<EntryId>,
                     gone: &mut BTreeSet<EntryId>,
                     bytes: &mut u64|
     -> Option<EntryId> {
        let victim = p.evict(&mut |id| {
            assert!(live.contains_key(&id), "asked about id {id}, which is not live");
            !pinned.contains(&id)
        });
        match victim {
            Some(v) => {
                assert!(!pinned.contains(&v), "evicted pinned id {v}");
                let size = live.remove(&v).unwrap_or_else(|| panic!("evicted id {v}, which is not live"));
                *bytes -= size;
                assert!(gone.insert(v), "id {v} left twice");
            }
            None => assert!(live.keys().all(|id| pinned.contains(id)), "None while an unpinned entry is live"),
        }
        victim
    };

    let pick = |rng: &mut StdRng, live: &BTreeMap<EntryId, u64>| -> Option<EntryId> {
        (!live.is_empty()).then(|| *live.keys().nth(rng.random_range(0..live.len())).unwrap())
    };

    for _ in 0..3000 {
        match rng.random_range(0..12) {
            0..=4 => {
                let size = rng.random_range(1..=8);
                while bytes + size > BUDGET {
                    if evict_one(&mut p, &mut live, &pinned, &mut gone, &mut bytes).is_none() {
                        break;
                    }
                    evictions += 1;
                }
                // Few fingerprints, so that evicted keys come back (ghost hits).
                let fp = rng.random_range(0..150);
                p.insert(next_id, fp, size, rng.random_range(0..32));
                live.insert(next_id, size);
                bytes += size;
                next_id += 1;
            }
            5..=7 => match pick(&mut rng, &live) {
                Some(id) if rng.random_bool(0.9) => p.access(id),
                _ => p.access(next_id + 7), // unknown ids are ignored
            },
            8 => {
                if let Some(id) = pick(&mut rng, &live) {
                    p.remove(id);
                    bytes -= live.remove(&id).unwrap();
                    pinned.remove(&id);
                    assert!(gone.insert(id));
                } else if let Some(&id) = gone.iter().next() {
                    p.remove(id); // already gone: no effect
                }
            }
            9 | 10 => {
                if let Some(id) = pick(&mut rng, &live) {
                    if !pinned.remove(&id) {
                        pinned.insert(id);
                    }
                }
            }
            _ => {
                if evict_one(&mut p, &mut live, &pinned, &mut gone, &mut bytes).is_some() {
                    evictions += 1;
                }
            }
        }
        p.check();
        assert_eq!(p.len(), live.len(), "{}: len disagrees", p.name());
    }
    assert!(evictions > 100, "the run should exercise eviction ({evictions})");

    // Pinned entries survived everything; once unpinned they drain.
    assert!(pinned.iter().all(|id| live.contains_key(id)));
    pinned.clear();
    while evict_one(&mut p, &mut live, &pinned, &mut gone, &mut bytes).is_some() {
        p.check();
    }
    assert!(live.is_empty() && p.is_empty() && bytes == 0);
    assert_eq!(gone.len() as u64, next_id - 1, "every inserted id left exactly once");
}

#[test]
fn random_operations_keep_invariants() {
    for seed in 0..4 {
        fuzz(Lru::default(), seed);
        fuzz(Fifo::default(), seed);
        fuzz(Lfu::default(), seed);
        fuzz(Cost::default(), seed);
        fuzz(S3Fifo::new(BUDGET), seed);
        fuzz(S3Fifo::new(0), seed);
    }
}

#[test]
fn kinds_build_their_policy() {
    for kind in PolicyKind::ALL {
        let mut p = kind.build(1000);
        assert_eq!(p.name(), kind.as_str());
        assert_eq!(kind.as_str().parse::<PolicyKind>(), Ok(kind));
        p.insert(1, 1, 10, 0);
        p.insert(2, 2, 10, 0);
        assert_eq!(p.len(), 2);
        p.remove(1);
        assert_eq!(p.evict(&mut |_| true), Some(2));
        assert!(p.is_empty());
    }
}
