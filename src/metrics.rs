//! Every metric the relay exports, with its name and HELP text, in one place; rendered in the
//! Prometheus text format on the admin port (`/metrics`).
//!
//! The recorder is per relay, not process-global: tests run several relays in
//! one process, and the demo runs a control plane beside the relay. Labels are bounded: `type_url`
//! (capped at [`MAX_TYPE_LABELS`] distinct values, the rest reported as `other`), `group` (one per
//! aggregation group, each of which already costs an upstream stream), `protocol` (`delta` or
//! `sotw`) and `reason` (a fixed set). Never a per-client label.
//!
//! Counters on hot paths are registered once per label set and kept as handles. Gauges that
//! describe state (streams, subscriptions, cache size, upstream state) are computed when
//! `/metrics` is scraped, so the data path pays nothing for them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dashmap::DashMap;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::accept::{AcceptError, AcceptReport, Listener};
use crate::sync::lock;
use crate::xds::Protocol;

/// Distinct `type_url` label values before further ones are reported as `other`.
pub const MAX_TYPE_LABELS: usize = 64;
pub const OTHER_TYPE: &str = "other";

/// Metric names. Each has a HELP text in [`DESCRIPTIONS`].
pub mod name {
    pub const BUILD_INFO: &str = "adsrelay_build_info";
    pub const DOWNSTREAM_CONNECTIONS: &str = "adsrelay_downstream_connections";
    pub const DOWNSTREAM_CONNECTIONS_ACCEPTED: &str =
        "adsrelay_downstream_connections_accepted_total";
    pub const DOWNSTREAM_CONNECTIONS_REJECTED: &str =
        "adsrelay_downstream_connections_rejected_total";
    pub const ACCEPT_ERRORS: &str = "adsrelay_accept_errors_total";
    pub const DOWNSTREAM_STREAMS: &str = "adsrelay_downstream_streams";
    pub const DOWNSTREAM_STREAMS_OPENED: &str = "adsrelay_downstream_streams_opened_total";
    pub const DOWNSTREAM_STREAMS_REJECTED: &str = "adsrelay_downstream_streams_rejected_total";
    pub const DOWNSTREAM_SUBSCRIPTIONS: &str = "adsrelay_downstream_subscriptions";
    pub const DOWNSTREAM_RESPONSES: &str = "adsrelay_downstream_responses_total";
    pub const DOWNSTREAM_RESOURCES_SENT: &str = "adsrelay_downstream_resources_sent_total";
    pub const DOWNSTREAM_SENT_BYTES: &str = "adsrelay_downstream_sent_bytes_total";
    pub const DOWNSTREAM_FRAMES: &str = "adsrelay_downstream_frames_total";
    pub const DOWNSTREAM_ACKS: &str = "adsrelay_downstream_acks_total";
    pub const DOWNSTREAM_NACKS: &str = "adsrelay_downstream_nacks_total";
    pub const FANOUT_LATENCY: &str = "adsrelay_fanout_latency_seconds";
    pub const CACHE_RESOURCES: &str = "adsrelay_cache_resources";
    pub const CACHE_VARIANTS: &str = "adsrelay_cache_variants";
    pub const CACHE_BYTES: &str = "adsrelay_cache_bytes";
    pub const CACHE_HITS: &str = "adsrelay_cache_hits_total";
    pub const CACHE_MISSES: &str = "adsrelay_cache_misses_total";
    pub const TLS_HANDSHAKE_FAILURES: &str = "adsrelay_tls_handshake_failures_total";
    pub const TLS_CERTIFICATE_RELOADS: &str = "adsrelay_tls_certificate_reloads_total";
    pub const UPSTREAM_CONNECTED: &str = "adsrelay_upstream_connected";
    pub const UPSTREAM_SUBSCRIPTIONS: &str = "adsrelay_upstream_subscriptions";
    pub const UPSTREAM_CONNECTS: &str = "adsrelay_upstream_connects_total";
    pub const UPSTREAM_RECONNECTS: &str = "adsrelay_upstream_reconnects_total";
    pub const UPSTREAM_RESPONSES: &str = "adsrelay_upstream_responses_total";
    pub const UPSTREAM_ACKS: &str = "adsrelay_upstream_acks_total";
    pub const UPSTREAM_NACKS: &str = "adsrelay_upstream_nacks_total";
    pub const UPSTREAM_LAST_RESPONSE_AGE: &str = "adsrelay_upstream_last_response_age_seconds";
    pub const VARIANT_AMBIGUOUS_MATCHES: &str = "adsrelay_variant_ambiguous_matches_total";
    pub const DO_NOT_CACHE_REFETCHES: &str = "adsrelay_do_not_cache_refetches_total";
    pub const DO_NOT_CACHE_REFETCH_FALLBACKS: &str =
        "adsrelay_do_not_cache_refetch_fallbacks_total";
    pub const CACHE_TTL_EXPIRED: &str = "adsrelay_cache_ttl_expired_total";
    pub const GROUP_MEMBER_MISMATCH: &str = "adsrelay_group_member_mismatch_total";
    pub const UPSTREAM_GROUPS: &str = "adsrelay_upstream_groups";
    pub const DRIFT_REPAIRS: &str = "adsrelay_drift_repairs_total";
    pub const UPSTREAM_RESYNCS: &str = "adsrelay_upstream_resyncs_total";
    pub const UPSTREAM_FAILOVERS: &str = "adsrelay_upstream_failovers_total";
    pub const UPSTREAM_WILDCARD_UNANSWERED: &str = "adsrelay_upstream_wildcard_unanswered_total";
    pub const RUNTIME_ALIVE_TASKS: &str = "adsrelay_runtime_alive_tasks";
    pub const SNAPSHOT_LOADED_RESOURCES: &str = "adsrelay_snapshot_loaded_resources";
    pub const SNAPSHOT_AGE: &str = "adsrelay_snapshot_age_seconds";
    pub const SNAPSHOT_REJECTED: &str = "adsrelay_snapshot_rejected_total";
    pub const SNAPSHOT_WRITES: &str = "adsrelay_snapshot_writes_total";
    pub const SNAPSHOT_WRITE_FAILURES: &str = "adsrelay_snapshot_write_failures_total";
    pub const UNSUBSCRIBED_CACHE_BUDGET: &str = "adsrelay_unsubscribed_cache_budget_bytes";
    pub const UNSUBSCRIBED_CACHE_BYTES: &str = "adsrelay_unsubscribed_cache_bytes";
    pub const UNSUBSCRIBED_CACHE_ENTRIES: &str = "adsrelay_unsubscribed_cache_entries";
    pub const UNSUBSCRIBED_CACHE_EVICTIONS: &str = "adsrelay_unsubscribed_cache_evictions_total";
    pub const UNSUBSCRIBED_CACHE_RESUBSCRIPTIONS: &str =
        "adsrelay_unsubscribed_cache_resubscriptions_total";
}

