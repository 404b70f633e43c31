//! Commands with options of their own over one namespace's keys: SET,
//! GETEX, EXPIRE and its kin, SCAN and KEYS.

use super::*;
use crate::Observe;

/// A time to live of `n` seconds (`secs`) or milliseconds from now,
/// refused as Redis refuses it: not positive, or past the last millisecond
/// since the epoch that a signed 64-bit count holds once now is added (a
/// TTL cast and added unchecked stored nothing, or panicked in a debug
/// build, where Redis answers an error).
pub(super) fn ttl_from_now(n: i64, secs: bool, cmd: &'static str) -> Result<Duration, CmdError> {
    let now = crate::types::now_ms() as i64;
    let ms = if secs { n.checked_mul(1000) } else { Some(n) };
    match ms {
        Some(ms) if ms > 0 && ms.checked_add(now).is_some() => Ok(Duration::from_millis(ms as u64)),
        _ => Err(CmdError::InvalidExpire(cmd)),
    }
}

/// The options SET and GETEX share, parsed as Redis parses them: each
/// option may repeat, but not meet one it excludes (`NX` with `XX`, one
/// expiry with another, `KEEPTTL` or `PERSIST` with an expiry), and the
/// expiry's number is read only once every option is known.
#[derive(Default)]
struct Extended {
    nx: bool,
    xx: bool,
    get: bool,
    keep_ttl: bool,
    persist: bool,
    /// The unit word (`EX`, `PX`, `EXAT`, `PXAT`) and its number, unread.
    expiry: Option<(Unit, Bytes)>,
}

#[derive(Clone, Copy, PartialEq)]
enum Unit {
    Ex,
    Px,
    ExAt,
    PxAt,
}

impl Extended {
    /// `set`: SET's options; otherwise GETEX's.
    fn parse(a: &[Bytes], set: bool) -> Result<Extended, CmdError> {
        let mut o = Extended::default();
        let mut i = 0;
        while i < a.len() {
            let (w, next) = (&a[i], a.get(i + 1));
            let unit = [("EX", Unit::Ex), ("PX", Unit::Px), ("EXAT", Unit::ExAt), ("PXAT", Unit::PxAt)]
                .into_iter()
                .find(|(name, _)| is(w, name))
                .map(|(_, u)| u);
            let other_unit = |u: Unit| o.expiry.as_ref().is_some_and(|(have, _)| *have != u);
            if set && is(w, "NX") && !o.xx {
                o.nx = true;
            } else if set && is(w, "XX") && !o.nx {
                o.xx = true;
            } else if set && is(w, "GET") {
                o.get = true;
            } else if set && is(w, "KEEPTTL") && !o.persist && o.expiry.is_none() {
                o.keep_ttl = true;
            } else if !set && is(w, "PERSIST") && !o.keep_ttl && o.expiry.is_none() {
                o.persist = true;
            } else if let (Some(u), Some(n)) = (unit, next) {
                if o.keep_ttl || o.persist || other_unit(u) {
                    return Err(CmdError::Syntax);
                }
                o.expiry = Some((u, n.clone()));
                i += 1;
            } else {
                return Err(CmdError::Syntax);
            }
            i += 1;
        }
        Ok(o)
    }
}

/// The deadline an `EX`/`PX`/`EXAT`/`PXAT` number sets, in milliseconds
/// since the epoch, refused as Redis refuses it: not an integer, not
/// positive, or past what a signed 64-bit count of milliseconds holds once
/// converted (and, for a relative time, once now is added). A deadline
/// already past is returned as it is: the key is then gone at once.
fn deadline(unit: Unit, n: &[u8], cmd: &'static str) -> Result<i64, CmdError> {
    let n = parse_i64(n)?;
    let secs = matches!(unit, Unit::Ex | Unit::ExAt);
    if n <= 0 || (secs && n > i64::MAX / 1000) {
        return Err(CmdError::InvalidExpire(cmd));
    }
    let ms = if secs { n * 1000 } else { n };
    match unit {
        Unit::Ex | Unit::Px => ms.checked_add(crate::types::now_ms() as i64).ok_or(CmdError::InvalidExpire(cmd)),
        Unit::ExAt | Unit::PxAt => Ok(ms),
    }
}

/// The time to live until `deadline` (ms since the epoch); zero for a
/// deadline already past, which the store treats as expired.
fn until(deadline: i64) -> Duration {
    Duration::from_millis((deadline as u64).saturating_sub(crate::types::now_ms()))
}

/// EXPIRE, PEXPIRE, EXPIREAT or PEXPIREAT: what their number means.
#[derive(Clone, Copy)]
pub(super) struct ExpireUnit {
    pub ms: bool,
    pub relative: bool,
    pub cmd: &'static str,
}

