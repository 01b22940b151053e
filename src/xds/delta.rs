//! The per-stream Delta xDS state machine (conformance sections A and E), shared by the relay's
//! downstream streams and the demo control plane. It is fed requests and change notifications and
//! produces responses from a [`Store`]; it never blocks, reads a clock or touches a socket.
//!
//! Per type it tracks what the client subscribed to (as [`Locator`]s: a name and the dynamic
//! parameters it came with), which variant and version of each the client holds (as far as the
//! relay knows), and which names need another look. Responses are built only when the adapter is
//! ready to write, from the store's current content, so a slow client holds at most its pending
//! name set, never a queue of outdated responses (D10).
//!
//! Subscriptions by plain name (`resource_names_subscribe`, and wildcards) use the stream's default
//! parameters (empty, or derived from node metadata) and receive resources with `name` set (E10);
//! subscriptions by `resource_locators_subscribe` receive `resource_name` with the variant's
//! constraints, and variant removals as `removed_resource_names` (E9, E11).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use smallvec::SmallVec;

use super::constraints::{self, ConstraintKey, Params};
use super::contract::{AckStatus, ProtocolError, RequestEffects, StreamCore, TypeView};
use super::delta_record::{first_of, ParamSets, TypeState};
use super::frame::{Content, Outgoing};
pub use super::holdings::Held;
use super::holdings::{DeltaWildcard, Holdings};
use super::interest::WILDCARD;
use super::names::{self, NameMap};
use super::packed;
use super::per_type::PerType;
use super::resource::{canonical_name, CachedResource, Locator, Name};
use super::store::{ChangeSet, Lookup, Store};
use super::wildcard_state::WhenFull;
use super::xdstp;
use crate::pb::discovery::{
    DeltaDiscoveryRequest, DynamicParameterConstraints, ResourceError, ResourceName,
};
use crate::pb::wire;

/// Per-type ACK/NACK state, for logs and introspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeStatus {
    pub type_url: String,
    pub wildcard: bool,
    pub explicit: usize,
    pub last_nonce: Option<String>,
    pub last_ack: Option<String>,
    pub last_nack: Option<(String, String)>,
}

#[derive(Debug, Default, Clone)]
pub struct DeltaStream {
    types: PerType<Box<TypeState>>,
    nonce_seq: u64,
    /// Parameters for plain-name and wildcard subscriptions (TP2 migration from node metadata).
    default_params: Arc<Params>,
    /// Subscriptions whose `do_not_cache` content must be fetched again for this client (C3).
    refetch: Vec<(String, Locator)>,
    /// The client's receive limit; 0 means [`DEFAULT_MAX_RESPONSE_BYTES`].
    pub(super) max_response_bytes: usize,
    /// A per-type service's stream (no RDS beside its VHDS, A27).
    single_type: bool,
}

/// B14: clusters before endpoints before listeners before routes, so a client never sees a
/// reference before its target. Other types follow in name order.
pub(crate) fn type_rank(type_url: &str) -> u8 {
    match type_url.rsplit('/').next().unwrap_or("") {
        "envoy.config.cluster.v3.Cluster" => 0,
        "envoy.config.endpoint.v3.ClusterLoadAssignment" => 1,
        "envoy.config.listener.v3.Listener" => 2,
        "envoy.config.route.v3.RouteConfiguration" => RDS_RANK,
        "envoy.config.route.v3.ScopedRouteConfiguration" => 4,
        "envoy.config.route.v3.VirtualHost" => VHDS_RANK,
        _ => 6,
    }
}

const VHDS_RANK: u8 = 5;
const RDS_RANK: u8 = 3;

/// The largest response a stream sends unless told otherwise: gRPC's default receive limit. A
/// Delta state larger than this goes out in several responses, each applied and ACKed on its own.
/// Responses are framed once into shared bytes (see [`super::frame`]), so no stream keeps an encode
/// buffer sized to its largest response and nothing else bounds a response's size.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 << 20;

/// `google.rpc.Code.INVALID_ARGUMENT`, for names the relay cannot subscribe to.
const INVALID_ARGUMENT: i32 = 3;

/// Room left in a response for everything but resources (type, nonce, removals, errors).
const RESPONSE_OVERHEAD_BYTES: usize = 64 << 10;

/// One response under construction: deduplicated so no name (or variant) appears twice and none
/// is both added and removed (A20).
#[derive(Default)]
struct Builder {
    resources: Vec<Bytes>,
    /// Encoded size of `resources`, to keep responses within the stream's size limit.
    bytes: usize,
    /// Wire identity (see [`wire_id`]) -> the resource sent under it. Only cached resources (names
    /// the upstream sent) are keys, hashed with foldhash (`NameMap`): one insert per resource sent.
    added: NameMap<(Name, ConstraintKey, bool), Arc<CachedResource>>,
    removed: BTreeSet<String>,
    removed_variants: Vec<ResourceName>,
    errors: Vec<ResourceError>,
}

impl Builder {
    /// Removes the variant `name` with constraints `c`, once per response (A20): two locators of a
    /// name whose parameter sets selected the same variant held it under one wire identity.
    fn remove_variant(&mut self, name: &str, c: &DynamicParameterConstraints) {
        let key = constraints::key(Some(c));
        let dup = self.removed_variants.iter().any(|rn| {
            rn.name == name && constraints::key(rn.dynamic_parameter_constraints.as_ref()) == key
        });
        if !dup {
            self.removed_variants.push(ResourceName {
                name: name.to_string(),
                dynamic_parameter_constraints: Some(c.clone()),
            });
        }
    }

