//! The synthetic resource set: Clusters and Listeners (every client subscribes to them by
//! wildcard) and a pool of ClusterLoadAssignments (each client subscribes to a few by name).
//! Names are `cluster-K`, `listener-K`, `eds-K`; a resource's version is `uG`, G being the update
//! that last changed it (0 = initial), so a client can tell from a version string alone whether it
//! holds an update; the body carries the same (see [`SyntheticBody`]).

use bytes::Bytes;
use prost::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use adsrelay::pb::discovery::Resource;
use adsrelay::xds::CachedResource;

/// The three resource types a simulated client subscribes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Cluster = 0,
    Listener = 1,
    Endpoints = 2,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Cluster, Kind::Listener, Kind::Endpoints];

    pub fn type_url(self) -> &'static str {
        match self {
            Kind::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            Kind::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
            Kind::Endpoints => "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        }
    }

    pub fn from_type_url(url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.type_url() == url)
    }

    pub fn name(self, index: u32) -> String {
        match self {
            Kind::Cluster => format!("cluster-{index}"),
            Kind::Listener => format!("listener-{index}"),
            Kind::Endpoints => format!("eds-{index}"),
        }
    }
}

/// `cluster-17` -> 17.
pub fn parse_index(name: &str) -> Option<u32> {
    name.rsplit('-').next()?.parse().ok()
}

pub fn version_string(generation: u32) -> String {
    format!("u{generation}")
}

/// `u3` -> 3.
pub fn parse_version(v: &str) -> Option<u32> {
    v.strip_prefix('u')?.parse().ok()
}

/// How updates pick the resources they change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdatePattern {
    /// `cluster-0` every time: a wildcard resource, so every client receives every update.
    One,
    /// One resource drawn uniformly from all Clusters, Listeners and the EDS pool.
    Random,
    /// Every resource changes.
    All,
}

/// The shape of the resource set and of each client's subscriptions.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    pub clusters: u32,
    pub listeners: u32,
    pub eds_pool: u32,
    pub eds_per_client: u32,
    pub resource_bytes: usize,
    pub seed: u64,
}

impl Workload {
    pub fn count(&self, kind: Kind) -> u32 {
        match kind {
            Kind::Cluster => self.clusters,
            Kind::Listener => self.listeners,
            Kind::Endpoints => self.eds_pool,
        }
    }

    /// Client `i`'s initial EDS names: `eds_per_client` distinct indices from the pool,
    /// deterministic in (seed, i).
    pub fn eds_for_client(&self, i: u32) -> Vec<u32> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ (u64::from(i) << 20) ^ 0x9e37_79b9);
        let n = self.eds_per_client.min(self.eds_pool) as usize;
        let mut v: Vec<u32> = rand::seq::index::sample(&mut rng, self.eds_pool as usize, n)
            .into_iter()
            .map(|x| x as u32)
            .collect();
        v.sort_unstable();
        v
    }

    /// Picks the resources update `generation` changes. Indices are sorted per kind.
    pub fn pick(&self, pattern: UpdatePattern, rng: &mut StdRng) -> Changed {
        let mut c = Changed::default();
        match pattern {
            UpdatePattern::One => c.names[0].push(0),
            UpdatePattern::All => {
                for kind in Kind::ALL {
                    c.names[kind as usize] = (0..self.count(kind)).collect();
                }
            }
            UpdatePattern::Random => {
                let total = self.clusters + self.listeners + self.eds_pool;
                let mut x = rng.random_range(0..total.max(1));
                for kind in Kind::ALL {
                    if x < self.count(kind) {
                        c.names[kind as usize].push(x);
                        break;
                    }
                    x -= self.count(kind);
                }
            }
        }
        c
    }
}

/// The resources one update changes, as sorted indices per [`Kind`].
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Changed {
    pub names: [Vec<u32>; 3],
}

impl Changed {
    pub fn len(&self) -> usize {
        self.names.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains_eds(&self, index: u32) -> bool {
        self.names[2].binary_search(&index).is_ok()
    }
}

/// The current version (generation) of every resource.
#[derive(Debug, Clone)]
pub struct Versions {
    pub v: [Vec<u32>; 3],
}

impl Versions {
    pub fn new(w: &Workload) -> Self {
        Versions {
            v: Kind::ALL.map(|k| vec![0; w.count(k) as usize]),
        }
    }

