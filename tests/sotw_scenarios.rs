//! Conformance scenarios for the state-of-the-world downstream protocol core (xds-conformance.md
//! section B, plus D8 and D9), driven directly through `SotwStream` and `Store`: no sockets, no
//! tokio. Every test asserts what a client would observe: the names, versions, `version_info`,
//! type URLs and nonces of the `DiscoveryResponse`s, the ACK attribution of requests, and the
//! subscription changes the relay forwards upstream.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use adsrelay::pb::core::Node;
use adsrelay::pb::discovery::{DiscoveryRequest, Resource, ResourceLocator};
use adsrelay::pb::rpc::Status;
use adsrelay::pb::wire;
use adsrelay::xds::resource::RESOURCE_TYPE_URL;
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

/// The body of a test resource: it depends on name and version, so a new version is a content
/// change, and a client can read both back from an unwrapped `Any`.
fn body(name: &str, version: &str) -> Vec<u8> {
    format!("{name}@{version}").into_bytes()
}

/// An encoded upstream `Resource{name, version, resource: Any{type_url, body}}`.
fn res(type_url: &str, name: &str, version: &str) -> Bytes {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: body(name, version),
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// An entry for `Store::complete`.
fn cached(type_url: &str, name: &str, version: &str) -> (String, CachedResource) {
    (
        type_url.to_string(),
        CachedResource::decode(res(type_url, name, version)).expect("valid resource"),
    )
}

/// Simulates one upstream (Delta) response into the store.
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

/// A SotW `DiscoveryRequest` builder.
struct Req(DiscoveryRequest);

fn req(type_url: &str) -> Req {
    Req(DiscoveryRequest {
        type_url: type_url.into(),
        ..Default::default()
    })
}

impl Req {
    fn names(mut self, names: &[&str]) -> Self {
        self.0
            .resource_names
            .extend(names.iter().map(|n| n.to_string()));
        self
    }

    fn locators(mut self, names: &[&str]) -> Self {
        self.0
            .resource_locators
            .extend(names.iter().map(|n| ResourceLocator {
                name: n.to_string(),
                ..Default::default()
            }));
        self
    }

    /// `version_info` and `response_nonce`, no `error_detail`: an ACK if `nonce` is current.
    fn ack(mut self, version: &str, nonce: &str) -> Self {
        self.0.version_info = version.into();
        self.0.response_nonce = nonce.into();
        self
    }

    /// A NACK: the last accepted `version_info`, the rejected nonce, and an `error_detail`.
    fn nack(mut self, version: &str, nonce: &str, message: &str) -> Self {
        self.0.version_info = version.into();
        self.0.response_nonce = nonce.into();
        self.0.error_detail = Some(Status {
            code: 3,
            message: message.into(),
            details: vec![],
        });
        self
    }
}

/// A `DiscoveryResponse` as the client decodes it.
#[derive(Debug, Clone)]
struct Resp {
    type_url: String,
    version: String,
    /// (name, version) in the order sent.
    resources: Vec<(String, String)>,
    /// Per resource: sent as an `Any` wrapping `envoy.service.discovery.v3.Resource`.
    wrapped: Vec<bool>,
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

    fn mentions(&self, name: &str) -> bool {
        self.resources.iter().any(|(n, _)| n == name)
    }
}

/// Reads name and version back from a test body (`name@version`).
fn parse_body(value: &[u8]) -> (String, String) {
    let text = std::str::from_utf8(value).expect("utf-8 body");
    let (name, version) = text.split_once('@').expect("name@version body");
    (name.to_string(), version.to_string())
}

/// Decodes one response as an Envoy or gRPC client would, checking the rules every SotW response
/// must obey: a non-empty nonce, a non-empty `version_info` (B7), each `Any`'s `type_url` equal to
/// the response `type_url` unless it wraps a `Resource` whose payload then matches (B15), and no
/// duplicate names (B20).
fn decode(r: wire::DiscoveryResponse) -> Resp {
    assert!(!r.nonce.is_empty(), "response without a nonce: {r:?}");
    assert!(!r.type_url.is_empty(), "response without a type_url");
    assert!(
        !r.version_info.is_empty(),
        "B7: response with an empty version_info: {r:?}"
    );
    let mut resources = Vec::new();
    let mut wrapped = Vec::new();
    for bytes in &r.resources {
        let any = prost_types::Any::decode(&bytes[..]).expect("resource decodes as an Any");
        if any.type_url == RESOURCE_TYPE_URL {
            let inner = Resource::decode(&any.value[..]).expect("wrapped Resource decodes");
            let payload = inner.resource.expect("wrapped Resource has a payload");
            assert_eq!(
                payload.type_url, r.type_url,
                "B15: wrapped payload type_url mismatch"
            );
            let (name, version) = parse_body(&payload.value);
            assert_eq!(inner.name, name, "wrapped Resource name");
            assert_eq!(inner.version, version, "wrapped Resource version");
            resources.push((name, version));
            wrapped.push(true);
        } else {
            assert_eq!(any.type_url, r.type_url, "B15: Any type_url mismatch");
            resources.push(parse_body(&any.value));
            wrapped.push(false);
        }
    }
    let distinct: HashSet<&str> = resources.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        distinct.len(),
        resources.len(),
        "B20: duplicate name in resources: {resources:?}"
    );
    Resp {
        type_url: r.type_url,
        version: r.version_info,
        resources,
        wrapped,
        nonce: r.nonce,
    }
}

/// One downstream SotW stream, remembering every nonce it received to check uniqueness.
struct Client {
    stream: SotwStream,
    nonces: HashSet<String>,
}

impl Client {
    fn new() -> Self {
        Self::with(SotwStream::new(false))
    }

    fn with(stream: SotwStream) -> Self {
        Client {
            stream,
            nonces: HashSet::new(),
        }
    }

    fn send(&mut self, r: Req) -> RequestEffects {
        self.stream.on_request(&r.0).expect("request accepted")
    }

