//! Admin HTTP server (an axum router served by hyper over our own accept loop): /healthz, /readyz, /metrics, JSON debug endpoints (cache, clients,
//! upstreams, config) and the run-time log level (POST). See docs/metrics.md.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::handler::Handler;
use axum::response::Response;
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::StatusCode;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tracing::{debug, info};

use crate::csds::TypeAck;
use crate::group::UpstreamStatus;
use crate::logging;
use crate::relay::Relay;
use crate::sync::{lock, read};

#[derive(Debug, Serialize)]
struct GroupReadiness {
    group: String,
    /// "never_synced", "synced", "serving_cached" (upstream stream down, cache served) or
    /// "serving_snapshot" (restored from the cache snapshot, no upstream answer yet).
    state: &'static str,
    /// The node the relay presents upstream for the group.
    upstream_node_id: String,
    upstream_node_cluster: String,
    /// Seconds since the group's last upstream response (null before the first).
    last_response_age_seconds: Option<f64>,
    /// 0 while the upstream stream is open (the cache follows the control plane); while it is down,
    /// seconds since it was lost: updates made since then may be missing.
    staleness_seconds: Option<f64>,
    clients: usize,
    upstream_subscriptions: usize,
    #[serde(flatten)]
    upstream: UpstreamStatus,
}

#[derive(Debug, Serialize)]
struct Readiness {
    ready: bool,
    /// "never_synced" (no upstream answer yet), "synced", "serving_cached" (upstream down) or
    /// "serving_snapshot" (serving what the cache snapshot restored; the upstream has not
    /// answered yet).
    state: &'static str,
    upstream_reached: bool,
    /// The largest `staleness_seconds` over the groups.
    max_staleness_seconds: f64,
    /// The cache snapshot loaded at startup (warm restart), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<SnapshotReadiness>,
    groups: Vec<GroupReadiness>,
}

#[derive(Debug, Serialize)]
struct SnapshotReadiness {
    path: String,
    /// Seconds since the loaded snapshot was written.
    age_seconds: f64,
    loaded_resources: usize,
}

fn secs_since(t: Option<SystemTime>, now: SystemTime) -> Option<f64> {
    t.map(|t| now.duration_since(t).unwrap_or_default().as_secs_f64())
}

fn readiness(relay: &Relay) -> Readiness {
    let now = SystemTime::now();
    let mut groups: Vec<GroupReadiness> = relay
        .groups()
        .iter()
        .map(|g| {
            let upstream = lock(&g.status).clone();
            let subscriptions = read(&g.state).interest().upstream_subscription_count();
            let state = if !upstream.synced_once && g.seeded_as_of.is_some() {
                "serving_snapshot"
            } else if !upstream.synced_once {
                "never_synced"
            } else if upstream.connected {
                "synced"
            } else {
                "serving_cached"
            };
            GroupReadiness {
                group: g.name.clone(),
                state,
                upstream_node_id: g.upstream_node.id.clone(),
                upstream_node_cluster: g.upstream_node.cluster.clone(),
                last_response_age_seconds: secs_since(upstream.last_response, now),
                staleness_seconds: if upstream.connected {
                    Some(0.0)
                } else if upstream.synced_once {
                    secs_since(upstream.disconnected_since.or(upstream.last_response), now)
                } else if g.seeded_as_of.is_some() {
                    secs_since(g.seeded_as_of, now)
                } else {
                    None
                },
                clients: g.stream_count(),
                upstream_subscriptions: subscriptions,
                upstream,
            }
        })
        .collect();
    groups.sort_by(|a, b| a.group.cmp(&b.group));
    let max_staleness_seconds = groups
        .iter()
        .filter_map(|g| g.staleness_seconds)
        .fold(0.0, f64::max);
    let reached = relay.upstream_reached.load(Ordering::Relaxed);
    let loaded = relay.snapshot.loaded();
    // Ready once the upstream has answered, or a snapshot was loaded (warm restart: serving it
    // is the point while the upstream is away); a group that has neither has nothing to serve.
    let all_servable = groups.iter().all(|g| {
        g.upstream.synced_once || g.state == "serving_snapshot" || g.upstream_subscriptions == 0
    });
    let from_snapshot =
        loaded.is_some() && (!reached || groups.iter().any(|g| g.state == "serving_snapshot"));
    let any_down = groups.iter().any(|g| !g.upstream.connected);
    let (ready, state) = match ((reached || loaded.is_some()) && all_servable, any_down) {
        // Shutting down: take the relay out of load balancing while clients move away.
        _ if relay.drain.is_draining() => (false, "draining"),
        (false, _) => (false, "never_synced"),
        (true, _) if from_snapshot => (true, "serving_snapshot"),
        (true, false) => (true, "synced"),
        (true, true) => (true, "serving_cached"),
    };
    Readiness {
        ready,
        state,
        upstream_reached: reached,
        max_staleness_seconds,
        snapshot: loaded.map(|l| SnapshotReadiness {
            path: l.path.display().to_string(),
            age_seconds: secs_since(Some(l.written_at), now).unwrap_or_default(),
            loaded_resources: l.resources,
        }),
        groups,
    }
}

