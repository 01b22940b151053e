//! A wildcard-only stream that follows the type's shared content (`follow_shared`) is sent
//! exactly what the name-by-name build sends a stream keeping its own record.

use super::*;
use crate::pb::discovery::Resource;
use proptest::prelude::*;
use prost::Message;
use std::collections::BTreeMap;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

fn resource(name: &str, version: u8) -> Bytes {
    Resource {
        name: name.into(),
        version: version.to_string(),
        resource: Some(prost_types::Any {
            type_url: CDS.into(),
            value: vec![version],
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

#[derive(Debug, Clone)]
enum Step {
    /// Upserts (name index, version) and removes names, as one upstream response.
    Upstream(Vec<(u8, u8)>, Vec<u8>),
    /// The clients answer their responses: ACK (true) or NACK (false).
    Answer(bool),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (
            proptest::collection::vec((0u8..8, 1u8..4), 0..4),
            proptest::collection::vec(0u8..8, 0..3)
        )
            .prop_map(|(up, rm)| Step::Upstream(up, rm)),
        2 => any::<bool>().prop_map(Step::Answer),
        1 => Just(Step::Answer(false)),
    ]
}

/// (name, version) sent, and names removed, in order.
type Seen = (Vec<(String, String)>, Vec<String>);

fn drain(c: &mut DeltaStream, store: &Store, nonces: &mut Vec<String>) -> Vec<Seen> {
    let mut seen = Vec::new();
    while let Some(r) = c.next_response(store) {
        let sent = r
            .resources
            .iter()
            .map(|b| {
                let r = Resource::decode(b.clone()).expect("relay-encoded resource");
                (r.name, r.version)
            })
            .collect();
        seen.push((sent, r.removed_resources.clone()));
        nonces.push(r.nonce);
    }
    seen
}

fn answer(c: &mut DeltaStream, nonces: &mut Vec<String>, ack: bool) {
    for nonce in nonces.drain(..) {
        c.on_request(&DeltaDiscoveryRequest {
            type_url: CDS.into(),
            response_nonce: nonce,
            error_detail: (!ack).then(|| crate::pb::rpc::Status {
                message: "rejected".into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .expect("valid answer");
    }
}

fn held(c: &DeltaStream) -> Vec<(String, String)> {
    c.held()
        .map(|(_, l, h)| (l.name.to_string(), h.version().to_string()))
        .collect()
}

fn is_shared(c: &DeltaStream) -> bool {
    c.types
        .get(CDS)
        .is_some_and(|ts| ts.known.shared().is_some())
}

proptest! {
    #[test]
    fn following_the_shared_content_sends_what_the_name_by_name_build_sends(
        initial in proptest::collection::vec(1u8..4, 8),
        steps in proptest::collection::vec(step(), 1..24),
    ) {
        let mut store = Store::new();
        let first = (0..8u8)
            .filter(|i| i % 3 != 0)
            .map(|i| resource(&format!("c{i}"), initial[usize::from(i)]))
            .collect();
        store.apply_delta(CDS, first, vec![], true).expect("valid response");
        let (mut shared, mut own) = (DeltaStream::new(), DeltaStream::new());
        let (mut shared_nonces, mut own_nonces) = (Vec::new(), Vec::new());
        for c in [&mut shared, &mut own] {
            c.on_request(&DeltaDiscoveryRequest {
                type_url: CDS.into(),
                ..Default::default()
            })
            .expect("wildcard request");
        }
        prop_assert_eq!(
            drain(&mut shared, &store, &mut shared_nonces),
            drain(&mut own, &store, &mut own_nonces)
        );
        prop_assert!(is_shared(&shared), "a joined wildcard-only stream holds the shared content");
        // The other stream keeps a record of its own, so it takes the name-by-name build.
        if let Some(ts) = own.types.get_mut(CDS) {
            ts.known = ts.known.iter().map(|(l, h)| (l.clone(), h.clone())).collect();
        }
        let mut nacked = false;
        for step in steps {
            match step {
                Step::Upstream(up, rm) => {
                    // One entry per name, as a control plane sends them.
                    let up: BTreeMap<u8, u8> = up.into_iter().collect();
                    let resources = up
                        .iter()
                        .map(|(i, v)| resource(&format!("c{i}"), *v))
                        .collect();
                    let removed = rm
                        .iter()
                        .filter(|i| !up.contains_key(i))
                        .map(|i| format!("c{i}"))
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect();
                    let changes = store
                        .apply_delta(CDS, resources, removed, false)
                        .expect("valid response");
                    shared.on_change(&changes);
                    own.on_change(&changes);
                }
                Step::Answer(ack) => {
                    nacked |= !ack && !shared_nonces.is_empty();
                    answer(&mut shared, &mut shared_nonces, ack);
                    answer(&mut own, &mut own_nonces, ack);
                }
            }
            prop_assert_eq!(
                drain(&mut shared, &store, &mut shared_nonces),
                drain(&mut own, &store, &mut own_nonces)
            );
            prop_assert_eq!(held(&shared), held(&own));
            if !nacked {
                prop_assert!(is_shared(&shared), "an update keeps the record shared");
            }
        }
    }
}
