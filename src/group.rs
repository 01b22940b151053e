//! One aggregation group at run time: its protocol state behind a lock, the mailboxes of its
//! downstream streams, the wake-up for its upstream task, and the upstream status operators see.
//! The relay creates groups and starts their tasks (the upstream module); this module only holds
//! what both sides share.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::downstream::Mailbox;
use crate::grouping::{Assignment, IgnoredFields};
use crate::pb::core::Node;
use crate::sync::{lock, read, write};
use crate::xds::upstream_session::Repairs;
use crate::xds::{Affected, ChangeSet, GroupState, Slot, SlotAllocator, StreamId};

/// The upstream connection of one group, as operators see it on /readyz.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct UpstreamStatus {
    pub connected: bool,
    #[serde(serialize_with = "crate::rfc3339::option")]
    pub connected_since: Option<SystemTime>,
    #[serde(serialize_with = "crate::rfc3339::option")]
    pub last_response: Option<SystemTime>,
    /// At least one response was received since the group was created: its cache holds upstream
    /// data, so it can serve while the upstream is down.
    pub synced_once: bool,
    pub streams_opened: u64,
    pub responses: u64,
    pub nacks_sent: u64,
    pub last_error: Option<String>,
    /// The control-plane address in use (or being tried).
    pub upstream: Option<String>,
    /// The ADS flavour spoken to it: "delta" or "sotw".
    pub upstream_protocol: &'static str,
    /// Upstreams `upstream_protocol = "auto"` switched to SotW (they answered UNIMPLEMENTED).
    pub protocol_switches: u64,
    /// Attempts moved to another control-plane address after a failure.
    pub failovers: u64,
    /// Periodic resyncs done, and the resources reconciliations found different and repaired.
    pub resyncs: u64,
    pub drift_repairs: u64,
    #[serde(serialize_with = "crate::rfc3339::option")]
    pub last_resync: Option<SystemTime>,
    /// The last reconciliation (C18): a stream without versions whose wildcard answers were
    /// compared with the cache; what it repaired per type.
    pub last_reconciliation: Option<ReconciliationReport>,
    /// Types the current stream subscribed when it opened that the upstream has not answered
    /// after the wait (`UNANSWERED_WAIT`); the group serves its cache for them meanwhile.
    pub unanswered_types: Vec<String>,
    /// When the upstream stream was lost (None while connected).
    #[serde(serialize_with = "crate::rfc3339::option")]
    pub disconnected_since: Option<SystemTime>,
}

/// What one reconciliation repaired, as /debug/upstreams shows it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReconciliationReport {
    #[serde(serialize_with = "crate::rfc3339::option")]
    pub finished_at: Option<SystemTime>,
    /// Every wildcard type got its full-state answer (false: the wait ended first).
    pub complete: bool,
    pub repairs: BTreeMap<String, Repairs>,
}

/// The mailboxes of a group's open streams, indexed by slot: a change set's affected slots find
/// theirs by position (one read lock per change set, not a map lookup per stream).
#[derive(Debug, Default)]
struct Mailboxes {
    slots: SlotAllocator,
    by_slot: Vec<Option<(StreamId, Arc<Mailbox>)>>,
}

/// A stream's membership of its group: the group, and the slot the group knows it by.
#[derive(Debug)]
pub struct Member {
    pub group: Arc<Group>,
    pub slot: Slot,
}

/// One aggregation group: the downstream clients of one upstream identity.
#[derive(Debug)]
pub struct Group {
    pub name: String,
    /// Read-locked by every stream building a response (they run in parallel); write-locked to
    /// apply subscriptions, upstream responses and expiry.
    pub state: RwLock<GroupState>,
    pub status: Mutex<UpstreamStatus>,
    /// The open streams' mailboxes by slot, the number the core's subscriber sets know them by.
    streams: RwLock<Mailboxes>,
    /// Wakes the upstream task when the interest changed.
    pub upstream_wake: Notify,
    /// The node the relay presents upstream for this group (its identity, D1).
    pub upstream_node: Node,
    /// The node fields the group ignores, as its first member had them.
    first_member: IgnoredFields,
    /// Members that joined differing from the first in ignored fields.
    pub member_mismatches: AtomicU64,
    /// Ignored fields already reported at warn level (later mismatches log at debug).
    mismatch_logged: Mutex<HashSet<&'static str>>,
    /// The group started from the cache snapshot, whose content was current at this time
    /// (docs/deploy.md "Warm restart").
    pub seeded_as_of: Option<SystemTime>,
}

