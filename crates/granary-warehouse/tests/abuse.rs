//! Hostile clients against the RESP server (issue 13, point 4): ten
//! thousand idle connections and slowloris senders. The server must keep
//! serving the well-behaved client beside them, refuse connections past its
//! cap with a clear error, and close the idle and the trickling ones when
//! the idle timeout passes. (Oversized frames before AUTH, the connection
//! cap on its own and quotas are in `tests/resp.rs` and `tests/store.rs`.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use granary_warehouse::auth::Auth;
use granary_warehouse::config::ServeLimits;
use granary_warehouse::{ServerCtx, Store, StoreConfig};

const SECRET: &[u8] = b"secret";

struct Server {
    port: u16,
    ctx: Arc<ServerCtx>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Server {
    /// A RESP server with one tenant `t` (password `secret`).
    fn start(limits: ServeLimits) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (port, ctx) = rt.block_on(async {
            let store = Store::open(StoreConfig::memory_only(64 << 20)).await.unwrap();
            let auth = Auth::from_plain(None, &[("t", "secret")]);
            let ctx = Arc::new(ServerCtx::new(store, auth).with_limits(limits));
            // A backlog as deep as the system allows: ten thousand clients
            // connect faster than a loaded test machine may accept.
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let listener = socket.listen(8192).unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(granary_warehouse::resp::serve(listener, ctx.clone(), async {
                let _ = stopped.await;
            }));
            (port, ctx)
        });
        Server { port, ctx, stop: Some(stop), rt: Some(rt) }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    /// A connection that has passed AUTH.
    fn client(&self) -> TcpStream {
        let mut s = self.connect();
        expect(&mut s, &resp(&[b"AUTH", SECRET]), b"+OK\r\n");
        s
    }

    fn open_connections(&self) -> u64 {
        self.ctx.resp.snapshot().connections_open
    }

    /// Waits until the server counts `n` open connections.
    fn wait_open(&self, n: u64, within: Duration) {
        let deadline = Instant::now() + within;
        while self.open_connections() != n {
            assert!(Instant::now() < deadline, "{} connections open, waited for {n}", self.open_connections());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        v.extend_from_slice(a);
        v.extend_from_slice(b"\r\n");
    }
    v
}

/// Sends a request and reads exactly `want.len()` bytes of reply.
fn expect(s: &mut TcpStream, send: &[u8], want: &[u8]) {
    s.write_all(send).unwrap();
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want));
}

/// Reads until the peer closes; `(bytes, closed)` (`false` on a read timeout).
fn read_to_close(s: &mut TcpStream) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

