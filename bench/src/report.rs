//! The result of a run: per-target figures, relay/plain, relay/floor (and relay/demo) ratios, the
//! JSON file and the console summary with the side-by-side table.

use std::fmt::Write as _;

use serde::Serialize;

use crate::cli::Args;
use crate::measure::{Dist, UpdateResult, UpstreamFigures};
use crate::procfs::ProcSample;
use crate::workload::Workload;

/// RSS and CPU of the server when `clients` had been started and `synced` of them held everything.
#[derive(Debug, Clone, Serialize)]
pub struct Milestone {
    pub clients: u32,
    pub synced: usize,
    pub elapsed_s: f64,
    pub rss_kb: u64,
    pub cpu_s: f64,
}

/// The process clients talk to (the relay, or a baseline's child process), from /proc.
#[derive(Debug, Clone, Serialize)]
pub struct ServerFigures {
    pub pid: u32,
    pub log: Option<String>,
    /// Server started and ready, no clients.
    pub baseline: ProcSample,
    /// Every client connected and synced.
    pub connected: ProcSample,
    /// After the updates (and --hold-secs).
    pub after_updates: ProcSample,
    /// (connected RSS - baseline RSS) / clients.
    pub rss_per_client_kb: f64,
    pub cpu_connect_s: f64,
    /// cpu_connect_s / clients.
    pub cpu_per_joining_client_us: f64,
    pub cpu_updates_s: f64,
    /// Server CPU during the updates divided by the deliveries (client-updates).
    pub cpu_per_delivery_us: f64,
    pub milestones: Vec<Milestone>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PhaseReport {
    /// relay, plain, floor or demo.
    pub target: String,
    pub clients: u32,
    pub connections: u32,
    pub connected: u64,
    pub synced: usize,
    pub connect_wall_s: f64,
    /// Per client: from its task start to holding its whole initial set.
    pub time_to_sync: Dist,
    pub updates: Vec<UpdateResult>,
    /// Every (client, update): from set_resources to the client holding the new version.
    pub latency: Dist,
    /// Per update: until the last expected client held it.
    pub update_fanout: Dist,
    pub deliveries: u64,
    pub deliveries_per_sec: f64,
    pub missed_deliveries: u64,
    pub responses: u64,
    /// Requests the clients sent (openings and ACKs).
    pub requests: u64,
    /// Responses and requests when every client had synced (the join's cost).
    pub join_responses: u64,
    pub join_requests: u64,
    /// Connections dropped machine-wide during the join because an accept queue was full (their
    /// clients retry a second or more later); `None` off Linux.
    pub join_syn_drops: Option<u64>,
    pub resources_received: u64,
    pub errors: u64,
    pub last_error: Option<String>,
    pub reconnects: u64,
    pub churn_events: u64,
    /// Relay: its upstream control plane's totals; baselines: their own.
    pub upstream: Option<UpstreamFigures>,
    /// `--storm`: the reconnect storm after the updates.
    pub storm: Option<StormFigures>,
    /// `--hold-secs` without churn.
    pub idle: Option<IdleFigures>,
    /// `--soak-cycles`.
    pub soak: Option<SoakFigures>,
    /// `--stuck-clients` that were open (subscribed, never reading) during the updates.
    pub stuck_clients: u32,
    /// The server's /proc figures (None when attached to a relay without --relay-pid).
    pub server: Option<ServerFigures>,
    /// CPU of the loadgen process itself during this phase (clients, and the relay's upstream).
    pub loadgen_cpu_s: f64,
    /// (latency ms, fraction) of the per-client latency distribution.
    pub cdf: Vec<(f64, f64)>,
}

/// The reconnect storm (`--storm`): every synced client reopened its stream at once.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StormFigures {
    /// `--storm-cold`: the clients had forgotten what they held and were sent everything again.
    pub cold: bool,
    /// Clients told to reconnect (those synced before the storm).
    pub clients: usize,
    /// Of those, synced again on their new stream within --timeout-secs.
    pub resynced: usize,
    pub timed_out: bool,
    /// From the storm start until the last client was synced again.
    pub wall_ms: f64,
    /// Per client: from the storm start to synced again.
    pub time_to_resync: Dist,
    /// What the control plane saw from the storm start until 2 s after the resync.
    pub upstream_requests: u64,
    pub upstream_streams_opened: u64,
    /// Control plane totals when the storm began (streams opened, open, requests so far).
    pub upstream_before: UpstreamFigures,
    /// Opened / requested between the storm start and the last client's resync; open at its end.
    pub upstream_during: UpstreamFigures,
    /// Opened / requested in the 2 s after the resync; open at its end.
    pub upstream_after: UpstreamFigures,
    /// The server's CPU per reconnecting client, from the storm start until 2 s after the
    /// resync (the answers and ACKs that follow the reopened streams included); None without a
    /// server pid.
    pub server_cpu_per_client_us: Option<f64>,
    /// loadgen's own CPU per reconnecting client over the same window: the clients' side of the
    /// storm, which shares the machine's cores with the server.
    pub loadgen_cpu_per_client_us: f64,
}

