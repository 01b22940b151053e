//! TP2 dynamic parameters and cache control through a real relay (section D and E scenarios):
//! variant selection per subscriber, constraints sent to locator subscribers and not to
//! plain-name ones, variant removal, upstream locator aggregation, node-metadata parameters, and
//! `do_not_cache` content fetched again for a later subscriber.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use adsrelay::pb::discovery::dynamic_parameter_constraints::single_constraint::ConstraintType;
use adsrelay::pb::discovery::dynamic_parameter_constraints::{SingleConstraint, Type};
use adsrelay::pb::discovery::{
    resource::CacheControl, DeltaDiscoveryRequest, DynamicParameterConstraints, Resource,
    ResourceLocator, ResourceName,
};
use adsrelay::xds::CachedResource;
use prost::Message;
use support::*;

const GROUP: &str = "tp2";

fn locator(name: &str, env: &str) -> ResourceLocator {
    ResourceLocator {
        name: name.into(),
        dynamic_parameters: HashMap::from([("env".to_string(), env.to_string())]),
    }
}

fn subscribe_locators(locators: Vec<ResourceLocator>) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_locators_subscribe: locators,
        ..Default::default()
    }
}

fn body(r: &Resource) -> String {
    String::from_utf8(r.resource.as_ref().unwrap().value.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e09_e13_each_parameter_set_gets_its_variant_and_one_upstream_locator() {
    let up = Upstream::start(vec![
        variant("foo", "prod", "p1"),
        variant("foo", "test", "t1"),
    ])
    .await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;

    let mut prod = Vec::new();
    for i in 0..3 {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("prod-{i}"), GROUP),
            subscribe_locators(vec![locator("foo", "prod")]),
        )
        .await;
        let r = c.recv_ack().await;
        assert_eq!(r.resources.len(), 1);
        let res = &r.resources[0];
        // E9: locator subscribers get the constraints, via resource_name and not name.
        assert_eq!(res.name, "");
        let rn = res.resource_name.as_ref().unwrap();
        assert_eq!(
            (rn.name.as_str(), rn.dynamic_parameter_constraints.clone()),
            ("foo", Some(env_is("prod")))
        );
        assert_eq!(body(res), "foo/prod@p1");
        prod.push(c);
    }
    let mut test = DeltaClient::connect(
        relay.xds,
        node("test-0", GROUP),
        subscribe_locators(vec![locator("foo", "test")]),
    )
    .await;
    assert_eq!(body(&test.recv_ack().await.resources[0]), "foo/test@t1");

    let stats = up.cp.stats();
    assert_eq!(stats.streams_opened, 1);
    assert_eq!(
        stats.subscribes.get(&(EDS.into(), "foo{env=prod}".into())),
        Some(&1)
    );
    assert_eq!(
        stats.subscribes.get(&(EDS.into(), "foo{env=test}".into())),
        Some(&1)
    );

    // E11: the prod variant is removed upstream -> removed_resource_names with its constraints,
    // and only to prod subscribers.
    up.cp.set_resources(vec![variant("foo", "test", "t1")]);
    for c in prod.iter_mut() {
        let r = c.recv_ack().await;
        assert!(
            r.resources.is_empty() && r.removed_resources.is_empty(),
            "{r:?}"
        );
        assert_eq!(
            r.removed_resource_names,
            vec![ResourceName {
                name: "foo".into(),
                dynamic_parameter_constraints: Some(env_is("prod"))
            }]
        );
    }
    test.expect_silence(Duration::from_millis(200)).await;

    // Last test subscriber leaves: the upstream sees exactly that locator unsubscribed.
    drop(test);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        up.cp
            .stats()
            .unsubscribes
            .get(&(EDS.into(), "foo{env=test}".into())),
        None,
        "linger holds it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e08_no_matching_variant_waits_for_the_upstream() {
    let up = Upstream::start(vec![variant("foo", "prod", "p1")]).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut p = DeltaClient::connect(
        relay.xds,
        node("p", GROUP),
        subscribe_locators(vec![locator("foo", "prod")]),
    )
    .await;
    p.recv_ack().await;
    // "qa" matches no cached variant: the relay asks the upstream, which has none either and says
    // so; only then is the client told.
    let mut qa = DeltaClient::connect(
        relay.xds,
        node("qa", GROUP),
        subscribe_locators(vec![locator("foo", "qa")]),
    )
    .await;
    let r = qa.recv_ack().await;
    assert!(r.resources.is_empty());
    assert_eq!(r.removed_resources, vec!["foo".to_string()]);
    assert_eq!(
        up.cp
            .stats()
            .subscribes
            .get(&(EDS.into(), "foo{env=qa}".into())),
        Some(&1)
    );
    // The variant appears upstream: the qa subscriber gets it.
    up.cp.set_resources(vec![
        variant("foo", "prod", "p1"),
        variant("foo", "qa", "q1"),
    ]);
    assert_eq!(body(&qa.recv_ack().await.resources[0]), "foo/qa@q1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e10_node_metadata_parameters_give_plain_name_clients_their_variant_by_name() {
    let up = Upstream::start(vec![
        variant("foo", "prod", "p1"),
        variant("foo", "test", "t1"),
    ])
    .await;
    let relay = RelayUnderTest::start_with(up.addr, |c| {
        c.params_from_metadata = vec!["env".into()];
    })
    .await;
    let mut n = node("legacy", GROUP);
    n.metadata = Some(prost_types::Struct {
        fields: [(
            "env".to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue("test".into())),
            },
        )]
        .into(),
    });
    let mut c = DeltaClient::connect(relay.xds, n, subscribe(EDS, &["foo"])).await;
    let r = c.recv_ack().await;
    let res = &r.resources[0];
    // E10: a plain-name subscriber gets `name`, never `resource_name`.
    assert_eq!(res.name, "foo");
    assert!(res.resource_name.is_none());
    assert_eq!(body(res), "foo/test@t1");
    assert_eq!(
        up.cp
            .stats()
            .subscribes
            .get(&(EDS.into(), "foo{env=test}".into())),
        Some(&1)
    );
}

