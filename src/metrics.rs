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

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use dashmap::DashMap;
use metrics::{Counter, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

use crate::accept::{AcceptError, AcceptReport, Listener};
use crate::sync::lock;
use crate::xds::{names, GroupStats, Protocol};

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
    pub const UPSTREAM_UNANSWERED_TYPES: &str = "adsrelay_upstream_unanswered_types";
    pub const UPSTREAM_SOTW: &str = "adsrelay_upstream_sotw";
    pub const UPSTREAM_PROTOCOL_SWITCHES: &str = "adsrelay_upstream_protocol_switches_total";
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

/// (name, HELP text). docs/metrics.md's table (tests/docs_checks.rs checks it) mirrors this list.
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
        name::UPSTREAM_SOTW,
        "1 while the group's upstream stream speaks state-of-the-world ADS, 0 for Delta, by group.",
    ),
    (
        name::UPSTREAM_PROTOCOL_SWITCHES,
        "Upstreams that upstream_protocol = auto switched to state-of-the-world after they answered UNIMPLEMENTED for Delta ADS, by group.",
    ),
    (
        name::UPSTREAM_UNANSWERED_TYPES,
        "Types the current upstream stream subscribed when it opened and the control plane has not answered 15s later (0 once it answers them), by group.",
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

/// A type's counters: from the fixed table of well-known types, or the map of the others.
enum TypeCountersRef<'a> {
    Known(&'a TypeCounters),
    Other(Arc<TypeCounters>),
}

impl std::ops::Deref for TypeCountersRef<'_> {
    type Target = TypeCounters;
    fn deref(&self) -> &TypeCounters {
        match self {
            TypeCountersRef::Known(c) => c,
            TypeCountersRef::Other(c) => c,
        }
    }
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

/// What `/metrics` reads at scrape time: the relay's open streams and every group's counters and
/// status. These families are written straight into the exposition (a collector), never kept in
/// the recorder: nothing is counted twice, and a label set that vanished is simply not written.
#[derive(Debug, Default)]
pub struct ScrapeState {
    /// Open streams by protocol.
    pub streams: [usize; 2],
    pub groups: Vec<GroupScrape>,
}

/// One group at scrape time: its core counters and its upstream task's status.
#[derive(Debug, Default)]
pub struct GroupScrape {
    pub group: String,
    pub stats: GroupStats,
    pub connected: bool,
    pub streams_opened: u64,
    pub responses: u64,
    pub nacks_sent: u64,
    pub last_response: Option<SystemTime>,
    pub member_mismatches: u64,
    pub drift_repairs: u64,
    pub resyncs: u64,
    pub failovers: u64,
    /// Types the current upstream stream left unanswered past the wait.
    pub unanswered_types: usize,
    /// The upstream stream speaks state-of-the-world.
    pub sotw: bool,
    pub protocol_switches: u64,
    /// The control-plane address the group uses (or tries) now.
    pub upstream: String,
}

pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// Counters of the well-known types, by [`names::type_url_index`].
    known_types: [OnceLock<TypeCounters>; names::TYPE_URL_COUNT],
    /// Counters of other types.
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
    fanout: BucketHistogram,
    /// Open downstream connections (kept by [`crate::accept::CountedIo`]).
    pub connections: Arc<AtomicI64>,
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
        let recorder = PrometheusBuilder::new().build_recorder();
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
        let fanout = BucketHistogram::new(FANOUT_BUCKETS);
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
            known_types: std::array::from_fn(|_| OnceLock::new()),
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

    /// A type's counters. The well-known types' sit in a fixed table, read with no lock and no
    /// refcount: this runs twice per delivery on every core.
    fn per_type(&self, type_url: &str) -> TypeCountersRef<'_> {
        if let Some(i) = names::type_url_index(type_url) {
            let c = self.known_types[i].get_or_init(|| self.type_counters(type_url));
            return TypeCountersRef::Known(c);
        }
        if let Some(c) = self.types.get(type_url) {
            return TypeCountersRef::Other(c.clone());
        }
        let c = Arc::new(self.type_counters(type_url));
        // Types beyond the label cap share the `other` counters but each gets its own map entry;
        // cap the map too, so it stays bounded.
        if self.types.len() < 4 * MAX_TYPE_LABELS {
            self.types.insert(type_url.to_string(), c.clone());
        }
        TypeCountersRef::Other(c)
    }

    fn type_counters(&self, type_url: &str) -> TypeCounters {
        let label = self.type_label(type_url);
        let counter = |n: &'static str, extra: Option<Label>| {
            let mut labels = vec![Label::new("type_url", label.clone())];
            labels.extend(extra);
            self.recorder
                .register_counter(&Key::from_parts(n, labels), &METADATA)
        };
        TypeCounters {
            responses: PROTOCOLS
                .map(|p| counter(name::DOWNSTREAM_RESPONSES, Some(Label::new("protocol", p)))),
            resources_sent: counter(name::DOWNSTREAM_RESOURCES_SENT, None),
            sent_bytes: counter(name::DOWNSTREAM_SENT_BYTES, None),
            acks: counter(name::DOWNSTREAM_ACKS, None),
            nacks: counter(name::DOWNSTREAM_NACKS, None),
            hits: counter(name::CACHE_HITS, None),
            misses: counter(name::CACHE_MISSES, None),
        }
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
        self.fanout.record(received_at.elapsed());
    }

    /// Renders everything in the Prometheus text format: the recorder's event counters and
    /// histograms, then the families read from `state` now, then the process metrics.
    pub fn render(&self, state: ScrapeState) -> String {
        let mut out = Exposition::default();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let tasks = rt.metrics().num_alive_tasks();
            out.family(name::RUNTIME_ALIVE_TASKS, [(vec![], tasks as f64)]);
        }
        out.family(
            name::DOWNSTREAM_CONNECTIONS,
            [(vec![], self.connections.load(Ordering::Relaxed) as f64)],
        );
        out.family(
            name::DOWNSTREAM_STREAMS,
            Protocol::ALL.map(|p| {
                let n = state.streams[p as usize];
                (vec![("protocol", p.label().to_string())], n as f64)
            }),
        );
        // Summed over groups, by (capped) type label.
        let mut subscriptions: BTreeMap<String, usize> = BTreeMap::new();
        let mut cache: BTreeMap<String, [usize; 3]> = BTreeMap::new();
        let mut ambiguous = 0;
        for g in &state.groups {
            for (t, n) in &g.stats.subscriptions {
                *subscriptions.entry(self.type_label(t)).or_default() += n;
            }
            for c in &g.stats.cache {
                let e = cache.entry(self.type_label(&c.type_url)).or_default();
                e[0] += c.names;
                e[1] += c.variants;
                e[2] += c.bytes;
            }
            ambiguous += g.stats.ambiguous_matches;
        }
        let by_type = |i: Option<usize>| -> Vec<Sample> {
            match i {
                None => subscriptions
                    .iter()
                    .map(|(t, n)| (vec![("type_url", t.clone())], *n as f64))
                    .collect(),
                Some(i) => cache
                    .iter()
                    .map(|(t, v)| (vec![("type_url", t.clone())], v[i] as f64))
                    .collect(),
            }
        };
        out.family(name::DOWNSTREAM_SUBSCRIPTIONS, by_type(None));
        out.family(name::CACHE_RESOURCES, by_type(Some(0)));
        out.family(name::CACHE_VARIANTS, by_type(Some(1)));
        out.family(name::CACHE_BYTES, by_type(Some(2)));
        out.family(
            name::VARIANT_AMBIGUOUS_MATCHES,
            [(vec![], ambiguous as f64)],
        );

        let now = SystemTime::now();
        let per_group = |value: &GroupValue| -> Vec<Sample> {
            state
                .groups
                .iter()
                .filter_map(|g| Some((vec![("group", g.group.clone())], value(g)?)))
                .collect()
        };
        let families: [(&'static str, &GroupValue); 23] = [
            (name::UPSTREAM_CONNECTED, &|g| {
                Some(f64::from(u8::from(g.connected)))
            }),
            (name::UPSTREAM_SUBSCRIPTIONS, &|g| {
                Some(g.stats.upstream_subscriptions as f64)
            }),
            (name::UPSTREAM_LAST_RESPONSE_AGE, &|g| {
                let t = g.last_response?;
                Some(
                    now.duration_since(t)
                        .unwrap_or(Duration::ZERO)
                        .as_secs_f64(),
                )
            }),
            (name::UPSTREAM_CONNECTS, &|g| Some(g.streams_opened as f64)),
            (name::UPSTREAM_RECONNECTS, &|g| {
                Some(g.streams_opened.saturating_sub(1) as f64)
            }),
            (name::UPSTREAM_RESPONSES, &|g| Some(g.responses as f64)),
            (name::UPSTREAM_NACKS, &|g| Some(g.nacks_sent as f64)),
            (name::UPSTREAM_ACKS, &|g| {
                Some(g.responses.saturating_sub(g.nacks_sent) as f64)
            }),
            (name::DO_NOT_CACHE_REFETCHES, &|g| {
                Some(g.stats.refetches as f64)
            }),
            (name::DO_NOT_CACHE_REFETCH_FALLBACKS, &|g| {
                Some(g.stats.refetch_fallbacks as f64)
            }),
            (name::CACHE_TTL_EXPIRED, &|g| {
                Some(g.stats.ttl_expired as f64)
            }),
            (name::GROUP_MEMBER_MISMATCH, &|g| {
                Some(g.member_mismatches as f64)
            }),
            (name::DRIFT_REPAIRS, &|g| Some(g.drift_repairs as f64)),
            (name::UPSTREAM_RESYNCS, &|g| Some(g.resyncs as f64)),
            (name::UPSTREAM_FAILOVERS, &|g| Some(g.failovers as f64)),
            (name::UPSTREAM_WILDCARD_UNANSWERED, &|g| {
                Some(g.stats.wildcards_unanswered as f64)
            }),
            (name::UPSTREAM_UNANSWERED_TYPES, &|g| {
                Some(g.unanswered_types as f64)
            }),
            (name::UPSTREAM_SOTW, &|g| Some(f64::from(u8::from(g.sotw)))),
            (name::UPSTREAM_PROTOCOL_SWITCHES, &|g| {
                Some(g.protocol_switches as f64)
            }),
            (name::UNSUBSCRIBED_CACHE_BUDGET, &|g| {
                Some(g.stats.unsubscribed.budget as f64)
            }),
            (name::UNSUBSCRIBED_CACHE_BYTES, &|g| {
                Some(g.stats.unsubscribed.bytes as f64)
            }),
            (name::UNSUBSCRIBED_CACHE_ENTRIES, &|g| {
                Some(g.stats.unsubscribed.entries as f64)
            }),
            (name::UNSUBSCRIBED_CACHE_RESUBSCRIPTIONS, &|g| {
                Some(g.stats.unsubscribed.resubscriptions as f64)
            }),
        ];
        for (n, value) in families {
            out.family(n, per_group(value));
        }
        out.family(
            name::UNSUBSCRIBED_CACHE_EVICTIONS,
            state.groups.iter().flat_map(|g| {
                let u = &g.stats.unsubscribed;
                [("budget", u.evicted_budget), ("linger", u.evicted_linger)].map(|(reason, v)| {
                    let labels = vec![("group", g.group.clone()), ("reason", reason.to_string())];
                    (labels, v as f64)
                })
            }),
        );
        let mut groups_per_upstream: BTreeMap<&str, usize> = BTreeMap::new();
        for g in &state.groups {
            *groups_per_upstream.entry(&g.upstream).or_default() += 1;
        }
        out.family(
            name::UPSTREAM_GROUPS,
            groups_per_upstream
                .into_iter()
                .map(|(u, n)| (vec![("upstream", u.to_string())], n as f64)),
        );
        out.histogram(name::FANOUT_LATENCY, &self.fanout);
        let mut text = self.handle.render();
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&out.text);
        let mut text = with_every_family(text);
        text.push_str(&crate::process::render());
        text
    }
}

