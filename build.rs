//! Compiles proto/ with protox (no protoc binary) and generates:
//! - prost messages for the wire contract and tonic client/server for the real ADS service;
//! - prost messages for the body of the warm-restart snapshot file (proto/adsrelay/snapshot.proto);
//! - a hand-declared "relay" ADS service whose responses are the shadow messages of
//!   proto/adsrelay/wire.proto, so encoded resources pass through the relay verbatim.

/// (package, service, state-of-the-world rpc, Delta rpc), as in envoy's api/envoy/service/.
const PER_TYPE: &[(&str, &str, Option<&str>, &str)] = &[
    (
        "envoy.service.cluster.v3",
        "ClusterDiscoveryService",
        Some("StreamClusters"),
        "DeltaClusters",
    ),
    (
        "envoy.service.listener.v3",
        "ListenerDiscoveryService",
        Some("StreamListeners"),
        "DeltaListeners",
    ),
    (
        "envoy.service.route.v3",
        "RouteDiscoveryService",
        Some("StreamRoutes"),
        "DeltaRoutes",
    ),
    (
        "envoy.service.route.v3",
        "ScopedRoutesDiscoveryService",
        Some("StreamScopedRoutes"),
        "DeltaScopedRoutes",
    ),
    (
        "envoy.service.route.v3",
        "VirtualHostDiscoveryService",
        None,
        "DeltaVirtualHosts",
    ),
    (
        "envoy.service.endpoint.v3",
        "EndpointDiscoveryService",
        Some("StreamEndpoints"),
        "DeltaEndpoints",
    ),
    (
        "envoy.service.secret.v3",
        "SecretDiscoveryService",
        Some("StreamSecrets"),
        "DeltaSecrets",
    ),
    (
        "envoy.service.runtime.v3",
        "RuntimeDiscoveryService",
        Some("StreamRuntime"),
        "DeltaRuntime",
    ),
    (
        "envoy.service.extension.v3",
        "ExtensionConfigDiscoveryService",
        Some("StreamExtensionConfigs"),
        "DeltaExtensionConfigs",
    ),
];

fn snake(rpc: &str) -> String {
    let mut out = String::new();
    for (i, c) in rpc.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The commit `adsrelay --version` reports: `ADSRELAY_GIT_COMMIT` if set (the Docker build passes
/// its REVISION build argument this way, having no .git), else `git rev-parse HEAD`, else
/// "unknown".
fn git_commit() -> String {
    println!("cargo:rerun-if-env-changed=ADSRELAY_GIT_COMMIT");
    if let Ok(c) = std::env::var("ADSRELAY_GIT_COMMIT") {
        if !c.trim().is_empty() {
            return c.trim().to_string();
        }
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let Some(commit) = git(&["rev-parse", "HEAD"]) else {
        return "unknown".into();
    };
    // Re-run when HEAD moves: a checkout rewrites HEAD, a commit rewrites the branch's ref (or
    // packed-refs). A watched path that does not exist would re-run the script on every build.
    let mut watch = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(git(&["rev-parse", "--git-path", &r]));
        watch.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    }
    for path in watch.into_iter().flatten() {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    commit
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rustc-env=ADSRELAY_GIT_COMMIT={}", git_commit());
    let fds = protox::compile(
        [
            "envoy/service/discovery/v3/ads.proto",
            "adsrelay/wire.proto",
            "adsrelay/snapshot.proto",
            "envoy/service/status/v3/csds.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .bytes(".adsrelay.wire")
        // Restored resources share the buffer the snapshot file was read into.
        .bytes(".adsrelay.snapshot")
        .btree_map(".adsrelay.snapshot.Locator.params")
        // A reconnecting client reports every version it holds; a B-tree decodes them without
        // hashing each name and hands them over in order.
        .btree_map(".envoy.service.discovery.v3.DeltaDiscoveryRequest.initial_resource_versions")
        .compile_fds(fds)?;

    let method = |name: &str, route: &str, input: &str, output: &str| {
        tonic_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type(input)
            .output_type(output)
            .codec_path("crate::codec::XdsCodec")
            .client_streaming()
            .server_streaming()
            .build()
    };
    let delta = |name: &str, route: &str| {
        method(
            name,
            route,
            "crate::pb::discovery::DeltaDiscoveryRequest",
            "crate::pb::wire::DeltaDiscoveryResponse",
        )
    };
    let sotw = |name: &str, route: &str| {
        method(
            name,
            route,
            "crate::pb::discovery::DiscoveryRequest",
            "crate::pb::wire::DiscoveryResponse",
        )
    };
    let mut services = vec![tonic_build::manual::Service::builder()
        .name("AggregatedDiscoveryService")
        .package("envoy.service.discovery.v3")
        .method(sotw(
            "stream_aggregated_resources",
            "StreamAggregatedResources",
        ))
        .method(delta(
            "delta_aggregated_resources",
            "DeltaAggregatedResources",
        ))
        .build()];
    // The per-type services Envoy can use instead of ADS: (package, service, SotW rpc, Delta rpc).
    for (package, service, stream_rpc, delta_rpc) in PER_TYPE {
        let mut b = tonic_build::manual::Service::builder()
            .name(service)
            .package(package);
        if let Some(rpc) = stream_rpc {
            b = b.method(sotw(&snake(rpc), rpc));
        }
        b = b.method(delta(&snake(delta_rpc), delta_rpc));
        services.push(b.build());
    }
    tonic_build::manual::Builder::new()
        .out_dir(std::env::var("OUT_DIR")?)
        .compile(&services);
    Ok(())
}
