//! Request and token limits per key and per tenant, in process or shared through Redis.
//!
//! Every request must fit both its key's and its tenant's [`Limits`]:
//!
//! | limit                 | counted as                                  |
//! |-----------------------|---------------------------------------------|
//! | `requests_per_minute` | a rate (GCRA): each request drains in 60 s / limit |
//! | `tokens_per_minute`   | a rate (GCRA): each token drains in 60 s / limit   |
//! | `tokens_per_day`      | a fixed window: the UTC day                 |
//! | `tokens_per_month`    | a fixed window: the UTC calendar month      |
//! | `spend_per_day`       | a fixed window: the UTC day, in currency    |
//! | `spend_per_month`     | a fixed window: the UTC month, in currency  |
//!
//! A rate is a bucket that drains continuously, so there is no window edge
//! at which a second full burst fits: whatever is taken at once, no 60 s
//! span sees more than the limit plus what drained within it. "Used" is the
//! bucket's level (rounded up), "reset" the time until it is empty, and a
//! refusal's retry time the time until it is under the limit again. The
//! day and month budgets are calendar windows, as billing is.
//!
//! Admission ([`Limiter::admit`]) happens before the request is sent
//! upstream, when only an estimate of its tokens is known. The request
//! counters are checked and incremented in one atomic step, so a rejected
//! request costs nothing. A token window admits while the tokens already
//! spent are under its limit (`used < max`); a request whose estimate alone
//! is over a token limit is refused outright, as it could never fit.
//! [`Limiter::reserve`] (what the proxy uses) also reserves the request's
//! worst case in every token window in that same step, so concurrent
//! requests see each other and overshoot a budget by at most one
//! reservation; [`Limiter::settle`] replaces the reservation with the real
//! tokens when the request ends. [`Limiter::charge`] adds tokens without
//! a reservation.
//!
//! The spend budgets work the same way in currency ([`Money`], micro-units):
//! [`Limiter::reserve_ask`] reserves the request's worst-case cost (the
//! prompt at the input price plus `max_tokens` at the output price of the
//! requested model) and [`Limiter::settle_spend`] replaces it with the cost
//! of what was used, at the price of the model that served it. A refusal
//! is a 429 with code `insufficient_quota`, as OpenAI answers a spent
//! quota, naming the budget.
//!
//! With one gateway the counters live in process ([`Limiter::in_process`]).
//! With several, they live in Redis ([`Limiter::redis`]): one script call
//! per admission, one pipeline per charge, and every counter expires after
//! its window. Redis trouble never blocks traffic: the limiter fails open,
//! counts the error ([`Limiter::backend_errors`]) and reconnects in the
//! background.

mod memory;
mod redis_store;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Datelike, NaiveDate, Utc};

use crate::pricing::Money;
use crate::types::now_ms;
use crate::{ApiError, Limits, Principal};

pub use self::redis_store::RedisOptions;

/// Whose limit blocked a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// The API key's own limits.
    Key,
    /// The limits of the tenant the key belongs to (shared by all its keys).
    Tenant,
}

impl Scope {
    /// `"key"` or `"tenant"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Key => "key",
            Scope::Tenant => "tenant",
        }
    }

    /// The letter that starts a Redis key of this scope.
    fn tag(self) -> &'static str {
        match self {
            Scope::Key => "k",
            Scope::Tenant => "t",
        }
    }
}

/// Why a request was refused: which limit of whom, and when to retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Whose limit it is.
    pub scope: Scope,
    /// `"requests_per_minute"`, `"tokens_per_minute"`, `"tokens_per_day"`,
    /// `"tokens_per_month"`, `"spend_per_day"` or `"spend_per_month"`.
    pub limit: &'static str,
    /// The limit's value (micro-units of currency for a spend budget).
    pub max: u64,
    /// What the window had used when the request came. Under `max` only
    /// when the request's own estimate was over the limit.
    pub used: u64,
    /// Time until the blocking window resets.
    pub retry_after: Duration,
    /// What the per-minute limits leave (for the `x-ratelimit-*` headers).
    pub quota: Quota,
}

