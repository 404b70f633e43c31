//! The RESP server against real clients: `redis-cli`, `redis-benchmark`,
//! redis-py (scripts in `tests/python/`), and raw sockets for what no
//! client would send. Missing external tools skip their test unless
//! `GRANARY_REQUIRE_EXTERNAL=1`, which turns a missing tool into a failure.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use granary_warehouse::auth::Auth;
use granary_warehouse::config::ServeLimits;
use granary_warehouse::{ServerCtx, Store, StoreConfig};

mod differential;
mod linearizable;
mod reference;
mod slow_tier;

struct Server {
    port: u16,
    ctx: Arc<ServerCtx>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Server {
    fn start(auth: Auth) -> Server {
        Self::start_with(StoreConfig::memory_only(256 << 20), auth)
    }

    fn start_with(cfg: StoreConfig, auth: Auth) -> Server {
        Self::start_limited(cfg, auth, ServeLimits::default())
    }

    fn start_limited(cfg: StoreConfig, auth: Auth, limits: ServeLimits) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (port, ctx) = rt.block_on(async {
            // Opened, so that configured lower tiers exist.
            let store = Store::open(cfg).await.unwrap();
            let ctx = Arc::new(ServerCtx::new(store, auth).with_limits(limits));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(granary_warehouse::resp::serve(listener, ctx.clone(), async {
                let _ = stopped.await;
            }));
            (port, ctx)
        });
        Server { port, ctx, stop: Some(stop), rt: Some(rt) }
    }

    /// A store whose memory tier holds only a few values, over a small disk
    /// tier and a remote tier (a `file://` directory) under `root`: values
    /// move between tiers all the time.
    fn tiered(root: &std::path::Path, offload: granary_warehouse::config::OffloadMode) -> StoreConfig {
        use granary_core::ByteSize;
        use granary_warehouse::config::{DiskConfig, RemoteConfig};
        let remote = root.join("remote");
        std::fs::create_dir_all(&remote).unwrap();
        StoreConfig {
            memory: ByteSize::kib(24),
            disk: Some(DiskConfig {
                dir: root.join("disk"),
                capacity: ByteSize::kib(48),
                policy: granary_warehouse::PolicyKind::Lru,
            }),
            remote: Some(RemoteConfig {
                url: url::Url::from_directory_path(&remote).unwrap().to_string(),
                options: Default::default(),
            }),
            offload,
            ..Default::default()
        }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn get(&self, ns: &str, key: &[u8]) -> Option<Vec<u8>> {
        let store = self.ctx.store.clone();
        let (ns, key) = (ns.to_string(), key.to_vec());
        self.rt.as_ref().unwrap().block_on(async move { store.get(&ns, &key).await.unwrap().map(|h| h.value.to_vec()) })
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

/// Whether an external program works; a missing one fails the test only in CI.
fn available(program: &str, args: &[&str]) -> bool {
    let ok = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") {
            panic!("{program} {args:?} is required (GRANARY_REQUIRE_EXTERNAL=1) but does not work");
        }
        eprintln!("skipped: {program} not available");
    }
    ok
}

fn cli(port: u16, args: &[&[u8]]) -> String {
    cli_stdin(port, args, None)
}

fn cli_stdin(port: u16, args: &[&[u8]], stdin: Option<&[u8]>) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-p", &port.to_string()]);
    for a in args {
        cmd.arg(std::ffi::OsStr::from_bytes(a));
    }
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "redis-cli {:?} failed: {}", args, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim_end().to_string()
}

/// Sends raw bytes and reads until `expect` replies' worth of bytes have arrived or the peer closes.
fn roundtrip(s: &mut TcpStream, send: &[u8], want_len: usize) -> Vec<u8> {
    s.write_all(send).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while got.len() < want_len {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("read failed after {} bytes: {e}", got.len()),
        }
    }
    got
}

/// Sends a request and asserts the exact reply bytes.
fn expect(s: &mut TcpStream, send: &[u8], want: &[u8]) {
    let got = roundtrip(s, send, want.len());
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want));
}

/// Sends a request and reads replies until they end with `suffix`.
fn read_until(s: &mut TcpStream, send: &[u8], suffix: &[u8]) -> Vec<u8> {
    s.write_all(send).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while !got.ends_with(suffix) {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("read failed after {} bytes: {e}", got.len()),
        }
    }
    got
}

/// Reads until the peer closes; whether it closed within the read timeout.
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

fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        v.extend_from_slice(a);
        v.extend_from_slice(b"\r\n");
    }
    v
}

