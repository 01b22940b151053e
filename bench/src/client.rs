//! A simulated client: what it holds (versions per resource), when it counts as synced and as
//! having received an update, and the Delta ADS session that drives it like an Envoy does.
//!
//! The xDS variant is chosen by [`Protocol`]: [`run_delta`] (incremental) or [`run_sotw`]
//! (State of the World), both over [`ClientState`].

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use adsrelay::pb::core::Node;
use adsrelay::pb::discovery::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};

use crate::measure::RunCtx;
use crate::workload::{parse_index, parse_version, version_string, Kind, SyntheticBody};

const ABSENT: u32 = u32::MAX;
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
/// Stream failures (not churn reconnects) a client tolerates before giving up.
const MAX_FAILURES: u32 = 5;

/// The parts of `DeltaDiscoveryResponse` a client needs; prost skips the rest (resource bodies
/// included) without copying it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LiteResponse {
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<LiteResource>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub nonce: String,
    #[prost(string, repeated, tag = "6")]
    pub removed_resources: Vec<String>,
}

/// `envoy.service.discovery.v3.Resource`: name, version and the body undecoded.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LiteResource {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(message, optional, tag = "2")]
    pub resource: Option<LiteAny>,
    #[prost(string, tag = "3")]
    pub name: String,
}

/// `google.protobuf.Any` with its value left as shared bytes (no copy unless read).
#[derive(Clone, PartialEq, prost::Message)]
pub struct LiteAny {
    #[prost(bytes = "bytes", tag = "2")]
    pub value: bytes::Bytes,
}

impl LiteResource {
    /// (index, generation, whether the version is the server's own): from the version when the
    /// server kept the workload's (`uG`), else from the body (a server that derives versions from
    /// the bytes: a SotW upstream behind the relay, go-control-plane).
    fn held(&self) -> Option<(u32, u32, bool)> {
        let i = parse_index(&self.name)?;
        match parse_version(&self.version) {
            Some(v) => Some((i, v, false)),
            None => SyntheticBody::parse(&self.resource.as_ref()?.value).map(|(_, v)| (i, v, true)),
        }
    }
}

/// Which xDS variant the simulated clients speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Incremental (Delta) ADS: `DeltaAggregatedResources`.
    Delta,
    /// State-of-the-world ADS: `StreamAggregatedResources`.
    Sotw,
}

/// Commands the churn driver sends a client.
#[derive(Debug, Clone, Copy)]
pub enum Ctrl {
    /// Unsubscribe one EDS name and subscribe another from the pool.
    Swap,
    /// Close the stream and open a new one on the same connection (with initial versions).
    Reconnect,
    /// Reconnect storm: like `Reconnect`, and report when the new stream holds everything again.
    /// In a cold storm ([`RunCtx::cold_storm`]) the client first forgets what it holds (an Envoy
    /// restart), so it reports no versions and everything is sent again.
    Storm,
}

/// What one client holds.
#[derive(Debug)]
pub struct ClientState {
    pub id: u32,
    /// Cluster and Listener versions by index (wildcard: all of them).
    wild: [Vec<u32>; 2],
    present: [usize; 2],
    /// Subscribed EDS indices and their held versions.
    eds: Vec<(u32, u32)>,
    synced: bool,
    done_generation: u32,
    started: Instant,
}

impl ClientState {
    pub fn new(id: u32, ctx: &RunCtx) -> Self {
        let w = &ctx.workload;
        let eds = crate::sync::lock(&ctx.eds_subs[id as usize])
            .iter()
            .map(|&e| (e, ABSENT))
            .collect();
        ClientState {
            id,
            wild: [
                vec![ABSENT; w.clusters as usize],
                vec![ABSENT; w.listeners as usize],
            ],
            present: [0, 0],
            eds,
            synced: false,
            done_generation: 0,
            started: Instant::now(),
        }
    }

    pub fn eds_indices(&self) -> Vec<u32> {
        self.eds.iter().map(|&(k, _)| k).collect()
    }

