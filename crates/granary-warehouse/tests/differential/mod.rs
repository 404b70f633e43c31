//! Differential testing against a real `redis-server`: seeded random
//! sequences over the RESP subset the warehouse implements go to both,
//! command by command, and the replies are compared byte for byte.
//!
//! Replies that no two servers can agree on byte for byte are compared by
//! rule, never by case; the rules are the table in docs/warehouse.md
//! ("Differences from redis-server") and [`Rule`] here:
//! - `KEYS` lists keys in hash-table order: compared as sets.
//! - `SCAN` cursors are each server's own: every `SCAN` is run to the end
//!   (cursor 0) on both, and the keys seen are compared as sets.
//! - A positive `TTL` or `PTTL` counts down while the sequence runs:
//!   compared within one second.
//!
//! A sequence starts from `FLUSHDB` on both. Expiries are either far in
//! the future or in the past, so no key expires while a sequence runs and
//! every reply is deterministic. The seed of a failing sequence is printed,
//! with how to run it alone.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::reference::Conn;

type Cmd = Vec<Vec<u8>>;

/// A seeded generator of command sequences.
pub struct Gen {
    rng: StdRng,
    /// Values up to 12 KiB, so that a small memory budget moves them
    /// between tiers.
    big: bool,
    /// A far-future Unix time in seconds, the same for both servers.
    future: u64,
}

const KEYS: usize = 5;