#[test]
fn redis_cli_commands() {
    if !available("redis-cli", &["--version"]) {
        return;
    }
    let srv = Server::start(Auth::default());
    let p = srv.port;
    assert_eq!(cli(p, &[b"PING"]), "PONG");
    assert_eq!(cli(p, &[b"SET", b"greeting", b"hello world"]), "OK");
    assert_eq!(cli(p, &[b"GET", b"greeting"]), "hello world");
    assert_eq!(cli(p, &[b"EXISTS", b"greeting", b"nope"]), "1");
    assert_eq!(cli(p, &[b"TTL", b"greeting"]), "-1");
    assert_eq!(cli(p, &[b"TTL", b"nope"]), "-2");
    assert_eq!(cli(p, &[b"SET", b"temp", b"v", b"EX", b"100"]), "OK");
    let ttl: i64 = cli(p, &[b"TTL", b"temp"]).parse().unwrap();
    assert!((99..=100).contains(&ttl), "ttl {ttl}");
    assert_eq!(cli(p, &[b"DEL", b"greeting", b"nope"]), "1");
    assert_eq!(cli(p, &[b"GET", b"greeting"]), "");
    assert_eq!(srv.get("default", b"greeting"), None);
    assert!(cli(p, &[b"FOO", b"bar"]).contains("unknown command 'FOO', with args beginning with: 'bar'"));

    // Non-UTF-8 key from argv, binary value (with NULs) from stdin via -x.
    let key: &[u8] = b"k\xff\xfe\x80";
    let value: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    assert_eq!(cli_stdin(p, &[b"-x", b"SET", key], Some(&value)), "OK");
    assert_eq!(srv.get("default", key).as_deref(), Some(&value[..]));
    assert_eq!(cli(p, &[b"STRLEN", key]), "70000");

    for i in 0..30 {
        cli(p, &[b"SET", format!("scan:{i}").as_bytes(), b"1"]);
    }
    let mut keys: Vec<String> = cli(p, &[b"--scan", b"--pattern", b"scan:1*"]).lines().map(String::from).collect();
    keys.sort();
    let mut want: Vec<String> = std::iter::once(1).chain(10..20).map(|i| format!("scan:{i}")).collect();
    want.sort();
    assert_eq!(keys, want);
    let n: u64 = cli(p, &[b"DBSIZE"]).parse().unwrap();
    assert_eq!(n, 32);
    let info = cli(p, &[b"INFO", b"keyspace"]);
    assert!(info.contains("db0:keys=32,expires=0,avg_ttl=0"), "{info}");
    assert!(cli(p, &[b"INFO"]).contains("redis_version:7.2.0"));
    // valkey-glide finds a standalone server's primary by this line.
    assert!(cli(p, &[b"INFO", b"replication"]).contains("role:master"));
    assert!(srv.ctx.resp.snapshot().requests_ok > 40);
}

#[test]
fn redis_benchmark_runs_against_the_server() {
    if !available("redis-benchmark", &["--version"]) {
        return;
    }
    let srv = Server::start(Auth::default());
    let out = Command::new("redis-benchmark")
        .args(["-p", &srv.port.to_string(), "-t", "set,get", "-n", "20000", "-c", "16", "-P", "8", "-q"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    assert!(out.status.success(), "redis-benchmark failed: {}", String::from_utf8_lossy(&out.stderr));
    for t in ["SET", "GET"] {
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with(&format!("{t}:")) && l.contains("requests per second"))
            .unwrap_or_else(|| panic!("no {t} result in {text}"));
        let rps: f64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no number in {line:?}"));
        assert!(rps > 0.0, "{line}");
    }
    // redis-benchmark writes its default 3-byte value to one fixed key.
    assert_eq!(srv.get("default", b"key:__rand_int__").map(|v| v.len()), Some(3));
    let snap = srv.ctx.resp.snapshot();
    assert!(snap.requests_ok >= 40_000, "{snap:?}");
    assert_eq!(snap.protocol_errors, 0);
}

fn python(script: &str, port: u16) {
    if !available("python3", &["-c", "import redis"]) {
        return;
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(script);
    let out = Command::new("python3").arg(&path).arg(port.to_string()).output().unwrap();
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn python_redis_client() {
    let srv = Server::start(Auth::default());
    python("basic.py", srv.port);
}

#[test]
fn python_namespaces_and_auth() {
    let srv = Server::start(Auth::from_plain(Some("root"), &[("t1", "s1"), ("t2", "s2")]));
    python("auth.py", srv.port);
    if srv.ctx.resp.snapshot().requests_ok > 0 {
        assert_eq!(srv.get("t1", b"shared-name"), None, "admin FLUSHDB emptied t1");
        assert_eq!(srv.get("t2", b"shared-name").as_deref(), Some(&b"from-t2"[..]));
    }
}

#[test]
fn raw_auth_errors() {
    let srv = Server::start(Auth::from_plain(None, &[("t1", "s1")]));
    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"GET", b"k"]), b"-NOAUTH Authentication required.\r\n");
    expect(&mut s, &resp(&[b"AUTH", b"bad"]), b"-WRONGPASS invalid username-password pair or user is disabled.\r\n");
    expect(
        &mut s,
        &resp(&[b"AUTH", b"t2", b"s1"]),
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    );
    expect(&mut s, &resp(&[b"GET", b"k"]), b"-NOAUTH Authentication required.\r\n");
    expect(&mut s, &resp(&[b"AUTH", b"t1", b"s1"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"GET", b"k"]), b"$-1\r\n");
    expect(
        &mut s,
        &resp(&[b"NAMESPACE", b"other"]),
        b"-NOPERM this user has no permissions to access namespace 'other'\r\n",
    );
}