    /// Records what a response carries; returns the number of resources in it.
    pub fn apply(&mut self, r: &LiteResponse, ctx: &RunCtx) -> usize {
        let Some(kind) = Kind::from_type_url(&r.type_url) else {
            return 0;
        };
        for res in &r.resources {
            let Some((i, v, own_version)) = res.held() else {
                continue;
            };
            if own_version {
                crate::sync::lock(&ctx.server_versions)
                    .entry((kind as u8, i, v))
                    .or_insert_with(|| res.version.clone());
            }
            self.set(kind, i, v);
        }
        for name in &r.removed_resources {
            if let Some(i) = parse_index(name) {
                self.set(kind, i, ABSENT);
            }
        }
        r.resources.len()
    }

    /// Records a State-of-the-World response of `kind` carrying `held` (index, version): Clusters
    /// and Listeners are the full state (anything not listed is gone), ClusterLoadAssignments merge.
    pub fn apply_sotw(&mut self, kind: Kind, held: &[(u32, u32)]) {
        if kind != Kind::Endpoints {
            let mut next = vec![ABSENT; self.wild[kind as usize].len()];
            for &(i, v) in held {
                if let Some(slot) = next.get_mut(i as usize) {
                    *slot = v;
                }
            }
            let k = kind as usize;
            self.present[k] = next.iter().filter(|&&v| v != ABSENT).count();
            self.wild[k] = next;
        } else {
            for &(i, v) in held {
                self.set(kind, i, v);
            }
        }
    }

    /// Forgets every resource held, keeping the subscriptions (a restarted client).
    pub fn forget(&mut self) {
        for held in &mut self.wild {
            held.fill(ABSENT);
        }
        self.present = [0, 0];
        for e in &mut self.eds {
            e.1 = ABSENT;
        }
    }

    /// Holds every Cluster, every Listener and each subscribed ClusterLoadAssignment.
    pub fn complete(&self) -> bool {
        self.present[0] == self.wild[0].len()
            && self.present[1] == self.wild[1].len()
            && self.eds.iter().all(|e| e.1 != ABSENT)
    }

    fn set(&mut self, kind: Kind, i: u32, v: u32) {
        match kind {
            Kind::Cluster | Kind::Listener => {
                let k = kind as usize;
                if let Some(slot) = self.wild[k].get_mut(i as usize) {
                    match (*slot == ABSENT, v == ABSENT) {
                        (true, false) => self.present[k] += 1,
                        (false, true) => self.present[k] -= 1,
                        _ => {}
                    }
                    *slot = v;
                }
            }
            Kind::Endpoints => {
                if let Some(e) = self.eds.iter_mut().find(|(k, _)| *k == i) {
                    e.1 = v;
                }
            }
        }
    }

    fn holds(&self, kind: Kind, i: u32, generation: u32) -> bool {
        let v = match kind {
            Kind::Cluster | Kind::Listener => self.wild[kind as usize]
                .get(i as usize)
                .copied()
                .unwrap_or(ABSENT),
            Kind::Endpoints => self
                .eds
                .iter()
                .find(|(k, _)| *k == i)
                .map_or(ABSENT, |e| e.1),
        };
        v != ABSENT && v >= generation
    }

    /// After a response or a subscription change: reports the first full sync and completion of
    /// the update in flight.
    pub fn check(&mut self, ctx: &RunCtx) {
        if !self.synced && self.complete() {
            self.synced = true;
            ctx.mark_synced(self.id, self.started);
        }
        let Some(spec) = ctx.current() else { return };
        let g = spec.generation;
        if g == self.done_generation || !spec.expected[self.id as usize] {
            return;
        }
        let c = &spec.changed.names;
        let done = c[0].iter().all(|&i| self.holds(Kind::Cluster, i, g))
            && c[1].iter().all(|&i| self.holds(Kind::Listener, i, g))
            && self
                .eds
                .iter()
                .all(|&(k, v)| !spec.changed.contains_eds(k) || (v != ABSENT && v >= g));
        if done {
            self.done_generation = g;
            spec.complete();
        }
    }

