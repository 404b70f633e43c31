//! `resp`: the warehouse's RESP server next to a real Redis.
//!
//! Starts the real `granary warehouse` process (this executable) and a real
//! `redis-server` with persistence off, checks that both answer PING, then
//! drives each identically with `redis-benchmark` (SET then GET, 16
//! clients, random keys over a keyspace of about 1 GiB of values: `-r`)
//! for 64 KiB, 1 MiB and 4 MiB values, and reads requests per second and
//! p50/p99 latency from its CSV output. Each size runs three rounds per
//! server, alternating which server goes first, and reports the median
//! round (req/s, p50 and p99 each) with the spread of req/s. SET and GET
//! are separate `redis-benchmark` runs, so that each has its own CPU
//! figures: the client's share of a core (near 100 % the client, not the
//! server, sets the pace) and the server's CPU time per request.
//!
//! A third server, the ceiling (`ceiling.rs`: a RESP server that does no
//! work), takes the same runs in the same rotation. Its req/s is the most
//! this client reaches on this host; each goal's line gives it beside the
//! goal's ratio, so a goal no server could meet with this client here reads
//! as such.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;

use super::report::{bar, size_label, Goal, Table};
use super::{Ctx, Unavailable};
use crate::bench::child::process_cpu_s;

const CLIENTS: u32 = 16;
/// Rounds per server and size (one with `--quick`).
const ROUNDS: usize = 3;
/// Bytes of values the random keys of one run cover.
const KEYSPACE_BYTES: u64 = 1 << 30;
const GOAL_SIZE: u64 = 1 << 20;
/// A client using this share of a core (of each of its threads) or more is
/// what limits the rate.
const CLIENT_BOUND: f64 = 0.95;

