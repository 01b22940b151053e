//! Real gRPC-Go and gRPC-Java xDS clients through the relay, with a real go-control-plane
//! (tests/support/gcp.rs) behind it. Each client resolves `xds:///greeter.example:50051` with the
//! bootstrap in deploy/grpc/bootstrap.json (relay port substituted): Listener (API listener, HTTP
//! connection manager with RDS over ADS) -> RouteConfiguration -> Cluster (EDS over ADS) ->
//! ClusterLoadAssignment, then calls the greeter backend the endpoint names, one call every
//! 100 ms on one channel, printing "OK NAME" (or "ERR CODE: message") per call.
//!
//! Scenario, per client:
//! 1. calls reach backend A (route -> cluster `greeter-a` -> A);
//! 2. a route change (-> cluster `greeter-b`, endpoint B) moves them to B;
//! 3. the relay restarts on the same port (graceful shutdown, 2 s down, a new relay with an empty
//!    cache): calls keep reaching B meanwhile (the client keeps its config), and once the client is
//!    back on the new relay an endpoint change (`greeter-b`'s endpoint -> A) moves them to A;
//! 4. a second client, started then, goes straight to A, and the relay kept one upstream stream;
//! 5. the listener is removed upstream: calls fail (UNAVAILABLE, naming it); it comes back: calls
//!    reach A again.
//!
//! Neither the clients nor the relay NACK anything (relay metrics, go-control-plane's events).
//!
//! gRPC's xDS clients speak state-of-the-world ADS; the relay speaks Delta ADS upstream.
//!
//! Needs, built by scripts, never skipped: target/interop/grpc-go-greeter and
//! target/interop/grpc-java-greeter.jar (scripts/setup-grpc-clients.sh; the Go binary also serves
//! the backends), target/interop/gcp-server (scripts/setup-go-interop.sh), and `java` (17).

mod support;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::gcp::{state, GoControlPlane, CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE};
use support::{hold_port, http_get};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

const TARGET: &str = "xds:///greeter.example:50051";
/// The API listener's name: the target's authority.
const LISTENER: &str = "greeter.example:50051";
const ROUTE: &str = "greeter_route";
/// The node id the relay presents upstream, and go-control-plane's snapshot key.
const NODE: &str = "relay-grpc-go-java";
/// Longest wait for a client to reach a backend (first resolution, a change, a reconnect).
const WAIT: Duration = Duration::from_secs(30);
/// How long the relay stays down between the old one's shutdown and the new one's start.
const RELAY_DOWN: Duration = Duration::from_secs(2);

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A file under target/interop/, or a panic saying how to build it.
fn interop_artifact(name: &str) -> PathBuf {
    let path = manifest_dir().join("target/interop").join(name);
    assert!(
        path.exists(),
        "{} not found: this test needs the gRPC-Go and gRPC-Java xDS clients. Build them with \
         scripts/setup-grpc-clients.sh (needs Go >= 1.26, Java 17, Maven 3.8).",
        path.display()
    );
    path
}

fn go_greeter() -> PathBuf {
    interop_artifact("grpc-go-greeter")
}

/// `java` (17 or later), or a panic.
fn java() -> PathBuf {
    let out = std::process::Command::new("java")
        .arg("-version")
        .output()
        .unwrap_or_else(|e| panic!("`java` not runnable ({e}): this test needs Java 17"));
    assert!(
        out.status.success(),
        "java -version failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from("java")
}

fn read_file(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()))
}

/// A scratch directory for one test.
fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("adsrelay-grpc-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// deploy/grpc/bootstrap.json with the relay's port, written to `dir`.
fn write_bootstrap(dir: &Path, relay: SocketAddr) -> PathBuf {
    let template =
        std::fs::read_to_string(manifest_dir().join("deploy/grpc/bootstrap.json")).unwrap();
    let json: Value = serde_json::from_str(&template).expect("bootstrap.json is JSON");
    assert_eq!(
        json["xds_servers"][0]["server_uri"], "127.0.0.1:18000",
        "deploy/grpc/bootstrap.json must point at 127.0.0.1:18000 (the test substitutes the port)"
    );
    let path = dir.join("bootstrap.json");
    std::fs::write(
        &path,
        template.replace("127.0.0.1:18000", &format!("127.0.0.1:{}", relay.port())),
    )
    .unwrap();
    path
}

// --- go-control-plane state: what gRPC's xDS client needs ---------------------------------------

/// The gRPC API listener for [`LISTENER`]: an HTTP connection manager taking RouteConfiguration
/// [`ROUTE`] over ADS, with the router filter (gRPC rejects an empty filter list).
fn api_listener() -> Value {
    json!({
        "@type": LISTENER_TYPE,
        "name": LISTENER,
        "api_listener": { "api_listener": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "greeter",
            "rds": {
                "route_config_name": ROUTE,
                "config_source": { "ads": {}, "resource_api_version": "V3" },
            },
            "http_filters": [{
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }],
        } },
    })
}

