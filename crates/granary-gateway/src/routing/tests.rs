use std::sync::Arc;
use std::time::Duration;

use granary_core::hash::{BlockHash, HashChain};

use super::*;
use crate::types::Priority;

fn cands(loads: &[(usize, usize)]) -> Vec<Candidate> {
    loads
        .iter()
        .enumerate()
        .map(|(i, &(active, max_active))| Candidate { index: i, active, max_active, publishes_events: true })
        .collect()
}

fn req(blocks: &[BlockHash]) -> RouteRequest<'_> {
    RouteRequest { namespace: "t", session: None, blocks, by_upstream: &[] }
}

fn blocks(n: usize, seed: u32) -> Vec<BlockHash> {
    let chain = HashChain::new("t", b"model", b"layout", 4);
    let tokens: Vec<u32> = (0..n as u32 * 4).map(|i| i + seed * 100_000).collect();
    chain.hashes(&tokens)
}

#[test]
fn round_robin_rotates_and_puts_full_upstreams_last() {
    let p = RoundRobin::default();
    let c = cands(&[(0, 0), (0, 0), (0, 0)]);
    let firsts: Vec<usize> = (0..6).map(|_| p.rank(&req(&[]), &c)[0]).collect();
    assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
    let c = cands(&[(1, 1), (0, 1), (0, 0)]);
    for _ in 0..3 {
        let r = p.rank(&req(&[]), &c);
        assert_eq!(r.len(), 3);
        assert_eq!(*r.last().unwrap(), 0, "the full one goes last: {r:?}");
    }
}

#[test]
fn least_load_picks_the_idlest_relative_to_capacity() {
    let p = LeastLoad::default();
    assert_eq!(p.rank(&req(&[]), &cands(&[(3, 0), (1, 0), (2, 0)]))[0], 1);
    // 4 of 8 is less loaded than 3 of 4.
    assert_eq!(p.rank(&req(&[]), &cands(&[(3, 4), (4, 8)]))[0], 1);
    // Ties rotate.
    let c = cands(&[(0, 0), (0, 0)]);
    let a = p.rank(&req(&[]), &c)[0];
    let b = p.rank(&req(&[]), &c)[0];
    assert_ne!(a, b);
}

#[test]
fn sessions_stick_and_move_minimally() {
    let p = Session::default();
    let c = cands(&[(0, 0), (5, 0), (0, 0), (0, 0)]);
    let place = |c: &[Candidate], s: &str| {
        p.rank(&RouteRequest { namespace: "t", session: Some(s), blocks: &[], by_upstream: &[] }, c)[0]
    };
    let sessions: Vec<String> = (0..200).map(|i| format!("conversation-{i}")).collect();
    let before: Vec<usize> = sessions.iter().map(|s| place(&c, s)).collect();
    assert_eq!(before, sessions.iter().map(|s| place(&c, s)).collect::<Vec<_>>(), "stable");
    let used: HashSet<usize> = before.iter().copied().collect();
    assert_eq!(used.len(), 4, "sessions spread over every upstream, load aside");
    // Upstream 2 leaves: only its sessions move.
    let without: Vec<Candidate> = c.iter().filter(|x| x.index != 2).cloned().collect();
    for (s, b) in sessions.iter().zip(&before) {
        let now = place(&without, s);
        if *b != 2 {
            assert_eq!(now, *b, "{s} moved although its upstream stayed");
        }
    }
    // No session: by load.
    assert_ne!(p.rank(&req(&[]), &c)[0], 1);
}

#[test]
fn kv_aware_prefers_the_longest_prefix_until_load_outweighs_it() {
    let index = Arc::new(KvIndex::new());
    let p = KvAware::new(index.clone(), 1.0, 1000);
    let prompt = blocks(10, 1);
    index.insert(1, &prompt[..8]);
    index.insert(2, &prompt[..3]);
    index.insert(0, &prompt[5..]); // not a prefix: worth nothing
    assert_eq!(index.prefix_match(1, &prompt), 8);
    assert_eq!(index.prefix_match(0, &prompt), 0);
    assert_eq!(p.rank(&req(&prompt), &cands(&[(0, 0), (0, 0), (0, 0)])), vec![1, 2, 0]);
    // Upstream 1 is busy: 8 - 6 < 3 - 0.
    assert_eq!(p.rank(&req(&prompt), &cands(&[(0, 0), (6, 0), (0, 0)]))[0], 2);
    // Full upstreams go last, whatever they hold.
    assert_eq!(*p.rank(&req(&prompt), &cands(&[(0, 0), (2, 2), (0, 0)])).last().unwrap(), 1);
    // Without blocks it goes by load.
    assert_eq!(p.rank(&req(&[]), &cands(&[(3, 0), (1, 0), (2, 0)]))[0], 1);
}

