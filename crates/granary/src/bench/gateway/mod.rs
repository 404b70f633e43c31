//! `granary bench gateway`: what the gateway adds to a request, against a
//! direct call and against nginx `proxy_pass`, in one run.
//!
//! One fast fixed upstream (an HTTP server answering every completion with
//! the same small JSON body, a process of its own) is reached four ways:
//! directly, through the gateway (the real `granary gateway` process, with
//! everything on: key check against its SQLite database, per-key and
//! per-tenant limits, metrics, an audit record per request, routing),
//! through nginx (`proxy_pass` with upstream keep-alive, access log off),
//! the anchor, and through a bare hyper proxy ([`floor`]: the gateway's
//! HTTP stack, hyper's server and the gateway's upstream pool, doing
//! nothing else). The proxies get the same number of
//! threads (`--workers`: runtime threads, nginx's worker processes); this
//! process is the client of all and pays the same cost for each.
//!
//! Latency: one client, sequential requests, p50/p99 after a warm-up; added
//! latency is each path's percentile minus the direct one's in the same
//! round. Throughput: `--connections` clients as fast as they can for
//! `--seconds`. `--rounds` alternating rounds (the order of the paths turns
//! each round); the report gives each figure's median and its range.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args as ClapArgs;
use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::child::{process_cpu_s, Proc};
use super::llm::median;
use super::warehouse::report::{bar, command_line, utc_timestamp, Goal, Host, Table};

mod floor;

/// The path name of the bare hyper proxy.
const FLOOR: &str = "bare hyper proxy";

const ADMIN: &str = "bench-admin-token-0123456789";
const ADDED_P50_GOAL_MS: f64 = 0.1;
const ADDED_P99_GOAL_MS: f64 = 2.0;
const THROUGHPUT_GOAL: f64 = 1.0;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Sequential requests per path and round for the latency percentiles.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Concurrent clients for the throughput run.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Seconds of the throughput run per path and round.
    #[arg(long, default_value_t = 4)]
    seconds: u64,
    /// Alternating rounds over the three paths.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Threads of the gateway's runtime and nginx's worker processes (the same).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The nginx binary (the anchor); skipped when missing.
    #[arg(long, default_value = "nginx")]
    nginx: String,
    /// Write the figures as JSON here, and a chart beside it.
    #[arg(long, default_value = "bench-out/gateway")]
    out: PathBuf,
    /// Serve the fixed upstream on `127.0.0.1:0` and print its address (the
    /// benchmark starts itself this way).
    #[arg(long, hide = true)]
    serve_upstream: bool,
    /// Serve the bare hyper proxy in front of this upstream and print its
    /// address (the benchmark starts itself this way).
    #[arg(long, hide = true)]
    serve_floor: Option<SocketAddr>,
}

struct Path {
    name: &'static str,
    url: String,
    key: Option<String>,
    /// The proxy's processes (nginx: its master and workers), whose CPU
    /// time is read around the throughput run; none for the direct path.
    pids: Vec<u32>,
}

#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Measured {
    p50_ms: f64,
    p99_ms: f64,
    rps: f64,
    /// The proxy's CPU time (user + system) per request of the throughput
    /// run, in microseconds.
    proxy_cpu_us: Option<f64>,
}

/// CPU seconds the processes have used so far.
fn cpu_s(pids: &[u32]) -> f64 {
    pids.iter().map(|&p| process_cpu_s(p)).sum()
}

const BODY: &str = r#"{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;

