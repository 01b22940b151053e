//! The upstream side of one aggregation group: a single Delta ADS stream to the control plane
//! carrying the group's refcounted interest. Connects (retrying with jittered backoff until the
//! control plane is reachable), re-establishes every subscription with `initial_resource_versions`
//! from the cache after any reconnect (C4), applies responses to the group's store, ACKs or NACKs
//! each one itself (C7, C8), and fans the changes out to subscribed streams.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn, Instrument};

use crate::backoff::Backoff;
use crate::config::Config;
use crate::pb::core::{node::UserAgentVersionType, Node};
use crate::pb::discovery::{DeltaDiscoveryRequest, ResourceLocator};
use crate::pb::relay_ads::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::pb::rpc;
use crate::pb::wire::DeltaDiscoveryResponse;
use crate::relay::Group;
use crate::sync::lock;
use crate::xds::{Locator, UpstreamUpdate};

/// gRPC status code NOT_FOUND, which TP3 `resource_errors` use to say a resource does not exist.
const NOT_FOUND: i32 = 5;
/// gRPC status code INTERNAL, used in NACKs as Envoy does.
const INTERNAL: i32 = 13;
/// NACK messages are truncated like Envoy's so a huge error cannot bloat the upstream request.
const MAX_NACK_MESSAGE: usize = 4096;

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("connect: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("stream: {0}")]
    Stream(#[from] tonic::Status),
    #[error("control plane closed the stream")]
    Closed,
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// The node the relay presents upstream for a group. The group's downstream `node.cluster` is kept
/// so a control plane that tailors config per cluster keeps doing so.
pub fn upstream_node(config: &Config, group: &str) -> Node {
    Node {
        id: config.node_id.clone(),
        cluster: group.to_string(),
        user_agent_name: "adsrelay".into(),
        user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
            env!("CARGO_PKG_VERSION").into(),
        )),
        ..Default::default()
    }
}

pub fn endpoint(config: &Config) -> Endpoint {
    Endpoint::from(config.upstream.clone())
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
}

/// Runs the group's time-driven work until shutdown, whether or not the upstream is connected:
/// unsubscribe lingers, refetch fallbacks (both become upstream requests) and TTL expiry (which
/// matters most while the upstream is down, D6). Wakes at least once a second.
pub async fn housekeeping(group: Arc<Group>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let now = Instant::now();
        let next = lock(&group.state)
            .next_deadline()
            .map_or(now + Duration::from_secs(1), |d| {
                d.min(now + Duration::from_secs(1))
            });
        tokio::select! {
            () = tokio::time::sleep_until(next.into()) => {}
            _ = shutdown.changed() => return,
        }
        let expired = lock(&group.state).expire(Instant::now());
        for (changes, affected) in expired {
            debug!(type_url = %changes.type_url, names = ?changes.names, "TTL expired");
            group.publish(changes, affected);
        }
        group.upstream_wake.notify_one();
    }
}