    /// Churn: replaces one subscribed EDS name with another from the pool. Returns (old, new).
    pub fn swap_eds(&mut self, ctx: &RunCtx, rng: &mut StdRng) -> Option<(u32, u32)> {
        let pool = ctx.workload.eds_pool;
        if self.eds.is_empty() || pool as usize <= self.eds.len() {
            return None;
        }
        let pos = rng.random_range(0..self.eds.len());
        let old = self.eds[pos].0;
        let new = (0..32)
            .map(|_| rng.random_range(0..pool))
            .find(|n| self.eds.iter().all(|(k, _)| k != n))?;
        self.eds[pos] = (new, ABSENT);
        *crate::sync::lock(&ctx.eds_subs[self.id as usize]) = self.eds_indices();
        Some((old, new))
    }

    /// (name -> version) of what this client holds of `kind`, for `initial_resource_versions`:
    /// the version the server sent.
    pub fn held_versions(&self, kind: Kind, ctx: &RunCtx) -> BTreeMap<String, String> {
        let held: Vec<(u32, u32)> = match kind {
            Kind::Cluster | Kind::Listener => self.wild[kind as usize]
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, v))
                .collect(),
            Kind::Endpoints => self.eds.clone(),
        };
        let server_versions = crate::sync::lock(&ctx.server_versions);
        held.into_iter()
            .filter(|&(_, v)| v != ABSENT)
            .map(|(i, v)| {
                let version = server_versions
                    .get(&(kind as u8, i, v))
                    .cloned()
                    .unwrap_or_else(|| version_string(v));
                (kind.name(i), version)
            })
            .collect()
    }
}

/// Runs one simulated client over `channel` until the phase drops its control sender.
pub async fn run_client(
    protocol: Protocol,
    ctx: Arc<RunCtx>,
    id: u32,
    channel: Channel,
    ctrl: mpsc::Receiver<Ctrl>,
) {
    match protocol {
        Protocol::Delta => run_delta(ctx, id, channel, ctrl).await,
        Protocol::Sotw => run_sotw(ctx, id, channel, ctrl).await,
    }
}

fn node(ctx: &RunCtx, id: u32) -> Node {
    Node {
        id: format!("loadgen-{id}"),
        cluster: ctx.group_of(id),
        ..Default::default()
    }
}

/// The requests that open (or reopen) a Delta stream, as Envoy sends them: wildcard Clusters and
/// Listeners (legacy wildcard: empty first subscribe), named ClusterLoadAssignments, each with the
/// versions already held.
fn delta_opening(state: &ClientState, node: Node, ctx: &RunCtx) -> Vec<DeltaDiscoveryRequest> {
    let mut out = Vec::with_capacity(3);
    for kind in Kind::ALL {
        out.push(DeltaDiscoveryRequest {
            node: out.is_empty().then(|| node.clone()),
            type_url: kind.type_url().into(),
            resource_names_subscribe: match kind {
                Kind::Endpoints => state
                    .eds_indices()
                    .into_iter()
                    .map(|i| kind.name(i))
                    .collect(),
                _ => Vec::new(),
            },
            initial_resource_versions: state.held_versions(kind, ctx),
            ..Default::default()
        });
    }
    out
}

fn ack(r: &LiteResponse) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: r.type_url.clone(),
        response_nonce: r.nonce.clone(),
        ..Default::default()
    }
}

enum StreamEnd {
    Failed,
    Churned,
    Storm,
    Stop,
}

