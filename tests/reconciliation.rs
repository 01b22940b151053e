//! C18: reconciling with a control plane that does not report what it removed. The scripted
//! upstream here behaves like java-control-plane 1.0.49's Delta server: on a new stream it ignores
//! `initial_resource_versions`, resends what it has, and never sends `removed_resources` for what
//! it dropped while the relay was away. The relay resumes with versions, then reconciles (a stream
//! without them) and removes what the full state lacks, telling clients only that.

mod support;

use std::time::{Duration, Instant};

use support::scripted::{res, Harness};
use support::*;

/// The JSON body of an admin response (headers included in `text`).
fn json_body(text: &str) -> serde_json::Value {
    let body = text.split_once("\r\n\r\n").map_or(text, |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c18_a_restarted_server_that_reports_no_removals_is_reconciled_after_the_resume() {
    let mut h = Harness::start().await;
    let mut client =
        DeltaClient::connect(h.relay.xds, node("envoy", "g"), subscribe(CDS, &[])).await;
    let first = h.next_request().await;
    assert_eq!(first.type_url, CDS);
    let n = h
        .send(vec![res("a", "1", CDS), res("b", "1", CDS)], &[])
        .await;
    assert_eq!(h.answer(&n).await, None);
    let got = client.recv_ack().await;
    assert_eq!(got.resources.len(), 2);

    // The server goes away and comes back without `b`. The relay resumes with its versions; the
    // server ignores them and resends `a` only, reporting no removal.
    h.cp.current.lock().unwrap().take();
    let resume = loop {
        let r = h.next_request().await;
        if r.type_url == CDS && r.response_nonce.is_empty() {
            break r;
        }
    };
    assert_eq!(resume.initial_resource_versions.len(), 2, "{resume:?}");
    let resumed_at = Instant::now();
    let n = h.send(vec![res("a", "1", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    // `a` is unchanged: clients hear nothing of the resend.
    client.expect_silence(Duration::from_millis(500)).await;

    // The reconciliation: a fresh stream without versions, a few seconds after the resume.
    let reconcile = loop {
        let r = h.next_request().await;
        if r.type_url == CDS && r.response_nonce.is_empty() {
            break r;
        }
    };
    assert!(
        reconcile.initial_resource_versions.is_empty(),
        "a reconciliation does not trust the server's diff: {reconcile:?}"
    );
    assert!(resumed_at.elapsed() < Duration::from_secs(15));
    let n = h.send(vec![res("a", "1", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    let removal = client.recv_ack().await;
    assert_eq!(removal.removed_resources, vec!["b".to_string()]);
    assert!(removal.resources.is_empty(), "a is not resent: {removal:?}");

    // Operators see what it repaired.
    let (code, body) = h.relay.admin_get("/debug/upstreams").await;
    assert_eq!(code, 200);
    let upstreams = json_body(&body);
    let last = &upstreams[0]["last_reconciliation"];
    assert_eq!(last["complete"], true, "{body}");
    assert_eq!(last["repairs"][CDS]["removed"], 1, "{body}");
    assert_eq!(last["repairs"][CDS]["changed"], 0, "{body}");
    let (_, metrics) = h.relay.admin_get("/metrics").await;
    assert!(
        metrics.contains("adsrelay_drift_repairs_total{group=\"g\"} 1"),
        "{metrics}"
    );
}

/// A wildcard type the server never answers (java-control-plane answers a wildcard type only once
/// it has a resource of it) holds readiness back only for a bounded wait, is named on
/// /debug/upstreams and in a metric, and wildcard clients get the (empty) cache instead of waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c18_a_wildcard_type_the_server_never_answers_stops_holding_readiness_back() {
    let mut h = Harness::start().await;
    let mut client =
        DeltaClient::connect(h.relay.xds, node("envoy", "g"), subscribe(CDS, &[])).await;
    let first = h.next_request().await;
    assert_eq!(first.type_url, CDS);
    let (code, _) = h.relay.admin_get("/readyz").await;
    assert_eq!(
        code, 503,
        "not ready before the upstream answered or the wait ended"
    );
    // No answer: after the wait the relay is ready and the client gets an empty CDS answer.
    client
        .expect_silence(adsrelay::upstream::UNANSWERED_WAIT - Duration::from_secs(1))
        .await;
    let answer = client.recv().await;
    assert!(answer.resources.is_empty());
    let (code, body) = h.relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    let (_, body) = h.relay.admin_get("/debug/upstreams").await;
    let upstreams = json_body(&body);
    assert_eq!(
        upstreams[0]["unanswered_types"],
        serde_json::json!([CDS]),
        "{body}"
    );
    let (_, metrics) = h.relay.admin_get("/metrics").await;
    assert!(
        metrics.contains("adsrelay_upstream_unanswered_types{group=\"g\"} 1"),
        "{metrics}"
    );
    // The server answers at last: the type is no longer unanswered, and clients get it.
    let n = h.send(vec![res("a", "1", CDS)], &[]).await;
    assert_eq!(h.answer(&n).await, None);
    let got = client.recv().await;
    assert_eq!(got.resources.len(), 1);
    let (_, body) = h.relay.admin_get("/debug/upstreams").await;
    let upstreams = json_body(&body);
    assert_eq!(
        upstreams[0]["unanswered_types"],
        serde_json::json!([]),
        "{body}"
    );
}