fn dnc(name: &str, version: &str) -> (String, CachedResource) {
    let r = Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: EDS.into(),
            value: version.as_bytes().to_vec(),
        }),
        cache_control: Some(CacheControl { do_not_cache: true }),
        ..Default::default()
    };
    (
        EDS.to_string(),
        CachedResource::decode(r.encode_to_vec().into()).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d02_do_not_cache_is_fetched_again_for_a_later_subscriber() {
    let up = Upstream::start(vec![dnc("secret", "s1"), resource(EDS, "plain", "1")]).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let mut a = DeltaClient::connect(
        relay.xds,
        node("a", GROUP),
        subscribe(EDS, &["secret", "plain"]),
    )
    .await;
    let r = a.recv_ack().await;
    assert_eq!(
        names(&r),
        vec![("plain".into(), "1".into()), ("secret".into(), "s1".into())]
    );
    // D3: cache_control reaches the client.
    let secret = r.resources.iter().find(|r| r.name == "secret").unwrap();
    assert_eq!(
        secret.cache_control,
        Some(CacheControl { do_not_cache: true })
    );

    let mut b = DeltaClient::connect(
        relay.xds,
        node("b", GROUP),
        subscribe(EDS, &["secret", "plain"]),
    )
    .await;
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(names(&b.recv_ack().await));
    }
    got.sort();
    assert_eq!(
        got,
        vec![("plain".into(), "1".into()), ("secret".into(), "s1".into())]
    );
    // The plain resource came from the cache; the do_not_cache one made the relay ask again.
    let stats = up.cp.stats();
    assert_eq!(
        stats.subscribes.get(&(EDS.into(), "plain".into())),
        Some(&1)
    );
    assert_eq!(
        stats.subscribes.get(&(EDS.into(), "secret".into())),
        Some(&2)
    );
    // C4: never reported as held.
    assert!(!stats
        .initial_versions
        .contains_key(&(EDS.into(), "secret".into())));
}

// Core-level: what the upstream side of a group does with TP3 resource errors and ambiguous
// variant sets, driven without sockets.

