//! Reply encoding into one output queue per connection.
//!
//! Replies to a pipeline of commands are gathered and written together.
//! Small replies are copied into a growing buffer; a large value (a GET of
//! a KV block) is queued as the stored `Bytes` itself, between the header
//! and trailer written around it, and goes to the socket in one vectored
//! write, never copied. The encoding follows the protocol version the
//! client chose with HELLO (RESP2, or RESP3 with `_` nulls and maps).

use std::io::IoSlice;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Values at least this large are queued by reference rather than copied.
const ZERO_COPY_MIN: usize = 16 * 1024;
/// Most slices handed to one vectored write.
const MAX_IOVECS: usize = 64;

/// Pending output of one connection.
#[derive(Debug)]
pub struct Out {
    /// 2 or 3.
    pub proto: u8,
    buf: BytesMut,
    chunks: Vec<Bytes>,
    queued: usize,
}

impl Default for Out {
    fn default() -> Self {
        Out::new()
    }
}

impl Out {
    pub fn new() -> Out {
        Out { proto: 2, buf: BytesMut::with_capacity(16 * 1024), chunks: Vec::new(), queued: 0 }
    }

    /// Bytes waiting to be written.
    pub fn pending(&self) -> usize {
        self.queued + self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending() == 0
    }

    fn line(&mut self, kind: u8, text: &[u8]) {
        self.buf.reserve(text.len() + 3);
        self.buf.put_u8(kind);
        self.buf.put_slice(text);
        self.buf.put_slice(b"\r\n");
    }

    fn number(&mut self, kind: u8, n: i64) {
        let digits = itoa_buf(n);
        self.line(kind, digits.as_bytes());
    }

    /// `+OK`.
    pub fn ok(&mut self) {
        self.buf.put_slice(b"+OK\r\n");
    }

    /// A status line; CR and LF are replaced so the reply stays one line.
    pub fn simple(&mut self, s: &str) {
        let clean = sanitize(s);
        self.line(b'+', clean.as_bytes());
    }

    /// An error line: `text` starts with its code (`ERR ...`, `NOAUTH ...`).
    pub fn error(&mut self, text: &str) {
        let clean = sanitize(text);
        self.line(b'-', clean.as_bytes());
    }

    pub fn int(&mut self, n: i64) {
        self.number(b':', n);
    }

    pub fn null(&mut self) {
        if self.proto >= 3 {
            self.buf.put_slice(b"_\r\n");
        } else {
            self.buf.put_slice(b"$-1\r\n");
        }
    }

    pub fn array(&mut self, len: usize) {
        self.number(b'*', len as i64);
    }

    /// A map of `len` pairs (RESP3), or a flat array of `2 * len` items (RESP2).
    pub fn map(&mut self, len: usize) {
        if self.proto >= 3 {
            self.number(b'%', len as i64);
        } else {
            self.array(len * 2);
        }
    }

    /// A bulk string, copied.
    pub fn bulk(&mut self, v: &[u8]) {
        self.number(b'$', v.len() as i64);
        self.buf.reserve(v.len() + 2);
        self.buf.put_slice(v);
        self.buf.put_slice(b"\r\n");
    }

    /// A bulk string; large values are queued without a copy.
    pub fn bulk_bytes(&mut self, v: Bytes) {
        if v.len() < ZERO_COPY_MIN {
            return self.bulk(&v);
        }
        self.number(b'$', v.len() as i64);
        self.seal();
        self.queued += v.len();
        self.chunks.push(v);
        self.buf.put_slice(b"\r\n");
    }

    /// Moves the copied bytes so far into the chunk queue.
    fn seal(&mut self) {
        if !self.buf.is_empty() {
            let b = self.buf.split().freeze();
            self.queued += b.len();
            self.chunks.push(b);
        }
    }