/// One Delta ADS client: opens the stream, ACKs every response, follows churn commands, reopens the
/// stream after a failure (at most [`MAX_FAILURES`] times) with the versions it holds.
pub async fn run_delta(
    ctx: Arc<RunCtx>,
    id: u32,
    channel: Channel,
    mut ctrl: mpsc::Receiver<Ctrl>,
) {
    let mut state = ClientState::new(id, &ctx);
    let mut rng =
        StdRng::seed_from_u64(ctx.workload.seed ^ u64::from(id).wrapping_mul(0x2545_f491));
    let mut failures = 0;
    let mut opened_before = false;
    let mut storm_reopen = false;
    while failures < MAX_FAILURES {
        let (tx, rx) = mpsc::channel(16);
        for req in delta_opening(&state, node(&ctx, id), &ctx) {
            let _ = tx.try_send(req);
            ctx.requests.fetch_add(1, Ordering::Relaxed);
        }
        let mut grpc = tonic::client::Grpc::new(channel.clone())
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        let opened = match grpc.ready().await {
            Ok(()) => {
                let codec =
                    tonic_prost::ProstCodec::<DeltaDiscoveryRequest, LiteResponse>::default();
                grpc.streaming(
                    tonic::Request::new(ReceiverStream::new(rx)),
                    http::uri::PathAndQuery::from_static(DELTA_PATH),
                    codec,
                )
                .await
            }
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        };
        let mut stream = match opened {
            Ok(r) => r.into_inner(),
            Err(status) => {
                ctx.error(format!("client {id}: open stream: {status}"));
                failures += 1;
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
                continue;
            }
        };
        if opened_before {
            ctx.reconnects.fetch_add(1, Ordering::Relaxed);
        } else {
            ctx.connected.fetch_add(1, Ordering::Relaxed);
        }
        opened_before = true;
        // After a storm reconnect the client announced everything it holds in
        // initial_resource_versions; a server sends only what differs, so the client is synced
        // again as soon as the stream is open and it holds its whole set.
        let mut storm_pending = std::mem::take(&mut storm_reopen);
        if storm_pending && state.complete() {
            ctx.mark_resynced();
            storm_pending = false;
        }
        let end = loop {
            tokio::select! {
                m = stream.message() => match m {
                    Ok(Some(r)) => {
                        let n = state.apply(&r, &ctx);
                        ctx.responses.fetch_add(1, Ordering::Relaxed);
                        ctx.resources_received.fetch_add(n as u64, Ordering::Relaxed);
                        let _ = tx.send(ack(&r)).await;
                        ctx.requests.fetch_add(1, Ordering::Relaxed);
                        state.check(&ctx);
                        if storm_pending && state.complete() {
                            ctx.mark_resynced();
                            storm_pending = false;
                        }
                    }
                    Ok(None) => {
                        ctx.error(format!("client {id}: stream ended by the server"));
                        break StreamEnd::Failed;
                    }
                    Err(status) => {
                        ctx.error(format!("client {id}: {status}"));
                        break StreamEnd::Failed;
                    }
                },
                c = ctrl.recv() => match c {
                    Some(Ctrl::Swap) => {
                        if let Some((old, new)) = state.swap_eds(&ctx, &mut rng) {
                            ctx.churn_events.fetch_add(1, Ordering::Relaxed);
                            let _ = tx.send(DeltaDiscoveryRequest {
                                type_url: Kind::Endpoints.type_url().into(),
                                resource_names_subscribe: vec![Kind::Endpoints.name(new)],
                                resource_names_unsubscribe: vec![Kind::Endpoints.name(old)],
                                ..Default::default()
                            }).await;
                            state.check(&ctx);
                        }
                    }
                    Some(Ctrl::Reconnect) => {
                        ctx.churn_events.fetch_add(1, Ordering::Relaxed);
                        break StreamEnd::Churned;
                    }
                    Some(Ctrl::Storm) => {
                        if ctx.cold_storm {
                            state.forget();
                        }
                        break StreamEnd::Storm;
                    }
                    None => break StreamEnd::Stop,
                },
            }
        };
        match end {
            StreamEnd::Stop => return,
            StreamEnd::Churned => {}
            StreamEnd::Storm => storm_reopen = true,
            StreamEnd::Failed => {
                // A stream lost in the middle of a storm still owes its resync: the next one
                // counts it (it resumes with what this one received).
                storm_reopen = storm_pending;
                failures += 1;
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
            }
        }
    }
}

/// (index, version) from a State-of-the-World resource: the `Any` carries no version, the
/// synthetic body does (see `workload::SyntheticBody`).
fn sotw_entry(any: &prost_types::Any) -> Option<(u32, u32)> {
    SyntheticBody::parse(&any.value)
}