    /// Adds `r` unless something with the same wire identity is already in. Returns whether the
    /// client will hold `r` under that identity (added now, or the same resource added before);
    /// `false` when two subscriptions of one name select different resources sent alike.
    fn add(&mut self, r: &Arc<CachedResource>, by_name: bool) -> bool {
        match self.added.entry(wire_id(r, by_name)) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let prev = e.get();
                Arc::ptr_eq(prev, r) || (prev.version == r.version && prev.key == r.key)
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(r.clone());
                let b = r.delta_bytes(by_name).clone();
                self.bytes += b.len();
                self.resources.push(b);
                true
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.resources.is_empty()
            && self.removed.is_empty()
            && self.removed_variants.is_empty()
            && self.errors.is_empty()
    }
}

/// Every subscription of one name on a stream, as a build evaluates them: (locator, by name,
/// covered by a subscription rather than only held), in locator order, each locator once. Nearly
/// always one or two, kept inline: this is built per name per response.
#[derive(Default)]
struct NameSubs(SmallVec<[(Locator, bool, bool); 2]>);

impl NameSubs {
    /// Adds `l` unless it is in already (the first entry for a locator wins).
    fn or_insert(&mut self, l: Locator, by_name: bool, covered: bool) {
        if let Err(i) = self.0.binary_search_by(|(k, _, _)| k.cmp(&l)) {
            self.0.insert(i, (l, by_name, covered));
        }
    }

