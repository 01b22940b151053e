//! Delta-only discovery through the protocol core (xds-conformance.md A25–A29, on-demand): xdstp
//! names and their canonical form, glob collections, VHDS aliases, and names subscribed
//! mid-stream. Driven through `GroupState` and `DeltaStream` the way the relay's adapter drives
//! them (requests -> group effects; upstream responses -> affected streams -> responses), with
//! no sockets. Every test asserts what a client or the upstream would observe.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, Resource};
use adsrelay::pb::wire;
use adsrelay::xds::*;
use bytes::Bytes;
use prost::Message;

const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const VHDS: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

fn resource(type_url: &str, name: &str, version: &str, aliases: &[&str]) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: format!("{name}@{version}").into_bytes(),
        }),
        aliases: aliases.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

fn res(type_url: &str, name: &str, version: &str) -> Bytes {
    resource(type_url, name, version, &[])
        .encode_to_vec()
        .into()
}

/// What a client decodes from one response.
#[derive(Debug, Clone, Default)]
struct Resp {
    /// name -> (version, aliases, has a body)
    resources: BTreeMap<String, (String, Vec<String>, bool)>,
    removed: BTreeSet<String>,
    /// (name, google.rpc code)
    errors: Vec<(String, i32)>,
}

impl Resp {
    fn names(&self) -> BTreeSet<&str> {
        self.resources.keys().map(String::as_str).collect()
    }
}

fn decode(r: wire::DeltaDiscoveryResponse) -> Resp {
    assert!(!r.nonce.is_empty());
    let mut out = Resp::default();
    for b in &r.resources {
        let x = Resource::decode(&b[..]).expect("resource decodes");
        let prev = out
            .resources
            .insert(x.name.clone(), (x.version, x.aliases, x.resource.is_some()));
        assert!(prev.is_none(), "A20: duplicate {}", x.name);
    }
    out.removed = r.removed_resources.into_iter().collect();
    out.errors = r
        .resource_errors
        .into_iter()
        .map(|e| {
            (
                e.resource_name.map(|n| n.name).unwrap_or_default(),
                e.error_detail.map_or(0, |s| s.code),
            )
        })
        .collect();
    out
}

/// One group with its downstream streams, driven like the relay's adapter drives them.
struct World {
    group: GroupState,
    streams: BTreeMap<Slot, DeltaStream>,
    now: Instant,
}

type Upstream = Vec<(String, Vec<String>, Vec<String>)>;

impl World {
    fn new() -> Self {
        World {
            group: GroupState::new(Duration::ZERO),
            streams: BTreeMap::new(),
            now: Instant::now(),
        }
    }

    fn request(&mut self, id: Slot, r: DeltaDiscoveryRequest) {
        let s = self.streams.entry(id).or_default();
        let effects = s.on_request(&r).expect("request accepted");
        let seq = self.group.apply_effects(id, &effects, self.now).seq;
        s.subscribed_at(seq);
    }

    fn sub(&mut self, id: Slot, type_url: &str, names: &[&str]) {
        self.request(id, req(type_url, names, &[]));
    }

    fn unsub(&mut self, id: Slot, type_url: &str, names: &[&str]) {
        self.request(id, req(type_url, &[], names));
    }

    /// One upstream response; notifies the affected streams.
    fn upstream(&mut self, type_url: &str, resources: Vec<Bytes>, removed: &[&str]) {
        let changes = self
            .group
            .apply_upstream(
                type_url,
                UpstreamUpdate {
                    resources,
                    removed: removed.iter().map(|n| n.to_string()).collect(),
                    ..Default::default()
                },
            )
            .expect("upstream response accepted");
        for id in self.group.affected(&changes) {
            if let Some(s) = self.streams.get_mut(&id) {
                s.on_change(&changes);
            }
        }
    }

    /// Every response stream `id` sends now.
    fn drain(&mut self, id: Slot) -> Vec<Resp> {
        let s = self.streams.get_mut(&id).expect("stream");
        let mut out = Vec::new();
        while let Some(r) = s.next_response(self.group.store()) {
            out.push(decode(r));
            assert!(out.len() < 16, "stream keeps producing responses");
        }
        out
    }

    fn one(&mut self, id: Slot) -> Resp {
        let mut out = self.drain(id);
        assert_eq!(out.len(), 1, "expected one response, got {out:?}");
        out.remove(0)
    }