/// The SotW request for `kind`: Clusters and Listeners by wildcard (empty names), EDS by name.
fn sotw_request(
    state: &ClientState,
    kind: Kind,
    node: Option<Node>,
    version_info: String,
    response_nonce: String,
) -> DiscoveryRequest {
    DiscoveryRequest {
        node,
        type_url: kind.type_url().into(),
        resource_names: match kind {
            Kind::Endpoints => state
                .eds_indices()
                .into_iter()
                .map(|i| kind.name(i))
                .collect(),
            _ => Vec::new(),
        },
        version_info,
        response_nonce,
        ..Default::default()
    }
}

/// One State-of-the-World ADS client (`StreamAggregatedResources`, the generated client): wildcard
/// Clusters and Listeners, named ClusterLoadAssignments; ACKs every response with its version_info
/// and nonce; follows churn commands (a swap re-sends the EDS name list); reopens the stream after
/// a failure (at most [`MAX_FAILURES`] times). SotW has no initial versions: a reopened stream
/// starts with empty version_info and receives the full state again.
pub async fn run_sotw(ctx: Arc<RunCtx>, id: u32, channel: Channel, mut ctrl: mpsc::Receiver<Ctrl>) {
    let mut state = ClientState::new(id, &ctx);
    let mut rng =
        StdRng::seed_from_u64(ctx.workload.seed ^ u64::from(id).wrapping_mul(0x2545_f491));
    let mut failures = 0;
    let mut opened_before = false;
    let mut storm_reopen = false;
    while failures < MAX_FAILURES {
        let (tx, rx) = mpsc::channel(16);
        for (n, kind) in Kind::ALL.into_iter().enumerate() {
            let node = (n == 0).then(|| node(&ctx, id));
            let _ = tx.try_send(sotw_request(
                &state,
                kind,
                node,
                String::new(),
                String::new(),
            ));
            ctx.requests.fetch_add(1, Ordering::Relaxed);
        }
        let mut ads = AggregatedDiscoveryServiceClient::new(channel.clone())
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        let mut stream = match ads
            .stream_aggregated_resources(ReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(status) => {
                ctx.error(format!("client {id}: open stream: {status}"));
                failures += 1;
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
                continue;
            }
        };
        if opened_before {
            ctx.reconnects.fetch_add(1, Ordering::Relaxed);
        } else {
            ctx.connected.fetch_add(1, Ordering::Relaxed);
        }
        opened_before = true;
        // After a storm: synced again once a response of every type arrived on the new stream and
        // the client holds its whole set.
        let mut storm_pending = std::mem::take(&mut storm_reopen);
        let mut seen = [false; 3];
        // Last accepted (version_info, nonce) of EDS, for re-sending the name list on a swap.
        let mut eds_ack = (String::new(), String::new());
        let end = loop {
            tokio::select! {
                m = stream.message() => match m {
                    Ok(Some(r)) => {
                        ctx.responses.fetch_add(1, Ordering::Relaxed);
                        ctx.resources_received.fetch_add(r.resources.len() as u64, Ordering::Relaxed);
                        let Some(kind) = Kind::from_type_url(&r.type_url) else { continue };
                        let held: Vec<(u32, u32)> = r.resources.iter().filter_map(sotw_entry).collect();
                        state.apply_sotw(kind, &held);
                        seen[kind as usize] = true;
                        if kind == Kind::Endpoints {
                            eds_ack = (r.version_info.clone(), r.nonce.clone());
                        }
                        let _ = tx
                            .send(sotw_request(&state, kind, None, r.version_info, r.nonce))
                            .await;
                        ctx.requests.fetch_add(1, Ordering::Relaxed);
                        state.check(&ctx);
                        if storm_pending && seen.iter().all(|&s| s) && state.complete() {
                            ctx.mark_resynced();
                            storm_pending = false;
                        }
                    }
                    Ok(None) => {
                        ctx.error(format!("client {id}: stream ended by the server"));
                        break StreamEnd::Failed;
                    }
                    Err(status) => {
                        ctx.error(format!("client {id}: {status}"));
                        break StreamEnd::Failed;
                    }
                },
                c = ctrl.recv() => match c {
                    Some(Ctrl::Swap) => {
                        if state.swap_eds(&ctx, &mut rng).is_some() {
                            ctx.churn_events.fetch_add(1, Ordering::Relaxed);
                            let (v, n) = eds_ack.clone();
                            let _ = tx
                                .send(sotw_request(&state, Kind::Endpoints, None, v, n))
                                .await;
                            state.check(&ctx);
                        }
                    }
                    Some(Ctrl::Reconnect) => {
                        ctx.churn_events.fetch_add(1, Ordering::Relaxed);
                        break StreamEnd::Churned;
                    }
                    Some(Ctrl::Storm) => {
                        if ctx.cold_storm {
                            state.forget();
                        }
                        break StreamEnd::Storm;
                    }
                    None => break StreamEnd::Stop,
                },
            }
        };
        match end {
            StreamEnd::Stop => return,
            StreamEnd::Churned => {}
            StreamEnd::Storm => storm_reopen = true,
            StreamEnd::Failed => {
                // A stream lost in the middle of a storm still owes its resync: the next one
                // counts it (it resumes with what this one received).
                storm_reopen = storm_pending;
                failures += 1;
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
            }
        }
    }
}