impl Gen {
    pub fn new(seed: u64, big: bool) -> Gen {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        Gen { rng: StdRng::seed_from_u64(seed), big, future: now + 1_000_000 }
    }

    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.rng.random_range(0..from.len())]
    }

    fn one_in(&mut self, n: u32) -> bool {
        self.rng.random_range(0..n) == 0
    }

    fn key(&mut self) -> Vec<u8> {
        match self.rng.random_range(0..40) {
            0 => Vec::new(),
            1 => b"k*".to_vec(),
            2 => b"k\x00z".to_vec(),
            3 => b"K1".to_vec(),
            4 => b"k[1]".to_vec(),
            _ => format!("k{}", self.rng.random_range(0..KEYS)).into_bytes(),
        }
    }

    fn keys(&mut self, at_least: usize) -> Vec<Vec<u8>> {
        let n = self.rng.random_range(at_least..at_least + 4);
        (0..n).map(|_| self.key()).collect()
    }

    fn value(&mut self) -> Vec<u8> {
        let len = match self.rng.random_range(0..10) {
            0 => 0,
            1..=5 => self.rng.random_range(1..12),
            6 | 7 => self.rng.random_range(12..300),
            _ if self.big => self.rng.random_range(2_000..12_000),
            _ => self.rng.random_range(300..2_000),
        };
        if self.one_in(5) {
            (0..len).map(|_| self.rng.random::<u8>()).collect()
        } else {
            (0..len).map(|_| b'a' + self.rng.random_range(0..26u8)).collect()
        }
    }

    /// An integer argument: mostly a valid relative expiry that will not
    /// pass while the sequence runs, sometimes one that is out of range,
    /// zero, negative, or not an integer at all.
    fn ttl(&mut self, millis: bool) -> Vec<u8> {
        let valid =
            if millis { self.rng.random_range(100_000..100_000_000u64) } else { self.rng.random_range(100..100_000) };
        let odd = [
            "0",
            "-1",
            "-100",
            "abc",
            "",
            "1.5",
            "+5",
            " 5",
            "5 ",
            "007",
            "9223372036854775807",
            "-9223372036854775808",
            "9223372036854775808",
            "9223372036854775",
            "9223372036854776",
            "4611686018427387904",
        ];
        if self.one_in(6) {
            self.pick(&odd).as_bytes().to_vec()
        } else {
            valid.to_string().into_bytes()
        }
    }

    /// An absolute expiry: far future, out of range, or with `past`, in the
    /// past (the key goes at once). SET is never given a past one: Redis
    /// then keeps the dead key, counted by DBSIZE until its expiry cycle
    /// happens to reclaim it, so its own answer depends on timing.
    fn at(&mut self, millis: bool, past: bool) -> Vec<u8> {
        let scale = if millis { 1000 } else { 1 };
        match self.rng.random_range(0..8) {
            0 if past => b"1".to_vec(),
            1 => b"0".to_vec(),
            // A small positive number is a time long past.
            2 if past => self.ttl(millis),
            3 => self.pick(&["abc", "-1", "9223372036854775807", "9223372036854776", "+5"]).as_bytes().to_vec(),
            _ => ((self.future + self.rng.random_range(0..1000)) * scale).to_string().into_bytes(),
        }
    }

    fn expiry_option(&mut self, set: bool, cmd: &mut Cmd) {
        match self.rng.random_range(0..if set { 5 } else { 6 }) {
            0 => cmd.extend([b"EX".to_vec(), self.ttl(false)]),
            1 => cmd.extend([b"PX".to_vec(), self.ttl(true)]),
            2 => cmd.extend([b"EXAT".to_vec(), self.at(false, !set)]),
            3 => cmd.extend([b"PXAT".to_vec(), self.at(true, !set)]),
            4 => cmd.push(b"KEEPTTL".to_vec()),
            _ => cmd.push(b"PERSIST".to_vec()),
        }
    }

    fn pattern(&mut self) -> Vec<u8> {
        let p = self.pick(&[
            "*", "k*", "k?", "?", "k[0-2]", "k[^0]", "k[!1]", "*z", "k\\*", "[", "k[", "\\", "k[a-", "K*", "*[13]",
            "k[2-0]", "**", "k\\", "[]]",
        ]);
        p.as_bytes().to_vec()
    }

    /// One command; `queued` leaves out those whose replies are compared by
    /// rule, so that an `EXEC` reply is compared byte for byte.
    fn command(&mut self, queued: bool) -> Cmd {
        let b = |s: &str| s.as_bytes().to_vec();
        loop {
            let cmd: Cmd = match self.rng.random_range(0..34) {
                0..=4 => {
                    let mut c = vec![b("SET"), self.key(), self.value()];
                    let mut opts: Vec<Cmd> = Vec::new();
                    if self.one_in(2) {
                        opts.push(vec![b(self.pick(&["NX", "XX", "nx"]))]);
                    }
                    if self.one_in(3) {
                        opts.push(vec![b("GET")]);
                    }
                    if self.one_in(2) {
                        let mut e = Vec::new();
                        self.expiry_option(true, &mut e);
                        opts.push(e);
                    }
                    if self.one_in(15) {
                        opts.push(vec![b(self.pick(&["NX", "XX", "EX", "KEEPTTL", "FOO", "GET"]))]);
                    }
                    // Options in any order.
                    for i in (1..opts.len()).rev() {
                        let j = self.rng.random_range(0..=i);
                        opts.swap(i, j);
                    }
                    c.extend(opts.into_iter().flatten());
                    c
                }
                5 | 6 => vec![b("GET"), self.key()],
                7 => vec![b("GETDEL"), self.key()],
                8 => {
                    let mut c = vec![b("GETEX"), self.key()];
                    if !self.one_in(3) {
                        self.expiry_option(false, &mut c);
                    }
                    c
                }
                9 => vec![b("SETNX"), self.key(), self.value()],
                10 => vec![b("SETEX"), self.key(), self.ttl(false), self.value()],
                11 => vec![b("PSETEX"), self.key(), self.ttl(true), self.value()],
                12 | 13 => {
                    let mut c = vec![b("MSET")];
                    for _ in 0..self.rng.random_range(1..4) {
                        c.extend([self.key(), self.value()]);
                    }
                    if self.one_in(10) {
                        c.push(self.key());
                    }
                    c
                }
                14 => [vec![b("MGET")], self.keys(1)].concat(),
                15 | 16 => [vec![b(self.pick(&["DEL", "UNLINK"]))], self.keys(1)].concat(),
                17 => [vec![b("EXISTS")], self.keys(1)].concat(),
                18 => vec![b(self.pick(&["STRLEN", "TYPE"])), self.key()],
                19 | 20 => {
                    let millis = self.one_in(2);
                    let mut c = vec![b(if millis { "PEXPIRE" } else { "EXPIRE" }), self.key(), self.ttl(millis)];
                    if self.one_in(3) {
                        c.push(b(self.pick(&["NX", "XX", "GT", "LT", "gt", "FOO"])));
                    }
                    if self.one_in(12) {
                        c.push(b(self.pick(&["NX", "XX", "GT", "LT"])));
                    }
                    c
                }
                21 => {
                    let millis = self.one_in(2);
                    let mut c =
                        vec![b(if millis { "PEXPIREAT" } else { "EXPIREAT" }), self.key(), self.at(millis, true)];
                    if self.one_in(4) {
                        c.push(b(self.pick(&["NX", "XX", "GT", "LT"])));
                    }
                    c
                }
                22 => vec![b("PERSIST"), self.key()],
                23 if !queued => vec![b(self.pick(&["TTL", "PTTL"])), self.key()],
                24 if !queued => vec![b("KEYS"), self.pattern()],
                25 if !queued => {
                    let mut c = vec![b("SCAN"), b("0")];
                    if self.one_in(2) {
                        c.extend([b("MATCH"), self.pattern()]);
                    }
                    if self.one_in(2) {
                        c.extend([b("COUNT"), b(self.pick(&["1", "2", "10", "1000", "0", "-1", "x"]))]);
                    }
                    if self.one_in(5) {
                        c.extend([b("TYPE"), b(self.pick(&["string", "hash", "STRING"]))]);
                    }
                    c
                }
                26 => vec![b("DBSIZE")],
                27 if self.one_in(4) => vec![b("FLUSHDB")],
                28 => {
                    let mut c = vec![b(self.pick(&["PING", "ECHO"]))];
                    if c[0] == b"ECHO" || self.one_in(2) {
                        c.push(self.value());
                    }
                    c
                }
                // Wrong arity: each command's own error.
                29 => {
                    let name = self.pick(&[
                        "GET", "SET", "GETDEL", "SETEX", "MGET", "MSET", "DEL", "EXISTS", "STRLEN", "EXPIRE", "TTL",
                        "PERSIST", "KEYS", "SCAN", "ECHO", "DBSIZE", "GETEX", "SETNX",
                    ]);
                    let mut c = vec![b(name)];
                    if self.one_in(2) && !matches!(name, "DBSIZE" | "MGET" | "DEL" | "EXISTS" | "GETEX" | "SCAN") {
                        c.push(self.key());
                        if matches!(name, "GET" | "GETDEL" | "STRLEN" | "TTL" | "PERSIST" | "KEYS" | "ECHO") {
                            c.push(self.key());
                        }
                    } else if name == "DBSIZE" {
                        c.push(self.key());
                    }
                    c
                }
                // A command the warehouse does not implement, under a name
                // Redis does not know either.
                30 => [vec![b(self.pick(&["FROB", "setx", "GETT"]))], self.keys(0)].concat(),
                31 if !queued => {
                    let mut c = vec![b("MULTI")];
                    if self.one_in(8) {
                        c.push(b("x"));
                    }
                    c
                }
                32 if !queued && self.one_in(3) => vec![b(self.pick(&["EXEC", "DISCARD"]))],
                33 => vec![b("SELECT"), b(self.pick(&["0", "0", "x", "-1", "16"]))],
                _ => continue,
            };
            return cmd;
        }
    }

    /// A sequence of about `len` commands; a transaction counts as one.
    pub fn sequence(&mut self, len: usize) -> Vec<Cmd> {
        let mut out = Vec::new();
        for _ in 0..len {
            if self.one_in(12) {
                out.push(vec![b"MULTI".to_vec()]);
                for _ in 0..self.rng.random_range(0..5) {
                    out.push(self.command(true));
                    if self.one_in(20) {
                        out.push(vec![b"MULTI".to_vec()]);
                    }
                }
                out.push(vec![if self.one_in(5) { b"DISCARD".to_vec() } else { b"EXEC".to_vec() }]);
            } else {
                let c = self.command(false);
                let opens = c.len() == 1 && c[0] == b"MULTI";
                out.push(c);
                if opens {
                    // A bare MULTI is closed, so that the next sequence
                    // starts outside a transaction.
                    out.push(self.command(true));
                    out.push(vec![b"EXEC".to_vec()]);
                }
            }
        }
        out
    }
}

