//! The RESP transport: a small RESP2 client on Tokio for the warehouse's
//! RESP server.
//!
//! The connector needs six commands (`AUTH`, `NAMESPACE`, `EXISTS`, `MGET`,
//! `SET`, pipelined), deadlines it controls itself, and connections that are
//! dropped, never reused, once a call on them failed or was cancelled half
//! way. A client of that size is simpler to hold to those rules than a
//! general Redis client with its own reconnect and timeout machinery.
//!
//! Connections are kept in a small pool (at most `max_connections` open,
//! guarded by a semaphore). A pooled connection the server has closed since
//! its last use fails on first write or read; the call is then retried once
//! on a fresh connection (every command here is idempotent).

use bytes::Bytes;
use granary_core::BlockHash;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use super::{key_of, ConnectorConfig, ConnectorError, Result, Source};

/// Longest status, error or length line accepted from the server.
const MAX_LINE: usize = 64 * 1024;
/// Most elements accepted in one array reply.
const MAX_ARRAY: usize = 1 << 20;

/// One RESP2 reply (nested arrays are not needed here and are refused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Bytes>),
    Array(Option<Vec<Reply>>),
}

/// One command: its arguments.
type Cmd = Vec<Bytes>;

struct Conn {
    io: BufStream<TcpStream>,
    max_bulk: u64,
}

impl Conn {
    /// Writes every command, then reads exactly one reply per command, so the
    /// connection stays in step even when some replies are errors.
    async fn round_trip(&mut self, cmds: &[Cmd]) -> Result<Vec<Reply>> {
        for cmd in cmds {
            self.io.write_all(format!("*{}\r\n", cmd.len()).as_bytes()).await?;
            for arg in cmd {
                self.io.write_all(format!("${}\r\n", arg.len()).as_bytes()).await?;
                // Large values go straight to the socket (BufStream passes them through).
                self.io.write_all(arg).await?;
                self.io.write_all(b"\r\n").await?;
            }
        }
        self.io.flush().await?;
        let mut out = Vec::with_capacity(cmds.len());
        for _ in cmds {
            out.push(self.read_reply().await?);
        }
        Ok(out)
    }