/// (name, HELP text). README's "Metrics" table mirrors this list.
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (name::BUILD_INFO, "Always 1; the version and revision (git commit) labels identify the build."),
    (
        name::RUNTIME_ALIVE_TASKS,
        "Tokio tasks alive in the relay (about one per client stream plus a few per group); a number that grows with no clients is a leak.",
    ),
    (name::DOWNSTREAM_CONNECTIONS, "Open downstream (client) TCP connections on the xDS port."),
    (name::DOWNSTREAM_CONNECTIONS_ACCEPTED, "Downstream TCP connections accepted on the xDS port."),
    (name::DOWNSTREAM_STREAMS, "Open downstream xDS streams, by protocol (delta or sotw)."),
    (name::DOWNSTREAM_STREAMS_OPENED, "Downstream xDS streams opened (first request accepted), by protocol."),
    (
        name::DOWNSTREAM_STREAMS_REJECTED,
        "Downstream xDS streams ended by the relay because of a bad request or an exceeded limit, by reason (missing_node, invalid_request, malformed_request, message_too_large, name_too_long, invalid_locator, too_many_subscriptions, rate_limited, stuck_client).",
    ),
    (
        name::DOWNSTREAM_CONNECTIONS_REJECTED,
        "Downstream TCP connections closed at once because max_connections were already open or fewer than fd_reserve file descriptors would remain free.",
    ),
    (
        name::ACCEPT_ERRORS,
        "Failed accepts, by listener (xds, admin) and reason (emfile, enfile, enobufs, connection, other); each descriptor or memory error pauses that listener for 10 ms doubling to 1 s.",
    ),
    (
        name::DOWNSTREAM_SUBSCRIPTIONS,
        "Downstream subscriptions, by type: (stream, resource name) pairs, a wildcard counting as one.",
    ),
    (name::DOWNSTREAM_RESPONSES, "xDS responses written to downstream clients, by type and protocol."),
    (name::DOWNSTREAM_RESOURCES_SENT, "Resources (and Delta removals) written to downstream clients, by type."),
    (name::DOWNSTREAM_SENT_BYTES, "Encoded size of the xDS responses written to downstream clients, by type."),
    (name::DOWNSTREAM_FRAMES, "Responses written to downstream clients by origin: shared (the same encoded frame another stream received) or encoded (framed for this stream)."),
    (name::DOWNSTREAM_ACKS, "Responses downstream clients accepted (ACK), by type."),
    (name::DOWNSTREAM_NACKS, "Responses downstream clients rejected (NACK), by type."),
    (
        name::FANOUT_LATENCY,
        "Time from the receipt of an upstream response to the write of the first downstream response carrying its change, per stream.",
    ),
    (name::CACHE_RESOURCES, "Resources held in the cache, by type, summed over groups."),
    (
        name::CACHE_VARIANTS,
        "Cached resource variants, by type, summed over groups (equal to adsrelay_cache_resources while every resource has one variant).",
    ),
    (name::CACHE_BYTES, "Encoded bytes of the resources held in the cache, by type, summed over groups."),
    (
        name::CACHE_HITS,
        "New downstream subscriptions the cache could answer at once (the name known present or absent, or the wildcard already synced), by type.",
    ),
    (
        name::CACHE_MISSES,
        "New downstream subscriptions that had to wait for the upstream (name or wildcard not known yet), by type.",
    ),
    (
        name::TLS_HANDSHAKE_FAILURES,
        "Downstream TLS handshakes that failed, by reason (no_client_certificate, bad_client_certificate, client_alert, protocol, timeout, io).",
    ),
    (
        name::TLS_CERTIFICATE_RELOADS,
        "Changes of the downstream TLS files seen, by result: applied, or failed (the previous certificate stays in use).",
    ),
    (name::UPSTREAM_CONNECTED, "1 while the group's upstream Delta ADS stream is open, else 0."),
    (
        name::UPSTREAM_SUBSCRIPTIONS,
        "Distinct resource names (and wildcards) the group holds subscribed upstream, including lingering ones.",
    ),
    (name::UPSTREAM_CONNECTS, "Upstream streams opened by the group."),
    (name::UPSTREAM_RECONNECTS, "Upstream streams opened by the group after an earlier one ended."),
    (name::UPSTREAM_RESPONSES, "Responses received from the control plane by the group."),
    (name::UPSTREAM_ACKS, "Upstream responses the relay accepted (ACK) for the group."),
    (name::UPSTREAM_NACKS, "Upstream responses the relay rejected (NACK) for the group."),
    (
        name::UPSTREAM_LAST_RESPONSE_AGE,
        "Seconds since the group last received a response from the control plane (absent before the first).",
    ),
    (
        name::VARIANT_AMBIGUOUS_MATCHES,
        "Variant selections where more than one cached variant matched a subscriber's dynamic parameters (resolved deterministically: the most specific wins).",
    ),
    (
        name::DO_NOT_CACHE_REFETCHES,
        "Re-subscriptions sent upstream because a new subscriber needed a do_not_cache resource the relay may not serve from memory, by group.",
    ),
    (
        name::DO_NOT_CACHE_REFETCH_FALLBACKS,
        "Refetches the upstream did not answer within 2s, retried as unsubscribe then subscribe, by group.",
    ),
    (name::CACHE_TTL_EXPIRED, "Cached resource variants dropped because their TTL ran out without a refresh, by group."),
    (
        name::GROUP_MEMBER_MISMATCH,
        "Clients that joined a group while differing from its first member in node fields the group ignores (cluster, metadata, locality, user agent), by group. The control plane sees one node for the whole group.",
    ),
    (
        name::UPSTREAM_GROUPS,
        "Aggregation groups (one upstream stream each) per control-plane address, by upstream.",
    ),
    (
        name::DRIFT_REPAIRS,
        "Resources found different from the control plane by a periodic resync (missed update or removal) and repaired, by group.",
    ),
    (name::UPSTREAM_RESYNCS, "Periodic resyncs (upstream stream re-established to reconcile the cache), by group."),
    (
        name::UPSTREAM_FAILOVERS,
        "Upstream connection attempts moved to another control-plane address after a failure, by group.",
    ),
    (
        name::UPSTREAM_WILDCARD_UNANSWERED,
        "Wildcard subscriptions added to a running upstream stream that the control plane left unanswered (it need not answer them) for 2s, after which wildcard clients were served from the cache, by group.",
    ),
    (
        name::SNAPSHOT_LOADED_RESOURCES,
        "Resources loaded from the cache snapshot at startup (warm restart); 0 if none was loaded.",
    ),
    (name::SNAPSHOT_AGE, "Age in seconds of the cache snapshot when it was loaded at startup."),
    (
        name::SNAPSHOT_REJECTED,
        "Cache snapshots not loaded at startup, by reason (unreadable, not_a_snapshot, unsupported_version, corrupt, foreign, too_old).",
    ),
    (name::SNAPSHOT_WRITES, "Cache snapshots written (periodically and at graceful shutdown)."),
    (name::SNAPSHOT_WRITE_FAILURES, "Cache snapshot writes that failed (the previous file is kept)."),
    (
        name::UNSUBSCRIBED_CACHE_BUDGET,
        "Byte budget of the group's unsubscribed set (unsubscribed_cache_bytes), by group.",
    ),
    (
        name::UNSUBSCRIBED_CACHE_BYTES,
        "Encoded bytes of cached resources no client subscribes to, kept subscribed upstream for fast re-subscription, by group.",
    ),
    (
        name::UNSUBSCRIBED_CACHE_ENTRIES,
        "Names (and lingering wildcards) in the group's unsubscribed set, by group.",
    ),
    (
        name::UNSUBSCRIBED_CACHE_EVICTIONS,
        "Entries that left the unsubscribed set with their upstream subscription, by group and reason (budget: least recently left past the byte budget; linger: older than unsubscribe_linger).",
    ),
    (
        name::UNSUBSCRIBED_CACHE_RESUBSCRIPTIONS,
        "Subscriptions served from the unsubscribed set: the name was still cached and subscribed upstream, so no upstream request was needed, by group.",
    ),
];

