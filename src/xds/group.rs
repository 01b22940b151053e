//! The protocol state of one aggregation group: its store, the refcounted interest it holds
//! upstream, the index from names to the downstream streams subscribed to them (the "who listens
//! to what" index that makes fan-out targeted), and the byte-bounded set of names no client wants
//! any more. No I/O; the adapter holds it behind a lock.
//!
//! A name no client subscribes to stays subscribed upstream while it is in the unsubscribed set,
//! so what the store holds for it stays fresh and a returning client is served at once. It leaves
//! the set when a client subscribes again, when it has been there for the linger, or when the set
//! is over its byte budget (least recently left first); the last two end the upstream
//! subscription and the store forgets the name in the same step, so nothing is served from a
//! lapsed subscription (D5). Names a client subscribes to, or that a client's wildcard of the type
//! covers, are never in the set.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::contract::RequestEffects;
use super::interest::{Interest, UpstreamChange, WILDCARD};
use super::resource::{Locator, Name};
use super::store::{ApplyError, ChangeSet, ExportedType, Lookup, Store, UpstreamUpdate};
use super::subscribers::{Affected, Slot, SubscriberIndex};
use super::unsubscribed::UnsubscribedSet;
use super::xdstp;

/// Identifies a downstream stream within the process.
pub type StreamId = u64;

#[derive(Debug, Default)]
pub struct GroupState {
    pub(super) store: Store,
    pub(super) interest: Interest,
    /// type_url -> name (or `"*"`) -> the slots of the streams subscribed to it.
    index: SubscriberIndex,
    /// Names (and lingering wildcards) held upstream that no client wants, within a byte budget.
    pub(super) unsubscribed: UnsubscribedSet,
    /// The upstream stream must be re-established to get a full answer (taken by the upstream
    /// task, see [`GroupState::take_resync`]).
    resync_wanted: bool,
}

/// What [`GroupState::apply_effects`] did: the store's sequence number when the subscriptions took
/// effect (so the stream can tell later deliveries from what was already there), and how many new
/// subscriptions the cache could answer at once (present, known absent, or a synced wildcard) and
/// how many wait for the upstream; and whether the upstream subscription may have to change (a
/// first reference or a last release), the only case the upstream task needs waking for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub seq: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub interest_changed: bool,
}

/// What a group's state counts, read at scrape time (metrics are never counted twice).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupStats {
    /// type_url -> downstream subscriptions (locators and wildcards) in the group.
    pub subscriptions: Vec<(String, usize)>,
    /// Per cached type: names, variants and their encoded bytes.
    pub cache: Vec<CacheStats>,
    /// Names (and wildcards) subscribed upstream.
    pub upstream_subscriptions: usize,
    pub refetches: u64,
    pub refetch_fallbacks: u64,
    pub ttl_expired: u64,
    pub ambiguous_matches: u64,
    pub wildcards_unanswered: u64,
    pub unsubscribed: UnsubscribedStats,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheStats {
    pub type_url: String,
    pub names: usize,
    pub variants: usize,
    pub bytes: usize,
}

/// The unsubscribed set: its budget and use, and why names left it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UnsubscribedStats {
    pub budget: usize,
    pub bytes: usize,
    pub entries: usize,
    pub evicted_budget: u64,
    pub evicted_linger: u64,
    pub resubscriptions: u64,
}

impl GroupState {
    /// A view of the counters and sizes, for `/metrics`.
    pub fn stats(&self) -> GroupStats {
        let cache = self
            .store
            .type_urls()
            .map(|t| {
                let (variants, bytes) = self
                    .store
                    .resources(t)
                    .fold((0, 0), |(n, b), r| (n + 1, b + r.encoded.len()));
                CacheStats {
                    type_url: t.to_string(),
                    names: self.store.names(t).count(),
                    variants,
                    bytes,
                }
            })
            .collect();
        let u = &self.unsubscribed;
        GroupStats {
            subscriptions: self
                .subscriptions_by_type()
                .map(|(t, n)| (t.to_string(), n))
                .collect(),
            cache,
            upstream_subscriptions: self.interest.upstream_subscription_count(),
            refetches: self.interest.refetches,
            refetch_fallbacks: self.interest.refetch_fallbacks,
            ttl_expired: self.store.ttl_expired,
            ambiguous_matches: self.store.ambiguous_matches(),
            wildcards_unanswered: self.interest.wildcards_unanswered,
            unsubscribed: UnsubscribedStats {
                budget: u.budget(),
                bytes: u.bytes(),
                entries: u.len(),
                evicted_budget: u.evicted_budget,
                evicted_linger: u.evicted_linger,
                resubscriptions: u.resubscriptions,
            },
        }
    }

    pub fn new(linger: Duration) -> Self {
        GroupState {
            store: Store::new(),
            interest: Interest::new(linger),
            index: SubscriberIndex::default(),
            unsubscribed: UnsubscribedSet::default(),
            resync_wanted: false,
        }
    }

