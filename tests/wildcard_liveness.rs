//! Wildcard liveness (issue 13, B2/D9): a conforming Delta server must answer only the first
//! wildcard request of a type on a stream; go-control-plane sends nothing for a `"*"` added
//! mid-stream when it adds no resource. The scripted upstream here behaves so: it answers the
//! type's first request and never the mid-stream `"*"`. Wildcard clients must still get their
//! state, and a guess must never become a removal.

mod support;

use std::time::{Duration, Instant};

use adsrelay::pb::discovery::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use adsrelay::pb::discovery::{DiscoveryRequest, DiscoveryResponse, Resource};
use adsrelay::pb::wire;
use prost::Message;
use support::scripted::{res, Harness};
use support::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// A SotW ADS stream, like a gRPC client or Envoy on `api_type: GRPC`.
struct SotwClient {
    tx: mpsc::Sender<DiscoveryRequest>,
    rx: tonic::Streaming<DiscoveryResponse>,
}

impl SotwClient {
    async fn connect(addr: std::net::SocketAddr, id: &str, type_url: &str, names: &[&str]) -> Self {
        let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(16);
        tx.send(DiscoveryRequest {
            node: Some(node(id, "g")),
            type_url: type_url.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
        let rx = client
            .stream_aggregated_resources(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        SotwClient { tx, rx }
    }

    /// The next response (ACKed), failing after `limit`.
    async fn recv_within(&mut self, limit: Duration) -> DiscoveryResponse {
        let r = match tokio::time::timeout(limit, self.rx.message()).await {
            Ok(Ok(Some(r))) => r,
            other => panic!("no response within {limit:?}: {other:?}"),
        };
        self.tx
            .send(DiscoveryRequest {
                type_url: r.type_url.clone(),
                version_info: r.version_info.clone(),
                response_nonce: r.nonce.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        r
    }
}

fn sotw_names(r: &DiscoveryResponse) -> Vec<String> {
    let mut v: Vec<String> = r
        .resources
        .iter()
        .map(|any| String::from_utf8_lossy(&any.value).to_string())
        .collect();
    v.sort();
    v
}

/// The relay's next request of `type_url` that subscribes `"*"`.
async fn wildcard_request(h: &mut Harness, type_url: &str) {
    loop {
        let r = h.next_request().await;
        if r.type_url == type_url && r.resource_names_subscribe.iter().any(|n| n == "*") {
            return;
        }
    }
}

async fn unanswered_count(h: &Harness) -> f64 {
    let (_, text) = h.relay.admin_get("/metrics").await;
    text.lines()
        .find_map(|l| {
            l.strip_prefix("adsrelay_upstream_wildcard_unanswered_total{group=\"g\"} ")?
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// B2: SotW client 1 asks CDS [c1, c2]; the upstream answers. SotW client 2 asks CDS with an empty
/// list (wildcard): the relay adds "*" upstream, which is never answered. Client 2 still gets the
/// full state, within the bounded wait, and the gap is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b2_sotw_wildcard_added_mid_stream_is_served_without_an_upstream_answer() {
    let mut h = Harness::start().await;
    let mut named = SotwClient::connect(h.relay.xds, "envoy-1", CDS, &["c1", "c2"]).await;
    let first = h.next_request().await;
    assert!(first.resource_names_subscribe.iter().all(|n| n != "*"));
    let n = h
        .send(vec![res("c1", "1", CDS), res("c2", "1", CDS)], &[])
        .await;
    assert_eq!(h.answer(&n).await, None);
    let r = named.recv_within(TIMEOUT).await;
    assert_eq!(sotw_names(&r), vec!["c1@1", "c2@1"]);

    let started = Instant::now();
    let mut wildcard = SotwClient::connect(h.relay.xds, "envoy-2", CDS, &[]).await;
    wildcard_request(&mut h, CDS).await;
    // go-control-plane: nothing new for "*", so no response.
    let r = wildcard.recv_within(Duration::from_secs(5)).await;
    assert_eq!(sotw_names(&r), vec!["c1@1", "c2@1"], "the full state");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(unanswered_count(&h).await, 1.0);

    // A later upstream change reaches both, as before.
    let n = h.send(vec![res("c3", "1", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    let r = wildcard.recv_within(TIMEOUT).await;
    assert_eq!(sotw_names(&r), vec!["c1@1", "c2@1", "c3@1"]);
}

/// D9 (Delta, LDS): client 1 asks for listener l1, which the upstream says does not exist. Client
/// 2 reconnects wildcard with initial versions {l9: v1}. Nothing is cached for LDS, so its answer
/// (A2) depends on the wildcard being synced; the "*" added mid-stream is never answered. After the
/// wait it gets its answer, and no removal of l9: a guess is not authoritative absence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d9_delta_wildcard_added_mid_stream_is_answered_but_never_removes_on_a_guess() {
    let mut h = Harness::start().await;
    let mut named =
        DeltaClient::connect(h.relay.xds, node("envoy-1", "g"), subscribe(LDS, &["l1"])).await;
    h.next_request().await;
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: LDS.into(),
            removed_resources: vec!["l1".into()],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    assert_eq!(
        named.recv_ack().await.removed_resources,
        vec!["l1".to_string()]
    );

    let mut first = subscribe(LDS, &["*"]);
    first.initial_resource_versions = [("l9".to_string(), "v1".to_string())].into();
    let mut wildcard = DeltaClient::connect(h.relay.xds, node("envoy-2", "g"), first).await;
    wildcard_request(&mut h, LDS).await;
    let r = wildcard.recv_ack().await;
    assert!(r.resources.is_empty(), "{r:?}");
    assert!(
        r.removed_resources.is_empty(),
        "l9 removed on a guess: {r:?}"
    );
    assert_eq!(unanswered_count(&h).await, 1.0);

    // The upstream's next LDS response is authoritative: now l9's absence is real.
    let body = Resource {
        name: "l2".into(),
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: LDS.into(),
            value: b"l2".to_vec(),
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: LDS.into(),
            resources: vec![body.into()],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    let mut got = Vec::new();
    let mut removed = Vec::new();
    while got.is_empty() || removed.is_empty() {
        let r = wildcard.recv_ack().await;
        got.extend(names(&r));
        removed.extend(r.removed_resources);
    }
    assert_eq!(got, vec![("l2".to_string(), "1".to_string())]);
    assert_eq!(removed, vec!["l9".to_string()]);
}

/// B2 after a warm restart: the snapshot holds c1 (named interest only). After the restart a
/// named client comes first; the relay's first CDS request carries c1 with its version, which a
/// go-control-plane upstream need not answer (nothing changed); a SotW wildcard client then adds
/// "*" mid-stream, also unanswered. It still gets the full state from the restored cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b2_after_a_warm_restart_a_wildcard_client_is_served_without_an_upstream_answer() {
    use adsrelay::config::SnapshotConfig;
    let dir = std::env::temp_dir().join(format!("adsrelay-wl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("snapshot");
    let with_snapshot = |path: std::path::PathBuf| {
        move |c: &mut adsrelay::config::Config| {
            c.snapshot = Some(SnapshotConfig {
                path,
                interval: Duration::from_secs(3600),
                max_staleness: Duration::from_secs(3600),
            })
        }
    };

    let mut h = Harness::start_with(with_snapshot(path.clone())).await;
    let mut named = SotwClient::connect(h.relay.xds, "envoy-1", CDS, &["c1"]).await;
    h.next_request().await;
    let n = h.send(vec![res("c1", "1", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    assert_eq!(sotw_names(&named.recv_within(TIMEOUT).await), vec!["c1@1"]);
    h.relay.shutdown();
    eventually("snapshot written at graceful shutdown", || path.exists()).await;
    drop(named);

    // The restarted relay (same upstream, so the snapshot is its own): a named client first,
    // served from the snapshot; the group's first CDS request carries c1 with its version.
    h.relay = RelayUnderTest::start_with(h.upstream, |c| {
        c.max_message_bytes = 64 * 1024;
        with_snapshot(path.clone())(c)
    })
    .await;
    let mut named = SotwClient::connect(h.relay.xds, "envoy-1", CDS, &["c1"]).await;
    let resumed = loop {
        let r = h.next_request().await;
        if !r.initial_resource_versions.is_empty() {
            break r;
        }
    };
    assert_eq!(
        resumed
            .initial_resource_versions
            .get("c1")
            .map(String::as_str),
        Some("1")
    );
    assert!(resumed.resource_names_subscribe.iter().all(|n| n != "*"));
    assert_eq!(sotw_names(&named.recv_within(TIMEOUT).await), vec!["c1@1"]);
    // Nothing changed upstream: no answer. A wildcard client arrives.
    let mut wildcard = SotwClient::connect(h.relay.xds, "envoy-2", CDS, &[]).await;
    wildcard_request(&mut h, CDS).await;
    let r = wildcard.recv_within(Duration::from_secs(5)).await;
    assert_eq!(sotw_names(&r), vec!["c1@1"]);
    let _ = std::fs::remove_dir_all(&dir);
}