    fn contains(&self, l: &Locator) -> bool {
        self.0.binary_search_by(|(k, _, _)| k.cmp(l)).is_ok()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// How a client identifies a resource in a response: its plain name (by-name subscribers, and
/// unconstrained variants, which carry `name`), or its name and constraints (A20).
fn wire_id(r: &CachedResource, by_name: bool) -> (Name, ConstraintKey, bool) {
    let plain = by_name || r.constraints.is_none();
    let key = if plain {
        ConstraintKey::default()
    } else {
        r.key.clone()
    };
    (r.name.clone(), key, plain)
}

/// Whether every name in `names` has a record in `known` (both in name order: one merge walk).
fn all_held(names: &BTreeSet<Name>, known: &Holdings) -> bool {
    let mut held = known.keys().map(|l| &l.name).peekable();
    names.iter().all(|n| {
        while held.next_if(|h| *h < n).is_some() {}
        held.next_if(|h| *h == n).is_some()
    })
}

/// The whole content of `type_url` for a wildcard-only subscriber with `params` that holds
/// nothing, as [`DeltaStream::build`] would give it name by name; `None` where each stream must
/// build its own: the type is not synced yet, or it holds `do_not_cache` content (refetched per
/// subscription, D2).
fn delta_wildcard(store: &Store, type_url: &str, params: &Arc<Params>) -> Option<DeltaWildcard> {
    let content = store.wildcard_content(type_url, params)?;
    // An alias not yet resolved is not the wildcard's (the name-by-name build skips it too).
    let resolved = |(l, _): &(Locator, _)| !store.is_unresolved_alias(type_url, &l.name);
    Some(DeltaWildcard::new(content.into_iter().filter(resolved)))
}

/// The type's shared wildcard content for `params`, from the store's memo (built by the first
/// stream to ask since the store changed).
fn shared_content(
    store: &Store,
    type_url: &str,
    params: &Arc<Params>,
    when_full: WhenFull,
) -> Option<Arc<DeltaWildcard>> {
    // `false`: the memo's SotW wrapping flag, which Delta has no use for.
    store
        .delta_wildcards()
        .get_or_build(type_url, false, params, when_full, || {
            delta_wildcard(store, type_url, params)
        })
}

impl DeltaStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// A stream whose plain-name and wildcard subscriptions carry `params` (TP2 migration path).
    pub fn with_default_params(params: Params) -> Self {
        DeltaStream {
            default_params: Arc::new(params),
            ..Self::default()
        }
    }

    /// Responses stay within `bytes` (the client's receive limit), a single resource larger than
    /// that excepted.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    pub fn on_request(
        &mut self,
        req: &DeltaDiscoveryRequest,
    ) -> Result<RequestEffects, ProtocolError> {
        if req.type_url.is_empty() {
            return Err(ProtocolError::MissingTypeUrl);
        }
        let defaults = &self.default_params;
        // (locator, by name)
        let subscribe = Locator::from_request(
            &req.resource_names_subscribe,
            &req.resource_locators_subscribe,
            defaults,
        );
        let unsubscribe: Vec<Locator> = Locator::from_request(
            &req.resource_names_unsubscribe,
            &req.resource_locators_unsubscribe,
            defaults,
        )
        .into_iter()
        .map(|(l, _)| l)
        .collect();

        let mut effects = RequestEffects::new(&req.type_url);
        let first = !self.types.contains_key(&req.type_url);
        let single_type = self.single_type;
        let ts = self.types.or_default(&req.type_url);
        let (explicit_before, mut known_before) = (ts.explicit.len(), ts.known.len());
        // A29: a malformed xdstp name is not subscribed; the client gets a resource error naming
        // it (INVALID_ARGUMENT), and every other name of the request is served as usual.
        let subscribe: Vec<(Locator, bool)> = subscribe
            .into_iter()
            .filter(|(l, _)| match xdstp::canonical(&l.name) {
                Ok(_) => true,
                Err(e) => {
                    ts.invalid.insert(l.name.clone(), e.to_string());
                    false
                }
            })
            .collect();

        if first {
            // A1: an empty first subscribe list is a legacy wildcard. A27: for VHDS it is
            // Envoy's namespace watch, so the wildcard is scoped: the stream receives only the
            // virtual hosts of the route configurations it subscribes to over RDS (named
            // `<route config>/...`), never every virtual host in the cache.
            if subscribe.is_empty() {
                ts.scoped = type_rank(&req.type_url) == VHDS_RANK && !single_type;
                Self::start_wildcard(ts, &mut effects);
            }
            // A11/A12/A14: the versions the client holds; they are not subscriptions. Nothing of
            // the type is recorded yet, so the records are built whole from the sorted list
            // (packed nodes, no search per name). The map arrives in name order; the sort is
            // for xdstp names, whose canonical form may order differently.
            let mut reported: Vec<(Locator, Held)> = req
                .initial_resource_versions
                .iter()
                .map(|(name, version)| {
                    let l = Locator::with_params(canonical_name(name), defaults.clone());
                    // Interned: a reconnecting fleet reports the same versions ten thousand times.
                    (l, Held::Reported(names::intern(version)))
                })
                .collect();
            reported.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            ts.pending = reported.iter().map(|(l, _)| l.name.clone()).collect();
            ts.known = reported.into_iter().collect();
            known_before = ts.known.len();
        }
        for (l, by_name) in subscribe {
            if &*l.name == WILDCARD {
                Self::start_wildcard(ts, &mut effects);
                continue;
            }
            let params = ts.explicit.entry(l.name.clone()).or_default();
            match params.insert(l.params.clone(), by_name) {
                None => {
                    effects.acquire.push(l.clone());
                    ts.unstamped.push(l.clone());
                    // A locator with the default parameters names what the wildcard or the
                    // initial versions held by plain name: the client tells the two forms apart
                    // (E9), so that is not this subscription's.
                    if !by_name && l.params == *defaults {
                        ts.forget(&l);
                    }
                }
                // E9/E10: now asked for in the other form (plain name <-> locator), which the
                // client tells apart: what it holds in the old form is not this subscription's,
                // and a NACK of an earlier response must not make it so again.
                Some(was) if was != by_name => {
                    ts.forget(&l);
                }
                Some(_) => {}
            }
            ts.pending.insert(l.name.clone());
            // A7: resend even if the client has it — except on the first request of a stream,
            // where initial_resource_versions says what it has (A11).
            let reported = Locator::with_params(l.name.clone(), defaults.clone());
            if !(first && ts.known.contains_key(&reported)) {
                ts.forced.insert(l);
            }
        }
        for l in unsubscribe {
            if &*l.name == WILDCARD {
                if ts.wildcard {
                    ts.wildcard = false;
                    ts.owe_response = false;
                    effects.release.push(Locator::plain(WILDCARD));
                    // A4: the client drops wildcard-only resources itself.
                    let explicit = &ts.explicit;
                    let keep = |k: &Locator| {
                        explicit
                            .get(&k.name)
                            .is_some_and(|m| m.contains_key(&k.params))
                    };
                    ts.known.retain(keep);
                    ts.rejected.retain(|k, _| keep(k));
                    ts.unacked.retain(keep);
                }
                continue;
            }
            // A25: a subscription by alias may be unsubscribed by the resource's name, and the
            // other way round.
            let l = Self::as_subscribed(ts, l);
            // A8: a name never subscribed is ignored.
            let Some(params) = ts.explicit.get_mut(&l.name) else {
                continue;
            };
            if params.remove(&l.params).is_none() {
                continue;
            }
            if params.is_empty() {
                ts.explicit.remove(&l.name);
            }
            effects.release.push(l.clone());
            if ts.wildcard && l.params == *defaults {
                // A6: the client now holds it ambiguously; answer with the resource or a removal.
                ts.pending.insert(l.name.clone());
                ts.forced.insert(l);
            } else {
                // A9: no response needed; stop tracking so a later subscribe starts fresh.
                ts.forget(&l);
                ts.forced.remove(&l);
                // Another subscription of the name may have waited for this one (B20).
                if ts.wildcard || ts.explicit.contains_key(&l.name) {
                    ts.pending.insert(l.name.clone());
                }
                if ts.empty_globs.remove(&l.name) || xdstp::is_glob(&l.name) {
                    // A28: so are the members the glob alone covered.
                    let explicit = &ts.explicit;
                    let keep = |k: &Locator| {
                        xdstp::collection_of(&k.name).as_deref() != Some(&*l.name)
                            || explicit
                                .get(&k.name)
                                .is_some_and(|m| m.contains_key(&k.params))
                    };
                    ts.known.retain(keep);
                    ts.rejected.retain(|k, _| keep(k));
                    ts.unacked.retain(keep);
                }
            }
        }

        packed::repack_after_bulk(&mut ts.explicit, explicit_before);
        ts.known.repack_after_bulk(known_before);

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
                ts.last_ack = Some(nonce.clone());
                AckStatus::Ack { nonce }
            };
            // Stale answers count too: a client answers every response, in order.
            ts.settle(answered, req.error_detail.is_some());
        }
        Ok(effects)
    }

    /// The subscription an unsubscribe of `l` means: `l` itself, or the subscription by another
    /// name (alias or real name) under which the client holds the resource `l` names.
    fn as_subscribed(ts: &TypeState, l: Locator) -> Locator {
        if ts.explicit.contains_key(&l.name) {
            return l;
        }
        ts.known
            .iter()
            .find(|(k, held)| {
                k.params == l.params
                    && ts.explicit_contains(k)
                    && matches!(held, Held::Sent(r) if r.name == l.name || r.aliases.contains(&l.name))
            })
            .map_or(l, |(k, _)| k.clone())
    }

    fn start_wildcard(ts: &mut TypeState, effects: &mut RequestEffects) {
        if !ts.wildcard {
            ts.wildcard = true;
            effects.acquire.push(Locator::plain(WILDCARD));
        }
        ts.pending_all = true;
        ts.owe_response = true;
    }

    /// The adapter applied this stream's latest subscriptions to the group when the store was at
    /// `seq`: `do_not_cache` content that arrived before then is not for these subscriptions.
    pub fn subscribed_at(&mut self, seq: u64) {
        for ts in self.types.values_mut() {
            for l in std::mem::take(&mut ts.unstamped) {
                if let Some(params) = ts.explicit.get_mut(&l.name) {
                    params.stamp(&l.params, seq);
                }
            }
        }
    }

    /// Subscriptions that need the upstream to send their `do_not_cache` content again.
    pub fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        std::mem::take(&mut self.refetch)
    }

    /// Records that names of a type changed in the store. Types this stream never asked for are
    /// ignored (A22).
    pub fn on_change(&mut self, changes: &ChangeSet) {
        if type_rank(&changes.type_url) == RDS_RANK {
            self.resend_virtual_hosts(changes);
        }
        if let Some(ts) = self.types.get_mut(&changes.type_url) {
            for name in &changes.names {
                if ts.concerns(name) {
                    ts.pending.insert(name.clone());
                }
            }
            for name in &changes.heartbeats {
                if ts.concerns(name) {
                    ts.heartbeats.insert(name.clone());
                }
            }
            if changes.wildcard_synced_now && ts.wildcard {
                ts.pending_all = true;
            }
        }
    }

    /// A26: a changed route configuration clears the client's virtual host table, so every
    /// virtual host it subscribed to for that configuration (named `<route config>/...`) is sent
    /// again, changed or not. The RDS response goes out first (B14).
    fn resend_virtual_hosts(&mut self, changes: &ChangeSet) {
        let Some(rds) = self.types.get(&changes.type_url) else {
            return;
        };
        let configs: Vec<String> = changes
            .names
            .iter()
            .filter(|n| rds.wildcard || rds.explicit.contains_key(*n))
            .map(|n| format!("{n}/"))
            .collect();
        if configs.is_empty() {
            return;
        }
        let Some(vhds) = self
            .types
            .iter_mut()
            .find(|(t, _)| type_rank(t) == VHDS_RANK)
            .map(|(_, ts)| ts)
        else {
            return;
        };
        let under = |n: &str| configs.iter().any(|c| n.starts_with(c.as_str()));
        for (name, params) in &vhds.explicit {
            if under(name) {
                vhds.pending.insert(name.clone());
                for p in params.keys() {
                    vhds.forced
                        .insert(Locator::with_params(name.clone(), p.clone()));
                }
            }
        }
        // What the scoped wildcard delivered, and whatever the configuration newly brings in
        // scope (A27).
        if vhds.scoped {
            for l in vhds.known.keys().filter(|l| under(&l.name)) {
                vhds.forced.insert(l.clone());
            }
            vhds.pending_all = true;
        }
    }

    /// Marks every name of a type for evaluation: what it subscribes to and what it holds. Used when
    /// too many changes piled up to track them one by one.
    pub fn mark_all_pending(&mut self, type_url: &str) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.pending_all = true;
        }
    }

    /// Whether a build might produce a response.
    pub fn has_work(&self) -> bool {
        self.types.values().any(|t| t.has_work())
    }

    /// Builds the next response, trying types in B14 order, with a nonce of this stream's own
    /// sequence. `None` means nothing to send now.
    pub fn next_response(&mut self, store: &Store) -> Option<wire::DeltaDiscoveryResponse> {
        let mut resp = self.next_content(store)?;
        self.nonce_seq += 1;
        resp.nonce = self.nonce_seq.to_string();
        self.sent(&resp.type_url, self.nonce_seq);
        Some(resp)
    }

    /// The next response as a shared frame from the store's frame cache (see [`super::frame`]).
    pub fn next_frame(&mut self, store: &Store) -> Option<Outgoing> {
        let content = Content::Delta(self.next_content(store)?);
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

    /// The next response's content (no nonce yet), trying types in B14 order.
    fn next_content(&mut self, store: &Store) -> Option<wire::DeltaDiscoveryResponse> {
        let mut order: Vec<Name> = self
            .types
            .iter()
            .filter(|(_, t)| t.has_work())
            .map(|(k, _)| k.clone())
            .collect();
        order.sort_by_key(|t| (type_rank(t), t.clone()));
        order
            .into_iter()
            .find_map(|type_url| self.build(&type_url, store))
    }

    fn build(&mut self, type_url: &str, store: &Store) -> Option<wire::DeltaDiscoveryResponse> {
        let synced = store.wildcard_synced(type_url);
        let authoritative = store.wildcard_authoritative(type_url);
        let defaults = &self.default_params;
        let limit = match self.max_response_bytes {
            0 => DEFAULT_MAX_RESPONSE_BYTES,
            n => n,
        };
        let budget = limit - RESPONSE_OVERHEAD_BYTES.min(limit / 4);
        let largest = store.largest_bytes(type_url);
        let scope = self.vhds_scope(type_url);
        let in_scope = |name: &str| {
            scope
                .as_ref()
                .is_none_or(|s| s.iter().any(|p| name.starts_with(p.as_str())))
        };
        let ts = self.types.get_mut(type_url)?;
        // Changes staged by an earlier build belong to its response (or to none).
        ts.unacked.seal(ts.last_nonce);
        if !ts.owe_response && ts.only_the_wildcard() && ts.known.shared().is_some() {
            if let Some(new) = shared_content(store, type_url, defaults, WhenFull::GiveUp) {
                // Taken, not cloned: every stream of a fan-out holds this one `Arc`, and a count
                // taken and dropped per stream moves its cache line between the cores.
                if let Some(old) = ts.known.take_shared() {
                    match Self::follow_shared(ts, type_url, store, &old, new, authoritative, budget)
                    {
                        Some(response) => return response,
                        None => ts.known = Holdings::Shared(old),
                    }
                }
            }
        }
        let known_before = ts.known.len();
        let mut candidates = std::mem::take(&mut ts.pending);
        if ts.pending_all {
            ts.pending_all = false;
            // The common join and resume of a wildcard-only subscriber, against the type's
            // whole content built once per store change (see `wildcard_state`): one that holds
            // nothing gets all of it (unless over the size limit, which the loop below splits);
            // one that reported exactly that content is due nothing but what A2 owes.
            if ts.only_the_wildcard() {
                if let Some(shared) = shared_content(store, type_url, defaults, WhenFull::StartOver)
                {
                    if ts.known.is_empty() && candidates.is_empty() && shared.bytes <= budget {
                        return Self::respond_with_shared(ts, type_url, &shared, synced);
                    }
                    if ts.known.holds_exactly(&shared) && all_held(&candidates, &ts.known) {
                        // A resumed client that reported exactly this: its record is the shared one.
                        ts.known = Holdings::Shared(shared);
                        return Self::answer_owed(ts, type_url, synced);
                    }
                }
            }
            if ts.wildcard {
                candidates.extend(store.names(type_url).cloned());
            }
            candidates.extend(ts.explicit.keys().cloned());
            candidates.extend(ts.known.keys().map(|l| l.name.clone()));
        }

        let errors_possible = store.may_have_errors(type_url);
        let mut out = Builder::default();
        let mut candidates: VecDeque<Name> = candidates.into_iter().collect();
        // Glob collections whose emptiness may have changed (A28).
        let mut globs: BTreeSet<Name> = BTreeSet::new();
        while let Some(name) = candidates.pop_front() {
            // The exact size is looked up only near the limit.
            if !out.resources.is_empty()
                && out.bytes + largest > budget
                && out.bytes + store.name_bytes(type_url, &name) > budget
            {
                // The rest goes in the next response, built when the client can take it.
                ts.pending.insert(name);
                ts.pending.extend(candidates);
                break;
            }
            if &*name == WILDCARD {
                continue;
            }
            if Self::expand_glob(ts, type_url, store, &name, &mut candidates) {
                globs.insert(name);
                continue;
            }
            // Every subscription of this name on the stream: explicit ones, the wildcard's, and
            // any the client still holds (to remove them if needed).
            let mut subs = NameSubs::default();
            if let Some(params) = ts.explicit.get(&name) {
                for (p, by_name) in params {
                    subs.or_insert(
                        Locator::with_params(name.clone(), p.clone()),
                        *by_name,
                        true,
                    );
                }
            }
            // A28: a member of a subscribed glob collection is covered by it.
            if let Some(glob) = xdstp::collection_of(&name).map(Name::from) {
                if let Some(params) = ts.explicit.get(&glob) {
                    for (p, by_name) in params {
                        subs.or_insert(
                            Locator::with_params(name.clone(), p.clone()),
                            *by_name,
                            true,
                        );
                    }
                    globs.insert(glob);
                }
            }
            let wild = Locator::with_params(name.clone(), defaults.clone());
            let wild_explicit = subs.contains(&wild);
            if ts.wildcard && in_scope(&name) && !store.is_unresolved_alias(type_url, &name) {
                subs.or_insert(wild, true, true);
            }
            let first = first_of(&name);
            let held = ts.known.from(&first).map(|(l, _)| l);
            let forced = ts.forced.range(&first..);
            for l in held
                .take_while(|l| l.name == name)
                .chain(forced.take_while(|l| l.name == name))
            {
                subs.or_insert(l.clone(), l.params == *defaults, false);
            }
            // B20: the client holds one resource per wire identity. When two subscriptions of
            // this name select different resources sent alike, the first in order holds it in
            // every response alike (else they would displace each other at the client); the
            // other gives up what it held and waits for the conflict to end.
            let contested = subs.len() > 1;
            let mut claimed: HashMap<(Name, ConstraintKey, bool), Arc<CachedResource>> =
                HashMap::new();
            for (l, by_name, covered) in subs.0 {
                if contested && covered {
                    if let Lookup::Present(r) = store.lookup_for(type_url, &l.name, &l.params) {
                        match claimed.entry(wire_id(r, by_name)) {
                            std::collections::hash_map::Entry::Occupied(e) => {
                                let holder = e.get();
                                if !(Arc::ptr_eq(holder, r)
                                    || (holder.version == r.version && holder.key == r.key))
                                {
                                    ts.unhold(&l);
                                    ts.forced.remove(&l);
                                    continue;
                                }
                            }
                            std::collections::hash_map::Entry::Vacant(e) => {
                                e.insert(r.clone());
                            }
                        }
                    }
                }
                Self::evaluate(
                    ts,
                    type_url,
                    store,
                    authoritative,
                    &l,
                    by_name,
                    covered,
                    wild_explicit,
                    &mut out,
                    &mut self.refetch,
                );
            }
            // TP3: report an upstream error for a subscribed name once, until the resource arrives.
            if !errors_possible {
                continue;
            }
            if let Some(err) = store.error(type_url, &name) {
                if ts.explicit.contains_key(&name) && ts.errors_sent.insert(name.clone()) {
                    out.errors.push(err.clone());
                }
            } else {
                ts.errors_sent.remove(&name);
            }
        }

        // A28: a subscribed collection the upstream answered that has no member is removed, once
        // per time it becomes empty.
        for glob in globs {
            if !ts.explicit.contains_key(&glob) {
                continue;
            }
            if store.collection_members(type_url, &glob).next().is_some() {
                ts.empty_globs.remove(&glob);
            } else if store.collection_answered(type_url, &glob)
                && ts.empty_globs.insert(glob.clone())
            {
                out.removed.insert(glob.to_string());
            }
        }

        // A23: a heartbeat goes only to clients holding exactly that version; anyone else either
        // gets the resource in full (above) or is behind after a NACK and must not be refreshed.
        for name in std::mem::take(&mut ts.heartbeats) {
            let first = first_of(&name);
            for (l, held) in ts.known.from(&first).take_while(|(l, _)| l.name == name) {
                let Lookup::Present(r) = store.lookup_for(type_url, &l.name, &l.params) else {
                    continue;
                };
                let by_name = l.params == *defaults;
                if !held.is(r) || (by_name && r.constraints.is_some()) {
                    continue;
                }
                let id = wire_id(r, by_name);
                if out.added.contains_key(&id) {
                    continue;
                }
                if let Some(hb) = store.heartbeat(type_url, &l.name, &r.key) {
                    out.added.insert(id, r.clone());
                    out.resources.push(hb.clone());
                }
            }
        }

        for (name, message) in std::mem::take(&mut ts.invalid) {
            out.errors.push(ResourceError {
                resource_name: Some(ResourceName {
                    name: name.to_string(),
                    dynamic_parameter_constraints: None,
                }),
                error_detail: Some(crate::pb::rpc::Status {
                    code: INVALID_ARGUMENT,
                    message,
                    details: vec![],
                }),
            });
        }

        // A20: nothing is added and removed under one wire identity in one response. When one
        // subscription of a name lost its match while another of the same name gained one sent
        // alike (B20), the add replaces what the client held: the removal is dropped.
        // Removals are rare, so the common response skips this.
        if !out.added.is_empty() {
            let added = &out.added;
            out.removed.retain(|n| {
                !added.contains_key(&(Name::from(n.as_str()), ConstraintKey::default(), true))
            });
            out.removed_variants.retain(|rn| {
                let key = constraints::key(rn.dynamic_parameter_constraints.as_ref());
                !added.contains_key(&(Name::from(rn.name.as_str()), key, false))
            });
        }

        ts.known.repack_after_bulk(known_before);

        // Without a wildcard (A27's first VHDS request) there is nothing to wait for.
        let answer_owed = ts.owe_response && synced;
        if out.is_empty() && !answer_owed {
            return None;
        }
        ts.owe_response = false;
        Some(wire::DeltaDiscoveryResponse {
            type_url: type_url.to_string(),
            resources: out.resources,
            removed_resources: out.removed.into_iter().collect(),
            removed_resource_names: out.removed_variants,
            resource_errors: out.errors,
            ..Default::default()
        })
    }

    /// What [`DeltaStream::build`]'s loop would give a wildcard-only subscriber holding nothing:
    /// every resource of `shared`, each now held (undone on NACK like any other).
    fn respond_with_shared(
        ts: &mut TypeState,
        type_url: &str,
        shared: &Arc<DeltaWildcard>,
        synced: bool,
    ) -> Option<wire::DeltaDiscoveryResponse> {
        for (l, _) in &shared.held {
            ts.unacked.record(l, None, ts.last_nonce);
        }
        ts.known = Holdings::Shared(shared.clone());
        if shared.held.is_empty() {
            return Self::answer_owed(ts, type_url, synced);
        }
        ts.owe_response = false;
        Some(wire::DeltaDiscoveryResponse {
            type_url: type_url.to_string(),
            resources: shared.resources(),
            ..Default::default()
        })
    }

    /// A wildcard-only subscriber holding the shared content `old` moves to `new` (the type's
    /// content now): it is sent what differs, in the order and form the name-by-name build would
    /// send it, and its record becomes `new`, shared again. `None` where that build must decide
    /// instead: over the size limit, or a removal that only it can judge (an upstream not yet
    /// authoritative for the type, an alias now unresolved).
    fn follow_shared(
        ts: &mut TypeState,
        type_url: &str,
        store: &Store,
        old: &Arc<DeltaWildcard>,
        new: Arc<DeltaWildcard>,
        authoritative: bool,
        budget: usize,
    ) -> Option<Option<wire::DeltaDiscoveryResponse>> {
        let mut resources = Vec::new();
        let mut bytes = 0;
        let mut removed = Vec::new();
        // What changed, with what the client held before (for a NACK to put back).
        let mut undo: Vec<(&Locator, Option<&Held>)> = Vec::new();
        if !Arc::ptr_eq(old, &new) {
            let (mut was, mut now) = (old.held.iter().peekable(), new.held.iter().peekable());
            loop {
                let gone = match (was.peek(), now.peek()) {
                    (None, None) => break,
                    (Some((lw, _)), Some((ln, _))) => lw < ln,
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                };
                if gone {
                    let Some((l, held)) = was.next() else { break };
                    if !authoritative || store.is_unresolved_alias(type_url, &l.name) {
                        return None;
                    }
                    // A25: what was sent for an alias is removed under the name it was sent with.
                    removed.push(match held {
                        Held::Sent(r) => r.name.to_string(),
                        Held::Reported(_) => l.name.to_string(),
                    });
                    undo.push((l, Some(held)));
                    continue;
                }
                let Some((l, now_held)) = now.next() else {
                    break;
                };
                let before = was.next_if(|(lw, _)| lw == l).map(|(_, h)| h);
                let same = match (before, now_held) {
                    (Some(b), Held::Sent(r)) => b.is(r),
                    _ => false,
                };
                if let (false, Some(resource)) = (same, DeltaWildcard::wire_bytes(now_held)) {
                    bytes += resource.len();
                    resources.push(resource.clone());
                    undo.push((l, before));
                }
            }
            if bytes > budget {
                return None;
            }
        }
        for (l, before) in undo {
            ts.unacked.record(l, before, ts.last_nonce);
        }
        ts.pending.clear();
        ts.pending_all = false;
        ts.known = Holdings::Shared(new);
        if resources.is_empty() && removed.is_empty() {
            return Some(None);
        }
        // As a set, like the name-by-name build's: an alias and its name remove one resource.
        removed.sort_unstable();
        removed.dedup();
        Some(Some(wire::DeltaDiscoveryResponse {
            type_url: type_url.to_string(),
            resources,
            removed_resources: removed,
            ..Default::default()
        }))
    }

    /// Nothing to send: the empty response an initial wildcard request is owed (A2), if any.
    fn answer_owed(
        ts: &mut TypeState,
        type_url: &str,
        synced: bool,
    ) -> Option<wire::DeltaDiscoveryResponse> {
        if !(ts.owe_response && synced) {
            return None;
        }
        ts.owe_response = false;
        Some(wire::DeltaDiscoveryResponse {
            type_url: type_url.to_string(),
            ..Default::default()
        })
    }

    /// For a scoped VHDS wildcard (A27), the name prefixes it covers: `<rc>/` for every route
    /// configuration the stream subscribes to (or holds, under an RDS wildcard). `None` when the
    /// type's wildcard, if any, is not scoped.
    fn vhds_scope(&self, type_url: &str) -> Option<Vec<String>> {
        if !self.types.get(type_url).is_some_and(|t| t.scoped) {
            return None;
        }
        let rds = self.types.iter().find(|(t, _)| type_rank(t) == RDS_RANK);
        Some(
            rds.into_iter()
                .flat_map(|(_, ts)| ts.explicit.keys().chain(ts.known.keys().map(|l| &l.name)))
                .map(|n| format!("{n}/"))
                .collect(),
        )
    }

    /// If `name` is a glob collection this stream subscribes to, queues every member the store
    /// holds for evaluation (a forced glob forces its members, A7) and returns true.
    fn expand_glob(
        ts: &mut TypeState,
        type_url: &str,
        store: &Store,
        name: &Name,
        queue: &mut VecDeque<Name>,
    ) -> bool {
        if !xdstp::is_xdstp(name) || !xdstp::is_glob(name) {
            return false;
        }
        let Some(params) = ts.explicit.get(name) else {
            return false;
        };
        let params: Vec<Arc<Params>> = params.keys().cloned().collect();
        for p in params {
            let glob = Locator::with_params(name.clone(), p.clone());
            let forced = ts.forced.remove(&glob);
            for m in store.collection_members(type_url, name) {
                if forced {
                    ts.forced.insert(Locator::with_params(m.clone(), p.clone()));
                }
                queue.push_back(m.clone());
            }
        }
        true
    }

    /// The glob subscription that covers `l` on this stream, if `l` is not subscribed itself.
    fn via_glob(ts: &TypeState, l: &Locator) -> Option<Locator> {
        if ts.explicit_contains(l) {
            return None;
        }
        let glob = Locator::with_params(xdstp::collection_of(&l.name)?, l.params.clone());
        ts.explicit_contains(&glob).then_some(glob)
    }

    /// Decides what one subscription gets now.
    #[allow(clippy::too_many_arguments)]
    fn evaluate(
        ts: &mut TypeState,
        type_url: &str,
        store: &Store,
        authoritative: bool,
        l: &Locator,
        by_name: bool,
        covered: bool,
        wild_explicit: bool,
        out: &mut Builder,
        refetch: &mut Vec<(String, Locator)>,
    ) {
        let forced = ts.forced.contains(l);
        let remove = |ts: &mut TypeState, out: &mut Builder| {
            let held = ts.unhold(l);
            match held.as_ref().and_then(Held::constraints) {
                Some(c) if !by_name => {
                    out.remove_variant(&l.name, c);
                    if let Some(h) = &held {
                        ts.unhold_variant_elsewhere(l, h.key());
                    }
                }
                _ => {
                    // A25: what was sent for an alias is removed under the name it was sent with.
                    let name = match &held {
                        Some(Held::Sent(r)) if r.name != l.name => &r.name,
                        _ => &l.name,
                    };
                    out.removed.insert(name.to_string());
                }
            }
            ts.forced.remove(l);
        };
        match store.lookup_for(type_url, &l.name, &l.params) {
            Lookup::Present(r) => {
                if !covered {
                    ts.forced.remove(l);
                    return;
                }
                let held = ts.known.get(l);
                if r.do_not_cache && !store.is_source() && !held.is_some_and(|h| h.is(r)) {
                    // D2: only for subscriptions that were waiting when it arrived.
                    // A glob's members were subscribed (and are refetched) by the glob.
                    let via = Self::via_glob(ts, l);
                    let sub = via.as_ref().unwrap_or(l);
                    let since = ts
                        .explicit
                        .get(&sub.name)
                        .map_or(u64::MAX, |p| p.since(&sub.params));
                    if r.arrival <= since {
                        refetch.push((type_url.to_string(), sub.clone()));
                        return;
                    }
                }
                let rejected = ts.was_rejected(l, Some(r));
                if forced || !(held.is_some_and(|h| h.is(r)) || rejected) {
                    // E14: a locator subscriber switching variants is told the old one is gone.
                    if let Some((key, Some(c))) = held.map(|h| (h.key().clone(), h.constraints())) {
                        if !by_name && key != r.key {
                            out.remove_variant(&l.name, c);
                            ts.unhold_variant_elsewhere(l, &key);
                        }
                    }
                    if out.add(r, by_name) {
                        ts.hold(l, Held::Sent(r.clone()));
                    } else {
                        // Another subscription of the name took its wire identity: whatever the
                        // client held under it is replaced, so send this one again later.
                        ts.unhold(l);
                    }
                }
                ts.forced.remove(l);
            }
            Lookup::Absent => {
                // A10/A12: tell the client, once, that it does not exist.
                if covered && (forced || (ts.known.contains_key(l) && !ts.was_rejected(l, None))) {
                    remove(ts, out);
                } else {
                    ts.forced.remove(l);
                }
            }
            Lookup::Unknown => {
                // Only a wildcard the upstream answered (not one just restored from a snapshot)
                // makes a missing name authoritative (A12, D9);
                // otherwise wait for the upstream.
                let via_wildcard =
                    ts.wildcard && by_name && !wild_explicit && !ts.explicit_contains(l);
                // E11/E14: the variant the client holds was removed upstream and none other
                // matches yet; the subscription itself stays and waits (E8).
                let held_variant_gone = ts.known.get(l).is_some_and(|h| {
                    h.constraints().is_some()
                        && store.has_variant(type_url, &l.name, h.key()) == Some(false)
                });
                // A31: a removal the client rejected is not repeated until something changes.
                let removal_rejected = !forced && ts.was_rejected(l, None);
                if !removal_rejected
                    && (held_variant_gone
                        || (via_wildcard && authoritative && (forced || ts.known.contains_key(l))))
                {
                    remove(ts, out);
                } else if !covered && !ts.wildcard {
                    ts.forced.remove(l);
                }
            }
        }
    }

    /// Every subscription this stream holds (explicit locators and `"*"`), to release when it ends.
    pub fn subscriptions(&self) -> Vec<(Name, Locator)> {
        // Sized up front (a name nearly always has one parameter set, so the names are the
        // count): a closing stream of a storm releases ~60 of them, and growing the list one
        // reallocation at a time was a sixth of a closing stream's CPU.
        let names: usize = self.types.iter().map(|(_, ts)| ts.explicit.len() + 1).sum();
        let mut out = Vec::with_capacity(names);
        for (t, ts) in self.types.iter() {
            for (name, params) in &ts.explicit {
                for p in params.keys() {
                    out.push((t.clone(), Locator::with_params(name.clone(), p.clone())));
                }
            }
            if ts.wildcard {
                out.push((t.clone(), Locator::plain(WILDCARD)));
            }
        }
        out
    }

    /// Whether this stream is wildcard-subscribed to a type.
    pub fn is_wildcard(&self, type_url: &str) -> bool {
        self.types.get(type_url).is_some_and(|t| t.wildcard)
    }

    /// The version of `name` the client holds (by plain name), as the relay believes.
    pub fn known_version(&self, type_url: &str, name: &str) -> Option<&str> {
        let l = Locator::with_params(name, self.default_params.clone());
        self.types
            .get(type_url)
            .and_then(|t| t.known.get(&l))
            .map(Held::version)
    }

    /// Every (type_url, locator, held) the client holds, for client status reporting.
    pub fn held(&self) -> impl Iterator<Item = (&str, &Locator, &Held)> {
        self.types
            .iter()
            .flat_map(|(t, ts)| ts.known.iter().map(move |(l, h)| (&**t, l, h)))
    }

    /// Per-type state for the admin API and CSDS; `resources` adds what the client holds and what
    /// it still waits for.
    pub fn view(&self, resources: bool) -> Vec<TypeView> {
        self.types
            .iter()
            .map(|(t, ts)| TypeView {
                type_url: t.to_string(),
                wildcard: ts.wildcard,
                subscribed: ts.explicit.values().map(ParamSets::len).sum(),
                held: ts.known.len(),
                last_nonce: ts.last_nonce.map(|n| n.to_string()),
                last_ack: ts.last_ack.clone(),
                last_nack: ts.last_nack.clone(),
                resources: if resources {
                    let mut v: Vec<(Name, String)> = ts
                        .known
                        .iter()
                        .map(|(l, h)| (l.name.clone(), h.version().to_string()))
                        .collect();
                    v.sort();
                    v
                } else {
                    Vec::new()
                },
                waiting: if resources {
                    ts.explicit
                        .keys()
                        .filter(|n| !ts.known.keys().any(|l| &l.name == *n))
                        .cloned()
                        .collect()
                } else {
                    Vec::new()
                },
                rejected: if resources {
                    let mut v: Vec<(Name, String)> = ts
                        .rejected
                        .iter()
                        .filter_map(|(l, h)| Some((l.name.clone(), h.as_ref()?.version().into())))
                        .collect();
                    v.sort();
                    v
                } else {
                    Vec::new()
                },
            })
            .collect()
    }

    pub fn status(&self) -> Vec<TypeStatus> {
        self.types
            .iter()
            .map(|(t, ts)| TypeStatus {
                type_url: t.to_string(),
                wildcard: ts.wildcard,
                explicit: ts.explicit.values().map(ParamSets::len).sum(),
                last_nonce: ts.last_nonce.map(|n| n.to_string()),
                last_ack: ts.last_ack.clone(),
                last_nack: ts.last_nack.clone(),
            })
            .collect()
    }
}

