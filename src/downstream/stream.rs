//! One task per downstream stream (Delta or SotW): reads requests, applies them to the protocol
//! core, and writes responses built from the current store whenever the client can take one. The
//! same driver serves the relay's clients and the demo control plane's (the relay, in the demo).

use std::sync::Arc;

use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::{debug, info, warn, Instrument};

use super::mailbox::Mailbox;
use crate::pb::core::Node;
use crate::xds::{
    AckStatus, Name, RequestEffects, Store, StreamCore, StreamId, XdsRequest, XdsResponse,
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
    /// Applies a request's subscription changes (interest, subscriber index).
    fn on_effects(&self, session: &Self::Session, id: StreamId, effects: &RequestEffects);
    /// Runs `f` with the store the session is served from.
    fn with_store<R>(&self, session: &Self::Session, f: impl FnOnce(&Store) -> R) -> R;
    /// The stream ended; `held` is every subscription it still had.
    fn close(&self, session: Self::Session, id: StreamId, held: Vec<(String, Name)>);
    fn next_stream_id(&self) -> StreamId;
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
    C::Response: XdsResponse + Send + 'static,
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
    C::Response: XdsResponse + Send + 'static,
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
    let span =
        tracing::info_span!("xds_stream", stream = id, node_id = %node.id, cluster = %node.cluster);
    let mut core = C::for_node(&node);
    let outcome = async {
        info!("stream opened");
        handle(&*host, &session, id, &mut core, first, fixed_type)?;
        let mut dirty = true;
        loop {
            tokio::select! {
                msg = inbound.message() => match msg {
                    Ok(Some(req)) => {
                        handle(&*host, &session, id, &mut core, req, fixed_type)?;
                        dirty = true;
                    }
                    Ok(None) => return Ok(()),
                    Err(status) => {
                        debug!(%status, "stream ended by the client");
                        return Ok(());
                    }
                },
                () = mailbox.notified() => {
                    dirty |= mailbox.drain_into(&mut core)?;
                }
                permit = tx.reserve(), if dirty => {
                    let Ok(permit) = permit else { return Ok(()) };
                    mailbox.drain_into(&mut core)?;
                    match host.with_store(&session, |store| core.next_response(store)) {
                        Some(resp) => {
                            let (type_url, nonce, count) = resp.summary();
                            debug!(%type_url, %nonce, resources = count, "sending response");
                            permit.send(Ok(resp));
                        }
                        None => dirty = false,
                    }
                }
            }
        }
    }
    .instrument(span.clone())
    .await;
    if let Err(status) = outcome {
        let _ = tx.send(Err(status)).await;
    }
    span.in_scope(|| info!("stream closed"));
    host.close(session, id, core.subscriptions());
}

fn handle<H, C>(
    host: &H,
    session: &H::Session,
    id: StreamId,
    core: &mut C,
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
    let effects = core
        .on_request(&req)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    match &effects.ack {
        AckStatus::Nack { nonce, message } => {
            warn!(type_url = %effects.type_url, %nonce, error = %message, "client rejected a response (NACK)")
        }
        AckStatus::Ack { nonce } => debug!(type_url = %effects.type_url, %nonce, "ACK"),
        AckStatus::Stale { nonce } => debug!(type_url = %effects.type_url, %nonce, "stale nonce"),
        AckStatus::None => {}
    }
    if !effects.acquire.is_empty() || !effects.release.is_empty() {
        debug!(type_url = %effects.type_url, subscribe = ?effects.acquire, unsubscribe = ?effects.release, "subscription change");
        host.on_effects(session, id, &effects);
    }
    Ok(())
}
