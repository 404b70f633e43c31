//! LMCache's `lm://` protocol over a real socket, spoken as LMCache's
//! `LMCServerConnector` speaks it (the header layout of
//! `lmcache/v1/protocol.py`). LMCache's own client drives the same server
//! in `crates/granary/tests/warehouse_process.rs` (behind `GRANARY_LMCACHE=1`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use granary_warehouse::auth::Auth;
use granary_warehouse::config::{LmConfig, ServeLimits};
use granary_warehouse::lm::{self, Command, Layout, Request, REPLY_LEN};
use granary_warehouse::{ServerCtx, Store};

struct Server {
    port: u16,
    store: Store,
    ctx: Arc<ServerCtx>,
    _rt: tokio::runtime::Runtime,
}

fn start(limits: ServeLimits) -> Server {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let store = Store::memory_only(64 << 20);
    let ctx = Arc::new(ServerCtx::new(store.clone(), Auth::default()).with_limits(limits));
    let port = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(lm::serve(l, ctx.clone(), std::future::pending()));
        port
    });
    Server { port, store, ctx, _rt: rt }
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn send(s: &mut TcpStream, command: Command, key: &str, length: usize, layout: Layout) {
    let req = Request { command, length: length as i32, layout, key: Bytes::copy_from_slice(key.as_bytes()) };
    s.write_all(&req.encode()).unwrap();
}

/// (code, length, fmt, dtype, shape) of a reply, then its body.
fn reply(s: &mut TcpStream) -> (i32, Layout, Vec<u8>) {
    let mut h = [0u8; REPLY_LEN];
    s.read_exact(&mut h).unwrap();
    let at = |i: usize| i32::from_le_bytes(h[i * 4..i * 4 + 4].try_into().unwrap());
    let layout = Layout { fmt: at(2), dtype: at(3), shape: [at(4), at(5), at(6), at(7)] };
    let mut body = vec![0u8; if at(0) == 200 { at(1) as usize } else { 0 }];
    s.read_exact(&mut body).unwrap();
    (at(0), layout, body)
}

#[test]
fn put_get_exist_list_and_health_as_lmcache_speaks_them() {
    let srv = start(ServeLimits::default());
    let mut s = connect(srv.port);
    send(&mut s, Command::Health, "", 0, Layout::default());
    assert_eq!(reply(&mut s).0, 200);

    let key = "granary-test@1@0@3e8@bfloat16";
    send(&mut s, Command::Exist, key, 0, Layout::default());
    assert_eq!(reply(&mut s).0, 400, "a fresh key exists");
    send(&mut s, Command::Get, key, 0, Layout::default());
    assert_eq!(reply(&mut s).0, 400, "a fresh key reads back");

    let layout = Layout { fmt: 1, dtype: 3, shape: [2, 4, 256, 256] };
    let data: Vec<u8> = (0..512 * 1024u32).map(|i| (i * 7 + 3) as u8).collect();
    // A PUT has no reply; the next request on the connection sees it.
    send(&mut s, Command::Put, key, data.len(), layout);
    s.write_all(&data).unwrap();
    send(&mut s, Command::Exist, key, 0, Layout::default());
    assert_eq!(reply(&mut s).0, 200);
    send(&mut s, Command::Get, key, 0, Layout::default());
    let (code, got_layout, body) = reply(&mut s);
    assert_eq!((code, got_layout), (200, layout));
    assert!(body == data, "the chunk differs after the round trip");

    // Stored as LMCache's redis:// connector stores a chunk.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let meta = rt.block_on(srv.store.get("default", format!("{key}metadata").as_bytes())).unwrap().unwrap();
    assert_eq!(lm::decode_meta(&meta.value), Some((data.len() as i32, layout)));
    let raw = rt.block_on(srv.store.get("default", format!("{key}kv_bytes").as_bytes())).unwrap().unwrap();
    assert!(raw.value == data);

    send(&mut s, Command::Put, "second@1@0@1@bfloat16", 3, layout);
    s.write_all(b"abc").unwrap();
    send(&mut s, Command::List, "", 0, Layout::default());
    let (code, _, body) = reply(&mut s);
    assert_eq!(code, 200);
    assert_eq!(String::from_utf8(body).unwrap(), format!("{key}\nsecond@1@0@1@bfloat16"));

    // A chunk whose bytes went missing is not served half.
    rt.block_on(srv.store.delete("default", format!("{key}kv_bytes").as_bytes())).unwrap();
    send(&mut s, Command::Exist, key, 0, Layout::default());
    assert_eq!(reply(&mut s).0, 400);
    send(&mut s, Command::Get, key, 0, Layout::default());
    assert_eq!(reply(&mut s).0, 400);
    assert!(srv.ctx.lm.requests_ok.load(std::sync::atomic::Ordering::Relaxed) >= 10);
}