#[test]
fn malformed_frame_closes_only_that_connection() {
    let srv = Server::start(Auth::default());
    let mut good = srv.connect();
    expect(&mut good, &resp(&[b"SET", b"a", b"1"]), b"+OK\r\n");
    let mut bad = srv.connect();
    bad.write_all(b"*2\r\n$3\r\nGET\r\n+oops\r\n").unwrap();
    let (got, closed) = read_to_close(&mut bad);
    assert!(closed, "connection must be closed after a protocol error");
    assert_eq!(got, b"-ERR Protocol error: expected '$', got '+'\r\n");
    expect(&mut good, &resp(&[b"GET", b"a"]), b"$1\r\n1\r\n");
    assert_eq!(srv.ctx.resp.snapshot().protocol_errors, 1);

    // A bulk longer than the store accepts is refused before it is read.
    let srv = Server::start_with(
        StoreConfig { max_value: granary_core::ByteSize::kib(64), ..StoreConfig::memory_only(1 << 20) },
        Auth::default(),
    );
    let mut s = srv.connect();
    s.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$999999999\r\n").unwrap();
    let (got, closed) = read_to_close(&mut s);
    assert!(closed);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("-ERR Protocol error: bulk of 999999999 bytes exceeds the limit"), "{text}");
    // A value over the store's limit but within the framing slack is a command error, not a protocol one.
    let mut s = srv.connect();
    let big = vec![b'v'; 64 * 1024 + 1];
    let got = read_until(&mut s, &resp(&[b"SET", b"k", &big]), b"\r\n");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("-ERR value too large: value of 65537 bytes exceeds the limit of 65536 bytes"), "{text}");
    expect(&mut s, &resp(&[b"PING"]), b"+PONG\r\n");
}

#[test]
fn disconnect_mid_value_stores_nothing() {
    let srv = Server::start(Auth::default());
    let mut s = srv.connect();
    let mut frame = resp(&[b"SET", b"half", &vec![b'z'; 1 << 20]]);
    frame.truncate(frame.len() / 2);
    s.write_all(&frame).unwrap();
    drop(s);
    // And one cut just before the closing CRLF.
    let mut s = srv.connect();
    let mut frame = resp(&[b"SET", b"almost", b"value"]);
    frame.truncate(frame.len() - 2);
    s.write_all(&frame).unwrap();
    drop(s);
    let mut c = srv.connect();
    expect(&mut c, &resp(&[b"EXISTS", b"half", b"almost"]), b":0\r\n");
    for _ in 0..100 {
        if srv.ctx.resp.connections_open.load(Relaxed) == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(srv.ctx.resp.connections_open.load(Relaxed), 1, "cut connections must be closed");
    assert_eq!(srv.get("default", b"half"), None);
}

#[test]
fn unknown_command_and_arity_errors() {
    let srv = Server::start(Auth::default());
    let mut s = srv.connect();
    let want = b"-ERR unknown command 'BOGUS', with args beginning with: 'x' 'y' \r\n";
    expect(&mut s, &resp(&[b"BOGUS", b"x", b"y"]), want);
    let want = b"-ERR wrong number of arguments for 'get' command\r\n";
    expect(&mut s, &resp(&[b"get"]), want);
    let want = b"-ERR syntax error\r\n";
    expect(&mut s, &resp(&[b"SET", b"k", b"v", b"NX", b"XX"]), want);
    let want = b"-NOPERM this user has no permissions to run the 'flushdb' command\r\n";
    expect(&mut s, &resp(&[b"FLUSHDB"]), want);
    // Inline commands work too.
    expect(&mut s, b"PING\r\n", b"+PONG\r\n");
    expect(&mut s, b"ECHO \"a b\"\r\n", b"$3\r\na b\r\n");
    assert_eq!(srv.ctx.resp.snapshot().protocol_errors, 0);
}

#[test]
fn pipelined_commands_are_answered_in_order() {
    let srv = Server::start(Auth::default());
    let mut s = srv.connect();
    let mut batch = Vec::new();
    let mut want = Vec::new();
    for i in 0..1000 {
        let v = format!("value-{i}");
        if i % 2 == 0 {
            batch.extend(resp(&[b"SET", format!("p{i}").as_bytes(), v.as_bytes()]));
            want.extend_from_slice(b"+OK\r\n");
        } else {
            batch.extend(resp(&[b"GET", format!("p{}", i - 1).as_bytes()]));
            let prev = format!("value-{}", i - 1);
            want.extend(format!("${}\r\n{prev}\r\n", prev.len()).into_bytes());
        }
    }
    let got = roundtrip(&mut s, &batch, want.len());
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want));
}

