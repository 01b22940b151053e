//! `plain`: the control plane a user would write instead of running the relay, the usual way.
//! tonic's generated ADS service, one task per client stream, a `watch` channel carrying the
//! current snapshot, and on every change one response per client per changed type, built from
//! cloned `Resource` structs and prost-encoded per client by tonic's stock codec. Versions only:
//! each stream remembers name -> version of what the client holds, nothing is shared or cached
//! between streams.
//!
//! Delta: Clusters and Listeners by wildcard (legacy empty first subscribe, or `*`),
//! ClusterLoadAssignments by name; `initial_resource_versions` is honoured, so a reconnecting
//! client only receives what changed (and, for a wildcard type, the one empty response
//! conformance A2 requires, as go-control-plane sends it). SotW: the full state of a type whenever anything the client
//! subscribes to changed (Clusters and Listeners by wildcard, EDS by name).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use adsrelay::pb::discovery::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};

use crate::measure::UpstreamFigures;
use crate::workload::{parse_index, resource, Changed, Kind, Workload};

/// Every resource at its current version. Shared by all streams through the `watch` channel;
/// resources are `Arc`ed so a new snapshot only rebuilds what changed.
struct Snapshot {
    generation: u32,
    resources: [Vec<Arc<Resource>>; 3],
}

impl Snapshot {
    /// The resource `name` of `kind`, if it exists (names come from clients: checked, not trusted).
    fn get(&self, kind: Kind, name: &str) -> Option<&Arc<Resource>> {
        let r = self.resources[kind as usize].get(parse_index(name)? as usize)?;
        (r.name == name).then_some(r)
    }
}

pub struct PlainControlPlane {
    workload: Arc<Workload>,
    snapshot: watch::Sender<Arc<Snapshot>>,
    streams_opened: AtomicU64,
    active_streams: AtomicU64,
    requests: AtomicU64,
}

impl PlainControlPlane {
    pub fn new(workload: Arc<Workload>) -> Arc<Self> {
        let w = &workload;
        let resources = Kind::ALL.map(|k| {
            (0..w.count(k))
                .map(|i| Arc::new(resource(k, i, 0, w.resource_bytes)))
                .collect()
        });
        Arc::new(PlainControlPlane {
            snapshot: watch::Sender::new(Arc::new(Snapshot {
                generation: 0,
                resources,
            })),
            workload,
            streams_opened: AtomicU64::new(0),
            active_streams: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        })
    }

    /// Publishes a snapshot where the `changed` resources are at `generation`.
    pub fn push(&self, changed: &Changed, generation: u32) {
        let mut resources = self.snapshot.borrow().resources.clone();
        for kind in Kind::ALL {
            for &i in &changed.names[kind as usize] {
                if let Some(slot) = resources[kind as usize].get_mut(i as usize) {
                    *slot = Arc::new(resource(kind, i, generation, self.workload.resource_bytes));
                }
            }
        }
        self.snapshot.send_replace(Arc::new(Snapshot {
            generation,
            resources,
        }));
    }

    pub fn stats(&self) -> UpstreamFigures {
        UpstreamFigures {
            streams_opened: self.streams_opened.load(Ordering::Relaxed),
            active_streams: self.active_streams.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }

    /// Serves ADS (Delta and SotW) on `listener` until the process ends.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<(), String> {
        let svc = AggregatedDiscoveryServiceServer::from_arc(Arc::new(Service(self)))
            .max_decoding_message_size(64 << 20);
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            )
            .await
            .map_err(|e| format!("plain control plane: {e}"))
    }

    /// Counts a stream for as long as the returned guard lives.
    fn open_stream(self: &Arc<Self>) -> StreamGuard {
        self.streams_opened.fetch_add(1, Ordering::Relaxed);
        self.active_streams.fetch_add(1, Ordering::Relaxed);
        StreamGuard(self.clone())
    }
}

