//! A client that never reads while 1,000 updates flow: the relay's other clients keep getting
//! updates promptly, and the stuck one is disconnected after `stuck_client_timeout`.

mod support;

use std::time::{Duration, Instant};

use adsrelay::pb::discovery::Resource;
use adsrelay::xds::CachedResource;
use prost::Message;
use support::*;

/// A CDS resource with a 32 KiB body, so a reader that stops fills HTTP/2 windows quickly.
fn big(name: &str, version: u32) -> (String, CachedResource) {
    let encoded = Resource {
        name: name.into(),
        version: version.to_string(),
        resource: Some(prost_types::Any {
            type_url: CDS.into(),
            value: vec![b'x'; 32 * 1024],
        }),
        ..Default::default()
    }
    .encode_to_vec();
    (CDS.into(), CachedResource::decode(encoded.into()).unwrap())
}

fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

#[tokio::test]
async fn stuck_client_is_disconnected_and_others_are_not_delayed() {
    let upstream = Upstream::start(vec![big("c1", 0)]).await;
    let relay = RelayUnderTest::start_with(upstream.addr, |c| {
        c.limits.stuck_client_timeout = Duration::from_secs(1);
    })
    .await;
    // The stuck client subscribes and never reads.
    let _stuck = DeltaClient::connect(relay.xds, node("stuck", "g"), subscribe(CDS, &["c1"])).await;
    let mut normal = Vec::new();
    for i in 0..3 {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("normal-{i}"), "g"),
            subscribe(CDS, &["c1"]),
        )
        .await;
        c.recv_ack().await;
        normal.push(c);
    }
    let mut worst = Duration::ZERO;
    for v in 1..=1000u32 {
        let sent = Instant::now();
        upstream.cp.set_resources(vec![big("c1", v)]);
        // Every tenth update, each normal client must see it (or a later one) promptly.
        if v % 10 == 0 {
            for c in &mut normal {
                loop {
                    let r = c.recv_ack().await;
                    let got: u32 = r.resources[0].version.parse().unwrap();
                    if got >= v {
                        break;
                    }
                }
            }
            worst = worst.max(sent.elapsed());
        }
    }
    assert!(
        worst < Duration::from_millis(500),
        "normal clients were delayed: worst {worst:?}"
    );
    eventually_metrics(&relay, "stuck client disconnected", |body| {
        metric(
            body,
            "adsrelay_downstream_streams_rejected_total{reason=\"stuck_client\"}",
        ) == Some(1.0)
            && metric(body, "adsrelay_downstream_streams{protocol=\"delta\"}") == Some(3.0)
    })
    .await;
}

async fn eventually_metrics(relay: &RelayUnderTest, what: &str, f: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (_, body) = http_request(relay.admin, "GET", "/metrics").await;
        if f(&body) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for: {what}\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
