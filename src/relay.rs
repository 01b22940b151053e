//! The relay's registry: its aggregation groups (created on a node's first stream, with their
//! upstream tasks) and its connected clients (admin API, CSDS). Implements [`StreamHost`] for
//! downstream streams: admission, group membership, and applying a stream's effects to its group.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dashmap::DashMap;
use tokio::sync::watch;
use tonic::Status;
use tracing::{info, warn};

use crate::config::Config;
use crate::downstream::{ClientEntry, Mailbox, StreamEvent, StreamHost};
use crate::group::{Group, Member};
use crate::grouping::{identity_digest, same_identity, Assignment, Grouping};
use crate::metrics::{GroupScrape, Metrics, ScrapeState, StreamRejection};
use crate::pb::core::Node;
use crate::sync::{lock, read, write};
use crate::token_bucket::TokenBucket;
use crate::xds::constraints::Params;
use crate::xds::{GroupState, Locator, Name, RequestEffects, Store, StreamId};

#[derive(Debug)]
pub struct Relay {
    pub config: Arc<Config>,
    groups: DashMap<String, Arc<Group>>,
    /// Held while a group is created, so two first streams of one group create it once.
    creating: Mutex<()>,
    next_stream: AtomicU64,
    /// The upstream answered at least once (probe or any group).
    pub upstream_reached: Arc<AtomicBool>,
    shutdown: watch::Receiver<bool>,
    pub metrics: Arc<Metrics>,
    /// Graceful shutdown: open connections and whether the relay is draining.
    pub drain: Arc<crate::drain::Drain>,
    /// Every open downstream stream, for the admin API and CSDS.
    clients: DashMap<StreamId, Arc<ClientEntry>>,
    grouping: Grouping,
    /// New-stream admission (None: unlimited).
    admission: Option<Mutex<TokenBucket>>,
    /// Warm restart: the loaded snapshot's groups not yet claimed, and the writer's lock.
    pub snapshot: crate::snapshot::SnapshotState,
}

impl Relay {
    pub fn new(config: Config, shutdown: watch::Receiver<bool>) -> Arc<Self> {
        let grouping = Grouping::new(
            config.grouping.rules.clone(),
            config.grouping.metadata_keys.clone(),
            config.node_id.clone(),
            config.grouping.unmatched,
        );
        let admission = TokenBucket::new(
            config.resilience.max_new_streams_per_second,
            config.resilience.new_streams_burst,
            Instant::now(),
        )
        .map(Mutex::new);
        Arc::new(Relay {
            grouping,
            admission,
            config: Arc::new(config),
            groups: DashMap::new(),
            creating: Mutex::new(()),
            next_stream: AtomicU64::new(1),
            upstream_reached: Arc::new(AtomicBool::new(false)),
            shutdown,
            metrics: Arc::new(Metrics::new()),
            drain: Arc::default(),
            clients: DashMap::new(),
            snapshot: Default::default(),
        })
    }

    pub fn group(&self, name: &str) -> Option<Arc<Group>> {
        self.groups.get(name).map(|g| g.clone())
    }

    /// Every open downstream stream.
    pub fn clients(&self) -> Vec<Arc<ClientEntry>> {
        self.clients.iter().map(|c| c.value().clone()).collect()
    }

