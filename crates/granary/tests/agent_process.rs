//! The real `granary agent` between a real registry (`granary registry
//! serve`, the default model imported from its cached directory with
//! `dir:`) and a real gateway (`granary gateway` with agents on), running
//! real `granary engine` processes:
//!
//! - end to end: a chat request through the gateway for a model no engine
//!   serves yet → the gateway asks the agent → the agent downloads it from
//!   the registry and starts an engine → the request succeeds;
//! - kill -9 the engine → restarted after a doubling backoff, reported
//!   unhealthy to the gateway meanwhile; kill -9 the agent → a new one
//!   adopts the running engine (same pid); unload; loads served from disk
//!   then promoted to RAM; bad input on the control API;
//! - an external command template (a shell line running the engine), idle
//!   unload, and a template that fails.
//! - a third-party engine, llama-cpp-python's `llama_cpp.server`, under a
//!   command template behind a front: loaded on demand through the
//!   gateway, answering, restarted after kill -9, unloaded when idle;
//! - GPUs (a configured fake list: no GPU here) given out per engine in
//!   `CUDA_VISIBLE_DEVICES`, and engines refused when no GPU or not
//!   enough host memory is free.

mod agent_support;
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use agent_support::*;
use serde_json::{json, Value};

/// The agent's metrics-only token.
const METRICS_TOKEN: &str = "agent-metrics-token-for-tests";

