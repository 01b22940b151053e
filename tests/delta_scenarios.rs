//! Conformance scenarios for the Delta downstream protocol core (xds-conformance.md section A, plus
//! C1, C4, C5, C8 and D9), driven directly through `DeltaStream`, `Store` and `GroupState`: no
//! sockets, no tokio. Every test asserts what a client (or the upstream) would observe: the names,
//! versions, removals and nonces of the `DeltaDiscoveryResponse`s, the ACK attribution of requests,
//! and the subscription changes sent upstream.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use adsrelay::pb::discovery::{
    resource::CacheControl, DeltaDiscoveryRequest, Resource, ResourceName,
};
use adsrelay::pb::rpc::Status;
use adsrelay::pb::wire;
use adsrelay::xds::*;
use bytes::Bytes;
use prost::Message;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// An encoded `Resource{name, version, resource: Any{type_url, value}}`. The body depends on name
/// and version, so a new version is a content change.
fn res(type_url: &str, name: &str, version: &str) -> Bytes {
    resource_msg(type_url, name, version).encode_to_vec().into()
}

fn resource_msg(type_url: &str, name: &str, version: &str) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: format!("{name}@{version}").into_bytes(),
        }),
        ..Default::default()
    }
}

/// An entry for `Store::complete`.
fn cached(type_url: &str, name: &str, version: &str) -> (String, CachedResource) {
    (
        type_url.to_string(),
        CachedResource::decode(res(type_url, name, version)).expect("valid resource"),
    )
}

/// A `DeltaDiscoveryRequest` builder.
struct Req(DeltaDiscoveryRequest);

fn req(type_url: &str) -> Req {
    Req(DeltaDiscoveryRequest {
        type_url: type_url.into(),
        ..Default::default()
    })
}

impl Req {
    fn sub(mut self, names: &[&str]) -> Self {
        self.0
            .resource_names_subscribe
            .extend(names.iter().map(|n| n.to_string()));
        self
    }

    fn unsub(mut self, names: &[&str]) -> Self {
        self.0
            .resource_names_unsubscribe
            .extend(names.iter().map(|n| n.to_string()));
        self
    }

    fn irv(mut self, versions: &[(&str, &str)]) -> Self {
        self.0
            .initial_resource_versions
            .extend(versions.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        self
    }

    fn ack(mut self, nonce: &str) -> Self {
        self.0.response_nonce = nonce.into();
        self
    }

    fn nack(mut self, nonce: &str, message: &str) -> Self {
        self.0.response_nonce = nonce.into();
        self.0.error_detail = Some(Status {
            code: 13,
            message: message.into(),
            details: vec![],
        });
        self
    }
}

/// A `DeltaDiscoveryResponse` as the client decodes it.
#[derive(Debug, Clone)]
struct Resp {
    type_url: String,
    /// (name, version) in the order sent.
    resources: Vec<(String, String)>,
    removed: Vec<String>,
    nonce: String,
}

impl Resp {
    fn names(&self) -> BTreeSet<&str> {
        self.resources.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn versions(&self) -> BTreeMap<&str, &str> {
        self.resources
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect()
    }

    fn removed(&self) -> BTreeSet<&str> {
        self.removed.iter().map(String::as_str).collect()
    }

    fn mentions(&self, name: &str) -> bool {
        self.resources.iter().any(|(n, _)| n == name) || self.removed.iter().any(|n| n == name)
    }
}

/// Decodes one response as an Envoy would, checking the per-response rules every response must
/// obey: a non-empty nonce (A17), matching `Any` type URLs (A19), no duplicate names and no name
/// both added and removed (A20), and a name and version on every resource (A16).
fn decode(r: wire::DeltaDiscoveryResponse) -> Resp {
    assert!(!r.nonce.is_empty(), "A17: response without a nonce: {r:?}");
    assert!(!r.type_url.is_empty(), "response without a type_url");
    let mut resources = Vec::new();
    for bytes in &r.resources {
        let resource = Resource::decode(&bytes[..]).expect("resource decodes");
        assert!(!resource.name.is_empty(), "A16: resource without a name");
        assert!(
            !resource.version.is_empty(),
            "A16: resource without a version"
        );
        if let Some(any) = &resource.resource {
            assert_eq!(any.type_url, r.type_url, "A19: Any type_url mismatch");
        }
        resources.push((resource.name, resource.version));
    }
    let added: HashSet<&str> = resources.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        added.len(),
        resources.len(),
        "A20: duplicate name in resources: {resources:?}"
    );
    let removed: HashSet<&str> = r.removed_resources.iter().map(String::as_str).collect();
    assert_eq!(
        removed.len(),
        r.removed_resources.len(),
        "A20: duplicate name in removed_resources: {:?}",
        r.removed_resources
    );
    assert!(
        added.is_disjoint(&removed),
        "A20: name both added and removed: {resources:?} / {:?}",
        r.removed_resources
    );
    Resp {
        type_url: r.type_url,
        resources,
        removed: r.removed_resources,
        nonce: r.nonce,
    }
}

/// Every response the stream has to send now, decoded.
fn drain(stream: &mut DeltaStream, store: &Store) -> Vec<Resp> {
    let mut out = Vec::new();
    while let Some(r) = stream.next_response(store) {
        out.push(decode(r));
        assert!(out.len() < 64, "stream keeps producing responses: {out:?}");
    }
    out
}

/// One downstream Delta stream, remembering every nonce it received to check uniqueness (A17).
#[derive(Default)]
struct Client {
    stream: DeltaStream,
    nonces: HashSet<String>,
}

impl Client {
    fn new() -> Self {
        Self::default()
    }

    fn send(&mut self, r: Req) -> RequestEffects {
        self.stream.on_request(&r.0).expect("request accepted")
    }

    fn drain(&mut self, store: &Store) -> Vec<Resp> {
        let out = drain(&mut self.stream, store);
        for r in &out {
            assert!(
                self.nonces.insert(r.nonce.clone()),
                "A17: nonce {:?} reused on the stream",
                r.nonce
            );
        }
        out
    }

    /// Drains and expects exactly one response.
    fn one(&mut self, store: &Store) -> Resp {
        let mut out = self.drain(store);
        assert_eq!(out.len(), 1, "expected exactly one response, got {out:?}");
        out.remove(0)
    }

