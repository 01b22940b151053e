//! The unsubscribed set end to end (docs/sizing.md "Memory budget for unsubscribed resources"):
//! resources no client wants any more stay cached and subscribed upstream within `unsubscribed_cache_bytes` per group; past the
//! budget the least recently left ones are unsubscribed upstream and forgotten, so a client that
//! comes back for one waits for the upstream (D5), while one still kept is served at once with no
//! upstream traffic. Subscribed resources are never evicted, whatever their size.

mod support;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, Resource};
use prost::Message;
use support::scripted::Harness;
use support::*;

/// A Cluster resource of a known encoded size (`payload` bytes of body).
fn sized(name: &str, version: &str, payload: usize) -> Vec<u8> {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: CDS.into(),
            value: vec![b'x'; payload],
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from /metrics"))
}

async fn metrics(h: &Harness) -> String {
    let (status, body) = h.relay.admin_get("/metrics").await;
    assert_eq!(status, 200);
    body
}

/// Polls /metrics until `ready` holds (failing after [`TIMEOUT`]); returns that scrape.
async fn metrics_when(h: &Harness, ready: impl Fn(&str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let body = metrics(h).await;
        if ready(&body) {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out; last scrape:\n{body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Upstream requests until one subscribes `name`; returns all of them.
async fn until_subscribed(h: &mut Harness, name: &str) -> Vec<DeltaDiscoveryRequest> {
    let mut seen = Vec::new();
    loop {
        let r = h.next_request().await;
        let done = r.resource_names_subscribe.iter().any(|n| n == name);
        seen.push(r);
        if done {
            return seen;
        }
    }
}

const PAYLOAD: usize = 1000;
const BIG: usize = 10_000;
const G: &str = "adsrelay_unsubscribed_cache";

#[tokio::test]
async fn unsubscribed_resources_are_kept_within_the_budget_and_evicted_least_recent_first() {
    let size = sized("r1", "1", PAYLOAD).len();
    let budget = 2 * size + size / 2;
    let mut h = Harness::start_with(|c| {
        c.unsubscribe_linger = std::time::Duration::from_secs(300);
        c.unsubscribed_cache_bytes = budget;
    })
    .await;

    // Another client holds a resource larger than the whole budget: it is never evicted.
    let mut keeper =
        DeltaClient::connect(h.relay.xds, node("keeper", "g"), subscribe(CDS, &["big"])).await;
    until_subscribed(&mut h, "big").await;
    h.send(vec![sized("big", "1", BIG)], &[]).await;
    assert_eq!(
        names(&keeper.recv_ack().await),
        [("big".into(), "1".into())]
    );

    let names4 = ["r1", "r2", "r3", "r4"];
    let mut a = DeltaClient::connect(h.relay.xds, node("a", "g"), subscribe(CDS, &names4)).await;
    until_subscribed(&mut h, "r4").await;
    h.send(names4.iter().map(|n| sized(n, "1", PAYLOAD)).collect(), &[])
        .await;
    let mut got = Vec::new();
    while got.len() < 4 {
        got.extend(names(&a.recv_ack().await));
    }
    got.sort();
    assert_eq!(got.len(), 4);

    // Leave in order r1..r4: r1 left first, so it is the first to go.
    for n in names4 {
        a.send(unsubscribe(CDS, &[n])).await;
    }
    let series = |m: &str| format!("{G}_{m}{{group=\"g\"}}");
    let budget_evictions = format!("{G}_evictions_total{{group=\"g\",reason=\"budget\"}}");
    let body = metrics_when(&h, |m| metric(m, &budget_evictions) == 2.0).await;
    assert_eq!(metric(&body, &series("budget_bytes")), budget as f64);
    assert_eq!(metric(&body, &series("bytes")), (2 * size) as f64);
    assert_eq!(metric(&body, &series("entries")), 2.0);
    assert_eq!(
        metric(
            &body,
            &format!("{G}_evictions_total{{group=\"g\",reason=\"linger\"}}")
        ),
        0.0
    );

    // A client subscribing to a kept resource is served at once; one subscribing to an evicted
    // resource waits for the upstream. The upstream sees a subscribe for r1 only.
    let mut c = DeltaClient::connect(h.relay.xds, node("c", "g"), subscribe(CDS, &["r4"])).await;
    assert_eq!(names(&c.recv_ack().await), [("r4".into(), "1".into())]);
    c.send(subscribe(CDS, &["r1"])).await;
    let seen = until_subscribed(&mut h, "r1").await;
    let upstream_subscribed: Vec<&String> = seen
        .iter()
        .flat_map(|r| &r.resource_names_subscribe)
        .collect();
    assert!(
        !upstream_subscribed.iter().any(|n| *n == "r4"),
        "a kept resource needs no upstream subscribe: {upstream_subscribed:?}"
    );
    let unsubscribed: Vec<&String> = seen
        .iter()
        .flat_map(|r| &r.resource_names_unsubscribe)
        .collect();
    assert!(unsubscribed.iter().any(|n| *n == "r1") && unsubscribed.iter().any(|n| *n == "r2"));
    assert!(!unsubscribed
        .iter()
        .any(|n| *n == "big" || *n == "r3" || *n == "r4"));
    // D5: r1@1 is gone from the cache; the client gets what the upstream sends now.
    h.send(vec![sized("r1", "2", PAYLOAD)], &[]).await;
    assert_eq!(names(&c.recv_ack().await), [("r1".into(), "2".into())]);

    let body = metrics(&h).await;
    assert_eq!(metric(&body, &series("resubscriptions_total")), 1.0);
    // r4 is subscribed again and r1 fresh; r3 alone is kept.
    assert_eq!(metric(&body, &series("bytes")), size as f64);
    // The keeper still holds "big", far over the budget, and is still served updates.
    h.send(vec![sized("big", "2", BIG)], &[]).await;
    assert_eq!(
        names(&keeper.recv_ack().await),
        [("big".into(), "2".into())]
    );
}

#[tokio::test]
async fn unsubscribed_resources_leave_after_the_linger() {
    let mut h = Harness::start_with(|c| {
        c.unsubscribe_linger = std::time::Duration::from_millis(200);
    })
    .await;
    let mut a = DeltaClient::connect(h.relay.xds, node("a", "g"), subscribe(CDS, &["r1"])).await;
    until_subscribed(&mut h, "r1").await;
    h.send(vec![sized("r1", "1", PAYLOAD)], &[]).await;
    assert_eq!(names(&a.recv_ack().await), [("r1".into(), "1".into())]);
    a.send(unsubscribe(CDS, &["r1"])).await;
    // Held until the linger ends, then unsubscribed upstream and forgotten.
    loop {
        let r = h.next_request().await;
        if r.resource_names_unsubscribe.iter().any(|n| n == "r1") {
            break;
        }
    }
    let linger = format!("{G}_evictions_total{{group=\"g\",reason=\"linger\"}}");
    let body = metrics_when(&h, |m| metric(m, &linger) == 1.0).await;
    assert_eq!(metric(&body, &format!("{G}_bytes{{group=\"g\"}}")), 0.0);
    assert_eq!(
        metric(&body, &format!("{G}_budget_bytes{{group=\"g\"}}")),
        (64 << 20) as f64
    );
    // Coming back after the lapse waits for the upstream (D5).
    a.send(subscribe(CDS, &["r1"])).await;
    until_subscribed(&mut h, "r1").await;
    h.send(vec![sized("r1", "2", PAYLOAD)], &[]).await;
    assert_eq!(names(&a.recv_ack().await), [("r1".into(), "2".into())]);
}
