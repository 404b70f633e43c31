//! Smoke tests of `granary bench`: the real binary runs `warehouse --quick`
//! (the in-process, hit-ratio and disk parts), `ttft --quick` and a small
//! `engine` run (both with the default model; skipped without it), and
//! writes JSON and charts. No timing is asserted, only that every figure is
//! there and positive and that the warm runs reused what they should.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn positive(v: &Value, what: &str) -> f64 {
    let x = v.as_f64().unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x > 0.0 && x.is_finite(), "{what} = {x}, expected a positive number");
    x
}

#[test]
fn quick_run_writes_json_and_chart() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let out = tmp.path().join("charts");
    let dir = tmp.path().join("disk");
    let run = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["bench", "warehouse", "--quick", "--only", "inproc,hitratio,disk", "--json"])
        .arg(&json)
        .arg("--out")
        .arg(&out)
        .arg("--dir")
        .arg(&dir)
        .env("GRANARY_LOG", "warn")
        .output()
        .expect("run granary bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.starts_with("Run with: "), "{stdout}");
    assert!(stdout.contains("--quick"), "{stdout}");

    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["quick"], true);
    assert!(r["run_with"].as_str().unwrap().contains("bench warehouse"));
    positive(&r["host"]["cores"], "host.cores");
    positive(&r["host"]["memory_bytes"], "host.memory_bytes");

    let inproc = &r["inproc"];
    let gets = inproc["gets"].as_array().expect("inproc.gets");
    assert!(!gets.is_empty());
    for g in gets {
        positive(&g["threads"], "threads");
        positive(&g["granary_gets_per_s"], "granary_gets_per_s");
        positive(&g["anchor_gets_per_s"], "anchor_gets_per_s");
        positive(&g["ratio"], "gets ratio");
    }
    let lookups = inproc["lookup"].as_array().expect("inproc.lookup");
    assert_eq!(lookups.len(), 2);
    for l in lookups {
        positive(&l["median_us"], "lookup median");
        positive(&l["p99_us"], "lookup p99");
    }
    positive(&inproc["lookup_ratio"], "lookup_ratio");

    let hit = &r["hitratio"];
    let ceiling = positive(&hit["ceiling"], "ceiling");
    assert!(ceiling < 1.0);
    positive(&hit["distinct_blocks"], "distinct_blocks");
    let budgets = hit["budgets"].as_array().expect("budgets").len();
    let cells = hit["cells"].as_array().expect("hitratio.cells");
    assert_eq!(cells.len(), 5 * budgets, "one cell per policy and budget");
    for c in cells {
        positive(&c["capacity_blocks"], "capacity_blocks");
        positive(&c["refs"], "refs");
        let h = positive(&c["hit_ratio"], "hit_ratio");
        assert!(h <= ceiling + 1e-9, "a bounded cache beat the unbounded ceiling: {c}");
    }
    for chart in ["hitratio.svg", "hitratio.png"] {
        let len = std::fs::metadata(out.join(chart)).unwrap_or_else(|e| panic!("{chart}: {e}")).len();
        assert!(len > 1000, "{chart} is only {len} bytes");
    }

    let rows = r["disk"]["rows"].as_array().expect("disk.rows");
    assert_eq!(rows.len(), 3);
    for row in rows {
        for f in ["granary_write_gbps", "raw_write_gbps", "granary_read_gbps", "raw_read_gbps", "read_ratio"] {
            positive(&row[f], f);
        }
    }

    let goals = r["goals"].as_array().expect("goals");
    assert_eq!(goals.len(), 4, "two inproc goals and two disk goals: {goals:?}");
    for g in goals {
        assert!(g["pass"].is_boolean() && g["figures"].is_string(), "{g}");
    }
    assert!(stdout.contains("Goals"), "{stdout}");
}

/// The default model for the model benchmarks' smoke runs, or `None` after
/// saying why they are skipped (a failure with GRANARY_REQUIRE_EXTERNAL=1).
fn model(test: &str) -> Option<std::path::PathBuf> {
    granary_tokenizer::testing::model_or_skip(test)
}

