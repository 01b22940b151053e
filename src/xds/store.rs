//! The resource store of one aggregation group: every resource the upstream sent, per type, as
//! encoded bytes, plus what the upstream said does not exist. Pure data; the adapter wraps it in a
//! lock and turns the returned change sets into notifications.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;

use super::resource::{CachedResource, Name, ResourceError};

/// What the store knows about one name.
#[derive(Debug, PartialEq)]
pub enum Lookup<'a> {
    Present(&'a Arc<CachedResource>),
    /// The upstream said authoritatively that the name does not exist.
    Absent,
    /// Nothing known yet: wait for the upstream rather than tell a client it does not exist (D9).
    Unknown,
}

#[derive(Debug, Default)]
struct TypeStore {
    resources: BTreeMap<Name, Arc<CachedResource>>,
    absent: HashSet<Name>,
    /// The upstream has answered a wildcard subscription of this type at least once, so names it
    /// did not send are really not part of the wildcard set.
    wildcard_synced: bool,
}

/// Names whose content or existence changed in one upstream response.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ChangeSet {
    pub type_url: String,
    pub names: Vec<Name>,
    /// This response completed the first wildcard sync of the type: initial wildcard requests that
    /// were waiting for it can now be answered.
    pub wildcard_synced_now: bool,
}

impl ChangeSet {
    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && !self.wildcard_synced_now
    }
}

/// Why an upstream response was rejected as a whole (and NACKed); nothing of it was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("resource #{index}: {source}")]
    BadResource { index: usize, source: ResourceError },
    #[error("resource {name:?} has type {got:?}, response type_url is {want:?}")]
    TypeMismatch {
        name: String,
        got: String,
        want: String,
    },
    #[error("duplicate resource name {0:?} among added/updated resources")]
    DuplicateName(String),
    #[error("resource name {0:?} is both added and removed")]
    AddedAndRemoved(String),
    #[error("resource {name:?} has no body and version {got:?} does not match the held version")]
    HeartbeatVersionMismatch { name: String, got: String },
}

#[derive(Debug, Default)]
pub struct Store {
    types: HashMap<String, TypeStore>,
    /// The store is the source of truth (the demo control plane): names it lacks do not exist.
    complete: bool,
}

impl Store {
    /// A store filled from an upstream: missing names are unknown until the upstream answers.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that is the source of truth, as in a control plane: every missing name is absent and
    /// every wildcard is synced.
    pub fn complete(resources: impl IntoIterator<Item = (String, CachedResource)>) -> Self {
        let mut store = Store {
            types: HashMap::new(),
            complete: true,
        };
        for (type_url, r) in resources {
            let ts = store.types.entry(type_url).or_default();
            ts.resources.insert(r.name.clone(), Arc::new(r));
        }
        store
    }