fn eds_variant_bytes(name: &str, c: DynamicParameterConstraints, version: &str) -> bytes::Bytes {
    Resource {
        resource_name: Some(ResourceName {
            name: name.into(),
            dynamic_parameter_constraints: Some(c),
        }),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: EDS.into(),
            value: version.as_bytes().to_vec(),
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn drain(
    stream: &mut adsrelay::xds::DeltaStream,
    store: &adsrelay::xds::Store,
) -> Vec<adsrelay::pb::discovery::DeltaDiscoveryResponse> {
    let mut out = Vec::new();
    while let Some(r) = stream.next_response(store) {
        out.push(
            adsrelay::pb::discovery::DeltaDiscoveryResponse::decode(r.encode_to_vec().as_slice())
                .unwrap(),
        );
    }
    out
}

#[test]
fn tp3_resource_errors_reach_subscribers_once_and_not_found_is_removal() {
    use adsrelay::pb::discovery::ResourceError;
    use adsrelay::pb::rpc::Status;
    use adsrelay::xds::{DeltaStream, GroupState, UpstreamUpdate};
    let now = std::time::Instant::now();
    let mut group = GroupState::new(Duration::ZERO);
    let mut s = DeltaStream::new();
    let e = s
        .on_request(&subscribe(EDS, &["denied", "missing"]))
        .unwrap();
    group.apply_effects(1, &e, now);
    let err = |name: &str, code: i32| ResourceError {
        resource_name: Some(ResourceName {
            name: name.into(),
            dynamic_parameter_constraints: None,
        }),
        error_detail: Some(Status {
            code,
            message: format!("{name}: code {code}"),
            details: vec![],
        }),
    };
    let changes = group
        .apply_upstream(
            EDS,
            UpstreamUpdate {
                removed: vec!["missing".into()], // what the adapter makes of a NOT_FOUND error
                errors: vec![err("denied", 7)],
                ..Default::default()
            },
        )
        .unwrap();
    s.on_change(&changes);
    let out = drain(&mut s, group.store());
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].removed_resources, vec!["missing".to_string()]);
    assert_eq!(out[0].resource_errors, vec![err("denied", 7)]);
    // Sent once: a later unrelated change does not repeat it.
    s.on_change(&changes);
    assert!(drain(&mut s, group.store()).is_empty());
}

#[test]
fn e07_ambiguous_match_is_deterministic_and_counted() {
    use adsrelay::pb::discovery::dynamic_parameter_constraints::ConstraintList;
    use adsrelay::xds::{DeltaStream, Store};
    let and_prod_v1 = DynamicParameterConstraints {
        r#type: Some(Type::AndConstraints(ConstraintList {
            constraints: vec![
                env_is("prod"),
                DynamicParameterConstraints {
                    r#type: Some(Type::Constraint(SingleConstraint {
                        key: "version".into(),
                        constraint_type: Some(ConstraintType::Value("v1".into())),
                    })),
                },
            ],
        })),
    };
    let mut store = Store::new();
    store
        .apply_delta(
            EDS,
            vec![
                eds_variant_bytes("foo", env_is("prod"), "broad"),
                eds_variant_bytes("foo", and_prod_v1, "specific"),
            ],
            vec![],
            false,
        )
        .unwrap();
    let before = store.ambiguous_matches();
    let mut s = DeltaStream::new();
    s.on_request(&DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_locators_subscribe: vec![ResourceLocator {
            name: "foo".into(),
            dynamic_parameters: HashMap::from([
                ("env".into(), "prod".into()),
                ("version".into(), "v1".into()),
            ]),
        }],
        ..Default::default()
    })
    .unwrap();
    let out = drain(&mut s, &store);
    // E7: the most specific variant, and only one variant for a leaf.
    assert_eq!(out[0].resources.len(), 1);
    assert_eq!(out[0].resources[0].version, "specific");
    assert!(store.ambiguous_matches() > before);
}

