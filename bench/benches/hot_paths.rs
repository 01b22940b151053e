//! Micro-benchmarks of the relay's hot paths, on the I/O-free core:
//! `cargo bench -p adsrelay-bench --bench hot_paths`.
//!
//! - response building: one client's response to a one-resource update, and a full initial state;
//! - variant selection: one subscriber's variant among 100 parameter sets;
//! - cache ingest: applying an upstream response of 100 resources of 1 KiB;
//! - fan-out: one change to 10,000 Delta or SotW subscribers, shared frames against encoding per
//!   client (no sockets: regressions in the per-client work show without a 10,000-client run);
//! - join and resume: what one client of loadgen's Delta run costs the core from its first request
//!   to its stream's end, fresh (everything sent) or reconnecting in a storm (everything reported
//!   in `initial_resource_versions`, nothing sent).

use adsrelay::pb::discovery::dynamic_parameter_constraints::single_constraint::ConstraintType;
use adsrelay::pb::discovery::dynamic_parameter_constraints::{SingleConstraint, Type};
use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DiscoveryRequest, DynamicParameterConstraints, Resource, ResourceName,
};
use adsrelay::xds::constraints::Params;
use adsrelay::xds::{ChangeSet, DeltaStream, GroupState, SotwStream, Store, StreamCore};
use bytes::Bytes;
use divan::{black_box, Bencher};
use prost::Message;
use std::time::{Duration, Instant};

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

fn main() {
    divan::main();
}

fn resource(name: &str, version: &str, size: usize) -> Bytes {
    resource_of(CDS, name, version, size)
}

fn resource_of(type_url: &str, name: &str, version: &str, size: usize) -> Bytes {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: vec![7; size],
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn store_with(n: usize) -> Store {
    let mut s = Store::new();
    let resources = (0..n)
        .map(|i| resource(&format!("c{i}"), "1", 1024))
        .collect();
    s.apply_delta(CDS, resources, vec![], true).unwrap();
    s
}

fn synced_client(store: &Store) -> DeltaStream {
    let mut c = DeltaStream::new();
    c.on_request(&DeltaDiscoveryRequest {
        type_url: CDS.into(),
        ..Default::default()
    })
    .unwrap();
    while c.next_response(store).is_some() {}
    c
}

/// The per-client work of one small update: fold the change in, build the response.
#[divan::bench]
fn delta_response_for_one_update(bencher: Bencher) {
    let mut store = store_with(100);
    let mut client = synced_client(&store);
    let mut version = 1u64;
    bencher.bench_local(|| {
        version += 1;
        let changes = store
            .apply_delta(
                CDS,
                vec![resource("c7", &version.to_string(), 1024)],
                vec![],
                true,
            )
            .unwrap();
        client.on_change(&changes);
        black_box(client.next_response(&store))
    });
}

/// A new client's whole initial state (100 clusters of 1 KiB), in as many responses as it takes.
#[divan::bench]
fn delta_initial_state_100(bencher: Bencher) {
    let store = store_with(100);
    bencher.bench_local(|| {
        let mut c = DeltaStream::new();
        c.on_request(&DeltaDiscoveryRequest {
            type_url: CDS.into(),
            ..Default::default()
        })
        .unwrap();
        let mut n = 0;
        while let Some(r) = c.next_response(&store) {
            n += r.resources.len();
        }
        black_box(n)
    });
}

/// A SotW Cluster full-state response after one change (100 clusters).
#[divan::bench]
fn sotw_full_state_100(bencher: Bencher) {
    let mut store = store_with(100);
    let mut c = SotwStream::new(false);
    c.on_request(&DiscoveryRequest {
        type_url: CDS.into(),
        ..Default::default()
    })
    .unwrap();
    while c.next_response(&store).is_some() {}
    let mut version = 1u64;
    bencher.bench_local(|| {
        version += 1;
        let changes = store
            .apply_delta(
                CDS,
                vec![resource("c7", &version.to_string(), 1024)],
                vec![],
                true,
            )
            .unwrap();
        c.on_change(&changes);
        black_box(c.next_response(&store))
    });
}

fn env_is(v: &str) -> DynamicParameterConstraints {
    DynamicParameterConstraints {
        r#type: Some(Type::Constraint(SingleConstraint {
            key: "env".into(),
            constraint_type: Some(ConstraintType::Value(v.into())),
        })),
    }
}

