//! LMCache's `lm://` server protocol, so LMCache's `LMCServerConnector`
//! (`remote_url = "lm://host:port"`) uses the warehouse unchanged.
//!
//! The wire format is LMCache's (`lmcache/v1/protocol.py`); integers are
//! 32-bit little-endian. A request is a 186-byte header:
//!
//! ```text
//! command, length, fmt, dtype, location, shape[0..4]   9 × i32
//! key                                                  150 bytes, space-padded
//! ```
//!
//! with `command` 1 PUT, 2 GET, 3 EXIST, 4 LIST, 5 HEALTH. A PUT is
//! followed by `length` bytes and gets no reply. Every other command gets
//! a 36-byte reply header (`code` 200 or 400, `length`, `fmt`, `dtype`,
//! `shape[0..4]`, `location`), followed by `length` bytes for a GET hit
//! and for LIST (keys, one per line: LMCache's own server has LIST
//! commented out; this is the reply that comment describes).
//!
//! A chunk is stored as LMCache's `redis://` connector stores it: the bytes
//! under `<key>kv_bytes`, and under `<key>metadata` its length, format,
//! dtype and shape as LMCache's `RemoteMetadata` packs them for one group
//! (7 × i32). A chunk saved through `lm://` is read back through
//! `redis://` and the other way round. `fmt` and `dtype` are LMCache's
//! enum numbers, kept as they come.
//!
//! The protocol has no authentication: the listener is off unless
//! configured (`[warehouse.lm] listen`, [`crate::config::LmConfig`]), serves one namespace
//! (`[warehouse.lm] namespace`), and shares the RESP connection cap and
//! idle timeout. A malformed header, an unknown command or a value larger
//! than the store's `max_value` closes the connection that sent it.
//!
//! With no authentication, whoever reaches the port is a stranger, so a
//! PUT's declared length reserves nothing ahead of its bytes: the value's
//! allocation grows with what arrives (64 KiB, then doubling, never past
//! the declared length). A value that stops arriving, or a reply the
//! client stops reading, for `io_timeout_secs` closes the connection.

use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::server::ServerCtx;
use crate::types::PutOptions;

/// Bytes of a request header.
pub const REQUEST_LEN: usize = 9 * 4 + KEY_LEN;
/// Bytes of a reply header.
pub const REPLY_LEN: usize = 9 * 4;
/// Bytes of the key field (LMCache's `MAX_KEY_LENGTH`).
pub const KEY_LEN: usize = 150;
/// Suffixes of the two keys a chunk is stored under (LMCache's `redis://` layout).
pub const DATA_SUFFIX: &[u8] = b"kv_bytes";
pub const META_SUFFIX: &[u8] = b"metadata";
/// Most keys one LIST returns.
pub const LIST_MAX: usize = 100_000;

const SUCCESS: i32 = 200;
const FAIL: i32 = 400;

/// A request's command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Put,
    Get,
    Exist,
    List,
    Health,
}

/// What a chunk's bytes are: LMCache's memory format, dtype and shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Layout {
    pub fmt: i32,
    pub dtype: i32,
    pub shape: [i32; 4],
}

/// A decoded request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub command: Command,
    pub length: i32,
    pub layout: Layout,
    pub key: Bytes,
}

fn i32_at(b: &[u8], i: usize) -> i32 {
    i32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().expect("4 bytes"))
}

impl Request {
    /// Decodes a header; an error names what is wrong with it.
    pub fn parse(h: &[u8; REQUEST_LEN]) -> Result<Request, String> {
        let command = match i32_at(h, 0) {
            1 => Command::Put,
            2 => Command::Get,
            3 => Command::Exist,
            4 => Command::List,
            5 => Command::Health,
            c => return Err(format!("unknown command {c}")),
        };
        let length = i32_at(h, 1);
        if length < 0 {
            return Err(format!("negative length {length}"));
        }
        let layout = Layout { fmt: i32_at(h, 2), dtype: i32_at(h, 3), shape: [5, 6, 7, 8].map(|i| i32_at(h, i)) };
        // Python's `str.strip()` of a space-padded field (NULs from a
        // shorter `struct` field too).
        let key = h[36..].trim_ascii().trim_end_matches_nul();
        Ok(Request { command, length, layout, key: Bytes::copy_from_slice(key) })
    }

