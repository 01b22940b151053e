//! TLS and mTLS (docs/configure.md "TLS and mTLS"): a real Envoy over mTLS, clients without (or with a wrong)
//! certificate refused, a rotated server certificate picked up without a restart, certificate
//! identities mapped to the groups they may join, and upstream mTLS with server-name verification
//! (a relay chained behind another relay serving mTLS). Certificates are minted per test (rcgen).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use adsrelay::config::Config;
use adsrelay::pb::discovery::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use adsrelay::tls::{
    Authorization, AuthorizationRule, ClientTlsSettings, ServerTls, ServerTlsSettings, UpstreamTls,
};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use support::envoy::{free_port, Envoy};
use support::{node, resource, subscribe, DeltaClient, RelayUnderTest, Upstream, CDS};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const RELAY_NAME: &str = "adsrelay.example.internal";

/// A test CA and a directory for the PEM files it issues (removed when dropped).
struct Pki {
    dir: PathBuf,
    _tmp: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and key written to disk.
#[derive(Clone)]
struct Issued {
    cert: PathBuf,
    key: PathBuf,
    cert_pem: String,
    key_pem: String,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("adsrelay-tls-{name}-"))
            .tempdir()
            .unwrap();
        let dir = tmp.path().to_path_buf();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("adsrelay test CA {name}"));
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
        Pki { dir, _tmp: tmp, ca }
    }

    fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// Issues a certificate with `dns` and `uri` SANs, subject `cn`, written as `file`.crt/.key.
    fn issue(&self, file: &str, cn: &str, dns: &[&str], uri: &[&str]) -> Issued {
        self.issue_with_key(file, cn, dns, uri, KeyPair::generate().unwrap())
    }

    fn issue_with_key(
        &self,
        file: &str,
        cn: &str,
        dns: &[&str],
        uri: &[&str],
        key: KeyPair,
    ) -> Issued {
        let mut params =
            CertificateParams::new(dns.iter().map(|d| d.to_string()).collect::<Vec<_>>()).unwrap();
        for u in uri {
            params
                .subject_alt_names
                .push(SanType::URI((*u).try_into().unwrap()));
        }
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &*self.ca).unwrap();
        let issued = Issued {
            cert: self.dir.join(format!("{file}.crt")),
            key: self.dir.join(format!("{file}.key")),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        };
        std::fs::write(&issued.key, &issued.key_pem).unwrap();
        std::fs::write(&issued.cert, &issued.cert_pem).unwrap();
        issued
    }
}

fn server_tls(server: &Issued, client_ca: Option<&Path>, reload: Duration) -> Arc<ServerTls> {
    ServerTls::new(ServerTlsSettings {
        cert: server.cert.clone(),
        key: server.key.clone(),
        client_ca: client_ca.map(Path::to_path_buf),
        reload_interval: reload,
    })
    .expect("valid test certificates")
}

/// A TLS channel to the relay trusting `ca`, presenting `identity` if given.
async fn tls_channel(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<&Issued>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name(RELAY_NAME);
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(&id.cert_pem, &id.key_pem));
    }
    Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect()
        .await
}

async fn open(
    channel: Channel,
    cluster: &str,
    names: &[&str],
) -> Result<DeltaClient, tonic::Status> {
    DeltaClient::try_open(
        AggregatedDiscoveryServiceClient::new(channel),
        Some(node(&format!("{cluster}-envoy"), cluster)),
        subscribe(CDS, names),
    )
    .await
}

