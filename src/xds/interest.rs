//! The refcounted union of downstream interest in one aggregation group, and the upstream
//! subscription changes it implies (C1, C2, C15, E13). Interest is counted per [`Locator`] (name
//! and exact parameter set); the wildcard is the plain name `"*"`, counted like any other. Time is
//! passed in, so the unsubscribe linger and the refetch fallback are testable without a clock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::names::NameMap;
use super::resource::{Locator, Name};

pub const WILDCARD: &str = "*";

/// How long a forced re-send (C3) may take before the relay falls back to unsubscribe+subscribe,
/// for upstreams that do not resend on a repeated subscribe (go-control-plane).
pub const REFETCH_FALLBACK: Duration = Duration::from_secs(2);

/// How long the group waits for an answer to a `"*"` added to a running upstream stream before
/// serving its wildcard subscribers from the cache. A conforming Delta server must answer only
/// the first wildcard request of a type on a stream (go-control-plane sends nothing when the
/// wildcard adds no resource), so readiness cannot depend on that answer (B2/D9 liveness). Names
/// the server has that the relay lacks arrive as an ordinary response, usually well within this
/// wait; the cache served after it is not authoritative for removals (A12): only a real answer
/// makes it so. Forcing an answer by re-listing a held name (A7) is not used: go-control-plane
/// does not resend on a repeated subscribe, and a type may hold no name to re-list.
pub const WILDCARD_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
struct TypeInterest {
    refs: NameMap<Locator, u32>,
    /// Locators per name, for `wants(name)`.
    names: NameMap<Name, u32>,
    /// Locators per name with a downstream reference (not lingering), for `referenced(name)`.
    referenced: NameMap<Name, u32>,
    /// Locators nobody wants any more, kept subscribed upstream until the deadline (C15).
    lingering: HashMap<Locator, Instant>,
    /// Changes not yet sent upstream.
    subscribe: BTreeSet<Locator>,
    unsubscribe: BTreeSet<Locator>,
    /// Refetches (C3) waiting for the upstream to resend, with their fallback deadline.
    refetching: HashMap<Locator, Instant>,
    /// Fallback refetches: unsubscribe, then subscribe again, in two requests.
    resubscribe: BTreeSet<Locator>,
    /// `"*"` has been sent upstream (on the current stream): only responses after that can count
    /// as the wildcard's answer (D9).
    wildcard_sent: bool,
    /// A request of this type went out on the current upstream stream.
    on_stream: bool,
    /// `"*"` went out after the type's first request on the stream, which a conforming server
    /// need not answer: when the wait ends the group serves its cache (see [`WILDCARD_WAIT`]).
    wildcard_wait: WildcardWait,
    /// `"*"` was unsubscribed on this stream: the server may still count the names it sent
    /// under it as held (go-control-plane does), while the store forgot them (D5).
    wildcard_dropped: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum WildcardWait {
    #[default]
    None,
    /// Sent; the deadline starts at the next clock reading (`arm_wildcard_waits` / `expire`).
    Sent,
    Until(Instant),
}

impl TypeInterest {
    fn held(&self, l: &Locator) -> bool {
        self.refs.contains_key(l) || self.lingering.contains_key(l)
    }

    fn count_name(&mut self, name: &Name, delta: i32) {
        bump(&mut self.names, name, delta);
    }
}

fn bump(map: &mut NameMap<Name, u32>, name: &Name, delta: i32) {
    let c = map.entry(name.clone()).or_insert(0);
    *c = c.saturating_add_signed(delta);
    if *c == 0 {
        map.remove(name);
    }
}

/// Subscription changes for one type, ready to become a `DeltaDiscoveryRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamChange {
    pub type_url: String,
    pub subscribe: Vec<Locator>,
    pub unsubscribe: Vec<Locator>,
}

#[derive(Debug, Default)]
pub struct Interest {
    types: BTreeMap<String, TypeInterest>,
    linger: Duration,
    /// Refetches requested (C3) and how many fell back to unsubscribe+subscribe, for metrics.
    pub refetches: u64,
    pub refetch_fallbacks: u64,
    /// Mid-stream `"*"` subscriptions the upstream left unanswered past [`WILDCARD_WAIT`].
    pub wildcards_unanswered: u64,
}