fn respond(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from(body.into()))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// Pretty-printed and newline-terminated for people using curl, which `axum::Json` is not.
fn json(status: StatusCode, value: &impl Serialize) -> Response {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    respond(status, "application/json", body)
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut r = respond(
        StatusCode::METHOD_NOT_ALLOWED,
        "text/plain",
        format!("method not allowed; use {allow}\n"),
    );
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// `/debug/cache` parameters. Read through a map so a repeated parameter keeps its last value
/// (a derived struct would reject it) and a bad `limit` falls back to the default.
#[derive(Debug, Deserialize)]
#[serde(from = "HashMap<String, String>")]
struct CacheQuery {
    type_url: Option<String>,
    prefix: Option<String>,
    group: Option<String>,
    limit: Option<usize>,
}

impl From<HashMap<String, String>> for CacheQuery {
    fn from(mut q: HashMap<String, String>) -> Self {
        CacheQuery {
            type_url: q.remove("type"),
            prefix: q.remove("prefix"),
            group: q.remove("group"),
            limit: q.remove("limit").and_then(|l| l.parse().ok()),
        }
    }
}

/// `/debug/clients` parameters (a repeated one keeps its last value, as for [`CacheQuery`]).
#[derive(Debug, Deserialize)]
#[serde(from = "HashMap<String, String>")]
struct ClientsQuery {
    node_id: Option<String>,
    group: Option<String>,
}

impl From<HashMap<String, String>> for ClientsQuery {
    fn from(mut q: HashMap<String, String>) -> Self {
        ClientsQuery {
            node_id: q.remove("node_id"),
            group: q.remove("group"),
        }
    }
}

/// `/debug/log-level` parameters (a repeated one keeps its last value, as for [`CacheQuery`]).
#[derive(Debug, Deserialize)]
#[serde(from = "HashMap<String, String>")]
struct LogLevelQuery {
    level: Option<String>,
}

impl From<HashMap<String, String>> for LogLevelQuery {
    fn from(mut q: HashMap<String, String>) -> Self {
        LogLevelQuery {
            level: q.remove("level"),
        }
    }
}

#[derive(Debug, Serialize)]
struct CacheEntry {
    name: String,
    version: String,
    bytes: usize,
    do_not_cache: bool,
}

#[derive(Debug, Serialize)]
struct CacheType {
    type_url: String,
    /// Resources of the type in the group's cache (before the name filter).
    resources: usize,
    bytes: usize,
    wildcard_synced: bool,
    entries: Vec<CacheEntry>,
}

#[derive(Debug, Serialize)]
struct CacheGroup {
    group: String,
    types: Vec<CacheType>,
}

#[derive(Debug, Serialize)]
struct CacheDump {
    groups: Vec<CacheGroup>,
    /// More entries matched than `limit`.
    truncated: bool,
}

/// `/debug/cache?type=&prefix=&group=&limit=`: names, versions and sizes; never bodies.
fn debug_cache(relay: &Relay, q: &CacheQuery) -> CacheDump {
    let limit = q.limit.unwrap_or(1000);
    let prefix = q.prefix.as_deref().unwrap_or("");
    let mut left = limit;
    let mut truncated = false;
    let mut groups = relay.groups();
    groups.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = Vec::new();
    for g in groups {
        if q.group.as_ref().is_some_and(|want| *want != g.name) {
            continue;
        }
        let state = read(&g.state);
        let mut type_urls: Vec<&str> = state
            .store()
            .type_urls()
            .filter(|t| q.type_url.as_deref().is_none_or(|want| want == *t))
            .collect();
        type_urls.sort_unstable();
        let mut types = Vec::new();
        for t in type_urls {
            let (mut resources, mut bytes) = (0, 0);
            let mut entries = Vec::new();
            for r in state.store().resources(t) {
                resources += 1;
                bytes += r.encoded.len();
                if !r.name.starts_with(prefix) {
                    continue;
                }
                if left == 0 {
                    truncated = true;
                    continue;
                }
                left -= 1;
                entries.push(CacheEntry {
                    name: r.name.to_string(),
                    version: r.version.clone(),
                    bytes: r.encoded.len(),
                    do_not_cache: r.do_not_cache,
                });
            }
            types.push(CacheType {
                type_url: t.to_string(),
                resources,
                bytes,
                wildcard_synced: state.store().wildcard_synced(t),
                entries,
            });
        }
        out.push(CacheGroup {
            group: g.name.clone(),
            types,
        });
    }
    CacheDump {
        groups: out,
        truncated,
    }
}

#[derive(Debug, Serialize)]
struct Answer {
    nonce: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(serialize_with = "crate::rfc3339::option")]
    at: Option<SystemTime>,
}