/// The deadline EXPIRE and its kin set (ms since the epoch) from their
/// number, checked as Redis checks it: the unit conversion and, for the
/// relative forms, adding now must not overflow. Unlike SET's, zero and
/// negative numbers are allowed: the key goes.
fn expire_when(n: i64, u: ExpireUnit) -> Result<i64, CmdError> {
    let when = if u.ms { Some(n) } else { n.checked_mul(1000) }.ok_or(CmdError::InvalidExpire(u.cmd))?;
    if !u.relative {
        return Ok(when);
    }
    when.checked_add(crate::types::now_ms() as i64).ok_or(CmdError::InvalidExpire(u.cmd))
}

impl Session<'_> {
    /// GETEX key [EX s | PX ms | EXAT t | PXAT t | PERSIST]: the value, and
    /// the new expiry set on it if there is one. As in Redis, the options'
    /// syntax is checked first, then the key is looked up, and only then the
    /// expiry's number (a missing key answers nil whatever it is).
    pub(super) async fn getex(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let o = Extended::parse(&a[1..], false)?;
        let Some(hit) = self.ctx.store.get(&self.ns, &a[0]).await? else {
            out.null();
            return Ok(());
        };
        if let Some((unit, n)) = &o.expiry {
            let at = deadline(*unit, n, "getex")?;
            if at <= crate::types::now_ms() as i64 {
                // A time already past deletes the key, as in Redis; the value is still answered.
                self.ctx.store.delete(&self.ns, &a[0]).await?;
            } else {
                self.ctx.store.expire(&self.ns, &a[0], Some(until(at))).await?;
            }
        } else if o.persist {
            self.ctx.store.expire(&self.ns, &a[0], None).await?;
        }
        out.bulk_bytes(hit.value);
        Ok(())
    }

    /// KEYS pattern, over this namespace only. It walks the namespace with
    /// the SCAN cursor and refuses once more than [`KEYS_LIMIT`] keys have
    /// been walked, so it can never stall the server on a huge keyspace.
    pub(super) async fn keys(&self, pattern: &[u8], out: &mut Out) -> Result<(), CmdError> {
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

    /// SET key value [NX | XX] [GET] [EX s | PX ms | EXAT t | PXAT t |
    /// KEEPTTL], in Redis's order: the options' syntax, the expiry's number,
    /// the old value (GET), then the condition. A deadline already past
    /// stores a key that is gone at once.
    pub(super) async fn set(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let o = Extended::parse(&a[2..], true)?;
        let at = o.expiry.as_ref().map(|(unit, n)| deadline(*unit, n, "set")).transpose()?;
        let opts = PutOptions {
            condition: match (o.nx, o.xx) {
                (true, _) => Condition::IfAbsent,
                (_, true) => Condition::IfPresent,
                _ => Condition::Always,
            },
            ttl: at.map(until),
            ..Default::default()
        };
        let get = o.get;
        let key = Bytes::copy_from_slice(&a[0]);
        // The old value and TTL are read with the write, not before it.
        let observe = Observe { old_value: get, keep_ttl: o.keep_ttl };
        let (done, old) = self.ctx.store.put_observed(&self.ns, key, own(a[1].clone()), opts, observe).await?;
        let stored = done.stored;
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

    /// EXPIRE and its kin, in Redis's order: the flags (`NX`, `XX`, `GT`,
    /// `LT`; a key without a TTL counts as one that never expires), the
    /// number `n`, then the key; a deadline already past deletes it.
    pub(super) async fn expire(
        &self,
        key: &[u8],
        n: &[u8],
        unit: ExpireUnit,
        flags: &[Bytes],
    ) -> Result<bool, CmdError> {
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
                return Err(CmdError::UnsupportedOption(String::from_utf8_lossy(f).into_owned()));
            }
        }
        if nx && (xx || gt || lt) {
            return Err(CmdError::ExpireNxWithOthers);
        }
        if gt && lt {
            return Err(CmdError::ExpireGtWithLt);
        }
        let when = expire_when(parse_i64(n)?, unit)?;
        // Whether the flags let the key's current TTL be replaced by `when`.
        let allowed = |current: Ttl| {
            let now = crate::types::now_ms() as i64;
            let current = match current {
                Ttl::Missing => return false,
                Ttl::Persistent => None,
                Ttl::Remaining(d) => Some(now.saturating_add(d.as_millis() as i64)),
            };
            match current {
                None => !(xx || gt),
                Some(c) => !(nx || (gt && when <= c) || (lt && when >= c)),
            }
        };
        if when <= crate::types::now_ms() as i64 {
            // A deadline already past deletes the key (if the flags allow).
            if !allowed(self.ctx.store.ttl(&self.ns, key).await?) {
                return Ok(false);
            }
            return Ok(self.ctx.store.delete(&self.ns, key).await?);
        }
        // Read and set at one version of the key: no write comes between
        // the flags' check and the new expiry.
        let ttl = until(when);
        Ok(self.ctx.store.expire_if(&self.ns, key, |current| allowed(current).then_some(Some(ttl))).await?)
    }

    pub(super) async fn scan(&self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
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
}
