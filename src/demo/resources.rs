//! The demo control plane's resource file: a small TOML description of an Envoy config (listeners,
//! routes, clusters) turned into real Envoy v3 resources, ready for [`crate::xds::Store::complete`].
//!
//! Every resource refers to the others over ADS: listeners fetch their route table via RDS, clusters
//! are EDS clusters whose `ClusterLoadAssignment` (named after the cluster) is built from the
//! cluster's `endpoints`. Versions are content-derived, so they are stable across restarts and change
//! exactly when a resource's content changes.
//!
//! A listener with `api_listener = true` is for gRPC's xDS client (gRFC A27) instead of Envoy: its
//! name is the `xds:///` target (e.g. `"greeter.example:50051"`), it has no address, and its
//! `HttpConnectionManager` sits in `api_listener` rather than in a filter chain. The rest of the
//! chain already suits gRPC: RDS and EDS over ADS, `ROUND_ROBIN` clusters, and localities with a
//! non-zero weight (gRPC ignores a locality without one). gRPC picks the virtual host whose
//! `domains` match the target (`"greeter.example:50051"`, or `"*"`).

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use bytes::Bytes;
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, header_value_option::HeaderAppendAction, socket_address, Address,
    AggregatedConfigSource, ApiVersion, ConfigSource, HeaderValue, HeaderValueOption, Locality,
    SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, ApiListener, Filter, FilterChain, Listener,
};
use envoy_types::pb::envoy::config::route::v3::{
    route, route_action, route_match, Route, RouteAction, RouteConfiguration, RouteMatch,
    VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value};
use prost::{Message, Name};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::xds::CachedResource;

/// The example resource file shipped in deploy/demo/resources.toml.
pub const EXAMPLE: &str = include_str!("../../deploy/demo/resources.toml");

const HCM_FILTER: &str = "envoy.filters.network.http_connection_manager";
const ROUTER_FILTER: &str = "envoy.filters.http.router";
/// The name of the single virtual host of every route table.
const VIRTUAL_HOST: &str = "demo";

