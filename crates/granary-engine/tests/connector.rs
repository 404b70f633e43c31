//! The KV connector against real warehouses: an in-process store, and the
//! warehouse's own RESP and HTTP servers on ephemeral loopback ports, with
//! the same cases for each transport; plus servers that are down or never
//! answer.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use granary_core::{BlockHash, ByteSize, DType, HashChain, KvBlock, KvLayout};
use granary_engine::connector::{
    Connector, ConnectorConfig, ConnectorError, KvShape, Source, StatsSnapshot, WarehouseSpec,
};
use granary_warehouse::auth::Auth;
use granary_warehouse::config::{DiskConfig, StoreConfig};
use granary_warehouse::{OffloadMode, PolicyKind, PutOptions, ServerCtx, Store};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const NS: &str = "default";

/// 2 layers x 2 kv heads x 16 dims x 16 tokens x f16 x (K, V) = 4096 bytes.
const LAYOUT: KvLayout = KvLayout { dtype: DType::F16, layers: 2, kv_heads: 2, head_dim: 16, block_tokens: 16 };

fn shape() -> KvShape {
    KvShape::of_block(&LAYOUT)
}

/// Names of the first `n` blocks of a prompt.
fn hashes(n: usize) -> Vec<BlockHash> {
    let chain = HashChain::for_layout("tenant-a", b"model-weights", &LAYOUT);
    let tokens: Vec<u32> = (0..(n * LAYOUT.block_tokens as usize) as u32).collect();
    chain.hashes(&tokens)
}

/// A distinct payload of the right size for [`shape`].
fn payload(seed: u64) -> Bytes {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let len = shape().payload_len() as usize;
    Bytes::from(
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect::<Vec<u8>>(),
    )
}

fn key(h: &BlockHash) -> Bytes {
    Bytes::from(h.to_hex())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Embedded,
    Resp,
    Http,
}

/// A warehouse reachable over one transport, and the store behind it.
struct Warehouse {
    kind: Kind,
    store: Store,
    spec: WarehouseSpec,
    ctx: Option<Arc<ServerCtx>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Warehouse {
    async fn start(kind: Kind, store: Store) -> Warehouse {
        Self::start_with(kind, store, Auth::default(), "127.0.0.1:0").await
    }

    async fn start_with(kind: Kind, store: Store, auth: Auth, bind: &str) -> Warehouse {
        if kind == Kind::Embedded {
            return Warehouse { kind, store, spec: WarehouseSpec::Embedded, ctx: None, stop: None, task: None };
        }
        let ctx = Arc::new(ServerCtx::new(store.clone(), auth));
        let listener = TcpListener::bind(bind).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = oneshot::channel::<()>();
        let stop = async move {
            let _ = rx.await;
        };
        let (spec, task) = match kind {
            Kind::Resp => (
                WarehouseSpec::Resp { addr },
                tokio::spawn(granary_warehouse::resp::serve(listener, ctx.clone(), stop)),
            ),
            _ => (
                WarehouseSpec::Http { addr },
                tokio::spawn(granary_warehouse::http::serve(listener, ctx.clone(), stop)),
            ),
        };
        Warehouse { kind, store, spec, ctx: Some(ctx), stop: Some(tx), task: Some(task) }
    }

    fn connector(&self, cfg: ConnectorConfig) -> Connector {
        Connector::new(self.spec.clone(), cfg, Some(Arc::new(self.store.clone()))).unwrap()
    }

    fn default_connector(&self) -> Connector {
        self.connector(ConnectorConfig::default())
    }

    /// Connections the server has accepted so far.
    fn connections(&self) -> u64 {
        let ctx = self.ctx.as_ref().expect("a server");
        match self.kind {
            Kind::Resp => ctx.resp.connections_total.load(Relaxed),
            _ => ctx.http.connections_total.load(Relaxed),
        }
    }

    /// What a loaded block reports as its tier when the warehouse read it from `tier`.
    fn reports(&self, tier: Source) -> Source {
        if self.kind == Kind::Resp {
            Source::Unknown
        } else {
            tier
        }
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let res = tokio::time::timeout(Duration::from_secs(10), task).await;
            assert!(matches!(res, Ok(Ok(Ok(())))), "server did not stop cleanly: {res:?}");
        }
    }
}

