//! TLS for both sides of the relay (docs/configure.md "TLS and mTLS"), with rustls and the `ring` provider.
//!
//! - Downstream: a server certificate, optionally a client CA (then client certificates are
//!   required and verified). The files are polled and reloaded on change; new connections use the
//!   new certificates, open ones keep theirs. Handshakes run in their own tasks with a timeout so
//!   a slow or hostile client never holds up the accept loop.
//! - The verified client's identity (its URI and DNS SANs) reaches the services through
//!   [`TlsPeer`] in the request extensions; [`Authorization`] maps identities to the groups they
//!   may join.
//! - Upstream: a CA, optionally a client certificate, and the name the server must present. The
//!   files are read again for every upstream session, so a rotation is picked up at the next
//!   reconnect.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tracing::{debug, info, warn};

use crate::accept::CountedIo;
use crate::sync::lock;

/// How long a client may take to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A certificate or key file that cannot be used. Names the setting and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{field} {path}: cannot read: {source}")]
    Read {
        field: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{field} {path}: {message}")]
    Invalid {
        field: &'static str,
        path: String,
        message: String,
    },
}

impl TlsError {
    /// The setting the error is about (for config errors).
    pub fn field(&self) -> &'static str {
        match self {
            TlsError::Read { field, .. } | TlsError::Invalid { field, .. } => field,
        }
    }
}

fn invalid(field: &'static str, path: &Path, message: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        field,
        path: path.display().to_string(),
        message: message.into(),
    }
}

fn read(field: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        field,
        path: path.display().to_string(),
        source,
    })
}

fn parse_certs(
    field: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(field, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(field, path, "no CERTIFICATE block in the file"));
    }
    Ok(certs)
}

fn parse_key(
    field: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| {
        invalid(
            field,
            path,
            format!("no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        )
    })
}

fn roots(field: &'static str, path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in parse_certs(field, path, pem)? {
        store
            .add(cert)
            .map_err(|e| invalid(field, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(store))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Downstream TLS settings (`tls_cert`, `tls_key`, `tls_client_ca`, `tls_reload_interval`).
#[derive(Debug, Clone, PartialEq)]
pub struct ServerTlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Set: client certificates are required and must chain to this CA bundle.
    pub client_ca: Option<PathBuf>,
    pub reload_interval: Duration,
}

impl ServerTlsSettings {
    /// The files' contents, read once: what a reload compares and builds from.
    fn read_files(&self) -> Result<ServerFiles, TlsError> {
        Ok(ServerFiles {
            cert: read("tls_cert", &self.cert)?,
            key: read("tls_key", &self.key)?,
            client_ca: match &self.client_ca {
                Some(p) => Some(read("tls_client_ca", p)?),
                None => None,
            },
        })
    }

    /// Reads and checks the files: the startup validation and every reload.
    pub fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        self.build(&self.read_files()?)
    }

    fn build(&self, files: &ServerFiles) -> Result<Arc<ServerConfig>, TlsError> {
        let certs = parse_certs("tls_cert", &self.cert, &files.cert)?;
        let key = parse_key("tls_key", &self.key, &files.key)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("tls_cert", &self.cert, e.to_string()))?;
        let builder = match (&self.client_ca, &files.client_ca) {
            (Some(path), Some(pem)) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    roots("tls_client_ca", path, pem)?,
                    provider(),
                )
                .build()
                .map_err(|e| invalid("tls_client_ca", path, e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| {
            invalid(
                "tls_key",
                &self.key,
                format!("does not match tls_cert {}: {e}", self.cert.display()),
            )
        })?;
        // gRPC is HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

#[derive(PartialEq)]
struct ServerFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl ServerFiles {
    fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()] {
            let part = part.map(Vec::as_slice).unwrap_or_default();
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.finalize().into()
    }
}

/// Outcome of a certificate reload, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    Applied,
    Failed,
}

/// The downstream server configuration in use, swapped when the files change.
pub struct ServerTls {
    settings: ServerTlsSettings,
    current: RwLock<Arc<ServerConfig>>,
    /// Digest of the files last seen (applied or refused), so a bad file is reported once.
    seen: Mutex<[u8; 32]>,
}

impl std::fmt::Debug for ServerTls {
    // The settings (file names) only: never the keys, and /debug/config prints this.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    pub fn new(settings: ServerTlsSettings) -> Result<Arc<Self>, TlsError> {
        let files = settings.read_files()?;
        let config = settings.build(&files)?;
        Ok(Arc::new(ServerTls {
            settings,
            current: RwLock::new(config),
            seen: Mutex::new(files.digest()),
        }))
    }

    pub fn settings(&self) -> &ServerTlsSettings {
        &self.settings
    }

    pub fn config(&self) -> Arc<ServerConfig> {
        match self.current.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Re-reads the files; if their contents changed, builds and installs the new configuration
    /// (or keeps the old one and warns). `None`: nothing changed.
    pub fn reload(&self) -> Option<Reload> {
        let files = match self.settings.read_files() {
            Ok(f) => f,
            Err(e) => {
                // A file mid-rotation may be briefly missing; report it once per content change.
                let mut seen = lock(&self.seen);
                if *seen == [0; 32] {
                    return None;
                }
                *seen = [0; 32];
                warn!(error = %e, "TLS certificate reload failed; keeping the previous certificate");
                return Some(Reload::Failed);
            }
        };
        let digest = files.digest();
        {
            let mut seen = lock(&self.seen);
            if *seen == digest {
                return None;
            }
            *seen = digest;
        }
        match self.settings.build(&files) {
            Ok(config) => {
                match self.current.write() {
                    Ok(mut c) => *c = config,
                    Err(poisoned) => *poisoned.into_inner() = config,
                }
                info!(cert = %self.settings.cert.display(), "TLS certificate reloaded; new connections use it");
                Some(Reload::Applied)
            }
            Err(e) => {
                warn!(error = %e, "TLS certificate reload failed; keeping the previous certificate");
                Some(Reload::Failed)
            }
        }
    }

    /// Polls the files every `reload_interval` until `stop` changes.
    pub async fn watch(
        self: Arc<Self>,
        on_reload: impl Fn(Reload) + Send + 'static,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.settings.reload_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let this = self.clone();
            // File reads and key parsing are blocking work.
            if let Ok(Some(r)) = tokio::task::spawn_blocking(move || this.reload()).await {
                on_reload(r);
            }
        }
    }
}

