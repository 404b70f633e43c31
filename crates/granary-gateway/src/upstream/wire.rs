//! Generation requests to an upstream, on the path every request takes.
//!
//! A plain `http://` upstream gets a pool of HTTP/1.1 connections of the
//! gateway's own ([`PlainWire`]): its generation paths and `Host` are
//! worked out once when it joins, and each connection is driven by the
//! request that holds it, in that request's task, from writing the request
//! to the last byte of the answer. A pooled client that runs every
//! connection as a task of its own hands each request over to that task and
//! each answer back (wake-ups both ways, a channel, a keyed pool lookup);
//! on a fast upstream that was a sizeable part of the gateway's CPU per
//! request. `https://` upstreams (TLS, client certificates), and every
//! upstream when the environment names an HTTP proxy, go through the
//! upstream's reqwest client.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use bytes::Bytes;
use futures::{Stream, TryStreamExt};
use http_body_util::Full;
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;

/// An error while reading an answer's body.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;
/// An answer's body as it arrives.
pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>;

/// An upstream's answer: its status and headers, and the body to read.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: BodyStream,
}

/// Why no answer came.
#[derive(Debug)]
pub enum SendError {
    /// No connection (refused, unreachable, past the connect timeout).
    Connect(String),
    /// Anything after connecting (the connection closed, a malformed answer).
    Other(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) => write!(f, "cannot connect: {e}"),
            SendError::Other(e) => f.write_str(e),
        }
    }
}

/// The variables through which the environment names an HTTP proxy (the
/// general-purpose client honours them; the plain pool does not).
const PROXY_VARS: [&str; 4] = ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"];

/// How long a connection may sit idle in the pool and still be used.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 512;

/// One HTTP/1.1 connection: the handle requests are sent through, and the
/// connection's state machine, which reads and writes the socket whenever
/// it is polled (by the request holding it: nothing polls an idle one).
struct Conn {
    send: http1::SendRequest<Full<Bytes>>,
    driver: Pin<Box<http1::Connection<TokioIo<TcpStream>, Full<Bytes>>>>,
}

/// Idle connections in the order they came back, the most recently used
/// last (taken first); the oldest, first, are the ones to expire.
type Idle = Arc<Mutex<VecDeque<(Conn, Instant)>>>;

/// The plain HTTP/1.1 pool of one upstream and its generation paths.
pub struct PlainWire {
    /// `host:port` to connect to.
    addr: String,
    host: HeaderValue,
    /// Each generation path and its request target (origin form).
    uris: Vec<(&'static str, Uri)>,
    connect_timeout: Duration,
    idle: Idle,
}

impl PlainWire {
    /// For an `http://` base URL when no proxy is configured; None otherwise.
    pub fn new(base: &str, paths: &[&'static str], connect_timeout: Duration) -> Option<PlainWire> {
        if !base.starts_with("http://") || PROXY_VARS.iter().any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()))
        {
            return None;
        }
        let base: Uri = base.parse().ok()?;
        let authority = base.authority()?;
        let addr = format!("{}:{}", authority.host(), authority.port_u16().unwrap_or(80));
        let host = HeaderValue::from_str(authority.as_str()).ok()?;
        let prefix = base.path().trim_end_matches('/');
        let uris: Vec<(&'static str, Uri)> =
            paths.iter().filter_map(|p| Some((*p, format!("{prefix}{p}").parse::<Uri>().ok()?))).collect();
        if uris.len() != paths.len() {
            return None;
        }
        Some(PlainWire { addr, host, uris, connect_timeout, idle: Arc::default() })
    }

    /// The request target of a generation path.
    pub fn uri(&self, path: &str) -> Option<&Uri> {
        self.uris.iter().find(|(p, _)| *p == path).map(|(_, u)| u)
    }

    pub async fn post(&self, uri: &Uri, mut headers: HeaderMap, payload: Bytes) -> Result<Answer, SendError> {
        headers.insert(header::HOST, self.host.clone());
        let mut req = Request::new(Full::new(payload));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        *req.headers_mut() = headers;
        loop {
            let (mut conn, reused) = match self.checkout().await {
                Some(c) => (c, true),
                None => (self.connect().await?, false),
            };
            match send(&mut conn, req).await {
                Ok(resp) => {
                    let (head, body) = resp.into_parts();
                    let body = Driven { body, conn: Some(conn), idle: self.idle.clone() };
                    return Ok(Answer { status: head.status, headers: head.headers, body: Box::pin(body) });
                }
                // A pooled connection the upstream had closed, found before
                // anything was written: the request goes on a new one.
                Err(Failed::NotSent(r, _)) if reused => req = *r,
                Err(Failed::NotSent(_, e)) => return Err(SendError::Other(error_chain(&e))),
                Err(Failed::Other(why)) => return Err(SendError::Other(why)),
            }
        }
    }

    /// An idle connection ready for a request, closing stale ones.
    async fn checkout(&self) -> Option<Conn> {
        loop {
            let (mut conn, since) = self.idle.lock().pop_back()?;
            if since.elapsed() < IDLE_TIMEOUT && ready(&mut conn).await {
                return Some(conn);
            }
        }
    }