    /// A group whose cache starts with `store` (for tests and fuzzing: a warm cache without an
    /// upstream).
    pub fn with_store(mut self, store: Store) -> Self {
        self.store = store;
        self
    }

    /// What the group has cached (read-only: the store changes only through the group's rules).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// What the group holds upstream (read-only, like [`GroupState::store`]).
    pub fn interest(&self) -> &Interest {
        &self.interest
    }

    /// Whether the upstream stream must be re-established (and clears the request).
    pub fn take_resync(&mut self) -> bool {
        std::mem::take(&mut self.resync_wanted)
    }

    /// Sets the byte budget of the unsubscribed set (`unsubscribed_cache_bytes`).
    pub fn with_unsubscribed_budget(mut self, bytes: usize) -> Self {
        self.unsubscribed = UnsubscribedSet::new(bytes);
        self
    }

    /// Applies the subscription changes of the stream in `slot` to the interest and the index.
    pub fn apply_effects(&mut self, slot: Slot, effects: &RequestEffects, now: Instant) -> Applied {
        let type_url = &effects.type_url;
        let (mut cache_hits, mut cache_misses) = (0, 0);
        for l in &effects.acquire {
            let hit = if &*l.name == WILDCARD {
                self.store.wildcard_synced(type_url)
            } else {
                !matches!(
                    self.store.lookup_for(type_url, &l.name, &l.params),
                    Lookup::Unknown
                )
            };
            if hit {
                cache_hits += 1;
            } else {
                cache_misses += 1;
            }
        }
        let subscribers = self.index.of_type_mut(type_url);
        let mut touched = Vec::with_capacity(effects.acquire.len() + effects.release.len());
        for l in &effects.acquire {
            subscribers.subscribe(&l.name, slot);
            // Only the first reference and the last release change anything below.
            if self.interest.acquire(type_url, l) {
                if self.unsubscribed.contains(type_url, &l.name) {
                    self.unsubscribed.resubscriptions += 1;
                }
                touched.push(l.name.clone());
            }
        }
        for l in &effects.release {
            if subscribers.unsubscribe(&l.name, slot) && self.interest.release(type_url, l, now) {
                touched.push(l.name.clone());
            }
        }
        let interest_changed = !touched.is_empty();
        self.settle(type_url, touched);
        Applied {
            seq: self.store.seq(),
            cache_hits,
            cache_misses,
            interest_changed,
        }
    }

    /// The stream in `slot` ended: release everything it held (F9). Returns whether that was the
    /// last reference to anything (the upstream subscription may have to change). The caller may
    /// hand the slot to another stream afterwards.
    pub fn remove_stream(&mut self, slot: Slot, held: &[(Name, Locator)], now: Instant) -> bool {
        let mut interest_changed = false;
        // `held` comes grouped by type: one index lookup per type, not per locator.
        for run in held.chunk_by(|a, b| a.0 == b.0) {
            let type_url = &*run[0].0;
            let Some(subscribers) = self.index.existing_mut(type_url) else {
                continue;
            };
            let mut touched = Vec::new();
            for (_, l) in run {
                if subscribers.unsubscribe(&l.name, slot) && self.interest.release(type_url, l, now)
                {
                    touched.push(l.name.clone());
                }
            }
            interest_changed |= !touched.is_empty();
            self.settle(type_url, touched);
        }
        interest_changed
    }

    /// Seeds one type from a warm-restart snapshot: its locators are held upstream as lingering
    /// until `hold_until` (so they go upstream on the first stream and lapse unless a client claims
    /// them) and join the unsubscribed set like any released name, under its byte budget. Returns
    /// the number of variants restored.
    pub fn restore_type(
        &mut self,
        locators: &[Locator],
        content: ExportedType,
        hold_until: Instant,
        now: Instant,
    ) -> usize {
        let type_url = content.type_url.clone();
        for l in locators {
            self.interest.restore(&type_url, l, hold_until);
        }
        let restored = self.store.import(vec![content], now);
        self.settle(&type_url, locators.iter().map(|l| l.name.clone()).collect());
        restored
    }

    /// Brings the store and the unsubscribed set in line with the interest in `names` of one type
    /// after it changed: a name nobody holds upstream any more is forgotten (D5); one held only by
    /// a linger is (re)accounted in the set; one a client wants (itself or by the type's wildcard)
    /// leaves the set. Then evicts whatever the budget no longer covers.
    fn settle(&mut self, type_url: &str, mut names: Vec<Name>) {
        if names.is_empty() {
            return;
        }
        if names.iter().any(|n| &**n == WILDCARD) {
            // Whether a client holds the wildcard decides for every kept name of the type.
            names.extend(self.interest.lingering_names(type_url));
            names.extend(self.unsubscribed.names_of_type(type_url));
        }
        names.sort();
        names.dedup();
        // `"*"` sorts first: a lapsed wildcard is forgotten before the names it covered settle.
        for n in &names {
            self.settle_name(type_url, n);
        }
        self.account_wildcard(type_url);
        self.enforce_budget();
    }