#[test]
fn a_malformed_header_or_oversized_put_closes_only_that_connection() {
    let srv = start(ServeLimits::default());
    let mut other = connect(srv.port);
    let mut bad = connect(srv.port);
    let mut h = Request { command: Command::Health, length: 0, layout: Layout::default(), key: Bytes::new() }.encode();
    h[0] = 42;
    bad.write_all(&h).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(bad.read(&mut buf).unwrap(), 0, "an unknown command must close the connection");

    let mut big = connect(srv.port);
    let max = srv.store.config().max_value.as_u64() as usize;
    send(&mut big, Command::Put, "big", max + 1, Layout::default());
    assert_eq!(big.read(&mut buf).unwrap(), 0, "a PUT over max_value must close the connection");

    send(&mut other, Command::Health, "", 0, Layout::default());
    assert_eq!(reply(&mut other).0, 200, "another client is still served");
    assert_eq!(srv.ctx.lm.protocol_errors.load(std::sync::atomic::Ordering::Relaxed), 2);
}

#[test]
fn idle_connections_are_closed_after_the_timeout() {
    let srv = start(ServeLimits { idle_timeout_secs: 1, ..Default::default() });
    let mut s = connect(srv.port);
    send(&mut s, Command::Health, "", 0, Layout::default());
    assert_eq!(reply(&mut s).0, 200);
    std::thread::sleep(Duration::from_millis(1500));
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "an idle connection stayed open");
}

/// The process's virtual size, in bytes (`VmSize` of /proc/self/status).
fn vm_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Issue 40: a PUT header allocated its whole declared length (up to
/// `max_value`, 512 MiB by default) before one byte of the value came, on a
/// protocol without authentication: 16 strangers' headers reserved 8 GiB.
/// Now what is reserved follows what arrives, and a value that stops
/// arriving closes its connection after `io_timeout_secs`.
#[test]
fn a_put_header_reserves_nothing_of_its_declared_length_and_a_stalled_value_is_closed() {
    const STRANGERS: usize = 16;
    let srv = start(ServeLimits { io_timeout_secs: 1, ..Default::default() });
    let max = srv.store.config().max_value.as_u64() as usize;
    let before = vm_size();
    let mut conns: Vec<TcpStream> = (0..STRANGERS)
        .map(|i| {
            let mut s = connect(srv.port);
            send(&mut s, Command::Put, &format!("k{i}"), max, Layout::default());
            s.write_all(&[7u8; 1000]).unwrap();
            s
        })
        .collect();
    // Every connection is inside its PUT, reading the value.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while srv.ctx.lm.bytes_read.load(std::sync::atomic::Ordering::Relaxed) < (STRANGERS * 186) as u64 {
        assert!(std::time::Instant::now() < deadline, "the headers were not read");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    let grown = vm_size().saturating_sub(before);
    assert!(
        grown < (STRANGERS * max / 8) as u64,
        "{STRANGERS} headers declaring {max} bytes each grew the process by {grown} bytes"
    );
    // The values stop arriving: each connection is closed by the I/O timeout.
    let mut buf = [0u8; 1];
    for s in &mut conns {
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "a stalled PUT kept its connection");
    }
    let ns = srv.ctx.lm_config.namespace.clone();
    let page = srv._rt.block_on(srv.store.scan(&ns, 0, 100)).unwrap();
    assert!(page.keys.is_empty(), "a partial value was stored: {:?}", page.keys);
    // A value that does arrive, even slowly, is stored whole.
    let mut s = connect(srv.port);
    let value: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    send(&mut s, Command::Put, "slow", value.len(), Layout::default());
    for part in value.chunks(100_000) {
        s.write_all(part).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    send(&mut s, Command::Get, "slow", 0, Layout::default());
    let (code, _, body) = reply(&mut s);
    assert_eq!((code, body.len()), (200, value.len()));
    assert!(body == value, "the value read back differs");
}

#[test]
fn the_listen_address_is_checked() {
    let mut l = LmConfig::default();
    assert_eq!(l.addr(), Ok(None));
    l.listen = "127.0.0.1:65432".into();
    assert_eq!(l.addr().unwrap().unwrap().port(), 65432);
    assert_eq!(l.validate(), Ok(()));
    l.listen = "nowhere".into();
    assert!(l.addr().unwrap_err().contains("warehouse.lm.listen"));
    let l = LmConfig { namespace: "a b".into(), ..Default::default() };
    assert!(l.validate().unwrap_err().contains("warehouse.lm.namespace"));
}

/// The settings' old place under `[warehouse.limits]` is refused with the
/// new one's name, not silently ignored.
#[test]
fn the_old_limits_keys_name_their_new_place() {
    let old: ServeLimits = serde_json::from_str(r#"{"lm_listen": "127.0.0.1:65432"}"#).unwrap();
    let err = old.validate().unwrap_err();
    assert!(err.contains("warehouse.limits.lm_listen") && err.contains("[warehouse.lm]"), "{err}");
    let old: ServeLimits = serde_json::from_str(r#"{"lm_namespace": "x"}"#).unwrap();
    assert!(old.validate().unwrap_err().contains("`namespace` under [warehouse.lm]"));
    assert_eq!(ServeLimits::default().validate(), Ok(()));
}