#[derive(Debug, Serialize)]
struct ClientType {
    type_url: String,
    wildcard: bool,
    /// Explicitly subscribed names.
    subscriptions: usize,
    /// Resources the client holds as far as the relay knows.
    resources: usize,
    /// not_sent, pending (response in flight), acked or nacked: the answer to the latest response.
    state: &'static str,
    last_nonce: Option<String>,
    last_ack: Option<Answer>,
    last_nack: Option<Answer>,
}

#[derive(Debug, Serialize)]
struct ClientInfo {
    stream_id: u64,
    node_id: String,
    cluster: String,
    group: String,
    protocol: crate::xds::Protocol,
    #[serde(serialize_with = "crate::rfc3339::serialize")]
    connected_since: SystemTime,
    types: Vec<ClientType>,
}

/// `/debug/clients?node_id=&group=`: every open stream and its per-type ACK/NACK state.
fn debug_clients(relay: &Relay, q: &ClientsQuery) -> Vec<ClientInfo> {
    let mut clients = relay.clients();
    clients.sort_by_key(|c| c.id);
    clients
        .into_iter()
        .filter(|c| q.node_id.as_ref().is_none_or(|n| *n == c.node.id))
        .filter(|c| q.group.as_ref().is_none_or(|g| *g == c.group))
        .map(|c| {
            let types = c
                .core
                .view(false)
                .into_iter()
                .map(|ts| {
                    let times = c.ack_times(&ts.type_url);
                    ClientType {
                        state: TypeAck::of(&ts).as_str(),
                        type_url: ts.type_url,
                        wildcard: ts.wildcard,
                        subscriptions: ts.subscribed,
                        resources: ts.held,
                        last_nonce: ts.last_nonce,
                        last_ack: ts.last_ack.map(|nonce| Answer {
                            nonce,
                            error: None,
                            at: times.last_ack,
                        }),
                        last_nack: ts.last_nack.map(|(nonce, error)| Answer {
                            nonce,
                            error: Some(error),
                            at: times.last_nack,
                        }),
                    }
                })
                .collect();
            ClientInfo {
                stream_id: c.id,
                node_id: c.node.id.clone(),
                cluster: c.node.cluster.clone(),
                group: c.group.clone(),
                protocol: c.protocol,
                connected_since: c.connected_since,
                types,
            }
        })
        .collect()
}

#[derive(Debug, Serialize)]
struct UpstreamSubscription {
    type_url: String,
    /// Distinct names (and `"*"`) subscribed upstream, lingering ones included.
    names: usize,
    wildcard: bool,
}

#[derive(Debug, Serialize)]
struct UpstreamInfo {
    group: String,
    clients: usize,
    #[serde(flatten)]
    status: UpstreamStatus,
    subscriptions: Vec<UpstreamSubscription>,
}

fn debug_upstreams(relay: &Relay) -> Vec<UpstreamInfo> {
    let mut groups = relay.groups();
    groups.sort_by(|a, b| a.name.cmp(&b.name));
    groups
        .iter()
        .map(|g| UpstreamInfo {
            group: g.name.clone(),
            clients: g.stream_count(),
            subscriptions: read(&g.state)
                .interest()
                .upstream_subscriptions_by_type()
                .into_iter()
                .map(|(type_url, names, wildcard)| UpstreamSubscription {
                    type_url,
                    names,
                    wildcard,
                })
                .collect(),
            status: lock(&g.status).clone(),
        })
        .collect()
}

