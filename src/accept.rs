//! Accept loops that survive running out of file descriptors.
//!
//! `accept` failing with EMFILE leaves the pending connection in the backlog and the listener
//! readable, so retrying at once spins a core and starves everything else (issue 13). Here an
//! accept error is counted (`adsrelay_accept_errors_total{listener,reason}`), logged at most once
//! a second, and followed by a pause of 10 ms doubling to 1 s, reset by the next success; errors
//! that concern one connection only (aborted, reset) are retried at once. Existing streams and
//! the other listener keep running meanwhile, and accepting resumes by itself when descriptors
//! free up.
//!
//! The xDS listener queues as many connections as the kernel allows (`net.core.somaxconn`), not
//! tokio's default of 1,024: when ten thousand clients reconnect at once, a full queue drops their
//! SYNs and each dropped client waits a second or more for its retransmission.
//!
//! The xDS listener also keeps [`FdBudget::reserve`] descriptors free for the admin port, the
//! upstream connections and snapshot files: a client connection that would eat into them is
//! closed at once and counted as rejected, so clients are shed before the process is starved.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::drain::Drain;

/// Asks for the longest accept queue there is: Linux and the BSDs cap a larger request at
/// `somaxconn` without complaint.
const LISTEN_BACKLOG: u32 = i32::MAX as u32;

/// The xDS listener on `addr`, with the kernel's longest accept queue (and `SO_REUSEADDR`, as
/// tokio's `TcpListener::bind` sets it).
pub fn bind_xds(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// What the accept loops report; the relay's metrics implement it.
pub trait AcceptReport: Send + Sync {
    fn accept_failed(&self, listener: Listener, reason: AcceptError);
    /// A client connection was kept.
    fn connection_accepted(&self);
    /// A client connection was closed at once (over a limit, or descriptors short).
    fn connection_refused(&self);
}

/// The listener an accept error happened on (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Xds,
    Admin,
}

impl Listener {
    pub const ALL: [Listener; 2] = [Listener::Xds, Listener::Admin];

    pub fn label(self) -> &'static str {
        match self {
            Listener::Xds => "xds",
            Listener::Admin => "admin",
        }
    }
}

/// Why an accept failed (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptError {
    /// The process is out of descriptors (EMFILE).
    ProcessFds,
    /// The system is out of descriptors (ENFILE).
    SystemFds,
    /// Out of socket buffers or memory (ENOBUFS, ENOMEM).
    Memory,
    /// One connection failed before it was accepted (aborted, reset, ...): retried at once.
    Connection,
    Other,
}

impl AcceptError {
    pub const ALL: [AcceptError; 5] = [
        AcceptError::ProcessFds,
        AcceptError::SystemFds,
        AcceptError::Memory,
        AcceptError::Connection,
        AcceptError::Other,
    ];

    pub fn of(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EMFILE) => AcceptError::ProcessFds,
            Some(libc::ENFILE) => AcceptError::SystemFds,
            Some(libc::ENOBUFS) | Some(libc::ENOMEM) => AcceptError::Memory,
            _ => match e.kind() {
                io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionRefused
                | io::ErrorKind::Interrupted => AcceptError::Connection,
                _ => AcceptError::Other,
            },
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            AcceptError::ProcessFds => "emfile",
            AcceptError::SystemFds => "enfile",
            AcceptError::Memory => "enobufs",
            AcceptError::Connection => "connection",
            AcceptError::Other => "other",
        }
    }
}

const PAUSE_INITIAL: Duration = Duration::from_millis(10);
const PAUSE_MAX: Duration = Duration::from_secs(1);
const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// One listener's accept loop state: the pause after the next error and the log rate limit.
#[derive(Debug)]
pub struct Acceptor {
    listener: TcpListener,
    which: Listener,
    pause: Duration,
    last_log: Option<Instant>,
    suppressed: u64,
}

impl Acceptor {
    pub fn new(listener: TcpListener, which: Listener) -> Self {
        Acceptor {
            listener,
            which,
            pause: PAUSE_INITIAL,
            last_log: None,
            suppressed: 0,
        }
    }