/// The headroom of one limit, as OpenAI's `x-ratelimit-*` headers carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headroom {
    /// The limit.
    pub limit: u64,
    /// What is left of it in the current window.
    pub remaining: u64,
    /// Until the window resets.
    pub reset: Duration,
}

/// Tokens reserved at admission, to be settled when the request ends
/// ([`Limiter::settle`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservation {
    /// What the per-minute limits leave (for the `x-ratelimit-*` headers).
    pub quota: Quota,
    /// The tokens reserved in every token window (0: none, e.g. no token
    /// limit applies or Redis failed open).
    pub tokens: u64,
    /// When it was taken (unix milliseconds): it is settled in the windows
    /// of this time.
    pub at_ms: i64,
    /// The spend reserved in every spend window (0: none).
    pub spend: Money,
}

/// What one admission asks of the windows: the amounts that refuse a
/// request outright and the amounts it reserves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask {
    /// The request's tokens as estimated (over a token limit on its own:
    /// refused outright).
    pub estimate: u64,
    /// Tokens reserved in every token window (the worst case).
    pub tokens: u64,
    /// The request's cost as estimated (over a spend budget on its own:
    /// refused outright).
    pub spend_estimate: Money,
    /// The worst-case cost, reserved in every spend window.
    pub spend: Money,
}

impl Ask {
    /// What a window of `kind` refuses outright above.
    fn estimate_for(&self, kind: LimitKind) -> u64 {
        if kind.is_spend() {
            self.spend_estimate.0
        } else {
            self.estimate
        }
    }

    /// What an admission adds to a window of `kind`.
    fn reserve_for(&self, kind: LimitKind) -> u64 {
        if kind.is_requests() {
            1
        } else if kind.is_spend() {
            self.spend.0
        } else {
            self.tokens
        }
    }
}

/// What the per-minute limits leave after an admission: of the key's and
/// the tenant's, the one with the least left. `None` where no such limit
/// applies, or the counters could not be read (Redis failing open).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    /// `requests_per_minute`, counting the request just admitted.
    pub requests: Option<Headroom>,
    /// `tokens_per_minute`, the tokens charged so far.
    pub tokens: Option<Headroom>,
}

impl Quota {
    /// Adds `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` as
    /// OpenAI sends them (reset as a duration: `1s`, `6m0s`, `250ms`).
    pub fn apply(&self, headers: &mut axum::http::HeaderMap) {
        use axum::http::{HeaderName, HeaderValue};
        const NAMES: [[&str; 3]; 2] = [
            ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"],
            ["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"],
        ];
        // Every answer to a limited key carries these: room for all six at
        // once, and the reset written without the formatting machinery.
        headers.reserve(3 * (usize::from(self.requests.is_some()) + usize::from(self.tokens.is_some())));
        let mut text = Vec::with_capacity(16);
        for (names, h) in NAMES.iter().zip([self.requests, self.tokens]) {
            let Some(h) = h else { continue };
            headers.insert(HeaderName::from_static(names[0]), HeaderValue::from(h.limit));
            headers.insert(HeaderName::from_static(names[1]), HeaderValue::from(h.remaining));
            text.clear();
            write_duration(&mut text, h.reset);
            if let Ok(v) = HeaderValue::from_bytes(&text) {
                headers.insert(HeaderName::from_static(names[2]), v);
            }
        }
    }
}

/// A duration the way OpenAI's reset headers (Go's `Duration.String`) write
/// it: `250ms`, `1s`, `17.5s`, `6m0s`.
pub fn duration_text(d: Duration) -> String {
    let mut out = Vec::with_capacity(16);
    write_duration(&mut out, d);
    String::from_utf8(out).unwrap_or_default()
}

