//! Command line, `ADSRELAY_*` environment and config file -> validated [`Config`], with one
//! precedence: flag > environment variable > file > default. Every error names the flag, the
//! variable or the file, and the field it came from.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::Deserialize;

pub mod effective;

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
    pub relay: RelayArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a demo: an embedded control plane with example resources, a backend, and the relay in
    /// front of them. Prints how to point an Envoy at it.
    Demo(DemoArgs),
    /// Validate the configuration (flags, ADSRELAY_* environment, config file) without binding
    /// anything; print the effective settings and where each came from. Exits 0 if valid, 64 if
    /// not.
    CheckConfig(Box<RelayArgs>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Default, Args)]
pub struct RelayArgs {
    /// Upstream xDS control plane, `host:port` or `http://host:port`. The relay keeps retrying
    /// until it is reachable.
    #[arg(long, value_name = "ADDR", env = "ADSRELAY_UPSTREAM")]
    pub upstream: Option<String>,
    /// Address for downstream xDS clients (gRPC) [default: 0.0.0.0:18000]
    #[arg(long, value_name = "ADDR", env = "ADSRELAY_LISTEN")]
    pub listen: Option<String>,
    /// Address for the admin HTTP server (/healthz, /readyz) [default: 127.0.0.1:9902]
    #[arg(long, value_name = "ADDR", env = "ADSRELAY_ADMIN")]
    pub admin: Option<String>,
    /// `node.id` the relay presents upstream; `node.cluster` is the aggregation group [default:
    /// adsrelay]
    #[arg(long, value_name = "ID", env = "ADSRELAY_NODE_ID")]
    pub node_id: Option<String>,
    /// How long the relay stays subscribed upstream after the last client left a resource, e.g.
    /// `30s`, `500ms`, `0s` [default: 5m]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_UNSUBSCRIBE_LINGER")]
    pub unsubscribe_linger: Option<String>,
    /// Per group: encoded bytes of resources no client subscribes to that the relay keeps
    /// (least recently left evicted first); 0 keeps none [default: 67108864]
    #[arg(long, value_name = "BYTES", env = "ADSRELAY_UNSUBSCRIBED_CACHE_BYTES")]
    pub unsubscribed_cache_bytes: Option<usize>,
    /// Largest xDS message accepted or sent, in bytes [default: 67108864]
    #[arg(long, value_name = "BYTES", env = "ADSRELAY_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Node metadata key whose value becomes a dynamic parameter of the client's plain-name
    /// subscriptions (TP2 migration path); repeatable
    #[arg(
        long = "param-from-metadata",
        value_name = "KEY",
        env = "ADSRELAY_PARAM_FROM_METADATA",
        value_delimiter = ','
    )]
    pub params_from_metadata: Vec<String>,
    /// Log format [default: text]; the level comes from RUST_LOG (default `info`)
    #[arg(long, value_enum, env = "ADSRELAY_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Open downstream connections; further ones are closed at once [default: 20000]
    #[arg(long, value_name = "N", env = "ADSRELAY_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Concurrent HTTP/2 streams per downstream connection [default: 100]
    #[arg(long, value_name = "N", env = "ADSRELAY_MAX_STREAMS_PER_CONNECTION")]
    pub max_streams_per_connection: Option<u32>,
    /// Subscriptions one stream may hold, all types together [default: 100000]
    #[arg(long, value_name = "N", env = "ADSRELAY_MAX_SUBSCRIPTIONS_PER_STREAM")]
    pub max_subscriptions_per_stream: Option<usize>,
    /// Longest resource name, type_url or locator parameter in a request, in bytes [default: 4096]
    #[arg(long, value_name = "BYTES", env = "ADSRELAY_MAX_NAME_BYTES")]
    pub max_name_bytes: Option<usize>,
    /// Largest response sent to a client (its gRPC receive limit): a larger Delta state is split
    /// over several responses [default: 4194304]
    #[arg(long, value_name = "BYTES", env = "ADSRELAY_MAX_RESPONSE_BYTES")]
    pub max_response_bytes: Option<usize>,
    /// File descriptors kept free for the admin port, the upstream and snapshots: new client
    /// connections are closed at once when fewer are free; 0 disables it [default: 64]
    #[arg(long, value_name = "N", env = "ADSRELAY_FD_RESERVE")]
    pub fd_reserve: Option<u64>,
    /// Sustained requests per second per stream; 0 disables the limit [default: 100]
    #[arg(long, value_name = "N", env = "ADSRELAY_MAX_REQUESTS_PER_SECOND")]
    pub max_requests_per_second: Option<u32>,
    /// Requests per stream allowed in a burst above the sustained rate [default: 1000]
    #[arg(long, value_name = "N", env = "ADSRELAY_REQUEST_BURST")]
    pub request_burst: Option<u32>,
    /// End a stream whose responses the client has not read for this long; 0s disables it
    /// [default: 60s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_STUCK_CLIENT_TIMEOUT")]
    pub stuck_client_timeout: Option<String>,
    /// On SIGTERM, close client connections gradually over this period, then exit [default: 10s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_DRAIN_PERIOD")]
    pub drain_period: Option<String>,
    /// TOML config file; flags and ADSRELAY_* variables override its values
    #[arg(long, value_name = "FILE", env = "ADSRELAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Warm restart: persist the cache to this file and serve from it after a restart (off unless
    /// set)
    #[arg(long, value_name = "FILE", env = "ADSRELAY_SNAPSHOT_PATH")]
    pub snapshot_path: Option<PathBuf>,
    /// How often the snapshot is rewritten (also written on graceful shutdown) [default: 30s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_SNAPSHOT_INTERVAL")]
    pub snapshot_interval: Option<String>,
    /// A snapshot older than this is not loaded [default: 1h]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_SNAPSHOT_MAX_STALENESS")]
    pub snapshot_max_staleness: Option<String>,
    /// Control-plane addresses in failover order (comma-separated or repeated); the first is the
    /// upstream [default: --upstream alone]
    #[arg(
        long,
        value_name = "ADDR",
        env = "ADSRELAY_UPSTREAMS",
        value_delimiter = ','
    )]
    pub upstreams: Vec<String>,
    /// First upstream reconnect delay [default: 250ms]
    #[arg(
        long,
        value_name = "DURATION",
        env = "ADSRELAY_UPSTREAM_BACKOFF_INITIAL"
    )]
    pub upstream_backoff_initial: Option<String>,
    /// Longest upstream reconnect delay [default: 30s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_UPSTREAM_BACKOFF_MAX")]
    pub upstream_backoff_max: Option<String>,
    /// Node metadata keys that split the implicit group (comma-separated or repeated)
    #[arg(
        long,
        value_name = "KEY",
        env = "ADSRELAY_GROUP_METADATA_KEYS",
        value_delimiter = ','
    )]
    pub group_metadata_keys: Vec<String>,
    /// What happens to a client no `[[groups]]` rule matches [default: reject]
    #[arg(long, value_enum, env = "ADSRELAY_UNMATCHED")]
    pub unmatched: Option<crate::grouping::Unmatched>,
    /// New downstream streams admitted per second; 0 disables the limit [default: 5000]
    #[arg(long, value_name = "N", env = "ADSRELAY_MAX_NEW_STREAMS_PER_SECOND")]
    pub max_new_streams_per_second: Option<f64>,
    /// New streams admitted in a burst above that rate [default: 10000]
    #[arg(long, value_name = "N", env = "ADSRELAY_NEW_STREAMS_BURST")]
    pub new_streams_burst: Option<u32>,
    /// Periodic reconciliation with the upstream; 0s turns it off [default: 0s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_RESYNC_INTERVAL")]
    pub resync_interval: Option<String>,
    /// HTTP/2 keepalive ping interval on the upstream connection [default: 30s]
    #[arg(
        long,
        value_name = "DURATION",
        env = "ADSRELAY_UPSTREAM_KEEPALIVE_INTERVAL"
    )]
    pub upstream_keepalive_interval: Option<String>,
    /// Upstream keepalive ping timeout [default: 10s]
    #[arg(
        long,
        value_name = "DURATION",
        env = "ADSRELAY_UPSTREAM_KEEPALIVE_TIMEOUT"
    )]
    pub upstream_keepalive_timeout: Option<String>,
    /// Send a downstream connection an HTTP/2 GOAWAY after about this long (up to 10% earlier,
    /// at random), so clients reconnect through the load balancer and spread over replicas; 0s
    /// turns it off [default: 0s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_MAX_CONNECTION_AGE")]
    pub max_connection_age: Option<String>,
    /// After the GOAWAY, how long in-flight streams may finish before the connection is closed
    /// [default: 30s]
    #[arg(
        long,
        value_name = "DURATION",
        env = "ADSRELAY_MAX_CONNECTION_AGE_GRACE"
    )]
    pub max_connection_age_grace: Option<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Ids of the flags above whose value came from their `ADSRELAY_*` environment variable, so
    /// errors name the variable (filled by [`RelayArgs::from_matches`]).
    #[arg(skip)]
    pub from_env: std::collections::BTreeSet<String>,
}

