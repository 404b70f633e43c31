//! Linearizability of concurrent histories, judged by stateright's
//! `LinearizabilityTester` (a maintained checker from crates.io, after Wing
//! and Gong), against a sequential model of one key written here
//! ([`Key`]).
//!
//! Several clients run `SET` (plain, `NX`, with a short `PX`), `GET`,
//! `GETDEL`, `DEL` and `FLUSHDB` on a few keys at once, each call's
//! invocation and return timed on one clock. Linearizability is local, so
//! each key's history is checked on its own; `FLUSHDB` is in every key's
//! history, as a delete of that key (its atomicity across keys is not
//! checked). An expiry is not an operation: the model knows the window in
//! which the server set the deadline (between the `SET`'s invocation and
//! return, plus the TTL) and accepts a read as expired or live only where
//! its own window allows it.
//!
//! Histories are run in short rounds (each from a known state: `FLUSHDB`,
//! or what the previous round left), which keeps the checker's search
//! small. Across a restart, a round ends with `WAITAOF`, the server is
//! stopped and started again on the same disk and remote tier, and every
//! key is read back as part of the round's history: what was acknowledged
//! as durable must be there, and what was deleted must stay deleted.

use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester, SequentialSpec};

use super::differential::{admin_auth, ADMIN};
use super::reference::Conn;

/// Nanoseconds the server's millisecond clock may round by. Times are in
/// nanoseconds on the test's clock, fine enough that one client's next call
/// never begins at the instant its last one returned.
const SLACK: u64 = 2_000_000;

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Set { id: u32, nx: bool, ttl_ms: Option<u64>, at: u64 },
    Get { at: u64 },
    GetDel { at: u64 },
    Del { at: u64 },
    Flush { at: u64 },
}

