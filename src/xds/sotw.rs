//! The per-stream state-of-the-world state machine (conformance section B), for gRPC xDS clients
//! and Envoys on `api_type: GRPC`. Same contract as [`super::delta`]: requests and change sets in,
//! responses out, no I/O.
//!
//! Listener and Cluster responses carry the full subscribed state, so one is never built from an
//! incomplete cache (B2, D9): it waits until every requested name is known to exist or not and the
//! wildcard is synced. Other types are sent partially. `version_info` is a digest of the
//! (name, version) pairs the client holds after the response, so it changes exactly when the
//! content it would receive changes, and is the same on every relay replica (D8).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::constraints::{ConstraintKey, Params};
use super::contract::{AckStatus, ProtocolError, RequestEffects, StreamCore, TypeView};
use super::frame::{Content, Outgoing};
use super::interest::WILDCARD;
use super::names::type_urls;
use super::packed;
use super::per_type::PerType;
use super::resource::{Locator, Name};
use super::store::{ChangeSet, Lookup, Store};
use super::unacked::Unacked;
use super::wildcard_state::{Held, WhenFull, WildcardState};
use crate::pb::core::Node;
use crate::pb::discovery::DiscoveryRequest;
use crate::pb::wire;

/// Client features that announce support for `Resource` wrappers in SotW responses (B16); Envoy's
/// docs and gRPC disagree on the name, so both are accepted.
pub const RESOURCE_IN_SOTW_FEATURES: [&str; 2] = [
    "xds.config.resource-in-sotw",
    "xds.config.supports-resource-in-sotw",
];

/// Exactly these types need the full state in every SotW response (B1).
pub fn is_full_state(type_url: &str) -> bool {
    type_url == type_urls::LISTENER || type_url == type_urls::CLUSTER
}

#[derive(Debug, Default, Clone)]
struct TypeState {
    /// Names whose upstream error (TP3) was already reported; cleared when the resource arrives.
    errors_sent: BTreeSet<Name>,
    wildcard: bool,
    /// Requested locators -> subscribed by plain name (true) or by `resource_locators` (false).
    subs: BTreeMap<Locator, bool>,
    /// A non-empty `resource_names` was seen: an empty one now means "nothing", not wildcard (B5).
    seen_names: bool,
    /// What the client holds from our responses: locator -> (variant, version). A response changes
    /// it through [`TypeState::set_sent`], so a NACK puts back the state the client kept, and
    /// `version_info`, CSDS and /debug/clients report what the client really holds.
    sent: BTreeMap<Locator, Held>,
    /// What the responses not yet ACKed changed in `sent`.
    unacked: Unacked<Locator, Held>,
    /// What a NACKed response gave (`None`: left out) where the client kept its previous state:
    /// that alone is no reason to respond again (A31, B7).
    rejected: BTreeMap<Locator, Option<Held>>,
    /// Something relevant changed since the last response.
    dirty: bool,
    /// Subscriptions to send even if unchanged: newly requested (B4), re-requested (B13).
    resend: BTreeSet<Locator>,
    /// A response is owed even if nothing changed (first request B8, re-request B13).
    force: bool,
    /// Store sequence at subscription time, for `do_not_cache` content (D2, D4).
    stamps: SubscriptionStamps,
    last_nonce: Option<u64>,
    acked_nonce: Option<String>,
    last_nack: Option<(String, String)>,
}

/// The store sequence at which each subscription of a stream was applied to its group, so
/// `do_not_cache` content is served only to subscriptions that were waiting when it arrived (D2).
/// (Delta keeps the stamp beside each subscription instead, in its per-name parameter list.)
#[derive(Debug, Default, Clone)]
struct SubscriptionStamps {
    at: std::collections::HashMap<Locator, u64>,
    /// Subscriptions made since the adapter last reported the store sequence.
    unstamped: Vec<Locator>,
}

impl SubscriptionStamps {
    fn added(&mut self, l: Locator) {
        self.unstamped.push(l);
    }

    fn removed(&mut self, l: &Locator) {
        self.at.remove(l);
    }

    /// The group applied every subscription added so far when its store was at `seq`. The list
    /// is taken, not drained: a join's list would otherwise keep its capacity for the stream's life.
    fn stamp(&mut self, seq: u64) {
        for l in std::mem::take(&mut self.unstamped) {
            self.at.insert(l, seq);
        }
    }