#[test]
fn d04_sotw_full_state_waits_for_a_fresh_do_not_cache_copy() {
    use adsrelay::pb::discovery::{DiscoveryRequest, Resource};
    use adsrelay::xds::{GroupState, SotwStream, UpstreamUpdate};
    let now = std::time::Instant::now();
    let cluster = |name: &str, dnc: bool| -> bytes::Bytes {
        Resource {
            name: name.into(),
            version: "1".into(),
            resource: Some(prost_types::Any {
                type_url: CDS.into(),
                value: name.as_bytes().to_vec(),
            }),
            cache_control: dnc.then_some(CacheControl { do_not_cache: true }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    };
    let req = DiscoveryRequest {
        type_url: CDS.into(),
        resource_names: vec!["L".into(), "M".into()],
        ..Default::default()
    };
    let mut group = GroupState::new(Duration::ZERO);
    let node = node("n", GROUP);
    let mut early = SotwStream::for_node(&node, Default::default());
    let e = early.on_request(&req).unwrap();
    let seq = group.apply_effects(1, &e, now).seq;
    early.subscribed_at(seq);
    group.take_upstream_changes();
    let update = || UpstreamUpdate {
        resources: vec![cluster("L", true), cluster("M", false)],
        ..Default::default()
    };
    let changes = group.apply_upstream(CDS, update()).unwrap();
    early.on_change(&changes);
    // The subscriber that was waiting gets the full state, L included.
    let r = early.next_response(group.store()).expect("full state");
    assert_eq!(r.resources.len(), 2);

    // A later subscriber: L may not come from memory, and the full state must not omit it (D4),
    // so nothing is sent until the upstream sends L again.
    let mut late = SotwStream::for_node(&node, Default::default());
    let e = late.on_request(&req).unwrap();
    let seq = group.apply_effects(2, &e, now).seq;
    late.subscribed_at(seq);
    assert!(late.next_response(group.store()).is_none());
    let refetch = late.take_refetch();
    assert_eq!(refetch.len(), 1);
    assert_eq!(&*refetch[0].1.name, "L");
    for (t, l) in &refetch {
        group.refetch(t, l, now);
    }
    let sent_again = group.take_upstream_changes();
    assert_eq!(sent_again.len(), 1);
    assert_eq!(
        &*sent_again[0].subscribe[0].name, "L",
        "C3: subscribed again upstream"
    );
    let changes = group
        .apply_upstream(
            CDS,
            UpstreamUpdate {
                resources: vec![cluster("L", true)],
                ..Default::default()
            },
        )
        .unwrap();
    late.on_change(&changes);
    let r = late
        .next_response(group.store())
        .expect("full state after the fresh copy");
    assert_eq!(r.resources.len(), 2);
}

#[test]
fn b21_sotw_full_state_carries_resource_errors_beside_the_rest() {
    use adsrelay::pb::discovery::{DiscoveryRequest, ResourceError};
    use adsrelay::pb::rpc::Status;
    use adsrelay::xds::{GroupState, SotwStream, UpstreamUpdate};
    let now = std::time::Instant::now();
    let mut group = GroupState::new(Duration::ZERO);
    let mut s = SotwStream::for_node(&node("grpc", GROUP), Default::default());
    let e = s
        .on_request(&DiscoveryRequest {
            type_url: CDS.into(),
            resource_names: vec!["ok".into(), "denied".into()],
            ..Default::default()
        })
        .unwrap();
    group.apply_effects(1, &e, now);
    let ok = Resource {
        name: "ok".into(),
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: CDS.into(),
            value: b"ok".to_vec(),
        }),
        ..Default::default()
    };
    let denied = ResourceError {
        resource_name: Some(ResourceName {
            name: "denied".into(),
            dynamic_parameter_constraints: None,
        }),
        error_detail: Some(Status {
            code: 7,
            message: "denied".into(),
            details: vec![],
        }),
    };
    let changes = group
        .apply_upstream(
            CDS,
            UpstreamUpdate {
                resources: vec![ok.encode_to_vec().into()],
                errors: vec![denied.clone()],
                ..Default::default()
            },
        )
        .unwrap();
    s.on_change(&changes);
    // Not held back by the errored name (B2 would otherwise wait for it): the full state goes out
    // with the error beside it, once.
    let r = s.next_response(group.store()).expect("full state");
    assert_eq!(r.resources.len(), 1);
    assert_eq!(r.resource_errors, vec![denied]);
    s.on_change(&changes);
    assert!(
        s.next_response(group.store()).is_none(),
        "the error is not repeated"
    );
}

