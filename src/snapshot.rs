//! Warm restart (docs/deploy.md "Warm restart"): the relay persists every group's cache and upstream
//! interest to a local snapshot file, periodically and when a graceful shutdown starts, and loads
//! it at startup. A group created after the restart whose name and upstream node match a group in
//! the snapshot starts with its store filled, so clients are served before the upstream answers;
//! its upstream stream then reports the restored versions in `initial_resource_versions` (C4), so
//! an unchanged upstream resends nothing.
//!
//! File layout (integers little-endian):
//!
//! ```text
//! magic "ADSRSNAP" | format version u32 | identity fingerprint [32] | written_at unix ms u64
//! | body | SHA-256 of everything before it [32]
//! ```
//!
//! The body is an `adsrelay.snapshot.Body` protobuf message (proto/adsrelay/snapshot.proto):
//! per group its name, upstream node and as-of time, per type the held locators and the cached
//! resources as the upstream encoded them, each with its wall-clock TTL deadline.
//!
//! A snapshot that fails any check (magic, version, checksum, identity, age) is rejected as a
//! whole with one warn line and the relay starts cold: none of it is served.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use prost::Message;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::config::{Config, SnapshotConfig};
use crate::group::Group;
use crate::grouping::same_identity;
use crate::pb::adsrelay::snapshot as file;
use crate::pb::core::Node;
use crate::sync::lock;
use crate::xds::store::{ExportedResource, ExportedType};
use crate::xds::{CachedResource, GroupState, Locator, WILDCARD};

pub const MAGIC: &[u8; 8] = b"ADSRSNAP";
/// 2: the body is a protobuf message (proto/adsrelay/snapshot.proto); 1 had a hand-rolled one.
pub const FORMAT_VERSION: u32 = 2;
const HEADER_LEN: usize = 8 + 4 + 32 + 8;
const CHECKSUM_LEN: usize = 32;

/// Restored interest is held at least this long for reconnecting clients to claim it, even with
/// a shorter `unsubscribe_linger`: clients reconnect to a restarted relay with backoff.
pub const RECLAIM_MIN: Duration = Duration::from_secs(30);

/// Why a snapshot file is not loaded. Every variant means the relay starts with an empty cache.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    #[error("cannot read it: {0}")]
    Unreadable(std::io::Error),
    #[error("not an adsrelay snapshot (bad magic)")]
    NotASnapshot,
    #[error("format version {0} is not supported (this relay reads version {FORMAT_VERSION})")]
    UnsupportedVersion(u32),
    #[error("checksum mismatch (corrupt)")]
    ChecksumMismatch,
    #[error("malformed content: {0} (corrupt)")]
    Malformed(String),
    #[error(
        "made for a different relay identity: the upstream addresses, node_id or [[groups]] \
         differ (foreign)"
    )]
    Foreign,
    #[error("written {age_secs}s ago, more than snapshot_max_staleness ({max_secs}s) (too old)")]
    TooOld { age_secs: u64, max_secs: u64 },
}

impl Rejection {
    /// The `reason` label of `adsrelay_snapshot_rejected_total`.
    /// Every value [`Rejection::reason`] returns, to export each at zero from startup.
    pub const REASONS: [&'static str; 6] = [
        "unreadable",
        "not_a_snapshot",
        "unsupported_version",
        "corrupt",
        "foreign",
        "too_old",
    ];

    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::Unreadable(_) => "unreadable",
            Rejection::NotASnapshot => "not_a_snapshot",
            Rejection::UnsupportedVersion(_) => "unsupported_version",
            Rejection::ChecksumMismatch | Rejection::Malformed(_) => "corrupt",
            Rejection::Foreign => "foreign",
            Rejection::TooOld { .. } => "too_old",
        }
    }
}

/// Why a snapshot could not be written (the previous file, if any, is left intact).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("writer task failed: {0}")]
    Task(String),
}

/// One instant on both clocks: TTL deadlines are `Instant`s in memory and wall-clock times on
/// disk, since `Instant`s mean nothing to another process.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub instant: Instant,
    pub wall: SystemTime,
}