#[test]
fn through_the_gateway_on_demand_then_restarts_adoption_unload_and_promotion() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let gw = Gateway::start();
    // A second replica: each gets the agent's heartbeats.
    let replica = Gateway::start();
    let cache_dir = dir.path().join("cache");
    let ram_dir = dir.path().join("ram");
    let args: Vec<String> = [
        "--registry",
        &registry.base,
        "--registry-token",
        READ,
        "--cache-dir",
        cache_dir.to_str().unwrap(),
        "--ram-dir",
        ram_dir.to_str().unwrap(),
        "--ram-budget",
        "2GiB",
        "--promote-after",
        "2",
        "--admin-token",
        TOKEN,
        "--metrics-token",
        METRICS_TOKEN,
        "--gateway",
        &gw.proc.base,
        "--gateway",
        &replica.proc.base,
        "--gateway-token",
        GW_ADMIN,
        "--agent-id",
        "node-a",
        "--heartbeat-interval",
        "500ms",
        "--health-interval",
        "100ms",
        "--engine-arg=--kv-cache=64MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = AgentProc::start(&args);

    // Bad input: no token, a wrong token, bad JSON, an unknown model, a bad name.
    let (s, body) = agent.call("GET", "/status", None, None);
    assert_eq!(s, 401, "{body}");
    assert!(body.contains("invalid_admin_token"), "{body}");
    assert_eq!(agent.call("POST", &format!("/models/{MODEL}/load"), Some("{}"), Some("wrong")).0, 401);
    assert_eq!(agent.call("GET", "/health", None, None).0, 200, "health needs no token");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), Some(r#"{"revision": 12}"#));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("revision")), "{v}");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), Some("{oops"));
    assert_eq!((s, v["error"]["code"].as_str()), (400, Some("invalid_request_body")), "{v}");
    let (s, v) = agent.json("POST", "/models/no-such-model/load", None);
    let got = (s, v["error"]["code"].as_str(), v["error"]["param"].as_str());
    assert_eq!(got, (404, Some("model_not_found"), Some("name")), "{v}");
    let (s, v) = agent.json("POST", "/models/.hidden/load", None);
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("name")), "{v}");
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/unload"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("model_not_loaded")), "{v}");

    // The gateway hears of the agent and what it can load.
    wait_until("the gateway lists the agent's models", Duration::from_secs(15), || {
        gw.agent("node-a").is_some_and(|a| a["models"].as_array().unwrap().iter().any(|m| m == MODEL))
    });
    let seen = gw.agent("node-a").unwrap();
    assert_eq!(seen["url"], agent.base.as_str(), "{seen}");
    assert_eq!(seen["has_token"], true, "{seen}");
    assert!(seen["engines"].as_array().unwrap().is_empty(), "{seen}");

    // End to end: a chat request for the model no engine serves yet.
    let r = gw.chat();
    let status = r.status();
    // The answer says where the model was loaded and why.
    let placement = r.headers().get("x-granary-placement").map(|v| v.to_str().unwrap().to_string());
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{v}");
    let placement = placement.expect("no x-granary-placement on the answer that waited for the load");
    assert!(placement.starts_with("loaded on node-a (est. "), "{placement}");
    assert!(placement.contains("; weights: none, 0 engine(s)"), "{placement}");
    let e = agent.engine().expect("the gateway had the agent load the model");
    assert_eq!((e["state"].as_str(), e["tier"].as_str()), (Some("ready"), Some("registry")), "{e}");
    let upstream = e["upstream"].as_str().unwrap().to_string();
    let seen = gw.agent("node-a").unwrap();
    assert_eq!(seen["engines"][0]["name"], format!("agent:node-a:{MODEL}"), "{seen}");
    assert_eq!(seen["engines"][0]["upstream"], upstream.as_str());
    assert_eq!(seen["engines"][0]["routable"], true, "{seen}");
    wait_until("the replica hears of the engine too", Duration::from_secs(10), || {
        replica.agent("node-a").is_some_and(|a| a["engines"][0]["upstream"] == upstream.as_str())
    });
    let st = agent.status();
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(st["tiers"]["disk"]["used"].as_u64().unwrap() >= size, "{st}");
    // Metrics: the engine and the tiers, for the metrics or the admin token.
    assert_eq!(agent.call("GET", "/metrics", None, None).0, 401, "metrics need a token");
    assert_eq!(agent.call("GET", "/metrics", None, Some("wrong")).0, 401);
    let (s, text) = agent.call("GET", "/metrics", None, Some(METRICS_TOKEN));
    assert_eq!(s, 200, "{text}");
    assert!(text.contains(&format!("granary_agent_engines{{model=\"{MODEL}\",state=\"ready\"}} 1")), "{text}");
    let disk_used = text
        .lines()
        .find(|l| l.starts_with("granary_agent_tier_used_bytes{tier=\"disk\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no disk tier bytes: {text}"));
    assert!(disk_used >= size, "{text}");
    assert!(text.contains("granary_agent_prefetches_total{outcome=\"asked\"}"), "{text}");
    assert_eq!(agent.call("GET", "/metrics", None, Some(TOKEN)).0, 200, "the admin token reads metrics too");
    assert_eq!(agent.call("GET", "/status", None, Some(METRICS_TOKEN)).0, 401, "the metrics token reads nothing else");
    // The registry imported the model's whole directory.
    let weights_bytes: u64 =
        common::files_under(model.parent().unwrap()).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    // (The engine's checkpoint may be reported too by now, once the agent
    // has taken it in: it is checked after the next loads.)
    let mut weights = st["weights"].clone();
    let w = weights[0].as_object_mut().unwrap();
    w.remove("checkpoint");
    w.remove("checkpoint_bytes");
    // The start converted (no checkpoint yet), and the agent read how long
    // that took from the engine's load stats; the download and the read
    // taught it this node's rates.
    let convert_ms = w.remove("convert_ms").and_then(|v| v.as_u64()).expect("the start's conversion is reported");
    assert!(convert_ms > 0, "{st}");
    assert_eq!(weights, json!([{"model": MODEL, "revision": "0.1.2", "tier": "disk", "bytes": weights_bytes}]), "{st}");
    let profile = &st["load_profile"];
    for key in ["disk_read_bps", "download_bps", "start_ms"] {
        assert!(profile[key].as_u64().is_some(), "{key} measured: {st}");
    }
    assert!(profile.get("ram_read_bps").is_none(), "nothing was read from RAM yet: {st}");
    wait_until("the gateway hears the node's load profile", Duration::from_secs(10), || {
        gw.agent("node-a").is_some_and(|a| a["load_profile"]["disk_read_bps"].as_u64().is_some())
    });
    // The load the gateway asked for, broken down: a download, then the engine's start.
    let last = &st["loads"][0];
    assert_eq!((last["model"].as_str(), last["tier"].as_str()), (Some(MODEL), Some("registry")), "{st}");
    let (load_ms, fetch_ms, engine_ms) =
        (last["load_ms"].as_u64().unwrap(), last["fetch_ms"].as_u64().unwrap(), last["engine_ms"].as_u64().unwrap());
    assert!(fetch_ms > 0 && engine_ms > 0 && fetch_ms + engine_ms <= load_ms, "{last}");
    let (s, logs) = agent.call("GET", &format!("/models/{MODEL}/logs?tail=50"), None, Some(TOKEN));
    assert_eq!(s, 200);
    assert!(logs.contains("granary: ready"), "{logs}");
    assert_eq!(agent.call("GET", &format!("/models/{MODEL}/logs?tail=x"), None, Some(TOKEN)).0, 400);

    // kill -9 the engine, twice: restarted after 0.5 s, then 1 s (the
    // backoff doubles); meanwhile the gateway is told it is unhealthy and
    // does not route to it.
    let mut waits = Vec::new();
    for round in 1..=2u64 {
        let pid = agent.engine().unwrap()["pid"].as_u64().unwrap() as u32;
        let killed = Instant::now();
        // SAFETY: the engine the agent started for this test.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let down = agent.wait_engine("seen restarting", Duration::from_secs(10), |e| e["state"] == "restarting");
        assert!(down["pid"].is_null(), "{down}");
        wait_until("the gateway takes it out of routing", Duration::from_secs(5), || {
            gw.agent("node-a")
                .is_some_and(|a| a["engines"][0]["healthy"] == false && a["engines"][0]["routable"] == false)
        });
        agent.wait_engine("a new process", Duration::from_secs(10), |e| {
            e["pid"].as_u64().is_some_and(|p| p as u32 != pid)
        });
        waits.push(killed.elapsed());
        let e = agent.wait_engine("ready again", Duration::from_secs(60), |e| e["state"] == "ready");
        assert_eq!(e["restarts"], round, "{e}");
        assert!(e["last_error"].as_str().unwrap().contains("signal 9"), "{e}");
        assert!(!alive(pid));
        wait_until("routable again", Duration::from_secs(10), || {
            gw.agent("node-a").is_some_and(|a| a["engines"][0]["routable"] == true)
        });
        assert_eq!(gw.chat().status(), 200);
    }
    assert!(waits[0] >= Duration::from_millis(500), "first restart after {:?}", waits[0]);
    assert!(waits[1] >= Duration::from_millis(1000), "second restart after {:?} (backoff doubled)", waits[1]);

    // kill -9 the agent; the engine keeps serving; a new agent adopts it.
    let before = agent.engine().unwrap();
    agent.kill9();
    let pid = before["pid"].as_u64().unwrap() as u32;
    assert!(alive(pid), "the engine outlives its agent");
    chat(before["upstream"].as_str().unwrap());
    let agent = AgentProc::start(&args);
    let e = agent.wait_engine("adopted and ready", Duration::from_secs(30), |e| e["state"] == "ready");
    assert_eq!(e["pid"], before["pid"], "the same process, adopted: {e}");
    assert_eq!(e["adopted"], true, "{e}");
    assert_eq!(e["restarts"], before["restarts"]);
    let again = agent.load();
    assert_eq!(again["upstream"], before["upstream"], "loading a loaded model answers at once");
    // The new agent's first heartbeats may report the engine before it is
    // adopted as ready; the gateway routes to it again once a heartbeat
    // sent after the adoption says it is healthy.
    let adopted_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    wait_until("routable after the adoption", Duration::from_secs(10), || {
        gw.agent("node-a").is_some_and(|a| {
            a["last_seen_ms"].as_i64().unwrap_or(0) > adopted_ms && a["engines"][0]["routable"] == true
        })
    });
    assert_eq!(gw.chat().status(), 200);

    // Unload: the process group is gone, the port closed, the gateway
    // drops the upstream; a second unload is 404.
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/unload"), None);
    assert_eq!((s, v["state"].as_str()), (200, Some("unloaded")), "{v}");
    assert!(!alive(pid), "the engine was stopped");
    assert!(std::net::TcpStream::connect(before["upstream"].as_str().unwrap().trim_start_matches("http://")).is_err());
    assert!(agent.engine().is_none());
    assert_eq!(agent.json("POST", &format!("/models/{MODEL}/unload"), None).0, 404);
    wait_until("the gateway drops the engine", Duration::from_secs(10), || {
        gw.agent("node-a").is_some_and(|a| a["engines"].as_array().unwrap().is_empty())
    });

    // Load again: from the disk tier this time (no download). Then again:
    // the second load within the window promotes it to RAM.
    let v = agent.load();
    assert_eq!(v["tier"], "disk", "{v}");
    assert_eq!(v["fetch_ms"], 0, "nothing to download: {v}");
    assert!(v["engine_ms"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(agent.status()["loads"][0]["upstream"], v["upstream"], "status keeps the last load");
    // The converted-weight checkpoint an earlier start wrote beside the
    // weights was taken into the disk tier, and this start loaded it.
    let rev_dir = cache_dir.join("models").join(MODEL).join("0.1.2");
    let checkpoint = std::fs::read_dir(&rev_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "ckpt"))
        .expect("a checkpoint beside the weights");
    let target = std::fs::read_link(&checkpoint).expect("the checkpoint is a link into the tiers");
    assert!(target.starts_with(&cache_dir), "{target:?} is in the disk tier");
    let (_, logs) = agent.call("GET", &format!("/models/{MODEL}/logs"), None, Some(TOKEN));
    assert!(logs.lines().any(|l| l.contains("granary: loaded") && l.ends_with("checkpoint loaded")), "{logs}");
    assert_eq!(agent.json("POST", &format!("/models/{MODEL}/unload"), None).0, 200);
    let v = agent.load();
    assert_eq!(v["tier"], "ram", "{v}");
    chat(v["upstream"].as_str().unwrap());
    let st = agent.status();
    assert!(st["tiers"]["ram"]["used"].as_u64().unwrap() >= size, "{st}");
    // The registry imported the model's whole directory.
    let weights_bytes: u64 =
        common::files_under(model.parent().unwrap()).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    let checkpoint_bytes = std::fs::metadata(&checkpoint).unwrap().len();
    assert_eq!(
        st["weights"],
        json!([{"model": MODEL, "revision": "0.1.2", "tier": "ram", "bytes": weights_bytes, "checkpoint": "ram",
                "checkpoint_bytes": checkpoint_bytes, "convert_ms": st["weights"][0]["convert_ms"]}]),
        "{st}"
    );
    assert!(st["weights"][0]["convert_ms"].as_u64().is_some(), "the first start's conversion is remembered: {st}");
    assert!(st["load_profile"]["ram_read_bps"].as_u64().is_some(), "the checkpoint was read from RAM: {st}");
    let gguf = model.file_name().unwrap();
    let link = cache_dir.join("models").join(MODEL).join("0.1.2").join(gguf);
    assert!(std::fs::read_link(&link).unwrap().starts_with(&ram_dir), "{link:?} points into the RAM tier");
    assert!(std::fs::read_link(&checkpoint).unwrap().starts_with(&ram_dir), "the checkpoint is promoted with it");
}

