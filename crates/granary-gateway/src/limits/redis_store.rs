//! Counters in Redis, shared by every gateway on the same server and prefix.
//!
//! Keys: `{prefix}{t<tenant>}:{k|t}:{id}:{rpm|tpm|tpd|tpmo|spd|spmo}:{window start, unix seconds}`,
//! e.g. `granary:limits:{t4}:k:42:tpd:1735689600`. They name key and tenant
//! ids, never secrets, and expire a second after their window ends. The
//! per-minute rates (`rpm`, `tpm`) have window start 0 and hold a time (GCRA,
//! see the admission script); they expire a second after all they counted
//! has drained. The
//! `{t<tenant>}` hash tag puts every key of one tenant (its own and its
//! keys') in one Redis Cluster slot, so one script call may touch them all.
//!
//! One admission is one script call: the script reads every window of the
//! key and the tenant and increments the request counters only if all of
//! them admit, reserving the request's worst case in the token windows. One
//! charge or settlement is one script call too (`INCRBY`, or a release that
//! never goes below 0).
//!
//! Every call is bounded by the configured timeout. On any error or timeout
//! the limiter fails open (the request is admitted, the charge dropped),
//! counts the error and logs a warning at most every 10 seconds; the
//! connection manager reconnects on its own.
//!
//! Several URLs, comma-separated, name the seed nodes of a Redis Cluster:
//! the cluster client follows the slot map (and `MOVED` answers), and the
//! hash tag keeps each script call in one slot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use parking_lot::RwLock;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use serde::Deserialize;

use super::{Ask, Check};

/// Where and how the limiter talks to Redis.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisOptions {
    /// Prepended to every key (default `granary:limits:`). Gateways that
    /// should share limits must use the same prefix.
    pub prefix: String,
    /// How long one admission or charge may wait for Redis before the
    /// limiter gives up and fails open, in milliseconds (default 50).
    pub timeout_ms: u64,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions { prefix: "granary:limits:".to_string(), timeout_ms: 50 }
    }
}