    fn get(&self, l: &Locator) -> Option<u64> {
        self.at.get(l).copied()
    }
}

/// How the client tells a resource it holds apart (B20): by name for a by-name subscription, by
/// name and variant for a locator subscription.
fn wire_identity(r: &super::CachedResource, by_name: bool) -> (Name, ConstraintKey) {
    let variant = if by_name {
        ConstraintKey::default()
    } else {
        r.key.clone()
    };
    (r.name.clone(), variant)
}

impl TypeState {
    fn has_work(&self) -> bool {
        self.dirty || self.force || !self.resend.is_empty()
    }

    /// Records that the response being built leaves the client holding `held` for `l` (or not).
    fn set_sent(&mut self, l: &Locator, held: Option<Held>) {
        self.rejected.remove(l);
        if self.sent.get(l) == held.as_ref() {
            return;
        }
        // What the client rejected under this name may no longer be what it holds under it: a
        // same-name subscription sent alike (B20) may have replaced it. A31 forbids resending
        // into an unchanged state only, so the rejected version may go out once more.
        if !self.rejected.is_empty() {
            self.rejected.retain(|r, _| r.name != l.name);
        }
        self.unacked.record(l, self.sent.get(l), self.last_nonce);
        match held {
            Some(h) => self.sent.insert(l.clone(), h),
            None => self.sent.remove(l),
        };
    }

