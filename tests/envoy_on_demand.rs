//! A real Envoy 1.40 using on-demand discovery through the relay on Delta ADS: a route
//! configuration with `vhds`, the `on_demand` HTTP filter with on-demand CDS, and a scripted
//! upstream that resolves VHDS aliases and serves clusters by name. A request for a host the
//! route table does not have makes Envoy fetch its virtual host by alias (VHDS on demand), then
//! the cluster that virtual host routes to (ODCDS); the request succeeds. And LEDS: a cluster
//! whose endpoints are an xdstp glob collection, expanded by the upstream, reaches its backend.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, Resource};
use adsrelay::pb::wire;
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, Address, AggregatedConfigSource, ApiVersion,
    ConfigSource, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::route::v3::{
    route, route_action, route_match, Route, RouteAction, RouteConfiguration, RouteMatch, Vhds,
    VirtualHost,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use prost::{Message, Name};
use support::envoy::{free_port, Envoy};
use support::scripted::Harness;
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const VHDS: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

const BOOTSTRAP: &str = r#"
admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: 9901 }
dynamic_resources:
  ads_config:
    api_type: DELTA_GRPC
    transport_api_version: V3
    set_node_on_first_message_only: true
    grpc_services:
      - envoy_grpc: { cluster_name: adsrelay }
static_resources:
  listeners:
    - name: od_listener
      address:
        socket_address: { address: 127.0.0.1, port_value: LISTENER_PORT }
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: od
                rds:
                  route_config_name: rc1
                  config_source: { ads: {}, resource_api_version: V3 }
                http_filters:
                  - name: envoy.filters.http.on_demand
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.on_demand.v3.OnDemand
                      odcds:
                        source: { ads: {}, resource_api_version: V3 }
                        timeout: 10s
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: adsrelay
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {}
      load_assignment:
        cluster_name: adsrelay
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: 18000 }
"#;

fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        ..Default::default()
    }
}

fn wrap<M: Message + Name>(name: &str, aliases: Vec<String>, m: &M) -> bytes::Bytes {
    Resource {
        name: name.into(),
        version: "1".into(),
        aliases,
        resource: Some(prost_types::Any {
            type_url: M::type_url(),
            value: m.encode_to_vec(),
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn route_config() -> bytes::Bytes {
    wrap(
        "rc1",
        vec![],
        &RouteConfiguration {
            name: "rc1".into(),
            vhds: Some(Vhds {
                config_source: Some(ads()),
            }),
            ..Default::default()
        },
    )
}

fn virtual_host(name: &str, domain: &str, aliases: Vec<String>) -> bytes::Bytes {
    wrap(
        name,
        aliases,
        &VirtualHost {
            name: name.into(),
            domains: vec![domain.into()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
                    ..Default::default()
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                        "od_cluster".into(),
                    )),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        },
    )
}

fn cluster_msg(backend: std::net::SocketAddr) -> bytes::Bytes {
    let addr = Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: backend.ip().to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(
                backend.port().into(),
            )),
            ..Default::default()
        })),
    };
    wrap(
        "od_cluster",
        vec![],
        &Cluster {
            name: "od_cluster".into(),
            connect_timeout: Some(PbDuration {
                seconds: 1,
                nanos: 0,
            }),
            cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
                cluster::DiscoveryType::Static as i32,
            )),
            load_assignment: Some(ClusterLoadAssignment {
                cluster_name: "od_cluster".into(),
                endpoints: vec![LocalityLbEndpoints {
                    lb_endpoints: vec![LbEndpoint {
                        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                            address: Some(addr),
                            ..Default::default()
                        })),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        },
    )
}