    /// Drains and expects silence.
    fn none(&mut self, store: &Store) {
        let out = self.drain(store);
        assert!(out.is_empty(), "expected no response, got {out:?}");
    }

    fn notify(&mut self, changes: &ChangeSet) {
        self.stream.on_change(changes);
    }
}

/// Simulates one upstream Delta response into the store.
fn upstream(
    store: &mut Store,
    type_url: &str,
    add: &[(&str, &str)],
    remove: &[&str],
    wildcard: bool,
) -> ChangeSet {
    store
        .apply_delta(
            type_url,
            add.iter().map(|(n, v)| res(type_url, n, v)).collect(),
            remove.iter().map(|n| n.to_string()).collect(),
            wildcard,
        )
        .expect("valid upstream response")
}

/// A store whose wildcard set for `type_url` is synced and holds `resources`.
fn synced_store(type_url: &str, resources: &[(&str, &str)]) -> Store {
    let mut store = Store::new();
    upstream(&mut store, type_url, resources, &[], true);
    store
}

fn set<'a>(names: &[&'a str]) -> BTreeSet<&'a str> {
    names.iter().copied().collect()
}

fn map<'a>(pairs: &[(&'a str, &'a str)]) -> BTreeMap<&'a str, &'a str> {
    pairs.iter().copied().collect()
}

fn strs(locators: &[adsrelay::xds::Locator]) -> Vec<&str> {
    locators.iter().map(|l| &*l.name).collect()
}

// ---------------------------------------------------------------------------------------------
// A. Delta downstream
// ---------------------------------------------------------------------------------------------

#[test]
fn a01_legacy_wildcard_on_first_request() {
    let mut store = synced_store(CDS, &[("c1", "1"), ("c2", "1")]);
    let mut client = Client::new();
    let effects = client.send(req(CDS));
    assert_eq!(strs(&effects.acquire), vec![WILDCARD]);

    let r = client.one(&store);
    assert_eq!(r.type_url, CDS);
    assert_eq!(r.versions(), map(&[("c1", "1"), ("c2", "1")]));
    assert!(r.removed.is_empty());

    // The stream is really wildcard-subscribed: a new cluster upstream reaches it unrequested.
    let changes = upstream(&mut store, CDS, &[("c3", "1")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("c3", "1")]));
}

#[test]
fn a01_legacy_wildcard_before_upstream_sync_is_answered_at_sync() {
    let mut store = Store::new();
    let mut client = Client::new();
    client.send(req(CDS));
    client.none(&store);

    let changes = upstream(&mut store, CDS, &[("c1", "1")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("c1", "1")]));
}

#[test]
fn a02_initial_wildcard_gets_empty_response() {
    // Authoritative store with no CDS and no LDS: both a legacy and an explicit "*" first request
    // are answered, with an empty response.
    let store = Store::complete(Vec::new());
    let mut client = Client::new();
    client.send(req(CDS));
    client.send(req(LDS).sub(&["*"]));
    let out = client.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    let types: BTreeSet<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
    assert_eq!(types, set(&[CDS, LDS]));
    for r in &out {
        assert!(r.resources.is_empty() && r.removed.is_empty(), "{r:?}");
    }
    // Answered once; nothing more to say.
    client.none(&store);

    // A reconnect whose initial_resource_versions are all current still gets its (empty) answer.
    let store = synced_store(CDS, &[("c1", "1")]);
    let mut client = Client::new();
    client.send(req(CDS).irv(&[("c1", "1")]));
    let r = client.one(&store);
    assert!(r.resources.is_empty() && r.removed.is_empty(), "{r:?}");
}

#[test]
fn a02_initial_wildcard_on_cold_store_answered_empty_once_synced() {
    let mut store = Store::new();
    let mut client = Client::new();
    client.send(req(CDS));
    client.none(&store);

    let changes = upstream(&mut store, CDS, &[], &[], true);
    assert!(changes.wildcard_synced_now);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.type_url, CDS);
    assert!(r.resources.is_empty() && r.removed.is_empty(), "{r:?}");
}

#[test]
fn a03_legacy_wildcard_survives_explicit_subscribe() {
    let mut store = synced_store(CDS, &[("A", "1"), ("B", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["A", "B"]));

    let effects = client.send(req(CDS).ack(&r.nonce).sub(&["A"]));
    assert_eq!(strs(&effects.acquire), vec!["A"]);
    assert!(effects.release.is_empty(), "wildcard must not be dropped");
    // A7: "A" is resent even though the client holds it.
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("A", "1")]));

    // Wildcard still active: wildcard-only resources keep flowing.
    let changes = upstream(&mut store, CDS, &[("B", "2"), ("C", "1")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("B", "2"), ("C", "1")]));
}

#[test]
fn a04_unsubscribing_wildcard_keeps_named_interest() {
    let mut store = synced_store(CDS, &[("A", "1"), ("B", "1"), ("U", "1")]);
    let mut client = Client::new();
    client.send(req(CDS).sub(&["*", "A"]));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["A", "B", "U"]));

    let effects = client.send(req(CDS).ack(&r.nonce).unsub(&["*"]));
    assert_eq!(strs(&effects.release), vec![WILDCARD]);
    // No removal is required for the wildcard-only "B" and "U", and nothing is resent.
    for r in client.drain(&store) {
        assert!(r.resources.is_empty(), "{r:?}");
    }

    // Wildcard-only resources no longer flow; the named one does.
    let changes = upstream(&mut store, CDS, &[("B", "2"), ("C", "1")], &[], true);
    client.notify(&changes);
    client.none(&store);
    let changes = upstream(&mut store, CDS, &[("A", "2")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("A", "2")]));

    // The client dropped the wildcard-only resources: subscribing "*" again sends them all.
    client.send(req(CDS).ack(&r.nonce).sub(&["*"]));
    let r = client.one(&store);
    assert!(r.removed.is_empty(), "{r:?}");
    let versions = r.versions();
    assert_eq!(versions.get("B"), Some(&"2"), "{r:?}");
    assert_eq!(versions.get("C"), Some(&"1"), "{r:?}");
    assert_eq!(
        versions.get("U"),
        Some(&"1"),
        "unchanged but dropped by the client: {r:?}"
    );
}