#[test]
fn kv_index_follows_events() {
    let index = KvIndex::new();
    let b = blocks(3, 2);
    let hex: Vec<String> = b.iter().map(BlockHash::to_hex).collect();
    let ev = |kind: &str, hashes: Vec<String>| KvEventMsg {
        kind: kind.into(),
        namespace: "t".into(),
        tier: "engine".into(),
        hashes,
    };
    index.apply(0, &ev("stored", hex.clone()));
    assert_eq!(index.prefix_match(0, &b), 3);
    index.apply(0, &ev("removed", vec![hex[1].clone()]));
    assert_eq!(index.prefix_match(0, &b), 1);
    index.apply(0, &ev("stored", vec!["zz-not-hex".into(), hex[1].clone()]));
    assert_eq!(index.prefix_match(0, &b), 3);
    assert_eq!(index.bad_hashes(), 1);
    index.apply(0, &ev("reset", vec![]));
    assert_eq!(index.blocks(0), 0);
    index.insert(1, &b);
    index.forget(1);
    assert_eq!(index.prefix_match(1, &b), 0);
}

#[test]
fn the_approximate_index_learns_from_routing_and_stays_bounded() {
    let index = Arc::new(KvIndex::new());
    let p = KvAware::new(index, 1.0, 4);
    let prompt = blocks(3, 3);
    let mut c = cands(&[(0, 0), (0, 0)]);
    for x in &mut c {
        x.publishes_events = false;
    }
    p.routed(&req(&prompt), 1);
    for _ in 0..4 {
        assert_eq!(p.rank(&req(&prompt), &c)[0], 1, "sent where the prefix went before");
    }
    p.routed(&req(&blocks(3, 4)), 1); // 6 blocks into a capacity of 4: the oldest go
    assert!(p.approx.prefix_match(1, &prompt) < 3);
}

#[test]
fn pools_get_their_weighted_share_and_fail_over_by_weight() {
    let s = PoolSelector::new(&[80, 15, 5]);
    let mut firsts = [0usize; 3];
    for _ in 0..1000 {
        let order = s.order();
        assert_eq!(order.len(), 3);
        firsts[order[0]] += 1;
        let rest = &order[1..];
        let mut sorted = rest.to_vec();
        sorted.sort_by_key(|&i| std::cmp::Reverse([80, 15, 5][i]));
        assert_eq!(rest, &sorted[..], "failover in descending weight");
    }
    assert_eq!(firsts, [800, 150, 50]);
}

#[tokio::test]
async fn premium_waiters_get_released_capacity_first() {
    let adm = Arc::new(Admission::<usize>::new());
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, prio) in [Priority::Batch, Priority::Batch, Priority::Standard, Priority::Premium].into_iter().enumerate() {
        let (adm, order) = (adm.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let got = adm.acquire(prio, &[0], Duration::from_secs(10), || None).await;
            order.lock().push(i);
            got
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(adm.waiting(Priority::Batch), 2);
    for n in 0..4 {
        adm.offer(0, || Some(n));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap().expect("a slot"));
    }
    assert_eq!(*order.lock(), vec![3, 2, 0, 1], "premium, standard, then batch in arrival order");
    assert_eq!(got, vec![2, 3, 1, 0], "each slot handed to exactly one waiter");
}

#[tokio::test]
async fn a_waiter_gives_up_at_its_timeout() {
    let adm = Admission::<()>::new();
    let t0 = std::time::Instant::now();
    let got: Option<()> = adm.acquire(Priority::Premium, &[0], Duration::from_millis(100), || None).await;
    assert!(got.is_none());
    assert!(t0.elapsed() >= Duration::from_millis(100));
    assert_eq!(adm.waiting(Priority::Premium), 0);
}

