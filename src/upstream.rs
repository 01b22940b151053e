//! The upstream side of one aggregation group at run time: a single Delta ADS stream to the control
//! plane carrying the group's refcounted interest. This task connects (retrying with jittered
//! backoff, failing over between addresses, resyncing periodically), sends what the core's
//! [`UpstreamSession`] says to send (subscriptions on open, C4; ACK/NACK, C7, C8; interest
//! changes) and publishes the changes it reports to the group's streams.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn, Instrument};

use crate::backoff::Backoff;
use crate::config::{Config, UpstreamProtocol};
use crate::group::{Group, ReconciliationReport};
use crate::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};
use crate::pb::relay_ads::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::pb::wire::{DeltaDiscoveryResponse, DiscoveryResponse};
use crate::sync::{lock, read, write};
use crate::xds::sotw_upstream::SotwUpstream;
use crate::xds::upstream_session::{Reconciliation, Repairs};
use crate::xds::{UpstreamSession, Verdict};

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
    #[error("resync")]
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

/// How long a stream waits for the upstream to answer every type it subscribed when it opened.
/// A type still unanswered then no longer holds readiness back, and a wildcard type is served from
/// the cache (a server may answer a wildcard type only once it has a resource of it, as
/// java-control-plane's Delta server does). Envoy's own `initial_fetch_timeout` defaults to 15 s.
pub const UNANSWERED_WAIT: Duration = Duration::from_secs(15);

/// After a lost stream is resumed (with versions), the reconciliation that follows it: soon, so a
/// control plane that restarted and does not report what it removed meanwhile (java-control-plane)
/// is caught within seconds, not a whole resync interval.
pub const RECONCILE_AFTER_RESUME: Duration = Duration::from_secs(5);

/// The resync interval with ±20 % jitter, so the groups of a fleet of relays started together do
/// not all reconcile with the control plane at the same moment.
fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(rand::random_range(0.8..1.2))
}

/// The ADS flavour of one upstream stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    Delta,
    Sotw,
}

impl Wire {
    fn as_str(self) -> &'static str {
        match self {
            Wire::Delta => "delta",
            Wire::Sotw => "sotw",
        }
    }
}

/// What the next session does, and what the last one achieved.
struct Attempt {
    /// Index into `config.upstreams`.
    target: usize,
    /// Send `initial_resource_versions` (false after switching servers, C6).
    send_versions: bool,
    /// This session reconciles (C18): no versions, each wildcard type's first answer is the
    /// server's whole state and is compared with the cache.
    reconcile: bool,
    /// The previous stream was lost after it had answered: this one resumes, and a
    /// reconciliation follows it soon.
    resumed: bool,
    /// Set once the session received a response.
    answered: bool,
}

