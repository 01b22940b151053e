//! The relay in front of a real java-control-plane (1.0.49: `V3DiscoveryServer` over a
//! `SimpleCache` keyed by node id; tests/interop/java-control-plane), with real Envoy 1.40s
//! (Delta and SotW) in front of it. Traffic goes through each Envoy's listener to tiny HTTP
//! backends that answer with their own name; java-control-plane's server callbacks tell what it
//! saw.
//!
//! Needs target/interop/jcp-server.jar (scripts/setup-java-interop.sh) and Envoy (scripts/test.sh).
//! The relay-restart scenario also runs behind go-control-plane (target/interop/gcp-server), the
//! same code over `ControlPlaneProcess<K>`.
//!
//! How java-control-plane's Delta server differs from go-control-plane's (v0.14.0, see
//! tests/go_control_plane_interop.rs), as observed here and in its 1.0.49 source
//! (`DeltaDiscoveryRequestStreamObserver`, `AdsDeltaDiscoveryRequestStreamObserver`,
//! `SimpleCache.createDeltaWatch`):
//! - It ignores `initial_resource_versions`. What a stream holds is only what the client ACKed on
//!   that stream, so a new stream (a relay reconnect, a resume from a warm restart) gets every
//!   resource it subscribes to again, matching versions or not (go-control-plane sends only what
//!   changed). Asserted in the restart scenarios.
//! - It never sends `removed_resources` on a new stream: a resource deleted while the relay was
//!   away, or while java-control-plane was down, is never reported as removed (go-control-plane
//!   removes the `initial_resource_versions` it no longer has in its first answer). Only a change
//!   seen on a live stream, for a resource the stream ACKed, yields a removal. So after a restart
//!   the relay learns of a deletion only by reconciling (a full state from a fresh stream).
//! - Wildcard is by type, not by subscription: Clusters and Listeners are always wildcard (a
//!   subscription naming one Cluster gets every Cluster), ClusterLoadAssignments and
//!   RouteConfigurations never are (`*` there names nothing). go-control-plane follows the
//!   subscription (`*`, or a legacy empty first subscribe).
//! - No answer to a wildcard type with no resources: an empty Cluster set is never sent, not even
//!   on the first request of a stream, until a Cluster exists (go-control-plane answers a new
//!   wildcard subscription with an empty response). Until a stream's first response it sends
//!   nothing at all, not even the response headers (gRPC-Java sends them with the first message),
//!   so a client that waits for the headers before it sends more requests (tonic's
//!   `delta_aggregated_resources(..).await`, as the relay's upstream task does) waits forever.
//! - Resource versions are a hash of the Java object's `hashCode()`, which includes the message
//!   descriptor's identity hash: they differ between processes, so after a java-control-plane
//!   restart every resource has a new version even if unchanged (go-control-plane's are content
//!   hashes, stable across restarts). `system_version_info` is the snapshot version.
//! - Events (tests/support/jcp.rs): stream ids start at 0 in each process.
//!
//! One upstream stream per group; all groups present the relay's node id, so they share
//! java-control-plane's one snapshot.
//!
//! Two of these failed before the relay's upstream stream stopped waiting for response headers
//! (it now sends requests and runs its answer wait before they arrive):
//! `wildcard_type_with_no_resources` (no further subscription went out, /readyz stayed 503), and,
//! now and then, `relay_restart_warm_and_cold_converges_without_nack` (a cold relay whose upstream
//! stream opened before the first Envoy's subscriptions were applied sent no request at all).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use adsrelay::config::SnapshotConfig;
use serde_json::Value;
use support::envoy::{free_port, Envoy};
use support::fleet::{backend, get, has_cluster, has_endpoint, process_events, strings};
use support::gcp::{
    cluster, listener, load_assignment, route_config, state, CLUSTER_TYPE, ENDPOINT_TYPE,
    LISTENER_TYPE, ROUTE_TYPE,
};
use support::gcp::{ControlPlaneProcess, Go, ServerKind};
use support::jcp::{Java, JavaControlPlane};
use support::RelayUnderTest;
use tokio::net::TcpListener;

/// The node id the relay presents upstream, and java-control-plane's snapshot key.
const NODE: &str = "relay-jcp-interop";
const LINGER: Duration = Duration::from_secs(2);
const CONVERGE: Duration = Duration::from_secs(60);
/// The relay's periodic resync in the restart scenario.
const RESYNC: Duration = Duration::from_secs(3);