#[test]
fn resp3_nulls_and_waitaof() {
    let srv = Server::start(Auth::default());
    let mut s = srv.connect();
    let mut both = resp(&[b"HELLO", b"3"]);
    both.extend(resp(&[b"PING"]));
    let hello = read_until(&mut s, &both, b"+PONG\r\n");
    let text = String::from_utf8_lossy(&hello);
    assert!(text.starts_with("%7\r\n$6\r\nserver\r\n$5\r\nredis\r\n"), "{text}");
    assert!(text.contains("$5\r\nproto\r\n:3\r\n"), "{text}");
    expect(&mut s, &resp(&[b"GET", b"nothing"]), b"_\r\n");
    // Memory only: nothing is durable, and WAITAOF says so.
    expect(&mut s, &resp(&[b"WAITAOF", b"1", b"0", b"100"]), b"*2\r\n:0\r\n:0\r\n");
    expect(&mut s, &resp(&[b"HELLO", b"4"]), b"-NOPROTO unsupported protocol version\r\n");
}

#[test]
fn large_values_round_trip_intact() {
    let srv = Server::start(Auth::default());
    let mut s = srv.connect();
    let value: Vec<u8> = (0..4 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    expect(&mut s, &resp(&[b"SET", b"big", &value]), b"+OK\r\n");
    let mut want = format!("${}\r\n", value.len()).into_bytes();
    want.extend_from_slice(&value);
    want.extend_from_slice(b"\r\n");
    let got = roundtrip(&mut s, &resp(&[b"GET", b"big"]), want.len());
    assert!(got == want, "4 MiB value changed in transit");
}

#[test]
fn shutdown_stops_the_server_and_closes_connections() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ctx = Arc::new(ServerCtx::new(Store::memory_only(1 << 20), Auth::default()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(granary_warehouse::resp::serve(listener, ctx.clone(), async {
            let _ = stopped.await;
        }));
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"PING\r\n").await.unwrap();
        let mut buf = [0u8; 7];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"+PONG\r\n");
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server).await.expect("serve must return").unwrap().unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0, "open connections are closed on shutdown");
        assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "listener must be closed");
        assert_eq!(ctx.resp.connections_open.load(Relaxed), 0);
    });
}

/// Issue 13: WAITAOF answers 1 only when the writes so far are synced on
/// the disk tier.
#[test]
fn waitaof_counts_only_a_synced_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::memory_only(1 << 20);
    cfg.disk = Some(granary_warehouse::config::DiskConfig {
        dir: dir.path().to_path_buf(),
        capacity: granary_core::ByteSize::mib(16),
        policy: granary_warehouse::PolicyKind::Lru,
    });
    let srv = Server::start_with(cfg.clone(), Auth::default());
    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"SET", b"k", b"v"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"WAITAOF", b"1", b"0", b"1000"]), b"*2\r\n:1\r\n:0\r\n");
    drop(srv);
    // Write-back mode: writes stay in memory, so WAITAOF cannot claim them.
    let dir2 = tempfile::tempdir().unwrap();
    cfg.offload = granary_warehouse::OffloadMode::Evicted;
    cfg.disk.as_mut().unwrap().dir = dir2.path().to_path_buf();
    let srv = Server::start_with(cfg, Auth::default());
    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"SET", b"k", b"v"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"WAITAOF", b"1", b"0", b"1000"]), b"*2\r\n:0\r\n:0\r\n");
}

