//! One allocation per distinct resource name in the whole process.
//!
//! Ten thousand clients subscribing to the same ClusterLoadAssignment each send its name; kept as
//! sent, every client's subscriptions, held records and the store would each own a copy. Names
//! taken in through [`intern`] share one refcounted string instead, so a name costs its bytes once plus a
//! pointer per holder. The versions clients report on reconnecting (Delta
//! `initial_resource_versions`) go through the same pool: a fleet reports the same few.
//!
//! The pool holds every name it handed out. Names nobody else holds any more are dropped by a
//! sweep when a shard has doubled since its last sweep, so the pool stays within about twice the
//! live names and a sweep's cost is amortized over the insertions that triggered it. Sharded so
//! that streams on different threads rarely wait for each other.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::{LazyLock, Mutex};

use arcstr::ArcStr;

use crate::sync::lock;

/// Resource names are shared by the store, every subscriber index and every pending set, so they are
/// reference counted rather than copied per client; a thin pointer (length and count live with the
/// bytes), since every stream keeps a couple of hundred of them in its records.
pub type Name = ArcStr;

/// The xDS type URLs, interned as static strings: cloning or dropping one touches no shared count.
/// Every stream keys its per-type state by a type URL and clones it per response; refcounted,
/// ten thousand streams on two cores kept that count's cache line moving between the cores, and
/// reading the string's length beside it was 2 % of the relay's CPU per update.
const TYPE_URLS: [Name; TYPE_URL_COUNT] = [
    arcstr::literal!(type_urls::CLUSTER),
    arcstr::literal!(type_urls::ENDPOINTS),
    arcstr::literal!(type_urls::LISTENER),
    arcstr::literal!(type_urls::ROUTE),
    arcstr::literal!(type_urls::SCOPED_ROUTE),
    arcstr::literal!(type_urls::VIRTUAL_HOST),
    arcstr::literal!(type_urls::SECRET),
    arcstr::literal!(type_urls::RUNTIME),
    arcstr::literal!(type_urls::EXTENSION_CONFIG),
];

/// The xDS resource type URLs the relay knows by name (the per-type services, SotW full state).
pub mod type_urls {
    pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    pub const ENDPOINTS: &str =
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    pub const SCOPED_ROUTE: &str =
        "type.googleapis.com/envoy.config.route.v3.ScopedRouteConfiguration";
    pub const VIRTUAL_HOST: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";
    pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
    pub const RUNTIME: &str = "type.googleapis.com/envoy.service.runtime.v3.Runtime";
    pub const EXTENSION_CONFIG: &str =
        "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
}

/// How many type URLs [`type_url_index`] knows.
pub const TYPE_URL_COUNT: usize = 9;

/// The position of an xDS type URL among the well-known ones, for tables indexed by type.
pub fn type_url_index(type_url: &str) -> Option<usize> {
    TYPE_URLS.iter().position(|t| t.as_str() == type_url)
}

/// A hash map keyed by names, or by locators (a name and its parameters): the group's
/// subscriber index and interest counts look names up several times per subscription, and
/// foldhash costs a fraction of the standard library's SipHash on names this short. Seeded per
/// process (names come from peers), as the standard hasher is.
pub type NameMap<K, V> = HashMap<K, V, Hasher>;
/// The core's hasher for maps whose keys are names, type URLs or other peer-sent strings:
/// [`NameMap`], the pool, the store's types, a response's resources.
pub type Hasher = foldhash::fast::RandomState;

/// A name-keyed map with hash lookups and walks in name order: the store's per-type table, which
/// a join or a resume looks up several times per subscribed name (a B-tree search there compared
/// long shared name prefixes, 13-18 % of join CPU), while wildcard answers and glob collections
/// (A28: a prefix range) walk it in order. The order is a second index of the same `Name`s
/// (pointers, not copies), changed only when a name is added or removed.
#[derive(Debug)]
pub struct SortedNameMap<V> {
    entries: NameMap<Name, V>,
    order: BTreeSet<Name>,
}

impl<V> Default for SortedNameMap<V> {
    fn default() -> Self {
        SortedNameMap {
            entries: NameMap::default(),
            order: BTreeSet::new(),
        }
    }
}

impl<V> SortedNameMap<V> {
    pub fn get(&self, name: &str) -> Option<&V> {
        self.entries.get(name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut V> {
        self.entries.get_mut(name)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The entry for `name`, made with `V::default()` if there is none.
    pub fn or_default(&mut self, name: &Name) -> &mut V
    where
        V: Default,
    {
        match self.entries.entry(name.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                self.order.insert(name.clone());
                e.insert(V::default())
            }
        }
    }

    pub fn remove(&mut self, name: &str) -> Option<V> {
        let removed = self.entries.remove(name);
        if removed.is_some() {
            self.order.remove(name);
        }
        removed
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&Name, &mut V) -> bool) {
        self.entries.retain(|n, v| keep(n, v));
        if self.order.len() != self.entries.len() {
            let entries = &self.entries;
            self.order.retain(|n| entries.contains_key(n));
        }
    }

    /// Every entry, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&Name, &V)> {
        self.order
            .iter()
            .filter_map(|n| self.entries.get_key_value(n))
    }