impl Op {
    fn at(&self) -> u64 {
        match *self {
            Op::Set { at, .. } | Op::Get { at } | Op::GetDel { at } | Op::Del { at } | Op::Flush { at } => at,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Ret {
    /// `OK`.
    Done {
        at: u64,
    },
    /// `SET … NX` that did not set.
    Refused {
        at: u64,
    },
    Value {
        id: Option<u32>,
        at: u64,
    },
    Count {
        n: i64,
        at: u64,
    },
}

impl Ret {
    fn at(&self) -> u64 {
        match *self {
            Ret::Done { at } | Ret::Refused { at } | Ret::Value { at, .. } | Ret::Count { at, .. } => at,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Entry {
    id: u32,
    /// The window the deadline lies in, in nanoseconds on the test clock.
    expires: Option<(u64, u64)>,
}

/// One key as a sequential object: absent, or a value with an optional
/// deadline.
#[derive(Clone, Debug)]
pub struct Key(Option<Entry>);

impl SequentialSpec for Key {
    type Op = Op;
    type Ret = Ret;

    /// Only for an operation that never returned (every history here is
    /// complete): the answer as if no deadline had passed.
    fn invoke(&mut self, op: &Op) -> Ret {
        let at = op.at();
        let before = self.0.map(|e| e.id);
        match *op {
            Op::Set { id, nx, ttl_ms, at } => {
                if nx && before.is_some() {
                    return Ret::Refused { at };
                }
                self.0 = Some(Entry { id, expires: ttl_ms.map(|t| (at + t * 1_000_000, at + t * 1_000_000)) });
                Ret::Done { at }
            }
            Op::Get { .. } => Ret::Value { id: before, at },
            Op::GetDel { .. } => {
                self.0 = None;
                Ret::Value { id: before, at }
            }
            Op::Del { .. } => {
                self.0 = None;
                Ret::Count { n: i64::from(before.is_some()), at }
            }
            Op::Flush { .. } => {
                self.0 = None;
                Ret::Done { at }
            }
        }
    }

    fn is_valid_step(&mut self, op: &Op, ret: &Ret) -> bool {
        let (called, returned) = (op.at(), ret.at());
        // Whether the key may be live, and whether it may be gone, at a
        // point between the call and the return.
        let (live, gone) = match self.0 {
            None => (false, true),
            Some(Entry { expires: None, .. }) => (true, false),
            Some(Entry { expires: Some((earliest, latest)), .. }) => {
                (called <= latest + SLACK, returned + SLACK >= earliest)
            }
        };
        let current = self.0.map(|e| e.id);
        match (op, ret) {
            (Op::Get { .. }, Ret::Value { id: None, .. }) if gone => {
                self.0 = None;
                true
            }
            (Op::Get { .. }, Ret::Value { id: Some(id), .. }) => live && current == Some(*id),
            (Op::GetDel { .. }, Ret::Value { id, .. }) => {
                let ok = match id {
                    None => gone,
                    Some(id) => live && current == Some(*id),
                };
                self.0 = None;
                ok
            }
            (Op::Del { .. }, Ret::Count { n, .. }) => {
                let ok = (*n == 0 && gone) || (*n == 1 && live);
                self.0 = None;
                ok
            }
            (Op::Set { id, nx, ttl_ms, at }, Ret::Done { at: done }) => {
                if *nx && !gone {
                    return false;
                }
                self.0 = Some(Entry { id: *id, expires: ttl_ms.map(|t| (at + t * 1_000_000, done + t * 1_000_000)) });
                true
            }
            (Op::Set { nx: true, .. }, Ret::Refused { .. }) => live,
            (Op::Flush { .. }, Ret::Done { .. }) => {
                self.0 = None;
                true
            }
            _ => false,
        }
    }
}

/// One completed call: who made it, on which key (`None`: every key).
#[derive(Clone, Debug)]
pub struct Call {
    pub client: usize,
    pub key: Option<usize>,
    pub op: Op,
    pub ret: Ret,
}

/// What the clients may do.
#[derive(Clone, Copy)]
pub struct Mix {
    pub keys: usize,
    /// Short `PX` expiries on some `SET`s.
    pub ttl: bool,
    pub flush: bool,
}

fn key_name(k: usize) -> Vec<u8> {
    format!("lin{k}").into_bytes()
}

fn value(id: u32, pad: usize) -> Vec<u8> {
    let mut v = format!("v{id}:").into_bytes();
    v.resize(v.len() + pad, b'x');
    v
}

fn id_of(raw: &[u8]) -> Option<u32> {
    if raw == b"$-1\r\n" {
        return None;
    }
    let body = &raw[raw.iter().position(|&b| b == b'\n').unwrap() + 1..];
    let colon = body.iter().position(|&b| b == b':').unwrap_or_else(|| panic!("not a value of this test: {raw:?}"));
    Some(std::str::from_utf8(&body[1..colon]).unwrap().parse().unwrap())
}

fn reply_error(raw: &[u8], what: &str) -> ! {
    panic!("{what} answered {:?}", String::from_utf8_lossy(raw))
}

/// Makes one random call on `conn` and returns it, timed on `clock`.
pub fn random_call(conn: &mut Conn, rng: &mut StdRng, mix: Mix, client: usize, id: u32, clock: Instant) -> Call {
    let k = rng.random_range(0..mix.keys);
    let name = key_name(k);
    let now = || clock.elapsed().as_nanos() as u64;
    let pad = [0, 200, 3_000, 6_000][rng.random_range(0..4)];
    let roll = rng.random_range(0..40);
    let (key, op, args): (Option<usize>, Op, Vec<Vec<u8>>) = match roll {
        0 if mix.flush => (None, Op::Flush { at: 0 }, vec![b"FLUSHDB".to_vec()]),
        0..=13 => {
            let nx = rng.random_range(0..3) == 0;
            let ttl_ms = (mix.ttl && rng.random_range(0..3) == 0).then(|| rng.random_range(5..60));
            let mut args = vec![b"SET".to_vec(), name, value(id, pad)];
            if nx {
                args.push(b"NX".to_vec());
            }
            if let Some(t) = ttl_ms {
                args.extend([b"PX".to_vec(), t.to_string().into_bytes()]);
            }
            (Some(k), Op::Set { id, nx, ttl_ms, at: 0 }, args)
        }
        14..=27 => (Some(k), Op::Get { at: 0 }, vec![b"GET".to_vec(), name]),
        28..=32 => (Some(k), Op::GetDel { at: 0 }, vec![b"GETDEL".to_vec(), name]),
        _ => (Some(k), Op::Del { at: 0 }, vec![b"DEL".to_vec(), name]),
    };
    let args_ref: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
    let called = now();
    let raw = conn.call(&args_ref);
    let returned = now();
    let what = String::from_utf8_lossy(&args[0]).into_owned();
    let (op, ret) = match op {
        Op::Set { id, nx, ttl_ms, .. } => {
            let ret = match raw.as_slice() {
                b"+OK\r\n" => Ret::Done { at: returned },
                b"$-1\r\n" if nx => Ret::Refused { at: returned },
                _ => reply_error(&raw, &what),
            };
            (Op::Set { id, nx, ttl_ms, at: called }, ret)
        }
        Op::Get { .. } | Op::GetDel { .. } => {
            if !raw.starts_with(b"$") {
                reply_error(&raw, &what);
            }
            let ret = Ret::Value { id: id_of(&raw), at: returned };
            (if matches!(op, Op::Get { .. }) { Op::Get { at: called } } else { Op::GetDel { at: called } }, ret)
        }
        Op::Del { .. } => {
            let n = match raw.as_slice() {
                b":0\r\n" => 0,
                b":1\r\n" => 1,
                _ => reply_error(&raw, &what),
            };
            (Op::Del { at: called }, Ret::Count { n, at: returned })
        }
        Op::Flush { .. } => {
            if raw != b"+OK\r\n" {
                reply_error(&raw, &what);
            }
            (Op::Flush { at: called }, Ret::Done { at: returned })
        }
    };
    Call { client, key, op, ret }
}

/// `clients` clients, `calls` calls each, all at once on `port`; the
/// history, in no particular order. `ids` makes every written value unique.
pub fn round(port: u16, clients: usize, calls: usize, mix: Mix, seed: u64, ids: &mut u32, clock: Instant) -> Vec<Call> {
    let history = Arc::new(Mutex::new(Vec::new()));
    let start = Arc::new(Barrier::new(clients));
    let first = *ids;
    *ids += (clients * calls) as u32;
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (history, start) = (history.clone(), start.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open_as(port, ADMIN);
                let mut rng = StdRng::seed_from_u64(seed * 1000 + c as u64);
                start.wait();
                for i in 0..calls {
                    let id = first + (c * calls + i) as u32;
                    let call = random_call(&mut conn, &mut rng, mix, c, id, clock);
                    history.lock().unwrap().push(call);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    Arc::try_unwrap(history).unwrap().into_inner().unwrap()
}

/// Reads every key back by one client after everything else (the check
/// after a restart); `client` is a number no round client has.
pub fn read_back(port: u16, keys: usize, client: usize, clock: Instant) -> Vec<Call> {
    let mut conn = Conn::open_as(port, ADMIN);
    (0..keys)
        .map(|k| {
            let called = clock.elapsed().as_nanos() as u64;
            let raw = conn.call(&[b"GET", &key_name(k)]);
            let returned = clock.elapsed().as_nanos() as u64;
            if !raw.starts_with(b"$") {
                reply_error(&raw, "GET");
            }
            Call { client, key: Some(k), op: Op::Get { at: called }, ret: Ret::Value { id: id_of(&raw), at: returned } }
        })
        .collect()
}

/// The value each key holds after `history`, as `read_back` found it.
pub fn last_read(history: &[Call], keys: usize, client: usize) -> Vec<Option<u32>> {
    (0..keys)
        .map(|k| {
            history
                .iter()
                .rev()
                .find_map(|c| match (&c.ret, c.client == client && c.key == Some(k)) {
                    (Ret::Value { id, .. }, true) => Some(*id),
                    _ => None,
                })
                .unwrap()
        })
        .collect()
}

/// Checks each key's history against [`Key`], starting from `init`; on a
/// failure, the key and its history in call order.
pub fn check(history: &[Call], init: &[Option<u32>]) -> Result<(), String> {
    for (k, init) in init.iter().enumerate() {
        let mine: Vec<&Call> = history.iter().filter(|c| c.key.is_none_or(|x| x == k)).collect();
        // Calls before returns at the same instant: such calls overlap.
        let mut events: Vec<(u64, bool, usize)> =
            mine.iter().enumerate().flat_map(|(i, c)| [(c.op.at(), false, i), (c.ret.at(), true, i)]).collect();
        events.sort();
        let mut tester = LinearizabilityTester::new(Key(init.map(|id| Entry { id, expires: None })));
        for (_, is_return, i) in events {
            let c = mine[i];
            let step = if is_return {
                tester.on_return(c.client, c.ret.clone())
            } else {
                tester.on_invoke(c.client, c.op.clone())
            };
            step.map_err(|e| format!("lin{k}: not a history: {e}"))?;
        }
        if !tester.is_consistent() {
            let mut sorted = mine.clone();
            sorted.sort_by_key(|c| c.op.at());
            let lines: Vec<String> =
                sorted.iter().map(|c| format!("  client {} {:?} -> {:?}", c.client, c.op, c.ret)).collect();
            return Err(format!("lin{k} (from {init:?}): no linearization of\n{}", lines.join("\n")));
        }
    }
    Ok(())
}

const CLIENTS: usize = 4;
const CALLS: usize = 10;

fn rounds() -> u64 {
    super::differential::env_u64("GRANARY_LIN_ROUNDS", 150)
}

/// Issue 40: four clients on three keys over a memory tier that holds a
/// value or two, a small disk tier and a remote tier, in offload modes
/// `all` and `evicted`: every key's history is linearizable, expiries
/// and `FLUSHDB` included.
#[test]
fn concurrent_histories_are_linearizable_across_tiers() {
    use granary_warehouse::config::OffloadMode;
    let mix = Mix { keys: 3, ttl: true, flush: true };
    for offload in [OffloadMode::All, OffloadMode::Evicted] {
        let root = tempfile::tempdir().unwrap();
        let srv = super::Server::start_with(super::Server::tiered(root.path(), offload), admin_auth());
        let (clock, mut ids) = (Instant::now(), 0);
        let mut admin = Conn::open_as(srv.port, ADMIN);
        for r in 0..rounds() {
            assert_eq!(admin.call(&[b"FLUSHDB"]), b"+OK\r\n");
            let history = round(srv.port, CLIENTS, CALLS, mix, r, &mut ids, clock);
            if let Err(e) = check(&history, &vec![None; mix.keys]) {
                panic!("offload {offload:?}, round {r} (GRANARY_LIN_ROUNDS={}): {e}", r + 1);
            }
        }
        eprintln!("offload {offload:?}: {} rounds of {CLIENTS}x{CALLS} calls linearizable", rounds());
    }
}

/// Issue 40: the same clients, and after every round `WAITAOF` and a
/// restart on the same disk and remote tiers; each key read back after
/// the restart is part of the round's history, so a write acknowledged as
/// durable that is missing, or a deleted key that comes back, fails.
#[test]
fn acknowledged_writes_survive_restarts_linearizably() {
    use granary_warehouse::config::OffloadMode;
    let mix = Mix { keys: 3, ttl: false, flush: true };
    let root = tempfile::tempdir().unwrap();
    let cfg = super::Server::tiered(root.path(), OffloadMode::All);
    let mut srv = super::Server::start_with(cfg.clone(), admin_auth());
    let (clock, mut ids) = (Instant::now(), 0);
    let mut init = vec![None; mix.keys];
    let reader = CLIENTS + 1;
    for r in 0..rounds() / 3 {
        let mut history = round(srv.port, CLIENTS, CALLS, mix, 10_000 + r, &mut ids, clock);
        let waited = Conn::open_as(srv.port, ADMIN).call(&[b"WAITAOF", b"1", b"0", b"0"]);
        assert_eq!(waited, b"*2\r\n:1\r\n:0\r\n", "round {r}: WAITAOF did not confirm every write durable");
        drop(srv);
        srv = super::Server::start_with(cfg.clone(), admin_auth());
        history.extend(read_back(srv.port, mix.keys, reader, clock));
        if let Err(e) = check(&history, &init) {
            panic!("round {r}, read back after a restart: {e}");
        }
        init = last_read(&history, mix.keys, reader);
    }
    eprintln!("{} restarts: every acknowledged write read back", rounds() / 3);
}
