//! The client's ceiling for the `resp` part: a RESP server that does no
//! work, run as a process of its own beside Redis and granary and driven by
//! the same `redis-benchmark` runs.
//!
//! Every SET is read and dropped (`+OK`); every GET is answered with one
//! preformatted value as large as the last SET's, written from a single
//! buffer; PING gets `+PONG` and anything else an empty array (which is
//! how `redis-benchmark`'s CONFIG GET probe is answered). No lookup, no
//! allocation per request, one thread with an event loop (as Redis). What the client
//! reaches against it is the most it can drive on this host: when that is
//! below a goal's ratio to Redis, no server could meet the goal with this
//! client here.

use std::io;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What the process prints first: the address it serves on.
pub const LISTENING: &str = "ceiling listening on ";

/// The reply to GET: a nil until the first SET.
type Reply = Arc<Mutex<Arc<Vec<u8>>>>;

/// Serves on `127.0.0.1:0` until killed, after printing [`LISTENING`] and
/// the address. One thread with an event loop, as Redis serves.
pub fn serve() -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        println!("{LISTENING}{}", listener.local_addr()?);
        serve_on(listener).await
    })
}

async fn serve_on(listener: TcpListener) -> Result<()> {
    let reply: Reply = Arc::new(Mutex::new(Arc::new(b"$-1\r\n".to_vec())));
    loop {
        let Ok((conn, _)) = listener.accept().await else { continue };
        let reply = reply.clone();
        tokio::spawn(async move {
            // A client that goes away or sends something else ends its connection.
            let _ = connection(conn, &reply).await;
        });
    }
}

async fn connection(stream: TcpStream, reply: &Reply) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::with_capacity(64 << 10, r);
    let (mut line, mut name, mut scratch) = (Vec::new(), Vec::new(), vec![0u8; 1 << 20]);
    while let Some(args) = header(&mut r, &mut line, b'*').await? {
        let mut last_len = 0;
        name.clear();
        for i in 0..args {
            let len = header(&mut r, &mut line, b'$').await?.ok_or_else(|| bad("end of stream in a command"))?;
            if i == 0 && len <= 64 {
                name.resize(len, 0);
                r.read_exact(&mut name).await?;
            } else {
                discard(&mut r, len, &mut scratch).await?;
            }
            last_len = len;
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf).await?;
        }
        name.make_ascii_uppercase();
        match name.as_slice() {
            b"GET" => {
                let value = reply.lock().expect("reply").clone();
                w.write_all(&value).await?;
            }
            b"SET" => {
                {
                    let mut value = reply.lock().expect("reply");
                    if value.len() != bulk_len(last_len) {
                        *value = Arc::new(bulk(last_len));
                    }
                }
                w.write_all(b"+OK\r\n").await?;
            }
            b"PING" => w.write_all(b"+PONG\r\n").await?,
            _ => w.write_all(b"*0\r\n").await?,
        }
    }
    Ok(())
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// A `<kind><n>\r\n` line; `None` at the end of the stream before it.
async fn header(r: &mut (impl AsyncBufRead + Unpin), line: &mut Vec<u8>, kind: u8) -> io::Result<Option<usize>> {
    line.clear();
    if r.read_until(b'\n', line).await? == 0 {
        return Ok(None);
    }
    let text = line.strip_prefix(&[kind]).and_then(|l| l.strip_suffix(b"\r\n")).ok_or_else(|| bad("not RESP"))?;
    let n = std::str::from_utf8(text).ok().and_then(|t| t.parse().ok()).ok_or_else(|| bad("bad length"))?;
    Ok(Some(n))
}

/// Reads and drops `len` bytes.
async fn discard(r: &mut (impl AsyncRead + Unpin), mut len: usize, scratch: &mut [u8]) -> io::Result<()> {
    while len > 0 {
        let n = len.min(scratch.len());
        r.read_exact(&mut scratch[..n]).await?;
        len -= n;
    }
    Ok(())
}

fn bulk_len(len: usize) -> usize {
    format!("${len}\r\n").len() + len + 2
}

/// A bulk string of `len` bytes, as a GET reply.
fn bulk(len: usize) -> Vec<u8> {
    let mut v = format!("${len}\r\n").into_bytes();
    v.resize(v.len() + len, b'x');
    v.extend_from_slice(b"\r\n");
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn gets_answer_with_a_value_as_large_as_the_last_set() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_on(listener));
        let mut s = TcpStream::connect(addr).await.unwrap();
        async fn ask(s: &mut TcpStream, req: &[u8], want: usize) -> Vec<u8> {
            s.write_all(req).await.unwrap();
            let mut got = vec![0u8; want];
            s.read_exact(&mut got).await.unwrap();
            got
        }
        assert_eq!(ask(&mut s, b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n", 5).await, b"$-1\r\n");
        let value = "v".repeat(70_000);
        let set = format!("*3\r\n$3\r\nset\r\n$1\r\nk\r\n${}\r\n{value}\r\n", value.len());
        assert_eq!(ask(&mut s, set.as_bytes(), 5).await, b"+OK\r\n");
        let got = ask(&mut s, b"*2\r\n$3\r\nGET\r\n$1\r\nz\r\n", bulk_len(70_000)).await;
        assert!(got.starts_with(b"$70000\r\nxxx") && got.ends_with(b"x\r\n"));
        assert_eq!(ask(&mut s, b"*1\r\n$4\r\nPING\r\n", 7).await, b"+PONG\r\n");
        assert_eq!(ask(&mut s, b"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$4\r\nsave\r\n", 4).await, b"*0\r\n");
        // Not RESP: the connection is closed.
        s.write_all(b"hello\r\n").await.unwrap();
        let mut rest = Vec::new();
        assert_eq!(s.read_to_end(&mut rest).await.unwrap(), 0);
    }
}
