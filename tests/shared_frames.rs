//! Shared frames (the fan-out's hot path): a response that many clients are due identically is
//! encoded once and the same bytes go to every one of them, while each stream keeps its own nonce
//! discipline (A17, A18, F6) and clients in a different state (other versions held, another
//! variant) get a response of their own.

mod support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, ResourceLocator};
use adsrelay::pb::rpc::Status as RpcStatus;
use adsrelay::xds::{DeltaStream, Store};
use prost::Message;
use support::*;

const GROUP: &str = "frames";

/// `series`' value in a /metrics scrape (0 when absent).
fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn frames(relay: &RelayUnderTest) -> (f64, f64) {
    let (status, body) = relay.admin_get("/metrics").await;
    assert_eq!(status, 200);
    (
        metric(&body, "adsrelay_downstream_frames_total{origin=\"shared\"}"),
        metric(
            &body,
            "adsrelay_downstream_frames_total{origin=\"encoded\"}",
        ),
    )
}

/// Waits until the relay has written `total` responses; returns (shared, encoded).
async fn frames_when(relay: &RelayUnderTest, total: f64) -> (f64, f64) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let (shared, encoded) = frames(relay).await;
        if shared + encoded >= total {
            return (shared, encoded);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{total} responses not written: {shared} shared, {encoded} encoded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn nack(resp: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        error_detail: Some(RpcStatus {
            code: 3,
            message: "rejected by the test".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a17_f6_one_change_is_one_frame_for_every_stream_with_per_stream_nonces() {
    const N: usize = 10;
    let up = Upstream::start(vec![resource(CDS, "c1", "1"), resource(CDS, "c2", "1")]).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut clients = Vec::new();
    let mut joins = Vec::new();
    for i in 0..N {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("e{i}"), GROUP),
            subscribe(CDS, &[]),
        )
        .await;
        joins.push(c.recv_ack().await);
        clients.push(c);
    }
    // Every client joined with the same state: one response, identical to the byte (same nonce).
    assert_eq!(
        names(&joins[0]),
        vec![("c1".into(), "1".into()), ("c2".into(), "1".into())]
    );
    assert!(joins.iter().all(|r| *r == joins[0]), "{joins:?}");
    let (shared, encoded) = frames_when(&relay, N as f64).await;
    assert_eq!(
        (shared, encoded),
        (N as f64 - 1.0, 1.0),
        "encoded once, shared N-1 times"
    );

    // One change: one frame again, with a nonce none of the streams has seen.
    up.cp
        .set_resources(vec![resource(CDS, "c1", "2"), resource(CDS, "c2", "1")]);
    let mut updates = Vec::new();
    for c in clients.iter_mut() {
        updates.push(c.recv().await);
    }
    assert_eq!(names(&updates[0]), vec![("c1".into(), "2".into())]);
    assert!(updates.iter().all(|r| *r == updates[0]));
    assert_ne!(updates[0].nonce, joins[0].nonce);
    let (shared, encoded) = frames_when(&relay, 2.0 * N as f64).await;
    assert_eq!(encoded, 2.0, "{shared} shared");

    // F6: client 0 answers with a stale nonce: ignored, nothing is sent.
    clients[0].send(ack(&joins[0])).await;
    // A18: client 1 rejects the update; the relay does not push it again.
    clients[1].send(nack(&updates[1])).await;
    for c in clients.iter().skip(2) {
        c.send(ack(&updates[0])).await;
    }
    clients[0].expect_silence(Duration::from_millis(200)).await;
    clients[1].expect_silence(Duration::from_millis(50)).await;
    // A17 on a shared stream: client 2 subscribes by name to c2, which it holds through the
    // wildcard: it gets c2 again, in a frame of its own with a nonce it has not seen.
    clients[2].send(subscribe(CDS, &["c2"])).await;
    let resend = clients[2].recv_ack().await;
    assert_eq!(names(&resend), vec![("c2".into(), "1".into())]);
    let seen: HashSet<&str> = [&joins[2], &updates[2], &resend]
        .iter()
        .map(|r| r.nonce.as_str())
        .collect();
    assert_eq!(seen.len(), 3, "a stream never sees a nonce twice");

    // The next change reaches everyone, the stale-nonce and NACKing clients included.
    clients[0].send(ack(&updates[0])).await;
    up.cp
        .set_resources(vec![resource(CDS, "c1", "3"), resource(CDS, "c2", "1")]);
    let mut next = Vec::new();
    for c in clients.iter_mut() {
        next.push(c.recv().await);
    }
    assert_eq!(names(&next[0]), vec![("c1".into(), "3".into())]);
    assert!(next.iter().all(|r| *r == next[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a11_clients_holding_other_versions_get_a_response_of_their_own() {
    let up = Upstream::start(vec![resource(CDS, "c1", "2"), resource(CDS, "c2", "1")]).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut fresh =
        DeltaClient::connect(relay.xds, node("fresh", GROUP), subscribe(CDS, &[])).await;
    assert_eq!(
        names(&fresh.recv_ack().await),
        vec![("c1".into(), "2".into()), ("c2".into(), "1".into())]
    );
    let with_versions = |held: &[(&str, &str)]| DeltaDiscoveryRequest {
        type_url: CDS.into(),
        initial_resource_versions: held
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    // Holds c1@1: gets only c1@2, not the fresh client's frame.
    let mut behind = DeltaClient::connect(
        relay.xds,
        node("behind", GROUP),
        with_versions(&[("c1", "1"), ("c2", "1")]),
    )
    .await;
    assert_eq!(
        names(&behind.recv_ack().await),
        vec![("c1".into(), "2".into())]
    );
    // Holds everything current: an empty answer to its wildcard (A2), nothing else.
    let mut current = DeltaClient::connect(
        relay.xds,
        node("current", GROUP),
        with_versions(&[("c1", "2"), ("c2", "1")]),
    )
    .await;
    let r = current.recv_ack().await;
    assert!(
        r.resources.is_empty() && r.removed_resources.is_empty(),
        "{r:?}"
    );
    let (_, encoded) = frames_when(&relay, 3.0).await;
    assert_eq!(encoded, 3.0, "three different contents, three frames");
}

fn by_locator(env: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_locators_subscribe: vec![ResourceLocator {
            name: "foo".into(),
            dynamic_parameters: HashMap::from([("env".to_string(), env.to_string())]),
        }],
        ..Default::default()
    }
}

fn decode(frame: &adsrelay::xds::Frame) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse::decode(&frame.bytes[5..]).expect("a DeltaDiscoveryResponse")
}

#[test]
fn e9_variant_subscribers_share_only_their_variants_frame() {
    let store = Store::complete(vec![
        variant("foo", "prod", "p1"),
        variant("foo", "test", "t1"),
    ]);
    let open = |env: &str| {
        let mut s = DeltaStream::new();
        s.on_request(&by_locator(env)).unwrap();
        s
    };
    let (mut prod_a, mut prod_b, mut test) = (open("prod"), open("prod"), open("test"));
    let a = prod_a.next_frame(&store).expect("prod answered").frame;
    let b = prod_b.next_frame(&store).expect("prod answered").frame;
    let t = test.next_frame(&store).expect("test answered").frame;
    assert_eq!(
        a.bytes.as_ptr(),
        b.bytes.as_ptr(),
        "one frame for both prod clients"
    );
    assert_ne!(a.bytes, t.bytes);
    let body = |r: &DeltaDiscoveryResponse| {
        r.resources
            .iter()
            .map(|r| String::from_utf8(r.resource.as_ref().unwrap().value.clone()).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(body(&decode(&a)), ["foo/prod@p1"]);
    assert_eq!(body(&decode(&t)), ["foo/test@t1"]);
    assert_eq!(
        decode(&t).resources[0]
            .resource_name
            .as_ref()
            .unwrap()
            .dynamic_parameter_constraints,
        Some(env_is("test"))
    );
}

/// A2 / A11: Delta clients joining by wildcard with nothing held get the type's whole content,
/// built once for all of them (one frame); a client that reports versions gets only what differs
/// (nothing but the A2 answer when it holds everything); a NACK takes back what the shared answer
/// gave, on that stream alone (A23).
#[test]
fn a2_wildcard_joins_share_the_whole_content_and_keep_their_own_records() {
    let store = Store::complete(vec![
        resource(CDS, "c1", "1"),
        resource(CDS, "c2", "1"),
        resource(CDS, "c3", "1"),
    ]);
    let join = || {
        let mut s = DeltaStream::new();
        s.on_request(&subscribe(CDS, &[])).unwrap();
        s
    };
    let (mut a, mut b) = (join(), join());
    let fa = a.next_frame(&store).expect("a answered").frame;
    let fb = b.next_frame(&store).expect("b answered").frame;
    assert_eq!(fa.bytes.as_ptr(), fb.bytes.as_ptr(), "one frame for both");
    let all: Vec<(String, String)> = ["c1", "c2", "c3"]
        .iter()
        .map(|n| (n.to_string(), "1".to_string()))
        .collect();
    let (ra, rb) = (decode(&fa), decode(&fb));
    assert_eq!(names(&ra), all);

    let mut warm = DeltaStream::new();
    let mut resume = subscribe(CDS, &[]);
    resume
        .initial_resource_versions
        .insert("c1".into(), "1".into());
    warm.on_request(&resume).unwrap();
    let rw = decode(&warm.next_frame(&store).expect("warm answered").frame);
    assert_eq!(names(&rw), all[1..], "only what the client does not hold");

    // A resume reporting exactly the current content is owed only the empty answer (A2); one
    // reporting an old version of c1 gets c1 alone.
    let resume_with = |versions: &[(&str, &str)]| {
        let mut s = DeltaStream::new();
        let mut r = subscribe(CDS, &[]);
        for (n, v) in versions {
            r.initial_resource_versions
                .insert(n.to_string(), v.to_string());
        }
        s.on_request(&r).unwrap();
        s
    };
    let mut current = resume_with(&[("c1", "1"), ("c2", "1"), ("c3", "1")]);
    let rc = decode(&current.next_frame(&store).expect("A2: answered").frame);
    assert!(rc.resources.is_empty() && rc.removed_resources.is_empty());
    assert_eq!(current.view(false)[0].held, 3);
    assert!(current.next_frame(&store).is_none(), "answered once");
    let mut stale = resume_with(&[("c1", "0"), ("c2", "1"), ("c3", "1")]);
    let rs = decode(&stale.next_frame(&store).expect("stale answered").frame);
    assert_eq!(names(&rs), all[..1]);

    a.on_request(&nack(&ra)).unwrap();
    b.on_request(&ack(&rb)).unwrap();
    let held = |s: &DeltaStream| s.view(false)[0].held;
    assert_eq!(held(&a), 0, "a NACK gives back what the shared answer gave");
    assert_eq!(held(&b), 3);
    assert!(
        a.next_frame(&store).is_none(),
        "a rejected answer is not sent again unchanged"
    );
}
