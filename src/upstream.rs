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
use crate::pb::core::Node;
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
    #[error("connect: {}", error_chain(.0))]
    Connect(#[from] tonic::transport::Error),
    #[error("stream: {0}")]
    Stream(#[from] tonic::Status),
    #[error("control plane closed the stream")]
    Closed,
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("periodic resync")]
    Resync,
}

/// An error with its sources: tonic's transport error alone says only "transport error", the
/// cause (refused connection, TLS certificate not valid for the name...) is in its sources.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        // Wrappers (io::Error around a rustls error) often repeat their cause's text.
        let part = s.to_string();
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

pub fn endpoint(config: &Config) -> Endpoint {
    endpoint_for(config, &config.upstream)
}

/// The endpoint for one control-plane address. Every session builds a new channel from it, and a
/// channel resolves the host name when it connects, so each reconnect re-resolves DNS.
/// For an https:// address the TLS files are read here, so a rotated certificate is used from
/// the next session on.
pub fn endpoint_for(config: &Config, uri: &http::Uri) -> Endpoint {
    let r = &config.resilience;
    let endpoint = Endpoint::from(uri.clone())
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(r.upstream_keepalive_interval)
        .keep_alive_timeout(r.upstream_keepalive_timeout)
        .keep_alive_while_idle(true);
    if uri.scheme_str() != Some("https") {
        return endpoint;
    }
    let tls = config
        .upstream_tls
        .client_config(uri.host().unwrap_or_default());
    match tls.map(|tls| endpoint.clone().tls_config(tls)) {
        Some(Ok(with_tls)) => with_tls,
        // Unreachable after config validation; connecting then fails with a TLS error.
        Some(Err(e)) => {
            warn!(upstream = %uri, error = %e, "upstream TLS configuration refused");
            endpoint
        }
        None => endpoint,
    }
}

/// How long after a resync's stream opens its first response per type counts as the
/// reconciliation answer (drift) rather than a new update.
const RESYNC_WINDOW: Duration = Duration::from_secs(10);

/// What the next session does, and what the last one achieved.
struct Attempt {
    /// Index into `config.upstreams`.
    target: usize,
    /// Send `initial_resource_versions` (false after switching servers, C6).
    send_versions: bool,
    /// This session is a periodic resync: count what it changes as drift.
    resync: bool,
    /// Set once the session received a response.
    answered: bool,
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
            if changes.wildcard_synced_now {
                warn!(type_url = %changes.type_url, wait = ?crate::xds::interest::WILDCARD_WAIT,
                    "upstream left a wildcard subscription added mid-stream unanswered; serving \
                     the cache to wildcard subscribers (not authoritative for removals)");
            } else {
                debug!(type_url = %changes.type_url, names = ?changes.names, "TTL expired");
            }
            group.publish(changes, affected);
        }
        group.upstream_wake.notify_one();
    }
}