/// A reply, parsed only as far as the comparison rules need.
#[derive(Debug, PartialEq)]
enum Reply {
    Int(i64),
    Array(Vec<Vec<u8>>),
    Other,
}

/// The top-level shape of a raw reply; an array's elements stay raw.
fn parse(raw: &[u8]) -> Reply {
    let line_end = raw.windows(2).position(|w| w == b"\r\n").unwrap_or(raw.len());
    let head = std::str::from_utf8(&raw[1..line_end]).unwrap_or("");
    match raw.first() {
        Some(b':') => head.parse().map(Reply::Int).unwrap_or(Reply::Other),
        Some(b'*') => {
            let mut rest = &raw[line_end + 2..];
            let mut items = Vec::new();
            while !rest.is_empty() {
                let n = element_len(rest);
                items.push(rest[..n].to_vec());
                rest = &rest[n..];
            }
            Reply::Array(items)
        }
        _ => Reply::Other,
    }
}

/// The length of the first whole element in `raw` (bulk strings, integers,
/// simple strings and errors: what `KEYS` and `SCAN` replies hold).
fn element_len(raw: &[u8]) -> usize {
    let line_end = raw.windows(2).position(|w| w == b"\r\n").unwrap() + 2;
    if raw[0] == b'$' {
        let n: i64 = std::str::from_utf8(&raw[1..line_end - 2]).unwrap().parse().unwrap();
        if n >= 0 {
            return line_end + n as usize + 2;
        }
    }
    if raw[0] == b'*' {
        let n: i64 = std::str::from_utf8(&raw[1..line_end - 2]).unwrap().parse().unwrap();
        let mut at = line_end;
        for _ in 0..n.max(0) {
            at += element_len(&raw[at..]);
        }
        return at;
    }
    line_end
}