#[derive(Debug, Clone, Serialize)]
pub struct RespRow {
    pub value_bytes: u64,
    pub op: String,
    pub server: &'static str,
    pub requests: u64,
    pub rps: f64,
    pub gbps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Rounds behind the medians, and the lowest and highest round's req/s.
    pub rounds: usize,
    pub rps_min: f64,
    pub rps_max: f64,
    /// Distinct keys the requests were spread over (`redis-benchmark -r`).
    pub keyspace: u64,
    /// The client's CPU time over the run's wall time (1.0 = one core busy).
    pub client_cpu: f64,
    /// The server's CPU time (all its threads) per request, microseconds.
    pub server_us_per_req: f64,
    /// granary / redis, on the granary row.
    pub rps_ratio: Option<f64>,
    pub p99_ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct RespReport {
    pub redis_version: String,
    pub clients: u32,
    /// `redis-benchmark --threads` (1: its default single thread).
    pub client_threads: usize,
    pub rows: Vec<RespRow>,
    /// Why granary's server could not be measured (the Redis rows stand alone).
    pub granary_error: Option<String>,
    /// Why the zero-work server could not be measured (no ceiling rows).
    pub ceiling_error: Option<String>,
    /// One MSET, then one MGET, of many large values (`multi.rs`).
    pub multi: Vec<super::multi::MultiRow>,
}

/// A child process stopped (SIGTERM, then SIGKILL) when dropped.
struct Proc {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Result<(Proc, mpsc::Receiver<String>)> {
        let program = cmd.get_program().to_string_lossy().into_owned();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let _ = tx.send(line);
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let tail = stderr.clone();
        let err = child.stderr.take().expect("piped stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(|l| l.ok()) {
                let mut t = tail.lock().expect("stderr tail");
                t.push(line);
                if t.len() > 20 {
                    t.remove(0);
                }
            }
        });
        Ok((Proc { child, stderr }, rx))
    }

    fn stderr_tail(&self) -> String {
        self.stderr.lock().expect("stderr tail").join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sizes and request counts: a few seconds per case on a small host.
fn cases(quick: bool) -> [(u64, u64); 3] {
    if quick {
        [(64 << 10, 1_000), (1 << 20, 200), (4 << 20, 50)]
    } else {
        [(64 << 10, 100_000), (1 << 20, 5_000), (4 << 20, 1_000)]
    }
}

pub fn run(ctx: &Ctx) -> Result<RespReport> {
    let redis_version = tool_version("redis-server", "--version")
        .map_err(|e| Unavailable(format!("redis-server not runnable ({e:#}); install Redis 7.x to run this part")))?;
    tool_version("redis-benchmark", "--version")
        .map_err(|e| Unavailable(format!("redis-benchmark not runnable ({e:#}); it ships with Redis 7.x")))?;
    if !redis_version.contains("v=7.") {
        eprintln!("resp: expected Redis 7.x, found {redis_version}; continuing");
    }

    // Redis is measured even when granary's server cannot be, so that the
    // anchor's figures are on record either way.
    let (redis, redis_port) = start_redis()?;
    let granary = start_granary();
    let granary_error = granary.as_ref().err().map(|e| format!("{e:#}"));
    if let Some(e) = &granary_error {
        eprintln!("resp: granary not measured: {e}");
    }

    let ceiling = start_ceiling();
    let ceiling_error = ceiling.as_ref().err().map(|e| format!("{e:#}"));
    if let Some(e) = &ceiling_error {
        eprintln!("resp: the zero-work server not measured: {e}");
    }

    let cases = cases(ctx.quick);
    let rounds = if ctx.quick { 1 } else { ROUNDS };
    // (name, process and port), in the order of the first round.
    let mut servers: Vec<(&'static str, &Proc, u16)> = vec![("redis", &redis, redis_port)];
    for (name, s) in [("granary", &granary), ("ceiling", &ceiling)] {
        if let Ok((proc, port)) = s {
            servers.push((name, proc, *port));
        }
    }
    let pb = bar((cases.len() * servers.len() * rounds) as u64, "resp");
    let mut rows = Vec::new();
    for (size, n) in cases {
        let mut runs: Vec<Vec<Vec<Measured>>> = vec![Vec::new(); servers.len()];
        for round in 0..rounds {
            // Each round starts with the next server, so none always gets the warmer machine.
            for k in 0..servers.len() {
                let at = (k + round) % servers.len();
                let (name, proc, port) = servers[at];
                pb.set_message(format!("{} x{n} against {name}, round {}", size_label(size), round + 1));
                let m = redis_benchmark(port, proc.child.id(), size, n, ctx.client_threads)
                    .with_context(|| format!("{name}: {}", proc.stderr_tail()))?;
                runs[at].push(m);
                pb.inc(1);
            }
        }
        let summaries: Vec<Vec<Summary>> = runs.iter().map(|r| medians(r)).collect();
        let anchor = &summaries[0];
        let row = |server, m: &Summary, anchor: Option<&Summary>| RespRow {
            value_bytes: size,
            op: m.op.clone(),
            server,
            requests: n,
            rps: m.rps,
            gbps: m.rps * size as f64 / 1e9,
            p50_ms: m.p50,
            p99_ms: m.p99,
            rounds: m.rounds,
            rps_min: m.rps_min,
            rps_max: m.rps_max,
            keyspace: keyspace(size),
            client_cpu: m.client_cpu,
            server_us_per_req: m.server_us,
            rps_ratio: anchor.map(|a| m.rps / a.rps),
            p99_ratio: anchor.map(|a| m.p99 / a.p99),
        };
        // Each redis row, then the others' rows for the same op.
        for r in anchor {
            rows.push(row("redis", r, None));
            for ((name, _, _), of) in servers.iter().zip(&summaries).skip(1) {
                if let Some(g) = of.iter().find(|g| g.op == r.op) {
                    rows.push(row(*name, g, Some(r)));
                }
            }
        }
    }
    pb.finish_and_clear();
    // The multi-key row: Redis and granary only (the zero-work server
    // cannot answer MGET).
    let pair: Vec<(&'static str, u16)> =
        servers.iter().filter(|(name, ..)| *name != "ceiling").map(|(name, _, port)| (*name, *port)).collect();
    eprintln!("resp: MSET/MGET of large values, {rounds} round(s) per server");
    let multi = super::multi::measure(&pair, ctx.quick, rounds)?;
    drop(servers);
    drop(ceiling);
    drop(granary);
    drop(redis);
    Ok(RespReport {
        redis_version,
        clients: CLIENTS,
        client_threads: ctx.client_threads,
        rows,
        granary_error,
        ceiling_error,
        multi,
    })
}

fn tool_version(program: &str, flag: &str) -> Result<String> {
    let out = Command::new(program).arg(flag).output()?;
    ensure!(out.status.success(), "{program} {flag} failed");
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Starts this executable as `granary warehouse` on an OS-chosen port and
/// waits for its `ready` line; the RESP address it printed.
fn start_granary() -> Result<(Proc, u16)> {
    let mut cmd = Command::new(std::env::current_exe().context("locating the granary executable")?);
    cmd.args(["warehouse", "--resp", "127.0.0.1:0", "--http", "off", "--memory", "8GiB"]).env("GRANARY_LOG", "warn");
    let (proc, lines) = Proc::spawn(cmd)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut addr = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if let Some(a) = line.strip_prefix("granary warehouse: resp listening on ") {
                    addr = Some(a.trim().to_string());
                } else if line.trim() == "granary warehouse: ready" {
                    break;
                }
            }
            Err(_) => bail!("granary warehouse did not print `ready` within 30 s: {}", proc.stderr_tail()),
        }
    }
    let addr = addr.context("granary warehouse printed no `resp listening on` line")?;
    ping(&addr, Duration::from_secs(5)).with_context(|| format!("granary's RESP server at {addr}"))?;
    let port = addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).context("granary's RESP port")?;
    Ok((proc, port))
}