    fn none(&mut self, id: Slot) {
        let out = self.drain(id);
        assert!(out.is_empty(), "expected silence, got {out:?}");
    }

    /// Subscription changes sent upstream since the last call: (type, subscribe, unsubscribe).
    fn upstream_changes(&mut self) -> Upstream {
        self.group
            .take_upstream_changes()
            .into_iter()
            .map(|c| {
                (
                    c.type_url,
                    c.subscribe.iter().map(|l| l.name.to_string()).collect(),
                    c.unsubscribe.iter().map(|l| l.name.to_string()).collect(),
                )
            })
            .collect()
    }
}

fn req(type_url: &str, sub: &[&str], unsub: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: type_url.into(),
        resource_names_subscribe: sub.iter().map(|n| n.to_string()).collect(),
        resource_names_unsubscribe: unsub.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}

fn set<'a>(names: &[&'a str]) -> BTreeSet<&'a str> {
    names.iter().copied().collect()
}

// ---------------------------------------------------------------------------------------------
// A29: xdstp context-parameter normalization
// ---------------------------------------------------------------------------------------------

const X_BA: &str = "xdstp://a/envoy.config.listener.v3.Listener/x?b=2&a=1";
const X_AB: &str = "xdstp://a/envoy.config.listener.v3.Listener/x?a=1&b=2";

#[test]
fn a29_differently_ordered_params_are_one_resource_emitted_canonically() {
    let mut w = World::new();
    w.sub(1, LDS, &[X_BA]);
    // The upstream is asked for the canonical form.
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![X_AB.to_string()], vec![])]
    );
    // A second client spelling it the other way shares that one upstream subscription.
    w.sub(2, LDS, &[X_AB]);
    assert_eq!(w.upstream_changes(), vec![]);
    // The upstream answers with yet another spelling: both clients get it, canonically named.
    w.upstream(
        LDS,
        vec![res(
            LDS,
            "xdstp://a/envoy.config.listener.v3.Listener/x?b=2&a=1",
            "v1",
        )],
        &[],
    );
    for id in [1, 2] {
        let r = w.one(id);
        assert_eq!(r.names(), set(&[X_AB]));
    }
    // Unsubscribing with a third spelling (same set) releases the subscription.
    w.unsub(1, LDS, &[X_BA]);
    w.unsub(2, LDS, &[X_BA]);
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![], vec![X_AB.to_string()])]
    );
}

#[test]
fn a29_upstream_removal_in_another_spelling_reaches_the_client() {
    let mut w = World::new();
    w.sub(1, LDS, &[X_AB]);
    w.upstream(LDS, vec![res(LDS, X_AB, "v1")], &[]);
    w.one(1);
    w.upstream(LDS, vec![], &[X_BA]);
    assert_eq!(w.one(1).removed, [X_AB.to_string()].into());
}

#[test]
fn a29_initial_resource_versions_are_matched_canonically() {
    let mut w = World::new();
    w.sub(9, LDS, &[X_AB]);
    w.upstream(LDS, vec![res(LDS, X_AB, "v1")], &[]);
    // A reconnecting client reports the version it holds under another spelling: nothing to send.
    let mut r = req(LDS, &[X_BA], &[]);
    r.initial_resource_versions.insert(X_BA.into(), "v1".into());
    w.request(1, r);
    w.none(1);
}

#[test]
fn a29_malformed_xdstp_name_gets_an_error_for_that_name_only() {
    let mut w = World::new();
    let bad = "xdstp://a/envoy.config.listener.v3.Listener/x?k=1&k=2";
    w.sub(1, LDS, &[bad, X_AB]);
    w.sub(2, LDS, &[X_AB]);
    // The malformed name never goes upstream.
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![X_AB.to_string()], vec![])]
    );
    let r = w.one(1);
    assert_eq!(r.errors, vec![(bad.to_string(), 3)], "INVALID_ARGUMENT");
    assert!(r.resources.is_empty());
    w.none(2);
    // The rest of both streams works.
    w.upstream(LDS, vec![res(LDS, X_AB, "v1")], &[]);
    assert_eq!(w.one(1).names(), set(&[X_AB]));
    assert_eq!(w.one(2).names(), set(&[X_AB]));
}