/// [`duration_text`] appended to `out`.
fn write_duration(out: &mut Vec<u8>, d: Duration) {
    let ms = d.as_millis();
    if ms < 1000 {
        push_decimal(out, ms);
        out.extend_from_slice(b"ms");
        return;
    }
    let (m, s, frac) = (ms / 60_000, (ms / 1000) % 60, ms % 1000);
    if m > 0 {
        push_decimal(out, m);
        out.push(b'm');
    }
    push_decimal(out, s);
    if frac != 0 {
        // Milliseconds as a decimal fraction, without trailing zeros.
        let digits = [frac / 100, frac / 10 % 10, frac % 10];
        let keep = if digits[2] != 0 {
            3
        } else if digits[1] != 0 {
            2
        } else {
            1
        };
        out.push(b'.');
        out.extend(digits[..keep].iter().map(|&d| b'0' + d as u8));
    }
    out.push(b's');
}

/// `n` in decimal, appended to `out`.
fn push_decimal(out: &mut Vec<u8>, mut n: u128) {
    let start = out.len();
    loop {
        out.push(b'0' + (n % 10) as u8);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out[start..].reverse();
}

/// The quota left in the per-minute windows of `checks`, `used` being each
/// window's count after the admission (empty: unknown).
fn quota(checks: &[Check], used: &[u64], now_ms: i64) -> Quota {
    if used.len() != checks.len() {
        return Quota::default();
    }
    let pick = |kind: LimitKind| {
        checks
            .iter()
            .zip(used)
            .filter(|(c, _)| c.kind == kind)
            .map(|(c, &u)| Headroom {
                limit: c.max,
                remaining: c.max.saturating_sub(u),
                reset: Duration::from_millis(u64::try_from(c.reset_ms(u, now_ms)).unwrap_or(0)),
            })
            .min_by_key(|h| h.remaining)
    };
    Quota { requests: pick(LimitKind::RequestsPerMinute), tokens: pick(LimitKind::TokensPerMinute) }
}

impl Rejection {
    /// The 429 answer: type `rate_limit_error`, code `rate_limit_exceeded`
    /// for the per-minute limits and `quota_exceeded` for the daily and
    /// monthly token budgets, and `Retry-After`; for a spend budget type
    /// and code `insufficient_quota` (as OpenAI answers a spent quota) with
    /// the budget as `param`.
    pub fn to_api_error(&self) -> ApiError {
        let secs = retry_secs(self.retry_after);
        let scope = self.scope.as_str();
        if self.limit.starts_with("spend_") {
            let (max, used) = (Money(self.max), Money(self.used));
            let message = if self.used < self.max {
                format!(
                    "the worst-case cost of this request exceeds the {scope} budget {} ({max}); \
                     lower max_tokens or shorten the prompt",
                    self.limit
                )
            } else {
                format!("the {scope} budget {} ({max}) is spent ({used} used); it renews in {secs} s", self.limit)
            };
            let mut err = ApiError::rate_limited(message, self.retry_after);
            err.kind = crate::error::ErrorType::InsufficientQuota;
            err.code = Some("insufficient_quota");
            err.param = Some(format!("{scope}.{}", self.limit));
            return err;
        }
        let message = if self.used < self.max {
            format!(
                "the estimated tokens of this request exceed the {scope} limit {} ({}); \
                 lower max_tokens or shorten the prompt",
                self.limit, self.max
            )
        } else {
            format!("{scope} limit {} ({}) reached; retry after {secs} s", self.limit, self.max)
        };
        let mut err = ApiError::rate_limited(message, self.retry_after);
        if matches!(self.limit, "tokens_per_day" | "tokens_per_month") {
            err.code = Some("quota_exceeded");
        }
        err
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} limit {} ({}) blocks the request ({} used); retry after {} s",
            self.scope.as_str(),
            self.limit,
            self.max,
            self.used,
            retry_secs(self.retry_after)
        )
    }
}

/// Whole seconds, rounded up, at least 1 (what `Retry-After` carries).
fn retry_secs(after: Duration) -> u64 {
    (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1)
}