    fn settle_name(&mut self, type_url: &str, name: &Name) {
        let wildcard = &**name == WILDCARD;
        if !self.interest.wants(type_url, name) {
            // The upstream subscription lapsed (or never existed): what is held may go stale.
            if wildcard {
                let interest = &self.interest;
                self.store
                    .forget_wildcard(type_url, |n| interest.wants(type_url, n));
            } else if !self.interest.is_wildcard(type_url) {
                // An alias nobody wants any more takes the resource it named, unless that is
                // still kept by its own name or another alias (A25).
                if let Some(real) = self.store.resolve_alias(type_url, name).cloned() {
                    if !self.keeps(type_url, &real) {
                        self.store.forget(type_url, &real);
                    }
                }
                self.store.forget(type_url, name);
                // A lapsed glob takes the members nothing else subscribes to with it (D5).
                if xdstp::is_glob(name) {
                    let interest = &self.interest;
                    self.store
                        .forget_collection(type_url, name, |m| interest.wants(type_url, m));
                }
            }
            self.unsubscribed.remove(type_url, name);
            return;
        }
        let protected = self.interest.referenced(type_url, name)
            || (!wildcard && self.interest.referenced(type_url, WILDCARD));
        if protected {
            self.unsubscribed.remove(type_url, name);
            return;
        }
        let bytes = if wildcard {
            self.wildcard_only_bytes(type_url)
        } else if xdstp::is_glob(name) {
            self.store
                .collection_members(type_url, name)
                .map(|m| self.store.name_bytes(type_url, m))
                .sum()
        } else {
            self.store.name_bytes(type_url, name)
        };
        self.unsubscribed.insert(type_url, name, bytes);
    }

    /// What a lingering wildcard alone keeps: the names of the type no locator holds explicitly.
    fn wildcard_only_bytes(&self, type_url: &str) -> usize {
        self.store
            .names(type_url)
            .filter(|n| !self.interest.wants(type_url, n))
            .map(|n| self.store.name_bytes(type_url, n))
            .sum()
    }

    /// Re-accounts a lingering wildcard of the type, if it is in the set (its bytes move with the
    /// type's content and with names gaining or losing their own subscription).
    fn account_wildcard(&mut self, type_url: &str) {
        let wildcard = Name::from(WILDCARD);
        if self.unsubscribed.contains(type_url, &wildcard) {
            let bytes = self.wildcard_only_bytes(type_url);
            self.unsubscribed.set_bytes(type_url, &wildcard, bytes);
        }
    }

    /// Evicts least recently left entries until the set fits its budget: each one's upstream
    /// subscription ends (the unsubscribe is queued) and the store forgets it at once (D5). A name
    /// evicted while its type's wildcard still lingers stays cached under the wildcard (the
    /// upstream keeps sending it), so its bytes move to the wildcard's entry.
    fn enforce_budget(&mut self) {
        while let Some((type_url, name)) = self.unsubscribed.pop_over_budget() {
            self.unsubscribed.evicted_budget += 1;
            self.interest.drop_lingering(&type_url, &name);
            self.settle_name(&type_url, &name);
            self.account_wildcard(&type_url);
        }
    }

    /// The streams that must look at a change set: subscribers of the changed (or heartbeat)
    /// names and every wildcard subscriber of the type.
    pub fn affected(&self, changes: &ChangeSet) -> Affected {
        // A28: a glob subscription is indexed under the collection's name, so a changed member
        // finds its collection's subscribers with one more lookup.
        let collections: Vec<String> = changes
            .names
            .iter()
            .filter_map(|n| xdstp::collection_of(n))
            .collect();
        let names = changes
            .names
            .iter()
            .chain(&changes.heartbeats)
            .map(|n| &**n)
            .chain(collections.iter().map(String::as_str))
            .chain(std::iter::once(WILDCARD));
        self.index.affected(&changes.type_url, names)
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
        if wildcard_answered {
            self.interest.wildcard_answered(type_url);
        }
        for n in &changes.names {
            self.interest.received(type_url, n);
        }
        if !wildcard {
            let unwanted: HashSet<Name> = changes
                .names
                .iter()
                .filter(|n| !self.keeps(type_url, n))
                .cloned()
                .collect();
            for n in &unwanted {
                self.store.forget(type_url, n);
            }
            changes.names.retain(|n| !unwanted.contains(n));
        }
        // Kept names the upstream updated cost what they cost now; that may evict some.
        for n in &changes.names {
            let bytes = self.store.name_bytes(type_url, n);
            self.unsubscribed.set_bytes(type_url, n, bytes);
        }
        self.account_wildcard(type_url);
        self.enforce_budget();
        Ok(changes)
    }

    /// Whether the group keeps what the upstream sends for `name`: it is subscribed, its glob
    /// collection is (A28), or one of its aliases is (A25).
    pub fn keeps(&self, type_url: &str, name: &str) -> bool {
        let wants = |n: &str| self.interest.wants(type_url, n);
        wants(name)
            || xdstp::collection_of(name).is_some_and(|c| wants(&c))
            || self
                .store
                .aliases_of(type_url, name)
                .iter()
                .any(|a| wants(a))
    }