/// Issue 13: a value no tier can hold is refused with Redis's OOM error.
#[test]
fn a_value_no_tier_can_hold_gets_oom() {
    let srv = Server::start_with(StoreConfig::memory_only(1000), Auth::default());
    let mut s = srv.connect();
    let big = vec![b'x'; 5000];
    let got = read_until(&mut s, &resp(&[b"SET", b"big", &big]), b"\r\n");
    assert!(got.starts_with(b"-OOM "), "{}", String::from_utf8_lossy(&got));
    expect(&mut s, &resp(&[b"GET", b"big"]), b"$-1\r\n");
    // A refused write leaves the key's old value alone, as in Redis.
    expect(&mut s, &resp(&[b"SET", b"k", b"old"]), b"+OK\r\n");
    let got = read_until(&mut s, &resp(&[b"SET", b"k", &big]), b"\r\n");
    assert!(got.starts_with(b"-OOM "), "{}", String::from_utf8_lossy(&got));
    expect(&mut s, &resp(&[b"GET", b"k"]), b"$3\r\nold\r\n");
}

/// Issue 13: before AUTH, a client on a server with tokens may send only
/// small commands (Redis: 10 arguments, 16 KiB); more is an error and a
/// closed connection. After AUTH the usual limits apply.
#[test]
fn unauthenticated_clients_are_limited_like_redis() {
    let srv = Server::start(Auth::from_plain(None, &[("a", "secret")]));
    let args: Vec<&[u8]> = vec![b"x"; 11];
    let mut s = srv.connect();
    s.write_all(&resp(&args)).unwrap();
    let (got, closed) = read_to_close(&mut s);
    assert!(got.starts_with(b"-ERR Protocol error: too many arguments"), "{}", String::from_utf8_lossy(&got));
    assert!(closed, "connection left open");

    let big = vec![b'v'; 20 * 1024];
    let mut s = srv.connect();
    // Only the header: the server must refuse without waiting for the bytes.
    s.write_all(format!("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n${}\r\n", 1 << 30).as_bytes()).unwrap();
    let (got, closed) = read_to_close(&mut s);
    assert!(got.starts_with(b"-ERR Protocol error: bulk of"), "{}", String::from_utf8_lossy(&got));
    assert!(closed, "connection left open");

    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"AUTH", b"secret"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"SET", b"k", &big]), b"+OK\r\n");
    let many: Vec<&[u8]> = std::iter::once(&b"DEL"[..]).chain(std::iter::repeat_n(&b"k"[..], 20)).collect();
    expect(&mut s, &resp(&many), b":1\r\n");
}

/// Issue 13: past `max_connections` a client is told so and closed; a
/// connection idle past `idle_timeout_secs` is closed.
#[test]
fn connection_cap_and_idle_timeout() {
    let limits = ServeLimits { max_connections: 2, idle_timeout_secs: 1, ..Default::default() };
    let srv = Server::start_limited(StoreConfig::memory_only(1 << 20), Auth::default(), limits);
    let mut a = srv.connect();
    let mut b = srv.connect();
    expect(&mut a, &resp(&[b"PING"]), b"+PONG\r\n");
    expect(&mut b, &resp(&[b"PING"]), b"+PONG\r\n");
    let mut c = srv.connect();
    let (got, closed) = read_to_close(&mut c);
    assert_eq!(String::from_utf8_lossy(&got), "-ERR max number of clients reached\r\n");
    assert!(closed);
    // `a` keeps talking for a while; `b` stays silent and is closed.
    let t = std::time::Instant::now();
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(400));
        expect(&mut a, &resp(&[b"PING"]), b"+PONG\r\n");
    }
    let (_, closed) = read_to_close(&mut b);
    assert!(closed && t.elapsed() < Duration::from_secs(5), "idle connection not closed");
    // A slot is free again.
    let mut d = srv.connect();
    expect(&mut d, &resp(&[b"PING"]), b"+PONG\r\n");
}

#[test]
fn python_transactions_keys_getex_and_clients() {
    let srv = Server::start(Auth::default());
    python("compat.py", srv.port);
}

