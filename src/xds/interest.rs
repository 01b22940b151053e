//! The refcounted union of downstream interest in one aggregation group, and the upstream
//! subscription changes it implies (C1, C2, C15). The wildcard is the name `"*"`, counted like any
//! other. Time is passed in, so the unsubscribe linger is testable without a clock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::resource::Name;

pub const WILDCARD: &str = "*";

#[derive(Debug, Default)]
struct TypeInterest {
    refs: HashMap<Name, u32>,
    /// Names nobody wants any more, kept subscribed upstream until the deadline (C15).
    lingering: HashMap<Name, Instant>,
    /// Changes not yet sent upstream.
    subscribe: BTreeSet<Name>,
    unsubscribe: BTreeSet<Name>,
    /// `"*"` has been sent upstream (on the current stream): only responses after that can count
    /// as the wildcard's answer (D9).
    wildcard_sent: bool,
}

/// Subscription changes for one type, ready to become a `DeltaDiscoveryRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamChange {
    pub type_url: String,
    pub subscribe: Vec<Name>,
    pub unsubscribe: Vec<Name>,
}

#[derive(Debug, Default)]
pub struct Interest {
    types: BTreeMap<String, TypeInterest>,
    linger: Duration,
}

impl Interest {
    pub fn new(linger: Duration) -> Self {
        Interest {
            types: BTreeMap::new(),
            linger,
        }
    }

    /// One more downstream subscriber wants `name`. Only the first one (that is not already kept by
    /// the linger) causes an upstream subscribe.
    pub fn acquire(&mut self, type_url: &str, name: &Name) {
        let ti = self.types.entry(type_url.to_string()).or_default();
        let count = ti.refs.entry(name.clone()).or_insert(0);
        *count += 1;
        if *count == 1 && ti.lingering.remove(name).is_none() && !ti.unsubscribe.remove(name) {
            ti.subscribe.insert(name.clone());
        }
    }

    /// One downstream subscriber left `name`. The last one starts the linger (or unsubscribes at
    /// once with a zero linger). Releasing a name that is not held is ignored.
    pub fn release(&mut self, type_url: &str, name: &Name, now: Instant) {
        let Some(ti) = self.types.get_mut(type_url) else {
            return;
        };
        let Some(count) = ti.refs.get_mut(name) else {
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        ti.refs.remove(name);
        if self.linger.is_zero() {
            Self::drop_upstream(ti, name);
        } else {
            ti.lingering.insert(name.clone(), now + self.linger);
        }
    }

    fn drop_upstream(ti: &mut TypeInterest, name: &Name) {
        // A subscribe that never went out needs no unsubscribe.
        if !ti.subscribe.remove(name) {
            ti.unsubscribe.insert(name.clone());
        }
    }

    /// Ends lingers that have expired. Returns the names whose upstream subscription now lapses, so
    /// the caller can drop what it holds for them.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Name)> {
        let mut lapsed = Vec::new();
        for (type_url, ti) in self.types.iter_mut() {
            let expired: Vec<Name> = ti
                .lingering
                .iter()
                .filter(|(_, deadline)| **deadline <= now)
                .map(|(n, _)| n.clone())
                .collect();
            for name in expired {
                ti.lingering.remove(&name);
                Self::drop_upstream(ti, &name);
                lapsed.push((type_url.clone(), name));
            }
        }
        lapsed
    }

