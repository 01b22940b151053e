//! [`Settings`]: each relay setting declared once, optional, read by clap (a long flag and its
//! `ADSRELAY_*` variable) and by serde (the config file key: the flag with underscores), and
//! merged layer over layer by one generated function that records where each value came from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;

use super::{env_var, ConfigError, LogFormat};
use crate::grouping::{GroupRule, Unmatched};
use crate::tls::AuthorizationRule;

/// Where one setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(String),
    Env(String),
    File(String),
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "flag --{flag}"),
            Source::Env(var) => write!(f, "env {var}"),
            Source::File(path) => write!(f, "file {path}"),
            Source::Default => f.write_str("default"),
        }
    }
}

impl Source {
    /// How errors name it: `--flag`, `ADSRELAY_VAR` or the file's path.
    pub fn origin(&self) -> String {
        match self {
            Source::Flag(flag) => format!("--{flag}"),
            Source::Env(s) | Source::File(s) => s.clone(),
            Source::Default => "default".into(),
        }
    }

    /// The merge layer: the command line (flags and variables, as clap merges them), the file,
    /// the default.
    fn layer(&self) -> u8 {
        match self {
            Source::Flag(_) | Source::Env(_) => 2,
            Source::File(_) => 1,
            Source::Default => 0,
        }
    }
}

/// The source of each setting that has a value; a missing key is its default.
pub type Origins = BTreeMap<&'static str, Source>;