fn run_bench(args: &[&str], extra: &[&std::path::Path]) -> String {
    let run = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(args)
        .args(extra)
        .env("GRANARY_LOG", "warn")
        .output()
        .expect("run granary bench");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.starts_with("Run with: "), "{stdout}");
    stdout
}

/// `granary bench ttft --sizes 300 --quick`: every warm run (engine memory,
/// disk after a restart, remote after a restart) reuses the prompt's one
/// full block, and the JSON and chart are written.
#[test]
fn ttft_quick_run_reuses_every_tier() {
    let Some(model) = model("ttft_quick_run_reuses_every_tier") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let scratch = tmp.path().join("scratch");
    let stdout = run_bench(
        &["bench", "ttft", "--sizes", "300", "--quick", "--model", model.to_str().unwrap(), "--out"],
        &[&out, std::path::Path::new("--dir"), &scratch],
    );
    assert!(stdout.contains("Goals"), "{stdout}");

    let r: Value = serde_json::from_str(&std::fs::read_to_string(out.join("ttft.json")).unwrap()).unwrap();
    assert_eq!(r["quick"], true);
    assert_eq!(r["block_tokens"], 256);
    let sizes = r["sizes"].as_array().expect("sizes");
    assert_eq!(sizes.len(), 1);
    let s = &sizes[0];
    assert_eq!(s["tokens"], 300);
    // One full block is reusable from the warehouse; the 44 tokens past it
    // are computed (engine memory holds them too).
    assert_eq!(s["expected_cached"], 256);
    for run in s["runs"].as_array().expect("runs") {
        assert_eq!(run["problems"].as_array().expect("problems").len(), 0, "{run}");
        assert_eq!(run["cold_cached_tokens"], 0);
        positive(&run["cold_ms"], "cold_ms");
        let tiers = run["tiers"].as_array().expect("tiers");
        let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
        assert_eq!(names, ["memory", "disk", "remote"]);
        for t in tiers {
            // Engine memory keeps the partial block too; the lower tiers
            // hold full blocks only.
            let want = if t["tier"] == "memory" { 299 } else { 256 };
            assert_eq!(t["cached_tokens"], want, "{t}");
            assert_eq!(t["loaded_tokens"], want, "{t}");
            positive(&t["ttft_ms"], "ttft_ms");
            positive(&t["raw_read_ms"], "raw_read_ms");
            let bytes = positive(&t["raw_bytes"], "raw_bytes");
            assert!(bytes >= 256.0 * 23_040.0, "{t}: fewer bytes read than the block holds");
        }
    }
    assert_eq!(r["goals"].as_array().expect("goals").len(), 4);
    assert!(std::fs::read_dir(&scratch).unwrap().next().is_none(), "scratch directories left behind");
    for chart in ["ttft.svg", "ttft.png"] {
        let len = std::fs::metadata(out.join(chart)).unwrap_or_else(|e| panic!("{chart}: {e}")).len();
        assert!(len > 1000, "{chart} is only {len} bytes");
    }
}

/// `granary bench engine` at concurrency 1 and 2 with a Python that does
/// not exist: the anchor is reported unavailable and granary's figures
/// still come out.
#[test]
fn engine_quick_run_without_the_anchor() {
    let Some(model) = model("engine_quick_run_without_the_anchor") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let stdout = run_bench(
        &[
            "bench",
            "engine",
            "--model",
            model.to_str().unwrap(),
            "--concurrency",
            "1,2",
            "--gen-tokens",
            "4",
            "--prompt-tokens",
            "64",
            "--python",
            "/nonexistent/python3",
            "--out",
        ],
        &[&out],
    );
    assert!(stdout.contains("llama.cpp anchor unavailable"), "{stdout}");

    let r: Value = serde_json::from_str(&std::fs::read_to_string(out.join("engine.json")).unwrap()).unwrap();
    let levels = r["granary"].as_array().expect("granary");
    assert_eq!(levels.len(), 2);
    for (l, c) in levels.iter().zip([1, 2]) {
        assert_eq!(l["concurrency"], c);
        positive(&l["prefill_tok_s"], "prefill_tok_s");
        positive(&l["decode_tok_s"], "decode_tok_s");
        assert_eq!(l["first_stream_ids"].as_array().unwrap().len(), 4);
    }
    assert!(r["llama_cpp"]["unavailable"].is_string(), "{}", r["llama_cpp"]);
    // Without an anchor there is nothing to alternate with: one round.
    assert_eq!(r["rounds"], 1, "{}", r["rounds"]);
    assert_eq!(r["spread"].as_array().unwrap().len(), 2, "{}", r["spread"]);
    let goals = r["goals"].as_array().expect("goals");
    // Prefill and decode at one stream, aggregate decode at 16 streams:
    // none measured without the anchor; then the rise with concurrency.
    assert_eq!(goals.len(), 4);
    for g in &goals[..3] {
        assert_eq!(g["pass"], false);
        assert!(g["figures"].as_str().unwrap().starts_with("not measured"), "{g}");
    }
    assert!(std::fs::metadata(out.join("engine.svg")).unwrap().len() > 1000);
}