#[test]
fn multi_exec_raw_replies() {
    let srv = Server::start(Auth::from_plain(Some("root"), &[("t1", "s1")]));
    let mut s = srv.connect();
    // Before AUTH, MULTI is refused like any data command.
    expect(&mut s, &resp(&[b"MULTI"]), b"-NOAUTH Authentication required.\r\n");
    expect(&mut s, &resp(&[b"AUTH", b"t1", b"s1"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"MULTI"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"SET", b"k", b"v"]), b"+QUEUED\r\n");
    expect(&mut s, &resp(&[b"GET", b"k"]), b"+QUEUED\r\n");
    expect(&mut s, &resp(&[b"MULTI"]), b"-ERR MULTI calls can not be nested\r\n");
    expect(&mut s, &resp(&[b"EXEC"]), b"*2\r\n+OK\r\n$1\r\nv\r\n");
    // A queueing error (arity, admin-only) dooms the transaction.
    expect(&mut s, &resp(&[b"MULTI"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"SET", b"k2", b"v"]), b"+QUEUED\r\n");
    expect(&mut s, &resp(&[b"GET"]), b"-ERR wrong number of arguments for 'get' command\r\n");
    expect(&mut s, &resp(&[b"FLUSHALL"]), b"-NOPERM this user has no permissions to run the 'flushall' command\r\n");
    expect(&mut s, &resp(&[b"EXEC"]), b"-EXECABORT Transaction discarded because of previous errors.\r\n");
    expect(&mut s, &resp(&[b"EXISTS", b"k2"]), b":0\r\n");
    // Runtime errors answer in their slot.
    expect(&mut s, &resp(&[b"MULTI"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"EXPIRE", b"k", b"x"]), b"+QUEUED\r\n");
    expect(&mut s, &resp(&[b"DEL", b"k"]), b"+QUEUED\r\n");
    expect(&mut s, &resp(&[b"EXEC"]), b"*2\r\n-ERR value is not an integer or out of range\r\n:1\r\n");
    // WATCH inside MULTI aborts; outside it is refused clearly.
    expect(&mut s, &resp(&[b"MULTI"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"WATCH", b"k"]), b"-ERR Command not allowed inside a transaction\r\n");
    expect(&mut s, &resp(&[b"DISCARD"]), b"+OK\r\n");
    let r = read_until(&mut s, &resp(&[b"WATCH", b"k"]), b"\r\n");
    assert!(r.starts_with(b"-ERR WATCH is not supported"), "{}", String::from_utf8_lossy(&r));
    expect(&mut s, &resp(&[b"UNWATCH"]), b"+OK\r\n");
    // Pipelined transaction in one write.
    let mut batch = resp(&[b"MULTI"]);
    batch.extend(resp(&[b"SET", b"p", b"1"]));
    batch.extend(resp(&[b"GETEX", b"p", b"EX", b"100"]));
    batch.extend(resp(&[b"TTL", b"p"]));
    batch.extend(resp(&[b"EXEC"]));
    expect(&mut s, &batch, b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n*3\r\n+OK\r\n$1\r\n1\r\n:100\r\n");
    // Multi-key commands run their keys concurrently; a key given twice
    // still ends as Redis leaves it.
    for _ in 0..20 {
        expect(&mut s, &resp(&[b"MSET", b"d", b"1", b"e", b"x", b"d", b"2", b"d", b"3"]), b"+OK\r\n");
        expect(&mut s, &resp(&[b"GET", b"d"]), b"$1\r\n3\r\n");
        expect(&mut s, &resp(&[b"EXISTS", b"d", b"d", b"nope", b"e"]), b":3\r\n");
        expect(&mut s, &resp(&[b"DEL", b"d", b"d", b"e"]), b":2\r\n");
    }
}

#[test]
fn keys_is_namespace_scoped_and_bounded() {
    let srv = Server::start(Auth::from_plain(Some("root"), &[("t1", "s1"), ("t2", "s2")]));
    let store = srv.ctx.store.clone();
    srv.rt.as_ref().unwrap().block_on(async {
        for i in 0..5 {
            store.put("t1", format!("a{i}").into(), "v".into(), Default::default()).await.unwrap();
        }
        store.put("t2", "a9".into(), "v".into(), Default::default()).await.unwrap();
        for i in 0..=granary_warehouse::resp::commands::KEYS_LIMIT {
            store.put("big", format!("k{i}").into(), "v".into(), Default::default()).await.unwrap();
        }
    });
    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"AUTH", b"t2", b"s2"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"KEYS", b"a*"]), b"*1\r\n$2\r\na9\r\n");
    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"AUTH", b"root"]), b"+OK\r\n");
    expect(&mut s, &resp(&[b"NAMESPACE", b"big"]), b"+OK\r\n");
    let r = read_until(&mut s, &resp(&[b"KEYS", b"k1"]), b"\r\n");
    assert!(r.starts_with(b"-ERR KEYS refused"), "{}", String::from_utf8_lossy(&r));
}

