//! A TCP proxy between the relay and its control plane that injects faults at the byte level:
//! stall (stop forwarding in both directions, connections stay open), cut every connection, or cut
//! the control plane's side after N more bytes (a stream dropped in the middle of a response).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug)]
struct State {
    target: SocketAddr,
    stalled: watch::Sender<bool>,
    /// Bumped to cut every open connection.
    generation: watch::Sender<u64>,
    /// Bytes from the control plane still forwarded before the connection is cut (usize::MAX: no
    /// cut armed).
    cut_after: AtomicUsize,
    pub connections: AtomicUsize,
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    state: Arc<State>,
}

impl FaultProxy {
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            target,
            stalled: watch::Sender::new(false),
            generation: watch::Sender::new(0),
            cut_after: AtomicUsize::new(usize::MAX),
            connections: AtomicUsize::new(0),
        });
        let s = state.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(s.target).await else {
                        return;
                    };
                    s.connections.fetch_add(1, Ordering::Relaxed);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let generation = *s.generation.borrow();
                    tokio::select! {
                        _ = pump(cr, sw, s.clone(), false) => {}
                        _ = pump(sr, cw, s.clone(), true) => {}
                        _ = async {
                            let mut g = s.generation.subscribe();
                            let _ = g.wait_for(|v| *v != generation).await;
                        } => {}
                    }
                });
            }
        });
        FaultProxy { addr, state }
    }

    pub fn stall(&self, on: bool) {
        self.state.stalled.send_replace(on);
    }

    pub fn cut_all(&self) {
        self.state.generation.send_modify(|g| *g += 1);
    }

    /// Forwards `n` more bytes from the control plane, then cuts that connection.
    pub fn cut_after(&self, n: usize) {
        self.state.cut_after.store(n, Ordering::SeqCst);
    }

    /// Connections the proxy opened to the control plane so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::Relaxed)
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    s: Arc<State>,
    from_server: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut stalled = s.stalled.subscribe();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.wait_for(|v| !*v).await.is_err() {
            return;
        }
        let mut len = n;
        let mut cut = false;
        if from_server {
            let left = s.cut_after.load(Ordering::SeqCst);
            if left != usize::MAX {
                if n >= left {
                    len = left;
                    cut = true;
                    s.cut_after.store(usize::MAX, Ordering::SeqCst);
                } else {
                    s.cut_after.store(left - n, Ordering::SeqCst);
                }
            }
        }
        if to.write_all(&buf[..len]).await.is_err() {
            return;
        }
        if cut {
            return;
        }
    }
}
