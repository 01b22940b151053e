//! Graceful shutdown: the relay stops being ready, refuses new streams, and closes its clients'
//! connections spread over the drain period rather than all at once.

mod support;

use std::time::{Duration, Instant};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_spreads_disconnects_over_the_drain_period() {
    let up = Upstream::start(vec![resource(CDS, "c1", "1")]).await;
    let mut relay = RelayUnderTest::start_with(up.addr, |c| {
        c.limits.drain_period = Duration::from_millis(1500);
    })
    .await;
    let mut clients = Vec::new();
    for i in 0..20 {
        let mut c =
            DeltaClient::connect(relay.xds, node(&format!("n{i}"), "g"), subscribe(CDS, &[])).await;
        c.recv_ack().await;
        clients.push(c);
    }
    let start = Instant::now();
    relay.shutdown();
    // Not ready any more while draining, so load balancers stop sending clients here.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("draining"), "{body}");

    // Watch every client at once, so each records when its own connection was closed.
    let watchers: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                c.wait_closed(Duration::from_secs(10)).await;
                start.elapsed()
            })
        })
        .collect();
    let mut ended = Vec::new();
    for w in watchers {
        ended.push(w.await.unwrap());
    }
    ended.sort();
    let (first, last) = (ended[0], ended[ended.len() - 1]);
    println!("disconnects between {first:?} and {last:?}");
    assert!(
        last - first >= Duration::from_millis(700),
        "spread: {first:?}..{last:?}"
    );
    assert!(
        last <= Duration::from_secs(4),
        "all gone within the period: {last:?}"
    );
}
