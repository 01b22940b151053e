//! One task per downstream stream (Delta or SotW): reads requests, applies them to the protocol
//! core, and writes responses built from the current store whenever the client can take one. The
//! same driver serves the relay's clients and the demo control plane's (the relay, in the demo).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use futures::Stream;
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::{debug, info, warn, Instrument};

use super::mailbox::Mailbox;
use crate::metrics::Rejection;
use crate::pb::core::Node;
use crate::sync::lock;
use crate::xds::constraints::Params;
use crate::xds::{
    AckStatus, Locator, RequestEffects, Store, StreamCore, StreamId, TypeSnapshot, XdsRequest,
    XdsResponse,
};

/// What a stream needs from whoever owns the store it serves.
pub trait StreamHost: Send + Sync + 'static {
    /// Per-stream context the host keeps (e.g. the aggregation group).
    type Session: Send + Sync + 'static;

    /// Admits a new stream given the node of its first request; registers its mailbox.
    fn open(
        &self,
        id: StreamId,
        node: &Node,
        mailbox: Arc<Mailbox>,
    ) -> Result<Self::Session, Status>;
    /// Sees every request as it arrives (the demo control plane counts them).
    fn on_request<R: XdsRequest + prost::Message>(&self, _session: &Self::Session, _req: &R) {}
    /// Dynamic parameters for the node's plain-name subscriptions (TP2 migration path).
    fn default_params(&self, _node: &Node) -> Params {
        Params::new()
    }
    /// Applies a request's subscription changes (interest, subscriber index); returns the store
    /// sequence number they were applied at.
    fn on_effects(&self, session: &Self::Session, id: StreamId, effects: &RequestEffects) -> u64;
    /// The stream needs `do_not_cache` content sent again by the upstream (C3).
    fn refetch(&self, _session: &Self::Session, _locators: Vec<(String, Locator)>) {}
    /// Runs `f` with the store the session is served from.
    fn with_store<R>(&self, session: &Self::Session, f: impl FnOnce(&Store) -> R) -> R;
    /// The stream ended; `held` is every subscription it still had.
    fn close(&self, session: Self::Session, id: StreamId, held: Vec<(String, Locator)>);
    fn next_stream_id(&self) -> StreamId;
    /// The name of the session's group, for introspection.
    fn group_name(&self, _session: &Self::Session) -> String {
        String::new()
    }
    /// Sees what happens on streams, for metrics and introspection (the relay records them; the
    /// demo control plane does not).
    fn observe(&self, _event: StreamEvent<'_>) {}
}

/// Something that happened on a stream, for [`StreamHost::observe`].
#[derive(Debug)]
pub enum StreamEvent<'a> {
    /// A stream was admitted; the entry stays valid (and introspectable) until it closes.
    Opened(&'a Arc<ClientEntry>),
    /// The relay ended a stream because of a bad request.
    Rejected(Rejection),
    /// The client answered a response: ACK, or NACK (`nack`).
    Answered { type_url: &'a str, nack: bool },
    /// A response was handed to the transport. `received_at` is the earliest upstream receipt
    /// among the changes of this type the stream took in since its previous response of the type.
    Sent {
        protocol: &'static str,
        type_url: &'a str,
        resources: usize,
        bytes: usize,
        received_at: Option<Instant>,
    },
}

/// Read access to a stream's protocol state from outside its task (admin API, CSDS).
pub trait Introspect: Send + Sync {
    fn snapshot(&self, resources: bool) -> Vec<TypeSnapshot>;
}

impl<C: StreamCore + Send> Introspect for Mutex<C> {
    fn snapshot(&self, resources: bool) -> Vec<TypeSnapshot> {
        lock(self).snapshot(resources)
    }
}

/// When a client last ACKed and NACKed a type.
#[derive(Debug, Clone, Copy, Default)]
pub struct AckTimes {
    pub last_ack: Option<SystemTime>,
    pub last_nack: Option<SystemTime>,
}

/// One downstream stream as the admin API and CSDS see it. Its protocol state is read on demand
/// through `core` (the stream's own state machine behind an uncontended lock), so keeping this
/// registry costs the data path nothing but that lock.
pub struct ClientEntry {
    pub id: StreamId,
    pub node: Node,
    pub group: String,
    pub protocol: &'static str,
    pub connected_since: SystemTime,
    pub core: Arc<dyn Introspect>,
    ack_times: Mutex<HashMap<String, AckTimes>>,
}

impl std::fmt::Debug for ClientEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientEntry")
            .field("id", &self.id)
            .field("node_id", &self.node.id)
            .field("group", &self.group)
            .field("protocol", &self.protocol)
            .finish_non_exhaustive()
    }
}