/// TLS flags (README "TLS and mTLS"); each has a config file key with underscores.
#[derive(Debug, Default, Args)]
pub struct TlsArgs {
    /// Serve downstream xDS over TLS with this PEM certificate chain (needs --tls-key)
    #[arg(long, value_name = "FILE", env = "ADSRELAY_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(long, value_name = "FILE", env = "ADSRELAY_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this PEM CA bundle (mTLS)
    #[arg(long, value_name = "FILE", env = "ADSRELAY_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// How often the TLS files are checked for changes [default: 10s]
    #[arg(long, value_name = "DURATION", env = "ADSRELAY_TLS_RELOAD_INTERVAL")]
    pub tls_reload_interval: Option<String>,
    /// Connect to the upstream over TLS (implied by an https:// address)
    #[arg(long, env = "ADSRELAY_UPSTREAM_TLS")]
    pub upstream_tls: bool,
    /// PEM CA bundle that verifies the upstream's certificate [default: the system roots]
    #[arg(long, value_name = "FILE", env = "ADSRELAY_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// PEM client certificate presented upstream (mTLS; needs --upstream-key)
    #[arg(long, value_name = "FILE", env = "ADSRELAY_UPSTREAM_CERT")]
    pub upstream_cert: Option<PathBuf>,
    /// PEM private key of --upstream-cert
    #[arg(long, value_name = "FILE", env = "ADSRELAY_UPSTREAM_KEY")]
    pub upstream_key: Option<PathBuf>,
    /// Name sent as SNI and required in the upstream's certificate [default: the address's host]
    #[arg(long, value_name = "NAME", env = "ADSRELAY_UPSTREAM_SERVER_NAME")]
    pub upstream_server_name: Option<String>,
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

/// The config file. Field names match the long flags (with underscores).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    upstream: Option<String>,
    listen: Option<String>,
    admin: Option<String>,
    node_id: Option<String>,
    unsubscribe_linger: Option<String>,
    unsubscribed_cache_bytes: Option<usize>,
    max_message_bytes: Option<usize>,
    log_format: Option<LogFormat>,
    upstream_backoff_initial: Option<String>,
    upstream_backoff_max: Option<String>,
    params_from_metadata: Option<Vec<String>>,
    max_connections: Option<usize>,
    max_streams_per_connection: Option<u32>,
    max_subscriptions_per_stream: Option<usize>,
    max_name_bytes: Option<usize>,
    max_response_bytes: Option<usize>,
    max_requests_per_second: Option<u32>,
    fd_reserve: Option<u64>,
    request_burst: Option<u32>,
    stuck_client_timeout: Option<String>,
    drain_period: Option<String>,
    // Groups and resilience (issue 5); see `apply_groups_and_resilience`.
    upstreams: Option<Vec<String>>,
    groups: Option<Vec<crate::grouping::GroupRule>>,
    group_metadata_keys: Option<Vec<String>>,
    unmatched: Option<crate::grouping::Unmatched>,
    max_new_streams_per_second: Option<f64>,
    new_streams_burst: Option<u32>,
    resync_interval: Option<String>,
    upstream_keepalive_interval: Option<String>,
    upstream_keepalive_timeout: Option<String>,
    // Warm restart; see `apply_snapshot`.
    snapshot_path: Option<PathBuf>,
    snapshot_interval: Option<String>,
    snapshot_max_staleness: Option<String>,
    max_connection_age: Option<String>,
    max_connection_age_grace: Option<String>,
    // TLS; see `apply_tls`.
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    tls_reload_interval: Option<String>,
    tls_authorization: Option<Vec<crate::tls::AuthorizationRule>>,
    upstream_tls: Option<bool>,
    upstream_ca: Option<PathBuf>,
    upstream_cert: Option<PathBuf>,
    upstream_key: Option<PathBuf>,
    upstream_server_name: Option<String>,
}