/// Issue 40: two tenants' identical prompts through one gateway, on the
/// one engine an agent started, share no KV. The gateway names each
/// request's namespace from its key's tenant; the engine the agent starts
/// runs the request there (before, it ran every tenant in `default`, and
/// the second tenant's prompt was served from the first one's blocks).
#[test]
fn two_tenants_on_an_agents_engine_share_no_kv() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let gw = Gateway::start();
    let beta = gw.key_for("beta");
    let agent =
        AgentProc::in_fleet(&registry.base, &gw.proc.base, dir.path(), "node-a", &["--engine-arg=--block-tokens=16"]);
    wait_until("the gateway lists the agent's models", Duration::from_secs(15), || {
        gw.agent("node-a").is_some_and(|a| a["models"].as_array().unwrap().iter().any(|m| m == MODEL))
    });
    let prompt =
        format!("Notes for the quarterly review: {} Summarise in one word.", "the ledger balanced again; ".repeat(24));
    let ask = |key: &str| -> u64 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0});
        let r =
            gw.http.post(format!("{}/v1/chat/completions", gw.proc.base)).bearer_auth(key).json(&body).send().unwrap();
        let status = r.status();
        let v: Value = r.json().unwrap();
        assert_eq!(status, 200, "{v}");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 100, "{v}");
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
    };
    // Blocks are kept once the answer is done: a repeat finds them soon
    // after, not necessarily at once.
    let reuses = |key: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let cached = ask(key);
            if cached > 0 || Instant::now() > deadline {
                return cached;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    assert_eq!(ask(&gw.key), 0, "the first request computes the prompt");
    assert!(reuses(&gw.key) > 0, "the same tenant's repeat reuses its own blocks");
    // Those blocks are in the engine now: a tenant that shared the
    // namespace would be served from them.
    assert_eq!(ask(&beta), 0, "another tenant's identical prompt reuses none of them");
    assert!(reuses(&beta) > 0, "that tenant reuses its own");
    let engines = agent.status()["engines"].as_array().unwrap().len();
    assert_eq!(engines, 1, "one engine served both tenants");
}

