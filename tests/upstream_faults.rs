//! Fault injection between the relay and its control plane (the demo control plane, behind a
//! byte-level fault proxy): kill and restart, stall, a stream cut in the middle of a response, and
//! a two-tier relay chain. In each case: no client is disconnected, no removal is sent, no update is
//! lost (every client ends with exactly the control plane's resources), and /metrics and /readyz
//! tell the truth.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use adsrelay::xds::CachedResource;
use support::faults::FaultProxy;
use support::*;

const GROUP: &str = "g";
const NAMES: [&str; 4] = ["e1", "e2", "e3", "big"];

fn resources(version: &str) -> Vec<(String, CachedResource)> {
    let mut v: Vec<_> = NAMES[..3]
        .iter()
        .map(|n| resource(EDS, n, version))
        .collect();
    v.push(resource(CDS, "c1", version));
    // A large resource, so a response spans many TCP segments and can be cut in the middle.
    let big = format!("{version}-{}", "x".repeat(200_000));
    v.push(resource(EDS, "big", &big));
    v
}

/// A client that applies every response to its own view and remembers any removal.
struct Tracked {
    c: DeltaClient,
    held: BTreeMap<(String, String), String>,
    removals: Vec<String>,
}

impl Tracked {
    async fn connect(relay: &RelayUnderTest, id: &str) -> Tracked {
        let c = DeltaClient::connect(relay.xds, node(id, GROUP), subscribe(CDS, &["*"])).await;
        let mut t = Tracked {
            c,
            held: BTreeMap::new(),
            removals: Vec::new(),
        };
        t.c.send(subscribe(EDS, &NAMES)).await;
        t.converge(&resources("1")).await;
        t
    }

    async fn converge(&mut self, want: &[(String, CachedResource)]) {
        let want: BTreeMap<(String, String), String> = want
            .iter()
            .map(|(t, r)| ((t.clone(), r.name.to_string()), r.version.clone()))
            .collect();
        while self.held != want {
            let r = self.c.recv_ack().await;
            for res in &r.resources {
                self.held
                    .insert((r.type_url.clone(), res.name.clone()), res.version.clone());
            }
            for n in &r.removed_resources {
                self.removals.push(n.clone());
                self.held.remove(&(r.type_url.clone(), n.clone()));
            }
        }
        assert!(
            self.removals.is_empty(),
            "removals sent: {:?}",
            self.removals
        );
    }
}

fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

async fn readyz(relay: &RelayUnderTest) -> (u16, serde_json::Value) {
    let (code, body) = relay.admin_get("/readyz").await;
    let json = serde_json::from_str(body.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap();
    (code, json)
}

async fn clients(relay: &RelayUnderTest, n: usize) -> Vec<Tracked> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(Tracked::connect(relay, &format!("envoy-{i}")).await);
    }
    v
}