/// Fan-out latency buckets, in seconds.
const FANOUT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const PROTOCOLS: [&str; 2] = [Protocol::Delta.label(), Protocol::Sotw.label()];

/// Why a downstream stream was ended by the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRejection {
    MissingNode,
    InvalidRequest,
    MalformedRequest,
    MessageTooLarge,
    NameTooLong,
    InvalidLocator,
    TooManySubscriptions,
    RateLimited,
    StuckClient,
    /// Over the new-stream admission rate (`max_new_streams_per_second`).
    Admission,
    /// The node matches no `[[groups]]` rule and `unmatched = "reject"`.
    NoGroup,
    /// The client's certificate identity may not join the node's group (`tls_authorization`).
    Unauthorized,
}

impl StreamRejection {
    pub const ALL: [StreamRejection; 12] = [
        StreamRejection::MissingNode,
        StreamRejection::InvalidRequest,
        StreamRejection::MalformedRequest,
        StreamRejection::MessageTooLarge,
        StreamRejection::NameTooLong,
        StreamRejection::InvalidLocator,
        StreamRejection::TooManySubscriptions,
        StreamRejection::RateLimited,
        StreamRejection::StuckClient,
        StreamRejection::Admission,
        StreamRejection::NoGroup,
        StreamRejection::Unauthorized,
    ];

