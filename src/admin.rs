//! Admin HTTP server (hyper): /healthz and /readyz.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpListener;
use tracing::debug;

use crate::relay::{Relay, UpstreamStatus};
use crate::sync::lock;

#[derive(Debug, Serialize)]
struct GroupReadiness {
    group: String,
    clients: usize,
    upstream_subscriptions: usize,
    #[serde(flatten)]
    upstream: UpstreamStatus,
}

#[derive(Debug, Serialize)]
struct Readiness {
    ready: bool,
    /// "never_synced" (no upstream answer yet), "synced" or "serving_cached" (upstream down).
    state: &'static str,
    upstream_reached: bool,
    groups: Vec<GroupReadiness>,
}

fn readiness(relay: &Relay) -> Readiness {
    let groups: Vec<GroupReadiness> = relay
        .groups()
        .iter()
        .map(|g| GroupReadiness {
            group: g.name.clone(),
            clients: g.stream_count(),
            upstream_subscriptions: lock(&g.state).interest.upstream_subscription_count(),
            upstream: lock(&g.status).clone(),
        })
        .collect();
    let reached = relay.upstream_reached.load(Ordering::Relaxed);
    // Ready once the upstream has answered; a group that never synced has nothing to serve.
    let all_synced = groups
        .iter()
        .all(|g| g.upstream.synced_once || g.upstream_subscriptions == 0);
    let any_down = groups.iter().any(|g| !g.upstream.connected);
    let (ready, state) = match (reached && all_synced, any_down) {
        (false, _) => (false, "never_synced"),
        (true, false) => (true, "synced"),
        (true, true) => (true, "serving_cached"),
    };
    Readiness {
        ready,
        state,
        upstream_reached: reached,
        groups,
    }
}

fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn route(relay: &Relay, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "use GET\n");
    }
    match req.uri().path() {
        "/healthz" => respond(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            let r = readiness(relay);
            let code = if r.ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let body = serde_json::to_vec_pretty(&r).unwrap_or_default();
            respond(code, "application/json", body)
        }
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found; try /healthz or /readyz\n",
        ),
    }
}

/// Serves the admin API on `listener` until `shutdown` completes.
pub async fn serve(relay: Arc<Relay>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => { debug!(error = %e, "admin accept failed"); continue; }
            },
            () = &mut shutdown => return,
        };
        let relay = relay.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let resp = route(&relay, &req);
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                debug!(error = %e, "admin connection error");
            }
        });
    }
}
