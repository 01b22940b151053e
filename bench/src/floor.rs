//! The floor: what HTTP/2, gRPC framing and the clients' decode alone cost, on the same
//! tonic/hyper/h2 stack as the relay and the plain control plane.
//!
//! A tonic server with one hand-written route (a tower `Service` that is a `NamedService` for the
//! ADS service name) and no xDS logic. Every message is a complete gRPC frame (flag byte, 4 length
//! bytes, protobuf) built once and handed to each stream's response body as a shared `Bytes` (a
//! reference count, no per-stream copy or encode buffer). Requests are decoded with tonic's
//! `Streaming` and otherwise ignored, except the first ClusterLoadAssignment request, which says
//! which EDS names the stream gets. Both `DeltaAggregatedResources` and
//! `StreamAggregatedResources` are served, so the simulated clients connect to it unchanged.
//!
//! On a stream's opening: all Clusters, all Listeners, its EDS (the wildcard frames are shared by
//! every stream opening at the same versions). On an update: one shared frame per changed
//! wildcard type (Delta: the changed resources; SotW: the full state), and one frame per stream for
//! its changed EDS names. No ACK tracking, no subscription changes, no initial versions.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::codec::{Codec, Streaming};
use tonic::server::NamedService;
use tonic_prost::ProstCodec;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};
use adsrelay::pb::wire::{DeltaDiscoveryResponse, DiscoveryResponse};

use crate::measure::UpstreamFigures;
use crate::workload::{parse_index, resource, Changed, Kind, Workload};

const SERVICE: &str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";

struct FloorStream {
    tx: mpsc::UnboundedSender<Bytes>,
    eds: Vec<u32>,
    sotw: bool,
}

struct FloorState {
    generation: u32,
    /// Encoded `Resource`s (Delta) and their encoded `Any`s (SotW), per kind, at current versions.
    resources: [Vec<Bytes>; 3],
    anys: [Vec<Bytes>; 3],
    /// Full-state frames of Clusters and Listeners for opening streams, [delta, sotw] per kind;
    /// dropped when the kind changes.
    full: [[Option<Bytes>; 2]; 2],
    /// Registered streams by id, until their response body is dropped.
    streams: HashMap<u64, FloorStream>,
    nonce: u64,
}

pub struct FloorServer {
    workload: Arc<Workload>,
    state: Mutex<FloorState>,
    streams_opened: AtomicU64,
    requests: AtomicU64,
}

/// gRPC message framing: uncompressed flag, big-endian length, payload.
fn frame(msg: &impl Message) -> Bytes {
    let len = msg.encoded_len();
    let mut b = BytesMut::with_capacity(len + 5);
    b.put_u8(0);
    b.put_u32(len as u32);
    msg.encode(&mut b).expect("capacity reserved");
    b.freeze()
}

impl FloorState {
    fn encode(&mut self, w: &Workload, kind: Kind, i: u32, generation: u32) {
        let r = resource(kind, i, generation, w.resource_bytes);
        let any = r
            .resource
            .as_ref()
            .map(Message::encode_to_vec)
            .unwrap_or_default();
        self.resources[kind as usize][i as usize] = Bytes::from(r.encode_to_vec());
        self.anys[kind as usize][i as usize] = Bytes::from(any);
    }

    /// One response frame of `kind` carrying the resources `idx` (SotW: their `Any`s).
    fn frame(&mut self, kind: Kind, idx: impl Iterator<Item = u32>, sotw: bool) -> Bytes {
        self.nonce += 1;
        let (k, nonce, type_url) = (
            kind as usize,
            self.nonce.to_string(),
            kind.type_url().into(),
        );
        if sotw {
            frame(&DiscoveryResponse {
                version_info: format!("g{}", self.generation),
                resources: idx.map(|i| self.anys[k][i as usize].clone()).collect(),
                type_url,
                nonce,
                ..Default::default()
            })
        } else {
            frame(&DeltaDiscoveryResponse {
                system_version_info: format!("g{}", self.generation),
                resources: idx.map(|i| self.resources[k][i as usize].clone()).collect(),
                type_url,
                nonce,
                ..Default::default()
            })
        }
    }

    /// The shared full-state frame of a wildcard kind.
    fn full(&mut self, kind: Kind, sotw: bool) -> Bytes {
        if let Some(f) = &self.full[kind as usize][usize::from(sotw)] {
            return f.clone();
        }
        let n = self.resources[kind as usize].len() as u32;
        let f = self.frame(kind, 0..n, sotw);
        self.full[kind as usize][usize::from(sotw)] = Some(f.clone());
        f
    }
}

impl FloorServer {
    pub fn new(workload: Arc<Workload>) -> Arc<Self> {
        let empty = Kind::ALL.map(|k| vec![Bytes::new(); workload.count(k) as usize]);
        let mut st = FloorState {
            generation: 0,
            resources: empty.clone(),
            anys: empty,
            full: Default::default(),
            streams: HashMap::new(),
            nonce: 0,
        };
        for kind in Kind::ALL {
            for i in 0..workload.count(kind) {
                st.encode(&workload, kind, i, 0);
            }
        }
        Arc::new(FloorServer {
            workload,
            state: Mutex::new(st),
            streams_opened: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        })
    }