/// Why a downstream handshake failed (the `reason` label of
/// `adsrelay_tls_handshake_failures_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// mTLS is on and the client sent no certificate.
    NoClientCertificate,
    /// The client's certificate did not verify (unknown CA, expired, wrong usage...).
    BadClientCertificate,
    /// The client aborted with an alert, typically because it rejected the relay's certificate.
    ClientAlert,
    /// Not TLS, or a TLS protocol error.
    Protocol,
    Timeout,
    /// The connection closed or failed mid-handshake.
    Io,
}

impl HandshakeFailure {
    pub const ALL: [HandshakeFailure; 6] = [
        HandshakeFailure::NoClientCertificate,
        HandshakeFailure::BadClientCertificate,
        HandshakeFailure::ClientAlert,
        HandshakeFailure::Protocol,
        HandshakeFailure::Timeout,
        HandshakeFailure::Io,
    ];

    pub fn label(self) -> &'static str {
        match self {
            HandshakeFailure::NoClientCertificate => "no_client_certificate",
            HandshakeFailure::BadClientCertificate => "bad_client_certificate",
            HandshakeFailure::ClientAlert => "client_alert",
            HandshakeFailure::Protocol => "protocol",
            HandshakeFailure::Timeout => "timeout",
            HandshakeFailure::Io => "io",
        }
    }

    fn classify(e: &std::io::Error) -> Self {
        match e.get_ref().and_then(|r| r.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::NoCertificatesPresented) => HandshakeFailure::NoClientCertificate,
            Some(rustls::Error::InvalidCertificate(_)) => HandshakeFailure::BadClientCertificate,
            Some(rustls::Error::AlertReceived(_)) => HandshakeFailure::ClientAlert,
            Some(_) => HandshakeFailure::Protocol,
            None if e.kind() == std::io::ErrorKind::InvalidData => HandshakeFailure::Protocol,
            None => HandshakeFailure::Io,
        }
    }
}

/// A verified client: its address and the identities (URI and DNS SANs) of its certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerIdentity {
    pub remote_addr: Option<SocketAddr>,
    pub identities: Vec<String>,
}

impl PeerIdentity {
    fn from_cert(remote_addr: Option<SocketAddr>, cert: Option<&CertificateDer<'_>>) -> Self {
        PeerIdentity {
            remote_addr,
            identities: cert.map(|c| san_identities(c)).unwrap_or_default(),
        }
    }
}

/// The URI and DNS subject alternative names of a certificate, in order.
pub fn san_identities(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some(san)) = parsed.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some(u.to_string()),
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .collect()
}

/// Connection info of a TLS connection, in the request extensions of every request on it.
#[derive(Debug, Clone)]
pub struct TlsPeer(pub Arc<PeerIdentity>);

