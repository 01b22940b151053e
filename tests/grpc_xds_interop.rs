//! A real gRPC xDS client (Python `grpcio`, gRPC C-core) through the relay, in front of the demo
//! control plane. The client resolves `xds:///greeter.example:50051` with the bootstrap in
//! deploy/grpc/bootstrap.json (relay port substituted): Listener (API listener) -> RDS route ->
//! Cluster -> ClusterLoadAssignment, then calls the greeter server the endpoint names. The endpoint
//! then moves to a second server: the same client channel follows it, and so does a new client.
//!
//! gRPC's xDS client speaks state-of-the-world ADS (`StreamAggregatedResources`). Needs
//! `.venv/bin/python` with `grpcio` (scripts/test.sh installs it).

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use support::{RelayUnderTest, Upstream};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const TARGET: &str = "xds:///greeter.example:50051";
/// Per expected reply, in the Python client.
const CALL_TIMEOUT_SECS: u64 = 30;
/// Wall-clock limit for anything the test waits on, above the client's own timeouts.
const WAIT: Duration = Duration::from_secs(CALL_TIMEOUT_SECS * 2 + 15);

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `.venv/bin/python` with `grpcio` importable, or a panic saying how to get it.
fn python() -> PathBuf {
    let python = manifest_dir().join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} not found: this test needs Python with grpcio. Run scripts/test.sh (it creates .venv \
         and installs scripts/requirements-test.txt).",
        python.display()
    );
    let check = std::process::Command::new(&python)
        .args(["-c", "import grpc"])
        .output()
        .expect("run python");
    assert!(
        check.status.success(),
        "grpcio is not installed in {}: run scripts/test.sh (installs scripts/requirements-test.txt)\n{}",
        python.display(),
        String::from_utf8_lossy(&check.stderr)
    );
    python
}

fn greeter_script() -> PathBuf {
    manifest_dir().join("tests/interop/greeter.py")
}