/// A name subscribed both by plain name and by a locator whose selection is the same
/// unconstrained resource: both go on the wire as plain `name`, so a response carries it once
/// (a client rejects duplicate names). Found by the `delta_requests` fuzz target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a20_name_and_locator_selecting_one_resource_send_it_once() {
    let up = Upstream::start(vec![resource(EDS, "b", "1"), resource(EDS, "c", "1")]).await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;
    let both = || DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_names_subscribe: vec!["b".into(), "c".into()],
        resource_locators_subscribe: vec![locator("b", "dev")],
        ..Default::default()
    };
    // The first client warms the cache; the second is answered from it in one response.
    let mut warm = DeltaClient::connect(relay.xds, node("warm", GROUP), both()).await;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let r = warm.recv_ack().await;
        seen.extend(r.resources.iter().map(|x| x.name.clone()));
    }
    let mut c = DeltaClient::connect(relay.xds, node("c", GROUP), both()).await;
    let r = c.recv_ack().await;
    let mut names: Vec<String> = r.resources.iter().map(|x| x.name.clone()).collect();
    names.sort();
    assert_eq!(names, vec!["b".to_string(), "c".to_string()], "{r:?}");
    c.expect_silence(Duration::from_millis(300)).await;
}

/// B20 with variants: a plain-name subscription (default parameters env=prod) and a locator with
/// no parameters select different variants of one name, but both reach a SotW client without
/// constraints, so the client can hold only one. The first subscription in order holds the name
/// (every response alike, no ping-pong); once it is released the other gets its own variant.
#[test]
fn b20_sotw_same_name_subscriptions_sent_alike_hold_the_name_in_turn() {
    use adsrelay::pb::discovery::DiscoveryRequest;
    use adsrelay::xds::{SotwStream, Store};
    let store = Store::complete(vec![variant("d", "prod", "1"), unconstrained("d", "2")]);
    // The body of each resource, unwrapping `Resource` wrappers (sent to locator subscribers).
    let bodies = |r: &adsrelay::pb::wire::DiscoveryResponse| -> Vec<String> {
        r.resources
            .iter()
            .map(|b| {
                let any = prost_types::Any::decode(&b[..]).unwrap();
                let value = if any.type_url.ends_with(".Resource") {
                    Resource::decode(&any.value[..])
                        .unwrap()
                        .resource
                        .unwrap()
                        .value
                } else {
                    any.value
                };
                String::from_utf8(value).unwrap()
            })
            .collect()
    };
    let params = std::collections::BTreeMap::from([("env".to_string(), "prod".to_string())]);
    let mut s = SotwStream::for_node(&Default::default(), params);
    let both = DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec!["d".into()],
        resource_locators: vec![ResourceLocator {
            name: "d".into(),
            dynamic_parameters: HashMap::new(),
        }],
        ..Default::default()
    };
    s.on_request(&both).unwrap();
    let first = s.next_response(&store).expect("a response");
    assert_eq!(bodies(&first), vec!["d/any@2"], "one entry for the name");
    s.on_request(&DiscoveryRequest {
        response_nonce: first.nonce.clone(),
        version_info: first.version_info.clone(),
        ..both.clone()
    })
    .unwrap();
    s.mark_all_pending(EDS);
    assert!(
        s.next_response(&store).is_none(),
        "the held-back subscription must not displace the holder"
    );
    // The locator is released: the plain-name subscription now gets its own variant.
    s.on_request(&DiscoveryRequest {
        resource_locators: vec![],
        response_nonce: first.nonce.clone(),
        version_info: first.version_info.clone(),
        ..both
    })
    .unwrap();
    let second = s.next_response(&store).expect("the plain-name variant");
    assert_eq!(bodies(&second), vec!["d/prod@1"]);
    assert!(s.next_response(&store).is_none());
}

