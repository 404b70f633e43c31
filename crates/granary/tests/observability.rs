//! The Grafana dashboards and Prometheus rules under `deploy/`: every query
//! names metrics Granary exports, and every dashboard panel shows data when
//! a real Prometheus scrapes a real fleet (gateway, node agent with the
//! engine it started, KV warehouse, registry) that served some traffic.

mod agent_support;
mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent_support::{default_model, registry, wait_until, AgentProc, Proc, Reaper, GW_ADMIN, MODEL, READ, TOKEN};
use serde_json::{json, Value};

const METRICS: &str = "metrics-token-for-tests";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// (dashboard title / panel title, query) for every target of every panel.
fn dashboard_queries() -> Vec<(String, String)> {
    let dir = deploy_dir().join("grafana");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut out = Vec::new();
    for f in files.iter().filter(|f| f.extension().is_some_and(|e| e == "json")) {
        let d: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap())
            .unwrap_or_else(|e| panic!("{}: not JSON: {e}", f.display()));
        let title = d["title"].as_str().unwrap_or_else(|| panic!("{}: no title", f.display()));
        assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()), "{}: no uid", f.display());
        let panels = d["panels"].as_array().unwrap_or_else(|| panic!("{}: no panels", f.display()));
        assert!(!panels.is_empty(), "{title}: no panels");
        for p in panels {
            let ptitle = p["title"].as_str().unwrap();
            let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{title} / {ptitle}: no targets"));
            assert!(!targets.is_empty(), "{title} / {ptitle}: no targets");
            for t in targets {
                let expr = t["expr"].as_str().unwrap_or_else(|| panic!("{title} / {ptitle}: a target without expr"));
                out.push((format!("{title} / {ptitle}"), expr.to_string()));
            }
        }
    }
    out
}

/// Granary's metric names in a query or rule file: identifiers starting
/// with `granary_` or `inference_` (recording rules, which contain `:`, and
/// label values in quotes excluded), histogram series suffixes removed.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_quotes = false;
    let mut word = String::new();
    let mut flush = |w: &mut String| {
        if (w.starts_with("granary_") || w.starts_with("inference_")) && !w.contains(':') {
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| w.strip_suffix(s)).unwrap_or(w);
            out.insert(base.to_string());
        }
        w.clear();
    };
    for c in text.chars() {
        if c == '"' {
            in_quotes = !in_quotes;
            flush(&mut word);
        } else if !in_quotes && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
        } else {
            flush(&mut word);
        }
    }
    flush(&mut word);
    out
}

fn exported_names() -> BTreeSet<String> {
    use granary_core::metrics::{engine, gateway, registry, warehouse};
    [warehouse::ALL, engine::ALL, gateway::ALL, registry::ALL]
        .iter()
        .flat_map(|l| l.iter().map(|s| s.to_string()))
        .collect()
}

#[test]
fn dashboards_and_rules_name_only_metrics_granary_exports() {
    let exported = exported_names();
    let queries = dashboard_queries();
    let dashboards: BTreeSet<&str> = queries.iter().map(|(p, _)| p.split(" / ").nth(1).unwrap()).collect();
    for want in ["Gateway", "Engines", "KV warehouse", "Agents and models"] {
        assert!(dashboards.contains(want), "a dashboard for {want}: {dashboards:?}");
    }
    let mut unknown = Vec::new();
    for (panel, expr) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{panel}: the query names no Granary metric: {expr}");
        unknown.extend(names.into_iter().filter(|n| !exported.contains(n)).map(|n| format!("{panel}: {n}")));
    }
    let rules = std::fs::read_to_string(deploy_dir().join("prometheus/granary-rules.yaml")).unwrap();
    let in_rules = metric_names(&rules);
    assert!(in_rules.len() >= 10, "the rules name Granary's metrics: {in_rules:?}");
    unknown.extend(in_rules.into_iter().filter(|n| !exported.contains(n)).map(|n| format!("rules: {n}")));
    assert!(unknown.is_empty(), "queries naming metrics no component exports:\n{}", unknown.join("\n"));
    // The name scanner itself: label values and recording rules are not metrics.
    let got = metric_names(r#"sum(rate(granary_x_total{a="granary_y"}[5m])) / granary:z + inference_l_bucket"#);
    assert_eq!(got.into_iter().collect::<Vec<_>>(), vec!["granary_x_total", "inference_l"]);
}

