//! The relay's shared runtime state: aggregation groups, each with its protocol state behind a lock,
//! its downstream mailboxes and its upstream task. Implements [`DeltaHost`] for downstream streams.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use dashmap::DashMap;
use tokio::sync::{watch, Notify};
use tonic::Status;

use crate::config::Config;
use crate::downstream::{Mailbox, StreamHost};
use crate::pb::core::Node;
use crate::sync::lock;
use crate::xds::{ChangeSet, GroupState, Name, RequestEffects, Store, StreamId};

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
}

impl Relay {
    pub fn new(config: Config, shutdown: watch::Receiver<bool>) -> Arc<Self> {
        Arc::new(Relay {
            config: Arc::new(config),
            groups: DashMap::new(),
            next_stream: AtomicU64::new(1),
            upstream_reached: Arc::new(AtomicBool::new(false)),
            shutdown,
        })
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

    fn on_effects(&self, group: &Arc<Group>, id: StreamId, effects: &RequestEffects) {
        lock(&group.state).apply_effects(id, effects, Instant::now());
        group.upstream_wake.notify_one();
    }

    fn with_store<R>(&self, group: &Arc<Group>, f: impl FnOnce(&Store) -> R) -> R {
        f(&lock(&group.state).store)
    }

    fn close(&self, group: Arc<Group>, id: StreamId, held: Vec<(String, Name)>) {
        group.streams.remove(&id);
        lock(&group.state).remove_stream(id, &held, Instant::now());
        group.upstream_wake.notify_one();
    }

    fn next_stream_id(&self) -> StreamId {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }
}