/// A histogram over fixed buckets, counted in atomics. Why not the exporter's: it keeps every
/// sample until a scrape drains it, so a relay nobody scrapes grows by 24 bytes per delivery, and
/// each observation is a push onto a list shared by every core.
struct BucketHistogram {
    /// Upper bounds (`le`), ascending.
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last is above every bound (`+Inf`).
    counts: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl BucketHistogram {
    fn new(bounds: &'static [f64]) -> Self {
        BucketHistogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    fn record(&self, value: Duration) {
        let secs = value.as_secs_f64();
        // The first bucket whose bound is at least the value (`le` is inclusive).
        let i = self.bounds.partition_point(|b| *b < secs);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(value.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Cumulative counts per `le` (the bounds, then `+Inf`), and the sum in seconds.
    fn snapshot(&self) -> (Vec<(String, u64)>, f64) {
        let mut total = 0;
        let les = self.bounds.iter().map(f64::to_string);
        let les = les.chain(std::iter::once("+Inf".to_string()));
        let buckets = les
            .zip(self.counts.iter())
            .map(|(le, c)| {
                total += c.load(Ordering::Relaxed);
                (le, total)
            })
            .collect();
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        (buckets, sum)
    }
}

/// A per-group family's value for one group (`None`: no sample).
type GroupValue<'a> = dyn Fn(&GroupScrape) -> Option<f64> + 'a;

/// One sample of a scrape-time family: label pairs and value.
type Sample = (Vec<(&'static str, String)>, f64);

/// Scrape-time families in the Prometheus text format.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    /// Writes a family's HELP and TYPE, then its samples (none is valid: the family is known).
    fn family(&mut self, n: &'static str, samples: impl IntoIterator<Item = Sample>) {
        use std::fmt::Write;
        let help = DESCRIPTIONS
            .iter()
            .find(|(d, _)| *d == n)
            .map_or("", |(_, h)| *h);
        let _ = write!(self.text, "# HELP {n} {help}\n# TYPE {n} {}\n", kind(n));
        for (labels, value) in samples {
            self.text.push_str(n);
            if !labels.is_empty() {
                self.text.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        self.text.push(',');
                    }
                    let _ = write!(self.text, "{k}=\"{}\"", escape_label(v));
                }
                self.text.push('}');
            }
            let _ = writeln!(self.text, " {value}");
        }
    }
}

impl Exposition {
    /// Writes a histogram family: cumulative `_bucket` series by `le`, then `_sum` and `_count`.
    fn histogram(&mut self, n: &'static str, h: &BucketHistogram) {
        use std::fmt::Write;
        let (buckets, sum) = h.snapshot();
        let count = buckets.last().map_or(0, |(_, c)| *c);
        self.family(n, []);
        for (le, c) in buckets {
            let _ = writeln!(self.text, "{n}_bucket{{le=\"{le}\"}} {c}");
        }
        let _ = writeln!(self.text, "{n}_sum {sum}\n{n}_count {count}");
    }
}

/// A label value as the text format wants it: backslash, double quote and newline escaped.
fn escape_label(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .into()
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
    fn fanout_histogram_counts_each_delivery_in_its_bucket_cumulatively() {
        let m = Metrics::new();
        for d in [0.0003, 0.0005, 0.7, 20.0] {
            m.fanout.record(Duration::from_secs_f64(d));
        }
        let out = m.render(ScrapeState::default());
        let n = name::FANOUT_LATENCY;
        for line in [
            format!("{n}_bucket{{le=\"0.0005\"}} 2"),
            format!("{n}_bucket{{le=\"0.5\"}} 2"),
            format!("{n}_bucket{{le=\"1\"}} 3"),
            format!("{n}_bucket{{le=\"10\"}} 3"),
            format!("{n}_bucket{{le=\"+Inf\"}} 4"),
            format!("{n}_count 4"),
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in:\n{out}");
        }
        let sum: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{n}_sum ")))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!((sum - 20.7008).abs() < 1e-6, "{sum}");
    }

    #[test]
    fn well_known_types_count_under_their_own_label() {
        let m = Metrics::new();
        let cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        m.response_sent(Protocol::Delta, cds, 3, 100, true);
        m.response_sent(Protocol::Delta, cds, 2, 50, true);
        m.client_ack(cds, false);
        let out = m.render(ScrapeState::default());
        let value = |family: &str| {
            out.lines()
                .find(|l| l.starts_with(family) && l.contains(cds))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        };
        assert_eq!(value(name::DOWNSTREAM_RESOURCES_SENT), Some(5.0), "{out}");
        assert_eq!(value(name::DOWNSTREAM_SENT_BYTES), Some(150.0));
        assert_eq!(value(name::DOWNSTREAM_ACKS), Some(1.0));
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
    fn scrape_time_families_are_read_now_and_vanish_with_their_source() {
        let m = Metrics::new();
        let group = |name: &str| GroupScrape {
            group: name.into(),
            stats: GroupStats {
                cache: vec![crate::xds::CacheStats {
                    type_url: "t".into(),
                    names: 2,
                    variants: 2,
                    bytes: 100,
                }],
                ..Default::default()
            },
            upstream: "http://cp\"1\"".into(),
            ..Default::default()
        };
        let out = m.render(ScrapeState {
            streams: [3, 1],
            groups: vec![group("a"), group("b")],
        });
        assert_eq!(out.matches("# HELP adsrelay_cache_bytes ").count(), 1);
        assert!(
            out.contains("adsrelay_cache_bytes{type_url=\"t\"} 200"),
            "{out}"
        );
        assert!(out.contains("adsrelay_downstream_streams{protocol=\"sotw\"} 1"));
        assert!(out.contains("adsrelay_upstream_groups{upstream=\"http://cp\\\"1\\\"\"} 2"));
        assert!(out.contains(
            "adsrelay_unsubscribed_cache_evictions_total{group=\"b\",reason=\"linger\"} 0"
        ));
        // A type no longer cached is no longer exported (Prometheus marks the series stale).
        let out = m.render(ScrapeState::default());
        assert!(!out.contains("adsrelay_cache_bytes{"));
        assert!(out.contains("# TYPE adsrelay_cache_bytes gauge"));
    }
}
