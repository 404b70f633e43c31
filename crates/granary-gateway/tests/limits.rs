//! The Redis-backed limiter against a real `redis-server`: two limiters
//! stand for two gateway processes sharing one server.
//!
//! Each test starts its own server on a free port. Without the
//! `redis-server` binary the tests are skipped with a notice, unless
//! `GRANARY_REQUIRE_EXTERNAL=1`, which makes them fail instead.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use granary_gateway::limits::{Limiter, RedisOptions, Scope};
use granary_gateway::pricing::Money;
use granary_gateway::{Limits, Principal, Priority};

/// 2025-03-14 15:09:26.500 UTC (a fixed clock keeps the minute from rolling over mid-test).
const T0: i64 = 1_741_964_966_500;

struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    /// Starts a server, or returns `None` (after a notice) when the binary is missing.
    fn start() -> Option<Self> {
        let port = free_port();
        Self::start_on(port)
    }

    fn start_on(port: u16) -> Option<Self> {
        Self::start_with(port, &[])
    }

    fn start_with(port: u16, extra: &[&str]) -> Option<Self> {
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") {
                    panic!("redis-server is not installed and GRANARY_REQUIRE_EXTERNAL=1");
                }
                eprintln!("SKIPPED: redis-server is not installed (set GRANARY_REQUIRE_EXTERNAL=1 to fail instead)");
                return None;
            }
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        let server = RedisServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::{Read, Write};
                let mut buf = [0u8; 7];
                if s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n" {
                    return Some(server);
                }
            }
            assert!(Instant::now() < deadline, "redis-server on port {port} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url()).unwrap().get_multiplexed_async_connection().await.unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn principal(key_id: i64, tenant_id: i64, key_limits: Limits, tenant_limits: Limits) -> Principal {
    Principal {
        key_id,
        key_prefix: format!("gk_{key_id}"),
        tenant_id,
        tenant: format!("tenant{tenant_id}"),
        namespace: format!("tenant{tenant_id}"),
        models: None,
        priority: Priority::Standard,
        key_limits,
        tenant_limits,
        log_prompts: false,
    }
}

fn rpm(n: u64) -> Limits {
    Limits { requests_per_minute: Some(n), ..Limits::default() }
}

