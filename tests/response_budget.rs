//! A Delta state goes out in as few responses as the client's receive limit allows: one response
//! when it fits, several of bounded size (each applied and ACKed on its own) when it does not.

use std::collections::HashSet;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use adsrelay::xds::{DeltaStream, Store};
use prost::Message;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// 100 Clusters of 1 KiB each.
fn hundred_clusters() -> Store {
    Store::complete((0..100).map(|i| {
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
    }))
}

#[test]
fn initial_wildcard_state_is_split_at_the_clients_receive_limit() {
    const LIMIT: usize = 8 * 1024;
    let store = hundred_clusters();
    let mut s = DeltaStream::new().with_max_response_bytes(LIMIT);
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
            bytes <= LIMIT,
            "response of {bytes} bytes over the {LIMIT}-byte limit"
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

#[test]
fn initial_wildcard_state_that_fits_goes_in_one_response() {
    let store = hundred_clusters();
    let mut s = DeltaStream::new();
    s.on_request(&DeltaDiscoveryRequest {
        type_url: CDS.into(),
        ..Default::default()
    })
    .unwrap();
    let first = s.next_response(&store).expect("the join is answered");
    assert_eq!(
        first.resources.len(),
        100,
        "the whole state in one response"
    );
    assert!(s.next_response(&store).is_none(), "and nothing after it");
}
