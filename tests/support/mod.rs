//! Test harness: an in-process demo control plane, an in-process relay on ephemeral ports, and a
//! scripted Delta client built on the real generated ADS client (so every response is decoded with
//! the full `envoy.service.discovery.v3` types, not the relay's shadow messages).
#![allow(dead_code)]

pub mod envoy;
pub mod faults;
pub mod fleet;
pub mod gcp;
pub mod jcp;
pub mod scripted;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use adsrelay::config::Config;
use adsrelay::demo::ControlPlane;
use adsrelay::pb::core::Node;
use adsrelay::pb::discovery::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use adsrelay::pb::discovery::dynamic_parameter_constraints::single_constraint::ConstraintType;
use adsrelay::pb::discovery::dynamic_parameter_constraints::{SingleConstraint, Type};
use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DynamicParameterConstraints, Resource,
    ResourceName,
};
use adsrelay::xds::CachedResource;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

pub const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// An opaque resource of `type_url`; the relay never looks inside.
pub fn resource(type_url: &str, name: &str, version: &str) -> (String, CachedResource) {
    let encoded = Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: format!("{name}@{version}").into_bytes(),
        }),
        ..Default::default()
    }
    .encode_to_vec();
    (
        type_url.to_string(),
        CachedResource::decode(encoded.into()).expect("valid resource"),
    )
}

pub struct Upstream {
    pub cp: Arc<ControlPlane>,
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Upstream {
    pub async fn start(resources: Vec<(String, CachedResource)>) -> Upstream {
        Self::start_on("127.0.0.1:0".parse().unwrap(), resources).await
    }

    pub async fn start_on(addr: SocketAddr, resources: Vec<(String, CachedResource)>) -> Upstream {
        let listener = TcpListener::bind(addr).await.expect("bind control plane");
        Self::serve(listener, resources)
    }

    /// Starts on a port the test already holds (see [`hold_port`]): no other test can take it
    /// in between.
    pub fn start_from(
        port: tokio::net::TcpSocket,
        resources: Vec<(String, CachedResource)>,
    ) -> Upstream {
        Self::serve(port.listen(1024).expect("listen"), resources)
    }

    fn serve(listener: TcpListener, resources: Vec<(String, CachedResource)>) -> Upstream {
        let addr = listener.local_addr().unwrap();
        let cp = ControlPlane::new(resources);
        let (tx, rx) = oneshot::channel();
        tokio::spawn(cp.clone().serve(listener, async {
            let _ = rx.await;
        }));
        Upstream {
            cp,
            addr,
            stop: Some(tx),
        }
    }

    /// Stops accepting connections and ends every open stream.
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
            self.cp.disconnect_all();
        }
    }
}

/// Binds `addr` without listening (connections to it are refused, as to a stopped control
/// plane), retrying for 5 s while a stopped upstream still holds it, and keeps it so a control
/// plane can come back on the same address with [`Upstream::start_from`].
pub async fn hold_port(addr: SocketAddr) -> tokio::net::TcpSocket {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        match socket.bind(addr) {
            Ok(()) => return socket,
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "rebind {addr}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop();
    }
}

pub struct RelayUnderTest {
    pub xds: SocketAddr,
    pub admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl RelayUnderTest {
    pub async fn start(upstream: SocketAddr, linger: Duration) -> RelayUnderTest {
        Self::start_with(upstream, |c| c.unsubscribe_linger = linger).await
    }

    /// Starts a relay with test defaults, then `adjust` applied to its config.
    pub async fn start_with(
        upstream: SocketAddr,
        adjust: impl FnOnce(&mut Config),
    ) -> RelayUnderTest {
        let xds = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut config = Config::with_upstream(format!("http://{upstream}").parse().unwrap());
        config.unsubscribe_linger = Duration::from_secs(30);
        config.backoff_initial = Duration::from_millis(50);
        config.backoff_max = Duration::from_millis(500);
        config.limits.drain_period = Duration::from_millis(200);
        adjust(&mut config);
        let relay = RelayUnderTest {
            xds: xds.local_addr().unwrap(),
            admin: admin.local_addr().unwrap(),
            stop: None,
        };
        let (tx, rx) = oneshot::channel();
        tokio::spawn(adsrelay::run(config, xds, admin, async {
            let _ = rx.await;
        }));
        RelayUnderTest {
            stop: Some(tx),
            ..relay
        }
    }

    /// GET on the admin port; returns (status, body).
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path).await
    }
}