#[test]
fn a20_b20_delta_name_that_changes_hands_is_added_without_being_removed() {
    use adsrelay::xds::{ChangeSet, DeltaStream, Store};
    // `d` by plain name (default parameters env=prod) and by a locator for env=test: both select
    // the unconstrained `d`, which the client holds once, by plain name.
    let before = Store::complete(vec![unconstrained("d", "1")]);
    let params = std::collections::BTreeMap::from([("env".to_string(), "prod".to_string())]);
    let mut s = DeltaStream::with_default_params(params);
    s.on_request(&DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_names_subscribe: vec!["d".into()],
        resource_locators_subscribe: vec![locator("d", "test")],
        ..Default::default()
    })
    .unwrap();
    let first = drain(&mut s, &before);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].resources.len(), 1, "one entry for the name");
    s.on_request(&DeltaDiscoveryRequest {
        type_url: EDS.into(),
        response_nonce: first[0].nonce.clone(),
        ..Default::default()
    })
    .unwrap();

    // The source replaces it with a prod-only variant: the locator (env=test) matches nothing any
    // more, while the plain name gets the prod variant, sent by plain name as well.
    let after = Store::complete(vec![variant("d", "prod", "2")]);
    s.on_change(&ChangeSet {
        type_url: EDS.into(),
        names: vec!["d".into()],
        ..Default::default()
    });
    let second = drain(&mut s, &after);
    assert_eq!(second.len(), 1);
    assert_eq!(
        second[0].resources.iter().map(body).collect::<Vec<_>>(),
        vec!["d/prod@2".to_string()]
    );
    // A20: the client would apply the add and then the removal, and end up without `d`.
    assert!(
        second[0].removed_resources.is_empty(),
        "{:?}",
        second[0].removed_resources
    );
}

#[test]
fn e09_e10_nack_after_a_form_switch_does_not_bring_back_the_old_form() {
    use adsrelay::pb::rpc::Status;
    use adsrelay::xds::{ChangeSet, DeltaStream, Store};
    let params = std::collections::BTreeMap::from([("env".to_string(), "prod".to_string())]);
    let mut s = DeltaStream::with_default_params(params);
    let changed = |name: &str| ChangeSet {
        type_url: EDS.into(),
        names: vec![name.into()],
        ..Default::default()
    };
    let ack = |nonce: &str, nack: bool| DeltaDiscoveryRequest {
        type_url: EDS.into(),
        response_nonce: nonce.into(),
        error_detail: nack.then(|| Status {
            code: 3,
            message: "rejected".into(),
            details: vec![],
        }),
        ..Default::default()
    };
    // A wildcard client whose plain names carry env=prod holds c (and b) by plain name.
    let store = Store::complete(vec![variant("c", "prod", "1"), variant("b", "prod", "1")]);
    s.on_request(&ack("", false)).unwrap();
    let first = drain(&mut s, &store);
    assert_eq!(first[0].resources.len(), 2);
    s.on_request(&ack(&first[0].nonce, false)).unwrap();
    // b changes; the client has not answered yet when it asks for c by locator too (the same
    // parameters, so the same subscription, now in locator form), then rejects the b update.
    let store = Store::complete(vec![variant("c", "prod", "1"), variant("b", "prod", "2")]);
    s.on_change(&changed("b"));
    let second = drain(&mut s, &store);
    assert_eq!(second.len(), 1);
    s.on_request(&DeltaDiscoveryRequest {
        resource_names_subscribe: vec!["c".into()],
        resource_locators_subscribe: vec![locator("c", "prod")],
        ..ack("", false)
    })
    .unwrap();
    s.on_request(&ack(&second[0].nonce, true)).unwrap();
    // c goes away: the client never held c's variant under its constraints, so it must not be
    // told that variant is removed (it would ignore it and keep c by plain name).
    let store = Store::complete(vec![variant("b", "prod", "1")]);
    s.on_change(&changed("c"));
    let out = drain(&mut s, &store);
    let variant_removals: Vec<_> = out.iter().flat_map(|r| &r.removed_resource_names).collect();
    assert!(variant_removals.is_empty(), "{variant_removals:?}");
    assert!(
        out.iter()
            .any(|r| r.removed_resources.contains(&"c".to_string())),
        "the client is told c is gone, by the name it holds: {out:?}"
    );
}