    pub fn lookup(&self, type_url: &str, name: &str) -> Lookup<'_> {
        let Some(ts) = self.types.get(type_url) else {
            return if self.complete {
                Lookup::Absent
            } else {
                Lookup::Unknown
            };
        };
        match ts.resources.get(name) {
            Some(r) => Lookup::Present(r),
            None if self.complete || ts.absent.contains(name) => Lookup::Absent,
            None => Lookup::Unknown,
        }
    }

    pub fn wildcard_synced(&self, type_url: &str) -> bool {
        self.complete || self.types.get(type_url).is_some_and(|t| t.wildcard_synced)
    }

    /// Every resource held for a type, in name order.
    pub fn resources(&self, type_url: &str) -> impl Iterator<Item = &Arc<CachedResource>> {
        self.types
            .get(type_url)
            .into_iter()
            .flat_map(|t| t.resources.values())
    }

    pub fn type_urls(&self) -> impl Iterator<Item = &str> {
        self.types.keys().map(String::as_str)
    }

    /// Versions to report in `initial_resource_versions` on a new upstream stream: every held
    /// resource still wanted, except content the relay may not keep (C4).
    pub fn initial_versions(
        &self,
        type_url: &str,
        wanted: impl Fn(&str) -> bool,
    ) -> HashMap<String, String> {
        self.resources(type_url)
            .filter(|r| !r.do_not_cache && wanted(&r.name))
            .map(|r| (r.name.to_string(), r.version.clone()))
            .collect()
    }

    /// Applies one upstream Delta response atomically: either everything or, on error, nothing.
    /// `resources` must be owned bytes (not slices of a receive buffer).
    pub fn apply_delta(
        &mut self,
        type_url: &str,
        resources: Vec<Bytes>,
        removed: Vec<String>,
        wildcard_subscribed: bool,
    ) -> Result<ChangeSet, ApplyError> {
        let mut parsed = Vec::with_capacity(resources.len());
        let mut seen = HashSet::with_capacity(resources.len());
        let held = self.types.get(type_url);
        for (index, bytes) in resources.into_iter().enumerate() {
            let r = CachedResource::decode(bytes)
                .map_err(|source| ApplyError::BadResource { index, source })?;
            if !seen.insert(r.name.clone()) {
                return Err(ApplyError::DuplicateName(r.name.to_string()));
            }
            if r.is_heartbeat() {
                let held_version = held
                    .and_then(|t| t.resources.get(&r.name))
                    .map(|h| h.version.as_str());
                if held_version != Some(r.version.as_str()) {
                    return Err(ApplyError::HeartbeatVersionMismatch {
                        name: r.name.to_string(),
                        got: r.version,
                    });
                }
            } else if r.body_type_url != type_url {
                return Err(ApplyError::TypeMismatch {
                    name: r.name.to_string(),
                    got: r.body_type_url,
                    want: type_url.to_string(),
                });
            }
            parsed.push(r);
        }
        if let Some(both) = removed.iter().find(|n| seen.contains(n.as_str())) {
            return Err(ApplyError::AddedAndRemoved(both.clone()));
        }

        // Validated: from here on the response is applied in full.
        let ts = self.types.entry(type_url.to_string()).or_default();
        let mut changes = ChangeSet {
            type_url: type_url.to_string(),
            ..ChangeSet::default()
        };
        for r in parsed {
            // A heartbeat only refreshes a TTL; the held content stays as it is.
            if r.is_heartbeat() {
                continue;
            }
            ts.absent.remove(&r.name);
            if ts
                .resources
                .get(&r.name)
                .is_some_and(|h| h.encoded == r.encoded)
            {
                continue;
            }
            changes.names.push(r.name.clone());
            ts.resources.insert(r.name.clone(), Arc::new(r));
        }
        for name in removed {
            let name: Name = name.into();
            ts.resources.remove(&name);
            if ts.absent.insert(name.clone()) {
                changes.names.push(name);
            }
        }
        if wildcard_subscribed && !ts.wildcard_synced {
            ts.wildcard_synced = true;
            changes.wildcard_synced_now = true;
        }
        Ok(changes)
    }

    /// The upstream subscription for `name` lapsed: what is held may go stale, so drop it (D5).
    pub fn forget(&mut self, type_url: &str, name: &str) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.resources.remove(name);
            ts.absent.remove(name);
        }
    }

    /// The upstream wildcard subscription lapsed: keep only names still wanted explicitly.
    pub fn forget_wildcard(&mut self, type_url: &str, still_wanted: impl Fn(&str) -> bool) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.resources.retain(|n, _| still_wanted(n));
            ts.absent.retain(|n| still_wanted(n));
            ts.wildcard_synced = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::Resource;
    use prost::Message;

    const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

    pub(crate) fn res(name: &str, version: &str, body: &[u8]) -> Bytes {
        Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: T.into(),
                value: body.to_vec(),
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    #[test]
    fn apply_add_update_remove() {
        let mut s = Store::new();
        assert_eq!(s.lookup(T, "a"), Lookup::Unknown);
        let c = s
            .apply_delta(
                T,
                vec![res("a", "1", b"x"), res("b", "1", b"y")],
                vec![],
                true,
            )
            .unwrap();
        assert_eq!(c.names.len(), 2);
        assert!(c.wildcard_synced_now);
        // Identical content is not a change.
        let c = s
            .apply_delta(T, vec![res("a", "1", b"x")], vec![], true)
            .unwrap();
        assert!(c.is_empty());
        let c = s.apply_delta(T, vec![], vec!["b".into()], true).unwrap();
        assert_eq!(c.names, vec![Name::from("b")]);
        assert_eq!(s.lookup(T, "b"), Lookup::Absent);
        assert!(matches!(s.lookup(T, "a"), Lookup::Present(r) if r.version == "1"));
    }

    #[test]
    fn invalid_response_changes_nothing() {
        let mut s = Store::new();
        s.apply_delta(T, vec![res("a", "1", b"x")], vec![], false)
            .unwrap();
        let dup = s.apply_delta(
            T,
            vec![res("a", "2", b"x"), res("a", "3", b"y")],
            vec![],
            false,
        );
        assert_eq!(dup, Err(ApplyError::DuplicateName("a".into())));
        let both = s.apply_delta(T, vec![res("a", "2", b"z")], vec!["a".into()], false);
        assert_eq!(both, Err(ApplyError::AddedAndRemoved("a".into())));
        let wrong = s.apply_delta("other", vec![res("c", "1", b"x")], vec![], false);
        assert!(matches!(wrong, Err(ApplyError::TypeMismatch { .. })));
        assert!(matches!(s.lookup(T, "a"), Lookup::Present(r) if r.version == "1"));
    }

    #[test]
    fn initial_versions_only_for_wanted() {
        let mut s = Store::new();
        s.apply_delta(
            T,
            vec![res("a", "1", b"x"), res("b", "2", b"y")],
            vec![],
            false,
        )
        .unwrap();
        let v = s.initial_versions(T, |n| n == "b");
        assert_eq!(v, HashMap::from([("b".to_string(), "2".to_string())]));
    }
}