    pub fn label(self) -> &'static str {
        match self {
            StreamRejection::MissingNode => "missing_node",
            StreamRejection::InvalidRequest => "invalid_request",
            StreamRejection::MalformedRequest => "malformed_request",
            StreamRejection::MessageTooLarge => "message_too_large",
            StreamRejection::NameTooLong => "name_too_long",
            StreamRejection::InvalidLocator => "invalid_locator",
            StreamRejection::TooManySubscriptions => "too_many_subscriptions",
            StreamRejection::RateLimited => "rate_limited",
            StreamRejection::StuckClient => "stuck_client",
            StreamRejection::Admission => "admission",
            StreamRejection::NoGroup => "no_group",
            StreamRejection::Unauthorized => "unauthorized",
        }
    }
}

fn protocol_index(protocol: Protocol) -> usize {
    protocol as usize
}

/// Hot-path counters of one type_url label value.
#[derive(Debug)]
struct TypeCounters {
    responses: [Counter; 2],
    resources_sent: Counter,
    sent_bytes: Counter,
    acks: Counter,
    nacks: Counter,
    hits: Counter,
    misses: Counter,
}

/// Values computed at scrape time.
#[derive(Debug, Default)]
pub struct ScrapeState {
    pub streams: [i64; 2],
    pub subscriptions: HashMap<String, usize>,
    /// type_url -> (names, variants, bytes).
    pub cache: HashMap<String, (usize, usize, usize)>,
    pub groups: Vec<GroupScrape>,
}

#[derive(Debug, Default)]
pub struct GroupScrape {
    pub group: String,
    pub connected: bool,
    pub subscriptions: usize,
    pub streams_opened: u64,
    pub responses: u64,
    pub nacks_sent: u64,
    pub last_response: Option<SystemTime>,
    pub refetches: u64,
    pub refetch_fallbacks: u64,
    pub ttl_expired: u64,
    pub member_mismatches: u64,
    pub drift_repairs: u64,
    pub resyncs: u64,
    pub failovers: u64,
    /// The control-plane address the group uses (or tries) now.
    pub upstream: String,
    pub unsubscribed: UnsubscribedScrape,
    pub wildcards_unanswered: u64,
}

/// One group's unsubscribed set, as exported.
#[derive(Debug, Default)]
pub struct UnsubscribedScrape {
    pub budget: usize,
    pub bytes: usize,
    pub entries: usize,
    pub evicted_budget: u64,
    pub evicted_linger: u64,
    pub resubscriptions: u64,
}

/// A scrape-time gauge: name and label pairs.
type GaugeKey = (&'static str, Vec<(&'static str, String)>);

pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    types: DashMap<String, Arc<TypeCounters>>,
    /// type_url label values handed out so far (bounded by [`MAX_TYPE_LABELS`]).
    type_labels: Mutex<HashSet<String>>,
    streams_opened: [Counter; 2],
    rejected: [Counter; StreamRejection::ALL.len()],
    connections_rejected: Counter,
    connections_accepted: Counter,
    accept_errors: [[Counter; AcceptError::ALL.len()]; 2],
    tls_handshake_failures: [Counter; crate::tls::HandshakeFailure::ALL.len()],
    tls_reloads: [Counter; 2],
    /// Responses by origin: [shared, encoded].
    frames: [Counter; 2],
    fanout: Histogram,
    /// Open downstream connections (kept by [`crate::accept::CountedIo`]).
    pub connections: Arc<AtomicI64>,
    /// Label sets of scrape-time gauges set before, so vanished ones are reset to 0.
    seen_gauges: Mutex<HashSet<GaugeKey>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

impl AcceptReport for Metrics {
    fn accept_failed(&self, listener: Listener, reason: AcceptError) {
        self.accept_errors[listener as usize][reason as usize].increment(1);
    }

    fn connection_accepted(&self) {
        self.connections_accepted.increment(1);
    }

    fn connection_refused(&self) {
        self.connections_rejected.increment(1);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(name::FANOUT_LATENCY.into()), FANOUT_BUCKETS)
            .expect("non-empty buckets")
            .build_recorder();
        for (n, help) in DESCRIPTIONS {
            let key = KeyName::from_const_str(n);
            let help = SharedString::const_str(help);
            match kind(n) {
                "counter" => recorder.describe_counter(key, None, help),
                "histogram" => recorder.describe_histogram(key, None, help),
                _ => recorder.describe_gauge(key, None, help),
            }
        }
        let handle = recorder.handle();
        let counter = |n: &'static str, labels: Vec<Label>| {
            recorder.register_counter(&Key::from_parts(n, labels), &METADATA)
        };
        let by_protocol =
            |n: &'static str| PROTOCOLS.map(|p| counter(n, vec![Label::new("protocol", p)]));
        let streams_opened = by_protocol(name::DOWNSTREAM_STREAMS_OPENED);
        let rejected = StreamRejection::ALL.map(|r| {
            counter(
                name::DOWNSTREAM_STREAMS_REJECTED,
                vec![Label::new("reason", r.label())],
            )
        });
        let connections_accepted = counter(name::DOWNSTREAM_CONNECTIONS_ACCEPTED, vec![]);
        let connections_rejected = counter(name::DOWNSTREAM_CONNECTIONS_REJECTED, vec![]);
        let accept_errors = Listener::ALL.map(|l| {
            AcceptError::ALL.map(|e| {
                counter(
                    name::ACCEPT_ERRORS,
                    vec![
                        Label::new("listener", l.label()),
                        Label::new("reason", e.label()),
                    ],
                )
            })
        });
        let tls_handshake_failures = crate::tls::HandshakeFailure::ALL.map(|f| {
            counter(
                name::TLS_HANDSHAKE_FAILURES,
                vec![Label::new("reason", f.label())],
            )
        });
        let tls_reloads = ["applied", "failed"]
            .map(|r| counter(name::TLS_CERTIFICATE_RELOADS, vec![Label::new("result", r)]));
        let frames = ["shared", "encoded"]
            .map(|o| counter(name::DOWNSTREAM_FRAMES, vec![Label::new("origin", o)]));
        let fanout = recorder.register_histogram(&Key::from_name(name::FANOUT_LATENCY), &METADATA);
        // Unlabelled families and those with a fixed label set exist from startup, at zero, so
        // dashboards and alerts have series before the first event. Families labelled by group,
        // type or upstream get their HELP/TYPE lines from `render` until a first series exists.
        for n in [name::SNAPSHOT_WRITES, name::SNAPSHOT_WRITE_FAILURES] {
            counter(n, vec![]).increment(0);
        }
        for reason in crate::snapshot::Rejection::REASONS {
            counter(name::SNAPSHOT_REJECTED, vec![Label::new("reason", reason)]).increment(0);
        }
        recorder
            .register_gauge(
                &Key::from_parts(
                    name::BUILD_INFO,
                    vec![
                        Label::new("version", env!("CARGO_PKG_VERSION")),
                        Label::new("revision", env!("ADSRELAY_GIT_COMMIT")),
                    ],
                ),
                &METADATA,
            )
            .set(1.0);
        Metrics {
            recorder,
            handle,
            types: DashMap::new(),
            type_labels: Mutex::new(HashSet::new()),
            streams_opened,
            rejected,
            connections_rejected,
            connections_accepted,
            accept_errors,
            tls_handshake_failures,
            tls_reloads,
            frames,
            fanout,
            connections: Arc::new(AtomicI64::new(0)),
            seen_gauges: Mutex::new(HashSet::new()),
        }
    }

    /// The label value for a type_url: itself for the first [`MAX_TYPE_LABELS`] distinct ones,
    /// then `other`, so a client inventing type URLs cannot blow up the series count.
    pub fn type_label(&self, type_url: &str) -> String {
        let mut labels = lock(&self.type_labels);
        if labels.contains(type_url) {
            return type_url.to_string();
        }
        if labels.len() < MAX_TYPE_LABELS {
            labels.insert(type_url.to_string());
            return type_url.to_string();
        }
        OTHER_TYPE.to_string()
    }

    fn per_type(&self, type_url: &str) -> Arc<TypeCounters> {
        if let Some(c) = self.types.get(type_url) {
            return c.clone();
        }
        let label = self.type_label(type_url);
        let counter = |n: &'static str, extra: Option<Label>| {
            let mut labels = vec![Label::new("type_url", label.clone())];
            labels.extend(extra);
            self.recorder
                .register_counter(&Key::from_parts(n, labels), &METADATA)
        };
        let c = Arc::new(TypeCounters {
            responses: PROTOCOLS
                .map(|p| counter(name::DOWNSTREAM_RESPONSES, Some(Label::new("protocol", p)))),
            resources_sent: counter(name::DOWNSTREAM_RESOURCES_SENT, None),
            sent_bytes: counter(name::DOWNSTREAM_SENT_BYTES, None),
            acks: counter(name::DOWNSTREAM_ACKS, None),
            nacks: counter(name::DOWNSTREAM_NACKS, None),
            hits: counter(name::CACHE_HITS, None),
            misses: counter(name::CACHE_MISSES, None),
        });
        // Types beyond the label cap share the `other` counters but each gets its own map entry;
        // cap the map too, so it stays bounded.
        if self.types.len() < 4 * MAX_TYPE_LABELS {
            self.types.insert(type_url.to_string(), c.clone());
        }
        c
    }

    pub fn stream_opened(&self, protocol: Protocol) {
        self.streams_opened[protocol_index(protocol)].increment(1);
    }

    pub fn stream_rejected(&self, reason: StreamRejection) {
        self.rejected[reason as usize].increment(1);
    }

    pub fn tls_handshake_failed(&self, reason: crate::tls::HandshakeFailure) {
        self.tls_handshake_failures[reason as usize].increment(1);
    }

    pub fn tls_reloaded(&self, result: crate::tls::Reload) {
        self.tls_reloads[result as usize].increment(1);
    }

    pub fn response_sent(
        &self,
        protocol: Protocol,
        type_url: &str,
        resources: usize,
        bytes: usize,
        shared: bool,
    ) {
        self.frames[usize::from(!shared)].increment(1);
        let c = self.per_type(type_url);
        c.responses[protocol_index(protocol)].increment(1);
        c.resources_sent.increment(resources as u64);
        c.sent_bytes.increment(bytes as u64);
    }

    pub fn client_ack(&self, type_url: &str, nack: bool) {
        let c = self.per_type(type_url);
        if nack {
            c.nacks.increment(1)
        } else {
            c.acks.increment(1)
        }
    }

    pub fn cache_lookups(&self, type_url: &str, hits: u64, misses: u64) {
        if hits + misses == 0 {
            return;
        }
        let c = self.per_type(type_url);
        c.hits.increment(hits);
        c.misses.increment(misses);
    }

    /// Warm restart: what the snapshot loaded at startup held, and how old it was.
    pub fn snapshot_loaded(&self, resources: usize, age: Duration) {
        let gauge = |n: &'static str| self.recorder.register_gauge(&Key::from_name(n), &METADATA);
        gauge(name::SNAPSHOT_LOADED_RESOURCES).set(resources as f64);
        gauge(name::SNAPSHOT_AGE).set(age.as_secs_f64());
    }

    /// `reason` is one of [`crate::snapshot::Rejection::reason`]'s fixed labels.
    pub fn snapshot_rejected(&self, reason: &'static str) {
        self.recorder
            .register_counter(
                &Key::from_parts(name::SNAPSHOT_REJECTED, vec![Label::new("reason", reason)]),
                &METADATA,
            )
            .increment(1);
    }

    pub fn snapshot_written(&self, ok: bool) {
        let n = if ok {
            name::SNAPSHOT_WRITES
        } else {
            name::SNAPSHOT_WRITE_FAILURES
        };
        self.recorder
            .register_counter(&Key::from_name(n), &METADATA)
            .increment(1);
    }

    pub fn fanout_latency(&self, received_at: Instant) {
        self.fanout.record(received_at.elapsed().as_secs_f64());
    }

    fn gauge(&self, n: &'static str, labels: Vec<(&'static str, String)>, value: f64) {
        lock(&self.seen_gauges).insert((n, labels.clone()));
        self.gauge_handle(n, &labels).set(value);
    }

    fn gauge_handle(&self, n: &'static str, labels: &[(&'static str, String)]) -> Gauge {
        let labels: Vec<Label> = labels
            .iter()
            .map(|(k, v)| Label::new(*k, v.clone()))
            .collect();
        self.recorder
            .register_gauge(&Key::from_parts(n, labels), &METADATA)
    }

    fn counter_absolute(&self, n: &'static str, labels: Vec<Label>, value: u64) {
        self.recorder
            .register_counter(&Key::from_parts(n, labels), &METADATA)
            .absolute(value);
    }

    /// Sets the scrape-time gauges from `state` and renders everything in the Prometheus text
    /// format.
    pub fn render(&self, state: ScrapeState) -> String {
        let previous = std::mem::take(&mut *lock(&self.seen_gauges));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let tasks = rt.metrics().num_alive_tasks();
            self.gauge(name::RUNTIME_ALIVE_TASKS, vec![], tasks as f64);
        }
        self.gauge(
            name::DOWNSTREAM_CONNECTIONS,
            vec![],
            self.connections.load(Ordering::Relaxed) as f64,
        );
        for (i, p) in PROTOCOLS.iter().enumerate() {
            self.gauge(
                name::DOWNSTREAM_STREAMS,
                vec![("protocol", p.to_string())],
                state.streams[i] as f64,
            );
        }
        let mut subscriptions: HashMap<String, usize> = HashMap::new();
        for (t, n) in state.subscriptions {
            *subscriptions.entry(self.type_label(&t)).or_default() += n;
        }
        for (t, n) in subscriptions {
            self.gauge(
                name::DOWNSTREAM_SUBSCRIPTIONS,
                vec![("type_url", t)],
                n as f64,
            );
        }
        let mut cache: HashMap<String, (usize, usize, usize)> = HashMap::new();
        for (t, (n, v, b)) in state.cache {
            let e = cache.entry(self.type_label(&t)).or_default();
            e.0 += n;
            e.1 += v;
            e.2 += b;
        }
        self.counter_absolute(
            name::VARIANT_AMBIGUOUS_MATCHES,
            vec![],
            crate::xds::store::AMBIGUOUS_MATCHES.load(Ordering::Relaxed),
        );
        for (t, (n, v, b)) in cache {
            self.gauge(
                name::CACHE_RESOURCES,
                vec![("type_url", t.clone())],
                n as f64,
            );
            self.gauge(
                name::CACHE_VARIANTS,
                vec![("type_url", t.clone())],
                v as f64,
            );
            self.gauge(name::CACHE_BYTES, vec![("type_url", t)], b as f64);
        }
        let now = SystemTime::now();
        let mut groups_per_upstream: HashMap<String, usize> = HashMap::new();
        for g in state.groups {
            let group = || vec![Label::new("group", g.group.clone())];
            self.gauge(
                name::UPSTREAM_CONNECTED,
                vec![("group", g.group.clone())],
                if g.connected { 1.0 } else { 0.0 },
            );
            self.gauge(
                name::UPSTREAM_SUBSCRIPTIONS,
                vec![("group", g.group.clone())],
                g.subscriptions as f64,
            );
            if let Some(t) = g.last_response {
                let age = now.duration_since(t).unwrap_or(Duration::ZERO);
                self.gauge(
                    name::UPSTREAM_LAST_RESPONSE_AGE,
                    vec![("group", g.group.clone())],
                    age.as_secs_f64(),
                );
            }
            self.counter_absolute(name::UPSTREAM_CONNECTS, group(), g.streams_opened);
            self.counter_absolute(
                name::UPSTREAM_RECONNECTS,
                group(),
                g.streams_opened.saturating_sub(1),
            );
            self.counter_absolute(name::UPSTREAM_RESPONSES, group(), g.responses);
            self.counter_absolute(name::DO_NOT_CACHE_REFETCHES, group(), g.refetches);
            self.counter_absolute(
                name::DO_NOT_CACHE_REFETCH_FALLBACKS,
                group(),
                g.refetch_fallbacks,
            );
            self.counter_absolute(name::CACHE_TTL_EXPIRED, group(), g.ttl_expired);
            self.counter_absolute(name::GROUP_MEMBER_MISMATCH, group(), g.member_mismatches);
            self.counter_absolute(name::DRIFT_REPAIRS, group(), g.drift_repairs);
            self.counter_absolute(name::UPSTREAM_RESYNCS, group(), g.resyncs);
            self.counter_absolute(name::UPSTREAM_FAILOVERS, group(), g.failovers);
            self.counter_absolute(
                name::UPSTREAM_WILDCARD_UNANSWERED,
                group(),
                g.wildcards_unanswered,
            );
            let u = &g.unsubscribed;
            for (n, v) in [
                (name::UNSUBSCRIBED_CACHE_BUDGET, u.budget),
                (name::UNSUBSCRIBED_CACHE_BYTES, u.bytes),
                (name::UNSUBSCRIBED_CACHE_ENTRIES, u.entries),
            ] {
                self.gauge(n, vec![("group", g.group.clone())], v as f64);
            }
            for (reason, v) in [("budget", u.evicted_budget), ("linger", u.evicted_linger)] {
                let mut labels = group();
                labels.push(Label::new("reason", reason));
                self.counter_absolute(name::UNSUBSCRIBED_CACHE_EVICTIONS, labels, v);
            }
            self.counter_absolute(
                name::UNSUBSCRIBED_CACHE_RESUBSCRIPTIONS,
                group(),
                u.resubscriptions,
            );
            *groups_per_upstream.entry(g.upstream.clone()).or_default() += 1;
            self.counter_absolute(name::UPSTREAM_NACKS, group(), g.nacks_sent);
            self.counter_absolute(
                name::UPSTREAM_ACKS,
                group(),
                g.responses.saturating_sub(g.nacks_sent),
            );
        }
        for (upstream, n) in groups_per_upstream {
            self.gauge(
                name::UPSTREAM_GROUPS,
                vec![("upstream", upstream)],
                n as f64,
            );
        }
        // Label sets that disappeared (a type no longer cached, ...) read 0, not their last value.
        let current = lock(&self.seen_gauges).clone();
        for (n, labels) in previous.difference(&current) {
            self.gauge_handle(n, labels).set(0.0);
        }
        let mut text = with_every_family(self.handle.render());
        text.push_str(&crate::process::render());
        text
    }
}