#[test]
fn e09_locator_with_the_default_parameters_does_not_take_over_what_the_wildcard_sent_by_name() {
    use adsrelay::xds::{ChangeSet, DeltaStream, Store};
    let params = std::collections::BTreeMap::from([("env".to_string(), "prod".to_string())]);
    let mut s = DeltaStream::with_default_params(params);
    // A wildcard client whose plain names carry env=prod holds c by plain name.
    let store = Store::complete(vec![variant("c", "prod", "1"), variant("b", "prod", "1")]);
    s.on_request(&DeltaDiscoveryRequest {
        type_url: EDS.into(),
        ..Default::default()
    })
    .unwrap();
    let first = drain(&mut s, &store);
    assert_eq!(first[0].resources.len(), 2);
    // It subscribes to c by locator with those same parameters, and before the relay answers,
    // c goes away.
    s.on_request(&DeltaDiscoveryRequest {
        type_url: EDS.into(),
        response_nonce: first[0].nonce.clone(),
        resource_locators_subscribe: vec![locator("c", "prod")],
        ..Default::default()
    })
    .unwrap();
    let store = Store::complete(vec![variant("b", "prod", "1")]);
    s.on_change(&ChangeSet {
        type_url: EDS.into(),
        names: vec!["c".into()],
        ..Default::default()
    });
    let out = drain(&mut s, &store);
    // The locator subscription never received c's variant: no variant removal for it.
    let variant_removals: Vec<_> = out.iter().flat_map(|r| &r.removed_resource_names).collect();
    assert!(variant_removals.is_empty(), "{variant_removals:?}");
}

/// E17: a variant removal names only a variant the client holds, and a client that rejected a
/// removal still holds the variant. Here a locator subscriber receives `c{env=prod}`, rejects the
/// response that removes it (so it keeps it, A23), and subscribes to it again (A7): it must be told
/// of the removal again, by the variant's constraints. A subscriber whose variant never reached it
/// is told the name does not exist by name (`removed_resources`), never with constraints it was
/// never sent.
#[test]
fn e17_variant_removal_names_only_a_variant_the_client_holds_including_one_kept_by_a_nack() {
    use adsrelay::pb::rpc::Status;
    use adsrelay::xds::{ChangeSet, DeltaStream, Store};
    let changed = |name: &str| ChangeSet {
        type_url: EDS.into(),
        names: vec![name.into()],
        ..Default::default()
    };
    let answer = |nonce: &str, nack: bool| DeltaDiscoveryRequest {
        type_url: EDS.into(),
        response_nonce: nonce.into(),
        error_detail: nack.then(|| Status {
            code: 3,
            message: "rejected".into(),
            details: vec![],
        }),
        ..Default::default()
    };
    let mut s = DeltaStream::new();
    s.on_request(&subscribe_locators(vec![locator("c", "prod")]))
        .unwrap();
    let store = Store::complete(vec![variant("c", "prod", "1")]);
    let first = drain(&mut s, &store);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].resources.len(), 1);
    s.on_request(&answer(&first[0].nonce, false)).unwrap();

    // The upstream removes the variant; the client rejects that response and keeps c{env=prod}.
    let store = Store::complete(vec![]);
    s.on_change(&changed("c"));
    let removal = drain(&mut s, &store);
    assert_eq!(removal.len(), 1);
    assert_eq!(removal[0].removed_resource_names.len(), 1);
    assert!(removal[0].removed_resources.is_empty(), "{removal:?}");
    s.on_request(&answer(&removal[0].nonce, true)).unwrap();
    // Not repeated by itself (A31) ...
    s.on_change(&changed("c"));
    assert!(drain(&mut s, &store).is_empty());
    // ... but a re-subscription asks again, and the client still holds the variant.
    s.on_request(&subscribe_locators(vec![locator("c", "prod")]))
        .unwrap();
    let again = drain(&mut s, &store);
    let removed: Vec<_> = again
        .iter()
        .flat_map(|r| &r.removed_resource_names)
        .collect();
    assert_eq!(removed.len(), 1, "{again:?}");
    assert_eq!(removed[0].name, "c");
    assert_eq!(
        removed[0].dynamic_parameter_constraints,
        Some(env_is("prod"))
    );
    s.on_request(&answer(&again[0].nonce, false)).unwrap();

    // A second locator subscriber of a name with no variant at all: told by name, no constraints.
    let mut late = DeltaStream::new();
    late.on_request(&subscribe_locators(vec![locator("d", "prod")]))
        .unwrap();
    let out = drain(&mut late, &store);
    assert!(
        out.iter().all(|r| r.removed_resource_names.is_empty()),
        "constraints the client was never sent: {out:?}"
    );
    assert!(
        out.iter()
            .any(|r| r.removed_resources == vec!["d".to_string()]),
        "the client is told d does not exist: {out:?}"
    );
}