    /// Every response the stream has to send now, decoded.
    fn drain(&mut self, store: &Store) -> Vec<Resp> {
        let mut out = Vec::new();
        while let Some(r) = self.stream.next_response(store) {
            let r = decode(r);
            assert!(
                self.nonces.insert(r.nonce.clone()),
                "nonce {:?} reused on the stream",
                r.nonce
            );
            out.push(r);
            assert!(out.len() < 64, "stream keeps producing responses: {out:?}");
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

fn set<'a>(names: &[&'a str]) -> BTreeSet<&'a str> {
    names.iter().copied().collect()
}

fn map<'a>(pairs: &[(&'a str, &'a str)]) -> BTreeMap<&'a str, &'a str> {
    pairs.iter().copied().collect()
}

fn strs(locators: &[adsrelay::xds::Locator]) -> Vec<&str> {
    locators.iter().map(|l| &*l.name).collect()
}

fn node(features: &[&str]) -> Node {
    Node {
        id: "sidecar~10.0.0.1~app.ns~ns.svc.cluster.local".into(),
        client_features: features.iter().map(|f| f.to_string()).collect(),
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------------------------
// B. SotW downstream
// ---------------------------------------------------------------------------------------------

#[test]
fn b01_full_state_cluster_on_single_change() {
    let mut store = synced_store(CDS, &[("a", "1"), ("b", "1"), ("c", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    let r1 = client.one(&store);
    assert_eq!(r1.versions(), map(&[("a", "1"), ("b", "1"), ("c", "1")]));
    client.send(req(CDS).ack(&r1.version, &r1.nonce));
    client.none(&store);

    // Only b changes: the response still carries a and c.
    let changes = upstream(&mut store, CDS, &[("b", "2")], &[], true);
    client.notify(&changes);
    let r2 = client.one(&store);
    assert_eq!(r2.type_url, CDS);
    assert_eq!(r2.versions(), map(&[("a", "1"), ("b", "2"), ("c", "1")]));
    assert_ne!(
        r2.version, r1.version,
        "B7: content changed, version_info must"
    );
    client.send(req(CDS).ack(&r2.version, &r2.nonce));

    // An authoritative upstream deletion is the only way a cluster drops out of the full state.
    let changes = upstream(&mut store, CDS, &[], &["c"], true);
    client.notify(&changes);
    let r3 = client.one(&store);
    assert_eq!(r3.versions(), map(&[("a", "1"), ("b", "2")]));
    assert_ne!(r3.version, r2.version);
}

#[test]
fn b01_full_state_listener_on_single_change() {
    let mut store = Store::new();
    upstream(
        &mut store,
        LDS,
        &[("l1", "1"), ("l2", "1"), ("l3", "1"), ("other", "1")],
        &[],
        false,
    );
    let mut client = Client::new();
    client.send(req(LDS).names(&["l1", "l2", "l3"]));
    let r1 = client.one(&store);
    assert_eq!(r1.versions(), map(&[("l1", "1"), ("l2", "1"), ("l3", "1")]));
    client.send(
        req(LDS)
            .names(&["l1", "l2", "l3"])
            .ack(&r1.version, &r1.nonce),
    );
    client.none(&store);

    let changes = upstream(&mut store, LDS, &[("l2", "2")], &[], false);
    client.notify(&changes);
    let r2 = client.one(&store);
    assert_eq!(r2.type_url, LDS);
    assert_eq!(r2.versions(), map(&[("l1", "1"), ("l2", "2"), ("l3", "1")]));
    assert_ne!(r2.version, r1.version);
    client.send(
        req(LDS)
            .names(&["l1", "l2", "l3"])
            .ack(&r2.version, &r2.nonce),
    );

    // A listener nobody on this stream asked for changes: nothing to say.
    let changes = upstream(&mut store, LDS, &[("other", "2")], &[], false);
    client.notify(&changes);
    client.none(&store);
}

#[test]
fn b02_no_full_state_while_explicit_name_unknown() {
    let mut store = Store::new();
    upstream(&mut store, CDS, &[("a", "1")], &[], false);
    let mut client = Client::new();
    let effects = client.send(req(CDS).names(&["a", "c"]));
    // B23: the cache miss is forwarded upstream at once.
    assert_eq!(strs(&effects.acquire), vec!["a", "c"]);
    // c is unknown: a response with only a would delete c at the client.
    client.none(&store);

    // Changes to a do not unblock it either.
    let changes = upstream(&mut store, CDS, &[("a", "2")], &[], false);
    client.notify(&changes);
    client.none(&store);

    // The upstream answers for c: now the full state.
    let changes = upstream(&mut store, CDS, &[("c", "1")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("a", "2"), ("c", "1")]));
}

#[test]
fn b02_unknown_name_answered_when_upstream_says_it_does_not_exist() {
    let mut store = Store::new();
    upstream(&mut store, LDS, &[("a", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(LDS).names(&["a", "gone"]));
    client.none(&store);

    // Authoritative absence is an answer: the full state is just a.
    let changes = upstream(&mut store, LDS, &[], &["gone"], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("a", "1")]));
}

#[test]
fn b02_no_full_state_while_wildcard_not_synced() {
    // The store holds a (another client asked for it by name) but the wildcard set is not synced.
    let mut store = Store::new();
    upstream(&mut store, CDS, &[("a", "1")], &[], false);
    let mut client = Client::new();
    let effects = client.send(req(CDS));
    assert_eq!(strs(&effects.acquire), vec![WILDCARD]);
    client.none(&store);

    // D9: the upstream's first wildcard response is what makes the set authoritative.
    let changes = upstream(&mut store, CDS, &[("a", "1"), ("b", "1")], &[], true);
    assert!(changes.wildcard_synced_now);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("a", "1"), ("b", "1")]));
}

#[test]
fn b02_transient_cache_loss_delays_rather_than_omits() {
    // Explicit names: c is evicted (upstream interest lapsed) while the client still holds it.
    let mut store = Store::new();
    upstream(&mut store, CDS, &[("a", "1"), ("c", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(CDS).names(&["a", "c"]));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["a", "c"]));
    client.send(req(CDS).names(&["a", "c"]).ack(&r.version, &r.nonce));

    store.forget(CDS, "c");
    let changes = upstream(&mut store, CDS, &[("a", "2")], &[], false);
    client.notify(&changes);
    client.stream.mark_all_pending(CDS);
    client.none(&store);
    let changes = upstream(&mut store, CDS, &[("c", "1")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("a", "2"), ("c", "1")]));

    // Wildcard: the upstream wildcard subscription lapses and the store forgets the set.
    let mut store = synced_store(LDS, &[("l1", "1"), ("l2", "1")]);
    let mut client = Client::new();
    client.send(req(LDS));
    let r = client.one(&store);
    assert_eq!(r.names(), set(&["l1", "l2"]));
    client.send(req(LDS).ack(&r.version, &r.nonce));
    store.forget_wildcard(LDS, |_| false);
    client.stream.mark_all_pending(LDS);
    client.none(&store);
    // A partial refill is not a sync.
    let changes = upstream(&mut store, LDS, &[("l1", "1")], &[], false);
    client.notify(&changes);
    client.none(&store);
    let changes = upstream(&mut store, LDS, &[("l1", "1"), ("l2", "2")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("l1", "1"), ("l2", "2")]));
}

