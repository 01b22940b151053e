//! Relay configuration. Every setting is declared once, in [`Settings`]: clap reads it from a flag
//! or its `ADSRELAY_*` variable, serde from the TOML config file. The layers merge generically,
//! flag > environment variable > file > default ([`settings`]), and validation turns the result
//! into [`Config`] (validate.rs). Every error names the flag, the variable or the file, and the
//! field it came from.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

pub mod effective;
pub mod settings;
mod validate;

pub use crate::logging::LogFormat;
pub use settings::{Merged, Origins, Settings, Source};

/// `adsrelay --version`: the crate version and the git commit it was built from (build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("ADSRELAY_GIT_COMMIT"),
    ")"
);

#[derive(Debug, Parser)]
#[command(name = "adsrelay", version = VERSION, about = "A caching xDS relay", long_about = None)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub relay: Settings,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a demo: an embedded control plane with example resources, a backend, and the relay in
    /// front of them. Prints how to point an Envoy at it.
    Demo(DemoArgs),
    /// Validate the configuration (flags, ADSRELAY_* environment, config file) without binding
    /// anything; print the effective settings and where each came from. Exits 0 if valid, 64 if
    /// not.
    CheckConfig(Box<Settings>),
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Example resources (TOML), reloaded when edited; created from the built-in example if missing
    #[arg(long, value_name = "FILE", default_value = "adsrelay-demo.toml")]
    pub resources: PathBuf,
    /// Relay xDS address (point Envoy here)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:18000")]
    pub listen: SocketAddr,
    /// Relay admin address
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9902")]
    pub admin: SocketAddr,
    /// Embedded control plane address
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:18001")]
    pub control_plane: SocketAddr,
    /// Embedded HTTP backend address (the example cluster's endpoint)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:18080")]
    pub backend: SocketAddr,
    /// Log format
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Every default, in one place (the flags' help and docs/configure.md quote them).
pub mod defaults {
    use super::*;

    pub const LISTEN: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 18000));
    pub const ADMIN: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9902));
    pub const NODE_ID: &str = "adsrelay";
    /// Bytes are bounded by `unsubscribed_cache_bytes`; the linger only bounds how long the
    /// control plane tracks names nobody wants, and 5m covers a rolling restart.
    pub const UNSUBSCRIBE_LINGER: Duration = Duration::from_secs(300);
    pub const UNSUBSCRIBED_CACHE_BYTES: usize =
        crate::xds::unsubscribed::DEFAULT_UNSUBSCRIBED_CACHE_BYTES;
    pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
    pub const UPSTREAM_BACKOFF_INITIAL: Duration = Duration::from_millis(250);
    pub const UPSTREAM_BACKOFF_MAX: Duration = Duration::from_secs(30);
    pub const MAX_CONNECTIONS: usize = 20_000;
    pub const MAX_STREAMS_PER_CONNECTION: u32 = 100;
    pub const MAX_SUBSCRIPTIONS_PER_STREAM: usize = 100_000;
    pub const MAX_NAME_BYTES: usize = 4096;
    pub const MAX_RESPONSE_BYTES: usize = crate::xds::delta::DEFAULT_MAX_RESPONSE_BYTES;
    pub const MAX_REQUESTS_PER_SECOND: u32 = 100;
    pub const REQUEST_BURST: u32 = 1000;
    pub const STUCK_CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
    pub const DRAIN_PERIOD: Duration = Duration::from_secs(10);
    pub const MAX_CONNECTION_AGE_GRACE: Duration = Duration::from_secs(30);
    pub const FD_RESERVE: u64 = 64;
    pub const MAX_NEW_STREAMS_PER_SECOND: f64 = 5000.0;
    pub const NEW_STREAMS_BURST: u32 = 10_000;
    /// One full-state answer per group every 5 minutes: what the control plane spends on one Envoy
    /// connecting, a bound on how long a removal the control plane never reported stays cached.
    pub const RESYNC_INTERVAL: Duration = Duration::from_secs(300);
    pub const UPSTREAM_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
    pub const UPSTREAM_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
    pub const SNAPSHOT_INTERVAL: Duration = Duration::from_secs(30);
    pub const SNAPSHOT_MAX_STALENESS: Duration = Duration::from_secs(3600);
    pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(10);
}