/// A real Prometheus server scraping `targets` (job, address, bearer token) every second.
struct Prometheus {
    child: Child,
    base: String,
}

impl Prometheus {
    fn start(dir: &Path, targets: &[(&str, String, Option<&str>)]) -> Option<Prometheus> {
        let Ok(bin) = which("prometheus") else {
            assert!(
                std::env::var("GRANARY_REQUIRE_EXTERNAL").is_err(),
                "GRANARY_REQUIRE_EXTERNAL=1 but prometheus is not installed"
            );
            eprintln!("SKIPPED: prometheus is not installed");
            return None;
        };
        let mut cfg = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n");
        for (job, addr, token) in targets {
            cfg.push_str(&format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n"));
            if let Some(t) = token {
                cfg.push_str(&format!("    authorization:\n      credentials: {t}\n"));
            }
        }
        std::fs::write(dir.join("prometheus.yml"), cfg).unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let child = Command::new(bin)
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, base: format!("http://127.0.0.1:{port}") };
        let http = reqwest::blocking::Client::new();
        wait_until("prometheus ready", Duration::from_secs(30), || {
            http.get(format!("{}/-/ready", p.base)).send().is_ok_and(|r| r.status().is_success())
        });
        Some(p)
    }

    fn query(&self, expr: &str) -> Value {
        let r = reqwest::blocking::Client::new()
            .get(format!("{}/api/v1/query", self.base))
            .query(&[("query", expr)])
            .send()
            .unwrap();
        let v: Value = r.json().unwrap();
        assert_eq!(v["status"], "success", "{expr}: {v}");
        v["data"]["result"].clone()
    }