/// A scratch directory for this test run.
fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("adsrelay-grpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// deploy/grpc/bootstrap.json with the relay's port, written to `dir`.
fn write_bootstrap(dir: &Path, relay: SocketAddr) -> PathBuf {
    let template =
        std::fs::read_to_string(manifest_dir().join("deploy/grpc/bootstrap.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&template).expect("bootstrap.json is JSON");
    assert_eq!(
        json["xds_servers"][0]["server_uri"], "127.0.0.1:18000",
        "deploy/grpc/bootstrap.json must point at 127.0.0.1:18000 (the test substitutes the port)"
    );
    assert_eq!(json["node"]["cluster"], "demo");
    let path = dir.join("bootstrap.json");
    std::fs::write(
        &path,
        template.replace("127.0.0.1:18000", &format!("127.0.0.1:{}", relay.port())),
    )
    .unwrap();
    path
}

/// The demo resource file: an API listener for the target, its route, and the cluster whose
/// endpoint is `backend`.
fn resources(backend: SocketAddr) -> Vec<(String, adsrelay::xds::CachedResource)> {
    let text = format!(
        r#"
        [[listeners]]
        name = "greeter.example:50051"
        api_listener = true
        route_config = "greeter_route"

        [[routes]]
        name = "greeter_route"
        domains = ["greeter.example:50051"]
        cluster = "greeter"

        [[clusters]]
        name = "greeter"
        endpoints = ["{backend}"]
        "#
    );
    adsrelay::demo::resources::parse(&text, "grpc-test.toml").unwrap()
}

fn read_file(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()))
}

/// Every greeter server's stderr in `dir`, for failure messages.
fn server_logs(dir: &Path) -> String {
    let mut out = String::new();
    for name in ["A", "B"] {
        let path = dir.join(format!("greeter-{name}.stderr"));
        out += &format!("--- greeter {name} stderr ---\n{}\n", read_file(&path));
    }
    out
}

/// A greeter server process replying with its name. It exits when dropped (killed), and by itself
/// when this test process dies (its stdin closes).
struct Greeter {
    name: &'static str,
    addr: SocketAddr,
    _child: Child,
}

impl Greeter {
    async fn start(python: &Path, dir: &Path, name: &'static str) -> Greeter {
        let stderr = dir.join(format!("greeter-{name}.stderr"));
        let mut child = Command::new(python)
            .arg(greeter_script())
            .args([
                "serve",
                "--port",
                "0",
                "--name",
                name,
                "--exit-on-stdin-eof",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", python.display()));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("greeter {name} did not start:\n{}", read_file(&stderr)));
        let line = line.unwrap().unwrap_or_else(|| {
            panic!(
                "greeter {name} exited before serving:\n{}",
                read_file(&stderr)
            )
        });
        // "serving NAME on 127.0.0.1:PORT"
        let addr = line
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("greeter {name}: unexpected first line {line:?}"));
        Greeter {
            name,
            addr,
            _child: child,
        }
    }
}

/// A `greeter.py call` process: prints "OK NAME" for each expected reply, in order.
struct Call {
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: PathBuf,
    dir: PathBuf,
    what: String,
}

impl Call {
    fn start(python: &Path, dir: &Path, bootstrap: &Path, label: &str, expect: &[&str]) -> Call {
        let stderr = dir.join(format!("call-{label}.stderr"));
        let mut cmd = Command::new(python);
        cmd.arg(greeter_script())
            .args(["call", "--target", TARGET, "--bootstrap"])
            .arg(bootstrap)
            .args(["--timeout", &CALL_TIMEOUT_SECS.to_string()]);
        for name in expect {
            cmd.args(["--expect", name]);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", python.display()));
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        Call {
            child,
            stdout,
            stderr,
            dir: dir.to_path_buf(),
            what: format!(
                "{label}: call {TARGET} --expect {}",
                expect.join(" --expect ")
            ),
        }
    }

    /// Waits for "OK `name`"; on anything else, fails with the client's exit status and stderr.
    async fn expect_ok(&mut self, name: &str) {
        let line = tokio::time::timeout(WAIT, self.stdout.next_line()).await;
        if let Ok(Ok(Some(line))) = &line {
            if line == &format!("OK {name}") {
                return;
            }
        }
        let status = self.finish().await;
        panic!(
            "{}: expected \"OK {name}\", got {line:?}; client {status}\n--- client stderr ---\n{}{}",
            self.what,
            read_file(&self.stderr),
            server_logs(&self.dir)
        );
    }

    /// Waits for the client to exit (killing it after [`WAIT`]).
    async fn finish(&mut self) -> ExitStatus {
        match tokio::time::timeout(WAIT, self.child.wait()).await {
            Ok(status) => status.unwrap(),
            Err(_) => {
                let _ = self.child.kill().await;
                self.child.wait().await.unwrap()
            }
        }
    }

    /// Asserts a clean exit 0.
    async fn expect_success(&mut self) {
        let status = self.finish().await;
        assert!(
            status.success(),
            "{}: client {status}\n--- client stderr ---\n{}{}",
            self.what,
            read_file(&self.stderr),
            server_logs(&self.dir)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_xds_client_resolves_through_the_relay_and_follows_an_endpoint_move() {
    let python = python();
    let dir = scratch_dir();
    let a = Greeter::start(&python, &dir, "A").await;
    let b = Greeter::start(&python, &dir, "B").await;

    let up = Upstream::start(resources(a.addr)).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let bootstrap = write_bootstrap(&dir, relay.xds);

    // One long-lived client channel: resolves through the relay and reaches A...
    let mut live = Call::start(&python, &dir, &bootstrap, "live", &[a.name, b.name]);
    live.expect_ok(a.name).await;

    // ...then the endpoint moves to B, and the same channel follows.
    up.cp.set_resources(resources(b.addr));
    live.expect_ok(b.name).await;
    live.expect_success().await;

    // A new client (served from the relay's cache) goes straight to B.
    let mut fresh = Call::start(&python, &dir, &bootstrap, "fresh", &[b.name]);
    fresh.expect_ok(b.name).await;
    fresh.expect_success().await;

    let stats = up.cp.stats();
    println!(
        "2 gRPC clients through the relay: upstream streams {}, upstream requests {}",
        stats.streams_opened, stats.requests
    );
    assert_eq!(
        stats.streams_opened, 1,
        "both gRPC clients share the group's one upstream stream"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