/// Runs the group's upstream stream until shutdown: connects to the control-plane addresses in
/// order, stays on the one that answers, fails over to the next when a connection fails or a stream
/// ends before answering, and re-establishes the stream every `resync_interval` to reconcile.
pub async fn run(
    config: Arc<Config>,
    group: Arc<Group>,
    reached: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let span = tracing::info_span!("upstream", group = %group.name);
    async move {
        let node = group.upstream_node.clone();
        let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        // The server that last answered: versions are per server, so only it gets IRV (C6).
        let mut last_answered: Option<usize> = None;
        let mut attempt = Attempt {
            target: 0,
            send_versions: true,
            resync: false,
            answered: false,
        };
        loop {
            if *shutdown.borrow() {
                return;
            }
            attempt.send_versions = last_answered.is_none_or(|i| i == attempt.target);
            attempt.answered = false;
            lock(&group.status).upstream = Some(config.upstreams[attempt.target].to_string());
            let ended = tokio::select! {
                r = session(&config, &group, &node, &reached, &mut backoff, &mut attempt) => r,
                _ = shutdown.changed() => return,
            };
            if attempt.answered {
                last_answered = Some(attempt.target);
            }
            attempt.resync = false;
            let error = match ended {
                Ok(()) => return,
                Err(SessionError::Resync) => {
                    info!("periodic resync: re-establishing the upstream stream to reconcile the cache");
                    let mut status = lock(&group.status);
                    status.resyncs += 1;
                    status.last_resync = Some(SystemTime::now());
                    attempt.resync = true;
                    continue;
                }
                Err(e) => e.to_string(),
            };
            let failed_over = !attempt.answered && config.upstreams.len() > 1;
            if failed_over {
                attempt.target = (attempt.target + 1) % config.upstreams.len();
            }
            {
                let mut status = lock(&group.status);
                if status.connected || status.disconnected_since.is_none() {
                    status.disconnected_since = Some(SystemTime::now());
                }
                status.connected = false;
                status.connected_since = None;
                status.last_error = Some(error.clone());
                if failed_over {
                    status.failovers += 1;
                }
            }
            let delay = backoff.next_delay();
            warn!(%error, retry_in = ?delay, next_upstream = %config.upstreams[attempt.target],
                "upstream unavailable; serving from cache");
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
    attempt: &mut Attempt,
) -> Result<(), SessionError> {
    let target = &config.upstreams[attempt.target];
    let channel: Channel = endpoint_for(config, target).connect().await?;
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
                let irv = if attempt.send_versions {
                    state
                        .store
                        .initial_versions(&type_url, |n| wildcard || interest.wants(&type_url, n))
                } else {
                    Default::default()
                };
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
    // A resync counts the first response per type (within the window) as the reconciliation.
    let mut resync_types: std::collections::HashSet<String> = if attempt.resync {
        initial.iter().map(|r| r.type_url.clone()).collect()
    } else {
        Default::default()
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
        status.disconnected_since = None;
    }
    info!(upstream = %target, initial_versions = attempt.send_versions, "upstream stream open");
    let opened = Instant::now();
    let resync_at = config
        .resilience
        .resync_interval
        .map(|d| tokio::time::Instant::now() + d);

    loop {
        tokio::select! {
            msg = inbound.message() => {
                let resp = msg?.ok_or(SessionError::Closed)?;
                backoff.reset();
                attempt.answered = true;
                reached.store(true, Ordering::Relaxed);
                let counts_as_drift = resync_types.remove(&resp.type_url)
                    && opened.elapsed() < RESYNC_WINDOW;
                let (reply, changed) = apply_response(group, node, resp)?;
                if counts_as_drift && changed > 0 {
                    info!(repaired = changed, "resync found drift between the cache and the control plane; repaired");
                    lock(&group.status).drift_repairs += changed as u64;
                }
                send(&tx, reply).await?;
            }
            () = sleep_until_opt(resync_at) => return Err(SessionError::Resync),
            () = group.upstream_wake.notified() => {
                send_interest_changes(group, node, &tx).await?;
                if lock(&group.state).take_resync() {
                    // A wildcard taken again after it lapsed got no answer: the server may hold
                    // names as sent that the cache forgot. A new stream resends them (C4).
                    warn!("re-establishing the upstream stream: a wildcard taken again after it lapsed was not answered");
                    return Err(SessionError::Resync);
                }
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
    let changes = {
        let mut state = lock(&group.state);
        let changes = state.take_upstream_changes();
        // A "*" sent now that the upstream need not answer is waited for from now on.
        state.interest.arm_wildcard_waits(Instant::now());
        changes
    };
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

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Applies one upstream response and returns the ACK or NACK for it, and how many names changed.
fn apply_response(
    group: &Group,
    node: &Node,
    resp: DeltaDiscoveryResponse,
) -> Result<(DeltaDiscoveryRequest, usize), SessionError> {
    let mut changed = 0;
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
            let evicted = state.unsubscribed.evicted_budget;
            let outcome = state
                .apply_upstream(&resp.type_url, update)
                .map(|mut changes| {
                    changes.received_at = Some(received_at);
                    let affected = state.affected(&changes);
                    Some((changes, affected))
                });
            if state.unsubscribed.evicted_budget != evicted {
                // The update pushed kept names over the budget: send their unsubscribes now.
                group.upstream_wake.notify_one();
            }
            outcome
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
            changed = changes.names.len();
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
    Ok((reply, changed))
}

/// Connects to the control plane once (retrying with backoff) so /readyz can tell a relay that has
/// never reached its upstream from one that has, before any client arrives.
pub async fn probe(
    config: Arc<Config>,
    reached: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
    let mut target = 0;
    while !reached.load(Ordering::Relaxed) {
        let uri = &config.upstreams[target];
        match endpoint_for(&config, uri).connect().await {
            Ok(_) => {
                info!(upstream = %uri, "control plane reachable");
                reached.store(true, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(upstream = %uri, error = %error_chain(&e), retry_in = ?delay, "control plane not reachable yet");
                target = (target + 1) % config.upstreams.len();
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return,
                }
            }
        }
    }
}
