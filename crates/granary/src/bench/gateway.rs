//! `granary bench gateway`: what the gateway adds to a request, against a
//! direct call and against nginx `proxy_pass`, in one run.
//!
//! One fast fixed upstream (an in-process HTTP server answering every
//! completion with the same small JSON body) is reached three ways: directly,
//! through the gateway with everything on (key check against its SQLite
//! database, per-key and per-tenant limits, metrics, an audit record per
//! request, routing), and through nginx (`proxy_pass` with upstream
//! keep-alive, access log off). Latency: one client, sequential requests,
//! p50/p99 after a warm-up; added latency is each path's percentile minus
//! the direct one. Throughput: `--connections` clients as fast as they can
//! for `--seconds`. The client, the upstream and the gateway share this
//! process (and its cores), nginx runs one worker; all three paths pay the
//! same client cost.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args as ClapArgs;
use granary_gateway::config::{GatewayConfig, UpstreamConfig};
use granary_gateway::identity::{AdminToken, Identity, IdentityOptions};
use granary_gateway::limits::Limiter;
use granary_gateway::Gateway;
use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::warehouse::report::{bar, command_line, utc_timestamp, Goal, Host, Table};

const ADMIN: &str = "bench-admin-token-0123456789";

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Sequential requests per path for the latency percentiles.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Concurrent clients for the throughput run.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Seconds of the throughput run per path.
    #[arg(long, default_value_t = 4)]
    seconds: u64,
    /// The nginx binary (the anchor); skipped when missing.
    #[arg(long, default_value = "nginx")]
    nginx: String,
}

struct Path {
    name: &'static str,
    url: String,
    key: Option<String>,
}

struct Measured {
    p50_ms: f64,
    p99_ms: f64,
    rps: f64,
}

const BODY: &str = r#"{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;

async fn upstream() -> Result<SocketAddr> {
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
    let addr = l.local_addr()?;
    tokio::spawn(async move { axum::serve(l, app).await });
    Ok(addr)
}

async fn gateway(up: SocketAddr, dir: &std::path::Path) -> Result<(SocketAddr, String, Identity)> {
    let mut cfg = GatewayConfig::default();
    cfg.gateway.database = format!("sqlite://{}", dir.join("gateway.db").display());
    let mut u = UpstreamConfig::new("fixed", format!("http://{up}"));
    u.kv_events = false;
    cfg.upstreams.push(u);
    let identity = Identity::open(&cfg.gateway.database, IdentityOptions::default()).await?;
    let gw = Gateway::new(&cfg, identity.clone(), Limiter::in_process())?;
    gw.upstreams.probe_all(&cfg.gateway).await;
    let app = granary_gateway::server::router(gw, Some(AdminToken::new(ADMIN)));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move { axum::serve(l, app).await });
    // A tenant and a key with limits high enough never to refuse, so the
    // limit checks run on every request.
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
    Ok((addr, key, identity))
}

