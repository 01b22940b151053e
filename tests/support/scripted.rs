//! A scripted control plane: a tiny tonic server whose responses the test writes by hand, for
//! upstream behaviour the demo control plane never produces (invalid responses, TTL heartbeats,
//! resource errors).

use std::sync::{Arc, Mutex};

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest, Resource};
use adsrelay::pb::relay_ads::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use adsrelay::pb::wire;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnboundedReceiverStream};
use tonic::{Request, Response, Status, Streaming};

use super::{RelayUnderTest, CDS, TIMEOUT};

type Out = mpsc::Sender<Result<wire::DeltaDiscoveryResponse, Status>>;

/// The scripted control plane: every request it receives goes to `requests`; the test sends
/// responses on the latest stream with [`Scripted::send`].
#[derive(Clone)]
pub struct Scripted {
    pub current: Arc<Mutex<Option<Out>>>,
    pub requests: mpsc::UnboundedSender<DeltaDiscoveryRequest>,
    pub streams: Arc<Mutex<u32>>,
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

pub struct Harness {
    pub cp: Scripted,
    pub requests: UnboundedReceiverStream<DeltaDiscoveryRequest>,
    pub relay: RelayUnderTest,
    pub nonce: u32,
    /// The scripted control plane's address (to start another relay against it).
    pub upstream: std::net::SocketAddr,
}

pub fn res(name: &str, version: &str, type_url: &str) -> Vec<u8> {
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
    pub async fn start() -> Harness {
        Self::start_with(|_| {}).await
    }

    /// [`Harness::start`] with `adjust` applied to the relay's config after the harness defaults.
    pub async fn start_with(adjust: impl FnOnce(&mut adsrelay::config::Config)) -> Harness {
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
        let relay = RelayUnderTest::start_with(addr, |c| {
            c.max_message_bytes = 64 * 1024;
            adjust(c);
        })
        .await;
        Harness {
            cp,
            requests: UnboundedReceiverStream::new(rrx),
            relay,
            nonce: 0,
            upstream: addr,
        }
    }

    pub async fn next_request(&mut self) -> DeltaDiscoveryRequest {
        use tokio_stream::StreamExt;
        tokio::time::timeout(TIMEOUT, self.requests.next())
            .await
            .expect("a request from the relay")
            .expect("requests channel open")
    }

    /// Sends a hand-made response on the current stream; its nonce is set here and returned.
    pub async fn send_raw(&mut self, mut resp: wire::DeltaDiscoveryResponse) -> String {
        self.nonce += 1;
        resp.nonce = format!("n{}", self.nonce);
        let nonce = resp.nonce.clone();
        let tx = self.cp.current.lock().unwrap().clone().expect("a stream");
        tx.send(Ok(resp)).await.unwrap();
        nonce
    }

    /// Sends a response on the current stream; returns its nonce.
    pub async fn send(&mut self, resources: Vec<Vec<u8>>, removed: &[&str]) -> String {
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
    pub async fn answer(&mut self, nonce: &str) -> Option<String> {
        loop {
            let r = self.next_request().await;
            if r.response_nonce == nonce {
                return r.error_detail.map(|e| e.message);
            }
        }
    }
}