impl RelayUnderTest {
    /// Starts a graceful shutdown, as SIGTERM does.
    pub fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for RelayUnderTest {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Minimal HTTP/1.1 GET (admin endpoints, Envoy admin, Envoy listeners).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

pub fn node(id: &str, cluster: &str) -> Node {
    Node {
        id: id.into(),
        cluster: cluster.into(),
        ..Default::default()
    }
}

pub fn subscribe(type_url: &str, names: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: type_url.into(),
        resource_names_subscribe: names.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub fn unsubscribe(type_url: &str, names: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: type_url.into(),
        resource_names_unsubscribe: names.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub fn ack(resp: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        ..Default::default()
    }
}

/// (name, version) of each resource in a response, sorted.
pub fn names(resp: &DeltaDiscoveryResponse) -> Vec<(String, String)> {
    let mut v: Vec<_> = resp
        .resources
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect();
    v.sort();
    v
}

/// A scripted Delta ADS client on its own connection, like one Envoy.
pub struct DeltaClient {
    tx: mpsc::Sender<DeltaDiscoveryRequest>,
    rx: Streaming<DeltaDiscoveryResponse>,
    node: Option<Node>,
}

impl DeltaClient {
    /// Opens a stream; `first` is sent with `node` attached.
    pub async fn connect(
        addr: SocketAddr,
        node: Node,
        first: DeltaDiscoveryRequest,
    ) -> DeltaClient {
        Self::try_connect(addr, Some(node), first)
            .await
            .expect("open stream")
    }

    pub async fn try_connect(
        addr: SocketAddr,
        node: Option<Node>,
        first: DeltaDiscoveryRequest,
    ) -> Result<DeltaClient, tonic::Status> {
        let client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        Self::try_open(client, node, first).await
    }

    /// Opens a stream on an existing client (e.g. one over TLS).
    pub async fn try_open(
        mut client: AggregatedDiscoveryServiceClient<tonic::transport::Channel>,
        node: Option<Node>,
        mut first: DeltaDiscoveryRequest,
    ) -> Result<DeltaClient, tonic::Status> {
        let (tx, rx) = mpsc::channel(16);
        first.node = node.clone();
        tx.send(first).await.unwrap();
        let rx = client
            .delta_aggregated_resources(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(DeltaClient { tx, rx, node })
    }

    pub async fn send(&self, req: DeltaDiscoveryRequest) {
        self.tx.send(req).await.expect("stream open");
    }

    /// The next response, failing the test after [`TIMEOUT`].
    pub async fn recv(&mut self) -> DeltaDiscoveryResponse {
        match tokio::time::timeout(TIMEOUT, self.rx.message()).await {
            Ok(Ok(Some(r))) => r,
            other => panic!("expected a response, got {other:?}"),
        }
    }

    /// The next response, or the stream's terminal status; fails the test after [`TIMEOUT`].
    pub async fn try_recv(&mut self) -> Result<DeltaDiscoveryResponse, tonic::Status> {
        match tokio::time::timeout(TIMEOUT, self.rx.message()).await {
            Ok(Ok(Some(r))) => Ok(r),
            Ok(Err(status)) => Err(status),
            other => panic!("expected a response or a status, got {other:?}"),
        }
    }

    /// The stream's terminal status, if the relay ends it.
    pub async fn recv_status(&mut self) -> tonic::Status {
        match tokio::time::timeout(TIMEOUT, self.rx.message()).await {
            Ok(Err(status)) => status,
            other => panic!("expected an error status, got {other:?}"),
        }
    }

    /// Waits until the stream ends (an error status or end of stream), failing after `limit`.
    pub async fn wait_closed(&mut self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) | Ok(Err(_)) => return,
                Err(_) => panic!("stream still open after {limit:?}"),
            }
        }
    }

    /// Asserts that nothing arrives within `wait`.
    pub async fn expect_silence(&mut self, wait: Duration) {
        if let Ok(r) = tokio::time::timeout(wait, self.rx.message()).await {
            panic!("expected no response, got {r:?}");
        }
    }

    /// Receives and ACKs the next response.
    pub async fn recv_ack(&mut self) -> DeltaDiscoveryResponse {
        let r = self.recv().await;
        self.send(ack(&r)).await;
        r
    }
}

/// Polls `f` until it returns true or the timeout passes.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Minimal HTTP/1.0 request (no chunked bodies to decode); returns (status, body without headers).
pub async fn http_request(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The TP2 constraint `env == v`.
pub fn env_is(v: &str) -> DynamicParameterConstraints {
    DynamicParameterConstraints {
        r#type: Some(Type::Constraint(SingleConstraint {
            key: "env".into(),
            constraint_type: Some(ConstraintType::Value(v.into())),
        })),
    }
}

/// EDS resource `name` with no constraints (every parameter set selects it); its body reads
/// `name/any@version`.
pub fn unconstrained(name: &str, version: &str) -> (String, CachedResource) {
    eds_entry(Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(eds_body(name, "any", version)),
        ..Default::default()
    })
}

/// A variant of EDS resource `name` for `env == <env>`; its body reads `name/env@version`.
pub fn variant(name: &str, env: &str, version: &str) -> (String, CachedResource) {
    eds_entry(Resource {
        resource_name: Some(ResourceName {
            name: name.into(),
            dynamic_parameter_constraints: Some(env_is(env)),
        }),
        version: version.into(),
        resource: Some(eds_body(name, env, version)),
        ..Default::default()
    })
}

/// The body `name/<label>@version` of an EDS resource.
fn eds_body(name: &str, label: &str, version: &str) -> prost_types::Any {
    prost_types::Any {
        type_url: EDS.into(),
        value: format!("{name}/{label}@{version}").into_bytes(),
    }
}

/// An EDS entry for `Store::complete`.
fn eds_entry(r: Resource) -> (String, CachedResource) {
    (
        EDS.to_string(),
        CachedResource::decode(r.encode_to_vec().into()).unwrap(),
    )
}