    /// The next connection; errors are counted, logged and waited out, never returned.
    pub async fn accept(&mut self, report: &dyn AcceptReport) -> TcpStream {
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    self.pause = PAUSE_INITIAL;
                    // Responses are written whole by h2; Nagle would hold a small one (an ACKed
                    // update, a resume's empty answer) until the peer ACKs the previous segment.
                    // tonic's own nodelay setting applies only to listeners it binds itself.
                    if let Err(e) = stream.set_nodelay(true) {
                        debug!(listener = self.which.label(), error = %e, "accept: TCP_NODELAY not set");
                    }
                    return stream;
                }
                Err(e) => {
                    let kind = AcceptError::of(&e);
                    report.accept_failed(self.which, kind);
                    if kind == AcceptError::Connection {
                        debug!(listener = self.which.label(), error = %e, "accept: connection failed");
                        continue;
                    }
                    let pause = self.pause;
                    self.pause = (self.pause * 2).min(PAUSE_MAX);
                    let now = Instant::now();
                    if self.last_log.is_none_or(|t| now >= t + LOG_INTERVAL) {
                        warn!(listener = self.which.label(), error = %e, retry_in = ?pause,
                            suppressed = self.suppressed,
                            "accept failed; pausing (out of file descriptors? see process_open_fds)");
                        self.last_log = Some(now);
                        self.suppressed = 0;
                    } else {
                        self.suppressed += 1;
                    }
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}

/// Descriptors the xDS listener leaves for everything else.
#[derive(Debug, Clone, Copy)]
pub struct FdBudget {
    /// The soft limit in force (`u64::MAX`: unlimited).
    pub limit: u64,
    /// 0 disables shedding: connections are accepted until `accept` fails.
    pub reserve: u64,
    /// Descriptors open before any client connected (listeners, runtime, logs).
    pub baseline: u64,
}

impl FdBudget {
    pub fn now(reserve: u64) -> Self {
        FdBudget {
            limit: crate::process::fd_limit().map_or(u64::MAX, |l| l.soft),
            reserve,
            baseline: crate::process::open_fds().unwrap_or(0),
        }
    }

    /// Whether keeping a new client connection, whose descriptor is `fd`, leaves fewer than the
    /// reserve free. `clients` is the number of client connections already open. Descriptors are
    /// allocated lowest first, so `fd + 1` is a lower bound of those open; the baseline plus the
    /// clients is the other estimate (it misses the few other descriptors, which the reserve is
    /// for). Counting `/proc/self/fd` per accept would cost a directory scan of every connection.
    pub fn short(&self, fd: u64, clients: u64) -> bool {
        if self.reserve == 0 {
            return false;
        }
        let used = (fd + 1).max(self.baseline + clients + 1);
        used.saturating_add(self.reserve) > self.limit
    }
}

/// The xDS listener's admission rules and where it reports.
pub struct XdsGate {
    pub max_connections: usize,
    /// Descriptors kept free for everything but clients ([`FdBudget::reserve`]).
    pub fd_reserve: u64,
    pub drain: Arc<Drain>,
    /// Open client connections, kept by [`CountedIo`].
    pub open: Arc<AtomicI64>,
    pub report: Arc<dyn AcceptReport>,
}

/// The xDS listener's connections, counted while open: past `max_connections`, while draining, or
/// when descriptors run short, a new connection is closed at once. Never yields an error (tonic
/// would end or spin the server on one).
pub fn incoming(
    listener: TcpListener,
    gate: XdsGate,
) -> impl Stream<Item = io::Result<CountedIo>> + Send + 'static {
    let budget = FdBudget::now(gate.fd_reserve);
    let acceptor = Acceptor::new(listener, Listener::Xds);
    futures::stream::unfold((acceptor, gate), move |(mut acceptor, gate)| async move {
        loop {
            let stream = acceptor.accept(&*gate.report).await;
            let open = gate.open.load(Ordering::Relaxed).max(0) as u64;
            let max_connections = gate.max_connections;
            if gate.drain.is_draining() {
                // Draining: new connections go to other replicas.
                continue;
            }
            if open >= max_connections as u64 {
                gate.report.connection_refused();
                debug!(
                    max_connections,
                    "connection refused: max_connections reached"
                );
                continue;
            }
            if budget.short(stream.as_raw_fd() as u64, open) {
                gate.report.connection_refused();
                debug!(
                    fd_limit = budget.limit,
                    fd_reserve = budget.reserve,
                    "connection refused: file descriptors reserved for the admin port and upstream"
                );
                continue;
            }
            gate.report.connection_accepted();
            let io = CountedIo::new(stream, &gate.open, gate.drain.register());
            return Some((Ok(io), (acceptor, gate)));
        }
    })
}