/// The fixed upstream, served until the process is killed.
async fn serve_upstream() -> Result<()> {
    let answer = json!({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}
    });
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async { Json(json!({"object": "list", "data": [{"id": "bench", "object": "model"}]})) }),
        )
        .route("/v1/chat/completions", post(move || async move { Json(answer.clone()) }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("granary: upstream on http://{}", l.local_addr()?);
    println!("granary: ready");
    axum::serve(l, app).await?;
    Ok(())
}

/// nginx, stopped when dropped: SIGTERM to the master, which stops its
/// workers (a SIGKILL would leave them running, orphaned), and SIGKILL only
/// if it has not exited within five seconds.
struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            // SAFETY: `kill` on our own child's pid, which we have not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.0.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn upstream() -> Result<(Proc, SocketAddr)> {
    let args = ["bench", "gateway", "--serve-upstream"].map(String::from);
    let p = Proc::start("fixed upstream", &args, &[], "granary: upstream on ", "granary: ready")?;
    let addr = p.base.trim_start_matches("http://").parse()?;
    Ok((p, addr))
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The real `granary gateway` in front of the upstream, with a tenant and
/// a key whose limits are high enough never to refuse (so that the limit
/// checks run on every request).
async fn gateway(up: SocketAddr, dir: &std::path::Path, workers: usize) -> Result<(Proc, SocketAddr, String)> {
    let conf = format!(
        "[gateway]\nlisten = \"127.0.0.1:0\"\ndatabase = \"sqlite://{}\"\n\n\
         [[upstream]]\nname = \"fixed\"\nurl = \"http://{up}\"\nkv_events = false\ngranary = false\n",
        dir.join("gateway.db").display()
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, conf)?;
    let args = ["gateway".to_string(), "--config".into(), path.display().to_string()];
    let threads = workers.to_string();
    let envs = [("GRANARY_ADMIN_TOKEN", ADMIN), ("TOKIO_WORKER_THREADS", threads.as_str())];
    let p = Proc::start("gateway", &args, &envs, "granary: gateway on ", "granary: ready")?;
    let addr: SocketAddr = p.base.trim_start_matches("http://").parse()?;
    let http = reqwest::Client::new();
    let base = format!("http://{addr}");
    let limits = json!({"requests_per_minute": 100_000_000u64, "tokens_per_minute": 1_000_000_000u64});
    let t = http
        .post(format!("{base}/admin/v1/tenants"))
        .bearer_auth(ADMIN)
        .json(&json!({"name": "bench", "limits": limits}))
        .send()
        .await?;
    anyhow::ensure!(t.status().is_success(), "creating the bench tenant: {}", t.text().await?);
    let k: Value = http
        .post(format!("{base}/admin/v1/keys"))
        .bearer_auth(ADMIN)
        .json(&json!({"tenant": "bench", "limits": limits}))
        .send()
        .await?
        .json()
        .await?;
    let key = k["key"].as_str().context("no key in the admin API's answer")?.to_string();
    // Until the health check has found the upstream, requests get a 503.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(BODY)
            .send()
            .await?;
        if r.status().is_success() {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the gateway never answered: {}", r.text().await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((p, addr, key))
}

fn nginx(bin: &str, up: SocketAddr, dir: &std::path::Path, workers: usize) -> Result<(Nginx, SocketAddr)> {
    let port = free_port()?;
    let d = dir.display();
    let conf = format!(
        "worker_processes {workers};\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         upstream fixed {{ server {up}; keepalive 64; }}\n\
         server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://fixed;\n\
         proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf)?;
    let mut p = Nginx(
        Command::new(bin)
            .args(["-p", &d.to_string(), "-c", &path.display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {bin}"))?,
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(addr).is_err() {
        if let Some(st) = p.0.try_wait()? {
            anyhow::bail!("nginx exited: {st}");
        }
        anyhow::ensure!(Instant::now() < deadline, "nginx did not start listening on {addr}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((p, addr))
}

async fn one(http: &reqwest::Client, p: &Path) -> Result<()> {
    let mut r = http.post(&p.url).header("content-type", "application/json").body(BODY);
    if let Some(k) = &p.key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await?;
    let status = resp.status();
    let body = resp.bytes().await?;
    anyhow::ensure!(status.is_success(), "{}: status {status}: {}", p.name, String::from_utf8_lossy(&body));
    Ok(())
}

async fn measure(p: &Path, args: &Args, round: usize) -> Result<Measured> {
    let http = reqwest::Client::builder().tcp_nodelay(true).build()?;
    for _ in 0..200 {
        one(&http, p).await?;
    }
    let what = format!("round {}/{}: {}", round + 1, args.rounds, p.name);
    let pb = bar(args.requests as u64, &format!("{what} latency"));
    let mut h = Histogram::<u64>::new(3)?;
    for _ in 0..args.requests {
        let t = Instant::now();
        one(&http, p).await?;
        h.record(t.elapsed().as_nanos() as u64)?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(args.seconds);
    let pb = bar(args.seconds, &format!("{what} throughput"));
    let tasks: Vec<_> = (0..args.connections)
        .map(|_| {
            let (http, done, path) = (
                http.clone(),
                done.clone(),
                Path { name: p.name, url: p.url.clone(), key: p.key.clone(), pids: Vec::new() },
            );
            tokio::spawn(async move {
                while Instant::now() < end {
                    one(&http, &path).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    let (t0, cpu0) = (Instant::now(), cpu_s(&p.pids));
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_secs(1)).await;
        pb.inc(1);
    }
    for t in tasks {
        t.await??;
    }
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed) as f64;
    let cpu = cpu_s(&p.pids) - cpu0;
    Ok(Measured {
        p50_ms: h.value_at_quantile(0.5) as f64 / 1e6,
        p99_ms: h.value_at_quantile(0.99) as f64 / 1e6,
        rps: n / secs,
        proxy_cpu_us: (!p.pids.is_empty() && cpu.is_finite() && n > 0.0).then(|| cpu / n * 1e6),
    })
}

/// `median (lowest-highest)` of a figure over the rounds.
struct Spread {
    median: f64,
    lo: f64,
    hi: f64,
}

impl Spread {
    fn of(xs: &[f64]) -> Spread {
        Spread {
            median: median(xs),
            lo: xs.iter().copied().fold(f64::INFINITY, f64::min),
            hi: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    fn show(&self, decimals: usize) -> String {
        format!("{:.d$} ({:.d$}-{:.d$})", self.median, self.lo, self.hi, d = decimals)
    }
}

pub async fn run(args: Args) -> Result<()> {
    if args.serve_upstream {
        return serve_upstream().await;
    }
    if let Some(up) = args.serve_floor {
        return floor::serve(up).await;
    }
    anyhow::ensure!(args.rounds >= 1, "--rounds: at least 1");
    anyhow::ensure!(args.workers >= 1, "--workers: at least 1");
    let started = SystemTime::now();
    let host = Host::probe();
    let dir = tempfile::tempdir()?;
    let (up_proc, up) = upstream()?;
    let (gw_proc, gw, key) = gateway(up, dir.path(), args.workers).await?;
    let mut paths = vec![
        Path { name: "direct", url: format!("http://{up}/v1/chat/completions"), key: None, pids: Vec::new() },
        Path {
            name: "granary gateway",
            url: format!("http://{gw}/v1/chat/completions"),
            key: Some(key),
            pids: vec![gw_proc.pid()],
        },
    ];
    let nginx_dir = tempfile::tempdir()?;
    let nginx = match nginx(&args.nginx, up, nginx_dir.path(), args.workers) {
        Ok((n, addr)) => {
            paths.push(Path {
                name: "nginx proxy_pass",
                url: format!("http://{addr}/v1/chat/completions"),
                key: None,
                pids: super::soak::procs::with_descendants(&[n.0.id()]),
            });
            Some(n)
        }
        Err(e) => {
            eprintln!("nginx unavailable ({e:#}): the anchor is skipped");
            None
        }
    };
    let floor_args = ["bench".to_string(), "gateway".into(), "--serve-floor".into(), up.to_string()];
    let threads = args.workers.to_string();
    let floor_proc = Proc::start(
        FLOOR,
        &floor_args,
        &[("TOKIO_WORKER_THREADS", threads.as_str())],
        "granary: proxy on ",
        "granary: ready",
    )?;
    paths.push(Path {
        name: FLOOR,
        url: format!("{}/v1/chat/completions", floor_proc.base),
        key: None,
        pids: vec![floor_proc.pid()],
    });
    // rounds[r][path]
    let mut rounds: Vec<Vec<Measured>> = Vec::new();
    for r in 0..args.rounds {
        let mut got: Vec<Option<Measured>> = vec![None; paths.len()];
        for k in 0..paths.len() {
            let i = (k + r) % paths.len();
            let m = measure(&paths[i], &args, r).await.with_context(|| format!("measuring {}", paths[i].name))?;
            got[i] = Some(m);
        }
        rounds.push(got.into_iter().map(|m| m.expect("every path measured")).collect());
    }
    drop(nginx);
    drop(floor_proc);
    drop(gw_proc);
    drop(up_proc);

    let per_path = |i: usize, f: fn(&Measured) -> f64| -> Vec<f64> { rounds.iter().map(|r| f(&r[i])).collect() };
    let added =
        |i: usize, f: fn(&Measured) -> f64| -> Vec<f64> { rounds.iter().map(|r| f(&r[i]) - f(&r[0])).collect() };
    let nginx_at = paths.iter().position(|p| p.name == "nginx proxy_pass");
    let mut table = Table::new(
        format!("Gateway overhead: one fixed upstream (chat completion, ~300-byte answer); median (lowest-highest) over {} rounds", args.rounds),
        &["path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "req/s", "vs nginx", "proxy CPU µs/req"],
    );
    for (i, p) in paths.iter().enumerate() {
        let vs = match nginx_at {
            Some(n) => {
                let ratios: Vec<f64> = rounds.iter().map(|r| r[i].rps / r[n].rps).collect();
                let s = Spread::of(&ratios);
                format!("{:.2}x ({:.2}-{:.2})", s.median, s.lo, s.hi)
            }
            None => "-".into(),
        };
        table.row(vec![
            p.name.to_string(),
            Spread::of(&per_path(i, |m| m.p50_ms)).show(3),
            Spread::of(&per_path(i, |m| m.p99_ms)).show(3),
            if i == 0 { "-".into() } else { Spread::of(&added(i, |m| m.p50_ms)).show(3) },
            if i == 0 { "-".into() } else { Spread::of(&added(i, |m| m.p99_ms)).show(3) },
            Spread::of(&per_path(i, |m| m.rps)).show(0),
            vs,
            match rounds.iter().map(|r| r[i].proxy_cpu_us).collect::<Option<Vec<f64>>>() {
                Some(us) => Spread::of(&us).show(1),
                None => "-".into(),
            },
        ]);
    }
    println!("granary bench gateway — {}", utc_timestamp(started));
    println!("host: {}", host.describe());
    println!("command: {}", command_line());
    println!(
        "{} sequential requests per path and round for latency; {} clients for {} s for throughput; {} alternating rounds; \
         gateway ({} runtime thread(s)) with key check (SQLite), limits, metrics, audit; nginx with {} worker process(es); \
         {FLOOR}: hyper's HTTP/1.1 server and the gateway's upstream pool alone ({} runtime thread(s)), nothing checked or recorded; \
         the upstream and this client are processes of their own; proxy CPU: the proxy's processes' user and \
         system time during the throughput run, per request",
        args.requests, args.connections, args.seconds, args.rounds, args.workers, args.workers, args.workers
    );
    println!();
    println!("{}", table.render());
    let p50 = Spread::of(&added(1, |m| m.p50_ms)).median;
    let p99 = Spread::of(&added(1, |m| m.p99_ms)).median;
    let mut goals = vec![
        Goal::new(
            "gateway",
            format!("added p50 <= {ADDED_P50_GOAL_MS} ms"),
            p50 <= ADDED_P50_GOAL_MS,
            format!("{p50:.3} ms"),
        ),
        Goal::new(
            "gateway",
            format!("added p99 <= {ADDED_P99_GOAL_MS} ms"),
            p99 <= ADDED_P99_GOAL_MS,
            format!("{p99:.3} ms"),
        ),
    ];
    let what = format!("throughput >= {THROUGHPUT_GOAL:.1}x nginx (median of the rounds' ratios)");
    match nginx_at {
        Some(n) => {
            let ratio_of = |i: usize| median(&rounds.iter().map(|r| r[i].rps / r[n].rps).collect::<Vec<_>>());
            let ratio = ratio_of(1);
            let (g, x) = (median(&per_path(1, |m| m.rps)), median(&per_path(n, |m| m.rps)));
            let floor = paths.iter().position(|p| p.name == FLOOR).expect("the floor is always measured");
            let f = median(&per_path(floor, |m| m.rps));
            goals.push(Goal::new(
                "gateway",
                what,
                ratio >= THROUGHPUT_GOAL,
                format!(
                    "{g:.0} vs {x:.0} req/s ({ratio:.2}x); {FLOOR} {f:.0} req/s ({:.2}x){}",
                    ratio_of(floor),
                    if ratio_of(floor) < THROUGHPUT_GOAL {
                        ": the HTTP stack alone is under the goal in this run"
                    } else {
                        ""
                    }
                ),
            ))
        }
        None => goals.push(Goal::unmeasured("gateway", what, "nginx is not installed")),
    }
    for goal in goals {
        println!("{}", goal.render());
    }
    std::fs::create_dir_all(&args.out)?;
    let json = json!({
        "paths": paths.iter().map(|p| p.name).collect::<Vec<_>>(),
        "workers": args.workers,
        "rounds": rounds,
    });
    let file = args.out.join("gateway.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&json)?)?;
    chart(&args.out.join("gateway.svg"), &paths, &rounds)?;
    println!("\nwrote {} and {}", file.display(), args.out.join("gateway.svg").display());
    Ok(())
}

/// Requests per second per path, each round a dot, the median a bar.
fn chart(file: &std::path::Path, paths: &[Path], rounds: &[Vec<Measured>]) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(file, (720, 360)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = rounds.iter().flatten().map(|m| m.rps).fold(0.0, f64::max) * 1.15;
    let n = paths.len();
    let mut c = ChartBuilder::on(&root)
        .caption("Throughput through each path (req/s; bar: median, dots: rounds)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n).into_segmented(), 0.0..top)?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => paths.get(*i).map_or(String::new(), |p| p.name.to_string()),
            _ => String::new(),
        })
        .draw()?;
    let med: Vec<f64> = (0..n).map(|i| median(&rounds.iter().map(|r| r[i].rps).collect::<Vec<_>>())).collect();
    c.draw_series((0..n).map(|i| {
        let colour = [BLUE.mix(0.5), GREEN.mix(0.6), RED.mix(0.5), CYAN.mix(0.5)][i % 4];
        let mut bar =
            Rectangle::new([(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), med[i])], colour.filled());
        bar.set_margin(0, 0, 20, 20);
        bar
    }))?;
    c.draw_series(
        rounds
            .iter()
            .flat_map(|r| r.iter().enumerate().map(|(i, m)| (i, m.rps)))
            .map(|(i, y)| Circle::new((SegmentValue::CenterOf(i), y), 4, BLACK.filled())),
    )?;
    root.present()?;
    Ok(())
}
