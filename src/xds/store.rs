//! The resource store of one aggregation group: every resource variant the upstream sent, per type
//! and name, as encoded bytes keyed by its constraints (TP2), plus what the upstream said does not
//! exist and the per-resource errors it reported. Pure data; the adapter wraps it in a lock and
//! turns the returned change sets into notifications.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::constraints::{self, ConstraintKey, Params, Selection};
use super::frame::FrameCache;
use super::holdings::DeltaWildcard;
use super::names::{Hasher, SortedNameMap};
use super::resource::{canonical_name, CachedResource, Locator, Name, ResourceError};
use super::wildcard_state::WildcardStates;
use super::xdstp;
use crate::pb::discovery::{ResourceError as ResourceErrorProto, ResourceName};

/// What the store knows about one name for one subscriber.
#[derive(Debug, PartialEq)]
pub enum Lookup<'a> {
    Present(&'a Arc<CachedResource>),
    /// The upstream said authoritatively that the name does not exist.
    Absent,
    /// Nothing known yet, or no variant matches these parameters: wait for the upstream rather
    /// than tell a client it does not exist (D9, E8).
    Unknown,
}

#[derive(Debug, Default)]
struct NameEntry {
    variants: BTreeMap<ConstraintKey, Arc<CachedResource>>,
    absent: bool,
    /// A non-NOT_FOUND error the upstream reported for this name (TP3), until the resource arrives.
    error: Option<ResourceErrorProto>,
    /// When each TTL-bearing variant expires unless refreshed (D6).
    expires: HashMap<ConstraintKey, Instant>,
    /// The latest heartbeat (body-less `Resource`) per variant, forwarded as-is (A23).
    heartbeats: HashMap<ConstraintKey, Bytes>,
}

#[derive(Debug, Default)]
struct TypeStore {
    names: SortedNameMap<NameEntry>,
    /// The upstream has answered a wildcard subscription of this type at least once, so names it
    /// did not send are really not part of the wildcard set.
    wildcard_synced: bool,
    /// The wildcard set came from a snapshot, or is served after the upstream left a mid-stream
    /// `"*"` unanswered, and the upstream has not answered the wildcard since: good enough to
    /// answer a wildcard request, not to tell a client that a name it holds is gone (it may be
    /// newer than the snapshot, or not sent yet, D9).
    wildcard_restored: bool,
    /// VHDS aliases (A25): alias -> the name of the resource that lists it. Kept while that
    /// resource is removed, so a client subscribed by alias learns of the removal.
    aliases: HashMap<Name, Name>,
    /// The largest encoded resource of the type seen so far: a bound that lets response building
    /// skip per-name size checks while a response is far from its limit.
    largest: usize,
    /// An upstream error was ever stored for a name of this type (never cleared): until then,
    /// response building skips the per-name error lookup, which showed in join profiles.
    had_errors: bool,
}

impl TypeStore {
    /// Indexes the aliases a resource lists (A25); an unresolved-alias entry lists only itself.
    fn index_aliases(&mut self, r: &CachedResource) {
        if !r.unresolved_alias {
            for a in &r.aliases {
                self.aliases.insert(a.clone(), r.name.clone());
            }
        }
    }

    /// The entry `name` denotes: its own when it holds a variant, else the resource it is an
    /// alias of, else its own (absent, errors).
    fn resolve(&self, name: &str) -> Option<&NameEntry> {
        let own = self.names.get(name);
        if own.is_some_and(|e| !e.variants.is_empty()) {
            return own;
        }
        self.aliases
            .get(name)
            .and_then(|real| self.names.get(real))
            .or(own)
    }
}

/// Names whose content or existence changed in one upstream response.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ChangeSet {
    pub type_url: String,
    pub names: Vec<Name>,
    /// This response completed the first wildcard sync of the type: initial wildcard requests that
    /// were waiting for it can now be answered.
    pub wildcard_synced_now: bool,
    /// When the upstream response was received (for fan-out latency), if known.
    pub received_at: Option<std::time::Instant>,
    /// Names whose TTL the upstream refreshed without changing them (heartbeats, A23, D7).
    pub heartbeats: Vec<Name>,
}

impl ChangeSet {
    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && !self.wildcard_synced_now && self.heartbeats.is_empty()
    }
}

/// Why an upstream response was rejected as a whole (and NACKed); nothing of it was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("resource #{index}: {source}")]
    BadResource { index: usize, source: ResourceError },
    #[error("resource {name:?} has type {got:?}, response type_url is {want:?}")]
    TypeMismatch {
        name: String,
        got: String,
        want: String,
    },
    #[error("duplicate resource name {0:?} among added/updated resources")]
    DuplicateName(String),
    #[error("resource name {0:?} is both added and removed")]
    AddedAndRemoved(String),
    #[error("resource {name:?} has no body and version {got:?} does not match the held version")]
    HeartbeatVersionMismatch { name: String, got: String },
    #[error("resource {name:?} has invalid dynamic parameter constraints: {reason}")]
    BadConstraints { name: String, reason: String },
}

/// One type of a store as a snapshot keeps it ([`Store::export`], [`Store::import`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedType {
    pub type_url: String,
    /// The upstream had answered the wildcard: the held names are the whole wildcard set.
    pub wildcard_synced: bool,
    pub resources: Vec<ExportedResource>,
}

/// One cached variant and, for a TTL'd one, when it expires.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedResource {
    pub resource: CachedResource,
    pub expires: Option<Instant>,
}

