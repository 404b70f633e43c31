//! The RESP (Redis protocol) front end of the warehouse.
//!
//! Redis tooling (`redis-cli`, `redis-benchmark`, redis-py) and LMCache's
//! `redis://` remote connector speak RESP; serving it over the [`Store`]
//! lets them use the warehouse unchanged. Each connection reads into one
//! buffer, takes every complete command out of it (pipelining), runs them
//! in order, gathers the replies and writes them when the input is
//! drained. Large values move without copies both ways: a SET's value is
//! a slice of the read buffer, a GET's reply is the stored bytes handed to
//! a vectored write. After a frame larger than a read buffer, the next
//! frame's header is read alone, so that a run of large SETs copies a few
//! hundred bytes each into their own allocations, not a buffer's worth. A malformed or oversized request closes only the
//! connection that sent it.
//!
//! Against hostile clients: until AUTH succeeds on a server with tokens, a
//! command may have at most 10 arguments and 16 KiB (Redis's limits for
//! unauthenticated clients); connections beyond `max_connections` are told
//! so and closed; with `idle_timeout_secs`, a connection silent that long
//! between commands is closed. Three bounds hold by default: a connection
//! to a server with tokens that has not passed AUTH within
//! `auth_timeout_secs` (10) of opening is closed; so is one that stops, for
//! `io_timeout_secs` (30), reading the replies it asked for or sending the
//! rest of a frame it began. The replies queued for one connection are
//! bounded without a setting: no further command of it runs while a write
//! of 8 MiB of replies is pending (Redis's `client-output-buffer-limit`
//! for a client that does not read, by construction).
//!
//! [`Store`]: crate::store::Store

pub mod commands;
pub mod glob;
pub mod parser;
pub mod reply;
pub mod table;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub use commands::{CmdError, Flow, ServerInfo, Session};
pub use glob::glob_match;
pub use parser::{parse_command, Limits, Parse, ProtocolError};
pub use reply::Out;

use crate::server::ServerCtx;

/// Size of a fresh read buffer.
const READ_CHUNK: usize = 64 * 1024;
/// Most room reserved ahead of a frame's bytes arriving.
const PREALLOC_MAX: usize = 32 << 20;
/// The first read of a frame when the one before was larger than a read
/// buffer: enough for the header of any command a client sends.
const HEADER_READ: usize = 1024;
/// Below this much free room, a new read buffer is started.
const MIN_READ: usize = 8 * 1024;
/// Replies queued beyond this are written before more commands run.
const FLUSH_AT: usize = 8 << 20;
/// How long shutdown waits for connections to finish what they are doing.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves RESP on `listener` until `shutdown` completes; then stops
/// accepting, tells connections to close once their current batch is
/// answered, and waits briefly for them.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let info = Arc::new(ServerInfo::new(listener.local_addr()?.port()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((mut stream, _peer)) => {
                    while conns.try_join_next().is_some() {}
                    if conns.len() >= ctx.limits.max_connections {
                        ctx.resp.requests_error.fetch_add(1, Relaxed);
                        // Told why, then closed, as Redis does past `maxclients`.
                        conns.spawn(async move {
                            use tokio::io::AsyncWriteExt;
                            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                                let _ = stream.write_all(b"-ERR max number of clients reached\r\n").await;
                                let _ = stream.shutdown().await;
                            })
                            .await;
                        });
                        continue;
                    }
                    conns.spawn(connection(stream, ctx.clone(), info.clone(), stop_rx.clone()));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "RESP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async { while conns.join_next().await.is_some() {} }).await;
    conns.abort_all();
    Ok(())
}

/// Decrements the open-connection gauge however the connection ends.
struct OpenGuard<'a>(&'a AtomicU64);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