/// How one command's replies are compared.
enum Rule {
    Exact,
    /// The array's elements as a set (`KEYS`).
    Unordered,
    /// Run to cursor 0, the keys seen as a set (`SCAN`).
    FullScan,
    /// Integers this far apart or less count as equal when both are
    /// positive (`TTL`, `PTTL`).
    Within(i64),
}

fn rule(cmd: &Cmd) -> Rule {
    match cmd[0].to_ascii_uppercase().as_slice() {
        b"KEYS" => Rule::Unordered,
        b"SCAN" => Rule::FullScan,
        b"TTL" => Rule::Within(1),
        b"PTTL" => Rule::Within(1000),
        _ => Rule::Exact,
    }
}

fn call(c: &mut Conn, cmd: &Cmd) -> Vec<u8> {
    let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
    c.call(&args)
}

/// Every key a `SCAN` sees from its first call to cursor 0, or the first
/// reply if it is not a scan page.
fn full_scan(c: &mut Conn, cmd: &Cmd) -> Result<BTreeSet<Vec<u8>>, Vec<u8>> {
    let mut cmd = cmd.clone();
    let mut seen = BTreeSet::new();
    for _ in 0..10_000 {
        let raw = call(c, &cmd);
        let Reply::Array(page) = parse(&raw) else { return Err(raw) };
        let [cursor, keys] = page.as_slice() else { return Err(raw) };
        let Reply::Array(keys) = parse(keys) else { return Err(raw) };
        seen.extend(keys);
        let cursor = cursor[cursor.iter().position(|&b| b == b'\n').unwrap() + 1..].to_vec();
        let cursor = cursor[..cursor.len() - 2].to_vec();
        if cursor == b"0" {
            return Ok(seen);
        }
        cmd[1] = cursor;
    }
    panic!("SCAN did not end after 10,000 pages");
}

fn show(b: &[u8]) -> String {
    String::from_utf8_lossy(b).replace("\r\n", "\\r\\n")
}

/// Sends `script` to both and returns the first command whose replies
/// differ by its rule, with its position and both replies.
/// With `GRANARY_DIFF_TRACE=1`, every command is printed as it is sent.
pub fn first_difference(ours: &mut Conn, reference: &mut Conn, script: &[Cmd]) -> Option<String> {
    let trace = std::env::var("GRANARY_DIFF_TRACE").is_ok_and(|v| v == "1");
    for (i, cmd) in script.iter().enumerate() {
        if trace {
            let words: Vec<String> = cmd.iter().map(|w| show(&w[..w.len().min(40)])).collect();
            eprintln!("{i}: {}", words.join(" "));
        }
        let same = match rule(cmd) {
            Rule::FullScan => {
                let (a, b) = (full_scan(ours, cmd), full_scan(reference, cmd));
                if a != b {
                    let fmt = |r: &Result<BTreeSet<Vec<u8>>, Vec<u8>>| match r {
                        Ok(keys) => format!("keys {:?}", keys.iter().map(|k| show(k)).collect::<Vec<_>>()),
                        Err(raw) => show(raw),
                    };
                    Some((fmt(&a), fmt(&b)))
                } else {
                    None
                }
            }
            r => {
                let (a, b) = (call(ours, cmd), call(reference, cmd));
                let equal = match (r, parse(&a), parse(&b)) {
                    (Rule::Unordered, Reply::Array(mut x), Reply::Array(mut y)) => {
                        x.sort();
                        y.sort();
                        x == y
                    }
                    (Rule::Within(d), Reply::Int(x), Reply::Int(y)) if x >= 0 && y >= 0 => (x - y).abs() <= d,
                    _ => a == b,
                };
                (!equal).then(|| (show(&a), show(&b)))
            }
        };
        if let Some((a, b)) = same {
            let words: Vec<String> = cmd.iter().map(|w| show(w)).collect();
            return Some(format!("command {i} `{}`: warehouse {a:?}, redis {b:?}", words.join(" ")));
        }
    }
    None
}