impl Group {
    pub fn new(
        name: String,
        assignment: &Assignment,
        state: GroupState,
        seeded_as_of: Option<SystemTime>,
    ) -> Self {
        Group {
            name,
            state: RwLock::new(state),
            status: Mutex::new(UpstreamStatus::default()),
            streams: RwLock::new(Mailboxes::default()),
            upstream_wake: Notify::new(),
            upstream_node: assignment.upstream.clone(),
            first_member: assignment.ignored.clone(),
            member_mismatches: AtomicU64::new(0),
            mismatch_logged: Mutex::new(HashSet::new()),
            seeded_as_of,
        }
    }

    /// A downstream stream joined: changes for its subscriptions reach `mailbox`. Returns the
    /// stream's slot in the group.
    pub fn attach(&self, id: StreamId, mailbox: Arc<Mailbox>) -> Slot {
        let mut streams = write(&self.streams);
        let slot = streams.slots.take();
        let i = slot as usize;
        if streams.by_slot.len() <= i {
            streams.by_slot.resize_with(i + 1, || None);
        }
        streams.by_slot[i] = Some((id, mailbox));
        slot
    }

    /// The stream in `slot` left (after the core released its subscriptions): the slot is free
    /// for the next stream.
    pub fn detach(&self, slot: Slot) {
        let mut streams = write(&self.streams);
        if let Some(entry) = streams.by_slot.get_mut(slot as usize) {
            if entry.take().is_some() {
                streams.slots.give_back(slot);
            }
        }
    }

    /// Delivers a change set to the streams in `affected` (those subscribed to one of its names).
    pub fn publish(&self, changes: ChangeSet, affected: Affected) {
        let changes = Arc::new(changes);
        let streams = read(&self.streams);
        for slot in affected.iter() {
            if let Some(Some((_, mailbox))) = streams.by_slot.get(slot as usize) {
                mailbox.post(&changes);
            }
        }
    }

    pub fn stream_count(&self) -> usize {
        read(&self.streams).slots.in_use()
    }

    /// The mailboxes of the group's open streams (graceful drain closes them in batches).
    pub fn mailboxes(&self) -> Vec<(StreamId, Arc<Mailbox>)> {
        read(&self.streams)
            .by_slot
            .iter()
            .flatten()
            .map(|(id, mailbox)| (*id, mailbox.clone()))
            .collect()
    }

    /// Makes a member that differs from the group's first member in fields the group ignores
    /// visible: the control plane tailors config to the one node the relay presents, so such a
    /// member may get config meant for another node.
    pub fn check_member(&self, node: &Node, a: &Assignment) {
        let differ = self.first_member.differences(&a.ignored);
        if differ.is_empty() {
            return;
        }
        self.member_mismatches.fetch_add(1, Ordering::Relaxed);
        let mut logged = lock(&self.mismatch_logged);
        let new: Vec<&str> = differ
            .iter()
            .copied()
            .filter(|f| logged.insert(f))
            .collect();
        drop(logged);
        if new.is_empty() {
            debug!(group = %self.name, node_id = %node.id, fields = ?differ,
                "group member differs from the first member in fields the group ignores");
        } else {
            warn!(group = %self.name, node_id = %node.id, cluster = %node.cluster, fields = ?differ,
                "group member differs from the group's first member in node fields the group \
                 ignores; the control plane sees one node for the whole group (add the field to \
                 the group's key, e.g. metadata_keys, if it tailors config by it)");
        }
    }
}
