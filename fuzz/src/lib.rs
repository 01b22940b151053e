//! Shared pieces of the fuzz targets: a small pre-populated store, resource encoders, a byte reader
//! for the op-sequence input formats, and a model of what a Delta/SotW client holds. The targets
//! drive only adsrelay's I/O-free core (`adsrelay::xds`), as the stream adapters do.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adsrelay::downstream::limits::{self, RequestShape, StreamLimits};
use adsrelay::pb::discovery::dynamic_parameter_constraints::single_constraint::ConstraintType;
use adsrelay::pb::discovery::dynamic_parameter_constraints::{SingleConstraint, Type};
use adsrelay::pb::discovery::{
    resource::CacheControl, DynamicParameterConstraints, Resource, ResourceError, ResourceName,
};
use adsrelay::pb::rpc;
use adsrelay::xds::constraints::{self, ConstraintKey, Params};
use adsrelay::xds::{
    CachedResource, ProtocolError, RequestEffects, Store, StreamCore, UpstreamUpdate,
};
use bytes::Bytes;
use prost::Message;

pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const CUSTOM: &str = "type.googleapis.com/fuzz.v1.Thing";
/// Types the fuzzed streams ask for: two full-state (SotW), two partial; index = byte % 4.
pub const TYPES: [&str; 4] = [CLUSTER, LISTENER, ENDPOINT, CUSTOM];
/// Resource names a shaped request or an upstream change picks from; `"*"` is the wildcard.
pub const NAMES: [&str; 8] = ["a", "b", "c", "d", "e", "f", "*", ""];
/// Dynamic-parameter sets of shaped locators (TP2).
pub fn param_set(i: u8) -> Params {
    let kv: &[(&str, &str)] = match i % 4 {
        0 => &[],
        1 => &[("env", "prod")],
        2 => &[("env", "dev")],
        _ => &[("env", "prod"), ("zone", "z1")],
    };
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `env == value`.
pub fn env_is(value: &str) -> DynamicParameterConstraints {
    DynamicParameterConstraints {
        r#type: Some(Type::Constraint(SingleConstraint {
            key: "env".into(),
            constraint_type: Some(ConstraintType::Value(value.into())),
        })),
    }
}

/// An encoded `Resource`. The body's value is `name \0 version`, so a SotW response (bare `Any`)
/// can be traced back to the resource it came from.
pub fn resource(
    type_url: &str,
    name: &str,
    version: &str,
    constraints: Option<DynamicParameterConstraints>,
    ttl_secs: Option<i64>,
    do_not_cache: bool,
) -> Bytes {
    let (plain, resource_name) = match constraints {
        Some(c) => (
            String::new(),
            Some(ResourceName {
                name: name.into(),
                dynamic_parameter_constraints: Some(c),
            }),
        ),
        None => (name.to_string(), None),
    };
    let r = Resource {
        name: plain,
        resource_name,
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: format!("{name}\0{version}").into_bytes(),
        }),
        ttl: ttl_secs.map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
        cache_control: do_not_cache.then_some(CacheControl { do_not_cache }),
        ..Default::default()
    };
    Bytes::from(r.encode_to_vec())
}

/// A body-less `Resource` (TTL heartbeat) for a held version.
pub fn heartbeat(name: &str, version: &str, ttl_secs: i64) -> Bytes {
    let r = Resource {
        name: name.into(),
        version: version.into(),
        ttl: Some(prost_types::Duration {
            seconds: ttl_secs,
            nanos: 0,
        }),
        ..Default::default()
    };
    Bytes::from(r.encode_to_vec())
}

pub fn resource_error(name: &str, code: i32) -> ResourceError {
    ResourceError {
        resource_name: Some(ResourceName {
            name: name.into(),
            dynamic_parameter_constraints: None,
        }),
        error_detail: Some(rpc::Status {
            code,
            message: format!("upstream error for {name}"),
            details: vec![],
        }),
    }
}

/// The fixed instant TTLs count from, so runs are reproducible.
pub fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// The resources every target starts from, per type: `a`, `b` plain; `c` in two variants
/// (env=prod, env=dev); `d` absent; `e` with an upstream error; `f` unknown.
fn initial_updates(type_url: &str) -> UpstreamUpdate {
    UpstreamUpdate {
        resources: vec![
            resource(type_url, "a", "1", None, None, false),
            resource(type_url, "b", "1", None, Some(30), false),
            resource(type_url, "c", "1", Some(env_is("prod")), None, false),
            resource(type_url, "c", "1", Some(env_is("dev")), None, false),
        ],
        removed: vec!["d".into()],
        errors: vec![resource_error("e", 14)],
        received_at: Some(epoch()),
        ..Default::default()
    }
}