impl ClientEntry {
    pub fn ack_times(&self, type_url: &str) -> AckTimes {
        lock(&self.ack_times)
            .get(type_url)
            .copied()
            .unwrap_or_default()
    }

    fn answered(&self, type_url: &str, nack: bool) {
        let mut times = lock(&self.ack_times);
        let t = times.entry(type_url.to_string()).or_default();
        if nack {
            t.last_nack = Some(SystemTime::now());
        } else {
            t.last_ack = Some(SystemTime::now());
        }
    }
}

pub type ResponseStream<T> = std::pin::Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Starts serving one stream and returns the response stream for tonic. `fixed_type` is the
/// type_url of a per-type (non-ADS) service, filled into requests that leave it empty.
pub fn serve<H, C>(
    host: Arc<H>,
    inbound: Streaming<C::Request>,
    fixed_type: Option<&'static str>,
) -> ResponseStream<C::Response>
where
    H: StreamHost,
    C: StreamCore + Send + 'static,
    C::Request: XdsRequest + prost::Message + Default + Send + 'static,
    C::Response: XdsResponse + prost::Message + Send + 'static,
{
    // One response in flight per stream: the rest stays as pending state in the state machine, so
    // a slow reader never accumulates outdated responses.
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(drive::<H, C>(host, inbound, tx, fixed_type));
    Box::pin(ReceiverStream::new(rx))
}