impl StreamCore for DeltaStream {
    type Request = DeltaDiscoveryRequest;

    fn for_node(_: &crate::pb::core::Node, default_params: Params) -> Self {
        Self::with_default_params(default_params)
    }
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError> {
        DeltaStream::on_request(self, req)
    }
    fn on_change(&mut self, changes: &ChangeSet) {
        DeltaStream::on_change(self, changes)
    }
    fn mark_all_pending(&mut self, type_url: &str) {
        DeltaStream::mark_all_pending(self, type_url)
    }
    fn next_frame(&mut self, store: &Store) -> Option<Outgoing> {
        DeltaStream::next_frame(self, store)
    }
    fn has_work(&self) -> bool {
        DeltaStream::has_work(self)
    }
    fn limit_response_bytes(&mut self, bytes: usize) {
        self.max_response_bytes = bytes;
    }
    fn serve_single_type(&mut self) {
        self.single_type = true;
    }
    fn subscriptions(&self) -> Vec<(Name, Locator)> {
        DeltaStream::subscriptions(self)
    }
    fn subscribed_at(&mut self, seq: u64) {
        DeltaStream::subscribed_at(self, seq)
    }
    fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        DeltaStream::take_refetch(self)
    }
    fn view(&self, resources: bool) -> Vec<TypeView> {
        DeltaStream::view(self, resources)
    }
}

#[cfg(test)]
mod tests;