/// A cache store as the relay holds it: filled by upstream responses; Cluster and the custom type
/// have had their wildcard answered.
pub fn cache_store() -> Store {
    let mut store = Store::new();
    for t in TYPES {
        let wildcard_answered = t == CLUSTER || t == CUSTOM;
        store
            .apply(t, initial_updates(t), wildcard_answered)
            .expect("fixture resources are valid");
    }
    store
}

/// A source-of-truth store (the demo control plane's): missing names are absent.
pub fn complete_store() -> Store {
    let mut all = Vec::new();
    for t in TYPES {
        for b in initial_updates(t).resources {
            let r = CachedResource::decode(b).expect("fixture resources are valid");
            all.push((t.to_string(), r));
        }
    }
    Store::complete(all)
}

/// One upstream change to the store, chosen by a byte: (type, name, action).
pub fn upstream_change(b: u8, version: u64) -> (&'static str, UpstreamUpdate) {
    let type_url = TYPES[(b & 3) as usize];
    let name = NAMES[((b >> 2) & 7) as usize % 6];
    let v = version.to_string();
    let mut u = UpstreamUpdate {
        received_at: Some(epoch()),
        ..Default::default()
    };
    match b >> 5 {
        0 => u.resources = vec![resource(type_url, name, &v, None, None, false)],
        1 => u.resources = vec![resource(type_url, name, &v, None, Some(10), true)],
        2 => u.removed = vec![name.into()],
        3 => {
            u.resources = vec![resource(
                type_url,
                name,
                &v,
                Some(env_is("prod")),
                None,
                false,
            )]
        }
        4 => {
            u.removed_variants = vec![ResourceName {
                name: name.into(),
                dynamic_parameter_constraints: Some(env_is("prod")),
            }]
        }
        5 => u.errors = vec![resource_error(name, 13)],
        // A heartbeat is only valid for the held version; the store rejects the rest (fine).
        6 => u.resources = vec![heartbeat(name, "1", 20)],
        _ => {
            u.resources = vec![resource(
                type_url,
                name,
                &v,
                Some(env_is("dev")),
                Some(5),
                false,
            )]
        }
    }
    (type_url, u)
}

/// A cursor over the fuzz input. Reads past the end yield zeros / empty slices, so every input is
/// a valid program.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Reader { data }
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }
    /// A length-prefixed (u16 little-endian) slice.
    pub fn chunk(&mut self) -> &'a [u8] {
        let len = u16::from_le_bytes([self.byte(), self.byte()]) as usize;
        let len = len.min(self.data.len());
        let (chunk, rest) = self.data.split_at(len);
        self.data = rest;
        chunk
    }
}

/// Appends a length-prefixed chunk in [`Reader::chunk`]'s format (seed generation).
pub fn push_chunk(out: &mut Vec<u8>, chunk: &[u8]) {
    let len = u16::try_from(chunk.len()).expect("seed chunk under 64 KiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(chunk);
}

/// How a response names one resource: by plain name, or by name and constraints (a variant).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Form {
    Plain,
    Variant(ConstraintKey),
}

/// What a client holds per type (name -> form -> version), as it would see from the responses it applied (a superset: the
/// model never drops what the relay might still consider held).
#[derive(Debug, Default)]
pub struct HeldModel {
    pub held: BTreeMap<String, BTreeMap<String, BTreeMap<Form, String>>>,
}

impl HeldModel {
    pub fn insert(&mut self, type_url: &str, name: &str, form: Form, version: &str) {
        self.held
            .entry(type_url.into())
            .or_default()
            .entry(name.into())
            .or_default()
            .insert(form, version.into());
    }
    /// Whether the client holds `name` (in any form) at `version`.
    pub fn holds_version(&self, type_url: &str, name: &str, version: &str) -> bool {
        self.held
            .get(type_url)
            .and_then(|t| t.get(name))
            .is_some_and(|f| f.values().any(|v| v == version))
    }
    pub fn holds(&self, type_url: &str, name: &str) -> bool {
        self.held
            .get(type_url)
            .and_then(|t| t.get(name))
            .is_some_and(|f| !f.is_empty())
    }
    pub fn remove(&mut self, type_url: &str, name: &str, form: Option<&Form>) {
        if let Some(forms) = self.held.get_mut(type_url).and_then(|t| t.get_mut(name)) {
            match form {
                Some(f) => {
                    forms.remove(f);
                }
                None => forms.clear(),
            }
        }
    }
    /// The client dropped what it held only through the wildcard (A4).
    pub fn retain_names(&mut self, type_url: &str, keep: impl Fn(&str) -> bool) {
        if let Some(t) = self.held.get_mut(type_url) {
            t.retain(|n, _| keep(n));
        }
    }
}

