//! Integration: a scripted upstream (the demo control plane) and scripted Delta clients through a
//! real relay over loopback gRPC. Covers C1 (one upstream stream and subscription per name for many
//! clients), refcounted unsubscribes, wildcard, upstream and downstream reconnects with
//! `initial_resource_versions` (A11, A12, C4, C5), and exactly-once fan-out of an update.

mod support;

use std::time::Duration;

use support::*;

const GROUP: &str = "g1";

fn initial() -> Vec<(String, adsrelay::xds::CachedResource)> {
    vec![
        resource(CDS, "c1", "1"),
        resource(CDS, "c2", "1"),
        resource(EDS, "e1", "1"),
        resource(EDS, "e2", "1"),
        resource(EDS, "e3", "1"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_hundred_clients_one_upstream_stream_one_subscription_per_name() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;

    let mut clients = Vec::new();
    for i in 0..100 {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("envoy-{i}"), GROUP),
            subscribe(CDS, &[]),
        )
        .await;
        let cds = c.recv_ack().await;
        assert_eq!(
            names(&cds),
            vec![("c1".into(), "1".into()), ("c2".into(), "1".into())]
        );
        c.send(subscribe(EDS, &["e1", "e2"])).await;
        let eds = c.recv_ack().await;
        assert_eq!(
            names(&eds),
            vec![("e1".into(), "1".into()), ("e2".into(), "1".into())]
        );
        clients.push(c);
    }

    let stats = up.cp.stats();
    println!(
        "aggregation: {} downstream clients -> upstream streams {}, requests {}, subscribes {:?}",
        clients.len(),
        stats.streams_opened,
        stats.requests,
        stats.subscribes
    );
    assert_eq!(
        stats.streams_opened, 1,
        "one upstream stream for the whole group"
    );
    assert_eq!(
        stats.nodes,
        vec![("adsrelay".to_string(), GROUP.to_string())]
    );
    assert_eq!(stats.subscribes.get(&(CDS.into(), "*".into())), Some(&1));
    assert_eq!(stats.subscribes.get(&(EDS.into(), "e1".into())), Some(&1));
    assert_eq!(stats.subscribes.get(&(EDS.into(), "e2".into())), Some(&1));
    assert_eq!(
        stats.subscribes.len(),
        3,
        "nothing else was subscribed upstream"
    );
    // One subscribe per type plus one ACK per upstream response; nothing per client.
    assert!(stats.requests <= 4, "upstream requests: {}", stats.requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_unsubscribes_are_refcounted() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::ZERO).await;
    let mut a = DeltaClient::connect(relay.xds, node("a", GROUP), subscribe(EDS, &["e1"])).await;
    a.recv_ack().await;
    let mut b = DeltaClient::connect(relay.xds, node("b", GROUP), subscribe(EDS, &["e1"])).await;
    b.recv_ack().await;

    a.send(unsubscribe(EDS, &["e1"])).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        up.cp.stats().unsubscribes.get(&(EDS.into(), "e1".into())),
        None
    );

    drop(b); // F9: a client that goes away releases what it held.
    eventually("upstream unsubscribe of e1", || {
        up.cp.stats().unsubscribes.get(&(EDS.into(), "e1".into())) == Some(&1)
    })
    .await;
    assert_eq!(
        up.cp.stats().subscribes.get(&(EDS.into(), "e1".into())),
        Some(&1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_reaches_every_subscriber_exactly_once() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut clients = Vec::new();
    for i in 0..100 {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("n{i}"), GROUP),
            subscribe(EDS, &["e1"]),
        )
        .await;
        c.recv_ack().await;
        clients.push(c);
    }
    let mut next = initial();
    next[2] = resource(EDS, "e1", "2");
    next[3] = resource(EDS, "e2", "2"); // nobody subscribes e2: nobody hears of it
    up.cp.set_resources(next);
    for c in clients.iter_mut() {
        let r = c.recv_ack().await;
        assert_eq!(names(&r), vec![("e1".into(), "2".into())]);
        assert!(r.removed_resources.is_empty());
    }
    for c in clients.iter_mut() {
        c.expect_silence(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcard_clients_get_additions_and_removals() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut c = DeltaClient::connect(relay.xds, node("w", GROUP), subscribe(CDS, &["*"])).await;
    assert_eq!(c.recv_ack().await.resources.len(), 2);
    let mut next = initial();
    next.remove(1); // c2 deleted
    next.push(resource(CDS, "c3", "1"));
    up.cp.set_resources(next);
    let mut added = Vec::new();
    let mut removed = Vec::new();
    while added.is_empty() || removed.is_empty() {
        let r = c.recv_ack().await;
        added.extend(names(&r));
        removed.extend(r.removed_resources);
    }
    assert_eq!(added, vec![("c3".to_string(), "1".to_string())]);
    assert_eq!(removed, vec!["c2".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a11_a12_downstream_reconnect_with_initial_resource_versions() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    // Warm the cache.
    let mut warm = DeltaClient::connect(relay.xds, node("warm", GROUP), subscribe(CDS, &[])).await;
    warm.recv_ack().await;
    // Let the relay's own ACK upstream land before counting.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let requests_before = up.cp.stats().requests;

    // A client that held c1@1 (current), c2@0 (outdated) and gone@1 (deleted meanwhile).
    let mut req = subscribe(CDS, &[]);
    req.initial_resource_versions = [("c1", "1"), ("c2", "0"), ("gone", "1")]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    let mut c = DeltaClient::connect(relay.xds, node("back", GROUP), req).await;
    let r = c.recv_ack().await;
    assert_eq!(
        names(&r),
        vec![("c2".into(), "1".into())],
        "only the changed resource is resent"
    );
    assert_eq!(r.removed_resources, vec!["gone".to_string()]);
    c.expect_silence(Duration::from_millis(200)).await;
    assert_eq!(
        up.cp.stats().requests,
        requests_before,
        "answered from the cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_c5_upstream_reconnect_resubscribes_with_versions_and_keeps_clients() {
    let mut up = Upstream::start(initial()).await;
    let addr = up.addr;
    let relay = RelayUnderTest::start(addr, Duration::from_secs(30)).await;
    let mut c =
        DeltaClient::connect(relay.xds, node("c", GROUP), subscribe(EDS, &["e1", "e2"])).await;
    assert_eq!(c.recv_ack().await.resources.len(), 2);

    up.stop();
    drop(up);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // While the upstream is down the relay serves from its cache (C13) and says so.
    let mut late =
        DeltaClient::connect(relay.xds, node("late", GROUP), subscribe(EDS, &["e1"])).await;
    assert_eq!(
        names(&late.recv_ack().await),
        vec![("e1".into(), "1".into())]
    );
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("serving_cached"), "{body}");

    // The control plane comes back with e2 changed and e1 unchanged.
    let mut next = initial();
    next[3] = resource(EDS, "e2", "2");
    let up2 = Upstream::start_on(addr, next).await;
    let r = c.recv_ack().await;
    assert_eq!(
        names(&r),
        vec![("e2".into(), "2".into())],
        "only the real difference arrives"
    );
    c.expect_silence(Duration::from_millis(200)).await;
    late.expect_silence(Duration::from_millis(10)).await;

    let stats = up2.cp.stats();
    assert_eq!(stats.streams_opened, 1);
    assert_eq!(
        stats.initial_versions.get(&(EDS.into(), "e1".into())),
        Some(&"1".to_string())
    );
    assert_eq!(
        stats.initial_versions.get(&(EDS.into(), "e2".into())),
        Some(&"1".to_string())
    );
    assert_eq!(
        stats.initial_versions.len(),
        2,
        "exactly what the relay holds and wants"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_get_separate_upstream_streams() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut a = DeltaClient::connect(relay.xds, node("a", "east"), subscribe(CDS, &[])).await;
    a.recv_ack().await;
    let mut b = DeltaClient::connect(relay.xds, node("b", "west"), subscribe(CDS, &[])).await;
    b.recv_ack().await;
    let stats = up.cp.stats();
    assert_eq!(stats.streams_opened, 2);
    let mut clusters: Vec<String> = stats.nodes.into_iter().map(|(_, c)| c).collect();
    clusters.sort();
    assert_eq!(clusters, vec!["east".to_string(), "west".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_end_only_their_own_stream() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut good =
        DeltaClient::connect(relay.xds, node("good", GROUP), subscribe(EDS, &["e1"])).await;
    good.recv_ack().await;

    // F10: no node on the first request.
    let mut no_node = DeltaClient::try_connect(relay.xds, None, subscribe(EDS, &["e1"]))
        .await
        .unwrap();
    let status = no_node.recv_status().await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("node"), "{}", status.message());

    // F1: no type_url.
    let mut no_type =
        DeltaClient::connect(relay.xds, node("x", GROUP), subscribe("", &["e1"])).await;
    let status = no_type.recv_status().await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("type_url"),
        "{}",
        status.message()
    );

    // The well-behaved client still gets updates.
    let mut next = initial();
    next[2] = resource(EDS, "e1", "2");
    up.cp.set_resources(next);
    assert_eq!(
        names(&good.recv_ack().await),
        vec![("e1".into(), "2".into())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a10_unknown_name_is_removed_and_arrives_when_created() {
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut c = DeltaClient::connect(relay.xds, node("c", GROUP), subscribe(EDS, &["nope"])).await;
    let r = c.recv_ack().await;
    assert!(r.resources.is_empty());
    assert_eq!(r.removed_resources, vec!["nope".to_string()]);
    let mut next = initial();
    next.push(resource(EDS, "nope", "1"));
    up.cp.set_resources(next);
    assert_eq!(
        names(&c.recv_ack().await),
        vec![("nope".into(), "1".into())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_waits_for_an_unreachable_upstream_and_readyz_says_so() {
    // Nothing listens on this port yet.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let relay = RelayUnderTest::start(port, Duration::from_secs(30)).await;
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("never_synced"), "{body}");
    let (code, _) = relay.admin_get("/healthz").await;
    assert_eq!(code, 200);

    let mut c = DeltaClient::connect(relay.xds, node("early", GROUP), subscribe(CDS, &[])).await;
    // D9: no (empty) wildcard answer from a cold cache.
    c.expect_silence(Duration::from_millis(300)).await;
    let _up = Upstream::start_on(port, initial()).await;
    assert_eq!(c.recv_ack().await.resources.len(), 2);
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
}
