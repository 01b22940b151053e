//! The raw floor: an HTTP/2 server with no xDS logic that pushes the same encoded
//! `DeltaDiscoveryResponse` bytes the relay would send, gRPC-framed (1-byte flag, 4-byte length),
//! on one long-lived stream per client; and the matching client. It times the same update fan-out
//! with nothing but HTTP/2, protobuf framing and the clients' decode in the way.
//!
//! A client opens a POST, sends its EDS indices (comma separated) and ends its side; the server
//! answers 200 with an initial snapshot (all Clusters, all Listeners, the client's EDS) and then
//! one frame per type an update touches.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use adsrelay::pb::wire::DeltaDiscoveryResponse;

use crate::client::{ClientState, LiteResponse};
use crate::measure::RunCtx;
use crate::workload::{encode_resource, Changed, Kind, Versions, Workload};

const WINDOW: u32 = 8 << 20;

struct FloorStream {
    send: h2::SendStream<Bytes>,
    eds: Vec<u32>,
}

struct FloorState {
    versions: Versions,
    /// Encoded resources at their current versions, per kind.
    encoded: [Vec<Bytes>; 3],
    streams: Vec<FloorStream>,
    nonce: u64,
}

pub struct FloorServer {
    workload: Arc<Workload>,
    state: Mutex<FloorState>,
    pub addr: SocketAddr,
}