/// Validated relay configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub upstream: http::Uri,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub node_id: String,
    pub unsubscribe_linger: Duration,
    /// Byte budget of each group's unsubscribed set (README "Limits and hardening").
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
    /// Aggregation groups (README "Groups and resilience").
    pub grouping: GroupingConfig,
    pub resilience: Resilience,
    /// Warm restart from a cache snapshot (README "Warm restart"); `None` = off.
    pub snapshot: Option<SnapshotConfig>,
    /// Downstream TLS (None: plaintext), its certificates loaded and reloadable.
    pub tls: Option<std::sync::Arc<crate::tls::ServerTls>>,
    /// Which client identities may join which groups (empty: any client may join any group).
    pub tls_authorization: crate::tls::Authorization,
    /// Upstream TLS settings for `https://` upstreams.
    pub upstream_tls: crate::tls::UpstreamTls,
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
            interval: Duration::from_secs(30),
            max_staleness: Duration::from_secs(3600),
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
    /// Periodic reconciliation with the upstream; `None` = off.
    pub resync_interval: Option<Duration>,
    pub upstream_keepalive_interval: Duration,
    pub upstream_keepalive_timeout: Duration,
}

impl Default for Resilience {
    fn default() -> Self {
        Resilience {
            max_new_streams_per_second: 5000.0,
            new_streams_burst: 10000,
            resync_interval: None,
            upstream_keepalive_interval: Duration::from_secs(30),
            upstream_keepalive_timeout: Duration::from_secs(10),
        }
    }
}

/// Downstream limits ("Limits and hardening" in README). Exceeding one ends only the offending
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
            max_connections: 20_000,
            max_streams_per_connection: 100,
            max_subscriptions_per_stream: 100_000,
            max_name_bytes: 4096,
            max_response_bytes: crate::xds::delta::DEFAULT_MAX_RESPONSE_BYTES,
            max_requests_per_second: 100,
            request_burst: 1000,
            stuck_client_timeout: Duration::from_secs(60),
            drain_period: Duration::from_secs(10),
            max_connection_age: None,
            max_connection_age_grace: Duration::from_secs(30),
            fd_reserve: 64,
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
        let upstream_clone = upstream.clone();
        Config {
            upstream,
            listen: ([0, 0, 0, 0], 18000).into(),
            admin: ([127, 0, 0, 1], 9902).into(),
            node_id: "adsrelay".into(),
            // Bytes are bounded by `unsubscribed_cache_bytes`; the linger only bounds how long the
            // control plane tracks names nobody wants, and 5m covers a rolling restart.
            unsubscribe_linger: Duration::from_secs(300),
            unsubscribed_cache_bytes: crate::xds::unsubscribed::DEFAULT_UNSUBSCRIBED_CACHE_BYTES,
            max_message_bytes: 64 << 20,
            log_format: LogFormat::Text,
            backoff_initial: Duration::from_millis(250),
            backoff_max: Duration::from_secs(30),
            params_from_metadata: Vec::new(),
            limits: Limits::default(),
            upstreams: vec![upstream_clone],
            grouping: GroupingConfig::default(),
            resilience: Resilience::default(),
            snapshot: None,
            tls: None,
            tls_authorization: Default::default(),
            upstream_tls: Default::default(),
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

/// Where a value came from, for error messages.
struct Sourced<T> {
    value: T,
    origin: String,
}

fn pick<T>(flag: Option<T>, flag_name: &str, file: Option<T>, path: &str) -> Option<Sourced<T>> {
    match (flag, file) {
        (Some(value), _) => Some(Sourced {
            value,
            origin: format!("--{flag_name}"),
        }),
        (None, Some(value)) => Some(Sourced {
            value,
            origin: path.to_string(),
        }),
        (None, None) => None,
    }
}

fn invalid(origin: &str, field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.to_string(),
        field,
        message: message.into(),
    }
}

impl ConfigError {
    /// Names the `ADSRELAY_*` variable instead of the flag when the value came from it.
    fn naming_env(self, env: &std::collections::BTreeSet<String>) -> Self {
        match self {
            ConfigError::Invalid {
                origin,
                field,
                message,
            } => {
                let origin = match origin.strip_prefix("--") {
                    Some(flag) if env.contains(flag) => env_var(flag),
                    _ => origin,
                };
                ConfigError::Invalid {
                    origin,
                    field,
                    message,
                }
            }
            other => other,
        }
    }
}

/// The environment variable of a long flag: `--node-id` reads `ADSRELAY_NODE_ID`.
pub fn env_var(flag: &str) -> String {
    format!("ADSRELAY_{}", flag.replace('-', "_").to_ascii_uppercase())
}