/// Validated relay configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub upstream: http::Uri,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub node_id: String,
    pub unsubscribe_linger: Duration,
    /// Byte budget of each group's unsubscribed set (docs/configure.md "Limits and hardening").
    pub unsubscribed_cache_bytes: usize,
    pub max_message_bytes: usize,
    pub log_format: LogFormat,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Node metadata keys turned into dynamic parameters for clients without locators.
    pub params_from_metadata: Vec<String>,
    /// Limits protecting the relay from hostile or broken clients.
    pub limits: Limits,
    /// Every control-plane address, in failover order; the first is `upstream`.
    pub upstreams: Vec<http::Uri>,
    /// Aggregation groups (docs/configure.md "Aggregation groups").
    pub grouping: GroupingConfig,
    pub resilience: Resilience,
    /// Warm restart from a cache snapshot (docs/deploy.md "Warm restart"); `None` = off.
    pub snapshot: Option<SnapshotConfig>,
    /// Downstream TLS (None: plaintext), its certificates loaded and reloadable.
    pub tls: Option<std::sync::Arc<crate::tls::ServerTls>>,
    /// Which client identities may join which groups (empty: any client may join any group).
    pub tls_authorization: crate::tls::Authorization,
    /// Upstream TLS settings for `https://` upstreams.
    pub upstream_tls: crate::tls::UpstreamTls,
    /// The ADS flavour spoken to the control plane.
    pub upstream_protocol: UpstreamProtocol,
}

/// `--upstream-protocol` / `upstream_protocol`: the ADS flavour the relay speaks upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamProtocol {
    /// `DeltaAggregatedResources` (the default).
    #[default]
    Delta,
    /// `StreamAggregatedResources`, for control planes without Delta.
    Sotw,
    /// Delta first; an upstream that answers UNIMPLEMENTED is spoken to in SotW until restart.
    Auto,
}

impl UpstreamProtocol {
    pub fn parse(v: &str) -> Result<Self, String> {
        match v {
            "delta" => Ok(Self::Delta),
            "sotw" => Ok(Self::Sotw),
            "auto" => Ok(Self::Auto),
            _ => Err(format!("{v:?} is not one of delta, sotw, auto")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delta => "delta",
            Self::Sotw => "sotw",
            Self::Auto => "auto",
        }
    }
}

/// Where the cache snapshot lives, how often it is written and how old it may be when loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotConfig {
    pub path: PathBuf,
    pub interval: Duration,
    pub max_staleness: Duration,
}

impl SnapshotConfig {
    pub fn new(path: PathBuf) -> Self {
        SnapshotConfig {
            path,
            interval: defaults::SNAPSHOT_INTERVAL,
            max_staleness: defaults::SNAPSHOT_MAX_STALENESS,
        }
    }
}

/// `[[groups]]` rules, the implicit rule's significant metadata keys, and unmatched clients.
#[derive(Debug, Clone, Default)]
pub struct GroupingConfig {
    pub rules: Vec<crate::grouping::GroupRule>,
    pub metadata_keys: Vec<String>,
    pub unmatched: crate::grouping::Unmatched,
}

/// Shielding the control plane: admission of new streams, periodic resync, upstream keepalive.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Resilience {
    /// New downstream streams admitted per second (token bucket); 0 disables the limit.
    pub max_new_streams_per_second: f64,
    pub new_streams_burst: u32,
    /// Periodic reconciliation with the upstream (C18), jittered ±20 %; `None` = off.
    pub resync_interval: Option<Duration>,
    pub upstream_keepalive_interval: Duration,
    pub upstream_keepalive_timeout: Duration,
}

impl Default for Resilience {
    fn default() -> Self {
        Resilience {
            max_new_streams_per_second: defaults::MAX_NEW_STREAMS_PER_SECOND,
            new_streams_burst: defaults::NEW_STREAMS_BURST,
            resync_interval: Some(defaults::RESYNC_INTERVAL),
            upstream_keepalive_interval: defaults::UPSTREAM_KEEPALIVE_INTERVAL,
            upstream_keepalive_timeout: defaults::UPSTREAM_KEEPALIVE_TIMEOUT,
        }
    }
}

/// Downstream limits ("Limits and hardening" in docs/configure.md). Exceeding one ends only the offending
/// stream (or closes the extra connection) and is counted.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Limits {
    pub max_connections: usize,
    pub max_streams_per_connection: u32,
    pub max_subscriptions_per_stream: usize,
    pub max_name_bytes: usize,
    /// The clients' receive limit: larger Delta states go out in several responses.
    pub max_response_bytes: usize,
    /// 0 disables the request-rate limit.
    pub max_requests_per_second: u32,
    pub request_burst: u32,
    /// Zero disables stuck-client detection.
    pub stuck_client_timeout: Duration,
    /// Graceful shutdown spreads connection closes over this period.
    pub drain_period: Duration,
    /// GOAWAY a downstream connection after this long (less up to 10% jitter); `None` = never.
    pub max_connection_age: Option<Duration>,
    /// How long in-flight streams may run after that GOAWAY.
    pub max_connection_age_grace: Duration,
    /// File descriptors kept free for the admin port, upstream connections and snapshot files:
    /// a new client connection is closed at once when fewer would remain. 0 disables it.
    pub fd_reserve: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: defaults::MAX_CONNECTIONS,
            max_streams_per_connection: defaults::MAX_STREAMS_PER_CONNECTION,
            max_subscriptions_per_stream: defaults::MAX_SUBSCRIPTIONS_PER_STREAM,
            max_name_bytes: defaults::MAX_NAME_BYTES,
            max_response_bytes: defaults::MAX_RESPONSE_BYTES,
            max_requests_per_second: defaults::MAX_REQUESTS_PER_SECOND,
            request_burst: defaults::REQUEST_BURST,
            stuck_client_timeout: defaults::STUCK_CLIENT_TIMEOUT,
            drain_period: defaults::DRAIN_PERIOD,
            max_connection_age: None,
            max_connection_age_grace: defaults::MAX_CONNECTION_AGE_GRACE,
            fd_reserve: defaults::FD_RESERVE,
        }
    }
}