    async fn connect(&self) -> Result<Conn, SendError> {
        let tcp = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr)).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(SendError::Connect(format!("{}: {e}", self.addr))),
            Err(_) => {
                return Err(SendError::Connect(format!(
                    "{}: no connection within {:?}",
                    self.addr, self.connect_timeout
                )))
            }
        };
        let _ = tcp.set_nodelay(true);
        let (send, driver) =
            http1::handshake(TokioIo::new(tcp)).await.map_err(|e| SendError::Connect(error_chain(&e)))?;
        Ok(Conn { send, driver: Box::pin(driver) })
    }
}

/// Whether a connection taken from the pool can carry a request: its state
/// machine is polled once (a connection the upstream closed ends there)
/// and then asked whether it takes a request. One that is neither closed
/// nor ready at once is given up rather than waited for.
async fn ready(conn: &mut Conn) -> bool {
    std::future::poll_fn(|cx| {
        if conn.driver.as_mut().poll(cx).is_ready() {
            return Poll::Ready(false);
        }
        Poll::Ready(matches!(conn.send.poll_ready(cx), Poll::Ready(Ok(()))))
    })
    .await
}

/// Why a request got no answer on a connection.
enum Failed {
    /// Nothing was written: the request comes back.
    NotSent(Box<Request<Full<Bytes>>>, hyper::Error),
    Other(String),
}

/// Sends `req` on `conn` and drives the connection until the answer's head
/// has arrived.
async fn send(conn: &mut Conn, req: Request<Full<Bytes>>) -> Result<hyper::Response<Incoming>, Failed> {
    let Conn { send, driver } = conn;
    let mut answer = std::pin::pin!(send.try_send_request(req));
    let mut closed = false;
    std::future::poll_fn(|cx| {
        loop {
            if let Poll::Ready(r) = answer.as_mut().poll(cx) {
                return Poll::Ready(r.map_err(|mut e| match e.take_message() {
                    Some(req) => Failed::NotSent(Box::new(req), e.into_error()),
                    None => Failed::Other(error_chain(e.error())),
                }));
            }
            if closed {
                return Poll::Ready(Err(Failed::Other("the connection closed before an answer came".into())));
            }
            match driver.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                // Closed: the answer's future has its error (or is polled
                // once more before giving up).
                Poll::Ready(_) => closed = true,
            }
        }
    })
    .await
}

/// An answer's body, driving its connection as it is read. The connection
/// goes back to the pool when the body has ended with the connection still
/// open; a body dropped before its end closes it (the upstream sees the
/// client go).
struct Driven {
    body: Incoming,
    conn: Option<Conn>,
    idle: Idle,
}

impl Stream for Driven {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        // The body first (it asks for more), then the connection (which
        // reads it), then the body again.
        for _ in 0..2 {
            loop {
                match Pin::new(&mut this.body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => return Poll::Ready(Some(Ok(data))),
                        Err(_trailers) => continue,
                    },
                    Poll::Ready(Some(Err(e))) => {
                        this.conn = None;
                        return Poll::Ready(Some(Err(Box::new(e))));
                    }
                    Poll::Ready(None) => {
                        if let Some(conn) = this.conn.take() {
                            release(&this.idle, conn);
                        }
                        return Poll::Ready(None);
                    }
                    Poll::Pending => break,
                }
            }
            match this.conn.as_mut().map(|c| c.driver.as_mut().poll(cx)) {
                Some(Poll::Ready(_)) => this.conn = None,
                Some(Poll::Pending) | None => {}
            }
        }
        Poll::Pending
    }
}

/// A connection whose answer was read to its end, back to the pool unless
/// the upstream is closing it.
fn release(idle: &Idle, conn: Conn) {
    if conn.send.is_closed() {
        return;
    }
    let now = Instant::now();
    let mut idle = idle.lock();
    while idle.front().is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT) {
        idle.pop_front();
    }
    if idle.len() < MAX_IDLE {
        idle.push_back((conn, now));
    }
}

/// Through the general-purpose client (TLS upstreams, proxies).
pub(super) async fn post_reqwest(
    client: &reqwest::Client,
    url: reqwest::Url,
    headers: HeaderMap,
    payload: Bytes,
) -> Result<Answer, SendError> {
    let resp =
        client.post(url).headers(headers).body(payload).send().await.map_err(|e| send_error(&e, e.is_connect()))?;
    let (status, headers) = (resp.status(), resp.headers().clone());
    let body = resp.bytes_stream().map_err(|e| Box::new(e) as BodyError);
    Ok(Answer { status, headers, body: Box::pin(body) })
}

impl Answer {
    /// The whole body, refused past `max` bytes.
    pub async fn read_all(&mut self, max: usize) -> Result<Vec<u8>, SendError> {
        use futures::StreamExt;
        let mut bytes = Vec::new();
        while let Some(chunk) = self.body.next().await {
            bytes.extend_from_slice(&chunk.map_err(|e| SendError::Other(e.to_string()))?);
            if bytes.len() > max {
                return Err(SendError::Other(format!("answer over {max} bytes")));
            }
        }
        Ok(bytes)
    }
}

