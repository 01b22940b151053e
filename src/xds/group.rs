//! The protocol state of one aggregation group: its store, the refcounted interest it holds
//! upstream, and the index from names to the downstream streams subscribed to them (the "who listens
//! to what" index that makes fan-out targeted). No I/O; the adapter holds it behind a lock.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::delta::RequestEffects;
use super::interest::{Interest, UpstreamChange, WILDCARD};
use super::resource::Name;
use super::store::{ApplyError, ChangeSet, Store};

/// Identifies a downstream stream within the process.
pub type StreamId = u64;

#[derive(Debug, Default)]
pub struct GroupState {
    pub store: Store,
    pub interest: Interest,
    /// type_url -> name (or `"*"`) -> streams subscribed to it.
    index: HashMap<String, HashMap<Name, HashSet<StreamId>>>,
}

impl GroupState {
    pub fn new(linger: Duration) -> Self {
        GroupState {
            store: Store::new(),
            interest: Interest::new(linger),
            index: HashMap::new(),
        }
    }

    /// Applies a stream's subscription changes to the interest and the index.
    pub fn apply_effects(&mut self, stream: StreamId, effects: &RequestEffects, now: Instant) {
        let by_name = self.index.entry(effects.type_url.clone()).or_default();
        for name in &effects.acquire {
            if by_name.entry(name.clone()).or_default().insert(stream) {
                self.interest.acquire(&effects.type_url, name);
            }
        }
        for name in &effects.release {
            if Self::unindex(by_name, name, stream) {
                self.interest.release(&effects.type_url, name, now);
            }
        }
    }

    /// A stream ended: release everything it held (F9).
    pub fn remove_stream(&mut self, stream: StreamId, held: &[(String, Name)], now: Instant) {
        for (type_url, name) in held {
            if let Some(by_name) = self.index.get_mut(type_url) {
                if Self::unindex(by_name, name, stream) {
                    self.interest.release(type_url, name, now);
                }
            }
        }
    }

    fn unindex(
        by_name: &mut HashMap<Name, HashSet<StreamId>>,
        name: &Name,
        stream: StreamId,
    ) -> bool {
        let Some(streams) = by_name.get_mut(name) else {
            return false;
        };
        let removed = streams.remove(&stream);
        if streams.is_empty() {
            by_name.remove(name);
        }
        removed
    }

    /// The streams that must look at a change set: subscribers of the changed names and every
    /// wildcard subscriber of the type.
    pub fn affected(&self, changes: &ChangeSet) -> HashSet<StreamId> {
        let Some(by_name) = self.index.get(&changes.type_url) else {
            return HashSet::new();
        };
        changes
            .names
            .iter()
            .map(|n| &**n)
            .chain(std::iter::once(WILDCARD))
            .filter_map(|n| by_name.get(n))
            .flatten()
            .copied()
            .collect()
    }

    /// Applies an upstream response. Resources the group does not want (no wildcard, not
    /// subscribed) are not kept: the upstream may send extras, but nobody here would receive them.
    pub fn apply_upstream(
        &mut self,
        type_url: &str,
        resources: Vec<Bytes>,
        removed: Vec<String>,
    ) -> Result<ChangeSet, ApplyError> {
        let wildcard = self.interest.is_wildcard(type_url);
        let wildcard_answered = wildcard && self.interest.wildcard_sent(type_url);
        let mut changes =
            self.store
                .apply_delta(type_url, resources, removed, wildcard_answered)?;
        if !wildcard {
            let interest = &self.interest;
            let store = &mut self.store;
            changes.names.retain(|n| {
                let wanted = interest.wants(type_url, n);
                if !wanted {
                    store.forget(type_url, n);
                }
                wanted
            });
        }
        Ok(changes)
    }

    /// Ends expired lingers and drops what the store holds for names no longer subscribed upstream.
    pub fn expire(&mut self, now: Instant) {
        for (type_url, name) in self.interest.expire(now) {
            if &*name == WILDCARD {
                let interest = &self.interest;
                self.store
                    .forget_wildcard(&type_url, |n| interest.wants(&type_url, n));
            } else if !self.interest.is_wildcard(&type_url) {
                self.store.forget(&type_url, &name);
            }
        }
    }

    pub fn take_upstream_changes(&mut self) -> Vec<UpstreamChange> {
        self.interest.take_changes()
    }

    /// Number of streams subscribed to `name` (for tests and introspection).
    pub fn subscribers(&self, type_url: &str, name: &str) -> usize {
        self.index
            .get(type_url)
            .and_then(|m| m.get(name))
            .map_or(0, HashSet::len)
    }
}