/// A downstream connection after its TLS handshake; counted and drainable through [`CountedIo`].
pub struct TlsIo {
    inner: tokio_rustls::server::TlsStream<CountedIo>,
    peer: Arc<PeerIdentity>,
}

impl Connected for TlsIo {
    type ConnectInfo = TlsPeer;
    fn connect_info(&self) -> TlsPeer {
        TlsPeer(self.peer.clone())
    }
}

impl AsyncRead for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Runs the TLS handshake of every accepted connection in its own task (with
/// [`HANDSHAKE_TIMEOUT`]) and yields the connections that complete it, in completion order.
/// Failures are logged with the peer address and reported to `on_failure`.
pub fn accept<S>(
    incoming: S,
    tls: Arc<ServerTls>,
    on_failure: impl Fn(HandshakeFailure) + Send + Sync + 'static,
) -> ReceiverStream<std::io::Result<TlsIo>>
where
    S: Stream<Item = std::io::Result<CountedIo>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    let on_failure = Arc::new(on_failure);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        loop {
            let conn = tokio::select! {
                c = incoming.next() => c,
                // The server stopped: release the listener.
                () = tx.closed() => return,
            };
            let io = match conn {
                None => return,
                Some(Err(e)) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Some(Ok(io)) => io,
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
            let tx = tx.clone();
            let on_failure = on_failure.clone();
            tokio::spawn(async move {
                let addr = *io
                    .connect_info()
                    .remote_addr()
                    .as_ref()
                    .unwrap_or(&unspecified());
                let result = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await;
                let failure = match result {
                    Ok(Ok(stream)) => {
                        let peer = PeerIdentity::from_cert(
                            Some(addr),
                            stream
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|c| c.first()),
                        );
                        debug!(peer = %addr, identities = ?peer.identities, "TLS handshake completed");
                        let _ = tx
                            .send(Ok(TlsIo {
                                inner: stream,
                                peer: Arc::new(peer),
                            }))
                            .await;
                        return;
                    }
                    Ok(Err(e)) => {
                        let f = HandshakeFailure::classify(&e);
                        warn!(peer = %addr, reason = f.label(), error = %e, "TLS handshake failed");
                        f
                    }
                    Err(_) => {
                        warn!(peer = %addr, timeout = ?HANDSHAKE_TIMEOUT, "TLS handshake timed out");
                        HandshakeFailure::Timeout
                    }
                };
                on_failure(failure);
            });
        }
    });
    ReceiverStream::new(rx)
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

/// One `[[tls_authorization]]` entry: clients with `identity` (a URI or DNS SAN; a trailing `*`
/// matches any suffix) may join the aggregation groups named in `groups` (same `*` rule).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AuthorizationRule {
    pub identity: String,
    pub groups: Vec<String>,
}

fn glob_match(pattern: &str, value: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => value.starts_with(prefix),
        None => pattern == value,
    }
}

/// Which client identities may join which groups. No rules: every verified client may join any
/// group. With rules, a client may join a group only if one of its identities matches a rule
/// listing that group; anything else is refused.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Authorization {
    pub rules: Vec<AuthorizationRule>,
}

impl Authorization {
    pub fn is_enabled(&self) -> bool {
        !self.rules.is_empty()
    }

    /// `Err` carries the refusal message for the client.
    pub fn check(&self, peer: Option<&PeerIdentity>, group: &str) -> Result<(), String> {
        if !self.is_enabled() {
            return Ok(());
        }
        let ids: &[String] = peer.map(|p| p.identities.as_slice()).unwrap_or_default();
        let allowed = ids.iter().any(|id| {
            self.rules.iter().any(|r| {
                glob_match(&r.identity, id) && r.groups.iter().any(|g| glob_match(g, group))
            })
        });
        if allowed {
            Ok(())
        } else if ids.is_empty() {
            Err(format!(
                "adsrelay: group {group:?} requires a client certificate with a URI or DNS SAN \
                 listed in tls_authorization"
            ))
        } else {
            Err(format!(
                "adsrelay: client identity {} may not join group {group:?} (tls_authorization)",
                ids.join(", ")
            ))
        }
    }
}

/// Upstream TLS settings (`upstream_tls`, `upstream_ca`, `upstream_cert`, `upstream_key`,
/// `upstream_server_name`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientTlsSettings {
    /// Unset: the system's trusted roots.
    pub ca: Option<PathBuf>,
    /// Client certificate and key for upstream mTLS (both or neither).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The name sent as SNI and checked against the server's certificate; unset: the host of the
    /// upstream address.
    pub server_name: Option<String>,
}