async fn connection(
    mut stream: TcpStream,
    ctx: Arc<ServerCtx>,
    info: Arc<ServerInfo>,
    mut stop: watch::Receiver<bool>,
) {
    let stats = &ctx.resp;
    stats.connections_total.fetch_add(1, Relaxed);
    stats.connections_open.fetch_add(1, Relaxed);
    let _open = OpenGuard(&stats.connections_open);
    let _ = stream.set_nodelay(true);
    let limits = Limits::for_max_value(ctx.store.config().max_value.as_u64());
    let before_auth = Limits::unauthenticated();
    let idle = ctx.limits.idle_timeout();
    let io = ctx.limits.io_timeout();
    let opened = tokio::time::Instant::now();
    let auth_by = ctx.limits.auth_timeout().map(|d| opened + d);
    let mut last_read = opened;
    // The idle clock restarts on a whole command, not on any byte, so a
    // client trickling a frame in cannot hold the connection forever.
    let mut last_command = tokio::time::Instant::now();
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut session = Session::with_peer(&ctx, &info, peer);
    let mut input = BytesMut::with_capacity(READ_CHUNK);
    let mut out = Out::new();
    // Bytes the input must hold before parsing can make progress.
    let mut need = 1usize;
    // The last command was larger than a read buffer: the next one's
    // header is read alone first (see HEADER_READ).
    let mut large = false;
    loop {
        while input.len() >= need {
            let lim = if session.authenticated() { &limits } else { &before_auth };
            let before = input.len();
            match parse_command(&mut input, lim) {
                Ok(Parse::Command(args)) => {
                    need = 1;
                    large = before - input.len() > READ_CHUNK;
                    last_command = tokio::time::Instant::now();
                    if args.is_empty() {
                        continue;
                    }
                    if session.execute(args, &mut out).await == Flow::Close {
                        let _ = write_out(&mut out, &mut stream, &ctx, io).await;
                        return;
                    }
                    if out.pending() >= FLUSH_AT && write_out(&mut out, &mut stream, &ctx, io).await.is_err() {
                        return;
                    }
                }
                Ok(Parse::Incomplete { need: n }) => need = n,
                Err(e) => {
                    stats.protocol_errors.fetch_add(1, Relaxed);
                    stats.requests_error.fetch_add(1, Relaxed);
                    tracing::debug!(error = %e, "RESP protocol error; closing connection");
                    out.error(&format!("ERR Protocol error: {e}"));
                    let _ = write_out(&mut out, &mut stream, &ctx, io).await;
                    return;
                }
            }
        }
        if let Err(e) = write_out(&mut out, &mut stream, &ctx, io).await {
            tracing::debug!(error = %e, "RESP write failed; closing connection");
            return;
        }
        make_room(&mut input, need, large);
        // The earliest of the deadlines that apply now: idle between
        // commands, AUTH not passed yet, a frame begun and stalled.
        let deadline = [
            idle.map(|d| last_command + d),
            auth_by.filter(|_| !session.authenticated()),
            io.filter(|_| !input.is_empty()).map(|d| last_read + d),
        ]
        .into_iter()
        .flatten()
        .min();
        tokio::select! {
            r = stream.read_buf(&mut input) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    last_read = tokio::time::Instant::now();
                    stats.bytes_read.fetch_add(n as u64, Relaxed);
                }
            },
            _ = async {
                match deadline {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                tracing::debug!(
                    authenticated = session.authenticated(),
                    partial_frame = input.len(),
                    "RESP connection past its idle, AUTH or I/O timeout; closing"
                );
                return;
            }
            _ = stop.changed() => return,
        }
    }
}

/// Makes room in `input` for the next read, toward a frame of at least
/// `need` bytes; `large` says the last frame was larger than a read buffer.
fn make_room(input: &mut BytesMut, need: usize, large: bool) {
    let spare = input.capacity() - input.len();
    if need > READ_CHUNK && need > input.capacity() {
        // A frame larger than a read buffer: give it one allocation of
        // exactly its size, filled by the reads that follow. The stored
        // value then owns that allocation alone instead of sharing (and
        // pinning) a read buffer with the requests after it. Beyond
        // PREALLOC_MAX the room grows with the bytes that actually arrive,
        // so a header alone cannot make the server reserve 512 MiB.
        //
        // A frame of many large arguments (MSET of 1 MiB values) asks for
        // more room argument by argument, each time only up to the end of
        // the one being read: growing to exactly that each time would copy
        // the frame so far once per argument (quadratic in its size). So a
        // frame that outgrows its own allocation at least doubles it.
        let want = if input.capacity() > READ_CHUNK { need.max(input.capacity().saturating_mul(2)) } else { need };
        let cap = want.min(input.len().saturating_mul(2).max(input.len() + PREALLOC_MAX));
        let mut frame = BytesMut::with_capacity(cap);
        frame.extend_from_slice(input);
        *input = frame;
    } else if large && input.is_empty() {
        // Probably another large frame: read its header alone, so that what
        // is copied into the frame's own allocation is a few hundred bytes,
        // not a read buffer's worth of its value.
        if input.capacity() < HEADER_READ {
            *input = BytesMut::with_capacity(HEADER_READ);
        }
    } else if spare < MIN_READ && !(need > READ_CHUNK && input.capacity() >= need) {
        // Smaller frames share a read buffer (one of exactly the missing
        // bytes would read a header one byte per call). A large frame's own
        // allocation already has room for the rest: growing it would copy it.
        input.reserve(READ_CHUNK);
    }
}