/// Every call for the target goes to `cluster`.
fn route_to(cluster: &str) -> Value {
    json!({
        "@type": ROUTE_TYPE,
        "name": ROUTE,
        "virtual_hosts": [{
            "name": "greeter",
            "domains": [LISTENER],
            "routes": [{ "match": { "prefix": "" }, "route": { "cluster": cluster } }],
        }],
    })
}

/// An EDS cluster (endpoints over ADS), round robin.
fn eds_cluster(name: &str) -> Value {
    json!({
        "@type": CLUSTER_TYPE,
        "name": name,
        "type": "EDS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "eds_cluster_config": { "eds_config": { "ads": {}, "resource_api_version": "V3" } },
    })
}

/// `cluster`'s one endpoint, `backend`, in a weighted locality (gRPC ignores weight-0 ones).
fn endpoints(cluster: &str, backend: SocketAddr) -> Value {
    json!({
        "@type": ENDPOINT_TYPE,
        "cluster_name": cluster,
        "endpoints": [{
            "locality": { "region": "local", "zone": "a" },
            "load_balancing_weight": 1,
            "lb_endpoints": [{ "endpoint": { "address": { "socket_address": {
                "address": backend.ip().to_string(), "port_value": backend.port(),
            } } } }],
        }],
    })
}

/// The whole state: the listener, the route to `route_cluster`, and clusters `greeter-a` and
/// `greeter-b` with their endpoints.
fn greeter_state(
    version: &str,
    route_cluster: &str,
    a_endpoint: SocketAddr,
    b_endpoint: SocketAddr,
) -> Value {
    state(
        version,
        vec![
            api_listener(),
            route_to(route_cluster),
            eds_cluster("greeter-a"),
            eds_cluster("greeter-b"),
            endpoints("greeter-a", a_endpoint),
            endpoints("greeter-b", b_endpoint),
        ],
    )
}

// --- the relay, restartable on the same port ----------------------------------------------------

/// An in-process relay in front of go-control-plane, presenting [`NODE`] upstream. Unlike
/// `support::RelayUnderTest` it can be stopped (graceful shutdown, awaited) and started again on
/// the same xDS port.
struct Relay {
    xds: SocketAddr,
    admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Relay {
        let xds = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(upstream, xds)
    }

    /// Starts on the port [`Relay::stop`] left (held with `hold_port`, so no one takes it).
    fn start_from(upstream: SocketAddr, port: tokio::net::TcpSocket) -> Relay {
        Self::serve(
            upstream,
            port.listen(1024).expect("listen on the relay's port"),
        )
    }

