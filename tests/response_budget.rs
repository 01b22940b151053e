//! Large Delta states go out as several responses of bounded size (each applied and ACKed on its
//! own), so no stream's encode buffer grows to the size of the whole state.

use std::collections::HashSet;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use adsrelay::xds::delta::RESPONSE_BUDGET_BYTES;
use adsrelay::xds::{DeltaStream, Store};
use prost::Message;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

#[test]
fn initial_wildcard_state_is_split_into_bounded_responses() {
    let store = Store::complete((0..100).map(|i| {
        let r = Resource {
            name: format!("c{i}"),
            version: "1".into(),
            resource: Some(prost_types::Any {
                type_url: CDS.into(),
                value: vec![7; 1024],
            }),
            ..Default::default()
        };
        (
            CDS.to_string(),
            adsrelay::xds::CachedResource::decode(r.encode_to_vec().into()).unwrap(),
        )
    }));
    let mut s = DeltaStream::new();
    s.on_request(&DeltaDiscoveryRequest {
        type_url: CDS.into(),
        ..Default::default()
    })
    .unwrap();
    let mut names = HashSet::new();
    let mut nonces = HashSet::new();
    let mut responses = 0;
    while let Some(r) = s.next_response(&store) {
        let bytes = r.encoded_len();
        let r = DeltaDiscoveryResponse::decode(r.encode_to_vec().as_slice()).unwrap();
        assert!(
            bytes <= RESPONSE_BUDGET_BYTES + 2048,
            "response of {bytes} bytes"
        );
        assert!(nonces.insert(r.nonce.clone()));
        for res in r.resources {
            assert!(names.insert(res.name), "a resource sent twice");
        }
        responses += 1;
    }
    assert_eq!(names.len(), 100, "every cluster arrives");
    assert!(responses >= 3, "{responses} responses");
}