/// Starts this executable's zero-work RESP server (`ceiling.rs`) and waits
/// for its address.
fn start_ceiling() -> Result<(Proc, u16)> {
    let mut cmd = Command::new(std::env::current_exe().context("locating the granary executable")?);
    cmd.args(["bench", "warehouse", "--serve-ceiling"]);
    let (proc, lines) = Proc::spawn(cmd)?;
    let line = lines
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| anyhow::anyhow!("the zero-work server printed no address: {}", proc.stderr_tail()))?;
    let addr = line.strip_prefix(super::ceiling::LISTENING).context("the zero-work server's first line")?.trim();
    ping(addr, Duration::from_secs(5)).with_context(|| format!("the zero-work server at {addr}"))?;
    let port = addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).context("the zero-work server's port")?;
    Ok((proc, port))
}

/// Starts `redis-server` without persistence on a free port.
fn start_redis() -> Result<(Proc, u16)> {
    // redis-server takes a port number, not a listener: find a free one.
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut cmd = Command::new("redis-server");
    cmd.args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1", "--port", &port.to_string()]);
    let (proc, _lines) = Proc::spawn(cmd)?;
    let addr = format!("127.0.0.1:{port}");
    ping(&addr, Duration::from_secs(10)).with_context(|| format!("redis-server at {addr}: {}", proc.stderr_tail()))?;
    Ok((proc, port))
}