    /// Serves the floor route on `listener` until the process ends.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<(), String> {
        tonic::transport::Server::builder()
            .add_service(FloorService(self))
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            )
            .await
            .map_err(|e| format!("floor: {e}"))
    }

    pub fn stats(&self) -> UpstreamFigures {
        UpstreamFigures {
            streams_opened: self.streams_opened.load(Ordering::Relaxed),
            active_streams: crate::sync::lock(&self.state).streams.len() as u64,
            requests: self.requests.load(Ordering::Relaxed),
        }
    }

    /// Applies an update and pushes it: one shared frame per changed wildcard type, one frame per
    /// stream for its changed EDS names.
    pub fn push(&self, changed: &Changed, generation: u32) {
        let mut guard = crate::sync::lock(&self.state);
        let st = &mut *guard;
        st.generation = generation;
        for kind in Kind::ALL {
            for &i in &changed.names[kind as usize] {
                if i < self.workload.count(kind) {
                    st.encode(&self.workload, kind, i, generation);
                }
            }
        }
        // Per wildcard kind: [delta, sotw] frames, built only if some stream speaks the variant.
        let variants = [false, true].map(|v| st.streams.values().any(|s| s.sotw == v));
        let mut shared: Vec<(bool, Bytes)> = Vec::new();
        for kind in [Kind::Cluster, Kind::Listener] {
            let names = &changed.names[kind as usize];
            if names.is_empty() {
                continue;
            }
            st.full[kind as usize] = [None, None];
            if variants[0] {
                let f = st.frame(kind, names.clone().into_iter(), false);
                shared.push((false, f));
            }
            if variants[1] {
                shared.push((true, st.full(kind, true)));
            }
        }
        let mut streams = std::mem::take(&mut st.streams);
        streams.retain(|_, s| {
            let mut ok = true;
            for (_, f) in shared.iter().filter(|(v, _)| *v == s.sotw) {
                ok &= s.tx.send(f.clone()).is_ok();
            }
            let mine: Vec<u32> = if s.sotw {
                s.eds.clone()
            } else {
                s.eds
                    .iter()
                    .copied()
                    .filter(|&i| changed.contains_eds(i))
                    .collect()
            };
            if s.eds.iter().any(|&i| changed.contains_eds(i)) {
                ok &=
                    s.tx.send(st.frame(Kind::Endpoints, mine.into_iter(), s.sotw))
                        .is_ok();
            }
            ok
        });
        st.streams = streams;
    }

    /// Reads a stream's requests: the first ClusterLoadAssignment request registers the stream
    /// with its EDS names and queues its opening frames; the rest are counted and dropped.
    async fn read_requests<T: Message + Default + Send + 'static>(
        self: Arc<Self>,
        sotw: bool,
        mut requests: Streaming<T>,
        tx: mpsc::UnboundedSender<Bytes>,
        eds_names: impl Fn(&T) -> Option<Vec<String>>,
    ) {
        let id = self.streams_opened.fetch_add(1, Ordering::Relaxed);
        let closed = tx.clone();
        let mut tx = Some(tx);
        while let Ok(Some(req)) = requests.message().await {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let (Some(names), Some(t)) = (eds_names(&req), &tx) else {
                continue;
            };
            let pool = self.workload.eds_pool;
            let eds: Vec<u32> = names
                .iter()
                .filter_map(|n| {
                    parse_index(n).filter(|&i| i < pool && Kind::Endpoints.name(i) == *n)
                })
                .collect();
            let mut st = crate::sync::lock(&self.state);
            let mut ok = t.send(st.full(Kind::Cluster, sotw)).is_ok();
            ok &= t.send(st.full(Kind::Listener, sotw)).is_ok();
            ok &= t
                .send(st.frame(Kind::Endpoints, eds.iter().copied(), sotw))
                .is_ok();
            if ok {
                let tx = tx.take().expect("checked above");
                st.streams.insert(id, FloorStream { tx, eds, sotw });
            }
        }
        // Requests ended (the client reset the stream, or half-closed it): keep pushing until the
        // response body is gone too, then forget the stream.
        closed.closed().await;
        crate::sync::lock(&self.state).streams.remove(&id);
    }
}

/// The route: answers both ADS methods, anything else with UNIMPLEMENTED.
#[derive(Clone)]
struct FloorService(Arc<FloorServer>);

impl NamedService for FloorService {
    const NAME: &'static str = SERVICE;
}

type BoxFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, Infallible>> + Send>>;

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for FloorService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> BoxFuture {
        let (tx, rx) = mpsc::unbounded_channel();
        let server = self.0.clone();
        let path = req.uri().path().to_owned();
        let body = req.into_body();
        let response = match path.as_str() {
            DELTA_PATH => {
                let decoder =
                    ProstCodec::<DeltaDiscoveryResponse, DeltaDiscoveryRequest>::default()
                        .decoder();
                let requests = Streaming::new_request(decoder, body, None, Some(64 << 20));
                tokio::spawn(server.read_requests(false, requests, tx, |r| {
                    (r.type_url == Kind::Endpoints.type_url())
                        .then(|| r.resource_names_subscribe.clone())
                }));
                grpc_response(FrameBody { rx, done: false })
            }
            SOTW_PATH => {
                let decoder =
                    ProstCodec::<DiscoveryResponse, DiscoveryRequest>::default().decoder();
                let requests = Streaming::new_request(decoder, body, None, Some(64 << 20));
                tokio::spawn(server.read_requests(true, requests, tx, |r| {
                    (r.type_url == Kind::Endpoints.type_url()).then(|| r.resource_names.clone())
                }));
                grpc_response(FrameBody { rx, done: false })
            }
            _ => tonic::Status::unimplemented(path).into_http(),
        };
        Box::pin(std::future::ready(Ok(response)))
    }
}

fn grpc_response(body: FrameBody) -> http::Response<tonic::body::Body> {
    let mut r = http::Response::new(tonic::body::Body::new(body));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    r
}

/// A response body yielding each queued pre-framed message as one data frame, then the
/// `grpc-status: 0` trailers once the server drops the stream's sender.
struct FrameBody {
    rx: mpsc::UnboundedReceiver<Bytes>,
    done: bool,
}

impl http_body::Body for FrameBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(None) => {
                self.done = true;
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