/// Issue 14, point 4: capacity freed on one model's upstream goes to a
/// waiter for that upstream, even when waiters of higher priority wait for
/// another model's; theirs is not spent on a waiter that cannot use it.
#[tokio::test]
async fn issue_14_capacity_goes_to_a_waiter_for_its_upstream_and_no_wake_up_is_lost() {
    let adm = Arc::new(Admission::<&'static str>::new());
    let spawn = |prio: Priority, wants: usize| {
        let adm = adm.clone();
        tokio::spawn(async move { adm.acquire(prio, &[wants], Duration::from_secs(5), || None).await })
    };
    // Model a is served by upstream 0, model b by upstream 1.
    let a1 = spawn(Priority::Premium, 0);
    let a2 = spawn(Priority::Premium, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = spawn(Priority::Batch, 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    adm.offer(1, || Some("slot on 1"));
    let got = tokio::time::timeout(Duration::from_secs(1), b).await.expect("the b waiter was handed the slot");
    assert_eq!(got.unwrap(), Some("slot on 1"));
    assert_eq!(adm.waiting(Priority::Premium), 2, "nobody waiting for upstream 0 was disturbed");
    adm.offer(0, || Some("slot on 0"));
    adm.offer(0, || Some("another on 0"));
    assert_eq!(a1.await.unwrap(), Some("slot on 0"));
    assert_eq!(a2.await.unwrap(), Some("another on 0"));
    // Nobody waits: the slot is not taken at all.
    let mut made = false;
    adm.offer(0, || {
        made = true;
        Some("unused")
    });
    assert!(!made);
}

/// A waiter that is cancelled as a slot is handed to it passes the slot on.
#[tokio::test]
async fn a_slot_handed_to_a_cancelled_waiter_goes_to_the_next() {
    let adm = Arc::new(Admission::<u32>::new());
    let first = {
        let adm = adm.clone();
        tokio::spawn(async move { adm.acquire(Priority::Premium, &[7], Duration::from_secs(5), || None).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = {
        let adm = adm.clone();
        tokio::spawn(async move { adm.acquire(Priority::Batch, &[7], Duration::from_secs(5), || None).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    first.abort();
    let _ = first.await;
    adm.offer(7, || Some(1));
    assert_eq!(tokio::time::timeout(Duration::from_secs(1), second).await.unwrap().unwrap(), Some(1));
}

/// Issue 14, point 4: two gateway replicas number their upstreams
/// differently (the order of the configuration, agents joining in another
/// order); a session must land on the same named upstream on both.
#[test]
fn issue_14_sessions_stick_to_the_same_upstream_name_on_every_replica() {
    let names = ["engine-a", "engine-b", "engine-c", "engine-d"];
    // Each replica: its own ids (from 100 × its first upstream), and a
    // policy that knows each id's name.
    let replica = |order: &[usize]| -> (Vec<Candidate>, Session) {
        let ids: Vec<(usize, &str)> = order.iter().enumerate().map(|(i, &n)| (i + 100 * order[0], names[n])).collect();
        let cands = ids
            .iter()
            .map(|&(index, _)| Candidate { index, active: 0, max_active: 0, publishes_events: false })
            .collect();
        let lookup: Vec<(usize, u64)> = ids.iter().map(|&(i, n)| (i, super::affinity_of(n))).collect();
        let policy = Session::with_affinity(Arc::new(move |id| lookup.iter().find(|(i, _)| *i == id).map(|x| x.1)));
        (cands, policy)
    };
    let one = replica(&[0, 1, 2, 3]);
    let two = replica(&[3, 1, 0, 2]);
    let name_of = |(c, p): &(Vec<Candidate>, Session), order: &[usize], s: &str| {
        let first = p.rank(&RouteRequest { namespace: "t", session: Some(s), blocks: &[], by_upstream: &[] }, c)[0];
        names[order[c.iter().position(|x| x.index == first).unwrap()]]
    };
    let mut spread = HashSet::new();
    for i in 0..100 {
        let s = format!("conversation-{i}");
        let a = name_of(&one, &[0, 1, 2, 3], &s);
        assert_eq!(a, name_of(&two, &[3, 1, 0, 2], &s), "{s}");
        spread.insert(a);
    }
    assert_eq!(spread.len(), 4);
}