#[test]
fn b03_eds_partial_and_deletion_sends_nothing() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "1"), ("y", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).names(&["x", "y"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("x", "1"), ("y", "1")]));
    client.send(req(EDS).names(&["x", "y"]).ack(&r.version, &r.nonce));

    // Only y changes: only y is sent.
    let changes = upstream(&mut store, EDS, &[("y", "2")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("y", "2")]));
    client.send(req(EDS).names(&["x", "y"]).ack(&r.version, &r.nonce));

    // EDS cannot signal deletion; an empty response would be a no-op: send nothing.
    let changes = upstream(&mut store, EDS, &[], &["x"], false);
    client.notify(&changes);
    client.none(&store);

    // x comes back: the client must get it.
    let changes = upstream(&mut store, EDS, &[("x", "1")], &[], false);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("x", "1")]));
}

#[test]
fn b04_newly_requested_names_resent_even_if_unchanged() {
    let store = {
        let mut s = Store::new();
        upstream(&mut s, EDS, &[("x", "1"), ("y", "1")], &[], false);
        s
    };
    let mut client = Client::new();
    client.send(req(EDS).names(&["x", "y"]));
    let r1 = client.one(&store);
    assert_eq!(r1.versions(), map(&[("x", "1"), ("y", "1")]));
    client.send(req(EDS).names(&["x", "y"]).ack(&r1.version, &r1.nonce));
    client.none(&store);

    // The client drops x (as Envoy does: same version_info, last nonce).
    let effects = client.send(req(EDS).names(&["y"]).ack(&r1.version, &r1.nonce));
    assert_eq!(strs(&effects.release), vec!["x"]);
    let mut last = r1.clone();
    for r in client.drain(&store) {
        assert!(!r.mentions("x"), "x is no longer requested: {r:?}");
        last = r;
    }

    // And asks for x again, still at the version it got x at: x is resent.
    let effects = client.send(req(EDS).names(&["x", "y"]).ack(&last.version, &last.nonce));
    assert_eq!(strs(&effects.acquire), vec!["x"]);
    let out = client.drain(&store);
    assert!(
        out.iter().any(|r| r.versions().get("x") == Some(&"1")),
        "B4: x must be resent: {out:?}"
    );

    // Also for a full-state type: names newly added are sent although unchanged.
    let store = Store::complete(vec![cached(LDS, "a", "1"), cached(LDS, "b", "1")]);
    let mut client = Client::new();
    client.send(req(LDS).names(&["a"]));
    let r = client.one(&store);
    client.send(req(LDS).names(&["a"]).ack(&r.version, &r.nonce));
    client.send(req(LDS).names(&["a", "b"]).ack(&r.version, &r.nonce));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("a", "1"), ("b", "1")]));
}

#[test]
fn b05_legacy_wildcard_and_its_exit() {
    let mut store = synced_store(LDS, &[("A", "1"), ("B", "1")]);
    let mut client = Client::new();

    // (1) [] on a new stream: wildcard.
    let effects = client.send(req(LDS));
    assert_eq!(strs(&effects.acquire), vec![WILDCARD]);
    let r1 = client.one(&store);
    assert_eq!(r1.versions(), map(&[("A", "1"), ("B", "1")]));

    // (2) ["*","A"]: wildcard plus A. A is newly requested, so it is (re)sent, in the full state.
    let effects = client.send(req(LDS).names(&["*", "A"]).ack(&r1.version, &r1.nonce));
    assert_eq!(strs(&effects.acquire), vec!["A"]);
    assert!(effects.release.is_empty(), "{effects:?}");
    let r2 = client.one(&store);
    assert_eq!(r2.versions(), map(&[("A", "1"), ("B", "1")]));

    // (3) ["A"]: the wildcard ends, A stays. Any answer now is the full state of {A}.
    let effects = client.send(req(LDS).names(&["A"]).ack(&r2.version, &r2.nonce));
    assert_eq!(strs(&effects.release), vec![WILDCARD]);
    assert!(effects.acquire.is_empty(), "{effects:?}");
    let mut last = r2.clone();
    for r in client.drain(&store) {
        assert_eq!(r.names(), set(&["A"]), "{r:?}");
        last = r;
    }
    // Wildcard-only listeners no longer flow; A does.
    let changes = upstream(&mut store, LDS, &[("B", "2"), ("C", "1")], &[], true);
    client.notify(&changes);
    client.none(&store);
    let changes = upstream(&mut store, LDS, &[("A", "2")], &[], true);
    client.notify(&changes);
    let r3 = client.one(&store);
    assert_eq!(r3.versions(), map(&[("A", "2")]));
    assert_ne!(r3.version, last.version);

    // (4) [] after names were seen: unsubscribe all, not wildcard.
    let effects = client.send(req(LDS).ack(&r3.version, &r3.nonce));
    assert!(effects.acquire.is_empty(), "not a wildcard: {effects:?}");
    assert_eq!(strs(&effects.release), vec!["A"]);
    client.none(&store);
    assert!(client.stream.subscriptions().is_empty());
    let changes = upstream(&mut store, LDS, &[("A", "3"), ("D", "1")], &[], true);
    client.notify(&changes);
    client.none(&store);
}

