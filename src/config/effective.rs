//! `adsrelay check-config`: the validated configuration as TOML-style lines, each with where its
//! value came from (flag > `ADSRELAY_*` environment variable > config file > default).

use std::fmt::Write as _;
use std::time::Duration;

use super::{Config, Origins, Source};

/// A duration as the config accepts it back (`250ms`, `30s`, `5m`, `1h`).
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".into(),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

fn quoted(s: impl std::fmt::Display) -> String {
    format!("{:?}", s.to_string())
}

fn list<T: std::fmt::Display>(items: &[T]) -> String {
    let items: Vec<String> = items.iter().map(quoted).collect();
    format!("[{}]", items.join(", "))
}

/// Every setting of `c` as `(key, TOML value)`; `None` for an unset optional setting.
pub fn settings(c: &Config) -> Vec<(&'static str, Option<String>)> {
    let d = |d: Duration| Some(quoted(duration(d)));
    let path = |p: Option<&std::path::PathBuf>| p.map(|p| quoted(p.display()));
    let server = c.tls.as_ref().map(|t| t.settings());
    let up = &c.upstream_tls.settings;
    let (l, r, s) = (&c.limits, &c.resilience, c.snapshot.as_ref());
    let unmatched = match c.grouping.unmatched {
        crate::grouping::Unmatched::Reject => "reject",
        crate::grouping::Unmatched::Passthrough => "passthrough",
    };
    vec![
        ("upstream", Some(quoted(&c.upstream))),
        ("upstreams", Some(list(&c.upstreams))),
        ("listen", Some(quoted(c.listen))),
        ("admin", Some(quoted(c.admin))),
        ("node_id", Some(quoted(&c.node_id))),
        (
            "log_format",
            Some(quoted(format!("{:?}", c.log_format).to_lowercase())),
        ),
        ("unsubscribe_linger", d(c.unsubscribe_linger)),
        (
            "unsubscribed_cache_bytes",
            Some(c.unsubscribed_cache_bytes.to_string()),
        ),
        ("max_message_bytes", Some(c.max_message_bytes.to_string())),
        ("params_from_metadata", Some(list(&c.params_from_metadata))),
        ("upstream_backoff_initial", d(c.backoff_initial)),
        ("upstream_backoff_max", d(c.backoff_max)),
        ("max_connections", Some(l.max_connections.to_string())),
        (
            "max_streams_per_connection",
            Some(l.max_streams_per_connection.to_string()),
        ),
        (
            "max_subscriptions_per_stream",
            Some(l.max_subscriptions_per_stream.to_string()),
        ),
        ("max_name_bytes", Some(l.max_name_bytes.to_string())),
        ("max_response_bytes", Some(l.max_response_bytes.to_string())),
        ("fd_reserve", Some(l.fd_reserve.to_string())),
        (
            "max_requests_per_second",
            Some(l.max_requests_per_second.to_string()),
        ),
        ("request_burst", Some(l.request_burst.to_string())),
        ("stuck_client_timeout", d(l.stuck_client_timeout)),
        ("drain_period", d(l.drain_period)),
        (
            "max_connection_age",
            d(l.max_connection_age.unwrap_or_default()),
        ),
        ("max_connection_age_grace", d(l.max_connection_age_grace)),
        ("group_metadata_keys", Some(list(&c.grouping.metadata_keys))),
        ("unmatched", Some(quoted(unmatched))),
        (
            "max_new_streams_per_second",
            Some(r.max_new_streams_per_second.to_string()),
        ),
        ("new_streams_burst", Some(r.new_streams_burst.to_string())),
        (
            "upstream_protocol",
            Some(quoted(c.upstream_protocol.as_str())),
        ),
        ("resync_interval", d(r.resync_interval.unwrap_or_default())),
        (
            "upstream_keepalive_interval",
            d(r.upstream_keepalive_interval),
        ),
        (
            "upstream_keepalive_timeout",
            d(r.upstream_keepalive_timeout),
        ),
        ("snapshot_path", path(s.map(|s| &s.path))),
        ("snapshot_interval", s.and_then(|s| d(s.interval))),
        ("snapshot_max_staleness", s.and_then(|s| d(s.max_staleness))),
        ("tls_cert", path(server.map(|t| &t.cert))),
        ("tls_key", path(server.map(|t| &t.key))),
        (
            "tls_client_ca",
            path(server.and_then(|t| t.client_ca.as_ref())),
        ),
        (
            "tls_reload_interval",
            server.and_then(|t| d(t.reload_interval)),
        ),
        (
            "upstream_tls",
            Some((c.upstream.scheme_str() == Some("https")).to_string()),
        ),
        ("upstream_ca", path(up.ca.as_ref())),
        ("upstream_cert", path(up.cert.as_ref())),
        ("upstream_key", path(up.key.as_ref())),
        ("upstream_server_name", up.server_name.as_ref().map(quoted)),
    ]
}

/// Where `key`'s effective value came from: the failover list that was not set is the single
/// upstream, and comes from wherever that came from.
fn source(key: &str, origins: &Origins) -> Source {
    let known = origins.get(key).or_else(|| match key {
        "upstreams" => origins.get("upstream"),
        _ => None,
    });
    known.cloned().unwrap_or(Source::Default)
}

/// The report `check-config` prints: one `key = value  # source` line per setting; the
/// structured file-only tables are summarized.
pub fn report(c: &Config, origins: &Origins) -> String {
    let mut out = String::from(
        "# adsrelay effective configuration (flag > ADSRELAY_* env > file > default)\n",
    );
    for (key, value) in settings(c) {
        let from = source(key, origins);
        let _ = match value {
            Some(v) => writeln!(out, "{key} = {v}  # {from}"),
            None => writeln!(out, "# {key} is not set  # {from}"),
        };
    }
    let _ = writeln!(
        out,
        "# [[groups]]: {} rule(s); [[tls_authorization]]: {} rule(s) (config file only)",
        c.grouping.rules.len(),
        c.tls_authorization.rules.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_in_the_largest_exact_unit() {
        for (ms, want) in [
            (0, "0s"),
            (250, "250ms"),
            (30_000, "30s"),
            (300_000, "5m"),
            (3_600_000, "1h"),
        ] {
            let d = Duration::from_millis(ms);
            assert_eq!(duration(d), want);
            assert_eq!(
                super::super::parse_duration(want),
                Ok(d),
                "{want} reads back"
            );
        }
    }
}
