//! `granary bench soak` for 20 seconds against the `granary serve` it starts
//! with the default model: no errors, at least six samples, the warehouse's
//! tiers read from serve's `/metrics`, and five PNG charts.

use std::process::Command;

#[test]
fn a_short_soak_against_serve_has_no_errors_and_draws_its_charts() {
    if granary_tokenizer::testing::model_or_skip("soak test").is_none() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_granary"))
        .args(["bench", "soak", "--duration", "20s", "--out"])
        .arg(out.path())
        .env("GRANARY_LOG", "warn")
        .output()
        .expect("run granary bench soak");
    let stdout = String::from_utf8_lossy(&run.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "granary bench soak failed: {}", run.status);
    assert!(stdout.contains("PASS soak     0 errors"), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("soak.json")).unwrap()).unwrap();
    assert_eq!(report["errors"], 0, "{report}");
    assert!(report["requests_ended"].as_u64().unwrap() > 0, "no request ended: {report}");
    let samples = report["samples"].as_array().unwrap();
    assert!(samples.len() >= 6, "{} samples", samples.len());
    for s in samples {
        let procs = s["procs"].as_array().unwrap();
        assert!(!procs.is_empty(), "a sample without the serve process: {s}");
        assert!(procs[0]["rss_bytes"].as_u64().unwrap() > 1 << 20 && procs[0]["fds"].as_u64().unwrap() > 0, "{s}");
        assert!(s["metrics_error"].is_null(), "{s}");
    }
    // Answered prompts were stored: serve's /metrics shows the embedded
    // warehouse holding bytes in memory by the end.
    let last = samples.last().unwrap();
    assert!(last["tier_bytes"]["memory"].as_u64().unwrap_or(0) > 0, "{last}");
    assert_eq!(report["goals"].as_array().unwrap().len(), 3);

    let charts = report["charts"].as_array().unwrap();
    assert_eq!(charts.len(), 5);
    for c in charts {
        let bytes = std::fs::read(c.as_str().unwrap()).unwrap();
        assert!(bytes.len() > 1000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{c} is not a PNG");
    }
}
