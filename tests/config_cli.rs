//! Config conventions (issue 14), through the `adsrelay` binary as an operator runs it:
//! - every relay flag reads `ADSRELAY_<FLAG>`;
//! - one precedence, flag > env > file > default, shown by `adsrelay check-config` with where
//!   each value came from;
//! - `check-config` exits 0 on a valid config and 64 on an invalid one, naming the field and the
//!   file (or variable), and binds nothing;
//! - `--version` prints the git commit.

use std::process::{Command, Output};

use clap::CommandFactory;

fn adsrelay(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_adsrelay"));
    cmd.args(args);
    // Only the variables a test sets: the developer's own ADSRELAY_* must not leak in.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("ADSRELAY_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied())
        .output()
        .expect("run adsrelay")
}

/// A config file holding `text`, deleted when dropped.
fn config_file(name: &str, text: &str) -> tempfile::TempPath {
    let file = tempfile::Builder::new()
        .prefix(name)
        .suffix(".toml")
        .tempfile()
        .unwrap();
    std::fs::write(file.path(), text).unwrap();
    file.into_temp_path()
}

/// The `key = value  # source` line of `key` in check-config's output.
fn line<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l.starts_with(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("no {key} in check-config output:\n{stdout}"))
}

#[test]
fn every_relay_flag_reads_its_adsrelay_variable() {
    let cmd = adsrelay::config::Cli::command();
    let mut checked = 0;
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if ["help", "version"].contains(&long) {
            continue;
        }
        let want = adsrelay::config::env_var(long);
        assert_eq!(
            arg.get_env().and_then(|e| e.to_str()),
            Some(want.as_str()),
            "--{long} does not read {want}"
        );
        checked += 1;
    }
    assert!(checked >= 40, "only {checked} flags found");
}