    /// One line without its CRLF.
    async fn read_line(&mut self) -> Result<Vec<u8>> {
        let mut line = Vec::new();
        loop {
            let buf = self.io.fill_buf().await?;
            if buf.is_empty() {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            let (take, done) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            line.extend_from_slice(&buf[..take]);
            self.io.consume(take);
            if line.len() > MAX_LINE {
                return Err(ConnectorError::Protocol(format!("reply line longer than {MAX_LINE} bytes")));
            }
            if done {
                break;
            }
        }
        if !line.ends_with(b"\r\n") {
            return Err(ConnectorError::Protocol("reply line not ended by CRLF".into()));
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }

    async fn read_reply(&mut self) -> Result<Reply> {
        let line = self.read_line().await?;
        match line.first() {
            Some(b'*') => {
                let Some(n) = count(&line[1..], MAX_ARRAY as u64)? else { return Ok(Reply::Array(None)) };
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let line = self.read_line().await?;
                    if line.first() == Some(&b'*') {
                        return Err(ConnectorError::Protocol("nested array in reply".into()));
                    }
                    items.push(self.scalar(line).await?);
                }
                Ok(Reply::Array(Some(items)))
            }
            _ => self.scalar(line).await,
        }
    }

    /// A reply other than an array, whose first line is `line`.
    async fn scalar(&mut self, line: Vec<u8>) -> Result<Reply> {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        match line.first() {
            Some(b'+') => Ok(Reply::Simple(text(&line[1..]))),
            Some(b'-') => Ok(Reply::Error(text(&line[1..]))),
            Some(b':') => std::str::from_utf8(&line[1..])
                .ok()
                .and_then(|s| s.parse().ok())
                .map(Reply::Int)
                .ok_or_else(|| ConnectorError::Protocol(format!("bad integer reply {:?}", text(&line)))),
            Some(b'$') => {
                let Some(len) = count(&line[1..], self.max_bulk)? else { return Ok(Reply::Bulk(None)) };
                let mut buf = Vec::with_capacity(len as usize + 2);
                (&mut self.io).take(len + 2).read_to_end(&mut buf).await?;
                if buf.len() as u64 != len + 2 {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
                if !buf.ends_with(b"\r\n") {
                    return Err(ConnectorError::Protocol("bulk reply not ended by CRLF".into()));
                }
                buf.truncate(len as usize);
                Ok(Reply::Bulk(Some(Bytes::from(buf))))
            }
            _ => Err(ConnectorError::Protocol(format!("unexpected reply {:?}", text(&line[..line.len().min(64)])))),
        }
    }
}

/// A length or count from a `$`/`*` line: `None` for `-1` (null), an
/// error past `max`.
fn count(digits: &[u8], max: u64) -> Result<Option<u64>> {
    let s = std::str::from_utf8(digits).unwrap_or("");
    if s == "-1" {
        return Ok(None);
    }
    match s.parse::<u64>() {
        Ok(n) if n <= max => Ok(Some(n)),
        Ok(n) => Err(ConnectorError::Protocol(format!("reply of {n} exceeds the limit of {max}"))),
        Err(_) => Err(ConnectorError::Protocol(format!("bad length {s:?} in reply"))),
    }
}

fn refused(op: &'static str, message: String) -> ConnectorError {
    ConnectorError::Refused { op, message }
}

pub(super) struct RespClient {
    addr: String,
    namespace: String,
    token: Option<String>,
    max_bulk: u64,
    idle: Mutex<Vec<Conn>>,
    permits: Semaphore,
}

impl RespClient {
    pub(super) fn new(addr: &str, cfg: &ConnectorConfig) -> Self {
        RespClient {
            addr: addr.to_string(),
            namespace: cfg.namespace.clone(),
            token: cfg.token.clone(),
            max_bulk: cfg.max_block_bytes,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(cfg.max_connections),
        }
    }

    /// Connects, authenticates and selects the namespace.
    async fn open(&self) -> Result<Conn> {
        let stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|source| ConnectorError::Connect { addr: self.addr.clone(), source })?;
        let _ = stream.set_nodelay(true);
        let mut conn = Conn { io: BufStream::new(stream), max_bulk: self.max_bulk };
        let mut hello: Vec<Cmd> = Vec::new();
        if let Some(t) = &self.token {
            hello.push(vec![Bytes::from_static(b"AUTH"), Bytes::from(t.clone())]);
        }
        // An open server binds every connection to `default`; anything else is asked for.
        if self.token.is_some() || self.namespace != granary_warehouse::auth::DEFAULT_NAMESPACE {
            hello.push(vec![Bytes::from_static(b"NAMESPACE"), Bytes::from(self.namespace.clone())]);
        }
        if !hello.is_empty() {
            for r in conn.round_trip(&hello).await? {
                match r {
                    Reply::Simple(_) => {}
                    Reply::Error(e) => return Err(refused("authentication", e)),
                    other => return Err(ConnectorError::Protocol(format!("unexpected answer to AUTH: {other:?}"))),
                }
            }
        }
        Ok(conn)
    }

    /// Runs a pipeline on a pooled connection (retrying once on a fresh one
    /// when a reused connection turns out dead). A connection goes back to
    /// the pool only after a complete exchange; a cancelled call drops it.
    async fn call(&self, cmds: &[Cmd]) -> Result<Vec<Reply>> {
        let _permit = self.permits.acquire().await.expect("the semaphore is never closed");
        let pooled = self.idle.lock().pop();
        let reused = pooled.is_some();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.open().await?,
        };
        let replies = match conn.round_trip(cmds).await {
            Ok(r) => r,
            Err(ConnectorError::Io(e)) if reused => {
                tracing::debug!(addr = %self.addr, error = %e, "pooled RESP connection failed; reconnecting");
                conn = self.open().await?;
                conn.round_trip(cmds).await?
            }
            Err(e) => return Err(e),
        };
        self.idle.lock().push(conn);
        Ok(replies)
    }