    /// Encodes a header (the client side, for tests and tools).
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut h = [0u8; REQUEST_LEN];
        let command = match self.command {
            Command::Put => 1,
            Command::Get => 2,
            Command::Exist => 3,
            Command::List => 4,
            Command::Health => 5,
        };
        let l = &self.layout;
        let ints = [command, self.length, l.fmt, l.dtype, 0, l.shape[0], l.shape[1], l.shape[2], l.shape[3]];
        for (i, v) in ints.iter().enumerate() {
            h[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        let key = &self.key[..self.key.len().min(KEY_LEN)];
        h[36..36 + key.len()].copy_from_slice(key);
        h[36 + key.len()..].fill(b' ');
        h
    }
}

trait TrimNul {
    fn trim_end_matches_nul(&self) -> &[u8];
}

impl TrimNul for [u8] {
    fn trim_end_matches_nul(&self) -> &[u8] {
        let end = self.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        self[..end].trim_ascii_end()
    }
}

/// A reply header.
pub fn reply(ok: bool, length: i32, layout: Layout) -> [u8; REPLY_LEN] {
    let mut h = [0u8; REPLY_LEN];
    let s = layout.shape;
    let code = if ok { SUCCESS } else { FAIL };
    for (i, v) in [code, length, layout.fmt, layout.dtype, s[0], s[1], s[2], s[3], 0].iter().enumerate() {
        h[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    h
}

/// LMCache's `RemoteMetadata` of one group: length, fmt, dtype, shape.
pub fn encode_meta(length: i32, l: Layout) -> Bytes {
    let mut b = Vec::with_capacity(28);
    for v in [length, l.fmt, l.dtype, l.shape[0], l.shape[1], l.shape[2], l.shape[3]] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    Bytes::from(b)
}

/// Reads [`encode_meta`]'s bytes back (`None` if they are not 7 integers).
pub fn decode_meta(b: &[u8]) -> Option<(i32, Layout)> {
    (b.len() == 28).then(|| {
        (i32_at(b, 0), Layout { fmt: i32_at(b, 1), dtype: i32_at(b, 2), shape: [3, 4, 5, 6].map(|i| i32_at(b, i)) })
    })
}

fn with_suffix(key: &[u8], suffix: &[u8]) -> Bytes {
    let mut k = Vec::with_capacity(key.len() + suffix.len());
    k.extend_from_slice(key);
    k.extend_from_slice(suffix);
    Bytes::from(k)
}

/// Binds and serves `lm://` when `ctx.lm_config.listen` names an address,
/// printing `granary warehouse: lm listening on ADDR` as the other front
/// ends do; `None` when it is off.
pub async fn spawn(
    ctx: Arc<ServerCtx>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<Option<JoinHandle<std::io::Result<()>>>> {
    let Some(addr) = ctx.lm_config.addr().map_err(std::io::Error::other)? else { return Ok(None) };
    let l = TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding lm:// on {addr}: {e}")))?;
    println!("granary warehouse: lm listening on {}", l.local_addr()?);
    Ok(Some(tokio::spawn(serve(l, ctx, shutdown))))
}

/// Serves `lm://` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    while conns.try_join_next().is_some() {}
                    if conns.len() >= ctx.limits.max_connections {
                        ctx.lm.requests_error.fetch_add(1, Relaxed);
                        drop(stream);
                        continue;
                    }
                    let (ctx, stop) = (ctx.clone(), stop_rx.clone());
                    conns.spawn(async move { connection(stream, ctx, stop).await });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "lm:// accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while conns.join_next().await.is_some() {} }).await;
    conns.abort_all();
    Ok(())
}

async fn connection(mut s: TcpStream, ctx: Arc<ServerCtx>, mut stop: watch::Receiver<bool>) {
    let stats = &ctx.lm;
    stats.connections_total.fetch_add(1, Relaxed);
    stats.connections_open.fetch_add(1, Relaxed);
    struct Open<'a>(&'a std::sync::atomic::AtomicU64);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Relaxed);
        }
    }
    let _open = Open(&stats.connections_open);
    let _ = s.set_nodelay(true);
    let idle = ctx.limits.idle_timeout();
    loop {
        let mut head = [0u8; REQUEST_LEN];
        let read = async {
            match idle {
                Some(d) => tokio::time::timeout(d, s.read_exact(&mut head)).await.ok(),
                None => Some(s.read_exact(&mut head).await),
            }
        };
        let got = tokio::select! {
            r = read => r,
            _ = stop.changed() => return,
        };
        // Idle past the timeout, closed, or broken: done.
        let Some(Ok(_)) = got else { return };
        stats.bytes_read.fetch_add(REQUEST_LEN as u64, Relaxed);
        let req = match Request::parse(&head) {
            Ok(r) => r,
            Err(e) => {
                stats.protocol_errors.fetch_add(1, Relaxed);
                tracing::debug!(error = %e, "lm:// protocol error; closing connection");
                return;
            }
        };
        match handle(&mut s, &ctx, req, ctx.limits.io_timeout()).await {
            Ok(true) => {}
            Ok(false) => {
                stats.protocol_errors.fetch_add(1, Relaxed);
                return;
            }
            Err(_) => return,
        }
    }
}

