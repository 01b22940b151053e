//! The relay under test as a child process: free loopback ports, start, wait for `/readyz`, stop.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

/// Pid of the running relay child, for the watchdog to kill on a forced exit (0 = none).
pub static CHILD_PID: AtomicU32 = AtomicU32::new(0);

pub struct RelayProcess {
    child: Child,
    pub pid: u32,
    pub xds: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
}

fn free_port() -> std::io::Result<SocketAddr> {
    StdListener::bind("127.0.0.1:0")?.local_addr()
}

/// The default relay binary: `adsrelay` next to this executable, else `target/release/adsrelay`.
pub fn default_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.join("adsrelay")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("target/release/adsrelay"))
}

/// Minimal HTTP/1.1 GET; returns the whole response (status line, headers, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Minimal HTTP/1.1 GET; returns the status code.
pub async fn http_status(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    Ok(http_get(addr, path)
        .await?
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0))
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

impl RelayProcess {
    /// Starts `bin` against `upstream` and waits (at most `timeout`) until `/readyz` answers 200.
    pub async fn start(
        bin: &Path,
        upstream: SocketAddr,
        linger: &str,
        upstream_protocol: &str,
        pin: bool,
        log: PathBuf,
        timeout: Duration,
    ) -> Result<RelayProcess, String> {
        let xds = free_port().map_err(|e| format!("no free port: {e}"))?;
        let admin = free_port().map_err(|e| format!("no free port: {e}"))?;
        let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = file.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(bin);
        cmd.arg("--upstream")
            .arg(upstream.to_string())
            .arg("--listen")
            .arg(xds.to_string())
            .arg("--admin")
            .arg(admin.to_string())
            .arg("--unsubscribe-linger")
            .arg(linger)
            .arg("--upstream-protocol")
            .arg(upstream_protocol)
            .stdin(std::process::Stdio::null())
            .stdout(file)
            .stderr(err)
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        if pin {
            // SAFETY: between fork and exec only sched_setaffinity runs (async-signal-safe).
            unsafe {
                cmd.pre_exec(|| crate::procfs::pin_current_thread(crate::procfs::SERVER_CPU));
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the relay {}: {e}", bin.display()))?;
        let pid = child.id().unwrap_or(0);
        CHILD_PID.store(pid, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                CHILD_PID.store(0, Ordering::SeqCst);
                return Err(format!(
                    "the relay exited during start-up ({status}); last log lines of {}:\n{}",
                    log.display(),
                    tail(&log)
                ));
            }
            if let Ok(200) = http_status(admin, "/readyz").await {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "the relay was not ready within {timeout:?}; last log lines of {}:\n{}",
                    log.display(),
                    tail(&log)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(RelayProcess {
            child,
            pid,
            xds,
            admin,
            log,
        })
    }

    /// SIGTERM, then SIGKILL after 5 s.
    pub async fn stop(mut self) {
        crate::procfs::signal(self.pid, false);
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        CHILD_PID.store(0, Ordering::SeqCst);
    }
}
