//! The tonic services: ADS (SotW and Delta) and every per-type discovery service, all thin shims
//! onto [`super::serve`] for any [`StreamHost`] (the relay, or the demo control plane).

use std::sync::Arc;

use tonic::{Request, Response, Status, Streaming};

use super::stream::{serve, ResponseStream, StreamHost};
use crate::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};
use crate::pb::per_type;
use crate::pb::relay_ads::aggregated_discovery_service_server::AggregatedDiscoveryService;
use crate::pb::wire;
use crate::xds::{DeltaStream, SotwStream};

/// Serves xDS for a host. Cloned per connection by tonic; holds only an `Arc`.
#[derive(Debug)]
pub struct XdsServices<H> {
    host: Arc<H>,
}

impl<H> Clone for XdsServices<H> {
    fn clone(&self) -> Self {
        XdsServices {
            host: self.host.clone(),
        }
    }
}

impl<H: StreamHost> XdsServices<H> {
    pub fn new(host: Arc<H>) -> Self {
        XdsServices { host }
    }

    fn sotw(
        &self,
        req: Request<Streaming<DiscoveryRequest>>,
        fixed_type: Option<&'static str>,
    ) -> Result<Response<ResponseStream<wire::DiscoveryResponse>>, Status> {
        let peer = tls_peer(&req);
        Ok(Response::new(serve::<H, SotwStream>(
            self.host.clone(),
            req.into_inner(),
            fixed_type,
            peer,
        )))
    }

    fn delta(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
        fixed_type: Option<&'static str>,
    ) -> Result<Response<ResponseStream<wire::DeltaDiscoveryResponse>>, Status> {
        let peer = tls_peer(&req);
        Ok(Response::new(serve::<H, DeltaStream>(
            self.host.clone(),
            req.into_inner(),
            fixed_type,
            peer,
        )))
    }
}

/// The verified client certificate's identity, on a TLS connection.
fn tls_peer<T>(req: &Request<T>) -> Option<Arc<crate::tls::PeerIdentity>> {
    req.extensions()
        .get::<crate::tls::TlsPeer>()
        .map(|p| p.0.clone())
}

#[tonic::async_trait]
impl<H: StreamHost> AggregatedDiscoveryService for XdsServices<H> {
    type StreamAggregatedResourcesStream = ResponseStream<wire::DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = ResponseStream<wire::DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.sotw(request, None)
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.delta(request, None)
    }
}

/// Implements one per-type service: its SotW and Delta rpcs with the type fixed.
macro_rules! per_type_service {
    ($module:ident :: $server_mod:ident :: $trait:ident, $type_url:literal,
     $(sotw: $sotw_fn:ident / $SotwAssoc:ident,)? delta: $delta_fn:ident / $DeltaAssoc:ident) => {
        #[tonic::async_trait]
        impl<H: StreamHost> per_type::$module::$server_mod::$trait for XdsServices<H> {
            $(
            type $SotwAssoc = ResponseStream<wire::DiscoveryResponse>;
            async fn $sotw_fn(
                &self,
                request: Request<Streaming<DiscoveryRequest>>,
            ) -> Result<Response<Self::$SotwAssoc>, Status> {
                self.sotw(request, Some($type_url))
            }
            )?
            type $DeltaAssoc = ResponseStream<wire::DeltaDiscoveryResponse>;
            async fn $delta_fn(
                &self,
                request: Request<Streaming<DeltaDiscoveryRequest>>,
            ) -> Result<Response<Self::$DeltaAssoc>, Status> {
                self.delta(request, Some($type_url))
            }
        }
    };
}

per_type_service!(cluster::cluster_discovery_service_server::ClusterDiscoveryService,
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    sotw: stream_clusters / StreamClustersStream, delta: delta_clusters / DeltaClustersStream);
per_type_service!(listener::listener_discovery_service_server::ListenerDiscoveryService,
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    sotw: stream_listeners / StreamListenersStream, delta: delta_listeners / DeltaListenersStream);
per_type_service!(route::route_discovery_service_server::RouteDiscoveryService,
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    sotw: stream_routes / StreamRoutesStream, delta: delta_routes / DeltaRoutesStream);
per_type_service!(scoped_routes::scoped_routes_discovery_service_server::ScopedRoutesDiscoveryService,
    "type.googleapis.com/envoy.config.route.v3.ScopedRouteConfiguration",
    sotw: stream_scoped_routes / StreamScopedRoutesStream,
    delta: delta_scoped_routes / DeltaScopedRoutesStream);
per_type_service!(virtual_host::virtual_host_discovery_service_server::VirtualHostDiscoveryService,
    "type.googleapis.com/envoy.config.route.v3.VirtualHost",
    delta: delta_virtual_hosts / DeltaVirtualHostsStream);
per_type_service!(endpoint::endpoint_discovery_service_server::EndpointDiscoveryService,
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    sotw: stream_endpoints / StreamEndpointsStream, delta: delta_endpoints / DeltaEndpointsStream);
per_type_service!(secret::secret_discovery_service_server::SecretDiscoveryService,
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
    sotw: stream_secrets / StreamSecretsStream, delta: delta_secrets / DeltaSecretsStream);
per_type_service!(runtime::runtime_discovery_service_server::RuntimeDiscoveryService,
    "type.googleapis.com/envoy.service.runtime.v3.Runtime",
    sotw: stream_runtime / StreamRuntimeStream, delta: delta_runtime / DeltaRuntimeStream);
per_type_service!(extension::extension_config_discovery_service_server::ExtensionConfigDiscoveryService,
    "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
    sotw: stream_extension_configs / StreamExtensionConfigsStream,
    delta: delta_extension_configs / DeltaExtensionConfigsStream);

/// Adds every xDS service for `host` to a tonic server, with the message size limits applied.
pub fn add_all<H: StreamHost>(
    server: &mut tonic::transport::Server,
    host: Arc<H>,
    max_message_bytes: usize,
) -> tonic::transport::server::Router {
    let svc = XdsServices::new(host);
    macro_rules! limited {
        ($server:path) => {{
            use $server as S;
            S::new(svc.clone())
                .max_decoding_message_size(max_message_bytes)
                .max_encoding_message_size(max_message_bytes)
        }};
    }
    server
        .add_service(limited!(
            crate::pb::relay_ads::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer
        ))
        .add_service(limited!(per_type::cluster::cluster_discovery_service_server::ClusterDiscoveryServiceServer))
        .add_service(limited!(per_type::listener::listener_discovery_service_server::ListenerDiscoveryServiceServer))
        .add_service(limited!(per_type::route::route_discovery_service_server::RouteDiscoveryServiceServer))
        .add_service(limited!(per_type::scoped_routes::scoped_routes_discovery_service_server::ScopedRoutesDiscoveryServiceServer))
        .add_service(limited!(per_type::virtual_host::virtual_host_discovery_service_server::VirtualHostDiscoveryServiceServer))
        .add_service(limited!(per_type::endpoint::endpoint_discovery_service_server::EndpointDiscoveryServiceServer))
        .add_service(limited!(per_type::secret::secret_discovery_service_server::SecretDiscoveryServiceServer))
        .add_service(limited!(per_type::runtime::runtime_discovery_service_server::RuntimeDiscoveryServiceServer))
        .add_service(limited!(per_type::extension::extension_config_discovery_service_server::ExtensionConfigDiscoveryServiceServer))
}
