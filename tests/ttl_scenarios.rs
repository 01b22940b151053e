//! TTL scenarios (A23, A24, B17, D6, D7) driven against the core: the TTL reaches clients
//! unchanged, heartbeats go only to clients holding that version, SotW clients get the resource
//! again instead of a heartbeat, and the cache drops what the upstream stopped refreshing.

use std::time::{Duration, Instant};

use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, Resource,
};
use adsrelay::pb::wire;
use adsrelay::xds::{DeltaStream, GroupState, SotwStream, UpstreamUpdate};
use prost::Message;

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

fn res(name: &str, version: &str, ttl_secs: Option<i64>, body: bool) -> bytes::Bytes {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: body.then(|| prost_types::Any {
            type_url: EDS.into(),
            value: version.as_bytes().to_vec(),
        }),
        ttl: ttl_secs.map(|s| prost_types::Duration {
            seconds: s,
            nanos: 0,
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn update(resources: Vec<bytes::Bytes>, at: Instant) -> UpstreamUpdate {
    UpstreamUpdate {
        resources,
        received_at: Some(at),
        ..Default::default()
    }
}

fn decode(r: wire::DeltaDiscoveryResponse) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse::decode(r.encode_to_vec().as_slice()).unwrap()
}

fn drain(s: &mut DeltaStream, g: &GroupState) -> Vec<DeltaDiscoveryResponse> {
    std::iter::from_fn(|| s.next_response(g.store()))
        .map(decode)
        .collect()
}

fn sub(names: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_names_subscribe: names.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// A group with stream 1 subscribed to foo and foo@v7 (ttl 30s) applied at `t0`.
fn setup(t0: Instant) -> (GroupState, DeltaStream) {
    let mut g = GroupState::new(Duration::ZERO);
    let mut s = DeltaStream::new();
    let e = s.on_request(&sub(&["foo"])).unwrap();
    g.apply_effects(1, &e, t0);
    let c = g
        .apply_upstream(EDS, update(vec![res("foo", "v7", Some(30), true)], t0))
        .unwrap();
    s.on_change(&c);
    (g, s)
}

#[test]
fn a24_ttl_reaches_the_client_unchanged_and_can_be_removed() {
    let t0 = Instant::now();
    let (mut g, mut s) = setup(t0);
    let out = drain(&mut s, &g);
    assert_eq!(
        out[0].resources[0].ttl,
        Some(prost_types::Duration {
            seconds: 30,
            nanos: 0
        })
    );
    // The upstream resends foo without a TTL: the client receives it without one.
    let c = g
        .apply_upstream(EDS, update(vec![res("foo", "v8", None, true)], t0))
        .unwrap();
    s.on_change(&c);
    let out = drain(&mut s, &g);
    assert_eq!(out[0].resources[0].version, "v8");
    assert_eq!(out[0].resources[0].ttl, None);
}

#[test]
fn a23_d07_heartbeat_refreshes_ttl_and_goes_only_to_holders_of_that_version() {
    let t0 = Instant::now();
    let (mut g, mut holder) = setup(t0);
    drain(&mut holder, &g);
    // A second client that holds v6 (from before a reconnect) and NACKed v7 stays at v6.
    let mut behind = DeltaStream::new();
    let mut req = sub(&["foo"]);
    req.initial_resource_versions = [("foo".to_string(), "v6".to_string())].into();
    let e = behind.on_request(&req).unwrap();
    g.apply_effects(2, &e, t0);
    let first = drain(&mut behind, &g);
    assert_eq!(first[0].resources[0].version, "v7");
    behind
        .on_request(&DeltaDiscoveryRequest {
            type_url: EDS.into(),
            response_nonce: first[0].nonce.clone(),
            error_detail: Some(adsrelay::pb::rpc::Status {
                code: 3,
                message: "bad".into(),
                details: vec![],
            }),
            ..Default::default()
        })
        .unwrap();

    // Heartbeat at t0+20s with a new TTL of 60s.
    let c = g
        .apply_upstream(
            EDS,
            update(
                vec![res("foo", "v7", Some(60), false)],
                t0 + Duration::from_secs(20),
            ),
        )
        .unwrap();
    assert!(c.names.is_empty(), "content unchanged");
    holder.on_change(&c);
    let hb = drain(&mut holder, &g);
    assert_eq!(hb.len(), 1);
    let r = &hb[0].resources[0];
    assert_eq!(
        (r.name.as_str(), r.version.as_str(), r.resource.is_none()),
        ("foo", "v7", true)
    );
    assert_eq!(
        r.ttl,
        Some(prost_types::Duration {
            seconds: 60,
            nanos: 0
        })
    );

    // The client that rejected v7 still holds v6: no heartbeat for v7, and no v7 again (A31).
    behind.on_change(&c);
    assert!(
        drain(&mut behind, &g).is_empty(),
        "a heartbeat for a version the client NACKed"
    );

    // The old deadline (t0+30s) no longer applies: the heartbeat moved it to t0+80s.
    assert!(g.expire(t0 + Duration::from_secs(31)).is_empty());
    // A new subscriber gets the full resource with the refreshed TTL.
    let mut late = DeltaStream::new();
    let e = late.on_request(&sub(&["foo"])).unwrap();
    g.apply_effects(3, &e, t0);
    let out = drain(&mut late, &g);
    assert!(out[0].resources[0].resource.is_some());
    assert_eq!(
        out[0].resources[0].ttl,
        Some(prost_types::Duration {
            seconds: 60,
            nanos: 0
        })
    );
}

#[test]
fn d06_expired_ttl_leaves_the_cache_and_the_clients() {
    let t0 = Instant::now();
    let (mut g, mut s) = setup(t0);
    drain(&mut s, &g);
    assert!(g.expire(t0 + Duration::from_secs(29)).is_empty());
    let expired = g.expire(t0 + Duration::from_secs(30));
    assert_eq!(expired.len(), 1);
    let (changes, affected) = &expired[0];
    assert!(affected.contains(&1));
    s.on_change(changes);
    let out = drain(&mut s, &g);
    assert_eq!(out[0].removed_resources, vec!["foo".to_string()]);
    assert_eq!(g.store().ttl_expired, 1);
    // Not served to new subscribers.
    let mut late = DeltaStream::new();
    let e = late.on_request(&sub(&["foo"])).unwrap();
    g.apply_effects(2, &e, t0);
    let out = drain(&mut late, &g);
    assert!(out[0].resources.is_empty());
}

#[test]
fn b17_sotw_clients_get_the_resource_again_instead_of_a_heartbeat() {
    let t0 = Instant::now();
    let mut g = GroupState::new(Duration::ZERO);
    let node = adsrelay::pb::core::Node::default();
    let mut s = SotwStream::for_node(&node, Default::default());
    let e = s
        .on_request(&DiscoveryRequest {
            type_url: EDS.into(),
            resource_names: vec!["foo".into()],
            ..Default::default()
        })
        .unwrap();
    g.apply_effects(1, &e, t0);
    let c = g
        .apply_upstream(EDS, update(vec![res("foo", "v7", Some(30), true)], t0))
        .unwrap();
    s.on_change(&c);
    let first = s.next_response(g.store()).unwrap();
    let c = g
        .apply_upstream(
            EDS,
            update(
                vec![res("foo", "v7", Some(30), false)],
                t0 + Duration::from_secs(10),
            ),
        )
        .unwrap();
    s.on_change(&c);
    let again = s.next_response(g.store()).expect("full resource again");
    assert_eq!(
        again.version_info, first.version_info,
        "same content, same version_info"
    );
    let any = prost_types::Any::decode(again.resources[0].clone()).unwrap();
    assert_eq!(
        any.type_url, EDS,
        "a real resource, not a body-less heartbeat"
    );
}