// ---------------------------------------------------------------------------------------------
// A28: xdstp glob collections
// ---------------------------------------------------------------------------------------------

const GLOB: &str = "xdstp://auth/envoy.config.listener.v3.Listener/foo/*?node_type=ingress";
const FOO_A: &str = "xdstp://auth/envoy.config.listener.v3.Listener/foo/a?node_type=ingress";
const FOO_B: &str = "xdstp://auth/envoy.config.listener.v3.Listener/foo/b?node_type=ingress";
const FOO_EGRESS: &str = "xdstp://auth/envoy.config.listener.v3.Listener/foo/c?node_type=egress";
const FOO_DEEP: &str = "xdstp://auth/envoy.config.listener.v3.Listener/foo/x/y?node_type=ingress";

#[test]
fn a28_glob_delivers_the_collection_and_follows_it() {
    let mut w = World::new();
    w.sub(1, LDS, &[GLOB]);
    // The upstream is asked for the collection itself.
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![GLOB.to_string()], vec![])]
    );
    w.none(1);
    // An xdstp-aware upstream expands it; it also sent (extra) names outside the collection.
    w.upstream(
        LDS,
        vec![
            res(LDS, FOO_A, "v1"),
            res(LDS, FOO_B, "v1"),
            res(LDS, FOO_EGRESS, "v1"),
            res(LDS, FOO_DEEP, "v1"),
        ],
        &[],
    );
    assert_eq!(w.one(1).names(), set(&[FOO_A, FOO_B]));
    // An update of one member, then its removal.
    w.upstream(LDS, vec![res(LDS, FOO_A, "v2")], &[]);
    let r = w.one(1);
    assert_eq!(r.resources[FOO_A].0, "v2");
    assert_eq!(r.names(), set(&[FOO_A]));
    w.upstream(LDS, vec![], &[FOO_A]);
    assert_eq!(w.one(1).removed, [FOO_A.to_string()].into());
    // The last member goes: the collection is empty, and the client is told so, once.
    w.upstream(LDS, vec![], &[FOO_B]);
    let r = w.one(1);
    assert_eq!(r.removed, [FOO_B.to_string(), GLOB.to_string()].into());
    w.none(1);
    // A new member arrives.
    w.upstream(LDS, vec![res(LDS, FOO_B, "v3")], &[]);
    assert_eq!(w.one(1).names(), set(&[FOO_B]));
}

#[test]
fn a28_empty_collection_is_removed_once_the_upstream_answers() {
    let mut w = World::new();
    w.sub(1, LDS, &[GLOB]);
    // Nothing known yet: no premature removal.
    w.none(1);
    w.upstream(LDS, vec![], &[GLOB]);
    assert_eq!(w.one(1).removed, [GLOB.to_string()].into());
}

#[test]
fn a28_clients_share_one_upstream_subscription_per_collection() {
    let mut w = World::new();
    for id in 1..=5 {
        w.sub(id, LDS, &[GLOB]);
    }
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![GLOB.to_string()], vec![])]
    );
    assert_eq!(w.group.interest().upstream_subscription_count(), 1);
    w.upstream(LDS, vec![res(LDS, FOO_A, "v1")], &[]);
    for id in 1..=5 {
        assert_eq!(w.one(id).names(), set(&[FOO_A]));
    }
    // A late joiner is served from the cache, with no new upstream subscription.
    w.sub(6, LDS, &[GLOB]);
    assert_eq!(w.one(6).names(), set(&[FOO_A]));
    assert_eq!(w.upstream_changes(), vec![]);
    // The collection is unsubscribed upstream when the last client leaves; the cache forgets it.
    for id in 1..=6 {
        w.unsub(id, LDS, &[GLOB]);
    }
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![], vec![GLOB.to_string()])]
    );
    assert!(matches!(
        w.group.store().lookup(LDS, FOO_A),
        Lookup::Unknown
    ));
}