/// Whether an external program runs, or `false` after saying why its part
/// is skipped (a failure with GRANARY_REQUIRE_EXTERNAL=1).
fn have(program: &str, test: &str) -> bool {
    let ok = Command::new(program).arg("-v").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os(granary_tokenizer::testing::REQUIRE_ENV).is_none_or(|v| v != "1"),
            "{test}: {program} is required (GRANARY_REQUIRE_EXTERNAL=1) but does not run"
        );
        eprintln!("{test}: {program} not found; its row is skipped");
    }
    ok
}

/// A figure in a table row: the cells of the first line starting with `name`.
fn row<'a>(stdout: &'a str, name: &str) -> Vec<&'a str> {
    let line = stdout.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no row {name:?} in:\n{stdout}"));
    line[name.len()..].split_whitespace().collect()
}

/// `granary bench gateway` with a few requests over two rounds: the
/// upstream and the gateway as processes of their own, direct, gateway,
/// nginx and bare hyper proxy rows, positive figures for every path in
/// every round, the proxies' CPU per request, the goal lines (the
/// throughput one naming the bare proxy's ratio) and the chart.
#[test]
fn gateway_quick_run_measures_every_path() {
    let nginx = have("nginx", "gateway_quick_run_measures_every_path");
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["bench", "gateway", "--requests", "40", "--connections", "4", "--seconds", "1", "--rounds", "2"])
        .arg("--out")
        .arg(out.path())
        .env("GRANARY_LOG", "warn")
        .output()
        .expect("run granary bench gateway");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let mut paths = vec!["direct", "granary gateway"];
    if nginx {
        paths.push("nginx proxy_pass");
    }
    paths.push("bare hyper proxy");
    for p in &paths {
        row(&stdout, p);
    }
    let r: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("gateway.json")).unwrap()).unwrap();
    assert_eq!(r["paths"].as_array().unwrap().len(), paths.len(), "{r}");
    let rounds = r["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 2);
    for round in rounds {
        for (m, p) in round.as_array().unwrap().iter().zip(&paths) {
            assert!(m["p50_ms"].as_f64().unwrap() > 0.0 && m["rps"].as_f64().unwrap() > 0.0, "{p}: {m}");
            // The proxies' CPU per request, read from /proc (none for the
            // direct path); a 10 ms clock tick may round a short run to 0.
            match *p {
                "direct" => assert!(m["proxy_cpu_us"].is_null(), "{p}: {m}"),
                _ => assert!(m["proxy_cpu_us"].as_f64().is_some_and(|us| us >= 0.0), "{p}: {m}"),
            }
        }
    }
    for goal in ["added p50 <= 0.1 ms", "added p99 <= 2 ms", "throughput >= 1.0x nginx"] {
        assert!(stdout.lines().any(|l| l.contains(goal)), "no goal line {goal:?}:\n{stdout}");
    }
    if nginx {
        let line = stdout.lines().find(|l| l.contains("throughput >= 1.0x nginx")).unwrap();
        assert!(line.contains("bare hyper proxy") && line.contains("req/s ("), "{line}");
    }
    assert!(out.path().join("gateway.svg").is_file());
}

