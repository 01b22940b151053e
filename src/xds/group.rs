//! The protocol state of one aggregation group: its store, the refcounted interest it holds
//! upstream, and the index from names to the downstream streams subscribed to them (the "who listens
//! to what" index that makes fan-out targeted). No I/O; the adapter holds it behind a lock.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::delta::RequestEffects;
use super::interest::{Interest, UpstreamChange, WILDCARD};
use super::resource::{Locator, Name};
use super::store::{ApplyError, ChangeSet, Store, UpstreamUpdate};

/// Identifies a downstream stream within the process.
pub type StreamId = u64;

#[derive(Debug, Default)]
pub struct GroupState {
    pub store: Store,
    pub interest: Interest,
    /// type_url -> name (or `"*"`) -> streams subscribed to it, with how many of their locators
    /// carry that name.
    index: HashMap<String, HashMap<Name, HashMap<StreamId, u32>>>,
}

impl GroupState {
    pub fn new(linger: Duration) -> Self {
        GroupState {
            store: Store::new(),
            interest: Interest::new(linger),
            index: HashMap::new(),
        }
    }

    /// Applies a stream's subscription changes to the interest and the index. Returns the store's
    /// sequence number, so the stream can tell later deliveries from what was already there.
    pub fn apply_effects(
        &mut self,
        stream: StreamId,
        effects: &RequestEffects,
        now: Instant,
    ) -> u64 {
        let by_name = self.index.entry(effects.type_url.clone()).or_default();
        for l in &effects.acquire {
            *by_name
                .entry(l.name.clone())
                .or_default()
                .entry(stream)
                .or_default() += 1;
            self.interest.acquire(&effects.type_url, l);
        }
        for l in &effects.release {
            if Self::unindex(by_name, &l.name, stream) {
                self.interest.release(&effects.type_url, l, now);
            }
        }
        self.store.seq()
    }

    /// A stream ended: release everything it held (F9).
    pub fn remove_stream(&mut self, stream: StreamId, held: &[(String, Locator)], now: Instant) {
        for (type_url, l) in held {
            if let Some(by_name) = self.index.get_mut(type_url) {
                if Self::unindex(by_name, &l.name, stream) {
                    self.interest.release(type_url, l, now);
                }
            }
        }
    }

    fn unindex(
        by_name: &mut HashMap<Name, HashMap<StreamId, u32>>,
        name: &Name,
        stream: StreamId,
    ) -> bool {
        let Some(streams) = by_name.get_mut(name) else {
            return false;
        };
        let Some(count) = streams.get_mut(&stream) else {
            return false;
        };
        *count -= 1;
        if *count == 0 {
            streams.remove(&stream);
        }
        if streams.is_empty() {
            by_name.remove(name);
        }
        true
    }

    /// The streams that must look at a change set: subscribers of the changed (or heartbeat)
    /// names and every wildcard subscriber of the type.
    pub fn affected(&self, changes: &ChangeSet) -> HashSet<StreamId> {
        let Some(by_name) = self.index.get(&changes.type_url) else {
            return HashSet::new();
        };
        changes
            .names
            .iter()
            .chain(&changes.heartbeats)
            .map(|n| &**n)
            .chain(std::iter::once(WILDCARD))
            .filter_map(|n| by_name.get(n))
            .flat_map(|m| m.keys())
            .copied()
            .collect()
    }

    /// Applies an upstream response. Resources the group does not want (no wildcard, not
    /// subscribed) are not kept: the upstream may send extras, but nobody here would receive them.
    pub fn apply_upstream(
        &mut self,
        type_url: &str,
        update: UpstreamUpdate,
    ) -> Result<ChangeSet, ApplyError> {
        let wildcard = self.interest.is_wildcard(type_url);
        let wildcard_answered = wildcard && self.interest.wildcard_sent(type_url);
        let mut changes = self.store.apply(type_url, update, wildcard_answered)?;
        for n in &changes.names {
            self.interest.received(type_url, n);
        }
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

    /// A stream needs the upstream to send `locator` again (C3).
    pub fn refetch(&mut self, type_url: &str, locator: &Locator, now: Instant) {
        self.interest.refetch(type_url, locator, now);
    }

    /// Ends expired lingers (dropping what the store holds for names no longer subscribed
    /// upstream) and expired TTLs; returns the change sets the TTL expiries caused, with the
    /// streams they affect.
    pub fn expire(&mut self, now: Instant) -> Vec<(ChangeSet, HashSet<StreamId>)> {
        for (type_url, l) in self.interest.expire(now) {
            if &*l.name == WILDCARD {
                let interest = &self.interest;
                self.store
                    .forget_wildcard(&type_url, |n| interest.wants(&type_url, n));
            } else if !self.interest.is_wildcard(&type_url)
                && !self.interest.wants(&type_url, &l.name)
            {
                self.store.forget(&type_url, &l.name);
            }
        }
        self.store
            .expire(now)
            .into_iter()
            .map(|c| {
                let affected = self.affected(&c);
                (c, affected)
            })
            .collect()
    }

    /// The next time [`GroupState::expire`] has work: a linger, a refetch fallback or a TTL.
    pub fn next_deadline(&self) -> Option<Instant> {
        match (self.interest.next_deadline(), self.store.next_expiry()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn take_upstream_changes(&mut self) -> Vec<UpstreamChange> {
        self.interest.take_changes()
    }

    /// Downstream subscriptions per type: (stream, name-or-`"*"`) pairs (for metrics).
    pub fn subscriptions_by_type(&self) -> impl Iterator<Item = (&str, usize)> {
        self.index
            .iter()
            .map(|(t, by_name)| (t.as_str(), by_name.values().map(|s| s.len()).sum()))
    }

    /// Number of streams subscribed to `name` (for tests and introspection).
    pub fn subscribers(&self, type_url: &str, name: &str) -> usize {
        self.index
            .get(type_url)
            .and_then(|m| m.get(name))
            .map_or(0, HashMap::len)
    }
}