/// A client's error as a [`SendError`], with its causes.
fn send_error(e: &(dyn std::error::Error + 'static), connect: bool) -> SendError {
    let why = error_chain(e);
    if connect {
        SendError::Connect(why)
    } else {
        SendError::Other(why)
    }
}

/// An error with its causes, `outer: inner: root`.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !s.contains(&c_text) {
            s.push_str(": ");
            s.push_str(&c_text);
        }
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use futures::StreamExt;

    const PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

    #[test]
    fn only_plain_http_upstreams_get_the_plain_pool() {
        let t = Duration::from_secs(1);
        assert!(PlainWire::new("https://127.0.0.1:8443", &PATHS, t).is_none(), "TLS goes through reqwest");
        let w = PlainWire::new("http://127.0.0.1:8000/base/", &PATHS, t).expect("plain HTTP");
        assert_eq!(w.uri("/v1/completions").map(|u| u.to_string()).as_deref(), Some("/base/v1/completions"));
        assert_eq!((w.addr.as_str(), w.host.to_str().unwrap()), ("127.0.0.1:8000", "127.0.0.1:8000"));
        assert!(w.uri("/v1/embeddings").is_none(), "only the generation paths are parsed ahead");
        let w = PlainWire::new("http://localhost", &PATHS, t).unwrap();
        assert_eq!((w.addr.as_str(), w.host.to_str().unwrap()), ("localhost:80", "localhost"));
    }

    /// An upstream that answers `host|authorization|body` and counts the
    /// connections it accepted; `keep_alive: false` closes each after its
    /// answer, as an upstream that does not keep connections would.
    async fn upstream(keep_alive: bool) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let h = |n: header::HeaderName| {
                        req.headers().get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
                    };
                    let (host, auth) = (h(header::HOST), h(header::AUTHORIZATION));
                    let path = req.uri().to_string();
                    let body = http_body_util::BodyExt::collect(req.into_body()).await.unwrap().to_bytes();
                    let text = format!("{host}|{auth}|{path}|{}", String::from_utf8_lossy(&body));
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(text))))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .keep_alive(keep_alive)
                        .serve_connection(TokioIo::new(tcp), service),
                );
            }
        });
        (addr, accepted)
    }

    async fn read(mut a: Answer) -> String {
        let mut got = Vec::new();
        while let Some(c) = a.body.next().await {
            got.extend_from_slice(&c.unwrap());
        }
        String::from_utf8(got).unwrap()
    }

    /// Requests reach the upstream with its `Host`, the caller's headers
    /// and the body; sequential requests share one connection; a port
    /// nothing listens on is a connect error.
    #[tokio::test]
    async fn requests_reach_the_upstream_over_one_kept_connection() {
        let (addr, accepted) = upstream(true).await;
        let w = PlainWire::new(&format!("http://{addr}/p"), &PATHS, Duration::from_secs(2)).unwrap();
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer k".parse().unwrap());
        for n in 0..5 {
            let uri = w.uri("/v1/completions").unwrap();
            let a = w.post(uri, h.clone(), Bytes::from(format!("{{\"n\":{n}}}"))).await.unwrap();
            assert_eq!(a.status, StatusCode::OK);
            assert_eq!(read(a).await, format!("{addr}|Bearer k|/p/v1/completions|{{\"n\":{n}}}"));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "five requests in a row, one connection");
        // Two at once take two connections, and both go back to the pool.
        let uri = w.uri("/v1/chat/completions").unwrap();
        let (a, b) = tokio::join!(w.post(uri, h.clone(), Bytes::from("a")), w.post(uri, h.clone(), Bytes::from("b")));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(read(b).await.ends_with("|b") && read(a).await.ends_with("|a"));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(w.idle.lock().len(), 2);
        // An answer dropped before its end closes its connection.
        let a = w.post(uri, h.clone(), Bytes::from("c")).await.unwrap();
        drop(a);
        assert_eq!(w.idle.lock().len(), 1);

        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let w = PlainWire::new(&format!("http://{free}"), &PATHS, Duration::from_secs(2)).unwrap();
        let uri = w.uri("/v1/completions").unwrap();
        match w.post(uri, HeaderMap::new(), Bytes::new()).await {
            Err(SendError::Connect(_)) => {}
            Err(e) => panic!("expected a connect error, got {e}"),
            Ok(a) => panic!("expected a connect error, got status {}", a.status),
        }
    }

    /// An upstream that closes every connection after its answer: each
    /// request still gets its answer, on a new connection, and nothing
    /// closed is kept in the pool.
    #[tokio::test]
    async fn connections_the_upstream_closes_are_not_reused() {
        let (addr, accepted) = upstream(false).await;
        let w = PlainWire::new(&format!("http://{addr}"), &PATHS, Duration::from_secs(2)).unwrap();
        let uri = w.uri("/v1/completions").unwrap();
        for n in 0..3 {
            let a = w.post(uri, HeaderMap::new(), Bytes::from(n.to_string())).await.unwrap();
            assert!(read(a).await.ends_with(&format!("|{n}")));
            // Let the close reach this side before the next request.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }
}