/// Generous timeout: the tests check enforcement, not latency, on a busy machine.
fn options(prefix: &str) -> RedisOptions {
    RedisOptions { prefix: prefix.to_string(), timeout_ms: 2_000 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_enforce_one_request_limit_together() {
    let Some(server) = RedisServer::start() else { return };
    let a = Limiter::redis(&server.url(), options("t1:")).await.unwrap();
    let b = Limiter::redis(&server.url(), options("t1:")).await.unwrap();
    assert_eq!(a.backend(), "redis");
    // The key allows 1000; the tenant allows 25 across both gateways.
    let p = principal(7, 70, rpm(1000), rpm(25));
    let mut tasks = Vec::new();
    for limiter in [a.clone(), b.clone(), a.clone(), b.clone()] {
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0;
            for _ in 0..20 {
                match limiter.admit_at(&p, 0, T0).await {
                    Ok(_) => admitted += 1,
                    Err(r) => {
                        assert_eq!((r.scope, r.limit, r.max), (Scope::Tenant, "requests_per_minute", 25));
                        // A rate: one of 25 a minute drains every 2.4 s.
                        assert_eq!(r.retry_after, Duration::from_millis(2_400));
                    }
                }
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 25, "exactly the tenant's limit across both gateways");
    assert_eq!((a.backend_errors(), b.backend_errors()), (0, 0));
    // Rejected requests were not counted: the rate holds 25 requests (its
    // time is 25 x 2.4 s ahead), not 80.
    let mut c = server.client().await;
    let keys: Vec<String> = redis::cmd("KEYS").arg("t1:{t70}:t:70:rpm:*").query_async(&mut c).await.unwrap();
    assert_eq!(keys, ["t1:{t70}:t:70:rpm:0"]);
    let tat: String = redis::cmd("GET").arg(&keys[0]).query_async(&mut c).await.unwrap();
    assert_eq!(tat.parse::<f64>().unwrap(), (T0 + 25 * 2_400) as f64);
    // Another limiter with another prefix does not see these counters.
    let other = Limiter::redis(&server.url(), options("t2:")).await.unwrap();
    other.admit_at(&p, 0, T0).await.unwrap();
}

#[tokio::test]
async fn token_budgets_are_shared_between_gateways() {
    let Some(server) = RedisServer::start() else { return };
    let a = Limiter::redis(&server.url(), options("tok:")).await.unwrap();
    let b = Limiter::redis(&server.url(), options("tok:")).await.unwrap();
    let p = principal(1, 10, Limits { tokens_per_day: Some(1_000), ..Limits::default() }, Limits::default());
    a.admit_at(&p, 300, T0).await.unwrap();
    a.charge_at(&p, 600, T0).await;
    b.admit_at(&p, 300, T0).await.unwrap();
    b.charge_at(&p, 400, T0).await;
    for l in [&a, &b] {
        let r = l.admit_at(&p, 0, T0).await.unwrap_err();
        assert_eq!((r.scope, r.limit, r.max, r.used), (Scope::Key, "tokens_per_day", 1_000, 1_000));
        assert_eq!(r.to_api_error().code, Some("quota_exceeded"));
    }
    // An estimate over the limit is refused by the script as well.
    let q = principal(2, 10, Limits { tokens_per_minute: Some(100), ..Limits::default() }, Limits::default());
    let r = b.admit_at(&q, 101, T0).await.unwrap_err();
    assert_eq!((r.limit, r.used), ("tokens_per_minute", 0));
    b.admit_at(&q, 100, T0).await.unwrap();
    // The next UTC day starts fresh.
    let tomorrow = T0 - T0.rem_euclid(86_400_000) + 86_400_000;
    a.admit_at(&p, 0, tomorrow).await.unwrap();
    assert_eq!((a.backend_errors(), b.backend_errors()), (0, 0));
}

#[tokio::test]
async fn keys_name_ids_and_expire_after_their_window() {
    let Some(server) = RedisServer::start() else { return };
    let l = Limiter::redis(&server.url(), RedisOptions { timeout_ms: 2_000, ..RedisOptions::default() }).await.unwrap();
    let all = Limits {
        requests_per_minute: Some(10),
        tokens_per_minute: Some(1_000),
        tokens_per_day: Some(10_000),
        tokens_per_month: Some(100_000),
        ..Limits::default()
    };
    let p = principal(42, 4, all.clone(), all);
    let now = wall_ms();
    l.admit_at(&p, 10, now).await.unwrap();
    l.charge_at(&p, 10, now).await;
    let mut c = server.client().await;
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut c).await.unwrap();
    keys.sort();
    let shapes: Vec<String> =
        keys.iter().map(|k| k.rsplit_once(':').map_or(k.clone(), |(head, _)| head.to_string())).collect();
    assert_eq!(
        shapes,
        [
            "granary:limits:{t4}:k:42:rpm",
            "granary:limits:{t4}:k:42:tpd",
            "granary:limits:{t4}:k:42:tpm",
            "granary:limits:{t4}:k:42:tpmo",
            "granary:limits:{t4}:t:4:rpm",
            "granary:limits:{t4}:t:4:tpd",
            "granary:limits:{t4}:t:4:tpm",
            "granary:limits:{t4}:t:4:tpmo",
        ]
    );
    for key in &keys {
        let ttl: i64 = redis::cmd("TTL").arg(key).query_async(&mut c).await.unwrap();
        let most = if key.contains(":rpm:") || key.contains(":tpm:") {
            61
        } else if key.contains(":tpd:") {
            86_401
        } else {
            31 * 86_400 + 1
        };
        assert!(ttl > 0 && ttl <= most, "{key} has TTL {ttl}, expected 1..={most}");
    }
    // A per-minute rate expires a second after what it holds has drained:
    // one request of 10 a minute, 6 s.
    let q = principal(43, 5, rpm(10), Limits::default());
    l.admit_at(&q, 0, now).await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("granary:limits:{t5}:k:43:*").query_async(&mut c).await.unwrap();
    assert_eq!(keys, ["granary:limits:{t5}:k:43:rpm:0"]);
    let ttl: i64 = redis::cmd("PTTL").arg(&keys[0]).query_async(&mut c).await.unwrap();
    assert!((5_000..=7_000).contains(&ttl), "PTTL {ttl}");
}

#[tokio::test]
async fn unlimited_principals_cost_no_round_trip() {
    let Some(server) = RedisServer::start() else { return };
    let l = Limiter::redis(&server.url(), options("u:")).await.unwrap();
    let p = principal(1, 1, Limits::default(), Limits::default());
    let mut c = server.client().await;
    let before = commands_processed(&mut c).await;
    for _ in 0..50 {
        l.admit(&p, 100).await.unwrap();
        l.charge(&p, 100).await;
    }
    // Only our own INFO calls reach the server.
    assert_eq!(commands_processed(&mut c).await, before + 1);
}

async fn commands_processed(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query_async(c).await.unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("INFO stats has total_commands_processed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_admits_and_counts_errors_then_enforces_again() {
    let Some(server) = RedisServer::start() else { return };
    let port = server.port;
    let opts = RedisOptions { prefix: "down:".to_string(), timeout_ms: 300 };
    let l = Limiter::redis(&server.url(), opts).await.unwrap();
    let p = principal(1, 10, rpm(3), Limits { tokens_per_day: Some(10), ..Limits::default() });
    for _ in 0..3 {
        l.admit_at(&p, 0, T0).await.unwrap();
    }
    assert!(l.admit_at(&p, 0, T0).await.is_err());
    assert_eq!(l.backend_errors(), 0);

    drop(server);
    // Fail open: every call is admitted and every failure counted.
    for i in 1..=10 {
        l.admit_at(&p, 0, T0).await.expect("admitted while Redis is down");
        assert_eq!(l.backend_errors(), i);
    }
    l.charge_at(&p, 5, T0).await;
    assert_eq!(l.backend_errors(), 11);

    // Redis comes back (empty: no persistence) on the same port.
    let _server = RedisServer::start_on(port).expect("redis-server ran a moment ago");
    let probe = principal(99, 99, rpm(1_000_000), Limits::default());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let before = l.backend_errors();
        l.admit_at(&probe, 0, T0).await.unwrap();
        if l.backend_errors() == before {
            break;
        }
        assert!(Instant::now() < deadline, "the limiter did not reconnect to Redis");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..3 {
        l.admit_at(&p, 0, T0).await.unwrap();
    }
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    assert_eq!((r.limit, r.used), ("requests_per_minute", 3));
}

#[tokio::test]
async fn an_unreachable_server_at_start_is_not_an_error() {
    let port = free_port();
    let started = Instant::now();
    let l = Limiter::redis(&format!("redis://127.0.0.1:{port}/"), RedisOptions::default()).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(l.backend(), "redis");
    let p = principal(1, 10, rpm(1), Limits::default());
    for _ in 0..3 {
        l.admit_at(&p, 0, T0).await.unwrap();
    }
    assert_eq!(l.backend_errors(), 3);

    // It connects once the server appears, and then enforces.
    let Some(_server) = RedisServer::start_on(port) else { return };
    let deadline = Instant::now() + Duration::from_secs(20);
    let probe = principal(99, 99, rpm(1_000_000), Limits::default());
    loop {
        let before = l.backend_errors();
        l.admit_at(&probe, 0, T0).await.unwrap();
        if l.backend_errors() == before {
            break;
        }
        assert!(Instant::now() < deadline, "the limiter never connected");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    l.admit_at(&p, 0, T0).await.unwrap();
    assert!(l.admit_at(&p, 0, T0).await.is_err());
}

/// The wall clock in unix milliseconds.
fn wall_ms() -> i64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    i64::try_from(d.as_millis()).unwrap()
}

/// Issue 14, point 1: what the per-minute limits leave, for the
/// `x-ratelimit-*` headers, is the same in process and in Redis: the
/// tightest of the key's and the tenant's, counting the request just
/// admitted and the tokens charged so far.
#[tokio::test]
async fn issue_14_admissions_report_the_quota_left_in_process_and_in_redis() {
    let server = RedisServer::start();
    let mut limiters = vec![("memory", Limiter::in_process())];
    if let Some(s) = &server {
        limiters.push(("redis", Limiter::redis(&s.url(), options("quota:")).await.unwrap()));
    }
    let key = Limits { requests_per_minute: Some(5), tokens_per_minute: Some(1_000), ..Limits::default() };
    let tenant = Limits { requests_per_minute: Some(3), ..Limits::default() };
    let p = principal(5, 50, key, tenant);
    // A rate: one request of 3 a minute drains in 20 s.
    let window_left = Duration::from_secs(20);
    for (name, l) in limiters {
        let q = l.admit_at(&p, 10, T0).await.unwrap();
        let r = q.requests.expect("a request quota");
        assert_eq!((r.limit, r.remaining, r.reset), (3, 2, window_left), "{name}: the tenant's is tighter");
        let t = q.tokens.expect("a token quota");
        assert_eq!((t.limit, t.remaining), (1_000, 1_000), "{name}");
        l.charge_at(&p, 300, T0).await;
        let q = l.admit_at(&p, 10, T0).await.unwrap();
        assert_eq!(q.requests.unwrap().remaining, 1, "{name}");
        assert_eq!(q.tokens.unwrap().remaining, 700, "{name}");
        l.admit_at(&p, 10, T0).await.unwrap();
        let r = l.admit_at(&p, 10, T0).await.unwrap_err();
        assert_eq!(r.quota.requests.unwrap().remaining, 0, "{name}: the refusal says none is left");
        assert_eq!(
            l.admit_at(&principal(6, 60, Limits::default(), Limits::default()), 0, T0).await.unwrap(),
            Default::default()
        );
        assert_eq!(l.backend_errors(), 0);
    }
}

/// Issue 14, point 1: two gateways reserve each request's worst case in
/// Redis at admission, so 50 concurrent requests against a budget that
/// fits 10 overshoot it by at most one reservation; settling releases what
/// a request did not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reservations_bound_the_overshoot_of_concurrent_requests_across_gateways() {
    let Some(server) = RedisServer::start() else { return };
    let a = Limiter::redis(&server.url(), options("r:")).await.unwrap();
    let b = Limiter::redis(&server.url(), options("r:")).await.unwrap();
    const RESERVE: u64 = 150;
    let budget =
        Limits { tokens_per_minute: Some(10 * RESERVE), tokens_per_month: Some(10 * RESERVE), ..Limits::default() };
    let p = principal(8, 80, Limits::default(), budget);
    let mut tasks = Vec::new();
    for i in 0..50 {
        let (l, p) = (if i % 2 == 0 { a.clone() } else { b.clone() }, p.clone());
        tasks.push(tokio::spawn(async move { l.reserve_at(&p, 50, RESERVE, T0).await.ok() }));
    }
    let mut admitted = Vec::new();
    for t in tasks {
        admitted.extend(t.await.unwrap());
    }
    assert_eq!(admitted.len(), 10, "a budget of 10 reservations admits 10");
    assert!(admitted.iter().all(|r| r.tokens == RESERVE && r.at_ms == T0));
    // Each used all it reserved: the budget is spent, nothing overshot.
    for r in &admitted {
        a.settle(&p, r, RESERVE).await;
    }
    let e = b.reserve_at(&p, 50, RESERVE, T0).await.unwrap_err();
    assert_eq!((e.limit, e.used), ("tokens_per_month", 10 * RESERVE));
    // A request that used 50 of its 150 gives 100 back.
    let mut c = server.client().await;
    let keys: Vec<String> = redis::cmd("KEYS").arg("r:{t80}:t:80:tpmo:*").query_async(&mut c).await.unwrap();
    redis::cmd("SET").arg(&keys[0]).arg(9 * RESERVE).query_async::<()>(&mut c).await.unwrap();
    // The minute rate holds 9 reservations: its time is 9 x 150 x 40 ms ahead.
    let minute: Vec<String> = redis::cmd("KEYS").arg("r:{t80}:t:80:tpm:*").query_async(&mut c).await.unwrap();
    redis::cmd("SET").arg(&minute[0]).arg(T0 + 9 * RESERVE as i64 * 40).query_async::<()>(&mut c).await.unwrap();
    let r = a.reserve_at(&p, 50, RESERVE, T0).await.unwrap();
    a.settle(&p, &r, 50).await;
    let n: u64 = redis::cmd("GET").arg(&keys[0]).query_async(&mut c).await.unwrap();
    assert_eq!(n, 9 * RESERVE + 50);
    let tat: String = redis::cmd("GET").arg(&minute[0]).query_async(&mut c).await.unwrap();
    assert_eq!(tat.parse::<f64>().unwrap(), (T0 + (9 * RESERVE + 50) as i64 * 40) as f64);
    // A release never takes a counter below 0.
    b.settle(&p, &r, 0).await;
    b.settle(&p, &admitted[0], 0).await;
    b.settle(&p, &admitted[1], 0).await;
    let n: i64 = redis::cmd("GET").arg(&keys[0]).query_async(&mut c).await.unwrap();
    assert!(n >= 0, "{n}");
    // The rate drained below now is removed rather than kept in the past.
    let tat: Option<String> = redis::cmd("GET").arg(&minute[0]).query_async(&mut c).await.unwrap();
    assert!(tat.as_ref().is_none_or(|t| t.parse::<f64>().unwrap() > T0 as f64), "{tat:?}");
    assert_eq!((a.backend_errors(), b.backend_errors()), (0, 0));
}

/// Issue 14, point 2: a Redis that lost its counters (a flush, a restart
/// without persistence) gets the day and month budgets back from the usage
/// rollup; counters that hold more keep their value.
#[tokio::test]
async fn budgets_are_rebuilt_in_redis_from_the_usage_rollup() {
    use granary_gateway::identity::DailyUsage;
    let Some(server) = RedisServer::start() else { return };
    let l = Limiter::redis(&server.url(), options("rb:")).await.unwrap();
    let month = Limits { tokens_per_month: Some(1_000), tokens_per_day: Some(600), ..Limits::default() };
    let p = principal(5, 50, month.clone(), Limits::default());
    let day = T0 - T0.rem_euclid(86_400_000);
    let usage = [
        // Today: 400 by key 5, 100 by another key of the tenant.
        DailyUsage { tenant_id: 50, key_id: 5, day_ms: day, tokens: 400, spend: Money(0) },
        DailyUsage { tenant_id: 50, key_id: 6, day_ms: day, tokens: 100, spend: Money(0) },
        // Earlier this month: 700 by key 5; last month's are ignored.
        DailyUsage { tenant_id: 50, key_id: 5, day_ms: day - 86_400_000, tokens: 700, spend: Money(0) },
        DailyUsage { tenant_id: 50, key_id: 5, day_ms: day - 40 * 86_400_000, tokens: 99_999, spend: Money(0) },
    ];
    l.admit_at(&p, 0, T0).await.unwrap();
    l.restore_at(&usage, T0).await;
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    assert_eq!((r.limit, r.used), ("tokens_per_month", 1_100));
    let mut c = server.client().await;
    let get = |k: &'static str| {
        let mut c = c.clone();
        async move {
            let keys: Vec<String> = redis::cmd("KEYS").arg(k).query_async(&mut c).await.unwrap();
            let v: u64 = redis::cmd("GET").arg(&keys[0]).query_async(&mut c).await.unwrap();
            v
        }
    };
    assert_eq!(get("rb:{t50}:k:5:tpd:*").await, 400);
    assert_eq!(get("rb:{t50}:t:50:tpd:*").await, 500);
    assert_eq!(get("rb:{t50}:t:50:tpmo:*").await, 1_200);
    // Raising only: a counter that holds more keeps it.
    l.charge_at(&p, 1_000, T0).await;
    l.restore_at(&usage, T0).await;
    assert_eq!(get("rb:{t50}:k:5:tpmo:*").await, 2_100);
    let _ = redis::cmd("PING").query_async::<String>(&mut c).await;
    assert_eq!(l.backend_errors(), 0);
}

/// Issue 14, point 1: per-minute limits are rates (GCRA) in Redis as in
/// process: a burst at the end of one wall-clock minute and another at the
/// start of the next together fit the limit.
#[tokio::test]
async fn a_burst_across_a_minute_edge_cannot_exceed_the_limit_in_redis_or_in_process() {
    let server = RedisServer::start();
    let mut limiters = vec![("memory", Limiter::in_process())];
    if let Some(s) = &server {
        limiters.push(("redis", Limiter::redis(&s.url(), options("edge:")).await.unwrap()));
    }
    let edge = T0 - T0.rem_euclid(60_000) + 60_000;
    for (name, l) in limiters {
        let p = principal(1, 10, rpm(10), Limits::default());
        let mut admitted = 0;
        for t in [edge - 500, edge - 1, edge, edge + 1, edge + 500] {
            for _ in 0..20 {
                admitted += u32::from(l.admit_at(&p, 0, t).await.is_ok());
            }
        }
        assert_eq!(admitted, 10, "{name}: no second burst after the edge");
        // Then one request per 6 s, and never more than 10 in any minute.
        let mut times = Vec::new();
        for step in 0..240 {
            let t = edge + 500 + step * 500;
            if l.admit_at(&p, 0, t).await.is_ok() {
                times.push(t);
            }
        }
        assert_eq!(times.first(), Some(&(edge - 500 + 6_000)), "{name}");
        assert!(times.windows(2).all(|w| w[1] - w[0] >= 6_000), "{name}: {times:?}");
        // Tokens: 1000 taken just before the edge leave what one second
        // drained (16 of 1000) just after it.
        let q = principal(2, 20, Limits { tokens_per_minute: Some(1_000), ..Limits::default() }, Limits::default());
        l.reserve_at(&q, 10, 1_000, edge - 500).await.unwrap();
        let tokens = l.admit_at(&q, 0, edge + 500).await.unwrap().tokens.unwrap();
        assert_eq!(
            (tokens.limit, tokens.remaining, tokens.reset),
            (1_000, 16, Duration::from_millis(59_040)),
            "{name}"
        );
        assert_eq!(l.backend_errors(), 0);
    }
}

/// Issue 14, point 2: on Redis Cluster every script call must name keys of
/// one hash slot (else `CROSSSLOT`, and the limiter would fail open). A
/// cluster-enabled server owning every slot enforces that rule, so the
/// limiter's calls must all succeed there: admission with reservation,
/// settlement, charge and the budget restore.
#[tokio::test]
async fn every_limiter_call_stays_in_one_cluster_slot() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = dir.path().join("nodes.conf");
    let port = free_port();
    let Some(server) =
        RedisServer::start_with(port, &["--cluster-enabled", "yes", "--cluster-config-file", nodes.to_str().unwrap()])
    else {
        return;
    };
    let mut c = server.client().await;
    let _: () = redis::cmd("CLUSTER").arg("ADDSLOTSRANGE").arg(0).arg(16383).query_async(&mut c).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await.unwrap();
        if info.contains("cluster_state:ok") {
            break;
        }
        assert!(Instant::now() < deadline, "the one-node cluster did not come up: {info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Keys of two slots in one script are refused here, as on any cluster.
    let cross: redis::RedisResult<i64> = redis::cmd("EVAL")
        .arg("return redis.call('EXISTS', KEYS[1], KEYS[2])")
        .arg(2)
        .arg("a")
        .arg("b")
        .query_async(&mut c)
        .await;
    assert!(cross.is_err(), "the server does not check slots: {cross:?}");

    let l = Limiter::redis(&server.url(), options("granary:limits:")).await.unwrap();
    let all = Limits {
        requests_per_minute: Some(3),
        tokens_per_minute: Some(10_000),
        tokens_per_day: Some(10_000),
        tokens_per_month: Some(100_000),
        ..Limits::default()
    };
    let p = principal(42, 4, all.clone(), all);
    for _ in 0..3 {
        let r = l.reserve_at(&p, 10, 100, T0).await.unwrap();
        l.settle(&p, &r, 60).await;
    }
    l.charge_at(&p, 5, T0).await;
    let usage = [granary_gateway::identity::DailyUsage {
        tenant_id: 4,
        key_id: 42,
        day_ms: T0 - T0 % 86_400_000,
        tokens: 500,
        spend: Money(0),
    }];
    l.restore_at(&usage, T0).await;
    assert_eq!(l.backend_errors(), 0, "a call named keys of more than one slot");
    let r = l.admit_at(&p, 0, T0).await.unwrap_err();
    assert_eq!(r.limit, "requests_per_minute");
}

/// Issue 14, point 2: a real Redis Cluster of three masters, made by the
/// test with `redis-server --cluster-enabled yes` and `redis-cli --cluster
/// create`. Two limiters given the seed nodes (comma-separated URLs)
/// enforce limits together for tenants whose keys live on different
/// masters, with no error from any call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_limits_hold_on_a_redis_cluster_of_three_masters() {
    let dir = tempfile::tempdir().unwrap();
    let mut servers = Vec::new();
    for i in 0..3 {
        let nodes = dir.path().join(format!("nodes-{i}.conf"));
        let args = ["--cluster-enabled", "yes", "--cluster-config-file", nodes.to_str().unwrap()];
        let Some(s) = RedisServer::start_with(free_port(), &args) else { return };
        servers.push(s);
    }
    let addrs: Vec<String> = servers.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
    let created = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli runs");
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stdout));
    for s in &servers {
        let mut c = s.client().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await.unwrap();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(Instant::now() < deadline, "the cluster did not come up: {info}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let urls = servers.iter().map(|s| s.url()).collect::<Vec<_>>().join(",");
    let a = Limiter::redis(&urls, options("granary:limits:")).await.unwrap();
    let b = Limiter::redis(&urls, options("granary:limits:")).await.unwrap();
    // Twelve tenants, each allowed 3 requests a minute across both limiters.
    for tenant in 1..=12 {
        let p = principal(100 + tenant, tenant, rpm(1000), rpm(3));
        let mut admitted = 0;
        for limiter in [&a, &b, &a, &b, &a] {
            if limiter.admit_at(&p, 0, T0).await.is_ok() {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 3, "tenant {tenant}");
    }
    assert_eq!((a.backend_errors(), b.backend_errors()), (0, 0), "every call reached the right master");
    // The tenants' keys are spread over the masters, not all on one.
    let mut holding = 0;
    for s in &servers {
        let n: i64 = redis::cmd("DBSIZE").query_async(&mut s.client().await).await.unwrap();
        holding += usize::from(n > 0);
    }
    assert!(holding >= 2, "keys on {holding} master(s)");
}

/// Issue 14, point 2: budgets in currency, in Redis (two gateways) as in
/// process: the worst-case cost is reserved at admission, settled to the
/// real cost, refused outright when over the budget on its own, and rebuilt
/// from the priced usage rollup; tokens and spend move independently.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn issue_14_spend_budgets_reserve_settle_and_restore_in_redis_and_in_process() {
    use granary_gateway::identity::DailyUsage;
    use granary_gateway::limits::Ask;
    let Some(server) = RedisServer::start() else { return };
    let a = Limiter::redis(&server.url(), options("sp:")).await.unwrap();
    let b = Limiter::redis(&server.url(), options("sp:")).await.unwrap();
    let mem = Limiter::in_process();
    let ask = |worst: u64| Ask { estimate: 10, tokens: 100, spend_estimate: Money(worst / 2), spend: Money(worst) };
    for (name, one, two) in [("redis", &a, &b), ("memory", &mem, &mem)] {
        // A tenant with 1.0 a day; each request may cost up to 0.15.
        let budget =
            Limits { spend_per_day: Some(Money(1_000_000)), tokens_per_day: Some(1_000_000), ..Limits::default() };
        let p = principal(9, 90, Limits::default(), budget);
        let mut tasks = Vec::new();
        for i in 0..40 {
            let (l, p) = (if i % 2 == 0 { one.clone() } else { two.clone() }, p.clone());
            tasks.push(tokio::spawn(async move { l.reserve_ask_at(&p, ask(150_000), T0).await }));
        }
        let mut admitted = Vec::new();
        let mut refused = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(r) => admitted.push(r),
                Err(e) => refused.push(e),
            }
        }
        // 0, 0.15, ..., 0.9 are under 1.0: 7 admitted, 1.05 reserved.
        assert_eq!(admitted.len(), 7, "{name}");
        assert!(admitted.iter().all(|r| r.spend == Money(150_000) && r.tokens == 100), "{name}");
        let e = &refused[0];
        assert_eq!((e.limit, e.scope, e.max, e.used), ("spend_per_day", Scope::Tenant, 1_000_000, 1_050_000), "{name}");
        let api = e.to_api_error();
        assert_eq!((api.code, api.param.as_deref()), (Some("insufficient_quota"), Some("tenant.spend_per_day")));
        assert!(api.message.contains("1.05 used"), "{name}: {}", api.message);
        // Each really cost 0.05: 0.7 comes back; the tokens settle on their own.
        for r in &admitted {
            one.settle_spend(&p, r, 40, Money(50_000)).await;
        }
        let mut more = 0;
        while one.reserve_ask_at(&p, ask(150_000), T0).await.is_ok() {
            more += 1;
        }
        assert_eq!(more, 5, "{name}: 0.35 spent: 0.35, 0.5, ..., 0.95 are under 1.0");
        // Over the budget on its own (the estimate, not the reservation).
        let fresh = principal(10, 91, Limits::default(), p.tenant_limits.clone());
        let e = two.reserve_ask_at(&fresh, ask(2_400_000), T0).await.unwrap_err();
        assert_eq!((e.limit, e.used), ("spend_per_day", 0), "{name}");
        assert!(e.to_api_error().message.contains("worst-case cost"), "{name}");
        // Tokens are counted apart: 7 × 40 + 5 × 100 of the tokens budget.
        let t = principal(9, 90, Limits::default(), Limits { tokens_per_day: Some(781), ..Limits::default() });
        assert_eq!(one.reserve_at(&t, 0, 1, T0).await.map(|r| r.tokens), Ok(1), "{name}: 780 < 781");
        assert_eq!(one.reserve_at(&t, 0, 1, T0).await.unwrap_err().limit, "tokens_per_day", "{name}");
        // Rebuilt from the rollup: a fresh tenant whose day cost 0.99.
        let q = principal(11, 92, Limits::default(), p.tenant_limits.clone());
        let day = T0 - T0.rem_euclid(86_400_000);
        one.restore_at(&[DailyUsage { tenant_id: 92, key_id: 11, day_ms: day, tokens: 5, spend: Money(990_000) }], T0)
            .await;
        assert!(two.reserve_ask_at(&q, ask(10_000), T0).await.is_ok(), "{name}: 0.99 is under 1.0");
        let e = two.reserve_ask_at(&q, ask(10_000), T0).await.unwrap_err();
        assert_eq!((e.limit, e.used), ("spend_per_day", 1_000_000), "{name}");
    }
    assert_eq!((a.backend_errors(), b.backend_errors()), (0, 0));
}
