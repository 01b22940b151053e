//! A scripted control plane (a tiny tonic server in this test) sends crafted bad responses: the
//! relay NACKs each with an error_detail naming the problem, keeps the last good state, and never
//! passes anything of the bad response to clients. An oversize response ends the upstream stream
//! (it cannot be decoded, so it cannot be NACKed); the relay reconnects and clients keep their
//! config.

mod support;

use std::time::Duration;

use support::scripted::{res, Harness};
use support::*;

#[tokio::test]
async fn bad_upstream_responses_are_nacked_and_never_reach_clients() {
    let mut h = Harness::start().await;
    let mut client = DeltaClient::connect(
        h.relay.xds,
        node("envoy", "g"),
        subscribe(CDS, &["c1", "c2"]),
    )
    .await;
    // The relay subscribes upstream; answer with the good state.
    let sub = h.next_request().await;
    assert_eq!(sub.type_url, CDS);
    let n = h
        .send(vec![res("c1", "1", CDS), res("c2", "1", CDS)], &[])
        .await;
    assert_eq!(h.answer(&n).await, None, "good response ACKed");
    let r = client.recv_ack().await;
    assert_eq!(
        names(&r),
        [("c1".into(), "1".into()), ("c2".into(), "1".into())]
    );

    // (resources, removed names, expected NACK text)
    type Case<'a> = (Vec<Vec<u8>>, Vec<&'a str>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![res("c1", "2", CDS), res("c1", "3", CDS)],
            vec![],
            "duplicate resource name \"c1\"",
        ),
        (
            vec![res("c1", "2", CDS)],
            vec!["c1"],
            "\"c1\" is both added and removed",
        ),
        (
            vec![res("c1", "2", EDS)],
            vec![],
            "resource \"c1\" has type \"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\"",
        ),
        (vec![vec![0xff, 0xff, 0xff]], vec![], "resource #0"),
    ];
    for (resources, removed, expected) in cases {
        let n = h.send(resources, &removed).await;
        let nack = h.answer(&n).await.expect("NACK");
        assert!(nack.contains(expected), "NACK {nack:?} lacks {expected:?}");
    }
    client.expect_silence(Duration::from_millis(300)).await;

    // Oversize: the relay cannot decode it, drops the stream and reconnects with its versions.
    let streams_before = *h.cp.streams.lock().unwrap();
    let big = vec![res("c1", &"9".repeat(70 * 1024), CDS)];
    h.send(big, &[]).await;
    let resub = loop {
        let r = h.next_request().await;
        if !r.initial_resource_versions.is_empty() {
            break r;
        }
    };
    assert!(*h.cp.streams.lock().unwrap() > streams_before);
    assert_eq!(
        resub
            .initial_resource_versions
            .get("c1")
            .map(String::as_str),
        Some("1")
    );
    client.expect_silence(Duration::from_millis(300)).await;

    // The last good state is intact: a real update flows through.
    let n = h.send(vec![res("c2", "2", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    assert_eq!(names(&client.recv_ack().await), [("c2".into(), "2".into())]);
    let (_, body) = http_request(h.relay.admin, "GET", "/metrics").await;
    assert!(
        body.contains("adsrelay_upstream_nacks_total{group=\"g\"} 4"),
        "{body}"
    );
}