/// Checks every window of one request and counts it if all admit.
///
/// `KEYS[i]` is a window; `ARGV[1]` the request's token estimate; then per
/// window three arguments: its kind, the limit, and the key's time to live
/// in seconds (calendar windows). Kinds: `r` requests per minute and `q`
/// tokens per minute, both rates (GCRA: the key holds the time, in unix
/// milliseconds, when all it counted has drained, each unit taking
/// 60000 / limit ms); `t` a calendar token window and `s` a calendar spend
/// window (the key holds a count, of tokens or of micro-units of currency).
/// Then the reservation (added to every token window on admission), the
/// caller's clock, the spend estimate (refuses outright when over an `s`
/// limit) and the spend reserved (added to every `s` window on admission). Returns every window's count after the call (`#KEYS`
/// values), then the failed windows as `i1, used1, i2, used2, ...`
/// (1-based), none when admitted.
const ADMIT_SCRIPT: &str = r#"
local estimate = tonumber(ARGV[1])
local reserve = tonumber(ARGV[3 * #KEYS + 2]) or 0
local now = tonumber(ARGV[3 * #KEYS + 3])
local spend_estimate = tonumber(ARGV[3 * #KEYS + 4]) or 0
local spend = tonumber(ARGV[3 * #KEYS + 5]) or 0
local function level(tat, max)
  if tat <= now then return 0 end
  return math.max(0, math.ceil((tat - now) * max / 60000 - 1e-6))
end
local failed = {}
local counts = {}
local state = {}
for i = 1, #KEYS do
  local kind = ARGV[3 * i - 1]
  local max = tonumber(ARGV[3 * i])
  local raw = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
  local used = raw
  if kind ~= 't' and kind ~= 's' then used = level(raw, max) end
  state[i] = raw
  counts[i] = used
  local ask = estimate
  if kind == 's' then ask = spend_estimate end
  if used >= max or (kind ~= 'r' and ask > max) then
    failed[#failed + 1] = i
    failed[#failed + 1] = used
  end
end
if #failed == 0 then
  for i = 1, #KEYS do
    local kind = ARGV[3 * i - 1]
    local max = tonumber(ARGV[3 * i])
    local n = reserve
    if kind == 'r' then n = 1 end
    if kind == 's' then n = spend end
    if n > 0 then
      if kind == 't' or kind == 's' then
        counts[i] = redis.call('INCRBY', KEYS[i], n)
        redis.call('EXPIRE', KEYS[i], ARGV[3 * i + 1])
      else
        local tat = math.max(state[i], now) + n * 60000 / max
        redis.call('SET', KEYS[i], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
        counts[i] = level(tat, max)
      end
    end
  end
end
for j = 1, #failed do
  counts[#counts + 1] = failed[j]
end
return counts
"#;

/// Adds `ARGV[1]` to every key (a negative amount releases: only from a
/// key that still exists, and never below 0); `ARGV[2]` is the caller's
/// clock; then per key its kind (`q`, `t` or `s`, as in the admission script),
/// limit and time to live in seconds.
const ADJUST_SCRIPT: &str = r#"
local delta = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
for i = 1, #KEYS do
  local kind = ARGV[3 * i]
  local max = tonumber(ARGV[3 * i + 1])
  if kind == 't' or kind == 's' then
    if delta > 0 then
      redis.call('INCRBY', KEYS[i], delta)
      redis.call('EXPIRE', KEYS[i], ARGV[3 * i + 2])
    elseif redis.call('EXISTS', KEYS[i]) == 1 then
      if redis.call('DECRBY', KEYS[i], -delta) < 0 then
        redis.call('SET', KEYS[i], 0, 'KEEPTTL')
      end
    end
  else
    local raw = redis.call('GET', KEYS[i])
    local tat = tonumber(raw or '0') or 0
    if delta > 0 then
      tat = math.max(tat, now) + delta * 60000 / max
      redis.call('SET', KEYS[i], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
    elseif raw then
      tat = tat + delta * 60000 / max
      if tat <= now then
        redis.call('DEL', KEYS[i])
      else
        redis.call('SET', KEYS[i], string.format('%.3f', tat), 'KEEPTTL')
      end
    end
  end
end
return 0
"#;

/// Raises every key to at least `ARGV[2i - 1]`, with time to live
/// `ARGV[2i]` when it sets it.
const RAISE_SCRIPT: &str = r#"
for i = 1, #KEYS do
  local want = tonumber(ARGV[2 * i - 1])
  local have = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
  if have < want then
    redis.call('SET', KEYS[i], want, 'EX', ARGV[2 * i])
  end
end
return 0
"#;

/// Seconds a key outlives its window (absorbs small clock differences
/// between gateways).
const GRACE_SECS: i64 = 1;
/// The most often a Redis failure is logged.
const WARN_EVERY: Duration = Duration::from_secs(10);
const NEVER: u64 = u64::MAX;

/// A connection to one server, or to a cluster.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Where to connect: one server, or a cluster's seed nodes.
#[derive(Clone)]
enum Target {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

impl Target {
    fn parse(url: &str) -> anyhow::Result<Target> {
        let urls: Vec<&str> = url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        if urls.len() > 1 {
            let client = redis::cluster::ClusterClientBuilder::new(urls)
                .connection_timeout(Duration::from_secs(1))
                .build()
                .context("limits: the Redis Cluster URLs are not valid")?;
            return Ok(Target::Cluster(client));
        }
        // The URL may hold a password: the error names the field, not the URL.
        Ok(Target::Single(redis::Client::open(url).context("limits: the Redis URL is not valid")?))
    }

    async fn connect(&self, config: &ConnectionManagerConfig) -> redis::RedisResult<Conn> {
        match self {
            Target::Single(c) => Ok(Conn::Single(ConnectionManager::new_with_config(c.clone(), config.clone()).await?)),
            Target::Cluster(c) => Ok(Conn::Cluster(c.get_async_connection().await?)),
        }
    }
}

/// What the background connector and the callers share.
struct Shared {
    conn: RwLock<Option<Conn>>,
    errors: AtomicU64,
    /// Milliseconds after `started` of the last warning, or [`NEVER`].
    last_warn_ms: AtomicU64,
    started: Instant,
}

impl Shared {
    /// Counts a failed call and logs it, at most once per [`WARN_EVERY`].
    fn failed(&self, what: &str, cause: &dyn std::fmt::Display) {
        let total = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(NEVER - 1);
        let last = self.last_warn_ms.load(Ordering::Relaxed);
        let due = last == NEVER || now >= last.saturating_add(WARN_EVERY.as_millis() as u64);
        if due && self.last_warn_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            tracing::warn!(
                error = %cause,
                errors_total = total,
                "limits: Redis {what} failed; admitting without limits until Redis answers again"
            );
        }
    }
}

pub(super) struct RedisStore {
    shared: Arc<Shared>,
    prefix: String,
    timeout: Duration,
    script: redis::Script,
    adjust: redis::Script,
    raise: redis::Script,
}

impl RedisStore {
    /// Parses the URL, starts connecting in the background and waits up to
    /// about a second for the first connection.
    pub(super) async fn connect(url: &str, options: RedisOptions) -> anyhow::Result<Self> {
        if options.timeout_ms == 0 {
            bail!("limits: redis timeout_ms must be at least 1");
        }
        let client = Target::parse(url)?;
        let shared = Arc::new(Shared {
            conn: RwLock::new(None),
            errors: AtomicU64::new(0),
            last_warn_ms: AtomicU64::new(NEVER),
            started: Instant::now(),
        });
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(connect_loop(client, Arc::downgrade(&shared), ready_tx));
        // Not connected after this is fine: callers fail open meanwhile.
        let _ = tokio::time::timeout(Duration::from_secs(1), ready_rx).await;
        Ok(RedisStore {
            shared,
            prefix: options.prefix,
            timeout: Duration::from_millis(options.timeout_ms),
            script: redis::Script::new(ADMIT_SCRIPT),
            adjust: redis::Script::new(ADJUST_SCRIPT),
            raise: redis::Script::new(RAISE_SCRIPT),
        })
    }

    pub(super) fn errors(&self) -> u64 {
        self.shared.errors.load(Ordering::Relaxed)
    }

    fn key(&self, check: &Check) -> String {
        format!(
            "{}{{t{}}}:{}:{}:{}:{}",
            self.prefix,
            check.tenant,
            check.scope.tag(),
            check.id,
            check.kind.tag(),
            check.start_ms.div_euclid(1000)
        )
    }

    /// The connection, or `None` (counted as an error) while the first one
    /// is still being made.
    fn connection(&self, what: &str) -> Option<Conn> {
        let conn = self.shared.conn.read().clone();
        if conn.is_none() {
            self.shared.failed(what, &"not connected yet (connecting in the background)");
        }
        conn
    }

    /// The failed windows as `(index into checks, used)`, and every
    /// window's count after the call; both empty when Redis failed (fail
    /// open).
    pub(super) async fn admit(&self, checks: &[Check], ask: &Ask, now_ms: i64) -> (Vec<(usize, u64)>, Vec<u64>) {
        let Some(mut conn) = self.connection("admission") else { return (Vec::new(), Vec::new()) };
        let mut call = self.script.prepare_invoke();
        call.arg(ask.estimate);
        for c in checks {
            call.key(self.key(c)).arg(kind_code(c)).arg(c.max).arg(ttl_secs(c, now_ms));
        }
        call.arg(ask.tokens).arg(now_ms).arg(ask.spend_estimate.0).arg(ask.spend.0);
        let reply = tokio::time::timeout(self.timeout, call.invoke_async::<Vec<i64>>(&mut conn)).await;
        let flat = match reply {
            Ok(Ok(flat)) => flat,
            Ok(Err(e)) => {
                self.shared.failed("admission", &e);
                return (Vec::new(), Vec::new());
            }
            Err(_) => {
                self.shared.failed("admission", &format_args!("no answer within {} ms", self.timeout.as_millis()));
                return (Vec::new(), Vec::new());
            }
        };
        if flat.len() < checks.len() {
            self.shared.failed("admission", &"a short answer from the admission script");
            return (Vec::new(), Vec::new());
        }
        let (counts, pairs) = flat.split_at(checks.len());
        let failed = pairs
            .chunks_exact(2)
            .filter_map(|pair| {
                let i = usize::try_from(pair[0]).ok()?.checked_sub(1)?;
                (i < checks.len()).then(|| (i, u64::try_from(pair[1]).unwrap_or(0)))
            })
            .collect();
        (failed, counts.iter().map(|&n| u64::try_from(n).unwrap_or(0)).collect())
    }

    /// Adds `delta` to every given token or spend window (a release, never
    /// below 0, when negative).
    pub(super) async fn adjust(&self, checks: &[Check], delta: i64, now_ms: i64) {
        let Some(mut conn) = self.connection("charge") else { return };
        let mut call = self.adjust.prepare_invoke();
        call.arg(delta).arg(now_ms);
        for c in checks.iter().filter(|c| !c.kind.is_requests()) {
            call.key(self.key(c)).arg(kind_code(c)).arg(c.max.max(1)).arg(ttl_secs(c, now_ms));
        }
        match tokio::time::timeout(self.timeout, call.invoke_async::<i64>(&mut conn)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => self.shared.failed("charge", &e),
            Err(_) => self.shared.failed("charge", &format_args!("no answer within {} ms", self.timeout.as_millis())),
        }
    }
}

impl RedisStore {
    /// Raises each counter (all of one tenant) to at least its value.
    pub(super) async fn raise(&self, counters: &[(Check, u64)], now_ms: i64) {
        let Some(mut conn) = self.connection("restore") else { return };
        let mut call = self.raise.prepare_invoke();
        for (c, value) in counters {
            call.key(self.key(c)).arg(*value).arg(ttl_secs(c, now_ms));
        }
        match tokio::time::timeout(self.timeout, call.invoke_async::<i64>(&mut conn)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => self.shared.failed("restore", &e),
            Err(_) => self.shared.failed("restore", &format_args!("no answer within {} ms", self.timeout.as_millis())),
        }
    }
}

/// The admission script's name for a check's kind.
fn kind_code(c: &Check) -> &'static str {
    match (c.kind.is_requests(), c.kind.is_rate(), c.kind.is_spend()) {
        (true, _, _) => "r",
        (false, true, _) => "q",
        (false, false, true) => "s",
        (false, false, false) => "t",
    }
}

/// Seconds from `now_ms` until the window ends, rounded up, plus grace.
fn ttl_secs(check: &Check, now_ms: i64) -> i64 {
    let left_ms = check.end_ms.saturating_sub(now_ms).max(0);
    (left_ms.saturating_add(999) / 1000).saturating_add(GRACE_SECS).max(1)
}

/// Makes the first connection, retrying with backoff until it succeeds or
/// the store is dropped. From then on the connection manager reconnects
/// by itself whenever a call meets a broken connection.
async fn connect_loop(client: Target, shared: Weak<Shared>, ready: tokio::sync::oneshot::Sender<()>) {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Duration::from_secs(1))
        .set_number_of_retries(1)
        .set_factor(50)
        .set_max_delay(500);
    let mut delay = Duration::from_millis(100);
    loop {
        if shared.strong_count() == 0 {
            return;
        }
        match client.connect(&config).await {
            Ok(conn) => {
                if let Some(shared) = shared.upgrade() {
                    *shared.conn.write() = Some(conn);
                    tracing::info!("limits: connected to Redis");
                }
                let _ = ready.send(());
                return;
            }
            Err(e) => {
                let Some(s) = shared.upgrade() else { return };
                if s.last_warn_ms.load(Ordering::Relaxed) == NEVER {
                    tracing::warn!(error = %e, "limits: cannot reach Redis yet; admitting without limits meanwhile");
                    s.last_warn_ms
                        .store(u64::try_from(s.started.elapsed().as_millis()).unwrap_or(0), Ordering::Relaxed);
                }
                drop(s);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}