/// One upstream Delta response, as the store needs it.
#[derive(Debug, Default)]
pub struct UpstreamUpdate {
    /// Owned bytes of each `Resource` (not slices of a receive buffer).
    pub resources: Vec<Bytes>,
    /// `removed_resources`, plus names reported NOT_FOUND in `resource_errors` (C14).
    pub removed: Vec<String>,
    /// `removed_resource_names`: variants removed by name and constraints (E11).
    pub removed_variants: Vec<ResourceName>,
    /// Other `resource_errors`, passed through to subscribers (TP3).
    pub errors: Vec<ResourceErrorProto>,
    /// When the response arrived: TTLs count from here. `None` disables TTL tracking.
    pub received_at: Option<Instant>,
    /// The response carries the server's whole state of the type (a reconciliation's wildcard
    /// answer on a stream opened without versions): cached names it does not carry are removed.
    /// Names with constrained variants are left alone (a wildcard answer need not list them).
    pub full_state: bool,
}

#[derive(Debug, Default)]
pub struct Store {
    /// Looked up by type URL for every name of every response built (URLs of ~60 bytes): hashed
    /// with foldhash (`names::Hasher`) rather than SipHash. The keys are the types the upstream sent.
    types: HashMap<String, TypeStore, Hasher>,
    /// The store is the source of truth (the demo control plane): names it lacks do not exist.
    complete: bool,
    /// Incremented by every applied response; stamped on resources as their `arrival`.
    seq: u64,
    /// Variants dropped because their TTL ran out, for metrics.
    pub ttl_expired: u64,
    /// Lookups whose parameters matched several variants equally well (TP2), for metrics;
    /// counted from `&self` lookups on the fan-out path, hence atomic.
    ambiguous_matches: AtomicU64,
    /// Responses built from this store, framed once and shared by the streams due them.
    frames: FrameCache,
    /// Full states for wildcard-only SotW subscribers, built once per change; every `&mut self`
    /// method that changes content clears them (`apply_delta` through `apply`).
    wildcard_states: WildcardStates,
    /// The same for Delta wildcard-only subscribers that hold nothing yet.
    delta_wildcards: WildcardStates<DeltaWildcard>,
}

static NO_PARAMS: std::sync::LazyLock<Params> = std::sync::LazyLock::new(Params::new);

impl Store {
    /// A store filled from an upstream: missing names are unknown until the upstream answers.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that is the source of truth, as in a control plane: every missing name is absent and
    /// every wildcard is synced.
    pub fn complete(resources: impl IntoIterator<Item = (String, CachedResource)>) -> Self {
        let mut store = Store {
            complete: true,
            ..Store::default()
        };
        for (type_url, r) in resources {
            let ts = store.types.entry(type_url).or_default();
            ts.index_aliases(&r);
            ts.largest = ts.largest.max(r.encoded.len());
            let entry = ts.names.or_default(&r.name);
            entry.variants.insert(r.key.clone(), Arc::new(r));
        }
        store
    }

    /// Whether this store is the source of truth rather than a cache: `do_not_cache` restricts
    /// caches only, so the source serves such content to anyone.
    pub fn is_source(&self) -> bool {
        self.complete
    }

    /// The shared response frames built from this store's content.
    pub fn frames(&self) -> &FrameCache {
        &self.frames
    }

    /// The wildcard SotW states built since the store last changed.
    pub fn wildcard_states(&self) -> &WildcardStates {
        &self.wildcard_states
    }

    /// The Delta wildcard contents built since the store last changed.
    pub fn delta_wildcards(&self) -> &WildcardStates<DeltaWildcard> {
        &self.delta_wildcards
    }

    /// The content changed: no shared state built before is current.
    fn forget_shared_states(&mut self) {
        self.wildcard_states.clear();
        self.delta_wildcards.clear();
    }