#[test]
fn b06_exact_names_and_full_requested_set() {
    let mut store = Store::complete(vec![
        cached(LDS, "svc.example.com:443", "1"),
        cached(LDS, "svc.example.com", "1"),
        cached(LDS, "A", "1"),
        cached(LDS, "B", "1"),
        cached(LDS, "other", "1"),
    ]);
    let mut client = Client::new();
    client.send(req(LDS).names(&["svc.example.com:443"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("svc.example.com:443", "1")]));

    // The subscription grows to [A, B]: each response carries both.
    let effects = client.send(req(LDS).names(&["A", "B"]).ack(&r.version, &r.nonce));
    assert_eq!(strs(&effects.acquire), vec!["A", "B"]);
    assert_eq!(strs(&effects.release), vec!["svc.example.com:443"]);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("A", "1"), ("B", "1")]));
    client.send(req(LDS).names(&["A", "B"]).ack(&r.version, &r.nonce));

    let changes = upstream(&mut store, LDS, &[("B", "2")], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("A", "1"), ("B", "2")]));
    client.send(req(LDS).names(&["A", "B"]).ack(&r.version, &r.nonce));

    // Extra resources are not pushed.
    let changes = upstream(&mut store, LDS, &[("other", "2")], &[], true);
    client.notify(&changes);
    client.none(&store);
}

#[test]
fn b07_version_info_semantics_and_nack() {
    let mut store = synced_store(CDS, &[("c1", "1"), ("c2", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    let r1 = client.one(&store);
    let v1 = r1.version.clone();
    let e = client.send(req(CDS).ack(&v1, &r1.nonce));
    assert_eq!(
        e.ack,
        AckStatus::Ack {
            nonce: r1.nonce.clone()
        }
    );

    // Identical content again, or a full re-evaluation: no new version, no response.
    let changes = upstream(&mut store, CDS, &[("c1", "1")], &[], true);
    client.notify(&changes);
    client.stream.mark_all_pending(CDS);
    client.none(&store);

    // Changed content: a new, non-empty version_info.
    let changes = upstream(&mut store, CDS, &[("c1", "2")], &[], true);
    client.notify(&changes);
    let r2 = client.one(&store);
    assert_ne!(r2.version, v1);

    // NACK: old version_info, the new nonce, error_detail. Not an ACK; nothing is resent.
    let e = client.send(req(CDS).nack(&v1, &r2.nonce, "bad cluster c1"));
    assert_eq!(
        e.ack,
        AckStatus::Nack {
            nonce: r2.nonce.clone(),
            message: "bad cluster c1".into()
        }
    );
    client.none(&store);
    client.stream.mark_all_pending(CDS);
    client.none(&store);
    let changes = upstream(&mut store, CDS, &[("c1", "2")], &[], true);
    client.notify(&changes);
    client.none(&store);

    // The next content change is sent, with a version distinct from both earlier ones.
    let changes = upstream(&mut store, CDS, &[("c1", "3")], &[], true);
    client.notify(&changes);
    let r3 = client.one(&store);
    assert_eq!(r3.versions(), map(&[("c1", "3"), ("c2", "1")]));
    assert_ne!(r3.version, v1);
    assert_ne!(r3.version, r2.version);

    // NACK detection uses error_detail, not version comparison: a NACK carrying the new version
    // is a NACK, an ACK carrying an old version is an ACK.
    let e = client.send(req(CDS).nack(&r3.version, &r3.nonce, "still bad"));
    assert!(matches!(e.ack, AckStatus::Nack { .. }), "{:?}", e.ack);
    client.none(&store);
    let changes = upstream(&mut store, CDS, &[("c2", "2")], &[], true);
    client.notify(&changes);
    let r4 = client.one(&store);
    let e = client.send(req(CDS).ack(&v1, &r4.nonce));
    assert_eq!(
        e.ack,
        AckStatus::Ack {
            nonce: r4.nonce.clone()
        }
    );
    client.none(&store);
}

#[test]
fn b08_first_request_answered_even_if_empty() {
    // An authoritative store with no clusters and no listeners.
    let store = Store::complete(Vec::new());
    let mut client = Client::new();
    client.send(req(CDS));
    client.send(req(LDS).names(&["*"]));
    let out = client.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    let types: BTreeSet<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
    assert_eq!(types, set(&[CDS, LDS]));
    for r in &out {
        assert!(r.resources.is_empty(), "{r:?}");
    }
    client.none(&store);

    // A synced relay cache with zero clusters, and a gRPC LDS name that does not exist.
    let mut store = synced_store(CDS, &[]);
    upstream(&mut store, LDS, &[], &["svc:443"], false);
    let mut client = Client::new();
    client.send(req(CDS));
    client.send(req(LDS).names(&["svc:443"]));
    let out = client.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    for r in &out {
        assert!(r.resources.is_empty(), "{r:?}");
    }
}

#[test]
fn b08_first_request_on_cold_cache_answered_at_sync() {
    let mut store = Store::new();
    let mut client = Client::new();
    client.send(req(CDS));
    client.none(&store);
    let changes = upstream(&mut store, CDS, &[], &[], true);
    client.notify(&changes);
    let r = client.one(&store);
    assert_eq!(r.type_url, CDS);
    assert!(r.resources.is_empty(), "{r:?}");
    client.send(req(CDS).ack(&r.version, &r.nonce));
    client.none(&store);
}

#[test]
fn b08_reconnect_with_old_version_and_empty_nonce_gets_current_state() {
    let mut store = synced_store(CDS, &[("a", "1"), ("b", "1")]);
    upstream(&mut store, EDS, &[("a", "1")], &[], false);

    // First stream: V7 for CDS, Ve for EDS.
    let mut first = Client::new();
    first.send(req(CDS));
    first.send(req(EDS).names(&["a"]));
    let out = first.drain(&store);
    let v7 = out
        .iter()
        .find(|r| r.type_url == CDS)
        .unwrap()
        .version
        .clone();
    let ve = out
        .iter()
        .find(|r| r.type_url == EDS)
        .unwrap()
        .version
        .clone();

    // Reconnect with nothing changed: old version_info, empty nonce. Answered anyway.
    let mut second = Client::new();
    second.send(req(CDS).ack(&v7, ""));
    second.send(req(EDS).names(&["a"]).ack(&ve, ""));
    let out = second.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    let cds = out.iter().find(|r| r.type_url == CDS).expect("CDS answer");
    assert_eq!(cds.versions(), map(&[("a", "1"), ("b", "1")]));
    assert_eq!(cds.version, v7, "D8: same content, same version_info");
    let eds = out.iter().find(|r| r.type_url == EDS).expect("EDS answer");
    assert_eq!(eds.versions(), map(&[("a", "1")]));

    // Reconnect after a change: the current state, with a new version.
    let changes = upstream(&mut store, CDS, &[("b", "2")], &[], true);
    assert!(!changes.is_empty());
    let mut third = Client::new();
    third.send(req(CDS).names(&["a", "b"]).ack(&v7, ""));
    let r = third.one(&store);
    assert_eq!(r.versions(), map(&[("a", "1"), ("b", "2")]));
    assert_ne!(r.version, v7);
}

#[test]
fn b08_first_request_of_type_answered_whatever_its_nonce() {
    // A client that sends a leftover nonce (from an earlier stream) with an empty version_info on
    // the first CDS request of a new stream: still the first request, still owed an answer, even
    // an empty one.
    let store = Store::complete(Vec::new());
    let mut client = Client::new();
    let e = client.send(req(CDS).ack("", "17"));
    assert!(
        !matches!(e.ack, AckStatus::Ack { .. } | AckStatus::Nack { .. }),
        "a nonce this stream never sent acknowledges nothing: {:?}",
        e.ack
    );
    let r = client.one(&store);
    assert_eq!(r.type_url, CDS);
    assert!(r.resources.is_empty(), "{r:?}");
}

#[test]
fn b09_stale_nonce_applies_names_and_sends_new_ones() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "1"), ("z", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(EDS).names(&["x"]));
    let n4 = client.one(&store);
    let changes = upstream(&mut store, EDS, &[("x", "2")], &[], false);
    client.notify(&changes);
    let n5 = client.one(&store);

    // Stale nonce n4 with a changed resource_names: not an ACK of n5; z is applied and sent.
    let e = client.send(req(EDS).names(&["x", "z"]).ack(&n4.version, &n4.nonce));
    assert_eq!(
        e.ack,
        AckStatus::Stale {
            nonce: n4.nonce.clone()
        }
    );
    assert_eq!(strs(&e.acquire), vec!["z"]);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("z", "1")]));

    // A stale NACK is not a NACK either.
    let e = client.send(req(EDS).names(&["x", "z"]).nack("", &n5.nonce, "late"));
    assert!(matches!(e.ack, AckStatus::Stale { .. }), "{:?}", e.ack);
    client.none(&store);

    // Stale nonce with only a removal: applied, nothing sent.
    let e = client.send(req(EDS).names(&["x"]).ack(&n4.version, &n4.nonce));
    assert!(matches!(e.ack, AckStatus::Stale { .. }), "{:?}", e.ack);
    assert_eq!(strs(&e.release), vec!["z"]);
    client.none(&store);
    // z really is gone from the subscription.
    let changes = upstream(&mut store, EDS, &[("z", "2")], &[], false);
    client.notify(&changes);
    client.none(&store);

    // The same on a full-state type: the added name is sent, in the full state.
    let store = Store::complete(vec![cached(CDS, "a", "1"), cached(CDS, "b", "1")]);
    let mut client = Client::new();
    client.send(req(CDS).names(&["a"]));
    let old = client.one(&store);
    client.send(req(CDS).names(&["a"]).ack(&old.version, &old.nonce));
    client.send(req(CDS).names(&["a", "b"]).ack(&old.version, &old.nonce));
    let cur = client.one(&store);
    assert_eq!(cur.versions(), map(&[("a", "1"), ("b", "1")]));
    let e = client.send(req(CDS).names(&["a"]).ack(&old.version, &old.nonce));
    assert!(matches!(e.ack, AckStatus::Stale { .. }), "{:?}", e.ack);
    client.none(&store);
}