    /// Writes everything queued; returns the bytes written.
    ///
    /// `stall`: how long one write may wait for the client to take
    /// anything; past it the flush fails with `TimedOut` (a client that
    /// stops reading its replies). A slow reader that keeps reading is
    /// never cut off.
    pub async fn flush_to<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        stall: Option<Duration>,
    ) -> std::io::Result<usize> {
        let total = self.pending();
        if total == 0 {
            return Ok(0);
        }
        if self.chunks.is_empty() {
            let mut at = 0;
            while at < self.buf.len() {
                match write_within(w, &[IoSlice::new(&self.buf[at..])], stall).await? {
                    0 => return Err(std::io::ErrorKind::WriteZero.into()),
                    n => at += n,
                }
            }
            self.buf.clear();
            return Ok(total);
        }
        self.seal();
        let mut chunks = std::mem::take(&mut self.chunks);
        self.queued = 0;
        let mut first = 0usize;
        let mut offset = 0usize;
        while first < chunks.len() {
            let n = {
                let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_IOVECS.min(chunks.len() - first));
                slices.push(IoSlice::new(&chunks[first][offset..]));
                for c in chunks.iter().skip(first + 1).take(MAX_IOVECS - 1) {
                    slices.push(IoSlice::new(c));
                }
                write_within(w, &slices, stall).await?
            };
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            let mut left = n;
            while left > 0 && first < chunks.len() {
                let avail = chunks[first].len() - offset;
                if left >= avail {
                    left -= avail;
                    first += 1;
                    offset = 0;
                } else {
                    offset += left;
                    left = 0;
                }
            }
        }
        chunks.clear();
        // Keep the vector's allocation for the next batch.
        self.chunks = chunks;
        Ok(total)
    }
}

/// One vectored write, given at most `stall` to take a byte.
async fn write_within<W: AsyncWrite + Unpin>(
    w: &mut W,
    slices: &[IoSlice<'_>],
    stall: Option<Duration>,
) -> std::io::Result<usize> {
    match stall {
        None => w.write_vectored(slices).await,
        Some(d) => tokio::time::timeout(d, w.write_vectored(slices)).await.unwrap_or_else(|_| {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("the client read nothing for {d:?}")))
        }),
    }
}

/// Replaces CR and LF, which would end a status or error line early.
fn sanitize(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains(['\r', '\n']) {
        std::borrow::Cow::Owned(s.replace(['\r', '\n'], " "))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// Decimal text of an integer without allocating.
struct NumBuf {
    bytes: [u8; 20],
    start: usize,
}

impl NumBuf {
    fn as_bytes(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

fn itoa_buf(n: i64) -> NumBuf {
    let mut bytes = [0u8; 20];
    let mut i = bytes.len();
    let neg = n < 0;
    let mut v = n.unsigned_abs();
    loop {
        i -= 1;
        bytes[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    if neg {
        i -= 1;
        bytes[i] = b'-';
    }
    NumBuf { bytes, start: i }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn encodes_both_protocols_and_large_values_by_reference() {
        let mut out = Out::new();
        out.ok();
        out.int(-42);
        out.int(i64::MIN);
        out.null();
        out.bulk(b"hi");
        out.error("ERR bad\r\nthing");
        let big = Bytes::from(vec![b'x'; ZERO_COPY_MIN + 5]);
        out.bulk_bytes(big.clone());
        out.array(1);
        out.proto = 3;
        out.null();
        out.map(1);
        let mut sink = Vec::new();
        let n = out.flush_to(&mut sink, None).await.unwrap();
        assert_eq!(n, sink.len());
        let mut want = b"+OK\r\n:-42\r\n:-9223372036854775808\r\n$-1\r\n$2\r\nhi\r\n-ERR bad  thing\r\n".to_vec();
        want.extend_from_slice(format!("${}\r\n", big.len()).as_bytes());
        want.extend_from_slice(&big);
        want.extend_from_slice(b"\r\n*1\r\n_\r\n%1\r\n");
        assert_eq!(sink, want);
        assert!(out.is_empty());
    }
}
