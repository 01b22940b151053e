//! One phase of a run: a target (the relay, or a baseline: the plain control plane, the floor, the
//! demo control plane), its upstream, N clients connected in milestones, the updates, and the
//! figures.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tonic::transport::Endpoint;

use adsrelay::demo::ControlPlane;

use crate::cli::RelayUpstream;
use crate::cli::{Args, ChurnKind};
use crate::client::{self, Ctrl, Protocol};
use crate::measure::{self, cdf, new_histogram, Dist, RunCtx, UpdateResult, UpstreamFigures};
use crate::procfs::{self, ProcSample};
use crate::progress::Progress;
use crate::relay_proc::RelayProcess;
use crate::report::{
    IdleFigures, Milestone, PhaseReport, ServerFigures, SoakFigures, StormFigures,
};
use crate::server_proc::{Baseline, ServerProcess};
use crate::workload::{build_resources, Versions, Workload};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The relay over `--relay-upstream`, Delta upstream.
    Relay,
    /// The same relay over the same upstream with `--upstream-protocol sotw`.
    RelaySotwUpstream,
    /// A baseline served by a `loadgen --serve` child process.
    Baseline(Baseline),
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Relay => "relay",
            Target::RelaySotwUpstream => "relay-sotwup",
            Target::Baseline(b) => b.name(),
        }
    }
}

/// Error text with its source chain (tonic's transport errors say little at the top level).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

enum Upstream {
    /// The relay's upstream, in this process.
    Cp {
        cp: Arc<ControlPlane>,
        stop: Option<oneshot::Sender<()>>,
    },
    /// A baseline in its child process: it is its own upstream.
    Child(Box<ServerProcess>),
}

impl Upstream {
    /// Totals of the server clients talk to upstream of (relay) or to (baselines).
    async fn stats(&mut self) -> UpstreamFigures {
        match self {
            Upstream::Cp { cp, .. } => upstream_now(cp),
            Upstream::Child(p) => p.stats().await.unwrap_or_default(),
        }
    }
}

async fn start_control_plane(
    workload: &Workload,
    bind: SocketAddr,
    tasks: &mut JoinSet<()>,
) -> Result<(Arc<ControlPlane>, SocketAddr, oneshot::Sender<()>), String> {
    let listener = TcpListener::bind(bind)
        .await
        .map_err(|e| format!("control plane: bind {bind}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let cp = ControlPlane::new(build_resources(workload, &Versions::new(workload)));
    let (tx, rx) = oneshot::channel();
    let serving = cp.clone();
    tasks.spawn(async move {
        let _ = serving
            .serve(listener, async {
                let _ = rx.await;
            })
            .await;
    });
    Ok((cp, addr, tx))
}

async fn grpc_connection(
    addr: SocketAddr,
    ctx: Arc<RunCtx>,
    ids: Vec<u32>,
    ctrls: Vec<mpsc::Receiver<Ctrl>>,
    protocol: Protocol,
    permit: OwnedSemaphorePermit,
) {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .expect("a socket address is a valid URI")
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(8 << 20));
    let mut channel = None;
    for attempt in 1..=5u64 {
        match ep.connect().await {
            Ok(c) => {
                channel = Some(c);
                break;
            }
            Err(e) => {
                ctx.error(format!("connect {addr}: {}", chain(&e)));
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
        }
    }
    drop(permit);
    let Some(channel) = channel else { return };
    let mut set = JoinSet::new();
    for (id, rx) in ids.into_iter().zip(ctrls) {
        set.spawn(client::run_client(
            protocol,
            ctx.clone(),
            id,
            channel.clone(),
            rx,
        ));
    }
    while set.join_next().await.is_some() {}
}

async fn churn(txs: Vec<mpsc::Sender<Ctrl>>, per_sec: f64, kind: ChurnKind, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc4u64);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_sec));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let cmd = match kind {
        ChurnKind::Swap => Ctrl::Swap,
        ChurnKind::Reconnect => Ctrl::Reconnect,
    };
    loop {
        tick.tick().await;
        let i = rng.random_range(0..txs.len());
        let _ = txs[i].try_send(cmd);
    }
}