/// Declares [`Settings`] with every field wrapped in `Option`, and the field-by-field merge.
macro_rules! settings {
    ($(#[$smeta:meta])* pub struct Settings { $( $(#[$fmeta:meta])* $field:ident: $ty:ty, )* }) => {
        $(#[$smeta])*
        pub struct Settings { $( $(#[$fmeta])* pub $field: Option<$ty>, )* }

        impl Settings {
            /// Takes each setting still unset from `lower`, recording its source; `source` gives
            /// none for a value that was not really set (a clap default).
            fn fill_from(
                &mut self,
                lower: Settings,
                source: impl Fn(&'static str) -> Option<Source>,
                origins: &mut Origins,
            ) {
                $(
                    if self.$field.is_none() && lower.$field.is_some() {
                        if let Some(from) = source(stringify!($field)) {
                            self.$field = lower.$field;
                            origins.insert(stringify!($field), from);
                        }
                    }
                )*
            }
        }
    };
}

settings! {
    /// Every relay setting. Field names are the config file keys and the long flags (with
    /// dashes); defaults are in [`super::defaults`], applied by validation.
    #[derive(Debug, Default, clap::Args, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Settings {
        /// Upstream xDS control plane, `host:port` or `http://host:port`. The relay keeps retrying
        /// until it is reachable.
        #[arg(long, value_name = "ADDR", env = "ADSRELAY_UPSTREAM")]
        upstream: String,
        /// Address for downstream xDS clients (gRPC) [default: 0.0.0.0:18000]
        #[arg(long, value_name = "ADDR", env = "ADSRELAY_LISTEN")]
        listen: String,
        /// Address for the admin HTTP server (/healthz, /readyz) [default: 127.0.0.1:9902]
        #[arg(long, value_name = "ADDR", env = "ADSRELAY_ADMIN")]
        admin: String,
        /// `node.id` the relay presents upstream; `node.cluster` is the aggregation group [default:
        /// adsrelay]
        #[arg(long, value_name = "ID", env = "ADSRELAY_NODE_ID")]
        node_id: String,
        /// How long the relay stays subscribed upstream after the last client left a resource, e.g.
        /// `30s`, `500ms`, `0s` [default: 5m]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_UNSUBSCRIBE_LINGER")]
        unsubscribe_linger: String,
        /// Per group: encoded bytes of resources no client subscribes to that the relay keeps
        /// (least recently left evicted first); 0 keeps none [default: 67108864]
        #[arg(long, value_name = "BYTES", env = "ADSRELAY_UNSUBSCRIBED_CACHE_BYTES")]
        unsubscribed_cache_bytes: usize,
        /// Largest xDS message accepted or sent, in bytes [default: 67108864]
        #[arg(long, value_name = "BYTES", env = "ADSRELAY_MAX_MESSAGE_BYTES")]
        max_message_bytes: usize,
        /// Node metadata key whose value becomes a dynamic parameter of the client's plain-name
        /// subscriptions (TP2 migration path); repeatable
        #[arg(
            long = "param-from-metadata",
            value_name = "KEY",
            env = "ADSRELAY_PARAM_FROM_METADATA",
            value_delimiter = ','
        )]
        params_from_metadata: Vec<String>,
        /// Log format [default: text]; the level comes from RUST_LOG (default `info`)
        #[arg(long, value_enum, env = "ADSRELAY_LOG_FORMAT")]
        log_format: LogFormat,
        /// Open downstream connections; further ones are closed at once [default: 20000]
        #[arg(long, value_name = "N", env = "ADSRELAY_MAX_CONNECTIONS")]
        max_connections: usize,
        /// Concurrent HTTP/2 streams per downstream connection [default: 100]
        #[arg(long, value_name = "N", env = "ADSRELAY_MAX_STREAMS_PER_CONNECTION")]
        max_streams_per_connection: u32,
        /// Subscriptions one stream may hold, all types together [default: 100000]
        #[arg(long, value_name = "N", env = "ADSRELAY_MAX_SUBSCRIPTIONS_PER_STREAM")]
        max_subscriptions_per_stream: usize,
        /// Longest resource name, type_url or locator parameter in a request, in bytes [default: 4096]
        #[arg(long, value_name = "BYTES", env = "ADSRELAY_MAX_NAME_BYTES")]
        max_name_bytes: usize,
        /// Largest response sent to a client (its gRPC receive limit): a larger Delta state is split
        /// over several responses [default: 4194304]
        #[arg(long, value_name = "BYTES", env = "ADSRELAY_MAX_RESPONSE_BYTES")]
        max_response_bytes: usize,
        /// File descriptors kept free for the admin port, the upstream and snapshots: new client
        /// connections are closed at once when fewer are free; 0 disables it [default: 64]
        #[arg(long, value_name = "N", env = "ADSRELAY_FD_RESERVE")]
        fd_reserve: u64,
        /// Sustained requests per second per stream; 0 disables the limit [default: 100]
        #[arg(long, value_name = "N", env = "ADSRELAY_MAX_REQUESTS_PER_SECOND")]
        max_requests_per_second: u32,
        /// Requests per stream allowed in a burst above the sustained rate [default: 1000]
        #[arg(long, value_name = "N", env = "ADSRELAY_REQUEST_BURST")]
        request_burst: u32,
        /// End a stream whose responses the client has not read for this long; 0s disables it
        /// [default: 60s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_STUCK_CLIENT_TIMEOUT")]
        stuck_client_timeout: String,
        /// On SIGTERM, close client connections gradually over this period, then exit [default: 10s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_DRAIN_PERIOD")]
        drain_period: String,
        /// TOML config file; flags and ADSRELAY_* variables override its values
        #[arg(long, value_name = "FILE", env = "ADSRELAY_CONFIG")]
        #[serde(skip)]
        config: PathBuf,
        /// Warm restart: persist the cache to this file and serve from it after a restart (off unless
        /// set)
        #[arg(long, value_name = "FILE", env = "ADSRELAY_SNAPSHOT_PATH")]
        snapshot_path: PathBuf,
        /// How often the snapshot is rewritten (also written on graceful shutdown) [default: 30s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_SNAPSHOT_INTERVAL")]
        snapshot_interval: String,
        /// A snapshot older than this is not loaded [default: 1h]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_SNAPSHOT_MAX_STALENESS")]
        snapshot_max_staleness: String,
        /// Control-plane addresses in failover order (comma-separated or repeated); the first is the
        /// upstream [default: --upstream alone]
        #[arg(long, value_name = "ADDR", env = "ADSRELAY_UPSTREAMS", value_delimiter = ',')]
        upstreams: Vec<String>,
        /// First upstream reconnect delay [default: 250ms]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_UPSTREAM_BACKOFF_INITIAL")]
        upstream_backoff_initial: String,
        /// Longest upstream reconnect delay [default: 30s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_UPSTREAM_BACKOFF_MAX")]
        upstream_backoff_max: String,
        /// Node metadata keys that split the implicit group (comma-separated or repeated)
        #[arg(long, value_name = "KEY", env = "ADSRELAY_GROUP_METADATA_KEYS", value_delimiter = ',')]
        group_metadata_keys: Vec<String>,
        /// What happens to a client no `[[groups]]` rule matches [default: reject]
        #[arg(long, value_enum, env = "ADSRELAY_UNMATCHED")]
        unmatched: Unmatched,
        /// New downstream streams admitted per second; 0 disables the limit [default: 5000]
        #[arg(long, value_name = "N", env = "ADSRELAY_MAX_NEW_STREAMS_PER_SECOND")]
        max_new_streams_per_second: f64,
        /// New streams admitted in a burst above that rate [default: 10000]
        #[arg(long, value_name = "N", env = "ADSRELAY_NEW_STREAMS_BURST")]
        new_streams_burst: u32,
        /// ADS flavour spoken to the control plane: delta, sotw (for control planes without
        /// Delta) or auto (Delta, switching an upstream that answers UNIMPLEMENTED to SotW)
        /// [default: delta]
        #[arg(long, value_name = "PROTOCOL", env = "ADSRELAY_UPSTREAM_PROTOCOL")]
        upstream_protocol: String,
        /// Periodic reconciliation with the upstream: a stream without versions whose full-state
        /// answers are compared with the cache (jittered ±20 %); 0s turns it off [default: 5m]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_RESYNC_INTERVAL")]
        resync_interval: String,
        /// HTTP/2 keepalive ping interval on the upstream connection [default: 30s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_UPSTREAM_KEEPALIVE_INTERVAL")]
        upstream_keepalive_interval: String,
        /// Upstream keepalive ping timeout [default: 10s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_UPSTREAM_KEEPALIVE_TIMEOUT")]
        upstream_keepalive_timeout: String,
        /// Send a downstream connection an HTTP/2 GOAWAY after about this long (up to 10% earlier,
        /// at random), so clients reconnect through the load balancer and spread over replicas; 0s
        /// turns it off [default: 0s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_MAX_CONNECTION_AGE")]
        max_connection_age: String,
        /// After the GOAWAY, how long in-flight streams may finish before the connection is closed
        /// [default: 30s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_MAX_CONNECTION_AGE_GRACE")]
        max_connection_age_grace: String,
        /// Serve downstream xDS over TLS with this PEM certificate chain (needs --tls-key)
        #[arg(long, value_name = "FILE", env = "ADSRELAY_TLS_CERT")]
        tls_cert: PathBuf,
        /// PEM private key of --tls-cert
        #[arg(long, value_name = "FILE", env = "ADSRELAY_TLS_KEY")]
        tls_key: PathBuf,
        /// Require client certificates signed by this PEM CA bundle (mTLS)
        #[arg(long, value_name = "FILE", env = "ADSRELAY_TLS_CLIENT_CA")]
        tls_client_ca: PathBuf,
        /// How often the TLS files are checked for changes [default: 10s]
        #[arg(long, value_name = "DURATION", env = "ADSRELAY_TLS_RELOAD_INTERVAL")]
        tls_reload_interval: String,
        /// Connect to the upstream over TLS (implied by an https:// address)
        #[arg(long, env = "ADSRELAY_UPSTREAM_TLS", action = clap::ArgAction::SetTrue)]
        upstream_tls: bool,
        /// PEM CA bundle that verifies the upstream's certificate [default: the system roots]
        #[arg(long, value_name = "FILE", env = "ADSRELAY_UPSTREAM_CA")]
        upstream_ca: PathBuf,
        /// PEM client certificate presented upstream (mTLS; needs --upstream-key)
        #[arg(long, value_name = "FILE", env = "ADSRELAY_UPSTREAM_CERT")]
        upstream_cert: PathBuf,
        /// PEM private key of --upstream-cert
        #[arg(long, value_name = "FILE", env = "ADSRELAY_UPSTREAM_KEY")]
        upstream_key: PathBuf,
        /// Name sent as SNI and required in the upstream's certificate [default: the address's host]
        #[arg(long, value_name = "NAME", env = "ADSRELAY_UPSTREAM_SERVER_NAME")]
        upstream_server_name: String,
        /// `[[groups]]` rules (config file only).
        #[arg(skip)]
        groups: Vec<GroupRule>,
        /// `[[tls_authorization]]` rules (config file only).
        #[arg(skip)]
        tls_authorization: Vec<AuthorizationRule>,
    }
}

/// The long flag of a setting (they match but for this one, which is repeatable).
pub fn flag_of(key: &str) -> String {
    match key {
        "params_from_metadata" => "param-from-metadata".into(),
        k => k.replace('_', "-"),
    }
}

/// The settings merged from every layer, and where each value came from.
#[derive(Debug, Default)]
pub struct Merged {
    pub settings: Settings,
    pub origins: Origins,
}

impl Merged {
    /// `cli` over the config file it names. `matches` tells values read from a variable (and
    /// clap's defaults) from flags; without it every value of `cli` counts as a flag.
    pub fn load(cli: Settings, matches: Option<&clap::ArgMatches>) -> Result<Self, ConfigError> {
        let mut merged = Merged::default();
        let file = match &cli.config {
            Some(path) => Some((read_file(path)?, path.display().to_string())),
            None => None,
        };
        let cli_source = |key: &'static str| match matches.and_then(|m| m.value_source(key)) {
            Some(ValueSource::EnvVariable) => Some(Source::Env(env_var(&flag_of(key)))),
            // The `false` clap gives a switch that was not given.
            Some(ValueSource::DefaultValue) => None,
            _ => Some(Source::Flag(flag_of(key))),
        };
        merged
            .settings
            .fill_from(cli, cli_source, &mut merged.origins);
        if let Some((file, path)) = file {
            let from_file = |_| Some(Source::File(path.clone()));
            merged
                .settings
                .fill_from(file, from_file, &mut merged.origins);
        }
        merged.upstream_follows_list();
        Ok(merged)
    }

    /// A layer's failover list also sets its upstream, and a layer's single upstream replaces the
    /// list of a lower layer.
    fn upstream_follows_list(&mut self) {
        let layer = |key| self.origins.get(key).map_or(0, Source::layer);
        let (single, list) = (layer("upstream"), layer("upstreams"));
        if list < single {
            self.settings.upstreams = None;
            self.origins.remove("upstreams");
        } else if list > single {
            self.settings.upstream = None;
            if let Some(from) = self.origins.get("upstreams").cloned() {
                self.origins.insert("upstream", from);
            }
        }
    }

    /// Where `key`'s value came from, as errors name it.
    pub fn origin(&self, key: &str) -> String {
        self.origins
            .get(key)
            .map_or_else(|| Source::Default.origin(), Source::origin)
    }
}

fn read_file(path: &Path) -> Result<Settings, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
