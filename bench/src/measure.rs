//! What a phase measures: the update in flight (which clients must receive it, who has), the
//! per-phase counters clients bump, and latency distributions.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::Notify;

use crate::workload::{Changed, Workload};

/// What a control plane (the upstream of the relay, or a baseline serving clients itself) saw:
/// streams opened, open now, and requests received.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct UpstreamFigures {
    pub streams_opened: u64,
    pub active_streams: u64,
    pub requests: u64,
}

/// One update in flight: published before the upstream is told, so no client can see the new
/// version before its start time is set.
#[derive(Debug)]
pub struct UpdateSpec {
    pub generation: u32,
    pub start: Instant,
    pub changed: Changed,
    /// Per client: must it receive this update (synced and subscribed to a changed name)?
    pub expected: Vec<bool>,
    pub expected_count: usize,
    pub done: AtomicUsize,
    /// Per-client latency in microseconds, in completion order.
    pub latencies_us: Mutex<Vec<u64>>,
    pub all_done: Notify,
}

impl UpdateSpec {
    /// Called by a client once it holds every changed resource it subscribes to.
    pub fn complete(&self) {
        let us = self.start.elapsed().as_micros() as u64;
        crate::sync::lock(&self.latencies_us).push(us);
        if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.expected_count {
            self.all_done.notify_one();
        }
    }
}

/// Shared state of one phase: the clients' counters and the update in flight.
#[derive(Debug)]
pub struct RunCtx {
    pub workload: Arc<Workload>,
    pub group: String,
    /// Groups the clients are spread over (`--groups`).
    pub groups: u32,
    pub current: RwLock<Option<Arc<UpdateSpec>>>,
    /// Per client: has it held its whole initial set once?
    pub synced_flags: Vec<AtomicBool>,
    pub synced: AtomicUsize,
    pub connected: AtomicUsize,
    /// Per client: its current EDS subscriptions (changed by churn).
    pub eds_subs: Vec<Mutex<Vec<u32>>>,
    pub responses: AtomicU64,
    /// Requests the clients sent (stream openings and ACKs; not churn).
    pub requests: AtomicU64,
    pub resources_received: AtomicU64,
    pub errors: AtomicU64,
    pub reconnects: AtomicU64,
    pub churn_events: AtomicU64,
    pub last_error: Mutex<Option<String>>,
    /// Microseconds from a client's task start to its first full sync.
    pub sync_us: Mutex<Histogram<u64>>,
    pub phase_start: Instant,
    /// Reconnect storm: when every client was told to reconnect (None before the storm).
    pub storm_start: Mutex<Option<Instant>>,
    /// `--storm-cold`: clients forget what they hold before reconnecting in the storm.
    pub cold_storm: bool,
    /// Clients synced again after the storm.
    pub resynced: AtomicUsize,
    /// Microseconds from the storm start to each client's resync.
    pub resync_us: Mutex<Histogram<u64>>,
    /// The server's version string of (kind, index, generation) where it is not the workload's
    /// `uG` (go-control-plane and a SotW upstream derive versions from the bytes), so a client
    /// resumes with the versions it was sent, as Envoy does. Shared: every client is sent the same.
    pub server_versions: Mutex<std::collections::HashMap<(u8, u32, u32), String>>,
}

