//! One task per downstream Delta stream: reads requests, applies them to the protocol core, and
//! writes responses built from the current store whenever the client can take one. The same driver
//! serves the relay's clients and the demo control plane's (the relay itself, in the demo).

use std::sync::Arc;

use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::{debug, info, warn, Instrument};

use super::mailbox::Mailbox;
use crate::pb::core::Node;
use crate::pb::discovery::DeltaDiscoveryRequest;
use crate::pb::wire;
use crate::xds::{AckStatus, DeltaStream, RequestEffects, Store, StreamId};

/// What a stream needs from whoever owns the store it serves.
pub trait DeltaHost: Send + Sync + 'static {
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
    fn on_request(&self, _session: &Self::Session, _req: &DeltaDiscoveryRequest) {}
    /// Applies a request's subscription changes (interest, subscriber index).
    fn on_effects(&self, session: &Self::Session, id: StreamId, effects: &RequestEffects);
    /// Runs `f` with the store the session is served from.
    fn with_store<R>(&self, session: &Self::Session, f: impl FnOnce(&Store) -> R) -> R;
    /// The stream ended; `held` is every subscription it still had.
    fn close(&self, session: Self::Session, id: StreamId, held: Vec<(String, crate::xds::Name)>);
    fn next_stream_id(&self) -> StreamId;
}

pub type ResponseStream =
    std::pin::Pin<Box<dyn Stream<Item = Result<wire::DeltaDiscoveryResponse, Status>> + Send>>;

/// Starts serving one stream and returns the response stream for tonic.
pub fn serve<H: DeltaHost>(
    host: Arc<H>,
    inbound: Streaming<DeltaDiscoveryRequest>,
) -> ResponseStream {
    // One response in flight per stream: the rest stays as pending names in the state machine, so
    // a slow reader never accumulates outdated responses.
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(drive(host, inbound, tx));
    Box::pin(ReceiverStream::new(rx))
}

type Tx = mpsc::Sender<Result<wire::DeltaDiscoveryResponse, Status>>;

async fn drive<H: DeltaHost>(host: Arc<H>, mut inbound: Streaming<DeltaDiscoveryRequest>, tx: Tx) {
    let first = match inbound.message().await {
        Ok(Some(first)) => first,
        Ok(None) => return,
        Err(status) => {
            debug!(%status, "delta stream failed before its first request");
            return;
        }
    };
    let Some(node) = first.node.clone() else {
        let _ = tx
            .send(Err(Status::invalid_argument(
                "the first DeltaDiscoveryRequest on a stream must carry node",
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
    let span = tracing::info_span!("delta_stream", stream = id, node_id = %node.id, cluster = %node.cluster);
    let mut core = DeltaStream::new();
    let outcome = async {
        info!("stream opened");
        handle(&*host, &session, id, &mut core, &first)?;
        let mut dirty = true;
        loop {
            tokio::select! {
                msg = inbound.message() => match msg {
                    Ok(Some(req)) => {
                        handle(&*host, &session, id, &mut core, &req)?;
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
                            debug!(type_url = %resp.type_url, nonce = %resp.nonce,
                                resources = resp.resources.len(), removed = resp.removed_resources.len(),
                                "sending response");
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

fn handle<H: DeltaHost>(
    host: &H,
    session: &H::Session,
    id: StreamId,
    core: &mut DeltaStream,
    req: &DeltaDiscoveryRequest,
) -> Result<(), Status> {
    host.on_request(session, req);
    let effects = core
        .on_request(req)
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