/// Runs `sequences` seeded sequences (seeds `first..`) against both
/// servers and returns a line for each failing seed (at most five). The
/// warehouse's connections are its admin's ([`ADMIN`]: `FLUSHDB` is the
/// admin's there), Redis's its default user's.
pub fn run(ours: u16, reference: u16, first: u64, sequences: u64, big: bool) -> Vec<String> {
    let (mut a, mut b) = (Conn::open_as(ours, ADMIN), Conn::open(reference));
    let mut failures = Vec::new();
    for seed in first..first + sequences {
        let script = Gen::new(seed, big).sequence(40);
        let flush = vec![vec![b"FLUSHDB".to_vec()]];
        let mut all = flush.clone();
        all.extend(script);
        if let Some(d) = first_difference(&mut a, &mut b, &all) {
            failures.push(format!("seed {seed}: {d}"));
            if failures.len() as u64 == env_u64("GRANARY_DIFF_MAX_FAILURES", 5) {
                break;
            }
            // A difference can leave the two in different states: start over.
            a = Conn::open_as(ours, ADMIN);
            b = Conn::open(reference);
        }
    }
    failures
}

/// The admin token of the warehouses these tests start.
pub const ADMIN: &[u8] = b"root";

/// A warehouse whose admin token is [`ADMIN`].
pub fn admin_auth() -> granary_warehouse::auth::Auth {
    granary_warehouse::auth::Auth::from_plain(Some("root"), &[])
}

/// A number from the environment, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn assert_same(failures: &[String], what: &str, seed: u64, n: u64) {
    assert!(
        failures.is_empty(),
        "{what}: {n} sequences from seed {seed}; replies that differ from redis-server's \
         (run one alone with GRANARY_DIFF_SEED=<seed> GRANARY_DIFF_SEQUENCES=1):\n{}",
        failures.join("\n")
    );
    eprintln!("{what}: {n} sequences from seed {seed} answered as redis-server does");
}

/// Issue 40: seeded command sequences (`GRANARY_DIFF_SEED`,
/// `GRANARY_DIFF_SEQUENCES`) answered byte for byte as redis-server
/// answers them, with the memory tier only.
#[test]
fn random_command_sequences_answer_as_redis_server_does() {
    let Some(redis) = super::reference::Redis::start() else { return };
    let (seed, n) = (env_u64("GRANARY_DIFF_SEED", 1), env_u64("GRANARY_DIFF_SEQUENCES", 2000));
    let srv = super::Server::start(admin_auth());
    assert_same(&run(srv.port, redis.port, seed, n, false), "memory only", seed, n);
}

/// The same with values of up to 12 KiB over a 24 KiB memory tier, a disk
/// tier and a remote tier, in both offload modes that move values.
#[test]
fn random_command_sequences_answer_as_redis_server_does_across_tiers() {
    use granary_warehouse::config::OffloadMode;
    let Some(redis) = super::reference::Redis::start() else { return };
    let (seed, n) = (env_u64("GRANARY_DIFF_SEED", 1), env_u64("GRANARY_DIFF_SEQUENCES", 2000) / 4);
    for offload in [OffloadMode::All, OffloadMode::Evicted] {
        let root = tempfile::tempdir().unwrap();
        let srv = super::Server::start_with(super::Server::tiered(root.path(), offload), admin_auth());
        assert_same(&run(srv.port, redis.port, seed, n, true), &format!("offload {offload:?}"), seed, n);
    }
}
