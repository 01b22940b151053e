//! Operability: `/metrics` passes `promtool check metrics`, a real Prometheus server scrapes a
//! running relay and returns the expected series, and the admin debug endpoints and CSDS report
//! clients that ACKed and one that NACKed.
//!
//! `promtool` and `prometheus` come from Debian's `prometheus` package (scripts/test.sh installs
//! it). Without them these tests fail under CI (`CI` set) and are skipped, loudly, elsewhere.

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use adsrelay::pb::csds::client_status_discovery_service_client::ClientStatusDiscoveryServiceClient;
use adsrelay::pb::csds::{ClientStatusRequest, ClientStatusResponse, ConfigStatus};
use adsrelay::pb::discovery::DeltaDiscoveryRequest;
use adsrelay::pb::envoy::admin::v3::ClientResourceStatus;
use adsrelay::pb::envoy::r#type::matcher::v3::{
    string_matcher::MatchPattern, NodeMatcher, StringMatcher,
};
use serde_json::Value;
use support::*;
use tokio::io::AsyncWriteExt;

/// The path of a tool, or None (and a skip notice) when it is missing outside CI.
fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{name} not found: install Debian's `prometheus` package (scripts/test.sh does)"
        );
        eprintln!("SKIPPING: {name} not installed (apt-get install prometheus)");
    }
    found
}

fn nack(
    resp: &adsrelay::pb::discovery::DeltaDiscoveryResponse,
    message: &str,
) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        error_detail: Some(adsrelay::pb::rpc::Status {
            code: 3,
            message: message.into(),
            details: vec![],
        }),
        ..Default::default()
    }
}

/// An upstream with two clusters and a relay in front of it.
async fn setup() -> (Upstream, RelayUnderTest) {
    let upstream = Upstream::start(vec![resource(CDS, "c1", "1"), resource(CDS, "c2", "7")]).await;
    let relay = RelayUnderTest::start(upstream.addr, Duration::from_secs(30)).await;
    (upstream, relay)
}

/// The value of one series in a Prometheus text exposition, if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