impl Interest {
    pub fn new(linger: Duration) -> Self {
        Interest {
            types: BTreeMap::new(),
            linger,
            refetches: 0,
            refetch_fallbacks: 0,
            wildcards_unanswered: 0,
        }
    }

    /// One more downstream subscriber wants `locator`. Only the first one (that is not already kept
    /// by the linger) causes an upstream subscribe. Returns whether it was the first.
    pub fn acquire(&mut self, type_url: &str, locator: &Locator) -> bool {
        // Every subscription of every joining client comes here: the common case (a type known,
        // a locator already wanted) allocates nothing and searches once.
        if !self.types.contains_key(type_url) {
            self.types
                .insert(type_url.to_string(), TypeInterest::default());
        }
        let Some(ti) = self.types.get_mut(type_url) else {
            return false;
        };
        if let Some(count) = ti.refs.get_mut(locator) {
            *count += 1;
            return false;
        }
        ti.refs.insert(locator.clone(), 1);
        bump(&mut ti.referenced, &locator.name, 1);
        if ti.lingering.remove(locator).is_none() {
            ti.count_name(&locator.name, 1);
            if ti.unsubscribe.remove(locator) {
                // Still subscribed upstream, but the store already forgot it (D5): the upstream
                // must send it again, which only unsubscribe+subscribe guarantees (C3).
                ti.resubscribe.insert(locator.clone());
            } else {
                ti.subscribe.insert(locator.clone());
            }
        }
        true
    }

    /// One downstream subscriber left `locator`. The last one starts the linger (or unsubscribes
    /// at once with a zero linger), and the call returns true. Releasing a locator that is not
    /// held is ignored.
    pub fn release(&mut self, type_url: &str, locator: &Locator, now: Instant) -> bool {
        let Some(ti) = self.types.get_mut(type_url) else {
            return false;
        };
        let Some(count) = ti.refs.get_mut(locator) else {
            return false;
        };
        *count -= 1;
        if *count > 0 {
            return false;
        }
        ti.refs.remove(locator);
        bump(&mut ti.referenced, &locator.name, -1);
        if self.linger.is_zero() {
            Self::drop_upstream(ti, locator);
        } else {
            ti.lingering.insert(locator.clone(), now + self.linger);
        }
        true
    }

    fn drop_upstream(ti: &mut TypeInterest, locator: &Locator) {
        ti.count_name(&locator.name, -1);
        ti.refetching.remove(locator);
        ti.resubscribe.remove(locator);
        // A subscribe that never went out needs no unsubscribe.
        if !ti.subscribe.remove(locator) {
            ti.unsubscribe.insert(locator.clone());
        }
    }

    /// Ends the linger of every locator of `name` now (the unsubscribed set evicted it): their
    /// upstream unsubscribes are queued.
    pub fn drop_lingering(&mut self, type_url: &str, name: &str) {
        let Some(ti) = self.types.get_mut(type_url) else {
            return;
        };
        let dropped: Vec<Locator> = ti
            .lingering
            .keys()
            .filter(|l| &*l.name == name)
            .cloned()
            .collect();
        for l in &dropped {
            ti.lingering.remove(l);
            Self::drop_upstream(ti, l);
        }
    }

    /// Names with at least one lingering locator (held upstream, wanted by no client).
    pub fn lingering_names(&self, type_url: &str) -> Vec<Name> {
        self.types
            .get(type_url)
            .map(|t| t.lingering.keys().map(|l| l.name.clone()).collect())
            .unwrap_or_default()
    }

    /// The relay holds `locator` upstream but must see its content again (a `do_not_cache`
    /// resource for a new subscriber, C3, D2): subscribe again, which a conforming upstream
    /// answers with a resend; if nothing arrives by the fallback deadline, `expire` turns it into
    /// an unsubscribe followed by a subscribe.
    pub fn refetch(&mut self, type_url: &str, locator: &Locator, now: Instant) {
        let Some(ti) = self.types.get_mut(type_url) else {
            return;
        };
        if !ti.held(locator) || ti.refetching.contains_key(locator) {
            return;
        }
        ti.subscribe.insert(locator.clone());
        ti.refetching
            .insert(locator.clone(), now + REFETCH_FALLBACK);
        self.refetches += 1;
    }