impl RelayArgs {
    /// The parsed flags, remembering which ones were read from their environment variable.
    pub fn from_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        use clap::FromArgMatches;
        let mut args = RelayArgs::from_arg_matches(m)?;
        let cmd = <RelayArgs as clap::Args>::augment_args(clap::Command::new("adsrelay"));
        args.from_env = cmd
            .get_arguments()
            .filter(|a| {
                m.value_source(a.get_id().as_str()) == Some(clap::parser::ValueSource::EnvVariable)
            })
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect();
        Ok(args)
    }

    /// Validates flags (and their `ADSRELAY_*` variables) over the config file over defaults.
    pub fn into_config(mut self) -> Result<Config, ConfigError> {
        let env = std::mem::take(&mut self.from_env);
        self.build().map_err(|e| e.naming_env(&env))
    }

    fn build(self) -> Result<Config, ConfigError> {
        let (file, path) = match &self.config {
            Some(p) => (read_file(p)?, p.display().to_string()),
            None => (FileConfig::default(), "config file".to_string()),
        };
        let file_upstream = file
            .upstream
            .or_else(|| file.upstreams.as_ref().and_then(|u| u.first().cloned()));
        let flag_upstreams = (!self.upstreams.is_empty()).then(|| Sourced {
            value: self.upstreams,
            origin: "--upstreams".to_string(),
        });
        let first_listed = flag_upstreams.as_ref().map(|l| l.value[0].clone());
        let flag_upstream = self.upstream.or(first_listed);
        let upstream = pick(flag_upstream, "upstream", file_upstream, &path).ok_or_else(|| {
            invalid(
                "command line",
                "upstream",
                "required: set --upstream or `upstream` in the config file",
            )
        })?;
        let mut cfg = Config::with_upstream(
            parse_upstream(&upstream.value)
                .map_err(|m| invalid(&upstream.origin, "upstream", m))?,
        );
        if let Some(s) = pick(self.listen, "listen", file.listen, &path) {
            cfg.listen = parse_addr(&s.value).map_err(|m| invalid(&s.origin, "listen", m))?;
        }
        if let Some(s) = pick(self.admin, "admin", file.admin, &path) {
            cfg.admin = parse_addr(&s.value).map_err(|m| invalid(&s.origin, "admin", m))?;
        }
        if let Some(s) = pick(self.node_id, "node-id", file.node_id, &path) {
            if s.value.trim().is_empty() {
                return Err(invalid(&s.origin, "node_id", "must not be empty"));
            }
            cfg.node_id = s.value;
        }
        if let Some(s) = pick(
            self.unsubscribe_linger,
            "unsubscribe-linger",
            file.unsubscribe_linger,
            &path,
        ) {
            cfg.unsubscribe_linger = parse_duration(&s.value)
                .map_err(|m| invalid(&s.origin, "unsubscribe_linger", m))?;
        }
        if let Some(s) = pick(
            self.unsubscribed_cache_bytes,
            "unsubscribed-cache-bytes",
            file.unsubscribed_cache_bytes,
            &path,
        ) {
            cfg.unsubscribed_cache_bytes = s.value;
        }
        if let Some(s) = pick(
            self.max_message_bytes,
            "max-message-bytes",
            file.max_message_bytes,
            &path,
        ) {
            if s.value < 64 * 1024 {
                return Err(invalid(
                    &s.origin,
                    "max_message_bytes",
                    format!("{} is too small (minimum 65536)", s.value),
                ));
            }
            cfg.max_message_bytes = s.value;
        }
        if let Some(s) = pick(self.log_format, "log-format", file.log_format, &path) {
            cfg.log_format = s.value;
        }
        if !self.params_from_metadata.is_empty() {
            cfg.params_from_metadata = self.params_from_metadata;
        } else if let Some(keys) = file.params_from_metadata {
            cfg.params_from_metadata = keys;
        }
        if let Some(k) = cfg.params_from_metadata.iter().find(|k| k.is_empty()) {
            return Err(invalid(
                &path,
                "params_from_metadata",
                format!("{k:?}: keys must not be empty"),
            ));
        }
        let mut backoff_origin = path.clone();
        if let Some(s) = pick(
            self.upstream_backoff_initial,
            "upstream-backoff-initial",
            file.upstream_backoff_initial,
            &path,
        ) {
            cfg.backoff_initial = parse_duration(&s.value)
                .map_err(|m| invalid(&s.origin, "upstream_backoff_initial", m))?;
            backoff_origin = s.origin;
        }
        if let Some(s) = pick(
            self.upstream_backoff_max,
            "upstream-backoff-max",
            file.upstream_backoff_max,
            &path,
        ) {
            cfg.backoff_max = parse_duration(&s.value)
                .map_err(|m| invalid(&s.origin, "upstream_backoff_max", m))?;
            backoff_origin = s.origin;
        }
        {
            let l = &mut cfg.limits;
            let positive = |v: Option<Sourced<usize>>, field: &'static str, out: &mut usize| {
                if let Some(s) = v {
                    if s.value == 0 {
                        return Err(invalid(&s.origin, field, "must be at least 1"));
                    }
                    *out = s.value;
                }
                Ok(())
            };
            positive(
                pick(
                    self.max_connections,
                    "max-connections",
                    file.max_connections,
                    &path,
                ),
                "max_connections",
                &mut l.max_connections,
            )?;
            positive(
                pick(
                    self.max_subscriptions_per_stream,
                    "max-subscriptions-per-stream",
                    file.max_subscriptions_per_stream,
                    &path,
                ),
                "max_subscriptions_per_stream",
                &mut l.max_subscriptions_per_stream,
            )?;
            if let Some(s) = pick(
                self.max_name_bytes,
                "max-name-bytes",
                file.max_name_bytes,
                &path,
            ) {
                if s.value < 64 {
                    return Err(invalid(
                        &s.origin,
                        "max_name_bytes",
                        format!("{} is too small (minimum 64)", s.value),
                    ));
                }
                l.max_name_bytes = s.value;
            }
            if let Some(s) = pick(
                self.max_response_bytes,
                "max-response-bytes",
                file.max_response_bytes,
                &path,
            ) {
                if s.value < 16 << 10 {
                    return Err(invalid(
                        &s.origin,
                        "max_response_bytes",
                        format!("{} is too small (minimum 16384)", s.value),
                    ));
                }
                l.max_response_bytes = s.value;
            }
            if let Some(s) = pick(
                self.max_streams_per_connection,
                "max-streams-per-connection",
                file.max_streams_per_connection,
                &path,
            ) {
                if s.value == 0 {
                    return Err(invalid(
                        &s.origin,
                        "max_streams_per_connection",
                        "must be at least 1",
                    ));
                }
                l.max_streams_per_connection = s.value;
            }
            if let Some(s) = pick(self.fd_reserve, "fd-reserve", file.fd_reserve, &path) {
                l.fd_reserve = s.value;
            }
            if let Some(s) = pick(
                self.max_requests_per_second,
                "max-requests-per-second",
                file.max_requests_per_second,
                &path,
            ) {
                l.max_requests_per_second = s.value;
            }
            if let Some(s) = pick(
                self.request_burst,
                "request-burst",
                file.request_burst,
                &path,
            ) {
                l.request_burst = s.value;
            }
            if let Some(s) = pick(
                self.stuck_client_timeout,
                "stuck-client-timeout",
                file.stuck_client_timeout,
                &path,
            ) {
                l.stuck_client_timeout = parse_duration(&s.value)
                    .map_err(|m| invalid(&s.origin, "stuck_client_timeout", m))?;
            }
            if let Some(s) = pick(self.drain_period, "drain-period", file.drain_period, &path) {
                l.drain_period =
                    parse_duration(&s.value).map_err(|m| invalid(&s.origin, "drain_period", m))?;
            }
            if let Some(s) = pick(
                self.max_connection_age,
                "max-connection-age",
                file.max_connection_age,
                &path,
            ) {
                let d = parse_duration(&s.value)
                    .map_err(|m| invalid(&s.origin, "max_connection_age", m))?;
                if !d.is_zero() && d < Duration::from_secs(1) {
                    return Err(invalid(
                        &s.origin,
                        "max_connection_age",
                        format!("{:?} is too short (minimum 1s; 0s turns it off)", s.value),
                    ));
                }
                l.max_connection_age = (!d.is_zero()).then_some(d);
            }
            if let Some(s) = pick(
                self.max_connection_age_grace,
                "max-connection-age-grace",
                file.max_connection_age_grace,
                &path,
            ) {
                l.max_connection_age_grace = parse_duration(&s.value)
                    .map_err(|m| invalid(&s.origin, "max_connection_age_grace", m))?;
            }
        }
        if cfg.backoff_initial.is_zero() || cfg.backoff_max < cfg.backoff_initial {
            return Err(invalid(
                &backoff_origin,
                "upstream_backoff_max",
                "backoff must satisfy 0 < upstream_backoff_initial <= upstream_backoff_max",
            ));
        }
        cfg.snapshot = apply_snapshot(
            pick(
                self.snapshot_path,
                "snapshot-path",
                file.snapshot_path,
                &path,
            ),
            pick(
                self.snapshot_interval,
                "snapshot-interval",
                file.snapshot_interval,
                &path,
            ),
            pick(
                self.snapshot_max_staleness,
                "snapshot-max-staleness",
                file.snapshot_max_staleness,
                &path,
            ),
        )?;
        let file_tls = FileTls {
            tls_cert: file.tls_cert,
            tls_key: file.tls_key,
            tls_client_ca: file.tls_client_ca,
            tls_reload_interval: file.tls_reload_interval,
            tls_authorization: file.tls_authorization,
            upstream_tls: file.upstream_tls,
            upstream_ca: file.upstream_ca,
            upstream_cert: file.upstream_cert,
            upstream_key: file.upstream_key,
            upstream_server_name: file.upstream_server_name,
        };
        // A flag-level upstream replaces the file's whole failover list.
        let upstream_from_flag = upstream.origin.starts_with("--");
        let file_upstreams = file.upstreams.filter(|_| !upstream_from_flag);
        let nonempty = |v: Vec<String>| (!v.is_empty()).then_some(v);
        apply_groups_and_resilience(
            &mut cfg,
            ExtraFile {
                upstreams: flag_upstreams.or_else(|| {
                    file_upstreams.map(|value| Sourced {
                        value,
                        origin: path.clone(),
                    })
                }),
                groups: file.groups,
                group_metadata_keys: pick(
                    nonempty(self.group_metadata_keys),
                    "group-metadata-keys",
                    file.group_metadata_keys,
                    &path,
                ),
                unmatched: self.unmatched.or(file.unmatched),
                max_new_streams_per_second: pick(
                    self.max_new_streams_per_second,
                    "max-new-streams-per-second",
                    file.max_new_streams_per_second,
                    &path,
                ),
                new_streams_burst: pick(
                    self.new_streams_burst,
                    "new-streams-burst",
                    file.new_streams_burst,
                    &path,
                ),
                resync_interval: pick(
                    self.resync_interval,
                    "resync-interval",
                    file.resync_interval,
                    &path,
                ),
                upstream_keepalive_interval: pick(
                    self.upstream_keepalive_interval,
                    "upstream-keepalive-interval",
                    file.upstream_keepalive_interval,
                    &path,
                ),
                upstream_keepalive_timeout: pick(
                    self.upstream_keepalive_timeout,
                    "upstream-keepalive-timeout",
                    file.upstream_keepalive_timeout,
                    &path,
                ),
            },
            &path,
        )?;
        apply_tls(&mut cfg, self.tls, file_tls, &path)?;
        Ok(cfg)
    }
}