/// Why a resource file cannot be used. Every message starts with the file it came from.
#[derive(Debug, thiserror::Error)]
pub enum DemoConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// Not TOML, or not the schema (unknown field, wrong type, missing field). toml's message
    /// carries the line and column.
    #[error("{origin}: {source}")]
    Parse {
        origin: String,
        source: toml::de::Error,
    },
    /// Well-formed, but not a usable config. `field` is a path such as `routes[0].cluster`.
    #[error("{origin}: {field}: {message}")]
    Invalid {
        origin: String,
        field: String,
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResourceFile {
    #[serde(default)]
    listeners: Vec<ListenerSpec>,
    #[serde(default)]
    routes: Vec<RouteSpec>,
    #[serde(default)]
    clusters: Vec<ClusterSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerSpec {
    name: String,
    /// A gRPC client listener (Listener.api_listener): no address or port, which must be absent.
    #[serde(default)]
    api_listener: bool,
    /// IP to bind; [`DEFAULT_ADDRESS`] when absent. Only for socket listeners.
    address: Option<String>,
    /// Required for socket listeners, absent for API listeners.
    port: Option<u16>,
    route_config: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteSpec {
    name: String,
    #[serde(default = "default_domains")]
    domains: Vec<String>,
    #[serde(default = "default_prefix")]
    prefix: String,
    cluster: String,
    /// Sorted, so the encoded route (and so its version) does not depend on map order.
    #[serde(default)]
    response_headers: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterSpec {
    name: String,
    #[serde(default = "default_connect_timeout_ms")]
    connect_timeout_ms: u64,
    endpoints: Vec<String>,
}

const DEFAULT_ADDRESS: &str = "127.0.0.1";

fn default_domains() -> Vec<String> {
    vec!["*".into()]
}

fn default_prefix() -> String {
    "/".into()
}

fn default_connect_timeout_ms() -> u64 {
    1000
}

/// Reads and builds a resource file; see [`parse`].
pub fn load(path: &Path) -> Result<Vec<(String, CachedResource)>, DemoConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DemoConfigError::Read {
        path: origin.clone(),
        source,
    })?;
    parse(&text, &origin)
}

/// Builds the resources a resource file describes, as `(type_url, resource)` pairs: listeners,
/// route configurations, clusters, then one cluster load assignment per cluster, each in file
/// order. `origin` names the file in error messages.
pub fn parse(text: &str, origin: &str) -> Result<Vec<(String, CachedResource)>, DemoConfigError> {
    let file: ResourceFile = toml::from_str(text).map_err(|source| DemoConfigError::Parse {
        origin: origin.to_string(),
        source,
    })?;
    let invalid = |field: String, message: String| DemoConfigError::Invalid {
        origin: origin.to_string(),
        field,
        message,
    };
    let endpoints = validate(&file).map_err(|(field, message)| invalid(field, message))?;

    let mut out = Vec::new();
    for l in &file.listeners {
        out.push(resource(&l.name, &listener(l)));
    }
    for r in &file.routes {
        out.push(resource(&r.name, &route_configuration(r)));
    }
    for c in &file.clusters {
        out.push(resource(&c.name, &eds_cluster(c)));
    }
    for (c, addrs) in file.clusters.iter().zip(&endpoints) {
        out.push(resource(&c.name, &load_assignment(&c.name, addrs)));
    }
    Ok(out)
}

/// Checks references and values; returns each cluster's parsed endpoints, or `(field, message)`.
fn validate(file: &ResourceFile) -> Result<Vec<Vec<SocketAddr>>, (String, String)> {
    fn unique<'a>(
        kind: &str,
        section: &str,
        names: impl Iterator<Item = &'a str>,
    ) -> Result<HashSet<&'a str>, (String, String)> {
        let mut seen = HashSet::new();
        for (i, name) in names.enumerate() {
            let field = format!("{section}[{i}].name");
            if name.is_empty() {
                return Err((field, "must not be empty".into()));
            }
            if !seen.insert(name) {
                return Err((field, format!("duplicate {kind} name {name:?}")));
            }
        }
        Ok(seen)
    }
    unique(
        "listener",
        "listeners",
        file.listeners.iter().map(|l| l.name.as_str()),
    )?;
    let routes = unique(
        "route",
        "routes",
        file.routes.iter().map(|r| r.name.as_str()),
    )?;
    let clusters = unique(
        "cluster",
        "clusters",
        file.clusters.iter().map(|c| c.name.as_str()),
    )?;

    for (i, l) in file.listeners.iter().enumerate() {
        if l.api_listener {
            let unused = [("address", l.address.is_some()), ("port", l.port.is_some())];
            if let Some((field, _)) = unused.iter().find(|(_, set)| *set) {
                return Err((
                    format!("listeners[{i}].{field}"),
                    "must not be set when api_listener = true (a gRPC client listener binds \
                     nothing)"
                        .into(),
                ));
            }
        } else {
            if let Some(a) = &l.address {
                if a.parse::<IpAddr>().is_err() {
                    return Err((
                        format!("listeners[{i}].address"),
                        format!("{a:?} is not an IP address"),
                    ));
                }
            }
            match l.port {
                None => {
                    return Err((
                        format!("listeners[{i}].port"),
                        "required (unless api_listener = true)".into(),
                    ))
                }
                Some(0) => return Err((format!("listeners[{i}].port"), "must not be 0".into())),
                Some(_) => {}
            }
        }
        if !routes.contains(l.route_config.as_str()) {
            return Err((
                format!("listeners[{i}].route_config"),
                format!("unknown route {:?}", l.route_config),
            ));
        }
    }
    for (i, r) in file.routes.iter().enumerate() {
        if r.domains.is_empty() {
            return Err((format!("routes[{i}].domains"), "must not be empty".into()));
        }
        if let Some(d) = r.domains.iter().position(String::is_empty) {
            return Err((
                format!("routes[{i}].domains[{d}]"),
                "must not be empty".into(),
            ));
        }
        if !clusters.contains(r.cluster.as_str()) {
            return Err((
                format!("routes[{i}].cluster"),
                format!("unknown cluster {:?}", r.cluster),
            ));
        }
        if r.response_headers.keys().any(String::is_empty) {
            return Err((
                format!("routes[{i}].response_headers"),
                "header names must not be empty".into(),
            ));
        }
    }
    let mut endpoints = Vec::with_capacity(file.clusters.len());
    for (i, c) in file.clusters.iter().enumerate() {
        if c.connect_timeout_ms == 0 {
            return Err((
                format!("clusters[{i}].connect_timeout_ms"),
                "must not be 0".into(),
            ));
        }
        let mut addrs = Vec::with_capacity(c.endpoints.len());
        for (j, e) in c.endpoints.iter().enumerate() {
            let field = format!("clusters[{i}].endpoints[{j}]");
            let addr: SocketAddr = e.parse().map_err(|_| {
                (
                    field.clone(),
                    format!("{e:?} is not an IP:port address (e.g. \"127.0.0.1:8080\")"),
                )
            })?;
            if addr.port() == 0 {
                return Err((field, format!("{e:?}: port must not be 0")));
            }
            addrs.push(addr);
        }
        endpoints.push(addrs);
    }
    Ok(endpoints)
}