async fn metrics(relay: &RelayUnderTest) -> String {
    let (status, body) = http_request(relay.admin, "GET", "/metrics").await;
    assert_eq!(status, 200, "{body}");
    body
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn promtool_accepts_metrics_and_prometheus_scrapes_the_relay() {
    let (Some(promtool), Some(prometheus)) = (tool("promtool"), tool("prometheus")) else {
        return;
    };
    let (_upstream, relay) = setup().await;
    let mut clients = Vec::new();
    for i in 0..3 {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("envoy-{i}"), "prom"),
            subscribe(CDS, &["c1"]),
        )
        .await;
        c.recv_ack().await;
        clients.push(c);
    }
    let text = metrics(&relay).await;
    eventually_async("3 delta streams and 3 ACKs in /metrics", || async {
        let text = metrics(&relay).await;
        sample(&text, "adsrelay_downstream_streams{protocol=\"delta\"}") == Some(3.0)
            && sample(
                &text,
                &format!("adsrelay_downstream_acks_total{{type_url=\"{CDS}\"}}"),
            ) == Some(3.0)
    })
    .await;
    for name in [
        "adsrelay_downstream_connections",
        "adsrelay_upstream_connected{group=\"prom\"}",
        "adsrelay_fanout_latency_seconds_count",
        &format!("adsrelay_cache_resources{{type_url=\"{CDS}\"}}"),
    ] {
        assert!(
            sample(&text, name).is_some(),
            "{name} missing from:\n{text}"
        );
    }

    // promtool check metrics reads the exposition on stdin.
    let mut check = tokio::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .await
        .unwrap();
    let out = check.wait_with_output().await.unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- metrics ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // A real Prometheus server scraping the relay every second.
    let dir = std::env::temp_dir().join(format!("adsrelay-prom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: adsrelay\n    static_configs:\n      - targets: ['{}']\n",
            relay.admin
        ),
    )
    .unwrap();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let prom_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut server = tokio::process::Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={prom_addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start prometheus");

    let query = |q: &str| {
        let path = format!("/api/v1/query?query={}", percent_encode(q));
        async move {
            match tokio::net::TcpStream::connect(prom_addr).await {
                Ok(_) => {
                    let (status, body) = http_request(prom_addr, "GET", &path).await;
                    if status != 200 {
                        return None;
                    }
                    let v: Value = serde_json::from_str(&body).ok()?;
                    Some(v["data"]["result"].as_array()?.clone())
                }
                Err(_) => None,
            }
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let value = loop {
        if let Some(result) = query("adsrelay_downstream_streams{protocol=\"delta\"}").await {
            if let Some(v) = result
                .first()
                .and_then(|r| r["value"][1].as_str().map(String::from))
            {
                break v;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Prometheus never returned the series"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(value, "3");
    let result = query("sum by (type_url) (adsrelay_downstream_acks_total)")
        .await
        .unwrap();
    assert_eq!(result[0]["metric"]["type_url"], CDS);
    assert_eq!(result[0]["value"][1], "3");
    let result = query("adsrelay_upstream_connected").await.unwrap();
    assert_eq!(result[0]["metric"]["group"], "prom");
    assert_eq!(result[0]["value"][1], "1");
    // The scrape itself was healthy.
    let result = query("up{job=\"adsrelay\"}").await.unwrap();
    assert_eq!(result[0]["value"][1], "1");

    server.kill().await.ok();
    let _ = std::fs::remove_dir_all(&dir);
    drop(clients);
}

async fn eventually_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn get_json(relay: &RelayUnderTest, path: &str) -> Value {
    let (status, body) = http_request(relay.admin, "GET", path).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

async fn fetch_status(relay: &RelayUnderTest, req: ClientStatusRequest) -> ClientStatusResponse {
    let mut csds = ClientStatusDiscoveryServiceClient::connect(format!("http://{}", relay.xds))
        .await
        .unwrap();
    csds.fetch_client_status(req).await.unwrap().into_inner()
}

#[tokio::test]
async fn admin_and_csds_report_acked_and_nacked_clients() {
    let (_upstream, relay) = setup().await;
    // a ACKs c1 (a cache miss); b ACKs c1 (hit) and c2 (miss), in one or two responses; then
    // both are cached and "bad" gets them in one response, and rejects it.
    let mut a =
        DeltaClient::connect(relay.xds, node("envoy-a", "g"), subscribe(CDS, &["c1"])).await;
    a.recv_ack().await;
    let mut b = DeltaClient::connect(
        relay.xds,
        node("envoy-b", "g"),
        subscribe(CDS, &["c1", "c2"]),
    )
    .await;
    let mut b_names = Vec::new();
    let mut b_responses = 0;
    while b_names.len() < 2 {
        b_names.extend(names(&b.recv_ack().await));
        b_responses += 1;
    }
    let mut bad = DeltaClient::connect(
        relay.xds,
        node("envoy-bad", "g"),
        subscribe(CDS, &["c1", "c2"]),
    )
    .await;
    let r = bad.recv().await;
    assert_eq!(names(&r).len(), 2);
    bad.send(nack(&r, "cluster c2: invalid lb_policy")).await;
    // A stream without a node is rejected and counted.
    let status = DeltaClient::try_connect(relay.xds, None, subscribe(CDS, &["c1"]))
        .await
        .err()
        .unwrap_or_else(|| tonic::Status::ok(""));
    let _ = status;

    eventually_async("the NACK reaches /debug/clients", || async {
        let v = get_json(&relay, "/debug/clients?node_id=envoy-bad").await;
        v[0]["types"][0]["state"] == "nacked"
    })
    .await;

    // /debug/clients
    let clients = get_json(&relay, "/debug/clients").await;
    let clients = clients.as_array().unwrap();
    assert_eq!(clients.len(), 3, "{clients:?}");
    for c in clients {
        assert_eq!(c["group"], "g");
        assert_eq!(c["protocol"], "delta");
        assert_rfc3339_now(&c["connected_since"]);
        let t = &c["types"][0];
        assert_eq!(t["type_url"], CDS);
        if c["node_id"] == "envoy-bad" {
            assert_eq!(t["state"], "nacked");
            assert_eq!(t["subscriptions"], 2);
            assert_eq!(
                t["resources"], 0,
                "it rejected the only response: holds nothing"
            );
            assert_eq!(t["last_nack"]["error"], "cluster c2: invalid lb_policy");
            assert_rfc3339_now(&t["last_nack"]["at"]);
            assert!(t["last_ack"].is_null());
        } else {
            let n = if c["node_id"] == "envoy-a" { 1 } else { 2 };
            assert_eq!(t["state"], "acked", "{c}");
            assert_eq!(t["subscriptions"], n);
            assert_eq!(t["resources"], n);
            assert!(t["last_nack"].is_null());
        }
    }

    // /debug/cache, filtered by type and prefix; no bodies.
    let cache = get_json(
        &relay,
        &format!("/debug/cache?type={}&prefix=c2", percent_encode(CDS)),
    )
    .await;
    let types = &cache["groups"][0]["types"];
    assert_eq!(cache["groups"][0]["group"], "g");
    assert_eq!(types[0]["type_url"], CDS);
    assert_eq!(types[0]["resources"], 2);
    let entries = types[0]["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["name"], "c2");
    assert_eq!(entries[0]["version"], "7");
    assert!(entries[0]["bytes"].as_u64().unwrap() > 0);
    assert!(entries[0].get("body").is_none());

    // /debug/upstreams
    let ups = get_json(&relay, "/debug/upstreams").await;
    assert_eq!(ups[0]["group"], "g");
    assert_eq!(ups[0]["connected"], true);
    assert_eq!(ups[0]["clients"], 3);
    assert_eq!(ups[0]["subscriptions"][0]["type_url"], CDS);
    assert_eq!(ups[0]["subscriptions"][0]["names"], 2);
    assert_rfc3339_now(&ups[0]["last_response"]);
    assert_rfc3339_now(&ups[0]["connected_since"]);

    // /debug/config
    let config = get_json(&relay, "/debug/config").await;
    assert_eq!(
        config["upstream"].as_str().unwrap().trim_end_matches('/'),
        format!("http://{}", _upstream.addr)
    );
    assert_eq!(config["unsubscribe_linger"], "30s");

    // State-changing endpoints are POST-only, read-only ones GET-only.
    let (status, _) = http_request(relay.admin, "GET", "/debug/log-level?level=debug").await;
    assert_eq!(status, 405);
    let (status, _) = http_request(relay.admin, "POST", "/debug/clients").await;
    assert_eq!(status, 405);
    let (status, _) = http_request(relay.admin, "GET", "/nope").await;
    assert_eq!(status, 404);
    adsrelay::logging::init(adsrelay::config::LogFormat::Text);
    let (status, body) = http_request(relay.admin, "POST", "/debug/log-level?level=warn").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(get_json(&relay, "/debug/config").await["log_level"], "warn");
    let (status, _) = http_request(
        relay.admin,
        "POST",
        "/debug/log-level?level=adsrelay%3D%5Bbad",
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = http_request(relay.admin, "POST", "/debug/log-level").await;
    assert_eq!(status, 400);

    // CSDS: every client, each resource with its ACK/NACK status.
    let all = fetch_status(&relay, ClientStatusRequest::default()).await;
    assert_eq!(all.config.len(), 3);
    for cfg in &all.config {
        let id = &cfg.node.as_ref().unwrap().id;
        let mut xds = cfg.generic_xds_configs.clone();
        xds.sort_by(|x, y| x.name.cmp(&y.name));
        if id == "envoy-bad" {
            assert_eq!(xds.len(), 2);
            for (x, (name, version)) in xds.iter().zip([("c1", "1"), ("c2", "7")]) {
                // It rejected its first response: it holds no version; the rejected one is in
                // error_state.
                assert_eq!((x.name.as_str(), x.version_info.as_str()), (name, ""));
                assert_eq!(x.type_url, CDS);
                assert_eq!(x.client_status, ClientResourceStatus::Nacked as i32);
                assert_eq!(x.config_status, ConfigStatus::Error as i32);
                let err = x.error_state.as_ref().expect("error_state");
                assert_eq!(err.version_info, version);
                assert_eq!(err.details, "cluster c2: invalid lb_policy");
                assert!(err.last_update_attempt.is_some());
            }
        } else {
            assert_eq!(xds.len(), if id == "envoy-a" { 1 } else { 2 }, "{id}");
            assert_eq!(xds[0].name, "c1");
            assert_eq!(xds[0].version_info, "1");
            assert_eq!(xds[0].client_status, ClientResourceStatus::Acked as i32);
            assert_eq!(xds[0].config_status, ConfigStatus::Synced as i32);
            assert!(xds[0].error_state.is_none());
            // Resource contents are included unless excluded.
            let body = xds[0].xds_config.as_ref().expect("xds_config");
            assert_eq!(body.type_url, CDS);
            assert_eq!(body.value, b"c1@1");
        }
    }
    // Node matchers select clients; exclude_resource_contents drops the bodies.
    let only = fetch_status(
        &relay,
        ClientStatusRequest {
            node_matchers: vec![NodeMatcher {
                node_id: Some(StringMatcher {
                    match_pattern: Some(MatchPattern::Exact("envoy-a".into())),
                    ignore_case: false,
                }),
            }],
            exclude_resource_contents: true,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(only.config.len(), 1);
    assert_eq!(only.config[0].node.as_ref().unwrap().id, "envoy-a");
    assert!(only.config[0].generic_xds_configs[0].xds_config.is_none());
    // StreamClientStatus answers each request.
    let mut csds = ClientStatusDiscoveryServiceClient::connect(format!("http://{}", relay.xds))
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(ClientStatusRequest::default()).await.unwrap();
    let mut stream = csds
        .stream_client_status(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.config.len(), 3);

    // Metrics: ACKs, the NACK, cache hits and misses, the rejected stream.
    let text = metrics(&relay).await;
    let t = |name: &str| format!("{name}{{type_url=\"{CDS}\"}}");
    // b's ACK of its first response is stale if its second was already sent.
    let acks = sample(&text, &t("adsrelay_downstream_acks_total")).unwrap();
    assert!(
        (2.0..=1.0 + b_responses as f64).contains(&acks),
        "{acks}: {text}"
    );
    assert_eq!(
        sample(&text, &t("adsrelay_downstream_nacks_total")),
        Some(1.0)
    );
    // a: c1 miss; b: c1 hit, c2 miss; bad: c1 and c2 hits.
    assert_eq!(
        sample(&text, &t("adsrelay_cache_misses_total")),
        Some(2.0),
        "{text}"
    );
    assert_eq!(sample(&text, &t("adsrelay_cache_hits_total")), Some(3.0));
    assert_eq!(
        sample(&text, &t("adsrelay_downstream_subscriptions")),
        Some(5.0)
    );
    assert_eq!(
        sample(
            &text,
            "adsrelay_downstream_streams_rejected_total{reason=\"missing_node\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "adsrelay_upstream_subscriptions{group=\"g\"}"),
        Some(2.0)
    );
    assert_eq!(sample(&text, &t("adsrelay_cache_resources")), Some(2.0));
    assert!(sample(&text, "adsrelay_fanout_latency_seconds_count").unwrap() >= 2.0);
}

/// A time in /debug JSON: an RFC 3339 UTC string (not serde's `{secs_since_epoch, ..}`), within
/// the last minute.
fn assert_rfc3339_now(v: &serde_json::Value) {
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("time is not an RFC 3339 string: {v}"));
    let now = std::time::SystemTime::now();
    let recent = (0..=60).any(|back| {
        let t = now - std::time::Duration::from_secs(back);
        s.starts_with(&adsrelay::rfc3339::format(t)[..19])
    });
    assert!(
        s.len() == 24 && s.ends_with('Z') && recent,
        "{s} is not an RFC 3339 time of the last minute"
    );
}

/// Issue 13: an idle relay (no client, upstream down) lists every adsrelay_ family, so
/// dashboards and alerts have them before the first client; promtool accepts the exposition.
#[tokio::test]
async fn every_family_is_listed_from_startup() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let relay = RelayUnderTest::start(addr, Duration::from_secs(30)).await;
    let text = metrics(&relay).await;
    let missing: Vec<&str> = adsrelay::metrics::DESCRIPTIONS
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !text.contains(&format!("# TYPE {n} ")))
        .collect();
    assert!(missing.is_empty(), "missing {missing:?} in:\n{text}");
    for series in [
        "adsrelay_downstream_connections_rejected_total",
        "adsrelay_snapshot_write_failures_total",
        "adsrelay_downstream_streams_rejected_total{reason=\"rate_limited\"}",
        "adsrelay_accept_errors_total{listener=\"xds\",reason=\"emfile\"}",
    ] {
        assert_eq!(sample(&text, series), Some(0.0), "{series} in:\n{text}");
    }
    // Process metrics under their conventional names.
    for series in [
        "process_open_fds",
        "process_max_fds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
    ] {
        assert!(
            sample(&text, series).is_some_and(|v| v > 0.0),
            "{series} in:\n{text}"
        );
    }
    let Some(promtool) = tool("promtool") else {
        return;
    };
    let mut check = tokio::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .await
        .unwrap();
    let out = check.wait_with_output().await.unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