/// The first allocation of a PUT's value.
const FIRST_VALUE_READ: usize = 64 * 1024;

/// Reads a value of `len` bytes into an allocation of exactly `len`, grown
/// with the bytes that arrive (each growth at most doubles it, so the
/// copies add up to less than `len`): a header alone reserves at most
/// [`FIRST_VALUE_READ`]. Each read may wait `stall` for a byte.
pub async fn read_value<R: tokio::io::AsyncRead + Unpin>(
    s: &mut R,
    len: usize,
    stall: Option<Duration>,
) -> std::io::Result<BytesMut> {
    let mut data = BytesMut::with_capacity(len.min(FIRST_VALUE_READ));
    while data.len() < len {
        if data.len() == data.capacity() {
            let mut bigger = BytesMut::with_capacity(len.min(data.capacity().saturating_mul(2)));
            bigger.extend_from_slice(&data);
            data = bigger;
        }
        let room = (data.capacity() - data.len()) as u64;
        let mut part = (&mut *s).take(room);
        let read = part.read_buf(&mut data);
        let n = match stall {
            None => read.await?,
            Some(d) => tokio::time::timeout(d, read).await.map_err(|_| timed_out(d))??,
        };
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(data)
}

/// Writes all of `buf`, each write given at most `stall` to take a byte.
async fn write_all(s: &mut TcpStream, buf: &[u8], stall: Option<Duration>) -> std::io::Result<()> {
    match stall {
        None => s.write_all(buf).await,
        Some(d) => {
            let mut at = 0;
            while at < buf.len() {
                match tokio::time::timeout(d, s.write(&buf[at..])).await.map_err(|_| timed_out(d))?? {
                    0 => return Err(std::io::ErrorKind::WriteZero.into()),
                    n => at += n,
                }
            }
            Ok(())
        }
    }
}

fn timed_out(d: Duration) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no progress for {d:?}"))
}