/// Wraps an Envoy message as a cached `Resource`, versioned by a hash of its encoding.
fn resource<M: Message + Name>(name: &str, msg: &M) -> (String, CachedResource) {
    let type_url = M::type_url();
    let value = msg.encode_to_vec();
    let encoded = crate::pb::discovery::Resource {
        name: name.to_string(),
        version: content_version(&value),
        resource: Some(prost_types::Any {
            type_url: type_url.clone(),
            value,
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let cached = CachedResource::decode(Bytes::from(encoded))
        .expect("a resource with a validated non-empty name always decodes");
    (type_url, cached)
}

/// First 16 hex digits of the SHA-256 of the encoded message.
fn content_version(encoded: &[u8]) -> String {
    Sha256::digest(encoded)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn any<M: Message + Name>(msg: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: msg.encode_to_vec(),
    }
}

/// `ConfigSource` pointing at the ADS stream, v3 API.
fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        ..Default::default()
    }
}

fn socket_address(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

fn listener(l: &ListenerSpec) -> Listener {
    let hcm = HttpConnectionManager {
        stat_prefix: l.name.clone(),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: l.route_config.clone(),
        })),
        http_filters: vec![HttpFilter {
            name: ROUTER_FILTER.into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(
                any(&Router::default()),
            )),
            ..Default::default()
        }],
        ..Default::default()
    };
    if l.api_listener {
        return Listener {
            name: l.name.clone(),
            api_listener: Some(ApiListener {
                api_listener: Some(any(&hcm)),
            }),
            ..Default::default()
        };
    }
    let ip = l.address.as_deref().unwrap_or(DEFAULT_ADDRESS);
    Listener {
        name: l.name.clone(),
        address: Some(socket_address(ip, l.port.unwrap_or_default())),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: HCM_FILTER.into(),
                config_type: Some(filter::ConfigType::TypedConfig(any(&hcm))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn route_configuration(r: &RouteSpec) -> RouteConfiguration {
    let response_headers_to_add = r
        .response_headers
        .iter()
        .map(|(key, value)| HeaderValueOption {
            header: Some(HeaderValue {
                key: key.clone(),
                value: value.clone(),
                ..Default::default()
            }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        })
        .collect();
    RouteConfiguration {
        name: r.name.clone(),
        virtual_hosts: vec![VirtualHost {
            name: VIRTUAL_HOST.into(),
            domains: r.domains.clone(),
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix(r.prefix.clone())),
                    ..Default::default()
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                        r.cluster.clone(),
                    )),
                    ..Default::default()
                })),
                response_headers_to_add,
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn eds_cluster(c: &ClusterSpec) -> Cluster {
    let ms = c.connect_timeout_ms;
    Cluster {
        name: c.name.clone(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        // What gRPC requires (A27); also Envoy's default.
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            ..Default::default()
        }),
        connect_timeout: Some(Duration {
            seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
            nanos: ((ms % 1000) * 1_000_000) as i32,
        }),
        ..Default::default()
    }
}

