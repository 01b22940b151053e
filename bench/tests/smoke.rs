//! Smoke run of the load generator, in CI: a few hundred clients for a few seconds against a relay
//! it starts itself, plus the direct and floor comparisons. Asserts that the run completes, every
//! client converges, no update is missed, and the JSON result is well formed. No timing
//! assertions: this machine is noisy; figures come from bench/RESULTS.md runs.

use std::path::PathBuf;
use std::process::Command;

fn relay_bin() -> PathBuf {
    // Built by the root package's tests (scripts/test.sh runs those first), debug or release.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    ["debug", "release"]
        .iter()
        .map(|p| target.join(p).join("adsrelay"))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "adsrelay binary not found under {}: run `cargo build` first",
                target.display()
            )
        })
}

#[test]
fn loadgen_smoke_run_converges_and_writes_json() {
    let out = std::env::temp_dir().join(format!("loadgen-smoke-{}.json", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args([
            "--clients",
            "200",
            "--updates",
            "3",
            "--resources",
            "20",
            "--listeners",
            "2",
        ])
        .args([
            "--eds-per-client",
            "2",
            "--eds-pool",
            "50",
            "--compare",
            "--timeout-secs",
            "60",
        ])
        .arg("--relay-bin")
        .arg(relay_bin())
        .arg("--out")
        .arg(&out)
        .status()
        .expect("run loadgen");
    assert!(status.success(), "loadgen failed: {status}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("result file")).expect("valid JSON");
    let phases = report["phases"].as_array().expect("phases");
    let targets: Vec<&str> = phases.iter().filter_map(|p| p["target"].as_str()).collect();
    assert_eq!(targets, vec!["relay", "direct", "floor"]);
    for p in phases {
        assert_eq!(
            p["synced"].as_u64(),
            Some(200),
            "{}: every client converges",
            p["target"]
        );
        assert_eq!(p["missed_deliveries"].as_u64(), Some(0), "{}", p["target"]);
        assert_eq!(p["errors"].as_u64(), Some(0), "{}", p["target"]);
    }
    let relay = &phases[0];
    assert_eq!(
        relay["upstream"]["streams_opened"].as_u64(),
        Some(1),
        "one upstream stream"
    );
    let _ = std::fs::remove_file(out);
}