/// Runs one request; `Ok(false)` when the connection must close.
async fn handle(s: &mut TcpStream, ctx: &ServerCtx, req: Request, stall: Option<Duration>) -> std::io::Result<bool> {
    let stats = &ctx.lm;
    let store = &ctx.store;
    let ns = ctx.lm_config.namespace.as_str();
    match req.command {
        Command::Put => {
            let len = req.length as usize;
            let max = store.config().max_value.as_u64();
            if len as u64 > max {
                tracing::debug!(len, max, "lm:// PUT larger than max_value; closing connection");
                return Ok(false);
            }
            let data = read_value(s, len, stall).await?;
            stats.bytes_read.fetch_add(len as u64, Relaxed);
            // The bytes first: a chunk whose metadata exists is whole.
            let put = async {
                store.put(ns, with_suffix(&req.key, DATA_SUFFIX), data.freeze(), PutOptions::default()).await?;
                let meta = encode_meta(req.length, req.layout);
                store.put(ns, with_suffix(&req.key, META_SUFFIX), meta, PutOptions::default()).await
            };
            match put.await {
                Ok(_) => stats.requests_ok.fetch_add(1, Relaxed),
                Err(e) => {
                    // The protocol has no reply to a PUT: count and log it.
                    tracing::warn!(error = %e, "lm:// PUT not stored");
                    stats.requests_error.fetch_add(1, Relaxed)
                }
            };
            Ok(true)
        }
        Command::Get => {
            let found = async {
                let Some(meta) = store.get(ns, &with_suffix(&req.key, META_SUFFIX)).await? else { return Ok(None) };
                let Some((length, layout)) = decode_meta(&meta.value) else { return Ok(None) };
                let Some(data) = store.get(ns, &with_suffix(&req.key, DATA_SUFFIX)).await? else { return Ok(None) };
                Ok::<_, crate::WarehouseError>((data.value.len() == length as usize).then_some((data.value, layout)))
            };
            match found.await {
                Ok(Some((data, layout))) => {
                    write_all(s, &reply(true, data.len() as i32, layout), stall).await?;
                    write_all(s, &data, stall).await?;
                    stats.bytes_written.fetch_add((REPLY_LEN + data.len()) as u64, Relaxed);
                    stats.requests_ok.fetch_add(1, Relaxed);
                }
                other => {
                    // A miss is an answer; a store error is counted as one.
                    match other {
                        Err(e) => {
                            tracing::warn!(error = %e, "lm:// GET failed");
                            stats.requests_error.fetch_add(1, Relaxed);
                        }
                        Ok(_) => {
                            stats.requests_ok.fetch_add(1, Relaxed);
                        }
                    }
                    write_all(s, &reply(false, 0, Layout::default()), stall).await?;
                    stats.bytes_written.fetch_add(REPLY_LEN as u64, Relaxed);
                }
            }
            Ok(true)
        }
        Command::Exist => {
            let meta = with_suffix(&req.key, META_SUFFIX);
            let data = with_suffix(&req.key, DATA_SUFFIX);
            let found = !req.key.is_empty()
                && store.exists(ns, &meta).await.unwrap_or(false)
                && store.exists(ns, &data).await.unwrap_or(false);
            write_all(s, &reply(found, 0, Layout::default()), stall).await?;
            stats.bytes_written.fetch_add(REPLY_LEN as u64, Relaxed);
            stats.requests_ok.fetch_add(1, Relaxed);
            Ok(true)
        }
        Command::Health => {
            write_all(s, &reply(true, 0, Layout::default()), stall).await?;
            stats.bytes_written.fetch_add(REPLY_LEN as u64, Relaxed);
            stats.requests_ok.fetch_add(1, Relaxed);
            Ok(true)
        }
        Command::List => {
            let mut keys = Vec::new();
            let mut cursor = 0;
            let mut ok = true;
            'scan: loop {
                match store.scan(ns, cursor, 1024).await {
                    Ok(page) => {
                        for k in page.keys {
                            if let Some(chunk) = k.strip_suffix(META_SUFFIX) {
                                if keys.len() == LIST_MAX {
                                    break 'scan;
                                }
                                keys.push(chunk.to_vec());
                            }
                        }
                        if page.next == 0 {
                            break;
                        }
                        cursor = page.next;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "lm:// LIST failed");
                        ok = false;
                        break;
                    }
                }
            }
            keys.sort();
            let body = keys.join(&b'\n');
            write_all(s, &reply(ok, if ok { body.len() as i32 } else { 0 }, Layout::default()), stall).await?;
            if ok {
                write_all(s, &body, stall).await?;
            }
            stats.bytes_written.fetch_add((REPLY_LEN + body.len()) as u64, Relaxed);
            stats.requests_ok.fetch_add(1, Relaxed);
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_keys_lose_their_padding() {
        let req = Request {
            command: Command::Put,
            length: 4096,
            layout: Layout { fmt: 1, dtype: 2, shape: [2, 32, 256, 64] },
            key: Bytes::from_static(b"vllm@model@1@0@abc"),
        };
        let h = req.encode();
        assert_eq!(h.len(), 186);
        assert_eq!(&h[36 + 18..36 + 20], b"  ");
        assert_eq!(Request::parse(&h).unwrap(), req);
        let mut bad = h;
        bad[0] = 9;
        assert_eq!(Request::parse(&bad).unwrap_err(), "unknown command 9");
        bad = h;
        bad[4..8].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(Request::parse(&bad).unwrap_err().contains("negative"));
    }

    #[test]
    fn metadata_is_lmcache_remote_metadata_of_one_group() {
        let l = Layout { fmt: 1, dtype: 3, shape: [2, 16, 256, 128] };
        let m = encode_meta(1 << 20, l);
        assert_eq!(m.len(), 28);
        assert_eq!(decode_meta(&m), Some((1 << 20, l)));
        assert_eq!(decode_meta(&m[..27]), None);
    }
}
