//! Delta-only discovery through a real relay (A25–A29, on demand), with a scripted upstream that
//! behaves like an xdstp-aware control plane: it expands glob collections, resolves VHDS aliases
//! (or answers them unresolved), reports missing names, and spells context parameters in its own
//! order. Clients are real ADS clients on their own connections.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use adsrelay::pb::discovery::{ResourceError, ResourceName};
use adsrelay::pb::rpc::Status;
use adsrelay::pb::wire;
use adsrelay::xds::xdstp;
use prost::Message;
use support::scripted::Harness;
use support::*;

const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const VHDS: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";

const GLOB: &str = "xdstp://auth/envoy.config.listener.v3.Listener/foo/*?node_type=ingress&zone=z1";
/// The same collection as another client spells it.
const GLOB_BA: &str =
    "xdstp://auth/envoy.config.listener.v3.Listener/foo/*?zone=z1&node_type=ingress";
const FOO_A: &str =
    "xdstp://auth/envoy.config.listener.v3.Listener/foo/a?node_type=ingress&zone=z1";
const FOO_B: &str =
    "xdstp://auth/envoy.config.listener.v3.Listener/foo/b?node_type=ingress&zone=z1";

/// One resource the control plane holds: name (as the control plane spells it), version, aliases.
struct Entry {
    name: &'static str,
    version: &'static str,
    aliases: &'static [&'static str],
}

fn encode(type_url: &str, e: &Entry) -> bytes::Bytes {
    Resource {
        name: e.name.into(),
        version: e.version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: format!("{}@{}", e.name, e.version).into_bytes(),
        }),
        aliases: e.aliases.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// How an xdstp-aware control plane answers one subscription request: a glob gets every member of
/// its collection (or the glob's removal when empty), a name or an alias gets its resource, an
/// unknown VHDS alias gets the unresolved-alias entry, any other unknown name NOT_FOUND, and `"*"`
/// everything.
fn answer(
    type_url: &str,
    catalog: &[Entry],
    req: &DeltaDiscoveryRequest,
) -> wire::DeltaDiscoveryResponse {
    let canon = |n: &str| {
        xdstp::canonical(n)
            .map(|c| c.into_owned())
            .unwrap_or(n.to_string())
    };
    let mut resp = wire::DeltaDiscoveryResponse {
        type_url: type_url.into(),
        ..Default::default()
    };
    for name in &req.resource_names_subscribe {
        if name == "*" {
            resp.resources
                .extend(catalog.iter().map(|e| encode(type_url, e)));
        } else if xdstp::is_glob(name) {
            let members: Vec<&Entry> = catalog
                .iter()
                .filter(|e| xdstp::collection_of(&canon(e.name)).as_deref() == Some(&canon(name)))
                .collect();
            if members.is_empty() {
                resp.removed_resources.push(name.clone());
            }
            resp.resources
                .extend(members.into_iter().map(|e| encode(type_url, e)));
        } else if let Some(e) = catalog
            .iter()
            .find(|e| canon(e.name) == canon(name) || e.aliases.contains(&name.as_str()))
        {
            resp.resources.push(encode(type_url, e));
        } else if type_url == VHDS {
            resp.resources.push(
                Resource {
                    name: name.clone(),
                    aliases: vec![name.clone()],
                    ..Default::default()
                }
                .encode_to_vec()
                .into(),
            );
        } else {
            resp.resource_errors.push(ResourceError {
                resource_name: Some(ResourceName {
                    name: name.clone(),
                    dynamic_parameter_constraints: None,
                }),
                error_detail: Some(Status {
                    code: 5,
                    message: "not found".into(),
                    details: vec![],
                }),
            });
        }
    }
    resp
}

/// Waits for the relay's next subscription request of `type_url`, answers it from `catalog` and
/// returns it. ACKs in between are skipped.
async fn serve(h: &mut Harness, type_url: &str, catalog: &[Entry]) -> DeltaDiscoveryRequest {
    loop {
        let r = h.next_request().await;
        if r.type_url == type_url && !r.resource_names_subscribe.is_empty() {
            let resp = answer(type_url, catalog, &r);
            let n = h.send_raw(resp).await;
            assert_eq!(h.answer(&n).await, None, "the relay accepts the response");
            return r;
        }
    }
}

/// The subscriptions the relay sends upstream within `wait` (ACKs skipped).
async fn upstream_subscriptions(h: &mut Harness, wait: Duration) -> Vec<String> {
    use tokio_stream::StreamExt;
    let mut out = Vec::new();
    while let Ok(Some(r)) = tokio::time::timeout(wait, h.requests.next()).await {
        out.extend(r.resource_names_subscribe);
    }
    out
}