fn memory_store() -> Store {
    Store::memory_only(1 << 24)
}

/// A store whose memory holds two of the test blocks, over a roomy disk tier.
async fn tiered_store(dir: &std::path::Path) -> Store {
    let mut cfg = StoreConfig::memory_only(10_000);
    cfg.offload = OffloadMode::All;
    cfg.disk = Some(DiskConfig { dir: dir.to_path_buf(), capacity: ByteSize(1 << 22), policy: PolicyKind::Lru });
    Store::open(cfg).await.unwrap()
}

/// Runs a case once per transport.
macro_rules! each_transport {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            use super::Kind;
            #[tokio::test]
            async fn embedded() {
                super::$case(Kind::Embedded).await
            }
            #[tokio::test]
            async fn resp() {
                super::$case(Kind::Resp).await
            }
            #[tokio::test]
            async fn http() {
                super::$case(Kind::Http).await
            }
        }
    )*};
}

/// Runs a case once per network transport.
macro_rules! each_remote {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            use super::Kind;
            #[tokio::test]
            async fn resp() {
                super::$case(Kind::Resp).await
            }
            #[tokio::test]
            async fn http() {
                super::$case(Kind::Http).await
            }
        }
    )*};
}

each_transport!(
    put_then_get_round_trips_bytes_and_shape,
    lookup_stops_at_the_first_gap,
    a_block_of_another_shape_is_a_counted_miss,
    a_corrupt_block_is_a_counted_miss,
    the_serving_tier_is_reported,
);

each_remote!(
    nothing_listening_fails_fast,
    a_silent_server_fails_within_the_deadline,
    connections_are_reused_and_bounded,
    a_restarted_warehouse_is_reconnected,
    a_token_opens_its_namespace,
);

async fn put_then_get_round_trips_bytes_and_shape(kind: Kind) {
    let w = Warehouse::start(kind, memory_store()).await;
    let c = w.default_connector();
    let h = hashes(4);
    c.put(h[0], &shape(), payload(0)).await.unwrap();
    c.put_many(&[(h[1], shape(), payload(1)), (h[2], shape(), payload(2))]).await.unwrap();

    assert_eq!(c.lookup(&h).await.unwrap(), 3);
    let got = c.get_many(&h, &shape()).await.unwrap();
    assert_eq!(got.len(), 4);
    for (i, g) in got[..3].iter().enumerate() {
        let g = g.as_ref().unwrap_or_else(|| panic!("block {i} missing"));
        assert_eq!(g.payload, payload(i as u64), "block {i} bytes");
        assert_eq!(g.tier, w.reports(Source::Memory));
    }
    assert!(got[3].is_none(), "a block never stored is missing");
    assert_eq!(c.get(h[1], &shape()).await.unwrap().unwrap().payload, payload(1));

    // What the warehouse holds is a KV block frame of that shape, under the hash's hex.
    let raw = w.store.get(NS, &key(&h[2])).await.unwrap().expect("stored under the hex key").value;
    let block = KvBlock::decode(raw).unwrap();
    assert!(shape().matches(&block.header), "{:?}", block.header);
    assert_eq!(block.payload, payload(2));

    let s = c.stats().snapshot();
    let len = shape().payload_len();
    assert_eq!(
        s,
        StatsSnapshot {
            lookups: 1,
            lookup_hashes: 4,
            lookup_matched: 3,
            hits: 4,
            misses: 1,
            bytes_loaded: 4 * len,
            blocks_saved: 3,
            bytes_saved: 3 * len,
            ..Default::default()
        }
    );

    // A payload that does not fit the shape is refused before anything is sent.
    let short = payload(9).slice(1..);
    assert!(matches!(c.put(h[3], &shape(), short).await, Err(ConnectorError::Block(_))));
    assert_eq!(c.lookup(&h[3..]).await.unwrap(), 0);
    w.stop().await;
}

