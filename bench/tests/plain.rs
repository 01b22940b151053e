//! The plain control plane speaks the protocol the way the comparison assumes: Delta honours
//! `initial_resource_versions` (a reconnect only gets what changed, and an empty response for a
//! wildcard type with nothing changed, as conformance A2 wants), an ACK gets no answer, an
//! update is one response per changed type carrying only the change; SotW sends the full state
//! of a type when something in it changed.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use adsrelay::pb::discovery::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use adsrelay_bench::plain::PlainControlPlane;
use adsrelay_bench::workload::{Changed, Kind, Workload};

fn workload() -> Arc<Workload> {
    Arc::new(Workload {
        clusters: 5,
        listeners: 2,
        eds_pool: 10,
        eds_per_client: 2,
        resource_bytes: 64,
        seed: 1,
    })
}

async fn start() -> (
    Arc<PlainControlPlane>,
    AggregatedDiscoveryServiceClient<tonic::transport::Channel>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let cp = PlainControlPlane::new(workload());
    tokio::spawn(cp.clone().serve(listener));
    let client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    (cp, client)
}

fn delta_opening(held: &[(&str, &str)]) -> Vec<DeltaDiscoveryRequest> {
    Kind::ALL
        .into_iter()
        .map(|kind| DeltaDiscoveryRequest {
            type_url: kind.type_url().into(),
            resource_names_subscribe: if kind == Kind::Endpoints {
                vec!["eds-1".into(), "eds-3".into()]
            } else {
                Vec::new()
            },
            initial_resource_versions: held
                .iter()
                .filter(|(n, _)| n.starts_with(kind.name(0).trim_end_matches('0')))
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        })
        .collect()
}

async fn next<T>(s: &mut Streaming<T>) -> Option<T> {
    match tokio::time::timeout(Duration::from_millis(300), s.message()).await {
        Ok(Ok(m)) => m,
        Ok(Err(status)) => panic!("stream failed: {status}"),
        Err(_) => None,
    }
}

fn names(r: &DeltaDiscoveryResponse) -> Vec<(String, String)> {
    r.resources
        .iter()
        .map(|x| (x.name.clone(), x.version.clone()))
        .collect()
}

#[tokio::test]
async fn delta_sends_changes_only_and_honours_initial_versions() {
    let (cp, mut client) = start().await;
    let (tx, rx) = mpsc::channel(8);
    for r in delta_opening(&[]) {
        tx.send(r).await.expect("queue");
    }
    let mut s = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("open")
        .into_inner();
    let mut counts = Vec::new();
    for _ in 0..3 {
        let r = next(&mut s).await.expect("opening response");
        counts.push((r.type_url.clone(), r.resources.len()));
        tx.send(DeltaDiscoveryRequest {
            type_url: r.type_url,
            response_nonce: r.nonce,
            ..Default::default()
        })
        .await
        .expect("ack");
    }
    counts.sort();
    let want = |k: Kind, n| (k.type_url().to_string(), n);
    let mut expected = vec![
        want(Kind::Cluster, 5),
        want(Kind::Listener, 2),
        want(Kind::Endpoints, 2),
    ];
    expected.sort();
    assert_eq!(counts, expected);
    assert!(next(&mut s).await.is_none(), "an ACK gets no answer");

    let mut changed = Changed::default();
    changed.names[0] = vec![0];
    changed.names[2] = vec![3, 7];
    cp.push(&changed, 1);
    let mut got = vec![
        names(&next(&mut s).await.expect("update")),
        names(&next(&mut s).await.expect("update")),
    ];
    got.sort();
    assert_eq!(
        got,
        vec![
            vec![("cluster-0".to_string(), "u1".to_string())],
            vec![("eds-3".to_string(), "u1".to_string())],
        ],
        "one response per changed type, the changed subscribed resources only"
    );
    assert!(next(&mut s).await.is_none());
    drop((tx, s));

    // Reconnect holding everything at current versions except listener-1 (an old version).
    let held = [
        ("cluster-0", "u1"),
        ("cluster-1", "u0"),
        ("cluster-2", "u0"),
        ("cluster-3", "u0"),
        ("cluster-4", "u0"),
        ("listener-0", "u0"),
        ("listener-1", "old"),
        ("eds-1", "u0"),
        ("eds-3", "u1"),
    ];
    let (tx, rx) = mpsc::channel(8);
    for r in delta_opening(&held) {
        tx.send(r).await.expect("queue");
    }
    let mut s = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("reopen")
        .into_inner();
    let mut got = Vec::new();
    for _ in 0..2 {
        let r = next(&mut s).await.expect("a response per wildcard type");
        got.push((r.type_url.clone(), names(&r)));
    }
    got.sort();
    let mut want = vec![
        // The wildcard Clusters are all current: one empty response (conformance A2).
        (Kind::Cluster.type_url().to_string(), vec![]),
        (
            Kind::Listener.type_url().to_string(),
            vec![("listener-1".into(), "u0".into())],
        ),
    ];
    want.sort();
    assert_eq!(got, want);
    assert!(next(&mut s).await.is_none(), "nothing else differs");
    drop(tx);
}

#[tokio::test]
async fn sotw_sends_full_state_of_a_changed_type() {
    let (cp, mut client) = start().await;
    let (tx, rx) = mpsc::channel(8);
    for kind in Kind::ALL {
        tx.send(DiscoveryRequest {
            type_url: kind.type_url().into(),
            resource_names: if kind == Kind::Endpoints {
                vec!["eds-2".into(), "eds-404".into()]
            } else {
                Vec::new()
            },
            ..Default::default()
        })
        .await
        .expect("queue");
    }
    let mut s = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("open")
        .into_inner();
    let mut sizes = Vec::new();
    for _ in 0..3 {
        let r: DiscoveryResponse = next(&mut s).await.expect("opening response");
        sizes.push((r.type_url.clone(), r.resources.len()));
        let kind = Kind::from_type_url(&r.type_url).expect("known type");
        tx.send(DiscoveryRequest {
            type_url: r.type_url,
            version_info: r.version_info,
            response_nonce: r.nonce,
            resource_names: if kind == Kind::Endpoints {
                vec!["eds-2".into(), "eds-404".into()]
            } else {
                Vec::new()
            },
            ..Default::default()
        })
        .await
        .expect("ack");
    }
    sizes.sort();
    let mut expected = vec![
        (Kind::Cluster.type_url().to_string(), 5),
        (Kind::Listener.type_url().to_string(), 2),
        (Kind::Endpoints.type_url().to_string(), 1),
    ];
    expected.sort();
    assert_eq!(sizes, expected, "unknown names are skipped");
    assert!(next(&mut s).await.is_none(), "an ACK gets no answer");

    let mut changed = Changed::default();
    changed.names[0] = vec![4];
    cp.push(&changed, 1);
    let r = next(&mut s).await.expect("update");
    assert_eq!(r.type_url, Kind::Cluster.type_url());
    assert_eq!(r.resources.len(), 5, "full state");
    assert_eq!(r.version_info, "g1");
    assert!(next(&mut s).await.is_none(), "EDS did not change");
    drop(tx);
}