#[test]
fn b10_resubscribe_after_emptied_type() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "1")], &[], false);

    // Re-subscription with an old nonce.
    let mut client = Client::new();
    client.send(req(EDS).names(&["x"]));
    let n1 = client.one(&store);
    let changes = upstream(&mut store, EDS, &[("x", "2")], &[], false);
    client.notify(&changes);
    let n2 = client.one(&store);
    client.send(req(EDS).names(&["x"]).ack(&n2.version, &n2.nonce));
    let e = client.send(req(EDS).ack(&n2.version, &n2.nonce));
    assert_eq!(strs(&e.release), vec!["x"]);
    client.none(&store);
    let e = client.send(req(EDS).names(&["x"]).ack(&n1.version, &n1.nonce));
    assert_eq!(strs(&e.acquire), vec!["x"]);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("x", "2")]));

    // Re-subscription with an empty nonce.
    let mut client = Client::new();
    client.send(req(EDS).names(&["x"]));
    let r = client.one(&store);
    client.send(req(EDS).names(&["x"]).ack(&r.version, &r.nonce));
    client.send(req(EDS).ack(&r.version, &r.nonce));
    client.none(&store);
    let e = client.send(req(EDS).names(&["x"]));
    assert_eq!(strs(&e.acquire), vec!["x"]);
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("x", "2")]));
}