/// `--hold-secs` with no churn: the relay holding every client with nothing changing.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IdleFigures {
    pub secs: f64,
    pub relay_cpu_s: f64,
    /// Relay CPU time / wall time, percent of one core.
    pub relay_cpu_percent: f64,
}

/// `--soak-cycles`: short-lived clients connecting, subscribing, syncing and disconnecting.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SoakFigures {
    pub cycles: u64,
    pub failed_cycles: u64,
    pub last_error: Option<String>,
    pub wall_s: f64,
    pub cycles_per_sec: f64,
    /// Warm-up cycles run before the baseline was taken (allocator and caches warm).
    pub warmup_cycles: u64,
    pub rss_before_kb: u64,
    pub rss_after_kb: u64,
    /// (after - before) / before, percent.
    pub rss_change_percent: f64,
    /// `adsrelay_runtime_alive_tasks` before and after (None if the relay's admin port is unknown).
    pub tasks_before: Option<u64>,
    pub tasks_after: Option<u64>,
    /// Open downstream streams after the soak, once the relay noticed every disconnect.
    pub streams_after: Option<u64>,
}

/// Relay figure divided by another target's (below 1: the relay is faster or lighter; 0: a figure
/// is missing).
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub update_fanout_p99: f64,
    pub deliveries_per_sec: f64,
    pub rss_per_client: f64,
    pub cpu_per_client_update: f64,
    pub join_wall: f64,
    pub cpu_per_joining_client: f64,
    pub join_responses_per_client: f64,
    pub storm_wall: f64,
    pub storm_cpu_per_client: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Ratios {
    pub relay_over_plain: Option<Ratio>,
    pub relay_over_floor: Option<Ratio>,
    pub relay_over_demo: Option<Ratio>,
    /// The relay against go-control-plane serving the same clients directly.
    pub relay_over_gcp: Option<Ratio>,
    /// The relay over a SotW upstream against the same relay over Delta, same upstream.
    pub sotw_upstream_over_delta_upstream: Option<Ratio>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub name: String,
    pub unix_time: u64,
    pub open_file_limit: u64,
    pub args: Args,
    pub workload: Workload,
    pub phases: Vec<PhaseReport>,
    pub ratios: Ratios,
}