    /// Starts the wait of every `"*"` sent mid-stream since the last call (the adapter calls this
    /// right after sending; `expire` does it too, for callers that never do).
    pub fn arm_wildcard_waits(&mut self, now: Instant) {
        for ti in self.types.values_mut() {
            if ti.wildcard_wait == WildcardWait::Sent {
                ti.wildcard_wait = WildcardWait::Until(now + WILDCARD_WAIT);
            }
        }
    }

    /// A response of the type arrived after `"*"` went out: it is the wildcard's answer.
    pub fn wildcard_answered(&mut self, type_url: &str) {
        if let Some(ti) = self.types.get_mut(type_url) {
            ti.wildcard_wait = WildcardWait::None;
        }
    }

    /// Types whose mid-stream `"*"` got no response by its deadline (the wait ends here), each
    /// with whether `"*"` had been unsubscribed earlier on the stream: then the cache may lack
    /// names the server believes the relay still holds, and only a new stream (C4, with initial
    /// versions) brings them back.
    pub fn unanswered_wildcards(&mut self, now: Instant) -> Vec<(String, bool)> {
        let mut out = Vec::new();
        for (type_url, ti) in self.types.iter_mut() {
            if matches!(ti.wildcard_wait, WildcardWait::Until(d) if d <= now) {
                ti.wildcard_wait = WildcardWait::None;
                if ti.wildcard_sent {
                    out.push((type_url.clone(), ti.wildcard_dropped));
                }
            }
        }
        out
    }

    /// The upstream sent `name`: refetches of it are satisfied.
    pub fn received(&mut self, type_url: &str, name: &str) {
        if let Some(ti) = self.types.get_mut(type_url) {
            if !ti.refetching.is_empty() {
                ti.refetching.retain(|l, _| &*l.name != name);
            }
        }
    }

