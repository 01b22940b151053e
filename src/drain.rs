//! Graceful shutdown: on SIGTERM the relay stops being ready, refuses new connections and streams,
//! and closes its existing client connections in batches spread over the drain period, so clients
//! reconnect elsewhere gradually instead of all at the same instant.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use dashmap::DashMap;
use futures::task::AtomicWaker;
use tracing::info;

/// One downstream connection the drain can close.
#[derive(Debug, Default)]
pub struct ConnHandle {
    closed: AtomicBool,
    waker: AtomicWaker,
}

impl ConnHandle {
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Called from the connection's `poll_read`: `Ready` (end of stream) once the drain closed it,
    /// which makes the HTTP/2 server drop the connection.
    pub fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.waker.register(cx.waker());
        if self.closed.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[derive(Debug, Default)]
pub struct Drain {
    conns: DashMap<u64, Arc<ConnHandle>>,
    next: AtomicU64,
    draining: AtomicBool,
}

/// Keeps a connection registered while it is open.
#[derive(Debug)]
pub struct Registration {
    id: u64,
    drain: Arc<Drain>,
    pub handle: Arc<ConnHandle>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.drain.conns.remove(&self.id);
    }
}

impl Drain {
    pub fn register(self: &Arc<Self>) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let handle = Arc::new(ConnHandle::default());
        self.conns.insert(id, handle.clone());
        Registration {
            id,
            drain: self.clone(),
            handle,
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn open_connections(&self) -> usize {
        self.conns.len()
    }

    /// Marks the relay draining and closes every open connection, in batches every 100 ms
    /// spread evenly over `period`.
    pub async fn run(&self, period: Duration) {
        self.draining.store(true, Ordering::Relaxed);
        let conns: Vec<Arc<ConnHandle>> = self.conns.iter().map(|c| c.value().clone()).collect();
        let step = Duration::from_millis(100);
        let steps = (period.as_millis() / step.as_millis()).max(1) as usize;
        let per_step = conns.len().div_ceil(steps).max(1);
        info!(connections = conns.len(), period = ?period, "draining: closing client connections gradually");
        for (i, batch) in conns.chunks(per_step).enumerate() {
            if i > 0 {
                tokio::time::sleep(step).await;
            }
            for c in batch {
                c.close();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn closes_every_connection_spread_over_the_period() {
        let drain = Arc::new(Drain::default());
        let regs: Vec<Registration> = (0..50).map(|_| drain.register()).collect();
        let start = tokio::time::Instant::now();
        let d = drain.clone();
        let task = tokio::spawn(async move { d.run(Duration::from_secs(1)).await });
        tokio::time::sleep(Duration::from_millis(450)).await;
        let closed_midway = regs
            .iter()
            .filter(|r| r.handle.closed.load(Ordering::Relaxed))
            .count();
        task.await.unwrap();
        assert!(drain.is_draining());
        assert!(closed_midway > 0 && closed_midway < 50, "{closed_midway}");
        assert!(regs.iter().all(|r| r.handle.closed.load(Ordering::Relaxed)));
        assert!(start.elapsed() <= Duration::from_secs(1));
        drop(regs);
        assert_eq!(drain.open_connections(), 0);
    }
}
