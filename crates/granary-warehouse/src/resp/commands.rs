//! Command execution for one RESP connection.
//!
//! A [`Session`] holds what a connection has established (who it is, which
//! namespace it acts on, the protocol version) and runs one parsed command
//! at a time against the store, writing the reply into the connection's
//! [`Out`]. Only the commands that Redis tooling and LMCache's connector
//! send are implemented; each keeps Redis's reply shapes and error texts so
//! unmodified clients work. Every failure is a typed [`CmdError`], turned
//! into reply text in one place.

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

fn parse_i64(b: &[u8]) -> Result<i64, CmdError> {
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

/// INFO's replication section: a lone primary. Clients that look for the
/// primary of a standalone deployment (valkey-glide, so LMCache's
/// `valkey://` connector) read `role:master` here.
const REPLICATION_INFO: &str = "# Replication\r\nrole:master\r\nconnected_slaves:0\r\n\r\n";

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

    /// A command received between MULTI and EXEC/DISCARD: transaction
    /// control runs at once; anything else is checked and queued (a failed
    /// check answers its error and dooms the transaction, as in Redis).
    async fn in_multi(&mut self, args: Vec<Bytes>, out: &mut Out) -> CmdResult {
        let spec = match self.check(&args) {
            Ok(spec) => spec,
            Err(e) => {
                self.tx_dirty = true;
                return Err(e);
            }
        };
        match spec.name {
            "multi" => return Err(CmdError::NestedMulti),
            "discard" => {
                self.end_multi();
                out.ok();
                return Ok(Flow::Continue);
            }
            "exec" => return self.exec(out).await,
            "quit" | "reset" => {
                self.end_multi();
                return self.dispatch(&args, out).await;
            }
            _ => {}
        }
        if spec.has(table::NO_MULTI) {
            self.tx_dirty = true;
            return Err(CmdError::NotInMulti);
        }
        let bytes: usize = args.iter().map(Bytes::len).sum();
        let queue = self.queued.as_mut().expect("inside MULTI");
        if queue.len() >= MAX_QUEUED || self.queued_bytes + bytes > MAX_QUEUED_BYTES {
            self.tx_dirty = true;
            return Err(CmdError::TxTooLarge);
        }
        self.queued_bytes += bytes;
        // Small arguments are copied so the queue does not pin read buffers.
        queue.push(args.into_iter().map(own).collect());
        out.simple("QUEUED");
        Ok(Flow::Continue)
    }

    fn end_multi(&mut self) -> Vec<Vec<Bytes>> {
        self.queued_bytes = 0;
        self.tx_dirty = false;
        self.queued.take().unwrap_or_default()
    }

    /// Runs the queued commands in order and answers one array of their
    /// replies; a command that fails at run time answers its error in its
    /// slot and the rest still run (Redis's semantics). Other connections'
    /// commands may interleave: there is no isolation, hence no WATCH.
    async fn exec(&mut self, out: &mut Out) -> CmdResult {
        let dirty = self.tx_dirty;
        let queued = self.end_multi();
        if dirty {
            return Err(CmdError::ExecAbort);
        }
        out.array(queued.len());
        for args in queued {
            match self.dispatch(&args, out).await {
                Ok(_) => self.ctx.resp.requests_ok.fetch_add(1, Relaxed),
                Err(e) => {
                    out.error(&e.to_string());
                    self.ctx.resp.requests_error.fetch_add(1, Relaxed)
                }
            };
        }
        Ok(Flow::Continue)
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
                let at = parse_i64(&a[1])?;
                let cmd = if ms { "pexpireat" } else { "expireat" };
                let at_ms = if ms { Some(at) } else { at.checked_mul(1000) }.ok_or(CmdError::InvalidExpire(cmd))?;
                let now = crate::types::now_ms() as i64;
                let set = self.expire(&a[0], at_ms.saturating_sub(now), true, &a[2..], cmd).await?;
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
                if n <= 0 {
                    return Err(CmdError::InvalidExpire(cmd));
                }
                let ttl = if name == "SETEX" { Duration::from_secs(n as u64) } else { Duration::from_millis(n as u64) };
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
                match self.ctx.store.get(&self.ns, &a[0]).await? {
                    Some(hit) => {
                        self.ctx.store.delete(&self.ns, &a[0]).await?;
                        out.bulk_bytes(hit.value);
                    }
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
                let n = parse_i64(&a[1])?;
                let cmd = if ms { "pexpire" } else { "expire" };
                let set = self.expire(&a[0], n, ms, &a[2..], cmd).await?;
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

    fn bind(&mut self, p: Principal) {
        self.ns = match &p {
            Principal::Admin => DEFAULT_NAMESPACE.to_string(),
            Principal::Namespace(n) => n.clone(),
            Principal::Metrics => DEFAULT_NAMESPACE.to_string(),
        };
        self.principal = Some(p);
    }

    fn authenticate(&mut self, user: Option<&[u8]>, pass: &[u8]) -> Result<(), CmdError> {
        if self.ctx.auth.is_open() {
            return Err(CmdError::AuthNotConfigured);
        }
        // `default` is the name Redis clients send when they have only a password.
        let ns = user.filter(|u| !is(u, "default")).map(|u| String::from_utf8_lossy(u).into_owned());
        match self.ctx.auth.authenticate(ns.as_deref(), pass) {
            // The metrics token is for HTTP `/metrics` alone.
            Some(Principal::Metrics) | None => Err(CmdError::WrongPass),
            Some(p) => {
                self.bind(p);
                Ok(())
            }
        }
    }

    fn auth(&mut self, args: &[Bytes], out: &mut Out) -> CmdResult {
        match args.len() {
            2 => self.authenticate(None, &args[1])?,
            3 => self.authenticate(Some(&args[1]), &args[2])?,
            _ => return Err(CmdError::Arity("auth".into())),
        }
        self.publish(out.proto);
        out.ok();
        Ok(Flow::Continue)
    }

    fn hello(&mut self, args: &[Bytes], out: &mut Out) -> CmdResult {
        let a = &args[1..];
        let mut proto = out.proto;
        let mut i = 0;
        if let Some(v) = a.first() {
            let v = parse_i64(v).map_err(|_| CmdError::ProtoNotInteger)?;
            if v != 2 && v != 3 {
                return Err(CmdError::NoProto);
            }
            proto = v as u8;
            i = 1;
        }
        let mut auth: Option<(&Bytes, &Bytes)> = None;
        let mut setname = None;
        while i < a.len() {
            if is(&a[i], "AUTH") && i + 2 < a.len() {
                auth = Some((&a[i + 1], &a[i + 2]));
                i += 3;
            } else if is(&a[i], "SETNAME") && i + 1 < a.len() {
                setname = Some(&a[i + 1]);
                i += 2;
            } else {
                return Err(CmdError::Syntax);
            }
        }
        if let Some(n) = setname {
            check_client_name(n)?;
        }
        if let Some((user, pass)) = auth {
            self.authenticate(Some(user), pass)?;
        }
        if self.principal.is_none() {
            return Err(CmdError::HelloNoAuth);
        }
        if let Some(n) = setname {
            self.name = (!n.is_empty()).then(|| n.clone());
        }
        out.proto = proto;
        self.publish(proto);
        out.map(7);
        out.bulk(b"server");
        out.bulk(b"redis");
        out.bulk(b"version");
        out.bulk(REDIS_VERSION.as_bytes());
        out.bulk(b"proto");
        out.int(i64::from(proto));
        out.bulk(b"id");
        out.int(self.id as i64);
        out.bulk(b"mode");
        out.bulk(b"standalone");
        out.bulk(b"role");
        out.bulk(b"master");
        out.bulk(b"modules");
        out.array(0);
        Ok(Flow::Continue)
    }

    fn client(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let sub = String::from_utf8_lossy(&a[0]).to_ascii_uppercase();
        let arity = |ok: bool| if ok { Ok(()) } else { Err(CmdError::Arity(format!("client|{}", sub.to_lowercase()))) };
        match sub.as_str() {
            "SETINFO" => {
                arity(a.len() == 3)?;
                out.ok();
            }
            "SETNAME" => {
                arity(a.len() == 2)?;
                check_client_name(&a[1])?;
                self.name = (!a[1].is_empty()).then(|| a[1].clone());
                self.publish(out.proto);
                out.ok();
            }
            "GETNAME" => {
                arity(a.len() == 1)?;
                match &self.name {
                    Some(n) => out.bulk(n),
                    None => out.null(),
                }
            }
            "ID" => {
                arity(a.len() == 1)?;
                out.int(self.id as i64);
            }
            "INFO" => {
                arity(a.len() == 1)?;
                let name = self.name.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
                let line = format!("id={} name={} db=0 namespace={} resp={}\n", self.id, name, self.ns, out.proto);
                out.bulk(line.as_bytes());
            }
            "LIST" => {
                // Redis's `CLIENT LIST [TYPE normal] [ID id ...]`; other filters are refused.
                let mut ids: Option<Vec<u64>> = None;
                let mut i = 1;
                while i < a.len() {
                    if is(&a[i], "TYPE") && i + 1 < a.len() {
                        if !is(&a[i + 1], "normal") {
                            ids = Some(Vec::new());
                        }
                        i += 2;
                    } else if is(&a[i], "ID") && i + 1 < a.len() {
                        let list = ids.get_or_insert_with(Vec::new);
                        for v in &a[i + 1..] {
                            list.push(parse_i64(v)? as u64);
                        }
                        i = a.len();
                    } else {
                        return Err(CmdError::Syntax);
                    }
                }
                let text = self.client_list(ids.as_deref());
                out.bulk(text.as_bytes());
            }
            "NO-EVICT" | "NO-TOUCH" | "REPLY" => {
                arity(a.len() == 2)?;
                out.ok();
            }
            _ => return Err(CmdError::UnknownSubcommand { cmd: "CLIENT", sub: String::from_utf8_lossy(&a[0]).into() }),
        }
        Ok(())
    }

    /// CLIENT LIST's lines: a tenant sees the connections working in its
    /// own namespace, the admin sees all.
    fn client_list(&self, ids: Option<&[u64]>) -> String {
        let admin = self.principal.as_ref().is_some_and(Principal::is_admin);
        let clients = self.info.clients.lock();
        let mut t = String::new();
        for (id, c) in clients.iter() {
            if ids.is_some_and(|ids| !ids.contains(id)) || (!admin && c.namespace != self.ns) {
                continue;
            }
            let _ = writeln!(
                t,
                "id={id} addr={} laddr=127.0.0.1:{} name={} age={} db=0 namespace={} resp={} flags=N",
                c.addr,
                self.info.port,
                c.name,
                c.connected.elapsed().as_secs(),
                c.namespace,
                c.resp,
            );
        }
        t
    }

    /// GETEX key [EX s | PX ms | EXAT t | PXAT t | PERSIST]: the value, and
    /// the new expiry set on it if there is one.
    async fn getex(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        enum Change {
            Keep,
            Persist,
            In(i64),
        }
        let change = match &a[1..] {
            [] => Change::Keep,
            [w] if is(w, "PERSIST") => Change::Persist,
            [w, n] => {
                let n = parse_i64(n)?;
                if n <= 0 {
                    return Err(CmdError::InvalidExpire("getex"));
                }
                let now = crate::types::now_ms() as i64;
                let ms = if is(w, "EX") {
                    n.checked_mul(1000)
                } else if is(w, "PX") {
                    Some(n)
                } else if is(w, "EXAT") {
                    n.checked_mul(1000).map(|at| at.saturating_sub(now))
                } else if is(w, "PXAT") {
                    Some(n.saturating_sub(now))
                } else {
                    return Err(CmdError::Syntax);
                };
                Change::In(ms.ok_or(CmdError::InvalidExpire("getex"))?)
            }
            _ => return Err(CmdError::Syntax),
        };
        let Some(hit) = self.ctx.store.get(&self.ns, &a[0]).await? else {
            out.null();
            return Ok(());
        };
        match change {
            Change::Keep => {}
            Change::Persist => {
                self.ctx.store.expire(&self.ns, &a[0], None).await?;
            }
            // A time already past deletes the key, as in Redis; the value is still answered.
            Change::In(ms) if ms <= 0 => {
                self.ctx.store.delete(&self.ns, &a[0]).await?;
            }
            Change::In(ms) => {
                self.ctx.store.expire(&self.ns, &a[0], Some(Duration::from_millis(ms as u64))).await?;
            }
        }
        out.bulk_bytes(hit.value);
        Ok(())
    }

    /// KEYS pattern, over this namespace only. It walks the namespace with
    /// the SCAN cursor and refuses once more than [`KEYS_LIMIT`] keys have
    /// been walked, so it can never stall the server on a huge keyspace.
    async fn keys(&self, pattern: &[u8], out: &mut Out) -> Result<(), CmdError> {
        let all = pattern == b"*";
        let (mut cursor, mut walked, mut found) = (0u64, 0usize, Vec::new());
        loop {
            let page = self.ctx.store.scan(&self.ns, cursor, 1000).await?;
            walked += page.keys.len();
            if walked > KEYS_LIMIT {
                return Err(CmdError::KeysTooMany);
            }
            found.extend(page.keys.into_iter().filter(|k| all || glob_match(pattern, k, false)));
            if page.next == 0 {
                break;
            }
            cursor = page.next;
        }
        out.array(found.len());
        for k in &found {
            out.bulk(k);
        }
        Ok(())
    }

    async fn set(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let mut opts = PutOptions::default();
        let (mut get, mut keep_ttl, mut expiry_given) = (false, false, false);
        let mut i = 2;
        while i < a.len() {
            let w = &a[i];
            if is(w, "NX") && opts.condition == Condition::Always {
                opts.condition = Condition::IfAbsent;
            } else if is(w, "XX") && opts.condition == Condition::Always {
                opts.condition = Condition::IfPresent;
            } else if is(w, "GET") {
                get = true;
            } else if is(w, "KEEPTTL") && !expiry_given {
                keep_ttl = true;
                expiry_given = true;
            } else if (is(w, "EX") || is(w, "PX") || is(w, "EXAT") || is(w, "PXAT")) && !expiry_given && i + 1 < a.len()
            {
                let n = parse_i64(&a[i + 1])?;
                if n <= 0 {
                    return Err(CmdError::InvalidExpire("set"));
                }
                let n = n as u64;
                let now = crate::types::now_ms();
                let ttl = if is(w, "EX") {
                    Duration::from_secs(n)
                } else if is(w, "PX") {
                    Duration::from_millis(n)
                } else {
                    let at = if is(w, "EXAT") { n.saturating_mul(1000) } else { n };
                    // A time already past stores a key that is gone at once, as in Redis.
                    Duration::from_millis(at.saturating_sub(now).max(1))
                };
                opts.ttl = Some(ttl);
                expiry_given = true;
                i += 1;
            } else {
                return Err(CmdError::Syntax);
            }
            i += 1;
        }
        let key = Bytes::copy_from_slice(&a[0]);
        let old = if get { self.ctx.store.get(&self.ns, &key).await?.map(|h| h.value) } else { None };
        if keep_ttl {
            if let Ttl::Remaining(d) = self.ctx.store.ttl(&self.ns, &key).await? {
                opts.ttl = Some(d.max(Duration::from_millis(1)));
            }
        }
        let stored = self.ctx.store.put(&self.ns, key, own(a[1].clone()), opts).await?;
        if get {
            match old {
                Some(v) => out.bulk_bytes(v),
                None => out.null(),
            }
        } else if stored {
            out.ok();
        } else {
            out.null();
        }
        Ok(())
    }

    async fn expire(&self, key: &[u8], n: i64, ms: bool, flags: &[Bytes], cmd: &'static str) -> Result<bool, CmdError> {
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for f in flags {
            if is(f, "NX") {
                nx = true;
            } else if is(f, "XX") {
                xx = true;
            } else if is(f, "GT") {
                gt = true;
            } else if is(f, "LT") {
                lt = true;
            } else {
                return Err(CmdError::Syntax);
            }
        }
        if (nx && (xx || gt || lt)) || (gt && lt) {
            return Err(CmdError::Syntax);
        }
        let new_ms = if ms { Some(n) } else { n.checked_mul(1000) }.ok_or(CmdError::InvalidExpire(cmd))?;
        let current = self.ctx.store.ttl(&self.ns, key).await?;
        let current_ms = match current {
            Ttl::Missing => return Ok(false),
            Ttl::Persistent => None,
            Ttl::Remaining(d) => Some(d.as_millis() as i64),
        };
        let allowed = match current_ms {
            None => !xx && !gt,
            Some(c) => !nx && (!gt || new_ms > c) && (!lt || new_ms < c),
        };
        if !allowed {
            return Ok(false);
        }
        if new_ms <= 0 {
            return Ok(self.ctx.store.delete(&self.ns, key).await?);
        }
        Ok(self.ctx.store.expire(&self.ns, key, Some(Duration::from_millis(new_ms as u64))).await?)
    }

    async fn scan(&self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let cursor =
            std::str::from_utf8(&a[0]).ok().and_then(|s| s.parse::<u64>().ok()).ok_or(CmdError::InvalidCursor)?;
        let (mut pattern, mut count, mut strings) = (None, DEFAULT_SCAN_COUNT, true);
        let mut i = 1;
        while i < a.len() {
            let Some(v) = a.get(i + 1) else { return Err(CmdError::Syntax) };
            if is(&a[i], "MATCH") {
                pattern = Some(v.clone());
            } else if is(&a[i], "COUNT") {
                let n = parse_i64(v)?;
                if n < 1 {
                    return Err(CmdError::Syntax);
                }
                count = n.min(100_000) as usize;
            } else if is(&a[i], "TYPE") {
                strings = is(v, "string");
            } else {
                return Err(CmdError::Syntax);
            }
            i += 2;
        }
        let page = self.ctx.store.scan(&self.ns, cursor, count).await?;
        let keys: Vec<&Bytes> = page
            .keys
            .iter()
            .filter(|k| strings && pattern.as_ref().is_none_or(|p| p.as_ref() == b"*" || glob_match(p, k, false)))
            .collect();
        out.array(2);
        out.bulk(page.next.to_string().as_bytes());
        out.array(keys.len());
        for k in keys {
            out.bulk(k);
        }
        Ok(())
    }

    fn config(&self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let sub = String::from_utf8_lossy(&a[0]).to_ascii_uppercase();
        match sub.as_str() {
            "GET" => {
                if a.len() < 2 {
                    return Err(CmdError::Arity("config|get".into()));
                }
                let cfg = self.ctx.store.config();
                let params: [(&str, String); 6] = [
                    ("maxmemory", cfg.memory.as_u64().to_string()),
                    ("maxmemory-policy", cfg.memory_policy.to_string()),
                    ("save", String::new()),
                    ("appendonly", "no".into()),
                    ("databases", "1".into()),
                    ("proto-max-bulk-len", cfg.max_value.as_u64().to_string()),
                ];
                let hits: Vec<&(&str, String)> =
                    params.iter().filter(|(k, _)| a[1..].iter().any(|p| glob_match(p, k.as_bytes(), true))).collect();
                out.map(hits.len());
                for (k, v) in hits {
                    out.bulk(k.as_bytes());
                    out.bulk(v.as_bytes());
                }
            }
            "SET" => {
                if a.len() < 3 || a.len().is_multiple_of(2) {
                    return Err(CmdError::Arity("config|set".into()));
                }
                out.ok();
            }
            "RESETSTAT" | "REWRITE" => out.ok(),
            _ => return Err(CmdError::UnknownSubcommand { cmd: "CONFIG", sub: String::from_utf8_lossy(&a[0]).into() }),
        }
        Ok(())
    }

    /// INFO as a tenant sees it: its own namespace's figures only (no
    /// process id, no server-wide counters, no other tenant's bytes).
    async fn tenant_info_text(&self, want: &(dyn Fn(&str) -> bool + Sync)) -> Result<String, CmdError> {
        let cfg = self.ctx.store.config();
        let usage = self.ctx.store.namespace_usage(&self.ns);
        let mut t = String::new();
        if want("server") {
            let _ = write!(
                t,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ngranary_version:{}\r\nredis_mode:standalone\r\n\
                 tcp_port:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                self.info.port,
            );
        }
        if want("clients") {
            let mine = self.info.clients.lock().values().filter(|c| c.namespace == self.ns).count();
            let _ = write!(t, "# Clients\r\nconnected_clients:{mine}\r\n\r\n");
        }
        if want("replication") {
            t.push_str(REPLICATION_INFO);
        }
        let mem = usage.iter().find(|u| u.tier == crate::TierKind::Memory);
        if want("memory") {
            let _ = write!(
                t,
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:{}\r\n\r\n",
                mem.and_then(|m| m.bytes).unwrap_or(0),
                mem.and_then(|m| m.quota).unwrap_or(cfg.memory.as_u64()),
                cfg.memory_policy,
            );
        }
        if want("tiers") || want("granary") {
            let _ = write!(t, "# Tiers\r\nnamespace:{}\r\n", self.ns);
            let num = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
            for u in &usage {
                let _ = write!(
                    t,
                    "tier_{}:bytes={},entries={},quota={}\r\n",
                    u.tier.as_str(),
                    num(u.bytes),
                    num(u.entries),
                    num(u.quota),
                );
            }
            t.push_str("\r\n");
        }
        if want("keyspace") {
            let keys = self.ctx.store.count(&self.ns).await?;
            let _ = write!(t, "# Keyspace\r\ndb0:keys={keys},expires=0,avg_ttl=0\r\n");
        }
        Ok(t)
    }

    async fn info_text(&self, a: &[Bytes]) -> Result<String, CmdError> {
        let wanted: Vec<String> = a.iter().map(|s| lower(s)).collect();
        let all = wanted.is_empty() || wanted.iter().any(|w| w == "all" || w == "everything" || w == "default");
        let want = |s: &str| all || wanted.iter().any(|w| w == s);
        // An open server has one trust level; with tokens, only the admin
        // sees the server's own figures.
        if !self.ctx.auth.is_open() && !self.principal.as_ref().is_some_and(Principal::is_admin) {
            return self.tenant_info_text(&want).await;
        }
        let stats = self.ctx.store.stats();
        let p = self.ctx.resp.snapshot();
        let cfg = self.ctx.store.config();
        let mut t = String::new();
        // Writing to a String cannot fail; results are ignored.
        if want("server") {
            let _ = write!(
                t,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ngranary_version:{}\r\nredis_mode:standalone\r\n\
                 os:{} {}\r\narch_bits:{}\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::OS,
                std::env::consts::ARCH,
                usize::BITS,
                std::process::id(),
                self.info.port,
                self.info.started.elapsed().as_secs(),
            );
        }
        if want("clients") {
            let _ = write!(t, "# Clients\r\nconnected_clients:{}\r\n\r\n", p.connections_open);
        }
        if want("replication") {
            t.push_str(REPLICATION_INFO);
        }
        let mem = stats.tiers.first().cloned().unwrap_or_default();
        if want("memory") {
            let _ = write!(
                t,
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:{}\r\n\r\n",
                mem.bytes,
                cfg.memory.as_u64(),
                cfg.memory_policy,
            );
        }
        if want("stats") {
            let _ = write!(
                t,
                "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\n\
                 total_net_input_bytes:{}\r\ntotal_net_output_bytes:{}\r\nkeyspace_hits:{}\r\n\
                 keyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:{}\r\ngranary_requests_ok:{}\r\n\
                 granary_requests_error:{}\r\ngranary_protocol_errors:{}\r\n\r\n",
                p.connections_total,
                p.requests_ok + p.requests_error,
                p.bytes_read,
                p.bytes_written,
                mem.hits,
                mem.misses,
                mem.evictions,
                mem.expirations,
                p.requests_ok,
                p.requests_error,
                p.protocol_errors,
            );
        }
        if want("tiers") || want("granary") {
            let _ = write!(t, "# Tiers\r\nnamespace:{}\r\n", self.ns);
            for s in &stats.tiers {
                let _ = write!(
                    t,
                    "tier_{}:bytes={},entries={},capacity={},hits={},misses={},evictions={},expirations={},\
                     corrupt_dropped={},verify_failed={},errors={},policy={}\r\n",
                    s.tier.map_or("unknown", |k| k.as_str()),
                    s.bytes,
                    s.entries,
                    s.capacity,
                    s.hits,
                    s.misses,
                    s.evictions,
                    s.expirations,
                    s.corrupt_dropped,
                    s.verify_failed,
                    s.errors,
                    s.policy.as_deref().unwrap_or("-"),
                );
            }
            for o in &stats.offload {
                let _ = write!(
                    t,
                    "offload_{}:queued={},written={},dropped={},errors={}\r\n",
                    o.tier.map_or("unknown", |k| k.as_str()),
                    o.queued,
                    o.written,
                    o.dropped,
                    o.errors,
                );
            }
            let _ = write!(
                t,
                "promotions_from_disk:{}\r\npromotions_from_remote:{}\r\n\r\n",
                stats.promotions_from_disk, stats.promotions_from_remote
            );
        }
        if want("keyspace") {
            let keys = self.ctx.store.count(&self.ns).await?;
            let _ = write!(t, "# Keyspace\r\ndb0:keys={keys},expires=0,avg_ttl=0\r\n");
        }
        Ok(t)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.info.clients.lock().remove(&self.id);
    }
}

fn check_client_name(n: &[u8]) -> Result<(), CmdError> {
    if n.iter().all(|&c| (b'!'..=b'~').contains(&c)) {
        Ok(())
    } else {
        Err(CmdError::BadClientName)
    }
}

/// Redis's text for an unknown command: the name and the first arguments, quoted.
fn unknown(args: &[Bytes]) -> CmdError {
    let clip = |b: &[u8], max: usize| {
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