/// The six counted limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum LimitKind {
    RequestsPerMinute,
    TokensPerMinute,
    TokensPerDay,
    TokensPerMonth,
    SpendPerDay,
    SpendPerMonth,
}

impl LimitKind {
    const TOKENS: [LimitKind; 3] = [LimitKind::TokensPerMinute, LimitKind::TokensPerDay, LimitKind::TokensPerMonth];
    const SPEND: [LimitKind; 2] = [LimitKind::SpendPerDay, LimitKind::SpendPerMonth];

    fn as_str(self) -> &'static str {
        match self {
            LimitKind::RequestsPerMinute => "requests_per_minute",
            LimitKind::TokensPerMinute => "tokens_per_minute",
            LimitKind::TokensPerDay => "tokens_per_day",
            LimitKind::TokensPerMonth => "tokens_per_month",
            LimitKind::SpendPerDay => "spend_per_day",
            LimitKind::SpendPerMonth => "spend_per_month",
        }
    }

    /// Short name inside Redis keys.
    fn tag(self) -> &'static str {
        match self {
            LimitKind::RequestsPerMinute => "rpm",
            LimitKind::TokensPerMinute => "tpm",
            LimitKind::TokensPerDay => "tpd",
            LimitKind::TokensPerMonth => "tpmo",
            LimitKind::SpendPerDay => "spd",
            LimitKind::SpendPerMonth => "spmo",
        }
    }

    fn is_requests(self) -> bool {
        self == LimitKind::RequestsPerMinute
    }

    /// The budgets in currency (micro-units), not in tokens.
    fn is_spend(self) -> bool {
        matches!(self, LimitKind::SpendPerDay | LimitKind::SpendPerMonth)
    }

    /// The per-minute limits: rates (GCRA), not calendar windows.
    fn is_rate(self) -> bool {
        matches!(self, LimitKind::RequestsPerMinute | LimitKind::TokensPerMinute)
    }

    fn max(self, limits: &Limits) -> Option<u64> {
        match self {
            LimitKind::RequestsPerMinute => limits.requests_per_minute,
            LimitKind::TokensPerMinute => limits.tokens_per_minute,
            LimitKind::TokensPerDay => limits.tokens_per_day,
            LimitKind::TokensPerMonth => limits.tokens_per_month,
            LimitKind::SpendPerDay => limits.spend_per_day.map(|m| m.0),
            LimitKind::SpendPerMonth => limits.spend_per_month.map(|m| m.0),
        }
    }

    /// The window holding `now_ms`: `(start, end)` in unix milliseconds.
    /// For the per-minute rates: `(0, now + 1 minute)`.
    fn window(self, now_ms: i64) -> (i64, i64) {
        const MINUTE: i64 = 60_000;
        const DAY: i64 = 86_400_000;
        match self {
            // Rates have one counter for all time; "end" is unused.
            LimitKind::RequestsPerMinute | LimitKind::TokensPerMinute => (0, now_ms.saturating_add(MINUTE)),
            LimitKind::TokensPerDay | LimitKind::SpendPerDay => fixed_window(now_ms, DAY),
            // A time chrono cannot place in the calendar (hundreds of
            // thousands of years away) falls back to 30-day windows.
            LimitKind::TokensPerMonth | LimitKind::SpendPerMonth => {
                month_window(now_ms).unwrap_or_else(|| fixed_window(now_ms, 30 * DAY))
            }
        }
    }
}

fn fixed_window(now_ms: i64, len: i64) -> (i64, i64) {
    let start = now_ms.div_euclid(len).saturating_mul(len);
    (start, start.saturating_add(len))
}

/// The UTC calendar month holding `now_ms`.
fn month_window(now_ms: i64) -> Option<(i64, i64)> {
    let now = DateTime::<Utc>::from_timestamp_millis(now_ms)?;
    let (year, month) = (now.year(), now.month());
    let (next_year, next_month) = if month == 12 { (year.checked_add(1)?, 1) } else { (year, month + 1) };
    let start = NaiveDate::from_ymd_opt(year, month, 1)?.and_hms_opt(0, 0, 0)?.and_utc();
    let end = NaiveDate::from_ymd_opt(next_year, next_month, 1)?.and_hms_opt(0, 0, 0)?.and_utc();
    Some((start.timestamp_millis(), end.timestamp_millis()))
}