/// The value of a metric line (`name{labels}` exactly), 0 if absent.
async fn metric(relay: &RelayUnderTest, series: &str) -> f64 {
    let (_, text) = relay.admin_get("/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

async fn eventually_metric(relay: &RelayUnderTest, series: &str, at_least: f64) {
    let deadline = tokio::time::Instant::now() + support::TIMEOUT;
    loop {
        let v = metric(relay, series).await;
        if v >= at_least {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} is {v}, expected at least {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gets_its_config_over_mtls() {
    let pki = Pki::new("envoy");
    let server = pki.issue("relay", "relay", &[RELAY_NAME], &[]);
    let client = pki.issue("envoy", "envoy", &[], &["spiffe://test/envoy"]);
    let listener_port = free_port();
    let example = adsrelay::demo::resources::EXAMPLE
        .replace("port = 10000", &format!("port = {listener_port}"));
    let up = Upstream::start(adsrelay::demo::resources::parse(&example, "test").unwrap()).await;
    let ca = pki.ca_path();
    let tls = server_tls(&server, Some(&ca), Duration::from_secs(10));
    let relay = RelayUnderTest::start_with(up.addr, |c| c.tls = Some(tls)).await;

    let (cert, key, ca) = (client.cert.clone(), client.key.clone(), pki.ca_path());
    let mut envoy = Envoy::start_edited(
        "bootstrap-delta-mtls.yaml",
        relay.xds.port(),
        "envoy-mtls",
        "mtls",
        |t| {
            t.replace("/etc/envoy/tls/client.crt", &cert.display().to_string())
                .replace("/etc/envoy/tls/client.key", &key.display().to_string())
                .replace("/etc/envoy/tls/ca.crt", &ca.display().to_string())
        },
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(envoy.is_running(), "envoy exited:\n{}", envoy.log_tail());
        let dump = envoy.admin_get("/config_dump").await;
        if dump.contains("\"listener_0\"") && dump.contains("\"demo_backend\"") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "envoy got no config over mTLS:\n{}",
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The relay saw Envoy's client as a verified TLS peer and nothing failed.
    let (_, clients) = relay.admin_get("/debug/clients").await;
    assert!(clients.contains("envoy-mtls"), "{clients}");
    for reason in [
        "no_client_certificate",
        "bad_client_certificate",
        "client_alert",
    ] {
        let series = format!("adsrelay_tls_handshake_failures_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&relay, &series).await, 0.0, "{series}");
    }
}

#[tokio::test]
async fn clients_without_a_trusted_certificate_are_refused() {
    let pki = Pki::new("refuse");
    let other = Pki::new("refuse-other");
    let server = pki.issue("relay", "relay", &[RELAY_NAME], &[]);
    let good = pki.issue("good", "good", &[], &["spiffe://test/good"]);
    let foreign = other.issue("foreign", "foreign", &[], &["spiffe://test/foreign"]);
    let up = Upstream::start(vec![resource(CDS, "a", "1")]).await;
    let ca = pki.ca_path();
    let tls = server_tls(&server, Some(&ca), Duration::from_secs(10));
    let relay = RelayUnderTest::start_with(up.addr, |c| c.tls = Some(tls)).await;

    // No certificate: TLS 1.3 lets the client finish its side, then the relay refuses; the
    // stream cannot be opened either way.
    let refused = match tls_channel(relay.xds, &pki.ca_pem(), None).await {
        Ok(ch) => open(ch, "c", &["a"]).await.err(),
        Err(e) => Some(tonic::Status::unavailable(e.to_string())),
    };
    assert!(
        refused.is_some(),
        "a client without a certificate got a stream"
    );
    eventually_metric(
        &relay,
        "adsrelay_tls_handshake_failures_total{reason=\"no_client_certificate\"}",
        1.0,
    )
    .await;

    // A certificate from another CA.
    let refused = match tls_channel(relay.xds, &pki.ca_pem(), Some(&foreign)).await {
        Ok(ch) => open(ch, "c", &["a"]).await.err(),
        Err(e) => Some(tonic::Status::unavailable(e.to_string())),
    };
    assert!(
        refused.is_some(),
        "a client with a foreign certificate got a stream"
    );
    eventually_metric(
        &relay,
        "adsrelay_tls_handshake_failures_total{reason=\"bad_client_certificate\"}",
        1.0,
    )
    .await;

    // Plaintext gRPC on the TLS port.
    assert!(
        DeltaClient::try_connect(relay.xds, Some(node("p", "c")), subscribe(CDS, &["a"]))
            .await
            .is_err()
    );
    eventually_metric(
        &relay,
        "adsrelay_tls_handshake_failures_total{reason=\"protocol\"}",
        1.0,
    )
    .await;

    // A trusted client is served.
    let ch = tls_channel(relay.xds, &pki.ca_pem(), Some(&good))
        .await
        .unwrap();
    let mut c = open(ch, "c", &["a"]).await.unwrap();
    assert_eq!(support::names(&c.recv().await), [("a".into(), "1".into())]);
}

/// The certificate a fresh TLS connection to the relay is shown.
async fn presented_certificate(addr: std::net::SocketAddr, ca: &str, client: &Issued) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(
        vec![CertificateDer::from_pem_slice(client.cert_pem.as_bytes()).unwrap()],
        PrivateKeyDer::from_pem_slice(client.key_pem.as_bytes()).unwrap(),
    )
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(RELAY_NAME).unwrap(), tcp)
        .await
        .expect("TLS handshake with the relay");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn der_of(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

#[tokio::test]
async fn a_rotated_certificate_is_used_for_new_connections_without_a_restart() {
    let pki = Pki::new("rotate");
    let key = KeyPair::generate().unwrap();
    let key_pem = key.serialize_pem();
    let old = pki.issue_with_key("relay", "relay v1", &[RELAY_NAME], &[], key);
    let client = pki.issue("client", "client", &[], &["spiffe://test/client"]);
    let up = Upstream::start(vec![resource(CDS, "a", "1")]).await;
    let ca = pki.ca_path();
    let tls = server_tls(&old, Some(&ca), Duration::from_millis(100));
    let relay = RelayUnderTest::start_with(up.addr, |c| c.tls = Some(tls)).await;

    assert_eq!(
        presented_certificate(relay.xds, &pki.ca_pem(), &client).await,
        der_of(&old.cert_pem)
    );
    let ch = tls_channel(relay.xds, &pki.ca_pem(), Some(&client))
        .await
        .unwrap();
    let mut existing = open(ch, "c", &["a"]).await.unwrap();
    existing.recv_ack().await;

    // Rotate: same key file, a new certificate (new serial and subject) written over the old.
    let new = pki.issue_with_key(
        "relay",
        "relay v2",
        &[RELAY_NAME],
        &[],
        KeyPair::from_pem(&key_pem).unwrap(),
    );
    assert_ne!(der_of(&new.cert_pem), der_of(&old.cert_pem));
    eventually_metric(
        &relay,
        "adsrelay_tls_certificate_reloads_total{result=\"applied\"}",
        1.0,
    )
    .await;
    assert_eq!(
        presented_certificate(relay.xds, &pki.ca_pem(), &client).await,
        der_of(&new.cert_pem)
    );

    // The stream opened before the rotation is still served.
    up.cp.set_resources(vec![resource(CDS, "a", "2")]);
    assert_eq!(
        support::names(&existing.recv().await),
        [("a".into(), "2".into())]
    );

    // A broken file is refused at reload time; the current certificate stays in use.
    std::fs::write(&new.cert, "not a certificate").unwrap();
    eventually_metric(
        &relay,
        "adsrelay_tls_certificate_reloads_total{result=\"failed\"}",
        1.0,
    )
    .await;
    assert_eq!(
        presented_certificate(relay.xds, &pki.ca_pem(), &client).await,
        der_of(&new.cert_pem)
    );
}

#[tokio::test]
async fn a_tenant_identity_cannot_join_another_tenants_group() {
    let pki = Pki::new("authz");
    let server = pki.issue("relay", "relay", &[RELAY_NAME], &[]);
    let tenant_a = pki.issue("a", "a", &[], &["spiffe://test/tenant-a/envoy"]);
    let tenant_b = pki.issue("b", "b", &[], &["spiffe://test/tenant-b/envoy"]);
    let up = Upstream::start(vec![resource(CDS, "a", "1")]).await;
    let ca = pki.ca_path();
    let tls = server_tls(&server, Some(&ca), Duration::from_secs(10));
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.tls = Some(tls);
        c.tls_authorization = Authorization {
            rules: vec![
                AuthorizationRule {
                    identity: "spiffe://test/tenant-a/*".into(),
                    groups: vec!["tenant-a".into()],
                },
                AuthorizationRule {
                    identity: "spiffe://test/tenant-b/*".into(),
                    groups: vec!["tenant-b".into()],
                },
            ],
        };
    })
    .await;
    let ca_pem = pki.ca_pem();

    let ch = tls_channel(relay.xds, &ca_pem, Some(&tenant_b))
        .await
        .unwrap();
    let mut b = open(ch, "tenant-b", &["a"]).await.unwrap();
    b.recv_ack().await;

    // Tenant A's certificate, claiming to be in tenant-b.
    let ch = tls_channel(relay.xds, &ca_pem, Some(&tenant_a))
        .await
        .unwrap();
    let status = match open(ch.clone(), "tenant-b", &["a"]).await {
        Ok(mut c) => c.recv_status().await,
        Err(s) => s,
    };
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("spiffe://test/tenant-a/envoy")
            && status.message().contains("\"tenant-b\""),
        "{}",
        status.message()
    );
    eventually_metric(
        &relay,
        "adsrelay_downstream_streams_rejected_total{reason=\"unauthorized\"}",
        1.0,
    )
    .await;

    // Its own group, on the same connection, is fine; tenant B is undisturbed.
    let mut a = open(ch, "tenant-a", &["a"]).await.unwrap();
    a.recv_ack().await;
    up.cp.set_resources(vec![resource(CDS, "a", "2")]);
    assert_eq!(support::names(&b.recv().await), [("a".into(), "2".into())]);
}

#[tokio::test]
async fn upstream_mtls_verifies_the_server_name() {
    let pki = Pki::new("upstream");
    let inner_server = pki.issue("inner", "inner", &["upstream.example.internal"], &[]);
    let outer_client = pki.issue("outer", "outer", &[], &["spiffe://test/outer-relay"]);
    let up = Upstream::start(vec![resource(CDS, "a", "1")]).await;
    let ca = pki.ca_path();
    let tls = server_tls(&inner_server, Some(&ca), Duration::from_secs(10));
    // The inner relay serves mTLS and is the outer relays' control plane.
    let inner = RelayUnderTest::start_with(up.addr, |c| c.tls = Some(tls)).await;
    let upstream_tls = |name: &str| {
        let settings = ClientTlsSettings {
            ca: Some(pki.ca_path()),
            cert: Some(outer_client.cert.clone()),
            key: Some(outer_client.key.clone()),
            server_name: Some(name.to_string()),
        };
        let inner_addr = inner.xds;
        move |c: &mut Config| {
            c.upstream = format!("https://{inner_addr}").parse().unwrap();
            c.upstreams = vec![c.upstream.clone()];
            c.upstream_tls = UpstreamTls::new(settings);
        }
    };
    let outer =
        RelayUnderTest::start_with(inner.xds, upstream_tls("upstream.example.internal")).await;
    let mut client = DeltaClient::connect(outer.xds, node("e", "c"), subscribe(CDS, &["a"])).await;
    assert_eq!(
        support::names(&client.recv().await),
        [("a".into(), "1".into())]
    );
    let (code, _) = outer.admin_get("/readyz").await;
    assert_eq!(code, 200);

    // The inner relay's certificate does not carry the expected name: no connection, not ready.
    let wrong = RelayUnderTest::start_with(inner.xds, upstream_tls("wrong.example.internal")).await;
    eventually_metric(
        &inner,
        "adsrelay_tls_handshake_failures_total{reason=\"client_alert\"}",
        1.0,
    )
    .await;
    let (code, body) = wrong.admin_get("/readyz").await;
    assert_eq!(code, 503, "{body}");
    // A client's group shows why it is not connected.
    let _client = DeltaClient::try_connect(wrong.xds, Some(node("e", "c")), subscribe(CDS, &["a"]))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + support::TIMEOUT;
    loop {
        let (_, upstreams) = wrong.admin_get("/debug/upstreams").await;
        if upstreams.contains("certificate not valid for name \\\"wrong.example.internal\\\"") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{upstreams}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn tls_connections_are_counted_limited_and_drained() {
    let pki = Pki::new("drain");
    let server = pki.issue("relay", "relay", &[RELAY_NAME], &[]);
    let client = pki.issue("client", "client", &[], &["spiffe://test/client"]);
    let up = Upstream::start(vec![resource(CDS, "a", "1")]).await;
    let ca = pki.ca_path();
    let tls = server_tls(&server, Some(&ca), Duration::from_secs(10));
    let mut relay = RelayUnderTest::start_with(up.addr, |c| {
        c.tls = Some(tls);
        c.limits.max_connections = 1;
    })
    .await;
    let ch = tls_channel(relay.xds, &pki.ca_pem(), Some(&client))
        .await
        .unwrap();
    let mut first = open(ch, "c", &["a"]).await.unwrap();
    first.recv_ack().await;
    assert_eq!(
        metric(&relay, "adsrelay_downstream_connections ").await,
        1.0
    );

    // Over max_connections: closed before any handshake.
    let second = match tls_channel(relay.xds, &pki.ca_pem(), Some(&client)).await {
        Ok(ch) => open(ch, "c", &["a"]).await.err(),
        Err(e) => Some(tonic::Status::unavailable(e.to_string())),
    };
    assert!(
        second.is_some(),
        "a connection over max_connections was served"
    );
    eventually_metric(
        &relay,
        "adsrelay_downstream_connections_rejected_total ",
        1.0,
    )
    .await;

    // Graceful shutdown closes the TLS connection too.
    relay.shutdown();
    first.wait_closed(Duration::from_secs(5)).await;
}

#[test]
fn unusable_tls_files_are_config_errors_naming_the_setting_and_the_file() {
    use adsrelay::config::Settings;
    let mut args = Settings {
        upstream: Some("127.0.0.1:1".into()),
        ..Default::default()
    };
    args.tls_cert = Some("/nonexistent/relay.crt".into());
    args.tls_key = Some("/nonexistent/relay.key".into());
    let e = args.into_config().unwrap_err().to_string();
    assert!(
        e.contains("--tls-cert") && e.contains("tls_cert") && e.contains("/nonexistent/relay.crt"),
        "{e}"
    );

    let pki = Pki::new("config");
    let a = pki.issue("a", "a", &["x"], &[]);
    let b = pki.issue("b", "b", &["x"], &[]);
    let mut args = Settings {
        upstream: Some("127.0.0.1:1".into()),
        ..Default::default()
    };
    args.tls_cert = Some(a.cert.clone());
    args.tls_key = Some(b.key.clone());
    let e = args.into_config().unwrap_err().to_string();
    assert!(
        e.contains("tls_key") && e.contains(&b.key.display().to_string()),
        "{e}"
    );

    let mut args = Settings {
        upstream: Some("127.0.0.1:1".into()),
        ..Default::default()
    };
    args.upstream_ca = Some("/nonexistent/ca.crt".into());
    args.upstream_tls = Some(true);
    let e = args.into_config().unwrap_err().to_string();
    assert!(
        e.contains("--upstream-ca")
            && e.contains("upstream_ca")
            && e.contains("/nonexistent/ca.crt"),
        "{e}"
    );

    // Authorization needs verified client identities.
    let file = pki.dir.join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "upstream = \"127.0.0.1:1\"\ntls_cert = {:?}\ntls_key = {:?}\n\
             [[tls_authorization]]\nidentity = \"spiffe://t/a\"\ngroups = [\"a\"]\n",
            a.cert.display().to_string(),
            a.key.display().to_string()
        ),
    )
    .unwrap();
    let args = Settings {
        config: Some(file.clone()),
        ..Default::default()
    };
    let e = args.into_config().unwrap_err().to_string();
    assert!(
        e.contains(&file.display().to_string())
            && e.contains("tls_authorization")
            && e.contains("tls_client_ca"),
        "{e}"
    );
}