/// The Prometheus type of a described family.
fn kind(n: &str) -> &'static str {
    if n.ends_with("_total") {
        "counter"
    } else if n == name::FANOUT_LATENCY {
        "histogram"
    } else {
        "gauge"
    }
}

/// Appends `# HELP` and `# TYPE` for every described family the exporter left out: it renders
/// only families with a series, and a family labelled by group or type has none before its
/// first group or type. Metadata without samples is valid exposition; Prometheus then knows
/// the family, and `absent()`-style alerts can tell "no data yet" from "not exported".
fn with_every_family(mut text: String) -> String {
    let present: HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
        .collect();
    let missing: Vec<&(&str, &str)> = DESCRIPTIONS
        .iter()
        .filter(|(n, _)| !present.contains(n))
        .collect();
    for (n, help) in missing {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!("# HELP {n} {help}\n# TYPE {n} {}\n", kind(n)));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_described_once_and_well_formed() {
        let mut seen = HashSet::new();
        for (n, help) in DESCRIPTIONS {
            assert!(seen.insert(*n), "{n} described twice");
            assert!(n.starts_with("adsrelay_"), "{n}");
            assert!(!help.is_empty());
        }
    }

    #[test]
    fn every_family_is_exported_before_any_event() {
        let out = Metrics::new().render(ScrapeState::default());
        for (n, _) in DESCRIPTIONS {
            let header = format!("# TYPE {n} {}\n", kind(n));
            assert_eq!(out.matches(&header).count(), 1, "{n} in:\n{out}");
        }
        assert!(out.contains("adsrelay_snapshot_rejected_total{reason=\"corrupt\"} 0"));
    }

    #[test]
    fn type_labels_are_capped() {
        let m = Metrics::new();
        for i in 0..MAX_TYPE_LABELS + 10 {
            m.response_sent(Protocol::Delta, &format!("t{i}"), 1, 10, false);
        }
        let out = m.render(ScrapeState::default());
        assert!(out.contains("type_url=\"other\""));
        let series = out
            .lines()
            .filter(|l| l.starts_with(name::DOWNSTREAM_RESOURCES_SENT))
            .count();
        assert_eq!(series, MAX_TYPE_LABELS + 1);
    }

    #[test]
    fn renders_help_and_vanished_gauges_as_zero() {
        let m = Metrics::new();
        let mut s = ScrapeState::default();
        s.cache.insert("t".into(), (2, 2, 100));
        let out = m.render(s);
        assert!(out.contains("# HELP adsrelay_cache_bytes"));
        assert!(out.contains("adsrelay_cache_bytes{type_url=\"t\"} 100"));
        let out = m.render(ScrapeState::default());
        assert!(out.contains("adsrelay_cache_bytes{type_url=\"t\"} 0"));
    }
}