/// Selecting one subscriber's variant among 100 parameter sets.
#[divan::bench]
fn variant_selection_among_100(bencher: Bencher) {
    let mut store = Store::new();
    let variants = (0..100)
        .map(|i| {
            Resource {
                resource_name: Some(ResourceName {
                    name: "foo".into(),
                    dynamic_parameter_constraints: Some(env_is(&format!("e{i}"))),
                }),
                version: "1".into(),
                resource: Some(prost_types::Any {
                    type_url: CDS.into(),
                    value: vec![1; 64],
                }),
                ..Default::default()
            }
            .encode_to_vec()
            .into()
        })
        .collect();
    store.apply_delta(CDS, variants, vec![], false).unwrap();
    let params: Params = [("env".to_string(), "e57".to_string())].into();
    bencher.bench_local(|| black_box(store.lookup_for(CDS, "foo", black_box(&params))));
}

/// Applying one upstream response of 100 resources of 1 KiB (decode headers, validate, store).
#[divan::bench]
fn cache_ingest_100(bencher: Bencher) {
    let batch: Vec<Bytes> = (0..100)
        .map(|i| resource(&format!("c{i}"), "1", 1024))
        .collect();
    bencher.bench_local(|| {
        let mut s = Store::new();
        black_box(s.apply_delta(CDS, batch.clone(), vec![], true).unwrap())
    });
}