/// The scenarios run one at a time: each runs a JVM, a relay and several Envoys, and the restart
/// scenario measures convergence against the resync interval (2 cores).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// With JCP_EVENTS_DUMP=DIR, writes java-control-plane's events to DIR/`test`.jsonl for a look.
fn dump<K: ServerKind>(jcp: &ControlPlaneProcess<K>, test: &str) {
    if let Ok(dir) = std::env::var("JCP_EVENTS_DUMP") {
        jcp.dump_events(&Path::new(&dir).join(format!("{test}.jsonl")));
    }
}

/// The relay in front of `upstream`, presenting [`NODE`], with a short unsubscribe linger, then
/// `adjust`.
async fn relay_for(
    upstream: SocketAddr,
    adjust: impl FnOnce(&mut adsrelay::config::Config),
) -> RelayUnderTest {
    RelayUnderTest::start_with(upstream, |c| {
        c.node_id = NODE.into();
        c.unsubscribe_linger = LINGER;
        adjust(c);
    })
    .await
}

/// Two groups, each a Delta and a SotW Envoy, on the relay at `port`.
fn fleet(port: u16) -> Vec<Envoy> {
    vec![
        Envoy::start("bootstrap-delta.yaml", port, "a-delta", "group-a"),
        Envoy::start("bootstrap-sotw.yaml", port, "a-sotw", "group-a"),
        Envoy::start("bootstrap-delta.yaml", port, "b-delta", "group-b"),
        Envoy::start("bootstrap-sotw.yaml", port, "b-sotw", "group-b"),
    ]
}