impl Clock {
    pub fn now() -> Self {
        Clock {
            instant: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    fn to_wall(self, at: Instant) -> SystemTime {
        match at.checked_duration_since(self.instant) {
            Some(ahead) => self.wall + ahead,
            None => self.wall - self.instant.duration_since(at),
        }
    }

    /// `None` if `at` is already past: the deadline ran out.
    fn to_instant(self, at: SystemTime) -> Option<Instant> {
        let left = at.duration_since(self.wall).ok()?;
        (!left.is_zero()).then(|| self.instant + left)
    }
}

/// One type of a group as saved: the upstream interest and the cached variants.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedType {
    pub locators: Vec<Locator>,
    pub store: ExportedType,
}

/// One group as saved.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSeed {
    /// The node the relay presented upstream for the group: a restored group must present the same.
    pub upstream_node: Node,
    /// When the content was last known to match the upstream (the upstream stream was open).
    pub as_of: SystemTime,
    pub types: Vec<SeedType>,
}

impl GroupSeed {
    pub fn resource_count(&self) -> usize {
        self.types.iter().map(|t| t.store.resources.len()).sum()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub written_at: SystemTime,
    pub groups: BTreeMap<String, GroupSeed>,
}

/// What one group's state contributes to a snapshot: the locators held upstream and, per type,
/// only the cached content those locators want (what nobody wants would go stale, D5).
pub fn export_group(
    state: &GroupState,
    upstream_node: &Node,
    as_of: SystemTime,
    now: Instant,
) -> GroupSeed {
    let mut locators: BTreeMap<String, Vec<Locator>> =
        state.interest().held_locators().into_iter().collect();
    let mut types = Vec::new();
    for mut store in state.store().export(now) {
        let held = locators.remove(&store.type_url).unwrap_or_default();
        let wildcard = held.iter().any(|l| &*l.name == WILDCARD);
        let wanted: HashSet<&str> = held.iter().map(|l| &*l.name).collect();
        store
            .resources
            .retain(|r| wildcard || wanted.contains(&*r.resource.name));
        store.wildcard_synced &= wildcard;
        if held.is_empty() {
            continue;
        }
        types.push(SeedType {
            locators: held,
            store,
        });
    }
    // Interest in types nothing is cached for yet is restored too, so it is resubscribed at once.
    for (type_url, held) in locators {
        types.push(SeedType {
            locators: held,
            store: ExportedType {
                type_url,
                wildcard_synced: false,
                resources: vec![],
            },
        });
    }
    types.sort_by(|a, b| a.store.type_url.cmp(&b.store.type_url));
    GroupSeed {
        upstream_node: upstream_node.clone(),
        as_of,
        types,
    }
}

/// Seeds a new group's (empty) state from its saved counterpart. The interest is restored as
/// lingering until `hold`, so it goes upstream on the first stream and lapses unless a client
/// claims it. Returns the number of variants restored.
pub fn restore_group(
    seed: GroupSeed,
    state: &mut GroupState,
    now: Instant,
    hold: Duration,
) -> usize {
    seed.types
        .into_iter()
        .map(|t| state.restore_type(&t.locators, t.store, now + hold, now))
        .sum()
}

/// SHA-256 over what makes snapshots interchangeable: the control-plane addresses (in any order:
/// failover order does not change what they serve), the relay's node id and the grouping rules.
pub fn fingerprint(config: &Config) -> [u8; 32] {
    let mut upstreams: Vec<String> = config.upstreams.iter().map(|u| u.to_string()).collect();
    upstreams.sort();
    upstreams.dedup();
    let mut h = Sha256::new();
    h.update(b"adsrelay snapshot identity v1\0");
    for u in &upstreams {
        h.update(u.as_bytes());
        h.update([0]);
    }
    h.update(config.node_id.as_bytes());
    h.update([0]);
    // Debug output of plain structs, Vecs and BTreeMaps: deterministic for one relay version,
    // and the format version guards layout changes across versions.
    h.update(format!("{:?}", config.grouping).as_bytes());
    h.finalize().into()
}

fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn from_unix_millis(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// Serializes a snapshot, ready to be written.
pub fn encode(snapshot: &Snapshot, fingerprint: &[u8; 32], clock: Clock) -> Vec<u8> {
    let body = file::Body {
        groups: snapshot
            .groups
            .iter()
            .map(|(name, g)| file::Group {
                name: name.clone(),
                upstream_node: Some(g.upstream_node.clone()),
                as_of_unix_ms: unix_millis(g.as_of),
                types: g
                    .types
                    .iter()
                    .map(|t| file::Type {
                        type_url: t.store.type_url.clone(),
                        wildcard_synced: t.store.wildcard_synced,
                        locators: t
                            .locators
                            .iter()
                            .map(|l| file::Locator {
                                name: l.name.to_string(),
                                params: (*l.params).clone(),
                            })
                            .collect(),
                        resources: t
                            .store
                            .resources
                            .iter()
                            .map(|r| file::Resource {
                                encoded: r.resource.encoded.clone(),
                                // 0 means "no TTL", so a deadline at the epoch is kept as 1 ms.
                                ttl_deadline_unix_ms: r
                                    .expires
                                    .map_or(0, |at| unix_millis(clock.to_wall(at)).max(1)),
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .collect(),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + body.encoded_len() + CHECKSUM_LEN);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(fingerprint);
    out.extend_from_slice(&unix_millis(snapshot.written_at).to_le_bytes());
    body.encode(&mut out).expect("a Vec grows to fit the body");
    let sum = Sha256::digest(&out);
    out.extend_from_slice(&sum);
    out
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Parses and validates a snapshot: magic, format version, checksum, identity, age, then every
/// resource. TTL'd resources whose deadline passed while the relay was down are dropped here.
pub fn decode(
    data: &[u8],
    fingerprint: &[u8; 32],
    clock: Clock,
    max_staleness: Duration,
) -> Result<Snapshot, Rejection> {
    if data.len() < MAGIC.len() || &data[..MAGIC.len()] != MAGIC {
        return Err(Rejection::NotASnapshot);
    }
    if data.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(Rejection::Malformed("truncated header".into()));
    }
    // Checked before anything else is trusted: version 1's body was not protobuf.
    let version = le_u32(&data[MAGIC.len()..]);
    if version != FORMAT_VERSION {
        return Err(Rejection::UnsupportedVersion(version));
    }
    let (content, sum) = data.split_at(data.len() - CHECKSUM_LEN);
    if Sha256::digest(content).as_slice() != sum {
        return Err(Rejection::ChecksumMismatch);
    }
    let (header, body) = content.split_at(HEADER_LEN);
    if &header[MAGIC.len() + 4..MAGIC.len() + 4 + 32] != fingerprint {
        return Err(Rejection::Foreign);
    }
    let written_at = from_unix_millis(le_u64(&header[HEADER_LEN - 8..]));
    // A snapshot from the future (clock step) counts as fresh.
    let age = clock.wall.duration_since(written_at).unwrap_or_default();
    if age > max_staleness {
        return Err(Rejection::TooOld {
            age_secs: age.as_secs(),
            max_secs: max_staleness.as_secs(),
        });
    }
    // One copy of the body; every restored resource is a slice of it.
    let body = file::Body::decode(Bytes::copy_from_slice(body))
        .map_err(|e| Rejection::Malformed(format!("body: {e}")))?;
    let mut groups = BTreeMap::new();
    for g in body.groups {
        let name = g.name;
        let upstream_node = g
            .upstream_node
            .ok_or_else(|| Rejection::Malformed(format!("group {name:?} has no upstream node")))?;
        let mut types = Vec::new();
        for t in g.types {
            let type_url = t.type_url;
            let locators = t
                .locators
                .into_iter()
                .map(|l| Locator::with_params(l.name, Arc::new(l.params)))
                .collect();
            let mut resources = Vec::new();
            for r in t.resources {
                let resource = CachedResource::decode(r.encoded).map_err(|e| {
                    Rejection::Malformed(format!("group {name:?} type {type_url:?}: {e}"))
                })?;
                if resource.body_type_url != type_url {
                    return Err(Rejection::Malformed(format!(
                        "resource {:?} has type {:?} under {type_url:?}",
                        resource.name, resource.body_type_url
                    )));
                }
                let expires = match r.ttl_deadline_unix_ms {
                    0 => None,
                    deadline => match clock.to_instant(from_unix_millis(deadline)) {
                        Some(at) => Some(at),
                        // D6: its TTL ran out while the relay was down.
                        None => continue,
                    },
                };
                if resource.do_not_cache {
                    continue;
                }
                resources.push(ExportedResource { resource, expires });
            }
            types.push(SeedType {
                locators,
                store: ExportedType {
                    type_url,
                    wildcard_synced: t.wildcard_synced,
                    resources,
                },
            });
        }
        groups.insert(
            name,
            GroupSeed {
                upstream_node,
                as_of: from_unix_millis(g.as_of_unix_ms),
                types,
            },
        );
    }
    Ok(Snapshot { written_at, groups })
}

/// Writes `data` to `path` atomically: a temporary file in the same directory, fsync, rename,
/// fsync of the directory. A crash leaves the old snapshot or the new one, never a torn file.
pub fn write_atomically(path: &Path, data: &[u8]) -> Result<(), WriteError> {
    let io = |source| WriteError::Io {
        path: path.display().to_string(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "snapshot".into());
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        std::fs::File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

/// What was loaded at startup (for /readyz).
#[derive(Debug, Clone)]
pub struct LoadedInfo {
    pub path: PathBuf,
    pub written_at: SystemTime,
    pub resources: usize,
}

/// The relay's warm-restart state: groups of the loaded snapshot not yet claimed by a group of
/// this process, and a lock that keeps two writes from racing on the temporary file.
#[derive(Debug, Default)]
pub struct SnapshotState {
    pending: Mutex<BTreeMap<String, GroupSeed>>,
    loaded: OnceLock<LoadedInfo>,
    writing: tokio::sync::Mutex<()>,
}

impl SnapshotState {
    pub fn loaded(&self) -> Option<&LoadedInfo> {
        self.loaded.get()
    }

    /// Fills a new group's state from the snapshot, if it saved a group of that name for the same
    /// upstream node. Restored interest is held for `linger` (at least [`RECLAIM_MIN`]). Returns
    /// when the restored content was last known current.
    pub fn restore_into(
        &self,
        group: &str,
        upstream_node: &Node,
        state: &mut GroupState,
        linger: Duration,
    ) -> Option<SystemTime> {
        let seed = lock(&self.pending).remove(group)?;
        if !same_identity(&seed.upstream_node, upstream_node) {
            warn!(
                group,
                "snapshot group not restored: it was saved for a different upstream node"
            );
            return None;
        }
        let as_of = seed.as_of;
        let restored = restore_group(seed, state, Instant::now(), linger.max(RECLAIM_MIN));
        info!(
            group,
            resources = restored,
            "group restored from the cache snapshot"
        );
        Some(as_of)
    }
}

/// What loading and writing the snapshot need from the relay (the relay implements it): the
/// settings, the loaded-but-unclaimed groups, the live groups, and where to report.
pub trait Host: Send + Sync + 'static {
    fn config(&self) -> &Config;
    fn snapshot_state(&self) -> &SnapshotState;
    fn groups(&self) -> Vec<Arc<Group>>;
    fn snapshot_loaded(&self, resources: usize, age: Duration);
    /// `reason` is one of [`Rejection::REASONS`].
    fn snapshot_rejected(&self, reason: &'static str);
    fn snapshot_written(&self, ok: bool);
}

/// Loads the configured snapshot into `relay` before it serves. A missing file is a cold start;
/// any other failure is one warn line naming the file and the reason, and a cold start.
pub fn load(relay: &impl Host) {
    let Some(cfg) = relay.config().snapshot.as_ref() else {
        return;
    };
    let clock = Clock::now();
    let data = match std::fs::read(&cfg.path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            info!(path = %cfg.path.display(), "no cache snapshot yet; starting with an empty cache");
            return;
        }
        Err(e) => return reject(relay, cfg, Rejection::Unreadable(e)),
    };
    let fp = fingerprint(relay.config());
    let mut snapshot = match decode(&data, &fp, clock, cfg.max_staleness) {
        Ok(s) => s,
        Err(e) => return reject(relay, cfg, e),
    };
    // A group whose content was already stale when it was saved (its upstream down long) is not
    // restored, even if the file itself is recent.
    snapshot.groups.retain(|name, g| {
        let age = clock.wall.duration_since(g.as_of).unwrap_or_default();
        let keep = age <= cfg.max_staleness;
        if !keep {
            warn!(path = %cfg.path.display(), group = %name, age_secs = age.as_secs(),
                "snapshot group not restored: its content is older than snapshot_max_staleness");
        }
        keep
    });
    let resources: usize = snapshot
        .groups
        .values()
        .map(GroupSeed::resource_count)
        .sum();
    let age = clock
        .wall
        .duration_since(snapshot.written_at)
        .unwrap_or_default();
    info!(path = %cfg.path.display(), groups = snapshot.groups.len(), resources,
        age_secs = age.as_secs(), "cache snapshot loaded; serving from it until the upstream answers");
    relay.snapshot_loaded(resources, age);
    let _ = relay.snapshot_state().loaded.set(LoadedInfo {
        path: cfg.path.clone(),
        written_at: snapshot.written_at,
        resources,
    });
    *lock(&relay.snapshot_state().pending) = snapshot.groups;
}

fn reject(relay: &impl Host, cfg: &SnapshotConfig, why: Rejection) {
    warn!(path = %cfg.path.display(), reason = why.reason(),
        "snapshot {} rejected: {why}; starting with an empty cache", cfg.path.display());
    relay.snapshot_rejected(why.reason());
}

/// Collects every group (and every saved group not claimed yet) into a snapshot.
fn collect(relay: &impl Host, clock: Clock) -> Snapshot {
    let mut groups = BTreeMap::new();
    for g in relay.groups() {
        let status = lock(&g.status).clone();
        let as_of = if status.connected && status.synced_once {
            clock.wall
        } else if status.synced_once {
            status
                .disconnected_since
                .or(status.last_response)
                .unwrap_or(clock.wall)
        } else if let Some(at) = g.seeded_as_of {
            at
        } else {
            // Never synced, nothing restored: nothing worth keeping.
            continue;
        };
        let seed = export_group(
            &crate::sync::read(&g.state),
            &g.upstream_node,
            as_of,
            clock.instant,
        );
        groups.insert(g.name.clone(), seed);
    }
    for (name, seed) in lock(&relay.snapshot_state().pending).iter() {
        groups.entry(name.clone()).or_insert_with(|| seed.clone());
    }
    Snapshot {
        written_at: clock.wall,
        groups,
    }
}

/// Writes the snapshot now (periodic writer and graceful shutdown). Returns the resources saved.
pub async fn write(relay: &impl Host) -> Result<usize, WriteError> {
    let Some(cfg) = relay.config().snapshot.clone() else {
        return Ok(0);
    };
    let _one_at_a_time = relay.snapshot_state().writing.lock().await;
    let clock = Clock::now();
    let snapshot = collect(relay, clock);
    let resources = snapshot
        .groups
        .values()
        .map(GroupSeed::resource_count)
        .sum();
    let data = encode(&snapshot, &fingerprint(relay.config()), clock);
    let result = tokio::task::spawn_blocking(move || write_atomically(&cfg.path, &data))
        .await
        .map_err(|e| WriteError::Task(e.to_string()))
        .and_then(|r| r);
    relay.snapshot_written(result.is_ok());
    result.map(|()| resources)
}

/// Rewrites the snapshot every `snapshot_interval` until shutdown.
pub async fn run(relay: Arc<impl Host>, mut shutdown: watch::Receiver<bool>) {
    let Some(interval) = relay.config().snapshot.as_ref().map(|c| c.interval) else {
        return;
    };
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
        match write(&*relay).await {
            Ok(resources) => debug!(resources, "cache snapshot written"),
            Err(e) => warn!(error = %e, "cache snapshot not written; the previous one is kept"),
        }
    }
}

/// The write at the start of a graceful shutdown, while clients are still connected and their
/// interest is intact.
pub async fn write_on_shutdown(relay: &impl Host) {
    if relay.config().snapshot.is_none() {
        return;
    }
    match write(relay).await {
        Ok(resources) => info!(resources, "cache snapshot written for the restart"),
        Err(e) => {
            warn!(error = %e, "cache snapshot not written at shutdown; the previous one is kept")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::Resource;
    use crate::xds::{RequestEffects, UpstreamSession, UpstreamUpdate};

    const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const E: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    fn res(type_url: &str, name: &str, version: &str, ttl: Option<i64>) -> Bytes {
        Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: type_url.into(),
                value: name.as_bytes().to_vec(),
            }),
            ttl: ttl.map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    fn node() -> Node {
        Node {
            id: "relay".into(),
            cluster: "edge".into(),
            ..Default::default()
        }
    }

    /// A group holding wildcard CDS (a, b) and EDS e1 with a 60 s TTL; EDS e2 was cached but is
    /// no longer wanted.
    fn group(now: Instant) -> GroupState {
        let mut s = GroupState::new(Duration::from_secs(30));
        for (t, name) in [(T, WILDCARD), (E, "e1")] {
            let mut effects = RequestEffects::new(t);
            effects.acquire.push(Locator::plain(name));
            s.apply_effects(1, &effects, now);
        }
        // The subscriptions went upstream on a stream, so the wildcard response completes the sync.
        UpstreamSession::new(node()).initial_requests(&mut s, false);
        s.apply_upstream(
            T,
            UpstreamUpdate {
                resources: vec![res(T, "a", "1", None), res(T, "b", "1", None)],
                received_at: Some(now),
                ..Default::default()
            },
        )
        .unwrap();
        s.apply_upstream(
            E,
            UpstreamUpdate {
                resources: vec![res(E, "e1", "7", Some(60))],
                received_at: Some(now),
                ..Default::default()
            },
        )
        .unwrap();
        s
    }

    fn snapshot(clock: Clock) -> Snapshot {
        let g = group(clock.instant);
        Snapshot {
            written_at: clock.wall,
            groups: BTreeMap::from([(
                "edge".to_string(),
                export_group(&g, &node(), clock.wall, clock.instant),
            )]),
        }
    }

    const FP: [u8; 32] = [7; 32];
    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn round_trip_restores_content_interest_and_wildcard() {
        let clock = Clock::now();
        let snap = snapshot(clock);
        let data = encode(&snap, &FP, clock);
        let back = decode(&data, &FP, clock, HOUR).unwrap();
        assert_eq!(back.groups.len(), 1);
        let seed = back.groups["edge"].clone();
        assert_eq!(seed.resource_count(), 3);

        let mut fresh = GroupState::new(Duration::from_secs(30));
        let restored = restore_group(seed, &mut fresh, clock.instant, RECLAIM_MIN);
        assert_eq!(restored, 3);
        assert!(
            fresh.store().wildcard_synced(T),
            "wildcard subscribers are answered at once"
        );
        assert!(fresh.interest().is_wildcard(T) && fresh.interest().wants(E, "e1"));
        // The first upstream stream resubscribes everything with the restored versions (C4).
        assert_eq!(
            fresh
                .store()
                .initial_versions(E, |_| true)
                .get("e1")
                .map(String::as_str),
            Some("7")
        );
        assert_eq!(fresh.store().initial_versions(T, |_| true).len(), 2);
        // The TTL deadline survives the trip (to the millisecond).
        let left = fresh.store().next_expiry().unwrap() - clock.instant;
        assert!(
            left > Duration::from_secs(59) && left <= Duration::from_secs(60),
            "{left:?}"
        );
    }

    #[test]
    fn unwanted_and_expired_content_is_not_saved() {
        let now = Instant::now();
        let mut g = group(now);
        // The last subscriber of e1 left and the linger ended: e1 is no longer wanted.
        let mut effects = RequestEffects::new(E);
        effects.release.push(Locator::plain("e1"));
        g.apply_effects(1, &effects, now);
        g.expire(now + Duration::from_secs(31));
        let seed = export_group(
            &g,
            &node(),
            SystemTime::now(),
            now + Duration::from_secs(31),
        );
        assert_eq!(seed.resource_count(), 2);
        assert!(seed.types.iter().all(|t| t.store.type_url == T));
    }

    #[test]
    fn ttl_that_ran_out_while_down_is_dropped_at_load() {
        let then = Clock::now();
        let data = encode(&snapshot(then), &FP, then);
        let later = Clock {
            instant: then.instant + Duration::from_secs(61),
            wall: then.wall + Duration::from_secs(61),
        };
        let back = decode(&data, &FP, later, HOUR).unwrap();
        let names: Vec<String> = back.groups["edge"]
            .types
            .iter()
            .flat_map(|t| {
                t.store
                    .resources
                    .iter()
                    .map(|r| r.resource.name.to_string())
            })
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn every_rejection_has_its_reason() {
        let clock = Clock::now();
        let data = encode(&snapshot(clock), &FP, clock);
        let reason = |d: &[u8], fp: &[u8; 32], clock: Clock| {
            decode(d, fp, clock, HOUR).map(|_| ()).unwrap_err().reason()
        };
        let mut flipped = data.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x01;
        assert_eq!(reason(&flipped, &FP, clock), "corrupt");
        assert_eq!(reason(&data[..data.len() - 1], &FP, clock), "corrupt");
        assert_eq!(reason(b"{\"json\": true}", &FP, clock), "not_a_snapshot");
        assert_eq!(reason(&data, &[8; 32], clock), "foreign");
        let mut v2 = data.clone();
        v2[8] = u8::try_from(FORMAT_VERSION + 1).unwrap();
        assert_eq!(reason(&v2, &FP, clock), "unsupported_version");
        // A file of the previous format (hand-rolled body).
        v2[8] = 1;
        assert_eq!(reason(&v2, &FP, clock), "unsupported_version");
        let later = Clock {
            instant: clock.instant,
            wall: clock.wall + HOUR + Duration::from_secs(1),
        };
        let e = decode(&data, &FP, later, HOUR).unwrap_err();
        assert_eq!(e.reason(), "too_old");
        assert!(
            e.to_string()
                .contains("more than snapshot_max_staleness (3600s)"),
            "{e}"
        );
    }

    #[test]
    fn fingerprint_follows_upstreams_and_grouping_not_their_order() {
        let a: http::Uri = "http://cp-a:18000".parse().unwrap();
        let b: http::Uri = "http://cp-b:18000".parse().unwrap();
        let mut c1 = Config::with_upstream(a.clone());
        c1.upstreams = vec![a.clone(), b.clone()];
        let mut c2 = c1.clone();
        c2.upstreams = vec![b.clone(), a.clone()];
        assert_eq!(fingerprint(&c1), fingerprint(&c2));
        let c3 = Config::with_upstream(b);
        assert_ne!(fingerprint(&c1), fingerprint(&c3));
        let mut c4 = c1.clone();
        c4.grouping.metadata_keys = vec!["tenant".into()];
        assert_ne!(fingerprint(&c1), fingerprint(&c4));
    }

    #[test]
    fn atomic_write_replaces_the_file() {
        let dir = std::env::temp_dir().join(format!("adsrelay-snap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cache.snap");
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let leftovers = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
        let e = write_atomically(&dir.join("missing/cache.snap"), b"x").unwrap_err();
        assert!(e.to_string().contains("missing/cache.snap"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