fn debug_config(relay: &Relay) -> serde_json::Value {
    let c = &relay.config;
    serde_json::json!({
        "upstream": c.upstream.to_string(),
        "upstreams": c.upstreams.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
        "groups": c.grouping.rules.len(),
        "group_metadata_keys": c.grouping.metadata_keys,
        "unmatched": c.grouping.unmatched,
        "resilience": c.resilience,
        "listen": c.listen.to_string(),
        "admin": c.admin.to_string(),
        "node_id": c.node_id,
        "unsubscribe_linger": format!("{:?}", c.unsubscribe_linger),
        "max_message_bytes": c.max_message_bytes,
        "log_format": format!("{:?}", c.log_format).to_lowercase(),
        "log_level": logging::level(),
        "upstream_backoff_initial": format!("{:?}", c.backoff_initial),
        "upstream_backoff_max": format!("{:?}", c.backoff_max),
        "params_from_metadata": c.params_from_metadata,
        "snapshot": c.snapshot.as_ref().map(|s| serde_json::json!({
            "path": s.path.display().to_string(),
            "interval": format!("{:?}", s.interval),
            "max_staleness": format!("{:?}", s.max_staleness),
        })),
        // Every field, including ones this endpoint does not list by name.
        "debug": format!("{c:?}"),
    })
}

async fn set_log_level(Query(q): Query<LogLevelQuery>) -> Response {
    let Some(level) = q.level.filter(|l| !l.is_empty()) else {
        return respond(
            StatusCode::BAD_REQUEST,
            "text/plain",
            "missing ?level=, e.g. ?level=debug or ?level=info,adsrelay=debug\n",
        );
    };
    match logging::set_level(&level) {
        Ok(()) => {
            info!(level = %level, "log level changed via admin API");
            json(StatusCode::OK, &serde_json::json!({ "log_level": level }))
        }
        Err(e @ logging::LevelError::Invalid(..)) => {
            respond(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n"))
        }
        Err(e) => respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("{e}\n"),
        ),
    }
}

const INDEX: &str = "adsrelay admin\n\
GET  /healthz\n\
GET  /readyz\n\
GET  /metrics\n\
GET  /debug/cache?type=TYPE_URL&prefix=NAME_PREFIX&group=GROUP&limit=1000\n\
GET  /debug/clients?node_id=ID&group=GROUP\n\
GET  /debug/upstreams\n\
GET  /debug/config\n\
POST /debug/log-level?level=debug\n";

const READ_ONLY: &str = "GET, HEAD";

/// A read-only endpoint: GET (and HEAD, which axum answers without the body); other methods 405.
fn read_only<H, T>(handler: H) -> MethodRouter<Arc<Relay>>
where
    H: Handler<T, Arc<Relay>>,
    T: 'static,
{
    get(handler).fallback(|| async { method_not_allowed(READ_ONLY) })
}

fn router(relay: Arc<Relay>) -> Router {
    Router::new()
        .route(
            "/",
            read_only(|| async { respond(StatusCode::OK, "text/plain", INDEX) }),
        )
        .route(
            "/healthz",
            read_only(|| async { respond(StatusCode::OK, "text/plain", "ok\n") }),
        )
        .route(
            "/readyz",
            read_only(|State(relay): State<Arc<Relay>>| async move {
                let r = readiness(&relay);
                let code = if r.ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json(code, &r)
            }),
        )
        .route(
            "/metrics",
            read_only(|State(relay): State<Arc<Relay>>| async move {
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    relay.render_metrics(),
                )
            }),
        )
        .route(
            "/debug/cache",
            read_only(
                |State(relay): State<Arc<Relay>>, Query(q): Query<CacheQuery>| async move {
                    json(StatusCode::OK, &debug_cache(&relay, &q))
                },
            ),
        )
        .route(
            "/debug/clients",
            read_only(
                |State(relay): State<Arc<Relay>>, Query(q): Query<ClientsQuery>| async move {
                    json(StatusCode::OK, &debug_clients(&relay, &q))
                },
            ),
        )
        .route(
            "/debug/upstreams",
            read_only(|State(relay): State<Arc<Relay>>| async move {
                json(StatusCode::OK, &debug_upstreams(&relay))
            }),
        )
        .route(
            "/debug/config",
            read_only(|State(relay): State<Arc<Relay>>| async move {
                json(StatusCode::OK, &debug_config(&relay))
            }),
        )
        // State-changing endpoints are POST-only.
        .route(
            "/debug/log-level",
            post(set_log_level).fallback(|| async { method_not_allowed("POST") }),
        )
        .fallback(|| async {
            respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                format!("not found\n\n{INDEX}"),
            )
        })
        .with_state(relay)
}

/// Serves the admin API on `listener` until `shutdown` completes.
pub async fn serve(relay: Arc<Relay>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    let metrics = relay.metrics.clone();
    let router = router(relay);
    // Accept errors (out of descriptors) pause this listener; they never spin it.
    let mut acceptor = crate::accept::Acceptor::new(listener, crate::accept::Listener::Admin);
    loop {
        let stream = tokio::select! {
            stream = acceptor.accept(&*metrics) => stream,
            () = &mut shutdown => return,
        };
        let svc = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                debug!(error = %e, "admin connection error");
            }
        });
    }
}