#[test]
fn tenant_info_shows_only_its_namespace() {
    let srv = Server::start(Auth::from_plain(Some("root"), &[("t1", "s1"), ("t2", "s2")]));
    let store = srv.ctx.store.clone();
    srv.rt.as_ref().unwrap().block_on(async {
        for i in 0..50 {
            store.put("t2", format!("k{i}").into(), vec![0u8; 1000].into(), Default::default()).await.unwrap();
        }
        store.put("t1", "mine".into(), "v".into(), Default::default()).await.unwrap();
    });
    let (_other, _again) = (srv.connect(), srv.connect());
    let mut s = srv.connect();
    expect(&mut s, &resp(&[b"AUTH", b"t1", b"s1"]), b"+OK\r\n");
    let text = String::from_utf8(read_until(&mut s, &resp(&[b"INFO"]), b"avg_ttl=0\r\n\r\n")).unwrap();
    for global in ["process_id", "total_connections_received", "keyspace_hits", "evicted_keys", "offload_", "os:"] {
        assert!(!text.contains(global), "tenant INFO shows {global}:\n{text}");
    }
    assert!(text.contains("connected_clients:1\r\n"), "{text}");
    assert!(text.contains("db0:keys=1,"), "{text}");
    let used: u64 = text.split("used_memory:").nth(1).unwrap().split("\r\n").next().unwrap().parse().unwrap();
    assert!(used > 0 && used < 1000, "t1's memory, not the store's: {used}");
    assert!(text.contains("tier_memory:bytes="), "{text}");
    // The admin sees the server.
    let mut a = srv.connect();
    expect(&mut a, &resp(&[b"AUTH", b"root"]), b"+OK\r\n");
    let text = String::from_utf8(read_until(&mut a, &resp(&[b"INFO", b"server"]), b"\r\n\r\n")).unwrap();
    assert!(text.contains("process_id:"), "{text}");
}

/// Issue 40: TTLs out of range are refused as Redis refuses them. Before,
/// `SET k v EX 9223372036854775807` answered OK and stored nothing (the
/// TTL was cast and added unchecked; a debug build panicked in the
/// connection task). Compared reply by reply with a real redis-server.
#[test]
fn out_of_range_expiries_are_refused_as_redis_refuses_them() {
    let Some(redis) = reference::Redis::start() else { return };
    let srv = Server::start(Auth::default());
    let max = i64::MAX.to_string();
    let just_under = (i64::MAX / 1000).to_string();
    let lines: Vec<String> = [
        "SET k v EX MAX",
        "GET k",
        "SET k v PX MAX",
        "GET k",
        "SET k v EX UNDER",
        "GET k",
        "SET k v EXAT MAX",
        "SET k v EX 0",
        "SET k v PX -5",
        "SETEX k MAX v",
        "PSETEX k MAX v",
        "GET k",
        "SET k v PXAT MAX",
        "GET k",
        "SET k v",
        "EXPIRE k MAX",
        "EXPIRE k UNDER",
        "PEXPIRE k MAX",
        "GETEX k EX MAX",
        "GETEX k PX MAX",
        "TTL k",
        "EXPIREAT k MAX",
        "GET k",
        "EXPIRE nokey UNDER",
        "EXPIRE nokey 100",
        "SET k v EX 100",
        "TTL k",
    ]
    .iter()
    .map(|l| l.replace("UNDER", &just_under).replace("MAX", &max))
    .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let diffs = reference::differences(srv.port, redis.port, &reference::script(&lines));
    assert!(diffs.is_empty(), "replies that differ from redis-server's:\n{}", diffs.join("\n"));
}

/// One bulk-string reply: `None` for the nil bulk.
fn read_bulk(r: &mut std::io::BufReader<TcpStream>) -> Option<Vec<u8>> {
    use std::io::BufRead;
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with('$'), "not a bulk reply: {line:?}");
    let n: i64 = line[1..].trim_end().parse().unwrap();
    if n < 0 {
        return None;
    }
    let mut v = vec![0u8; n as usize + 2];
    r.read_exact(&mut v).unwrap();
    v.truncate(n as usize);
    Some(v)
}

