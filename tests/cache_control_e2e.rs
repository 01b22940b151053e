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

/// Issue 13 / A23: C ACKs e1@2, D NACKs it and keeps e1@1. A heartbeat for e1@2 reaches C only;
/// D gets no body-less entry for a version it rejected, and CSDS reports D at version 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a23_heartbeat_never_reaches_a_client_that_nacked_that_version() {
    use adsrelay::pb::csds::client_status_discovery_service_client::ClientStatusDiscoveryServiceClient;
    use adsrelay::pb::csds::ClientStatusRequest;
    use adsrelay::pb::discovery::DeltaDiscoveryRequest;

    let mut h = Harness::start().await;
    let mut c =
        DeltaClient::connect(h.relay.xds, node("envoy-c", "g"), subscribe(CDS, &["e1"])).await;
    h.next_request().await;
    let mut d =
        DeltaClient::connect(h.relay.xds, node("envoy-d", "g"), subscribe(CDS, &["e1"])).await;
    let send = |version: &'static str, body: bool| wire::DeltaDiscoveryResponse {
        type_url: CDS.into(),
        resources: vec![with_ttl("e1", version, 30, body)],
        ..Default::default()
    };
    let n = h.send_raw(send("1", true)).await;
    assert_eq!(h.answer(&n).await, None);
    assert_eq!(c.recv_ack().await.resources[0].version, "1");
    assert_eq!(d.recv_ack().await.resources[0].version, "1");

    let n = h.send_raw(send("2", true)).await;
    assert_eq!(h.answer(&n).await, None);
    assert_eq!(c.recv_ack().await.resources[0].version, "2");
    let rejected = d.recv().await;
    assert_eq!(rejected.resources[0].version, "2");
    d.send(DeltaDiscoveryRequest {
        type_url: CDS.into(),
        response_nonce: rejected.nonce.clone(),
        error_detail: Some(Status {
            code: 3,
            message: "e1@2 rejected".into(),
            details: vec![],
        }),
        ..Default::default()
    })
    .await;

    // The relay has seen the NACK once /debug/clients says so.
    let admin = h.relay.admin;
    for _ in 0..100 {
        let (_, body) = http_get(admin, "/debug/clients?node_id=envoy-d").await;
        if body.contains("nacked") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let n = h.send_raw(send("2", false)).await;
    assert_eq!(
        h.answer(&n).await,
        None,
        "a heartbeat at the cached version"
    );
    let hb = c.recv_ack().await;
    assert!(
        hb.resources[0].resource.is_none(),
        "C holds e1@2: a heartbeat"
    );
    assert_eq!(hb.resources[0].version, "2");
    // D holds e1@1: a body-less e1@2 would be processed as an update and rejected again.
    if let Ok(r) = tokio::time::timeout(Duration::from_millis(500), d.recv()).await {
        assert!(
            r.resources.iter().all(|x| x.resource.is_some()),
            "D got a heartbeat for a version it rejected: {r:?}"
        );
    }

    // CSDS: D keeps version 1, with the rejected version 2 in error_state.
    let mut csds = ClientStatusDiscoveryServiceClient::connect(format!("http://{}", h.relay.xds))
        .await
        .unwrap();
    let status = csds
        .fetch_client_status(ClientStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    let d_cfg = status
        .config
        .iter()
        .find(|c| c.node.as_ref().unwrap().id == "envoy-d")
        .expect("D reported");
    let e1 = &d_cfg.generic_xds_configs[0];
    assert_eq!(e1.version_info, "1", "D kept version 1");
    assert_eq!(e1.error_state.as_ref().unwrap().version_info, "2");
}
