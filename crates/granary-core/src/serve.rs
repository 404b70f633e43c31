//! Serving an axum router with the limits every Granary HTTP server keeps
//! (the gateway's and the warehouse's own loops keep the same two):
//!
//! - a **header timeout**: a client has that long to send a request's
//!   headers, counted from when the server is ready for them (a new
//!   connection, or the end of the previous answer on a kept-alive one).
//!   A client that sends nothing, trickles its headers (slowloris) or holds
//!   an idle connection is closed, so it does not keep a slot for good;
//! - a **connection cap**: one connection past `max_connections` is
//!   answered a 503 `too_many_connections` in the OpenAI error shape and
//!   closed, before anything else is read from it.
//!
//! HTTP/1.1 and HTTP/2 (h2c, prior knowledge) are both answered, as
//! `axum::serve` answers them; the first bytes of either must arrive within
//! the header timeout. Accept errors (out of descriptors and the like)
//! back off instead of spinning.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// What one server allows its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// How long a client has to send a request's headers; `None`: no limit.
    pub header_timeout: Option<Duration>,
    /// Most connections open at once.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    /// 30 seconds and 10,000 connections (Redis's `maxclients`), as the
    /// gateway and the warehouse default to.
    fn default() -> Self {
        HttpLimits { header_timeout: Some(Duration::from_secs(30)), max_connections: 10_000 }
    }
}

impl HttpLimits {
    /// From configuration's seconds (0: no header timeout) and cap.
    pub fn new(header_timeout_s: u64, max_connections: usize) -> HttpLimits {
        HttpLimits {
            header_timeout: (header_timeout_s > 0).then(|| Duration::from_secs(header_timeout_s)),
            max_connections,
        }
    }
}

const TOO_MANY: &str = "{\"error\": {\"message\": \"max number of clients reached\", \"type\": \"server_error\", \
     \"param\": null, \"code\": \"too_many_connections\"}}\n";

/// The whole HTTP answer to a connection past the cap: a 503 with the
/// OpenAI-shaped body, `connection: close`.
pub fn too_many_connections() -> String {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n\
         retry-after: 1\r\ncontent-length: {}\r\n\r\n{TOO_MANY}",
        TOO_MANY.len()
    )
}

/// The connection cap of one listener.
#[derive(Clone)]
pub struct ConnectionCap {
    open: Arc<AtomicUsize>,
    max: usize,
}

/// One place among a listener's open connections; given back when dropped.
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl ConnectionCap {
    pub fn new(max: usize) -> ConnectionCap {
        ConnectionCap { open: Arc::new(AtomicUsize::new(0)), max }
    }

    /// A place for a connection just accepted, or `None` when all are
    /// taken: the connection is then to be dropped, the client answered
    /// the 503 first when `answer` (plain HTTP; a TLS client would read it
    /// as garbage). `try_write`: a client that never reads cannot stall
    /// the accept loop; the answer fits in an empty socket buffer.
    pub fn admit(&self, tcp: &tokio::net::TcpStream, answer: bool) -> Option<Slot> {
        if self.open.fetch_add(1, Relaxed) >= self.max {
            self.open.fetch_sub(1, Relaxed);
            if answer {
                let _ = tcp.try_write(too_many_connections().as_bytes());
            }
            return None;
        }
        Some(Slot(self.open.clone()))
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Relaxed)
    }
}