/// Waits until every Envoy's `path` admin page satisfies `ok`, by `deadline`.
async fn converge_by(
    envoys: &mut [Envoy],
    deadline: tokio::time::Instant,
    path: &str,
    what: &str,
    ok: impl Fn(&str) -> bool,
) {
    for (i, e) in envoys.iter_mut().enumerate() {
        loop {
            assert!(e.is_running(), "envoy {i} exited:\n{}", e.log_tail());
            let page = e.admin_get(path).await;
            if ok(&page) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "envoy {i} did not converge on {what}:\n{}\n--- {path}:\n{}",
                e.log_tail(),
                page.lines().take(40).collect::<Vec<_>>().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Waits (up to [`CONVERGE`]) until every Envoy's `path` admin page satisfies `ok`.
async fn converge(envoys: &mut [Envoy], path: &str, what: &str, ok: impl Fn(&str) -> bool) {
    let deadline = tokio::time::Instant::now() + CONVERGE;
    converge_by(envoys, deadline, path, what, ok).await;
}

/// The counter `stat` of one Envoy (0 if absent).
async fn counter(envoy: &Envoy, stat: &str) -> u64 {
    let stats = envoy.admin_get(&format!("/stats?filter=^{stat}$")).await;
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{stat}: ")))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Sends requests to the shared listener port (SO_REUSEPORT spreads connections over the Envoys)
/// until every Envoy has answered one; each must answer `code` (and `body`, if given).
async fn every_envoy_answers(
    envoys: &[Envoy],
    port: u16,
    path: &str,
    code: u16,
    body: Option<&str>,
) {
    let stat = format!("http.ingress.downstream_rq_{}xx", code / 100);
    let mut before = Vec::new();
    for e in envoys {
        before.push(counter(e, &stat).await);
    }
    for attempt in 0..400 {
        let (got, text) = get(port, path).await;
        assert_eq!(
            got, code,
            "GET {path} through the Envoys (attempt {attempt}): {text}"
        );
        if let Some(want) = body {
            assert_eq!(
                text, want,
                "GET {path} through the Envoys (attempt {attempt})"
            );
        }
        if attempt % 8 == 7 {
            let mut all = true;
            for (e, b) in envoys.iter().zip(&before) {
                all &= counter(e, &stat).await > *b;
            }
            if all {
                return;
            }
        }
    }
    panic!("not every Envoy answered {path} with {code}");
}

async fn every_envoy_serves(envoys: &[Envoy], port: u16, path: &str, want: &str) {
    every_envoy_answers(envoys, port, path, 200, Some(want)).await;
}

/// GET `path` until it answers `code` (and `want`, if given), by `deadline` (Envoys may still be
/// converging, the listener may not be there yet).
async fn answers_by(
    deadline: tokio::time::Instant,
    port: u16,
    path: &str,
    code: u16,
    want: Option<&str>,
) {
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(("127.0.0.1", port)),
        )
        .await
        {
            let (got, body) = get(port, path).await;
            if got == code && want.is_none_or(|w| body == w) {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "GET {path} never answered {code} {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn eventually_answers(port: u16, path: &str, want: &str) {
    let deadline = tokio::time::Instant::now() + CONVERGE;
    answers_by(deadline, port, path, 200, Some(want)).await;
}

/// The `response` events of `type_url`.
fn responses<'a>(events: &'a [Value], type_url: &'a str) -> impl Iterator<Item = &'a Value> {
    events
        .iter()
        .filter(move |e| e["event"] == "response" && e["type"] == type_url)
}

/// Per stream: every resource name java-control-plane sent for `type_url`.
fn sent_by_stream(events: &[Value], type_url: &str) -> BTreeMap<i64, BTreeSet<String>> {
    let mut sent: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    for e in responses(events, type_url) {
        sent.entry(e["stream"].as_i64().unwrap())
            .or_default()
            .extend(strings(&e["resources"]));
    }
    sent
}

/// No NACK upstream (java-control-plane's view), and no Envoy rejected config or is
/// disconnected.
async fn assert_no_nack<K: ServerKind>(jcp: &ControlPlaneProcess<K>, envoys: &[Envoy]) {
    let events = jcp.events();
    let nacks: Vec<&Value> = events.iter().filter(|e| e["nack"] == true).collect();
    assert!(nacks.is_empty(), "the relay NACKed: {nacks:?}");
    for (i, e) in envoys.iter().enumerate() {
        let stats = e
            .admin_get("/stats?filter=update_rejected|control_plane.connected_state")
            .await;
        assert!(
            stats.contains("control_plane.connected_state: 1"),
            "envoy {i}: {stats}"
        );
        for line in stats.lines().filter(|l| l.contains("update_rejected")) {
            assert!(line.ends_with(": 0"), "envoy {i} rejected config: {line}");
        }
    }
}

/// Waits until java-control-plane has received, after its `seen`th event, a request of
/// `type_url` from the relay; returns how long that took. Fails after `limit` with the relay's
/// upstream status and what java-control-plane saw.
async fn upstream_request<K: ServerKind>(
    jcp: &ControlPlaneProcess<K>,
    relay: &RelayUnderTest,
    seen: usize,
    type_url: &str,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let events = jcp.events();
        if events[seen..]
            .iter()
            .any(|e| e["event"] == "request" && e["type"] == type_url)
        {
            return start.elapsed();
        }
        if start.elapsed() > limit {
            let (_, upstreams) = relay.admin_get("/debug/upstreams").await;
            panic!(
                "no {type_url} request reached java-control-plane within {limit:?}.\n\
                 java-control-plane saw: {:#?}\nrelay /debug/upstreams: {upstreams}",
                &events[seen..]
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// GETs `path` through the listener every 20 ms in the background, recording (status, body).
struct Traffic {
    seen: Arc<Mutex<Vec<(u16, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Traffic {
    fn start(port: u16, path: &'static str) -> Traffic {
        let seen: Arc<Mutex<Vec<(u16, String)>>> = Arc::default();
        let record = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            loop {
                let answer = get(port, path).await;
                record.lock().unwrap().push(answer);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Traffic { seen, task }
    }

    async fn stop(self) -> Vec<(u16, String)> {
        self.task.abort();
        let _ = self.task.await;
        Arc::try_unwrap(self.seen)
            .map(|m| m.into_inner().unwrap())
            .unwrap_or_else(|seen| seen.lock().unwrap().clone())
    }
}

/// A TCP forwarder on a fixed port in front of the relay of the moment, so the Envoys keep their
/// bootstrap's address across relay restarts (the test relay binds an ephemeral port).
struct Forwarder {
    port: u16,
    target: Arc<Mutex<Option<SocketAddr>>>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start() -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let (t, c) = (target.clone(), conns.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = listener.accept().await else {
                    return;
                };
                // No relay: the connection closes at once, as a refused one would fail.
                let Some(addr) = *t.lock().unwrap() else {
                    continue;
                };
                c.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(addr).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                }));
            }
        });
        Forwarder {
            port,
            target,
            conns,
            task,
        }
    }

    /// New connections go to `relay` (none: closed); open ones are cut.
    fn point_at(&self, relay: Option<SocketAddr>) {
        *self.target.lock().unwrap() = relay;
        for conn in self.conns.lock().unwrap().drain(..) {
            conn.abort();
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.point_at(None);
        self.task.abort();
    }
}

struct Ports {
    listener: u16,
    a1: u16,
    a2: u16,
    b1: u16,
    b2: u16,
    c1: u16,
}

async fn ports() -> Ports {
    Ports {
        listener: free_port(),
        a1: backend("a1").await,
        a2: backend("a2").await,
        b1: backend("b1").await,
        b2: backend("b2").await,
        c1: backend("c1").await,
    }
}

/// The listener and its route config (`routes` in order), then `clusters` as (name, endpoint
/// port).
fn resources(p: &Ports, routes: &[(&str, &str)], clusters: &[(&str, u16)]) -> Vec<Value> {
    let mut r = vec![
        listener("ingress", p.listener, "routes"),
        route_config("routes", routes),
    ];
    for (name, port) in clusters {
        r.push(cluster(name));
        r.push(load_assignment(name, &[*port]));
    }
    r
}

/// java-control-plane saw one Delta ADS stream per group (opened in `events`), with the relay's
/// node id and the group as node cluster; none per Envoy, and no SotW stream.
fn assert_one_delta_stream_per_group(events: &[Value]) {
    let opened: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "stream_open")
        .collect();
    assert!(
        opened.iter().all(|e| e["delta"] == true && e["type"] == ""),
        "only Delta ADS streams upstream: {opened:?}"
    );
    let mut clusters_by_stream: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    for e in events.iter().filter(|e| e["event"] == "request") {
        assert_eq!(e["node_id"], NODE, "upstream node id: {e}");
        clusters_by_stream
            .entry(e["stream"].as_i64().unwrap())
            .or_default()
            .insert(e["node_cluster"].as_str().unwrap().to_string());
    }
    assert_eq!(opened.len(), 2, "one upstream stream per group: {opened:?}");
    let mut flat: Vec<String> = clusters_by_stream.values().flatten().cloned().collect();
    flat.sort();
    assert_eq!(
        (clusters_by_stream.len(), flat),
        (2, vec!["group-a".to_string(), "group-b".to_string()]),
        "each stream presents one group: {clusters_by_stream:?}"
    );
}

/// 1. A route change and an endpoint change reach every Envoy (two groups, a Delta and a SotW
/// Envoy each); java-control-plane sends each change once per group stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_and_endpoint_updates_reach_every_envoy() {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let p = ports().await;
    let clusters = [("alpha", p.a1), ("beta", p.b1)];
    let mut jcp = JavaControlPlane::start(
        NODE,
        &state("v1", resources(&p, &[("/", "alpha")], &clusters)),
    )
    .await;
    let relay = relay_for(jcp.addr, |_| {}).await;
    let mut envoys = fleet(relay.xds.port());

    let t = Instant::now();
    converge(&mut envoys, "/clusters", "v1 endpoints", |c| {
        has_endpoint(c, "alpha", p.a1) && has_endpoint(c, "beta", p.b1)
    })
    .await;
    eventually_answers(p.listener, "/", "a1").await;
    every_envoy_serves(&envoys, p.listener, "/", "a1").await;
    println!(
        "fleet converged and served: {:.1}s",
        t.elapsed().as_secs_f64()
    );
    assert_one_delta_stream_per_group(&jcp.events());

    // A route change.
    let t = Instant::now();
    let seen = jcp.events().len();
    jcp.set(&state("v2", resources(&p, &[("/", "beta")], &clusters)))
        .await;
    converge(&mut envoys, "/config_dump", "route to beta", |d| {
        d.contains("\"cluster\": \"beta\"") && !d.contains("\"cluster\": \"alpha\"")
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/", "b1").await;
    println!("route change: {:.1}s", t.elapsed().as_secs_f64());
    let events = jcp.events();
    let after = &events[seen..];
    // Only the route changed, and only it went out (once per stream), at the new version.
    for type_url in [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE] {
        assert!(
            responses(after, type_url).next().is_none(),
            "{type_url} sent though unchanged: {after:#?}"
        );
    }
    let routes: Vec<&Value> = responses(after, ROUTE_TYPE).collect();
    assert_eq!(routes.len(), 2, "the route once per group: {routes:#?}");
    assert!(
        routes
            .iter()
            .all(|r| strings(&r["resources"]) == ["routes"] && r["version"] == "v2"),
        "{routes:#?}"
    );

    // An endpoint change.
    let t = Instant::now();
    let seen = jcp.events().len();
    jcp.set(&state(
        "v3",
        resources(&p, &[("/", "beta")], &[("alpha", p.a1), ("beta", p.b2)]),
    ))
    .await;
    converge(&mut envoys, "/clusters", "beta on b2", |c| {
        has_endpoint(c, "beta", p.b2) && !has_endpoint(c, "beta", p.b1)
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/", "b2").await;
    println!("endpoint change: {:.1}s", t.elapsed().as_secs_f64());
    let events = jcp.events();
    let after = &events[seen..];
    let eds: Vec<&Value> = responses(after, ENDPOINT_TYPE).collect();
    assert_eq!(eds.len(), 2, "beta's endpoints once per group: {eds:#?}");
    assert!(
        eds.iter().all(|r| strings(&r["resources"]) == ["beta"]),
        "{eds:#?}"
    );

    assert_no_nack(&jcp, &envoys).await;
    dump(&jcp, "updates");
    println!("scenario: {:.1}s", t0.elapsed().as_secs_f64());
}

/// 2. A Cluster removed while the relay is connected disappears from every Envoy:
/// java-control-plane reports it in `removed_resources` on each group's stream. Also probes,
/// directly, that a Delta subscription naming one Cluster gets every Cluster (wildcard by type).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_cluster_disappears_from_every_envoy() {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let p = ports().await;
    let mut jcp = JavaControlPlane::start(
        NODE,
        &state(
            "v1",
            resources(
                &p,
                &[("/alpha", "alpha"), ("/", "beta")],
                &[("alpha", p.a1), ("beta", p.b1)],
            ),
        ),
    )
    .await;

    // Wildcard by type: a Delta client naming only `alpha` gets `beta` too.
    let mut probe = support::DeltaClient::connect(
        jcp.addr,
        support::node(NODE, "probe"),
        support::subscribe(CLUSTER_TYPE, &["alpha"]),
    )
    .await;
    let first = probe.recv_ack().await;
    assert_eq!(
        support::names(&first)
            .into_iter()
            .map(|(n, _)| n)
            .collect::<Vec<_>>(),
        ["alpha", "beta"],
        "a subscription to `alpha` alone"
    );
    drop(probe);

    let relay = relay_for(jcp.addr, |_| {}).await;
    let mut envoys = fleet(relay.xds.port());
    converge(&mut envoys, "/clusters", "alpha and beta", |c| {
        has_endpoint(c, "alpha", p.a1) && has_endpoint(c, "beta", p.b1)
    })
    .await;
    eventually_answers(p.listener, "/alpha", "a1").await;
    every_envoy_serves(&envoys, p.listener, "/alpha", "a1").await;

    let t = Instant::now();
    let seen = jcp.events().len();
    jcp.set(&state(
        "v2",
        resources(&p, &[("/", "beta")], &[("beta", p.b1)]),
    ))
    .await;
    converge(&mut envoys, "/clusters", "alpha gone", |c| {
        !has_cluster(c, "alpha") && has_endpoint(c, "beta", p.b1)
    })
    .await;
    every_envoy_serves(&envoys, p.listener, "/alpha", "b1").await;
    println!("cluster removed: {:.1}s", t.elapsed().as_secs_f64());

    let events = jcp.events();
    let after = &events[seen..];
    let removals: BTreeSet<i64> = responses(after, CLUSTER_TYPE)
        .filter(|e| strings(&e["removed"]) == ["alpha"])
        .map(|e| e["stream"].as_i64().unwrap())
        .collect();
    assert_eq!(
        removals.len(),
        2,
        "alpha removed on each group's stream: {after:#?}"
    );

    assert_no_nack(&jcp, &envoys).await;
    dump(&jcp, "removal");
    println!("scenario: {:.1}s", t0.elapsed().as_secs_f64());
}

/// 3. java-control-plane restarts with a Cluster removed and others changed while it was away.
/// Its new streams resend everything but never say what was removed, so the relay must reconcile
/// (a fresh stream's full state): every Envoy converges, including the removal, within one resync
/// interval (plus 2 s) of the relay's reconnection. Traffic on a path whose cluster stays never fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_removal_converges_within_one_resync() {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let p = ports().await;
    let mut jcp = JavaControlPlane::start(
        NODE,
        &state(
            "v1",
            resources(
                &p,
                &[("/gamma", "gamma"), ("/", "beta")],
                &[("alpha", p.a1), ("beta", p.b1), ("gamma", p.c1)],
            ),
        ),
    )
    .await;
    let relay = relay_for(jcp.addr, |c| c.resilience.resync_interval = Some(RESYNC)).await;
    let mut envoys = fleet(relay.xds.port());
    converge(&mut envoys, "/clusters", "v1", |c| {
        has_endpoint(c, "alpha", p.a1)
            && has_endpoint(c, "beta", p.b1)
            && has_endpoint(c, "gamma", p.c1)
    })
    .await;
    eventually_answers(p.listener, "/", "b1").await;
    every_envoy_serves(&envoys, p.listener, "/gamma", "c1").await;

    // Crash; while it is down, beta goes, / moves to gamma, gamma and alpha move endpoints.
    let traffic = Traffic::start(p.listener, "/gamma");
    jcp.stop().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    every_envoy_serves(&envoys, p.listener, "/", "b1").await;
    jcp.set(&state(
        "v2",
        resources(
            &p,
            &[("/gamma", "gamma"), ("/", "gamma")],
            &[("alpha", p.a2), ("gamma", p.b2)],
        ),
    ))
    .await;
    let t = Instant::now();
    jcp.restart().await;
    // The relay reconnects (its backoff is 50-500 ms here); from then on, one resync interval (plus
    // 2 s for the reconciling stream's answers to reach the Envoys).
    let reconnected = loop {
        let opened = process_events(&jcp.events(), 1)
            .iter()
            .filter(|e| e["event"] == "stream_open")
            .count();
        if opened >= 2 {
            break tokio::time::Instant::now();
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the relay never reconnected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "relay reconnected {:.1}s after the restart began",
        t.elapsed().as_secs_f64()
    );
    let deadline = reconnected + RESYNC + Duration::from_secs(2);

    // The changes: java-control-plane resends every resource on the new streams.
    converge_by(&mut envoys, deadline, "/clusters", "v2's changes", |c| {
        has_endpoint(c, "alpha", p.a2) && has_endpoint(c, "gamma", p.b2)
    })
    .await;
    println!(
        "changes after the restart: {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let events = jcp.events();
    let second = process_events(&events, 1);
    let cds = sent_by_stream(&second, CLUSTER_TYPE);
    let all: BTreeSet<String> = ["alpha", "gamma"].map(String::from).into();
    assert!(
        cds.len() == 2 && cds.values().all(|s| *s == all),
        "every Cluster resent on each new stream: {cds:?}"
    );
    let resumed = second
        .iter()
        .filter(|e| {
            e["event"] == "request"
                && e["type"] == CLUSTER_TYPE
                && e["initial_versions"]
                    .as_object()
                    .is_some_and(|m| !m.is_empty())
        })
        .count();
    println!("CDS requests with initial_resource_versions after the restart: {resumed}");

    // The removal: java-control-plane never says (no removed_resources on its new streams), so
    // only the relay's reconciliation removes beta.
    let events = jcp.events();
    let second = process_events(&events, 1);
    let removals: Vec<&Value> = second
        .iter()
        .filter(|e| e["event"] == "response" && !strings(&e["removed"]).is_empty())
        .collect();
    assert!(
        removals.is_empty(),
        "java-control-plane does send removals after a restart: {removals:#?}"
    );
    converge_by(&mut envoys, deadline, "/clusters", "beta removed", |c| {
        !has_cluster(c, "beta")
    })
    .await;
    println!(
        "beta removed from every Envoy {:.1}s after the relay reconnected",
        reconnected.elapsed().as_secs_f64()
    );
    every_envoy_serves(&envoys, p.listener, "/", "b2").await;
    let seen = traffic.stop().await;
    let failed: Vec<&(u16, String)> = seen.iter().filter(|(code, _)| *code != 200).collect();
    assert!(
        seen.len() > 10 && failed.is_empty(),
        "{} requests on /gamma, failed: {failed:?}",
        seen.len()
    );
    assert_no_nack(&jcp, &envoys).await;
    dump(&jcp, "restart");
    println!("scenario: {:.1}s", t0.elapsed().as_secs_f64());
}

fn snapshot_config(path: &Path) -> SnapshotConfig {
    SnapshotConfig {
        path: path.to_path_buf(),
        interval: Duration::from_secs(3600),
        max_staleness: Duration::from_secs(3600),
    }
}

/// Shuts `relay` down gracefully (cutting what is left through `fwd`); with `snapshot`, waits for
/// the snapshot it writes.
async fn shut_down(mut relay: RelayUnderTest, fwd: &Forwarder, snapshot: Option<&Path>) {
    relay.shutdown();
    if let Some(path) = snapshot {
        support::eventually("snapshot written at graceful shutdown", || path.exists()).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    fwd.point_at(None);
    drop(relay);
}

/// 4. The relay restarts, warm (from its snapshot) and then cold, while java-control-plane's
/// state changes: the Envoys reconnect, converge on the new state, and nothing is NACKed, by the
/// Envoys or by the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_restart_warm_and_cold_converges_without_nack() {
    relay_restart_scenario::<Java>().await;
}

/// The same relay restarts behind go-control-plane (Delta upstream), for issue 29: its resumed
/// streams get only what changed, where java-control-plane resends everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_restart_warm_and_cold_behind_go_control_plane() {
    relay_restart_scenario::<Go>().await;
}

async fn relay_restart_scenario<K: ServerKind>() {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let p = ports().await;
    let dir: PathBuf = tempfile::Builder::new()
        .prefix("adsrelay-relay-restart-snapshot-")
        .tempdir()
        .unwrap()
        .keep();
    let snap = dir.join("cache.snap");
    let mut jcp = ControlPlaneProcess::<K>::start(
        NODE,
        &state(
            "v1",
            resources(&p, &[("/", "alpha")], &[("alpha", p.a1), ("beta", p.b1)]),
        ),
    )
    .await;
    let fwd = Forwarder::start().await;
    let relay = relay_for(jcp.addr, |c| c.snapshot = Some(snapshot_config(&snap))).await;
    fwd.point_at(Some(relay.xds));
    let mut envoys = fleet(fwd.port);
    converge(&mut envoys, "/clusters", "v1", |c| {
        has_endpoint(c, "alpha", p.a1) && has_endpoint(c, "beta", p.b1)
    })
    .await;
    eventually_answers(p.listener, "/", "a1").await;
    every_envoy_serves(&envoys, p.listener, "/", "a1").await;

    // Warm: the relay goes (writing its snapshot), the state changes, a new relay starts from the
    // snapshot.
    let t = Instant::now();
    shut_down(relay, &fwd, Some(&snap)).await;
    jcp.set(&state(
        "v2",
        resources(&p, &[("/", "beta")], &[("alpha", p.a1), ("beta", p.b2)]),
    ))
    .await;
    let relay = relay_for(jcp.addr, |c| c.snapshot = Some(snapshot_config(&snap))).await;
    fwd.point_at(Some(relay.xds));
    converge(&mut envoys, "/clusters", "v2 after a warm restart", |c| {
        has_endpoint(c, "beta", p.b2) && !has_endpoint(c, "beta", p.b1)
    })
    .await;
    eventually_answers(p.listener, "/", "b2").await;
    every_envoy_serves(&envoys, p.listener, "/", "b2").await;
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert_no_nack(&jcp, &envoys).await;
    println!(
        "warm relay restart converged: {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // Cold: no snapshot; the state changes again.
    let t = Instant::now();
    shut_down(relay, &fwd, None).await;
    std::fs::remove_file(&snap).unwrap();
    jcp.set(&state(
        "v3",
        resources(&p, &[("/", "alpha")], &[("alpha", p.a2), ("beta", p.b2)]),
    ))
    .await;
    let seen = jcp.events().len();
    let relay = relay_for(jcp.addr, |_| {}).await;
    fwd.point_at(Some(relay.xds));
    // The reconnecting Envoys' subscriptions go upstream.
    upstream_request(&jcp, &relay, seen, CLUSTER_TYPE, Duration::from_secs(15)).await;
    converge(&mut envoys, "/clusters", "v3 after a cold restart", |c| {
        has_endpoint(c, "alpha", p.a2) && !has_endpoint(c, "alpha", p.a1)
    })
    .await;
    eventually_answers(p.listener, "/", "a2").await;
    every_envoy_serves(&envoys, p.listener, "/", "a2").await;
    assert_no_nack(&jcp, &envoys).await;
    println!(
        "cold relay restart converged: {:.1}s",
        t.elapsed().as_secs_f64()
    );

    drop(envoys);
    let _ = std::fs::remove_dir_all(&dir);
    dump(&jcp, &format!("relay-restart-{}", K::NAME));
    if K::NAME != Java::NAME {
        println!("scenario: {:.1}s", t0.elapsed().as_secs_f64());
        return;
    }
    // Three relays, two groups each: six upstream streams, each new one sent every resource again
    // (java-control-plane keeps no state across streams).
    let events = jcp.events();
    let opened = events
        .iter()
        .filter(|e| e["event"] == "stream_open")
        .count();
    assert_eq!(opened, 6, "one stream per group per relay");
    let cds = sent_by_stream(&events, CLUSTER_TYPE);
    assert!(
        cds.values()
            .all(|s| s.contains("alpha") && s.contains("beta")),
        "{cds:?}"
    );
    println!("scenario: {:.1}s", t0.elapsed().as_secs_f64());
}

/// 5. No Clusters at all: java-control-plane's Delta server never answers the wildcard Cluster
/// subscription while it has none. The Envoys still get the Listener and the route (503: the
/// route's cluster does not exist), /readyz turns 200 within 30 s, and once a Cluster exists
/// java-control-plane answers and every Envoy serves through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcard_type_with_no_resources() {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let p = ports().await;
    let mut jcp =
        JavaControlPlane::start(NODE, &state("v1", resources(&p, &[("/", "alpha")], &[]))).await;
    // Directly: a Delta client subscribing to every Cluster gets nothing at all, not even the
    // response headers (gRPC-Java sends them with the first response).
    let probe = tokio::time::timeout(Duration::from_secs(3), async {
        let mut c = support::DeltaClient::try_connect(
            jcp.addr,
            Some(support::node(NODE, "probe")),
            support::subscribe(CLUSTER_TYPE, &["*"]),
        )
        .await?;
        c.try_recv().await
    })
    .await;
    assert!(
        probe.is_err(),
        "java-control-plane answered a Cluster wildcard with no Clusters: {probe:?}"
    );

    let seen = jcp.events().len();
    let relay = relay_for(jcp.addr, |_| {}).await;
    let port = relay.xds.port();
    let mut envoys = vec![
        Envoy::start("bootstrap-delta.yaml", port, "e-delta", "empty"),
        Envoy::start("bootstrap-sotw.yaml", port, "e-sotw", "empty"),
    ];
    upstream_request(&jcp, &relay, seen, CLUSTER_TYPE, Duration::from_secs(15)).await;

    // Readiness, from the moment the relay's wildcard Cluster request is upstream: 200 within
    // 30 s although java-control-plane never answers it.
    let start = tokio::time::Instant::now();
    let ready_after = loop {
        let (code, body) = relay.admin_get("/readyz").await;
        if code == 200 {
            break start.elapsed();
        }
        if start.elapsed() > Duration::from_secs(30) {
            let types: BTreeSet<String> = jcp.events()[seen..]
                .iter()
                .filter(|e| e["event"] == "request")
                .map(|e| e["type"].as_str().unwrap().to_string())
                .collect();
            panic!(
                "/readyz still {code} 30 s after subscribing to a wildcard type the upstream \
                 never answers (types requested upstream: {types:?}):\n{body}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    println!("/readyz 200 after {:.1}s", ready_after.as_secs_f64());

    // The Envoys get the Listener (Envoy's own 15 s CDS initial-fetch timeout at the latest) and
    // answer 503: no such cluster.
    let deadline = start + CONVERGE;
    answers_by(deadline, p.listener, "/", 503, None).await;
    every_envoy_answers(&envoys, p.listener, "/", 503, None).await;
    println!(
        "listener served (503, no cluster) after {:.1}s",
        start.elapsed().as_secs_f64()
    );
    for e in &envoys {
        let clusters = e.admin_get("/clusters").await;
        assert!(!has_cluster(&clusters, "alpha"), "{clusters}");
    }
    let events = jcp.events();
    let cds_requests = events
        .iter()
        .filter(|e| e["event"] == "request" && e["type"] == CLUSTER_TYPE)
        .count();
    assert!(
        cds_requests > 0,
        "the relay subscribed to Clusters: {events:#?}"
    );
    let cds: Vec<&Value> = responses(&events, CLUSTER_TYPE).collect();
    assert!(
        cds.is_empty(),
        "java-control-plane answered the Cluster wildcard with no Clusters: {cds:#?}"
    );

    // A Cluster appears: java-control-plane answers at last, and every Envoy serves through it.
    let t = Instant::now();
    jcp.set(&state(
        "v2",
        resources(&p, &[("/", "alpha")], &[("alpha", p.a1)]),
    ))
    .await;
    converge(&mut envoys, "/clusters", "alpha", |c| {
        has_endpoint(c, "alpha", p.a1)
    })
    .await;
    eventually_answers(p.listener, "/", "a1").await;
    every_envoy_serves(&envoys, p.listener, "/", "a1").await;
    println!("first Cluster served: {:.1}s", t.elapsed().as_secs_f64());
    let events = jcp.events();
    let cds: Vec<&Value> = responses(&events, CLUSTER_TYPE).collect();
    assert!(
        !cds.is_empty() && cds.iter().all(|e| strings(&e["resources"]) == ["alpha"]),
        "{cds:#?}"
    );
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert_no_nack(&jcp, &envoys).await;
    dump(&jcp, "empty-wildcard");
    println!("scenario: {:.1}s", t0.elapsed().as_secs_f64());
}