struct StreamGuard(Arc<PlainControlPlane>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.active_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One type on one stream: what the client subscribes to and the versions it holds.
#[derive(Default)]
struct TypeState {
    /// Requested at least once on this stream.
    active: bool,
    wildcard: bool,
    names: HashSet<String>,
    /// name -> version the client holds (sent to it, or announced in initial_resource_versions).
    held: HashMap<String, String>,
    /// Delta: a response of this type went out on the stream.
    answered: bool,
}

impl TypeState {
    /// The subscribed resources that exist in `snap`.
    fn wanted<'a>(&'a self, kind: Kind, snap: &'a Snapshot) -> Vec<&'a Arc<Resource>> {
        if self.wildcard {
            snap.resources[kind as usize].iter().collect()
        } else {
            self.names
                .iter()
                .filter_map(|n| snap.get(kind, n))
                .collect()
        }
    }

    /// The wanted resources whose version differs from what the client holds; records them as
    /// held.
    fn take_changed(&mut self, kind: Kind, snap: &Snapshot) -> Vec<Resource> {
        let out: Vec<Resource> = self
            .wanted(kind, snap)
            .into_iter()
            .filter(|r| self.held.get(&r.name) != Some(&r.version))
            .map(|r| (**r).clone())
            .collect();
        for r in &out {
            self.held.insert(r.name.clone(), r.version.clone());
        }
        out
    }
}

#[derive(Default)]
struct Session {
    types: [TypeState; 3],
    nonce: u64,
}

impl Session {
    fn next_nonce(&mut self) -> String {
        self.nonce += 1;
        self.nonce.to_string()
    }

    /// Delta: the response for `kind` carrying what the client lacks, if anything. Like
    /// go-control-plane, the first response to a wildcard subscription on a stream goes out even
    /// when empty (conformance A2: Envoy waits for it to finish initialising), so a reconnecting
    /// wildcard client whose versions are all current gets one empty response per type.
    fn delta_response(&mut self, kind: Kind, snap: &Snapshot) -> Option<DeltaDiscoveryResponse> {
        let t = &mut self.types[kind as usize];
        let resources = t.take_changed(kind, snap);
        if resources.is_empty() && (t.answered || !t.wildcard) {
            return None;
        }
        t.answered = true;
        Some(DeltaDiscoveryResponse {
            system_version_info: format!("g{}", snap.generation),
            resources,
            type_url: kind.type_url().into(),
            nonce: self.next_nonce(),
            ..Default::default()
        })
    }

    /// SotW: the full state of `kind` for this client, if `force` or anything in it changed.
    fn sotw_response(
        &mut self,
        kind: Kind,
        snap: &Snapshot,
        force: bool,
    ) -> Option<DiscoveryResponse> {
        let t = &mut self.types[kind as usize];
        if t.take_changed(kind, snap).is_empty() && !force {
            return None;
        }
        let resources = t
            .wanted(kind, snap)
            .into_iter()
            .filter_map(|r| r.resource.clone())
            .collect();
        Some(DiscoveryResponse {
            version_info: format!("g{}", snap.generation),
            resources,
            type_url: kind.type_url().into(),
            nonce: self.next_nonce(),
            ..Default::default()
        })
    }
}

struct Service(Arc<PlainControlPlane>);

type Out<T> = ReceiverStream<Result<T, Status>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Service {
    type StreamAggregatedResourcesStream = Out<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = Out<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(run_sotw(self.0.clone(), request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(run_delta(self.0.clone(), request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// One Delta stream until the client goes away.
async fn run_delta(
    cp: Arc<PlainControlPlane>,
    mut requests: Streaming<DeltaDiscoveryRequest>,
    tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
) {
    let _guard = cp.open_stream();
    let mut snapshots = cp.snapshot.subscribe();
    let mut s = Session::default();
    loop {
        let due: Vec<Kind> = tokio::select! {
            m = requests.message() => {
                let Ok(Some(req)) = m else { return };
                cp.requests.fetch_add(1, Ordering::Relaxed);
                let Some(kind) = Kind::from_type_url(&req.type_url) else { continue };
                let t = &mut s.types[kind as usize];
                let first = !t.active;
                t.active = true;
                if first && kind != Kind::Endpoints && req.resource_names_subscribe.is_empty() {
                    t.wildcard = true;
                }
                t.held.extend(req.initial_resource_versions);
                let subscribing = !req.resource_names_subscribe.is_empty();
                for name in req.resource_names_subscribe {
                    if name == "*" {
                        t.wildcard = true;
                    } else {
                        t.names.insert(name);
                    }
                }
                for name in &req.resource_names_unsubscribe {
                    if name == "*" {
                        t.wildcard = false;
                    }
                    t.names.remove(name);
                    t.held.remove(name);
                }
                // An ACK (no subscription change) needs no answer.
                if first || subscribing { vec![kind] } else { continue }
            }
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return;
                }
                snapshots.borrow_and_update();
                Kind::ALL.into_iter().filter(|k| s.types[*k as usize].active).collect()
            }
        };
        // Not borrow_and_update: a change seen here must still wake the branch above, which
        // sends it for every type, not just this one.
        let snap = snapshots.borrow().clone();
        for kind in due {
            if let Some(r) = s.delta_response(kind, &snap) {
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// One SotW stream until the client goes away.
async fn run_sotw(
    cp: Arc<PlainControlPlane>,
    mut requests: Streaming<DiscoveryRequest>,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
) {
    let _guard = cp.open_stream();
    let mut snapshots = cp.snapshot.subscribe();
    let mut s = Session::default();
    loop {
        let (due, force): (Vec<Kind>, bool) = tokio::select! {
            m = requests.message() => {
                let Ok(Some(req)) = m else { return };
                cp.requests.fetch_add(1, Ordering::Relaxed);
                let Some(kind) = Kind::from_type_url(&req.type_url) else { continue };
                let t = &mut s.types[kind as usize];
                let first = !t.active;
                t.active = true;
                let names: HashSet<String> = req.resource_names.into_iter().collect();
                let wildcard = kind != Kind::Endpoints && (names.is_empty() || names.contains("*"));
                // An ACK repeats the subscription; only a first request or a new name list
                // needs an answer (the full state of the type).
                if !first && wildcard == t.wildcard && names == t.names {
                    continue;
                }
                t.wildcard = wildcard;
                t.names = names;
                t.held.retain(|n, _| wildcard || t.names.contains(n));
                (vec![kind], true)
            }
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return;
                }
                snapshots.borrow_and_update();
                let active = Kind::ALL.into_iter().filter(|k| s.types[*k as usize].active);
                (active.collect(), false)
            }
        };
        let snap = snapshots.borrow().clone();
        for kind in due {
            if let Some(r) = s.sotw_response(kind, &snap, force) {
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
        }
    }
}