    /// The current sequence number: resources that arrive later have a larger `arrival`.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Lookup for a plain-name subscriber (no dynamic parameters).
    pub fn lookup(&self, type_url: &str, name: &str) -> Lookup<'_> {
        self.lookup_for(type_url, name, &NO_PARAMS)
    }

    /// The variant a subscriber with `params` gets (E7, E8).
    pub fn lookup_for(&self, type_url: &str, name: &str, params: &Params) -> Lookup<'_> {
        let entry = self.types.get(type_url).and_then(|t| t.resolve(name));
        let Some(entry) = entry else {
            return if self.complete {
                Lookup::Absent
            } else {
                Lookup::Unknown
            };
        };
        // Fast path: one variant, unconstrained, which every subscriber gets.
        if entry.variants.len() == 1 {
            if let Some((k, r)) = entry.variants.iter().next() {
                if k.is_unconstrained() {
                    return Lookup::Present(r);
                }
            }
        }
        let selection = constraints::select(
            entry
                .variants
                .iter()
                .map(|(k, r)| (k, r.constraints.as_ref(), r)),
            params,
        );
        if selection.is_ambiguous() {
            self.ambiguous_matches.fetch_add(1, Ordering::Relaxed);
        }
        match selection {
            Selection::One(r) | Selection::Ambiguous { chosen: r, .. } => Lookup::Present(r),
            Selection::None if entry.absent || self.complete => Lookup::Absent,
            Selection::None => Lookup::Unknown,
        }
    }

    /// Whether the variant `key` of `name` is held; `None` if nothing is known about the name.
    pub fn has_variant(&self, type_url: &str, name: &str, key: &ConstraintKey) -> Option<bool> {
        self.types
            .get(type_url)
            .and_then(|t| t.names.get(name))
            .map(|e| e.variants.contains_key(key))
    }

    /// The largest encoded resource of the type seen so far (an upper bound for any one of them).
    pub fn largest_bytes(&self, type_url: &str) -> usize {
        self.types.get(type_url).map_or(0, |t| t.largest)
    }

    /// Encoded bytes of every variant held for `name` (what keeping it costs).
    pub fn name_bytes(&self, type_url: &str, name: &str) -> usize {
        self.types
            .get(type_url)
            .and_then(|t| t.names.get(name))
            .map_or(0, |e| e.variants.values().map(|r| r.encoded.len()).sum())
    }

    /// The error the upstream reported for a name, if any and not yet cleared by the resource.
    pub fn error(&self, type_url: &str, name: &str) -> Option<&ResourceErrorProto> {
        self.types
            .get(type_url)
            .and_then(|t| t.names.get(name))
            .and_then(|e| e.error.as_ref())
    }

    /// False only if no name of the type can have an error (see [`Store::error`]).
    pub fn may_have_errors(&self, type_url: &str) -> bool {
        self.types.get(type_url).is_some_and(|t| t.had_errors)
    }

    pub fn wildcard_synced(&self, type_url: &str) -> bool {
        self.complete || self.types.get(type_url).is_some_and(|t| t.wildcard_synced)
    }

    /// Whether a name missing from the wildcard set is really gone: synced, and confirmed by the
    /// upstream rather than only restored from a snapshot.
    pub fn wildcard_authoritative(&self, type_url: &str) -> bool {
        self.complete
            || self
                .types
                .get(type_url)
                .is_some_and(|t| t.wildcard_synced && !t.wildcard_restored)
    }

    /// What a wildcard-only subscriber with `params` is given of `type_url`: each name's
    /// selected variant, in locator order. `None` while the type is not synced, or when it holds
    /// `do_not_cache` content, which a cache serves per subscription (D2), never shared.
    pub fn wildcard_content(
        &self,
        type_url: &str,
        params: &Arc<Params>,
    ) -> Option<Vec<(Locator, &Arc<CachedResource>)>> {
        if !self.wildcard_synced(type_url) {
            return None;
        }
        let mut present = Vec::new();
        // Names come in order and share `params`: the list is in locator order as built.
        for name in self.names(type_url) {
            if let Lookup::Present(r) = self.lookup_for(type_url, name, params) {
                if r.do_not_cache && !self.is_source() {
                    return None;
                }
                present.push((Locator::with_params(name.clone(), params.clone()), r));
            }
        }
        debug_assert!(present.is_sorted_by(|a, b| a.0 <= b.0));
        Some(present)
    }

    /// Every name with at least one variant, in order.
    pub fn names(&self, type_url: &str) -> impl Iterator<Item = &Name> {
        self.types
            .get(type_url)
            .into_iter()
            .flat_map(|t| t.names.iter())
            .filter(|(_, e)| !e.variants.is_empty())
            .map(|(n, _)| n)
    }

    /// The names held in glob collection `glob` (A28): same authority, type and context
    /// parameters, one more path segment. A range scan over the sorted names, so a collection
    /// costs its prefix's names, not the type's.
    pub fn collection_members<'a>(
        &'a self,
        type_url: &str,
        glob: &'a str,
    ) -> impl Iterator<Item = &'a Name> + 'a {
        self.collection_entries(type_url, glob)
            .filter(|(_, e)| !e.variants.is_empty())
            .map(|(n, _)| n)
    }

    /// Whether the upstream has answered glob `glob`: it sent a member (present or removed since)
    /// or named the collection itself in `removed_resources` (empty collection).
    pub fn collection_answered(&self, type_url: &str, glob: &str) -> bool {
        self.complete
            || self
                .types
                .get(type_url)
                .is_some_and(|t| t.names.contains_key(glob))
            || self.collection_entries(type_url, glob).next().is_some()
    }

    fn collection_entries<'a>(
        &'a self,
        type_url: &str,
        glob: &'a str,
    ) -> impl Iterator<Item = (&'a Name, &'a NameEntry)> + 'a {
        let prefix = xdstp::glob_prefix(glob);
        let names = self.types.get(type_url).map(|t| &t.names);
        names
            .zip(prefix)
            .into_iter()
            .flat_map(|(names, prefix)| {
                names
                    .iter_from(prefix.as_str())
                    .take_while(|(n, _)| n.starts_with(prefix.as_str()))
                    .collect::<Vec<_>>()
            })
            .filter(move |(n, _)| xdstp::collection_of(n).as_deref() == Some(glob))
    }

    /// Every variant held for a type, in name order.
    pub fn resources(&self, type_url: &str) -> impl Iterator<Item = &Arc<CachedResource>> {
        self.types
            .get(type_url)
            .into_iter()
            .flat_map(|t| t.names.iter().map(|(_, e)| e))
            .flat_map(|e| e.variants.values())
    }

    /// Whether the store holds a variant of `name`.
    pub fn holds_name(&self, type_url: &str, name: &str) -> bool {
        self.types
            .get(type_url)
            .and_then(|t| t.names.get(name))
            .is_some_and(|e| !e.variants.is_empty())
    }

    /// Lookups that matched several variants equally well (TP2 E7).
    pub fn ambiguous_matches(&self) -> u64 {
        self.ambiguous_matches.load(Ordering::Relaxed)
    }

    pub fn type_urls(&self) -> impl Iterator<Item = &str> {
        self.types.keys().map(String::as_str)
    }

    /// Versions to report in `initial_resource_versions` on a new upstream stream: every held
    /// resource still wanted, except content the relay may not keep (C4) and names with
    /// constrained variants, which a name-keyed map cannot identify (C17).
    pub fn initial_versions(
        &self,
        type_url: &str,
        wanted: impl Fn(&str) -> bool,
    ) -> BTreeMap<String, String> {
        self.types
            .get(type_url)
            .into_iter()
            .flat_map(|t| t.names.iter())
            .filter(|(n, _)| wanted(n))
            .filter_map(|(n, e)| match e.variants.iter().next() {
                Some((k, r))
                    if e.variants.len() == 1 && k.is_unconstrained() && !r.do_not_cache =>
                {
                    Some((n.to_string(), r.version.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Applies one upstream Delta response atomically: either everything or, on error, nothing.
    /// Variant replacements in one response are therefore seen together (E12).
    /// Cached names of `type_url` (unconstrained variants only) that a full-state response
    /// carrying `sent` does not list.
    fn absent_from(&self, type_url: &str, sent: &HashSet<(Name, ConstraintKey)>) -> Vec<String> {
        let sent: HashSet<&Name> = sent.iter().map(|(n, _)| n).collect();
        self.types
            .get(type_url)
            .into_iter()
            .flat_map(|ts| ts.names.iter())
            .filter(|(n, e)| {
                !e.variants.is_empty()
                    && e.variants.keys().all(ConstraintKey::is_unconstrained)
                    && !sent.contains(n)
            })
            .map(|(n, _)| n.to_string())
            .collect()
    }

    pub fn apply(
        &mut self,
        type_url: &str,
        mut update: UpstreamUpdate,
        wildcard_answered: bool,
    ) -> Result<ChangeSet, ApplyError> {
        self.forget_shared_states();
        // A29: removals name resources as the store keys them.
        for n in update.removed.iter_mut().filter(|n| xdstp::is_xdstp(n)) {
            *n = canonical_name(n).to_string();
        }
        let mut parsed = Vec::with_capacity(update.resources.len());
        let mut seen: HashSet<(Name, ConstraintKey)> =
            HashSet::with_capacity(update.resources.len());
        let held = self.types.get(type_url);
        for (index, bytes) in update.resources.into_iter().enumerate() {
            let r = CachedResource::decode(bytes)
                .map_err(|source| ApplyError::BadResource { index, source })?;
            if let Some(c) = &r.constraints {
                constraints::validate(c).map_err(|e| ApplyError::BadConstraints {
                    name: r.name.to_string(),
                    reason: e.to_string(),
                })?;
            }
            if !seen.insert((r.name.clone(), r.key.clone())) {
                return Err(ApplyError::DuplicateName(r.name.to_string()));
            }
            if r.is_heartbeat() {
                let held_version = held
                    .and_then(|t| t.names.get(&r.name))
                    .and_then(|e| e.variants.get(&r.key))
                    .map(|h| h.version.as_str());
                if held_version != Some(r.version.as_str()) {
                    return Err(ApplyError::HeartbeatVersionMismatch {
                        name: r.name.to_string(),
                        got: r.version,
                    });
                }
            } else if !r.unresolved_alias && r.body_type_url != type_url {
                return Err(ApplyError::TypeMismatch {
                    name: r.name.to_string(),
                    got: r.body_type_url,
                    want: type_url.to_string(),
                });
            }
            parsed.push(r);
        }
        let added_names: HashSet<&str> = seen.iter().map(|(n, _)| &**n).collect();
        if let Some(both) = update
            .removed
            .iter()
            .find(|n| added_names.contains(n.as_str()))
        {
            return Err(ApplyError::AddedAndRemoved(both.clone()));
        }
        for rn in &update.removed_variants {
            let k = constraints::key(rn.dynamic_parameter_constraints.as_ref());
            if seen.contains(&(Name::from(rn.name.as_str()), k)) {
                return Err(ApplyError::AddedAndRemoved(rn.name.clone()));
            }
        }

        // Validated: from here on the response is applied in full.
        if update.full_state {
            let absent = self.absent_from(type_url, &seen);
            update.removed.extend(absent);
        }
        self.seq += 1;
        let seq = self.seq;
        let ts = self.types.entry(type_url.to_string()).or_default();
        let mut changed: Vec<Name> = Vec::new();
        let mut heartbeats: Vec<Name> = Vec::new();
        for mut r in parsed {
            if !r.is_heartbeat() && !r.unresolved_alias {
                // A25: index the aliases; an alias now resolved drops the upstream's earlier
                // "unresolved" entry under that name; subscribers by alias are notified.
                let old: Vec<Name> = ts
                    .names
                    .get(&r.name)
                    .into_iter()
                    .flat_map(|e| e.variants.values())
                    .flat_map(|v| v.aliases.iter().cloned())
                    .collect();
                for a in old.iter().filter(|a| !r.aliases.contains(a)) {
                    ts.aliases.remove(a);
                    changed.push(a.clone());
                }
                for a in &r.aliases {
                    if ts.names.get(a).is_some_and(|e| {
                        !e.variants.is_empty() && e.variants.values().all(|v| v.unresolved_alias)
                    }) {
                        ts.names.remove(a);
                    }
                    ts.aliases.insert(a.clone(), r.name.clone());
                    changed.push(a.clone());
                }
            }
            let entry = ts.names.or_default(&r.name);
            match (r.ttl, update.received_at) {
                (Some(ttl), Some(at)) => {
                    entry.expires.insert(r.key.clone(), at + ttl);
                }
                _ => {
                    entry.expires.remove(&r.key);
                }
            }
            // A heartbeat only refreshes (or changes) the TTL; the held content stays (D7).
            if r.is_heartbeat() {
                if let Some(held) = entry.variants.get(&r.key) {
                    if held.ttl != r.ttl {
                        let refreshed = held.with_ttl_of(&r);
                        entry.variants.insert(r.key.clone(), Arc::new(refreshed));
                    }
                }
                entry.heartbeats.insert(r.key.clone(), r.encoded.clone());
                heartbeats.push(r.name.clone());
                continue;
            }
            entry.heartbeats.remove(&r.key);
            entry.absent = false;
            entry.error = None;
            let same = entry
                .variants
                .get(&r.key)
                .is_some_and(|h| h.encoded == r.encoded);
            // A do_not_cache resource is a fresh delivery every time it arrives (D2).
            if same && !r.do_not_cache {
                continue;
            }
            r.arrival = seq;
            changed.push(r.name.clone());
            ts.largest = ts.largest.max(r.encoded.len());
            entry.variants.insert(r.key.clone(), Arc::new(r));
        }
        for name in update.removed {
            let name = Name::from(name);
            let entry = ts.names.or_default(&name);
            let was_absent = entry.absent && entry.variants.is_empty();
            // Subscribers by alias learn of the removal too (the alias still resolves here).
            changed.extend(
                entry
                    .variants
                    .values()
                    .flat_map(|v| v.aliases.iter().cloned()),
            );
            entry.variants.clear();
            entry.absent = true;
            entry.error = None;
            if !was_absent {
                changed.push(name);
            }
        }
        for rn in update.removed_variants {
            let k = constraints::key(rn.dynamic_parameter_constraints.as_ref());
            if let Some(entry) = ts.names.get_mut(rn.name.as_str()) {
                if entry.variants.remove(&k).is_some() {
                    if entry.variants.is_empty() {
                        entry.absent = true;
                    }
                    changed.push(rn.name.as_str().into());
                }
            }
        }
        for err in update.errors {
            let Some(name) = err.resource_name.as_ref().map(|r| canonical_name(&r.name)) else {
                continue;
            };
            ts.names.or_default(&name).error = Some(err);
            ts.had_errors = true;
            changed.push(name);
        }
        changed.sort();
        changed.dedup();
        let mut changes = ChangeSet {
            type_url: type_url.to_string(),
            names: changed,
            heartbeats,
            ..ChangeSet::default()
        };
        if wildcard_answered && (!ts.wildcard_synced || ts.wildcard_restored) {
            ts.wildcard_synced = true;
            ts.wildcard_restored = false;
            changes.wildcard_synced_now = true;
        }
        Ok(changes)
    }

    /// [`Store::apply`] for a response with only resources and plain removals.
    pub fn apply_delta(
        &mut self,
        type_url: &str,
        resources: Vec<Bytes>,
        removed: Vec<String>,
        wildcard_answered: bool,
    ) -> Result<ChangeSet, ApplyError> {
        self.apply(
            type_url,
            UpstreamUpdate {
                resources,
                removed,
                ..UpstreamUpdate::default()
            },
            wildcard_answered,
        )
    }

    /// The latest heartbeat for a variant, to forward to clients that hold it (A23).
    pub fn heartbeat(&self, type_url: &str, name: &str, key: &ConstraintKey) -> Option<&Bytes> {
        self.types
            .get(type_url)
            .and_then(|t| t.names.get(name))
            .and_then(|e| e.heartbeats.get(key))
    }

    /// The earliest TTL expiry, so the adapter knows when to call [`Store::expire`].
    pub fn next_expiry(&self) -> Option<Instant> {
        self.types
            .values()
            .flat_map(|t| t.names.values())
            .flat_map(|e| e.expires.values())
            .min()
            .copied()
    }

    /// Drops variants whose TTL ran out without a refresh (D6): the upstream is gone long enough
    /// that the configuration must not outlive it. Their names count as removed, so clients that
    /// did not get the TTL (plain SotW) lose them too.
    pub fn expire(&mut self, now: Instant) -> Vec<ChangeSet> {
        self.forget_shared_states();
        let mut out = Vec::new();
        for (type_url, ts) in self.types.iter_mut() {
            let mut names = Vec::new();
            for (name, entry) in ts.names.iter_mut() {
                let expired: Vec<ConstraintKey> = entry
                    .expires
                    .iter()
                    .filter(|(_, at)| **at <= now)
                    .map(|(k, _)| k.clone())
                    .collect();
                if expired.is_empty() {
                    continue;
                }
                self.ttl_expired += expired.len() as u64;
                for k in &expired {
                    entry.expires.remove(k);
                    entry.heartbeats.remove(k);
                    entry.variants.remove(k);
                }
                if entry.variants.is_empty() {
                    entry.absent = true;
                }
                names.push(name.clone());
            }
            if !names.is_empty() {
                // The table walks in hash order; change sets list names in order.
                names.sort();
                out.push(ChangeSet {
                    type_url: type_url.clone(),
                    names,
                    ..ChangeSet::default()
                });
            }
        }
        out
    }

    /// What a snapshot keeps (warm restart): per type, whether the wildcard was synced and every
    /// variant that may be kept, with its TTL deadline. Never `do_not_cache` content (D2) nor
    /// anything already expired (D6); negative entries, errors and heartbeats are not kept either:
    /// the upstream restates them when it answers.
    pub fn export(&self, now: Instant) -> Vec<ExportedType> {
        let mut out: Vec<ExportedType> = self
            .types
            .iter()
            .map(|(type_url, ts)| ExportedType {
                type_url: type_url.clone(),
                wildcard_synced: ts.wildcard_synced,
                resources: ts
                    .names
                    .iter()
                    .map(|(_, e)| e)
                    .flat_map(|e| {
                        e.variants
                            .iter()
                            .map(move |(k, r)| (r, e.expires.get(k).copied()))
                    })
                    .filter(|(r, expires)| {
                        !r.do_not_cache && !r.is_heartbeat() && expires.is_none_or(|at| at > now)
                    })
                    .map(|(r, expires)| ExportedResource {
                        resource: CachedResource::clone(r),
                        expires,
                    })
                    .collect(),
            })
            .filter(|t| t.wildcard_synced || !t.resources.is_empty())
            .collect();
        out.sort_by(|a, b| a.type_url.cmp(&b.type_url));
        out
    }

    /// Fills an empty store from a snapshot, as if the upstream had sent it before the restart.
    /// Variants that may not be kept or whose TTL ran out by `now` are skipped. Returns how many
    /// variants were restored.
    pub fn import(&mut self, types: Vec<ExportedType>, now: Instant) -> usize {
        self.forget_shared_states();
        let mut restored = 0;
        for t in types {
            let ts = self.types.entry(t.type_url).or_default();
            if t.wildcard_synced && !ts.wildcard_synced {
                ts.wildcard_synced = true;
                ts.wildcard_restored = true;
            }
            for ExportedResource { resource, expires } in t.resources {
                if resource.do_not_cache
                    || resource.is_heartbeat()
                    || expires.is_some_and(|at| at <= now)
                {
                    continue;
                }
                ts.index_aliases(&resource);
                ts.largest = ts.largest.max(resource.encoded.len());
                let entry = ts.names.or_default(&resource.name);
                if let Some(at) = expires {
                    entry.expires.insert(resource.key.clone(), at);
                }
                entry
                    .variants
                    .insert(resource.key.clone(), Arc::new(resource));
                restored += 1;
            }
        }
        restored
    }

    /// The upstream left a `"*"` added mid-stream unanswered for [`super::interest::WILDCARD_WAIT`]
    /// (it need not answer): serve what the cache holds to wildcard subscribers, without the
    /// authority to remove names (A12). A later response of the type makes it authoritative.
    pub fn serve_unanswered_wildcard(&mut self, type_url: &str) -> Option<ChangeSet> {
        self.forget_shared_states();
        let ts = self.types.entry(type_url.to_string()).or_default();
        if ts.wildcard_synced {
            return None;
        }
        ts.wildcard_synced = true;
        ts.wildcard_restored = true;
        Some(ChangeSet {
            type_url: type_url.to_string(),
            wildcard_synced_now: true,
            ..ChangeSet::default()
        })
    }

    /// The upstream subscription for `name` lapsed: what is held may go stale, so drop it (D5).
    pub fn forget(&mut self, type_url: &str, name: &str) {
        self.forget_shared_states();
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.names.remove(name);
            if !ts.aliases.is_empty() {
                ts.aliases.retain(|_, real| &**real != name);
            }
        }
    }

    /// Forgets what is known of glob collection `glob`'s members (held, removed, errors), except
    /// the names `keep` says are still wanted by themselves: a lapsed collection must not be
    /// answered from stale knowledge when subscribed again (D5).
    pub fn forget_collection(&mut self, type_url: &str, glob: &str, keep: impl Fn(&str) -> bool) {
        self.forget_shared_states();
        let members: Vec<Name> = self
            .collection_entries(type_url, glob)
            .map(|(n, _)| n.clone())
            .filter(|n| !keep(n))
            .collect();
        for m in members {
            self.forget(type_url, &m);
        }
    }

    /// Whether what is held for `name` is only the upstream's unresolved-alias answer (A25): it
    /// is for the clients that asked for that alias, not part of a wildcard's set.
    pub fn is_unresolved_alias(&self, type_url: &str, name: &str) -> bool {
        self.types
            .get(type_url)
            .and_then(|t| t.names.get(name))
            .is_some_and(|e| {
                !e.variants.is_empty() && e.variants.values().all(|v| v.unresolved_alias)
            })
    }

    /// The name of the resource `alias` resolves to (A25), if it is a known alias.
    pub fn resolve_alias(&self, type_url: &str, alias: &str) -> Option<&Name> {
        self.types.get(type_url)?.aliases.get(alias)
    }

    /// The aliases of `name`: those its held variants list or, once removed, those that still
    /// resolve to it.
    pub fn aliases_of(&self, type_url: &str, name: &str) -> Vec<Name> {
        let Some(t) = self.types.get(type_url) else {
            return Vec::new();
        };
        match t.names.get(name) {
            Some(e) if !e.variants.is_empty() => e
                .variants
                .values()
                .flat_map(|v| v.aliases.iter().cloned())
                .collect(),
            Some(_) if !t.aliases.is_empty() => t
                .aliases
                .iter()
                .filter(|(_, real)| &***real == name)
                .map(|(a, _)| a.clone())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The upstream wildcard subscription lapsed: keep only names still wanted explicitly.
    pub fn forget_wildcard(&mut self, type_url: &str, still_wanted: impl Fn(&str) -> bool) {
        self.forget_shared_states();
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.names.retain(|n, _| still_wanted(n));
            ts.wildcard_synced = false;
            ts.wildcard_restored = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::dynamic_parameter_constraints::single_constraint::ConstraintType;
    use crate::pb::discovery::dynamic_parameter_constraints::{SingleConstraint, Type};
    use crate::pb::discovery::{DynamicParameterConstraints, Resource};
    use prost::Message;
    use std::time::Duration;

    const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

    pub(crate) fn res(name: &str, version: &str, body: &[u8]) -> Bytes {
        Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: T.into(),
                value: body.to_vec(),
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    fn env_is(v: &str) -> DynamicParameterConstraints {
        DynamicParameterConstraints {
            r#type: Some(Type::Constraint(SingleConstraint {
                key: "env".into(),
                constraint_type: Some(ConstraintType::Value(v.into())),
            })),
        }
    }

    fn variant(name: &str, version: &str, c: DynamicParameterConstraints) -> Bytes {
        Resource {
            resource_name: Some(ResourceName {
                name: name.into(),
                dynamic_parameter_constraints: Some(c),
            }),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: T.into(),
                value: version.as_bytes().to_vec(),
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    fn params(env: &str) -> Params {
        Params::from([("env".to_string(), env.to_string())])
    }

    #[test]
    fn apply_add_update_remove() {
        let mut s = Store::new();
        assert_eq!(s.lookup(T, "a"), Lookup::Unknown);
        let c = s
            .apply_delta(
                T,
                vec![res("a", "1", b"x"), res("b", "1", b"y")],
                vec![],
                true,
            )
            .unwrap();
        assert_eq!(c.names.len(), 2);
        assert!(c.wildcard_synced_now);
        // Identical content is not a change.
        let c = s
            .apply_delta(T, vec![res("a", "1", b"x")], vec![], true)
            .unwrap();
        assert!(c.is_empty());
        let c = s.apply_delta(T, vec![], vec!["b".into()], true).unwrap();
        assert_eq!(c.names, vec![Name::from("b")]);
        assert_eq!(s.lookup(T, "b"), Lookup::Absent);
        assert!(matches!(s.lookup(T, "a"), Lookup::Present(r) if r.version == "1"));
    }

    #[test]
    fn invalid_response_changes_nothing() {
        let mut s = Store::new();
        s.apply_delta(T, vec![res("a", "1", b"x")], vec![], false)
            .unwrap();
        let dup = s.apply_delta(
            T,
            vec![res("a", "2", b"x"), res("a", "3", b"y")],
            vec![],
            false,
        );
        assert_eq!(dup, Err(ApplyError::DuplicateName("a".into())));
        let both = s.apply_delta(T, vec![res("a", "2", b"z")], vec!["a".into()], false);
        assert_eq!(both, Err(ApplyError::AddedAndRemoved("a".into())));
        let wrong = s.apply_delta("other", vec![res("c", "1", b"x")], vec![], false);
        assert!(matches!(wrong, Err(ApplyError::TypeMismatch { .. })));
        assert!(matches!(s.lookup(T, "a"), Lookup::Present(r) if r.version == "1"));
        assert_eq!(
            s.type_urls().count(),
            1,
            "a rejected response creates nothing"
        );
    }

    #[test]
    fn initial_versions_only_for_wanted_plain_resources() {
        let mut s = Store::new();
        s.apply_delta(
            T,
            vec![
                res("a", "1", b"x"),
                res("b", "2", b"y"),
                variant("v", "3", env_is("prod")),
            ],
            vec![],
            false,
        )
        .unwrap();
        let v = s.initial_versions(T, |n| n != "a");
        assert_eq!(v, BTreeMap::from([("b".to_string(), "2".to_string())]));
    }

    fn with_ttl(name: &str, version: &str, ttl_secs: i64, do_not_cache: bool) -> Bytes {
        Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: T.into(),
                value: b"x".to_vec(),
            }),
            ttl: (ttl_secs > 0).then_some(prost_types::Duration {
                seconds: ttl_secs,
                nanos: 0,
            }),
            cache_control: do_not_cache
                .then_some(crate::pb::discovery::resource::CacheControl { do_not_cache: true }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    #[test]
    fn export_import_round_trip_skips_uncacheable_and_expired() {
        let t0 = Instant::now();
        let mut s = Store::new();
        s.apply(
            T,
            UpstreamUpdate {
                resources: vec![
                    res("a", "1", b"x"),
                    with_ttl("short", "1", 5, false),
                    with_ttl("long", "1", 60, false),
                    with_ttl("secret", "1", 0, true),
                    variant("v", "p1", env_is("prod")),
                ],
                received_at: Some(t0),
                ..Default::default()
            },
            true,
        )
        .unwrap();
        let exported = s.export(t0 + Duration::from_secs(1));
        assert_eq!(exported.len(), 1);
        assert!(exported[0].wildcard_synced);
        let mut names: Vec<&str> = exported[0]
            .resources
            .iter()
            .map(|r| &*r.resource.name)
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["a", "long", "short", "v"],
            "do_not_cache is never exported"
        );
        // Restored 10 s later: the 5 s TTL ran out meanwhile, the 60 s one keeps its deadline.
        let mut r = Store::new();
        let restored = r.import(exported, t0 + Duration::from_secs(10));
        assert_eq!(restored, 3);
        assert!(r.wildcard_synced(T));
        assert!(
            !r.wildcard_authoritative(T),
            "a restored wildcard set does not prove absence until the upstream answers"
        );
        assert_eq!(r.lookup(T, "short"), Lookup::Unknown);
        assert_eq!(r.lookup(T, "secret"), Lookup::Unknown);
        assert!(matches!(r.lookup(T, "a"), Lookup::Present(x) if x.version == "1"));
        assert!(
            matches!(r.lookup_for(T, "v", &params("prod")), Lookup::Present(x) if x.version == "p1")
        );
        assert_eq!(r.next_expiry(), Some(t0 + Duration::from_secs(60)));
        // What was restored is reported upstream as held (C4), constrained variants excepted (C17).
        let irv = r.initial_versions(T, |_| true);
        assert_eq!(irv.len(), 2);
        assert_eq!(irv.get("long").map(String::as_str), Some("1"));
        // The upstream's wildcard answer (here: nothing changed) confirms the set.
        let c = r.apply_delta(T, vec![], vec![], true).unwrap();
        assert!(c.wildcard_synced_now && r.wildcard_authoritative(T));
    }

    #[test]
    fn variants_are_selected_by_params_and_miss_is_unknown() {
        let mut s = Store::new();
        s.apply_delta(
            T,
            vec![
                variant("foo", "p1", env_is("prod")),
                variant("foo", "t1", env_is("test")),
            ],
            vec![],
            false,
        )
        .unwrap();
        assert!(
            matches!(s.lookup_for(T, "foo", &params("prod")), Lookup::Present(r) if r.version == "p1")
        );
        assert!(
            matches!(s.lookup_for(T, "foo", &params("test")), Lookup::Present(r) if r.version == "t1")
        );
        // E8: no matching variant is a miss, not "does not exist".
        assert_eq!(s.lookup_for(T, "foo", &params("qa")), Lookup::Unknown);
        assert_eq!(s.names(T).count(), 1);
    }

    #[test]
    fn variant_replacement_is_atomic() {
        let mut s = Store::new();
        s.apply_delta(T, vec![variant("foo", "p1", env_is("prod"))], vec![], false)
            .unwrap();
        let c = s
            .apply(
                T,
                UpstreamUpdate {
                    resources: vec![variant(
                        "foo",
                        "any",
                        DynamicParameterConstraints::default(),
                    )],
                    removed_variants: vec![ResourceName {
                        name: "foo".into(),
                        dynamic_parameter_constraints: Some(env_is("prod")),
                    }],
                    ..Default::default()
                },
                false,
            )
            .unwrap();
        assert_eq!(c.names, vec![Name::from("foo")]);
        assert!(
            matches!(s.lookup_for(T, "foo", &params("prod")), Lookup::Present(r) if r.version == "any")
        );
    }

    /// E17, upstream side: the upstream removing a variant the relay never held (or already
    /// removed) changes nothing and tells no one.
    #[test]
    fn removal_of_a_variant_never_held_changes_nothing() {
        let mut s = Store::new();
        s.apply_delta(T, vec![variant("foo", "p1", env_is("prod"))], vec![], false)
            .unwrap();
        let seq = s.seq();
        let remove = |env: &str| UpstreamUpdate {
            removed_variants: vec![ResourceName {
                name: "foo".into(),
                dynamic_parameter_constraints: Some(env_is(env)),
            }],
            ..Default::default()
        };
        let c = s.apply(T, remove("dev"), false).unwrap();
        assert!(c.names.is_empty(), "{c:?}");
        assert!(matches!(
            s.lookup_for(T, "foo", &params("prod")),
            Lookup::Present(_)
        ));
        let c = s.apply(T, remove("prod"), false).unwrap();
        assert_eq!(c.names, vec![Name::from("foo")]);
        let c = s.apply(T, remove("prod"), false).unwrap();
        assert!(
            c.names.is_empty(),
            "a second removal of the same variant: {c:?}"
        );
        assert!(s.seq() > seq);
    }

    fn aliased(name: &str, alias: &str) -> Bytes {
        Resource {
            name: name.into(),
            version: "1".into(),
            aliases: vec![alias.into()],
            resource: Some(prost_types::Any {
                type_url: T.into(),
                value: b"vh".to_vec(),
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    #[test]
    fn aliases_resolve_after_a_warm_restart_and_in_a_source_store() {
        let now = Instant::now();
        let mut s = Store::new();
        s.apply_delta(T, vec![aliased("rc1/vh", "rc1/foo.com")], vec![], false)
            .unwrap();
        let mut restored = Store::new();
        restored.import(s.export(now), now);
        assert!(
            matches!(restored.lookup(T, "rc1/foo.com"), Lookup::Present(r) if &*r.name == "rc1/vh")
        );
        let source = Store::complete([(
            T.to_string(),
            CachedResource::decode(aliased("rc1/vh", "rc1/foo.com")).unwrap(),
        )]);
        assert!(
            matches!(source.lookup(T, "rc1/foo.com"), Lookup::Present(r) if &*r.name == "rc1/vh")
        );
        assert_eq!(source.lookup(T, "rc1/bar.com"), Lookup::Absent);
    }

    #[test]
    fn upstream_names_are_keyed_and_emitted_canonically() {
        let mut s = Store::new();
        let c = s
            .apply_delta(
                T,
                vec![res("xdstp://a/T/x?b=2&a=1", "1", b"x")],
                vec![],
                false,
            )
            .unwrap();
        assert_eq!(c.names, vec![Name::from("xdstp://a/T/x?a=1&b=2")]);
        let Lookup::Present(r) = s.lookup(T, "xdstp://a/T/x?a=1&b=2") else {
            panic!("held under the canonical name");
        };
        assert_eq!(
            Resource::decode(r.encoded.clone()).unwrap().name,
            "xdstp://a/T/x?a=1&b=2"
        );
    }
}
