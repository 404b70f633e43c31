//! Commands with options of their own over one namespace's keys: SET,
//! GETEX, EXPIRE and its kin, SCAN and KEYS.

use super::*;

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

impl Session<'_> {
    /// GETEX key [EX s | PX ms | EXAT t | PXAT t | PERSIST]: the value, and
    /// the new expiry set on it if there is one.
    pub(super) async fn getex(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
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
                let ms = if is(w, "EX") || is(w, "PX") {
                    Some(ttl_from_now(n, is(w, "EX"), "getex")?.as_millis() as i64)
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

    pub(super) async fn set(&mut self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
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
                let ttl = if is(w, "EX") || is(w, "PX") {
                    ttl_from_now(n, is(w, "EX"), "set")?
                } else {
                    let now = crate::types::now_ms();
                    let n = n as u64;
                    let at = if is(w, "EXAT") {
                        n.checked_mul(1000).filter(|&ms| ms <= i64::MAX as u64).ok_or(CmdError::InvalidExpire("set"))?
                    } else {
                        n
                    };
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

    pub(super) async fn expire(
        &self,
        key: &[u8],
        n: i64,
        ms: bool,
        flags: &[Bytes],
        cmd: &'static str,
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
                return Err(CmdError::Syntax);
            }
        }
        if (nx && (xx || gt || lt)) || (gt && lt) {
            return Err(CmdError::Syntax);
        }
        let new_ms = if ms { Some(n) } else { n.checked_mul(1000) }.ok_or(CmdError::InvalidExpire(cmd))?;
        // Checked before the key is looked up, as Redis does.
        let ttl = if new_ms > 0 { Some(ttl_from_now(new_ms, false, cmd)?) } else { None };
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
        match ttl {
            None => Ok(self.ctx.store.delete(&self.ns, key).await?),
            ttl => Ok(self.ctx.store.expire(&self.ns, key, ttl).await?),
        }
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
