//! Issue 5: aggregation groups (rules, isolation, unmatched clients, member mismatches), upstream
//! failover without cross-server `initial_resource_versions` (C6), admission rate limiting,
//! periodic resync repairing drift, and /readyz staleness.

mod support;

use std::time::Duration;

use adsrelay::grouping::GroupRule;
use adsrelay::pb::core::Node;
use prost_types::{value::Kind, Struct, Value};
use support::*;

fn with_md(id: &str, cluster: &str, md: &[(&str, &str)]) -> Node {
    Node {
        metadata: Some(Struct {
            fields: md
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Value {
                            kind: Some(Kind::StringValue(v.to_string())),
                        },
                    )
                })
                .collect(),
        }),
        ..node(id, cluster)
    }
}

/// The value of one series in a /metrics body (0 if absent).
fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

fn initial() -> Vec<(String, adsrelay::xds::CachedResource)> {
    vec![
        resource(CDS, "c1", "1"),
        resource(EDS, "e1", "1"),
        resource(EDS, "e2", "1"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_never_see_each_others_resources() {
    let up = Upstream::start(initial()).await;
    // The control plane tailors config by the node cluster the relay presents: "prod" or "test".
    up.cp.set_resources_for(
        "prod",
        vec![resource(CDS, "prod-c", "1"), resource(EDS, "shared", "p1")],
    );
    up.cp.set_resources_for(
        "test",
        vec![resource(CDS, "test-c", "1"), resource(EDS, "shared", "t1")],
    );
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.grouping.rules = vec![GroupRule {
            cluster: Some("web*".into()),
            upstream_cluster: Some("{metadata.env}".into()),
            upstream_id: Some("adsrelay-{metadata.env}".into()),
            metadata_keys: vec!["env".into()],
            ..Default::default()
        }];
    })
    .await;
    let mut prod = Vec::new();
    let mut test = Vec::new();
    for i in 0..3 {
        for (env, list) in [("prod", &mut prod), ("test", &mut test)] {
            let mut c = DeltaClient::connect(
                relay.xds,
                with_md(&format!("{env}-{i}"), "web-a", &[("env", env)]),
                subscribe(CDS, &["*"]),
            )
            .await;
            assert_eq!(
                names(&c.recv_ack().await),
                vec![(format!("{env}-c"), "1".into())]
            );
            c.send(subscribe(EDS, &["shared"])).await;
            let want = if env == "prod" { "p1" } else { "t1" };
            assert_eq!(
                names(&c.recv_ack().await),
                vec![("shared".into(), want.into())]
            );
            list.push(c);
        }
    }
    let mut nodes = up.cp.stats().nodes;
    nodes.sort();
    assert_eq!(
        nodes,
        vec![
            ("adsrelay-prod".to_string(), "prod".to_string()),
            ("adsrelay-test".to_string(), "test".to_string())
        ],
        "one upstream stream per group, with the rendered identity"
    );
    // An update for prod reaches prod only.
    up.cp.set_resources_for(
        "prod",
        vec![resource(CDS, "prod-c", "2"), resource(EDS, "shared", "p2")],
    );
    for c in prod.iter_mut() {
        let mut got = Vec::new();
        while got.len() < 2 {
            got.extend(names(&c.recv_ack().await));
        }
        got.sort();
        assert_eq!(
            got,
            vec![
                ("prod-c".into(), "2".into()),
                ("shared".into(), "p2".into())
            ]
        );
    }
    for c in test.iter_mut() {
        c.expect_silence(Duration::from_millis(200)).await;
    }
    let (_, m) = relay.admin_get("/metrics").await;
    assert_eq!(
        metric(
            &m,
            &format!(
                "adsrelay_upstream_groups{{upstream=\"http://{}/\"}}",
                up.addr
            )
        ),
        2.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_clients_are_refused_and_mismatches_counted() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.grouping.rules = vec![GroupRule {
            cluster: Some("web".into()),
            ..Default::default()
        }];
    })
    .await;
    let mut a = DeltaClient::connect(
        relay.xds,
        with_md("a", "web", &[("shard", "1")]),
        subscribe(EDS, &["e1"]),
    )
    .await;
    a.recv_ack().await;
    // Same group, different metadata the group ignores: served, but counted and logged.
    let mut b = DeltaClient::connect(
        relay.xds,
        with_md("b", "web", &[("shard", "2")]),
        subscribe(EDS, &["e1"]),
    )
    .await;
    b.recv_ack().await;
    let mut lost =
        DeltaClient::connect(relay.xds, node("x", "batch"), subscribe(EDS, &["e1"])).await;
    let status = lost.recv_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("matches no [[groups]] rule"),
        "{}",
        status.message()
    );
    let (_, m) = relay.admin_get("/metrics").await;
    assert_eq!(
        metric(&m, "adsrelay_group_member_mismatch_total{group=\"web\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "adsrelay_downstream_streams_rejected_total{reason=\"no_group\"}"
        ),
        1.0
    );
    assert_eq!(up.cp.stats().streams_opened, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_limit_refuses_excess_new_streams() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.resilience.max_new_streams_per_second = 0.5;
        c.resilience.new_streams_burst = 2;
    })
    .await;
    let mut ok = Vec::new();
    for i in 0..2 {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("n{i}"), "g"),
            subscribe(EDS, &["e1"]),
        )
        .await;
        c.recv_ack().await;
        ok.push(c);
    }
    let mut third = DeltaClient::connect(relay.xds, node("n3", "g"), subscribe(EDS, &["e1"])).await;
    let status = third.recv_status().await;
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains("admission limit"),
        "{}",
        status.message()
    );
    let (_, m) = relay.admin_get("/metrics").await;
    assert_eq!(
        metric(
            &m,
            "adsrelay_downstream_streams_rejected_total{reason=\"admission\"}"
        ),
        1.0
    );
    // Admitted clients are unaffected.
    let mut next = initial();
    next[1] = resource(EDS, "e1", "2");
    up.cp.set_resources(next);
    for c in ok.iter_mut() {
        assert_eq!(names(&c.recv_ack().await), vec![("e1".into(), "2".into())]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_failover_to_another_server_sends_no_initial_versions() {
    let mut a = Upstream::start(initial()).await;
    let mut other = initial();
    other[2] = resource(EDS, "e2", "b2");
    let b = Upstream::start(other).await;
    let (a_addr, b_addr) = (a.addr, b.addr);
    let relay = RelayUnderTest::start_with(a_addr, |c| {
        c.upstreams = vec![
            format!("http://{a_addr}").parse().unwrap(),
            format!("http://{b_addr}").parse().unwrap(),
        ];
    })
    .await;
    let mut c =
        DeltaClient::connect(relay.xds, node("c", "g"), subscribe(EDS, &["e1", "e2"])).await;
    assert_eq!(c.recv_ack().await.resources.len(), 2);
    assert_eq!(b.cp.stats().streams_opened, 0, "the primary is used first");

    a.stop();
    drop(a);
    // The relay fails over to B; versions are per server, so it sends no IRV (C6) and B sends
    // everything; the client sees only the real difference and no removal.
    let r = c.recv_ack().await;
    assert_eq!(names(&r), vec![("e2".into(), "b2".into())]);
    assert!(r.removed_resources.is_empty());
    c.expect_silence(Duration::from_millis(200)).await;
    let stats = b.cp.stats();
    assert_eq!(stats.streams_opened, 1);
    assert!(
        stats.initial_versions.is_empty(),
        "{:?}",
        stats.initial_versions
    );
    let (_, m) = relay.admin_get("/metrics").await;
    assert!(
        metric(&m, "adsrelay_upstream_failovers_total{group=\"g\"}") >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            &format!("adsrelay_upstream_groups{{upstream=\"http://{b_addr}/\"}}")
        ),
        1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_repairs_drift_and_counts_it() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.resilience.resync_interval = Some(Duration::from_secs(1));
    })
    .await;
    let mut c =
        DeltaClient::connect(relay.xds, node("c", "g"), subscribe(EDS, &["e1", "e2"])).await;
    assert_eq!(c.recv_ack().await.resources.len(), 2);
    // The control plane changes e1 and deletes e2 but the push is lost.
    up.cp
        .set_resources_silently(vec![resource(CDS, "c1", "1"), resource(EDS, "e1", "2")]);
    let (mut updated, mut removed) = (Vec::new(), Vec::new());
    while updated.is_empty() || removed.is_empty() {
        let r = c.recv_ack().await;
        updated.extend(names(&r));
        removed.extend(r.removed_resources);
    }
    assert_eq!(updated, vec![("e1".to_string(), "2".to_string())]);
    assert_eq!(removed, vec!["e2".to_string()]);
    // The counter is bumped right after the repair is fanned out.
    let mut m = String::new();
    for _ in 0..50 {
        m = relay.admin_get("/metrics").await.1;
        if metric(&m, "adsrelay_drift_repairs_total{group=\"g\"}") == 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        metric(&m, "adsrelay_drift_repairs_total{group=\"g\"}"),
        2.0,
        "{m}"
    );
    assert!(metric(&m, "adsrelay_upstream_resyncs_total{group=\"g\"}") >= 1.0);
    assert_eq!(
        metric(
            &m,
            "adsrelay_downstream_streams_opened_total{protocol=\"delta\"}"
        ),
        1.0,
        "the client was never disconnected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_staleness_while_serving_cached() {
    let mut up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut c = DeltaClient::connect(relay.xds, node("c", "g"), subscribe(EDS, &["e1"])).await;
    c.recv_ack().await;
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    let json: serde_json::Value =
        serde_json::from_str(body.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(json["state"], "synced");
    assert_eq!(json["groups"][0]["state"], "synced");
    assert_eq!(json["groups"][0]["staleness_seconds"], 0.0);
    up.stop();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    let json: serde_json::Value =
        serde_json::from_str(body.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(json["state"], "serving_cached");
    assert_eq!(json["groups"][0]["state"], "serving_cached");
    let staleness = json["groups"][0]["staleness_seconds"].as_f64().unwrap();
    assert!((0.9..10.0).contains(&staleness), "{staleness}");
    assert!(json["max_staleness_seconds"].as_f64().unwrap() >= staleness);
    assert!(
        json["groups"][0]["last_response_age_seconds"]
            .as_f64()
            .unwrap()
            >= staleness
    );
    // New clients are served from the cache meanwhile.
    let mut late =
        DeltaClient::connect(relay.xds, node("late", "g"), subscribe(EDS, &["e1"])).await;
    assert_eq!(
        names(&late.recv_ack().await),
        vec![("e1".into(), "1".into())]
    );
}