#[test]
fn an_external_command_template_runs_and_an_idle_engine_is_unloaded() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let cache_dir = dir.path().join("cache");
    let common = |template: &str| -> Vec<String> {
        [
            "--registry",
            &registry.base,
            "--registry-token",
            READ,
            "--cache-dir",
            cache_dir.to_str().unwrap(),
            "--ram-budget",
            "0",
            "--admin-token",
            TOKEN,
            "--engine-command",
            template,
            "--idle-unload",
            "2s",
            "--idle-poll",
            "200ms",
            "--health-interval",
            "100ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    // Nothing listens beyond loopback without an admin token.
    let out = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["agent", "--listen", "0.0.0.0:0", "--cache-dir", cache_dir.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--admin-token"), "{err}");

    // Weights whose sha256 does not match: one byte flipped in the
    // registry's stored copy. Refused, nothing kept, nothing started.
    let failing = common("echo cannot start {model_id} >&2; exit 3");
    let agent = AgentProc::start(&failing.iter().map(String::as_str).collect::<Vec<_>>());
    let size = std::fs::metadata(&model).unwrap().len();
    let stored = common::files_under(&dir.path().join("registry"))
        .into_iter()
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.len() == size))
        .expect("the registry's copy of the weights");
    let original = std::fs::read(&stored).unwrap();
    let mut corrupt = original.clone();
    corrupt[size as usize / 2] ^= 0xff;
    std::fs::write(&stored, &corrupt).unwrap();
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (502, Some("checksum_mismatch")), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("sha256 mismatch") && msg.contains(".gguf"), "{msg}");
    assert!(agent.engine().is_none());
    let big: Vec<_> = common::files_under(&cache_dir.join("blobs"))
        .into_iter()
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.len() >= size / 2))
        .collect();
    assert!(big.is_empty(), "nothing of the bad download is kept: {big:?}");
    std::fs::write(&stored, &original).unwrap();

    // A template that cannot start: the load fails with the log's tail, nothing keeps running.
    let (s, v) = agent.json("POST", &format!("/models/{MODEL}/load"), None);
    assert_eq!((s, v["error"]["code"].as_str()), (503, Some("engine_failed")), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("exited with status 3") && msg.contains(&format!("cannot start {MODEL}")), "{msg}");
    assert!(agent.engine().is_none());
    drop(agent);

    // A real external command: a shell line that echoes, then runs the
    // engine (as one would vLLM), with the agent's placeholders.
    let template = format!(
        "echo external engine for {{model_id}}; '{}' engine --model {{model_path}} --model-id {{model_id}} --listen {{host}}:{{port}} --kv-cache 64MiB",
        env!("CARGO_BIN_EXE_granary")
    );
    let args = common(&template);
    let agent = AgentProc::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let v = agent.load();
    assert_eq!(v["tier"], "disk", "the failed load above had downloaded it: {v}");
    let upstream = v["upstream"].as_str().unwrap().to_string();
    let pid = agent.engine().unwrap()["pid"].as_u64().unwrap() as u32;
    let (_, logs) = agent.call("GET", &format!("/models/{MODEL}/logs"), None, Some(TOKEN));
    assert!(logs.contains(&format!("external engine for {MODEL}")), "{logs}");
    assert!(logs.contains("sh -c echo external engine"), "{logs}");

    // Requests keep it loaded; once they stop it goes after 2 s idle.
    let mut last_request = Instant::now();
    for _ in 0..3 {
        last_request = Instant::now();
        chat(&upstream);
        std::thread::sleep(Duration::from_millis(700));
        assert!(agent.engine().is_some(), "unloaded while in use");
    }
    wait_until("the idle engine is unloaded", Duration::from_secs(20), || agent.engine().is_none());
    let idle_for = last_request.elapsed();
    assert!(idle_for >= Duration::from_secs(2), "unloaded after only {idle_for:?} idle");
    assert!(!alive(pid), "the shell is gone");
    // The whole process group went: nothing still runs on that model path.
    let survivors: Vec<String> = processes_naming(&cache_dir.display().to_string())
        .into_iter()
        // The shell (`sh -c ...`) or the engine it ran, not the agent.
        .filter(|(_, args)| args.get(1).is_some_and(|a| a == "engine" || a == "-c"))
        .map(|(_, args)| args.join(" "))
        .collect();
    assert!(survivors.is_empty(), "left running: {survivors:?}");
    assert!(std::net::TcpStream::connect(upstream.trim_start_matches("http://")).is_err());
}