async fn drive<H, C>(
    host: Arc<H>,
    mut inbound: Streaming<C::Request>,
    tx: mpsc::Sender<Result<C::Response, Status>>,
    fixed_type: Option<&'static str>,
) where
    H: StreamHost,
    C: StreamCore + Send + 'static,
    C::Request: XdsRequest + prost::Message + Default + Send + 'static,
    C::Response: XdsResponse + prost::Message + Send + 'static,
{
    let first = match inbound.message().await {
        Ok(Some(first)) => first,
        Ok(None) => return,
        Err(status) => {
            debug!(%status, "stream failed before its first request");
            return;
        }
    };
    let Some(node) = first.node().cloned() else {
        host.observe(StreamEvent::Rejected(Rejection::MissingNode));
        debug!("rejecting a stream whose first request has no node");
        let _ = tx
            .send(Err(Status::invalid_argument(
                "the first request on a stream must carry node",
            )))
            .await;
        return;
    };
    let id = host.next_stream_id();
    let mailbox = Arc::new(Mailbox::default());
    let session = match host.open(id, &node, mailbox.clone()) {
        Ok(s) => s,
        Err(status) => {
            let _ = tx.send(Err(status)).await;
            return;
        }
    };
    let protocol = if first.as_delta().is_some() {
        "delta"
    } else {
        "sotw"
    };
    let group = host.group_name(&session);
    let span = tracing::info_span!("xds_stream", stream = id, node_id = %node.id,
        cluster = %node.cluster, %group, protocol);
    // The state machine is locked only by this task and, on demand, by introspection.
    let core = Arc::new(Mutex::new(C::for_node(&node, host.default_params(&node))));
    let client = Arc::new(ClientEntry {
        id,
        node: node.clone(),
        group,
        protocol,
        connected_since: SystemTime::now(),
        core: core.clone(),
        ack_times: Mutex::new(HashMap::new()),
    });
    host.observe(StreamEvent::Opened(&client));
    // Per type, the earliest upstream receipt among changes not yet written (fan-out latency).
    let mut received: HashMap<String, Instant> = HashMap::new();
    let outcome: Result<(), Status> = async {
        info!("stream opened");
        handle(&*host, &session, &client, &core, first, fixed_type)?;
        let mut dirty = true;
        loop {
            tokio::select! {
                msg = inbound.message() => match msg {
                    Ok(Some(req)) => {
                        handle(&*host, &session, &client, &core, req, fixed_type)?;
                        dirty = true;
                    }
                    Ok(None) => return Ok(()),
                    Err(status) => {
                        debug!(%status, "stream ended by the client");
                        return Ok(());
                    }
                },
                () = mailbox.notified() => {
                    dirty |= mailbox.drain_into(&mut *lock(&core), &mut received)?;
                }
                permit = tx.reserve(), if dirty => {
                    let Ok(permit) = permit else { return Ok(()) };
                    let (next, refetch) = {
                        let mut core = lock(&core);
                        mailbox.drain_into(&mut *core, &mut received)?;
                        let next = host.with_store(&session, |store| core.next_response(store));
                        (next, core.take_refetch())
                    };
                    if !refetch.is_empty() {
                        host.refetch(&session, refetch);
                    }
                    match next {
                        Some(resp) => {
                            let (type_url, nonce, count) = resp.summary();
                            debug!(%type_url, %nonce, resources = count, "sending response");
                            host.observe(StreamEvent::Sent {
                                protocol,
                                type_url,
                                resources: count,
                                bytes: resp.encoded_len(),
                                received_at: received.remove(type_url),
                            });
                            permit.send(Ok(resp));
                        }
                        None => {
                            // Nothing due: what was received produced nothing to write.
                            received.clear();
                            dirty = false;
                        }
                    }
                }
            }
        }
    }
    .instrument(span.clone())
    .await;
    if let Err(status) = outcome {
        if status.code() == tonic::Code::InvalidArgument {
            host.observe(StreamEvent::Rejected(Rejection::InvalidRequest));
        }
        span.in_scope(|| warn!(%status, "ending stream"));
        let _ = tx.send(Err(status)).await;
    }
    span.in_scope(|| info!("stream closed"));
    let held = lock(&core).subscriptions();
    host.close(session, id, held);
}

fn handle<H, C>(
    host: &H,
    session: &H::Session,
    client: &ClientEntry,
    core: &Mutex<C>,
    mut req: C::Request,
    fixed_type: Option<&'static str>,
) -> Result<(), Status>
where
    H: StreamHost,
    C: StreamCore,
    C::Request: XdsRequest + prost::Message,
{
    if let Some(t) = fixed_type {
        let type_url = req.type_url_mut();
        if type_url.is_empty() {
            *type_url = t.to_string();
        } else if type_url != t {
            return Err(Status::invalid_argument(format!(
                "this service serves {t}; request has type_url {type_url}"
            )));
        }
    }
    host.on_request(session, &req);
    let effects = lock(core)
        .on_request(&req)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    match &effects.ack {
        AckStatus::Nack { nonce, message } => {
            client.answered(&effects.type_url, true);
            host.observe(StreamEvent::Answered {
                type_url: &effects.type_url,
                nack: true,
            });
            warn!(type_url = %effects.type_url, %nonce, error = %message, "client rejected a response (NACK)")
        }
        AckStatus::Ack { nonce } => {
            client.answered(&effects.type_url, false);
            host.observe(StreamEvent::Answered {
                type_url: &effects.type_url,
                nack: false,
            });
            debug!(type_url = %effects.type_url, %nonce, "ACK")
        }
        AckStatus::Stale { nonce } => debug!(type_url = %effects.type_url, %nonce, "stale nonce"),
        AckStatus::None => {}
    }
    if !effects.acquire.is_empty() || !effects.release.is_empty() {
        debug!(type_url = %effects.type_url, subscribe = ?effects.acquire, unsubscribe = ?effects.release, "subscription change");
        let seq = host.on_effects(session, client.id, &effects);
        lock(core).subscribed_at(seq);
    }
    Ok(())
}