async fn lookup_stops_at_the_first_gap(kind: Kind) {
    let w = Warehouse::start(kind, memory_store()).await;
    let c = w.default_connector();
    let h = hashes(6);
    for i in [0, 1, 2, 4, 5] {
        c.put(h[i], &shape(), payload(i as u64)).await.unwrap();
    }
    assert_eq!(c.lookup(&h).await.unwrap(), 3, "block 3 is missing: the prefix ends there");
    assert_eq!(c.lookup(&h[..2]).await.unwrap(), 2);
    assert_eq!(c.lookup(&h[3..]).await.unwrap(), 0, "a missing first block matches nothing");
    assert_eq!(c.lookup(&h[4..]).await.unwrap(), 2);
    assert_eq!(c.lookup(&[]).await.unwrap(), 0);
    let s = c.stats().snapshot();
    assert_eq!((s.lookups, s.lookup_hashes, s.lookup_matched), (5, 6 + 2 + 3 + 2, 3 + 2 + 2));
    w.stop().await;
}

async fn a_block_of_another_shape_is_a_counted_miss(kind: Kind) {
    let w = Warehouse::start(kind, memory_store()).await;
    let c = w.default_connector();
    let h = hashes(2);
    // Same byte count, other layout of heads: only the header tells them apart.
    let other = KvShape { kv_heads: 4, head_dim: 8, ..shape() };
    assert_eq!(other.payload_len(), shape().payload_len());
    c.put(h[0], &other, payload(0)).await.unwrap();
    c.put(h[1], &shape(), payload(1)).await.unwrap();

    let got = c.get_many(&h, &shape()).await.unwrap();
    assert!(got[0].is_none(), "a block of another shape must not be returned");
    assert_eq!(got[1].as_ref().unwrap().payload, payload(1));
    let bf16 = KvShape { dtype: DType::Bf16, ..shape() };
    assert!(c.get(h[1], &bf16).await.unwrap().is_none(), "another dtype must not be returned");
    assert_eq!(c.get(h[0], &other).await.unwrap().unwrap().payload, payload(0));

    let s = c.stats().snapshot();
    assert_eq!((s.shape_mismatch, s.misses, s.hits, s.corrupt), (2, 2, 2, 0));
    w.stop().await;
}

async fn a_corrupt_block_is_a_counted_miss(kind: Kind) {
    let w = Warehouse::start(kind, memory_store()).await;
    let c = w.default_connector();
    let h = hashes(3);
    for (i, h) in h.iter().enumerate() {
        c.put(*h, &shape(), payload(i as u64)).await.unwrap();
    }
    // Overwrite two values behind the connector's back: one with bytes that
    // are no frame at all, one with a frame whose payload has a flipped bit.
    let opts = PutOptions::default();
    w.store.put(NS, key(&h[0]), Bytes::from_static(b"not a KV block"), opts.clone()).await.unwrap();
    let mut flipped = shape().frame(payload(1)).unwrap().encode().to_vec();
    flipped[granary_core::HEADER_LEN + 100] ^= 0x08;
    w.store.put(NS, key(&h[1]), Bytes::from(flipped), opts).await.unwrap();

    assert_eq!(c.lookup(&h).await.unwrap(), 3, "lookup sees keys, not contents");
    let got = c.get_many(&h, &shape()).await.unwrap();
    assert!(got[0].is_none() && got[1].is_none(), "corrupt blocks must not be returned");
    assert_eq!(got[2].as_ref().unwrap().payload, payload(2), "a sound block in the same batch still loads");
    let s = c.stats().snapshot();
    assert_eq!((s.corrupt, s.misses, s.hits, s.shape_mismatch), (2, 2, 1, 0));
    w.stop().await;
}

async fn the_serving_tier_is_reported(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let store = tiered_store(dir.path()).await;
    let w = Warehouse::start(kind, store.clone()).await;
    let c = w.default_connector();
    let h = hashes(4);
    c.put(h[0], &shape(), payload(0)).await.unwrap();
    // Written through to disk; then two more blocks push it out of memory.
    store.flush(Duration::from_secs(10)).await.unwrap();
    for (i, h) in h.iter().enumerate().take(3).skip(1) {
        c.put(*h, &shape(), payload(i as u64)).await.unwrap();
    }
    store.flush(Duration::from_secs(10)).await.unwrap();
    assert!(store.get_cached(NS, &key(&h[0])).is_none(), "block 0 should have left memory");
    assert_eq!(c.lookup(&h[..3]).await.unwrap(), 3, "a block on disk still counts as present");

    let first = c.get(h[0], &shape()).await.unwrap().expect("found on disk");
    assert_eq!(first.payload, payload(0));
    assert_eq!(first.tier, w.reports(Source::Disk));
    // The read promoted it back into memory.
    let again = c.get(h[0], &shape()).await.unwrap().unwrap();
    assert_eq!(again.tier, w.reports(Source::Memory));
    w.stop().await;
}

