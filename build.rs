//! Compiles proto/ with protox (no protoc binary) and generates:
//! - prost messages for the wire contract and tonic client/server for the real ADS service;
//! - a hand-declared "relay" ADS service whose responses are the shadow messages of
//!   proto/adsrelay/wire.proto, so encoded resources pass through the relay verbatim.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(
        [
            "envoy/service/discovery/v3/ads.proto",
            "adsrelay/wire.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .bytes(".adsrelay.wire")
        .compile_fds(fds)?;

    let method = |name: &str, route: &str, input: &str, output: &str| {
        tonic_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type(input)
            .output_type(output)
            .codec_path("tonic_prost::ProstCodec")
            .client_streaming()
            .server_streaming()
            .build()
    };
    let relay_ads = tonic_build::manual::Service::builder()
        .name("AggregatedDiscoveryService")
        .package("envoy.service.discovery.v3")
        .method(method(
            "delta_aggregated_resources",
            "DeltaAggregatedResources",
            "crate::pb::discovery::DeltaDiscoveryRequest",
            "crate::pb::wire::DeltaDiscoveryResponse",
        ))
        .build();
    tonic_build::manual::Builder::new()
        .out_dir(std::env::var("OUT_DIR")?)
        .compile(&[relay_ads]);
    Ok(())
}