    /// Every target's last scrape succeeded.
    fn targets_up(&self) -> Vec<(String, String)> {
        let r: Value = reqwest::blocking::get(format!("{}/api/v1/targets", self.base)).unwrap().json().unwrap();
        r["data"]["activeTargets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["labels"]["job"].as_str().unwrap().to_string(), t["health"].as_str().unwrap().to_string()))
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn which(name: &str) -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").trim_end_matches('/').to_string()
}

#[test]
fn every_dashboard_panel_shows_data_from_a_real_fleet() {
    let Some(model) = default_model() else { return };
    if which("prometheus").is_err() && std::env::var("GRANARY_REQUIRE_EXTERNAL").is_err() {
        eprintln!("SKIPPED: prometheus is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());

    let disk = dir.path().join("kv");
    let wh = common::Warehouse::start(&["--disk-dir", disk.to_str().unwrap(), "--metrics-token", METRICS], &[]);
    let reg = registry(&model, dir.path());

    let gw_cfg = dir.path().join("gateway.toml");
    std::fs::write(
        &gw_cfg,
        format!(
            "[gateway]\nlisten = \"127.0.0.1:0\"\ndatabase = \"sqlite://{}/gateway.db\"\n\
             metrics_token_env = \"GRANARY_METRICS_TOKEN\"\n\
             [gateway.health]\ninterval_ms = 250\ntimeout_ms = 1000\n\
             [gateway.agents]\nenabled = true\nttl_ms = 5000\nload_timeout_ms = 180000\n\
             [gateway.prices]\ncurrency = \"USD\"\n\
             [gateway.prices.models.\"{MODEL}\"]\ninput_per_million = 1.0\noutput_per_million = 2.0\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let gw = Proc::start(
        &["gateway", "--config", gw_cfg.to_str().unwrap()],
        &[("GRANARY_ADMIN_TOKEN", GW_ADMIN), ("GRANARY_METRICS_TOKEN", METRICS)],
        "granary: gateway on ",
        "granary: ready",
    );
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
    let admin = |path: &str, body: Value| -> Value {
        let r = http.post(format!("{}{path}", gw.base)).bearer_auth(GW_ADMIN).json(&body).send().unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.text().unwrap());
        r.json().unwrap()
    };
    admin("/admin/v1/tenants", json!({"name": "acme"}));
    let key = admin("/admin/v1/keys", json!({"tenant": "acme"}))["key"].as_str().unwrap().to_string();
    let tight = admin("/admin/v1/keys", json!({"tenant": "acme", "limits": {"requests_per_minute": 1}}))["key"]
        .as_str()
        .unwrap()
        .to_string();

    let cache_dir = dir.path().join("cache");
    let ram_dir = dir.path().join("ram");
    let warehouse_arg = format!("--engine-arg=--warehouse=resp://{}", wh.resp.as_ref().unwrap());
    let agent = AgentProc::start(&[
        "--registry",
        &reg.base,
        "--registry-token",
        READ,
        "--cache-dir",
        cache_dir.to_str().unwrap(),
        "--ram-dir",
        ram_dir.to_str().unwrap(),
        "--admin-token",
        TOKEN,
        "--gateway",
        &gw.base,
        "--gateway-token",
        GW_ADMIN,
        "--agent-id",
        "node-a",
        "--heartbeat-interval",
        "500ms",
        "--engine-arg=--kv-cache=64MiB",
        "--engine-arg=--block-tokens=16",
        &warehouse_arg,
    ]);
    wait_until("the gateway lists the agent's model", Duration::from_secs(20), || {
        let r = http.get(format!("{}/v1/models", gw.base)).bearer_auth(&key).send().unwrap();
        r.json::<Value>().is_ok_and(|v| v["data"].as_array().is_some_and(|d| d.iter().any(|m| m["id"] == MODEL)))
    });

    // Traffic: the first request loads the model on the agent (a cold
    // start); a long shared prefix twice, so KV-aware routing and the
    // warehouse see hits; a bad key (rejected) and a key over its limit (429).
    let doc = "Granary keeps the attention state of prompts it has seen in a warehouse of blocks. ".repeat(12);
    let chat = |key: &str, text: &str| {
        let body =
            json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0});
        http.post(format!("{}/v1/chat/completions", gw.base)).bearer_auth(key).json(&body).send().unwrap()
    };
    let first = chat(&key, &format!("{doc} Summarize."));
    assert_eq!(first.status(), 200, "{}", first.text().unwrap());
    let engine_url = agent.engine().expect("the agent runs an engine")["upstream"].as_str().unwrap().to_string();
    let drive = || {
        for q in ["What is kept?", "Where is it kept?"] {
            let r = chat(&key, &format!("{doc} {q}"));
            assert_eq!(r.status(), 200, "{}", r.text().unwrap());
        }
        assert_eq!(chat("sk-not-a-key", "hi").status(), 401);
        let _ = chat(&tight, "hi");
        assert_eq!(chat(&tight, "hi").status(), 429, "the second request in a minute is over the key's limit");
        // The registry serves a blob read (as agents do for weights).
        let r = http.get(format!("{}/v1/models", reg.base)).bearer_auth(READ).send().unwrap();
        assert!(r.status().is_success());
    };
    drive();

    let prom = Prometheus::start(
        dir.path(),
        &[
            ("gateway", host_port(&gw.base), Some(METRICS)),
            ("engine", host_port(&engine_url), None),
            ("warehouse", wh.http.clone().unwrap(), Some(METRICS)),
            ("registry", host_port(&reg.base), Some(READ)),
        ],
    )
    .unwrap();
    wait_until("every target scraped", Duration::from_secs(30), || {
        let t = prom.targets_up();
        t.len() == 4 && t.iter().all(|(_, h)| h == "up")
    });
    // Counters need two samples in a rate window, with traffic between.
    std::thread::sleep(Duration::from_secs(3));
    drive();
    std::thread::sleep(Duration::from_secs(3));

    let started = Instant::now();
    let mut empty = Vec::new();
    let queries = dashboard_queries();
    for (panel, expr) in &queries {
        let result = prom.query(expr);
        let n = result.as_array().map_or(0, Vec::len);
        let sample = result[0]["value"][1].as_str().unwrap_or("-").to_string();
        println!("{n:>3} series  {sample:>12}  {panel}: {expr}");
        if n == 0 {
            empty.push(format!("{panel}: {expr}"));
        }
    }
    let panels: BTreeSet<&str> = queries.iter().map(|(p, _)| p.as_str()).collect();
    println!("{} queries of {} panels evaluated in {:?}", queries.len(), panels.len(), started.elapsed());
    assert!(empty.is_empty(), "dashboard queries with no data from a real fleet:\n{}", empty.join("\n"));
    // The engine's KV went through the warehouse (the KV panels show real flow).
    let entries = prom.query("sum(granary_warehouse_tier_entries)");
    let entries: f64 = entries[0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(entries > 0.0, "the engine saved KV blocks to the warehouse");
}