async fn write_out(
    out: &mut Out,
    stream: &mut TcpStream,
    ctx: &ServerCtx,
    stall: Option<Duration>,
) -> std::io::Result<()> {
    let n = out.flush_to(stream, stall).await?;
    ctx.resp.bytes_written.fetch_add(n as u64, Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_have_room_for_more_than_the_byte_a_header_needs() {
        // A large frame just taken off the front leaves no room at all.
        let mut input = BytesMut::new();
        for need in [1, 5, 40] {
            make_room(&mut input, need, false);
            assert!(input.capacity() - input.len() >= MIN_READ, "need {need}: room {}", input.capacity());
        }
    }

    #[test]
    fn a_large_frame_gets_an_allocation_of_its_size_that_is_never_grown() {
        let mut input = BytesMut::with_capacity(READ_CHUNK);
        input.extend_from_slice(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1048576\r\n");
        let head = input.to_vec();
        let need = head.len() + (1 << 20) + 2;
        make_room(&mut input, need, false);
        assert_eq!((input.capacity(), &input[..]), (need, &head[..]));
        // Most of the value arrived; the last few KiB fit in the room left.
        input.resize(need - 4096, 7);
        let at = input.as_ptr();
        make_room(&mut input, need, false);
        assert_eq!((input.as_ptr(), input.capacity()), (at, need), "the frame was copied into a larger buffer");
    }

    /// Issue 40: an MSET of 100 values of 1 MiB was read in quadratic time
    /// (12.8 s against Redis's 0.18 s), the frame copied into a new buffer
    /// of exactly the next argument's end at every argument. Now the bytes
    /// copied stay within a few times the frame's size.
    #[test]
    fn a_frame_of_many_large_arguments_is_copied_a_bounded_number_of_times() {
        const VALUES: usize = 100;
        const VALUE: usize = 1 << 20;
        let mut frame = format!("*{}\r\n$4\r\nMSET\r\n", 1 + 2 * VALUES).into_bytes();
        for i in 0..VALUES {
            frame.extend_from_slice(format!("$4\r\nk{i:03}\r\n${VALUE}\r\n").as_bytes());
            frame.resize(frame.len() + VALUE, b'v');
            frame.extend_from_slice(b"\r\n");
        }
        let limits = Limits::for_max_value(u64::MAX / 4);
        let mut input = BytesMut::new();
        let (mut fed, mut copied, mut need, mut large) = (0usize, 0usize, 1usize, false);
        loop {
            while input.len() >= need {
                match parse_command(&mut input, &limits).unwrap() {
                    Parse::Command(args) => {
                        assert_eq!(args.len(), 1 + 2 * VALUES);
                        assert_eq!(fed, frame.len());
                        assert!(copied <= 4 * frame.len(), "copied {copied} bytes for a frame of {}", frame.len());
                        return;
                    }
                    Parse::Incomplete { need: n } => need = n,
                }
            }
            let before = input.as_ptr();
            let held = input.len();
            make_room(&mut input, need, large);
            large = false;
            if input.as_ptr() != before {
                copied += held;
            }
            // A read: as much as the room allows, at most 64 KiB.
            let n = (input.capacity() - input.len()).min(READ_CHUNK).min(frame.len() - fed);
            input.extend_from_slice(&frame[fed..fed + n]);
            fed += n;
        }
    }

    #[test]
    fn after_a_large_frame_the_next_header_is_read_alone() {
        let mut input = BytesMut::new();
        make_room(&mut input, 1, true);
        assert_eq!(input.capacity(), HEADER_READ);
        // A small command after all: it gets a read buffer once the header is in.
        input.extend_from_slice(&[b'x'; HEADER_READ]);
        make_room(&mut input, HEADER_READ + 1, false);
        assert!(input.capacity() - input.len() >= MIN_READ);
    }
}
