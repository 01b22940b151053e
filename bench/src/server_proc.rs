//! The baselines (`plain`, `floor`, `demo`) run in a child process of their own, `loadgen --serve
//! <target>`, so their CPU and RSS come from /proc exactly as the relay's do, apart from the
//! clients' and from one another's leftovers.
//!
//! The parent drives the child over pipes, one JSON line per command: `Push` (apply an update),
//! `Stats` (answered with one JSON line of [`UpstreamFigures`]). The child's first stdout line is
//! `listening <addr>`; it exits when its stdin closes, so it never outlives loadgen.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use adsrelay::demo::ControlPlane;

use crate::floor::FloorServer;
use crate::measure::UpstreamFigures;
use crate::plain::PlainControlPlane;
use crate::workload::{build_resources, Changed, Versions, Workload};

/// go-control-plane's baseline binary: `gcp-baseline` next to loadgen's target directory
/// (scripts/setup-go-interop.sh builds it into target/interop), else that path from the working
/// directory.
pub fn default_gcp_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.parent()?.join("interop/gcp-baseline")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("target/interop/gcp-baseline"))
}

/// A baseline server loadgen can run as a child process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// The minimal control plane a user would write (src/plain.rs).
    Plain,
    /// Pre-framed shared bytes through tonic, no xDS logic (src/floor.rs).
    Floor,
    /// The project's demo control plane (`adsrelay::demo::ControlPlane`).
    Demo,
    /// go-control-plane v0.14 (`server/v3` + one `SnapshotCache` snapshot for the fleet), the
    /// control plane most users run: bench/gcp-baseline, a Go program speaking this module's
    /// protocol.
    Gcp,
}

impl Baseline {
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Plain => "plain",
            Baseline::Floor => "floor",
            Baseline::Demo => "demo",
            Baseline::Gcp => "gcp",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
enum Cmd {
    Push { generation: u32, changed: Changed },
    Stats,
}

pub struct ServerProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    pub addr: SocketAddr,
    pub pid: u32,
}