    /// Settles the response a request answers. On NACK the client keeps its previous state (B7),
    /// so `sent` goes back to it; a later full-state response in flight supersedes it.
    /// `nonce`: the answered one, if this relay could have sent it.
    fn settle(&mut self, type_url: &str, nonce: Option<u64>, nacked: bool) {
        self.unacked.seal(self.last_nonce);
        let Some(nonce) = nonce else { return };
        if !nacked {
            self.unacked.ack(nonce);
            return;
        }
        for (l, before) in self.unacked.nack(nonce, is_full_state(type_url)) {
            self.rejected.insert(l.clone(), self.sent.get(&l).cloned());
            match before {
                Some(h) => self.sent.insert(l, h),
                None => self.sent.remove(&l),
            };
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct SotwStream {
    types: PerType<Box<TypeState>>,
    nonce_seq: u64,
    /// Send each resource wrapped in a `Resource` (client announced the feature).
    wrap: bool,
    /// Parameters for plain-name and wildcard subscriptions (TP2 migration from node metadata).
    default_params: Arc<Params>,
    /// Subscriptions whose `do_not_cache` content must be fetched again for this client (C3).
    refetch: Vec<(String, Locator)>,
}

impl SotwStream {
    pub fn new(wrap: bool) -> Self {
        SotwStream {
            wrap,
            ..Default::default()
        }
    }

    /// Wraps resources iff the node announces one of [`RESOURCE_IN_SOTW_FEATURES`].
    pub fn for_node(node: &Node, default_params: Params) -> Self {
        let wrap = node
            .client_features
            .iter()
            .any(|f| RESOURCE_IN_SOTW_FEATURES.contains(&f.as_str()));
        SotwStream {
            wrap,
            default_params: Arc::new(default_params),
            ..Default::default()
        }
    }

    pub fn on_request(&mut self, req: &DiscoveryRequest) -> Result<RequestEffects, ProtocolError> {
        if req.type_url.is_empty() {
            return Err(ProtocolError::MissingTypeUrl);
        }
        let defaults = &self.default_params;
        let requested =
            Locator::from_request(&req.resource_names, &req.resource_locators, defaults);
        let first = !self.types.contains_key(&req.type_url);
        let ts = self.types.or_default(&req.type_url);
        let mut effects = RequestEffects {
            type_url: req.type_url.clone(),
            acquire: Vec::new(),
            release: Vec::new(),
            ack: AckStatus::None,
        };

        let mut rerequest = false;
        // ACK/NACK is judged by nonce and error_detail, never by version_info (B7, F5).
        if !req.response_nonce.is_empty() {
            let nonce = req.response_nonce.clone();
            let answered = super::frame::parse_nonce(&nonce);
            effects.ack = if answered.is_none() || answered != ts.last_nonce {
                AckStatus::Stale { nonce }
            } else if let Some(err) = &req.error_detail {
                ts.last_nack = Some((nonce.clone(), err.message.clone()));
                AckStatus::Nack {
                    nonce,
                    message: err.message.clone(),
                }
            } else {
                // B13: the same ACK again with the same names is a re-request (Envoy's EDS after a
                // CDS update); with other names it is a subscription change (B4/B9 cover it).
                rerequest = ts.acked_nonce.as_deref() == Some(nonce.as_str());
                ts.acked_nonce = Some(nonce.clone());
                AckStatus::Ack { nonce }
            };
            // Stale answers count too: a client answers every response, in order.
            ts.settle(&req.type_url, answered, req.error_detail.is_some());
        }
        // B8: the first request of a type on a stream (fresh or reconnecting, whatever nonce it
        // carries) gets an answer; so does a request without a nonce.
        if first || req.response_nonce.is_empty() {
            ts.force = true;
        }

        // The requested set, superseding the previous one (B11); B5 legacy wildcard rules.
        let (wildcard, subs): (bool, BTreeMap<Locator, bool>) = if requested.is_empty() {
            (first || (ts.wildcard && !ts.seen_names), BTreeMap::new())
        } else {
            ts.seen_names = true;
            (
                requested.iter().any(|(l, _)| &*l.name == WILDCARD),
                requested
                    .into_iter()
                    .filter(|(l, _)| &*l.name != WILDCARD)
                    .collect(),
            )
        };
        if wildcard && !ts.wildcard {
            effects.acquire.push(Locator::plain(WILDCARD));
            ts.stamps.added(Locator::plain(WILDCARD));
            ts.dirty = true;
        } else if !wildcard && ts.wildcard {
            effects.release.push(Locator::plain(WILDCARD));
            ts.sent.retain(|l, _| subs.contains_key(l));
            ts.rejected.retain(|l, _| subs.contains_key(l));
            ts.unacked.retain(|l| subs.contains_key(l));
        }
        for added in subs.keys().filter(|l| !ts.subs.contains_key(*l)) {
            effects.acquire.push(added.clone());
            ts.stamps.added(added.clone());
            // B4: newly requested names are sent even if sent before and unchanged.
            ts.resend.insert(added.clone());
        }
        // The same locator now asked for in the other form (by plain name instead of by
        // `resource_locators`, or back): the client identifies it differently (E9, E10), so it
        // gets it again in the form it now asks for.
        for (l, by_name) in &subs {
            if ts.subs.get(l).is_some_and(|was| was != by_name) {
                ts.resend.insert(l.clone());
            }
        }
        for removed in ts.subs.keys().filter(|l| !subs.contains_key(*l)) {
            effects.release.push(removed.clone());
            ts.stamps.removed(removed);
            if !wildcard {
                ts.sent.remove(removed);
                ts.rejected.remove(removed);
                ts.unacked.forget(removed);
            }
            ts.resend.remove(removed);
            // Another subscription of the same name may have been held back by this one (two
            // subscriptions sent alike, B20): look at the type again.
            ts.dirty = true;
        }
        if rerequest && wildcard == ts.wildcard && subs == ts.subs {
            ts.force = true;
            ts.resend.extend(subs.keys().cloned());
        }
        ts.wildcard = wildcard;
        ts.subs = subs;
        Ok(effects)
    }

    /// The adapter applied this stream's latest subscriptions when the store was at `seq`.
    pub fn subscribed_at(&mut self, seq: u64) {
        for ts in self.types.values_mut() {
            ts.stamps.stamp(seq);
        }
    }

    /// Subscriptions that need the upstream to send their `do_not_cache` content again.
    pub fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        std::mem::take(&mut self.refetch)
    }

    pub fn on_change(&mut self, changes: &ChangeSet) {
        if let Some(ts) = self.types.get_mut(&changes.type_url) {
            // B17: SotW clients get a refreshed TTL as the full resource again, never a body-less
            // heartbeat (which Listener/Cluster full state would read as a deletion).
            for name in &changes.heartbeats {
                let held: Vec<Locator> = ts
                    .sent
                    .range(Locator::plain(name.clone())..)
                    .map(|(l, _)| l)
                    .take_while(|l| &l.name == name)
                    .cloned()
                    .collect();
                if !held.is_empty() {
                    ts.resend.extend(held);
                    ts.dirty = true;
                }
            }
            if ts.wildcard
                || changes.wildcard_synced_now
                || changes.names.iter().any(|n| {
                    // Locators sort by name first, the plain one (no parameters) first of all.
                    ts.subs
                        .range(Locator::plain(n.clone())..)
                        .next()
                        .is_some_and(|(l, _)| &l.name == n)
                })
            {
                ts.dirty = true;
            }
        }
    }

    pub fn mark_all_pending(&mut self, type_url: &str) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.dirty = true;
        }
    }