#[test]
fn b11_later_requests_supersede() {
    let store = {
        let mut s = Store::new();
        upstream(
            &mut s,
            EDS,
            &[("c1", "1"), ("c2", "1"), ("c3", "1"), ("c4", "1")],
            &[],
            false,
        );
        s
    };
    let mut client = Client::new();
    // Envoy adds watches one by one; the relay reads all three before it can write.
    client.send(req(EDS).names(&["c1"]));
    client.send(req(EDS).names(&["c1", "c2"]));
    client.send(req(EDS).names(&["c1", "c2", "c3"]));
    let r = client.one(&store);
    assert_eq!(r.versions(), map(&[("c1", "1"), ("c2", "1"), ("c3", "1")]));
    client.send(
        req(EDS)
            .names(&["c1", "c2", "c3"])
            .ack(&r.version, &r.nonce),
    );

    // A name requested and withdrawn before the relay could answer is not sent.
    client.send(
        req(EDS)
            .names(&["c1", "c2", "c3", "c4"])
            .ack(&r.version, &r.nonce),
    );
    client.send(req(EDS).names(&["c1"]).ack(&r.version, &r.nonce));
    let out = client.drain(&store);
    assert!(out.len() <= 1, "one response at most: {out:?}");
    for r in &out {
        assert!(!r.mentions("c4"), "c4 was superseded: {r:?}");
        assert!(r.names().is_subset(&set(&["c1"])), "{r:?}");
    }
}

#[test]
fn b12_no_response_after_ack_when_nothing_changed() {
    let mut store = synced_store(CDS, &[("c1", "1")]);
    upstream(&mut store, EDS, &[("c1", "1")], &[], false);
    let mut client = Client::new();
    client.send(req(CDS));
    client.send(req(EDS).names(&["c1"]));
    let out = client.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    for r in &out {
        let names: Vec<&str> = if r.type_url == EDS {
            vec!["c1"]
        } else {
            vec![]
        };
        let e = client.send(req(&r.type_url).names(&names).ack(&r.version, &r.nonce));
        assert!(matches!(e.ack, AckStatus::Ack { .. }), "{:?}", e.ack);
    }
    // One ACK per response, nothing changed: silence.
    client.none(&store);

    // The upstream repeats identical content; a full re-evaluation finds nothing new.
    let changes = upstream(&mut store, CDS, &[("c1", "1")], &[], true);
    client.notify(&changes);
    let changes = upstream(&mut store, EDS, &[("c1", "1")], &[], false);
    client.notify(&changes);
    client.stream.mark_all_pending(CDS);
    client.stream.mark_all_pending(EDS);
    client.none(&store);
}

#[test]
fn b13_eds_rerequest_after_cds_update_is_answered() {
    let mut store = synced_store(CDS, &[("c", "1")]);
    upstream(&mut store, EDS, &[("c", "1")], &[], false);
    let mut envoy = Client::new();
    envoy.send(req(CDS));
    let cds1 = envoy.one(&store);
    envoy.send(req(CDS).ack(&cds1.version, &cds1.nonce));
    envoy.send(req(EDS).names(&["c"]));
    let eds1 = envoy.one(&store);
    assert_eq!(eds1.versions(), map(&[("c", "1")]));
    envoy.send(req(EDS).names(&["c"]).ack(&eds1.version, &eds1.nonce));
    envoy.none(&store);

    // CDS modifies c; Envoy ACKs and, warming c, re-issues its unchanged EDS request.
    let changes = upstream(&mut store, CDS, &[("c", "2")], &[], true);
    envoy.notify(&changes);
    let cds2 = envoy.one(&store);
    assert_eq!(cds2.versions(), map(&[("c", "2")]));
    envoy.send(req(CDS).ack(&cds2.version, &cds2.nonce));
    envoy.none(&store);
    let e = envoy.send(req(EDS).names(&["c"]).ack(&eds1.version, &eds1.nonce));
    assert!(
        !matches!(e.ack, AckStatus::Nack { .. } | AckStatus::Stale { .. }),
        "{:?}",
        e.ack
    );
    let r = envoy.one(&store);
    assert_eq!(r.type_url, EDS);
    assert_eq!(r.versions(), map(&[("c", "1")]));
    assert_eq!(
        r.version, eds1.version,
        "content unchanged, version unchanged"
    );
}

#[test]
fn b15_any_type_url_equals_response_type_url() {
    let mut store = synced_store(CDS, &[("c1", "1")]);
    upstream(&mut store, EDS, &[("c1", "1")], &[], false);
    upstream(&mut store, LDS, &[("l1", "1")], &[], true);
    upstream(&mut store, RDS, &[("r1", "1")], &[], false);
    for wrap in [false, true] {
        let mut client = Client::with(SotwStream::new(wrap));
        client.send(req(CDS));
        client.send(req(EDS).names(&["c1"]));
        client.send(req(LDS));
        client.send(req(RDS).names(&["r1"]));
        let out = client.drain(&store);
        assert_eq!(out.len(), 4, "{out:?}");
        for r in &out {
            assert_eq!(r.resources.len(), 1, "{r:?}");
            assert_eq!(r.wrapped, vec![wrap], "{r:?}");
        }
        // Raw check as well, independent of decode().
        let mut client = Client::with(SotwStream::new(wrap));
        client.send(req(EDS).names(&["c1"]));
        let raw = client.stream.next_response(&store).expect("EDS response");
        assert_eq!(raw.type_url, EDS);
        for bytes in &raw.resources {
            let any = prost_types::Any::decode(&bytes[..]).unwrap();
            if wrap {
                assert_eq!(any.type_url, RESOURCE_TYPE_URL);
                let inner = Resource::decode(&any.value[..]).unwrap();
                assert_eq!(inner.resource.unwrap().type_url, EDS);
            } else {
                assert_eq!(any.type_url, EDS);
            }
        }
    }
}