struct Nginx {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nginx(bin: &str, up: SocketAddr) -> Result<(Nginx, SocketAddr)> {
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let d = dir.path().display();
    let conf = format!(
        "worker_processes 1;\ndaemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         upstream fixed {{ server {up}; keepalive 64; }}\n\
         server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://fixed;\n\
         proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let path = dir.path().join("nginx.conf");
    std::fs::write(&path, conf)?;
    let child = Command::new(bin)
        .args(["-p", &d.to_string(), "-c", &path.display().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {bin}"))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "nginx did not start listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((Nginx { child, _dir: dir }, addr))
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

async fn measure(p: &Path, args: &Args) -> Result<Measured> {
    let http = reqwest::Client::builder().tcp_nodelay(true).build()?;
    for _ in 0..200 {
        one(&http, p).await?;
    }
    let pb = bar(args.requests as u64, &format!("{} latency", p.name));
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
    let pb = bar(args.seconds, &format!("{} throughput", p.name));
    let tasks: Vec<_> = (0..args.connections)
        .map(|_| {
            let (http, done, path) =
                (http.clone(), done.clone(), Path { name: p.name, url: p.url.clone(), key: p.key.clone() });
            tokio::spawn(async move {
                while Instant::now() < end {
                    one(&http, &path).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    let t0 = Instant::now();
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_secs(1)).await;
        pb.inc(1);
    }
    for t in tasks {
        t.await??;
    }
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    Ok(Measured {
        p50_ms: h.value_at_quantile(0.5) as f64 / 1e6,
        p99_ms: h.value_at_quantile(0.99) as f64 / 1e6,
        rps: done.load(Ordering::Relaxed) as f64 / secs,
    })
}

pub async fn run(args: Args) -> Result<()> {
    let started = SystemTime::now();
    let host = Host::probe();
    let dir = tempfile::tempdir()?;
    let up = upstream().await?;
    let (gw, key, identity) = gateway(up, dir.path()).await?;
    let mut paths = vec![
        Path { name: "direct", url: format!("http://{up}/v1/chat/completions"), key: None },
        Path { name: "granary gateway", url: format!("http://{gw}/v1/chat/completions"), key: Some(key) },
    ];
    let nginx = match nginx(&args.nginx, up) {
        Ok((n, addr)) => {
            paths.push(Path { name: "nginx proxy_pass", url: format!("http://{addr}/v1/chat/completions"), key: None });
            Some(n)
        }
        Err(e) => {
            eprintln!("nginx unavailable ({e:#}): the anchor is skipped");
            None
        }
    };
    let mut results = Vec::new();
    for p in &paths {
        results.push(measure(p, &args).await.with_context(|| format!("measuring {}", p.name))?);
    }
    identity.flush().await;
    drop(nginx);

    let direct = &results[0];
    let mut table = Table::new(
        "Gateway overhead: one fixed upstream (chat completion, ~300-byte answer)",
        &["path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "req/s", "vs nginx"],
    );
    let nginx_rps = results.get(2).map(|r| r.rps);
    for (p, r) in paths.iter().zip(&results) {
        table.row(vec![
            p.name.to_string(),
            format!("{:.3}", r.p50_ms),
            format!("{:.3}", r.p99_ms),
            if p.name == "direct" { "-".into() } else { format!("{:.3}", r.p50_ms - direct.p50_ms) },
            if p.name == "direct" { "-".into() } else { format!("{:.3}", r.p99_ms - direct.p99_ms) },
            format!("{:.0}", r.rps),
            nginx_rps.map_or("-".into(), |n| format!("{:.2}x", r.rps / n)),
        ]);
    }
    println!("granary bench gateway — {}", utc_timestamp(started));
    println!("host: {}", host.describe());
    println!("command: {}", command_line());
    println!(
        "{} sequential requests per path for latency; {} clients for {} s for throughput; gateway with key check (SQLite), limits, metrics, audit",
        args.requests, args.connections, args.seconds
    );
    println!();
    println!("{}", table.render());
    let g = &results[1];
    let mut goals = vec![
        Goal::new(
            "gateway",
            "added p50 <= 0.3 ms",
            g.p50_ms - direct.p50_ms <= 0.3,
            format!("{:.3} ms", g.p50_ms - direct.p50_ms),
        ),
        Goal::new(
            "gateway",
            "added p99 <= 2 ms",
            g.p99_ms - direct.p99_ms <= 2.0,
            format!("{:.3} ms", g.p99_ms - direct.p99_ms),
        ),
    ];
    match nginx_rps {
        Some(n) => goals.push(Goal::new(
            "gateway",
            "throughput >= 0.8x nginx",
            g.rps >= 0.8 * n,
            format!("{:.0} vs {:.0} req/s ({:.2}x)", g.rps, n, g.rps / n),
        )),
        None => goals.push(Goal::unmeasured("gateway", "throughput >= 0.8x nginx", "nginx is not installed")),
    }
    for goal in goals {
        println!("{}", goal.render());
    }
    Ok(())
}