    /// Builds the next response, in the same cross-type order as Delta (B14), with a nonce of this
    /// stream's own sequence.
    pub fn next_response(&mut self, store: &Store) -> Option<wire::DiscoveryResponse> {
        let mut resp = self.next_content(store)?;
        self.nonce_seq += 1;
        resp.nonce = self.nonce_seq.to_string();
        self.sent(&resp.type_url, self.nonce_seq);
        Some(resp)
    }

    /// The next response as a shared frame: every client due the same state of a type (all
    /// wildcard clients after a change, say) gets the same bytes, encoded once.
    pub fn next_frame(&mut self, store: &Store) -> Option<Outgoing> {
        let content = Content::Sotw(self.next_content(store)?);
        let out = store
            .frames()
            .frame_for_stream(content, &mut self.nonce_seq);
        self.sent(&out.type_url, out.frame.nonce);
        Some(out)
    }

    /// A response of `type_url` went out with `nonce`: ACKs and NACKs are judged against it.
    fn sent(&mut self, type_url: &str, nonce: u64) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.last_nonce = Some(nonce);
        }
    }

    /// Whether a response may be due (conservative: a build may still find nothing to send).
    pub fn has_work(&self) -> bool {
        self.types.iter().any(|(_, t)| t.has_work())
    }

    fn next_content(&mut self, store: &Store) -> Option<wire::DiscoveryResponse> {
        let mut order: Vec<Name> = self
            .types
            .iter()
            .filter(|(_, t)| t.has_work())
            .map(|(k, _)| k.clone())
            .collect();
        order.sort_by_key(|t| (super::delta::type_rank(t), t.clone()));
        order.into_iter().find_map(|t| self.build(&t, store))
    }

    fn build(&mut self, type_url: &str, store: &Store) -> Option<wire::DiscoveryResponse> {
        let wrap = self.wrap;
        let defaults = &self.default_params;
        let ts = self.types.get_mut(type_url)?;
        // Changes staged by an earlier build belong to its response (or to none).
        ts.unacked.seal(ts.last_nonce);
        let sent_before = ts.sent.len();
        // The common case, a wildcard-only subscriber of a full-state type: the response every
        // such stream gets is built once per store change (see `wildcard_state`).
        if ts.wildcard && ts.subs.is_empty() && ts.rejected.is_empty() && is_full_state(type_url) {
            let shared = store.wildcard_states().get_or_build(
                type_url,
                wrap,
                defaults,
                WhenFull::StartOver,
                || wildcard_state(store, type_url, wrap, defaults),
            );
            if let Some(shared) = shared {
                return Self::respond_with_shared(ts, type_url, &shared, sent_before);
            }
        }
        // (locator, by name): the requested set, plus every name of the type for a wildcard.
        let mut scope: BTreeMap<Locator, bool> = ts.subs.clone();
        if ts.wildcard {
            for n in store.names(type_url) {
                scope
                    .entry(Locator::with_params(n.clone(), defaults.clone()))
                    .or_insert(true);
            }
        }
        // D2/D4: `do_not_cache` content the client does not hold is only for subscriptions that
        // were waiting when it arrived; anything else must come from the upstream again.
        let wildcard_since = ts.stamps.get(&Locator::plain(WILDCARD));
        let withheld = |ts: &TypeState, l: &Locator, r: &super::CachedResource| {
            r.do_not_cache
                && !store.is_source()
                && ts.sent.get(l) != Some(&(r.key.clone(), r.version.clone()))
                && r.arrival <= ts.stamps.get(l).or(wildcard_since).unwrap_or(u64::MAX)
        };
        // B21 (TP3): each subscribed name's upstream error is reported once, until it arrives.
        let mut errors = Vec::new();
        for l in ts.subs.keys() {
            match store.error(type_url, &l.name) {
                Some(e) if !ts.errors_sent.contains(&l.name) => {
                    errors.push((l.name.clone(), e.clone()))
                }
                Some(_) => {}
                None => {
                    ts.errors_sent.remove(&l.name);
                }
            }
        }
        errors.dedup_by(|a, b| a.0 == b.0);
        let mut refetch = Vec::new();
        let mut out: Vec<Bytes> = Vec::new();
        // B20: the client holds one resource per wire identity: the name for by-name subscribers,
        // the name and variant for locator subscribers. When two subscriptions select different
        // resources under one identity, the first in order holds it, in every response alike
        // (else they would displace each other forever); the other waits for the conflict to end.
        // Only a name subscribed more than once can collide; every other name skips the
        // bookkeeping (this runs per client per change).
        let contested: BTreeSet<&Name> = scope
            .keys()
            .zip(scope.keys().skip(1))
            .filter(|(a, b)| a.name == b.name)
            .map(|(a, _)| &a.name)
            .collect();
        let mut claimed: BTreeMap<(Name, ConstraintKey), Held> = BTreeMap::new();
        let mut claim = |r: &super::CachedResource, by_name: bool| -> bool {
            if !contested.contains(&r.name) {
                return true;
            }
            let held = (r.key.clone(), r.version.clone());
            match claimed.entry(wire_identity(r, by_name)) {
                std::collections::btree_map::Entry::Occupied(e) => *e.get() == held,
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(held);
                    true
                }
            }
        };
        let mut emitted = BTreeSet::new();
        let mut emit = |out: &mut Vec<Bytes>, r: &super::CachedResource, by_name: bool| {
            if !contested.contains(&r.name) || emitted.insert(wire_identity(r, by_name)) {
                // Locator subscribers can take wrappers ([PROTO] resource_locators) and need the
                // constraints (E9).
                out.push(r.sotw_bytes(wrap || !by_name, by_name).clone());
            }
        };
        if is_full_state(type_url) {
            // B2/D9: wait rather than omit something the client would take as deleted.
            // A name the upstream reported an error for is known well enough: B21 sends the rest
            // with the error beside it.
            let unknown = ts.subs.keys().any(|l| {
                matches!(
                    store.lookup_for(type_url, &l.name, &l.params),
                    Lookup::Unknown
                ) && store.error(type_url, &l.name).is_none()
            });
            if unknown || (ts.wildcard && !store.wildcard_synced(type_url)) {
                return None;
            }
            // Each name is looked up once: this runs per client per change.
            let present: Vec<(&Locator, bool, &Arc<super::CachedResource>)> = scope
                .iter()
                .filter_map(
                    |(l, by_name)| match store.lookup_for(type_url, &l.name, &l.params) {
                        Lookup::Present(r) => Some((l, *by_name, r)),
                        _ => None,
                    },
                )
                .collect();
            for (l, _, r) in &present {
                if withheld(ts, l, r) {
                    refetch.push((type_url.to_string(), (*l).clone()));
                }
            }
            if !refetch.is_empty() {
                // D4: the full state waits for the fresh copies rather than omit them.
                self.refetch.extend(refetch);
                return None;
            }
            let mut current = BTreeMap::new();
            for (l, by_name, r) in present {
                if claim(r, by_name) {
                    emit(&mut out, r, by_name);
                    current.insert(l.clone(), (r.key.clone(), r.version.clone()));
                }
            }
            let owed = ts.force || !ts.resend.is_empty();
            ts.dirty = false;
            ts.resend.clear();
            // Only what the client already rejected differs: wait for a real change (A31).
            let unchanged = if ts.rejected.is_empty() {
                current == ts.sent
            } else {
                ts.sent
                    .keys()
                    .chain(current.keys())
                    .filter(|l| current.get(*l) != ts.sent.get(*l))
                    .all(|l| ts.rejected.get(l) == Some(&current.get(l).cloned()))
            };
            if unchanged && !owed && errors.is_empty() {
                return None;
            }
            ts.rejected.clear();
            let gone: Vec<Locator> = ts
                .sent
                .keys()
                .filter(|l| !current.contains_key(*l))
                .cloned()
                .collect();
            for l in gone {
                ts.set_sent(&l, None);
            }
            for (l, held) in current {
                ts.set_sent(&l, Some(held));
            }
        } else {
            for (l, by_name) in &scope {
                match store.lookup_for(type_url, &l.name, &l.params) {
                    Lookup::Present(r) if withheld(ts, l, r) => {
                        refetch.push((type_url.to_string(), l.clone()));
                    }
                    Lookup::Present(r) if !claim(r, *by_name) => {
                        // Another subscription holds this identity at the client.
                        ts.resend.remove(l);
                        ts.set_sent(l, None);
                    }
                    Lookup::Present(r) => {
                        let resend = ts.resend.remove(l) || ts.force;
                        let now = Some((r.key.clone(), r.version.clone()));
                        let changed =
                            ts.sent.get(l) != now.as_ref() && ts.rejected.get(l) != Some(&now);
                        if resend || changed {
                            emit(&mut out, r, *by_name);
                            ts.set_sent(l, now);
                        }
                    }
                    // B3: a partial type cannot signal deletion; the client keeps what it has.
                    Lookup::Absent => {
                        ts.resend.remove(l);
                        ts.set_sent(l, None);
                    }
                    // Wait for the upstream; the resend mark stays until it arrives.
                    Lookup::Unknown => {}
                }
            }
            ts.dirty = false;
            ts.force = false;
            self.refetch.extend(refetch);
        }
        packed::repack_after_bulk(&mut ts.sent, sent_before);
        if !is_full_state(type_url) && out.is_empty() && errors.is_empty() {
            return None;
        }
        ts.errors_sent.extend(errors.iter().map(|(n, _)| n.clone()));
        let errors = errors.into_iter().map(|(_, e)| e).collect();
        ts.force = false;
        Some(wire::DiscoveryResponse {
            version_info: version_of(&ts.sent),
            resources: out,
            type_url: type_url.to_string(),
            resource_errors: errors,
            ..Default::default()
        })
    }

    /// [`SotwStream::build`] for a wildcard-only subscriber from the shared state: the same
    /// response the per-client build would make, at the cost of comparing what the client holds.
    fn respond_with_shared(
        ts: &mut TypeState,
        type_url: &str,
        shared: &WildcardState,
        sent_before: usize,
    ) -> Option<wire::DiscoveryResponse> {
        let owed = ts.force || !ts.resend.is_empty();
        ts.dirty = false;
        ts.force = false;
        ts.resend.clear();
        // One merge walk of two sorted lists finds what differs; only that is recorded (this runs
        // per client per change, and a change is usually one resource of many).
        let mut changes: Vec<(Locator, Option<Held>)> = Vec::new();
        let mut sent = ts.sent.iter().peekable();
        let mut held = shared.held.iter().peekable();
        loop {
            match (sent.peek(), held.peek()) {
                (None, None) => break,
                (Some((l, _)), None) => {
                    changes.push(((*l).clone(), None));
                    sent.next();
                }
                (None, Some((l, h))) => {
                    changes.push((l.clone(), Some(h.clone())));
                    held.next();
                }
                (Some((sl, sh)), Some((l, h))) => match (*sl).cmp(l) {
                    std::cmp::Ordering::Less => {
                        changes.push(((*sl).clone(), None));
                        sent.next();
                    }
                    std::cmp::Ordering::Greater => {
                        changes.push((l.clone(), Some(h.clone())));
                        held.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if *sh != h {
                            changes.push((l.clone(), Some(h.clone())));
                        }
                        sent.next();
                        held.next();
                    }
                },
            }
        }
        if changes.is_empty() && !owed {
            return None;
        }
        for (l, now) in changes {
            ts.set_sent(&l, now);
        }
        packed::repack_after_bulk(&mut ts.sent, sent_before);
        Some(wire::DiscoveryResponse {
            version_info: shared.version_info.clone(),
            resources: shared.resources.clone(),
            type_url: type_url.to_string(),
            ..Default::default()
        })
    }

    pub fn subscriptions(&self) -> Vec<(Name, Locator)> {
        self.types
            .iter()
            .flat_map(|(t, ts)| {
                ts.subs
                    .keys()
                    .cloned()
                    .chain(ts.wildcard.then(|| Locator::plain(WILDCARD)))
                    .map(move |l| (t.clone(), l))
            })
            .collect()
    }

    /// Per-type state for the admin API and CSDS.
    pub fn view(&self, resources: bool) -> Vec<TypeView> {
        self.types
            .iter()
            .map(|(t, ts)| TypeView {
                type_url: t.to_string(),
                wildcard: ts.wildcard,
                subscribed: ts.subs.len(),
                held: ts.sent.len(),
                last_nonce: ts.last_nonce.map(|n| n.to_string()),
                last_ack: ts.acked_nonce.clone(),
                last_nack: ts.last_nack.clone(),
                resources: if resources {
                    ts.sent
                        .iter()
                        .map(|(l, (_, v))| (l.name.clone(), v.clone()))
                        .collect()
                } else {
                    Vec::new()
                },
                waiting: if resources {
                    ts.subs
                        .keys()
                        .filter(|l| !ts.sent.contains_key(*l))
                        .map(|l| l.name.clone())
                        .collect()
                } else {
                    Vec::new()
                },
                rejected: if resources {
                    ts.rejected
                        .iter()
                        .filter_map(|(l, h)| Some((l.name.clone(), h.as_ref()?.1.clone())))
                        .collect()
                } else {
                    Vec::new()
                },
            })
            .collect()
    }

    /// Every (type_url, name, version) the client was sent, for client status reporting.
    pub fn held(&self) -> impl Iterator<Item = (&str, &Locator, &str)> {
        self.types
            .iter()
            .flat_map(|(t, ts)| ts.sent.iter().map(move |(l, (_, v))| (&**t, l, v.as_str())))
    }
}