/// The header fields of an encoded `Resource` a response carries: (name, form, version, has body).
pub fn resource_identity(bytes: &[u8]) -> (String, Form, String, bool) {
    let r = adsrelay::pb::wire::ResourceHeader::decode(bytes)
        .expect("the relay only sends resources it decoded");
    let (name, form) = match &r.resource_name {
        Some(rn) if r.name.is_empty() => (
            rn.name.clone(),
            match &rn.dynamic_parameter_constraints {
                Some(c) => Form::Variant(constraints::key(Some(c))),
                None => Form::Plain,
            },
        ),
        _ => (r.name.clone(), Form::Plain),
    };
    (name, form, r.version, r.resource.is_some())
}

/// One change a response makes to what the client holds.
#[derive(Debug, Clone)]
pub enum HeldChange {
    /// The client now holds `name` in `form` at a version.
    Set(String, Form, String),
    /// `name` in `form` was removed.
    Remove(String, Form),
    /// A SotW full-state response replaces everything of its type.
    Clear,
}

/// Responses per type the relay remembers unanswered (`unacked::MAX_IN_FLIGHT`); older ones count
/// as accepted there, and so here.
pub const MAX_UNANSWERED: usize = 16;

/// What a client holds after applying only the responses it accepted (a NACKed response changes
/// nothing, B7): each response's changes wait under its nonce until the client answers it, and an
/// answer settles every earlier response of the type too (clients answer in order).
#[derive(Debug, Default)]
pub struct Answers {
    pub accepted: HeldModel,
    unanswered: BTreeMap<String, VecDeque<(u64, Vec<HeldChange>)>>,
    /// (type, name, version) the client rejected: not sent again until it changes (A31).
    pub rejected: BTreeSet<(String, String, String)>,
}

impl Answers {
    fn apply(accepted: &mut HeldModel, t: &str, changes: Vec<HeldChange>) {
        for c in changes {
            match c {
                HeldChange::Set(name, form, v) => accepted.insert(t, &name, form, &v),
                HeldChange::Remove(name, form) => accepted.remove(t, &name, Some(&form)),
                HeldChange::Clear => accepted.retain_names(t, |_| false),
            }
        }
    }

    /// A response of type `t` with `nonce` carried `changes`.
    pub fn sent(&mut self, t: &str, nonce: &str, changes: Vec<HeldChange>) {
        let (Ok(n), false) = (nonce.parse::<u64>(), changes.is_empty()) else {
            return;
        };
        let q = self.unanswered.entry(t.to_string()).or_default();
        q.push_back((n, changes));
        if q.len() > MAX_UNANSWERED {
            if let Some((_, old)) = q.pop_front() {
                Self::apply(&mut self.accepted, t, old);
            }
        }
    }

    /// The client answered `nonce`: everything before it was accepted; it was itself unless
    /// `nacked`.
    pub fn answered(&mut self, t: &str, nonce: &str, nacked: bool) {
        let Ok(n) = nonce.parse::<u64>() else {
            return;
        };
        let Some(q) = self.unanswered.get_mut(t) else {
            return;
        };
        if !q.iter().any(|(m, _)| *m == n) {
            return;
        }
        while let Some((m, changes)) = q.pop_front() {
            if m == n && nacked {
                for c in changes {
                    if let HeldChange::Set(name, _, v) = c {
                        self.rejected.insert((t.to_string(), name, v));
                    }
                }
                break;
            }
            Self::apply(&mut self.accepted, t, changes);
            if m == n {
                break;
            }
        }
    }

    /// What the client holds of type `t` now: what it accepted, then every response it has not
    /// answered yet applied in order (a NACKed one was dropped from the queue and changes nothing).
    pub fn client_holds(&self, t: &str) -> BTreeMap<String, BTreeMap<Form, String>> {
        let mut view = HeldModel::default();
        if let Some(held) = self.accepted.held.get(t) {
            view.held.insert(t.to_string(), held.clone());
        }
        for (_, changes) in self.unanswered.get(t).into_iter().flatten() {
            Self::apply(&mut view, t, changes.clone());
        }
        view.held.remove(t).unwrap_or_default()
    }

