//! One task per downstream stream (Delta or SotW): reads requests, applies them to the protocol
//! core, and writes responses built from the current store whenever the client can take one. The
//! same driver serves the relay's clients and the demo control plane's (the relay, in the demo).

use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tonic::Status;
use tracing::{debug, Instrument};

use super::limits::{self, Refusal, RequestShape, StreamLimits, TokenBucket};
use super::mailbox::{Mailbox, Receipts};
use super::requests::RequestReader;
use super::slot;
use crate::metrics::StreamRejection;
use crate::pb::core::Node;
use crate::sync::lock;
use crate::tls::PeerIdentity;
use crate::xds::constraints::Params;
use crate::xds::names::{self, Name};
use crate::xds::{
    AckStatus, Locator, Protocol, ProtocolError, RequestEffects, Store, StreamCore, StreamId,
    TypeView, XdsRequest,
};

/// What a stream needs from whoever owns the store it serves.
pub trait StreamHost: Send + Sync + 'static {
    /// What joining gives a stream: its way to its group (the relay: the group itself).
    type Membership: Send + Sync + 'static;

    /// Admits a new stream given the node of its first request; registers its mailbox.
    fn open(
        &self,
        id: StreamId,
        node: &Node,
        mailbox: Arc<Mailbox>,
    ) -> Result<Self::Membership, Status>;
    /// May the client (its TLS identity, if any) join the group `node` maps to? Checked before
    /// [`StreamHost::open`].
    fn authorize(&self, _node: &Node, _peer: Option<&PeerIdentity>) -> Result<(), Status> {
        Ok(())
    }
    /// Sees every request as it arrives (the demo control plane counts them).
    fn on_request<R: XdsRequest + prost::Message>(&self, _membership: &Self::Membership, _req: &R) {
    }
    /// Dynamic parameters for the node's plain-name subscriptions (TP2 migration path).
    fn default_params(&self, _node: &Node) -> Params {
        Params::new()
    }
    /// Applies a request's subscription changes (interest, subscriber index); returns the store
    /// sequence number they were applied at.
    fn on_effects(
        &self,
        membership: &Self::Membership,
        id: StreamId,
        effects: &RequestEffects,
    ) -> u64;
    /// The stream needs `do_not_cache` content sent again by the upstream (C3).
    fn refetch(&self, _membership: &Self::Membership, _locators: Vec<(String, Locator)>) {}
    /// Runs `f` with the store the membership is served from.
    fn with_store<R>(&self, membership: &Self::Membership, f: impl FnOnce(&Store) -> R) -> R;
    /// The stream ended; `held` is every subscription it still had.
    fn close(&self, membership: Self::Membership, id: StreamId, held: Vec<(Name, Locator)>);
    fn next_stream_id(&self) -> StreamId;
    /// The limits every stream of this host enforces (default: none).
    fn limits(&self) -> StreamLimits {
        StreamLimits::default()
    }
    /// The name of the membership's group, for introspection.
    fn group_name(&self, _membership: &Self::Membership) -> String {
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
    Rejected(StreamRejection),
    /// The client answered a response: ACK, or NACK (`nack`).
    Answered { type_url: &'a str, nack: bool },
    /// A response was handed to the transport. `received_at` is the earliest upstream receipt
    /// among the changes of this type the stream took in since its previous response of the type.
    Sent {
        protocol: Protocol,
        type_url: &'a str,
        resources: usize,
        bytes: usize,
        received_at: Option<Instant>,
        /// The frame was shared with other streams rather than encoded for this one.
        shared: bool,
    },
}

/// Read access to a stream's protocol state from outside its task (admin API, CSDS).
pub trait Introspect: Send + Sync {
    fn view(&self, resources: bool) -> Vec<TypeView>;
}

impl<C: StreamCore + Send> Introspect for Mutex<C> {
    fn view(&self, resources: bool) -> Vec<TypeView> {
        lock(self).view(resources)
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
    pub protocol: Protocol,
    pub connected_since: SystemTime,
    pub core: Arc<dyn Introspect>,
    /// Per type: a stream speaks a few types, so a short list keyed by the interned type URL
    /// (no allocation per client per type) rather than a map.
    ack_times: Mutex<Vec<(Name, AckTimes)>>,
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
            .iter()
            .find(|(t, _)| &**t == type_url)
            .map(|(_, times)| *times)
            .unwrap_or_default()
    }

    fn answered(&self, type_url: &str, nack: bool) {
        let mut times = lock(&self.ack_times);
        let i = match times.iter().position(|(t, _)| &**t == type_url) {
            Some(i) => i,
            None => {
                times.push((names::intern(type_url), AckTimes::default()));
                times.len() - 1
            }
        };
        let t = &mut times[i].1;
        if nack {
            t.last_nack = Some(SystemTime::now());
        } else {
            t.last_ack = Some(SystemTime::now());
        }
    }
}

/// A stream's responses as the HTTP/2 body takes them: complete gRPC messages (shared frames),
/// then at most one status. One slot: a slow reader never accumulates outdated responses.
pub type Responses = slot::Receiver;

/// Starts serving one stream and returns its responses for the body. `fixed_type` is the
/// type_url of a per-type (non-ADS) service, filled into requests that leave it empty.
pub fn serve<H, C>(
    host: Arc<H>,
    inbound: RequestReader<C::Request>,
    fixed_type: Option<&'static str>,
    peer: Option<Arc<PeerIdentity>>,
) -> Responses
where
    H: StreamHost,
    C: StreamCore + Send + 'static,
    C::Request: XdsRequest + RequestShape + prost::Message + Default + Send + 'static,
{
    // One large response in flight per stream (or a few small ones that leave together): the
    // rest stays as pending state in the state machine, so a slow reader never accumulates
    // outdated responses.
    let (tx, rx) = slot::slot();
    tokio::spawn(drive::<H, C>(host, Box::new(inbound), tx, fixed_type, peer));
    rx
}

/// The stream task's end of the response slot.
type Outbox = slot::Sender;

/// The request stream, boxed: an async fn keeps its arguments for its whole life, so the task's
/// future holds 8 bytes here instead of the reader twice.
type Inbound<C> = Box<RequestReader<<C as StreamCore>::Request>>;

/// The task of one stream: admission (its own future, on the heap only while it runs: it holds
/// the first request and the node), then the request/response loop, then the ending. Split so
/// the future a stream keeps for its life is ~1 KiB rather than ~3.6 KiB (rustc keeps every
/// local of an async fn, moved or not, until its scope ends).
async fn drive<H, C>(
    host: Arc<H>,
    mut inbound: Inbound<C>,
    tx: Outbox,
    fixed_type: Option<&'static str>,
    peer: Option<Arc<PeerIdentity>>,
) where
    H: StreamHost,
    C: StreamCore + Send + 'static,
    C::Request: XdsRequest + RequestShape + prost::Message + Default + Send + 'static,
{
    let Some((mut stream, first)) = Box::pin(admit_stream::<H, C>(
        &host,
        &mut inbound,
        &tx,
        peer,
        fixed_type,
    ))
    .await
    else {
        return;
    };
    let span = stream.span.clone();
    let outcome = match span.in_scope(|| stream.handle(&*host, *first, fixed_type)) {
        Ok(_) => {
            stream
                .run(&*host, &mut inbound, &tx, fixed_type)
                .instrument(span.clone())
                .await
        }
        Err(refusal) => Err(refusal),
    };
    if let Err(refusal) = outcome {
        refuse(&*host, &tx, refusal).instrument(span.clone()).await;
    }
    span.in_scope(|| debug!("stream closed"));
    // A refused request left the core as it was: what it holds is what the group holds for it.
    let held = lock(&stream.core).subscriptions();
    host.close(stream.membership, stream.client.id, held);
}

/// A stream its group admitted: what its loop needs.
struct Admitted<H: StreamHost, C: StreamCore> {
    membership: H::Membership,
    client: Arc<ClientEntry>,
    core: Arc<Mutex<C>>,
    mailbox: Arc<Mailbox>,
    guard: Guard,
    span: tracing::Span,
    protocol: Protocol,
}

/// Reads the first request and admits the stream: limits, node, authorization, group. Returns the
/// first request, not yet applied; `None`: the stream was refused (and told why) or ended before
/// asking anything.
async fn admit_stream<H, C>(
    host: &Arc<H>,
    inbound: &mut Inbound<C>,
    tx: &Outbox,
    peer: Option<Arc<PeerIdentity>>,
    fixed_type: Option<&'static str>,
) -> Option<(Admitted<H, C>, Box<C::Request>)>
where
    H: StreamHost,
    C: StreamCore + Send + 'static,
    C::Request: XdsRequest + RequestShape + prost::Message + Default + Send + 'static,
{
    let first = match inbound.message().await {
        Ok(Some(first)) => first,
        Ok(None) => return None,
        Err(error) => {
            if let Some(refusal) = limits::classify_read_error(&error) {
                refuse(&**host, tx, refusal).await;
            } else {
                debug!(%error, "stream failed before its first request");
            }
            return None;
        }
    };
    let stream_limits = host.limits();
    if let Err(refusal) = limits::check_request(&first, &stream_limits) {
        refuse(&**host, tx, refusal).await;
        return None;
    }
    let Some(node) = first.node().cloned() else {
        host.observe(StreamEvent::Rejected(StreamRejection::MissingNode));
        debug!("rejecting a stream whose first request has no node");
        let _ = tx
            .send(Err(Box::new(Status::invalid_argument(
                "the first request on a stream must carry node",
            ))))
            .await;
        return None;
    };
    if let Err(status) = host.authorize(&node, peer.as_deref()) {
        let _ = tx.send(Err(Box::new(status))).await;
        return None;
    }
    let id = host.next_stream_id();
    let mailbox = Arc::new(Mailbox::default());
    let membership = match host.open(id, &node, mailbox.clone()) {
        Ok(s) => s,
        Err(status) => {
            let _ = tx.send(Err(Box::new(status))).await;
            return None;
        }
    };
    let protocol = if first.as_delta().is_some() {
        Protocol::Delta
    } else {
        Protocol::Sotw
    };
    let group = host.group_name(&membership);
    // DEBUG, like every per-stream line: at INFO a fleet's joins would flood the log, and an
    // enabled span costs on every poll of the stream.
    let span = tracing::debug_span!("xds_stream", stream = id, node_id = %node.id,
        cluster = %node.cluster, %group, protocol = protocol.label());
    // The state machine is locked only by this task and, on demand, by introspection.
    let mut state_machine = C::for_node(&node, host.default_params(&node));
    state_machine.limit_response_bytes(stream_limits.max_response_bytes);
    if fixed_type.is_some() {
        state_machine.serve_single_type();
    }
    let core = Arc::new(Mutex::new(state_machine));
    // The node moves into the registry entry: an Envoy's node (extensions, metadata) can be
    // kilobytes, and a copy kept by the task would be a second one per client.
    let client = Arc::new(ClientEntry {
        id,
        node,
        group,
        protocol,
        connected_since: SystemTime::now(),
        core: core.clone(),
        ack_times: Mutex::new(Vec::new()),
    });
    host.observe(StreamEvent::Opened(&client));
    span.in_scope(|| debug!("stream opened"));
    let admitted = Admitted {
        membership,
        client,
        core,
        mailbox,
        guard: Guard {
            bucket: limits::request_bucket(&stream_limits, Instant::now()),
            limits: stream_limits,
            subscriptions: 0,
        },
        span,
        protocol,
    };
    Some((admitted, Box::new(first)))
}

impl<H: StreamHost, C> Admitted<H, C>
where
    C: StreamCore + Send + 'static,
    C::Request: XdsRequest + RequestShape + prost::Message + Default + Send + 'static,
{
    fn handle(
        &mut self,
        host: &H,
        req: C::Request,
        fixed_type: Option<&'static str>,
    ) -> Result<bool, Refusal> {
        handle(
            host,
            &self.membership,
            &self.client,
            &self.core,
            req,
            fixed_type,
            &mut self.guard,
        )
    }

    /// Reads requests and writes responses until the stream ends: `Err` is why the relay ends it.
    async fn run(
        &mut self,
        host: &H,
        inbound: &mut Inbound<C>,
        tx: &Outbox,
        fixed_type: Option<&'static str>,
    ) -> Result<(), Refusal> {
        let stuck_timeout = self.guard.limits.stuck_timeout;
        let mut receipts = Receipts::default();
        // A response may be due. Cleared as soon as the core has nothing to send, so an ACK or a
        // written response costs no further wake-up of this task.
        let mut dirty = true;
        // Since when a response is due but the transport has not taken the previous one.
        let mut blocked_since: Option<tokio::time::Instant> = None;
        loop {
            // Write whenever a response may be due and the slot has room (the transport took the
            // previous frame, or only small ones wait); the select below waits only when it has
            // none.
            if dirty {
                match tx.is_free() {
                    Ok(true) => {
                        blocked_since = None;
                        dirty = self.write_next(host, tx, &mut receipts)?;
                        continue;
                    }
                    Ok(false) => {
                        blocked_since.get_or_insert_with(tokio::time::Instant::now);
                    }
                    Err(slot::Closed) => return Ok(()),
                }
            }
            let stuck_at = blocked_since
                .filter(|_| dirty && !stuck_timeout.is_zero())
                .map(|t| t + stuck_timeout);
            tokio::select! {
                msg = inbound.message() => match msg {
                    Ok(Some(req)) => {
                        admit(&req, &mut self.guard)?;
                        dirty |= self.handle(host, req, fixed_type)?;
                    }
                    Ok(None) => return Ok(()),
                    Err(error) => {
                        if let Some(refusal) = limits::classify_read_error(&error) {
                            return Err(refusal);
                        }
                        debug!(%error, "stream ended by the client");
                        return Ok(());
                    }
                },
                () = sleep_until_opt(stuck_at), if stuck_at.is_some() => {
                    return Err(Refusal::new(
                        StreamRejection::StuckClient,
                        Status::unavailable(format!(
                            "client has not read its responses for {stuck_timeout:?}; disconnecting"
                        )),
                    ));
                }
                () = self.mailbox.notified() => {
                    dirty |= self.mailbox.drain_into(&mut *lock(&self.core), &mut receipts)?;
                }
                // The slot emptied: the write happens at the top of the loop.
                ready = tx.ready(), if dirty => {
                    if ready.is_err() {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Writes the next response due, if any, into the transport's slot (the caller saw it
    /// free); returns whether another may be due.
    fn write_next(
        &mut self,
        host: &H,
        tx: &Outbox,
        receipts: &mut Receipts,
    ) -> Result<bool, Refusal> {
        let (next, refetch, more) = {
            let mut core = lock(&self.core);
            self.mailbox.drain_into(&mut *core, receipts)?;
            let next = host.with_store(&self.membership, |store| core.next_frame(store));
            (next, core.take_refetch(), core.has_work())
        };
        if !refetch.is_empty() {
            host.refetch(&self.membership, refetch);
        }
        let Some(out) = next else {
            // Nothing due: what was received produced nothing to write.
            receipts.clear();
            return Ok(false);
        };
        debug!(type_url = %out.type_url, nonce = out.frame.nonce,
            resources = out.resources, shared = out.shared, "sending response");
        host.observe(StreamEvent::Sent {
            protocol: self.protocol,
            type_url: &out.type_url,
            resources: out.resources,
            bytes: out.frame.message_len(),
            received_at: receipts.take(&out.type_url),
            shared: out.shared,
        });
        tx.put(Ok(out.frame.bytes));
        Ok(more)
    }
}

/// Per-stream limit state.
struct Guard {
    limits: StreamLimits,
    bucket: Option<TokenBucket>,
    /// Subscriptions the group holds for this stream (acquired minus released).
    subscriptions: usize,
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Ends a stream with the refusal's status (counted when it is the client's fault). The send is
/// bounded in time: a stuck client may never make room for it.
async fn refuse<H: StreamHost>(host: &H, tx: &Outbox, refusal: Refusal) {
    if let Some(reason) = refusal.reason {
        host.observe(StreamEvent::Rejected(reason));
    }
    let status = refusal.status;
    debug!(code = ?status.code(), message = %status.message(), "ending stream");
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        tx.send(Err(Box::new(status))),
    )
    .await;
}

/// A later request's admission: the stream's request rate, then the request's shape (the first
/// request's shape is checked before the stream joins its group).
fn admit<R: RequestShape>(req: &R, guard: &mut Guard) -> Result<(), Refusal> {
    if let Some(bucket) = &mut guard.bucket {
        if !bucket.take(Instant::now()) {
            return Err(limits::rate_limited(&guard.limits));
        }
    }
    limits::check_request(req, &guard.limits)
}

/// Applies an admitted request: to the state machine, then its effects to the group.
fn handle<H, C>(
    host: &H,
    membership: &H::Membership,
    client: &ClientEntry,
    core: &Mutex<C>,
    mut req: C::Request,
    fixed_type: Option<&'static str>,
    guard: &mut Guard,
) -> Result<bool, Refusal>
where
    H: StreamHost,
    C: StreamCore,
    C::Request: XdsRequest + RequestShape + prost::Message,
{
    let invalid = |status| Refusal::new(StreamRejection::InvalidRequest, status);
    if let Some(t) = fixed_type {
        let type_url = req.type_url_mut();
        if type_url.is_empty() {
            *type_url = t.to_string();
        } else if type_url != t {
            return Err(invalid(Status::invalid_argument(format!(
                "this service serves {t}; request has type_url {type_url}"
            ))));
        }
    }
    host.on_request(membership, &req);
    let may_add = req.subscribe_entries();
    // Whether a response is due is read under the same lock as the request is applied.
    let (effects, has_work) = {
        let mut core = lock(core);
        let effects = core.on_request_within(
            &req,
            guard.subscriptions,
            may_add,
            guard.limits.max_subscriptions,
        );
        (effects, core.has_work())
    };
    let effects = effects.map_err(|e| match e {
        ProtocolError::TooManySubscriptions { total, .. } => {
            limits::too_many_subscriptions(total, &guard.limits)
        }
        e => invalid(Status::invalid_argument(e.to_string())),
    })?;
    guard.subscriptions =
        (guard.subscriptions + effects.acquire.len()).saturating_sub(effects.release.len());
    match &effects.ack {
        AckStatus::Nack { nonce, message } => {
            client.answered(&effects.type_url, true);
            host.observe(StreamEvent::Answered {
                type_url: &effects.type_url,
                nack: true,
            });
            debug!(type_url = %effects.type_url, %nonce, error = %message, "client rejected a response (NACK)")
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
        let seq = host.on_effects(membership, client.id, &effects);
        lock(core).subscribed_at(seq);
    }
    Ok(has_work)
}
