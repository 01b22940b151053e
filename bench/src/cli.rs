//! Command-line flags of `loadgen` (documented in bench/README.md).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use serde::Serialize;

use crate::client::Protocol;
use crate::workload::UpdatePattern;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChurnKind {
    /// Unsubscribe one EDS name, subscribe another (same stream).
    Swap,
    /// Close the stream and reopen it with `initial_resource_versions`.
    Reconnect,
}

/// The control plane behind the relay under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RelayUpstream {
    /// The project's demo control plane, in loadgen's process.
    Demo,
    /// go-control-plane (bench/gcp-baseline) in a child process.
    Gcp,
}

/// Load generator for adsrelay: N simulated xDS clients against the relay (and, with --compare,
/// against a plain tonic control plane and against the pre-framed floor, side by side).
#[derive(Debug, Clone, Parser, Serialize)]
#[command(name = "loadgen", version)]
pub struct Args {
    /// Simulated clients.
    #[arg(long, default_value_t = 200)]
    pub clients: u32,
    /// Client streams sharing one connection (1 = one connection per client, like Envoy).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub streams_per_connection: u32,
    /// xDS variant the clients speak.
    #[arg(long, value_enum, default_value_t = Protocol::Delta)]
    pub protocol: Protocol,
    /// Number of Cluster resources (every client subscribes by wildcard).
    #[arg(long, default_value_t = 100)]
    pub resources: u32,
    /// Number of Listener resources (wildcard).
    #[arg(long, default_value_t = 10)]
    pub listeners: u32,
    /// Size of each resource's opaque body, bytes.
    #[arg(long, default_value_t = 512)]
    pub resource_bytes: usize,
    /// ClusterLoadAssignment names in the pool clients draw from.
    #[arg(long, default_value_t = 1000)]
    pub eds_pool: u32,
    /// ClusterLoadAssignments each client subscribes to by name.
    #[arg(long, default_value_t = 10)]
    pub eds_per_client: u32,
    /// node.cluster of every client (the relay's group); with --groups N > 1, client i uses
    /// `<group>-<i mod N>`.
    #[arg(long, default_value = "loadgen")]
    pub group: String,
    /// Aggregation groups the clients are spread over (round robin by client index).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub groups: u32,
    /// Updates to push after all clients synced.
    #[arg(long, default_value_t = 10)]
    pub updates: u32,
    /// Updates pushed and waited for before the measured ones, not counted in any figure: in
    /// them this process's own heap grows to hold a whole update in flight, and the page faults
    /// of that growth (up to 2 s per update for 9,000 SotW clients of 100 KiB, over the first
    /// 8 or so updates) would otherwise land in one target's measured updates and not another's.
    #[arg(long, default_value_t = 8)]
    pub warmup_updates: u32,
    /// Minimum time between the starts of two updates (each update is waited for first).
    #[arg(long, default_value_t = 200)]
    pub update_interval_ms: u64,
    /// Which resources an update changes.
    #[arg(long, value_enum, default_value_t = UpdatePattern::One)]
    pub update_pattern: UpdatePattern,
    /// Churn events per second (all clients together) during updates and --hold-secs.
    #[arg(long, default_value_t = 0.0)]
    pub churn_per_sec: f64,
    /// What a churn event does.
    #[arg(long, value_enum, default_value_t = ChurnKind::Swap)]
    pub churn_kind: ChurnKind,
    /// Keep the clients connected this long after the updates (steady state, churn).
    #[arg(long, default_value_t = 0)]
    pub hold_secs: u64,
    /// After the updates (and --hold-secs): every client drops its stream and reconnects at once
    /// (Delta: with initial_resource_versions); reports the time until all are synced again and
    /// the requests the control plane saw meanwhile (relay: its upstream; baselines: themselves;
    /// not the Delta floor, which ignores initial versions).
    #[arg(long)]
    pub storm: bool,
    /// With --storm: the clients first forget what they hold (a fleet of restarted Envoys), so
    /// they report no versions and every server sends everything again; the floor takes part.
    #[arg(long)]
    pub storm_cold: bool,
    /// Extra clients (every target but the floor) that subscribe like the others after they
    /// synced, then never read a response, for the whole phase; the report shows whether the
    /// normal clients' update latency and the server's RSS notice.
    #[arg(long, default_value_t = 0)]
    pub stuck_clients: u32,
    /// Soak (relay target): after everything else, this many extra short-lived clients each
    /// connect, subscribe, sync and disconnect; reports the relay's RSS and live tasks before and
    /// after (0 = no soak).
    #[arg(long, default_value_t = 0)]
    pub soak_cycles: u64,
    /// Soak cycles running at once.
    #[arg(long, default_value_t = 64)]
    pub soak_concurrency: usize,
    /// Also run the same clients against `plain` (a minimal tonic control plane, the baseline a
    /// user would pick instead of the relay) and `floor` (pre-framed bytes, same HTTP/2 stack).
    #[arg(long)]
    pub compare: bool,
    /// With --compare, leave `plain` out (where it cannot fit beside loadgen's clients: at
    /// 100,000 streams plain holds ~11 GiB and loadgen ~15 GiB on a 24 GiB machine).
    #[arg(long)]
    pub no_plain: bool,
    /// With --compare, also run `demo`: the project's demo control plane (the relay's state
    /// machines over a complete store).
    #[arg(long)]
    pub with_demo: bool,
    /// Also run the same clients directly against go-control-plane (bench/gcp-baseline, one
    /// snapshot for the fleet), the control plane most users would otherwise serve them from.
    #[arg(long)]
    pub with_gcp: bool,
    /// The relay's upstream: the project's demo control plane in this process, or go-control-plane
    /// in a child process (on loadgen's CPU when pinned).
    #[arg(long, value_enum, default_value_t = RelayUpstream::Demo)]
    pub relay_upstream: RelayUpstream,
    /// Also run the relay with `--upstream-protocol sotw` (target `relay-sotwup`), beside the
    /// relay over Delta, against the same upstream.
    #[arg(long)]
    pub also_sotw_upstream: bool,
    /// go-control-plane's baseline binary (default: target/interop/gcp-baseline, built by
    /// scripts/setup-go-interop.sh).
    #[arg(long)]
    pub gcp_bin: Option<PathBuf>,
    /// Internal: serve this baseline in a child process (loadgen starts these itself).
    #[arg(long, hide = true, value_enum)]
    pub serve: Option<crate::server_proc::Baseline>,
    /// Internal: the workload the --serve child serves, as JSON.
    #[arg(long, hide = true)]
    pub serve_workload: Option<String>,
    /// The adsrelay binary to start (default: `adsrelay` next to loadgen, else target/release/adsrelay).
    #[arg(long)]
    pub relay_bin: Option<PathBuf>,
    /// Attach to a running relay at this xDS address instead of starting one (it must use
    /// --upstream-listen as its upstream for updates to reach it).
    #[arg(long)]
    pub relay_addr: Option<SocketAddr>,
    /// Pid of the attached relay, for CPU/RSS sampling from /proc.
    #[arg(long)]
    pub relay_pid: Option<u32>,
    /// --unsubscribe-linger passed to the started relay.
    #[arg(long, default_value = "30s")]
    pub unsubscribe_linger: String,
    /// Pin the server under test (the relay, or a baseline's process) to CPU 0 and loadgen (its
    /// clients, and the relay's in-process control plane) to CPU 1, so ratios do not depend on
    /// who wins the shared cores. Needs two CPUs.
    #[arg(long)]
    pub pin: bool,
    /// Where the in-process control plane listens during the relay phase.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub upstream_listen: SocketAddr,
    /// Log file of the started relay (default: <temp dir>/loadgen-relay-<pid>.log).
    #[arg(long)]
    pub relay_log: Option<PathBuf>,
    /// Connections being opened at once.
    #[arg(long, default_value_t = 256)]
    pub connect_concurrency: usize,
    /// RSS samples taken while clients connect (the RSS-versus-clients curve).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub milestones: u32,
    /// Bound on every wait: relay start, each connect milestone, each update.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
    /// Hard limit on the whole run; past it loadgen kills the relay it started and exits 2.
    #[arg(long, default_value_t = 1800)]
    pub max_run_secs: u64,
    /// JSON result file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// SVG image: latency CDF per target and relay RSS versus clients.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Run name in the result (default: the --out file stem, else "loadgen").
    #[arg(long)]
    pub name: Option<String>,
    /// Seed for EDS choice, random updates and churn.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Permit non-loopback addresses for --relay-addr / --upstream-listen.
    #[arg(long)]
    pub allow_non_loopback: bool,
}