#[test]
fn b16_wrapping_only_with_client_feature() {
    let store = Store::complete(vec![cached(CDS, "c1", "1"), cached(EDS, "c1", "1")]);
    let cases: [(&[&str], bool); 5] = [
        (&[], false),
        (&["envoy.lb.does_not_support_overprovisioning"], false),
        (&["xds.config.resource-in-sotw"], true),
        (&["xds.config.supports-resource-in-sotw"], true),
        (
            &[
                "envoy.lrs.supports_send_all_clusters",
                "xds.config.resource-in-sotw",
            ],
            true,
        ),
    ];
    for (features, wrapped) in cases {
        let mut client = Client::with(SotwStream::for_node(&node(features), Default::default()));
        client.send(req(CDS));
        client.send(req(EDS).names(&["c1"]));
        let out = client.drain(&store);
        assert_eq!(out.len(), 2, "{features:?}: {out:?}");
        for r in &out {
            assert_eq!(r.versions(), map(&[("c1", "1")]), "{features:?}");
            assert_eq!(r.wrapped, vec![wrapped], "{features:?}: {r:?}");
        }
    }
    // Unwrapped, the Any is exactly the upstream payload.
    let mut client = Client::with(SotwStream::for_node(&node(&[]), Default::default()));
    client.send(req(CDS));
    let raw = client.stream.next_response(&store).unwrap();
    let any = prost_types::Any::decode(&raw.resources[0][..]).unwrap();
    assert_eq!(
        any,
        prost_types::Any {
            type_url: CDS.into(),
            value: body("c1", "1")
        }
    );
}

#[test]
fn b20_no_duplicate_names() {
    let store = Store::complete(vec![
        cached(LDS, "a", "1"),
        cached(LDS, "b", "1"),
        cached(CDS, "a", "1"),
        cached(CDS, "b", "1"),
    ]);
    let mut client = Client::new();
    // Duplicates within resource_names, across resource_names and resource_locators, and an
    // explicit name that is also in the wildcard set.
    let e = client.send(req(LDS).names(&["a", "a", "b"]).locators(&["b", "a"]));
    assert_eq!(strs(&e.acquire), vec!["a", "b"]);
    client.send(req(CDS).names(&["*", "a", "a"]));
    let out = client.drain(&store);
    assert_eq!(out.len(), 2, "{out:?}");
    for r in &out {
        assert_eq!(r.resources.len(), 2, "{r:?}");
        assert_eq!(r.versions(), map(&[("a", "1"), ("b", "1")]));
    }
}