/// Deadlines short enough for tests.
fn quick() -> ConnectorConfig {
    ConnectorConfig {
        lookup_timeout: Duration::from_millis(300),
        get_timeout: Duration::from_millis(400),
        put_timeout: Duration::from_millis(400),
        per_block_timeout: Duration::from_millis(50),
        ..Default::default()
    }
}

/// How late past its deadline a call may fail on a loaded test machine.
const SLACK: Duration = Duration::from_millis(1500);

fn spec(kind: Kind, addr: String) -> WarehouseSpec {
    match kind {
        Kind::Resp => WarehouseSpec::Resp { addr },
        _ => WarehouseSpec::Http { addr },
    }
}

/// Every operation against `c` fails, each within its deadline (plus slack).
/// Returns whether each failure was a timeout.
async fn every_call_fails(c: &Connector) -> [bool; 3] {
    let cfg = c.config().clone();
    let h = hashes(2);
    let t = Instant::now();
    let e1 = c.lookup(&h).await.unwrap_err();
    let lookup = t.elapsed();
    let t = Instant::now();
    let e2 = c.get_many(&h, &shape()).await.unwrap_err();
    let get = t.elapsed();
    let t = Instant::now();
    let e3 = c.put(h[0], &shape(), payload(0)).await.unwrap_err();
    let put = t.elapsed();
    assert!(lookup < cfg.lookup_timeout + SLACK, "lookup took {lookup:?}: {e1}");
    // A batch's deadline grows by the per-block allowance: 2 blocks, 1 block.
    assert!(get < cfg.get_timeout + cfg.per_block_timeout * 2 + SLACK, "get took {get:?}: {e2}");
    assert!(put < cfg.put_timeout + cfg.per_block_timeout + SLACK, "put took {put:?}: {e3}");
    let s = c.stats().snapshot();
    assert_eq!((s.errors, s.hits, s.blocks_saved), (3, 0, 0));
    [e1, e2, e3].map(|e| matches!(e, ConnectorError::Timeout { .. }))
}

async fn nothing_listening_fails_fast(kind: Kind) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let c = Connector::new(spec(kind, addr.clone()), quick(), None).unwrap();
    let timeouts = every_call_fails(&c).await;
    assert_eq!(timeouts, [false; 3], "a refused connection is reported as such, not waited out");
    let e = c.lookup(&hashes(1)).await.unwrap_err().to_string();
    assert!(e.contains(&addr), "the error names the address: {e}");
}