impl ClientTlsSettings {
    /// Reads the files and builds tonic's client configuration for `host`.
    pub fn load(&self, host: &str) -> Result<tonic::transport::ClientTlsConfig, TlsError> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let mut tls = ClientTlsConfig::new()
            .domain_name(self.server_name.as_deref().unwrap_or(host))
            .assume_http2(true);
        tls = match &self.ca {
            Some(p) => {
                let pem = read("upstream_ca", p)?;
                roots("upstream_ca", p, &pem)?;
                tls.ca_certificate(Certificate::from_pem(pem))
            }
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            let cert_pem = read("upstream_cert", cert)?;
            let key_pem = read("upstream_key", key)?;
            parse_certs("upstream_cert", cert, &cert_pem)?;
            parse_key("upstream_key", key, &key_pem)?;
            tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
        }
        Ok(tls)
    }
}

/// Upstream TLS as a session uses it: the files are read for every new session; if they have
/// become unreadable the last good configuration is used (and a warning logged).
#[derive(Clone, Default)]
pub struct UpstreamTls {
    pub settings: ClientTlsSettings,
    last_good: Arc<Mutex<Option<tonic::transport::ClientTlsConfig>>>,
}

impl std::fmt::Debug for UpstreamTls {
    // The settings (file names) only: tonic's configuration holds the private key, and
    // /debug/config prints this.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &Self) -> bool {
        self.settings == other.settings
    }
}

impl UpstreamTls {
    pub fn new(settings: ClientTlsSettings) -> Self {
        UpstreamTls {
            settings,
            last_good: Arc::default(),
        }
    }

    pub fn client_config(&self, host: &str) -> Option<tonic::transport::ClientTlsConfig> {
        match self.settings.load(host) {
            Ok(c) => {
                *lock(&self.last_good) = Some(c.clone());
                Some(c)
            }
            Err(e) => {
                warn!(error = %e, "upstream TLS files unusable; keeping the previous ones");
                lock(&self.last_good).clone()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ids: &[&str]) -> PeerIdentity {
        PeerIdentity {
            remote_addr: None,
            identities: ids.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn authorization_matches_identity_and_group_globs() {
        let auth = Authorization {
            rules: vec![
                AuthorizationRule {
                    identity: "spiffe://example.org/tenant-a/*".into(),
                    groups: vec!["tenant-a".into(), "shared-*".into()],
                },
                AuthorizationRule {
                    identity: "ops.example.org".into(),
                    groups: vec!["*".into()],
                },
            ],
        };
        let a = peer(&["spiffe://example.org/tenant-a/envoy-1"]);
        assert_eq!(auth.check(Some(&a), "tenant-a"), Ok(()));
        assert_eq!(auth.check(Some(&a), "shared-edge"), Ok(()));
        let denied = auth.check(Some(&a), "tenant-b").unwrap_err();
        assert!(
            denied.contains("spiffe://example.org/tenant-a/envoy-1"),
            "{denied}"
        );
        assert!(denied.contains("\"tenant-b\""), "{denied}");
        assert_eq!(
            auth.check(Some(&peer(&["x", "ops.example.org"])), "anything"),
            Ok(())
        );
        assert!(auth.check(None, "tenant-a").is_err());
        assert_eq!(Authorization::default().check(None, "tenant-b"), Ok(()));
    }

    #[test]
    fn debug_output_names_files_but_never_key_material() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["relay.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert_path, key_path) = (dir.join("c.crt"), dir.join("c.key"));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        let upstream = UpstreamTls::new(ClientTlsSettings {
            ca: Some(cert_path.clone()),
            cert: Some(cert_path.clone()),
            key: Some(key_path.clone()),
            server_name: None,
        });
        assert!(upstream.client_config("relay.test").is_some());
        let server = ServerTls::new(ServerTlsSettings {
            cert: cert_path,
            key: key_path.clone(),
            client_ca: None,
            reload_interval: Duration::from_secs(10),
        })
        .unwrap();
        let shown = format!("{upstream:?} {server:?}");
        assert!(shown.contains(&key_path.display().to_string()), "{shown}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
        let key_body: String = key
            .serialize_pem()
            .lines()
            .nth(1)
            .unwrap()
            .chars()
            .take(20)
            .collect();
        assert!(!shown.contains(&key_body), "{shown}");
    }

    #[test]
    fn unreadable_and_mismatched_files_name_field_and_file() {
        let s = ServerTlsSettings {
            cert: "/nonexistent/cert.pem".into(),
            key: "/nonexistent/key.pem".into(),
            client_ca: None,
            reload_interval: Duration::from_secs(10),
        };
        let e = s.load().unwrap_err();
        assert_eq!(e.field(), "tls_cert");
        assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");
    }
}