/// Update fan-out in the core with 10,000 subscribers across 100 parameter sets: the upstream
/// replaces every variant of one name, and every subscriber gets its own variant (selection plus
/// response building, as each stream task does after a change). Divide by 10,000 for per-client.
#[divan::bench(sample_count = 10)]
fn variant_fanout_10k_subscribers_100_param_sets(bencher: Bencher) {
    use adsrelay::pb::discovery::ResourceLocator;
    let variant = |i: usize, version: u64| -> Bytes {
        Resource {
            resource_name: Some(ResourceName {
                name: "foo".into(),
                dynamic_parameter_constraints: Some(env_is(&format!("e{i}"))),
            }),
            version: version.to_string(),
            resource: Some(prost_types::Any {
                type_url: CDS.into(),
                value: vec![1; 1024],
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    };
    let mut store = Store::new();
    store
        .apply_delta(
            CDS,
            (0..100).map(|i| variant(i, 1)).collect(),
            vec![],
            false,
        )
        .unwrap();
    let mut clients: Vec<DeltaStream> = (0..10_000)
        .map(|c| {
            let mut s = DeltaStream::new();
            s.on_request(&DeltaDiscoveryRequest {
                type_url: CDS.into(),
                resource_locators_subscribe: vec![ResourceLocator {
                    name: "foo".into(),
                    dynamic_parameters: [("env".to_string(), format!("e{}", c % 100))].into(),
                }],
                ..Default::default()
            })
            .unwrap();
            while s.next_response(&store).is_some() {}
            s
        })
        .collect();
    let mut version = 1u64;
    bencher.bench_local(|| {
        version += 1;
        let changes = store
            .apply_delta(
                CDS,
                (0..100).map(|i| variant(i, version)).collect(),
                vec![],
                false,
            )
            .unwrap();
        let mut sent = 0;
        for c in clients.iter_mut() {
            c.on_change(&changes);
            while let Some(r) = c.next_response(&store) {
                sent += r.resources.len();
            }
        }
        assert_eq!(sent, 10_000);
        black_box(sent)
    });
}

/// A new version of cluster `c7` (1 KiB), as the upstream would send it.
fn change_c7(store: &mut Store, version: u64) -> ChangeSet {
    store
        .apply_delta(
            CDS,
            vec![resource("c7", &version.to_string(), 1024)],
            vec![],
            true,
        )
        .unwrap()
}

/// Every client folds the change in and takes its response: the shared frame, or (for
/// comparison) a response encoded for it alone. Returns the bytes due to the sockets.
fn fan_out<C: StreamCore>(
    clients: &mut [C],
    store: &Store,
    changes: &ChangeSet,
    how: &str,
    encode_alone: fn(&mut C, &Store) -> usize,
) -> usize {
    clients
        .iter_mut()
        .map(|c| {
            c.on_change(changes);
            if how == "shared_frame" {
                c.next_frame(store).map_or(0, |o| o.frame.bytes.len())
            } else {
                encode_alone(c, store)
            }
        })
        .sum()
}

/// `n` wildcard Cluster subscribers holding the store's content, every response taken.
fn framed_clients(store: &Store, n: usize) -> Vec<DeltaStream> {
    (0..n)
        .map(|_| {
            let mut c = synced_client(store);
            while c.next_frame(store).is_some() {}
            c
        })
        .collect()
}

/// The fan-out of one 1 KiB change to 10,000 Delta subscribers, as the stream tasks do it: fold
/// the change in, build the response and take its frame (shared after the first), no sockets.
/// Beside it, the same with a per-client encode (what a control plane that encodes per client
/// does). Divide by 10,000 for per-client figures.
#[divan::bench(args = ["shared_frame", "encode_per_client"], sample_count = 10)]
fn fanout_one_change_10k_delta(bencher: Bencher, how: &str) {
    let mut store = store_with(100);
    let mut clients = framed_clients(&store, 10_000);
    let mut version = 1u64;
    bencher.bench_local(|| {
        version += 1;
        let changes = change_c7(&mut store, version);
        black_box(fan_out(&mut clients, &store, &changes, how, |c, s| {
            c.next_response(s).map_or(0, |r| r.encode_to_vec().len())
        }))
    });
}

/// The same fan-out split over `threads` worker threads, as the relay's stream tasks run on
/// tokio's workers: each thread folds the change into its share of the clients and takes their
/// frames, all reading one store and one frame cache. Wall time per change; with 2 threads on 2
/// free cores, half of 1 thread's is perfect scaling (the CPU spent is about `threads` x the time).
#[divan::bench(args = [1, 2], sample_count = 10)]
fn fanout_one_change_10k_delta_threads(bencher: Bencher, threads: usize) {
    let mut store = store_with(100);
    let mut clients = framed_clients(&store, 10_000);
    let mut version = 1u64;
    let share = clients.len().div_ceil(threads);
    bencher.bench_local(|| {
        version += 1;
        let changes = change_c7(&mut store, version);
        let (store, changes) = (&store, &changes);
        let sent: usize = std::thread::scope(|s| {
            let workers: Vec<_> = clients
                .chunks_mut(share)
                .map(|part| {
                    s.spawn(move || fan_out(part, store, changes, "shared_frame", |_, _| 0))
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a fan-out worker panicked"))
                .sum()
        });
        black_box(sent)
    });
}

/// One Cluster change to 10,000 wildcard SotW clients holding 100 Clusters of 1 KiB (100 KiB of
/// full state each): every client is due the same full state, framed once.
#[divan::bench(args = ["shared_frame", "encode_per_client"], sample_count = 5)]
fn fanout_one_change_10k_sotw_full_state_100(bencher: Bencher, how: &str) {
    let mut store = store_with(100);
    let mut clients: Vec<SotwStream> = (0..10_000)
        .map(|_| {
            let mut c = SotwStream::new(false);
            c.on_request(&DiscoveryRequest {
                type_url: CDS.into(),
                ..Default::default()
            })
            .unwrap();
            while c.next_frame(&store).is_some() {}
            c
        })
        .collect();
    let mut version = 1u64;
    bencher.bench_local(|| {
        version += 1;
        let changes = change_c7(&mut store, version);
        black_box(fan_out(&mut clients, &store, &changes, how, |c, s| {
            c.next_response(s).map_or(0, |r| r.encode_to_vec().len())
        }))
    });
}

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// A group's cache as in loadgen's default Delta run: 50 Clusters and a pool of 1,000
/// ClusterLoadAssignments, 1 KiB each.
fn join_group() -> GroupState {
    let mut store = store_with(50);
    let eds = (0..1000)
        .map(|i| resource_of(EDS, &format!("e{i}"), "1", 1024))
        .collect();
    store.apply_delta(EDS, eds, vec![], false).unwrap();
    let mut group = GroupState::new(Duration::from_secs(30)).with_store(store);
    // The rest of the fleet, as in a 10,000-client join or storm: every name keeps subscribers,
    // so a client's arrival and departure are not the first or last reference, and the group's
    // index holds 10,000 wildcard subscribers and about 500 per endpoint name.
    for id in 0..FLEET {
        let mut fleet = DeltaStream::new();
        for (type_url, names) in [
            (CDS, vec![]),
            (
                EDS,
                (0..50)
                    .map(|i| format!("e{}", (id * 7 + i) % 1000))
                    .collect(),
            ),
        ] {
            let effects = fleet
                .on_request(&DeltaDiscoveryRequest {
                    type_url: type_url.into(),
                    resource_names_subscribe: names,
                    ..Default::default()
                })
                .unwrap();
            group.apply_effects(id, &effects, Instant::now());
        }
    }
    group
}

/// Streams already in the group when the benchmarked client joins.
const FLEET: u32 = 10_000;

/// One simulated client's whole stream, as a stream task drives it: the wildcard Cluster request
/// and a request for 50 endpoint names (with `initial_resource_versions` when `resume`), their
/// effects on the group, every response framed and ACKed, then the stream's end. Returns the
/// resources sent.
fn client_stream(group: &mut GroupState, id: u32, resume: bool) -> usize {
    let eds: Vec<String> = (0..50)
        .map(|i| format!("e{}", (id * 7 + i) % 1000))
        .collect();
    let versions = |names: Vec<String>| -> std::collections::BTreeMap<String, String> {
        if resume {
            names.into_iter().map(|n| (n, "1".to_string())).collect()
        } else {
            Default::default()
        }
    };
    let requests = [
        DeltaDiscoveryRequest {
            type_url: CDS.into(),
            initial_resource_versions: versions((0..50).map(|i| format!("c{i}")).collect()),
            ..Default::default()
        },
        DeltaDiscoveryRequest {
            type_url: EDS.into(),
            resource_names_subscribe: eds.clone(),
            initial_resource_versions: versions(eds),
            ..Default::default()
        },
    ];
    let mut c = DeltaStream::new();
    let now = Instant::now();
    for req in &requests {
        let effects = c.on_request(req).unwrap();
        let applied = group.apply_effects(id, &effects, now);
        c.subscribed_at(applied.seq);
    }
    let mut sent = 0;
    while let Some(out) = c.next_frame(group.store()) {
        sent += out.resources;
        let ack = DeltaDiscoveryRequest {
            type_url: out.type_url.clone(),
            response_nonce: out.frame.nonce.to_string(),
            ..Default::default()
        };
        c.on_request(&ack).unwrap();
    }
    group.remove_stream(id, &c.subscriptions(), now);
    sent
}

/// What one joining client costs the relay's core (loadgen's Delta join, no sockets): 50
/// Clusters by wildcard and 50 endpoint names, framed, ACKed, and the stream closed again.
#[divan::bench]
fn delta_join_one_client(bencher: Bencher) {
    bench_client_streams(bencher, false, 100);
}

/// The same client reconnecting in a storm: it reports every version it holds, so nothing is
/// sent but the wildcard's answer (A2).
#[divan::bench]
fn delta_resume_one_client(bencher: Bencher) {
    bench_client_streams(bencher, true, 0);
}

/// One client stream after another against the same group, each expected to receive `sent`
/// resources.
fn bench_client_streams(bencher: Bencher, resume: bool, sent: usize) {
    let mut group = join_group();
    // The slot of each stream that closed is the next one's, as in the relay; the names vary.
    let mut id = FLEET;
    bencher.bench_local(|| {
        id = FLEET + (id + 1 - FLEET) % 1000;
        let got = client_stream(&mut group, id, resume);
        assert_eq!(got, sent);
        black_box(got)
    });
}

/// A group whose clients want every Cluster, and the 1,000 Clusters of 1 KiB a SotW control
/// plane resends in full for each change (the body of `c0007` says `version`).
fn sotw_full_state(version: u8) -> Vec<Bytes> {
    (0..1000)
        .map(|i| {
            let mut value = Vec::new();
            prost::encoding::string::encode(1, &format!("c{i:04}"), &mut value);
            let fill = if i == 7 { version } else { 7 };
            prost::encoding::bytes::encode(2, &vec![fill; 1024], &mut value);
            prost_types::Any {
                type_url: CDS.into(),
                value,
            }
            .encode_to_vec()
            .into()
        })
        .collect()
}

fn wildcard_cluster_group() -> GroupState {
    let mut group = GroupState::new(Duration::from_secs(30));
    let effects = DeltaStream::new()
        .on_request(&DeltaDiscoveryRequest {
            type_url: CDS.into(),
            ..Default::default()
        })
        .unwrap();
    group.apply_effects(1, &effects, Instant::now());
    group
}

/// Issue 33: the relay's cost of one state-of-the-world upstream response of 1,000 Clusters of
/// 1 KiB with one changed (decode, wrap each plain Any with a version from its bytes, compare with
/// the cache by bytes): the change set is that one Cluster. Compare with
/// `delta_upstream_one_cluster_changed`, the same change over Delta.
#[divan::bench(sample_count = 20)]
fn sotw_upstream_1000_clusters_one_changed(bencher: Bencher) {
    use adsrelay::pb::wire::DiscoveryResponse;
    use adsrelay::xds::sotw_upstream::SotwUpstream;
    let mut group = wildcard_cluster_group();
    let mut session = SotwUpstream::new(Default::default());
    session.initial_requests(&mut group);
    let full = [sotw_full_state(1), sotw_full_state(2)];
    let mut n = 0u64;
    let respond = |group: &mut GroupState, session: &mut SotwUpstream, n: &mut u64| {
        *n += 1;
        let resp = DiscoveryResponse {
            version_info: n.to_string(),
            resources: full[(*n % 2) as usize].clone(),
            type_url: CDS.into(),
            nonce: n.to_string(),
            ..Default::default()
        };
        session.on_response(group, resp, Instant::now()).unwrap()
    };
    respond(&mut group, &mut session, &mut n);
    bencher.bench_local(|| {
        let out = respond(&mut group, &mut session, &mut n);
        assert!(matches!(&out.verdict, adsrelay::xds::Verdict::Applied { changes, .. } if changes.names.len() == 1));
        black_box(out)
    });
}

/// The same one-Cluster change as a Delta upstream sends it (one resource).
#[divan::bench]
fn delta_upstream_one_cluster_changed(bencher: Bencher) {
    use adsrelay::pb::wire::DeltaDiscoveryResponse;
    use adsrelay::xds::UpstreamSession;
    let mut group = wildcard_cluster_group();
    let session = UpstreamSession::new(Default::default());
    session.initial_requests(&mut group, true);
    let initial = DeltaDiscoveryResponse {
        type_url: CDS.into(),
        nonce: "0".into(),
        resources: (0..1000)
            .map(|i| resource(&format!("c{i:04}"), "1", 1024))
            .collect(),
        ..Default::default()
    };
    session
        .on_response(&mut group, initial, Instant::now())
        .unwrap();
    let mut n = 0u64;
    bencher.bench_local(|| {
        n += 1;
        let resp = DeltaDiscoveryResponse {
            type_url: CDS.into(),
            nonce: n.to_string(),
            resources: vec![resource("c0007", &n.to_string(), 1024)],
            ..Default::default()
        };
        black_box(
            session
                .on_response(&mut group, resp, Instant::now())
                .unwrap(),
        )
    });
}

/// Issue 34: what a reconciliation costs the relay per group: the control plane's full state of
/// 1,000 Clusters of 1 KiB on a stream without versions, compared with a cache that already holds
/// all of them (nothing changed, nothing is told to anyone).
#[divan::bench(sample_count = 20)]
fn delta_reconciliation_1000_clusters_unchanged(bencher: Bencher) {
    use adsrelay::pb::wire::DeltaDiscoveryResponse;
    use adsrelay::xds::UpstreamSession;
    let mut group = wildcard_cluster_group();
    let session = UpstreamSession::new(Default::default());
    session.initial_requests(&mut group, true);
    let full: Vec<Bytes> = (0..1000)
        .map(|i| resource(&format!("c{i:04}"), "1", 1024))
        .collect();
    let initial = DeltaDiscoveryResponse {
        type_url: CDS.into(),
        nonce: "0".into(),
        resources: full.clone(),
        ..Default::default()
    };
    session
        .on_response(&mut group, initial, Instant::now())
        .unwrap();
    let mut n = 0u64;
    bencher.bench_local(|| {
        n += 1;
        let (_, mut reconciliation) = session.reconciling_requests(&mut group);
        let resp = DeltaDiscoveryResponse {
            type_url: CDS.into(),
            nonce: n.to_string(),
            resources: full.clone(),
            ..Default::default()
        };
        let out = session
            .on_reconciling_response(&mut group, resp, Instant::now(), &mut reconciliation)
            .unwrap();
        assert!(matches!(&out.verdict, adsrelay::xds::Verdict::Applied { changes, .. } if changes.names.is_empty()));
        black_box(out)
    });
}