/// One limited window of one key or tenant, as a request meets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Check {
    scope: Scope,
    id: i64,
    /// The tenant of the request (the Redis hash tag: one slot per tenant).
    tenant: i64,
    kind: LimitKind,
    max: u64,
    start_ms: i64,
    end_ms: i64,
}

/// What a per-minute rate drains in: its limit per [`RATE_PERIOD_MS`].
pub(crate) const RATE_PERIOD_MS: i64 = 60_000;

impl Check {
    /// Milliseconds one unit (a request, a token) of this rate takes to drain.
    fn unit_ms(&self) -> f64 {
        RATE_PERIOD_MS as f64 / self.max.max(1) as f64
    }

    /// Until `used` is under the limit again: for a rate, until enough has
    /// drained; for a calendar window, until it ends.
    fn retry_ms(&self, used: u64, now_ms: i64) -> i64 {
        if self.kind.is_rate() {
            let over = used.saturating_add(1).saturating_sub(self.max) as f64;
            ((over * self.unit_ms()).ceil() as i64).max(1)
        } else {
            self.end_ms.saturating_sub(now_ms)
        }
    }

    /// Until nothing is used: a rate fully drained, a window ended.
    fn reset_ms(&self, used: u64, now_ms: i64) -> i64 {
        if self.kind.is_rate() {
            (used as f64 * self.unit_ms()).ceil() as i64
        } else {
            self.end_ms.saturating_sub(now_ms)
        }
    }

    fn rejection(&self, used: u64, now_ms: i64) -> Rejection {
        let left = u64::try_from(self.retry_ms(used, now_ms)).unwrap_or(0);
        Rejection {
            scope: self.scope,
            limit: self.kind.as_str(),
            max: self.max,
            used,
            retry_after: Duration::from_millis(left),
            quota: Quota::default(),
        }
    }

    /// Whether this window lets a request with `estimate` tokens in, given
    /// what it has `used`.
    fn admits(&self, used: u64, estimate: u64) -> bool {
        if self.kind.is_requests() {
            used < self.max
        } else {
            used < self.max && estimate <= self.max
        }
    }
}

/// The limited windows a principal's request meets at `now_ms`, key first;
/// `kinds` selects which limits.
/// What settling a reservation changes: for tokens and for spend, the
/// windows to adjust and by how much (used minus reserved; nothing where
/// they are equal or no limit applies).
fn settlement(who: &Principal, reservation: &Reservation, used_tokens: u64, spent: Money) -> Vec<(Vec<Check>, i64)> {
    if who.key_limits.is_unlimited() && who.tenant_limits.is_unlimited() {
        return Vec::new();
    }
    let delta = |used: u64, reserved: u64| {
        i64::try_from(used).unwrap_or(i64::MAX).saturating_sub(i64::try_from(reserved).unwrap_or(i64::MAX))
    };
    [
        (&LimitKind::TOKENS[..], delta(used_tokens, reservation.tokens)),
        (&LimitKind::SPEND[..], delta(spent.0, reservation.spend.0)),
    ]
    .into_iter()
    .filter(|&(_, delta)| delta != 0)
    .map(|(kinds, delta)| (checks(who, reservation.at_ms, kinds), delta))
    .filter(|(checks, _)| !checks.is_empty())
    .collect()
}

fn checks(who: &Principal, now_ms: i64, kinds: &[LimitKind]) -> Vec<Check> {
    let mut out = Vec::new();
    for (scope, id, limits) in
        [(Scope::Key, who.key_id, &who.key_limits), (Scope::Tenant, who.tenant_id, &who.tenant_limits)]
    {
        for &kind in kinds {
            if let Some(max) = kind.max(limits) {
                let (start_ms, end_ms) = kind.window(now_ms);
                out.push(Check { scope, id, tenant: who.tenant_id, kind, max, start_ms, end_ms });
            }
        }
    }
    out
}