#[test]
fn a05_empty_request_after_explicit_subscriptions_is_not_wildcard() {
    let mut store = synced_store(CDS, &[("A", "1"), ("B", "1")]);
    let mut client = Client::new();
    client.send(req(CDS).sub(&["A"]));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["A"]));
    client.send(req(CDS).ack(&r.nonce).unsub(&["A"]));
    client.drain(&store);

    // Mid-stream empty request (e.g. a node re-send): a no-op.
    let effects = client.send(req(CDS));
    assert!(effects.acquire.is_empty(), "{effects:?}");
    assert!(effects.release.is_empty(), "{effects:?}");
    client.none(&store);

    let changes = upstream(&mut store, CDS, &[("B", "2"), ("C", "1")], &[], true);
    client.notify(&changes);
    client.none(&store);
}

#[test]
fn a06_unsubscribing_name_under_wildcard_requires_answer() {
    // foo belongs to the wildcard set: it is sent again in resources.
    let store = synced_store(CDS, &[("foo", "3"), ("bar", "1")]);
    let mut client = Client::new();
    client.send(req(CDS).sub(&["*", "foo"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("bar", "1"), ("foo", "3")]));

    client.send(req(CDS).ack(&r.nonce).unsub(&["foo"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "3")]));
    assert!(r.removed.is_empty());
}

#[test]
fn a06_unsubscribing_missing_name_under_wildcard_answers_with_removal() {
    // foo does not exist (authoritatively): the answer carries it in removed_resources.
    let store = Store::complete(vec![cached(CDS, "bar", "1")]);
    let mut client = Client::new();
    client.send(req(CDS).sub(&["*", "foo"]));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["bar"]));
    assert_eq!(r.removed(), set(&["foo"]));

    client.send(req(CDS).ack(&r.nonce).unsub(&["foo"]));
    let r = client.one(&store);
    assert!(r.resources.is_empty(), "{r:?}");
    assert_eq!(r.removed(), set(&["foo"]));
}

#[test]
fn a07_resubscribe_resends_held_resource() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "1")]));

    // Remove-then-add collapsed into a plain subscribe: resend in full.
    let effects = client.send(req(EDS).ack(&r.nonce).sub(&["foo"]));
    assert!(
        effects.acquire.is_empty(),
        "already subscribed: {effects:?}"
    );
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "1")]));

    // And once more, pipelined without an ACK.
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "1")]));
}

#[test]
fn a08_phantom_unsubscribe_is_ignored() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("bar", "1"), ("foo", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["bar"]));
    let r = client.one(&store);

    let effects = client
        .stream
        .on_request(&req(EDS).ack(&r.nonce).unsub(&["foo"]).0)
        .expect("a phantom unsubscribe is not an error");
    assert!(effects.release.is_empty(), "{effects:?}");
    client.none(&store);

    // Unsubscribing "*" without a wildcard is a phantom too.
    let effects = client
        .stream
        .on_request(&req(EDS).unsub(&["*"]).0)
        .expect("a phantom unsubscribe is not an error");
    assert!(effects.release.is_empty(), "{effects:?}");
    client.none(&store);

    // The stream carries on normally.
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "1")]));
}

#[test]
fn a09_plain_unsubscribe_stops_updates() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "1"), ("bar", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo", "bar"]));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["bar", "foo"]));

    let effects = client.send(req(EDS).ack(&r.nonce).unsub(&["foo"]));
    assert_eq!(strs(&effects.release), vec!["foo"]);
    // A removal is permitted, a resend is not.
    for r in client.drain(&store) {
        assert!(!r.resources.iter().any(|(n, _)| n == "foo"), "{r:?}");
    }

    let changes = upstream(&mut store, EDS, &[("foo", "2")], &[], false);
    client.notify(&changes);
    client.none(&store);
    let changes = upstream(&mut store, EDS, &[("bar", "2")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("bar", "2")]));
}

#[test]
fn a10_nonexistent_resource_is_removed_and_stays_subscribed() {
    let mut store = Store::new();
    // The upstream said authoritatively that foo does not exist.
    upstream(&mut store, EDS, &[], &["foo"], false);
    let mut client = Client::new();
    let effects = client.send(req(EDS).sub(&["foo"]));
    assert_eq!(strs(&effects.acquire), vec!["foo"]);
    let r = client.one(&store);
    assert!(r.resources.is_empty());
    assert_eq!(r.removed(), set(&["foo"]));
    // Said once: a re-evaluation does not repeat the removal.
    client.stream.mark_all_pending(EDS);
    client.none(&store);

    // Still subscribed: when foo appears, it is sent.
    let changes = upstream(&mut store, EDS, &[("foo", "1")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "1")]));
    assert!(r.removed.is_empty());
}

#[test]
fn a10_nonexistent_in_authoritative_store() {
    let store = Store::complete(vec![cached(EDS, "bar", "1")]);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo", "bar"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("bar", "1")]));
    assert_eq!(r.removed(), set(&["foo"]));
}

#[test]
fn a10_unknown_name_waits_for_upstream() {
    // D9 for an explicit name: a cold store is not authoritative absence.
    let mut store = Store::new();
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo"]));
    client.none(&store);

    let changes = upstream(&mut store, EDS, &[], &["foo"], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.removed(), set(&["foo"]));
}

#[test]
fn a11_reconnect_honours_initial_resource_versions() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "2000"), ("y", "3001")], &[], false);
    let mut client = Client::new();
    client.send(
        req(EDS)
            .sub(&["x", "y"])
            .irv(&[("x", "2000"), ("y", "3000")]),
    );
    let r = client.one(&store);
    // MUST send the changed y; SHOULD skip the unchanged x.
    assert_eq!(r.versions(), map(&[("y", "3001")]));
    assert!(r.removed.is_empty());

    // x is subscribed nevertheless.
    let changes = upstream(&mut store, EDS, &[("x", "2001")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("x", "2001")]));
}

