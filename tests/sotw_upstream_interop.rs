//! The relay's state-of-the-world upstream (`upstream_protocol = sotw`, and `auto` falling back to
//! it) against a real go-control-plane (v0.14.0, tests/interop/go-control-plane) that serves no
//! Delta at all (`--sotw-only`: grpc-go answers `DeltaAggregatedResources` with UNIMPLEMENTED), with
//! real Envoy 1.40s (Delta and SotW bootstraps) and a gRPC-Go xDS client in front of the relay.
//!
//! Scenarios (one at a time: 2 shared cores):
//! - an Envoy fleet in two groups follows route and endpoint changes, a removed Cluster and a
//!   removed Listener, and a Cluster added later (wildcard CDS); go-control-plane sees one SotW ADS
//!   stream per group and no Delta; then go-control-plane restarts with a Cluster removed while the
//!   relay was away, and the fleet converges on it;
//! - the relay restarts warm (snapshot_path) and then cold, with a change each time while it is
//!   down: Envoys and the gRPC client converge, nothing is NACKed;
//! - `auto` against the SotW-only server: the group ends on SotW (/debug/upstreams), one switch is
//!   counted, the Envoy gets its config;
//! - `--classify-only` (a MuxCache that cannot route Delta: the first Delta request would crash the
//!   server) with LinearCache EDS: the SotW upstream never sends it one, endpoint changes flow;
//! - the SnapshotCache with its ads flag on and off (`--snapshot-ads`): Envoys converge and follow
//!   a change either way. With it on, go-control-plane answers a named type only when the request
//!   names every resource of that type in the snapshot, so a group (all groups present the
//!   relay's node id: one snapshot) wanting one of two RouteConfigurations is answered only with
//!   it off. A group subscribing RouteConfigurations by wildcard gets them all either way, which
//!   needs the legacy wildcard (an empty list) upstream for every type, not only Listener and
//!   Cluster: go-control-plane's SotW SnapshotCache does not know an explicit `*` (in ADS mode the
//!   request fails its check and is never answered; without it the answer keeps only the
//!   requested names, so it is empty, and is sent again on every ACK).
//!
//! Needs target/interop/gcp-server (scripts/setup-go-interop.sh), target/interop/grpc-go-greeter
//! (scripts/setup-grpc-clients.sh) and Envoy (scripts/test.sh).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use adsrelay::config::{Config, SnapshotConfig, UpstreamProtocol};
use serde_json::{json, Value};
use support::envoy::{free_port, Envoy};
use support::fleet::{backend, get, has_cluster, has_endpoint, process_events, strings};
use support::gcp::{
    cluster, listener, load_assignment, route_config, state, GoControlPlane, CLUSTER_TYPE,
    ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE,
};
use support::{hold_port, http_get};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// The node id the relay presents upstream, and go-control-plane's snapshot key.
const NODE: &str = "relay-gcp-sotw";
const CONVERGE: Duration = Duration::from_secs(45);
const SOTW_ONLY: &[&str] = &["--sotw-only"];

/// One scenario at a time: each runs Envoys, go-control-plane and the relay on 2 shared cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// --- the relay, restartable on the same port ----------------------------------------------------