    /// At the end every response still unanswered counts as applied (as the relay records it).
    pub fn settle_all(&mut self) {
        for (t, q) in std::mem::take(&mut self.unanswered) {
            for (_, changes) in q {
                Self::apply(&mut self.accepted, &t, changes);
            }
        }
    }

    /// Whether the client accepted `name` at `version`, or rejected exactly that version.
    pub fn has_or_rejected(&self, t: &str, name: &str, version: &str) -> bool {
        self.accepted.holds_version(t, name, version)
            || self
                .rejected
                .contains(&(t.to_string(), name.to_string(), version.to_string()))
    }
}

/// Whether the store holds a variant of `name` at `version`.
pub fn store_has_version(store: &Store, type_url: &str, name: &str, version: &str) -> bool {
    store
        .resources(type_url)
        .any(|r| &*r.name == name && r.version == version)
}

/// Everything observable about a store's content, for before/after comparisons: every variant
/// (bytes, arrival, TTL), heartbeats, wildcard sync, and for `probe` names the lookup outcome and
/// reported error.
pub fn store_digest(store: &Store, probe: &[String]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let mut types: Vec<&str> = store.type_urls().collect();
    types.sort();
    let _ = writeln!(
        out,
        "seq={} next_expiry={:?}",
        store.seq(),
        store.next_expiry()
    );
    for t in types {
        let _ = writeln!(out, "type {t} synced={}", store.wildcard_synced(t));
        for r in store.resources(t) {
            let _ = writeln!(
                out,
                "  {} key={} v={} arrival={} ttl={:?} dnc={} bytes={:?} hb={:?}",
                r.name,
                r.key,
                r.version,
                r.arrival,
                r.ttl,
                r.do_not_cache,
                r.encoded,
                store.heartbeat(t, &r.name, &r.key)
            );
        }
        for n in probe {
            let _ = writeln!(
                out,
                "  probe {n:?}: {:?} err={:?}",
                lookup_kind(store, t, n),
                store.error(t, n)
            );
        }
    }
    out
}

fn lookup_kind(store: &Store, type_url: &str, name: &str) -> &'static str {
    match store.lookup(type_url, name) {
        adsrelay::xds::Lookup::Present(_) => "present",
        adsrelay::xds::Lookup::Absent => "absent",
        adsrelay::xds::Lookup::Unknown => "unknown",
    }
}

/// Default parameters for plain-name subscriptions: none, or env=prod (TP2 migration path).
pub fn default_params(flag: bool) -> Params {
    if flag {
        param_set(1)
    } else {
        Params::new()
    }
}

pub fn arc_params(p: Params) -> Arc<Params> {
    Arc::new(p)
}

pub const TTL_STEP: Duration = Duration::from_secs(7);

pub mod constraint_input;
pub mod seeds;

/// Whether the subscriptions of `name` (each a parameter set) select different resources from
/// the store. Such a client asked for two things under one name, which may reach it under one
/// wire identity; which one it ends up holding is not defined, so delivery is not checked.
pub fn selections_differ<'a>(
    store: &Store,
    type_url: &str,
    name: &str,
    params: impl IntoIterator<Item = &'a Params>,
) -> bool {
    let mut seen = std::collections::BTreeSet::new();
    for p in params {
        if let adsrelay::xds::Lookup::Present(r) = store.lookup_for(type_url, name, p) {
            seen.insert((r.key.clone(), r.version.clone()));
        }
    }
    seen.len() > 1
}

/// The adapter's admission of one request (downstream/stream.rs `handle`): its shape, then the
/// state machine within the subscription limit. `None`: refused (the stream ends); a request
/// refused for the limit must leave the stream exactly as it was.
pub fn admit_request<C>(
    stream: &mut C,
    req: &C::Request,
    held: usize,
    limits: &StreamLimits,
) -> Option<RequestEffects>
where
    C: StreamCore,
    C::Request: RequestShape,
{
    limits::check_request(req, limits).ok()?;
    let before = (stream.subscriptions(), stream.view(true));
    match stream.on_request_within(req, held, req.subscribe_entries(), limits.max_subscriptions) {
        Ok(effects) => Some(effects),
        Err(ProtocolError::TooManySubscriptions { .. }) => {
            assert_eq!(
                (stream.subscriptions(), stream.view(true)),
                before,
                "a refused request changed the stream"
            );
            None
        }
        Err(_) => None,
    }
}
