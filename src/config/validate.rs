//! Validation: merged [`Settings`] -> [`Config`]. Each value is checked and unset ones take their
//! [`defaults`]; an error names the field and where its value came from. The only I/O is tls.rs
//! reading the TLS files, so that an unusable one is a startup error, not a failed handshake.

use std::time::Duration;

use super::settings::Merged;
use super::{
    defaults, invalid, parse_addr, parse_duration, parse_upstream, Config, ConfigError, Settings,
    SnapshotConfig,
};
use crate::tls::{ClientTlsSettings, ServerTls, ServerTlsSettings, TlsError, UpstreamTls};

impl Settings {
    /// Validates these settings, each counted as a flag, over the config file they name (tests and
    /// embedders; the binary uses [`Merged::load`] with the parsed arguments).
    pub fn into_config(self) -> Result<Config, ConfigError> {
        Merged::load(self, None)?.to_config()
    }
}

impl Merged {
    /// Validates the merged settings into the relay's [`Config`].
    pub fn to_config(&self) -> Result<Config, ConfigError> {
        let s = &self.settings;
        let single = self.parse("upstream", &s.upstream, parse_upstream)?;
        // The list, when set, is the failover order and its first entry the upstream; an empty
        // list with no upstream at all is reported as the missing upstream below.
        let upstreams = match &s.upstreams {
            Some(list) if list.is_empty() && single.is_some() => {
                return Err(self.invalid("upstreams", "must list at least one address"))
            }
            Some(list) => list
                .iter()
                .map(|u| parse_upstream(u).map_err(|m| self.invalid("upstreams", m)))
                .collect::<Result<Vec<_>, _>>()?,
            None => single.into_iter().collect(),
        };
        let Some(first) = upstreams.first().cloned() else {
            return Err(invalid(
                "command line",
                "upstream",
                "required: set --upstream or `upstream` in the config file",
            ));
        };
        let mut cfg = Config::with_upstream(first);
        cfg.upstreams = upstreams;
        if let Some(a) = self.parse("listen", &s.listen, parse_addr)? {
            cfg.listen = a;
        }
        if let Some(a) = self.parse("admin", &s.admin, parse_addr)? {
            cfg.admin = a;
        }
        if let Some(id) = &s.node_id {
            if id.trim().is_empty() {
                return Err(self.invalid("node_id", "must not be empty"));
            }
            cfg.node_id = id.clone();
        }
        let linger = self.duration("unsubscribe_linger", &s.unsubscribe_linger)?;
        cfg.unsubscribe_linger = linger.unwrap_or(defaults::UNSUBSCRIBE_LINGER);
        cfg.unsubscribed_cache_bytes = s
            .unsubscribed_cache_bytes
            .unwrap_or(defaults::UNSUBSCRIBED_CACHE_BYTES);
        cfg.max_message_bytes = self.min_size(
            "max_message_bytes",
            s.max_message_bytes,
            64 << 10,
            defaults::MAX_MESSAGE_BYTES,
        )?;
        cfg.log_format = s.log_format.unwrap_or_default();
        cfg.upstream_protocol = self
            .parse(
                "upstream_protocol",
                &s.upstream_protocol,
                crate::config::UpstreamProtocol::parse,
            )?
            .unwrap_or_default();
        cfg.params_from_metadata = s.params_from_metadata.clone().unwrap_or_default();
        if let Some(k) = cfg.params_from_metadata.iter().find(|k| k.is_empty()) {
            let message = format!("{k:?}: keys must not be empty");
            return Err(self.invalid("params_from_metadata", message));
        }
        let initial = self.duration("upstream_backoff_initial", &s.upstream_backoff_initial)?;
        let max = self.duration("upstream_backoff_max", &s.upstream_backoff_max)?;
        cfg.backoff_initial = initial.unwrap_or(defaults::UPSTREAM_BACKOFF_INITIAL);
        cfg.backoff_max = max.unwrap_or(defaults::UPSTREAM_BACKOFF_MAX);
        self.limits(&mut cfg)?;
        if cfg.backoff_initial.is_zero() || cfg.backoff_max < cfg.backoff_initial {
            let set = if max.is_some() {
                "upstream_backoff_max"
            } else {
                "upstream_backoff_initial"
            };
            return Err(invalid(
                &self.origin(set),
                "upstream_backoff_max",
                "backoff must satisfy 0 < upstream_backoff_initial <= upstream_backoff_max",
            ));
        }
        cfg.snapshot = self.snapshot()?;
        self.groups_and_resilience(&mut cfg)?;
        self.tls(&mut cfg)?;
        Ok(cfg)
    }

