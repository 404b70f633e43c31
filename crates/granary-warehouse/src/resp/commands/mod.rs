//! Command execution for one RESP connection.
//!
//! A [`Session`] holds what a connection has established (who it is, which
//! namespace it acts on, the protocol version) and runs one parsed command
//! at a time against the store, writing the reply into the connection's
//! [`Out`]. Only the commands that Redis tooling and LMCache's connector
//! send are implemented; each keeps Redis's reply shapes and error texts so
//! unmodified clients work. Every failure is a typed [`CmdError`], turned
//! into reply text in one place.
//!
//! This module holds the session, the table check and the dispatch of the
//! simple commands; commands with more to them live by idea beside it:
//! [`connection`] (AUTH, HELLO, CLIENT), [`keyspace`] (SET, GETEX, EXPIRE,
//! SCAN, KEYS), [`transaction`] (MULTI, EXEC) and [`info`] (CONFIG, INFO).

mod connection;
mod info;
mod keyspace;
mod transaction;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::auth::{Principal, DEFAULT_NAMESPACE};
use crate::error::WarehouseError;
use crate::resp::glob::glob_match;
use crate::resp::reply::Out;
use crate::resp::table::{self, CommandSpec};
use crate::server::ServerCtx;
use crate::types::{Condition, PutOptions, Ttl};

/// Values shorter than this are copied out of the request frame before
/// being stored, so a small value never keeps a whole read buffer alive.
const OWN_COPY_BELOW: usize = 16 * 1024;
/// `SCAN` page size when the client gives no COUNT.
const DEFAULT_SCAN_COUNT: usize = 10;
/// Longest wait of `WAITAOF` (its timeout 0 means "no limit" in Redis).
const MAX_DURABILITY_WAIT: Duration = Duration::from_secs(60);
/// Store calls one MGET/MSET/EXISTS/DEL keeps in flight: cold keys reach
/// the disk and remote tiers concurrently instead of one round trip each.
pub const TIER_CALLS_IN_FLIGHT: usize = 16;
/// Most commands one MULTI may queue.
pub const MAX_QUEUED: usize = 10_000;
/// Most argument bytes one MULTI may queue.
pub const MAX_QUEUED_BYTES: usize = 1 << 30;
/// KEYS walks at most this many keys of the namespace; past it, it refuses.
pub const KEYS_LIMIT: usize = 100_000;
/// Version Redis clients see (feature checks key off it).
pub const REDIS_VERSION: &str = "7.2.0";

