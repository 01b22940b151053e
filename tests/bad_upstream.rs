//! A scripted control plane (a tiny tonic server in this test) sends crafted bad responses: the
//! relay NACKs each with an error_detail naming the problem, keeps the last good state, and never
//! passes anything of the bad response to clients. An oversize response ends the upstream stream
//! (it cannot be decoded, so it cannot be NACKed); the relay reconnects and clients keep their
//! config.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest, Resource};
use adsrelay::pb::relay_ads::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use adsrelay::pb::wire;
use prost::Message;
use support::*;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnboundedReceiverStream};
use tonic::{Request, Response, Status, Streaming};

type Out = mpsc::Sender<Result<wire::DeltaDiscoveryResponse, Status>>;

/// The scripted control plane: every request it receives goes to `requests`; the test sends
/// responses on the latest stream with [`Scripted::send`].
#[derive(Clone)]
struct Scripted {
    current: Arc<Mutex<Option<Out>>>,
    requests: mpsc::UnboundedSender<DeltaDiscoveryRequest>,
    streams: Arc<Mutex<u32>>,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Scripted {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<wire::DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream =
        ReceiverStream<Result<wire::DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        _: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("delta only"))
    }

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        *self.current.lock().unwrap() = Some(tx);
        *self.streams.lock().unwrap() += 1;
        let requests = self.requests.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = inbound.message().await {
                let _ = requests.send(r);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Harness {
    cp: Scripted,
    requests: UnboundedReceiverStream<DeltaDiscoveryRequest>,
    relay: RelayUnderTest,
    nonce: u32,
}

fn res(name: &str, version: &str, type_url: &str) -> Vec<u8> {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: format!("{name}@{version}").into_bytes(),
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

impl Harness {
    async fn start() -> Harness {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (rtx, rrx) = mpsc::unbounded_channel();
        let cp = Scripted {
            current: Arc::new(Mutex::new(None)),
            requests: rtx,
            streams: Arc::new(Mutex::new(0)),
        };
        let svc = AggregatedDiscoveryServiceServer::new(cp.clone())
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let relay = RelayUnderTest::start_with(addr, |c| c.max_message_bytes = 64 * 1024).await;
        Harness {
            cp,
            requests: UnboundedReceiverStream::new(rrx),
            relay,
            nonce: 0,
        }
    }

    async fn next_request(&mut self) -> DeltaDiscoveryRequest {
        use tokio_stream::StreamExt;
        tokio::time::timeout(TIMEOUT, self.requests.next())
            .await
            .expect("a request from the relay")
            .expect("requests channel open")
    }

    /// Sends a response on the current stream; returns its nonce.
    async fn send(&mut self, resources: Vec<Vec<u8>>, removed: &[&str]) -> String {
        self.nonce += 1;
        let nonce = format!("n{}", self.nonce);
        let tx = self.cp.current.lock().unwrap().clone().expect("a stream");
        tx.send(Ok(wire::DeltaDiscoveryResponse {
            type_url: CDS.into(),
            resources: resources.into_iter().map(Into::into).collect(),
            removed_resources: removed.iter().map(|s| s.to_string()).collect(),
            nonce: nonce.clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
        nonce
    }

    /// The relay's answer to `nonce`: `None` for an ACK, the error message for a NACK.
    async fn answer(&mut self, nonce: &str) -> Option<String> {
        loop {
            let r = self.next_request().await;
            if r.response_nonce == nonce {
                return r.error_detail.map(|e| e.message);
            }
        }
    }
}

#[tokio::test]
async fn bad_upstream_responses_are_nacked_and_never_reach_clients() {
    let mut h = Harness::start().await;
    let mut client = DeltaClient::connect(
        h.relay.xds,
        node("envoy", "g"),
        subscribe(CDS, &["c1", "c2"]),
    )
    .await;
    // The relay subscribes upstream; answer with the good state.
    let sub = h.next_request().await;
    assert_eq!(sub.type_url, CDS);
    let n = h
        .send(vec![res("c1", "1", CDS), res("c2", "1", CDS)], &[])
        .await;
    assert_eq!(h.answer(&n).await, None, "good response ACKed");
    let r = client.recv_ack().await;
    assert_eq!(
        names(&r),
        [("c1".into(), "1".into()), ("c2".into(), "1".into())]
    );

    // (resources, removed names, expected NACK text)
    type Case<'a> = (Vec<Vec<u8>>, Vec<&'a str>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![res("c1", "2", CDS), res("c1", "3", CDS)],
            vec![],
            "duplicate resource name \"c1\"",
        ),
        (
            vec![res("c1", "2", CDS)],
            vec!["c1"],
            "\"c1\" is both added and removed",
        ),
        (
            vec![res("c1", "2", EDS)],
            vec![],
            "resource \"c1\" has type \"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\"",
        ),
        (vec![vec![0xff, 0xff, 0xff]], vec![], "resource #0"),
    ];
    for (resources, removed, expected) in cases {
        let n = h.send(resources, &removed).await;
        let nack = h.answer(&n).await.expect("NACK");
        assert!(nack.contains(expected), "NACK {nack:?} lacks {expected:?}");
    }
    client.expect_silence(Duration::from_millis(300)).await;

    // Oversize: the relay cannot decode it, drops the stream and reconnects with its versions.
    let streams_before = *h.cp.streams.lock().unwrap();
    let big = vec![res("c1", &"9".repeat(70 * 1024), CDS)];
    h.send(big, &[]).await;
    let resub = loop {
        let r = h.next_request().await;
        if !r.initial_resource_versions.is_empty() {
            break r;
        }
    };
    assert!(*h.cp.streams.lock().unwrap() > streams_before);
    assert_eq!(
        resub
            .initial_resource_versions
            .get("c1")
            .map(String::as_str),
        Some("1")
    );
    client.expect_silence(Duration::from_millis(300)).await;

    // The last good state is intact: a real update flows through.
    let n = h.send(vec![res("c2", "2", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    assert_eq!(names(&client.recv_ack().await), [("c2".into(), "2".into())]);
    let (_, body) = http_request(h.relay.admin, "GET", "/metrics").await;
    assert!(
        body.contains("adsrelay_upstream_nacks_total{group=\"g\"} 4"),
        "{body}"
    );
}
