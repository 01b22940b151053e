//! The relay's shared runtime state: aggregation groups, each with its protocol state behind a lock,
//! its downstream mailboxes and its upstream task. Implements [`StreamHost`] for downstream streams,
//! keeps the registry of connected clients (admin API, CSDS) and records the relay's metrics.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use dashmap::DashMap;
use tokio::sync::{watch, Notify};
use tonic::Status;

use crate::config::Config;
use crate::downstream::{ClientEntry, Mailbox, StreamEvent, StreamHost};
use crate::metrics::{GroupScrape, Metrics, ScrapeState};
use crate::pb::core::Node;
use crate::sync::lock;
use crate::xds::constraints::Params;
use crate::xds::{
    ChangeSet, GroupState, Locator, Lookup, RequestEffects, Store, StreamId, WILDCARD,
};

/// The upstream connection of one group, as operators see it on /readyz.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct UpstreamStatus {
    pub connected: bool,
    pub connected_since: Option<SystemTime>,
    pub last_response: Option<SystemTime>,
    /// At least one response was received since the group was created: its cache holds upstream
    /// data, so it can serve while the upstream is down.
    pub synced_once: bool,
    pub streams_opened: u64,
    pub responses: u64,
    pub nacks_sent: u64,
    pub last_error: Option<String>,
}

/// One aggregation group: the downstream clients of one upstream identity.
#[derive(Debug)]
pub struct Group {
    pub name: String,
    pub state: Mutex<GroupState>,
    pub status: Mutex<UpstreamStatus>,
    streams: DashMap<StreamId, Arc<Mailbox>>,
    /// Wakes the upstream task when the interest changed.
    pub upstream_wake: Notify,
}

impl Group {
    /// Delivers a change set to every stream subscribed to one of its names.
    pub fn publish(&self, changes: ChangeSet, affected: impl IntoIterator<Item = StreamId>) {
        let changes = Arc::new(changes);
        for id in affected {
            if let Some(mailbox) = self.streams.get(&id) {
                mailbox.post(&changes);
            }
        }
    }

    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }
}

#[derive(Debug)]
pub struct Relay {
    pub config: Arc<Config>,
    groups: DashMap<String, Arc<Group>>,
    next_stream: AtomicU64,
    /// The upstream answered at least once (probe or any group).
    pub upstream_reached: Arc<AtomicBool>,
    shutdown: watch::Receiver<bool>,
    pub metrics: Metrics,
    /// Every open downstream stream, for the admin API and CSDS.
    clients: DashMap<StreamId, Arc<ClientEntry>>,
}

impl Relay {
    pub fn new(config: Config, shutdown: watch::Receiver<bool>) -> Arc<Self> {
        Arc::new(Relay {
            config: Arc::new(config),
            groups: DashMap::new(),
            next_stream: AtomicU64::new(1),
            upstream_reached: Arc::new(AtomicBool::new(false)),
            shutdown,
            metrics: Metrics::new(),
            clients: DashMap::new(),
        })
    }

    pub fn group(&self, name: &str) -> Option<Arc<Group>> {
        self.groups.get(name).map(|g| g.clone())
    }

    /// Every open downstream stream.
    pub fn clients(&self) -> Vec<Arc<ClientEntry>> {
        self.clients.iter().map(|c| c.value().clone()).collect()
    }