#[test]
fn a22_equivalent_never_send_unrequested_type() {
    let mut store = synced_store(CDS, &[("c1", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    let r = client.one(&store);
    client.send(req(CDS).ack(&r.version, &r.nonce));

    let changes = upstream(&mut store, RDS, &[("r1", "1")], &[], true);
    client.notify(&changes);
    client.stream.mark_all_pending(RDS);
    let changes = upstream(&mut store, EDS, &[("e1", "1")], &["e2"], false);
    client.notify(&changes);
    let changes = upstream(&mut store, LDS, &[], &[], true);
    assert!(changes.wildcard_synced_now);
    client.notify(&changes);
    client.none(&store);
    assert!(client
        .stream
        .subscriptions()
        .iter()
        .all(|(t, _)| &**t == CDS));
}

#[test]
fn b14_cross_type_order_within_one_drain() {
    let store = Store::complete(vec![
        cached(CDS, "X", "1"),
        cached(EDS, "X", "1"),
        cached(LDS, "L", "1"),
        cached(RDS, "R", "1"),
    ]);
    let mut client = Client::new();
    // Requests arrive in the "wrong" order; responses still go CDS, EDS, LDS, RDS.
    client.send(req(RDS).names(&["R"]));
    client.send(req(LDS));
    client.send(req(EDS).names(&["X"]));
    client.send(req(CDS));
    let out = client.drain(&store);
    let order: Vec<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
    assert_eq!(order, vec![CDS, EDS, LDS, RDS]);
}

// ---------------------------------------------------------------------------------------------
// D. Versions
// ---------------------------------------------------------------------------------------------

#[test]
fn d08_independent_streams_same_content_same_version() {
    // Two replicas filled in a different order, two clients naming in a different order.
    let mut replica1 = Store::new();
    upstream(&mut replica1, CDS, &[("a", "1"), ("b", "7")], &[], true);
    upstream(&mut replica1, EDS, &[("a", "3"), ("b", "4")], &[], false);
    let mut replica2 = Store::new();
    upstream(&mut replica2, EDS, &[("b", "4")], &[], false);
    upstream(&mut replica2, EDS, &[("a", "3")], &[], false);
    upstream(&mut replica2, CDS, &[("b", "7"), ("a", "1")], &[], true);

    let mut c1 = Client::new();
    c1.send(req(CDS));
    c1.send(req(EDS).names(&["a", "b"]));
    let out1 = c1.drain(&replica1);
    let mut c2 = Client::with(SotwStream::new(true));
    c2.send(req(EDS).names(&["b", "a"]));
    c2.send(req(CDS));
    let out2 = c2.drain(&replica2);
    assert_eq!(out1.len(), 2);
    assert_eq!(out2.len(), 2);
    for t in [CDS, EDS] {
        let v1 = &out1.iter().find(|r| r.type_url == t).unwrap().version;
        let v2 = &out2.iter().find(|r| r.type_url == t).unwrap().version;
        assert_eq!(v1, v2, "{t}: same content, same version_info");
    }

    // Different content, different version.
    let mut replica3 = synced_store(CDS, &[("a", "1"), ("b", "8")]);
    let mut c3 = Client::new();
    c3.send(req(CDS));
    let v3 = c3.one(&replica3).version;
    let cds1 = &out1.iter().find(|r| r.type_url == CDS).unwrap().version;
    assert_ne!(&v3, cds1);
    // And back to the same content: the same version as everyone else.
    let changes = upstream(&mut replica3, CDS, &[("b", "7")], &[], true);
    c3.notify(&changes);
    assert_eq!(&c3.one(&replica3).version, cds1);
}

// ---------------------------------------------------------------------------------------------
// Issue 13: after a NACK the client keeps its previous state, and so does the relay's record
// ---------------------------------------------------------------------------------------------

#[test]
fn b07_version_info_after_nack_describes_the_state_the_client_kept() {
    let mut store = Store::new();
    upstream(&mut store, EDS, &[("x", "1"), ("y", "1")], &[], false);
    let mut accepts = Client::new();
    let mut rejects = Client::new();
    for c in [&mut accepts, &mut rejects] {
        c.send(req(EDS).names(&["x", "y"]));
        let r = c.one(&store);
        c.send(req(EDS).names(&["x", "y"]).ack(&r.version, &r.nonce));
    }
    let changes = upstream(&mut store, EDS, &[("x", "2")], &[], false);
    accepts.notify(&changes);
    rejects.notify(&changes);
    let a = accepts.one(&store);
    accepts.send(req(EDS).names(&["x", "y"]).ack(&a.version, &a.nonce));
    let r = rejects.one(&store);
    let kept = r.version.clone();
    rejects.send(req(EDS).names(&["x", "y"]).nack("", &r.nonce, "bad x"));
    assert_eq!(
        rejects.stream.view(true)[0].resources,
        vec![("x".into(), "1".into()), ("y".into(), "1".into())]
    );

    let changes = upstream(&mut store, EDS, &[("y", "2")], &[], false);
    accepts.notify(&changes);
    rejects.notify(&changes);
    let a = accepts.one(&store);
    let r = rejects.one(&store);
    assert_eq!(
        r.versions(),
        map(&[("y", "2")]),
        "x@2 is not repeated (A31)"
    );
    // One holds x@2, the other x@1: their versions must differ (B7, D8).
    assert_ne!(a.version, r.version);
    assert_ne!(r.version, kept);
}

#[test]
fn b07_full_state_nack_keeps_the_previous_state_on_record() {
    let mut store = synced_store(CDS, &[("c1", "1"), ("c2", "1")]);
    let mut client = Client::new();
    client.send(req(CDS));
    let r1 = client.one(&store);
    client.send(req(CDS).ack(&r1.version, &r1.nonce));
    let changes = upstream(&mut store, CDS, &[("c1", "2")], &[], true);
    client.notify(&changes);
    let r2 = client.one(&store);
    client.send(req(CDS).nack(&r1.version, &r2.nonce, "bad c1"));
    let snap = client.stream.view(true);
    assert_eq!(
        snap[0].resources,
        vec![("c1".into(), "1".into()), ("c2".into(), "1".into())]
    );
    assert_eq!(snap[0].rejected, vec![("c1".into(), "2".into())]);

    // The upstream rolls c1 back: the client already holds exactly that, nothing to send.
    let changes = upstream(&mut store, CDS, &[("c1", "1")], &[], true);
    client.notify(&changes);
    client.none(&store);

    // A real change is sent as the full state, with the version_info of a client that accepted
    // it from the start.
    let changes = upstream(&mut store, CDS, &[("c2", "2")], &[], true);
    client.notify(&changes);
    let r3 = client.one(&store);
    assert_eq!(r3.versions(), map(&[("c1", "1"), ("c2", "2")]));
    let mut fresh = Client::new();
    fresh.send(req(CDS));
    assert_eq!(fresh.one(&store).version, r3.version);
}

// ---------------------------------------------------------------------------------------------
// Issue 17: a wildcard-only subscriber's full state is built once per change and shared
// ---------------------------------------------------------------------------------------------

/// A wildcard-only client takes the shared full state; a client that also names one of the
/// clusters holds the same set and builds its own. Both must see exactly the same responses
/// through adds, changes, removals, a NACK and an ACK.
#[test]
fn b01_shared_wildcard_state_matches_a_per_client_build() {
    let mut store = synced_store(CDS, &[("c1", "1"), ("c2", "1"), ("c3", "1")]);
    let mut shared = Client::new();
    shared.send(req(CDS));
    let mut own = Client::new();
    own.send(req(CDS).names(&["*", "c1"]));
    let (a, b) = (shared.one(&store), own.one(&store));
    assert_eq!(a.resources, b.resources);
    assert_eq!(a.version, b.version);
    shared.send(req(CDS).ack(&a.version, &a.nonce));
    own.send(req(CDS).names(&["*", "c1"]).ack(&b.version, &b.nonce));

    type Step<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let steps: [Step; 3] = [
        (&[("c2", "2"), ("c4", "1")], &[]),
        (&[], &["c3"]),
        (&[("c1", "5")], &["c4"]),
    ];
    let mut last = a;
    for (add, remove) in steps {
        let changes = upstream(&mut store, CDS, add, remove, true);
        shared.notify(&changes);
        own.notify(&changes);
        let (a, b) = (shared.one(&store), own.one(&store));
        assert_eq!(a.versions(), b.versions(), "after +{add:?} -{remove:?}");
        assert_eq!(a.version, b.version, "same state, same version_info");
        assert_ne!(a.version, last.version);
        shared.send(req(CDS).ack(&a.version, &a.nonce));
        own.send(req(CDS).names(&["*", "c1"]).ack(&b.version, &b.nonce));
        last = a;
    }
    assert_eq!(last.versions(), map(&[("c1", "5"), ("c2", "2")]));

    // Nothing changed for the type: neither is sent anything.
    let changes = upstream(&mut store, EDS, &[("e", "1")], &[], false);
    shared.notify(&changes);
    shared.none(&store);

    // A NACKed state is not sent again into an unchanged store (A31), shared or not.
    let changes = upstream(&mut store, CDS, &[("c2", "3")], &[], true);
    shared.notify(&changes);
    own.notify(&changes);
    let (a, b) = (shared.one(&store), own.one(&store));
    assert_eq!(a.version, b.version);
    shared.send(req(CDS).nack(&last.version, &a.nonce, "bad c2"));
    own.send(
        req(CDS)
            .names(&["*", "c1"])
            .nack(&last.version, &b.nonce, "bad c2"),
    );
    let changes = upstream(&mut store, EDS, &[("e", "2")], &[], false);
    shared.notify(&changes);
    shared.none(&store);
    // The next real change reaches both alike again.
    let changes = upstream(&mut store, CDS, &[("c1", "6")], &[], true);
    shared.notify(&changes);
    own.notify(&changes);
    let (a, b) = (shared.one(&store), own.one(&store));
    assert_eq!(a.versions(), map(&[("c1", "6"), ("c2", "3")]));
    assert_eq!(a.versions(), b.versions());
    assert_eq!(a.version, b.version);
}
