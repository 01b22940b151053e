//! go-control-plane's own integration test, through the relay.
//!
//! go-control-plane's maintainers test their server against a real Envoy with the program in its
//! package `pkg/test/main` (driven by its `scripts/integration.sh`): an xDS server that pushes
//! generated snapshots (clusters, endpoints, HTTP / scoped-route / TCP / VHDS listeners, routes,
//! runtimes, extension configs; with `-tls`, SDS secrets), one per update round, and after each
//! one sends batches of HTTP requests through Envoy's listeners to an upstream that must answer
//! with the expected message. It exits non-zero if any round has no batch in which every
//! listener answered. `scripts/setup-gcp-integration.sh` builds that program, unchanged, from
//! go-control-plane v0.14.0 (tests/interop/go-control-plane-integration/ pins it) into
//! target/interop/gcp-integration; this test builds it if it is missing.
//!
//! Here each run puts the relay between the two: the program's xDS server is the relay's
//! upstream (`--node-id test-id`, the node its snapshots are keyed on), and a real Envoy 1.40 with
//! a bootstrap of ours (the shape of the program's `sample/bootstrap-<mode>.yaml`, its xDS
//! cluster pointed at the relay) talks only to the relay. The upstream echo server is the demo
//! backend (it answers every request with `GREETING`, passed as the program's `-message`). The
//! program's checks are its own; on top of them this test asserts that Envoy rejected no update
//! and holds the last round's clusters.
//!
//! The mode (`-xds`) sets how Envoy talks to the relay and which config sources the generated
//! resources name; the program's server sees the relay's one ADS stream, Delta by default
//! (`DeltaAggregatedResources`), or state-of-the-world (`StreamAggregatedResources`) in the modes
//! that start the relay with `--upstream-protocol sotw`. Modes run: every Envoy transport the relay
//! serves: `ads` (SotW ADS), `delta-ads`, `xds` (SotW per-type services), `delta` (Delta per-type
//! services), each also with `-tls` (listeners whose certificates come over SDS); with the relay's
//! upstream in SotW: `ads` (`ads_sotw_upstream`: the program's SnapshotCache in ADS mode, which
//! answers a named type only when the request names all of its resources) and `xds -mux`
//! (`xds_mux`: EDS from a LinearCache behind a MuxCache that has no `ClassifyDelta`, so the first
//! Delta request would crash the program). `rest` is not served by the relay. Runs are serialized
//! (2 cores; each takes ~10 s).

mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::envoy::{envoy_binary, free_port};
use support::http_get;
use tokio::net::TcpListener;
use tokio::process::{Child, Command};

/// The program's `-nodeID` (its default): the node its snapshots are keyed on, which the relay
/// presents upstream.
const NODE_ID: &str = "test-id";
/// Snapshot update rounds (`-u`); each round sends `-r` (default 5) request batches 0.5 s apart.
const UPDATES: u32 = 4;
/// Ports for Envoy's listeners: HTTP, scoped-route, TCP and (delta mode) VHDS listeners, two each.
const LISTENERS: u16 = 8;
/// How long the program may take (it gives up by itself a minute after start without a request).
const PROGRAM_LIMIT: Duration = Duration::from_secs(120);

/// One run at a time: each starts an Envoy, the relay and the Go program on 2 shared cores, and
/// the program's request batches time out after 100 ms.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, Debug)]
struct Mode {
    /// The program's `-xds`: ads, delta-ads, xds or delta.
    xds: &'static str,
    tls: bool,
    mux: bool,
    /// The relay speaks state-of-the-world upstream (`--upstream-protocol sotw`), not Delta.
    sotw_upstream: bool,
}

impl Mode {
    const fn new(xds: &'static str) -> Mode {
        Mode {
            xds,
            tls: false,
            mux: false,
            sotw_upstream: false,
        }
    }

    fn label(&self) -> String {
        let mut s = self.xds.to_string();
        if self.tls {
            s.push_str("-tls");
        }
        if self.mux {
            s.push_str("-mux");
        }
        if self.sotw_upstream {
            s.push_str("-sotw-upstream");
        }
        s
    }

    /// The relay's flags for this mode, beyond addresses and node id.
    fn relay_args(&self) -> &'static [&'static str] {
        if self.sotw_upstream {
            &["--upstream-protocol", "sotw"]
        } else {
            &[]
        }
    }

    fn aggregated(&self) -> bool {
        matches!(self.xds, "ads" | "delta-ads")
    }

    fn api_type(&self) -> &'static str {
        if self.xds.starts_with("delta") {
            "DELTA_GRPC"
        } else {
            "GRPC"
        }
    }

    /// RTDS layers in the snapshots, as go-control-plane's scripts/integration.sh sets them.
    fn runtimes(&self) -> u32 {
        if self.xds == "ads" {
            2
        } else {
            1
        }
    }
}