/// Every stream still open, none re-opened: the relay never disconnected a client.
async fn assert_no_client_disconnect(relay: &RelayUnderTest, n: usize) {
    let (_, m) = relay.admin_get("/metrics").await;
    assert_eq!(
        metric(
            &m,
            "adsrelay_downstream_streams_opened_total{protocol=\"delta\"}"
        ),
        n as f64
    );
    assert_eq!(
        metric(&m, "adsrelay_downstream_streams{protocol=\"delta\"}"),
        n as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_and_restart_control_plane() {
    let mut up = Upstream::start(resources("1")).await;
    let addr = up.addr;
    let relay = RelayUnderTest::start(addr, Duration::from_secs(30)).await;
    let mut cs = clients(&relay, 5).await;

    up.stop();
    drop(up);
    eventually_async(&relay, "serving_cached", |j| j["state"] == "serving_cached").await;
    let (_, m) = relay.admin_get("/metrics").await;
    assert_eq!(metric(&m, "adsrelay_upstream_connected{group=\"g\"}"), 0.0);
    for c in cs.iter_mut() {
        c.c.expect_silence(Duration::from_millis(100)).await;
    }
    // It comes back with everything changed while it was down.
    let up = Upstream::start_on(addr, resources("2")).await;
    for c in cs.iter_mut() {
        c.converge(&resources("2")).await;
    }
    eventually_async(&relay, "synced", |j| j["state"] == "synced").await;
    assert_no_client_disconnect(&relay, 5).await;
    let (_, m) = relay.admin_get("/metrics").await;
    assert_eq!(metric(&m, "adsrelay_upstream_connected{group=\"g\"}"), 1.0);
    assert!(metric(&m, "adsrelay_upstream_reconnects_total{group=\"g\"}") >= 1.0);
    assert_eq!(up.cp.stats().streams_opened, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_control_plane() {
    let up = Upstream::start(resources("1")).await;
    let proxy = FaultProxy::start(up.addr).await;
    let relay = RelayUnderTest::start_with(proxy.addr, |c| {
        c.resilience.upstream_keepalive_interval = Duration::from_millis(500);
        c.resilience.upstream_keepalive_timeout = Duration::from_millis(500);
    })
    .await;
    let mut cs = clients(&relay, 3).await;

    proxy.stall(true);
    up.cp.set_resources(resources("2"));
    // Keepalive notices the silent connection; the relay says it serves from cache.
    eventually_async(&relay, "stall detected", |j| j["state"] == "serving_cached").await;
    for c in cs.iter_mut() {
        c.c.expect_silence(Duration::from_millis(100)).await;
    }
    proxy.stall(false);
    for c in cs.iter_mut() {
        c.converge(&resources("2")).await;
    }
    eventually_async(&relay, "synced", |j| j["state"] == "synced").await;
    assert_no_client_disconnect(&relay, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_dropped_mid_response() {
    let up = Upstream::start(resources("1")).await;
    let proxy = FaultProxy::start(up.addr).await;
    let relay = RelayUnderTest::start(proxy.addr, Duration::from_secs(30)).await;
    let mut cs = clients(&relay, 3).await;
    let before = proxy.connections();

    // The next response (with the 200 KB resource) is cut after 50 KB.
    proxy.cut_after(50_000);
    up.cp.set_resources(resources("2"));
    for c in cs.iter_mut() {
        c.converge(&resources("2")).await;
    }
    assert!(proxy.connections() > before, "the relay reconnected");
    // A half-received response was never applied: nothing but whole versions reached clients.
    assert_no_client_disconnect(&relay, 3).await;
    let (_, m) = relay.admin_get("/metrics").await;
    assert!(
        metric(&m, "adsrelay_upstream_reconnects_total{group=\"g\"}") >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "adsrelay_upstream_nacks_total{group=\"g\"}"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tier_chain_converges_like_one_relay() {
    let up = Upstream::start(resources("1")).await;
    let regional = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let edge = RelayUnderTest::start(regional.xds, Duration::from_secs(30)).await;
    let mut cs = clients(&edge, 4).await;
    up.cp.set_resources(resources("2"));
    for c in cs.iter_mut() {
        c.converge(&resources("2")).await;
    }
    // A deletion propagates through both tiers as a removal.
    let mut next = resources("3");
    next.retain(|(_, r)| &*r.name != "e3");
    up.cp.set_resources(next.clone());
    for c in cs.iter_mut() {
        while c.held.contains_key(&(EDS.to_string(), "e3".to_string())) {
            let r = c.c.recv_ack().await;
            for res in &r.resources {
                c.held
                    .insert((r.type_url.clone(), res.name.clone()), res.version.clone());
            }
            for n in &r.removed_resources {
                c.held.remove(&(r.type_url.clone(), n.clone()));
            }
        }
        c.converge(&next).await;
    }
    // The control plane sees one stream: the regional relay's.
    assert_eq!(up.cp.stats().streams_opened, 1);
    assert_no_client_disconnect(&edge, 4).await;
}

async fn eventually_async(
    relay: &RelayUnderTest,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let (code, j) = readyz(relay).await;
        if f(&j) {
            assert_eq!(code, 200, "{j}");
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {j}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