/// A server that accepts connections, reads nothing and never answers.
async fn silent_server() -> (String, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

async fn a_silent_server_fails_within_the_deadline(kind: Kind) {
    let (addr, server) = silent_server().await;
    let c = Connector::new(spec(kind, addr), quick(), None).unwrap();
    let t = Instant::now();
    let timeouts = every_call_fails(&c).await;
    assert_eq!(timeouts, [true; 3]);
    assert!(t.elapsed() >= Duration::from_millis(300 + 400 + 400), "each call waited out its own deadline");
    assert_eq!(c.stats().snapshot().timeouts, 3);
    server.abort();
}

async fn connections_are_reused_and_bounded(kind: Kind) {
    let w = Warehouse::start(kind, memory_store()).await;
    let c = Arc::new(w.connector(ConnectorConfig { max_connections: 2, ..Default::default() }));
    let h = hashes(8);
    for (i, h) in h.iter().enumerate() {
        c.put(*h, &shape(), payload(i as u64)).await.unwrap();
    }
    for _ in 0..20 {
        assert_eq!(c.lookup(&h).await.unwrap(), 8);
    }
    assert_eq!(w.connections(), 1, "sequential calls share one connection");

    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (c, h) = (c.clone(), h.clone());
        tasks.push(tokio::spawn(async move { c.get_many(&h, &shape()).await.unwrap().iter().flatten().count() }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 8);
    }
    assert!(w.connections() <= 2, "at most max_connections open: {}", w.connections());
    w.stop().await;
}

async fn a_restarted_warehouse_is_reconnected(kind: Kind) {
    let store = memory_store();
    let w = Warehouse::start(kind, store.clone()).await;
    let addr = w.spec.addr().unwrap().to_string();
    let c = w.default_connector();
    let h = hashes(2);
    c.put_many(&[(h[0], shape(), payload(0)), (h[1], shape(), payload(1))]).await.unwrap();
    assert_eq!(c.lookup(&h).await.unwrap(), 2);

    // Restarted on the same address: the pooled connection died with the
    // old server; the call goes through on a new one.
    w.stop().await;
    let w = Warehouse::start_with(kind, store.clone(), Auth::default(), &addr).await;
    assert_eq!(c.lookup(&h).await.unwrap(), 2);
    assert_eq!(c.get(h[1], &shape()).await.unwrap().unwrap().payload, payload(1));

    // Down: errors at once; up again: served again.
    w.stop().await;
    let t = Instant::now();
    assert!(c.lookup(&h).await.is_err());
    assert!(c.get(h[0], &shape()).await.is_err());
    assert!(t.elapsed() < SLACK, "a warehouse that is down fails fast: {:?}", t.elapsed());
    let w = Warehouse::start_with(kind, store, Auth::default(), &addr).await;
    assert_eq!(c.lookup(&h).await.unwrap(), 2);
    w.stop().await;
}

async fn a_token_opens_its_namespace(kind: Kind) {
    let auth = Auth::from_plain(Some("root"), &[("tenant-a", "secret-a"), ("tenant-b", "secret-b")]);
    let w = Warehouse::start_with(kind, memory_store(), auth, "127.0.0.1:0").await;
    let cfg = |ns: &str, token: Option<&str>| ConnectorConfig {
        namespace: ns.into(),
        token: token.map(str::to_string),
        ..Default::default()
    };
    let h = hashes(1);
    let a = w.connector(cfg("tenant-a", Some("secret-a")));
    a.put(h[0], &shape(), payload(0)).await.unwrap();
    assert_eq!(a.get(h[0], &shape()).await.unwrap().unwrap().payload, payload(0));
    assert!(w.store.get("tenant-a", &key(&h[0])).await.unwrap().is_some(), "stored in the token's namespace");

    // The admin token reaches any namespace; tenant-b holds nothing of tenant-a's.
    let admin = w.connector(cfg("tenant-b", Some("root")));
    assert_eq!(admin.lookup(&h).await.unwrap(), 0);

    for (ns, token) in [("tenant-a", Some("wrong")), ("tenant-b", Some("secret-a")), ("tenant-a", None)] {
        let c = w.connector(cfg(ns, token));
        let e = c.lookup(&h).await.unwrap_err();
        assert!(matches!(e, ConnectorError::Refused { .. }), "{ns} with {token:?}: {e}");
    }
    w.stop().await;
}

#[test]
fn an_embedded_spec_needs_a_store_and_settings_are_checked() {
    let e = Connector::new(WarehouseSpec::Embedded, ConnectorConfig::default(), None).unwrap_err();
    assert!(e.to_string().contains("embedded"), "{e}");
    let spec = WarehouseSpec::parse("resp://127.0.0.1:6380").unwrap();
    let bad_ns = ConnectorConfig { namespace: "a/b".into(), ..Default::default() };
    let e = Connector::new(spec.clone(), bad_ns, None).unwrap_err();
    assert!(e.to_string().contains("\"a/b\""), "{e}");
    let none = ConnectorConfig { max_connections: 0, ..Default::default() };
    assert!(Connector::new(spec, none, None).unwrap_err().to_string().contains("max_connections"));
    let e = WarehouseSpec::parse("resp://warehouse").unwrap_err();
    assert!(e.to_string().contains("missing port"), "{e}");
}