fn resource_names(r: &DeltaDiscoveryResponse) -> BTreeSet<String> {
    r.resources.iter().map(|x| x.name.clone()).collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

async fn metric(h: &Harness, series: &str) -> f64 {
    let (status, body) = h.relay.admin_get("/metrics").await;
    assert_eq!(status, 200);
    body.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a28_a29_glob_collection_shared_by_clients_through_the_relay() {
    let mut h = Harness::start().await;
    // The control plane spells parameters in its own order.
    let catalog = [
        Entry {
            name: "xdstp://auth/envoy.config.listener.v3.Listener/foo/a?zone=z1&node_type=ingress",
            version: "1",
            aliases: &[],
        },
        Entry {
            name: FOO_B,
            version: "1",
            aliases: &[],
        },
        Entry {
            name: "xdstp://auth/envoy.config.listener.v3.Listener/foo/c?node_type=egress&zone=z1",
            version: "1",
            aliases: &[],
        },
    ];
    let mut c1 = DeltaClient::connect(h.relay.xds, node("e1", "g"), subscribe(LDS, &[GLOB])).await;
    let r = serve(&mut h, LDS, &catalog).await;
    assert_eq!(r.resource_names_subscribe, vec![GLOB.to_string()]);
    let got = c1.recv_ack().await;
    assert_eq!(
        resource_names(&got),
        set(&[FOO_A, FOO_B]),
        "canonical names, collection only"
    );

    // More clients, one spelling the collection differently: served from the cache, and the
    // upstream sees no new subscription.
    let mut others = Vec::new();
    for (i, glob) in [GLOB_BA, GLOB, GLOB_BA].into_iter().enumerate() {
        let mut c = DeltaClient::connect(
            h.relay.xds,
            node(&format!("e{}", i + 2), "g"),
            subscribe(LDS, &[glob]),
        )
        .await;
        assert_eq!(resource_names(&c.recv_ack().await), set(&[FOO_A, FOO_B]));
        others.push(c);
    }
    assert_eq!(
        upstream_subscriptions(&mut h, Duration::from_millis(300)).await,
        Vec::<String>::new()
    );
    assert_eq!(metric(&h, "adsrelay_upstream_subscriptions{").await, 1.0);

    // The collection grows, then empties: every client follows.
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: LDS.into(),
            resources: vec![encode(
                LDS,
                &Entry {
                    name: "xdstp://auth/envoy.config.listener.v3.Listener/foo/d?zone=z1&node_type=ingress",
                    version: "1",
                    aliases: &[],
                },
            )],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    let foo_d = "xdstp://auth/envoy.config.listener.v3.Listener/foo/d?node_type=ingress&zone=z1";
    for c in std::iter::once(&mut c1).chain(others.iter_mut()) {
        assert_eq!(resource_names(&c.recv_ack().await), set(&[foo_d]));
    }
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: LDS.into(),
            removed_resources: vec![FOO_A.into(), FOO_B.into(), foo_d.into()],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    for c in std::iter::once(&mut c1).chain(others.iter_mut()) {
        let r = c.recv_ack().await;
        let removed: BTreeSet<String> = r.removed_resources.into_iter().collect();
        assert_eq!(removed, set(&[FOO_A, FOO_B, foo_d, GLOB]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a28_empty_collection_and_a29_malformed_name_through_the_relay() {
    let mut h = Harness::start().await;
    let bad = "xdstp://auth/envoy.config.listener.v3.Listener/foo/x?k=1&k=2";
    let mut c =
        DeltaClient::connect(h.relay.xds, node("e1", "g"), subscribe(LDS, &[bad, GLOB])).await;
    let r = c.recv_ack().await;
    assert_eq!(r.resource_errors.len(), 1);
    let e = &r.resource_errors[0];
    assert_eq!(e.resource_name.as_ref().unwrap().name, bad);
    assert_eq!(e.error_detail.as_ref().unwrap().code, 3, "INVALID_ARGUMENT");
    // Only the well-formed glob goes upstream; the empty collection is reported removed.
    let req = serve(&mut h, LDS, &[]).await;
    assert_eq!(req.resource_names_subscribe, vec![GLOB.to_string()]);
    let r = c.recv_ack().await;
    assert_eq!(r.removed_resources, vec![GLOB.to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a25_a27_vhds_by_alias_on_demand_through_the_relay() {
    let mut h = Harness::start().await;
    let vhosts = [
        Entry {
            name: "rc1/vhost_1",
            version: "1",
            aliases: &["rc1/foo.com", "rc1/www.foo.com"],
        },
        Entry {
            name: "rc9/vhost_9",
            version: "1",
            aliases: &["rc9/other.com"],
        },
    ];
    // Another client's virtual host is in the cache.
    let mut other = DeltaClient::connect(
        h.relay.xds,
        node("e9", "g"),
        subscribe(VHDS, &["rc9/other.com"]),
    )
    .await;
    serve(&mut h, VHDS, &vhosts).await;
    assert_eq!(
        resource_names(&other.recv_ack().await),
        set(&["rc9/vhost_9"])
    );

    // A27: the first, empty VHDS request of a client with no route configuration: the upstream
    // is asked for everything (once per group), the client gets none of it.
    let mut c = DeltaClient::connect(h.relay.xds, node("e1", "g"), subscribe(VHDS, &[])).await;
    let req = serve(&mut h, VHDS, &vhosts).await;
    assert_eq!(req.resource_names_subscribe, vec!["*".to_string()]);
    let first = c.recv_ack().await;
    assert!(
        first.resources.is_empty() && first.removed_resources.is_empty(),
        "{first:?}"
    );

    // A25: on demand by alias; the client gets the virtual host under its name, with aliases.
    c.send(subscribe(VHDS, &["rc1/foo.com"])).await;
    let req = serve(&mut h, VHDS, &vhosts).await;
    assert_eq!(
        req.resource_names_subscribe,
        vec!["rc1/foo.com".to_string()]
    );
    let r = c.recv_ack().await;
    assert_eq!(resource_names(&r), set(&["rc1/vhost_1"]));
    assert_eq!(
        r.resources[0].aliases,
        vec!["rc1/foo.com", "rc1/www.foo.com"]
    );

    // An alias the control plane cannot resolve is passed through as the resource-less entry.
    c.send(subscribe(VHDS, &["rc1/nope.com"])).await;
    serve(&mut h, VHDS, &vhosts).await;
    let r = c.recv_ack().await;
    assert_eq!(resource_names(&r), set(&["rc1/nope.com"]));
    assert!(r.resources[0].resource.is_none());
    assert_eq!(r.resources[0].aliases, vec!["rc1/nope.com"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a26_route_configuration_change_resends_virtual_hosts_through_the_relay() {
    let mut h = Harness::start().await;
    let routes = [Entry {
        name: "rc1",
        version: "1",
        aliases: &[],
    }];
    let vhosts = [Entry {
        name: "rc1/vhost_1",
        version: "1",
        aliases: &["rc1/foo.com"],
    }];
    let mut c = DeltaClient::connect(h.relay.xds, node("e1", "g"), subscribe(RDS, &["rc1"])).await;
    serve(&mut h, RDS, &routes).await;
    assert_eq!(resource_names(&c.recv_ack().await), set(&["rc1"]));
    c.send(subscribe(VHDS, &["rc1/foo.com"])).await;
    serve(&mut h, VHDS, &vhosts).await;
    assert_eq!(resource_names(&c.recv_ack().await), set(&["rc1/vhost_1"]));

    // rc1 changes upstream; the virtual host does not. RDS first, then the virtual host again.
    let n = h
        .send_raw(wire::DeltaDiscoveryResponse {
            type_url: RDS.into(),
            resources: vec![encode(
                RDS,
                &Entry {
                    name: "rc1",
                    version: "2",
                    aliases: &[],
                },
            )],
            ..Default::default()
        })
        .await;
    assert_eq!(h.answer(&n).await, None);
    let r = c.recv_ack().await;
    assert_eq!(
        (r.type_url.as_str(), resource_names(&r)),
        (RDS, set(&["rc1"]))
    );
    let r = c.recv_ack().await;
    assert_eq!(
        (r.type_url.as_str(), resource_names(&r)),
        (VHDS, set(&["rc1/vhost_1"]))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_demand_cds_found_and_missing_through_the_relay() {
    let mut h = Harness::start().await;
    let clusters = [Entry {
        name: "od",
        version: "1",
        aliases: &[],
    }];
    let mut c = DeltaClient::connect(h.relay.xds, node("e1", "g"), subscribe(CDS, &["base"])).await;
    serve(
        &mut h,
        CDS,
        &[Entry {
            name: "base",
            version: "1",
            aliases: &[],
        }],
    )
    .await;
    c.recv_ack().await;
    // Mid-stream, as the on-demand filter does: fetched upstream and answered on arrival.
    c.send(subscribe(CDS, &["od"])).await;
    let req = serve(&mut h, CDS, &clusters).await;
    assert_eq!(req.resource_names_subscribe, vec!["od".to_string()]);
    assert_eq!(resource_names(&c.recv_ack().await), set(&["od"]));
    // A cluster that does not exist: removed as soon as the upstream says NOT_FOUND, so the
    // filter does not wait for its timeout.
    c.send(subscribe(CDS, &["nope"])).await;
    serve(&mut h, CDS, &clusters).await;
    let r = tokio::time::timeout(Duration::from_secs(2), c.recv())
        .await
        .expect("prompt answer");
    assert_eq!(r.removed_resources, vec!["nope".to_string()]);
}