fn load_assignment(cluster_name: &str, addrs: &[SocketAddr]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster_name.to_string(),
        endpoints: vec![LocalityLbEndpoints {
            // gRPC skips a locality without a weight (A27); Envoy ignores it unless locality
            // weighted load balancing is configured.
            locality: Some(Locality::default()),
            load_balancing_weight: Some(UInt32Value { value: 1 }),
            lb_endpoints: addrs
                .iter()
                .map(|a| LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket_address(&a.ip().to_string(), a.port())),
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::Resource;

    const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const CLA: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    fn example() -> Vec<(String, CachedResource)> {
        parse(EXAMPLE, "resources.toml").unwrap()
    }

    /// Decodes the `Resource` envelope and its body, checking the envelope against the cache header.
    fn body<M: Message + Name + Default>(r: &CachedResource) -> M {
        let res = Resource::decode(r.encoded.clone()).unwrap();
        assert_eq!(res.name, &*r.name);
        assert_eq!(res.version, r.version);
        let any = res.resource.unwrap();
        assert_eq!(any.type_url, M::type_url());
        M::decode(&any.value[..]).unwrap()
    }

    fn find<'a>(rs: &'a [(String, CachedResource)], type_url: &str) -> &'a CachedResource {
        &rs.iter().find(|(t, _)| t == type_url).unwrap().1
    }

    fn assert_ads(cs: &Option<ConfigSource>) {
        let cs = cs.as_ref().unwrap();
        assert_eq!(cs.resource_api_version, ApiVersion::V3 as i32);
        assert_eq!(
            cs.config_source_specifier,
            Some(config_source::ConfigSourceSpecifier::Ads(
                AggregatedConfigSource {}
            ))
        );
    }

    fn ip_port(a: &Option<Address>) -> (String, u32) {
        match &a.as_ref().unwrap().address {
            Some(address::Address::SocketAddress(sa)) => match sa.port_specifier {
                Some(socket_address::PortSpecifier::PortValue(p)) => (sa.address.clone(), p),
                ref other => panic!("unexpected port {other:?}"),
            },
            other => panic!("unexpected address {other:?}"),
        }
    }

    #[test]
    fn example_builds_four_resources() {
        let rs = example();
        let got: Vec<(&str, &str)> = rs.iter().map(|(t, r)| (t.as_str(), &*r.name)).collect();
        assert_eq!(
            got,
            vec![
                (LISTENER, "listener_0"),
                (ROUTE, "local_route"),
                (CLUSTER, "demo_backend"),
                (CLA, "demo_backend"),
            ]
        );
        for (t, r) in &rs {
            assert_eq!(&r.body_type_url, t);
            assert!(!r.do_not_cache);
            assert_eq!(r.version.len(), 16);
            assert!(r.version.chars().all(|c| c.is_ascii_hexdigit()));
        }
        assert_eq!(LISTENER, Listener::type_url());
        assert_eq!(ROUTE, RouteConfiguration::type_url());
        assert_eq!(CLUSTER, Cluster::type_url());
        assert_eq!(CLA, ClusterLoadAssignment::type_url());
    }

    #[test]
    fn listener_uses_rds_over_ads_and_the_router() {
        let l: Listener = body(find(&example(), LISTENER));
        assert_eq!(l.name, "listener_0");
        assert_eq!(ip_port(&l.address), ("127.0.0.1".into(), 10000));
        assert_eq!(l.filter_chains.len(), 1);
        let filters = &l.filter_chains[0].filters;
        assert_eq!(filters.len(), 1);
        assert_eq!(filters[0].name, HCM_FILTER);
        let Some(filter::ConfigType::TypedConfig(any)) = &filters[0].config_type else {
            panic!("no typed_config");
        };
        assert_eq!(any.type_url, HttpConnectionManager::type_url());
        let hcm = HttpConnectionManager::decode(&any.value[..]).unwrap();
        assert_eq!(hcm.stat_prefix, "listener_0");
        assert_eq!(
            hcm.codec_type,
            http_connection_manager::CodecType::Auto as i32
        );
        let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = &hcm.route_specifier else {
            panic!("not RDS");
        };
        assert_eq!(rds.route_config_name, "local_route");
        assert_ads(&rds.config_source);
        assert_eq!(hcm.http_filters.len(), 1);
        assert_eq!(hcm.http_filters[0].name, ROUTER_FILTER);
        let Some(http_filter::ConfigType::TypedConfig(router)) = &hcm.http_filters[0].config_type
        else {
            panic!("router has no typed_config");
        };
        assert_eq!(router.type_url, Router::type_url());
    }

    /// What gRPC's xDS client needs (gRFC A27): an API listener named after the target.
    const GRPC: &str = r#"
        [[listeners]]
        name = "greeter.example:50051"
        api_listener = true
        route_config = "greeter_route"

        [[routes]]
        name = "greeter_route"
        domains = ["greeter.example:50051"]
        cluster = "greeter"

        [[clusters]]
        name = "greeter"
        endpoints = ["127.0.0.1:50051"]
    "#;

    /// The `HttpConnectionManager` inside an API listener.
    fn api_hcm(l: &Listener) -> HttpConnectionManager {
        let any = l
            .api_listener
            .as_ref()
            .and_then(|a| a.api_listener.as_ref())
            .expect("api_listener.api_listener is set");
        assert_eq!(any.type_url, HttpConnectionManager::type_url());
        assert_eq!(
            any.type_url,
            "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.\
             HttpConnectionManager"
        );
        HttpConnectionManager::decode(&any.value[..]).unwrap()
    }

    #[test]
    fn api_listener_is_what_grpc_clients_need() {
        let rs = parse(GRPC, "grpc.toml").unwrap();
        let got: Vec<(&str, &str)> = rs.iter().map(|(t, r)| (t.as_str(), &*r.name)).collect();
        assert_eq!(
            got,
            vec![
                (LISTENER, "greeter.example:50051"),
                (ROUTE, "greeter_route"),
                (CLUSTER, "greeter"),
                (CLA, "greeter"),
            ]
        );

        let l: Listener = body(find(&rs, LISTENER));
        assert_eq!(l.name, "greeter.example:50051");
        assert_eq!(l.address, None, "an API listener binds nothing");
        assert!(l.filter_chains.is_empty());
        let hcm = api_hcm(&l);
        let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = &hcm.route_specifier else {
            panic!("not RDS");
        };
        assert_eq!(rds.route_config_name, "greeter_route");
        assert_ads(&rds.config_source);
        // gRPC (A39) requires the router as the last HTTP filter, with a typed_config.
        let last = hcm.http_filters.last().expect("http filters");
        assert_eq!(last.name, ROUTER_FILTER);
        let Some(http_filter::ConfigType::TypedConfig(router)) = &last.config_type else {
            panic!("router has no typed_config");
        };
        assert_eq!(router.type_url, Router::type_url());

        let rc: RouteConfiguration = body(find(&rs, ROUTE));
        assert_eq!(rc.virtual_hosts[0].domains, vec!["greeter.example:50051"]);
        let Some(route::Action::Route(action)) = &rc.virtual_hosts[0].routes[0].action else {
            panic!("not a route action");
        };
        assert_eq!(
            action.cluster_specifier,
            Some(route_action::ClusterSpecifier::Cluster("greeter".into()))
        );

        let c: Cluster = body(find(&rs, CLUSTER));
        assert_eq!(c.lb_policy, cluster::LbPolicy::RoundRobin as i32);
        assert_eq!(
            c.cluster_discovery_type,
            Some(cluster::ClusterDiscoveryType::Type(
                cluster::DiscoveryType::Eds as i32
            ))
        );
        assert_ads(&c.eds_cluster_config.as_ref().unwrap().eds_config);

        let cla: ClusterLoadAssignment = body(find(&rs, CLA));
        assert_eq!(cla.cluster_name, "greeter");
        let locality = &cla.endpoints[0];
        assert_eq!(
            locality.load_balancing_weight,
            Some(UInt32Value { value: 1 })
        );
        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) =
            &locality.lb_endpoints[0].host_identifier
        else {
            panic!("no endpoint");
        };
        assert_eq!(ip_port(&e.address), ("127.0.0.1".into(), 50051));
    }

    #[test]
    fn api_and_socket_listeners_mix_and_share_a_route() {
        let text = format!(
            "{EXAMPLE}\n[[listeners]]\nname = \"demo.grpc:443\"\napi_listener = true\n\
             route_config = \"local_route\"\n"
        );
        let rs = parse(&text, "mixed.toml").unwrap();
        let listeners: Vec<Listener> = rs
            .iter()
            .filter(|(t, _)| t == LISTENER)
            .map(|(_, r)| body(r))
            .collect();
        assert_eq!(listeners.len(), 2);
        assert_eq!(listeners[0].name, "listener_0");
        assert_eq!(ip_port(&listeners[0].address), ("127.0.0.1".into(), 10000));
        assert_eq!(listeners[0].api_listener, None);
        assert_eq!(listeners[1].name, "demo.grpc:443");
        assert_eq!(listeners[1].address, None);
        let Some(http_connection_manager::RouteSpecifier::Rds(rds)) =
            api_hcm(&listeners[1]).route_specifier
        else {
            panic!("not RDS");
        };
        assert_eq!(rds.route_config_name, "local_route");
        // Adding a listener leaves every other resource as it was.
        let others = |rs: &[(String, CachedResource)]| -> Vec<(String, CachedResource)> {
            rs.iter().filter(|(t, _)| t != LISTENER).cloned().collect()
        };
        assert_eq!(others(&rs), others(&example()));
        // `api_listener = false` is the default.
        let explicit = edit("port = 10000", "port = 10000\napi_listener = false");
        assert_eq!(parse(&explicit, "x.toml").unwrap(), example());
    }

    #[test]
    fn route_sends_prefix_to_cluster_and_adds_header() {
        let rc: RouteConfiguration = body(find(&example(), ROUTE));
        assert_eq!(rc.name, "local_route");
        assert_eq!(rc.virtual_hosts.len(), 1);
        let vh = &rc.virtual_hosts[0];
        assert_eq!(vh.name, VIRTUAL_HOST);
        assert_eq!(vh.domains, vec!["*".to_string()]);
        assert_eq!(vh.routes.len(), 1);
        let route = &vh.routes[0];
        assert_eq!(
            route.r#match.as_ref().unwrap().path_specifier,
            Some(route_match::PathSpecifier::Prefix("/".into()))
        );
        let Some(route::Action::Route(action)) = &route.action else {
            panic!("not a route action");
        };
        assert_eq!(
            action.cluster_specifier,
            Some(route_action::ClusterSpecifier::Cluster(
                "demo_backend".into()
            ))
        );
        assert_eq!(route.response_headers_to_add.len(), 1);
        let h = &route.response_headers_to_add[0];
        let hv = h.header.as_ref().unwrap();
        assert_eq!(
            (hv.key.as_str(), hv.value.as_str()),
            ("x-demo-version", "v1")
        );
        assert_eq!(
            h.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
    }

    #[test]
    fn cluster_is_eds_over_ads_with_its_endpoints() {
        let rs = example();
        let c: Cluster = body(find(&rs, CLUSTER));
        assert_eq!(c.name, "demo_backend");
        assert_eq!(
            c.cluster_discovery_type,
            Some(cluster::ClusterDiscoveryType::Type(
                cluster::DiscoveryType::Eds as i32
            ))
        );
        let eds = c.eds_cluster_config.as_ref().unwrap();
        assert_ads(&eds.eds_config);
        assert_eq!(eds.service_name, "");
        assert_eq!(
            c.connect_timeout,
            Some(Duration {
                seconds: 1,
                nanos: 0
            })
        );

        assert_eq!(c.lb_policy, cluster::LbPolicy::RoundRobin as i32);

        let cla: ClusterLoadAssignment = body(find(&rs, CLA));
        assert_eq!(cla.cluster_name, "demo_backend");
        assert_eq!(cla.endpoints.len(), 1);
        assert_eq!(
            cla.endpoints[0].load_balancing_weight,
            Some(UInt32Value { value: 1 }),
            "gRPC ignores localities without a weight"
        );
        assert_eq!(cla.endpoints[0].locality, Some(Locality::default()));
        let lbs = &cla.endpoints[0].lb_endpoints;
        assert_eq!(lbs.len(), 1);
        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &lbs[0].host_identifier else {
            panic!("no endpoint");
        };
        assert_eq!(ip_port(&e.address), ("127.0.0.1".into(), 18080));
    }

    #[test]
    fn defaults_and_multiple_endpoints() {
        let text = r#"
            [[listeners]]
            name = "l"
            port = 8000
            route_config = "r"
            [[routes]]
            name = "r"
            cluster = "c"
            [[clusters]]
            name = "c"
            connect_timeout_ms = 2500
            endpoints = ["10.0.0.1:80", "[::1]:8080"]
        "#;
        let rs = parse(text, "t.toml").unwrap();
        let l: Listener = body(find(&rs, LISTENER));
        assert_eq!(ip_port(&l.address), ("127.0.0.1".into(), 8000));
        let rc: RouteConfiguration = body(find(&rs, ROUTE));
        let vh = &rc.virtual_hosts[0];
        assert_eq!(vh.domains, vec!["*".to_string()]);
        assert_eq!(
            vh.routes[0].r#match.as_ref().unwrap().path_specifier,
            Some(route_match::PathSpecifier::Prefix("/".into()))
        );
        assert!(vh.routes[0].response_headers_to_add.is_empty());
        let c: Cluster = body(find(&rs, CLUSTER));
        assert_eq!(
            c.connect_timeout,
            Some(Duration {
                seconds: 2,
                nanos: 500_000_000
            })
        );
        let cla: ClusterLoadAssignment = body(find(&rs, CLA));
        let addrs: Vec<(String, u32)> = cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|lb| match &lb.host_identifier {
                Some(lb_endpoint::HostIdentifier::Endpoint(e)) => ip_port(&e.address),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(addrs, vec![("10.0.0.1".into(), 80), ("::1".into(), 8080)]);
        // An empty file is a valid (empty) config.
        assert!(parse("", "t.toml").unwrap().is_empty());
    }

    #[test]
    fn versions_change_iff_content_changes() {
        let a = example();
        let b = example();
        assert_eq!(a, b, "same text, same resources and versions");

        let edited = EXAMPLE.replace("\"x-demo-version\" = \"v1\"", "\"x-demo-version\" = \"v2\"");
        assert_ne!(edited, EXAMPLE);
        let c = parse(&edited, "resources.toml").unwrap();
        for ((ta, ra), (tc, rc)) in a.iter().zip(&c) {
            assert_eq!(ta, tc);
            if ta == ROUTE {
                assert_ne!(ra.version, rc.version, "edited route gets a new version");
                assert_ne!(ra.encoded, rc.encoded);
            } else {
                assert_eq!(ra, rc, "{ta} is unchanged");
            }
        }

        // Comments and formatting do not matter, only content.
        let reformatted: String = EXAMPLE
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(parse(&reformatted, "x.toml").unwrap(), a);
    }

    fn err(text: &str) -> String {
        parse(text, "adsrelay-demo.toml").unwrap_err().to_string()
    }

    /// The example with one substring replaced.
    fn edit(from: &str, to: &str) -> String {
        assert!(EXAMPLE.contains(from), "{from:?} not in EXAMPLE");
        EXAMPLE.replacen(from, to, 1)
    }

    #[test]
    fn validation_errors_name_file_and_field() {
        let cases = [
            (
                edit("cluster = \"demo_backend\"", "cluster = \"x\""),
                "adsrelay-demo.toml: routes[0].cluster: unknown cluster \"x\"",
            ),
            (
                edit("route_config = \"local_route\"", "route_config = \"nope\""),
                "adsrelay-demo.toml: listeners[0].route_config: unknown route \"nope\"",
            ),
            (
                edit("port = 10000", "port = 0"),
                "adsrelay-demo.toml: listeners[0].port: must not be 0",
            ),
            (
                edit("address = \"127.0.0.1\"", "address = \"localhost\""),
                "adsrelay-demo.toml: listeners[0].address: \"localhost\" is not an IP address",
            ),
            (
                edit("\"127.0.0.1:18080\"", "\"127.0.0.1:18080\", \"127.0.0.1\""),
                "adsrelay-demo.toml: clusters[0].endpoints[1]: \"127.0.0.1\" is not an IP:port",
            ),
            (
                edit("\"127.0.0.1:18080\"", "\"127.0.0.1:0\""),
                "adsrelay-demo.toml: clusters[0].endpoints[0]: \"127.0.0.1:0\": port must not be 0",
            ),
            (
                edit("connect_timeout_ms = 1000", "connect_timeout_ms = 0"),
                "adsrelay-demo.toml: clusters[0].connect_timeout_ms: must not be 0",
            ),
            (
                edit("domains = [\"*\"]", "domains = []"),
                "adsrelay-demo.toml: routes[0].domains: must not be empty",
            ),
            (
                edit("name = \"listener_0\"", "name = \"\""),
                "adsrelay-demo.toml: listeners[0].name: must not be empty",
            ),
            (
                edit("port = 10000", ""),
                "adsrelay-demo.toml: listeners[0].port: required (unless api_listener = true)",
            ),
            (
                edit("port = 10000", "port = 10000\napi_listener = true"),
                "adsrelay-demo.toml: listeners[0].address: must not be set when api_listener = true",
            ),
            (
                GRPC.replace("api_listener = true", "api_listener = true\nport = 50051"),
                "adsrelay-demo.toml: listeners[0].port: must not be set when api_listener = true",
            ),
            (
                GRPC.replace("route_config = \"greeter_route\"", "route_config = \"nope\""),
                "adsrelay-demo.toml: listeners[0].route_config: unknown route \"nope\"",
            ),
            (
                format!("{EXAMPLE}\n[[clusters]]\nname = \"demo_backend\"\nendpoints = []\n"),
                "adsrelay-demo.toml: clusters[1].name: duplicate cluster name \"demo_backend\"",
            ),
            (
                format!(
                    "{EXAMPLE}\n[[routes]]\nname = \"local_route\"\ncluster = \"demo_backend\"\n"
                ),
                "adsrelay-demo.toml: routes[1].name: duplicate route name \"local_route\"",
            ),
            (
                format!(
                    "{EXAMPLE}\n[[listeners]]\nname = \"listener_0\"\nport = 1\nroute_config = \"local_route\"\n"
                ),
                "adsrelay-demo.toml: listeners[1].name: duplicate listener name \"listener_0\"",
            ),
        ];
        for (text, want) in cases {
            let got = err(&text);
            assert!(got.starts_with(want), "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn parse_errors_carry_toml_position() {
        let cases = [
            // Unknown field.
            (edit("port = 10000", "port = 10000\nprot = 1"), "prot"),
            // Wrong type / out of range.
            (edit("port = 10000", "port = 70000"), "port"),
            // Missing required field.
            (edit("cluster = \"demo_backend\"", ""), "cluster"),
            // Not TOML.
            ("[[listeners]\n".to_string(), ""),
        ];
        for (text, mention) in cases {
            let e = parse(&text, "adsrelay-demo.toml").unwrap_err();
            assert!(matches!(e, DemoConfigError::Parse { .. }), "{e:?}");
            let msg = e.to_string();
            assert!(msg.starts_with("adsrelay-demo.toml: "), "{msg}");
            assert!(msg.contains("line"), "no position in {msg}");
            assert!(msg.contains(mention), "{mention:?} not in {msg}");
        }
    }

    #[test]
    fn load_reads_the_file_and_names_it_on_error() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let rs = load(&dir.join("deploy/demo/resources.toml")).unwrap();
        assert_eq!(rs, example());

        let missing = dir.join("deploy/demo/does-not-exist.toml");
        let e = load(&missing).unwrap_err();
        assert!(matches!(e, DemoConfigError::Read { .. }));
        assert!(e.to_string().starts_with(&missing.display().to_string()));
    }
}