#[test]
fn a28_unsubscribed_glob_stops_updates_but_a_named_member_stays() {
    let mut w = World::new();
    w.sub(1, LDS, &[GLOB, FOO_A]);
    w.upstream(LDS, vec![res(LDS, FOO_A, "v1"), res(LDS, FOO_B, "v1")], &[]);
    assert_eq!(w.one(1).names(), set(&[FOO_A, FOO_B]));
    w.unsub(1, LDS, &[GLOB]);
    w.none(1);
    w.upstream(LDS, vec![res(LDS, FOO_A, "v2"), res(LDS, FOO_B, "v2")], &[]);
    // Only the name subscribed by itself is still delivered (FOO_B is no longer kept).
    let r = w.one(1);
    assert_eq!(r.names(), set(&[FOO_A]));
}

#[test]
fn a28_glob_spelled_with_other_param_order_is_the_same_collection() {
    let mut w = World::new();
    let glob_ba = "xdstp://auth/envoy.config.listener.v3.Listener/foo/*?z=1&node_type=ingress";
    let member = "xdstp://auth/envoy.config.listener.v3.Listener/foo/a?node_type=ingress&z=1";
    w.sub(1, LDS, &[glob_ba]);
    w.upstream(
        LDS,
        vec![res(
            LDS,
            "xdstp://auth/envoy.config.listener.v3.Listener/foo/a?z=1&node_type=ingress",
            "v1",
        )],
        &[],
    );
    assert_eq!(w.one(1).names(), set(&[member]));
}

// ---------------------------------------------------------------------------------------------
// A25–A27: VHDS aliases
// ---------------------------------------------------------------------------------------------

fn vhost(name: &str, version: &str, aliases: &[&str]) -> Bytes {
    resource(VHDS, name, version, aliases)
        .encode_to_vec()
        .into()
}