    fn serve(upstream: SocketAddr, xds: TcpListener) -> Relay {
        let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        admin.set_nonblocking(true).unwrap();
        let admin = TcpListener::from_std(admin).unwrap();
        let admin_addr = admin.local_addr().unwrap();
        let mut config =
            adsrelay::config::Config::with_upstream(format!("http://{upstream}").parse().unwrap());
        config.node_id = NODE.into();
        config.unsubscribe_linger = Duration::from_secs(30);
        config.backoff_initial = Duration::from_millis(50);
        config.backoff_max = Duration::from_millis(500);
        config.limits.drain_period = Duration::from_millis(200);
        let addr = xds.local_addr().unwrap();
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(adsrelay::run(config, xds, admin, async {
            let _ = rx.await;
        }));
        Relay {
            xds: addr,
            admin: admin_addr,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// The sum of metric `name` over its label sets (0 if absent).
    async fn metric(&self, name: &str) -> f64 {
        let (code, body) = http_get(self.admin, "/metrics").await;
        assert_eq!(code, 200, "GET /metrics: {body}");
        body.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Asserts that neither the gRPC client nor the relay rejected anything; returns the client
    /// ACKs the relay counted.
    async fn assert_no_nacks(&self, what: &str) -> f64 {
        let down = self.metric("adsrelay_downstream_nacks_total").await;
        let up = self.metric("adsrelay_upstream_nacks_total").await;
        assert_eq!(
            (down, up),
            (0.0, 0.0),
            "{what}: NACKs (from the gRPC client, to go-control-plane)"
        );
        self.metric("adsrelay_downstream_acks_total").await
    }

    /// Waits until the relay counted `n` client ACKs: a reconnected gRPC client ACKs the first
    /// response of each of its 4 types.
    async fn wait_acks(&self, n: f64) -> Result<Duration, String> {
        let start = Instant::now();
        loop {
            let acks = self.metric("adsrelay_downstream_acks_total").await;
            if acks >= n {
                return Ok(start.elapsed());
            }
            if start.elapsed() > WAIT {
                return Err(format!(
                    "the relay counted {acks} client ACKs in {WAIT:?}, expected {n}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Graceful shutdown (as SIGTERM), awaited; returns the port, bound but not listening
    /// (connections are refused, as to a stopped relay), for [`Relay::start_from`].
    async fn stop(&mut self) -> tokio::net::TcpSocket {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(Duration::from_secs(15), task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => panic!("relay ended with an error: {e}"),
                Ok(Err(e)) => panic!("relay task panicked: {e}"),
                Err(_) => panic!("relay did not shut down within 15 s"),
            }
        }
        hold_port(self.xds).await
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

// --- processes ---------------------------------------------------------------------------------

/// A Go greeter server replying with its name. It dies when dropped (killed), and by itself when
/// this test process dies (its stdin closes).
struct Greeter {
    name: &'static str,
    addr: SocketAddr,
    _child: Child,
}

impl Greeter {
    async fn start(dir: &Path, name: &'static str) -> Greeter {
        let stderr = dir.join(format!("greeter-{name}.stderr"));
        let mut child = Command::new(go_greeter())
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
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", go_greeter().display()));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("greeter {name} did not start:\n{}", read_file(&stderr)))
            .unwrap()
            .unwrap_or_else(|| {
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

#[derive(Clone, Copy, Debug)]
enum Lang {
    Go,
    Java,
}

/// A client process calling [`TARGET`] every 100 ms until its stdin closes (it is dropped or the
/// test dies), one stdout line per call.
struct Client {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    /// The last lines read, for failure messages.
    recent: VecDeque<String>,
    stderr: PathBuf,
    /// "Go client live", for messages.
    what: String,
    calls: usize,
    errors: usize,
}

impl Client {
    fn start(lang: Lang, dir: &Path, bootstrap: &Path, label: &str) -> Client {
        let stderr = dir.join(format!("client-{label}.stderr"));
        let mut cmd = match lang {
            Lang::Go => Command::new(go_greeter()),
            Lang::Java => {
                let mut cmd = Command::new(java());
                cmd.arg("-jar")
                    .arg(interop_artifact("grpc-java-greeter.jar"));
                cmd
            }
        };
        cmd.args(["call", "--target", TARGET, "--bootstrap"])
            .arg(bootstrap)
            .args(["--interval-ms", "100", "--rpc-timeout-ms", "2000"])
            .env("GRPC_XDS_BOOTSTRAP", bootstrap)
            .env("GRPC_GO_LOG_SEVERITY_LEVEL", "warning")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the {lang:?} client: {e}"));
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Client {
            child,
            lines,
            recent: VecDeque::new(),
            stderr,
            what: format!("{lang:?} client {label}"),
            calls: 0,
            errors: 0,
        }
    }

    /// The next call's line, or None if the client exited or nothing came before `deadline`.
    async fn next(&mut self, deadline: tokio::time::Instant) -> Option<String> {
        let line = tokio::time::timeout_at(deadline, self.lines.recv())
            .await
            .ok()
            .flatten()?;
        self.calls += 1;
        if !line.starts_with("OK ") {
            self.errors += 1;
        }
        self.recent.push_back(line.clone());
        if self.recent.len() > 15 {
            self.recent.pop_front();
        }
        Some(line)
    }

    fn failure(&mut self, what: &str) -> String {
        let status = match self.child.try_wait() {
            Ok(Some(status)) => format!("exited: {status}"),
            _ => "still running".into(),
        };
        format!(
            "{}: {what} (client {status}; {} calls, {} failed)\n--- last calls ---\n{}\n\
             --- client stderr ---\n{}",
            self.what,
            self.calls,
            self.errors,
            Vec::from(self.recent.clone()).join("\n"),
            read_file(&self.stderr)
        )
    }

    /// Reads calls until one is answered by `name`; returns how long that took, or the failure
    /// message.
    async fn try_reaches(&mut self, name: &str) -> Result<Duration, String> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + WAIT;
        let want = format!("OK {name}");
        loop {
            match self.next(deadline).await {
                Some(line) if line == want => return Ok(start.elapsed()),
                Some(_) => {}
                None => {
                    return Err(self.failure(&format!("no call reached {name} within {WAIT:?}")))
                }
            }
        }
    }

    /// [`Client::try_reaches`], failing the test with the relay's and go-control-plane's view.
    async fn reaches(&mut self, name: &str, relay: &Relay, gcp: &GoControlPlane) -> Duration {
        match self.try_reaches(name).await {
            Ok(t) => t,
            Err(msg) => panic!("{msg}\n{}", diagnostics(relay, gcp).await),
        }
    }

    /// Reads calls until one fails; returns how long that took and the failure.
    async fn fails(&mut self) -> (Duration, String) {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match self.next(deadline).await {
                Some(line) if line.starts_with("ERR ") => return (start.elapsed(), line),
                Some(_) => {}
                None => {
                    let msg = self.failure(&format!("no call failed within {WAIT:?}"));
                    panic!("{msg}")
                }
            }
        }
    }

    /// For `period`, every call (and at least a few) must be answered by `name`; returns the
    /// number of calls.
    async fn stays_on(&mut self, name: &str, period: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + period;
        let want = format!("OK {name}");
        let mut n = 0;
        while let Some(line) = self.next(deadline).await {
            if line != want {
                let msg = self.failure(&format!(
                    "expected every call answered by {name} for {period:?}, call {n} got {line:?}"
                ));
                panic!("{msg}")
            }
            n += 1;
        }
        if n < 3 {
            let msg = self.failure(&format!(
                "only {n} calls in {period:?} (the client should call every 100 ms)"
            ));
            panic!("{msg}")
        }
        n
    }
}

/// The relay's view of its clients and upstream, and go-control-plane's last events, for failure
/// messages.
async fn diagnostics(relay: &Relay, gcp: &GoControlPlane) -> String {
    let mut out = String::new();
    for path in ["/debug/clients", "/debug/upstreams"] {
        let (_, body) = http_get(relay.admin, path).await;
        out += &format!("--- relay {path} ---\n{body}\n");
    }
    let events = gcp.events();
    out += "--- go-control-plane: last events ---\n";
    for e in &events[events.len().saturating_sub(30)..] {
        out += &format!("{e}\n");
    }
    out + &format!("--- go-control-plane stderr ---\n{}", gcp.stderr())
}

/// The relay's upstream streams seen by go-control-plane so far.
fn upstream_streams(gcp: &GoControlPlane) -> usize {
    gcp.events()
        .iter()
        .filter(|e| e["event"] == "stream_open")
        .count()
}

async fn scenario(lang: Lang) {
    let test_start = Instant::now();
    let dir = scratch_dir(&format!("{lang:?}").to_lowercase());
    let a = Greeter::start(&dir, "A").await;
    let b = Greeter::start(&dir, "B").await;

    let mut gcp =
        GoControlPlane::start(NODE, &greeter_state("v1", "greeter-a", a.addr, b.addr)).await;
    let mut relay = Relay::start(gcp.addr).await;
    let bootstrap = write_bootstrap(&dir, relay.xds);
    let mut client = Client::start(lang, &dir, &bootstrap, "live");

    // 1. Resolves through the relay and reaches A.
    let t = client.reaches(a.name, &relay, &gcp).await;
    let n = client.stays_on(a.name, Duration::from_millis(500)).await;
    println!("{lang:?}: 1. first call answered by A after {t:?} (then {n} calls, all A)");

    // 2. A route change moves the calls to cluster greeter-b, endpoint B.
    gcp.set(&greeter_state("v2", "greeter-b", a.addr, b.addr))
        .await;
    let t = client.reaches(b.name, &relay, &gcp).await;
    let n = client.stays_on(b.name, Duration::from_millis(500)).await;
    println!("{lang:?}: 2. route -> greeter-b: calls on B after {t:?} (then {n} calls, all B)");
    let streams_before = upstream_streams(&gcp);
    let acks = relay.assert_no_nacks("before the restart").await;
    assert!(
        acks >= 4.0,
        "the client ACKed LDS, RDS, CDS, EDS: {acks} ACKs"
    );

    // 3. The relay restarts on the same port. While it is down the client keeps its config...
    let down = Instant::now();
    let port = relay.stop().await;
    let shutdown = down.elapsed();
    let n = client.stays_on(b.name, RELAY_DOWN).await;
    println!(
        "{lang:?}: 3. relay shut down in {shutdown:?}; down {:?}: {n} calls, all B",
        down.elapsed()
    );
    // ...reconnects to the new relay (empty cache) and gets its config again (ACKs LDS, RDS,
    // CDS, EDS)...
    let relay = Relay::start_from(gcp.addr, port);
    assert_eq!(relay.xds.port(), bootstrap_port(&bootstrap));
    let back = match relay.wait_acks(4.0).await {
        Ok(t) => t,
        Err(e) => panic!(
            "{}\n{}",
            client.failure(&format!("not back on the new relay: {e}")),
            diagnostics(&relay, &gcp).await
        ),
    };
    let n = client.stays_on(b.name, Duration::from_millis(300)).await;
    println!(
        "{lang:?}: 3. new relay up; the client is back on it after {back:?} (calls on B: {n})"
    );
    // ...and follows an endpoint change through it.
    gcp.set(&greeter_state("v3", "greeter-b", a.addr, a.addr))
        .await;
    let t = client.reaches(a.name, &relay, &gcp).await;
    let n = client.stays_on(a.name, Duration::from_millis(500)).await;
    println!(
        "{lang:?}: 3. greeter-b's endpoint -> A: calls on A after {t:?} (then {n} calls, all A)"
    );

    // 4. A new client, with the first one still on the relay, goes straight to A, on the same
    //    upstream stream.
    let mut fresh = Client::start(lang, &dir, &bootstrap, "fresh");
    let t = fresh.reaches(a.name, &relay, &gcp).await;
    let n = fresh.stays_on(a.name, Duration::from_millis(500)).await;
    println!("{lang:?}: 4. a new client: first call answered by A after {t:?} (then {n} calls)");

    // 5. The listener is removed: calls fail (gRPC treats a resource missing from a
    //    state-of-the-world LDS response as deleted); it comes back: calls succeed again.
    let mut without_listener = greeter_state("v4", "greeter-b", a.addr, a.addr);
    without_listener["resources"]
        .as_array_mut()
        .unwrap()
        .retain(|r| r["@type"] != LISTENER_TYPE);
    gcp.set(&without_listener).await;
    let (t, error) = client.fails().await;
    assert!(
        error.to_uppercase().starts_with("ERR UNAVAILABLE") && error.contains(LISTENER),
        "{lang:?}: expected UNAVAILABLE naming the removed listener, got {error:?}"
    );
    println!("{lang:?}: 5. listener removed: calls fail after {t:?}: {error}");
    gcp.set(&greeter_state("v5", "greeter-b", a.addr, a.addr))
        .await;
    let t = client.reaches(a.name, &relay, &gcp).await;
    let n = client.stays_on(a.name, Duration::from_millis(500)).await;
    fresh.reaches(a.name, &relay, &gcp).await;
    println!("{lang:?}: 5. listener back: calls on A after {t:?} (then {n} calls, all A)");

    let acks_after = relay.assert_no_nacks("after the restart").await;
    let events = gcp.events();
    let nacked: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "request" && e["nack"] == true)
        .collect();
    assert!(
        nacked.is_empty(),
        "the relay NACKed go-control-plane: {nacked:?}"
    );
    let streams = upstream_streams(&gcp);
    println!(
        "{lang:?}: client ACKs counted by the relay: {acks} before the restart, {acks_after} by \
         the new relay; upstream streams: {streams_before} before the restart, {streams} in all; \
         {} calls, {} failed; {:?} in all",
        client.calls + fresh.calls,
        client.errors + fresh.errors,
        test_start.elapsed()
    );
    assert_eq!(
        (streams_before, streams),
        (1, 2),
        "one upstream stream per relay, shared by both clients"
    );
    drop(client);
    drop(fresh);
    drop(relay);
    gcp.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

fn bootstrap_port(bootstrap: &Path) -> u16 {
    let json: Value = serde_json::from_str(&read_file(bootstrap)).unwrap();
    json["xds_servers"][0]["server_uri"]
        .as_str()
        .and_then(|s| s.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("server_uri host:port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_xds_client_follows_changes_and_a_relay_restart_with_go_control_plane() {
    scenario(Lang::Go).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_java_xds_client_follows_changes_and_a_relay_restart_with_go_control_plane() {
    scenario(Lang::Java).await;
}