/// An in-process relay presenting [`NODE`] upstream, speaking `protocol` to it. Unlike
/// `support::RelayUnderTest` it can be stopped (graceful shutdown, awaited: the snapshot is
/// written) and started again on the same xDS port.
struct Relay {
    xds: SocketAddr,
    admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Relay {
    async fn start(upstream: SocketAddr, protocol: UpstreamProtocol) -> Relay {
        let xds = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(upstream, protocol, None, xds).await
    }

    /// Serves on `xds` (a port [`Relay::stop`] left), warm from `snapshot` if given.
    async fn serve(
        upstream: SocketAddr,
        protocol: UpstreamProtocol,
        snapshot: Option<&Path>,
        xds: TcpListener,
    ) -> Relay {
        let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_addr = admin.local_addr().unwrap();
        let mut config = Config::with_upstream(format!("http://{upstream}").parse().unwrap());
        config.node_id = NODE.into();
        config.upstream_protocol = protocol;
        config.unsubscribe_linger = Duration::from_secs(2);
        config.backoff_initial = Duration::from_millis(50);
        config.backoff_max = Duration::from_millis(500);
        config.limits.drain_period = Duration::from_millis(200);
        config.snapshot = snapshot.map(|path| SnapshotConfig {
            path: path.to_path_buf(),
            // Written at the graceful shutdown; no periodic writes during the test.
            interval: Duration::from_secs(3600),
            max_staleness: Duration::from_secs(3600),
        });
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

    /// Graceful shutdown (as SIGTERM), awaited; returns the xDS port, bound but not listening
    /// (connections are refused, as to a stopped relay), for [`Relay::serve`].
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

    async fn get(&self, path: &str) -> String {
        let (code, text) = http_get(self.admin, path).await;
        assert_eq!(code, 200, "GET {path}: {text}");
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default()
    }

    /// The sum of metric `name` over its label sets (0 if absent).
    async fn metric(&self, name: &str) -> f64 {
        self.get("/metrics")
            .await
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Per group, the `upstream_protocol` /debug/upstreams shows (wherever it sits in the group's
    /// object), or "(absent)".
    async fn upstream_protocols(&self) -> BTreeMap<String, String> {
        fn find(v: &Value) -> Option<String> {
            match v {
                Value::Object(m) => m
                    .get("upstream_protocol")
                    .and_then(|p| p.as_str().map(String::from))
                    .or_else(|| m.values().find_map(find)),
                Value::Array(a) => a.iter().find_map(find),
                _ => None,
            }
        }
        let body = self.get("/debug/upstreams").await;
        let groups: Value = serde_json::from_str(body.trim())
            .unwrap_or_else(|e| panic!("/debug/upstreams is not JSON ({e}): {body}"));
        groups
            .as_array()
            .unwrap_or_else(|| panic!("/debug/upstreams is not a list: {body}"))
            .iter()
            .map(|g| {
                (
                    g["group"].as_str().unwrap_or("?").to_string(),
                    find(g).unwrap_or_else(|| "(absent)".into()),
                )
            })
            .collect()
    }

    /// Asserts that no client NACKed the relay and the relay NACKed nothing upstream.
    async fn assert_no_nacks(&self, what: &str) {
        let down = self.metric("adsrelay_downstream_nacks_total").await;
        let up = self.metric("adsrelay_upstream_nacks_total").await;
        assert_eq!(
            (down, up),
            (0.0, 0.0),
            "{what}: NACKs (from clients, to go-control-plane)"
        );
    }

    /// Waits until every group in `groups` shows `"upstream_protocol": "sotw"` in
    /// /debug/upstreams.
    async fn expect_sotw(&self, groups: &[&str]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let protocols = self.upstream_protocols().await;
            if groups
                .iter()
                .all(|g| protocols.get(*g).map(String::as_str) == Some("sotw"))
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "/debug/upstreams does not show every group {groups:?} on sotw: {protocols:?}\n{}",
                self.get("/debug/upstreams").await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

// --- Envoys and their traffic (the patterns of tests/go_control_plane_interop.rs) ---------------

/// Waits until every Envoy's `path` admin page satisfies `ok`, with diagnostics on timeout.
async fn converge(envoys: &mut [Envoy], path: &str, what: &str, ok: impl Fn(&str) -> bool) {
    let deadline = tokio::time::Instant::now() + CONVERGE;
    for (i, e) in envoys.iter_mut().enumerate() {
        loop {
            assert!(e.is_running(), "envoy {i} exited:\n{}", e.log_tail());
            if ok(&e.admin_get(path).await) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "envoy {i} did not converge on {what}:\n{}",
                e.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// True if Envoy's /listeners page lists listener `name`.
fn has_listener(listeners: &str, name: &str) -> bool {
    listeners
        .lines()
        .any(|l| l.starts_with(&format!("{name}::")))
}

/// `http.<listener>.downstream_rq_2xx` of one Envoy (the listeners' stat prefix is their name).
async fn served(envoy: &Envoy, listener: &str) -> u64 {
    let stat = format!("http.{listener}.downstream_rq_2xx");
    let stats = envoy
        .admin_get(&format!("/stats?filter=^{}$", stat.replace('.', "\\.")))
        .await;
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{stat}: ")))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// [`every_envoy_serves_on`] listener `ingress`.
async fn every_envoy_serves(envoys: &[Envoy], port: u16, path: &str, want: &str) {
    every_envoy_serves_on(envoys, "ingress", port, path, want).await;
}

/// GETs `path` through `listener`'s shared port (SO_REUSEPORT spreads connections over the
/// Envoys) until every Envoy has served one; each must answer `want`. Waits first for the
/// listener to answer `want` at all (the Envoys may still be converging).
async fn every_envoy_serves_on(
    envoys: &[Envoy],
    listener: &str,
    port: u16,
    path: &str,
    want: &str,
) {
    let deadline = tokio::time::Instant::now() + CONVERGE;
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
            && get(port, path).await == (200, want.to_string())
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "GET {path} never answered {want}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut before = Vec::new();
    for e in envoys {
        before.push(served(e, listener).await);
    }
    for attempt in 0..400 {
        let (code, body) = get(port, path).await;
        assert_eq!(
            (code, body.as_str()),
            (200, want),
            "GET {path} through the Envoys (attempt {attempt})"
        );
        if attempt % 8 == 7 {
            let mut all = true;
            for (e, b) in envoys.iter().zip(&before) {
                all &= served(e, listener).await > *b;
            }
            if all {
                return;
            }
        }
    }
    panic!("not every Envoy served {path}");
}

/// Asserts every Envoy is connected and rejected no update.
async fn assert_envoys_clean(envoys: &[Envoy], what: &str) {
    for (i, e) in envoys.iter().enumerate() {
        let stats = e
            .admin_get("/stats?filter=update_rejected|control_plane.connected_state")
            .await;
        assert!(
            stats.contains("control_plane.connected_state: 1"),
            "{what}: envoy {i}: {stats}"
        );
        for line in stats.lines().filter(|l| l.contains("update_rejected")) {
            assert!(
                line.ends_with(": 0"),
                "{what}: envoy {i} rejected config: {line}"
            );
        }
    }
}

// --- what go-control-plane saw ------------------------------------------------------------------

/// Asserts go-control-plane saw only SotW streams, `streams` of them, each presenting the relay's
/// node id and one group (node cluster), the groups being `groups`; and that the relay NACKed
/// nothing.
fn assert_sotw_streams(gcp: &GoControlPlane, streams: usize, groups: &[&str]) {
    let events = gcp.events();
    let opened: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "stream_open")
        .collect();
    let delta: Vec<&Value> = events.iter().filter(|e| e["delta"] == true).collect();
    assert!(delta.is_empty(), "Delta upstream: {delta:?}");
    assert_eq!(opened.len(), streams, "upstream streams: {opened:?}");
    // Stream ids start again at 1 in each go-control-plane process: key by (process, stream).
    let mut clusters_by_stream: BTreeMap<(usize, i64), BTreeSet<String>> = BTreeMap::new();
    let mut process = 0;
    for e in &events {
        if e["event"] == "listening" {
            process += 1;
        }
        if e["event"] != "request" {
            continue;
        }
        assert_eq!(e["node_id"], NODE, "upstream node id: {e}");
        clusters_by_stream
            .entry((process, e["stream"].as_i64().unwrap()))
            .or_default()
            .insert(e["node_cluster"].as_str().unwrap().to_string());
    }
    assert!(
        clusters_by_stream.values().all(|c| c.len() == 1),
        "each stream presents one group: {clusters_by_stream:?}"
    );
    let seen: BTreeSet<&str> = clusters_by_stream
        .values()
        .flatten()
        .map(String::as_str)
        .collect();
    assert_eq!(
        seen,
        groups.iter().copied().collect(),
        "{clusters_by_stream:?}"
    );
    let nacks: Vec<&Value> = events.iter().filter(|e| e["nack"] == true).collect();
    assert!(
        nacks.is_empty(),
        "the relay NACKed go-control-plane: {nacks:?}"
    );
}

// --- 1 and 2: an Envoy fleet, changes, removals, a go-control-plane restart ---------------------

struct Ports {
    listener: u16,
    extra: u16,
    a1: u16,
    b1: u16,
    b2: u16,
    c1: u16,
}

/// Four Envoys in two groups (a Delta and a SotW Envoy each) through one relay whose upstream is
/// SotW, in front of a go-control-plane without Delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_fleet_follows_sotw_only_go_control_plane() {
    let _one_at_a_time = SERIAL.lock().await;
    let started = Instant::now();
    let p = Ports {
        listener: free_port(),
        extra: free_port(),
        a1: backend("a1").await,
        b1: backend("b1").await,
        b2: backend("b2").await,
        c1: backend("c1").await,
    };
    // `routes` on the shared listener, and a second listener `extra` on its own port.
    let base = |routes: &[(&str, &str)], extra: bool| {
        let mut r = vec![
            listener("ingress", p.listener, "routes"),
            route_config("routes", routes),
        ];
        if extra {
            r.push(listener("extra", p.extra, "routes"));
        }
        r
    };
    let mut v1 = base(&[("/", "alpha")], true);
    v1.extend([
        cluster("alpha"),
        cluster("beta"),
        load_assignment("alpha", &[p.a1]),
        load_assignment("beta", &[p.b1]),
    ]);
    let mut gcp = GoControlPlane::start_with_args(NODE, &state("v1", v1), SOTW_ONLY).await;
    let relay = Relay::start(gcp.addr, UpstreamProtocol::Sotw).await;
    let port = relay.xds.port();
    let mut envoys = vec![
        Envoy::start("bootstrap-delta.yaml", port, "a-delta", "group-a"),
        Envoy::start("bootstrap-sotw.yaml", port, "a-sotw", "group-a"),
        Envoy::start("bootstrap-delta.yaml", port, "b-delta", "group-b"),
        Envoy::start("bootstrap-sotw.yaml", port, "b-sotw", "group-b"),
    ];

    // 1. LDS/RDS/CDS/EDS reach every Envoy, and each serves traffic.
    let t = Instant::now();
    converge(&mut envoys, "/clusters", "v1 endpoints", |c| {
        has_endpoint(c, "alpha", p.a1) && has_endpoint(c, "beta", p.b1)
    })
    .await;
    converge(&mut envoys, "/listeners", "v1 listeners", |l| {
        has_listener(l, "ingress") && has_listener(l, "extra")
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/", "a1").await;
    println!("1. fleet converged and served: {:.1?}", t.elapsed());
    relay.expect_sotw(&["group-a", "group-b"]).await;
    assert_sotw_streams(&gcp, 2, &["group-a", "group-b"]);

    // 2. A route change reaches every Envoy.
    let t = Instant::now();
    let mut v2 = base(&[("/", "beta")], true);
    v2.extend([
        cluster("alpha"),
        cluster("beta"),
        load_assignment("alpha", &[p.a1]),
        load_assignment("beta", &[p.b1]),
    ]);
    gcp.set(&state("v2", v2)).await;
    converge(&mut envoys, "/config_dump", "route to beta", |d| {
        d.contains("\"cluster\": \"beta\"") && !d.contains("\"cluster\": \"alpha\"")
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/", "b1").await;
    println!("2. route change: {:.1?}", t.elapsed());

    // 3. An endpoint change (LinearCache) reaches every Envoy.
    let t = Instant::now();
    let mut v3 = base(&[("/", "beta")], true);
    v3.extend([
        cluster("alpha"),
        cluster("beta"),
        load_assignment("alpha", &[p.a1]),
        load_assignment("beta", &[p.b2]),
    ]);
    gcp.set(&state("v3", v3)).await;
    converge(&mut envoys, "/clusters", "beta on b2", |c| {
        has_endpoint(c, "beta", p.b2) && !has_endpoint(c, "beta", p.b1)
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/", "b2").await;
    println!("3. endpoint change: {:.1?}", t.elapsed());

    // 4. A removed Cluster and a removed Listener disappear from every Envoy; a Cluster added
    // later is picked up by wildcard CDS, with its endpoints and a route to it.
    let t = Instant::now();
    let mut v4 = base(&[("/gamma", "gamma"), ("/", "beta")], false);
    v4.extend([
        cluster("beta"),
        cluster("gamma"),
        load_assignment("beta", &[p.b2]),
        load_assignment("gamma", &[p.c1]),
    ]);
    gcp.set(&state("v4", v4)).await;
    converge(&mut envoys, "/clusters", "alpha gone, gamma added", |c| {
        !has_cluster(c, "alpha") && has_endpoint(c, "gamma", p.c1)
    })
    .await;
    converge(&mut envoys, "/listeners", "extra gone", |l| {
        has_listener(l, "ingress") && !has_listener(l, "extra")
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/gamma", "c1").await;
    every_envoy_serves(&envoys, p.listener, "/", "b2").await;
    println!(
        "4. cluster and listener removed, cluster added: {:.1?}",
        t.elapsed()
    );
    assert_sotw_streams(&gcp, 2, &["group-a", "group-b"]);
    assert_envoys_clean(&envoys, "after the changes").await;

    // 5. go-control-plane goes away; while the relay cannot reach it, beta is removed (and / goes
    // to gamma). It comes back with that state: the fleet converges on it.
    let t = Instant::now();
    gcp.stop().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    every_envoy_serves(&envoys, p.listener, "/", "b2").await;
    let mut v5 = base(&[("/", "gamma")], false);
    v5.extend([cluster("gamma"), load_assignment("gamma", &[p.c1])]);
    gcp.set(&state("v5", v5)).await;
    gcp.restart().await;
    converge(
        &mut envoys,
        "/clusters",
        "beta gone after the restart",
        |c| !has_cluster(c, "beta") && has_endpoint(c, "gamma", p.c1),
    )
    .await;
    converge(&mut envoys, "/config_dump", "/ to gamma", |d| {
        !d.contains("\"cluster\": \"beta\"")
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/", "c1").await;
    println!(
        "5. go-control-plane restart with a removal: {:.1?}",
        t.elapsed()
    );
    let events = gcp.events();
    let after = process_events(&events, 1);
    let opened: Vec<&Value> = after
        .iter()
        .filter(|e| e["event"] == "stream_open")
        .collect();
    assert!(
        opened.len() == 2 && opened.iter().all(|e| e["delta"] == false),
        "one SotW stream per group after the restart: {opened:?}"
    );
    assert_sotw_streams(&gcp, 4, &["group-a", "group-b"]);
    assert_envoys_clean(&envoys, "after the go-control-plane restart").await;
    relay.assert_no_nacks("fleet").await;
    relay.expect_sotw(&["group-a", "group-b"]).await;
    assert_eq!(
        relay
            .metric("adsrelay_upstream_protocol_switches_total")
            .await,
        0.0,
        "`sotw` never tries Delta, so never switches"
    );
    println!("fleet scenario: {:.1?}", started.elapsed());
}

// --- 3: relay restarts, warm and cold, with Envoys and a gRPC-Go client -------------------------

const GRPC_TARGET: &str = "xds:///greeter.example:50051";
/// The gRPC API listener's name: the target's authority.
const GRPC_LISTENER: &str = "greeter.example:50051";
const GRPC_ROUTE: &str = "greeter_route";
/// The node cluster (so the group) of deploy/grpc/bootstrap.json.
const GRPC_GROUP: &str = "demo";

fn go_greeter() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/interop/grpc-go-greeter");
    assert!(
        path.exists(),
        "{} not found: build it with scripts/setup-grpc-clients.sh (needs Go >= 1.26)",
        path.display()
    );
    path
}

/// The gRPC API listener: an HTTP connection manager taking [`GRPC_ROUTE`] over ADS. (Envoy
/// ignores an API listener from LDS, with a warning, and does not reject the update.)
fn api_listener() -> Value {
    json!({
        "@type": LISTENER_TYPE,
        "name": GRPC_LISTENER,
        "api_listener": { "api_listener": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "greeter",
            "rds": {
                "route_config_name": GRPC_ROUTE,
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

/// Every gRPC call goes to `cluster`.
fn grpc_route_to(cluster: &str) -> Value {
    json!({
        "@type": ROUTE_TYPE,
        "name": GRPC_ROUTE,
        "virtual_hosts": [{
            "name": "greeter",
            "domains": [GRPC_LISTENER],
            "routes": [{ "match": { "prefix": "" }, "route": { "cluster": cluster } }],
        }],
    })
}

/// `cluster`'s one endpoint, `backend`, in a weighted locality (gRPC ignores weight-0 ones).
fn grpc_endpoints(cluster: &str, backend: SocketAddr) -> Value {
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

/// A Go greeter server replying with its name; dies with the test (killed on drop, and by itself
/// when its stdin closes).
struct Greeter {
    addr: SocketAddr,
    _child: Child,
}

impl Greeter {
    async fn start(dir: &Path, name: &str) -> Greeter {
        let stderr = dir.join(format!("greeter-{name}.stderr"));
        let mut child = Command::new(go_greeter())
            .args(["serve", "--port", "0", "--name", name])
            .arg("--exit-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", go_greeter().display()));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // "serving NAME on 127.0.0.1:PORT"
        let line = tokio::time::timeout(Duration::from_secs(15), lines.next_line())
            .await
            .ok()
            .and_then(|l| l.ok().flatten())
            .unwrap_or_else(|| {
                panic!(
                    "greeter {name} did not start:\n{}",
                    std::fs::read_to_string(&stderr).unwrap_or_default()
                )
            });
        let addr = line
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("greeter {name}: unexpected first line {line:?}"));
        Greeter {
            addr,
            _child: child,
        }
    }
}

/// The gRPC-Go xDS client calling [`GRPC_TARGET`] every 100 ms, one stdout line per call
/// ("OK NAME" or "ERR ...").
struct GrpcClient {
    _child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    recent: Vec<String>,
    stderr: PathBuf,
}

impl GrpcClient {
    fn start(dir: &Path, relay: SocketAddr) -> GrpcClient {
        let template = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/grpc/bootstrap.json"),
        )
        .unwrap();
        assert!(template.contains("127.0.0.1:18000"), "{template}");
        let bootstrap = dir.join("bootstrap.json");
        std::fs::write(
            &bootstrap,
            template.replace("127.0.0.1:18000", &relay.to_string()),
        )
        .unwrap();
        let stderr = dir.join("client.stderr");
        let mut child = Command::new(go_greeter())
            .args(["call", "--target", GRPC_TARGET, "--bootstrap"])
            .arg(&bootstrap)
            .args(["--interval-ms", "100", "--rpc-timeout-ms", "2000"])
            .env("GRPC_XDS_BOOTSTRAP", &bootstrap)
            .env("GRPC_GO_LOG_SEVERITY_LEVEL", "warning")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the gRPC-Go client: {e}"));
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        GrpcClient {
            _child: child,
            lines,
            recent: Vec::new(),
            stderr,
        }
    }

    /// Reads calls until one is answered by `name`; returns how long that took.
    async fn reaches(&mut self, name: &str) -> Duration {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + CONVERGE;
        let want = format!("OK {name}");
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) if line == want => return start.elapsed(),
                Ok(Some(line)) => {
                    self.recent.push(line);
                    let drop = self.recent.len().saturating_sub(10);
                    self.recent.drain(..drop);
                }
                _ => panic!(
                    "gRPC-Go client: no call reached {name} within {CONVERGE:?}; last calls:\n{}\n\
                     --- stderr ---\n{}",
                    self.recent.join("\n"),
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                ),
            }
        }
    }
}

/// The relay restarts twice on the same port, each time with a change made upstream while it was
/// down: first warm (its snapshot serves the reconnecting clients until go-control-plane answers),
/// then cold (empty cache). Two Envoys (Delta and SotW) and a gRPC-Go client follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_restarts_warm_and_cold_with_a_sotw_upstream() {
    let _one_at_a_time = SERIAL.lock().await;
    let started = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("adsrelay-sotw-restart-")
        .tempdir()
        .unwrap();
    let snapshot = dir.path().join("cache.snap");
    let (listener_port, a1, b1, b2) = (
        free_port(),
        backend("a1").await,
        backend("b1").await,
        backend("b2").await,
    );
    let greeter_a = Greeter::start(dir.path(), "A").await;
    let greeter_b = Greeter::start(dir.path(), "B").await;
    // The Envoys' route goes to `route`, beta's endpoint is `beta_port`; the gRPC route goes to
    // `grpc_route`, greeter-b's endpoint is `greeter_b`.
    let world =
        |version: &str, route: &str, beta_port: u16, grpc_route: &str, greeter_b: SocketAddr| {
            state(
                version,
                vec![
                    listener("ingress", listener_port, "routes"),
                    route_config("routes", &[("/", route)]),
                    cluster("alpha"),
                    cluster("beta"),
                    load_assignment("alpha", &[a1]),
                    load_assignment("beta", &[beta_port]),
                    api_listener(),
                    grpc_route_to(grpc_route),
                    cluster("greeter-a"),
                    cluster("greeter-b"),
                    grpc_endpoints("greeter-a", greeter_a.addr),
                    grpc_endpoints("greeter-b", greeter_b),
                ],
            )
        };
    // Without the SnapshotCache's ads flag: the gRPC group names one of the two Listeners and the
    // Envoys' group one of the two RouteConfigurations, and both groups present the same node id
    // (one snapshot), so in ADS mode go-control-plane would answer neither (see the last test).
    let mut gcp = GoControlPlane::start_with_args(
        NODE,
        &world("v1", "alpha", b1, "greeter-a", greeter_b.addr),
        &["--sotw-only", "--snapshot-ads=false"],
    )
    .await;
    let xds = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut relay = Relay::serve(gcp.addr, UpstreamProtocol::Sotw, Some(&snapshot), xds).await;
    let port = relay.xds.port();
    let mut envoys = vec![
        Envoy::start("bootstrap-delta.yaml", port, "r-delta", "restart"),
        Envoy::start("bootstrap-sotw.yaml", port, "r-sotw", "restart"),
    ];
    let mut client = GrpcClient::start(dir.path(), relay.xds);
    let t = Instant::now();
    every_envoy_serves(&envoys, listener_port, "/", "a1").await;
    let grpc = client.reaches("A").await;
    println!(
        "first config: Envoys {:.1?}, gRPC-Go client on A after {grpc:.1?}",
        t.elapsed()
    );
    relay.expect_sotw(&["restart", GRPC_GROUP]).await;
    assert_envoys_clean(&envoys, "before the restarts").await;
    relay.assert_no_nacks("before the restarts").await;

    // Warm: while the relay is down, the Envoys' route moves to beta and the gRPC route to
    // greeter-b.
    let t = Instant::now();
    let held = relay.stop().await;
    assert!(snapshot.exists(), "no snapshot written at shutdown");
    gcp.set(&world("v2", "beta", b1, "greeter-b", greeter_b.addr))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let xds = held.listen(1024).unwrap();
    relay = Relay::serve(gcp.addr, UpstreamProtocol::Sotw, Some(&snapshot), xds).await;
    converge(&mut envoys, "/config_dump", "route to beta", |d| {
        d.contains("\"cluster\": \"beta\"") && !d.contains("\"cluster\": \"alpha\"")
    })
    .await;
    every_envoy_serves(&envoys, listener_port, "/", "b1").await;
    client.reaches("B").await;
    println!("warm restart converged: {:.1?}", t.elapsed());
    assert!(
        relay.metric("adsrelay_snapshot_loaded_resources").await > 0.0,
        "the warm relay loaded its snapshot"
    );
    relay.expect_sotw(&["restart", GRPC_GROUP]).await;
    assert_envoys_clean(&envoys, "after the warm restart").await;
    relay.assert_no_nacks("after the warm restart").await;

    // Cold: while the relay is down, beta's endpoint moves to b2 and greeter-b's to A.
    let t = Instant::now();
    let held = relay.stop().await;
    gcp.set(&world("v3", "beta", b2, "greeter-b", greeter_a.addr))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let xds = held.listen(1024).unwrap();
    relay = Relay::serve(gcp.addr, UpstreamProtocol::Sotw, None, xds).await;
    converge(&mut envoys, "/clusters", "beta on b2", |c| {
        has_endpoint(c, "beta", b2) && !has_endpoint(c, "beta", b1)
    })
    .await;
    every_envoy_serves(&envoys, listener_port, "/", "b2").await;
    client.reaches("A").await;
    println!("cold restart converged: {:.1?}", t.elapsed());
    relay.expect_sotw(&["restart", GRPC_GROUP]).await;
    assert_envoys_clean(&envoys, "after the cold restart").await;
    relay.assert_no_nacks("after the cold restart").await;
    // One SotW stream per group per relay: 3 relays, 2 groups.
    assert_sotw_streams(&gcp, 6, &["restart", GRPC_GROUP]);
    println!("restart scenario: {:.1?}", started.elapsed());
}

// --- 4: auto against a server without Delta -----------------------------------------------------

/// `auto`: the relay tries Delta first; go-control-plane (`--sotw-only`) answers UNIMPLEMENTED, so
/// the group switches to SotW (once, counted) and the Envoy gets its config over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_switches_to_sotw_when_delta_is_unimplemented() {
    let _one_at_a_time = SERIAL.lock().await;
    let t = Instant::now();
    let (listener_port, a1, a2) = (free_port(), backend("a1").await, backend("a2").await);
    let world = |version: &str, port: u16| {
        state(
            version,
            vec![
                listener("ingress", listener_port, "routes"),
                route_config("routes", &[("/", "alpha")]),
                cluster("alpha"),
                load_assignment("alpha", &[port]),
            ],
        )
    };
    let mut gcp = GoControlPlane::start_with_args(NODE, &world("v1", a1), SOTW_ONLY).await;
    let relay = Relay::start(gcp.addr, UpstreamProtocol::Auto).await;
    let mut envoys = vec![Envoy::start(
        "bootstrap-delta.yaml",
        relay.xds.port(),
        "auto-delta",
        "auto",
    )];
    every_envoy_serves(&envoys, listener_port, "/", "a1").await;
    relay.expect_sotw(&["auto"]).await;
    gcp.set(&world("v2", a2)).await;
    converge(&mut envoys, "/clusters", "alpha on a2", |c| {
        has_endpoint(c, "alpha", a2)
    })
    .await;
    every_envoy_serves(&envoys, listener_port, "/", "a2").await;
    let metrics = relay.get("/metrics").await;
    let switches: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("adsrelay_upstream_protocol_switches_total"))
        .collect();
    assert_eq!(
        switches,
        vec!["adsrelay_upstream_protocol_switches_total{group=\"auto\"} 1"],
        "one switch, for group auto"
    );
    assert_sotw_streams(&gcp, 1, &["auto"]);
    assert_envoys_clean(&envoys, "auto").await;
    relay.assert_no_nacks("auto").await;
    println!("auto switched to SotW and served: {:.1?}", t.elapsed());
}

// --- 5: a MuxCache that cannot serve Delta -------------------------------------------------------

/// go-control-plane with every service registered (Delta included) but a MuxCache with only
/// `Classify`, as its own integration driver's `-mux` mode: a Delta request would panic it. With a
/// SotW upstream none reaches it; EDS comes from the LinearCache and follows changes: an endpoint
/// moves, a Cluster added later gets its endpoints, endpoints are added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classify_only_mux_cache_with_linear_eds() {
    let _one_at_a_time = SERIAL.lock().await;
    let t = Instant::now();
    let (listener_port, a1, a2, g1) = (
        free_port(),
        backend("a1").await,
        backend("a2").await,
        backend("g1").await,
    );
    let world = |version: &str, alpha: &[u16], gamma: bool| {
        let mut r = vec![
            listener("ingress", listener_port, "routes"),
            route_config("routes", &[("/g", "gamma"), ("/", "alpha")]),
            cluster("alpha"),
            load_assignment("alpha", alpha),
        ];
        if gamma {
            r.extend([cluster("gamma"), load_assignment("gamma", &[g1])]);
        }
        state(version, r)
    };
    let mut gcp =
        GoControlPlane::start_with_args(NODE, &world("v1", &[a1], false), &["--classify-only"])
            .await;
    let relay = Relay::start(gcp.addr, UpstreamProtocol::Sotw).await;
    let port = relay.xds.port();
    let mut envoys = vec![
        Envoy::start("bootstrap-delta.yaml", port, "mux-delta", "mux"),
        Envoy::start("bootstrap-sotw.yaml", port, "mux-sotw", "mux"),
    ];
    every_envoy_serves(&envoys, listener_port, "/", "a1").await;
    gcp.set(&world("v2", &[a2], true)).await;
    converge(&mut envoys, "/clusters", "alpha on a2, gamma on g1", |c| {
        has_endpoint(c, "alpha", a2)
            && !has_endpoint(c, "alpha", a1)
            && has_endpoint(c, "gamma", g1)
    })
    .await;
    every_envoy_serves(&envoys, listener_port, "/", "a2").await;
    every_envoy_serves(&envoys, listener_port, "/g", "g1").await;
    // Still alive (`set` waits for its answer), and never asked for Delta.
    gcp.set(&world("v3", &[a1, a2], true)).await;
    converge(&mut envoys, "/clusters", "alpha on a1 and a2", |c| {
        has_endpoint(c, "alpha", a1) && has_endpoint(c, "alpha", a2)
    })
    .await;
    assert!(!gcp.stderr().contains("panic"), "{}", gcp.stderr());
    assert_sotw_streams(&gcp, 1, &["mux"]);
    let eds = gcp
        .events()
        .iter()
        .filter(|e| e["event"] == "response" && e["type"] == ENDPOINT_TYPE)
        .count();
    assert!(eds >= 3, "EDS answers from the LinearCache: {eds}");
    assert_envoys_clean(&envoys, "classify-only").await;
    relay.assert_no_nacks("classify-only").await;
    println!(
        "classify-only MuxCache with LinearCache EDS: {:.1?}",
        t.elapsed()
    );
}

// --- 6: the SnapshotCache's ads flag -------------------------------------------------------------

/// With the SnapshotCache's ads flag on and off: two listeners with a route configuration each
/// (RDS names two resources: with the flag on, go-control-plane answers only a request naming
/// both), wildcard CDS and LDS (with the flag on, answered only when the request names nothing).
/// Route changes reach a Delta and a SotW Envoy either way. A second group wanting only one of
/// the route configurations is answered only without the flag: every group presents the relay's
/// node id, so they share one snapshot, and ADS mode wants each request to name all of a type. A
/// third group subscribing RouteConfigurations by wildcard gets them all either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_cache_with_and_without_its_ads_flag() {
    let _one_at_a_time = SERIAL.lock().await;
    for ads in [true, false] {
        let t = Instant::now();
        let (one, two, a1, b1) = (
            free_port(),
            free_port(),
            backend("a1").await,
            backend("b1").await,
        );
        let world = |version: &str, second: &str| {
            state(
                version,
                vec![
                    listener("one", one, "routes-one"),
                    listener("two", two, "routes-two"),
                    route_config("routes-one", &[("/", "alpha")]),
                    route_config("routes-two", &[("/", second)]),
                    cluster("alpha"),
                    cluster("beta"),
                    load_assignment("alpha", &[a1]),
                    load_assignment("beta", &[b1]),
                ],
            )
        };
        let flag = format!("--snapshot-ads={ads}");
        let mut gcp =
            GoControlPlane::start_with_args(NODE, &world("v1", "alpha"), &["--sotw-only", &flag])
                .await;
        let relay = Relay::start(gcp.addr, UpstreamProtocol::Sotw).await;
        let group = format!("ads-{ads}");
        let port = relay.xds.port();
        let envoys = vec![
            Envoy::start("bootstrap-delta.yaml", port, "snap-delta", &group),
            Envoy::start("bootstrap-sotw.yaml", port, "snap-sotw", &group),
        ];
        every_envoy_serves_on(&envoys, "one", one, "/", "a1").await;
        every_envoy_serves_on(&envoys, "two", two, "/", "a1").await;
        // Another group (same node id upstream, so the same snapshot) wants only routes-one. In
        // ADS mode go-control-plane does not answer a request that leaves out routes-two.
        let subset = format!("subset-{ads}");
        let mut client = support::DeltaClient::connect(
            relay.xds,
            support::node("subset-0", &subset),
            support::subscribe(ROUTE_TYPE, &["routes-one"]),
        )
        .await;
        // A third group wants every RouteConfiguration (`*`, as Envoy's wildcard SRDS or a
        // wildcard VHDS is). go-control-plane's SotW SnapshotCache knows only the legacy wildcard
        // (an empty list): it answers an explicit `*` with nothing in ADS mode, and with no
        // resources (over and over) otherwise.
        let mut wild = support::DeltaClient::connect(
            relay.xds,
            support::node("wild-0", &format!("wild-{ads}")),
            support::subscribe(ROUTE_TYPE, &["*"]),
        )
        .await;
        let all = tokio::time::timeout(Duration::from_secs(5), wild.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "ads={ads}: wildcard RDS through the relay got no answer in 5 s (the relay must \
                     send go-control-plane the legacy wildcard, an empty list):\n{}",
                    gcp.stderr()
                )
            });
        wild.send(support::ack(&all)).await;
        assert_eq!(
            support::names(&all)
                .into_iter()
                .map(|(n, _)| n)
                .collect::<Vec<_>>(),
            vec!["routes-one".to_string(), "routes-two".to_string()],
            "ads={ads}: wildcard RDS through the relay"
        );
        if ads {
            client.expect_silence(Duration::from_secs(2)).await;
            assert!(
                gcp.stderr().contains("ADS mode: not responding"),
                "{}",
                gcp.stderr()
            );
        } else {
            let routes = client.recv_ack().await;
            assert_eq!(
                support::names(&routes)
                    .into_iter()
                    .map(|(n, _)| n)
                    .collect::<Vec<_>>(),
                vec!["routes-one".to_string()]
            );
        }
        gcp.set(&world("v2", "beta")).await;
        every_envoy_serves_on(&envoys, "two", two, "/", "b1").await;
        every_envoy_serves_on(&envoys, "one", one, "/", "a1").await;
        let events = gcp.events();
        let rds_answers: Vec<Vec<String>> = events
            .iter()
            .filter(|e| e["event"] == "response" && e["type"] == ROUTE_TYPE)
            .map(|e| {
                let mut names = strings(&e["resources"]);
                names.sort();
                names
            })
            .collect();
        assert!(
            rds_answers
                .iter()
                .any(|n| n == &["routes-one".to_string(), "routes-two".to_string()]),
            "ads={ads}: an RDS answer with both route configurations: {rds_answers:?}"
        );
        for type_url in [CLUSTER_TYPE, LISTENER_TYPE] {
            let answered = events.iter().any(|e| {
                e["event"] == "response"
                    && e["type"] == type_url
                    && !strings(&e["resources"]).is_empty()
            });
            assert!(answered, "ads={ads}: no non-empty {type_url} answer");
        }
        assert_sotw_streams(&gcp, 3, &[&group, &subset, &format!("wild-{ads}")]);
        assert_envoys_clean(&envoys, &format!("ads={ads}")).await;
        relay.assert_no_nacks(&format!("ads={ads}")).await;
        println!(
            "snapshot ads={ads}: converged and followed a change: {:.1?}",
            t.elapsed()
        );
    }
}
