//! TTL and resource errors through a real relay, with a scripted upstream (the demo control plane
//! never sends heartbeats or errors): the TTL reaches the client, a heartbeat reaches the client
//! holding that version, an expired TTL removes the resource, and TP3 resource errors reach the
//! subscribers of those names (NOT_FOUND as a removal).

mod support;

use std::time::Duration;

use adsrelay::pb::discovery::{Resource, ResourceError, ResourceName};
use adsrelay::pb::rpc::Status;
use adsrelay::pb::wire;
use prost::Message;
use support::scripted::{res, Harness};
use support::*;

fn with_ttl(name: &str, version: &str, secs: i64, body: bool) -> bytes::Bytes {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: body.then(|| prost_types::Any {
            type_url: CDS.into(),
            value: b"x".to_vec(),
        }),
        ttl: Some(prost_types::Duration {
            seconds: secs,
            nanos: 0,
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a23_a24_d06_ttl_heartbeat_and_expiry_through_the_relay() {
    let mut h = Harness::start().await;
    let mut c = DeltaClient::connect(h.relay.xds, node("envoy", "g"), subscribe(CDS, &["t"])).await;
    h.next_request().await; // the relay's subscribe
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: CDS.into(),
            resources: vec![with_ttl("t", "1", 2, true)],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    let r = c.recv_ack().await;
    assert_eq!(
        r.resources[0].ttl,
        Some(prost_types::Duration {
            seconds: 2,
            nanos: 0
        })
    );

    // Heartbeat: same version, no body; the client holding v1 receives it as-is.
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: CDS.into(),
            resources: vec![with_ttl("t", "1", 2, false)],
            ..Default::default()
        })
        .await;
    assert_eq!(
        h.answer(&n).await,
        None,
        "a heartbeat at the held version is ACKed"
    );
    let hb = c.recv_ack().await;
    assert_eq!(hb.resources.len(), 1);
    assert!(
        hb.resources[0].resource.is_none(),
        "forwarded as a heartbeat"
    );
    assert_eq!(hb.resources[0].version, "1");

    // No more refreshes: within the TTL (2 s) plus the housekeeping tick (1 s) it is removed.
    let gone = c.recv_ack().await;
    assert_eq!(gone.removed_resources, vec!["t".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp3_resource_errors_reach_subscribers_and_not_found_removes() {
    let mut h = Harness::start().await;
    let mut c = DeltaClient::connect(
        h.relay.xds,
        node("envoy", "g"),
        subscribe(CDS, &["ok", "denied", "missing"]),
    )
    .await;
    h.next_request().await;
    let err = |name: &str, code: i32| ResourceError {
        resource_name: Some(ResourceName {
            name: name.into(),
            dynamic_parameter_constraints: None,
        }),
        error_detail: Some(Status {
            code,
            message: format!("{name}: code {code}"),
            details: vec![],
        }),
    };
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: CDS.into(),
            resources: vec![res("ok", "1", CDS).into()],
            resource_errors: vec![err("denied", 7), err("missing", 5)],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    let mut got = Vec::new();
    let mut removed = Vec::new();
    let mut errors = Vec::new();
    while got.is_empty() || removed.is_empty() || errors.is_empty() {
        let r = c.recv_ack().await;
        got.extend(names(&r));
        removed.extend(r.removed_resources);
        errors.extend(r.resource_errors);
    }
    assert_eq!(got, vec![("ok".to_string(), "1".to_string())]);
    assert_eq!(
        removed,
        vec!["missing".to_string()],
        "NOT_FOUND is a removal"
    );
    assert_eq!(errors, vec![err("denied", 7)]);
    c.expect_silence(Duration::from_millis(200)).await;
}