/// The program, built by scripts/setup-gcp-integration.sh if it is not there yet.
fn program_binary() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let bin = root.join("target/interop/gcp-integration");
    if !bin.exists() {
        let out = std::process::Command::new(root.join("scripts/setup-gcp-integration.sh"))
            .output()
            .expect("run scripts/setup-gcp-integration.sh");
        assert!(
            out.status.success() && bin.exists(),
            "scripts/setup-gcp-integration.sh failed (it needs Go >= 1.26 and the Go module \
             proxy):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    bin
}

/// `n` consecutive free ports on 127.0.0.1, below the ephemeral range, for Envoy's listeners.
fn free_port_range(n: u16) -> u16 {
    for _ in 0..500 {
        let base: u16 = rand::random_range(20_000..30_000);
        let held: Result<Vec<_>, _> = (base..base + n)
            .map(|p| std::net::TcpListener::bind(("127.0.0.1", p)))
            .collect();
        if held.is_ok() {
            return base;
        }
    }
    panic!("no {n} consecutive free ports in 20000..30000");
}

/// Our Envoy bootstrap for `mode`: the layout of go-control-plane's sample/bootstrap-<mode>.yaml
/// (ADS or per-type config sources for CDS and LDS, an RTDS layer `runtime-0` in the per-type
/// modes, the static `xds_cluster` and `als_cluster` the generated resources refer to), with
/// `xds_cluster` pointed at the relay and our own node.
fn bootstrap(mode: Mode, relay: u16, admin: u16, als: u16) -> String {
    const SOURCE: &str = "{ api_type: API_TYPE, transport_api_version: V3, \
                          set_node_on_first_message_only: true, \
                          grpc_services: [{ envoy_grpc: { cluster_name: xds_cluster } }] }";
    const ADS: &str = r#"dynamic_resources:
  ads_config: SOURCE
  cds_config: { ads: {}, resource_api_version: V3 }
  lds_config: { ads: {}, resource_api_version: V3 }
"#;
    const PER_TYPE: &str = r#"dynamic_resources:
  cds_config: { resource_api_version: V3, api_config_source: SOURCE }
  lds_config: { resource_api_version: V3, api_config_source: SOURCE }
layered_runtime:
  layers:
    - name: runtime-0
      rtds_layer:
        name: runtime-0
        rtds_config: { resource_api_version: V3, api_config_source: SOURCE }
"#;
    const STATIC: &str = r#"node: { id: NODE, cluster: gcp-integration }
admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: ADMIN_PORT }
static_resources:
  clusters:
    - name: xds_cluster
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: { http2_protocol_options: {} }
      load_assignment:
        cluster_name: xds_cluster
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: RELAY_PORT }
    - name: als_cluster
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: { http2_protocol_options: {} }
      load_assignment:
        cluster_name: als_cluster
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: ALS_PORT }
"#;
    let dynamic = if mode.aggregated() { ADS } else { PER_TYPE };
    format!(
        "# go-control-plane integration through adsrelay, mode {}\n{dynamic}{STATIC}",
        mode.label()
    )
    .replace("SOURCE", &SOURCE.replace("API_TYPE", mode.api_type()))
    .replace("NODE", &format!("gcp-integration-{}", mode.label()))
    .replace("ADMIN_PORT", &admin.to_string())
    .replace("RELAY_PORT", &relay.to_string())
    .replace("ALS_PORT", &als.to_string())
}

/// The last `n` lines of a file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Everything one run started; dropped, it kills the processes (and, unless the test is failing,
/// removes its directory of logs and bootstrap).
struct Run {
    mode: Mode,
    dir: PathBuf,
    program: Child,
    relay: Child,
    envoy: Child,
    relay_admin: u16,
    envoy_admin: u16,
    started: Instant,
}