/// A Delta stream on a new connection of its own, opened with `node` and the subscriptions of
/// `state`: the request sender and the response stream, open until dropped.
type OwnStream = (
    mpsc::Sender<DeltaDiscoveryRequest>,
    tonic::Streaming<LiteResponse>,
);

async fn open_own_stream(
    endpoint: tonic::transport::Endpoint,
    state: &ClientState,
    node: Node,
    ctx: &RunCtx,
) -> Result<OwnStream, String> {
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (tx, rx) = mpsc::channel(16);
    for req in delta_opening(state, node, ctx) {
        let _ = tx.try_send(req);
    }
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let codec = tonic_prost::ProstCodec::<DeltaDiscoveryRequest, LiteResponse>::default();
    let stream = grpc
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            http::uri::PathAndQuery::from_static(DELTA_PATH),
            codec,
        )
        .await
        .map_err(|s| format!("open stream: {s}"))?
        .into_inner();
    Ok((tx, stream))
}

fn endpoint(addr: std::net::SocketAddr) -> Result<tonic::transport::Endpoint, String> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}")).map_err(|e| e.to_string())
}

/// One soak cycle: a new connection, a Delta stream subscribing like client `id` (wildcard
/// Clusters and Listeners, its EDS names), ACKs until it holds its whole set, then disconnect.
/// Bounded by `timeout`; returns what went wrong.
pub async fn soak_cycle(
    addr: std::net::SocketAddr,
    ctx: &RunCtx,
    id: u32,
    timeout: Duration,
) -> Result<(), String> {
    let session = async {
        let mut state = ClientState::new(id, ctx);
        let ep = endpoint(addr)?.tcp_nodelay(true);
        let (tx, mut stream) = open_own_stream(ep, &state, node(ctx, id), ctx).await?;
        while !state.complete() {
            match stream.message().await {
                Ok(Some(r)) => {
                    state.apply(&r, ctx);
                    let _ = tx.send(ack(&r)).await;
                }
                Ok(None) => return Err("stream ended by the server before sync".to_string()),
                Err(status) => return Err(status.to_string()),
            }
        }
        Ok(())
    };
    tokio::time::timeout(timeout, session)
        .await
        .map_err(|_| format!("not synced within {timeout:?}"))?
}

/// A client that stops reading: it opens a Delta stream like client `id` (on its own connection,
/// with HTTP/2's default 64 KiB stream window) and never reads a response. The returned handles
/// keep the connection and both directions of the stream open until dropped.
pub async fn stuck_client(
    addr: std::net::SocketAddr,
    ctx: &RunCtx,
    id: u32,
) -> Result<OwnStream, String> {
    let ep = endpoint(addr)?
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535));
    let mut stuck_node = node(ctx, id);
    stuck_node.id = format!("loadgen-stuck-{id}");
    open_own_stream(ep, &ClientState::new(id, ctx), stuck_node, ctx).await
}