    pub fn apply(&mut self, changed: &Changed, generation: u32) {
        for (kind, names) in changed.names.iter().enumerate() {
            for &i in names {
                self.v[kind][i as usize] = generation;
            }
        }
    }
}

/// The body of every synthetic resource, laid out as a real one: field 1 is the name (as in
/// Cluster, Listener and ClusterLoadAssignment, so a SotW upstream can name it and
/// go-control-plane can carry it as its own message type), field 1000 the version of the update
/// that last changed it and field 1001 padding to the requested size. Clients read the version
/// from here where the server's own versions are not `uG` (SotW `Any`s carry none; a SotW
/// upstream and go-control-plane derive theirs from the bytes). bench/gcp-baseline builds the
/// same layout.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SyntheticBody {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "1000")]
    pub version: String,
    #[prost(bytes = "vec", tag = "1001")]
    pub padding: Vec<u8>,
}

impl SyntheticBody {
    /// (index, generation) this body carries.
    pub fn parse(value: &[u8]) -> Option<(u32, u32)> {
        let b = SyntheticBody::decode(value).ok()?;
        Some((parse_index(&b.name)?, parse_version(&b.version)?))
    }
}

/// The `Any` for (kind, index) at `generation`: a [`SyntheticBody`] of about `size` bytes.
pub fn resource_any(kind: Kind, index: u32, generation: u32, size: usize) -> prost_types::Any {
    let mut body = SyntheticBody {
        name: kind.name(index),
        version: version_string(generation),
        padding: Vec::new(),
    };
    // The padding field's own tag and length take up to 4 bytes (as gcp-baseline counts them).
    let base = body.encoded_len();
    if size > base + 4 {
        body.padding = vec![0; size - base - 4];
    }
    prost_types::Any {
        type_url: kind.type_url().into(),
        value: body.encode_to_vec(),
    }
}

/// The `envoy.service.discovery.v3.Resource` for (kind, index) at `generation`.
pub fn resource(kind: Kind, index: u32, generation: u32, size: usize) -> Resource {
    Resource {
        name: kind.name(index),
        version: version_string(generation),
        resource: Some(resource_any(kind, index, generation, size)),
        ..Default::default()
    }
}

/// The encoded `envoy.service.discovery.v3.Resource` for (kind, index) at `generation`: a body of
/// about `size` bytes in an `Any` of the kind's type.
pub fn encode_resource(kind: Kind, index: u32, generation: u32, size: usize) -> Bytes {
    Bytes::from(resource(kind, index, generation, size).encode_to_vec())
}

/// The whole resource set at `versions`, as the demo control plane takes it.
pub fn build_resources(w: &Workload, versions: &Versions) -> Vec<(String, CachedResource)> {
    let mut out = Vec::new();
    for kind in Kind::ALL {
        for (i, &g) in versions.v[kind as usize].iter().enumerate() {
            let enc = encode_resource(kind, i as u32, g, w.resource_bytes);
            let cached = CachedResource::decode(enc).expect("synthetic resource is valid");
            out.push((kind.type_url().to_string(), cached));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> Workload {
        Workload {
            clusters: 5,
            listeners: 2,
            eds_pool: 50,
            eds_per_client: 4,
            resource_bytes: 64,
            seed: 1,
        }
    }

    #[test]
    fn names_and_versions_round_trip() {
        assert_eq!(parse_index(&Kind::Endpoints.name(42)), Some(42));
        assert_eq!(parse_version(&version_string(7)), Some(7));
        let r = build_resources(&w(), &Versions::new(&w()));
        assert_eq!(r.len(), 57);
        assert_eq!(&*r[0].1.name, "cluster-0");
        assert_eq!(r[0].1.version, "u0");
        let any = resource_any(Kind::Endpoints, 42, 7, 1024);
        assert_eq!(SyntheticBody::parse(&any.value), Some((42, 7)));
        assert!(
            (1020..=1024).contains(&any.value.len()),
            "{}",
            any.value.len()
        );
    }

    #[test]
    fn eds_choice_is_deterministic_and_distinct() {
        let a = w().eds_for_client(3);
        assert_eq!(a, w().eds_for_client(3));
        let mut d = a.clone();
        d.dedup();
        assert_eq!(d.len(), 4);
    }
}