    /// Ends expired lingers and refetch waits. Returns the locators whose upstream subscription now
    /// lapses, so the caller can drop what it holds for them.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Locator)> {
        self.arm_wildcard_waits(now);
        let mut lapsed = Vec::new();
        for (type_url, ti) in self.types.iter_mut() {
            let expired: Vec<Locator> = ti
                .lingering
                .iter()
                .filter(|(_, deadline)| **deadline <= now)
                .map(|(l, _)| l.clone())
                .collect();
            for l in expired {
                ti.lingering.remove(&l);
                Self::drop_upstream(ti, &l);
                lapsed.push((type_url.clone(), l));
            }
            let stuck: Vec<Locator> = ti
                .refetching
                .iter()
                .filter(|(_, deadline)| **deadline <= now)
                .map(|(l, _)| l.clone())
                .collect();
            for l in stuck {
                ti.refetching.remove(&l);
                ti.resubscribe.insert(l);
                self.refetch_fallbacks += 1;
            }
        }
        lapsed
    }

    /// The earliest linger or refetch deadline, so the adapter knows when to call `expire`.
    pub fn next_deadline(&self) -> Option<Instant> {
        let waits = self.types.values().filter_map(|t| match t.wildcard_wait {
            WildcardWait::Until(d) => Some(d),
            _ => None,
        });
        self.types
            .values()
            .flat_map(|t| t.lingering.values().chain(t.refetching.values()))
            .copied()
            .chain(waits)
            .min()
    }

    /// Takes the subscription changes that have not been sent upstream yet, in the order they must
    /// be sent (a fallback refetch is an unsubscribe request, then a subscribe request).
    pub fn take_changes(&mut self) -> Vec<UpstreamChange> {
        let mut out = Vec::new();
        for (type_url, t) in self.types.iter_mut() {
            let resubscribe = std::mem::take(&mut t.resubscribe);
            if !resubscribe.is_empty() {
                out.push(UpstreamChange {
                    type_url: type_url.clone(),
                    subscribe: vec![],
                    unsubscribe: resubscribe.iter().cloned().collect(),
                });
                t.subscribe.extend(resubscribe);
            }
            if t.subscribe.is_empty() && t.unsubscribe.is_empty() {
                continue;
            }
            if t.subscribe.iter().any(|l| &*l.name == WILDCARD) {
                t.wildcard_sent = true;
                // Only the type's first request on a stream must be answered when it carries
                // "*" (go-control-plane's delta server answers exactly that one).
                if t.on_stream {
                    t.wildcard_wait = WildcardWait::Sent;
                }
            }
            if t.unsubscribe.iter().any(|l| &*l.name == WILDCARD) {
                t.wildcard_sent = false;
                t.wildcard_wait = WildcardWait::None;
                t.wildcard_dropped = true;
            }
            t.on_stream = true;
            out.push(UpstreamChange {
                type_url: type_url.clone(),
                subscribe: std::mem::take(&mut t.subscribe).into_iter().collect(),
                unsubscribe: std::mem::take(&mut t.unsubscribe).into_iter().collect(),
            });
        }
        out
    }

    /// For a new upstream stream: per type, every locator wanted now (held or lingering), in order.
    /// Pending changes are folded in, since the new stream starts from this full set (C4).
    pub fn resubscribe_all(&mut self) -> Vec<(String, Vec<Locator>)> {
        let mut out = Vec::new();
        for (type_url, ti) in self.types.iter_mut() {
            ti.subscribe.clear();
            ti.unsubscribe.clear();
            ti.resubscribe.clear();
            ti.refetching.clear();
            let all: BTreeSet<Locator> =
                ti.refs.keys().chain(ti.lingering.keys()).cloned().collect();
            ti.wildcard_sent = all.iter().any(|l| &*l.name == WILDCARD);
            ti.on_stream = !all.is_empty();
            ti.wildcard_wait = WildcardWait::None;
            ti.wildcard_dropped = false;
            if !all.is_empty() {
                out.push((type_url.clone(), all.into_iter().collect()));
            }
        }
        out
    }

    /// Every locator held upstream now (held or lingering), per type: what a snapshot records so
    /// a restarted relay subscribes to the same set.
    pub fn held_locators(&self) -> Vec<(String, Vec<Locator>)> {
        self.types
            .iter()
            .map(|(t, ti)| {
                let all: BTreeSet<Locator> =
                    ti.refs.keys().chain(ti.lingering.keys()).cloned().collect();
                (t.clone(), all.into_iter().collect::<Vec<_>>())
            })
            .filter(|(_, l)| !l.is_empty())
            .collect()
    }

    /// Restores a locator from a snapshot as lingering until `until`: it is subscribed upstream
    /// on the next stream (with the versions held, C4) and lapses like any unsubscribed locator
    /// unless a client claims it first. No change is queued: a new stream sends the full set.
    pub fn restore(&mut self, type_url: &str, locator: &Locator, until: Instant) {
        let ti = self.types.entry(type_url.to_string()).or_default();
        if ti.held(locator) {
            return;
        }
        ti.count_name(&locator.name, 1);
        ti.lingering.insert(locator.clone(), until);
    }

    /// Whether any subscription for `name` is (or will be) held upstream.
    pub fn wants(&self, type_url: &str, name: &str) -> bool {
        self.types
            .get(type_url)
            .is_some_and(|t| t.names.contains_key(name))
    }

    /// Whether anything of this type is subscribed upstream.
    pub fn has_type(&self, type_url: &str) -> bool {
        self.types
            .get(type_url)
            .is_some_and(|t| !t.names.is_empty())
    }

    /// Whether `"*"` has gone out upstream, so a response now may be the wildcard's answer.
    pub fn wildcard_sent(&self, type_url: &str) -> bool {
        self.types.get(type_url).is_some_and(|t| t.wildcard_sent)
    }

    /// Whether a downstream client subscribes to some locator of `name` (lingering ones aside).
    pub fn referenced(&self, type_url: &str, name: &str) -> bool {
        self.types
            .get(type_url)
            .is_some_and(|t| t.referenced.contains_key(name))
    }

    pub fn is_wildcard(&self, type_url: &str) -> bool {
        self.wants(type_url, WILDCARD)
    }

    /// Number of downstream references to `locator` (for introspection and tests).
    pub fn refcount(&self, type_url: &str, locator: &Locator) -> u32 {
        self.types
            .get(type_url)
            .and_then(|t| t.refs.get(locator))
            .copied()
            .unwrap_or(0)
    }

    /// Per type: (locators held upstream including lingering ones, whether `"*"` is one of them),
    /// for introspection.
    pub fn upstream_subscriptions_by_type(&self) -> Vec<(String, usize, bool)> {
        self.types
            .iter()
            .map(|(t, ti)| {
                (
                    t.clone(),
                    ti.refs.len() + ti.lingering.len(),
                    ti.names.contains_key(WILDCARD),
                )
            })
            .filter(|(_, n, _)| *n > 0)
            .collect()
    }

    /// Distinct locators (including `"*"`) subscribed upstream, summed over types.
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
    use std::sync::Arc;

    const T: &str = "eds";

    fn n(s: &str) -> Locator {
        Locator::plain(s)
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
    fn each_distinct_parameter_set_is_one_upstream_locator() {
        let mut i = Interest::new(Duration::ZERO);
        let prod = Locator::with_params(
            "foo",
            Arc::new([("env".to_string(), "prod".to_string())].into()),
        );
        let test = Locator::with_params(
            "foo",
            Arc::new([("env".to_string(), "test".to_string())].into()),
        );
        i.acquire(T, &prod);
        i.acquire(T, &prod.clone());
        i.acquire(T, &test);
        let c = i.take_changes();
        assert_eq!(c[0].subscribe, vec![prod.clone(), test.clone()]);
        i.release(T, &test, Instant::now());
        assert_eq!(i.take_changes()[0].unsubscribe, vec![test]);
        assert!(i.wants(T, "foo"));
    }

    #[test]
    fn restored_locators_are_resubscribed_and_lapse_unless_claimed() {
        let now = Instant::now();
        let mut i = Interest::new(Duration::from_secs(30));
        let until = now + Duration::from_secs(30);
        i.restore(T, &n("a"), until);
        i.restore(T, &n("b"), until);
        assert!(
            i.take_changes().is_empty(),
            "the new stream sends the full set"
        );
        assert_eq!(
            i.resubscribe_all(),
            vec![(T.to_string(), vec![n("a"), n("b")])]
        );
        // A client claims `a` (no upstream change: it is already held); `b` lapses.
        i.acquire(T, &n("a"));
        assert!(i.take_changes().is_empty());
        assert_eq!(i.expire(until), vec![(T.to_string(), n("b"))]);
        assert_eq!(i.take_changes()[0].unsubscribe, vec![n("b")]);
        assert!(i.wants(T, "a") && !i.wants(T, "b"));
        assert_eq!(i.held_locators(), vec![(T.to_string(), vec![n("a")])]);
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
    fn refetch_resubscribes_then_falls_back_to_unsubscribe_subscribe() {
        let t0 = Instant::now();
        let mut i = Interest::new(Duration::ZERO);
        i.acquire(T, &n("foo"));
        i.take_changes();
        i.refetch(T, &n("foo"), t0);
        assert_eq!(i.take_changes()[0].subscribe, vec![n("foo")]);
        // Nothing arrives: after the fallback deadline, unsubscribe and subscribe, in that order.
        i.expire(t0 + REFETCH_FALLBACK);
        let c = i.take_changes();
        assert_eq!(c.len(), 2);
        assert_eq!(
            (c[0].unsubscribe.clone(), c[0].subscribe.clone()),
            (vec![n("foo")], vec![])
        );
        assert_eq!(
            (c[1].unsubscribe.clone(), c[1].subscribe.clone()),
            (vec![], vec![n("foo")])
        );
        // A refetch the upstream answers needs no fallback.
        i.refetch(T, &n("foo"), t0);
        i.take_changes();
        i.received(T, "foo");
        i.expire(t0 + REFETCH_FALLBACK * 2);
        assert!(i.take_changes().is_empty());
    }

    #[test]
    fn reacquire_before_a_queued_unsubscribe_went_out_refetches() {
        let mut i = Interest::new(Duration::ZERO);
        i.acquire(T, &n("a"));
        i.take_changes();
        i.release(T, &n("a"), Instant::now());
        i.acquire(T, &n("a"));
        let c = i.take_changes();
        assert_eq!(
            c.iter()
                .map(|c| (c.subscribe.clone(), c.unsubscribe.clone()))
                .collect::<Vec<_>>(),
            vec![(vec![], vec![n("a")]), (vec![n("a")], vec![])]
        );
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
        /// locators with a positive refcount.
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
            let want: BTreeSet<Locator> = (0..4).filter(|k| counts[*k] > 0).map(|k| n(&k.to_string())).collect();
            prop_assert_eq!(upstream, want);
        }
    }
}