const ALL_KINDS: [LimitKind; 6] = [
    LimitKind::RequestsPerMinute,
    LimitKind::TokensPerMinute,
    LimitKind::TokensPerDay,
    LimitKind::TokensPerMonth,
    LimitKind::SpendPerDay,
    LimitKind::SpendPerMonth,
];

/// Among the failed windows, the one that admits last: retrying earlier
/// would fail again. `failed` holds `(index into checks, used)`.
fn blocking(checks: &[Check], failed: &[(usize, u64)], now_ms: i64) -> Option<Rejection> {
    let mut best: Option<(usize, u64)> = None;
    for &(i, used) in failed {
        let Some(check) = checks.get(i) else { continue };
        if best.is_none_or(|(b, bu)| check.retry_ms(used, now_ms) > checks[b].retry_ms(bu, now_ms)) {
            best = Some((i, used));
        }
    }
    best.map(|(i, used)| checks[i].rejection(used, now_ms))
}

enum Backend {
    Memory(memory::MemoryStore),
    Redis(redis_store::RedisStore),
}

/// Counts requests and tokens against the key's and the tenant's limits.
/// Cheap to clone; clones share their counters.
#[derive(Clone)]
pub struct Limiter {
    backend: Arc<Backend>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter").field("backend", &self.backend()).finish()
    }
}

impl Limiter {
    /// Counters in this process only: right for a single gateway.
    pub fn in_process() -> Self {
        Limiter { backend: Arc::new(Backend::Memory(memory::MemoryStore::new())) }
    }

    /// Counters in Redis, shared by every gateway configured with the same
    /// server and prefix.
    ///
    /// Fails only on a malformed URL or bad options. A server that cannot be
    /// reached is not an error: the limiter admits everything (counting
    /// [`backend_errors`](Self::backend_errors)) and keeps connecting in the
    /// background. Waits at most about a second for the first connection.
    pub async fn redis(url: &str, options: RedisOptions) -> anyhow::Result<Self> {
        let store = redis_store::RedisStore::connect(url, options).await?;
        Ok(Limiter { backend: Arc::new(Backend::Redis(store)) })
    }