#[test]
fn a12_reconnect_reports_deletions_while_disconnected() {
    // Legacy wildcard reconnect, upstream-fed store synced with only a@v1.
    let store = synced_store(CDS, &[("a", "v1")]);
    let mut client = Client::new();
    client.send(req(CDS).irv(&[("a", "v1"), ("b", "v1")]));
    let r = client.one(&store);
    assert_eq!(r.removed(), set(&["b"]));
    assert!(r.resources.is_empty(), "a is unchanged: {r:?}");

    // Explicit "*" reconnect against an authoritative store.
    let store = Store::complete(vec![cached(CDS, "a", "v1")]);
    let mut client = Client::new();
    client.send(req(CDS).sub(&["*"]).irv(&[("a", "v1"), ("b", "v1")]));
    let r = client.one(&store);
    assert_eq!(r.removed(), set(&["b"]));
    assert!(r.resources.is_empty(), "a is unchanged: {r:?}");
}

#[test]
fn a12_reconnect_reports_deleted_explicit_names() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "1")], &["gone"], false);
    let mut client = Client::new();
    client.send(
        req(EDS)
            .sub(&["x", "gone"])
            .irv(&[("x", "1"), ("gone", "1")]),
    );
    let r = client.one(&store);
    assert_eq!(r.removed(), set(&["gone"]));
    assert!(r.resources.is_empty(), "x is unchanged: {r:?}");
}

#[test]
fn a13_reconnect_state_is_exactly_the_first_request() {
    let mut store = Store::new();
    upstream(
        &mut store,
        EDS,
        &[
            ("name1", "1"),
            ("name2", "1"),
            ("name3", "1"),
            ("name4", "1"),
        ],
        &[],
        false,
    );
    let mut old = Client::new();
    old.send(req(EDS).sub(&["name1", "name2", "name3"]));
    assert_eq!(old.one(&store).names(), set(&["name1", "name2", "name3"]));

    // A new stream: nothing carries over.
    let mut client = Client::new();
    let effects = client.send(req(EDS).sub(&["name2", "name3", "name4"]));
    let acquired: BTreeSet<&str> = strs(&effects.acquire).into_iter().collect();
    assert_eq!(acquired, set(&["name2", "name3", "name4"]));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["name2", "name3", "name4"]));
    let held: BTreeSet<String> = client
        .stream
        .subscriptions()
        .into_iter()
        .map(|(_, n)| n.to_string())
        .collect();
    assert_eq!(
        held,
        ["name2", "name3", "name4"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );

    let changes = upstream(&mut store, EDS, &[("name1", "2")], &[], false);
    client.notify(&changes);
    client.none(&store);
}

#[test]
fn a14_reconnect_with_explicit_wildcard_and_names() {
    let mut store = synced_store(CDS, &[("name1", "v1"), ("name2", "v2"), ("name3", "v1")]);
    let mut client = Client::new();
    let effects = client.send(req(CDS).sub(&["*", "name3"]).irv(&[
        ("name1", "v1"),
        ("name2", "v1"),
        ("name3", "v1"),
    ]));
    // IRV names are known versions, not subscriptions.
    let acquired: BTreeSet<&str> = strs(&effects.acquire).into_iter().collect();
    assert_eq!(acquired, set(&[WILDCARD, "name3"]));

    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("name2", "v2")]));
    assert!(r.removed.is_empty());

    // Leaving the wildcard keeps only name3: IRV did not make name1 explicit.
    client.send(req(CDS).ack(&r.nonce).unsub(&["*"]));
    for r in client.drain(&store) {
        assert!(r.resources.is_empty(), "{r:?}");
    }
    let changes = upstream(&mut store, CDS, &[("name1", "v2")], &[], true);
    client.notify(&changes);
    client.none(&store);
    let changes = upstream(&mut store, CDS, &[("name3", "v2")], &[], true);
    client.notify(&changes);
    assert_eq!(client.one(&store).versions(), map(&[("name3", "v2")]));
}

#[test]
fn a17_delta_nonce_and_ack_nack() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "1"), ("bar", "1")], &[], false);
    upstream(&mut store, CDS, &[("c1", "1")], &[], true);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo", "bar"]));
    let n1 = client.one(&store).nonce;

    // Pipelined without waiting for an ACK.
    let changes = upstream(&mut store, EDS, &[("foo", "2")], &[], false);
    client.notify(&changes);
    let n2 = client.one(&store).nonce;
    assert_ne!(n1, n2);

    let e = client.send(req(EDS).ack(&n2));
    assert_eq!(e.ack, AckStatus::Ack { nonce: n2.clone() });
    let e = client.send(req(EDS).ack(&n1));
    assert_eq!(e.ack, AckStatus::Stale { nonce: n1.clone() });

    // A nonce is attributed within its type only.
    client.send(req(CDS));
    let n3 = client.one(&store).nonce;
    let e = client.send(req(EDS).ack(&n3));
    assert!(
        !matches!(e.ack, AckStatus::Ack { .. } | AckStatus::Nack { .. }),
        "a CDS nonce must not ack EDS: {:?}",
        e.ack
    );
    let e = client.send(req(CDS).ack(&n3));
    assert_eq!(e.ack, AckStatus::Ack { nonce: n3.clone() });

    // NACK.
    let changes = upstream(&mut store, EDS, &[("bar", "2")], &[], false);
    client.notify(&changes);
    let n4 = client.one(&store).nonce;
    let e = client.send(req(EDS).nack(&n4, "bad endpoint"));
    assert_eq!(
        e.ack,
        AckStatus::Nack {
            nonce: n4.clone(),
            message: "bad endpoint".into()
        }
    );
    // A pure subscription change acknowledges nothing.
    let e = client.send(req(EDS).sub(&["baz"]));
    assert_eq!(e.ack, AckStatus::None);
    assert_eq!(client.nonces.len(), 4);
}

#[test]
fn a18_stale_nonce_still_changes_subscriptions() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "1"), ("z", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["x"]));
    let n1 = client.one(&store).nonce;
    let changes = upstream(&mut store, EDS, &[("x", "2")], &[], false);
    client.notify(&changes);
    let _n2 = client.one(&store).nonce;

    let e = client.send(req(EDS).ack(&n1).sub(&["z"]));
    assert_eq!(e.ack, AckStatus::Stale { nonce: n1 });
    assert_eq!(strs(&e.acquire), vec!["z"]);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("z", "1")]));

    // Also a stale NACK with an unsubscribe.
    let e = client.send(req(EDS).nack("1", "old").unsub(&["x"]));
    assert!(matches!(e.ack, AckStatus::Stale { .. }), "{:?}", e.ack);
    assert_eq!(strs(&e.release), vec!["x"]);
}

