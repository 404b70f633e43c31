//! Smoke test of `granary bench warehouse --quick`: the real binary runs the
//! in-process, hit-ratio and disk parts and writes JSON and the chart. No
//! timing is asserted, only that every figure is there and positive.

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
