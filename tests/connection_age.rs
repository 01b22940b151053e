//! `max_connection_age` with a real Envoy (issue 14): with a 3 s age the relay sends the Envoy's
//! connection an HTTP/2 GOAWAY; Envoy reconnects (a new accepted connection), its listener and
//! cluster are served throughout and never rebuilt, and the relay resends nothing Envoy already
//! holds (Envoy's Delta reconnect carries initial_resource_versions).

mod support;

use std::time::Duration;

use support::envoy::{free_port, Envoy};
use support::{http_get, RelayUnderTest, Upstream};
use tokio::net::TcpListener;

/// Sum of every series of `name` (any labels) on a /metrics page.
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Envoy's counters of listeners and clusters added, modified (rebuilt, which drains a
/// listener's connections) and removed.
const CHURN_STATS: &str =
    "/stats?filter=(listener|cluster)_(added|modified|removed)$&usedonly=false";

fn config_churn(stats: &str) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = stats
        .lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect();
    out.sort();
    assert!(
        out.iter()
            .any(|(n, v)| n.ends_with("listener_added") && *v >= 1),
        "no listener_added counter in:\n{stats}"
    );
    out
}

fn has_config(dump: &str, backend_port: u16) -> bool {
    dump.contains("\"listener_0\"")
        && dump.contains("\"demo_backend\"")
        && dump.contains(&format!("\"port_value\": {backend_port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aged_connections_are_replaced_without_losing_or_resending_config() {
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    tokio::spawn(adsrelay::demo::backend::serve(backend));
    let listener_port = free_port();
    let resources = adsrelay::demo::resources::EXAMPLE
        .replace("port = 10000", &format!("port = {listener_port}"))
        .replace("127.0.0.1:18080", &backend_addr.to_string());
    let up = Upstream::start(adsrelay::demo::resources::parse(&resources, "test").unwrap()).await;
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.limits.max_connection_age = Some(Duration::from_secs(3));
        c.limits.max_connection_age_grace = Duration::from_secs(1);
    })
    .await;
    let mut envoy = Envoy::start("bootstrap-delta.yaml", relay.xds.port(), "aged-0", "demo");

    // Converged: listener, cluster and endpoint served, a request routed to the backend.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !has_config(
        &envoy.admin_get("/config_dump?include_eds").await,
        backend_addr.port(),
    ) {
        assert!(envoy.is_running(), "envoy exited:\n{}", envoy.log_tail());
        assert!(
            tokio::time::Instant::now() < deadline,
            "envoy did not converge:\n{}",
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, _) = http_get(([127, 0, 0, 1], listener_port).into(), "/").await;
    assert_eq!(code, 200, "no route through Envoy before any GOAWAY");
    // Let the first connection's initial exchange settle (ACKs of every type) before counting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let churn0 = config_churn(&envoy.admin_get(CHURN_STATS).await);
    let (_, before) = relay.admin_get("/metrics").await;
    let accepted0 = metric(&before, "adsrelay_downstream_connections_accepted_total");
    let sent0 = metric(&before, "adsrelay_downstream_resources_sent_total");
    assert!(accepted0 >= 1.0 && sent0 >= 3.0, "{before}");

    // Two more connections, i.e. at least two GOAWAYs, while Envoy's config never goes away.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut after;
    loop {
        let dump = envoy.admin_get("/config_dump?include_eds").await;
        assert!(
            has_config(&dump, backend_addr.port()),
            "Envoy lost its config across a connection replacement:\n{dump}"
        );
        (_, after) = relay.admin_get("/metrics").await;
        let accepted = metric(&after, "adsrelay_downstream_connections_accepted_total");
        let streams = metric(&after, "adsrelay_downstream_streams");
        if accepted >= accepted0 + 2.0 && streams >= 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Envoy's connection was not replaced after max_connection_age (accepted {accepted0} \
             -> {accepted}):\n{}",
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The new stream's initial exchange is done once its requests are ACKed; give it a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, after) = relay.admin_get("/metrics").await;
    assert_eq!(
        metric(&after, "adsrelay_downstream_resources_sent_total"),
        sent0,
        "the relay resent resources Envoy already held after reconnecting:\n{after}"
    );
    assert_eq!(
        config_churn(&envoy.admin_get(CHURN_STATS).await),
        churn0,
        "Envoy added, modified or removed listeners or clusters across the reconnects"
    );
    let (code, _) = http_get(([127, 0, 0, 1], listener_port).into(), "/").await;
    assert_eq!(code, 200, "no route through Envoy after the reconnects");
    let stats = envoy
        .admin_get("/stats?filter=update_rejected|control_plane.connected_state")
        .await;
    assert!(
        stats.contains("control_plane.connected_state: 1"),
        "{stats}"
    );
    for line in stats.lines().filter(|l| l.contains("update_rejected")) {
        assert!(line.ends_with(": 0"), "envoy rejected config: {line}");
    }
    assert_eq!(
        up.cp.stats().streams_opened,
        1,
        "the upstream stream stays put"
    );
}