    /// The entries from `from` on, in name order.
    pub fn iter_from<'a>(
        &'a self,
        from: &str,
    ) -> impl Iterator<Item = (&'a Name, &'a V)> + use<'a, V> {
        self.order
            .range::<str, _>((std::ops::Bound::Included(from), std::ops::Bound::Unbounded))
            .filter_map(|n| self.entries.get_key_value(n))
    }

    /// Every value, in no particular order (no walk of the sorted index).
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.values()
    }

    /// Every entry, in no particular order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&Name, &mut V)> {
        self.entries.iter_mut()
    }
}

const SHARDS: usize = 16;
/// A shard is not swept before it holds this many names.
const MIN_SWEEP: usize = 256;

#[derive(Default)]
struct Shard {
    names: HashSet<Name, Hasher>,
    /// Names left after the last sweep.
    after_sweep: usize,
}

static POOL: LazyLock<[Mutex<Shard>; SHARDS]> =
    LazyLock::new(|| std::array::from_fn(|_| Mutex::default()));
/// Picks a name's shard.
static SHARD_OF: LazyLock<Hasher> = LazyLock::new(Hasher::default);

/// The shared `Name` for `name`.
pub fn intern(name: &str) -> Name {
    if let Some(i) = type_url_index(name) {
        return TYPE_URLS[i].clone();
    }
    let hash = SHARD_OF.hash_one(name);
    let mut shard = lock(&POOL[hash as usize % SHARDS]);
    if let Some(n) = shard.names.get(name) {
        return n.clone();
    }
    if shard.names.len() >= (2 * shard.after_sweep).max(MIN_SWEEP) {
        // Only the pool holds such a name, and only under this lock could anyone get it.
        shard
            .names
            .retain(|n| ArcStr::strong_count(n).is_some_and(|c| c > 1));
        shard.after_sweep = shard.names.len();
    }
    let n = Name::from(name);
    shard.names.insert(n.clone());
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pooled(name: &str) -> bool {
        let hash = SHARD_OF.hash_one(name);
        lock(&POOL[hash as usize % SHARDS]).names.contains(name)
    }

    #[test]
    fn sorted_name_map_walks_in_order_and_follows_removals() {
        let mut m: SortedNameMap<u32> = SortedNameMap::default();
        for (i, n) in ["b/2", "a", "b/1", "c"].into_iter().enumerate() {
            *m.or_default(&Name::from(n)) = i as u32;
        }
        *m.or_default(&Name::from("a")) += 10;
        let names =
            |m: &SortedNameMap<u32>| m.iter().map(|(n, _)| n.to_string()).collect::<Vec<_>>();
        assert_eq!(names(&m), ["a", "b/1", "b/2", "c"]);
        assert_eq!(m.get("a"), Some(&11));
        let from_b: Vec<&str> = m.iter_from("b/").map(|(n, _)| &**n).collect();
        assert_eq!(from_b, ["b/1", "b/2", "c"]);
        assert_eq!(m.remove("b/1"), Some(2));
        assert_eq!(m.remove("b/1"), None);
        m.retain(|n, _| &**n != "c");
        assert_eq!(names(&m), ["a", "b/2"]);
        assert!(!m.contains_key("c") && m.contains_key("b/2"));
        let mut values: Vec<u32> = m.values().copied().collect();
        values.sort();
        assert_eq!(values, [0, 11]);
    }

    #[test]
    fn equal_names_share_one_allocation() {
        let cds = intern(type_urls::CLUSTER);
        assert!(ArcStr::is_static(&cds), "type URLs carry no refcount");
        assert!(!ArcStr::is_static(&intern("names-test-cluster-a")));
        let a = intern("names-test-cluster-a");
        let b = intern(&String::from("names-test-cluster-a"));
        assert!(ArcStr::ptr_eq(&a, &b));
        assert!(!ArcStr::ptr_eq(&a, &intern("names-test-cluster-b")));
    }

    #[test]
    fn names_nobody_holds_are_dropped_by_a_later_sweep() {
        let kept = intern("names-test-kept");
        drop(intern("names-test-dropped"));
        assert!(pooled("names-test-dropped"));
        // Enough new names to make every shard sweep at least once.
        let fill: Vec<Name> = (0..SHARDS * MIN_SWEEP * 4)
            .map(|i| intern(&format!("names-test-fill-{i}")))
            .collect();
        assert!(
            !pooled("names-test-dropped"),
            "an unheld name stays in the pool"
        );
        assert!(ArcStr::ptr_eq(&kept, &intern("names-test-kept")));
        drop(fill);
    }
}