    fn invalid(&self, key: &'static str, message: impl Into<String>) -> ConfigError {
        invalid(&self.origin(key), key, message)
    }

    /// `value` parsed by `parse`, its error naming `key` and where the value came from.
    fn parse<T>(
        &self,
        key: &'static str,
        value: &Option<String>,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, ConfigError> {
        let parsed = value
            .as_deref()
            .map(|v| parse(v).map_err(|m| self.invalid(key, m)));
        parsed.transpose()
    }

    fn duration(
        &self,
        key: &'static str,
        value: &Option<String>,
    ) -> Result<Option<Duration>, ConfigError> {
        self.parse(key, value, parse_duration)
    }

    /// A duration setting that is off at `0s` and otherwise at least a second.
    fn optional_period(
        &self,
        key: &'static str,
        value: &Option<String>,
        off: &str,
    ) -> Result<Option<Option<Duration>>, ConfigError> {
        let Some(d) = self.duration(key, value)? else {
            return Ok(None);
        };
        if !d.is_zero() && d < Duration::from_secs(1) {
            let v = value.as_deref().unwrap_or_default();
            let message = format!("{v:?} is too short (minimum 1s; 0s turns {off} off)");
            return Err(self.invalid(key, message));
        }
        Ok(Some((!d.is_zero()).then_some(d)))
    }

    /// `value` (else `default`), at least `min` bytes.
    fn min_size(
        &self,
        key: &'static str,
        value: Option<usize>,
        min: usize,
        default: usize,
    ) -> Result<usize, ConfigError> {
        match value {
            Some(v) if v < min => {
                Err(self.invalid(key, format!("{v} is too small (minimum {min})")))
            }
            v => Ok(v.unwrap_or(default)),
        }
    }

    /// `value` (else `default`), at least 1.
    fn positive<T: Copy + Default + PartialEq>(
        &self,
        key: &'static str,
        value: Option<T>,
        default: T,
    ) -> Result<T, ConfigError> {
        match value {
            Some(v) if v == T::default() => Err(self.invalid(key, "must be at least 1")),
            v => Ok(v.unwrap_or(default)),
        }
    }

    fn limits(&self, cfg: &mut Config) -> Result<(), ConfigError> {
        let (s, l) = (&self.settings, &mut cfg.limits);
        l.max_connections = self.positive(
            "max_connections",
            s.max_connections,
            defaults::MAX_CONNECTIONS,
        )?;
        l.max_subscriptions_per_stream = self.positive(
            "max_subscriptions_per_stream",
            s.max_subscriptions_per_stream,
            defaults::MAX_SUBSCRIPTIONS_PER_STREAM,
        )?;
        l.max_name_bytes = self.min_size(
            "max_name_bytes",
            s.max_name_bytes,
            64,
            defaults::MAX_NAME_BYTES,
        )?;
        l.max_response_bytes = self.min_size(
            "max_response_bytes",
            s.max_response_bytes,
            16 << 10,
            defaults::MAX_RESPONSE_BYTES,
        )?;
        l.max_streams_per_connection = self.positive(
            "max_streams_per_connection",
            s.max_streams_per_connection,
            defaults::MAX_STREAMS_PER_CONNECTION,
        )?;
        l.fd_reserve = s.fd_reserve.unwrap_or(defaults::FD_RESERVE);
        l.max_requests_per_second = s
            .max_requests_per_second
            .unwrap_or(defaults::MAX_REQUESTS_PER_SECOND);
        l.request_burst = s.request_burst.unwrap_or(defaults::REQUEST_BURST);
        l.stuck_client_timeout = self
            .duration("stuck_client_timeout", &s.stuck_client_timeout)?
            .unwrap_or(defaults::STUCK_CLIENT_TIMEOUT);
        l.drain_period = self
            .duration("drain_period", &s.drain_period)?
            .unwrap_or(defaults::DRAIN_PERIOD);
        if let Some(age) =
            self.optional_period("max_connection_age", &s.max_connection_age, "it")?
        {
            l.max_connection_age = age;
        }
        l.max_connection_age_grace = self
            .duration("max_connection_age_grace", &s.max_connection_age_grace)?
            .unwrap_or(defaults::MAX_CONNECTION_AGE_GRACE);
        Ok(())
    }

    /// Warm restart: the path turns it on; the other two settings need it.
    fn snapshot(&self) -> Result<Option<SnapshotConfig>, ConfigError> {
        let s = &self.settings;
        let Some(path) = &s.snapshot_path else {
            for (key, v) in [
                ("snapshot_interval", &s.snapshot_interval),
                ("snapshot_max_staleness", &s.snapshot_max_staleness),
            ] {
                if v.is_some() {
                    return Err(self.invalid(key, "needs snapshot_path"));
                }
            }
            return Ok(None);
        };
        if path.as_os_str().is_empty() || path.file_name().is_none() {
            return Err(self.invalid("snapshot_path", "must name a file"));
        }
        let mut c = SnapshotConfig::new(path.clone());
        if let Some(d) = self.duration("snapshot_interval", &s.snapshot_interval)? {
            if d < Duration::from_secs(1) {
                let v = s.snapshot_interval.as_deref().unwrap_or_default();
                let message = format!("{v:?} is too short (minimum 1s)");
                return Err(self.invalid("snapshot_interval", message));
            }
            c.interval = d;
        }
        if let Some(d) = self.duration("snapshot_max_staleness", &s.snapshot_max_staleness)? {
            if d.is_zero() {
                return Err(self.invalid("snapshot_max_staleness", "must be > 0"));
            }
            c.max_staleness = d;
        }
        Ok(Some(c))
    }

    /// "Groups and resilience" (issue 5).
    fn groups_and_resilience(&self, cfg: &mut Config) -> Result<(), ConfigError> {
        let s = &self.settings;
        if let Some(rules) = &s.groups {
            for (i, r) in rules.iter().enumerate() {
                r.validate().map_err(|(field, m)| {
                    self.invalid("groups", format!("[[groups]] #{} {field}: {m}", i + 1))
                })?;
            }
            cfg.grouping.rules = rules.clone();
        }
        if let Some(keys) = &s.group_metadata_keys {
            if keys.iter().any(String::is_empty) {
                return Err(self.invalid("group_metadata_keys", "keys must not be empty"));
            }
            cfg.grouping.metadata_keys = keys.clone();
        }
        cfg.grouping.unmatched = s.unmatched.unwrap_or_default();
        let r = &mut cfg.resilience;
        if let Some(v) = s.max_new_streams_per_second {
            if !v.is_finite() || v < 0.0 {
                let message = format!("{v} must be >= 0 (0 disables the limit)");
                return Err(self.invalid("max_new_streams_per_second", message));
            }
            r.max_new_streams_per_second = v;
        }
        r.new_streams_burst = self.positive(
            "new_streams_burst",
            s.new_streams_burst,
            defaults::NEW_STREAMS_BURST,
        )?;
        if let Some(d) = self.optional_period("resync_interval", &s.resync_interval, "resync")? {
            r.resync_interval = d;
        }
        for (key, value, out) in [
            (
                "upstream_keepalive_interval",
                &s.upstream_keepalive_interval,
                &mut r.upstream_keepalive_interval,
            ),
            (
                "upstream_keepalive_timeout",
                &s.upstream_keepalive_timeout,
                &mut r.upstream_keepalive_timeout,
            ),
        ] {
            if let Some(d) = self.duration(key, value)? {
                if d.is_zero() {
                    let message = "upstream keepalive interval and timeout must be > 0";
                    return Err(self.invalid(key, message));
                }
                *out = d;
            }
        }
        Ok(())
    }

    /// Downstream and upstream TLS (docs/configure.md "TLS and mTLS"); tls.rs reads and checks the files.
    fn tls(&self, cfg: &mut Config) -> Result<(), ConfigError> {
        let s = &self.settings;
        // A file's error names the setting and where that setting came from.
        let tls_error = |e: TlsError| invalid(&self.origin(e.field()), e.field(), e.to_string());
        let reload_interval = match self.duration("tls_reload_interval", &s.tls_reload_interval)? {
            Some(d) if d.is_zero() => {
                return Err(self.invalid("tls_reload_interval", "must be more than 0s"))
            }
            d => d.unwrap_or(defaults::TLS_RELOAD_INTERVAL),
        };
        match (&s.tls_cert, &s.tls_key) {
            (Some(cert), Some(key)) => {
                let settings = ServerTlsSettings {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: s.tls_client_ca.clone(),
                    reload_interval,
                };
                cfg.tls = Some(ServerTls::new(settings).map_err(tls_error)?);
            }
            (Some(_), None) => {
                let origin = self.origin("tls_cert");
                return Err(invalid(&origin, "tls_key", "required with tls_cert"));
            }
            (None, Some(_)) => {
                let origin = self.origin("tls_key");
                return Err(invalid(&origin, "tls_cert", "required with tls_key"));
            }
            (None, None) if s.tls_client_ca.is_some() => {
                return Err(self.invalid("tls_client_ca", "needs tls_cert and tls_key"));
            }
            (None, None) => {}
        }
        if let Some(rules) = &s.tls_authorization {
            let mtls = cfg
                .tls
                .as_ref()
                .is_some_and(|t| t.settings().client_ca.is_some());
            if !rules.is_empty() && !mtls {
                let message = "needs mTLS: set tls_cert, tls_key and tls_client_ca";
                return Err(self.invalid("tls_authorization", message));
            }
            if let Some(i) = rules
                .iter()
                .position(|r| r.identity.is_empty() || r.groups.iter().any(String::is_empty))
            {
                let message = format!(
                    "[[tls_authorization]] #{}: identity and groups must not be empty",
                    i + 1
                );
                return Err(self.invalid("tls_authorization", message));
            }
            cfg.tls_authorization.rules = rules.clone();
        }
        match (&s.upstream_cert, &s.upstream_key) {
            (Some(_), None) => {
                let origin = self.origin("upstream_cert");
                return Err(invalid(
                    &origin,
                    "upstream_key",
                    "required with upstream_cert",
                ));
            }
            (None, Some(_)) => {
                let origin = self.origin("upstream_key");
                return Err(invalid(
                    &origin,
                    "upstream_cert",
                    "required with upstream_key",
                ));
            }
            _ => {}
        }
        let settings = ClientTlsSettings {
            ca: s.upstream_ca.clone(),
            cert: s.upstream_cert.clone(),
            key: s.upstream_key.clone(),
            server_name: s.upstream_server_name.clone(),
        };
        let https = cfg
            .upstreams
            .iter()
            .any(|u| u.scheme_str() == Some("https"));
        if s.upstream_tls.unwrap_or(false) || https {
            // tonic speaks TLS to https:// addresses only.
            for u in &mut cfg.upstreams {
                *u = with_https(u);
            }
            cfg.upstream = with_https(&cfg.upstream);
            let host = cfg.upstream.host().unwrap_or_default().to_string();
            settings.load(&host).map_err(tls_error)?;
        } else if settings != ClientTlsSettings::default() {
            let set = ["upstream_ca", "upstream_cert", "upstream_key"]
                .into_iter()
                .find(|k| self.origins.contains_key(k))
                .unwrap_or("upstream_server_name");
            return Err(invalid(
                &self.origin(set),
                "upstream_tls",
                "upstream_ca, upstream_cert, upstream_key and upstream_server_name need \
                 upstream_tls = true or an https:// upstream",
            ));
        }
        cfg.upstream_tls = UpstreamTls::new(settings);
        Ok(())
    }
}

/// `uri` with the https scheme.
fn with_https(uri: &http::Uri) -> http::Uri {
    let mut parts = uri.clone().into_parts();
    parts.scheme = Some(http::uri::Scheme::HTTPS);
    http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn args(upstream: Option<&str>) -> Settings {
        Settings {
            upstream: upstream.map(String::from),
            ..Default::default()
        }
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
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
    }

    #[test]
    fn unsubscribed_cache_bytes_from_file_or_flag() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
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
    }

    #[test]
    fn file_errors_name_file_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
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
