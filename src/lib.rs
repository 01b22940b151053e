//! adsrelay: a caching xDS relay. Downstream it serves Aggregated Discovery Service streams, Delta
//! and state-of-the-world, to many Envoys and gRPC clients; upstream it keeps one aggregated Delta
//! ADS stream per group of clients, and a shared cache.
//!
//! # Layout
//! The protocol core, free of I/O (tests drive it directly):
//! - [`xds`]: resource store, refcounted interest, the per-stream Delta and SotW state machines,
//!   shared response frames, a group's subscriber index, the upstream session (what to send the
//!   control plane and what its responses change), xdstp names, TP2 variant matching.
//!
//! The runtime around it (no module imports one that imports it back):
//! - [`group`]: one group at run time: its state behind a lock, its streams' mailboxes, the
//!   upstream task's wake-up and status.
//! - [`relay`]: the registry: creates groups and starts their tasks, admission, the client
//!   registry; the host of downstream streams and of the snapshot.
//! - [`downstream`]: the gRPC services, one task per client stream driving the core, bounded
//!   change mailboxes, per-stream limits.
//! - [`upstream`]: the per-group upstream task: connect, failover, backoff, resync, and a loop
//!   around [`xds::UpstreamSession`]; the group's housekeeping timer.
//! - [`accept`]: accept loops that pause on descriptor exhaustion and keep a descriptor reserve.
//! - [`drain`]: graceful shutdown, closing connections gradually.
//! - [`tls`]: downstream TLS/mTLS with certificate reload, identity-to-group authorization,
//!   upstream TLS.
//! - [`codec`]: the prost codec of the generated gRPC code (the upstream client, CSDS).
//! - [`snapshot`]: warm restart: the cache persisted to a local file and restored at startup.
//! - [`grouping`]: which downstream nodes share a group, and the node presented upstream for it.
//! - [`admin`]: HTTP /healthz, /readyz, /metrics, /debug/*; [`csds`]: client status discovery;
//!   [`rfc3339`]: the times they print.
//! - [`metrics`]: every metric name and HELP text; [`process`]: the descriptor limit and
//!   `process_*` metrics.
//! - [`config`]: one settings struct read from flags, environment and config file -> validated
//!   [`config::Config`]; [`logging`]: log format and run-time level.
//! - [`backoff`], [`token_bucket`], [`sync`]: small helpers (retry delays, rate limits, locks).
//! - [`demo`]: the embedded demo control plane, its example resources and backend.
//! - [`pb`]: generated protobuf types (proto/ is the wire contract).
#![forbid(unsafe_code)]

pub mod accept;
pub mod admin;
pub mod backoff;
pub mod codec;
pub mod config;
pub mod csds;
pub mod demo;
pub mod downstream;
pub mod drain;
pub mod group;
pub mod grouping;
pub mod logging;
pub mod metrics;
pub mod pb;
pub mod process;
pub mod relay;
pub mod rfc3339;
pub mod snapshot;
pub mod sync;
pub mod tls;
pub mod token_bucket;
pub mod upstream;
pub mod xds;

use std::future::Future;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::relay::Relay;

/// Runs the relay on already-bound listeners until `shutdown` completes. Tests bind `127.0.0.1:0`.
pub async fn run(
    config: Config,
    xds: TcpListener,
    admin: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let relay = Relay::new(config, stop_rx.clone());
    // Warm restart: the snapshot is loaded before anything is served.
    snapshot::load(&*relay);
    tokio::spawn(snapshot::run(relay.clone(), stop_rx.clone()));
    tokio::spawn(upstream::probe(
        relay.config.clone(),
        relay.upstream_reached.clone(),
        stop_rx.clone(),
    ));
    let mut admin_stop = stop_rx.clone();
    tokio::spawn(admin::serve(relay.clone(), admin, async move {
        let _ = admin_stop.changed().await;
    }));
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .max_concurrent_streams(Some(relay.config.limits.max_streams_per_connection));
    // GOAWAY old connections so clients rebalance over replicas (docs/deploy.md "Scale out").
    if let Some(age) = relay.config.limits.connection_age_jittered() {
        server = server
            .max_connection_age(age)
            .max_connection_age_grace(relay.config.limits.max_connection_age_grace);
    }
    // Each accepted connection is counted (adsrelay_downstream_connections) while it is open;
    // past max_connections, or when descriptors run short, a new one is closed at once (and
    // counted); accept errors pause the listener instead of reaching tonic.
    let incoming = accept::incoming(
        xds,
        accept::XdsGate {
            max_connections: relay.config.limits.max_connections,
            fd_reserve: relay.config.limits.fd_reserve,
            drain: relay.drain.clone(),
            open: relay.metrics.connections.clone(),
            report: relay.metrics.clone(),
        },
    );
    // On shutdown: drain (not ready, refuse new work, close connections gradually), then stop
    // the server; whatever is still open after a further 5 s is abandoned.
    let (served_tx, served_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = relay.drain.clone();
    let period = relay.config.limits.drain_period;
    let saving = relay.clone();
    let drained = async move {
        shutdown.await;
        // Saved before the drain closes clients, so their interest is still in the snapshot.
        snapshot::write_on_shutdown(&*saving).await;
        drain.run(period).await;
        let _ = served_tx.send(());
    };
    let router =
        downstream::services::add_all(&mut server, relay.clone(), relay.config.max_message_bytes)
            .add_service(csds::Csds::server(relay.clone()));
    type Serving =
        std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;
    let mut serve: Serving = match relay.config.tls.clone() {
        None => Box::pin(router.serve_with_incoming_shutdown(incoming, drained)),
        // TLS: handshakes run beside the accept loop; accepted connections stay counted (and
        // drainable) through their CountedIo.
        Some(tls) => {
            let reloads = relay.clone();
            tokio::spawn(
                tls.clone()
                    .watch(move |r| reloads.metrics.tls_reloaded(r), stop_rx.clone()),
            );
            let failures = relay.clone();
            let incoming = tls::accept(incoming, tls, move |f| {
                failures.metrics.tls_handshake_failed(f)
            });
            Box::pin(router.serve_with_incoming_shutdown(incoming, drained))
        }
    };
    let result = tokio::select! {
        r = &mut serve => r,
        _ = async {
            let _ = served_rx.await;
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        } => {
            tracing::warn!("shutdown deadline passed with connections still open; exiting");
            Ok(())
        }
    };
    let _ = stop_tx.send(true);
    result
}
