//! Property-based fuzzing of the protocol core (cargo-fuzz needs a nightly toolchain, which this
//! project does not use): arbitrary bytes as requests, and arbitrary interleavings of requests and
//! upstream updates, never panic and never produce a response a client would reject (a name twice,
//! or both added and removed).

use std::collections::HashSet;

use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, Resource,
};
use adsrelay::xds::{DeltaStream, GroupState, SotwStream, UpstreamUpdate};
use proptest::prelude::*;
use prost::Message;

const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const NAMES: [&str; 5] = ["a", "b", "c", "*", "d"];

#[derive(Debug, Clone)]
enum Op {
    Subscribe(Vec<usize>),
    Unsubscribe(Vec<usize>),
    Ack,
    Nack,
    Upstream {
        add: Vec<(usize, u8)>,
        remove: Vec<usize>,
    },
    Sotw(Vec<usize>),
}

fn op() -> impl Strategy<Value = Op> {
    let idx = || proptest::collection::vec(0usize..NAMES.len(), 0..4);
    prop_oneof![
        idx().prop_map(Op::Subscribe),
        idx().prop_map(Op::Unsubscribe),
        Just(Op::Ack),
        Just(Op::Nack),
        (
            proptest::collection::vec((0usize..NAMES.len(), 0u8..3), 0..4),
            idx()
        )
            .prop_map(|(add, remove)| Op::Upstream { add, remove }),
        idx().prop_map(Op::Sotw),
    ]
}

fn names(ix: &[usize]) -> Vec<String> {
    ix.iter().map(|i| NAMES[*i].to_string()).collect()
}

fn check_delta(resp: &DeltaDiscoveryResponse) -> Result<(), TestCaseError> {
    let mut seen = HashSet::new();
    for r in &resp.resources {
        prop_assert!(seen.insert(r.name.clone()), "duplicate {}", r.name);
    }
    for n in &resp.removed_resources {
        prop_assert!(!seen.contains(n), "{n} both added and removed");
    }
    prop_assert!(!resp.nonce.is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(req) = DeltaDiscoveryRequest::decode(bytes.as_slice()) {
            let _ = DeltaStream::new().on_request(&req);
        }
        if let Ok(req) = DiscoveryRequest::decode(bytes.as_slice()) {
            let _ = SotwStream::new(false).on_request(&req);
        }
        let _ = adsrelay::xds::CachedResource::decode(bytes.into());
    }

    #[test]
    fn arbitrary_interleavings_keep_responses_valid(ops in proptest::collection::vec(op(), 1..40)) {
        let now = std::time::Instant::now();
        let mut group = GroupState::new(std::time::Duration::ZERO);
        let mut delta = DeltaStream::new();
        let mut sotw = SotwStream::new(false);
        let mut last_nonce = String::new();
        for op in ops {
            match op {
                Op::Subscribe(ix) | Op::Unsubscribe(ix) if ix.is_empty() => {}
                Op::Subscribe(ix) => {
                    let req = DeltaDiscoveryRequest { type_url: T.into(), resource_names_subscribe: names(&ix), ..Default::default() };
                    let e = delta.on_request(&req).unwrap();
                    group.apply_effects(1, &e, now);
                }
                Op::Unsubscribe(ix) => {
                    let req = DeltaDiscoveryRequest { type_url: T.into(), resource_names_unsubscribe: names(&ix), ..Default::default() };
                    let e = delta.on_request(&req).unwrap();
                    group.apply_effects(1, &e, now);
                }
                Op::Ack | Op::Nack => {
                    let req = DeltaDiscoveryRequest {
                        type_url: T.into(),
                        response_nonce: last_nonce.clone(),
                        error_detail: matches!(op, Op::Nack).then(|| adsrelay::pb::rpc::Status { code: 3, message: "no".into(), details: vec![] }),
                        ..Default::default()
                    };
                    delta.on_request(&req).unwrap();
                }
                Op::Upstream { add, remove } => {
                    let added: HashSet<usize> = add.iter().map(|(i, _)| *i).collect();
                    let resources = added.iter().filter(|i| NAMES[**i] != "*").map(|i| {
                        let v = add.iter().find(|(j, _)| j == i).map(|(_, v)| *v).unwrap_or(0);
                        Resource {
                            name: NAMES[*i].into(),
                            version: v.to_string(),
                            resource: Some(prost_types::Any { type_url: T.into(), value: format!("{}{v}", NAMES[*i]).into_bytes() }),
                            ..Default::default()
                        }.encode_to_vec().into()
                    }).collect();
                    let removed = remove.iter().filter(|i| !added.contains(i)).map(|i| NAMES[*i].to_string()).collect();
                    if let Ok(changes) = group.apply_upstream(T, UpstreamUpdate { resources, removed, ..Default::default() }) {
                        delta.on_change(&changes);
                        sotw.on_change(&changes);
                    }
                }
                Op::Sotw(ix) => {
                    let req = DiscoveryRequest { type_url: T.into(), resource_names: names(&ix), ..Default::default() };
                    let e = sotw.on_request(&req).unwrap();
                    group.apply_effects(2, &e, now);
                }
            }
            while let Some(r) = delta.next_response(group.store()) {
                let r = DeltaDiscoveryResponse::decode(r.encode_to_vec().as_slice()).unwrap();
                check_delta(&r)?;
                last_nonce = r.nonce.clone();
            }
            while let Some(r) = sotw.next_response(group.store()) {
                prop_assert!(!r.version_info.is_empty());
                let n: HashSet<&bytes::Bytes> = r.resources.iter().collect();
                prop_assert_eq!(n.len(), r.resources.len(), "duplicate entries in a SotW response");
            }
        }
    }
}