/// A20 for variant removals: two locators of one name whose parameter sets select the same variant
/// hold it under one wire identity, so its removal is listed once (found by fuzzing, issue 32).
#[test]
fn a20_e17_a_variant_two_locators_selected_is_removed_once() {
    use adsrelay::xds::{ChangeSet, DeltaStream, Store};
    let mut s = DeltaStream::new();
    let zone = ResourceLocator {
        name: "c".into(),
        dynamic_parameters: HashMap::from([
            ("env".to_string(), "prod".to_string()),
            ("zone".to_string(), "z1".to_string()),
        ]),
    };
    s.on_request(&subscribe_locators(vec![locator("c", "prod"), zone]))
        .unwrap();
    let store = Store::complete(vec![variant("c", "prod", "1")]);
    let first = drain(&mut s, &store);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].resources.len(), 1, "sent once (A20)");
    let store = Store::complete(vec![]);
    s.on_change(&ChangeSet {
        type_url: EDS.into(),
        names: vec!["c".into()],
        ..Default::default()
    });
    let out = drain(&mut s, &store);
    let removed: Vec<_> = out.iter().flat_map(|r| &r.removed_resource_names).collect();
    assert_eq!(removed.len(), 1, "removed once: {out:?}");
}

/// E17 with two locators: a variant removal names one wire identity (name and constraints), so
/// once it went out for one of the name's locators, the client holds that variant under none of
/// them; re-subscribing the other locator must not remove it a second time. Fuzzing found the
/// relay doing so (regressions/delta_requests/variant-removed-for-one-locator-is-gone-for-both).
#[test]
fn e17_a_variant_removed_for_one_locator_is_gone_for_every_locator_that_selected_it() {
    use adsrelay::pb::rpc::Status;
    use adsrelay::xds::{ChangeSet, DeltaStream, Store};
    let answer = |nonce: &str, nack: bool| DeltaDiscoveryRequest {
        type_url: EDS.into(),
        response_nonce: nonce.into(),
        error_detail: nack.then(|| Status {
            code: 3,
            message: "rejected".into(),
            details: vec![],
        }),
        ..Default::default()
    };
    let zone = ResourceLocator {
        name: "c".into(),
        dynamic_parameters: HashMap::from([
            ("env".to_string(), "prod".to_string()),
            ("zone".to_string(), "z1".to_string()),
        ]),
    };
    let mut s = DeltaStream::new();
    s.on_request(&subscribe_locators(vec![
        locator("c", "prod"),
        zone.clone(),
    ]))
    .unwrap();
    let store = Store::complete(vec![variant("c", "prod", "1")]);
    let first = drain(&mut s, &store);
    assert_eq!(first[0].resources.len(), 1, "sent once (A20)");
    s.on_request(&answer(&first[0].nonce, false)).unwrap();

    // The variant goes; the client rejects the removal and keeps c{env=prod} (A23).
    let store = Store::complete(vec![]);
    s.on_change(&ChangeSet {
        type_url: EDS.into(),
        names: vec!["c".into()],
        ..Default::default()
    });
    let removal = drain(&mut s, &store);
    s.on_request(&answer(&removal[0].nonce, true)).unwrap();

    // Re-subscribing one locator removes the variant again, and the client accepts.
    s.on_request(&subscribe_locators(vec![locator("c", "prod")]))
        .unwrap();
    let again = drain(&mut s, &store);
    let removed: Vec<_> = again
        .iter()
        .flat_map(|r| &r.removed_resource_names)
        .collect();
    assert_eq!(removed.len(), 1, "{again:?}");
    s.on_request(&answer(&again[0].nonce, false)).unwrap();

    // The client holds no c{env=prod} under any locator now: nothing more to remove.
    s.on_request(&subscribe_locators(vec![zone])).unwrap();
    let after = drain(&mut s, &store);
    assert!(
        after.iter().all(|r| r.removed_resource_names.is_empty()),
        "a variant the client no longer holds was removed again: {after:?}"
    );
}