    /// `"memory"` or `"redis"`.
    pub fn backend(&self) -> &'static str {
        match &*self.backend {
            Backend::Memory(_) => "memory",
            Backend::Redis(_) => "redis",
        }
    }

    /// Admits a request of `who` or says which limit blocks it.
    /// `estimated_tokens` is what the request may cost (prompt tokens plus
    /// `max_tokens`; 0 when unknown). An admitted request counts against
    /// the request limits; a rejected one does not.
    pub async fn admit(&self, who: &Principal, estimated_tokens: u64) -> Result<Quota, Rejection> {
        self.admit_at(who, estimated_tokens, now_ms()).await
    }

    /// [`admit`](Self::admit) at an explicit time (unix milliseconds).
    pub async fn admit_at(&self, who: &Principal, estimated_tokens: u64, now_ms: i64) -> Result<Quota, Rejection> {
        self.reserve_at(who, estimated_tokens, 0, now_ms).await.map(|r| r.quota)
    }

    /// Admits a request and, in the same atomic step, reserves `reserve`
    /// tokens of every token window of its key and tenant (the request's
    /// worst case: prompt plus `max_tokens`, or the configured default when
    /// it sends none). Concurrent requests then see each other's
    /// reservations, so a budget is overshot by at most one reservation.
    /// `estimated_tokens` is what refuses a request outright (over a token
    /// limit on its own). Hand the [`Reservation`] to
    /// [`settle`](Self::settle) when the request ends.
    pub async fn reserve(
        &self,
        who: &Principal,
        estimated_tokens: u64,
        reserve: u64,
    ) -> Result<Reservation, Rejection> {
        self.reserve_at(who, estimated_tokens, reserve, now_ms()).await
    }

    /// [`reserve`](Self::reserve) at an explicit time (unix milliseconds).
    pub async fn reserve_at(
        &self,
        who: &Principal,
        estimated_tokens: u64,
        reserve: u64,
        now_ms: i64,
    ) -> Result<Reservation, Rejection> {
        let ask = Ask { estimate: estimated_tokens, tokens: reserve, ..Ask::default() };
        self.reserve_ask_at(who, ask, now_ms).await
    }

    /// [`reserve`](Self::reserve) with the worst-case cost too: `ask.spend`
    /// is reserved in every spend window (and refuses the request outright
    /// when over a spend budget on its own). Settle with
    /// [`settle_spend`](Self::settle_spend).
    pub async fn reserve_ask(&self, who: &Principal, ask: Ask) -> Result<Reservation, Rejection> {
        self.reserve_ask_at(who, ask, now_ms()).await
    }

    /// [`reserve_ask`](Self::reserve_ask) at an explicit time (unix milliseconds).
    pub async fn reserve_ask_at(&self, who: &Principal, ask: Ask, now_ms: i64) -> Result<Reservation, Rejection> {
        let none = Reservation { quota: Quota::default(), tokens: 0, at_ms: now_ms, spend: Money(0) };
        if who.key_limits.is_unlimited() && who.tenant_limits.is_unlimited() {
            return Ok(none);
        }
        let checks = checks(who, now_ms, &ALL_KINDS);
        if checks.is_empty() {
            return Ok(none);
        }
        // Nothing to reserve in where no such limit applies.
        let mut ask = ask;
        if !checks.iter().any(|c| !c.kind.is_requests() && !c.kind.is_spend()) {
            ask.tokens = 0;
        }
        if !checks.iter().any(|c| c.kind.is_spend()) {
            ask.spend = Money(0);
            ask.spend_estimate = Money(0);
        }
        let (failed, used) = match &*self.backend {
            Backend::Memory(m) => m.admit(who.tenant_id, &checks, &ask, now_ms),
            Backend::Redis(r) => r.admit(&checks, &ask, now_ms).await,
        };
        let quota = quota(&checks, &used, now_ms);
        match blocking(&checks, &failed, now_ms) {
            Some(rejection) => Err(Rejection { quota, ..rejection }),
            // No counts back: Redis failed open and nothing was reserved.
            None if used.is_empty() => Ok(Reservation { quota, ..none }),
            None => Ok(Reservation { quota, tokens: ask.tokens, at_ms: now_ms, spend: ask.spend }),
        }
    }

    /// Ends a reservation: the token windows it was taken from get the
    /// tokens really used (prompt plus completion) instead of the reserved
    /// ones; the unused part is released, an excess added. Windows that
    /// have ended since are left alone when releasing.
    pub async fn settle(&self, who: &Principal, reservation: &Reservation, used_tokens: u64) {
        self.settle_spend(who, reservation, used_tokens, reservation.spend).await
    }

    /// [`settle`](Self::settle) for the tokens and the spend windows alike:
    /// the spend reserved is replaced by `spent`, the cost of what was used.
    pub async fn settle_spend(&self, who: &Principal, reservation: &Reservation, used_tokens: u64, spent: Money) {
        // The windows are those of the admission; so is the clock used to
        // prune and to set expiries (at worst a little generous).
        let at = reservation.at_ms;
        for (checks, delta) in settlement(who, reservation, used_tokens, spent) {
            match &*self.backend {
                Backend::Memory(m) => m.adjust(who.tenant_id, &checks, delta, at),
                Backend::Redis(r) => r.adjust(&checks, delta, at).await,
            }
        }
    }

    /// [`Limiter::settle_spend`] done at once where it needs no I/O (the
    /// in-process store), so a finished request spawns no task for it;
    /// `false` (nothing done) where it must be awaited (Redis).
    pub fn settle_spend_now(&self, who: &Principal, reservation: &Reservation, used_tokens: u64, spent: Money) -> bool {
        let Backend::Memory(m) = &*self.backend else { return false };
        for (checks, delta) in settlement(who, reservation, used_tokens, spent) {
            m.adjust(who.tenant_id, &checks, delta, reservation.at_ms);
        }
        true
    }

    /// Adds the tokens a request really used (prompt plus completion) to
    /// every token window of its key and tenant.
    pub async fn charge(&self, who: &Principal, tokens: u64) {
        self.charge_at(who, tokens, now_ms()).await
    }

    /// [`charge`](Self::charge) at an explicit time (unix milliseconds).
    pub async fn charge_at(&self, who: &Principal, tokens: u64, now_ms: i64) {
        if tokens == 0 || (who.key_limits.is_unlimited() && who.tenant_limits.is_unlimited()) {
            return;
        }
        let checks = checks(who, now_ms, &LimitKind::TOKENS);
        if checks.is_empty() {
            return;
        }
        match &*self.backend {
            Backend::Memory(m) => m.adjust(who.tenant_id, &checks, i64::try_from(tokens).unwrap_or(i64::MAX), now_ms),
            Backend::Redis(r) => r.adjust(&checks, i64::try_from(tokens).unwrap_or(i64::MAX), now_ms).await,
        }
    }

    /// Raises the day and month token and spend counters of every tenant
    /// and key in `usage` to at least what it says they used (never lowers one), so a
    /// restart, or a Redis that lost its data, does not reset a budget.
    /// `usage` is per tenant, key (0: none) and UTC day, as the
    /// `usage_daily` rollup keeps it; days outside the current day and
    /// month are ignored. Counters that already hold more (requests served
    /// since) keep their value.
    pub async fn restore(&self, usage: &[crate::identity::DailyUsage]) {
        self.restore_at(usage, now_ms()).await
    }

    /// [`restore`](Self::restore) at an explicit time (unix milliseconds).
    pub async fn restore_at(&self, usage: &[crate::identity::DailyUsage], now_ms: i64) {
        use std::collections::BTreeMap;
        // (tenant, scope, id, kind) -> tokens
        let mut totals: BTreeMap<(i64, Scope, i64, LimitKind), u64> = BTreeMap::new();
        for u in usage {
            for kind in
                [LimitKind::TokensPerDay, LimitKind::TokensPerMonth, LimitKind::SpendPerDay, LimitKind::SpendPerMonth]
            {
                let (start, end) = kind.window(now_ms);
                let value = if kind.is_spend() { u.spend.0 } else { u.tokens };
                if u.day_ms < start || u.day_ms >= end || value == 0 {
                    continue;
                }
                let mut add = |scope, id| {
                    let t = totals.entry((u.tenant_id, scope, id, kind)).or_default();
                    *t = t.saturating_add(value);
                };
                add(Scope::Tenant, u.tenant_id);
                if u.key_id != 0 {
                    add(Scope::Key, u.key_id);
                }
            }
        }
        // One call per tenant: its keys share its Redis hash slot.
        let mut per_tenant: BTreeMap<i64, Vec<(Check, u64)>> = BTreeMap::new();
        for ((tenant, scope, id, kind), tokens) in totals {
            let (start_ms, end_ms) = kind.window(now_ms);
            let check = Check { scope, id, tenant, kind, max: 0, start_ms, end_ms };
            per_tenant.entry(tenant).or_default().push((check, tokens));
        }
        for (tenant, counters) in per_tenant {
            match &*self.backend {
                Backend::Memory(m) => m.raise(tenant, &counters, now_ms),
                Backend::Redis(r) => r.raise(&counters, now_ms).await,
            }
        }
    }

    /// How many Redis calls failed or timed out (each one admitted the
    /// request or dropped the charge). Always 0 in process.
    pub fn backend_errors(&self) -> u64 {
        match &*self.backend {
            Backend::Memory(_) => 0,
            Backend::Redis(r) => r.errors(),
        }
    }
}

#[cfg(test)]
mod tests;