/// The upstream's answer for an alias it cannot resolve: name = alias, aliases = [alias], no body.
fn unresolved(alias: &str) -> Bytes {
    Resource {
        name: alias.into(),
        aliases: vec![alias.into()],
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

#[test]
fn a25_subscription_by_alias_gets_the_resource_under_its_name() {
    let mut w = World::new();
    w.sub(1, VHDS, &["rc1/foo.com"]);
    assert_eq!(
        w.upstream_changes(),
        vec![(VHDS.to_string(), vec!["rc1/foo.com".to_string()], vec![])]
    );
    w.upstream(
        VHDS,
        vec![vhost("rc1/vhost_1", "v1", &["rc1/foo.com"])],
        &[],
    );
    let r = w.one(1);
    assert_eq!(r.names(), set(&["rc1/vhost_1"]));
    assert_eq!(
        r.resources["rc1/vhost_1"].1,
        vec!["rc1/foo.com".to_string()]
    );
    // Updates reach the alias subscriber.
    w.upstream(
        VHDS,
        vec![vhost("rc1/vhost_1", "v2", &["rc1/foo.com"])],
        &[],
    );
    assert_eq!(w.one(1).resources["rc1/vhost_1"].0, "v2");
    // A second client subscribing by another alias of the same virtual host is served from the
    // cache once the upstream lists that alias.
    w.upstream(
        VHDS,
        vec![vhost(
            "rc1/vhost_1",
            "v3",
            &["rc1/foo.com", "rc1/www.foo.com"],
        )],
        &[],
    );
    assert_eq!(w.one(1).resources["rc1/vhost_1"].0, "v3");
    w.sub(2, VHDS, &["rc1/www.foo.com"]);
    assert_eq!(w.one(2).names(), set(&["rc1/vhost_1"]));
    // Removal upstream: the alias subscriber is told under the resource's name.
    w.upstream(VHDS, vec![], &["rc1/vhost_1"]);
    assert_eq!(w.one(1).removed, ["rc1/vhost_1".to_string()].into());
    assert_eq!(w.one(2).removed, ["rc1/vhost_1".to_string()].into());
}

#[test]
fn a25_unresolved_alias_is_passed_through_then_resolved() {
    let mut w = World::new();
    w.sub(1, VHDS, &["rc1/bar.com"]);
    w.upstream(VHDS, vec![unresolved("rc1/bar.com")], &[]);
    let r = w.one(1);
    assert_eq!(r.names(), set(&["rc1/bar.com"]));
    let (_, aliases, body) = &r.resources["rc1/bar.com"];
    assert_eq!(aliases, &vec!["rc1/bar.com".to_string()]);
    assert!(!body, "an unresolved alias carries no resource");
    // The virtual host appears later.
    w.upstream(
        VHDS,
        vec![vhost("rc1/vhost_2", "v1", &["rc1/bar.com"])],
        &[],
    );
    assert_eq!(w.one(1).names(), set(&["rc1/vhost_2"]));
}

#[test]
fn a25_unsubscribe_by_alias_or_by_name() {
    let mut w = World::new();
    w.sub(1, VHDS, &["rc1/foo.com"]);
    w.sub(2, VHDS, &["rc1/foo.com"]);
    w.upstream(
        VHDS,
        vec![vhost("rc1/vhost_1", "v1", &["rc1/foo.com"])],
        &[],
    );
    w.one(1);
    w.one(2);
    w.upstream_changes();
    // One client unsubscribes by the alias, the other by the resource's name.
    w.unsub(1, VHDS, &["rc1/foo.com"]);
    w.unsub(2, VHDS, &["rc1/vhost_1"]);
    assert_eq!(
        w.upstream_changes(),
        vec![(VHDS.to_string(), vec![], vec!["rc1/foo.com".to_string()])]
    );
    w.upstream(
        VHDS,
        vec![vhost("rc1/vhost_1", "v2", &["rc1/foo.com"])],
        &[],
    );
    w.none(1);
    w.none(2);
}

#[test]
fn a26_route_configuration_change_resends_its_virtual_hosts() {
    let mut w = World::new();
    w.sub(1, RDS, &["rc1"]);
    w.sub(1, VHDS, &["rc1/foo.com", "rc1/bar.com"]);
    w.sub(2, VHDS, &["rc1/foo.com"]); // no RDS subscription: unaffected
    w.upstream(RDS, vec![res(RDS, "rc1", "r1")], &[]);
    w.upstream(
        VHDS,
        vec![
            vhost("rc1/vhost_1", "v1", &["rc1/foo.com"]),
            vhost("rc1/vhost_2", "v1", &["rc1/bar.com"]),
        ],
        &[],
    );
    let out = w.drain(1);
    assert_eq!(out.len(), 2);
    w.one(2);
    // rc1 changes; the virtual hosts do not: the client still gets them all again, after RDS.
    w.upstream(RDS, vec![res(RDS, "rc1", "r2")], &[]);
    let out = w.drain(1);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out[0].names(), set(&["rc1"]));
    assert_eq!(out[1].names(), set(&["rc1/vhost_1", "rc1/vhost_2"]));
    w.none(2);
}

#[test]
fn a27_first_empty_vhds_request_is_scoped_to_the_clients_route_configurations() {
    let mut w = World::new();
    w.sub(1, RDS, &["rc1"]);
    w.upstream(RDS, vec![res(RDS, "rc1", "r1")], &[]);
    w.one(1);
    w.upstream_changes();
    // Envoy's first, empty VHDS request after receiving rc1 (which has `vhds`).
    w.sub(1, VHDS, &[]);
    assert_eq!(
        w.upstream_changes(),
        vec![(VHDS.to_string(), vec!["*".to_string()], vec![])]
    );
    w.none(1);
    // The upstream answers with every virtual host it has: the client gets rc1's only.
    w.upstream(
        VHDS,
        vec![
            vhost("rc1/vhost_1", "v1", &["rc1/foo.com"]),
            vhost("rc9/vhost_9", "v1", &["rc9/other.com"]),
        ],
        &[],
    );
    assert_eq!(w.one(1).names(), set(&["rc1/vhost_1"]));
    // Out-of-scope changes do not reach it; in-scope ones do.
    w.upstream(
        VHDS,
        vec![vhost("rc9/vhost_9", "v2", &["rc9/other.com"])],
        &[],
    );
    w.none(1);
    w.upstream(VHDS, vec![vhost("rc1/vhost_3", "v1", &[])], &[]);
    assert_eq!(w.one(1).names(), set(&["rc1/vhost_3"]));
    // Another client's unresolved alias is for that client only.
    w.sub(3, VHDS, &["rc1/nope.com"]);
    w.upstream(VHDS, vec![unresolved("rc1/nope.com")], &[]);
    assert_eq!(w.one(3).names(), set(&["rc1/nope.com"]));
    w.none(1);
    // A client with no route configuration gets an empty answer, not the cache's virtual hosts.
    w.sub(2, VHDS, &[]);
    let r = w.one(2);
    assert!(r.resources.is_empty() && r.removed.is_empty(), "{r:?}");
    // Once it subscribes to rc9 and receives it, rc9's virtual hosts follow.
    w.sub(2, RDS, &["rc9"]);
    w.upstream(RDS, vec![res(RDS, "rc9", "r1")], &[]);
    let out = w.drain(2);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out[0].names(), set(&["rc9"]));
    assert_eq!(out[1].names(), set(&["rc9/vhost_9"]));
}