/// The config file's TLS keys.
struct FileTls {
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    tls_reload_interval: Option<String>,
    tls_authorization: Option<Vec<crate::tls::AuthorizationRule>>,
    upstream_tls: Option<bool>,
    upstream_ca: Option<PathBuf>,
    upstream_cert: Option<PathBuf>,
    upstream_key: Option<PathBuf>,
    upstream_server_name: Option<String>,
}

/// Downstream and upstream TLS (README "TLS and mTLS"): flags over file keys; the files are read
/// and checked now, so a bad one is a startup error naming the setting and the file.
fn apply_tls(
    cfg: &mut Config,
    args: TlsArgs,
    file: FileTls,
    path: &str,
) -> Result<(), ConfigError> {
    use crate::tls::{ClientTlsSettings, ServerTls, ServerTlsSettings, UpstreamTls};
    let tls_error =
        |origin: &str, e: crate::tls::TlsError| invalid(origin, e.field(), e.to_string());
    let cert = pick(args.tls_cert, "tls-cert", file.tls_cert, path);
    let key = pick(args.tls_key, "tls-key", file.tls_key, path);
    let client_ca = pick(
        args.tls_client_ca,
        "tls-client-ca",
        file.tls_client_ca,
        path,
    );
    let reload = pick(
        args.tls_reload_interval,
        "tls-reload-interval",
        file.tls_reload_interval,
        path,
    );
    let reload_interval = match reload {
        Some(s) => {
            let d = parse_duration(&s.value)
                .map_err(|m| invalid(&s.origin, "tls_reload_interval", m))?;
            if d.is_zero() {
                return Err(invalid(
                    &s.origin,
                    "tls_reload_interval",
                    "must be more than 0s",
                ));
            }
            d
        }
        None => Duration::from_secs(10),
    };
    match (cert, key) {
        (Some(cert), Some(key)) => {
            let settings = ServerTlsSettings {
                cert: cert.value,
                key: key.value,
                client_ca: client_ca.map(|c| c.value),
                reload_interval,
            };
            cfg.tls = Some(ServerTls::new(settings).map_err(|e| tls_error(&cert.origin, e))?);
        }
        (Some(s), None) => return Err(invalid(&s.origin, "tls_key", "required with tls_cert")),
        (None, Some(s)) => return Err(invalid(&s.origin, "tls_cert", "required with tls_key")),
        (None, None) => {
            if let Some(s) = client_ca {
                return Err(invalid(
                    &s.origin,
                    "tls_client_ca",
                    "needs tls_cert and tls_key",
                ));
            }
        }
    }
    if let Some(rules) = file.tls_authorization {
        let mtls = cfg
            .tls
            .as_ref()
            .is_some_and(|t| t.settings().client_ca.is_some());
        if !rules.is_empty() && !mtls {
            return Err(invalid(
                path,
                "tls_authorization",
                "needs mTLS: set tls_cert, tls_key and tls_client_ca",
            ));
        }
        for (i, r) in rules.iter().enumerate() {
            if r.identity.is_empty() || r.groups.iter().any(String::is_empty) {
                return Err(invalid(
                    path,
                    "tls_authorization",
                    format!(
                        "[[tls_authorization]] #{}: identity and groups must not be empty",
                        i + 1
                    ),
                ));
            }
        }
        cfg.tls_authorization.rules = rules;
    }
    let upstream_tls = args.upstream_tls || file.upstream_tls.unwrap_or(false);
    let ca = pick(args.upstream_ca, "upstream-ca", file.upstream_ca, path);
    let cert = pick(
        args.upstream_cert,
        "upstream-cert",
        file.upstream_cert,
        path,
    );
    let key = pick(args.upstream_key, "upstream-key", file.upstream_key, path);
    let server_name = pick(
        args.upstream_server_name,
        "upstream-server-name",
        file.upstream_server_name,
        path,
    );
    // Where each setting came from, for errors about its file.
    let origin_of = |field: &str| {
        let s = match field {
            "upstream_ca" => ca.as_ref().map(|s| &s.origin),
            "upstream_cert" => cert.as_ref().map(|s| &s.origin),
            "upstream_key" => key.as_ref().map(|s| &s.origin),
            _ => server_name.as_ref().map(|s| &s.origin),
        };
        s.cloned().unwrap_or_else(|| path.to_string())
    };
    match (&cert, &key) {
        (Some(s), None) => {
            return Err(invalid(
                &s.origin,
                "upstream_key",
                "required with upstream_cert",
            ))
        }
        (None, Some(s)) => {
            return Err(invalid(
                &s.origin,
                "upstream_cert",
                "required with upstream_key",
            ))
        }
        _ => {}
    }
    let settings = ClientTlsSettings {
        ca: ca.as_ref().map(|s| s.value.clone()),
        cert: cert.as_ref().map(|s| s.value.clone()),
        key: key.as_ref().map(|s| s.value.clone()),
        server_name: server_name.as_ref().map(|s| s.value.clone()),
    };
    let upstream_tls = upstream_tls
        || cfg
            .upstreams
            .iter()
            .any(|u| u.scheme_str() == Some("https"));
    if upstream_tls {
        // tonic speaks TLS to https:// addresses only.
        for u in &mut cfg.upstreams {
            *u = with_https(u);
        }
        cfg.upstream = with_https(&cfg.upstream);
        let host = cfg.upstream.host().unwrap_or_default().to_string();
        settings
            .load(&host)
            .map_err(|e| tls_error(&origin_of(e.field()), e))?;
    } else if settings != ClientTlsSettings::default() {
        return Err(invalid(
            &origin_of(""),
            "upstream_tls",
            "upstream_ca, upstream_cert, upstream_key and upstream_server_name need upstream_tls \
             = true or an https:// upstream",
        ));
    }
    cfg.upstream_tls = UpstreamTls::new(settings);
    Ok(())
}