impl Run {
    async fn start(mode: Mode) -> Run {
        let program_bin = program_binary();
        let dir = tempfile::Builder::new()
            .prefix(&format!("adsrelay-gcp-{}-", mode.label()))
            .tempdir()
            .unwrap()
            .keep();

        // The upstream HTTP server Envoy's clusters point at.
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend_port = backend.local_addr().unwrap().port();
        tokio::spawn(adsrelay::demo::backend::serve(backend));

        let (xds, gateway, als) = (free_port(), free_port(), free_port());
        let base = free_port_range(LISTENERS);
        let (relay_port, relay_admin, envoy_admin) = (free_port(), free_port(), free_port());
        let started = Instant::now();

        // go-control-plane's test program: the xDS server (and ALS server and REST gateway), the
        // snapshot rounds and the HTTP checks.
        let log = std::fs::File::create(dir.join("program.log")).unwrap();
        let mut cmd = Command::new(&program_bin);
        cmd.args(["-xds", mode.xds, "-nodeID", NODE_ID, "-debug"])
            .args(["-port", &xds.to_string()])
            .args(["-gateway", &gateway.to_string()])
            .args(["-als", &als.to_string()])
            .args(["-upstream", &backend_port.to_string()])
            .args(["-base", &base.to_string()])
            .args(["-message", adsrelay::demo::backend::GREETING])
            .args(["-u", &UPDATES.to_string()])
            .args(["-runtimes", &mode.runtimes().to_string()]);
        if mode.tls {
            cmd.arg("-tls");
        }
        if mode.mux {
            cmd.arg("-mux");
        }
        let program = cmd
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program_bin.display()));

        // The relay, with the program's server as its upstream.
        let log = std::fs::File::create(dir.join("relay.log")).unwrap();
        let relay = Command::new(env!("CARGO_BIN_EXE_adsrelay"))
            .args(["--upstream", &format!("127.0.0.1:{xds}")])
            .args(["--listen", &format!("127.0.0.1:{relay_port}")])
            .args(["--admin", &format!("127.0.0.1:{relay_admin}")])
            .args(["--node-id", NODE_ID])
            .args(mode.relay_args())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start the relay");

        // Envoy, configured only through the relay.
        let config = dir.join("bootstrap.yaml");
        std::fs::write(&config, bootstrap(mode, relay_port, envoy_admin, als)).unwrap();
        let envoy = Command::new(envoy_binary())
            .arg("-c")
            .arg(&config)
            .args(["--disable-hot-restart", "--drain-time-s", "1"])
            .args(["--concurrency", "1", "-l", "info", "--log-path"])
            .arg(dir.join("envoy.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start Envoy ({}): {e}", envoy_binary().display()));

        Run {
            mode,
            dir,
            program,
            relay,
            envoy,
            relay_admin,
            envoy_admin,
            started,
        }
    }

    /// The program's output, the relay's and Envoy's logs, and what the relay reports.
    async fn diagnostics(&mut self) -> String {
        let relay_running = matches!(self.relay.try_wait(), Ok(None));
        let envoy_running = matches!(self.envoy.try_wait(), Ok(None));
        let readyz = if relay_running {
            http_get(([127, 0, 0, 1], self.relay_admin).into(), "/readyz")
                .await
                .1
        } else {
            "(relay not running)".into()
        };
        // Which listeners (and the xDS subscriptions they wait for) Envoy has not initialized.
        let init = if envoy_running {
            let admin = ([127, 0, 0, 1], self.envoy_admin).into();
            let (_, text) = http_get(admin, "/init_dump").await;
            text.split_once("\r\n\r\n")
                .map_or(text.clone(), |(_, b)| b.to_string())
        } else {
            "(Envoy not running)".into()
        };
        let envoy_log = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
        let envoy_warnings: Vec<&str> = envoy_log
            .lines()
            .filter(|l| {
                (l.contains("][warning][") || l.contains("][error]["))
                    && !l.contains("Deprecated field")
            })
            .collect();
        format!(
            "--- go-control-plane program ({}, last 150 lines of {}):\n{}\n\
             --- relay log (running: {relay_running}, last 40 lines):\n{}\n\
             --- relay /readyz:\n{readyz}\n\
             --- Envoy /init_dump (what it still waits for):\n{init}\n\
             --- Envoy warnings and errors (running: {envoy_running}):\n{}\n\
             --- logs and bootstrap kept in {}",
            self.mode.label(),
            self.dir.join("program.log").display(),
            tail(&self.dir.join("program.log"), 150),
            tail(&self.dir.join("relay.log"), 40),
            envoy_warnings[envoy_warnings.len().saturating_sub(40)..].join("\n"),
            self.dir.display()
        )
    }

    /// Waits for the program; fails the test unless it exits 0.
    async fn expect_program_passes(&mut self) {
        match tokio::time::timeout(PROGRAM_LIMIT, self.program.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => {
                let diag = self.diagnostics().await;
                panic!(
                    "go-control-plane's integration test failed in mode {} ({status}) after \
                     {:.1?}\n{diag}",
                    self.mode.label(),
                    self.started.elapsed()
                );
            }
            Ok(Err(e)) => panic!("waiting for the program: {e}"),
            Err(_) => {
                let _ = self.program.start_kill();
                let diag = self.diagnostics().await;
                panic!(
                    "go-control-plane's integration test did not finish within {PROGRAM_LIMIT:?} \
                     in mode {}\n{diag}",
                    self.mode.label()
                );
            }
        }
    }

    /// Our checks on top of the program's: Envoy, connected through the relay, rejected no
    /// update and holds the last round's clusters.
    async fn expect_envoy_clean(&mut self) {
        let admin = ([127, 0, 0, 1], self.envoy_admin).into();
        let (_, stats) = http_get(admin, "/stats?filter=update_rejected|connected_state").await;
        let rejected: Vec<&str> = stats
            .lines()
            .filter(|l| l.contains("update_rejected") && !l.ends_with(": 0"))
            .collect();
        let disconnected: Vec<&str> = stats
            .lines()
            .filter(|l| l.contains("control_plane.connected_state") && !l.ends_with(": 1"))
            .collect();
        let (_, dump) = http_get(admin, "/config_dump?resource=dynamic_active_clusters").await;
        let last = format!("\"cluster-v{}-0\"", UPDATES - 1);
        if !rejected.is_empty() || !disconnected.is_empty() || !dump.contains(&last) {
            let diag = self.diagnostics().await;
            panic!(
                "mode {}: the program passed, but Envoy rejected {rejected:?}, is disconnected \
                 on {disconnected:?}, or lacks cluster {last} (active clusters: {dump})\n{diag}",
                self.mode.label()
            );
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

async fn passes(mode: Mode) {
    let _one_at_a_time = SERIAL.lock().await;
    let mut run = Run::start(mode).await;
    run.expect_program_passes().await;
    run.expect_envoy_clean().await;
    println!(
        "go-control-plane integration, mode {}: {UPDATES} update rounds passed through the relay \
         in {:.1?}",
        mode.label(),
        run.started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads() {
    passes(Mode::new("ads")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_ads() {
    passes(Mode::new("delta-ads")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xds() {
    passes(Mode::new("xds")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_tls() {
    passes(Mode {
        tls: true,
        ..Mode::new("ads")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_ads_tls() {
    passes(Mode {
        tls: true,
        ..Mode::new("delta-ads")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xds_tls() {
    passes(Mode {
        tls: true,
        ..Mode::new("xds")
    })
    .await;
}

/// Per-type Delta services. Its two VHDS listeners' route configurations (`vhds` over DELTA_GRPC)
/// make Envoy open one per-type `DeltaVirtualHosts` stream each, whose first request names nothing
/// (Envoy's namespace watch); go-control-plane answers it as a wildcard (the node's virtual hosts).
/// The relay scopes that request to the route configurations the same stream subscribes to over
/// RDS only on ADS streams (A27); on a per-type VHDS stream it is the group's VHDS wildcard. Before
/// that distinction the route configurations stayed uninitialized and every listener refused
/// connections in the first round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta() {
    passes(Mode::new("delta")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_tls() {
    passes(Mode {
        tls: true,
        ..Mode::new("delta")
    })
    .await;
}

/// The program's `-xds ads` with the relay's upstream in state-of-the-world: the program's
/// SnapshotCache is in ADS mode (its `NewSnapshotCache(mode == ads, ...)`), answering a named type
/// only when the request names every resource of that type in the snapshot and a wildcard type
/// only when the request names nothing (legacy wildcard), and its ordered-ADS SotW code serves the
/// relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_sotw_upstream() {
    passes(Mode {
        sotw_upstream: true,
        ..Mode::new("ads")
    })
    .await;
}

/// The program's `-mux` (EDS from a LinearCache behind a MuxCache). Its MuxCache has `Classify`
/// but no `ClassifyDelta`, so a Delta request panics it (nil function): go-control-plane runs
/// `-mux` only with SotW (`make integration.xds.mux`), and so does the relay's upstream here
/// (`--upstream-protocol sotw`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xds_mux() {
    passes(Mode {
        mux: true,
        sotw_upstream: true,
        ..Mode::new("xds")
    })
    .await;
}