/// `SET … GET` read the old value, then wrote: two clients could both get
/// the same old value (one of the writes it answered was lost to both),
/// which Redis, running each command alone, never does. Four clients
/// chain `SET k v GET` on one key of a tiered store (values move between
/// tiers, so reads take time): every value written is handed back as the
/// old value exactly once, except the last, which the key holds.
#[test]
fn concurrent_set_get_hands_each_old_value_back_once() {
    let dir = tempfile::tempdir().unwrap();
    let srv = Server::start_with(
        Server::tiered(dir.path(), granary_warehouse::config::OffloadMode::Evicted),
        Auth::default(),
    );
    // Filler keys keep the tiny memory tier evicting, the key included.
    let filler = vec![b'f'; 2048];
    let mut c = srv.connect();
    for i in 0..40 {
        expect(&mut c, &resp(&[b"SET", format!("fill{i}").as_bytes(), &filler]), b"+OK\r\n");
    }
    const CLIENTS: usize = 4;
    const EACH: usize = 150;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|t| {
            let s = srv.connect();
            std::thread::spawn(move || {
                let mut w = s.try_clone().unwrap();
                let mut r = std::io::BufReader::new(s);
                let mut olds = Vec::new();
                for i in 0..EACH {
                    let v = format!("{t}-{i}-{}", "x".repeat(1500));
                    w.write_all(&resp(&[b"SET", b"k", v.as_bytes(), b"GET"])).unwrap();
                    olds.push(read_bulk(&mut r));
                    // Something else moves through memory between writes.
                    let f = format!("fill{}", (t * EACH + i) % 40);
                    w.write_all(&resp(&[b"SET", f.as_bytes(), b"y"])).unwrap();
                    let mut ok = [0u8; 5];
                    r.read_exact(&mut ok).unwrap();
                }
                olds
            })
        })
        .collect();
    let olds: Vec<Option<Vec<u8>>> = clients.into_iter().flat_map(|h| h.join().unwrap()).collect();
    check_set_get_chain(&srv, olds);
}

/// Every old value handed back once, the last write held, one nil.
fn check_set_get_chain(srv: &Server, olds: Vec<Option<Vec<u8>>>) {
    let last = srv.get("default", b"k").expect("the key holds the last write");
    let nils = olds.iter().filter(|o| o.is_none()).count();
    let mut seen = std::collections::HashMap::<Vec<u8>, usize>::new();
    for o in olds.iter().flatten() {
        *seen.entry(o.clone()).or_default() += 1;
    }
    let twice: Vec<String> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(v, n)| format!("{}x{n}", String::from_utf8_lossy(&v[..8])))
        .collect();
    assert!(twice.is_empty(), "old values handed back more than once: {twice:?}");
    assert_eq!(nils, 1, "only the first write finds the key absent");
    assert!(!seen.contains_key(&last), "the value the key holds was also handed back as replaced");
    assert_eq!(seen.len() + 1, olds.len(), "every write but the last is some later write's old value");
}

/// Conditional `EXPIRE` read the TTL, then set the new one: `EXPIRE k 1000
/// GT` could check against the old TTL while another client's `EXPIRE k
/// 5000` landed, then overwrite it with the shorter one, which no order of
/// the two commands gives (either GT runs first and is overwritten, or it
/// runs second and is refused). Raced 200 times on a tiered store: the key
/// ends with the longer TTL every time.
#[test]
fn a_conditional_expire_racing_another_never_shortens_what_it_must_not() {
    let dir = tempfile::tempdir().unwrap();
    let srv = Server::start_with(
        Server::tiered(dir.path(), granary_warehouse::config::OffloadMode::Evicted),
        Auth::default(),
    );
    let mut c = srv.connect();
    let (mut a, mut b) = (srv.connect(), srv.connect());
    let filler = vec![b'f'; 4096];
    let mut wrong = Vec::new();
    for round in 0..200 {
        expect(&mut c, &resp(&[b"SET", b"k", &filler, b"EX", b"500"]), b"+OK\r\n");
        // Something else through the small memory tier, so the key moves.
        expect(&mut c, &resp(&[b"SET", format!("fill{}", round % 8).as_bytes(), &filler]), b"+OK\r\n");
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let (ta, tb) = (a.try_clone().unwrap(), b.try_clone().unwrap());
        let (ba, bb) = (barrier.clone(), barrier);
        let ha = std::thread::spawn(move || {
            let mut s = ta;
            ba.wait();
            let r = read_until(&mut s, &resp(&[b"EXPIRE", b"k", b"1000", b"GT"]), b"\r\n");
            (s, r)
        });
        let hb = std::thread::spawn(move || {
            let mut s = tb;
            bb.wait();
            expect(&mut s, &resp(&[b"EXPIRE", b"k", b"5000"]), b":1\r\n");
            s
        });
        let (sa, _) = ha.join().unwrap();
        let sb = hb.join().unwrap();
        (a, b) = (sa, sb);
        let ttl = read_until(&mut c, &resp(&[b"TTL", b"k"]), b"\r\n");
        let secs: i64 = String::from_utf8_lossy(&ttl[1..ttl.len() - 2]).parse().unwrap();
        if secs < 4000 {
            wrong.push((round, secs));
        }
    }
    assert!(wrong.is_empty(), "rounds that ended with the shorter TTL (round, TTL): {wrong:?}");
}