/// Why a command failed; `Display` is the reply text (code first).
#[derive(Debug, thiserror::Error)]
pub enum CmdError {
    #[error("ERR unknown command '{name}', with args beginning with: {args}")]
    UnknownCommand { name: String, args: String },
    #[error("ERR unknown subcommand '{sub}'. Try {cmd} HELP.")]
    UnknownSubcommand { cmd: &'static str, sub: String },
    #[error("ERR wrong number of arguments for '{0}' command")]
    Arity(String),
    #[error("ERR syntax error")]
    Syntax,
    #[error("ERR value is not an integer or out of range")]
    NotInteger,
    #[error("ERR invalid expire time in '{0}' command")]
    InvalidExpire(&'static str),
    #[error("ERR Unsupported option {0}")]
    UnsupportedOption(String),
    #[error("ERR NX and XX, GT or LT options at the same time are not compatible")]
    ExpireNxWithOthers,
    #[error("ERR GT and LT options at the same time are not compatible")]
    ExpireGtWithLt,
    #[error("ERR invalid cursor")]
    InvalidCursor,
    #[error("ERR DB index is out of range")]
    DbIndex,
    #[error("ERR Protocol version is not an integer or out of range")]
    ProtoNotInteger,
    #[error("NOPROTO unsupported protocol version")]
    NoProto,
    #[error("NOAUTH Authentication required.")]
    NoAuth,
    #[error(
        "NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH \
         <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the \
         same time"
    )]
    HelloNoAuth,
    #[error("WRONGPASS invalid username-password pair or user is disabled.")]
    WrongPass,
    #[error(
        "ERR AUTH <password> called without any password configured for the default user. Are you sure your \
         configuration is correct?"
    )]
    AuthNotConfigured,
    #[error("NOPERM this user has no permissions to run the '{0}' command")]
    NoPerm(&'static str),
    #[error("NOPERM this user has no permissions to access namespace '{0}'")]
    NamespaceDenied(String),
    #[error("ERR invalid namespace: {0}")]
    BadNamespace(&'static str),
    #[error("ERR Client names cannot contain spaces, newlines or special characters.")]
    BadClientName,
    #[error("ERR MULTI calls can not be nested")]
    NestedMulti,
    #[error("ERR {0} without MULTI")]
    WithoutMulti(&'static str),
    #[error("ERR Command not allowed inside a transaction")]
    NotInMulti,
    #[error("EXECABORT Transaction discarded because of previous errors.")]
    ExecAbort,
    #[error("ERR transaction too large: at most {MAX_QUEUED} commands and {MAX_QUEUED_BYTES} bytes may be queued")]
    TxTooLarge,
    #[error("ERR WATCH is not supported by this server (transactions run their commands in order, without isolation)")]
    WatchUnsupported,
    #[error("ERR KEYS refused: namespace holds more than {KEYS_LIMIT} keys; use SCAN with a cursor to walk it")]
    KeysTooMany,
    #[error("{}", store_error_text(.0))]
    Store(#[from] WarehouseError),
}

/// The one mapping from store errors to RESP error text.
fn store_error_text(e: &WarehouseError) -> String {
    match e {
        WarehouseError::TooLarge { .. } => format!("ERR value too large: {e}"),
        // Redis's code for a write refused for lack of memory; clients know it.
        WarehouseError::OutOfMemory { .. } => format!("OOM command not allowed: {e}"),
        WarehouseError::Invalid { .. } => format!("ERR {e}"),
        WarehouseError::Io { .. } | WarehouseError::Remote(_) | WarehouseError::Corrupt { .. } => {
            format!("ERR storage error: {e}")
        }
        other => format!("ERR {other}"),
    }
}

type CmdResult = Result<Flow, CmdError>;

/// What the connection does after a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Flush the replies, then close (QUIT).
    Close,
}

/// Facts about the listener every session reports.
#[derive(Debug)]
pub struct ServerInfo {
    pub started: Instant,
    pub port: u16,
    pub next_client_id: AtomicU64,
    /// Open connections by client id, for CLIENT LIST.
    pub clients: parking_lot::Mutex<std::collections::BTreeMap<u64, ClientRecord>>,
}

impl ServerInfo {
    pub fn new(port: u16) -> ServerInfo {
        ServerInfo { started: Instant::now(), port, next_client_id: AtomicU64::new(1), clients: Default::default() }
    }
}

/// State of one connection.
pub struct Session<'a> {
    ctx: &'a ServerCtx,
    info: &'a ServerInfo,
    id: u64,
    principal: Option<Principal>,
    ns: String,
    name: Option<Bytes>,
    /// [`crate::Store::durability_losses`] at the last WAITAOF (or connect).
    losses_mark: Option<u64>,
    /// Commands queued since MULTI; `None` outside a transaction.
    queued: Option<Vec<Vec<Bytes>>>,
    queued_bytes: usize,
    /// A command failed to queue: EXEC answers EXECABORT.
    tx_dirty: bool,
}

/// What CLIENT LIST shows of one connection.
#[derive(Debug, Clone)]
pub struct ClientRecord {
    pub addr: String,
    pub name: String,
    pub namespace: String,
    pub connected: Instant,
    pub resp: u8,
}

fn lower(name: &[u8]) -> String {
    String::from_utf8_lossy(name).to_ascii_lowercase()
}

/// An integer argument, read as Redis reads one (`string2ll`): digits with
/// an optional leading `-`, no `+`, no spaces, no leading zeros, nothing
/// outside a signed 64-bit integer. `007`, `+5` and `-0` are not integers.
fn parse_i64(b: &[u8]) -> Result<i64, CmdError> {
    let digits = b.strip_prefix(b"-").unwrap_or(b);
    let canonical = match digits {
        [b'0'] => digits.len() == b.len(),
        [b'1'..=b'9', rest @ ..] => rest.iter().all(u8::is_ascii_digit),
        _ => false,
    };
    if !canonical {
        return Err(CmdError::NotInteger);
    }
    std::str::from_utf8(b).ok().and_then(|s| s.parse::<i64>().ok()).ok_or(CmdError::NotInteger)
}

fn is(b: &[u8], word: &str) -> bool {
    b.eq_ignore_ascii_case(word.as_bytes())
}

/// A stored value owns its bytes unless it is large enough to be worth
/// sharing the request frame's allocation.
fn own(v: Bytes) -> Bytes {
    if v.len() < OWN_COPY_BELOW {
        Bytes::copy_from_slice(&v)
    } else {
        v
    }
}

fn check_namespace(ns: &[u8]) -> Result<String, CmdError> {
    crate::types::check_namespace(ns).map(str::to_owned).map_err(CmdError::BadNamespace)
}

/// Redis-style rounding of a remaining TTL to seconds.
fn ttl_secs(d: Duration) -> i64 {
    ((d.as_millis() + 500) / 1000) as i64
}

impl<'a> Session<'a> {
    pub fn new(ctx: &'a ServerCtx, info: &'a ServerInfo) -> Session<'a> {
        Self::with_peer(ctx, info, String::new())
    }

    /// A session for a connection from `addr` (shown by CLIENT LIST).
    pub fn with_peer(ctx: &'a ServerCtx, info: &'a ServerInfo, addr: String) -> Session<'a> {
        let principal = ctx.auth.anonymous();
        let id = info.next_client_id.fetch_add(1, Relaxed);
        let ns = DEFAULT_NAMESPACE.to_string();
        info.clients.lock().insert(
            id,
            ClientRecord { addr, name: String::new(), namespace: ns.clone(), connected: Instant::now(), resp: 2 },
        );
        Session {
            ctx,
            info,
            id,
            principal,
            ns,
            name: None,
            losses_mark: ctx.store.durability_losses(),
            queued: None,
            queued_bytes: 0,
            tx_dirty: false,
        }
    }

    /// Brings this connection's CLIENT LIST entry up to date.
    fn publish(&self, resp: u8) {
        if let Some(r) = self.info.clients.lock().get_mut(&self.id) {
            r.name = self.name.as_deref().map(|n| String::from_utf8_lossy(n).into_owned()).unwrap_or_default();
            r.namespace.clone_from(&self.ns);
            r.resp = resp;
        }
    }

    /// Whether the client may run data commands (authenticated, or an open server).
    pub fn authenticated(&self) -> bool {
        self.principal.is_some()
    }

    /// Runs one command and writes its reply; counts it.
    pub async fn execute(&mut self, args: Vec<Bytes>, out: &mut Out) -> Flow {
        let result =
            if self.queued.is_some() { self.in_multi(args, out).await } else { self.dispatch(&args, out).await };
        match result {
            Ok(flow) => {
                self.ctx.resp.requests_ok.fetch_add(1, Relaxed);
                flow
            }
            Err(e) => {
                self.ctx.resp.requests_error.fetch_add(1, Relaxed);
                out.error(&e.to_string());
                Flow::Continue
            }
        }
    }

    /// Checks a command against the table: known, allowed for this
    /// client, right number of arguments. The same check decides whether a
    /// command may be queued inside MULTI.
    fn check(&self, args: &[Bytes]) -> Result<&'static CommandSpec, CmdError> {
        let first = &args[0];
        let spec = if first.len() > 32 { None } else { table::lookup(first) };
        if !spec.is_some_and(|s| s.has(table::NO_AUTH)) && self.principal.is_none() {
            // Client libraries announce themselves right after connecting,
            // before authenticating; that touches no data, so it is allowed.
            let announce = spec.is_some_and(|s| s.name == "client") && args.get(1).is_some_and(|s| is(s, "SETINFO"));
            if !announce {
                return Err(CmdError::NoAuth);
            }
        }
        let spec = spec.ok_or_else(|| unknown(args))?;
        if !spec.arity_ok(args.len()) {
            return Err(CmdError::Arity(spec.name.to_string()));
        }
        if spec.has(table::ADMIN) && !self.principal.as_ref().is_some_and(Principal::is_admin) {
            return Err(CmdError::NoPerm(spec.name));
        }
        Ok(spec)
    }

    async fn dispatch(&mut self, args: &[Bytes], out: &mut Out) -> CmdResult {
        if args.is_empty() {
            return Ok(Flow::Continue);
        }
        let spec = self.check(args)?;
        let name = spec.name.to_ascii_uppercase();
        match spec.name {
            "auth" => return self.auth(args, out),
            "hello" => return self.hello(args, out),
            "quit" => {
                out.ok();
                return Ok(Flow::Close);
            }
            _ => {}
        }
        let first = &args[0];
        let a = &args[1..];
        let arity = |ok: bool| if ok { Ok(()) } else { Err(CmdError::Arity(lower(first))) };
        match name.as_str() {
            "MULTI" => {
                self.queued = Some(Vec::new());
                self.queued_bytes = 0;
                self.tx_dirty = false;
                out.ok();
            }
            "EXEC" => return Err(CmdError::WithoutMulti("EXEC")),
            "DISCARD" => return Err(CmdError::WithoutMulti("DISCARD")),
            "WATCH" => return Err(CmdError::WatchUnsupported),
            // Nothing is ever watched; redis-py sends it when resetting a pipeline.
            "UNWATCH" => out.ok(),
            "GETEX" => self.getex(a, out).await?,
            "EXPIREAT" | "PEXPIREAT" => {
                let ms = name == "PEXPIREAT";
                let cmd = if ms { "pexpireat" } else { "expireat" };
                let unit = keyspace::ExpireUnit { ms, relative: false, cmd };
                let set = self.expire(&a[0], &a[1], unit, &a[2..]).await?;
                out.int(i64::from(set));
            }
            "KEYS" => self.keys(&a[0], out).await?,
            "PING" => {
                arity(a.len() <= 1)?;
                match a.first() {
                    Some(m) => out.bulk(m),
                    None => out.simple("PONG"),
                }
            }
            "ECHO" => {
                arity(a.len() == 1)?;
                out.bulk(&a[0]);
            }
            "SELECT" => {
                arity(a.len() == 1)?;
                if parse_i64(&a[0])? != 0 {
                    return Err(CmdError::DbIndex);
                }
                out.ok();
            }
            "CLIENT" => {
                arity(!a.is_empty())?;
                self.client(a, out)?;
            }
            "NAMESPACE" => {
                arity(a.len() <= 1)?;
                if let Some(n) = a.first() {
                    let ns = check_namespace(n)?;
                    if !self.principal.as_ref().is_some_and(|p| p.may_access(&ns)) {
                        return Err(CmdError::NamespaceDenied(ns));
                    }
                    self.ns = ns;
                    self.publish(out.proto);
                    out.ok();
                } else {
                    out.bulk(self.ns.as_bytes());
                }
            }
            "GET" => {
                arity(a.len() == 1)?;
                match self.ctx.store.get(&self.ns, &a[0]).await? {
                    Some(hit) => out.bulk_bytes(hit.value),
                    None => out.null(),
                }
            }
            "SET" => {
                arity(a.len() >= 2)?;
                self.set(a, out).await?;
            }
            "SETEX" | "PSETEX" => {
                arity(a.len() == 3)?;
                let n = parse_i64(&a[1])?;
                let cmd = if name == "SETEX" { "setex" } else { "psetex" };
                let ttl = keyspace::ttl_from_now(n, name == "SETEX", cmd)?;
                let opts = PutOptions { ttl: Some(ttl), ..Default::default() };
                self.ctx.store.put(&self.ns, Bytes::copy_from_slice(&a[0]), own(a[2].clone()), opts).await?;
                out.ok();
            }
            "SETNX" => {
                arity(a.len() == 2)?;
                let opts = PutOptions { condition: Condition::IfAbsent, ..Default::default() };
                let stored =
                    self.ctx.store.put(&self.ns, Bytes::copy_from_slice(&a[0]), own(a[1].clone()), opts).await?;
                out.int(i64::from(stored));
            }
            "MGET" => {
                arity(!a.is_empty())?;
                // Look everything up first so an error leaves no half-written
                // array; cold keys go to the lower tiers concurrently.
                let (store, ns) = (self.ctx.store.clone(), Arc::<str>::from(self.ns.as_str()));
                let hits: Vec<_> = futures::stream::iter(a.to_vec())
                    .map(move |k| {
                        let (store, ns) = (store.clone(), ns.clone());
                        async move { store.get(&ns, &k).await }
                    })
                    .buffered(TIER_CALLS_IN_FLIGHT)
                    .try_collect()
                    .await?;
                out.array(hits.len());
                for h in hits {
                    match h {
                        Some(hit) => out.bulk_bytes(hit.value),
                        None => out.null(),
                    }
                }
            }
            "MSET" => {
                arity(!a.is_empty() && a.len().is_multiple_of(2))?;
                // The last value of a key given twice wins, as in Redis; the
                // distinct keys are then written concurrently.
                let mut last = std::collections::HashMap::with_capacity(a.len() / 2);
                for (i, kv) in a.chunks_exact(2).enumerate() {
                    last.insert(&kv[0], i);
                }
                let pairs: Vec<(Bytes, Bytes)> = a
                    .chunks_exact(2)
                    .enumerate()
                    .filter(|(i, kv)| last[&kv[0]] == *i)
                    .map(|(_, kv)| (Bytes::copy_from_slice(&kv[0]), own(kv[1].clone())))
                    .collect();
                let (store, ns) = (self.ctx.store.clone(), Arc::<str>::from(self.ns.as_str()));
                futures::stream::iter(pairs)
                    .map(move |(k, v)| {
                        let (store, ns) = (store.clone(), ns.clone());
                        async move { store.put(&ns, k, v, PutOptions::default()).await }
                    })
                    .buffer_unordered(TIER_CALLS_IN_FLIGHT)
                    .try_collect::<Vec<_>>()
                    .await?;
                out.ok();
            }
            "EXISTS" => {
                arity(!a.is_empty())?;
                let (store, ns) = (self.ctx.store.clone(), Arc::<str>::from(self.ns.as_str()));
                let found: Vec<bool> = futures::stream::iter(a.to_vec())
                    .map(move |k| {
                        let (store, ns) = (store.clone(), ns.clone());
                        async move { store.exists(&ns, &k).await }
                    })
                    .buffer_unordered(TIER_CALLS_IN_FLIGHT)
                    .try_collect()
                    .await?;
                out.int(found.into_iter().filter(|&f| f).count() as i64);
            }
            "DEL" | "UNLINK" => {
                arity(!a.is_empty())?;
                // A key given twice is deleted once: its deletes are ordered
                // by the key's lane, so the second finds nothing.
                let (store, ns) = (self.ctx.store.clone(), Arc::<str>::from(self.ns.as_str()));
                let gone: Vec<bool> = futures::stream::iter(a.to_vec())
                    .map(move |k| {
                        let (store, ns) = (store.clone(), ns.clone());
                        async move { store.delete(&ns, &k).await }
                    })
                    .buffer_unordered(TIER_CALLS_IN_FLIGHT)
                    .try_collect()
                    .await?;
                out.int(gone.into_iter().filter(|&g| g).count() as i64);
            }
            "GETDEL" => {
                arity(a.len() == 1)?;
                match self.ctx.store.take(&self.ns, &a[0]).await? {
                    Some(hit) => out.bulk_bytes(hit.value),
                    None => out.null(),
                }
            }
            "STRLEN" => {
                arity(a.len() == 1)?;
                let len = self.ctx.store.get(&self.ns, &a[0]).await?.map_or(0, |h| h.value.len());
                out.int(len as i64);
            }
            "TYPE" => {
                arity(a.len() == 1)?;
                let found = self.ctx.store.exists(&self.ns, &a[0]).await?;
                out.simple(if found { "string" } else { "none" });
            }
            "EXPIRE" | "PEXPIRE" => {
                arity(a.len() >= 2)?;
                let ms = name == "PEXPIRE";
                let cmd = if ms { "pexpire" } else { "expire" };
                let unit = keyspace::ExpireUnit { ms, relative: true, cmd };
                let set = self.expire(&a[0], &a[1], unit, &a[2..]).await?;
                out.int(i64::from(set));
            }
            "PERSIST" => {
                arity(a.len() == 1)?;
                let had = matches!(self.ctx.store.ttl(&self.ns, &a[0]).await?, Ttl::Remaining(_));
                if had {
                    self.ctx.store.expire(&self.ns, &a[0], None).await?;
                }
                out.int(i64::from(had));
            }
            "TTL" | "PTTL" => {
                arity(a.len() == 1)?;
                let v = match self.ctx.store.ttl(&self.ns, &a[0]).await? {
                    Ttl::Missing => -2,
                    Ttl::Persistent => -1,
                    Ttl::Remaining(d) if name == "PTTL" => d.as_millis() as i64,
                    Ttl::Remaining(d) => ttl_secs(d),
                };
                out.int(v);
            }
            "SCAN" => {
                arity(!a.is_empty())?;
                self.scan(a, out).await?;
            }
            "DBSIZE" => {
                arity(a.is_empty())?;
                out.int(self.ctx.store.count(&self.ns).await? as i64);
            }
            "INFO" => {
                let text = self.info_text(a).await?;
                out.bulk(text.as_bytes());
            }
            "CONFIG" => {
                arity(!a.is_empty())?;
                self.config(a, out)?;
            }
            "FLUSHDB" | "FLUSHALL" => {
                arity(a.len() <= 1)?;
                if let Some(mode) = a.first() {
                    if !is(mode, "ASYNC") && !is(mode, "SYNC") {
                        return Err(CmdError::Syntax);
                    }
                }
                if !self.principal.as_ref().is_some_and(Principal::is_admin) {
                    return Err(CmdError::NoPerm(if name == "FLUSHDB" { "flushdb" } else { "flushall" }));
                }
                if name == "FLUSHDB" {
                    self.ctx.store.delete_namespace(&self.ns).await?;
                } else {
                    for ns in self.ctx.store.namespaces().await? {
                        self.ctx.store.delete_namespace(&ns).await?;
                    }
                }
                out.ok();
            }
            "COMMAND" => match a.first() {
                Some(s) if is(s, "COUNT") => out.int(table::COMMANDS.len() as i64),
                Some(s) if is(s, "DOCS") => out.map(0),
                _ => out.array(0),
            },
            "WAITAOF" => {
                arity(a.len() == 3)?;
                let (local, replicas, timeout) = (parse_i64(&a[0])?, parse_i64(&a[1])?, parse_i64(&a[2])?);
                if local < 0 || replicas < 0 || timeout < 0 {
                    return Err(CmdError::NotInteger);
                }
                let wait = if timeout == 0 {
                    MAX_DURABILITY_WAIT
                } else {
                    Duration::from_millis(timeout as u64).min(MAX_DURABILITY_WAIT)
                };
                // 1 only if every write so far reached a tier that makes it
                // durable, and that tier synced within the timeout.
                let synced = match self.ctx.store.flush(wait).await {
                    Ok(()) => true,
                    Err(WarehouseError::Timeout { .. }) => false,
                    Err(e) => return Err(e.into()),
                };
                let now = self.ctx.store.durability_losses();
                let local = synced && now.is_some() && now == self.losses_mark;
                self.losses_mark = now;
                out.array(2);
                out.int(i64::from(local));
                out.int(0);
            }
            "WAIT" => {
                arity(a.len() == 2)?;
                parse_i64(&a[0])?;
                parse_i64(&a[1])?;
                out.int(0);
            }
            "READONLY" | "READWRITE" | "RESET" => {
                arity(a.is_empty())?;
                if name == "RESET" {
                    out.simple("RESET");
                } else {
                    out.ok();
                }
            }
            _ => return Err(unknown(args)),
        }
        Ok(Flow::Continue)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.info.clients.lock().remove(&self.id);
    }
}

/// Redis's text for an unknown command: the name and the first arguments, quoted.
fn unknown(args: &[Bytes]) -> CmdError {
    // Redis prints each word with `%.*s`, which stops at a NUL byte.
    let clip = |b: &[u8], max: usize| {
        let b = &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())];
        let s = String::from_utf8_lossy(b);
        s.chars().take(max).collect::<String>()
    };
    let mut list = String::new();
    for a in &args[1..] {
        if list.len() >= 128 {
            break;
        }
        let room = 128 - list.len();
        let _ = write!(list, "'{}' ", clip(a, room));
    }
    CmdError::UnknownCommand { name: clip(&args[0], 128), args: list }
}