/// `uri` with the https scheme.
fn with_https(uri: &http::Uri) -> http::Uri {
    let mut parts = uri.clone().into_parts();
    parts.scheme = Some(http::uri::Scheme::HTTPS);
    http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

/// The settings of "Groups and resilience" (issue 5), each from a flag or the file.
struct ExtraFile {
    upstreams: Option<Sourced<Vec<String>>>,
    /// Structured tables: file only.
    groups: Option<Vec<crate::grouping::GroupRule>>,
    group_metadata_keys: Option<Sourced<Vec<String>>>,
    unmatched: Option<crate::grouping::Unmatched>,
    max_new_streams_per_second: Option<Sourced<f64>>,
    new_streams_burst: Option<Sourced<u32>>,
    resync_interval: Option<Sourced<String>>,
    upstream_keepalive_interval: Option<Sourced<String>>,
    upstream_keepalive_timeout: Option<Sourced<String>>,
}

fn apply_groups_and_resilience(
    cfg: &mut Config,
    f: ExtraFile,
    path: &str,
) -> Result<(), ConfigError> {
    if let Some(Sourced {
        value: list,
        origin,
    }) = f.upstreams
    {
        if list.is_empty() {
            return Err(invalid(
                &origin,
                "upstreams",
                "must list at least one address",
            ));
        }
        cfg.upstreams = list
            .iter()
            .map(|u| parse_upstream(u).map_err(|m| invalid(&origin, "upstreams", m)))
            .collect::<Result<_, _>>()?;
        cfg.upstream = cfg.upstreams[0].clone();
    }
    if let Some(rules) = f.groups {
        for (i, r) in rules.iter().enumerate() {
            r.validate().map_err(|(field, m)| {
                invalid(
                    path,
                    "groups",
                    format!("[[groups]] #{} {field}: {m}", i + 1),
                )
            })?;
        }
        cfg.grouping.rules = rules;
    }
    if let Some(Sourced {
        value: keys,
        origin,
    }) = f.group_metadata_keys
    {
        if keys.iter().any(String::is_empty) {
            return Err(invalid(
                &origin,
                "group_metadata_keys",
                "keys must not be empty",
            ));
        }
        cfg.grouping.metadata_keys = keys;
    }
    if let Some(u) = f.unmatched {
        cfg.grouping.unmatched = u;
    }
    let r = &mut cfg.resilience;
    if let Some(Sourced { value: v, origin }) = f.max_new_streams_per_second {
        if !v.is_finite() || v < 0.0 {
            return Err(invalid(
                &origin,
                "max_new_streams_per_second",
                format!("{v} must be >= 0 (0 disables the limit)"),
            ));
        }
        r.max_new_streams_per_second = v;
    }
    if let Some(Sourced { value: v, origin }) = f.new_streams_burst {
        if v == 0 {
            return Err(invalid(&origin, "new_streams_burst", "must be at least 1"));
        }
        r.new_streams_burst = v;
    }
    if let Some(Sourced { value: v, origin }) = f.resync_interval {
        let d = parse_duration(&v).map_err(|m| invalid(&origin, "resync_interval", m))?;
        if !d.is_zero() && d < Duration::from_secs(1) {
            return Err(invalid(
                &origin,
                "resync_interval",
                format!("{v:?} is too short (minimum 1s; 0s turns resync off)"),
            ));
        }
        r.resync_interval = (!d.is_zero()).then_some(d);
    }
    if let Some(Sourced { value: v, origin }) = f.upstream_keepalive_interval {
        r.upstream_keepalive_interval =
            parse_duration(&v).map_err(|m| invalid(&origin, "upstream_keepalive_interval", m))?;
    }
    if let Some(Sourced { value: v, origin }) = f.upstream_keepalive_timeout {
        r.upstream_keepalive_timeout =
            parse_duration(&v).map_err(|m| invalid(&origin, "upstream_keepalive_timeout", m))?;
    }
    if r.upstream_keepalive_interval.is_zero() || r.upstream_keepalive_timeout.is_zero() {
        return Err(invalid(
            path,
            "upstream_keepalive_interval",
            "upstream keepalive interval and timeout must be > 0",
        ));
    }
    Ok(())
}

/// Warm-restart settings: the path turns the feature on; the other two need it.
fn apply_snapshot(
    path: Option<Sourced<PathBuf>>,
    interval: Option<Sourced<String>>,
    max_staleness: Option<Sourced<String>>,
) -> Result<Option<SnapshotConfig>, ConfigError> {
    let Some(path) = path else {
        if let Some(s) = interval {
            return Err(invalid(
                &s.origin,
                "snapshot_interval",
                "needs snapshot_path",
            ));
        }
        if let Some(s) = max_staleness {
            return Err(invalid(
                &s.origin,
                "snapshot_max_staleness",
                "needs snapshot_path",
            ));
        }
        return Ok(None);
    };
    if path.value.as_os_str().is_empty() || path.value.file_name().is_none() {
        return Err(invalid(&path.origin, "snapshot_path", "must name a file"));
    }
    let mut c = SnapshotConfig::new(path.value);
    if let Some(s) = interval {
        let d = parse_duration(&s.value).map_err(|m| invalid(&s.origin, "snapshot_interval", m))?;
        if d < Duration::from_secs(1) {
            return Err(invalid(
                &s.origin,
                "snapshot_interval",
                format!("{:?} is too short (minimum 1s)", s.value),
            ));
        }
        c.interval = d;
    }
    if let Some(s) = max_staleness {
        let d = parse_duration(&s.value)
            .map_err(|m| invalid(&s.origin, "snapshot_max_staleness", m))?;
        if d.is_zero() {
            return Err(invalid(&s.origin, "snapshot_max_staleness", "must be > 0"));
        }
        c.max_staleness = d;
    }
    Ok(Some(c))
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.display().to_string(),
        message: e.to_string(),
    })
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