    /// `/metrics`: every group's stats and status read now (each group's lock taken once,
    /// briefly), then everything in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        let mut s = ScrapeState::default();
        for c in self.clients.iter() {
            s.streams[c.protocol as usize] += 1;
        }
        for g in self.groups() {
            let stats = read(&g.state).stats();
            let status = lock(&g.status).clone();
            s.groups.push(GroupScrape {
                group: g.name.clone(),
                stats,
                connected: status.connected,
                streams_opened: status.streams_opened,
                responses: status.responses,
                nacks_sent: status.nacks_sent,
                last_response: status.last_response,
                member_mismatches: g.member_mismatches.load(Ordering::Relaxed),
                drift_repairs: status.drift_repairs,
                resyncs: status.resyncs,
                failovers: status.failovers,
                unanswered_types: status.unanswered_types.len(),
                sotw: status.upstream_protocol == "sotw",
                protocol_switches: status.protocol_switches,
                upstream: status.upstream.unwrap_or_default(),
            });
        }
        self.metrics.render(s)
    }

    /// The group for a downstream node (docs/configure.md "Aggregation groups"): the first matching
    /// `[[groups]]` rule (or the implicit one) names it and renders the node presented upstream.
    /// Nodes share a group only if that upstream node is the same; a name already taken by a
    /// different identity gets a digest suffix. A node that matches no rule is refused
    /// (PERMISSION_DENIED) unless `unmatched = "passthrough"`.
    pub fn group_for(&self, node: &Node) -> Result<Arc<Group>, Status> {
        let Some(a) = self.grouping.assign(node) else {
            return Err(Status::permission_denied(format!(
                "adsrelay: node id={:?} cluster={:?} matches no [[groups]] rule of this relay; \
                 add a rule for it or set unmatched = \"passthrough\"",
                node.id, node.cluster
            )));
        };
        let mut name = a.name.clone();
        if let Some(g) = self.groups.get(&name) {
            if !same_identity(&g.upstream_node, &a.upstream) {
                name = format!("{name}~{}", identity_digest(&a.upstream));
            }
        }
        let existing = self.groups.get(&name).map(|g| g.clone());
        let group = match existing {
            Some(g) => g,
            None => {
                // Creation (snapshot restore, two tasks) runs under its own lock, not the map's:
                // streams of other groups are never held up by it.
                let _creating = lock(&self.creating);
                let existing = self.groups.get(&name).map(|g| g.clone());
                match existing {
                    Some(g) => g,
                    None => {
                        let g = self.new_group(name.clone(), &a);
                        self.groups.insert(name, g.clone());
                        g
                    }
                }
            }
        };
        group.check_member(node, &a);
        Ok(group)
    }

    fn new_group(&self, name: String, a: &Assignment) -> Arc<Group> {
        info!(group = %name, upstream_id = %a.upstream.id, upstream_cluster = %a.upstream.cluster,
            passthrough = a.passthrough, "new aggregation group");
        let mut state = GroupState::new(self.config.unsubscribe_linger)
            .with_unsubscribed_budget(self.config.unsubscribed_cache_bytes);
        // Warm restart: a group saved in the loaded snapshot starts with its cache.
        let seeded_as_of = self.snapshot.restore_into(
            &name,
            &a.upstream,
            &mut state,
            self.config.unsubscribe_linger,
        );
        let group = Arc::new(Group::new(name, a, state, seeded_as_of));
        tokio::spawn(crate::upstream::housekeeping(
            group.clone(),
            self.shutdown.clone(),
        ));
        tokio::spawn(crate::upstream::run(
            self.config.clone(),
            group.clone(),
            self.upstream_reached.clone(),
            self.shutdown.clone(),
        ));
        group
    }

    pub fn groups(&self) -> Vec<Arc<Group>> {
        self.groups.iter().map(|g| g.value().clone()).collect()
    }
}

impl StreamHost for Relay {
    type Membership = Member;

    /// `tls_authorization`: the client's certificate identity must be allowed the group its node
    /// maps to (the rule's group name, before any digest suffix).
    fn authorize(
        &self,
        node: &Node,
        peer: Option<&crate::tls::PeerIdentity>,
    ) -> Result<(), Status> {
        let auth = &self.config.tls_authorization;
        if !auth.is_enabled() {
            return Ok(());
        }
        // Unmatched nodes are refused by `open`.
        let Some(a) = self.grouping.assign(node) else {
            return Ok(());
        };
        auth.check(peer, &a.name).map_err(|message| {
            self.metrics.stream_rejected(StreamRejection::Unauthorized);
            warn!(node_id = %node.id, group = %a.name, peer = ?peer.and_then(|p| p.remote_addr),
                "{message}");
            Status::permission_denied(message)
        })
    }

    fn open(&self, id: StreamId, node: &Node, mailbox: Arc<Mailbox>) -> Result<Member, Status> {
        if self.drain.is_draining() {
            return Err(Status::unavailable(
                "adsrelay is shutting down; reconnect to another replica",
            ));
        }
        if let Some(a) = &self.admission {
            if !lock(a).take(Instant::now()) {
                self.metrics.stream_rejected(StreamRejection::Admission);
                let r = &self.config.resilience;
                return Err(Status::unavailable(format!(
                    "adsrelay: too many new streams (admission limit {}/s, burst {}); retry with backoff",
                    r.max_new_streams_per_second, r.new_streams_burst
                )));
            }
        }
        let group = self.group_for(node).inspect_err(|_| {
            self.metrics.stream_rejected(StreamRejection::NoGroup);
        })?;
        let slot = group.attach(id, mailbox);
        Ok(Member { group, slot })
    }