// ---------------------------------------------------------------------------------------------
// On demand (ODCDS, VHDS on demand)
// ---------------------------------------------------------------------------------------------

#[test]
fn on_demand_cluster_is_fetched_and_answered_as_soon_as_it_arrives() {
    let mut w = World::new();
    w.sub(1, CDS, &["a"]);
    w.upstream(CDS, vec![res(CDS, "a", "v1")], &[]);
    w.one(1);
    w.upstream_changes();
    // Mid-stream, the on-demand filter asks for a cluster nobody has asked for yet.
    w.sub(1, CDS, &["od"]);
    assert_eq!(
        w.upstream_changes(),
        vec![(CDS.to_string(), vec!["od".to_string()], vec![])]
    );
    w.none(1);
    w.upstream(CDS, vec![res(CDS, "od", "v1")], &[]);
    assert_eq!(w.one(1).names(), set(&["od"]));
    // Another client asking for it later is answered from the cache at once.
    w.sub(2, CDS, &["od"]);
    assert_eq!(w.one(2).names(), set(&["od"]));
    assert_eq!(w.upstream_changes(), vec![]);
}

#[test]
fn on_demand_missing_name_is_removed_as_soon_as_the_upstream_says_so() {
    let mut w = World::new();
    w.sub(1, CDS, &["missing"]);
    w.none(1);
    w.upstream(CDS, vec![], &["missing"]);
    assert_eq!(w.one(1).removed, ["missing".to_string()].into());
    // A second client asking for it is told at once (the upstream's answer is cached).
    w.sub(2, CDS, &["missing"]);
    assert_eq!(w.one(2).removed, ["missing".to_string()].into());
}

#[test]
fn a28_resubscribed_collection_waits_for_the_upstream_again() {
    let mut w = World::new();
    w.sub(1, LDS, &[GLOB]);
    w.upstream(LDS, vec![res(LDS, FOO_A, "v1")], &[]);
    w.one(1);
    w.upstream(LDS, vec![], &[FOO_A]);
    w.one(1);
    w.unsub(1, LDS, &[GLOB]);
    w.upstream_changes();
    // Subscribed again after the collection lapsed: nothing stale is claimed, the upstream is
    // asked again and its answer is served.
    w.sub(2, LDS, &[GLOB]);
    w.none(2);
    assert_eq!(
        w.upstream_changes(),
        vec![(LDS.to_string(), vec![GLOB.to_string()], vec![])]
    );
    w.upstream(LDS, vec![res(LDS, FOO_B, "v1")], &[]);
    assert_eq!(w.one(2).names(), set(&[FOO_B]));
}

#[test]
fn c04_reconnect_reports_versions_of_collection_members_and_aliased_resources() {
    let mut w = World::new();
    w.sub(1, LDS, &[GLOB]);
    w.upstream(LDS, vec![res(LDS, FOO_A, "v1")], &[]);
    w.sub(1, VHDS, &["rc1/foo.com"]);
    w.upstream(
        VHDS,
        vec![vhost("rc1/vhost_1", "v1", &["rc1/foo.com"])],
        &[],
    );
    let g = &w.group;
    let lds = g.store().initial_versions(LDS, |n| g.keeps(LDS, n));
    assert_eq!(lds.get(FOO_A).map(String::as_str), Some("v1"));
    let vhds = g.store().initial_versions(VHDS, |n| g.keeps(VHDS, n));
    assert_eq!(vhds.get("rc1/vhost_1").map(String::as_str), Some("v1"));
}