    /// A stream needs the upstream to send `locator` again (C3).
    pub fn refetch(&mut self, type_url: &str, locator: &Locator, now: Instant) {
        self.interest.refetch(type_url, locator, now);
    }

    /// Ends expired lingers (dropping what the store holds for names no longer subscribed
    /// upstream), unanswered wildcard waits and expired TTLs; returns the change sets the wildcard
    /// waits and TTL expiries caused, with the streams they affect.
    /// The upstream stream left `type_url` unanswered past the wait: a wildcard type is served
    /// from the cache (not authoritative for removals until a real answer), as a mid-stream
    /// `"*"` is (D9). Returns what to tell whom.
    pub fn stop_waiting_for(&mut self, type_url: &str) -> Option<(ChangeSet, Affected)> {
        if !self.interest.is_wildcard(type_url) {
            return None;
        }
        let changes = self.store.serve_unanswered_wildcard(type_url)?;
        self.interest.wildcards_unanswered += 1;
        let affected = self.affected(&changes);
        Some((changes, affected))
    }

    pub fn expire(&mut self, now: Instant) -> Vec<(ChangeSet, Affected)> {
        let mut lapsed: HashMap<String, Vec<Name>> = HashMap::new();
        for (type_url, l) in self.interest.expire(now) {
            if !self.interest.wants(&type_url, &l.name)
                && self.unsubscribed.contains(&type_url, &l.name)
            {
                self.unsubscribed.evicted_linger += 1;
            }
            lapsed.entry(type_url).or_default().push(l.name);
        }
        for (type_url, names) in lapsed {
            self.settle(&type_url, names);
        }
        // B2/D9 liveness: a mid-stream "*" the upstream did not answer (it need not).
        let mut served = Vec::new();
        for (type_url, dropped_before) in self.interest.unanswered_wildcards(now) {
            if dropped_before && !self.store.wildcard_synced(&type_url) {
                // Serving now could omit names the server thinks we hold: start a new stream.
                self.resync_wanted = true;
                continue;
            }
            if let Some(c) = self.store.serve_unanswered_wildcard(&type_url) {
                self.interest.wildcards_unanswered += 1;
                let affected = self.affected(&c);
                served.push((c, affected));
            }
        }
        let expired = self.store.expire(now);
        // Kept names whose TTL ran out hold less now.
        for c in &expired {
            for n in &c.names {
                let bytes = self.store.name_bytes(&c.type_url, n);
                self.unsubscribed.set_bytes(&c.type_url, n, bytes);
            }
            self.account_wildcard(&c.type_url);
        }
        served.extend(expired.into_iter().map(|c| {
            let affected = self.affected(&c);
            (c, affected)
        }));
        served
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
        self.index.pairs_by_type()
    }