/// The Mooncake conversation trace where `granary bench` looks for it
/// (`crates/granary/src/bench/sim.rs`): `$GRANARY_MOONCAKE_TRACE`, else
/// `shared/data/mooncake/` in or beside the repository, else `/work/shared`.
fn mooncake_trace() -> Result<PathBuf, String> {
    let rel = "data/mooncake/conversation_trace.jsonl";
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tried: Vec<PathBuf> = std::env::var_os("GRANARY_MOONCAKE_TRACE")
        .map(PathBuf::from)
        .into_iter()
        .chain([root.join("shared").join(rel), root.join("../shared").join(rel), Path::new("/work/shared").join(rel)])
        .collect();
    tried
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| format!("Mooncake conversation trace not found in {tried:?}"))
}

/// `granary bench routing` on the first 1,500 requests of the Mooncake
/// trace over 4 simulated engines: every policy's row, kv_aware above
/// round_robin, the goal lines and the chart.
#[test]
fn routing_quick_run_ranks_kv_aware_above_round_robin() {
    let trace = match mooncake_trace() {
        Ok(t) => t,
        Err(e) => {
            assert!(
                std::env::var_os(granary_tokenizer::testing::REQUIRE_ENV).is_none_or(|v| v != "1"),
                "the Mooncake trace is required: {e}"
            );
            eprintln!("skipped: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let head: String = std::fs::read_to_string(trace).unwrap().lines().take(1500).map(|l| format!("{l}\n")).collect();
    let small = tmp.path().join("trace.jsonl");
    std::fs::write(&small, head).unwrap();
    let chart = tmp.path().join("routing.svg");
    let run = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["bench", "routing", "--engines", "4", "--sweep", "4", "--trace"])
        .arg(&small)
        .arg("--chart")
        .arg(&chart)
        .env("GRANARY_LOG", "warn")
        .output()
        .expect("run granary bench routing");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let hit = |p: &str| -> f64 { row(&stdout, p)[0].trim_end_matches('%').parse().unwrap() };
    for p in ["round_robin", "least_load", "session", "kv_aware"] {
        assert!(hit(p) >= 0.0, "{p}");
    }
    assert!(hit("kv_aware") > hit("round_robin"), "kv_aware should hit more than round_robin:\n{stdout}");
    assert!(stdout.contains("kv_aware hit rate >= 90% of the unbounded ceiling"), "{stdout}");
    assert!(std::fs::metadata(&chart).unwrap().len() > 1000, "chart too small");
}

/// `granary bench load --quick` on the default model's GGUF and an 8 MiB
/// synthetic checkpoint: one run, the table, the goal lines (two per file,
/// two more for the model's converted-weight checkpoint), the conversion
/// and checkpoint tables, JSON with every figure positive, the chart, and
/// nothing left in the scratch directory.
#[test]
fn load_quick_run_prints_its_table_and_goals() {
    let Some(model) = model("load_quick_run_prints_its_table_and_goals") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let files = tmp.path().join("files");
    let json = tmp.path().join("load.json");
    let stdout = run_bench(
        &[
            "bench",
            "load",
            "--quick",
            "--synthetic",
            "8MiB",
            "--threads",
            "3",
            "--model",
            model.to_str().unwrap(),
            "--out",
        ],
        &[&out, std::path::Path::new("--dir"), &files, std::path::Path::new("--json"), &json],
    );
    assert!(stdout.contains("load: weights into tensors, GB/s"), "{stdout}");
    assert!(stdout.contains("conversion"), "{stdout}");
    let goal_lines: Vec<&str> =
        stdout.lines().filter(|l| l.starts_with("PASS load") || l.starts_with("MISS load")).collect();
    assert_eq!(goal_lines.len(), 6, "{stdout}");
    assert!(
        goal_lines.iter().any(|l| l.contains("0.8x raw disk")) && goal_lines.iter().any(|l| l.contains("3x naive"))
    );
    assert!(goal_lines.iter().any(|l| l.contains("checkpoint load <= 1.2x the raw read of its bytes")), "{stdout}");
    assert!(goal_lines.iter().any(|l| l.contains("checkpoint load >= 5x naive read-and-convert")), "{stdout}");
    assert!(stdout.contains("load: the converted-weight checkpoint against converting"), "{stdout}");

    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["quick"], true);
    assert_eq!(r["threads"], 3);
    let cases = r["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2, "the GGUF and the synthetic checkpoint");
    assert_eq!(cases[0]["case"]["format"], "gguf");
    assert_eq!(cases[0]["case"]["bytes"].as_u64(), Some(std::fs::metadata(&model).unwrap().len()));
    assert_eq!(cases[1]["case"]["format"], "safetensors");
    for c in cases {
        let m = &c["median"];
        for f in ["raw_gbps", "naive_gbps", "parallel_gbps", "parallel_fingerprint_gbps", "vs_raw", "vs_naive"] {
            positive(&m[f], f);
        }
        assert!(m["max_cached"].as_f64().unwrap() < 0.5, "the page cache was not dropped: {m}");
        assert_eq!(c["runs"]["parallel"].as_array().unwrap().len(), 1);
    }
    positive(&cases[0]["median"]["engine_read_ms"], "engine_read_ms");
    positive(&cases[0]["median"]["engine_convert_ms"], "engine_convert_ms");
    for f in ["naive_engine_ms", "checkpoint_bytes", "checkpoint_raw_ms", "checkpoint_ms"] {
        positive(&cases[0]["median"][f], f);
    }
    assert!(cases[1]["median"]["checkpoint_ms"].is_null());
    assert!(cases[1]["median"]["engine_read_ms"].is_null(), "no model is built from random bytes");
    assert_eq!(r["goals"].as_array().unwrap().len(), 6);
    assert!(std::fs::metadata(out.join("load.svg")).unwrap().len() > 1000);
    assert!(std::fs::read_dir(&files).unwrap().next().is_none(), "files left in {}", files.display());
}

/// `granary bench coldstart --quick`: a real registry, gateway, agent and
/// engines; one cold start per tier, each served from the tier it claims,
/// with the breakdown filled in from the agent and the engine's log.
#[test]
fn coldstart_quick_run_measures_every_tier() {
    let Some(model) = model("coldstart_quick_run_measures_every_tier") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let scratch = tmp.path().join("scratch");
    let json = tmp.path().join("coldstart.json");
    let stdout = run_bench(
        &["bench", "coldstart", "--quick", "--max-tokens", "2", "--model", model.to_str().unwrap(), "--out"],
        &[&out, std::path::Path::new("--dir"), &scratch, std::path::Path::new("--json"), &json],
    );
    assert!(stdout.contains("coldstart: request → first token"), "{stdout}");
    assert!(stdout.contains("where the time went"), "{stdout}");

    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["gateway"], true);
    let tiers = r["tiers"].as_array().expect("tiers");
    let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
    assert_eq!(names, ["registry", "disk", "ram"]);
    for t in tiers {
        let runs = t["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 1);
        let run = &runs[0];
        assert_eq!(run["tier"], t["tier"]);
        for f in ["ttft_ms", "warm_ttft_ms", "load_ms", "engine_ms", "read_ms", "convert_ms", "ready_ms"] {
            positive(&run[f], f);
        }
        // A fresh agent's engine converts the weights (and writes a
        // checkpoint, which the agent keeps in its tiers); the disk and RAM
        // tiers' starts load that checkpoint.
        if t["tier"] == "registry" {
            assert_eq!(run["loader"], "parallel", "{run}");
            assert_eq!(run["weights_bytes"].as_u64(), Some(std::fs::metadata(&model).unwrap().len()));
        } else {
            assert_eq!(run["loader"], "checkpoint", "{run}");
            assert_eq!(run["checkpoint"], "loaded", "{run}");
        }
        let ttft = run["ttft_ms"].as_f64().unwrap();
        assert!(ttft >= run["load_ms"].as_f64().unwrap(), "{run}");
        let parts: f64 = t["median_parts"].as_array().unwrap().iter().map(|p| p.as_f64().unwrap()).sum();
        assert!((parts - ttft).abs() < 1.0 || parts > ttft, "{t}");
        let fetched = run["fetch_ms"].as_f64().unwrap();
        if t["tier"] == "registry" {
            assert!(fetched > 0.0, "{run}");
        } else {
            assert_eq!(fetched, 0.0, "{run}");
        }
    }
    assert!(std::fs::metadata(out.join("coldstart.svg")).unwrap().len() > 1000);
    assert!(std::fs::read_dir(&scratch).unwrap().next().is_none(), "scratch directories left behind");
}

/// `granary bench coldstart --fleet --quick`: three real agents and two
/// gateways; locality loads where the gateway's estimate is lowest, on a
/// node that holds the weights (the disk node, whose checkpoint spares the
/// conversion, where converting costs more than reading the checkpoint;
/// the RAM node where the checkpoint is large and converting quick, as
/// with dense f32 weights on CPUs without AVX-512 VNNI), fewest-engines on
/// the first agent by name, and the replayed prediction pre-stages some
/// loads' weights.
#[test]
fn coldstart_fleet_quick_run_compares_placements_and_replays_the_prediction() {
    let Some(model) = model("coldstart_fleet_quick_run_compares_placements_and_replays_the_prediction") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let scratch = tmp.path().join("scratch");
    let json = tmp.path().join("fleet.json");
    let stdout = run_bench(
        &["bench", "coldstart", "--fleet", "--quick", "--max-tokens", "2", "--model", model.to_str().unwrap(), "--dir"],
        &[&scratch, std::path::Path::new("--json"), &json],
    );
    assert!(stdout.contains("coldstart --fleet: request → first token"), "{stdout}");
    assert!(stdout.contains("prefetch prediction replayed"), "{stdout}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = r["fleet"]["runs"].as_array().expect("runs");
    let by = |p: &str| runs.iter().find(|x| x["policy"] == p).unwrap_or_else(|| panic!("no {p} run: {r}")).clone();
    assert_eq!(runs.len(), 2);
    let local = by("locality");
    let est = local["estimated_ms"].as_f64().unwrap_or_else(|| panic!("no estimate: {local}"));
    let others: Vec<f64> = local["ranked_after_ms"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(others.len(), 2, "the other two agents were ranked: {local}");
    // The gateway counts estimates within 20% + 50 ms of the best as equal
    // (they differ by less than the measurements behind them vary) and
    // lets the closer tier decide among them.
    let best = others.iter().copied().fold(est, f64::min);
    let near = |ms: f64| ms <= best * 1.2 + 50.0;
    assert!(near(est), "locality took an estimate near the lowest: {local}");
    // Round 1 gives tier i to agent i: fleet-1 RAM, fleet-2 disk.
    let placement = local["placement"].as_str().unwrap();
    let est_of = |agent: &str| -> f64 {
        let at = placement.find(&format!("{agent} (est. ")).unwrap_or_else(|| panic!("{agent} not ranked: {local}"));
        let rest = &placement[at + agent.len() + " (est. ".len()..];
        rest.split_once(" ms").and_then(|(n, _)| n.parse().ok()).unwrap_or_else(|| panic!("{local}"))
    };
    let expected = if near(est_of("fleet-1")) { ("ram", "fleet-1") } else { ("disk", "fleet-2") };
    assert_eq!((local["tier"].as_str().unwrap(), local["agent"].as_str().unwrap()), expected, "{local}");
    assert_eq!(by("fewest_engines")["agent"], "fleet-1", "all tie: the first by name");
    positive(&by("locality")["ttft_ms"], "ttft_ms");
    let on = &r["replay"]["on"];
    assert!(on["prestaged"].as_u64().unwrap() > 0, "{on}");
    assert!(on["from_ram"].as_u64() > r["replay"]["off"]["from_ram"].as_u64(), "{r}");
    assert!(std::fs::read_dir(&scratch).unwrap().next().is_none(), "scratch directories left behind");
}