/// The upstream: answers RDS `rc1`, the VHDS base set, VHDS aliases of `od.test` (others
/// unresolved), and CDS `od_cluster`.
fn answer(
    req: &DeltaDiscoveryRequest,
    backend: std::net::SocketAddr,
) -> wire::DeltaDiscoveryResponse {
    let mut resp = wire::DeltaDiscoveryResponse {
        type_url: req.type_url.clone(),
        ..Default::default()
    };
    for name in &req.resource_names_subscribe {
        match (req.type_url.as_str(), name.as_str()) {
            (RDS, "rc1") => resp.resources.push(route_config()),
            // The base set a VHDS server sends for the initial (namespace) request; rc9's host
            // belongs to another route configuration and must not reach this Envoy (A27).
            (VHDS, "*") => {
                resp.resources
                    .push(virtual_host("rc1/vhost_base", "base.test", vec![]));
                resp.resources
                    .push(virtual_host("rc9/vhost_other", "other.test", vec![]));
            }
            (VHDS, a) if a.starts_with("rc1/od.test") => {
                resp.resources
                    .push(virtual_host("rc1/vhost_od", "od.test", vec![a.to_string()]))
            }
            (VHDS, a) => resp.resources.push(
                Resource {
                    name: a.into(),
                    aliases: vec![a.into()],
                    ..Default::default()
                }
                .encode_to_vec()
                .into(),
            ),
            (CDS, "od_cluster") => resp.resources.push(cluster_msg(backend)),
            (_, n) => resp.removed_resources.push(n.into()),
        }
    }
    resp
}

async fn get_host(port: u16, host: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return (0, String::new());
    };
    let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_vhds_and_cds_on_demand_through_the_relay() {
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    tokio::spawn(adsrelay::demo::backend::serve(backend));

    let h = Harness::start().await;
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let (cp, mut requests, relay) = (h.cp.clone(), h.requests, h.relay);
    let log = seen.clone();
    tokio::spawn(async move {
        let mut nonce = 0;
        while let Some(r) = requests.next().await {
            if r.resource_names_subscribe.is_empty() {
                continue;
            }
            log.lock().unwrap().extend(
                r.resource_names_subscribe
                    .iter()
                    .map(|n| (r.type_url.clone(), n.clone())),
            );
            let mut resp = answer(&r, backend_addr);
            nonce += 1;
            resp.nonce = format!("n{nonce}");
            let tx = cp.current.lock().unwrap().clone();
            if let Some(tx) = tx {
                let _ = tx.send(Ok(resp)).await;
            }
        }
    });

    let listener_port = free_port();
    let mut envoy = Envoy::start_edited(
        "bootstrap-delta.yaml",
        relay.xds.port(),
        "od-envoy",
        "g",
        |_| BOOTSTRAP.replace("LISTENER_PORT", &listener_port.to_string()),
    );

    // The host is not in rc1's table: Envoy fetches its virtual host by alias, then the cluster
    // it routes to, and the request goes through. Well before Envoy's 15 s initial fetch timeout:
    // the scoped VHDS wildcard (A27) answers the initial namespace request with rc1's base set.
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(60);
    let text = loop {
        assert!(envoy.is_running(), "envoy exited:\n{}", envoy.log_tail());
        let (code, text) = get_host(listener_port, "od.test").await;
        if code == 200 {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no 200 for od.test (last {code}); upstream saw {:?}\n{}",
            seen.lock().unwrap(),
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        text.contains(adsrelay::demo::backend::GREETING.trim()),
        "{text}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}: initialization waited for a timeout",
        start.elapsed()
    );
    let dump = envoy.admin_get("/config_dump").await;
    assert!(
        dump.contains("rc1/vhost_base") && dump.contains("rc1/vhost_od"),
        "{dump}"
    );
    assert!(
        !dump.contains("rc9/vhost_other"),
        "A27: another route configuration's host"
    );
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.contains(&(VHDS.to_string(), "rc1/od.test".to_string())),
        "the virtual host was fetched by alias: {seen:?}"
    );
    assert!(
        seen.contains(&(CDS.to_string(), "od_cluster".to_string())),
        "the cluster was fetched on demand: {seen:?}"
    );
    drop(relay);
}

// ---------------------------------------------------------------------------------------------
// LEDS: endpoints as an xdstp glob collection (A28)
// ---------------------------------------------------------------------------------------------

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const LEDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.LbEndpoint";
const LEDS_GLOB: &str = "xdstp://test/envoy.config.endpoint.v3.LbEndpoint/leds_cluster/*";

const LEDS_BOOTSTRAP: &str = r#"
admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: 9901 }
dynamic_resources:
  ads_config:
    api_type: DELTA_GRPC
    transport_api_version: V3
    set_node_on_first_message_only: true
    grpc_services:
      - envoy_grpc: { cluster_name: adsrelay }
  cds_config: { ads: {}, resource_api_version: V3 }