    pub(super) async fn lookup(&self, keys: &[BlockHash]) -> Result<usize> {
        let cmds: Vec<Cmd> = keys.iter().map(|k| vec![Bytes::from_static(b"EXISTS"), key_of(k)]).collect();
        let replies = self.call(&cmds).await?;
        let mut matched = 0;
        for r in replies {
            match r {
                Reply::Int(1) => matched += 1,
                Reply::Int(0) => break,
                Reply::Error(e) => return Err(refused("lookup", e)),
                other => return Err(ConnectorError::Protocol(format!("unexpected answer to EXISTS: {other:?}"))),
            }
        }
        Ok(matched)
    }

    pub(super) async fn get_many(&self, keys: &[BlockHash]) -> Result<Vec<Option<(Bytes, Source)>>> {
        let mut cmd = Vec::with_capacity(keys.len() + 1);
        cmd.push(Bytes::from_static(b"MGET"));
        cmd.extend(keys.iter().map(key_of));
        let reply = self.call(&[cmd]).await?.pop();
        match reply {
            Some(Reply::Array(Some(items))) => items
                .into_iter()
                .map(|r| match r {
                    Reply::Bulk(v) => Ok(v.map(|v| (v, Source::Unknown))),
                    other => Err(ConnectorError::Protocol(format!("unexpected element in MGET answer: {other:?}"))),
                })
                .collect(),
            Some(Reply::Error(e)) => Err(refused("get", e)),
            other => Err(ConnectorError::Protocol(format!("unexpected answer to MGET: {other:?}"))),
        }
    }

    pub(super) async fn put_many(&self, frames: &[(BlockHash, Bytes)]) -> Result<()> {
        let cmds: Vec<Cmd> =
            frames.iter().map(|(h, f)| vec![Bytes::from_static(b"SET"), key_of(h), f.clone()]).collect();
        for r in self.call(&cmds).await? {
            match r {
                Reply::Simple(s) if s == "OK" => {}
                Reply::Error(e) => return Err(refused("put", e)),
                other => return Err(ConnectorError::Protocol(format!("unexpected answer to SET: {other:?}"))),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    /// A client connection to a server that sends `script` and closes.
    async fn conn_fed(script: &'static [u8]) -> Conn {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(script).await.unwrap();
        });
        Conn { io: BufStream::new(TcpStream::connect(addr).await.unwrap()), max_bulk: 16 }
    }

    #[tokio::test]
    async fn parses_the_replies_it_needs() {
        let mut c = conn_fed(b"+OK\r\n-ERR no\r\n:1\r\n$3\r\nab\n\r\n$-1\r\n*2\r\n$1\r\nx\r\n$-1\r\n*-1\r\n").await;
        assert_eq!(c.read_reply().await.unwrap(), Reply::Simple("OK".into()));
        assert_eq!(c.read_reply().await.unwrap(), Reply::Error("ERR no".into()));
        assert_eq!(c.read_reply().await.unwrap(), Reply::Int(1));
        assert_eq!(c.read_reply().await.unwrap(), Reply::Bulk(Some(Bytes::from_static(b"ab\n"))));
        assert_eq!(c.read_reply().await.unwrap(), Reply::Bulk(None));
        assert_eq!(
            c.read_reply().await.unwrap(),
            Reply::Array(Some(vec![Reply::Bulk(Some(Bytes::from_static(b"x"))), Reply::Bulk(None)]))
        );
        assert_eq!(c.read_reply().await.unwrap(), Reply::Array(None));
    }

    #[tokio::test]
    async fn refuses_malformed_and_oversized_replies() {
        for (script, want) in [
            (&b"$17\r\n"[..], "exceeds the limit"),
            (b"*1\r\n*0\r\n", "nested"),
            (b"?x\r\n", "unexpected reply"),
            (b":x\r\n", "bad integer"),
            (b"+OK\n", "CRLF"),
            (b"$2\r\nabcd", "CRLF"),
        ] {
            let mut c = conn_fed(script).await;
            let e = c.read_reply().await.unwrap_err().to_string();
            assert!(e.contains(want), "{script:?}: {e}");
        }
        let mut c = conn_fed(b"$5\r\nab").await;
        assert!(matches!(c.read_reply().await, Err(ConnectorError::Io(_))));
    }
}