impl Args {
    pub fn connections(&self) -> u32 {
        self.clients.div_ceil(self.streams_per_connection)
    }

    /// Checks flag combinations; returns an operator-facing message.
    pub fn validate(&self) -> Result<(), String> {
        if self.clients == 0 {
            return Err("--clients must be at least 1".into());
        }
        if self.eds_per_client > self.eds_pool {
            return Err("--eds-per-client cannot exceed --eds-pool".into());
        }
        if self.resources == 0 {
            return Err(
                "--resources must be at least 1 (update pattern `one` changes cluster-0)".into(),
            );
        }
        if !self.allow_non_loopback {
            for (flag, addr) in [
                ("--relay-addr", self.relay_addr),
                ("--upstream-listen", Some(self.upstream_listen)),
            ] {
                if let Some(a) = addr {
                    if !a.ip().is_loopback() {
                        return Err(format!(
                            "{flag} {a} is not a loopback address; pass --allow-non-loopback if you really mean it"
                        ));
                    }
                }
            }
        }
        if self.with_demo && !self.compare {
            return Err("--with-demo needs --compare".into());
        }
        if self.relay_addr.is_some()
            && (self.relay_upstream != RelayUpstream::Demo || self.also_sotw_upstream)
        {
            return Err(
                "--relay-addr (attach) uses --upstream-listen's demo control plane; --relay-upstream and --also-sotw-upstream need a started relay".into(),
            );
        }
        if self.relay_addr.is_some() && self.relay_bin.is_some() {
            return Err("--relay-addr (attach) and --relay-bin (start) exclude each other".into());
        }
        Ok(())
    }
}
