//! The processes a cold-start run starts: `granary` children (registry,
//! gateway, agents) killed on drop, and the engines their agents started.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use futures::StreamExt;
use serde_json::{json, Value};

use super::{GW_ADMIN, MODEL};

pub(super) use crate::bench::child::Proc;

/// Engines this run's agents started, killed at the end whatever happened
/// (engines outlive their agent by design): those seen in the agent's
/// status, and any `granary engine` whose command line names this run's
/// scratch directory (where their model paths are).
pub(super) struct Engines {
    pub(super) pids: Vec<u32>,
    pub(super) marker: String,
}

impl Drop for Engines {
    fn drop(&mut self) {
        let mut pids = self.pids.clone();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
                let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
                let args: Vec<String> = String::from_utf8_lossy(&cmd).split('\0').map(str::to_string).collect();
                if args.get(1).is_some_and(|a| a == "engine") && args.iter().any(|a| a.contains(&self.marker)) {
                    pids.push(pid);
                }
            }
        }
        for pid in pids {
            // SAFETY: kill(2) on the process group of an engine this run's agent started.
            unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
        }
    }
}

pub(super) fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

pub(super) fn is_tmpfs(p: &Path) -> bool {
    let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else { return false };
    let p = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2).then(|| (PathBuf::from(f[1]), f[2] == "tmpfs"))
        })
        .filter(|(m, _)| p.starts_with(m))
        .max_by_key(|(m, _)| m.as_os_str().len())
        .is_some_and(|(_, t)| t)
}

/// Starts a gateway with agents on (`agents`: more `[gateway.agents]`
/// lines), its files named `name`; it and a key of tenant `bench`.
pub(super) async fn start_gateway(
    dir: &Path,
    http: &reqwest::Client,
    name: &str,
    agents: &str,
) -> Result<(Proc, String)> {
    let cfg = format!(
        "[gateway]\nlisten = \"127.0.0.1:0\"\ndatabase = \"sqlite://{}/{name}.db\"\n\
         [gateway.agents]\nenabled = true\nttl_ms = 10000\nload_timeout_ms = 300000\n{agents}",
        dir.display()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, cfg)?;
    let gw = Proc::start(
        "gateway",
        &strings(&["gateway", "--config", &path.display().to_string()]),
        &[("GRANARY_ADMIN_TOKEN", GW_ADMIN)],
        "granary: gateway on ",
        "granary: ready",
    )?;
    let admin = |p: &'static str, body: Value| {
        let req = http.post(format!("{}{p}", gw.base)).bearer_auth(GW_ADMIN).json(&body);
        async move {
            let r = req.send().await?;
            let status = r.status();
            let v: Value = r.json().await?;
            ensure!(status.is_success(), "{p}: {status} {v}");
            Ok::<Value, anyhow::Error>(v)
        }
    };
    admin("/admin/v1/tenants", json!({"name": "bench"})).await?;
    let key = admin("/admin/v1/keys", json!({"tenant": "bench"})).await?["key"]
        .as_str()
        .context("the gateway returned no key")?
        .to_string();
    Ok((gw, key))
}

/// Streams one chat request for the model to `url`; ms to the first
/// content chunk, and the answer's `x-granary-placement` (a load's reason).
pub(super) async fn chat(
    http: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    max_tokens: u32,
) -> Result<(f64, Option<String>)> {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi in one short sentence."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
    let t0 = Instant::now();
    let mut req = http.post(format!("{url}/v1/chat/completions")).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await?;
    let status = r.status();
    let placement = r.headers().get("x-granary-placement").and_then(|v| v.to_str().ok()).map(str::to_string);
    if !status.is_success() {
        bail!("chat completion: {status} {}", r.text().await.unwrap_or_default());
    }
    let mut stream = r.bytes_stream();
    let mut buf = Vec::new();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk?);
        while let Some(i) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).with_context(|| format!("a stream chunk: {data}"))?;
            if let Some(e) = v.get("error") {
                bail!("the stream failed: {e}");
            }
            let c = &v["choices"][0];
            let content = c["delta"]["content"].as_str().is_some_and(|s| !s.is_empty());
            if first.is_none() && (content || !c["finish_reason"].is_null()) {
                first = Some(t0.elapsed());
            }
        }
    }
    Ok((first.context("the stream ended without a token")?.as_secs_f64() * 1e3, placement))
}