/// The control plane's totals now.
fn upstream_now(cp: &ControlPlane) -> UpstreamFigures {
    let s = cp.stats();
    UpstreamFigures {
        streams_opened: s.streams_opened,
        active_streams: s.active_streams,
        requests: s.requests,
    }
}

/// What the control plane saw between `from` and `to` (streams open: at `to`).
fn upstream_delta(from: &UpstreamFigures, to: &UpstreamFigures) -> UpstreamFigures {
    UpstreamFigures {
        streams_opened: to.streams_opened - from.streams_opened,
        active_streams: to.active_streams,
        requests: to.requests - from.requests,
    }
}

/// Tells every client to drop its stream and reconnect at once; waits until those that were synced
/// are synced again on their new stream (bounded by `timeout`), then 2 s more for the upstream
/// traffic the storm caused to settle, and reports the control plane's view before, during and
/// after.
async fn storm(
    upstream: &mut Upstream,
    pid: Option<u32>,
    ctx: &RunCtx,
    ctrl_txs: &[mpsc::Sender<Ctrl>],
    timeout: Duration,
    progress: &Progress,
    target: &str,
) -> StormFigures {
    let cold = ctx.cold_storm;
    let clients = ctx.synced.load(Ordering::Acquire);
    let before = upstream.stats().await;
    let cpu_before = sample(pid);
    let own_before = procfs::sample_self();
    let start = Instant::now();
    *crate::sync::lock(&ctx.storm_start) = Some(start);
    for tx in ctrl_txs {
        // Capacity 4 and churn has stopped: this does not block in practice.
        let _ = tx.send(Ctrl::Storm).await;
    }
    let deadline = start + timeout;
    let mut timed_out = false;
    while ctx.resynced.load(Ordering::Acquire) < clients {
        if Instant::now() >= deadline {
            timed_out = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let resynced_at = upstream.stats().await;
    let hist = crate::sync::lock(&ctx.resync_us).clone();
    let wall_ms = if timed_out {
        start.elapsed().as_secs_f64() * 1000.0
    } else {
        hist.max() as f64 / 1000.0
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = upstream.stats().await;
    let per_client = |cpu_s: f64| cpu_s * 1e6 / clients.max(1) as f64;
    let server_cpu_per_client_us = pid.map(|_| per_client(sample(pid).cpu_s - cpu_before.cpu_s));
    let loadgen_cpu_per_client_us = per_client(procfs::sample_self().cpu_s - own_before.cpu_s);
    let f = StormFigures {
        cold,
        clients,
        resynced: ctx.resynced.load(Ordering::Acquire),
        timed_out,
        wall_ms,
        time_to_resync: Dist::from_us(&hist),
        upstream_requests: after.requests - before.requests,
        upstream_streams_opened: after.streams_opened - before.streams_opened,
        upstream_during: upstream_delta(&before, &resynced_at),
        upstream_after: upstream_delta(&resynced_at, &after),
        upstream_before: before,
        server_cpu_per_client_us,
        loadgen_cpu_per_client_us,
    };
    progress.line(format!(
        "{target} {}storm: {}/{} clients synced again in {:.1} ms (p50 {:.1} p99 {:.1}){}; upstream saw {} requests, {} new streams{}; loadgen CPU {:.0} us per client",
        if cold { "cold " } else { "" },
        f.resynced,
        f.clients,
        f.wall_ms,
        f.time_to_resync.p50_ms,
        f.time_to_resync.p99_ms,
        if timed_out { " TIMED OUT" } else { "" },
        f.upstream_requests,
        f.upstream_streams_opened,
        server_cpu_per_client_us.map_or(String::new(), |us| format!(
            "; server CPU {us:.0} us per client"
        )),
        loadgen_cpu_per_client_us,
    ));
    f
}

/// `adsrelay_runtime_alive_tasks` and the open downstream streams from the relay's /metrics.
async fn relay_tasks_and_streams(admin: SocketAddr) -> (Option<u64>, Option<u64>) {
    let Ok(page) = crate::relay_proc::http_get(admin, "/metrics").await else {
        return (None, None);
    };
    let value = |prefix: &str| -> Option<u64> {
        let mut found = None;
        for line in page.lines().filter(|l| l.starts_with(prefix)) {
            let v: f64 = line.rsplit(' ').next()?.parse().ok()?;
            *found.get_or_insert(0) += v as u64;
        }
        found
    };
    (
        value("adsrelay_runtime_alive_tasks "),
        value("adsrelay_downstream_streams{"),
    )
}

/// Runs `cycles` soak cycles, `concurrency` at a time, as client ids 0.. (mod the client count).
async fn soak_cycles(
    addr: SocketAddr,
    ctx: &Arc<RunCtx>,
    cycles: u64,
    concurrency: usize,
    timeout: Duration,
    bar: &mut crate::progress::Bar,
) -> (u64, Option<String>) {
    let clients = ctx.synced_flags.len() as u64;
    let mut set = JoinSet::new();
    let (mut next, mut done, mut failed, mut last_error) = (0u64, 0u64, 0u64, None);
    while done < cycles {
        while next < cycles && set.len() < concurrency.max(1) {
            let ctx = ctx.clone();
            let id = (next % clients.max(1)) as u32;
            set.spawn(async move { client::soak_cycle(addr, &ctx, id, timeout).await });
            next += 1;
        }
        match set.join_next().await {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(e))) => {
                failed += 1;
                last_error = Some(e);
            }
            Some(Err(e)) => {
                failed += 1;
                last_error = Some(format!("soak task: {e}"));
            }
            None => break,
        }
        done += 1;
        if done % 500 == 0 || done == cycles {
            bar.set(done, format!("{failed} failed"));
        }
    }
    (failed, last_error)
}

/// The soak: warm up, take the baseline, run the cycles, wait until the relay has noticed every
/// disconnect, and compare.
async fn soak(
    args: &Args,
    addr: SocketAddr,
    ctx: &Arc<RunCtx>,
    pid: Option<u32>,
    admin: Option<SocketAddr>,
    progress: &Progress,
) -> SoakFigures {
    let timeout = Duration::from_secs(args.timeout_secs);
    let warmup = (args.soak_cycles / 10).clamp(1, 1000);
    let mut bar = progress.bar(warmup, "soak warm-up");
    let _ = soak_cycles(addr, ctx, warmup, args.soak_concurrency, timeout, &mut bar).await;
    bar.finish(format!("{warmup} warm-up cycles"));
    let settle = |admin: Option<SocketAddr>| async move {
        // Streams open now = the phase's long-lived clients; wait until the soak's are gone.
        let want = ctx.connected.load(Ordering::Relaxed) as u64;
        let deadline = Instant::now() + timeout;
        loop {
            let (tasks, streams) = match admin {
                Some(a) => relay_tasks_and_streams(a).await,
                None => (None, None),
            };
            if streams.is_none_or(|s| s <= want) || Instant::now() >= deadline {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let (tasks, streams) = match admin {
                    Some(a) => relay_tasks_and_streams(a).await,
                    None => (tasks, streams),
                };
                return (sample(pid), tasks, streams);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let (before, tasks_before, _) = settle(admin).await;
    let start = Instant::now();
    let mut bar = progress.bar(args.soak_cycles, "soak");
    let (failed, last_error) = soak_cycles(
        addr,
        ctx,
        args.soak_cycles,
        args.soak_concurrency,
        timeout,
        &mut bar,
    )
    .await;
    let wall_s = start.elapsed().as_secs_f64();
    let (after, tasks_after, streams_after) = settle(admin).await;
    let f = SoakFigures {
        cycles: args.soak_cycles,
        failed_cycles: failed,
        last_error,
        wall_s,
        cycles_per_sec: args.soak_cycles as f64 / wall_s.max(1e-9),
        warmup_cycles: warmup,
        rss_before_kb: before.rss_kb,
        rss_after_kb: after.rss_kb,
        rss_change_percent: if before.rss_kb > 0 {
            (after.rss_kb as f64 - before.rss_kb as f64) * 100.0 / before.rss_kb as f64
        } else {
            0.0
        },
        tasks_before,
        tasks_after,
        streams_after,
    };
    bar.finish(format!(
        "{} cycles ({} failed) in {:.1} s; RSS {:+.1}%",
        f.cycles, f.failed_cycles, f.wall_s, f.rss_change_percent
    ));
    f
}

fn sample(pid: Option<u32>) -> ProcSample {
    pid.and_then(procfs::sample).unwrap_or_default()
}

fn rss_msg(pid: Option<u32>) -> String {
    match pid.and_then(procfs::sample) {
        Some(s) => format!("server RSS {:.1} MiB", s.rss_kb as f64 / 1024.0),
        None => String::new(),
    }
}

/// Runs one target end to end and stops everything it started.
pub async fn run(
    target: Target,
    args: &Args,
    workload: Arc<Workload>,
    progress: &Progress,
) -> Result<PhaseReport, String> {
    let timeout = Duration::from_secs(args.timeout_secs);
    let self_start = procfs::sample_self();
    let mut servers = JoinSet::new();
    let mut relay_proc = None;

    // The upstream and the address clients connect to.
    let gcp_bin = args
        .gcp_bin
        .clone()
        .unwrap_or_else(crate::server_proc::default_gcp_bin);
    let (mut upstream, addr, pid) = match target {
        Target::Baseline(b) => {
            let p = ServerProcess::start(b, &workload, args.pin, &gcp_bin, timeout).await?;
            progress.line(format!("{}: pid {} on {}", b.name(), p.pid, p.addr));
            let (addr, pid) = (p.addr, p.pid);
            (Upstream::Child(Box::new(p)), addr, Some(pid))
        }
        Target::Relay | Target::RelaySotwUpstream => {
            let (up, cp_addr) = match args.relay_upstream {
                RelayUpstream::Demo => {
                    let (cp, cp_addr, stop) =
                        start_control_plane(&workload, args.upstream_listen, &mut servers).await?;
                    let up = Upstream::Cp {
                        cp,
                        stop: Some(stop),
                    };
                    (up, cp_addr)
                }
                RelayUpstream::Gcp => {
                    // Not pinned to the server's CPU: it inherits loadgen's, as the in-process
                    // demo control plane runs there.
                    let p =
                        ServerProcess::start(Baseline::Gcp, &workload, false, &gcp_bin, timeout)
                            .await?;
                    let a = p.addr;
                    (Upstream::Child(Box::new(p)), a)
                }
            };
            let protocol = if target == Target::RelaySotwUpstream {
                "sotw"
            } else {
                "delta"
            };
            match args.relay_addr {
                Some(a) => (up, a, args.relay_pid),
                None => {
                    let bin = args
                        .relay_bin
                        .clone()
                        .unwrap_or_else(crate::relay_proc::default_bin);
                    let log = args.relay_log.clone().unwrap_or_else(|| {
                        std::env::temp_dir()
                            .join(format!("loadgen-relay-{}.log", std::process::id()))
                    });
                    let r = RelayProcess::start(
                        &bin,
                        cp_addr,
                        &args.unsubscribe_linger,
                        protocol,
                        args.pin,
                        log,
                        timeout,
                    )
                    .await?;
                    progress.line(format!(
                        "{}: {} pid {} on {} (upstream {cp_addr}, {protocol}), log {}",
                        target.name(),
                        bin.display(),
                        r.pid,
                        r.xds,
                        r.log.display()
                    ));
                    let (a, p) = (r.xds, r.pid);
                    relay_proc = Some(r);
                    (up, a, Some(p))
                }
            }
        }
    };
    if pid.is_some() {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let baseline = sample(pid);

    // Connect in milestones.
    let n = args.clients;
    let k = args.streams_per_connection;
    let conns = args.connections();
    let ctx = RunCtx::new(
        workload.clone(),
        args.group.clone(),
        args.groups,
        n,
        args.storm_cold,
    );
    let sem = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
    let mut ctrl_txs = Vec::with_capacity(n as usize);
    let mut clients = JoinSet::new();
    let mut milestones = Vec::new();
    let overflows_before = procfs::listen_overflows();
    let connect_start = Instant::now();
    let mut bar = progress.bar(u64::from(n), &format!("{} sync", target.name()));
    let mut started = 0;
    let mut sync_ok = true;
    for m in 1..=args.milestones.min(conns) {
        let upto = (u64::from(conns) * u64::from(m) / u64::from(args.milestones.min(conns))) as u32;
        for c in started..upto {
            let ids: Vec<u32> = (c * k..((c + 1) * k).min(n)).collect();
            let ctx = ctx.clone();
            let sem = sem.clone();
            let rxs = ids
                .iter()
                .map(|_| {
                    let (tx, rx) = mpsc::channel(4);
                    ctrl_txs.push(tx);
                    rx
                })
                .collect();
            let protocol = args.protocol;
            clients.spawn(async move {
                let permit = sem.acquire_owned().await.expect("semaphore open");
                grpc_connection(addr, ctx, ids, rxs, protocol, permit).await
            });
        }
        started = upto;
        let want = (upto * k).min(n) as usize;
        let deadline = Instant::now() + timeout;
        loop {
            let synced = ctx.synced.load(Ordering::Acquire);
            bar.set(
                synced as u64,
                format!(
                    "{} streams open, {} errors {}",
                    ctx.connected.load(Ordering::Relaxed),
                    ctx.errors.load(Ordering::Relaxed),
                    rss_msg(pid)
                ),
            );
            if synced >= want {
                break;
            }
            if Instant::now() >= deadline {
                sync_ok = false;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let s = sample(pid);
        milestones.push(Milestone {
            clients: (upto * k).min(n),
            synced: ctx.synced.load(Ordering::Acquire),
            elapsed_s: connect_start.elapsed().as_secs_f64(),
            rss_kb: s.rss_kb,
            cpu_s: s.cpu_s,
        });
        if !sync_ok {
            break;
        }
    }
    let connect_wall_s = connect_start.elapsed().as_secs_f64();
    let synced = ctx.synced.load(Ordering::Acquire);
    bar.finish(format!(
        "{synced}/{n} synced in {connect_wall_s:.2} s, {} errors {}",
        ctx.errors.load(Ordering::Relaxed),
        rss_msg(pid)
    ));
    if !sync_ok {
        progress.line(format!(
            "{}: only {synced} of {n} clients synced within {timeout:?}; last error: {}",
            target.name(),
            crate::sync::lock(&ctx.last_error)
                .clone()
                .unwrap_or_default()
        ));
    }
    // What the join cost the clients, before stuck clients and churn add to it.
    let join_responses = ctx.responses.load(Ordering::Relaxed);
    let join_requests = ctx.requests.load(Ordering::Relaxed);
    let join_syn_drops = overflows_before
        .zip(procfs::listen_overflows())
        .map(|(before, after)| after.saturating_sub(before));
    // Stuck clients: held open (never read) until the phase ends. Not against the floor: it
    // queues without bound for a client that does not read.
    let floor = target == Target::Baseline(Baseline::Floor);
    let mut stuck = Vec::new();
    if !floor {
        for i in 0..args.stuck_clients {
            match client::stuck_client(addr, &ctx, i % n).await {
                Ok(handles) => stuck.push(handles),
                Err(e) => ctx.error(format!("stuck client {i}: {e}")),
            }
        }
        if args.stuck_clients > 0 {
            progress.line(format!(
                "{}: {} stuck clients subscribed and not reading",
                target.name(),
                stuck.len()
            ));
        }
    }
    let stuck_clients = stuck.len() as u32;
    let connected = sample(pid);

    // Churn (not against the floor: it ignores subscription changes), then the updates.
    let churn_task = (args.churn_per_sec > 0.0 && !floor && !ctrl_txs.is_empty()).then(|| {
        tokio::spawn(churn(
            ctrl_txs.clone(),
            args.churn_per_sec,
            args.churn_kind,
            args.seed,
        ))
    });
    let mut versions = Versions::new(&workload);
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut results: Vec<UpdateResult> = Vec::new();
    let mut all = new_histogram();
    let mut fanout = new_histogram();
    let mut ubar = progress.bar(
        u64::from(args.updates),
        &format!("{} updates", target.name()),
    );
    // CPU per delivery counts from the end of the warm-up updates.
    let mut updates_from = connected;
    let warmups = args.warmup_updates;
    for g in 1..=warmups + args.updates {
        let began = Instant::now();
        let changed = workload.pick(args.update_pattern, &mut rng);
        versions.apply(&changed, g);
        let prepared = match &upstream {
            Upstream::Cp { .. } => Some(build_resources(&workload, &versions)),
            Upstream::Child(_) => None,
        };
        let spec = ctx.publish(g, changed);
        match (&mut upstream, prepared) {
            (Upstream::Cp { cp, .. }, Some(res)) => cp.set_resources(res),
            (Upstream::Child(p), _) => {
                if let Err(e) = p.push(&spec.changed, g).await {
                    ctx.error(format!("{}: push: {e}", target.name()));
                }
            }
            _ => unreachable!("resources are prepared for a control plane"),
        }
        let expected = spec.expected_count;
        let measured = g.saturating_sub(warmups);
        let timed_out = measure::wait_update(&spec, timeout, |done| {
            let what = if measured == 0 {
                format!("warm-up update {g}")
            } else {
                format!("update {measured}")
            };
            ubar.set(
                u64::from(measured.saturating_sub(1)),
                format!("{what}: {done}/{expected} clients"),
            )
        })
        .await;
        if measured == 0 {
            if g == warmups {
                updates_from = sample(pid);
            }
        } else {
            let res = UpdateResult::from_spec(&spec, timed_out);
            for &us in crate::sync::lock(&spec.latencies_us).iter() {
                let _ = all.record(us.max(1));
            }
            if res.delivered_clients > 0 {
                let _ = fanout.record(((res.max_ms * 1000.0) as u64).max(1));
            }
            ubar.set(
                u64::from(measured),
                format!(
                    "last: p50 {:.2} p99 {:.2} max {:.2} ms{}",
                    res.p50_ms,
                    res.p99_ms,
                    res.max_ms,
                    if timed_out { " TIMED OUT" } else { "" }
                ),
            );
            results.push(res);
        }
        let next = began + Duration::from_millis(args.update_interval_ms);
        tokio::time::sleep_until(next.into()).await;
    }
    ubar.finish(format!(
        "{} updates: p50 {:.2} p99 {:.2} max {:.2} ms",
        results.len(),
        Dist::from_us(&all).p50_ms,
        Dist::from_us(&all).p99_ms,
        Dist::from_us(&all).max_ms
    ));
    let mut idle = None;
    if args.hold_secs > 0 {
        progress.line(format!("{}: holding {} s", target.name(), args.hold_secs));
        let (held_from, t0) = (sample(pid), Instant::now());
        tokio::time::sleep(Duration::from_secs(args.hold_secs)).await;
        if churn_task.is_none() && pid.is_some() {
            let secs = t0.elapsed().as_secs_f64();
            let relay_cpu_s = sample(pid).cpu_s - held_from.cpu_s;
            idle = Some(IdleFigures {
                secs,
                relay_cpu_s,
                relay_cpu_percent: relay_cpu_s * 100.0 / secs,
            });
        }
    }
    let after = sample(pid);
    if let Some(t) = churn_task {
        t.abort();
    }

    // Reconnect storm: every synced client reopens its stream at once.
    // Not the Delta floor in a warm storm: it ignores initial_resource_versions and resends
    // everything, so its storm would not be the floor of anything; in a cold one it is.
    let storm = if args.storm && !(floor && args.protocol == Protocol::Delta && !args.storm_cold) {
        Some(
            storm(
                &mut upstream,
                pid,
                &ctx,
                &ctrl_txs,
                timeout,
                progress,
                target.name(),
            )
            .await,
        )
    } else {
        None
    };

    let soak = match target {
        Target::Relay | Target::RelaySotwUpstream if args.soak_cycles > 0 => {
            let admin = relay_proc.as_ref().map(|r| r.admin);
            Some(soak(args, addr, &ctx, pid, admin, progress).await)
        }
        _ => None,
    };

    // Figures.
    let deliveries: u64 = results.iter().map(|r| r.delivered_clients as u64).sum();
    let missed: u64 = results
        .iter()
        .map(|r| (r.expected_clients - r.delivered_clients.min(r.expected_clients)) as u64)
        .sum();
    let busy_s: f64 = results.iter().map(|r| r.max_ms).sum::<f64>() / 1000.0;
    let upstream_figs = Some(upstream.stats().await);
    let server = pid.map(|pid| {
        let cpu_updates_s = after.cpu_s - updates_from.cpu_s;
        let cpu_connect_s = connected.cpu_s - baseline.cpu_s;
        ServerFigures {
            pid,
            log: relay_proc.as_ref().map(|r| r.log.display().to_string()),
            baseline,
            connected,
            after_updates: after,
            rss_per_client_kb: (connected.rss_kb as f64 - baseline.rss_kb as f64)
                / f64::from(n.max(1)),
            cpu_connect_s,
            cpu_per_joining_client_us: cpu_connect_s * 1e6 / f64::from(n.max(1)),
            cpu_updates_s,
            cpu_per_delivery_us: if deliveries > 0 {
                cpu_updates_s * 1e6 / deliveries as f64
            } else {
                0.0
            },
            milestones,
        }
    });
    let report = PhaseReport {
        target: target.name().into(),
        clients: n,
        connections: conns,
        connected: ctx.connected.load(Ordering::Relaxed) as u64,
        synced,
        connect_wall_s,
        time_to_sync: Dist::from_us(&crate::sync::lock(&ctx.sync_us)),
        latency: Dist::from_us(&all),
        update_fanout: Dist::from_us(&fanout),
        updates: results,
        deliveries,
        deliveries_per_sec: if busy_s > 0.0 {
            deliveries as f64 / busy_s
        } else {
            0.0
        },
        missed_deliveries: missed,
        responses: ctx.responses.load(Ordering::Relaxed),
        requests: ctx.requests.load(Ordering::Relaxed),
        join_responses,
        join_requests,
        join_syn_drops,
        resources_received: ctx.resources_received.load(Ordering::Relaxed),
        errors: ctx.errors.load(Ordering::Relaxed),
        last_error: crate::sync::lock(&ctx.last_error).clone(),
        reconnects: ctx.reconnects.load(Ordering::Relaxed),
        churn_events: ctx.churn_events.load(Ordering::Relaxed),
        upstream: upstream_figs,
        storm,
        idle,
        soak,
        stuck_clients,
        server,
        loadgen_cpu_s: procfs::sample_self().cpu_s - self_start.cpu_s,
        cdf: cdf(&all, 200),
    };

    // Stop: clients, then the relay, then the upstream (or the baseline's process).
    drop(stuck);
    drop(ctrl_txs);
    clients.shutdown().await;
    if let Some(r) = relay_proc {
        r.stop().await;
    }
    match upstream {
        Upstream::Cp { cp, mut stop } => {
            if let Some(s) = stop.take() {
                let _ = s.send(());
            }
            cp.disconnect_all();
        }
        Upstream::Child(p) => p.stop().await,
    }
    servers.shutdown().await;
    Ok(report)
}
