//! The xDS gRPC services: ADS (SotW and Delta) and every per-type discovery service, for any
//! [`StreamHost`] (the relay, or the demo control plane).
//!
//! The write side is hand-written rather than tonic's generated servers: tonic's encoder copies
//! every response into a per-stream buffer that keeps the capacity of the stream's largest
//! message. Here a response is a shared, pre-framed gRPC message ([`crate::xds::Frame`]) handed
//! to HTTP/2 as the body's next data frame: no copy, and nothing per stream outlives the write.
//! The request side is read by [`RequestReader`] (decoded with prost, no buffer kept between
//! requests), and the rest is plain gRPC:
//! `content-type: application/grpc`, status in trailers, `grpc-timeout` by tonic's server layer,
//! compressed requests refused with UNIMPLEMENTED.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame as BodyFrame;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::Status;

use super::requests::RequestReader;
use super::stream::{serve, Responses, StreamHost};
use crate::tls::TlsPeer;
use crate::xds::names::type_urls;
use crate::xds::{DeltaStream, SotwStream, StreamCore, XdsRequest};

/// The gRPC methods of one discovery service.
pub trait Methods: Send + Sync + 'static {
    /// `package.Service`, the route prefix.
    const NAME: &'static str;
    /// The state-of-the-world method, if the service has one (VHDS has none).
    const SOTW: Option<&'static str>;
    const DELTA: &'static str;
    /// The type a per-type service serves (None for ADS).
    const TYPE_URL: Option<&'static str>;
}

/// Serves one discovery service for a host. Cloned per connection; holds only an `Arc`.
pub struct XdsService<H, M> {
    host: Arc<H>,
    max_request_bytes: usize,
    methods: PhantomData<fn() -> M>,
}

impl<H, M> Clone for XdsService<H, M> {
    fn clone(&self) -> Self {
        XdsService {
            host: self.host.clone(),
            max_request_bytes: self.max_request_bytes,
            methods: PhantomData,
        }
    }
}

impl<H, M: Methods> NamedService for XdsService<H, M> {
    const NAME: &'static str = M::NAME;
}

impl<H: StreamHost, M: Methods> XdsService<H, M> {
    pub fn new(host: Arc<H>, max_request_bytes: usize) -> Self {
        XdsService {
            host,
            max_request_bytes,
            methods: PhantomData,
        }
    }

    fn respond(&self, req: http::Request<Body>) -> http::Response<Body> {
        let method = req.uri().path().rsplit('/').next().unwrap_or_default();
        if M::SOTW == Some(method) {
            self.stream::<SotwStream>(req)
        } else if M::DELTA == method {
            self.stream::<DeltaStream>(req)
        } else {
            Status::unimplemented(format!("{} has no method {method}", M::NAME)).into_http()
        }
    }

    fn stream<C>(&self, req: http::Request<Body>) -> http::Response<Body>
    where
        C: StreamCore + Send + 'static,
        C::Request:
            XdsRequest + super::limits::RequestShape + prost::Message + Default + Send + 'static,
    {
        // tonic is built without compression: a compressed request could not be read.
        if let Some(enc) = req.headers().get("grpc-encoding") {
            if enc.as_bytes() != b"identity" {
                return Status::unimplemented(format!(
                    "adsrelay does not accept compressed requests (grpc-encoding: {}); send \
                     them uncompressed",
                    String::from_utf8_lossy(enc.as_bytes())
                ))
                .into_http();
            }
        }
        let peer = req.extensions().get::<TlsPeer>().map(|p| p.0.clone());
        let inbound = RequestReader::new(req.into_body(), self.max_request_bytes);
        let responses = serve::<H, C>(self.host.clone(), inbound, M::TYPE_URL, peer);
        let mut resp = http::Response::new(Body::new(FrameBody {
            responses: Some(responses),
        }));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        resp
    }
}

impl<H: StreamHost, M: Methods> tonic::codegen::Service<http::Request<Body>> for XdsService<H, M> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        std::future::ready(Ok(self.respond(req)))
    }
}

/// A stream's response body: each frame the stream task sends, as one HTTP/2 data frame of the
/// shared bytes; then the status as trailers (OK when the task ends without one).
struct FrameBody {
    /// `None` once the trailers went out.
    responses: Option<Responses>,
}