/// The Python with llama-cpp-python's server (`llama-cpp-python[server]`):
/// `GRANARY_LLAMA_CPP_PYTHON`, else the repository's `.venv/bin/python`
/// (which `scripts/test.sh` sets up). None, after saying why, when it
/// cannot import `llama_cpp.server` (a failure with GRANARY_REQUIRE_EXTERNAL=1).
fn llama_cpp_server_python() -> Option<String> {
    let py = std::env::var("GRANARY_LLAMA_CPP_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python").display().to_string()
    });
    let ok = Command::new(&py)
        .args(["-c", "import llama_cpp.server.app, uvicorn"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = format!("{py} cannot import llama_cpp.server (pip install 'llama-cpp-python[server]==0.3.16')");
        assert!(std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() != Ok("1"), "{why}");
        eprintln!("skipping: {why}");
        return None;
    }
    Some(py)
}

/// The pids of `llama_cpp.server` processes serving from `dir`.
fn llama_servers(dir: &std::path::Path) -> Vec<u32> {
    processes_naming(&dir.display().to_string())
        .into_iter()
        .filter(|(_, args)| args.iter().any(|a| a == "llama_cpp.server") && !args.iter().any(|a| a == "-c"))
        .map(|(pid, _)| pid)
        .collect()
}

#[test]
fn llama_cpp_server_under_a_template_on_demand_restarted_and_unloaded_when_idle() {
    let Some(model) = default_model() else { return };
    let Some(python) = llama_cpp_server_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry(&model, dir.path());
    let gw = Gateway::start();
    let cache_dir = dir.path().join("cache");
    // llama_cpp.server has no /metrics: its front counts its requests for
    // idle unload.
    let template = format!(
        "exec '{python}' -m llama_cpp.server --model {{model_path}} --model_alias {{model_id}} \
         --host {{host}} --port {{port}} --n_threads {{threads}} --n_ctx 512 \
         --interrupt_requests False"
    );
    let args: Vec<String> = [
        "--registry",
        &registry.base,
        "--registry-token",
        READ,
        "--cache-dir",
        cache_dir.to_str().unwrap(),
        "--ram-budget",
        "0",
        "--admin-token",
        TOKEN,
        "--gateway",
        &gw.proc.base,
        "--gateway-token",
        GW_ADMIN,
        "--agent-id",
        "node-l",
        "--heartbeat-interval",
        "300ms",
        "--engine-command",
        &template,
        // It has no /health; its model list waits behind a running
        // completion; FastAPI's own /openapi.json answers at once, and only
        // once the model is loaded (the server listens after loading it).
        "--engine-health-path",
        "/openapi.json",
        "--engine-threads",
        "1",
        "--engine-proxy",
        // llama_cpp.server answers the gateway's request ids (not UUIDs) with an empty 400.
        "--engine-proxy-drop-header",
        "x-request-id",
        "--idle-unload",
        "3s",
        "--idle-poll",
        "200ms",
        "--health-interval",
        "200ms",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = AgentProc::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_until("the gateway lists the agent's models", Duration::from_secs(15), || {
        gw.agent("node-l").is_some_and(|a| a["models"].as_array().unwrap().iter().any(|m| m == MODEL))
    });

    // On demand through the gateway: the agent starts llama_cpp.server.
    let r = gw.chat();
    let status = r.status();
    let text = r.text().unwrap();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status}: {e}: {text:?}"));
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["model"], MODEL, "llama_cpp.server answers under the alias: {v}");
    let e = agent.engine().expect("loaded by the gateway's request");
    assert_eq!(e["state"], "ready", "{e}");
    let (front, engine_url) = (e["upstream"].as_str().unwrap().to_string(), e["engine_url"].as_str().unwrap());
    assert_ne!(front, engine_url, "reported at its front: {e}");
    let servers = llama_servers(&cache_dir);
    assert_eq!(
        servers.len(),
        1,
        "one llama_cpp.server process: {:?}",
        processes_naming(&cache_dir.display().to_string())
    );
    let (_, logs) = agent.call("GET", &format!("/models/{MODEL}/logs?tail=100000"), None, Some(TOKEN));
    assert!(logs.contains("llama_cpp.server") && logs.contains("--n_threads 1"), "{logs}");
    assert!(logs.contains("Uvicorn running on"), "{logs}");
    // The gateway's health checks reach it through the front's /health
    // (its /openapi.json): it stays up and routable.
    std::thread::sleep(Duration::from_millis(800));
    let seen = gw.agent("node-l").unwrap();
    assert_eq!(seen["engines"][0]["upstream"], front.as_str(), "{seen}");
    assert_eq!(
        (seen["engines"][0]["up"].as_bool(), seen["engines"][0]["routable"].as_bool()),
        (Some(true), Some(true))
    );

    // kill -9 the server: the agent starts it again (same port, same front).
    let pid = servers[0];
    // SAFETY: the llama_cpp.server the agent started for this test.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let e = agent.wait_engine("restarted", Duration::from_secs(60), |e| e["state"] == "ready" && e["restarts"] == 1);
    assert!(e["last_error"].as_str().unwrap().contains("signal 9"), "{e}");
    assert_eq!(e["upstream"], front.as_str());
    let again = llama_servers(&cache_dir);
    assert!(again.len() == 1 && again[0] != pid && !alive(pid), "{again:?}");
    wait_until("routable again", Duration::from_secs(10), || {
        gw.agent("node-l").is_some_and(|a| a["engines"][0]["routable"] == true)
    });

    // Requests through the gateway keep it loaded; 3 s after the last it
    // goes. The agent's idle clock starts when its front sees the answer
    // end, which is before the gateway's answer reaches this test: so the
    // time is taken as the request leaves (a lower bound of that end).
    let mut last_request = Instant::now();
    for _ in 0..3 {
        last_request = Instant::now();
        let r = gw.chat();
        assert_eq!(r.status(), 200);
        std::thread::sleep(Duration::from_millis(1500));
        assert!(agent.engine().is_some(), "unloaded while in use");
    }
    wait_until("the idle engine is unloaded", Duration::from_secs(20), || agent.engine().is_none());
    let idle_for = last_request.elapsed();
    assert!(idle_for >= Duration::from_secs(3), "unloaded after only {idle_for:?} idle");
    assert!(llama_servers(&cache_dir).is_empty(), "the server process is gone");
    // The front closes once the drained engine's stop completes.
    wait_until("the front is closed", Duration::from_secs(10), || {
        std::net::TcpStream::connect(front.trim_start_matches("http://")).is_err()
    });
    wait_until("the gateway drops the engine", Duration::from_secs(10), || {
        gw.agent("node-l").is_some_and(|a| a["engines"].as_array().unwrap().is_empty())
    });
    // And the next request loads it again.
    let r = gw.chat();
    let status = r.status();
    assert_eq!(status, 200, "{}", r.text().unwrap());
    assert!(agent.engine().is_some());
}