/// Parses `250ms`, `30s`, `5m`, `1h`, or a bare number of seconds.
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

/// Run-time log level control (`POST /debug/log-level`): the binary installs the global
/// subscriber with a reloadable filter; the admin API swaps the filter.
pub mod logging {
    use std::sync::{Mutex, OnceLock};

    use tracing_subscriber::prelude::*;
    use tracing_subscriber::{fmt, reload, EnvFilter, Registry};

    use super::LogFormat;

    struct Control {
        handle: reload::Handle<EnvFilter, Registry>,
        current: Mutex<String>,
    }

    static CONTROL: OnceLock<Control> = OnceLock::new();

    /// Installs the global subscriber: `format`, filtered by `RUST_LOG` (default `info`), with a
    /// filter the admin API can replace. Returns false if a subscriber was already installed.
    pub fn init(format: LogFormat) -> bool {
        let initial = std::env::var("RUST_LOG")
            .ok()
            .filter(|s| EnvFilter::try_new(s).is_ok())
            .unwrap_or_else(|| "info".to_string());
        let (filter, handle) = reload::Layer::new(EnvFilter::new(&initial));
        let text = (format == LogFormat::Text).then(fmt::layer);
        let json = (format == LogFormat::Json).then(|| fmt::layer().json().flatten_event(true));
        let installed = tracing_subscriber::registry()
            .with(filter)
            .with(text)
            .with(json)
            .try_init()
            .is_ok();
        if installed {
            let _ = CONTROL.set(Control {
                handle,
                current: Mutex::new(initial),
            });
        }
        installed
    }

    /// The current filter, if the binary installed a reloadable one.
    pub fn level() -> Option<String> {
        CONTROL.get().map(|c| crate::sync::lock(&c.current).clone())
    }