fn div(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn ratio(relay: &PhaseReport, other: &PhaseReport) -> Ratio {
    let f = |get: fn(&PhaseReport) -> Option<f64>| match (get(relay), get(other)) {
        (Some(a), Some(b)) => div(a, b),
        _ => 0.0,
    };
    Ratio {
        p50: div(relay.latency.p50_ms, other.latency.p50_ms),
        p99: div(relay.latency.p99_ms, other.latency.p99_ms),
        max: div(relay.latency.max_ms, other.latency.max_ms),
        update_fanout_p99: div(relay.update_fanout.p99_ms, other.update_fanout.p99_ms),
        deliveries_per_sec: div(relay.deliveries_per_sec, other.deliveries_per_sec),
        rss_per_client: f(|p| p.server.as_ref().map(|s| s.rss_per_client_kb)),
        cpu_per_client_update: f(|p| p.server.as_ref().map(|s| s.cpu_per_delivery_us)),
        join_wall: div(relay.connect_wall_s, other.connect_wall_s),
        cpu_per_joining_client: f(|p| p.server.as_ref().map(|s| s.cpu_per_joining_client_us)),
        join_responses_per_client: div(relay.join_responses as f64, other.join_responses as f64),
        storm_wall: f(|p| p.storm.as_ref().map(|s| s.wall_ms)),
        storm_cpu_per_client: f(|p| p.storm.as_ref().and_then(|s| s.server_cpu_per_client_us)),
    }
}

pub fn ratios(phases: &[PhaseReport]) -> Ratios {
    let find = |t: &str| phases.iter().find(|p| p.target == t);
    let Some(relay) = find("relay") else {
        return Ratios::default();
    };
    Ratios {
        relay_over_plain: find("plain").map(|d| ratio(relay, d)),
        relay_over_floor: find("floor").map(|f| ratio(relay, f)),
        relay_over_demo: find("demo").map(|d| ratio(relay, d)),
        relay_over_gcp: find("gcp").map(|g| ratio(relay, g)),
        sotw_upstream_over_delta_upstream: find("relay-sotwup").map(|r| ratio(r, relay)),
    }
}

/// One row of the side-by-side table: a figure per target, formatted; None where not measured;
/// and whether relay/other ratios of it mean anything (not for counts such as dropped SYNs).
type Row = (&'static str, fn(&PhaseReport) -> Option<f64>, usize, bool);

const SIDE_BY_SIDE: [Row; 11] = [
    (
        "RSS per client after join, KiB",
        |p| p.server.as_ref().map(|s| s.rss_per_client_kb),
        1,
        true,
    ),
    (
        "update p99 to all subscribers, ms",
        |p| (p.latency.count > 0).then_some(p.latency.p99_ms),
        1,
        true,
    ),
    (
        "server CPU per client-update, us",
        |p| p.server.as_ref().map(|s| s.cpu_per_delivery_us),
        1,
        true,
    ),
    (
        "cold join, time to last client, s",
        |p| Some(p.connect_wall_s),
        2,
        true,
    ),
    (
        "server CPU per joining client, us",
        |p| p.server.as_ref().map(|s| s.cpu_per_joining_client_us),
        0,
        true,
    ),
    (
        "SYNs dropped in the join (queue full)",
        |p| p.join_syn_drops.map(|d| d as f64),
        0,
        false,
    ),
    (
        "responses per joining client",
        |p| Some(p.join_responses as f64 / f64::from(p.clients.max(1))),
        1,
        true,
    ),
    (
        "requests per joining client",
        |p| Some(p.join_requests as f64 / f64::from(p.clients.max(1))),
        1,
        true,
    ),
    (
        "reconnect storm, all resynced, ms",
        |p| p.storm.as_ref().map(|s| s.wall_ms),
        0,
        true,
    ),
    (
        "server CPU per reconnecting client, us",
        |p| p.storm.as_ref().and_then(|s| s.server_cpu_per_client_us),
        0,
        true,
    ),
    (
        "loadgen CPU per reconnecting client, us",
        |p| p.storm.as_ref().map(|s| s.loadgen_cpu_per_client_us),
        0,
        true,
    ),
];

/// The figures of every target side by side, with relay/plain and relay/floor ratios.
pub fn side_by_side(r: &RunReport) -> String {
    let mut s = String::new();
    let others: Vec<&PhaseReport> = r.phases.iter().filter(|p| p.target != "relay").collect();
    let relay = r.phases.iter().find(|p| p.target == "relay");
    let _ = write!(s, "{:<38}", "figure");
    for p in &r.phases {
        let _ = write!(s, " {:>9}", p.target);
    }
    if relay.is_some() {
        for o in others.iter().filter(|o| o.target != "demo") {
            let _ = write!(s, " {:>12}", format!("relay/{}", o.target));
        }
    }
    s.push('\n');
    for (label, get, digits, ratio) in SIDE_BY_SIDE {
        let _ = write!(s, "{label:<38}");
        for p in &r.phases {
            match get(p) {
                Some(v) => {
                    let _ = write!(s, " {v:>9.digits$}");
                }
                None => {
                    let _ = write!(s, " {:>9}", "-");
                }
            }
        }
        if let Some(relay) = relay {
            for o in others.iter().filter(|o| o.target != "demo") {
                match (get(relay), get(o)) {
                    (Some(a), Some(b)) if ratio && b > 0.0 => {
                        let _ = write!(s, " {:>12}", format!("x{:.2}", a / b));
                    }
                    _ => {
                        let _ = write!(s, " {:>12}", "-");
                    }
                }
            }
        }
        s.push('\n');
    }
    s
}

/// The human summary printed at the end of a run.
pub fn summary(r: &RunReport) -> String {
    let mut s = String::new();
    let w = &r.workload;
    let _ = writeln!(
        s,
        "\n== {}: {} clients on {} connections, {} clusters + {} listeners (wildcard), {} of {} EDS each, {} B bodies, {} updates ({:?})",
        r.name,
        r.args.clients,
        r.args.connections(),
        w.clusters,
        w.listeners,
        w.eds_per_client,
        w.eds_pool,
        w.resource_bytes,
        r.args.updates,
        r.args.update_pattern
    );
    let _ = writeln!(
        s,
        "{:<7} {:>7} {:>9} {:>8} {:>8} {:>8} {:>11} {:>11} {:>10} {:>7} {:>7}",
        "target",
        "synced",
        "sync p99",
        "p50 ms",
        "p99 ms",
        "max ms",
        "fanout p50",
        "fanout max",
        "deliv/s",
        "missed",
        "errors"
    );
    for p in &r.phases {
        let _ = writeln!(
            s,
            "{:<7} {:>7} {:>9.1} {:>8.2} {:>8.2} {:>8.2} {:>11.2} {:>11.2} {:>10.0} {:>7} {:>7}",
            p.target,
            p.synced,
            p.time_to_sync.p99_ms,
            p.latency.p50_ms,
            p.latency.p99_ms,
            p.latency.max_ms,
            p.update_fanout.p50_ms,
            p.update_fanout.max_ms,
            p.deliveries_per_sec,
            p.missed_deliveries,
            p.errors
        );
    }
    for p in &r.phases {
        if let Some(u) = &p.upstream {
            let _ = writeln!(
                s,
                "{:<7} {}: {} streams opened, {} requests; loadgen CPU {:.2} s",
                p.target,
                if p.target.starts_with("relay") {
                    "upstream"
                } else {
                    "server saw"
                },
                u.streams_opened,
                u.requests,
                p.loadgen_cpu_s
            );
        } else {
            let _ = writeln!(s, "{:<7} loadgen CPU {:.2} s", p.target, p.loadgen_cpu_s);
        }
        if p.churn_events > 0 || p.reconnects > 0 {
            let _ = writeln!(
                s,
                "{:<7} churn: {} events, {} stream reopens",
                p.target, p.churn_events, p.reconnects
            );
        }
        if let Some(st) = &p.storm {
            let _ = writeln!(
                s,
                "{:<7} {}storm: {}/{} synced again in {:.1} ms (p50 {:.1} p99 {:.1}){}; upstream {} requests, {} streams opened",
                p.target,
                if st.cold { "cold " } else { "" },
                st.resynced,
                st.clients,
                st.wall_ms,
                st.time_to_resync.p50_ms,
                st.time_to_resync.p99_ms,
                if st.timed_out { " TIMED OUT" } else { "" },
                st.upstream_requests,
                st.upstream_streams_opened
            );
            for (when, u) in [
                ("before", &st.upstream_before),
                ("during", &st.upstream_during),
                ("after", &st.upstream_after),
            ] {
                let _ = writeln!(
                    s,
                    "{:<7} storm upstream {when:<6}: {} streams open, {} opened, {} requests",
                    p.target, u.active_streams, u.streams_opened, u.requests
                );
            }
        }
        if p.stuck_clients > 0 {
            let _ = writeln!(
                s,
                "{:<7} {} stuck clients (subscribed, never reading) open during the updates",
                p.target, p.stuck_clients
            );
        }
        if let Some(i) = &p.idle {
            let _ = writeln!(
                s,
                "{:<7} idle: server CPU {:.3} s over {:.0} s ({:.2}% of a core)",
                p.target, i.relay_cpu_s, i.secs, i.relay_cpu_percent
            );
        }
        if let Some(k) = &p.soak {
            let opt = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
            let _ = writeln!(
                s,
                "{:<7} soak: {} cycles ({} failed) in {:.1} s ({:.0}/s); RSS {:.1} -> {:.1} MiB ({:+.1}%); tasks {} -> {}; streams after {}",
                p.target,
                k.cycles,
                k.failed_cycles,
                k.wall_s,
                k.cycles_per_sec,
                k.rss_before_kb as f64 / 1024.0,
                k.rss_after_kb as f64 / 1024.0,
                k.rss_change_percent,
                opt(k.tasks_before),
                opt(k.tasks_after),
                opt(k.streams_after)
            );
        }
        if let Some(e) = &p.last_error {
            let _ = writeln!(s, "{:<7} last error: {e}", p.target);
        }
    }
    for p in &r.phases {
        if let Some(rf) = &p.server {
            let mb = |kb: u64| kb as f64 / 1024.0;
            let _ = writeln!(
                s,
                "{:<7} RSS: baseline {:.1} MiB, connected {:.1} MiB, after updates {:.1} MiB; {:.1} KiB per client",
                p.target,
                mb(rf.baseline.rss_kb),
                mb(rf.connected.rss_kb),
                mb(rf.after_updates.rss_kb),
                rf.rss_per_client_kb
            );
            let _ = writeln!(
                s,
                "{:<7} CPU: {:.2} s connecting, {:.2} s during updates ({:.1} us per delivery)",
                p.target, rf.cpu_connect_s, rf.cpu_updates_s, rf.cpu_per_delivery_us
            );
        }
    }
    for (label, ra) in [
        ("relay/plain", &r.ratios.relay_over_plain),
        ("relay/floor", &r.ratios.relay_over_floor),
        ("relay/demo", &r.ratios.relay_over_demo),
        ("relay/gcp", &r.ratios.relay_over_gcp),
        (
            "relay-sotwup/relay",
            &r.ratios.sotw_upstream_over_delta_upstream,
        ),
    ] {
        if let Some(x) = ra {
            let _ = writeln!(
                s,
                "{label:<13} latency p50 x{:.2}, p99 x{:.2}, max x{:.2}; fan-out p99 x{:.2}; deliveries/s x{:.2}",
                x.p50, x.p99, x.max, x.update_fanout_p99, x.deliveries_per_sec
            );
        }
    }
    if r.phases.len() > 1 {
        let _ = writeln!(s, "\nside by side (server = the process clients talk to):");
        s.push_str(&side_by_side(r));
    }
    s
}