impl http_body::Body for FrameBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<BodyFrame<Bytes>, Status>>> {
        let Some(rx) = self.responses.as_mut() else {
            return Poll::Ready(None);
        };
        let status = match rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(bytes))) => return Poll::Ready(Some(Ok(BodyFrame::data(bytes)))),
            Poll::Ready(Some(Err(status))) => *status,
            Poll::Ready(None) => Status::ok(""),
        };
        self.responses = None;
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            // A message that cannot be a header value: the code alone.
            trailers.clear();
            trailers.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
        }
        Poll::Ready(Some(Ok(BodyFrame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.responses.is_none()
    }
}

/// Declares the marker type of one discovery service.
macro_rules! methods {
    ($marker:ident, $name:literal, $sotw:expr, $delta:literal, $type_url:expr) => {
        pub struct $marker;
        impl Methods for $marker {
            const NAME: &'static str = $name;
            const SOTW: Option<&'static str> = $sotw;
            const DELTA: &'static str = $delta;
            const TYPE_URL: Option<&'static str> = $type_url;
        }
    };
}

methods!(
    Ads,
    "envoy.service.discovery.v3.AggregatedDiscoveryService",
    Some("StreamAggregatedResources"),
    "DeltaAggregatedResources",
    None
);
methods!(
    Cds,
    "envoy.service.cluster.v3.ClusterDiscoveryService",
    Some("StreamClusters"),
    "DeltaClusters",
    Some(type_urls::CLUSTER)
);
methods!(
    Lds,
    "envoy.service.listener.v3.ListenerDiscoveryService",
    Some("StreamListeners"),
    "DeltaListeners",
    Some(type_urls::LISTENER)
);
methods!(
    Rds,
    "envoy.service.route.v3.RouteDiscoveryService",
    Some("StreamRoutes"),
    "DeltaRoutes",
    Some(type_urls::ROUTE)
);
methods!(
    Srds,
    "envoy.service.route.v3.ScopedRoutesDiscoveryService",
    Some("StreamScopedRoutes"),
    "DeltaScopedRoutes",
    Some(type_urls::SCOPED_ROUTE)
);
methods!(
    Vhds,
    "envoy.service.route.v3.VirtualHostDiscoveryService",
    None,
    "DeltaVirtualHosts",
    Some(type_urls::VIRTUAL_HOST)
);
methods!(
    Eds,
    "envoy.service.endpoint.v3.EndpointDiscoveryService",
    Some("StreamEndpoints"),
    "DeltaEndpoints",
    Some(type_urls::ENDPOINTS)
);
methods!(
    Sds,
    "envoy.service.secret.v3.SecretDiscoveryService",
    Some("StreamSecrets"),
    "DeltaSecrets",
    Some(type_urls::SECRET)
);
methods!(
    Rtds,
    "envoy.service.runtime.v3.RuntimeDiscoveryService",
    Some("StreamRuntime"),
    "DeltaRuntime",
    Some(type_urls::RUNTIME)
);
methods!(
    Ecds,
    "envoy.service.extension.v3.ExtensionConfigDiscoveryService",
    Some("StreamExtensionConfigs"),
    "DeltaExtensionConfigs",
    Some(type_urls::EXTENSION_CONFIG)
);

/// Adds every xDS service for `host` to a tonic server; requests larger than
/// `max_request_bytes` end their stream with RESOURCE_EXHAUSTED.
pub fn add_all<H: StreamHost>(
    server: &mut tonic::transport::Server,
    host: Arc<H>,
    max_request_bytes: usize,
) -> tonic::transport::server::Router {
    let h = || host.clone();
    let m = max_request_bytes;
    server
        .add_service(XdsService::<H, Ads>::new(h(), m))
        .add_service(XdsService::<H, Cds>::new(h(), m))
        .add_service(XdsService::<H, Lds>::new(h(), m))
        .add_service(XdsService::<H, Rds>::new(h(), m))
        .add_service(XdsService::<H, Srds>::new(h(), m))
        .add_service(XdsService::<H, Vhds>::new(h(), m))
        .add_service(XdsService::<H, Eds>::new(h(), m))
        .add_service(XdsService::<H, Sds>::new(h(), m))
        .add_service(XdsService::<H, Rtds>::new(h(), m))
        .add_service(XdsService::<H, Ecds>::new(h(), m))
}