    /// The earliest linger deadline, so the adapter knows when to call `expire`.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.types
            .values()
            .flat_map(|t| t.lingering.values())
            .min()
            .copied()
    }

    /// Takes the subscription changes that have not been sent upstream yet.
    pub fn take_changes(&mut self) -> Vec<UpstreamChange> {
        self.types
            .iter_mut()
            .filter(|(_, t)| !t.subscribe.is_empty() || !t.unsubscribe.is_empty())
            .map(|(type_url, t)| {
                if t.subscribe.contains(WILDCARD) {
                    t.wildcard_sent = true;
                }
                if t.unsubscribe.contains(WILDCARD) {
                    t.wildcard_sent = false;
                }
                UpstreamChange {
                    type_url: type_url.clone(),
                    subscribe: std::mem::take(&mut t.subscribe).into_iter().collect(),
                    unsubscribe: std::mem::take(&mut t.unsubscribe).into_iter().collect(),
                }
            })
            .collect()
    }

    /// For a new upstream stream: per type, every name wanted now (held or lingering), in order.
    /// Pending changes are folded in, since the new stream starts from this full set (C4).
    pub fn resubscribe_all(&mut self) -> Vec<(String, Vec<Name>)> {
        let mut out = Vec::new();
        for (type_url, ti) in self.types.iter_mut() {
            ti.subscribe.clear();
            ti.unsubscribe.clear();
            let names: BTreeSet<Name> =
                ti.refs.keys().chain(ti.lingering.keys()).cloned().collect();
            ti.wildcard_sent = names.contains(WILDCARD);
            if !names.is_empty() {
                out.push((type_url.clone(), names.into_iter().collect()));
            }
        }
        out
    }

    /// Whether the upstream subscription for `name` is (or will be) held.
    pub fn wants(&self, type_url: &str, name: &str) -> bool {
        self.types
            .get(type_url)
            .is_some_and(|t| t.refs.contains_key(name) || t.lingering.contains_key(name))
    }

    /// Whether anything of this type is subscribed upstream.
    pub fn has_type(&self, type_url: &str) -> bool {
        self.types
            .get(type_url)
            .is_some_and(|t| !t.refs.is_empty() || !t.lingering.is_empty())
    }

    /// Whether `"*"` has gone out upstream, so a response now may be the wildcard's answer.
    pub fn wildcard_sent(&self, type_url: &str) -> bool {
        self.types.get(type_url).is_some_and(|t| t.wildcard_sent)
    }

    pub fn is_wildcard(&self, type_url: &str) -> bool {
        self.wants(type_url, WILDCARD)
    }

    /// Number of downstream references to `name` (for introspection and tests).
    pub fn refcount(&self, type_url: &str, name: &str) -> u32 {
        self.types
            .get(type_url)
            .and_then(|t| t.refs.get(name))
            .copied()
            .unwrap_or(0)
    }

    /// Distinct names (including `"*"`) subscribed upstream, summed over types.
    pub fn upstream_subscription_count(&self) -> usize {
        self.types
            .values()
            .map(|t| t.refs.len() + t.lingering.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: &str = "eds";

    fn n(s: &str) -> Name {
        s.into()
    }

    #[test]
    fn first_acquire_and_last_release_reach_upstream_once() {
        let now = Instant::now();
        let mut i = Interest::new(Duration::ZERO);
        i.acquire(T, &n("foo"));
        i.acquire(T, &n("foo"));
        assert_eq!(
            i.take_changes(),
            vec![UpstreamChange {
                type_url: T.into(),
                subscribe: vec![n("foo")],
                unsubscribe: vec![]
            }]
        );
        i.release(T, &n("foo"), now);
        assert!(i.take_changes().is_empty());
        i.release(T, &n("foo"), now);
        assert_eq!(i.take_changes()[0].unsubscribe, vec![n("foo")]);
        // A phantom release is ignored.
        i.release(T, &n("foo"), now);
        assert!(i.take_changes().is_empty());
    }

    #[test]
    fn linger_absorbs_quick_resubscribe() {
        let t0 = Instant::now();
        let mut i = Interest::new(Duration::from_secs(5));
        i.acquire(T, &n("foo"));
        i.take_changes();
        i.release(T, &n("foo"), t0);
        assert_eq!(i.next_deadline(), Some(t0 + Duration::from_secs(5)));
        i.acquire(T, &n("foo"));
        assert!(i.take_changes().is_empty());
        i.release(T, &n("foo"), t0);
        assert!(i.expire(t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(
            i.expire(t0 + Duration::from_secs(5)),
            vec![(T.into(), n("foo"))]
        );
        assert_eq!(i.take_changes()[0].unsubscribe, vec![n("foo")]);
    }

    #[test]
    fn subscribe_then_unsubscribe_before_send_cancels_out() {
        let mut i = Interest::new(Duration::ZERO);
        i.acquire(T, &n("a"));
        i.release(T, &n("a"), Instant::now());
        assert!(i.take_changes().is_empty());
    }

    proptest! {
        /// Whatever the interleaving, the changes sent upstream always describe exactly the set of
        /// names with a positive refcount.
        #[test]
        fn upstream_view_equals_refcounted_union(ops in proptest::collection::vec((0u8..4, any::<bool>()), 0..200)) {
            let now = Instant::now();
            let mut i = Interest::new(Duration::ZERO);
            let mut counts = [0u32; 4];
            let mut upstream = BTreeSet::new();
            for (name, acquire) in ops {
                let nm = n(&name.to_string());
                if acquire {
                    counts[name as usize] += 1;
                    i.acquire(T, &nm);
                } else if counts[name as usize] > 0 {
                    counts[name as usize] -= 1;
                    i.release(T, &nm, now);
                }
                for c in i.take_changes() {
                    for s in c.subscribe { prop_assert!(upstream.insert(s)); }
                    for u in c.unsubscribe { prop_assert!(upstream.remove(&u)); }
                }
            }
            let want: BTreeSet<Name> = (0..4).filter(|k| counts[*k] > 0).map(|k| n(&k.to_string())).collect();
            prop_assert_eq!(upstream, want);
        }
    }
}
