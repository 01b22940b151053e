//! Real Envoy 1.40 processes through the relay, in front of the demo control plane, on Delta ADS
//! and on state-of-the-world ADS (`api_type: GRPC`). Asserts from each Envoy's admin /config_dump
//! that all converge, that a request through an Envoy's listener reaches the backend with the
//! configured route, and that an update made at the control plane reaches every Envoy. The control
//! plane sees one upstream stream for all of them.

mod support;

use std::time::Duration;

use support::envoy::{free_port, Envoy};
use support::{http_get, RelayUnderTest, Upstream};
use tokio::net::TcpListener;

fn resources(listener_port: u16, backend: std::net::SocketAddr, version: &str) -> String {
    adsrelay::demo::resources::EXAMPLE
        .replace("port = 10000", &format!("port = {listener_port}"))
        .replace("127.0.0.1:18080", &backend.to_string())
        .replace(
            "\"x-demo-version\" = \"v1\"",
            &format!("\"x-demo-version\" = \"{version}\""),
        )
}

/// Waits until every Envoy's config dump satisfies `ok`, with diagnostics on timeout.
async fn converge(envoys: &mut [Envoy], what: &str, ok: impl Fn(&str) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for (i, e) in envoys.iter_mut().enumerate() {
        loop {
            assert!(e.is_running(), "envoy {i} exited:\n{}", e.log_tail());
            let dump = e.admin_get("/config_dump?include_eds").await;
            if ok(&dump) {
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

async fn get_through(port: u16) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            let (code, text) = http_get(([127, 0, 0, 1], port).into(), "/").await;
            if code == 200 {
                return text;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no 200 through Envoy on port {port}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct Setup {
    listener_port: u16,
    up: Upstream,
    relay: RelayUnderTest,
    backend_addr: std::net::SocketAddr,
}

async fn setup() -> Setup {
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    tokio::spawn(adsrelay::demo::backend::serve(backend));
    let listener_port = free_port();
    let up = Upstream::start(
        adsrelay::demo::resources::parse(&resources(listener_port, backend_addr, "v1"), "test")
            .unwrap(),
    )
    .await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    Setup {
        listener_port,
        up,
        relay,
        backend_addr,
    }
}

/// Converges on v1, routes a request, pushes v2, converges again, and checks no Envoy rejected
/// anything and the control plane saw a single stream.
async fn converge_route_update(s: &Setup, envoys: &mut [Envoy]) {
    let backend_port = s.backend_addr.port().to_string();
    converge(envoys, "v1", |d| {
        d.contains("\"listener_0\"")
            && d.contains("\"demo_backend\"")
            && d.contains(&format!("\"port_value\": {backend_port}"))
            && d.contains("\"value\": \"v1\"")
    })
    .await;

    // Envoy reuses the port across processes (SO_REUSEPORT), so any of them may answer.
    let text = get_through(s.listener_port).await;
    assert!(
        text.contains(adsrelay::demo::backend::GREETING.trim()),
        "{text}"
    );
    assert!(text.to_lowercase().contains("x-demo-version: v1"), "{text}");

    s.up.cp.set_resources(
        adsrelay::demo::resources::parse(&resources(s.listener_port, s.backend_addr, "v2"), "test")
            .unwrap(),
    );
    converge(envoys, "v2", |d| {
        d.contains("\"value\": \"v2\"") && !d.contains("\"value\": \"v1\"")
    })
    .await;
    let text = get_through(s.listener_port).await;
    assert!(text.to_lowercase().contains("x-demo-version: v2"), "{text}");

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
    let stats = s.up.cp.stats();
    println!(
        "{} Envoys through the relay: upstream streams {}, upstream requests {}",
        envoys.len(),
        stats.streams_opened,
        stats.requests
    );
    assert_eq!(
        stats.streams_opened, 1,
        "all Envoys of the group, one upstream stream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_delta_envoys_converge_route_and_follow_an_update() {
    let s = setup().await;
    let mut envoys: Vec<Envoy> = (0..3)
        .map(|i| {
            Envoy::start(
                "bootstrap-delta.yaml",
                s.relay.xds.port(),
                &format!("envoy-{i}"),
                "demo",
            )
        })
        .collect();
    converge_route_update(&s, &mut envoys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_envoy_converges_routes_and_follows_an_update() {
    let s = setup().await;
    let mut envoys = vec![Envoy::start(
        "bootstrap-sotw.yaml",
        s.relay.xds.port(),
        "sotw-0",
        "demo",
    )];
    converge_route_update(&s, &mut envoys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_and_delta_envoys_of_one_group_share_one_upstream_stream() {
    let s = setup().await;
    let mut envoys = vec![
        Envoy::start("bootstrap-sotw.yaml", s.relay.xds.port(), "sotw-1", "demo"),
        Envoy::start(
            "bootstrap-delta.yaml",
            s.relay.xds.port(),
            "delta-1",
            "demo",
        ),
    ];
    converge_route_update(&s, &mut envoys).await;
}

/// Two tiers: Envoys (one Delta, one SotW) on an edge relay whose upstream is a regional relay in
/// front of the control plane. They converge, route, and follow an update like Envoys of one
/// relay; the control plane sees one stream and the regional relay one client stream (the edge's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tier_chain_with_envoys_at_the_bottom() {
    let s = setup().await;
    let edge = RelayUnderTest::start(s.relay.xds, Duration::from_secs(30)).await;
    let mut envoys = vec![
        Envoy::start(
            "bootstrap-delta.yaml",
            edge.xds.port(),
            "edge-delta",
            "demo",
        ),
        Envoy::start("bootstrap-sotw.yaml", edge.xds.port(), "edge-sotw", "demo"),
    ];
    converge_route_update(&s, &mut envoys).await;
    let (_, regional) = s.relay.admin_get("/metrics").await;
    assert_eq!(
        (streams(&regional, "delta"), streams(&regional, "sotw")),
        (1, 0),
        "the regional relay serves one stream, the edge relay's:\n{regional}"
    );
    let (_, edge_metrics) = edge.admin_get("/metrics").await;
    assert_eq!(
        (
            streams(&edge_metrics, "delta"),
            streams(&edge_metrics, "sotw")
        ),
        (1, 1),
        "the edge relay serves both Envoys:\n{edge_metrics}"
    );
}

/// `adsrelay_downstream_streams{protocol=...}` from a /metrics page (0 when absent).
fn streams(metrics: &str, protocol: &str) -> u64 {
    let prefix = format!("adsrelay_downstream_streams{{protocol=\"{protocol}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().expect("gauge value"))
}