/// Sends PING until `+PONG` comes back or `within` passes.
fn ping(addr: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        let attempt = || -> Result<()> {
            let mut s = TcpStream::connect(addr)?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(b"*1\r\n$4\r\nPING\r\n")?;
            let mut buf = [0u8; 7];
            s.read_exact(&mut buf)?;
            ensure!(&buf == b"+PONG\r\n", "answered {:?}", String::from_utf8_lossy(&buf));
            Ok(())
        };
        match attempt() {
            Ok(()) => return Ok(()),
            Err(e) => last = format!("{e:#}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("no PONG within {} s (last: {last})", within.as_secs())
}

/// One test's result.
#[derive(Debug, Clone, PartialEq)]
struct Measured {
    op: String,
    rps: f64,
    p50: f64,
    p99: f64,
    /// Client CPU time / wall time.
    client_cpu: f64,
    /// Server CPU microseconds per request.
    server_us: f64,
}

/// Distinct keys for values of `size`: about [`KEYSPACE_BYTES`] of them.
fn keyspace(size: u64) -> u64 {
    (KEYSPACE_BYTES / size.max(1)).clamp(1, 100_000)
}

/// The median round of one op (each figure's own median) and the spread of req/s.
#[derive(Debug, Clone, PartialEq)]
struct Summary {
    op: String,
    rps: f64,
    p50: f64,
    p99: f64,
    rounds: usize,
    rps_min: f64,
    rps_max: f64,
    client_cpu: f64,
    server_us: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Per op (in the first round's order), the medians over `runs`.
fn medians(runs: &[Vec<Measured>]) -> Vec<Summary> {
    let Some(first) = runs.first() else { return Vec::new() };
    first
        .iter()
        .map(|Measured { op, .. }| {
            let of = |f: fn(&Measured) -> f64| -> Vec<f64> {
                runs.iter().filter_map(|r| r.iter().find(|m| &m.op == op)).map(f).collect()
            };
            let rps = of(|m| m.rps);
            Summary {
                op: op.clone(),
                rounds: rps.len(),
                rps_min: rps.iter().copied().fold(f64::INFINITY, f64::min),
                rps_max: rps.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                rps: median(rps),
                p50: median(of(|m| m.p50)),
                p99: median(of(|m| m.p99)),
                client_cpu: median(of(|m| m.client_cpu)),
                server_us: median(of(|m| m.server_us)),
            }
        })
        .collect()
}

/// SET then GET, one `redis-benchmark` run each, against the server on
/// `port` whose process is `server_pid`.
fn redis_benchmark(port: u16, server_pid: u32, size: u64, n: u64, threads: usize) -> Result<Vec<Measured>> {
    ["set", "get"].into_iter().map(|test| redis_benchmark_one(port, server_pid, test, size, n, threads)).collect()
}

/// CPU time this process's waited-for children have used, in seconds.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// One `redis-benchmark` run of one test, with its CPU figures.
fn redis_benchmark_one(port: u16, server_pid: u32, test: &str, size: u64, n: u64, threads: usize) -> Result<Measured> {
    let (client0, server0, t0) = (children_cpu_s(), process_cpu_s(server_pid), Instant::now());
    let threads = if threads > 1 { vec!["--threads".to_string(), threads.to_string()] } else { Vec::new() };
    let mut child = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", test, "-d", &size.to_string()])
        .args(["-c", &CLIENTS.to_string(), "-n", &n.to_string(), "-r", &keyspace(size).to_string(), "--csv"])
        .args(threads)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting redis-benchmark")?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("redis-benchmark ran past 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = reader.join().unwrap_or_default();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let (wall, server_cpu, client_cpu) =
        (t0.elapsed().as_secs_f64(), process_cpu_s(server_pid) - server0, children_cpu_s() - client0);
    ensure!(status.success(), "redis-benchmark failed ({status}): {}{}", out.trim(), err.trim());
    let mut rows = parse_csv(&out)?;
    ensure!(rows.len() == 1, "redis-benchmark printed {} result rows, expected one for {test}:\n{out}", rows.len());
    let mut m = rows.remove(0);
    m.client_cpu = client_cpu / wall;
    m.server_us = server_cpu * 1e6 / n as f64;
    Ok(m)
}

fn parse_csv(out: &str) -> Result<Vec<Measured>> {
    let split = |l: &str| l.split(',').map(|f| f.trim().trim_matches('"').to_string()).collect::<Vec<_>>();
    let mut lines = out.lines().map(str::trim).filter(|l| l.starts_with('"'));
    let header = split(lines.next().context("redis-benchmark printed no CSV header")?);
    let col = |name: &str| header.iter().position(|h| h == name).with_context(|| format!("CSV lacks column {name}"));
    let (test, rps, p50, p99) = (col("test")?, col("rps")?, col("p50_latency_ms")?, col("p99_latency_ms")?);
    lines
        .map(|l| {
            let f = split(l);
            let num = |i: usize| -> Result<f64> {
                f.get(i).context("short CSV row")?.parse::<f64>().with_context(|| format!("bad number in {l}"))
            };
            Ok(Measured {
                op: f.get(test).context("short CSV row")?.clone(),
                rps: num(rps)?,
                p50: num(p50)?,
                p99: num(p99)?,
                client_cpu: f64::NAN,
                server_us: f64::NAN,
            })
        })
        .collect()
}

pub fn tables(r: &RespReport) -> Vec<Table> {
    let mut t = Table::new(
        format!(
            "resp: redis-benchmark -t set, then -t get, -c {}{} -r <keys> against granary, {} (persistence off) and a zero-work server (ceiling: the most this client reaches here); medians of rotating rounds",
            r.clients,
            if r.client_threads > 1 { format!(" --threads {}", r.client_threads) } else { String::new() },
            r.redis_version.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
        ),
        &[
            "size",
            "op",
            "server",
            "keys",
            "requests",
            "rounds",
            "req/s",
            "req/s range",
            "GB/s",
            "p50 ms",
            "p99 ms",
            "req/s ratio",
            "p99 ratio",
            "client CPU",
            "server µs/req",
        ],
    );
    for row in &r.rows {
        t.row(vec![
            size_label(row.value_bytes),
            row.op.clone(),
            row.server.to_string(),
            row.keyspace.to_string(),
            row.requests.to_string(),
            row.rounds.to_string(),
            format!("{:.0}", row.rps),
            format!("{:.0}-{:.0}", row.rps_min, row.rps_max),
            format!("{:.3}", row.gbps),
            format!("{:.3}", row.p50_ms),
            format!("{:.3}", row.p99_ms),
            row.rps_ratio.map_or_else(|| "anchor".into(), |x| format!("{x:.2}x")),
            row.p99_ratio.map_or_else(|| "anchor".into(), |x| format!("{x:.2}x")),
            format!("{:.0}%", row.client_cpu * 100.0),
            format!("{:.0}", row.server_us_per_req),
        ]);
    }
    vec![t, super::multi::table(&r.multi)]
}

pub fn goals(r: &RespReport) -> Vec<Goal> {
    let mut out = benchmark_goals(r);
    out.extend(super::multi::goals(&r.multi, r.granary_error.as_deref()));
    out
}

fn benchmark_goals(r: &RespReport) -> Vec<Goal> {
    // (value size, op, req/s against Redis, p99 no worse too)
    const GOALS: [(u64, &str, f64, bool); 3] =
        [(GOAL_SIZE, "GET", 1.5, true), (4 << 20, "GET", 2.0, true), (64 << 10, "SET", 1.0, false)];
    GOALS
        .iter()
        .map(|&(size, op, want, p99)| {
            let goal = format!(
                "{} {op}: granary >= {want:.1}x Redis req/s{}",
                size_label(size),
                if p99 { ", p99 no worse" } else { "" }
            );
            let find = |server: &str| r.rows.iter().find(|x| x.value_bytes == size && x.op == op && x.server == server);
            match (find("granary"), find("redis")) {
                (Some(g), Some(a)) => {
                    let ratio = g.rps / a.rps;
                    let ceiling = find("ceiling").map_or_else(String::new, |c| {
                        let most = c.rps / a.rps;
                        format!(
                            "; a zero-work server {:.0} req/s ({most:.2}x){}",
                            c.rps,
                            if most < want && ratio < want { ": beyond this client on this host" } else { "" }
                        )
                    });
                    Goal::new(
                        "resp",
                        goal,
                        ratio >= want && (!p99 || g.p99_ms <= a.p99_ms),
                        format!(
                            "{:.0} vs {:.0} req/s ({ratio:.2}x), p99 {:.2} vs {:.2} ms; server CPU {:.0} vs {:.0} µs/req, \
                             client CPU {:.0}% / {:.0}% of a core{}{ceiling}",
                            g.rps,
                            a.rps,
                            g.p99_ms,
                            a.p99_ms,
                            g.server_us_per_req,
                            a.server_us_per_req,
                            g.client_cpu * 100.0,
                            a.client_cpu * 100.0,
                            if g.client_cpu.min(a.client_cpu) >= CLIENT_BOUND * r.client_threads as f64 { " (client-bound)" } else { "" }
                        ),
                    )
                }
                _ => Goal::unmeasured("resp", goal, r.granary_error.as_deref().unwrap_or("no rows for this size")),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_csv() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                   \"SET\",\"1458.79\",\"7.136\",\"0.592\",\"7.151\",\"11.431\",\"19.583\",\"37.119\"\n\
                   \"GET\",\"1063.26\",\"6.977\",\"0.352\",\"6.239\",\"15.863\",\"18.863\",\"21.471\"\n";
        let rows = parse_csv(out).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].op.as_str(), rows[1].rps, rows[1].p50, rows[1].p99), ("GET", 1063.26, 6.239, 18.863));
    }

    #[test]
    fn rounds_are_summarised_by_their_medians_and_spread() {
        let m = |op: &str, rps: f64, p50: f64, p99: f64| Measured {
            op: op.to_string(),
            rps,
            p50,
            p99,
            client_cpu: rps / 400.0,
            server_us: 1e6 / rps,
        };
        let run = |rps: f64, p99: f64| vec![m("SET", rps / 2.0, 1.0, p99), m("GET", rps, 0.5, p99)];
        let s = medians(&[run(100.0, 9.0), run(300.0, 3.0), run(200.0, 5.0)]);
        assert_eq!(s.len(), 2);
        let get = &s[1];
        assert_eq!((get.op.as_str(), get.rps, get.p99, get.rounds), ("GET", 200.0, 5.0, 3));
        assert_eq!((get.rps_min, get.rps_max), (100.0, 300.0));
        assert_eq!((get.client_cpu, get.server_us), (0.5, 5000.0));
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(keyspace(1 << 20), 1024);
        assert_eq!(keyspace(1), 100_000);
    }

    #[test]
    fn cpu_time_of_this_process_and_of_waited_children_is_read() {
        let me = std::process::id();
        let before = process_cpu_s(me);
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(200) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
        }
        let used = process_cpu_s(me) - before;
        assert!(used >= 0.1, "200 ms of spinning counted as {used} s");
        let c0 = children_cpu_s();
        let st = Command::new("sh").args(["-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"]).status().unwrap();
        assert!(st.success());
        assert!(children_cpu_s() > c0, "a waited-for child's CPU time was not counted");
    }
}
