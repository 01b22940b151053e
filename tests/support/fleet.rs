//! What the Envoy-fleet interop tests (tests/go_control_plane_interop.rs,
//! tests/java_control_plane_interop.rs, tests/sotw_upstream_interop.rs) share: tiny HTTP backends,
//! requests through an Envoy listener, reading Envoy's admin output and a control plane's events.

use serde_json::Value;

use super::http_get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An HTTP backend answering every request with `name`; returns its port.
pub async fn backend(name: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{name}",
                    name.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    port
}

/// GET `path` through the Envoys' shared listener port (HTTP/1.1: Envoy refuses 1.0);
/// returns (status, body).
pub async fn get(port: u16, path: &str) -> (u16, String) {
    let (code, text) = http_get(([127, 0, 0, 1], port).into(), path).await;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// True if Envoy's /clusters page lists cluster `name` with an endpoint on `port`.
pub fn has_endpoint(clusters: &str, name: &str, port: u16) -> bool {
    clusters
        .lines()
        .any(|l| l.starts_with(&format!("{name}::127.0.0.1:{port}::")))
}

pub fn has_cluster(clusters: &str, name: &str) -> bool {
    clusters
        .lines()
        .any(|l| l.starts_with(&format!("{name}::")))
}

/// Events of the control-plane process started `nth` (0 = first; each begins with `listening`).
pub fn process_events(events: &[Value], nth: usize) -> Vec<Value> {
    let starts: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e["event"] == "listening")
        .map(|(i, _)| i)
        .collect();
    let end = starts.get(nth + 1).copied().unwrap_or(events.len());
    events[starts[nth]..end].to_vec()
}

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}