static_resources:
  listeners:
    - name: leds_listener
      address:
        socket_address: { address: 127.0.0.1, port_value: LISTENER_PORT }
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: leds
                route_config:
                  validate_clusters: false
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: { prefix: "/" }
                          route: { cluster: leds_cluster }
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: adsrelay
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {}
      load_assignment:
        cluster_name: adsrelay
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: 18000 }
"#;

fn leds_answer(
    req: &DeltaDiscoveryRequest,
    backend: std::net::SocketAddr,
) -> wire::DeltaDiscoveryResponse {
    use envoy_types::pb::envoy::config::endpoint::v3::{
        locality_lb_endpoints, LedsClusterLocalityConfig,
    };
    let mut resp = wire::DeltaDiscoveryResponse {
        type_url: req.type_url.clone(),
        ..Default::default()
    };
    for name in &req.resource_names_subscribe {
        match (req.type_url.as_str(), name.as_str()) {
            (CDS, "*") | (CDS, "leds_cluster") => resp.resources.push(wrap(
                "leds_cluster",
                vec![],
                &Cluster {
                    name: "leds_cluster".into(),
                    connect_timeout: Some(PbDuration {
                        seconds: 1,
                        nanos: 0,
                    }),
                    cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
                        cluster::DiscoveryType::Eds as i32,
                    )),
                    eds_cluster_config: Some(cluster::EdsClusterConfig {
                        eds_config: Some(ads()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )),
            (EDS, "leds_cluster") => resp.resources.push(wrap(
                "leds_cluster",
                vec![],
                &ClusterLoadAssignment {
                    cluster_name: "leds_cluster".into(),
                    endpoints: vec![LocalityLbEndpoints {
                        lb_config: Some(
                            locality_lb_endpoints::LbConfig::LedsClusterLocalityConfig(
                                LedsClusterLocalityConfig {
                                    leds_config: Some(ads()),
                                    leds_collection_name: LEDS_GLOB.into(),
                                },
                            ),
                        ),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            )),
            // An xdstp-aware control plane expands the collection.
            (LEDS, LEDS_GLOB) => {
                let ep = LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(Address {
                            address: Some(address::Address::SocketAddress(SocketAddress {
                                address: backend.ip().to_string(),
                                port_specifier: Some(socket_address::PortSpecifier::PortValue(
                                    backend.port().into(),
                                )),
                                ..Default::default()
                            })),
                        }),
                        ..Default::default()
                    })),
                    ..Default::default()
                };
                resp.resources.push(wrap(
                    "xdstp://test/envoy.config.endpoint.v3.LbEndpoint/leds_cluster/ep1",
                    vec![],
                    &ep,
                ));
            }
            (_, n) => resp.removed_resources.push(n.into()),
        }
    }
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_leds_glob_collection_through_the_relay() {
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    tokio::spawn(adsrelay::demo::backend::serve(backend));

    let h = Harness::start().await;
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let (cp, mut requests, relay) = (h.cp.clone(), h.requests, h.relay);
    let log = seen.clone();
    tokio::spawn(async move {
        let mut nonce = 0;
        while let Some(r) = requests.next().await {
            if r.resource_names_subscribe.is_empty() {
                continue;
            }
            log.lock().unwrap().extend(
                r.resource_names_subscribe
                    .iter()
                    .map(|n| (r.type_url.clone(), n.clone())),
            );
            let mut resp = leds_answer(&r, backend_addr);
            nonce += 1;
            resp.nonce = format!("n{nonce}");
            let tx = cp.current.lock().unwrap().clone();
            if let Some(tx) = tx {
                let _ = tx.send(Ok(resp)).await;
            }
        }
    });

    let listener_port = free_port();
    let mut envoy = Envoy::start_edited(
        "bootstrap-delta.yaml",
        relay.xds.port(),
        "leds-envoy",
        "g",
        |_| LEDS_BOOTSTRAP.replace("LISTENER_PORT", &listener_port.to_string()),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(envoy.is_running(), "envoy exited:\n{}", envoy.log_tail());
        let (code, text) = get_host(listener_port, "any.test").await;
        if code == 200 {
            assert!(
                text.contains(adsrelay::demo::backend::GREETING.trim()),
                "{text}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no 200 through the LEDS cluster (last {code}); upstream saw {:?}\n{}",
            seen.lock().unwrap(),
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.contains(&(LEDS.to_string(), LEDS_GLOB.to_string())),
        "the relay subscribed the collection upstream: {seen:?}"
    );
    drop(relay);
}