/// Runs the group's time-driven work until shutdown, whether or not the upstream is connected:
/// unsubscribe lingers, refetch fallbacks (both become upstream requests) and TTL expiry (which
/// matters most while the upstream is down, D6). Wakes at least once a second.
pub async fn housekeeping(group: Arc<Group>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let now = Instant::now();
        let next = read(&group.state)
            .next_deadline()
            .map_or(now + Duration::from_secs(1), |d| {
                d.min(now + Duration::from_secs(1))
            });
        tokio::select! {
            () = tokio::time::sleep_until(next.into()) => {}
            _ = shutdown.changed() => return,
        }
        let expired = write(&group.state).expire(Instant::now());
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
        let protocol = UpstreamSession::new(group.upstream_node.clone());
        let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        // The server that last answered: versions are per server, so only it gets IRV (C6).
        let mut last_answered: Option<usize> = None;
        let mut attempt = Attempt {
            target: 0,
            send_versions: true,
            reconcile: false,
            resumed: false,
            answered: false,
        };
        // The ADS flavour spoken to each control-plane address (`auto` starts with Delta).
        let start = match config.upstream_protocol {
            UpstreamProtocol::Sotw => Wire::Sotw,
            UpstreamProtocol::Delta | UpstreamProtocol::Auto => Wire::Delta,
        };
        let mut wires = vec![start; config.upstreams.len()];
        loop {
            if *shutdown.borrow() {
                return;
            }
            attempt.send_versions = last_answered.is_none_or(|i| i == attempt.target);
            attempt.answered = false;
            let wire = wires[attempt.target];
            {
                let mut status = lock(&group.status);
                status.upstream = Some(config.upstreams[attempt.target].to_string());
                status.upstream_protocol = wire.as_str();
            }
            let ended = tokio::select! {
                r = async {
                    match wire {
                        Wire::Delta => one_stream(&config, &group, &protocol, &reached, &mut backoff, &mut attempt).await,
                        Wire::Sotw => one_sotw_stream(&config, &group, &reached, &mut backoff, &mut attempt).await,
                    }
                } => r,
                _ = shutdown.changed() => return,
            };
            if attempt.answered {
                last_answered = Some(attempt.target);
            }
            attempt.reconcile = false;
            attempt.resumed = false;
            let error = match ended {
                Ok(()) => return,
                Err(SessionError::Resync) => {
                    info!("resync: re-establishing the upstream stream without versions to reconcile the cache");
                    let mut status = lock(&group.status);
                    status.resyncs += 1;
                    status.last_resync = Some(SystemTime::now());
                    attempt.reconcile = true;
                    continue;
                }
                Err(SessionError::Stream(ref s))
                    if s.code() == tonic::Code::Unimplemented
                        && config.upstream_protocol == UpstreamProtocol::Auto
                        && wire == Wire::Delta =>
                {
                    warn!(upstream = %config.upstreams[attempt.target], error = %s.message(),
                        "the control plane does not serve Delta ADS; speaking state-of-the-world to it until the relay restarts");
                    wires[attempt.target] = Wire::Sotw;
                    lock(&group.status).protocol_switches += 1;
                    continue;
                }
                Err(e) => e.to_string(),
            };
            attempt.resumed = attempt.answered;
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

async fn one_stream(
    config: &Config,
    group: &Group,
    protocol: &UpstreamSession,
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

    // C4: one request per type with everything still wanted and the versions held for it. A
    // stream without versions (a resync, or another server, C6) is a reconciliation (C18).
    let (initial, mut reconciliation) = if attempt.reconcile || !attempt.send_versions {
        let (requests, r) = protocol.reconciling_requests(&mut write(&group.state));
        (requests, Some(r))
    } else {
        let requests = protocol.initial_requests(&mut write(&group.state), true);
        (requests, None)
    };
    // Types the server has yet to answer on this stream (readiness waits for them, boundedly).
    let mut unanswered: std::collections::BTreeSet<String> =
        initial.iter().map(|r| r.type_url.clone()).collect();
    for req in initial {
        info!(type_url = %req.type_url, names = req.resource_names_subscribe.len(),
            initial_versions = req.initial_resource_versions.len(), "subscribing upstream");
        let _ = tx.try_send(req);
    }

    // The call resolves when the server sends its response headers, which a server may hold back
    // until its first response (gRPC-Java's servers do: java-control-plane). Meanwhile the stream
    // is open for requests: interest changes go out and the wait for answers runs.
    let call = client.delta_aggregated_resources(ReceiverStream::new(rx));
    tokio::pin!(call);
    let mut inbound: Option<tonic::Streaming<DeltaDiscoveryResponse>> = None;
    mark_open(group);
    info!(upstream = %target, initial_versions = attempt.send_versions && !attempt.reconcile,
        reconcile = reconciliation.is_some(), "upstream stream open");
    let mut wait_ends = Some(tokio::time::Instant::now() + UNANSWERED_WAIT);
    // The next reconciliation: soon after a resume, else one (jittered) resync interval away.
    let resync_at = config.resilience.resync_interval.map(|d| {
        let wait = if attempt.resumed {
            RECONCILE_AFTER_RESUME.min(d)
        } else {
            jittered(d)
        };
        tokio::time::Instant::now() + wait
    });

    loop {
        tokio::select! {
            headers = &mut call, if inbound.is_none() => {
                inbound = Some(headers?.into_inner());
            }
            msg = next_message(&mut inbound) => {
                let resp = msg?.ok_or(SessionError::Closed)?;
                answered(group, reached, backoff, attempt, &mut unanswered, &resp.type_url);
                let reply = on_response(group, protocol, resp, reconciliation.as_mut())?;
                if let Some(r) = reconciliation.take_if(|r| !r.is_awaiting()) {
                    report_reconciliation(group, r);
                }
                send(&tx, reply).await?;
            }
            () = sleep_until_opt(wait_ends) => {
                wait_ends = None;
                stop_waiting(group, &unanswered);
                if let Some(r) = reconciliation.take() {
                    report_reconciliation(group, r);
                }
            }
            () = sleep_until_opt(resync_at) => return Err(SessionError::Resync),
            () = group.upstream_wake.notified() => {
                send_interest_changes(group, protocol, &tx).await?;
                if write(&group.state).take_resync() {
                    // A wildcard taken again after it lapsed got no answer: the server may hold
                    // names as sent that the cache forgot. A new stream resends them (C4).
                    warn!("re-establishing the upstream stream: a wildcard taken again after it lapsed was not answered");
                    return Err(SessionError::Resync);
                }
            }
        }
    }
}

/// One state-of-the-world stream (for control planes without Delta): the same life as
/// [`one_stream`] with [`SotwUpstream`] as the protocol. Reopening it is a reconciliation by
/// itself: the server resends its state and Listener/Cluster absence removes.
async fn one_sotw_stream(
    config: &Config,
    group: &Group,
    reached: &AtomicBool,
    backoff: &mut Backoff,
    attempt: &mut Attempt,
) -> Result<(), SessionError> {
    let target = &config.upstreams[attempt.target];
    let channel: Channel = endpoint_for(config, target).connect().await?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let (tx, rx) = mpsc::channel::<DiscoveryRequest>(1024);
    let mut session = SotwUpstream::new(group.upstream_node.clone());
    let initial = session.initial_requests(&mut write(&group.state));
    let mut unanswered: std::collections::BTreeSet<String> =
        initial.iter().map(|r| r.type_url.clone()).collect();
    for req in initial {
        info!(type_url = %req.type_url, names = req.resource_names.len(), "subscribing upstream (SotW)");
        let _ = tx.try_send(req);
    }
    let call = client.stream_aggregated_resources(ReceiverStream::new(rx));
    tokio::pin!(call);
    let mut inbound: Option<tonic::Streaming<DiscoveryResponse>> = None;
    mark_open(group);
    info!(upstream = %target, "upstream stream open (state of the world)");
    let mut wait_ends = Some(tokio::time::Instant::now() + UNANSWERED_WAIT);
    let resync_at = config
        .resilience
        .resync_interval
        .map(|d| tokio::time::Instant::now() + jittered(d));
    loop {
        tokio::select! {
            headers = &mut call, if inbound.is_none() => {
                inbound = Some(headers?.into_inner());
            }
            msg = next_message(&mut inbound) => {
                let resp = msg?.ok_or(SessionError::Closed)?;
                answered(group, reached, backoff, attempt, &mut unanswered, &resp.type_url);
                let (type_url, nonce) = (resp.type_url.clone(), resp.nonce.clone());
                let outcome = session
                    .on_response(&mut write(&group.state), resp, Instant::now())
                    .map_err(|e| SessionError::Protocol(e.to_string()))?;
                record_verdict(group, &type_url, &nonce, outcome.verdict);
                tx.send(outcome.reply).await.map_err(|_| SessionError::Closed)?;
            }
            () = sleep_until_opt(wait_ends) => {
                wait_ends = None;
                stop_waiting(group, &unanswered);
            }
            () = sleep_until_opt(resync_at) => return Err(SessionError::Resync),
            () = group.upstream_wake.notified() => {
                let requests = session.interest_requests(&mut write(&group.state), Instant::now());
                for req in requests {
                    debug!(type_url = %req.type_url, names = req.resource_names.len(), "upstream subscription change (SotW)");
                    tx.send(req).await.map_err(|_| SessionError::Closed)?;
                }
                if write(&group.state).take_resync() {
                    return Err(SessionError::Resync);
                }
            }
        }
    }
}

/// The stream got a response of `type_url`: the upstream is alive and that type answered.
fn answered(
    group: &Group,
    reached: &AtomicBool,
    backoff: &mut Backoff,
    attempt: &mut Attempt,
    unanswered: &mut std::collections::BTreeSet<String>,
    type_url: &str,
) {
    backoff.reset();
    attempt.answered = true;
    reached.store(true, Ordering::Relaxed);
    if unanswered.remove(type_url) {
        lock(&group.status)
            .unanswered_types
            .retain(|t| t != type_url);
    }
}

/// The group's status once a stream is open.
fn mark_open(group: &Group) {
    let mut status = lock(&group.status);
    status.connected = true;
    status.connected_since = Some(SystemTime::now());
    status.streams_opened += 1;
    status.last_error = None;
    status.disconnected_since = None;
    status.unanswered_types.clear();
}

/// The wait for the stream's first answers ended with `unanswered` types still silent: they stop
/// holding readiness back, and wildcard subscribers of them are served from the cache.
fn stop_waiting(group: &Group, unanswered: &std::collections::BTreeSet<String>) {
    {
        let mut status = lock(&group.status);
        status.synced_once = true;
        status.unanswered_types = unanswered.iter().cloned().collect();
    }
    if unanswered.is_empty() {
        return;
    }
    warn!(types = ?unanswered, wait = ?UNANSWERED_WAIT,
        "the upstream left types unanswered; serving the cache for them (a server may not answer a wildcard type it has no resource of)");
    for type_url in unanswered {
        let served = write(&group.state).stop_waiting_for(type_url);
        if let Some((changes, affected)) = served {
            group.publish(changes, affected);
        }
    }
}

/// Logs and records what a reconciliation repaired, once every type answered or the wait ended.
fn report_reconciliation(group: &Group, r: Reconciliation) {
    let complete = r.is_complete();
    let repaired: u64 = r.repairs.values().map(Repairs::total).sum();
    for (type_url, rep) in r.repairs.iter().filter(|(_, rep)| rep.total() > 0) {
        info!(%type_url, added = rep.added, changed = rep.changed, removed = rep.removed,
            "reconciliation found the cache different from the control plane; repaired");
    }
    if !complete {
        warn!("reconciliation incomplete: a wildcard type got no answer on the reconciling stream");
    }
    debug!(repaired, complete, "reconciliation done");
    let mut status = lock(&group.status);
    status.drift_repairs += repaired;
    status.last_reconciliation = Some(ReconciliationReport {
        finished_at: Some(SystemTime::now()),
        complete,
        repairs: r.repairs,
    });
}

/// The stream's next message once its response headers arrived; until then, never.
async fn next_message<T>(
    inbound: &mut Option<tonic::Streaming<T>>,
) -> Result<Option<T>, tonic::Status> {
    match inbound {
        Some(s) => s.message().await,
        None => std::future::pending().await,
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
    protocol: &UpstreamSession,
    tx: &mpsc::Sender<DeltaDiscoveryRequest>,
) -> Result<(), SessionError> {
    let requests = protocol.interest_requests(&mut write(&group.state), Instant::now());
    for req in requests {
        debug!(type_url = %req.type_url, subscribe = ?req.resource_names_subscribe,
            unsubscribe = ?req.resource_names_unsubscribe,
            subscribe_locators = req.resource_locators_subscribe.len(),
            unsubscribe_locators = req.resource_locators_unsubscribe.len(),
            "upstream subscription change");
        send(tx, req).await?;
    }
    Ok(())
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Applies one upstream response through the core, publishes its changes and records it on the
/// group's status; returns the ACK or NACK for it and how many names changed.
fn on_response(
    group: &Group,
    protocol: &UpstreamSession,
    resp: DeltaDiscoveryResponse,
    reconciliation: Option<&mut Reconciliation>,
) -> Result<DeltaDiscoveryRequest, SessionError> {
    let (type_url, nonce) = (resp.type_url.clone(), resp.nonce.clone());
    let now = Instant::now();
    let outcome = match reconciliation {
        Some(r) => protocol.on_reconciling_response(&mut write(&group.state), resp, now, r),
        None => protocol.on_response(&mut write(&group.state), resp, now),
    }
    .map_err(|e| SessionError::Protocol(e.to_string()))?;
    if outcome.interest_changed {
        group.upstream_wake.notify_one();
    }
    record_verdict(group, &type_url, &nonce, outcome.verdict);
    Ok(outcome.reply)
}

/// Records one response's verdict on the group's status and publishes what it changed.
fn record_verdict(group: &Group, type_url: &str, nonce: &str, verdict: Verdict) {
    {
        let mut status = lock(&group.status);
        status.responses += 1;
        status.last_response = Some(SystemTime::now());
        status.synced_once = true;
        if matches!(verdict, Verdict::Rejected { .. }) {
            status.nacks_sent += 1;
        }
    }
    match verdict {
        Verdict::Applied { changes, affected } => {
            debug!(%type_url, %nonce, changed = changes.names.len(), "upstream update");
            if !changes.is_empty() {
                group.publish(changes, affected);
            }
        }
        Verdict::NotSubscribed => {
            warn!(%type_url, "ignoring upstream response for a type the relay did not subscribe to");
        }
        Verdict::Rejected { message } => {
            warn!(%type_url, %nonce, error = %message,
                "rejecting upstream response (NACK); keeping the last good state");
        }
    }
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