/// A downstream connection, counted in the open-connections gauge while it is open.
#[derive(Debug)]
pub struct CountedIo {
    inner: tokio::net::TcpStream,
    open: Arc<AtomicI64>,
    /// Lets a graceful shutdown close this connection (reads end as if the client closed it).
    drain: crate::drain::Registration,
}

impl CountedIo {
    pub fn new(
        inner: tokio::net::TcpStream,
        open: &Arc<AtomicI64>,
        drain: crate::drain::Registration,
    ) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        CountedIo {
            inner,
            open: open.clone(),
            drain,
        }
    }
}

impl Drop for CountedIo {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl tonic::transport::server::Connected for CountedIo {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl tokio::io::AsyncRead for CountedIo {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.drain.handle.poll_closed(cx).is_ready() {
            // End of stream: the HTTP/2 server drops the connection and the client reconnects.
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for CountedIo {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ss` shows a listening socket's accept-queue limit in its Send-Q column.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_xds_listener_queues_as_many_connections_as_the_kernel_allows() {
        let listener = bind_xds("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = listener.local_addr().unwrap().port();
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let ss = std::process::Command::new("ss")
            .args(["-Hltn", &format!("sport = :{port}")])
            .output()
            .expect("ss (iproute2) shows the listener's queue");
        let line = String::from_utf8(ss.stdout).unwrap();
        let queue: u32 = line
            .split_whitespace()
            .nth(2)
            .and_then(|q| q.parse().ok())
            .unwrap_or_else(|| panic!("no listener in `ss` output: {line:?}"));
        assert_eq!(queue, somaxconn, "not tokio's default of 1,024");
    }

    #[test]
    fn descriptor_errors_are_told_apart() {
        let e = |n| io::Error::from_raw_os_error(n);
        assert_eq!(AcceptError::of(&e(libc::EMFILE)), AcceptError::ProcessFds);
        assert_eq!(AcceptError::of(&e(libc::ENFILE)), AcceptError::SystemFds);
        assert_eq!(AcceptError::of(&e(libc::ENOBUFS)), AcceptError::Memory);
        assert_eq!(
            AcceptError::of(&e(libc::ECONNABORTED)),
            AcceptError::Connection
        );
    }

    #[test]
    fn the_reserve_sheds_clients_first() {
        let b = FdBudget {
            limit: 100,
            reserve: 20,
            baseline: 10,
        };
        assert!(!b.short(12, 0));
        assert!(!b.short(75, 60), "76 open + 20 reserved fit in 100");
        assert!(b.short(80, 60), "a high descriptor shows the table is full");
        assert!(
            b.short(12, 70),
            "holes at the bottom: the client count tells"
        );
        let unlimited = FdBudget {
            limit: u64::MAX,
            ..b
        };
        assert!(!unlimited.short(1 << 40, 1 << 40));
        let off = FdBudget { reserve: 0, ..b };
        assert!(!off.short(99, 99), "0 disables the reserve");
    }

    struct Silent;
    impl AcceptReport for Silent {
        fn accept_failed(&self, _: Listener, _: AcceptError) {}
        fn connection_accepted(&self) {}
        fn connection_refused(&self) {}
    }

    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_acks_to_write() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut acceptor = Acceptor::new(listener, Listener::Xds);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = acceptor.accept(&Silent).await;
        assert!(
            accepted.nodelay().unwrap(),
            "Nagle would hold a small response until the client ACKs the previous segment"
        );
    }
}