/// A real engine (`granary engine` under a template that prints its
/// `CUDA_VISIBLE_DEVICES`) on a node whose GPUs are a configured list.
#[test]
fn gpus_are_given_out_per_engine_and_loads_that_do_not_fit_are_refused() {
    let Some(model) = default_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let registry = registry_with(&model, dir.path(), &["m-a", "m-b", "m-c"]);
    let exe = env!("CARGO_BIN_EXE_granary");
    let template = format!(
        "echo visible=$CUDA_VISIBLE_DEVICES; exec '{exe}' engine --model {{model_path}} --model-id {{model_id}} \
         --listen {{host}}:{{port}} --kv-cache 32MiB"
    );
    let config = |name: &str, body: &str| -> String {
        let p = dir.path().join(name);
        let text = format!(
            "[agent]\nregistry = \"{}\"\nregistry_token = \"{READ}\"\ncache_dir = \"{}\"\nadmin_token = \"{TOKEN}\"\n\
             [agent.tiers]\nram_budget = \"0\"\n[agent.engines]\ncommand = {:?}\nhealth_interval = \"100ms\"\n{body}",
            registry.base,
            dir.path().join(name).with_extension("cache").display(),
            template
        );
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let gpus = config(
        "gpus.toml",
        "[agent.resources]\ngpus_per_engine = 1\nengine_memory = \"800MiB\"\n\
         gpus = [{index = 0, memory = \"1GiB\", name = \"fake-0\"}, {index = 1, memory = \"1GiB\", name = \"fake-1\"}]\n",
    );
    let agent = AgentProc::start(&["--config", &gpus]);
    let st = agent.status();
    assert_eq!(st["resources"]["gpu_source"], "config", "{st}");
    assert_eq!(st["resources"]["gpus"][1]["memory_free"], 1u64 << 30, "{st}");

    let environ = |pid: u64| -> String {
        let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        String::from_utf8_lossy(&raw)
            .split('\0')
            .find(|v| v.starts_with("CUDA_VISIBLE_DEVICES="))
            .unwrap_or("")
            .to_string()
    };
    let mut given = Vec::new();
    for m in ["m-a", "m-b"] {
        agent.load_model(m);
        let e = agent.engine_of(m).unwrap();
        assert_eq!(e["memory"], 800u64 << 20, "{e}");
        let gpu = e["gpus"][0].as_u64().unwrap();
        assert_eq!(environ(e["pid"].as_u64().unwrap()), format!("CUDA_VISIBLE_DEVICES={gpu}"), "{e}");
        let (_, logs) = agent.call("GET", &format!("/models/{m}/logs"), None, Some(TOKEN));
        assert!(logs.contains(&format!("visible={gpu}")), "{logs}");
        given.push(gpu);
    }
    assert_eq!(given, [0, 1], "one engine per GPU");
    let st = agent.status();
    assert_eq!(st["resources"]["gpus"][0]["memory_free"], 224u64 << 20, "{st}");
    assert_eq!(st["resources"]["gpus"][0]["engines"], json!(["m-a"]), "{st}");

    // No GPU has 800 MiB left: refused, with who holds what; nothing started.
    let (s, v) = agent.json("POST", "/models/m-c/load", None);
    assert_eq!((s, v["error"]["code"].as_str()), (503, Some("insufficient_resources")), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("GPU 0: 224 MiB free, held by m-a") && msg.contains("GPU 1: 224 MiB free, held by m-b"),
        "{msg}"
    );
    assert!(agent.engine_of("m-c").is_none());

    // Unloading one frees its GPU for the next.
    assert_eq!(agent.json("POST", "/models/m-a/unload", None).0, 200);
    agent.load_model("m-c");
    assert_eq!(agent.engine_of("m-c").unwrap()["gpus"], json!([0]));
    drop(agent);

    // No GPUs, 300 MiB of host memory: one engine (weights + 128 MiB) fits, a second does not.
    let host =
        config("host.toml", "[agent.resources]\ngpus = []\nhost_memory = \"300MiB\"\nmemory_overhead = \"128MiB\"\n");
    let agent = AgentProc::start(&["--config", &host]);
    let v = agent.load_model("m-a");
    assert_eq!(v["state"], "ready");
    let e = agent.engine_of("m-a").unwrap();
    let rev: Value = reqwest::blocking::Client::new()
        .get(format!("{}/v1/models/m-a/revisions/latest", registry.base))
        .bearer_auth(READ)
        .send()
        .unwrap()
        .json()
        .unwrap();
    let weights = rev["size"].as_u64().unwrap();
    assert!(weights >= std::fs::metadata(&model).unwrap().len(), "{rev}");
    assert_eq!(e["memory"], weights + (128 << 20), "the estimate: weights + overhead: {e}");
    assert_eq!(environ(e["pid"].as_u64().unwrap()), "", "no GPU list on a node without GPUs");
    let (s, v) = agent.json("POST", "/models/m-b/load", None);
    assert_eq!((s, v["error"]["code"].as_str()), (503, Some("insufficient_resources")), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("of host memory") && msg.contains("held by: m-a"), "{msg}");
    assert_eq!(agent.status()["resources"]["host_memory_total"], 300u64 << 20);
}
