//! Warm restart (docs/deploy.md "Warm restart"): a relay persists its cache to a snapshot and, after a
//! restart, serves clients from it before the upstream answers; a corrupt, foreign or too old
//! snapshot is never served.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use adsrelay::config::{Config, SnapshotConfig};
use adsrelay::pb::discovery::{DeltaDiscoveryResponse, Resource};
use adsrelay::snapshot::{self, Clock};
use adsrelay::xds::CachedResource;
use prost::Message;
use support::*;

const GROUP: &str = "edge";

fn snapshot_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("adsrelay-warm-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Relay settings with warm restart on `path` (periodic writes off the test's path: 1 h).
fn with_snapshot(path: &Path) -> impl FnOnce(&mut Config) {
    let path = path.to_path_buf();
    move |c: &mut Config| {
        c.snapshot = Some(SnapshotConfig {
            path,
            interval: Duration::from_secs(3600),
            max_staleness: Duration::from_secs(3600),
        })
    }
}

fn initial() -> Vec<(String, CachedResource)> {
    vec![
        resource(CDS, "a", "1"),
        resource(CDS, "b", "1"),
        resource(EDS, "e1", "1"),
    ]
}

fn ttl_resource(name: &str, version: &str, ttl_secs: i64) -> (String, CachedResource) {
    let encoded = Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: EDS.into(),
            value: b"x".to_vec(),
        }),
        ttl: Some(prost_types::Duration {
            seconds: ttl_secs,
            nanos: 0,
        }),
        ..Default::default()
    }
    .encode_to_vec();
    (EDS.into(), CachedResource::decode(encoded.into()).unwrap())
}

/// A wildcard CDS + named EDS client, like an Envoy: returns it with what it received.
async fn envoy_like(
    relay: &RelayUnderTest,
    id: &str,
    eds: &[&str],
) -> (DeltaClient, DeltaDiscoveryResponse, DeltaDiscoveryResponse) {
    let mut c = DeltaClient::connect(relay.xds, node(id, GROUP), subscribe(CDS, &[])).await;
    let cds = c.recv_ack().await;
    c.send(subscribe(EDS, eds)).await;
    let eds = c.recv_ack().await;
    (c, cds, eds)
}

/// Runs a relay against `upstream` until a client got everything, then shuts it down gracefully
/// and waits for the snapshot it writes.
async fn prime(path: &Path, upstream: SocketAddr, eds: &[&str]) {
    let mut relay = RelayUnderTest::start_with(upstream, with_snapshot(path)).await;
    let (_c, cds, _) = envoy_like(&relay, "first", eds).await;
    assert_eq!(names(&cds).len(), 2);
    relay.shutdown();
    eventually("snapshot written at graceful shutdown", || path.exists()).await;
}

/// A snapshot written by a relay whose upstream (holding `initial()`, EDS `e1` subscribed) is
/// gone since: the snapshot's folder and file, and the address the upstream had.
async fn primed_then_upstream_gone(test: &str) -> (PathBuf, PathBuf, SocketAddr) {
    let dir = snapshot_dir(test);
    let path = dir.join("cache.snap");
    let mut up = Upstream::start(initial()).await;
    let addr = up.addr;
    prime(&path, addr, &["e1"]).await;
    up.stop();
    drop(up);
    (dir, path, addr)
}