#[test]
fn flag_beats_env_beats_file_beats_default() {
    let file = config_file(
        "precedence",
        "upstream = \"10.0.0.1:18000\"\nnode_id = \"from-file\"\ndrain_period = \"7s\"\n\
         resync_interval = \"5m\"\nlisten = \"0.0.0.0:18001\"\n",
    );
    let out = adsrelay(
        &[
            "check-config",
            "--config",
            file.to_str().unwrap(),
            "--drain-period",
            "3s",
        ],
        &[
            ("ADSRELAY_NODE_ID", "from-env"),
            ("ADSRELAY_DRAIN_PERIOD", "9s"),
            ("ADSRELAY_UPSTREAM_KEEPALIVE_INTERVAL", "45s"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown = file.display().to_string();
    assert_eq!(
        line(&stdout, "drain_period"),
        "drain_period = \"3s\"  # flag --drain-period"
    );
    assert_eq!(
        line(&stdout, "node_id"),
        "node_id = \"from-env\"  # env ADSRELAY_NODE_ID"
    );
    assert_eq!(
        line(&stdout, "upstream_keepalive_interval"),
        "upstream_keepalive_interval = \"45s\"  # env ADSRELAY_UPSTREAM_KEEPALIVE_INTERVAL"
    );
    assert_eq!(
        line(&stdout, "resync_interval"),
        format!("resync_interval = \"5m\"  # file {shown}")
    );
    assert_eq!(
        line(&stdout, "listen"),
        format!("listen = \"0.0.0.0:18001\"  # file {shown}")
    );
    assert_eq!(
        line(&stdout, "upstreams"),
        format!("upstreams = [\"http://10.0.0.1:18000/\"]  # file {shown}"),
        "the failover list follows the single upstream's source"
    );
    assert_eq!(
        line(&stdout, "max_connections"),
        "max_connections = 20000  # default"
    );
    assert_eq!(
        line(&stdout, "max_connection_age"),
        "max_connection_age = \"0s\"  # default",
        "max_connection_age is off unless configured"
    );
}

#[test]
fn env_alone_configures_a_relay() {
    let out = adsrelay(
        &["check-config"],
        &[
            ("ADSRELAY_UPSTREAMS", "10.0.0.1:18000,10.0.0.2:18000"),
            ("ADSRELAY_MAX_CONNECTION_AGE", "30m"),
            ("ADSRELAY_PARAM_FROM_METADATA", "zone,tenant"),
            ("ADSRELAY_UNMATCHED", "passthrough"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        line(&stdout, "upstreams"),
        "upstreams = [\"http://10.0.0.1:18000/\", \"http://10.0.0.2:18000/\"]  # env ADSRELAY_UPSTREAMS"
    );
    assert!(line(&stdout, "upstream").contains("10.0.0.1:18000"));
    assert_eq!(
        line(&stdout, "max_connection_age"),
        "max_connection_age = \"30m\"  # env ADSRELAY_MAX_CONNECTION_AGE"
    );
    assert_eq!(
        line(&stdout, "params_from_metadata"),
        "params_from_metadata = [\"zone\", \"tenant\"]  # env ADSRELAY_PARAM_FROM_METADATA"
    );
    assert_eq!(
        line(&stdout, "unmatched"),
        "unmatched = \"passthrough\"  # env ADSRELAY_UNMATCHED"
    );
}

#[test]
fn invalid_config_exits_64_naming_field_and_origin() {
    let file = config_file(
        "invalid",
        "upstream = \"10.0.0.1:18000\"\nmax_connection_age = \"10ms\"\n",
    );
    let out = adsrelay(&["check-config", "--config", file.to_str().unwrap()], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains(&file.display().to_string()) && stderr.contains("max_connection_age"),
        "the error names neither the file nor the field: {stderr}"
    );
    assert!(out.stdout.is_empty(), "printed a config for an invalid one");

    let out = adsrelay(
        &["check-config", "--config", file.to_str().unwrap()],
        &[
            ("ADSRELAY_MAX_CONNECTION_AGE", "30m"),
            ("ADSRELAY_NEW_STREAMS_BURST", "0"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("ADSRELAY_NEW_STREAMS_BURST") && stderr.contains("new_streams_burst"),
        "an env value's error names the variable and the field: {stderr}"
    );

    let out = adsrelay(&["check-config"], &[]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("upstream"));

    // A file that is not TOML names the file.
    let file = config_file("broken", "upstream = [\n");
    let out = adsrelay(&["check-config", "--config", file.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&file.display().to_string()));
}

#[test]
fn check_config_binds_nothing() {
    // Both ports are held by this test: the relay would fail to bind them; check-config passes.
    let xds = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = adsrelay(
        &[
            "check-config",
            "--upstream",
            "127.0.0.1:1",
            "--listen",
            &xds.local_addr().unwrap().to_string(),
            "--admin",
            &admin.local_addr().unwrap().to_string(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("# config OK"));
}

#[test]
fn version_prints_the_commit() {
    let out = adsrelay(&["--version"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    assert_eq!(
        stdout.trim(),
        format!("adsrelay {} (commit {head})", env!("CARGO_PKG_VERSION"))
    );
}

/// Issue 33: `upstream_protocol` from each source; a bad value exits 64 naming the field and where
/// it came from.
#[test]
fn upstream_protocol_is_checked_naming_its_source() {
    let ok = adsrelay(
        &["check-config", "--upstream", "cp:18000"],
        &[("ADSRELAY_UPSTREAM_PROTOCOL", "auto")],
    );
    assert!(ok.status.success(), "{ok:?}");
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        line(&stdout, "upstream_protocol").contains("\"auto\""),
        "{stdout}"
    );
    let default = adsrelay(&["check-config", "--upstream", "cp:18000"], &[]);
    let stdout = String::from_utf8_lossy(&default.stdout);
    assert!(
        line(&stdout, "upstream_protocol").contains("\"delta\""),
        "{stdout}"
    );

    let file = config_file(
        "proto",
        "upstream = \"cp:18000\"\nupstream_protocol = \"grpc\"\n",
    );
    let path = file.to_str().unwrap();
    // (arguments, environment, the source the error must name)
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: [Case; 3] = [
        (
            vec![
                "check-config",
                "--upstream",
                "cp:18000",
                "--upstream-protocol",
                "sotw2",
            ],
            vec![],
            "--upstream-protocol",
        ),
        (
            vec!["check-config", "--upstream", "cp:18000"],
            vec![("ADSRELAY_UPSTREAM_PROTOCOL", "Delta")],
            "ADSRELAY_UPSTREAM_PROTOCOL",
        ),
        (vec!["check-config", "--config", path], vec![], path),
    ];
    for (args, env, source) in cases {
        let out = adsrelay(&args, &env);
        assert_eq!(out.status.code(), Some(64), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("upstream_protocol"), "{stderr}");
        assert!(stderr.contains(source), "{stderr} does not name {source}");
        assert!(stderr.contains("delta, sotw, auto"), "{stderr}");
    }
}