#[test]
fn a20_no_duplicates_and_no_add_remove_overlap() {
    let mut store = synced_store(CDS, &[("a", "1"), ("b", "1")]);
    let mut client = Client::new();
    // Wildcard plus an explicit name also in the wildcard set: each name once.
    client.send(req(CDS).sub(&["*", "a", "a"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("a", "1"), ("b", "1")]));

    // Several upstream changes coalesce before the client reads: remove then re-add a, update b
    // twice, add then remove c.
    let mut changes = vec![
        upstream(&mut store, CDS, &[], &["a"], true),
        upstream(&mut store, CDS, &[("a", "2"), ("b", "2")], &[], true),
        upstream(&mut store, CDS, &[("b", "3"), ("c", "1")], &[], true),
        upstream(&mut store, CDS, &[], &["c"], true),
    ];
    for c in changes.drain(..) {
        client.notify(&c);
    }
    // decode() checks the per-response rules; across the drained responses the final state
    // must be a@2, b@3 and no c.
    let out = client.drain(&store);
    assert!(!out.is_empty());
    let mut held: BTreeMap<String, String> = BTreeMap::new();
    held.insert("a".into(), "1".into());
    held.insert("b".into(), "1".into());
    for r in &out {
        for (n, v) in &r.resources {
            held.insert(n.clone(), v.clone());
        }
        for n in &r.removed {
            held.remove(n);
        }
    }
    assert_eq!(
        held,
        BTreeMap::from([("a".into(), "2".into()), ("b".into(), "3".into())])
    );
    for r in &out {
        assert!(!r.resources.iter().any(|(n, _)| n == "c"), "{r:?}");
    }

    // Update then remove of an explicit name in one batch: only the removal.
    let changes = upstream(&mut store, CDS, &[("a", "3")], &[], true);
    client.notify(&changes);
    let changes = upstream(&mut store, CDS, &[], &["a"], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert!(r.resources.is_empty(), "{r:?}");
    assert_eq!(r.removed(), set(&["a"]));
}

#[test]
fn a22_never_send_unsubscribed_type() {
    let mut store = synced_store(CDS, &[("c1", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    client.one(&store);

    let changes = upstream(&mut store, RDS, &[("r1", "1")], &[], true);
    client.notify(&changes);
    client.stream.mark_all_pending(RDS);
    let changes = upstream(&mut store, EDS, &[("e1", "1")], &["e2"], false);
    client.notify(&changes);
    let out = client.drain(&store);
    assert!(out.iter().all(|r| r.type_url == CDS), "{out:?}");
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn a30_ads_per_type_isolation() {
    let mut store = synced_store(CDS, &[("x", "1"), ("c1", "1")]);
    upstream(&mut store, RDS, &[("x", "7"), ("r1", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(CDS));
    client.send(req(RDS).sub(&["r1", "x"]));
    let out = client.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    let cds = out
        .iter()
        .find(|r| r.type_url == CDS)
        .expect("CDS response");
    let rds = out
        .iter()
        .find(|r| r.type_url == RDS)
        .expect("RDS response");
    // Same name, different types: versions are tracked per type.
    assert_eq!(cds.versions(), map(&[("c1", "1"), ("x", "1")]));
    assert_eq!(rds.versions(), map(&[("r1", "1"), ("x", "7")]));
    let (cds_nonce, rds_nonce) = (cds.nonce.clone(), rds.nonce.clone());

    let e = client.send(req(RDS).nack(&rds_nonce, "bad route"));
    assert!(matches!(e.ack, AckStatus::Nack { .. }), "{:?}", e.ack);
    // The RDS NACK leaves the CDS nonce current and CDS delivery unaffected.
    let e = client.send(req(CDS).ack(&cds_nonce));
    assert_eq!(e.ack, AckStatus::Ack { nonce: cds_nonce });
    let changes = upstream(&mut store, CDS, &[("c1", "2")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.type_url, CDS);
    assert_eq!(r.versions(), map(&[("c1", "2")]));
    let e = client.send(req(CDS).ack(&r.nonce));
    assert_eq!(e.ack, AckStatus::Ack { nonce: r.nonce });

    // An RDS change goes to RDS only.
    let changes = upstream(&mut store, RDS, &[("r1", "2")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.type_url, RDS);
    assert_eq!(r.versions(), map(&[("r1", "2")]));
}

#[test]
fn a31_no_retransmit_after_nack() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "v1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    client.send(req(EDS).ack(&r.nonce));

    let changes = upstream(&mut store, EDS, &[("foo", "v2")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "v2")]));
    client.send(req(EDS).nack(&r.nonce, "rejected"));
    client.none(&store);

    // Nothing changed upstream: an identical resend or a full re-evaluation sends nothing.
    let changes = upstream(&mut store, EDS, &[("foo", "v2")], &[], false);
    client.notify(&changes);
    client.stream.mark_all_pending(EDS);
    client.none(&store);

    // A new version is sent.
    let changes = upstream(&mut store, EDS, &[("foo", "v3")], &[], false);
    client.notify(&changes);
    assert_eq!(client.one(&store).versions(), map(&[("foo", "v3")]));
    client.send(req(EDS).nack("2", "still rejected"));
    client.none(&store);

    // A re-subscribe resends (A7).
    client.send(req(EDS).sub(&["foo"]));
    assert_eq!(client.one(&store).versions(), map(&[("foo", "v3")]));
}

// ---------------------------------------------------------------------------------------------
// C. Upstream behaviour
// ---------------------------------------------------------------------------------------------

type Upstream = Vec<(String, Vec<String>, Vec<String>)>;

fn upstream_changes(group: &mut GroupState) -> Upstream {
    group
        .take_upstream_changes()
        .into_iter()
        .map(|c| {
            (
                c.type_url,
                c.subscribe.iter().map(|n| n.to_string()).collect(),
                c.unsubscribe.iter().map(|n| n.to_string()).collect(),
            )
        })
        .collect()
}

#[test]
fn c01_refcounted_interest() {
    let now = Instant::now();
    let mut group = GroupState::new(Duration::ZERO);
    let (mut d1, mut d2) = (Client::new(), Client::new());

    let e = d1.send(req(EDS).sub(&["foo"]));
    group.apply_effects(1, &e, now);
    assert_eq!(
        upstream_changes(&mut group),
        vec![(EDS.to_string(), vec!["foo".to_string()], vec![])]
    );

    let e = d2.send(req(EDS).sub(&["foo"]));
    group.apply_effects(2, &e, now);
    assert_eq!(upstream_changes(&mut group), vec![]);
    // A7 re-subscribe by D2 is not a new upstream subscription.
    let e = d2.send(req(EDS).sub(&["foo"]));
    group.apply_effects(2, &e, now);
    assert_eq!(upstream_changes(&mut group), vec![]);

    let e = d1.send(req(EDS).unsub(&["foo"]));
    group.apply_effects(1, &e, now);
    assert_eq!(upstream_changes(&mut group), vec![]);
    // A phantom unsubscribe by D1 does not steal D2's reference.
    let e = d1.send(req(EDS).unsub(&["foo"]));
    group.apply_effects(1, &e, now);
    assert_eq!(upstream_changes(&mut group), vec![]);

    group.remove_stream(2, &d2.stream.subscriptions(), now);
    assert_eq!(
        upstream_changes(&mut group),
        vec![(EDS.to_string(), vec![], vec!["foo".to_string()])]
    );
    assert_eq!(upstream_changes(&mut group), vec![]);
}

#[test]
fn c01_refcounted_wildcard_interest() {
    let now = Instant::now();
    let mut group = GroupState::new(Duration::ZERO);
    let (mut d1, mut d2) = (Client::new(), Client::new());
    let e = d1.send(req(CDS));
    group.apply_effects(1, &e, now);
    let e = d2.send(req(CDS).sub(&["*"]));
    group.apply_effects(2, &e, now);
    assert_eq!(
        upstream_changes(&mut group),
        vec![(CDS.to_string(), vec![WILDCARD.to_string()], vec![])]
    );
    group.remove_stream(1, &d1.stream.subscriptions(), now);
    assert_eq!(upstream_changes(&mut group), vec![]);
    let e = d2.send(req(CDS).unsub(&["*"]));
    group.apply_effects(2, &e, now);
    assert_eq!(
        upstream_changes(&mut group),
        vec![(CDS.to_string(), vec![], vec![WILDCARD.to_string()])]
    );
}

#[test]
fn c04_initial_versions_exclude_unwanted() {
    let now = Instant::now();
    let mut group = GroupState::new(Duration::ZERO);
    let mut d1 = Client::new();
    let e = d1.send(req(EDS).sub(&["a", "b", "c", "d"]));
    group.apply_effects(1, &e, now);
    let e = d1.send(req(EDS).unsub(&["b"]));
    group.apply_effects(1, &e, now);

    let no_cache = Resource {
        cache_control: Some(CacheControl { do_not_cache: true }),
        ..resource_msg(EDS, "c", "1")
    };
    // The group's cache as it was before the unsubscription settled (a standalone store, so `b`
    // stays cached while no longer wanted).
    let mut store = Store::new();
    store
        .apply_delta(
            EDS,
            vec![
                res(EDS, "a", "1"),
                res(EDS, "b", "1"),
                no_cache.encode_to_vec().into(),
            ],
            vec![],
            false,
        )
        .unwrap();
    let interest = group.interest();
    let irv = store.initial_versions(EDS, |n| interest.wants(EDS, n));
    // b: no longer wanted; c: do_not_cache; d: never received.
    assert_eq!(
        irv,
        [("a".to_string(), "1".to_string())].into_iter().collect()
    );

    // A rejected update keeps the last accepted version; a deleted resource is not reported.
    let bad = store.apply_delta(
        EDS,
        vec![res(EDS, "a", "2"), res(EDS, "a", "3")],
        vec![],
        false,
    );
    assert!(bad.is_err());
    let irv = store.initial_versions(EDS, |_| true);
    assert_eq!(irv.get("a").map(String::as_str), Some("1"));
    store
        .apply_delta(EDS, vec![], vec!["a".into()], false)
        .unwrap();
    let irv = store.initial_versions(EDS, |_| true);
    assert!(!irv.contains_key("a"), "{irv:?}");
}

#[test]
fn c05_removal_after_reconnect_only_touches_removed_name() {
    let mut store = synced_store(CDS, &[("a", "v1"), ("b", "v1")]);
    let mut wild = Client::new();
    wild.send(req(CDS));
    assert_eq!(wild.one(&store).names(), set(&["a", "b"]));
    let mut named = Client::new();
    named.send(req(CDS).sub(&["a", "b"]));
    assert_eq!(named.one(&store).names(), set(&["a", "b"]));

    // After reconnecting with IRV {a:v1, b:v1}, upstream resends nothing for a and removes b.
    let changes = upstream(&mut store, CDS, &[], &["b"], true);
    assert_eq!(
        changes.names.iter().map(|n| &**n).collect::<Vec<_>>(),
        vec!["b"]
    );
    assert!(
        matches!(store.lookup(CDS, "a"), Lookup::Present(r) if r.version == "v1"),
        "a must stay valid"
    );
    assert_eq!(store.lookup(CDS, "b"), Lookup::Absent);

    for client in [&mut wild, &mut named] {
        client.notify(&changes);
        let r = client.one(&store);
        assert!(r.resources.is_empty(), "a is not resent: {r:?}");
        assert_eq!(r.removed(), set(&["b"]));
    }
}

#[test]
fn c08_invalid_upstream_response_changes_nothing() {
    let mut store = synced_store(CDS, &[("a", "1"), ("b", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    client.one(&store);
    let snapshot = |s: &Store| -> Vec<(String, String, Bytes)> {
        s.resources(CDS)
            .map(|r| (r.name.to_string(), r.version.clone(), r.encoded.clone()))
            .collect()
    };
    let before = snapshot(&store);
    let irv_before = store.initial_versions(CDS, |_| true);

    let both_names = Resource {
        resource_name: Some(ResourceName {
            name: "c".into(),
            dynamic_parameter_constraints: None,
        }),
        ..resource_msg(CDS, "c", "1")
    };
    let heartbeat_wrong_version = Resource {
        resource: None,
        ..resource_msg(CDS, "a", "9")
    };
    let invalid: Vec<(&str, Vec<Bytes>, Vec<String>)> = vec![
        (
            "duplicate name",
            vec![res(CDS, "a", "2"), res(CDS, "a", "3")],
            vec![],
        ),
        (
            "added and removed",
            vec![res(CDS, "a", "2")],
            vec!["a".into()],
        ),
        (
            "type mismatch",
            vec![res(CDS, "c", "1"), res(EDS, "a", "2")],
            vec!["b".into()],
        ),
        (
            "name and resource_name",
            vec![res(CDS, "a", "2"), both_names.encode_to_vec().into()],
            vec![],
        ),
        (
            "malformed",
            vec![res(CDS, "a", "2"), Bytes::from_static(&[0xff, 0xff])],
            vec!["b".into()],
        ),
        (
            "heartbeat with a different version",
            vec![
                res(CDS, "b", "2"),
                heartbeat_wrong_version.encode_to_vec().into(),
            ],
            vec![],
        ),
    ];
    for (what, resources, removed) in invalid {
        let result = store.apply_delta(CDS, resources, removed, true);
        assert!(result.is_err(), "{what}: must be rejected, got {result:?}");
        assert_eq!(snapshot(&store), before, "{what}: store changed");
        assert_eq!(store.initial_versions(CDS, |_| true), irv_before, "{what}");
        assert_eq!(store.lookup(CDS, "c"), Lookup::Unknown, "{what}");
        client.none(&store);
    }

    // A rejected first response does not mark a wildcard type as synced either.
    let mut cold = Store::new();
    let result = cold.apply_delta(
        LDS,
        vec![res(LDS, "l", "1"), res(LDS, "l", "1")],
        vec![],
        true,
    );
    assert!(result.is_err());
    assert!(!cold.wildcard_synced(LDS));
    let mut waiting = Client::new();
    waiting.send(req(LDS));
    waiting.none(&cold);
}

// ---------------------------------------------------------------------------------------------
// D. Caching
// ---------------------------------------------------------------------------------------------

#[test]
fn d09_cold_store_is_not_authoritative_absence() {
    let mut store = Store::new();
    let mut client = Client::new();
    client.send(req(CDS).irv(&[("a", "v1"), ("b", "v1")]));
    // Not synced: no removal (and nothing else) yet.
    client.none(&store);

    // An explicit, non-wildcard upstream answer for another name does not sync the wildcard.
    let changes = upstream(&mut store, CDS, &[("x", "1")], &[], false);
    client.notify(&changes);
    for r in client.drain(&store) {
        assert!(r.removed.is_empty(), "{r:?}");
    }

    // The wildcard sync: b is gone, a is unchanged.
    let changes = upstream(&mut store, CDS, &[("a", "v1")], &[], true);
    assert!(changes.wildcard_synced_now);
    client.notify(&changes);
    let out = client.drain(&store);
    let removed: Vec<&str> = out
        .iter()
        .flat_map(|r| r.removed.iter().map(String::as_str))
        .collect();
    assert_eq!(removed, vec!["b"], "{out:?}");
    assert!(
        out.iter().all(|r| !r.mentions("a")),
        "a is unchanged: {out:?}"
    );
    client.none(&store);

    // Explicit names: no removal until the upstream answers for that name.
    let mut store = Store::new();
    let mut client = Client::new();
    client.send(req(EDS).sub(&["e1", "e2"]).irv(&[("e1", "1"), ("e2", "1")]));
    client.none(&store);
    let changes = upstream(&mut store, EDS, &[("e1", "1")], &[], false);
    client.notify(&changes);
    client.none(&store);
    let changes = upstream(&mut store, EDS, &[], &["e2"], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert!(r.resources.is_empty(), "{r:?}");
    assert_eq!(r.removed(), set(&["e2"]));
}

#[test]
fn d09_wildcard_sync_not_inferred_from_answer_to_earlier_explicit_subscribe() {
    // Through GroupState: the group holds an explicit CDS "x" upstream; then a wildcard
    // subscriber reconnects with IRV before the "*" subscribe has even been sent upstream. The next
    // upstream CDS response answers "x", not the wildcard, so it must not count as the sync.
    let now = Instant::now();
    let mut group = GroupState::new(Duration::ZERO);
    let mut named = Client::new();
    let e = named.send(req(CDS).sub(&["x"]));
    group.apply_effects(1, &e, now);
    assert_eq!(
        upstream_changes(&mut group),
        vec![(CDS.to_string(), vec!["x".to_string()], vec![])]
    );

    let mut wild = Client::new();
    let e = wild.send(req(CDS).irv(&[("a", "v1"), ("b", "v1")]));
    group.apply_effects(2, &e, now);
    wild.none(group.store());

    // The upstream answers the earlier "x" subscribe; "*" is still unsent.
    let changes = group
        .apply_upstream(
            CDS,
            adsrelay::xds::UpstreamUpdate {
                resources: vec![res(CDS, "x", "1")],
                removed: vec![],
                ..Default::default()
            },
        )
        .unwrap();
    named.notify(&changes);
    assert_eq!(named.one(group.store()).versions(), map(&[("x", "1")]));
    wild.notify(&changes);
    for r in wild.drain(group.store()) {
        assert!(
            r.removed.is_empty(),
            "D9: removal before the wildcard sync: {r:?}"
        );
    }

    // Now the wildcard subscribe goes out and is answered: only then is b gone.
    assert_eq!(
        upstream_changes(&mut group),
        vec![(CDS.to_string(), vec![WILDCARD.to_string()], vec![])]
    );
    let changes = group
        .apply_upstream(
            CDS,
            adsrelay::xds::UpstreamUpdate {
                resources: vec![res(CDS, "a", "v1"), res(CDS, "x", "1")],
                removed: vec![],
                ..Default::default()
            },
        )
        .unwrap();
    wild.notify(&changes);
    let removed: BTreeSet<String> = wild
        .drain(group.store())
        .into_iter()
        .flat_map(|r| r.removed)
        .collect();
    assert_eq!(removed, BTreeSet::from(["b".to_string()]));
}

// ---------------------------------------------------------------------------------------------
// Issue 13: after a NACK the relay's record of what the client holds is what it held before
// ---------------------------------------------------------------------------------------------

/// The record the relay keeps (what CSDS and /debug/clients report) for `name`.
fn held(client: &Client, type_url: &str, name: &str) -> Option<String> {
    client
        .stream
        .known_version(type_url, name)
        .map(str::to_string)
}

#[test]
fn a31_nack_restores_the_held_version_and_a7_still_resends() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "v1"), ("bar", "v1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo", "bar"]));
    let r = client.one(&store);
    client.send(req(EDS).ack(&r.nonce));
    let changes = upstream(&mut store, EDS, &[("foo", "v2")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    client.send(req(EDS).nack(&r.nonce, "bad foo"));
    assert_eq!(held(&client, EDS, "foo").as_deref(), Some("v1"));
    assert_eq!(held(&client, EDS, "bar").as_deref(), Some("v1"));
    let snap = client.stream.view(true);
    assert_eq!(
        snap[0].resources,
        vec![("bar".into(), "v1".into()), ("foo".into(), "v1".into())]
    );
    assert_eq!(snap[0].rejected, vec![("foo".into(), "v2".into())]);

    // A7: a re-subscribe resends the current version; accepted, it is held.
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("foo", "v2")]));
    client.send(req(EDS).ack(&r.nonce));
    assert_eq!(held(&client, EDS, "foo").as_deref(), Some("v2"));
    assert!(client.stream.view(true)[0].rejected.is_empty());
}

#[test]
fn a12_nacked_removal_keeps_the_resource_held() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "v1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    client.send(req(EDS).ack(&r.nonce));
    let changes = upstream(&mut store, EDS, &[], &["foo"], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.removed(), set(&["foo"]));
    client.send(req(EDS).nack(&r.nonce, "no"));
    assert_eq!(held(&client, EDS, "foo").as_deref(), Some("v1"));
    // Not repeated while nothing changes (A31); a new version is sent.
    client.stream.mark_all_pending(EDS);
    client.none(&store);
    let changes = upstream(&mut store, EDS, &[("foo", "v3")], &[], false);
    client.notify(&changes);
    assert_eq!(client.one(&store).versions(), map(&[("foo", "v3")]));
}

#[test]
fn a17_nack_of_an_earlier_response_in_flight_restores_only_its_names() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("a", "1"), ("b", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["a", "b"]));
    let r = client.one(&store);
    client.send(req(EDS).ack(&r.nonce));
    // Two responses in flight: a@2 then b@2.
    let changes = upstream(&mut store, EDS, &[("a", "2")], &[], false);
    client.notify(&changes);
    let first = client.one(&store);
    let changes = upstream(&mut store, EDS, &[("b", "2")], &[], false);
    client.notify(&changes);
    let second = client.one(&store);
    assert_eq!(second.versions(), map(&[("b", "2")]));
    // The client rejects the first and accepts the second, in order.
    client.send(req(EDS).nack(&first.nonce, "bad a"));
    client.send(req(EDS).ack(&second.nonce));
    assert_eq!(held(&client, EDS, "a").as_deref(), Some("1"));
    assert_eq!(held(&client, EDS, "b").as_deref(), Some("2"));
}

#[test]
fn a11_record_after_nack_matches_the_reconnect_irv() {
    // What the relay records after a NACK is what the client would report on reconnect.
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("foo", "v1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).sub(&["foo"]));
    let r = client.one(&store);
    client.send(req(EDS).ack(&r.nonce));
    let changes = upstream(&mut store, EDS, &[("foo", "v2")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    client.send(req(EDS).nack(&r.nonce, "bad"));

    let mut reconnected = Client::new();
    reconnected.send(req(EDS).sub(&["foo"]).irv(&[("foo", "v1")]));
    assert_eq!(
        client.stream.view(true)[0].resources,
        reconnected.stream.view(true)[0].resources
    );
    // The new stream sends v2 (A11: changed); the old one does not repeat it (A31).
    assert_eq!(reconnected.one(&store).versions(), map(&[("foo", "v2")]));
    client.stream.mark_all_pending(EDS);
    client.none(&store);
}

#[test]
fn a31_nacked_wildcard_removal_is_not_repeated() {
    // A wildcard client reconnects claiming b, which the upstream no longer has (A12).
    let store = synced_store(CDS, &[("a", "v1")]);
    let mut client = Client::new();
    client.send(req(CDS).irv(&[("a", "v1"), ("b", "v1")]));
    let r = client.one(&store);
    assert_eq!(r.removed(), set(&["b"]));
    // The client rejects the removal: it keeps b, and the removal is not sent again while
    // nothing changes, even when the type is looked at again.
    client.send(req(CDS).nack(&r.nonce, "no"));
    assert_eq!(held(&client, CDS, "b").as_deref(), Some("v1"));
    client.stream.mark_all_pending(CDS);
    client.none(&store);
}

#[test]
fn f12_request_over_the_subscription_limit_leaves_the_stream_as_it_was() {
    let store = synced_store(CDS, &[("a", "1"), ("b", "1"), ("c", "1")]);
    let mut s = DeltaStream::new();
    let e = s
        .on_request_within(&req(CDS).sub(&["a", "b"]).0, 0, 2, 3)
        .unwrap();
    assert_eq!(e.acquire.len(), 2);
    let held = s.subscriptions();
    let view = s.view(true);
    // Two more would make four: refused, and nothing of it is taken in (so closing the stream
    // releases exactly what the group holds for it).
    let refused = s.on_request_within(&req(CDS).sub(&["c", "d"]).0, 2, 2, 3);
    assert!(
        matches!(
            refused,
            Err(ProtocolError::TooManySubscriptions { total: 4, max: 3 })
        ),
        "{refused:?}"
    );
    assert_eq!(s.subscriptions(), held);
    assert_eq!(s.view(true), view);
    // Re-listing what it holds plus one stays within the limit.
    let e = s
        .on_request_within(&req(CDS).sub(&["a", "c"]).0, 2, 2, 3)
        .unwrap();
    assert_eq!(e.acquire.len(), 1);
    assert!(s.next_response(&store).is_some());
}
