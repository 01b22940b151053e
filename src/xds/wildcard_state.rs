//! The state of the world a wildcard-only SotW subscriber gets, and the whole content a Delta
//! wildcard-only subscriber that holds nothing yet gets (a join, a restarted client), each built
//! once per store change and shared by every such stream of the group.
//!
//! A full-state type (Listener, Cluster) answers each change with everything the client holds. A
//! wildcard-only subscriber with the group's usual dynamic parameters holds exactly the store's
//! content for the type, so its response is the same for all of them: which resources (and their
//! bytes), what each then holds, and the `version_info` digest of that. Building it per client
//! costs a store lookup, a map insert and a digest per resource per client (most of a SotW update's
//! CPU with 100 Clusters); built here it costs that once per change, and each stream compares what
//! it holds against the shared list.
//!
//! A Delta client joining by wildcard likewise receives every resource of the type: per client that
//! was a store lookup, a record, an undo entry and a duplicate check per resource; shared, the
//! stream takes the list, and holds it as its record while that is exactly what it holds
//! (`holdings::DeltaWildcard`).
//!
//! Kept in the store it was built from, keyed by (type, wrapping, parameters),
//! and dropped by every change to the store, so an entry is never stale.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::constraints::{ConstraintKey, Params};
use super::resource::Locator;
use crate::sync::lock;

/// What a SotW client holds for one subscription: the variant and its version.
pub type Held = (ConstraintKey, String);

/// One type's full state for a wildcard subscriber.
#[derive(Debug)]
pub struct WildcardState {
    /// What the client holds after receiving it, in locator order.
    pub held: Vec<(Locator, Held)>,
    /// The response's resources, in the same order.
    pub resources: Vec<Bytes>,
    /// The response's `version_info`: the digest of `held`.
    pub version_info: String,
}

struct Entry<T> {
    type_url: String,
    wrap: bool,
    params: Arc<Params>,
    /// `None`: this type cannot be answered from a shared state now (not yet synced, or content
    /// that must not be shared), so each stream builds its own response.
    state: Option<Arc<T>>,
}

/// Past this many (type, wrapping, parameters) keys the memo starts over: a group whose clients
/// carry many distinct parameter sets gains little from it.
const MAX_ENTRIES: usize = 32;

/// What [`WildcardStates::get_or_build`] does with a new key when the memo is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenFull {
    /// Forget every entry and build this one: for a caller that needs the state (a join).
    StartOver,
    /// Build nothing and return `None`: for a caller that can do without (a Delta update), so
    /// a group with more parameter sets than the memo keeps does not rebuild a type's whole
    /// content per stream.
    GiveUp,
}

/// The shared states (SotW: [`WildcardState`]; Delta: `holdings::DeltaWildcard`) built since
/// the store last changed.
pub struct WildcardStates<T = WildcardState>(Mutex<Vec<Entry<T>>>);

impl<T> Default for WildcardStates<T> {
    fn default() -> Self {
        WildcardStates(Mutex::new(Vec::new()))
    }
}

impl<T> std::fmt::Debug for WildcardStates<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("WildcardStates")
            .field(&lock(&self.0).len())
            .finish()
    }
}

impl<T> WildcardStates<T> {
    /// The shared state for (type, wrapping, parameters), built by `build` the first time it is
    /// asked for since the store changed. Building under the lock: streams woken by one change
    /// wait for the first build rather than repeat it. `when_full`: what to do when the key is
    /// new and the memo holds [`MAX_ENTRIES`] already.
    pub fn get_or_build(
        &self,
        type_url: &str,
        wrap: bool,
        params: &Arc<Params>,
        when_full: WhenFull,
        build: impl FnOnce() -> Option<T>,
    ) -> Option<Arc<T>> {
        let mut entries = lock(&self.0);
        let found = entries.iter().find(|e| {
            e.wrap == wrap
                && e.type_url == type_url
                && (Arc::ptr_eq(&e.params, params) || e.params == *params)
        });
        if let Some(e) = found {
            return e.state.clone();
        }
        if entries.len() >= MAX_ENTRIES {
            match when_full {
                WhenFull::StartOver => entries.clear(),
                WhenFull::GiveUp => return None,
            }
        }
        let state = build().map(Arc::new);
        entries.push(Entry {
            type_url: type_url.to_string(),
            wrap,
            params: params.clone(),
            state: state.clone(),
        });
        state
    }

    /// The store changed: nothing built before is current.
    pub fn clear(&mut self) {
        match self.0.get_mut() {
            Ok(entries) => entries.clear(),
            Err(poisoned) => poisoned.into_inner().clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(version: &str) -> WildcardState {
        WildcardState {
            held: Vec::new(),
            resources: Vec::new(),
            version_info: version.into(),
        }
    }

    #[test]
    fn built_once_per_key_until_cleared() {
        let mut states = WildcardStates::default();
        let params = Arc::new(Params::new());
        let mut builds = 0;
        for _ in 0..3 {
            let s = states.get_or_build("t", false, &params, WhenFull::StartOver, || {
                builds += 1;
                Some(state("1"))
            });
            assert_eq!(s.map(|s| s.version_info.clone()).as_deref(), Some("1"));
        }
        assert_eq!(
            builds, 1,
            "one build serves every stream until the store changes"
        );
        // Equal parameters in another allocation share the entry; other keys do not.
        let same = Arc::new(Params::new());
        assert!(states
            .get_or_build("t", false, &same, WhenFull::StartOver, || None)
            .is_some());
        assert!(states
            .get_or_build("t", true, &params, WhenFull::StartOver, || None)
            .is_none());
        states.clear();
        let s = states.get_or_build("t", false, &params, WhenFull::StartOver, || {
            Some(state("2"))
        });
        assert_eq!(s.map(|s| s.version_info.clone()).as_deref(), Some("2"));
    }

    #[test]
    fn a_full_memo_is_kept_for_callers_that_can_do_without() {
        let states = WildcardStates::default();
        let types: Vec<String> = (0..=MAX_ENTRIES).map(|i| format!("t{i}")).collect();
        let params = Arc::new(Params::new());
        for t in &types[..MAX_ENTRIES] {
            assert!(states
                .get_or_build(t, false, &params, WhenFull::StartOver, || Some(state("1")))
                .is_some());
        }
        let last = &types[MAX_ENTRIES];
        let mut built = false;
        let s = states.get_or_build(last, false, &params, WhenFull::GiveUp, || {
            built = true;
            Some(state("1"))
        });
        assert!(
            s.is_none() && !built,
            "no room: no build, and the memo stays"
        );
        assert!(
            states
                .get_or_build(&types[0], false, &params, WhenFull::GiveUp, || None)
                .is_some(),
            "what the memo holds is still served"
        );
        assert!(states
            .get_or_build(last, false, &params, WhenFull::StartOver, || Some(state(
                "1"
            )))
            .is_some());
    }
}