/// A megabyte stored and read back on `s`: the server still does real work.
fn big_round_trip(s: &mut TcpStream, key: &[u8], seed: u8) {
    let value: Vec<u8> = (0..1 << 20).map(|i: u32| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    expect(s, &resp(&[b"SET", key, &value]), b"+OK\r\n");
    let mut want = format!("${}\r\n", value.len()).into_bytes();
    want.extend_from_slice(&value);
    want.extend_from_slice(b"\r\n");
    expect(s, &resp(&[b"GET", key]), &want);
}

/// Lets this process hold `n` more descriptors (the server's side of the
/// idle connections); the clients' side lives in a child process.
fn raise_nofile(n: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct given.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < n {
            assert!(lim.rlim_max >= n, "RLIMIT_NOFILE hard limit {} is below the {n} this test needs", lim.rlim_max);
            lim.rlim_cur = n;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
}

/// Whether `python3` runs; a missing one fails the test only in CI.
fn python_available() -> bool {
    let ok = Command::new("python3").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !ok {
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "python3 required");
        eprintln!("skipped: python3 not available");
    }
    ok
}

/// Ten thousand connections that never send a byte (and never AUTH) take
/// the server up to its cap: a well-behaved client beside them is served
/// in full, one more connection is told the cap is reached, and the idle
/// timeout closes all ten thousand while the busy client stays.
#[test]
fn ten_thousand_idle_connections() {
    const IDLE: u64 = 10_000;
    if !python_available() {
        return;
    }
    raise_nofile(IDLE + 1024);
    let idle_timeout = Duration::from_secs(6);
    let limits = ServeLimits {
        max_connections: IDLE as usize + 1,
        idle_timeout_secs: idle_timeout.as_secs(),
        ..Default::default()
    };
    let srv = Server::start(limits);

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/idle_clients.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .args([srv.port.to_string(), IDLE.to_string(), "30".into()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let t0 = Instant::now();
    let opened = lines.recv_timeout(Duration::from_secs(30)).expect("the idle clients never opened");
    assert!(opened.starts_with(&format!("open {IDLE} ")), "{opened}");
    let opened_in = t0.elapsed();
    eprintln!("{opened} (seconds), {opened_in:?} from the start");
    srv.wait_open(IDLE, Duration::from_secs(5));

    // The cap is one above the idle crowd: the busy client gets the last
    // slot, the next connection is refused with Redis's message.
    let mut busy = srv.client();
    big_round_trip(&mut busy, b"big", 1);
    let mut refused = srv.connect();
    let (got, closed) = read_to_close(&mut refused);
    assert_eq!(String::from_utf8_lossy(&got), "-ERR max number of clients reached\r\n");
    assert!(closed, "a connection past the cap was left open");

    // The busy client keeps talking through the idle timeout.
    let mut rounds = 0u8;
    let closed_line = loop {
        match lines.recv_timeout(Duration::from_millis(500)) {
            Ok(line) if line.starts_with("closed ") => break line,
            Ok(line) => assert_eq!(line, "answered 0", "the server wrote to idle connections"),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                rounds = rounds.wrapping_add(1);
                big_round_trip(&mut busy, b"big", rounds);
                assert!(t0.elapsed() < Duration::from_secs(40), "idle connections were not closed");
            }
            Err(e) => panic!("idle clients ended early: {e}"),
        }
    };
    assert!(child.wait().unwrap().success());
    let fields: Vec<&str> = closed_line.split(' ').collect();
    assert_eq!(fields[1], IDLE.to_string(), "{closed_line}: not every idle connection was closed");
    let secs: f64 = fields[2].parse().unwrap();
    assert!(secs + opened_in.as_secs_f64() >= idle_timeout.as_secs_f64() - 0.5, "closed before the timeout: {secs}s");
    eprintln!("{IDLE} idle connections opened in {opened_in:?}, all closed {secs}s later");

    srv.wait_open(1, Duration::from_secs(5));
    big_round_trip(&mut busy, b"big", 200);
    let mut again = srv.client();
    expect(&mut again, &resp(&[b"PING"]), b"+PONG\r\n");
}

/// Writes `frame` one byte every `gap` until done or the server closes;
/// returns how many bytes went out.
fn trickle(mut s: TcpStream, frame: Vec<u8>, gap: Duration, sent: Arc<AtomicUsize>) {
    for b in frame {
        if s.write_all(&[b]).is_err() {
            return;
        }
        sent.fetch_add(1, Relaxed);
        std::thread::sleep(gap);
    }
}

/// Slowloris: clients that keep a command coming one byte at a time are
/// closed by the idle timeout (which restarts on whole commands, not on
/// bytes), before AUTH and after it, while another client is served.
#[test]
fn slowloris_senders_are_closed_by_the_idle_timeout() {
    let srv = Server::start(ServeLimits { idle_timeout_secs: 1, ..Default::default() });
    let value = vec![b'v'; 200];
    let frames = [
        // Before AUTH: an AUTH command that never finishes.
        (srv.connect(), resp(&[b"AUTH", SECRET])),
        // After AUTH: a SET whose value arrives a byte at a time.
        (srv.client(), resp(&[b"SET", b"slow", &value])),
    ];
    let gap = Duration::from_millis(100);
    let mut senders = Vec::new();
    for (s, frame) in frames {
        let (len, sent) = (frame.len(), Arc::new(AtomicUsize::new(0)));
        let reader = s.try_clone().unwrap();
        let (w, c) = (s, sent.clone());
        let writer = std::thread::spawn(move || trickle(w, frame, gap, c));
        senders.push((reader, len, sent, writer));
    }
    let t0 = Instant::now();
    let mut busy = srv.client();
    let mut i = 0u8;
    while t0.elapsed() < Duration::from_millis(1500) {
        big_round_trip(&mut busy, b"busy", i);
        i = i.wrapping_add(1);
    }
    for (mut reader, len, sent, writer) in senders {
        let (got, closed) = read_to_close(&mut reader);
        assert!(closed && got.is_empty(), "a trickling client was answered or kept: {got:?}");
        let at = t0.elapsed();
        writer.join().unwrap();
        let n = sent.load(Relaxed);
        assert!(n < len, "the whole frame ({len} bytes) got through");
        assert!(at < Duration::from_secs(4), "closed only after {at:?}");
    }
    expect(&mut busy, &resp(&[b"EXISTS", b"slow"]), b":0\r\n");
    srv.wait_open(1, Duration::from_secs(3));
}

/// Issue 40: connections that never pass AUTH held their slots for as long
/// as they liked (the idle timeout is off by default, as Redis's is). Now
/// one still unauthenticated `auth_timeout_secs` after it opened is closed,
/// whether silent or sending commands it may not run, while an
/// authenticated one beside it stays open past that time.
#[test]
fn a_connection_that_never_authenticates_is_closed_after_the_auth_timeout() {
    let srv = Server::start(ServeLimits { auth_timeout_secs: 1, ..Default::default() });
    let t0 = Instant::now();
    let mut silent = srv.connect();
    let mut chatty = srv.connect();
    let mut authed = srv.client();
    srv.wait_open(3, Duration::from_secs(3));
    // The chatty one keeps sending what an unauthenticated client may.
    let mut pings = 0;
    let closed = loop {
        std::thread::sleep(Duration::from_millis(200));
        if chatty.write_all(&resp(&[b"GET", b"k"])).is_err() {
            break true;
        }
        let mut got = [0u8; 64];
        match chatty.read(&mut got) {
            Ok(0) | Err(_) => break true,
            Ok(n) => assert!(got[..n].starts_with(b"-NOAUTH"), "{}", String::from_utf8_lossy(&got[..n])),
        }
        pings += 1;
        assert!(t0.elapsed() < Duration::from_secs(5), "an unauthenticated client kept its connection");
    };
    assert!(closed && pings >= 2, "closed after {pings} commands");
    let (got, closed) = read_to_close(&mut silent);
    assert!(closed && got.is_empty(), "a silent unauthenticated connection was kept or answered: {got:?}");
    let at = t0.elapsed();
    assert!(at >= Duration::from_millis(900) && at < Duration::from_secs(5), "closed after {at:?}");
    // Past the timeout, the authenticated connection still works.
    expect(&mut authed, &resp(&[b"PING"]), b"+PONG\r\n");
    srv.wait_open(1, Duration::from_secs(3));
}

/// Issue 40: a client that sends commands and never reads their replies
/// held its connection (and the replies queued for it) forever: writes
/// had no timeout. Now a write that makes no progress for
/// `io_timeout_secs` closes the connection; the server stops running that
/// client's commands while its replies wait, so what is queued stays
/// bounded; other clients are served throughout.
#[test]
fn a_client_that_does_not_read_its_replies_is_closed_after_the_io_timeout() {
    let srv = Server::start(ServeLimits { io_timeout_secs: 1, ..Default::default() });
    let mut busy = srv.client();
    let value = vec![b'v'; 1 << 20];
    expect(&mut busy, &resp(&[b"SET", b"big", &value]), b"+OK\r\n");
    let mut deaf = srv.client();
    // 256 MiB of replies asked for, none read.
    let gets: Vec<u8> = (0..256).flat_map(|_| resp(&[b"GET", b"big"])).collect();
    deaf.write_all(&gets).unwrap();
    let t0 = Instant::now();
    let mut round = 0u8;
    while srv.open_connections() > 1 {
        assert!(t0.elapsed() < Duration::from_secs(8), "a client that reads nothing kept its connection");
        big_round_trip(&mut busy, b"other", round);
        round = round.wrapping_add(1);
    }
    eprintln!("closed {:?} after its requests, {round} round trips of another client meanwhile", t0.elapsed());
    let served = srv.ctx.resp.snapshot().bytes_written;
    assert!(served < 128 << 20, "{served} bytes written: the deaf client's replies were not held back");
}