    /// `/metrics`: the scrape-time gauges, then everything in the Prometheus text format. Each
    /// group's lock is taken once, briefly, to count its subscriptions and cache.
    pub fn render_metrics(&self) -> String {
        let mut s = ScrapeState::default();
        for c in self.clients.iter() {
            s.streams[usize::from(c.protocol != "delta")] += 1;
        }
        for g in self.groups() {
            let subscriptions = {
                let state = lock(&g.state);
                for (t, n) in state.subscriptions_by_type() {
                    *s.subscriptions.entry(t.to_string()).or_default() += n;
                }
                for t in state.store.type_urls() {
                    let e = s.cache.entry(t.to_string()).or_default();
                    e.0 += state.store.names(t).count();
                    for r in state.store.resources(t) {
                        e.1 += 1;
                        e.2 += r.encoded.len();
                    }
                }
                (
                    state.interest.upstream_subscription_count(),
                    state.interest.refetches,
                    state.interest.refetch_fallbacks,
                    state.store.ttl_expired,
                )
            };
            let (subscriptions, refetches, refetch_fallbacks, ttl_expired) = subscriptions;
            let status = lock(&g.status).clone();
            s.groups.push(GroupScrape {
                group: g.name.clone(),
                connected: status.connected,
                subscriptions,
                streams_opened: status.streams_opened,
                responses: status.responses,
                nacks_sent: status.nacks_sent,
                last_response: status.last_response,
                refetches,
                refetch_fallbacks,
                ttl_expired,
            });
        }
        self.metrics.render(s)
    }

    /// The group for a downstream node: in this version, its `node.cluster`.
    pub fn group_for(&self, node: &Node) -> Arc<Group> {
        if let Some(g) = self.groups.get(&node.cluster) {
            return g.clone();
        }
        let entry = self.groups.entry(node.cluster.clone()).or_insert_with(|| {
            let group = Arc::new(Group {
                name: node.cluster.clone(),
                state: Mutex::new(GroupState::new(self.config.unsubscribe_linger)),
                status: Mutex::new(UpstreamStatus::default()),
                streams: DashMap::new(),
                upstream_wake: Notify::new(),
            });
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
        });
        entry.clone()
    }

    pub fn groups(&self) -> Vec<Arc<Group>> {
        self.groups.iter().map(|g| g.value().clone()).collect()
    }
}

impl StreamHost for Relay {
    type Session = Arc<Group>;

    fn open(&self, id: StreamId, node: &Node, mailbox: Arc<Mailbox>) -> Result<Arc<Group>, Status> {
        let group = self.group_for(node);
        group.streams.insert(id, mailbox);
        Ok(group)
    }

    fn default_params(&self, node: &Node) -> Params {
        params_from_metadata(node, &self.config.params_from_metadata)
    }

    fn on_effects(&self, group: &Arc<Group>, id: StreamId, effects: &RequestEffects) -> u64 {
        let mut state = lock(&group.state);
        // Cache hit: a new subscription the cache can answer now (present or known absent, or a
        // synced wildcard); miss: it waits for the upstream.
        let (mut hits, mut misses) = (0, 0);
        for l in &effects.acquire {
            let hit = if &*l.name == WILDCARD {
                state.store.wildcard_synced(&effects.type_url)
            } else {
                !matches!(
                    state
                        .store
                        .lookup_for(&effects.type_url, &l.name, &l.params),
                    Lookup::Unknown
                )
            };
            if hit {
                hits += 1;
            } else {
                misses += 1;
            }
        }
        let seq = state.apply_effects(id, effects, Instant::now());
        drop(state);
        self.metrics.cache_lookups(&effects.type_url, hits, misses);
        group.upstream_wake.notify_one();
        seq
    }

    fn refetch(&self, group: &Arc<Group>, locators: Vec<(String, Locator)>) {
        let now = Instant::now();
        let mut state = lock(&group.state);
        for (type_url, l) in &locators {
            state.refetch(type_url, l, now);
        }
        drop(state);
        group.upstream_wake.notify_one();
    }

    fn with_store<R>(&self, group: &Arc<Group>, f: impl FnOnce(&Store) -> R) -> R {
        f(&lock(&group.state).store)
    }

    fn close(&self, group: Arc<Group>, id: StreamId, held: Vec<(String, Locator)>) {
        self.clients.remove(&id);
        group.streams.remove(&id);
        lock(&group.state).remove_stream(id, &held, Instant::now());
        group.upstream_wake.notify_one();
    }

    fn next_stream_id(&self) -> StreamId {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    fn group_name(&self, group: &Arc<Group>) -> String {
        group.name.clone()
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
            } => {
                self.metrics
                    .response_sent(protocol, type_url, resources, bytes);
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