#[test]
fn d02_do_not_cache_collection_members_go_only_to_waiting_glob_subscribers() {
    use adsrelay::pb::discovery::resource::CacheControl;
    let mut w = World::new();
    w.sub(1, LDS, &[GLOB]);
    let mut member = resource(LDS, FOO_A, "v1", &[]);
    member.cache_control = Some(CacheControl { do_not_cache: true });
    w.upstream(LDS, vec![member.encode_to_vec().into()], &[]);
    // The client that was waiting gets it.
    assert_eq!(w.one(1).names(), set(&[FOO_A]));
    // A later subscriber of the collection is not served the cached copy: the relay asks the
    // upstream for the collection again instead.
    w.sub(2, LDS, &[GLOB]);
    w.none(2);
    let refetch = w.streams.get_mut(&2).unwrap().take_refetch();
    assert_eq!(
        refetch
            .iter()
            .map(|(t, l)| (t.as_str(), &*l.name))
            .collect::<Vec<_>>(),
        vec![(LDS, GLOB)]
    );
}

// ---------------------------------------------------------------------------------------------
// Property: a glob subscriber's view follows the collection
// ---------------------------------------------------------------------------------------------

/// Spellings the upstream may use for names in and around the collection.
const SPELLINGS: [&str; 6] = [
    FOO_A,
    "xdstp://auth/envoy.config.listener.v3.Listener/foo/a?node_type=ingress",
    FOO_B,
    FOO_EGRESS,
    FOO_DEEP,
    "xdstp://auth/envoy.config.listener.v3.Listener/foo/b?node_type=ingress",
];

#[derive(Debug, Clone)]
enum GlobOp {
    Subscribe,
    Unsubscribe,
    Upstream {
        add: Vec<(usize, u8)>,
        remove: Vec<usize>,
    },
}

fn glob_op() -> impl proptest::strategy::Strategy<Value = GlobOp> {
    use proptest::prelude::*;
    prop_oneof![
        Just(GlobOp::Subscribe),
        Just(GlobOp::Unsubscribe),
        (
            proptest::collection::vec((0..SPELLINGS.len(), 0u8..3), 0..3),
            proptest::collection::vec(0..SPELLINGS.len(), 0..2)
        )
            .prop_map(|(add, remove)| GlobOp::Upstream { add, remove }),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Whatever the upstream sends and however it spells names, a client subscribed to the glob
    /// holds exactly the collection's members the relay holds, under canonical names, and never
    /// anything outside the collection.
    #[test]
    fn glob_subscriber_holds_exactly_the_collection(ops in proptest::collection::vec(glob_op(), 1..30)) {
        let mut w = World::new();
        let mut subscribed = false;
        let mut held: BTreeSet<String> = BTreeSet::new();
        // An unrelated subscriber keeps some names outside the collection wanted.
        w.sub(2, LDS, &[FOO_EGRESS, FOO_DEEP]);
        for op in ops {
            match op {
                GlobOp::Subscribe => {
                    w.sub(1, LDS, &[GLOB]);
                    subscribed = true;
                }
                GlobOp::Unsubscribe if subscribed => {
                    w.unsub(1, LDS, &[GLOB]);
                    subscribed = false;
                    // The client drops what only the glob brought (A9).
                    held.clear();
                }
                GlobOp::Unsubscribe => {}
                GlobOp::Upstream { add, remove } => {
                    let canon = |i: usize| adsrelay::xds::xdstp::canonical(SPELLINGS[i]).unwrap().into_owned();
                    let mut names = BTreeSet::new();
                    let resources = add
                        .iter()
                        .filter(|(i, _)| names.insert(canon(*i)))
                        .map(|(i, v)| res(LDS, SPELLINGS[*i], &v.to_string()))
                        .collect();
                    let removed: Vec<&str> = remove
                        .iter()
                        .filter(|i| !names.contains(&canon(**i)))
                        .map(|i| SPELLINGS[*i])
                        .collect();
                    w.upstream(LDS, resources, &removed);
                }
            }
            if w.streams.contains_key(&1) {
                for r in w.drain(1) {
                    for n in r.removed {
                        held.remove(&n);
                    }
                    held.extend(r.resources.into_keys());
                }
            }
            w.drain(2);
            if subscribed {
                let want: BTreeSet<String> = w
                    .group
                    .store()
                    .collection_members(LDS, GLOB)
                    .map(|n| n.to_string())
                    .collect();
                proptest::prop_assert_eq!(&held, &want);
                proptest::prop_assert!(held.iter().all(|n| n == FOO_A || n == FOO_B));
            }
        }
    }
}