/// The next connection on `listener`. An accept error (out of descriptors
/// and the like) is logged and waited out for 50 ms instead of spinning.
pub async fn accept(listener: &TcpListener) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(x) => return x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` resolves,
/// then lets the requests in flight finish.
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let cap = ConnectionCap::new(limits.max_connections);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => break,
            x = accept(&listener) => x,
        };
        let Some(slot) = cap.admit(&tcp, true) else { continue };
        let _ = tcp.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _slot = slot;
            // hyper's protocol detection waits for the first bytes with no
            // timer: they get the header timeout here.
            if let Some(t) = limits.header_timeout {
                let mut first = [0u8; 1];
                match tokio::time::timeout(t, tcp.peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return,
                }
            }
            let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            b.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let conn = b.serve_connection_with_upgrades(TokioIo::new(tcp), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpStream;
    use std::process::{Command, Stdio};
    use std::time::Instant;

    use axum::routing::get;

    use super::*;

    /// A server on a free port in its own runtime, stopped when dropped.
    struct Server {
        port: u16,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        _rt: tokio::runtime::Runtime,
    }

    impl Server {
        fn start(limits: HttpLimits) -> Server {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let port = rt.block_on(async {
                // A backlog as deep as the system allows: ten thousand
                // clients connect faster than a loaded machine accepts.
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
                let l = socket.listen(8192).unwrap();
                let port = l.local_addr().unwrap().port();
                let app = Router::new().route("/health", get(|| async { "ok" }));
                tokio::spawn(serve_http(l, app, limits, async {
                    let _ = stopped.await;
                }));
                port
            });
            Server { port, stop: Some(stop), _rt: rt }
        }

        fn connect(&self) -> TcpStream {
            let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s
        }

        /// One `GET /health` on a new connection: the whole answer.
        fn get(&self) -> String {
            let mut s = self.connect();
            s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.stop.take().map(|s| s.send(()));
        }
    }

    /// How long until the server closes `s` (reading what it sends).
    fn closed_after(s: &mut TcpStream) -> Duration {
        let t0 = Instant::now();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return t0.elapsed(),
                Ok(_) => {}
            }
        }
    }

    /// Issue 40: a client that sends nothing and one that trickles its
    /// headers a byte at a time (slowloris) are closed once the header
    /// timeout passes, while other clients are served meanwhile.
    #[test]
    fn silent_and_slowloris_clients_are_closed_after_the_header_timeout() {
        let srv = Server::start(HttpLimits { header_timeout: Some(Duration::from_secs(1)), max_connections: 100 });
        let mut silent = srv.connect();
        let mut slow = srv.connect();
        let trickle = std::thread::spawn({
            let mut slow = slow.try_clone().unwrap();
            move || {
                for b in b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
                    if slow.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        assert!(srv.get().starts_with("HTTP/1.1 200"), "served while the slow clients wait");
        let (a, b) = (closed_after(&mut silent), closed_after(&mut slow));
        assert!(a < Duration::from_secs(3), "a silent client was held {a:?}");
        assert!(b < Duration::from_secs(3), "a slowloris was held {b:?}");
        trickle.join().unwrap();
    }

    /// Issue 40: 10,000 idle connections (from another process, so that
    /// their descriptors do not count here) leave room for a client under
    /// the cap, the one past it is answered 503 `too_many_connections` and
    /// closed, and the idle ones are closed by the header timeout, after
    /// which clients are served again.
    #[test]
    fn ten_thousand_idle_connections_neither_lock_others_out_nor_stay() {
        const IDLE: usize = 10_000;
        // This process holds the server's end of every connection.
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        if (lim.rlim_max as usize) < IDLE + 200 {
            panic!("this test needs {} descriptors; the hard limit is {}", IDLE + 200, lim.rlim_max);
        }
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
        let srv = Server::start(HttpLimits { header_timeout: Some(Duration::from_secs(5)), max_connections: IDLE + 1 });
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../granary-warehouse/tests/python/idle_clients.py");
        let mut child = Command::new("python3")
            .args([script, &srv.port.to_string(), &IDLE.to_string(), "30"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs the idle clients");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok);
        let opened = lines.next().expect("the idle clients never opened");
        assert!(opened.starts_with(&format!("open {IDLE} ")), "{opened}");
        eprintln!("{opened} (seconds)");
        // One place is left: a client gets it.
        let mut held = srv.connect();
        held.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        let mut first = [0u8; 12];
        held.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        // The next is refused, in the OpenAI error shape, and closed.
        let refused = srv.get();
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        assert!(refused.contains("\"code\": \"too_many_connections\""), "{refused}");
        drop(held);
        let answered = lines.next().unwrap();
        let closed = lines.next().unwrap();
        assert_eq!(answered, "answered 0", "the idle clients were sent something");
        let secs: f64 = closed.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(closed.starts_with(&format!("closed {IDLE} ")) && secs < 15.0, "{closed}");
        child.wait().unwrap();
        let t0 = Instant::now();
        while !srv.get().starts_with("HTTP/1.1 200") {
            assert!(t0.elapsed() < Duration::from_secs(5), "not served after the idle clients went");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