    fn default_params(&self, node: &Node) -> Params {
        params_from_metadata(node, &self.config.params_from_metadata)
    }

    fn on_effects(&self, member: &Member, _id: StreamId, effects: &RequestEffects) -> u64 {
        let group = &member.group;
        let applied = write(&group.state).apply_effects(member.slot, effects, Instant::now());
        self.metrics
            .cache_lookups(&effects.type_url, applied.cache_hits, applied.cache_misses);
        // A storm's thousands of resubscriptions to names others hold change nothing upstream:
        // only a first reference or a last release wakes the upstream task (and its write lock).
        if applied.interest_changed {
            group.upstream_wake.notify_one();
        }
        applied.seq
    }

    fn refetch(&self, member: &Member, locators: Vec<(String, Locator)>) {
        let group = &member.group;
        let now = Instant::now();
        let mut state = write(&group.state);
        for (type_url, l) in &locators {
            state.refetch(type_url, l, now);
        }
        drop(state);
        group.upstream_wake.notify_one();
    }

    fn with_store<R>(&self, member: &Member, f: impl FnOnce(&Store) -> R) -> R {
        f(read(&member.group.state).store())
    }

    fn close(&self, member: Member, id: StreamId, held: Vec<(Name, Locator)>) {
        self.clients.remove(&id);
        let Member { group, slot } = member;
        let interest_changed = write(&group.state).remove_stream(slot, &held, Instant::now());
        // Only now may another stream take the slot: the core no longer counts it as this one.
        group.detach(slot);
        if interest_changed {
            group.upstream_wake.notify_one();
        }
    }

    fn next_stream_id(&self) -> StreamId {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    fn limits(&self) -> crate::downstream::limits::StreamLimits {
        crate::downstream::limits::StreamLimits::from_settings(&self.config.limits)
    }

    fn group_name(&self, member: &Member) -> String {
        member.group.name.clone()
    }

    fn observe(&self, event: StreamEvent<'_>) {
        match event {
            StreamEvent::Opened(client) => {
                self.metrics.stream_opened(client.protocol);
                self.clients.insert(client.id, client.clone());
            }
            StreamEvent::Rejected(reason) => self.metrics.stream_rejected(reason),
            StreamEvent::Answered { type_url, nack } => self.metrics.client_ack(type_url, nack),
            StreamEvent::Sent {
                protocol,
                type_url,
                resources,
                bytes,
                received_at,
                shared,
            } => {
                self.metrics
                    .response_sent(protocol, type_url, resources, bytes, shared);
                if let Some(at) = received_at {
                    self.metrics.fanout_latency(at);
                }
            }
        }
    }
}

/// TP2's migration path: dynamic parameters for a client that sends no locators, read from the
/// configured keys of its `node.metadata` (strings as they are, numbers and booleans printed).
pub fn params_from_metadata(node: &Node, keys: &[String]) -> Params {
    use prost_types::value::Kind;
    let Some(md) = node.metadata.as_ref() else {
        return Params::new();
    };
    keys.iter()
        .filter_map(|k| {
            let v = match md.fields.get(k)?.kind.as_ref()? {
                Kind::StringValue(s) => s.clone(),
                Kind::NumberValue(n) => n.to_string(),
                Kind::BoolValue(b) => b.to_string(),
                _ => return None,
            };
            Some((k.clone(), v))
        })
        .collect()
}

impl crate::snapshot::Host for Relay {
    fn config(&self) -> &Config {
        &self.config
    }

    fn snapshot_state(&self) -> &crate::snapshot::SnapshotState {
        &self.snapshot
    }

    fn groups(&self) -> Vec<Arc<Group>> {
        Relay::groups(self)
    }

    fn snapshot_loaded(&self, resources: usize, age: std::time::Duration) {
        self.metrics.snapshot_loaded(resources, age);
    }

    fn snapshot_rejected(&self, reason: &'static str) {
        self.metrics.snapshot_rejected(reason);
    }

    fn snapshot_written(&self, ok: bool) {
        self.metrics.snapshot_written(ok);
    }
}