    /// Number of streams subscribed to `name` (for tests and introspection).
    pub fn subscribers(&self, type_url: &str, name: &str) -> usize {
        self.index.count(type_url, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::Resource;
    use crate::xds::store::Lookup;
    use crate::xds::AckStatus;
    use bytes::Bytes;
    use proptest::prelude::*;
    use prost::Message;
    use std::collections::BTreeSet;

    const T: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    const LINGER: Duration = Duration::from_secs(60);

    /// A resource whose encoded size grows with `body_len`.
    fn res(name: &str, version: &str, body_len: usize) -> Bytes {
        Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: T.into(),
                value: vec![b'x'; body_len],
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    fn effects(acquire: &[&str], release: &[&str]) -> RequestEffects {
        RequestEffects {
            type_url: T.into(),
            acquire: acquire.iter().map(|n| Locator::plain(*n)).collect(),
            release: release.iter().map(|n| Locator::plain(*n)).collect(),
            ack: AckStatus::None,
        }
    }

    fn sub(g: &mut GroupState, stream: Slot, names: &[&str], now: Instant) {
        g.apply_effects(stream, &effects(names, &[]), now);
    }

    fn unsub(g: &mut GroupState, stream: Slot, names: &[&str], now: Instant) {
        g.apply_effects(stream, &effects(&[], names), now);
    }

    fn send(g: &mut GroupState, resources: Vec<Bytes>) -> ChangeSet {
        g.apply_upstream(
            T,
            UpstreamUpdate {
                resources,
                ..Default::default()
            },
        )
        .expect("valid response")
    }

    /// (subscribed, unsubscribed) names of the upstream changes queued since the last call.
    fn upstream(g: &mut GroupState) -> (Vec<String>, Vec<String>) {
        let mut out = (vec![], vec![]);
        for c in g.take_upstream_changes() {
            out.0.extend(c.subscribe.iter().map(|l| l.name.to_string()));
            out.1
                .extend(c.unsubscribe.iter().map(|l| l.name.to_string()));
        }
        out
    }

    fn present(g: &GroupState, name: &str) -> bool {
        matches!(g.store.lookup(T, name), Lookup::Present(_))
    }

    /// B2/D9: a `"*"` added to a running stream need not be answered; after the wait the cache
    /// serves wildcard subscribers, without authority to remove names.
    #[test]
    fn a_mid_stream_wildcard_left_unanswered_is_served_after_the_wait() {
        use crate::xds::interest::WILDCARD_WAIT;
        let t0 = Instant::now();
        let mut g = GroupState::new(LINGER);
        sub(&mut g, 1, &["a"], t0);
        assert_eq!(upstream(&mut g).0, vec!["a"]);
        send(&mut g, vec![res("a", "1", 1)]);
        sub(&mut g, 2, &[WILDCARD], t0);
        assert_eq!(upstream(&mut g).0, vec![WILDCARD]);
        g.interest.arm_wildcard_waits(t0);
        assert!(!g.store.wildcard_synced(T));
        assert_eq!(g.next_deadline(), Some(t0 + WILDCARD_WAIT));
        assert!(g.expire(t0 + WILDCARD_WAIT / 2).is_empty());
        let served = g.expire(t0 + WILDCARD_WAIT);
        assert_eq!(served.len(), 1);
        assert!(served[0].0.wildcard_synced_now);
        assert!(
            served[0].1.contains(&2),
            "the wildcard subscriber looks again"
        );
        assert!(g.store.wildcard_synced(T));
        assert!(
            !g.store.wildcard_authoritative(T),
            "a guess proves no removal"
        );
        assert_eq!(g.interest.wildcards_unanswered, 1);
        // A later response is the answer: now authoritative.
        send(&mut g, vec![res("b", "1", 1)]);
        assert!(g.store.wildcard_authoritative(T));
    }

    #[test]
    fn a_wildcard_the_upstream_must_answer_is_waited_for() {
        use crate::xds::interest::WILDCARD_WAIT;
        let t0 = Instant::now();
        // The type's first request on the stream carries "*": the server must answer it.
        let mut g = GroupState::new(LINGER);
        sub(&mut g, 1, &[WILDCARD], t0);
        upstream(&mut g);
        g.interest.arm_wildcard_waits(t0);
        assert!(g.expire(t0 + WILDCARD_WAIT * 10).is_empty());
        assert!(!g.store.wildcard_synced(T));
        // Added mid-stream but answered in time: no guess, no count.
        let mut g = GroupState::new(LINGER);
        sub(&mut g, 1, &["a"], t0);
        upstream(&mut g);
        sub(&mut g, 2, &[WILDCARD], t0);
        upstream(&mut g);
        g.interest.arm_wildcard_waits(t0);
        send(&mut g, vec![res("a", "1", 1)]);
        assert!(g.expire(t0 + WILDCARD_WAIT).is_empty());
        assert!(g.store.wildcard_authoritative(T));
        assert_eq!(g.interest.wildcards_unanswered, 0);
        // On a new stream the first request carries "*" again: no wait.
        g.interest.resubscribe_all();
        assert_eq!(g.interest.next_deadline(), None);
    }

    #[test]
    fn a_wildcard_dropped_and_taken_again_asks_for_a_new_stream() {
        use crate::xds::interest::WILDCARD_WAIT;
        let t0 = Instant::now();
        let mut g = GroupState::new(Duration::ZERO);
        sub(&mut g, 1, &[WILDCARD], t0);
        upstream(&mut g);
        send(&mut g, vec![res("a", "1", 1), res("b", "1", 1)]);
        // The wildcard lapses: the store forgets a and b, the server may still count them held.
        unsub(&mut g, 1, &[WILDCARD], t0);
        assert_eq!(upstream(&mut g).1, vec![WILDCARD]);
        assert!(!present(&g, "a"));
        sub(&mut g, 2, &[WILDCARD], t0);
        upstream(&mut g);
        g.interest.arm_wildcard_waits(t0);
        assert!(
            g.expire(t0 + WILDCARD_WAIT).is_empty(),
            "no guess from a gutted cache"
        );
        assert!(!g.store.wildcard_synced(T));
        assert!(g.take_resync(), "a new stream brings every name back (C4)");
        assert!(!g.take_resync());
    }

    fn group(budget: usize) -> GroupState {
        GroupState::new(LINGER).with_unsubscribed_budget(budget)
    }

    #[test]
    fn subscribed_names_are_never_evicted_nor_counted() {
        let now = Instant::now();
        let mut g = group(10);
        sub(&mut g, 1, &["a", "b"], now);
        upstream(&mut g);
        send(&mut g, vec![res("a", "1", 500), res("b", "1", 500)]);
        assert_eq!(g.unsubscribed.bytes(), 0);
        assert!(present(&g, "a") && present(&g, "b"));
        assert_eq!(upstream(&mut g), (vec![], vec![]));
        assert_eq!(g.unsubscribed.evicted_budget, 0);
    }

    #[test]
    fn evicts_least_recently_left_past_the_budget_and_forgets_it() {
        let now = Instant::now();
        let a = res("a", "1", 100).len();
        let mut g = group(2 * a + a / 2);
        sub(&mut g, 1, &["a", "b", "c"], now);
        send(
            &mut g,
            vec![res("a", "1", 100), res("b", "1", 100), res("c", "1", 100)],
        );
        upstream(&mut g);
        unsub(&mut g, 1, &["b"], now);
        unsub(&mut g, 1, &["a"], now);
        assert_eq!(g.unsubscribed.bytes(), 2 * a);
        assert_eq!(
            upstream(&mut g),
            (vec![], vec![]),
            "kept names stay subscribed"
        );
        unsub(&mut g, 1, &["c"], now);
        // b left first, so it goes first: unsubscribed upstream and forgotten in one step (D5).
        assert_eq!(upstream(&mut g), (vec![], vec!["b".to_string()]));
        assert!(!present(&g, "b"));
        assert_eq!(g.store.lookup(T, "b"), Lookup::Unknown);
        assert!(present(&g, "a") && present(&g, "c"));
        assert_eq!(g.unsubscribed.bytes(), 2 * a);
        assert_eq!(g.unsubscribed.evicted_budget, 1);
    }

    #[test]
    fn resubscribing_a_kept_name_is_served_without_upstream_traffic() {
        let now = Instant::now();
        let mut g = group(1 << 20);
        sub(&mut g, 1, &["a"], now);
        send(&mut g, vec![res("a", "1", 10)]);
        upstream(&mut g);
        unsub(&mut g, 1, &["a"], now);
        sub(&mut g, 2, &["a"], now + Duration::from_secs(1));
        assert_eq!(upstream(&mut g), (vec![], vec![]));
        assert!(present(&g, "a"));
        assert_eq!(g.unsubscribed.resubscriptions, 1);
        assert_eq!((g.unsubscribed.bytes(), g.unsubscribed.len()), (0, 0));
        // Back in use: the linger no longer applies.
        g.expire(now + 2 * LINGER);
        assert!(present(&g, "a"));
    }

    #[test]
    fn resubscribing_an_evicted_name_subscribes_upstream_and_waits() {
        let now = Instant::now();
        let mut g = group(0);
        sub(&mut g, 1, &["a"], now);
        send(&mut g, vec![res("a", "1", 10)]);
        upstream(&mut g);
        unsub(&mut g, 1, &["a"], now);
        assert_eq!(upstream(&mut g), (vec![], vec!["a".to_string()]));
        sub(&mut g, 2, &["a"], now);
        assert_eq!(upstream(&mut g), (vec!["a".to_string()], vec![]));
        assert_eq!(g.store.lookup(T, "a"), Lookup::Unknown);
        assert_eq!(g.unsubscribed.resubscriptions, 0);
    }

    #[test]
    fn linger_is_the_longest_stay() {
        let now = Instant::now();
        let mut g = group(1 << 20);
        sub(&mut g, 1, &["a"], now);
        send(&mut g, vec![res("a", "1", 10)]);
        upstream(&mut g);
        unsub(&mut g, 1, &["a"], now);
        g.expire(now + LINGER - Duration::from_secs(1));
        assert!(present(&g, "a"));
        g.expire(now + LINGER);
        assert_eq!(upstream(&mut g), (vec![], vec!["a".to_string()]));
        assert!(!present(&g, "a"));
        assert_eq!(g.unsubscribed.evicted_linger, 1);
        assert!(g.unsubscribed.is_empty());
    }

    #[test]
    fn updates_while_kept_are_reaccounted_and_may_evict() {
        let now = Instant::now();
        let small = res("a", "1", 10).len();
        let big = res("a", "2", 1000).len();
        let mut g = group(2 * small + 10);
        sub(&mut g, 1, &["a", "b"], now);
        send(&mut g, vec![res("a", "1", 10), res("b", "1", 10)]);
        upstream(&mut g);
        unsub(&mut g, 1, &["a", "b"], now);
        assert_eq!(g.unsubscribed.bytes(), 2 * small);
        // `a` grows past the budget; it left first, so it goes.
        let c = send(&mut g, vec![res("a", "2", 1000)]);
        assert!(big > g.unsubscribed.budget());
        assert_eq!(c.names, vec![Name::from("a")]);
        assert_eq!(upstream(&mut g), (vec![], vec!["a".to_string()]));
        assert!(!present(&g, "a"));
        assert_eq!(g.unsubscribed.bytes(), small);
        // An update that shrinks a kept name is accounted too.
        send(&mut g, vec![res("b", "2", 0)]);
        assert_eq!(g.unsubscribed.bytes(), res("b", "2", 0).len());
    }

    #[test]
    fn a_kept_name_whose_ttl_ran_out_holds_nothing() {
        let t0 = Instant::now();
        let mut g = group(1 << 20);
        sub(&mut g, 1, &["a"], t0);
        let mut with_ttl = Resource::decode(res("a", "1", 100)).expect("valid");
        with_ttl.ttl = Some(prost_types::Duration {
            seconds: 5,
            nanos: 0,
        });
        g.apply_upstream(
            T,
            UpstreamUpdate {
                resources: vec![with_ttl.encode_to_vec().into()],
                received_at: Some(t0),
                ..Default::default()
            },
        )
        .expect("valid response");
        unsub(&mut g, 1, &["a"], t0);
        assert!(g.unsubscribed.bytes() > 100);
        g.expire(t0 + Duration::from_secs(5));
        assert_eq!((g.unsubscribed.len(), g.unsubscribed.bytes()), (1, 0));
    }

    #[test]
    fn a_wildcard_subscriber_protects_its_types_names() {
        let now = Instant::now();
        let mut g = group(1);
        sub(&mut g, 1, &["*"], now);
        sub(&mut g, 2, &["a"], now);
        send(&mut g, vec![res("a", "1", 100), res("b", "1", 100)]);
        upstream(&mut g);
        unsub(&mut g, 2, &["a"], now);
        assert_eq!(g.unsubscribed.bytes(), 0);
        assert!(present(&g, "a") && present(&g, "b"));
        assert_eq!(upstream(&mut g), (vec![], vec![]));
        // The wildcard leaves too: now everything it kept is over the budget of 1 byte.
        unsub(&mut g, 1, &["*"], now);
        let (_, unsubscribed) = upstream(&mut g);
        assert_eq!(unsubscribed, vec!["*".to_string(), "a".to_string()]);
        assert!(!present(&g, "a") && !present(&g, "b"));
        assert!(
            !g.store.wildcard_synced(T),
            "a lapsed wildcard is not synced any more"
        );
        assert_eq!(g.unsubscribed.bytes(), 0);
    }

    #[test]
    fn a_lingering_wildcard_is_kept_and_accounted_as_one_entry() {
        let now = Instant::now();
        let one = res("a", "1", 100).len();
        let mut g = group(10 * one);
        sub(&mut g, 1, &["*"], now);
        upstream(&mut g);
        send(&mut g, vec![res("a", "1", 100), res("b", "1", 100)]);
        unsub(&mut g, 1, &["*"], now);
        assert_eq!((g.unsubscribed.len(), g.unsubscribed.bytes()), (1, 2 * one));
        // Names the upstream sends under the kept wildcard are accounted to it.
        send(&mut g, vec![res("c", "1", 100)]);
        assert_eq!(g.unsubscribed.bytes(), 3 * one);
        sub(&mut g, 2, &["*"], now);
        assert_eq!(upstream(&mut g), (vec![], vec![]));
        assert!(
            g.store.wildcard_synced(T),
            "served from the kept wildcard at once"
        );
        assert_eq!(g.unsubscribed.resubscriptions, 1);
        assert!(g.unsubscribed.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Sub(u8, u8),
        Unsub(u8, u8),
        /// The control plane changes a name (body size); it sends it if the name is subscribed
        /// upstream, or anyway (unsolicited) if the flag is set.
        Update(u8, u16, bool),
        Tick(u8),
        /// The upstream task sends the queued changes; the control plane answers new subscriptions.
        Flush,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Name 0 is the wildcard.
        prop_oneof![
            (0u8..3, 0u8..6).prop_map(|(s, n)| Op::Sub(s, n)),
            (0u8..3, 0u8..6).prop_map(|(s, n)| Op::Unsub(s, n)),
            (1u8..6, 0u16..300, any::<bool>()).prop_map(|(n, l, f)| Op::Update(n, l, f)),
            (0u8..40).prop_map(Op::Tick),
            Just(Op::Flush),
        ]
    }

    fn nm(n: u8) -> String {
        if n == 0 {
            WILDCARD.to_string()
        } else {
            format!("r{n}")
        }
    }

    /// The control plane: its resources and what the relay subscribes to on its stream.
    #[derive(Default)]
    struct ControlPlane {
        content: HashMap<String, (String, usize)>,
        subscribed: BTreeSet<String>,
    }

    impl ControlPlane {
        fn covers(&self, name: &str) -> bool {
            self.subscribed.contains(name) || self.subscribed.contains(WILDCARD)
        }

        /// Takes the relay's queued changes and answers every new subscription (as go-control-plane
        /// does: a name already subscribed is not resent), until nothing is queued.
        fn flush(&mut self, g: &mut GroupState) {
            loop {
                let changes = g.take_upstream_changes();
                if changes.is_empty() {
                    return;
                }
                for c in changes {
                    for l in c.unsubscribe {
                        self.subscribed.remove(&*l.name);
                    }
                    let mut new = Vec::new();
                    for l in c.subscribe {
                        if self.subscribed.insert(l.name.to_string()) {
                            new.push(l.name.to_string());
                        }
                    }
                    let send_all = new.iter().any(|n| n == WILDCARD);
                    let answer: Vec<Bytes> = self
                        .content
                        .iter()
                        .filter(|(n, _)| send_all || new.contains(n))
                        .map(|(n, (v, len))| res(n, v, *len))
                        .collect();
                    if !answer.is_empty() {
                        send(g, answer);
                    }
                }
            }
        }
    }

    proptest! {
        /// The relay wakes the upstream task only when a stream's subscriptions or its end report
        /// an interest change; whatever the sequence, none that reported none left an upstream
        /// subscription change waiting (it would never be sent).
        #[test]
        fn no_upstream_change_waits_unreported(
            ops in proptest::collection::vec((0u32..3, 0usize..4, 0u8..3), 1..80),
        ) {
            let now = Instant::now();
            let pool = ["a", "b", WILDCARD, "c"];
            let mut g = GroupState::new(LINGER);
            let mut held: [Vec<(Name, Locator)>; 3] = Default::default();
            for (stream, name, what) in ops {
                let l = Locator::plain(pool[name]);
                let subs = &mut held[stream as usize];
                let changed = match what {
                    // A stream acquires a locator once, as its state machine reports it.
                    0 if subs.iter().any(|(_, h)| *h == l) => continue,
                    0 => {
                        subs.push((crate::xds::names::intern(T), l.clone()));
                        g.apply_effects(stream, &effects(&[pool[name]], &[]), now).interest_changed
                    }
                    1 => match subs.iter().position(|(_, h)| *h == l) {
                        Some(i) => {
                            subs.remove(i);
                            g.apply_effects(stream, &effects(&[], &[pool[name]]), now)
                                .interest_changed
                        }
                        None => continue,
                    },
                    _ => g.remove_stream(stream, &std::mem::take(subs), now),
                };
                let queued = upstream(&mut g);
                prop_assert!(
                    changed || (queued.0.is_empty() && queued.1.is_empty()),
                    "stream {stream} op {what} on {}: nothing reported, {queued:?} queued",
                    pool[name]
                );
            }
        }

        /// Whatever the sequence: the set stays within its budget and holds no subscribed name;
        /// its byte count is the sum of what its entries keep; nothing is served for a name whose
        /// upstream subscription lapsed (D5); and once the queued changes went out, every
        /// subscribed name the control plane has is served at its current version.
        #[test]
        fn budget_and_d5_hold(ops in proptest::collection::vec(op(), 1..150), budget in 0usize..1200) {
            let mut now = Instant::now();
            let mut g = GroupState::new(Duration::from_secs(20)).with_unsubscribed_budget(budget);
            let mut held: [BTreeSet<String>; 3] = Default::default();
            let mut cp = ControlPlane::default();
            let mut version = 0u32;
            for op in ops {
                let mut flushed = false;
                match op {
                    Op::Sub(s, n) => {
                        if held[s as usize].insert(nm(n)) {
                            sub(&mut g, s.into(), &[&nm(n)], now);
                        }
                    }
                    Op::Unsub(s, n) => {
                        if held[s as usize].remove(&nm(n)) {
                            unsub(&mut g, s.into(), &[&nm(n)], now);
                        }
                    }
                    Op::Tick(secs) => {
                        now += Duration::from_secs(secs.into());
                        g.expire(now);
                    }
                    Op::Update(n, len, force) => {
                        let name = nm(n);
                        version += 1;
                        let v = version.to_string();
                        cp.content.insert(name.clone(), (v.clone(), len.into()));
                        if cp.covers(&name) || force {
                            send(&mut g, vec![res(&name, &v, len.into())]);
                        }
                    }
                    Op::Flush => {
                        cp.flush(&mut g);
                        flushed = true;
                    }
                }

                prop_assert!(g.unsubscribed.bytes() <= budget);
                let recount: usize = g.unsubscribed.names_of_type(T).iter().map(|n| {
                    if &**n == WILDCARD {
                        g.store.names(T).filter(|m| !g.interest.wants(T, m)).map(|m| g.store.name_bytes(T, m)).sum()
                    } else {
                        g.store.name_bytes(T, n)
                    }
                }).sum();
                prop_assert_eq!(recount, g.unsubscribed.bytes());
                let wanted: BTreeSet<&String> = held.iter().flatten().collect();
                let wildcard_wanted = wanted.contains(&WILDCARD.to_string());
                for n in 0..6 {
                    let name = nm(n);
                    let key = Name::from(name.as_str());
                    if wanted.contains(&name) || (n > 0 && wildcard_wanted) {
                        prop_assert!(!g.unsubscribed.contains(T, &key), "{} subscribed but in the set", name);
                    }
                    if n == 0 {
                        continue;
                    }
                    let lookup = g.store.lookup(T, &name);
                    // The relay's view at every step; the control plane's once changes went out.
                    let relay_holds = g.interest.wants(T, &name) || g.interest.is_wildcard(T);
                    if !relay_holds || (flushed && !cp.covers(&name)) {
                        prop_assert_eq!(&lookup, &Lookup::Unknown, "{} served after its subscription lapsed", name);
                    }
                    if flushed && (wanted.contains(&name) || wildcard_wanted) {
                        if let Some((v, _)) = cp.content.get(&name) {
                            prop_assert!(matches!(lookup, Lookup::Present(r) if &r.version == v), "subscribed {} not served at {}", name, v);
                        }
                    }
                }
            }
        }
    }
}