/// Runs the group's upstream stream until shutdown.
pub async fn run(
    config: Arc<Config>,
    group: Arc<Group>,
    reached: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let span = tracing::info_span!("upstream", group = %group.name);
    async move {
        let node = upstream_node(&config, &group.name);
        let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        loop {
            if *shutdown.borrow() {
                return;
            }
            let ended = tokio::select! {
                r = session(&config, &group, &node, &reached, &mut backoff) => r,
                _ = shutdown.changed() => return,
            };
            let error = match ended {
                Ok(()) => return,
                Err(e) => e.to_string(),
            };
            {
                let mut status = lock(&group.status);
                status.connected = false;
                status.connected_since = None;
                status.last_error = Some(error.clone());
            }
            let delay = backoff.next_delay();
            warn!(%error, retry_in = ?delay, "upstream unavailable; serving from cache");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
    .instrument(span)
    .await
}

async fn session(
    config: &Config,
    group: &Group,
    node: &Node,
    reached: &AtomicBool,
    backoff: &mut Backoff,
) -> Result<(), SessionError> {
    let channel: Channel = endpoint(config).connect().await?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(1024);

    // C4: one request per type with everything still wanted and the versions held for it.
    let initial: Vec<DeltaDiscoveryRequest> = {
        let mut state = lock(&group.state);
        let types = state.interest.resubscribe_all();
        types
            .into_iter()
            .map(|(type_url, names)| {
                let interest = &state.interest;
                let wildcard = interest.is_wildcard(&type_url);
                let irv = state
                    .store
                    .initial_versions(&type_url, |n| wildcard || interest.wants(&type_url, n));
                let (names, locators) = split_locators(&names);
                DeltaDiscoveryRequest {
                    node: Some(node.clone()),
                    resource_names_subscribe: names,
                    resource_locators_subscribe: locators,
                    initial_resource_versions: irv,
                    type_url,
                    ..Default::default()
                }
            })
            .collect()
    };
    for req in initial {
        info!(type_url = %req.type_url, names = req.resource_names_subscribe.len(),
            initial_versions = req.initial_resource_versions.len(), "subscribing upstream");
        let _ = tx.try_send(req);
    }

    let mut inbound = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await?
        .into_inner();
    {
        let mut status = lock(&group.status);
        status.connected = true;
        status.connected_since = Some(SystemTime::now());
        status.streams_opened += 1;
        status.last_error = None;
    }
    info!(upstream = %config.upstream, "upstream stream open");

    loop {
        tokio::select! {
            msg = inbound.message() => {
                let resp = msg?.ok_or(SessionError::Closed)?;
                backoff.reset();
                reached.store(true, Ordering::Relaxed);
                let reply = apply_response(group, node, resp)?;
                send(&tx, reply).await?;
            }
            () = group.upstream_wake.notified() => {
                send_interest_changes(group, node, &tx).await?;
            }
        }
    }
}

async fn send(
    tx: &mpsc::Sender<DeltaDiscoveryRequest>,
    req: DeltaDiscoveryRequest,
) -> Result<(), SessionError> {
    tx.send(req).await.map_err(|_| SessionError::Closed)
}

async fn send_interest_changes(
    group: &Group,
    node: &Node,
    tx: &mpsc::Sender<DeltaDiscoveryRequest>,
) -> Result<(), SessionError> {
    let changes = lock(&group.state).take_upstream_changes();
    for c in changes {
        debug!(type_url = %c.type_url, subscribe = ?c.subscribe, unsubscribe = ?c.unsubscribe,
            "upstream subscription change");
        let (subscribe, subscribe_locators) = split_locators(&c.subscribe);
        let (unsubscribe, unsubscribe_locators) = split_locators(&c.unsubscribe);
        send(
            tx,
            DeltaDiscoveryRequest {
                node: Some(node.clone()),
                type_url: c.type_url,
                resource_names_subscribe: subscribe,
                resource_names_unsubscribe: unsubscribe,
                resource_locators_subscribe: subscribe_locators,
                resource_locators_unsubscribe: unsubscribe_locators,
                ..Default::default()
            },
        )
        .await?;
    }
    Ok(())
}

/// Plain locators go upstream as names, the rest as `ResourceLocator`s with their parameters (E13).
fn split_locators(locators: &[Locator]) -> (Vec<String>, Vec<ResourceLocator>) {
    let (plain, with_params): (Vec<&Locator>, Vec<&Locator>) =
        locators.iter().partition(|l| l.is_plain());
    (
        plain.iter().map(|l| l.name.to_string()).collect(),
        with_params
            .iter()
            .map(|l| ResourceLocator {
                name: l.name.to_string(),
                dynamic_parameters: l
                    .params
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            })
            .collect(),
    )
}

/// Applies one upstream response and returns the ACK or NACK for it.
fn apply_response(
    group: &Group,
    node: &Node,
    resp: DeltaDiscoveryResponse,
) -> Result<DeltaDiscoveryRequest, SessionError> {
    let received_at = Instant::now();
    if resp.nonce.is_empty() {
        // F8: a response without a nonce cannot be acknowledged; start over.
        return Err(SessionError::Protocol(format!(
            "DeltaDiscoveryResponse for {:?} has no nonce",
            resp.type_url
        )));
    }
    // Received bytes share the stream's receive buffer; the cache keeps its own copy.
    let resources: Vec<Bytes> = resp
        .resources
        .iter()
        .map(|b| Bytes::copy_from_slice(b))
        .collect();
    let mut removed: Vec<String> = resp.removed_resources;
    // C14: NOT_FOUND in resource_errors means the same as removed_resources; other errors are
    // passed through to the subscribers of those names (TP3).
    let (not_found, errors): (Vec<_>, Vec<_>) = resp
        .resource_errors
        .into_iter()
        .partition(|e| e.error_detail.as_ref().is_some_and(|s| s.code == NOT_FOUND));
    removed.extend(
        not_found
            .into_iter()
            .filter_map(|e| e.resource_name.map(|r| r.name)),
    );
    removed.sort();
    removed.dedup();
    let update = UpstreamUpdate {
        resources,
        removed,
        removed_variants: resp.removed_resource_names,
        errors,
        received_at: Some(received_at),
    };

    let outcome = {
        let mut state = lock(&group.state);
        if !state.interest.has_type(&resp.type_url) {
            // C10: never asked for this type; nothing to cache or fan out.
            Ok(None)
        } else {
            state
                .apply_upstream(&resp.type_url, update)
                .map(|mut changes| {
                    changes.received_at = Some(received_at);
                    let affected = state.affected(&changes);
                    Some((changes, affected))
                })
        }
    };
    let mut status = lock(&group.status);
    status.responses += 1;
    status.last_response = Some(SystemTime::now());
    status.synced_once = true;
    let mut reply = DeltaDiscoveryRequest {
        node: Some(node.clone()),
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        ..Default::default()
    };
    match outcome {
        Ok(Some((changes, affected))) => {
            debug!(type_url = %resp.type_url, nonce = %resp.nonce, changed = changes.names.len(), "upstream update");
            drop(status);
            if !changes.is_empty() {
                group.publish(changes, affected);
            }
        }
        Ok(None) => {
            warn!(type_url = %resp.type_url, "ignoring upstream response for a type the relay did not subscribe to");
        }
        Err(e) => {
            status.nacks_sent += 1;
            let mut message = e.to_string();
            if message.len() > MAX_NACK_MESSAGE {
                let mut cut = MAX_NACK_MESSAGE;
                while !message.is_char_boundary(cut) {
                    cut -= 1;
                }
                message.truncate(cut);
                message.push_str("...(truncated)");
            }
            warn!(type_url = %resp.type_url, nonce = %resp.nonce, error = %message,
                "rejecting upstream response (NACK); keeping the last good state");
            reply.error_detail = Some(rpc::Status {
                code: INTERNAL,
                message,
                details: vec![],
            });
        }
    }
    Ok(reply)
}

/// Connects to the control plane once (retrying with backoff) so /readyz can tell a relay that has
/// never reached its upstream from one that has, before any client arrives.
pub async fn probe(
    config: Arc<Config>,
    reached: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
    while !reached.load(Ordering::Relaxed) {
        match endpoint(&config).connect().await {
            Ok(_) => {
                info!(upstream = %config.upstream, "control plane reachable");
                reached.store(true, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(upstream = %config.upstream, error = %e, retry_in = ?delay, "control plane not reachable yet");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return,
                }
            }
        }
    }
}