impl ServerProcess {
    /// Starts `loadgen --serve <which>` (for `gcp`: `gcp_bin`) serving `workload`; waits for
    /// its address. `pin`: on the server's CPU (else it shares loadgen's).
    pub async fn start(
        which: Baseline,
        workload: &Workload,
        pin: bool,
        gcp_bin: &Path,
        timeout: Duration,
    ) -> Result<Self, String> {
        let spec = serde_json::to_string(workload).map_err(|e| e.to_string())?;
        let mut cmd = if which == Baseline::Gcp {
            let mut c = Command::new(gcp_bin);
            c.arg("--workload").arg(spec);
            c
        } else {
            let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
            let mut c = Command::new(exe);
            c.arg("--serve")
                .arg(which.name())
                .arg("--serve-workload")
                .arg(spec);
            c
        };
        if pin {
            // SAFETY: between fork and exec only sched_setaffinity runs (async-signal-safe).
            unsafe {
                cmd.pre_exec(|| crate::procfs::pin_current_thread(crate::procfs::SERVER_CPU));
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| match which {
                Baseline::Gcp => format!(
                    "start go-control-plane ({}): {e}; build it with scripts/setup-go-interop.sh",
                    gcp_bin.display()
                ),
                _ => format!("start {} server: {e}", which.name()),
            })?;
        let pid = child.id().ok_or("server exited at once")?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("server pipes missing".into());
        };
        let mut stdout = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(timeout, stdout.next_line())
            .await
            .map_err(|_| format!("{} server not listening within {timeout:?}", which.name()))?
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{} server exited before listening", which.name()))?;
        let addr = line
            .strip_prefix("listening ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("{} server said {line:?}", which.name()))?;
        Ok(ServerProcess {
            child,
            stdin,
            stdout,
            addr,
            pid,
        })
    }

    async fn send(&mut self, cmd: &Cmd) -> Result<(), String> {
        let mut line = serde_json::to_vec(cmd).map_err(|e| e.to_string())?;
        line.push(b'\n');
        self.stdin
            .write_all(&line)
            .await
            .map_err(|e| format!("server stdin: {e}"))
    }

    pub async fn push(&mut self, changed: &Changed, generation: u32) -> Result<(), String> {
        self.send(&Cmd::Push {
            generation,
            changed: changed.clone(),
        })
        .await
    }

    pub async fn stats(&mut self) -> Result<UpstreamFigures, String> {
        self.send(&Cmd::Stats).await?;
        let line = self
            .stdout
            .next_line()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("server exited")?;
        serde_json::from_str(&line).map_err(|e| format!("server stats {line:?}: {e}"))
    }

    /// Closes its stdin (it exits) and reaps it; kills it if it lingers.
    pub async fn stop(mut self) {
        drop(self.stdin);
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// One of the three servers, as the child holds it.
enum Served {
    Plain(Arc<PlainControlPlane>),
    Floor(Arc<FloorServer>),
    Demo(Arc<ControlPlane>, Workload, Versions),
}

/// The child side: serves `which` on a free loopback port and follows the parent's commands.
pub async fn serve(which: Baseline, workload: Workload) -> ExitCode {
    // The relay's accept queue (the kernel's longest, as a Go control plane gets by default), so a
    // join compares serving, not SYNs dropped by tokio's default queue of 1,024 and retried a
    // second later.
    let listener = match adsrelay::accept::bind_xds(([127, 0, 0, 1], 0).into()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("loadgen --serve: bind: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(addr) = listener.local_addr() else {
        return ExitCode::FAILURE;
    };
    let w = Arc::new(workload.clone());
    let mut served = match which {
        Baseline::Plain => {
            let cp = PlainControlPlane::new(w);
            tokio::spawn(report_failure(cp.clone().serve(listener)));
            Served::Plain(cp)
        }
        Baseline::Floor => {
            let f = FloorServer::new(w);
            tokio::spawn(report_failure(f.clone().serve(listener)));
            Served::Floor(f)
        }
        Baseline::Demo => {
            let versions = Versions::new(&workload);
            let cp = ControlPlane::new(build_resources(&workload, &versions));
            let serving = cp.clone();
            tokio::spawn(report_failure(async move {
                serving
                    .serve(listener, std::future::pending())
                    .await
                    .map_err(|e| format!("demo control plane: {e}"))
            }));
            Served::Demo(cp, workload, versions)
        }
        Baseline::Gcp => {
            eprintln!("loadgen --serve gcp: go-control-plane is bench/gcp-baseline, not loadgen");
            return ExitCode::FAILURE;
        }
    };
    // Plain std I/O on a thread: tokio's "io-std" feature is not enabled in this workspace.
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
    };
    if !say(format!("listening {addr}")) {
        return ExitCode::FAILURE;
    }
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = lines.recv().await {
        let cmd: Cmd = match serde_json::from_str(&line) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("loadgen --serve: bad command {line:?}: {e}");
                return ExitCode::FAILURE;
            }
        };
        match (cmd, &mut served) {
            (
                Cmd::Push {
                    generation,
                    changed,
                },
                Served::Plain(cp),
            ) => cp.push(&changed, generation),
            (
                Cmd::Push {
                    generation,
                    changed,
                },
                Served::Floor(f),
            ) => f.push(&changed, generation),
            (
                Cmd::Push {
                    generation,
                    changed,
                },
                Served::Demo(cp, w, versions),
            ) => {
                versions.apply(&changed, generation);
                cp.set_resources(build_resources(w, versions));
            }
            (Cmd::Stats, s) => {
                let stats = match s {
                    Served::Plain(cp) => cp.stats(),
                    Served::Floor(f) => f.stats(),
                    Served::Demo(cp, ..) => {
                        let s = cp.stats();
                        UpstreamFigures {
                            streams_opened: s.streams_opened,
                            active_streams: s.active_streams,
                            requests: s.requests,
                        }
                    }
                };
                if !say(serde_json::to_string(&stats).unwrap_or_default()) {
                    break;
                }
            }
        }
    }
    // stdin closed: loadgen is done with this phase (or gone).
    ExitCode::SUCCESS
}

async fn report_failure(serving: impl std::future::Future<Output = Result<(), String>>) {
    if let Err(e) = serving.await {
        eprintln!("loadgen --serve: {e}");
        std::process::exit(1);
    }
}