    #[derive(Debug, thiserror::Error)]
    pub enum LevelError {
        #[error("log level control is not available (logging was not set up by the binary)")]
        Unavailable,
        #[error("invalid level or filter {0:?}: {1}")]
        Invalid(String, String),
    }

    /// Replaces the filter: a level (`debug`) or any `RUST_LOG` directive (`info,adsrelay=debug`).
    pub fn set_level(directive: &str) -> Result<(), LevelError> {
        let control = CONTROL.get().ok_or(LevelError::Unavailable)?;
        let filter = EnvFilter::try_new(directive)
            .map_err(|e| LevelError::Invalid(directive.to_string(), e.to_string()))?;
        control
            .handle
            .reload(filter)
            .map_err(|e| LevelError::Invalid(directive.to_string(), e.to_string()))?;
        *crate::sync::lock(&control.current) = directive.to_string();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(upstream: Option<&str>) -> RelayArgs {
        RelayArgs {
            upstream: upstream.map(String::from),
            ..Default::default()
        }
    }

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

    #[test]
    fn missing_upstream_names_the_field() {
        let e = args(None).into_config().unwrap_err().to_string();
        assert!(e.contains("upstream"), "{e}");
    }

    #[test]
    fn flag_errors_name_the_flag() {
        let mut a = args(Some("127.0.0.1:1"));
        a.listen = Some("nonsense".into());
        let e = a.into_config().unwrap_err().to_string();
        assert!(e.starts_with("--listen: listen:"), "{e}");
    }

    #[test]
    fn snapshot_settings_from_file_and_flags() {
        let dir = std::env::temp_dir().join(format!("adsrelay-snapcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\nsnapshot_path = \"/var/lib/adsrelay/cache.snap\"\n\
             snapshot_max_staleness = \"2h\"\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        a.snapshot_interval = Some("10s".into());
        let c = a.into_config().unwrap().snapshot.unwrap();
        assert_eq!(c.path, PathBuf::from("/var/lib/adsrelay/cache.snap"));
        assert_eq!(c.interval, Duration::from_secs(10));
        assert_eq!(c.max_staleness, Duration::from_secs(7200));
        assert!(args(Some("127.0.0.1:1"))
            .into_config()
            .unwrap()
            .snapshot
            .is_none());

        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\nsnapshot_interval = \"5s\"\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        let e = a.into_config().unwrap_err().to_string();
        assert!(
            e.contains("relay.toml: snapshot_interval: needs snapshot_path"),
            "{e}"
        );
        let mut a = args(Some("127.0.0.1:1"));
        a.snapshot_path = Some("/tmp/x.snap".into());
        a.snapshot_interval = Some("10ms".into());
        let e = a.into_config().unwrap_err().to_string();
        assert!(
            e.starts_with("--snapshot-interval: snapshot_interval:"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unsubscribed_cache_bytes_from_file_or_flag() {
        let dir = std::env::temp_dir().join(format!("adsrelay-cfg-lru-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        let default = args(Some("127.0.0.1:1")).into_config().unwrap();
        assert_eq!(default.unsubscribed_cache_bytes, 64 << 20);
        assert_eq!(default.unsubscribe_linger, Duration::from_secs(300));
        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\nunsubscribed_cache_bytes = 1024\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        assert_eq!(a.into_config().unwrap().unsubscribed_cache_bytes, 1024);
        let mut a = args(None);
        a.config = Some(path.clone());
        a.unsubscribed_cache_bytes = Some(0);
        assert_eq!(a.into_config().unwrap().unsubscribed_cache_bytes, 0);
        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\nunsubscribed_cache_bytes = -1\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        let e = a.into_config().unwrap_err().to_string();
        assert!(
            e.contains("relay.toml") && e.contains("unsubscribed_cache_bytes"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_errors_name_file_and_field() {
        let dir = std::env::temp_dir().join(format!("adsrelay-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\nunsubscribe_linger = \"soon\"\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        let e = a.into_config().unwrap_err().to_string();
        assert!(e.contains("relay.toml: unsubscribe_linger:"), "{e}");

        std::fs::write(&path, "upstream = \"127.0.0.1:1\"\nlisten_port = 5\n").unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        let e = a.into_config().unwrap_err().to_string();
        assert!(e.contains("relay.toml") && e.contains("listen_port"), "{e}");

        // Flags override the file.
        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\nnode_id = \"from-file\"\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path);
        a.node_id = Some("from-flag".into());
        assert_eq!(a.into_config().unwrap().node_id, "from-flag");
    }

    #[test]
    fn groups_upstreams_and_resilience_from_file() {
        let dir = std::env::temp_dir().join(format!("adsrelay-cfg5-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(
            &path,
            "upstreams = [\"10.0.0.1:18000\", \"cp-b.internal:18000\"]\n\
             resync_interval = \"10m\"\nmax_new_streams_per_second = 50\n\
             unmatched = \"passthrough\"\n\
             [[groups]]\ncluster = \"edge-*\"\nupstream_id = \"adsrelay-{cluster}\"\n\
             metadata_keys = [\"env\"]\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path.clone());
        let c = a.into_config().unwrap();
        assert_eq!(c.upstreams.len(), 2);
        assert_eq!(c.upstream, c.upstreams[0]);
        assert_eq!(c.resilience.resync_interval, Some(Duration::from_secs(600)));
        assert_eq!(c.resilience.max_new_streams_per_second, 50.0);
        assert_eq!(
            c.grouping.unmatched,
            crate::grouping::Unmatched::Passthrough
        );
        assert_eq!(c.grouping.rules[0].metadata_keys, vec!["env".to_string()]);

        std::fs::write(
            &path,
            "upstream = \"127.0.0.1:1\"\n[[groups]]\nupstream_id = \"{clustr}\"\n",
        )
        .unwrap();
        let mut a = args(None);
        a.config = Some(path);
        let e = a.into_config().unwrap_err().to_string();
        assert!(
            e.contains("[[groups]] #1 upstream_id") && e.contains("{clustr}"),
            "{e}"
        );
    }
}
