//! Smoke run of the load generator, in CI: a few hundred clients for a few seconds against a relay
//! it starts itself, plus the plain, floor (and demo) baselines, Delta and SotW, with a storm. Asserts that the run completes, every
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

/// Runs loadgen with `args` plus the common small workload; returns the parsed JSON result.
fn run_loadgen(name: &str, args: &[&str]) -> serde_json::Value {
    let out = std::env::temp_dir().join(format!("loadgen-{name}-{}.json", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(["--resources", "20", "--listeners", "2"])
        .args(["--eds-per-client", "2", "--eds-pool", "50"])
        .args(["--timeout-secs", "60"])
        .args(args)
        .arg("--relay-bin")
        .arg(relay_bin())
        .arg("--out")
        .arg(&out)
        .status()
        .expect("run loadgen");
    assert!(status.success(), "loadgen failed: {status}");
    let report =
        serde_json::from_slice(&std::fs::read(&out).expect("result file")).expect("valid JSON");
    let _ = std::fs::remove_file(out);
    report
}

/// Every target's clients converged, nothing missed, no errors; each server was sampled.
fn assert_converged(report: &serde_json::Value, clients: u64, targets: &[&str]) {
    let phases = report["phases"].as_array().expect("phases");
    let names: Vec<&str> = phases.iter().filter_map(|p| p["target"].as_str()).collect();
    assert_eq!(names, targets);
    for p in phases {
        let t = &p["target"];
        assert_eq!(
            p["synced"].as_u64(),
            Some(clients),
            "{t}: every client converges"
        );
        assert_eq!(p["missed_deliveries"].as_u64(), Some(0), "{t}");
        assert_eq!(p["errors"].as_u64(), Some(0), "{t}");
        assert!(p["server"]["pid"].as_u64().is_some(), "{t}: server sampled");
        if !p["storm"].is_null() {
            assert_eq!(p["storm"]["resynced"].as_u64(), Some(clients), "{t}: storm");
        }
    }
}

#[test]
fn loadgen_smoke_run_converges_and_writes_json() {
    let report = run_loadgen(
        "smoke",
        &["--clients", "200", "--updates", "3", "--compare", "--storm"],
    );
    assert_converged(&report, 200, &["relay", "plain", "floor"]);
    let relay = &report["phases"][0];
    assert_eq!(
        relay["upstream"]["streams_opened"].as_u64(),
        Some(1),
        "one upstream stream"
    );
    for r in ["relay_over_plain", "relay_over_floor"] {
        assert!(
            report["ratios"][r]["rss_per_client"].as_f64() > Some(0.0),
            "{r}"
        );
    }
}

#[test]
fn loadgen_sotw_smoke_run_with_demo_converges() {
    let report = run_loadgen(
        "smoke-sotw",
        &[
            "--protocol",
            "sotw",
            "--clients",
            "50",
            "--updates",
            "2",
            "--compare",
            "--with-demo",
            "--storm",
        ],
    );
    assert_converged(&report, 50, &["relay", "plain", "floor", "demo"]);
}

/// go-control-plane's baseline binary, built by scripts/setup-go-interop.sh (scripts/test.sh runs it).
fn gcp_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/interop/gcp-baseline");
    assert!(
        p.exists(),
        "{} missing: run scripts/setup-go-interop.sh (needs Go)",
        p.display()
    );
    p
}

/// go-control-plane as the relay's upstream over Delta and over SotW, and as the clients' direct
/// control plane, in one run: every client of every target converges on every update, and the
/// relay over either protocol shows go-control-plane one stream.
#[test]
fn loadgen_smoke_run_behind_go_control_plane_both_upstream_protocols() {
    let gcp = gcp_bin();
    let report = run_loadgen(
        "smoke-gcp",
        &[
            "--clients",
            "100",
            "--updates",
            "3",
            "--storm",
            "--relay-upstream",
            "gcp",
            "--also-sotw-upstream",
            "--with-gcp",
            "--gcp-bin",
            gcp.to_str().expect("utf-8 path"),
        ],
    );
    assert_converged(&report, 100, &["relay", "relay-sotwup", "gcp"]);
    for i in [0, 1] {
        let p = &report["phases"][i];
        assert_eq!(
            p["upstream"]["streams_opened"].as_u64(),
            Some(1),
            "{}: go-control-plane sees one stream",
            p["target"]
        );
    }
    assert!(
        report["ratios"]["relay_over_gcp"]["rss_per_client"].as_f64() > Some(0.0),
        "relay/gcp ratio present"
    );
    assert!(
        report["ratios"]["sotw_upstream_over_delta_upstream"]["rss_per_client"].as_f64()
            > Some(0.0),
        "relay-sotwup/relay ratio present"
    );
}