/// gRPC message framing: uncompressed flag, big-endian length, payload.
fn frame(payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(payload.len() + 5);
    b.put_u8(0);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

fn response(kind: Kind, resources: Vec<Bytes>, nonce: u64) -> Bytes {
    frame(
        &DeltaDiscoveryResponse {
            type_url: kind.type_url().into(),
            resources,
            nonce: nonce.to_string(),
            ..Default::default()
        }
        .encode_to_vec(),
    )
}

impl FloorServer {
    /// Binds `bind` and serves until the returned server is dropped and its tasks aborted (the
    /// accept loop runs in `tasks`).
    pub async fn start(
        workload: Arc<Workload>,
        bind: SocketAddr,
        tasks: &mut JoinSet<()>,
    ) -> std::io::Result<Arc<FloorServer>> {
        let listener = TcpListener::bind(bind).await?;
        let versions = Versions::new(&workload);
        let encoded = Kind::ALL.map(|k| {
            versions.v[k as usize]
                .iter()
                .enumerate()
                .map(|(i, &g)| encode_resource(k, i as u32, g, workload.resource_bytes))
                .collect()
        });
        let server = Arc::new(FloorServer {
            addr: listener.local_addr()?,
            workload,
            state: Mutex::new(FloorState {
                versions,
                encoded,
                streams: Vec::new(),
                nonce: 0,
            }),
        });
        let s = server.clone();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((sock, _)) = listener.accept().await {
                let _ = sock.set_nodelay(true);
                conns.spawn(s.clone().serve_connection(sock));
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(server)
    }

    async fn serve_connection(self: Arc<Self>, sock: TcpStream) {
        let Ok(mut conn) = h2::server::Builder::new()
            .initial_window_size(WINDOW)
            .initial_connection_window_size(WINDOW)
            .max_concurrent_streams(10_000)
            .handshake::<_, Bytes>(sock)
            .await
        else {
            return;
        };
        let mut streams = JoinSet::new();
        while let Some(Ok((req, respond))) = conn.accept().await {
            streams.spawn(self.clone().open_stream(req, respond));
            while streams.try_join_next().is_some() {}
        }
    }

    async fn open_stream(
        self: Arc<Self>,
        req: http::Request<h2::RecvStream>,
        mut respond: h2::server::SendResponse<Bytes>,
    ) {
        let mut body = req.into_body();
        let mut names = Vec::new();
        while let Some(chunk) = body.data().await {
            let Ok(chunk) = chunk else { return };
            let _ = body.flow_control().release_capacity(chunk.len());
            names.extend_from_slice(&chunk);
        }
        let eds: Vec<u32> = String::from_utf8_lossy(&names)
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        let head = http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc")
            .body(())
            .expect("static response head");
        let Ok(mut send) = respond.send_response(head, false) else {
            return;
        };
        let mut st = crate::sync::lock(&self.state);
        st.nonce += 1;
        let n = st.nonce;
        for kind in [Kind::Cluster, Kind::Listener] {
            let _ = send.send_data(response(kind, st.encoded[kind as usize].clone(), n), false);
        }
        let mine = eds
            .iter()
            .map(|&i| st.encoded[2][i as usize].clone())
            .collect();
        let _ = send.send_data(response(Kind::Endpoints, mine, n), false);
        st.streams.push(FloorStream { send, eds });
    }

    /// Applies an update and pushes it: one shared frame per wildcard type, a frame per client
    /// for its changed EDS names.
    pub fn push(&self, changed: &Changed, generation: u32) {
        let w = &self.workload;
        let mut guard = crate::sync::lock(&self.state);
        let st = &mut *guard;
        st.versions.apply(changed, generation);
        for (k, names) in changed.names.iter().enumerate() {
            for &i in names {
                st.encoded[k][i as usize] =
                    encode_resource(Kind::ALL[k], i, generation, w.resource_bytes);
            }
        }
        st.nonce += 1;
        let n = st.nonce;
        let shared: Vec<Bytes> = [Kind::Cluster, Kind::Listener]
            .into_iter()
            .filter(|k| !changed.names[*k as usize].is_empty())
            .map(|k| {
                let res = changed.names[k as usize]
                    .iter()
                    .map(|&i| st.encoded[k as usize][i as usize].clone())
                    .collect();
                response(k, res, n)
            })
            .collect();
        let encoded = &st.encoded;
        st.streams.retain_mut(|s| {
            let mut ok = true;
            for f in &shared {
                ok &= s.send.send_data(f.clone(), false).is_ok();
            }
            let mine: Vec<Bytes> = s
                .eds
                .iter()
                .filter(|&&i| changed.contains_eds(i))
                .map(|&i| encoded[2][i as usize].clone())
                .collect();
            if !mine.is_empty() {
                ok &= s
                    .send
                    .send_data(response(Kind::Endpoints, mine, n), false)
                    .is_ok();
            }
            ok
        });
    }

    pub fn streams(&self) -> usize {
        crate::sync::lock(&self.state).streams.len()
    }
}

/// One floor connection carrying the clients `ids`, one stream each.
pub async fn run_connection(
    addr: SocketAddr,
    ctx: Arc<RunCtx>,
    ids: Vec<u32>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let mut tcp = None;
    for attempt in 1..=5u64 {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => {
                ctx.error(format!("floor connect {addr}: {e}"));
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
        }
    }
    let Some(tcp) = tcp else { return };
    let _ = tcp.set_nodelay(true);
    let (send_req, conn) = match h2::client::Builder::new()
        .initial_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .handshake::<_, Bytes>(tcp)
        .await
    {
        Ok(x) => x,
        Err(e) => return ctx.error(format!("floor handshake: {e}")),
    };
    drop(permit);
    let mut tasks = JoinSet::new();
    let c2 = ctx.clone();
    tasks.spawn(async move {
        if let Err(e) = conn.await {
            c2.error(format!("floor connection: {e}"));
        }
    });
    for id in ids {
        tasks.spawn(run_stream(addr, ctx.clone(), id, send_req.clone()));
    }
    while tasks.join_next().await.is_some() {}
}

async fn run_stream(
    addr: SocketAddr,
    ctx: Arc<RunCtx>,
    id: u32,
    send_req: h2::client::SendRequest<Bytes>,
) {
    let mut state = ClientState::new(id, &ctx);
    let names: Vec<String> = state.eds_indices().iter().map(u32::to_string).collect();
    let req = http::Request::post(format!("http://{addr}/floor"))
        .body(())
        .expect("static request");
    let opened = async {
        let mut send_req = send_req.ready().await?;
        let (resp, mut body_tx) = send_req.send_request(req, false)?;
        body_tx.send_data(Bytes::from(names.join(",")), true)?;
        resp.await
    };
    let resp = match opened.await {
        Ok(r) => r,
        Err(e) => return ctx.error(format!("floor client {id}: {e}")),
    };
    ctx.connected.fetch_add(1, Ordering::Relaxed);
    let mut body = resp.into_body();
    let mut buf = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return ctx.error(format!("floor client {id}: {e}")),
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if buf.len() < 5 + len {
                break;
            }
            buf.advance(5);
            let msg = buf.split_to(len).freeze();
            match LiteResponse::decode(msg) {
                Ok(r) => {
                    let n = state.apply(&r);
                    ctx.responses.fetch_add(1, Ordering::Relaxed);
                    ctx.resources_received
                        .fetch_add(n as u64, Ordering::Relaxed);
                    state.check(&ctx);
                }
                Err(e) => return ctx.error(format!("floor client {id}: decode: {e}")),
            }
        }
    }
}