impl Limits {
    /// `max_connection_age` less a random 0-10%, drawn once per process: tonic applies one age
    /// to every connection, so this spreads replicas (and restarts) apart; connections of one
    /// replica are spread by when they were accepted.
    pub fn connection_age_jittered(&self) -> Option<Duration> {
        self.max_connection_age
            .map(|age| age.mul_f64(1.0 - rand::random::<f64>() * 0.1))
    }
}

impl Config {
    /// Defaults for everything but the upstream (used by the demo and tests).
    pub fn with_upstream(upstream: http::Uri) -> Self {
        Config {
            upstreams: vec![upstream.clone()],
            upstream,
            listen: defaults::LISTEN,
            admin: defaults::ADMIN,
            node_id: defaults::NODE_ID.into(),
            unsubscribe_linger: defaults::UNSUBSCRIBE_LINGER,
            unsubscribed_cache_bytes: defaults::UNSUBSCRIBED_CACHE_BYTES,
            max_message_bytes: defaults::MAX_MESSAGE_BYTES,
            log_format: LogFormat::Text,
            backoff_initial: defaults::UPSTREAM_BACKOFF_INITIAL,
            backoff_max: defaults::UPSTREAM_BACKOFF_MAX,
            params_from_metadata: Vec::new(),
            limits: Limits::default(),
            grouping: GroupingConfig::default(),
            resilience: Resilience::default(),
            snapshot: None,
            tls: None,
            tls_authorization: Default::default(),
            upstream_tls: Default::default(),
            upstream_protocol: UpstreamProtocol::Delta,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{origin}: {field}: {message}")]
    Invalid {
        origin: String,
        field: &'static str,
        message: String,
    },
    #[error("{path}: cannot read config file: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
}

fn invalid(origin: &str, field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.to_string(),
        field,
        message: message.into(),
    }
}

/// The environment variable of a long flag: `--node-id` reads `ADSRELAY_NODE_ID`.
pub fn env_var(flag: &str) -> String {
    format!("ADSRELAY_{}", flag.replace('-', "_").to_ascii_uppercase())
}

/// Accepts `host:port` or an `http://` / `https://` URI.
pub fn parse_upstream(s: &str) -> Result<http::Uri, String> {
    let with_scheme = if s.contains("://") {
        s.to_string()
    } else {
        format!("http://{s}")
    };
    let uri: http::Uri = with_scheme
        .parse()
        .map_err(|e| format!("{s:?} is not host:port or a URI: {e}"))?;
    match (uri.scheme_str(), uri.port_u16()) {
        (Some("http") | Some("https"), Some(_)) if uri.host().is_some() => Ok(uri),
        (Some(other), _) if other != "http" && other != "https" => {
            Err(format!("{s:?}: scheme must be http or https"))
        }
        _ => Err(format!(
            "{s:?} needs a host and a port, e.g. 10.0.0.5:18000"
        )),
    }
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("{s:?} is not an IP:port address, e.g. 0.0.0.0:18000"))
}

/// Parses `250ms`, `30s`, `5m`, `1h`, or a bare number of seconds: every duration setting.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 500ms, 30s, 5m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    if !secs.is_finite() || !(0.0..=86400.0 * 365.0).contains(&secs) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_age_is_jittered_down_by_at_most_a_tenth() {
        let mut limits = Limits::default();
        assert_eq!(limits.connection_age_jittered(), None, "off by default");
        limits.max_connection_age = Some(Duration::from_secs(1800));
        let ages: Vec<Duration> = (0..200)
            .filter_map(|_| limits.connection_age_jittered())
            .collect();
        assert!(ages
            .iter()
            .all(|a| *a > Duration::from_secs(1620) && *a <= Duration::from_secs(1800)));
        assert!(
            ages.iter().any(|a| *a != ages[0]),
            "every draw gave the same age: no jitter"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("3 weeks").is_err());
    }

    #[test]
    fn upstream_forms() {
        assert_eq!(
            parse_upstream("127.0.0.1:18000").unwrap().port_u16(),
            Some(18000)
        );
        assert!(parse_upstream("https://cp.example:443").is_ok());
        assert!(parse_upstream("cp.example").is_err());
        assert!(parse_upstream("ftp://cp:1").is_err());
    }
}
