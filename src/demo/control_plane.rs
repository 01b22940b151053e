//! The embedded demo control plane: a Delta ADS server whose store is the demo resource file. It
//! follows the spec's server rules through the same state machine as the relay (authoritative
//! store: unknown names do not exist, wildcards are always synced), and counts what it is asked so
//! tests can see exactly what the relay sends upstream.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::Status;

use crate::downstream::{Mailbox, StreamHost};
use crate::pb::core::Node;
use crate::sync::lock;
use crate::xds::constraints::params_of;
use crate::xds::{CachedResource, Locator, Name, RequestEffects, Store, StreamId, XdsRequest};

/// What the control plane has seen, for tests and the demo's log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub streams_opened: u64,
    pub active_streams: u64,
    pub requests: u64,
    /// (type_url, name) -> how many requests listed it in `resource_names_subscribe`; locators in
    /// `resource_locators_subscribe` are counted as `name{k=v,...}`.
    pub subscribes: BTreeMap<(String, String), u64>,
    /// (type_url, name) -> how many requests listed it in `resource_names_unsubscribe`.
    pub unsubscribes: BTreeMap<(String, String), u64>,
    /// (type_url, name) -> version, from `initial_resource_versions` of every request.
    pub initial_versions: BTreeMap<(String, String), String>,
    /// The `node.id` / `node.cluster` of every stream opened, in order.
    pub nodes: Vec<(String, String)>,
}

#[derive(Debug)]
pub struct ControlPlane {
    /// The resources served now, replaced whole on every edit.
    current: watch::Sender<Arc<Store>>,
    streams: DashMap<StreamId, Arc<Mailbox>>,
    next_stream: AtomicU64,
    stats: Mutex<Stats>,
    /// Test hook: resources served to streams whose `node.cluster` is the key instead of the
    /// common set (a control plane that tailors config per node).
    tailored: DashMap<String, Arc<Store>>,
}

impl ControlPlane {
    pub fn new(resources: Vec<(String, CachedResource)>) -> Arc<Self> {
        Arc::new(ControlPlane {
            current: watch::Sender::new(Arc::new(Store::complete(resources))),
            streams: DashMap::new(),
            next_stream: AtomicU64::new(1),
            stats: Mutex::new(Stats::default()),
            tailored: DashMap::new(),
        })
    }

    /// Replaces the whole resource set; every stream re-evaluates the affected types and receives
    /// only what actually changed for it.
    pub fn set_resources(&self, resources: Vec<(String, CachedResource)>) {
        let new = Arc::new(Store::complete(resources));
        let old = self.current.send_replace(new.clone());
        let mut types: Vec<String> = old
            .type_urls()
            .chain(new.type_urls())
            .map(String::from)
            .collect();
        types.sort();
        types.dedup();
        for mailbox in self.streams.iter() {
            for t in &types {
                mailbox.post_all(t);
            }
        }
    }

    /// Test hook: serve `resources` to streams of node cluster `cluster` (set before they open),
    /// and push the change to open ones.
    pub fn set_resources_for(&self, cluster: &str, resources: Vec<(String, CachedResource)>) {
        let new = Arc::new(Store::complete(resources));
        let types: Vec<String> = new.type_urls().map(String::from).collect();
        self.tailored.insert(cluster.to_string(), new);
        for mailbox in self.streams.iter() {
            for t in &types {
                mailbox.post_all(t);
            }
        }
    }

    /// Test hook: replaces the resources without telling open streams, as a control plane that
    /// loses a push would. Only a new stream (or a request on an open one) sees the change.
    pub fn set_resources_silently(&self, resources: Vec<(String, CachedResource)>) {
        self.current
            .send_replace(Arc::new(Store::complete(resources)));
    }

    /// Ends every open stream with UNAVAILABLE, as a control plane that goes down would.
    pub fn disconnect_all(&self) {
        for mailbox in self.streams.iter() {
            mailbox.close(Status::unavailable("control plane shutting down"));
        }
    }

    pub fn stats(&self) -> Stats {
        lock(&self.stats).clone()
    }

    /// Serves Delta ADS on `listener` until `shutdown` completes.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        let mut server = tonic::transport::Server::builder();
        crate::downstream::services::add_all(&mut server, self, 64 << 20)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                shutdown,
            )
            .await
    }
}

impl StreamHost for ControlPlane {
    /// The node cluster, when the stream is served tailored resources.
    type Membership = Option<String>;

    fn open(
        &self,
        id: StreamId,
        node: &Node,
        mailbox: Arc<Mailbox>,
    ) -> Result<Option<String>, Status> {
        self.streams.insert(id, mailbox);
        let mut stats = lock(&self.stats);
        stats.streams_opened += 1;
        stats.active_streams += 1;
        stats.nodes.push((node.id.clone(), node.cluster.clone()));
        Ok(self
            .tailored
            .contains_key(&node.cluster)
            .then(|| node.cluster.clone()))
    }

    fn on_request<R: XdsRequest + prost::Message>(&self, _: &Option<String>, req: &R) {
        let mut stats = lock(&self.stats);
        stats.requests += 1;
        // Only Delta requests (the relay's upstream protocol) are broken down by name.
        let Some(req) = req.as_delta() else { return };
        let locator = |l: &crate::pb::discovery::ResourceLocator| {
            Locator::with_params(l.name.as_str(), std::sync::Arc::new(params_of(l))).to_string()
        };
        let subscribed = req
            .resource_names_subscribe
            .iter()
            .cloned()
            .chain(req.resource_locators_subscribe.iter().map(locator));
        for n in subscribed {
            *stats
                .subscribes
                .entry((req.type_url.clone(), n))
                .or_default() += 1;
        }
        for (n, v) in &req.initial_resource_versions {
            stats
                .initial_versions
                .insert((req.type_url.clone(), n.clone()), v.clone());
        }
        let unsubscribed = req
            .resource_names_unsubscribe
            .iter()
            .cloned()
            .chain(req.resource_locators_unsubscribe.iter().map(locator));
        for n in unsubscribed {
            *stats
                .unsubscribes
                .entry((req.type_url.clone(), n))
                .or_default() += 1;
        }
    }

    fn on_effects(&self, s: &Option<String>, _: StreamId, _: &RequestEffects) -> u64 {
        self.with_store(s, |store| store.seq())
    }

    fn with_store<R>(&self, s: &Option<String>, f: impl FnOnce(&Store) -> R) -> R {
        if let Some(store) = s.as_ref().and_then(|c| self.tailored.get(c)) {
            let store = store.clone();
            return f(&store);
        }
        f(&self.current.borrow())
    }

    fn close(&self, _: Option<String>, id: StreamId, _: Vec<(Name, Locator)>) {
        self.streams.remove(&id);
        lock(&self.stats).active_streams -= 1;
    }

    fn next_stream_id(&self) -> StreamId {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }
}