impl RunCtx {
    pub fn new(
        workload: Arc<Workload>,
        group: String,
        groups: u32,
        clients: u32,
        cold_storm: bool,
    ) -> Arc<Self> {
        Arc::new(RunCtx {
            cold_storm,
            synced_flags: (0..clients).map(|_| AtomicBool::new(false)).collect(),
            eds_subs: (0..clients)
                .map(|i| Mutex::new(workload.eds_for_client(i)))
                .collect(),
            workload,
            group,
            groups: groups.max(1),
            current: RwLock::new(None),
            synced: AtomicUsize::new(0),
            connected: AtomicUsize::new(0),
            responses: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            resources_received: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            churn_events: AtomicU64::new(0),
            last_error: Mutex::new(None),
            sync_us: Mutex::new(new_histogram()),
            phase_start: Instant::now(),
            storm_start: Mutex::new(None),
            resynced: AtomicUsize::new(0),
            resync_us: Mutex::new(new_histogram()),
            server_versions: Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// The node.cluster (the relay's aggregation group) of client `id`.
    pub fn group_of(&self, id: u32) -> String {
        if self.groups > 1 {
            format!("{}-{}", self.group, id % self.groups)
        } else {
            self.group.clone()
        }
    }

    pub fn current(&self) -> Option<Arc<UpdateSpec>> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn mark_synced(&self, id: u32, since: Instant) {
        if !self.synced_flags[id as usize].swap(true, Ordering::AcqRel) {
            self.synced.fetch_add(1, Ordering::AcqRel);
            let us = since.elapsed().as_micros() as u64;
            let _ = crate::sync::lock(&self.sync_us).record(us.max(1));
        }
    }

    /// A client holds its whole set again on its post-storm stream.
    pub fn mark_resynced(&self) {
        let Some(start) = *crate::sync::lock(&self.storm_start) else {
            return;
        };
        let us = start.elapsed().as_micros() as u64;
        let _ = crate::sync::lock(&self.resync_us).record(us.max(1));
        self.resynced.fetch_add(1, Ordering::AcqRel);
    }

    pub fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *crate::sync::lock(&self.last_error) = Some(what);
    }

    /// Builds and publishes the spec for an update; returns it. Call before telling the upstream.
    pub fn publish(&self, generation: u32, changed: Changed) -> Arc<UpdateSpec> {
        let wildcard_changed = !changed.names[0].is_empty() || !changed.names[1].is_empty();
        let expected: Vec<bool> = (0..self.synced_flags.len())
            .map(|i| {
                self.synced_flags[i].load(Ordering::Acquire)
                    && (wildcard_changed
                        || crate::sync::lock(&self.eds_subs[i])
                            .iter()
                            .any(|&e| changed.contains_eds(e)))
            })
            .collect();
        let expected_count = expected.iter().filter(|&&e| e).count();
        let spec = Arc::new(UpdateSpec {
            generation,
            start: Instant::now(),
            changed,
            expected,
            expected_count,
            done: AtomicUsize::new(0),
            latencies_us: Mutex::new(Vec::with_capacity(expected_count)),
            all_done: Notify::new(),
        });
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(spec.clone());
        spec
    }
}

pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// A latency distribution in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Dist {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Dist {
    pub fn from_us(h: &Histogram<u64>) -> Dist {
        if h.is_empty() {
            return Dist::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Dist {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
            mean_ms: h.mean() / 1000.0,
        }
    }
}

/// (latency ms, fraction of samples at or below) at up to `points` quantiles, for a CDF plot.
pub fn cdf(h: &Histogram<u64>, points: usize) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    (0..=points)
        .map(|i| {
            let q = i as f64 / points as f64;
            (h.value_at_quantile(q) as f64 / 1000.0, q)
        })
        .collect()
}

/// One update's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateResult {
    pub generation: u32,
    pub changed_resources: usize,
    pub expected_clients: usize,
    pub delivered_clients: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Until the last expected client held it (the update's fan-out time).
    pub max_ms: f64,
    pub timed_out: bool,
}

impl UpdateResult {
    pub fn from_spec(spec: &UpdateSpec, timed_out: bool) -> Self {
        let mut l = crate::sync::lock(&spec.latencies_us).clone();
        l.sort_unstable();
        let q = |p: f64| -> f64 {
            if l.is_empty() {
                return 0.0;
            }
            let idx = ((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1;
            l[idx] as f64 / 1000.0
        };
        UpdateResult {
            generation: spec.generation,
            changed_resources: spec.changed.len(),
            expected_clients: spec.expected_count,
            delivered_clients: l.len(),
            p50_ms: q(0.5),
            p99_ms: q(0.99),
            max_ms: l.last().map_or(0.0, |&x| x as f64 / 1000.0),
            timed_out,
        }
    }
}

/// Waits until every expected client completed `spec` or `timeout` passed; calls `tick` about
/// every 200 ms with the number done. Returns whether it timed out.
pub async fn wait_update(
    spec: &UpdateSpec,
    timeout: Duration,
    mut tick: impl FnMut(usize),
) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let done = spec.done.load(Ordering::Acquire);
        tick(done);
        if done >= spec.expected_count {
            return false;
        }
        if tokio::time::Instant::now() >= deadline {
            return true;
        }
        let _ = tokio::time::timeout(Duration::from_millis(200), spec.all_done.notified()).await;
    }
}