async fn metric(relay: &RelayUnderTest, line_start: &str) -> Option<f64> {
    let (_, body) = relay.admin_get("/metrics").await;
    body.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Polls `/metrics` until `name` is at least `min` (an async `eventually`).
async fn metric_reaches(relay: &RelayUnderTest, name: &str, min: f64) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while metric(relay, name).await < Some(min) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {name} >= {min}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn restarted_relay_serves_the_snapshot_without_upstream() {
    let (dir, path, addr) = primed_then_upstream_gone("serve").await;

    let relay = RelayUnderTest::start_with(addr, with_snapshot(&path)).await;
    // Ready before any client, though the upstream is unreachable: the snapshot will be served.
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"state\": \"serving_snapshot\""), "{body}");
    assert!(body.contains("cache.snap"), "{body}");

    let (_c, cds, eds) = envoy_like(&relay, "after-restart", &["e1"]).await;
    assert_eq!(
        names(&cds),
        vec![("a".into(), "1".into()), ("b".into(), "1".into())],
        "the wildcard is answered from the snapshot"
    );
    assert_eq!(names(&eds), vec![("e1".into(), "1".into())]);
    assert!(cds.removed_resources.is_empty() && eds.removed_resources.is_empty());

    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"group\": \"edge\""), "{body}");
    assert!(body.contains("\"state\": \"serving_snapshot\""), "{body}");
    assert_eq!(
        metric(&relay, "adsrelay_snapshot_loaded_resources").await,
        Some(3.0)
    );
    assert!(metric(&relay, "adsrelay_snapshot_age_seconds")
        .await
        .is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn upstream_return_delivers_only_the_difference() {
    let (dir, path, addr) = primed_then_upstream_gone("diff").await;

    let relay = RelayUnderTest::start_with(addr, with_snapshot(&path)).await;
    let (mut c, _, _) = envoy_like(&relay, "after-restart", &["e1"]).await;

    // The control plane comes back with `a` changed.
    let mut next = initial();
    next[0] = resource(CDS, "a", "2");
    let up2 = Upstream::start_on(addr, next).await;
    let r = c.recv_ack().await;
    assert_eq!(names(&r), vec![("a".into(), "2".into())]);
    assert!(r.removed_resources.is_empty(), "{r:?}");
    c.expect_silence(Duration::from_millis(300)).await;

    // The relay told it what the snapshot held (C4), so it resent nothing unchanged.
    let stats = up2.cp.stats();
    for (t, n) in [(CDS, "a"), (CDS, "b"), (EDS, "e1")] {
        assert_eq!(
            stats.initial_versions.get(&(t.to_string(), n.to_string())),
            Some(&"1".to_string()),
            "{n}: {stats:?}"
        );
    }
    let (_, body) = relay.admin_get("/readyz").await;
    assert!(body.contains("\"state\": \"synced\""), "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn snapshot_never_proves_a_name_gone_only_the_upstream_does() {
    let (dir, path, addr) = primed_then_upstream_gone("absence").await;

    let relay = RelayUnderTest::start_with(addr, with_snapshot(&path)).await;
    // An Envoy that also holds `z` (say, from another replica with newer config) reconnects.
    let mut first = subscribe(CDS, &[]);
    first.initial_resource_versions = [("a", "1"), ("b", "1"), ("z", "1")]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    let mut c = DeltaClient::connect(relay.xds, node("c", GROUP), first).await;
    let r = c.recv_ack().await;
    assert!(
        r.resources.is_empty() && r.removed_resources.is_empty(),
        "the wildcard is answered (A2), unchanged names are not resent (A11) and the snapshot's \
         view does not remove z (D9): {r:?}"
    );
    // The upstream answers: it has no `z`, and now the relay may say so (A12).
    let _up = Upstream::start_on(addr, initial()).await;
    let r = c.recv_ack().await;
    assert_eq!(r.removed_resources, vec!["z".to_string()]);
    assert!(r.resources.is_empty(), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a relay on a rejected snapshot with the upstream down; the client gets nothing, the
/// rejection is counted with `reason`, and the client is served once an upstream answers.
async fn assert_rejected_then_cold(
    path: &Path,
    upstream_port: tokio::net::TcpSocket,
    adjust: impl FnOnce(&mut Config),
    reason: &str,
) {
    let relay_upstream = upstream_port.local_addr().unwrap();
    let relay = RelayUnderTest::start_with(relay_upstream, |c| {
        with_snapshot(path)(c);
        adjust(c);
    })
    .await;
    assert_eq!(
        metric(
            &relay,
            &format!("adsrelay_snapshot_rejected_total{{reason=\"{reason}\"}}")
        )
        .await,
        Some(1.0)
    );
    let (code, body) = relay.admin_get("/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(!body.contains("serving_snapshot"), "{body}");
    let mut c = DeltaClient::connect(relay.xds, node("c", GROUP), subscribe(CDS, &[])).await;
    c.expect_silence(Duration::from_millis(500)).await;

    let mut next = initial();
    next[1] = resource(CDS, "b", "9");
    let _up = Upstream::start_from(upstream_port, next);
    assert_eq!(
        names(&c.recv_ack().await),
        vec![("a".into(), "1".into()), ("b".into(), "9".into())],
        "served from the upstream only"
    );
}

#[tokio::test]
async fn corrupt_snapshot_is_rejected() {
    let (dir, path, addr) = primed_then_upstream_gone("corrupt").await;
    let port = hold_port(addr).await;
    let mut data = std::fs::read(&path).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x01;
    std::fs::write(&path, data).unwrap();
    assert_rejected_then_cold(&path, port, |_| {}, "corrupt").await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn snapshot_of_an_older_format_is_rejected() {
    let (dir, path, addr) = primed_then_upstream_gone("old-format").await;
    let port = hold_port(addr).await;
    // Version 1 (hand-rolled body) under a valid checksum: refused on the version alone.
    let mut data = std::fs::read(&path).unwrap();
    data.truncate(data.len() - 32);
    data[8..12].copy_from_slice(&1u32.to_le_bytes());
    let sum = <sha2::Sha256 as sha2::Digest>::digest(&data);
    data.extend_from_slice(&sum);
    std::fs::write(&path, data).unwrap();
    assert_rejected_then_cold(&path, port, |_| {}, "unsupported_version").await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn foreign_snapshot_is_rejected() {
    let dir = snapshot_dir("foreign");
    let path = dir.join("cache.snap");
    let up = Upstream::start(initial()).await;
    prime(&path, up.addr, &["e1"]).await;
    // The same file, given to a relay of another control plane.
    let other = hold_port("127.0.0.1:0".parse().unwrap()).await;
    assert_rejected_then_cold(&path, other, |_| {}, "foreign").await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn snapshot_older_than_max_staleness_is_rejected() {
    let (dir, path, addr) = primed_then_upstream_gone("old").await;
    let port = hold_port(addr).await;
    // Re-sign the same content as written two hours ago.
    let config = Config::with_upstream(format!("http://{addr}").parse().unwrap());
    let fp = snapshot::fingerprint(&config);
    let clock = Clock::now();
    let mut snap = snapshot::decode(
        &std::fs::read(&path).unwrap(),
        &fp,
        clock,
        Duration::from_secs(3600),
    )
    .unwrap();
    let two_hours = Duration::from_secs(7200);
    snap.written_at -= two_hours;
    for g in snap.groups.values_mut() {
        g.as_of -= two_hours;
    }
    std::fs::write(&path, snapshot::encode(&snap, &fp, clock)).unwrap();
    assert_rejected_then_cold(&path, port, |_| {}, "too_old").await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn ttl_expired_while_down_is_not_served() {
    let dir = snapshot_dir("ttl");
    let path = dir.join("cache.snap");
    let mut resources = initial();
    resources.push(ttl_resource("short", "1", 1));
    resources.push(ttl_resource("long", "1", 3600));
    let mut up = Upstream::start(resources).await;
    let addr = up.addr;
    prime(&path, addr, &["e1", "short", "long"]).await;
    up.stop();
    drop(up);
    // The relay is down longer than `short`'s TTL.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let relay = RelayUnderTest::start_with(addr, with_snapshot(&path)).await;
    let (mut c, _, eds) = envoy_like(&relay, "after-restart", &["e1", "short", "long"]).await;
    assert_eq!(
        names(&eds),
        vec![("e1".into(), "1".into()), ("long".into(), "1".into())]
    );
    assert!(
        eds.removed_resources.is_empty(),
        "not known absent either: {eds:?}"
    );
    c.expect_silence(Duration::from_millis(300)).await;
    assert_eq!(
        metric(&relay, "adsrelay_snapshot_loaded_resources").await,
        Some(4.0),
        "a, b, e1, long"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn snapshot_is_rewritten_periodically_and_write_failures_are_counted() {
    let dir = snapshot_dir("periodic");
    let path = dir.join("cache.snap");
    let up = Upstream::start(initial()).await;
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        with_snapshot(&path)(c);
        if let Some(s) = c.snapshot.as_mut() {
            s.interval = Duration::from_secs(1);
        }
    })
    .await;
    let (_c, _, _) = envoy_like(&relay, "c", &["e1"]).await;
    // No shutdown: the periodic write alone must leave a loadable snapshot (a crash loses at most
    // one interval).
    metric_reaches(&relay, "adsrelay_snapshot_writes_total", 1.0).await;
    assert!(path.exists());
    let config = Config::with_upstream(format!("http://{}", up.addr).parse().unwrap());
    let snap = snapshot::decode(
        &std::fs::read(&path).unwrap(),
        &snapshot::fingerprint(&config),
        Clock::now(),
        Duration::from_secs(3600),
    )
    .unwrap();
    assert_eq!(snap.groups[GROUP].resource_count(), 3);

    let unwritable = dir.join("missing-dir").join("cache.snap");
    let broken = RelayUnderTest::start_with(up.addr, |c| {
        with_snapshot(&unwritable)(c);
        if let Some(s) = c.snapshot.as_mut() {
            s.interval = Duration::from_secs(1);
        }
    })
    .await;
    metric_reaches(&broken, "adsrelay_snapshot_write_failures_total", 1.0).await;
    assert!(!unwritable.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