/// The full state of `type_url` for a wildcard-only subscriber with `params`, as
/// [`SotwStream::build`] would give it; `None` where each stream must build its own: the type is
/// not synced yet, or it holds `do_not_cache` content (served per subscription, D2).
fn wildcard_state(
    store: &Store,
    type_url: &str,
    wrap: bool,
    params: &Arc<Params>,
) -> Option<WildcardState> {
    let present = store.wildcard_content(type_url, params)?;
    let resources = present
        .iter()
        .map(|(_, r)| r.sotw_bytes(wrap, true).clone())
        .collect();
    let held: Vec<(Locator, Held)> = present
        .into_iter()
        .map(|(l, r)| (l, (r.key.clone(), r.version.clone())))
        .collect();
    let version_info = version_of(held.iter().map(|(l, h)| (l, h)));
    Some(WildcardState {
        held,
        resources,
        version_info,
    })
}

/// A digest of what the client holds: equal content, equal version, on any replica (D8). Never
/// empty, so a client never mistakes it for "no state" (B7).
fn version_of<'a>(held: impl IntoIterator<Item = (&'a Locator, &'a Held)>) -> String {
    let mut h = Sha256::new();
    for (l, (key, version)) in held {
        h.update(l.name.as_bytes());
        h.update([0]);
        for (k, v) in l.params.iter() {
            h.update(k.as_bytes());
            h.update([1]);
            h.update(v.as_bytes());
            h.update([1]);
        }
        // Written into the digest, not formatted into a String: this runs per client per response.
        let _ = write!(h, "{key}");
        h.update([0]);
        h.update(version.as_bytes());
        h.update([0]);
    }
    let digest = h.finalize();
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl StreamCore for SotwStream {
    type Request = DiscoveryRequest;

    fn for_node(node: &Node, default_params: Params) -> Self {
        SotwStream::for_node(node, default_params)
    }
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError> {
        SotwStream::on_request(self, req)
    }
    fn on_change(&mut self, changes: &ChangeSet) {
        SotwStream::on_change(self, changes)
    }
    fn mark_all_pending(&mut self, type_url: &str) {
        SotwStream::mark_all_pending(self, type_url)
    }
    fn next_frame(&mut self, store: &Store) -> Option<Outgoing> {
        SotwStream::next_frame(self, store)
    }
    fn has_work(&self) -> bool {
        SotwStream::has_work(self)
    }
    fn subscriptions(&self) -> Vec<(Name, Locator)> {
        SotwStream::subscriptions(self)
    }
    fn subscribed_at(&mut self, seq: u64) {
        SotwStream::subscribed_at(self, seq)
    }
    fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        SotwStream::take_refetch(self)
    }
    fn view(&self, resources: bool) -> Vec<TypeView> {
        SotwStream::view(self, resources)
    }
}
