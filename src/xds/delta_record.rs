//! What a Delta stream records per type (the state `DeltaStream` works on, in `delta.rs`):
//! the subscriptions with their parameter sets, what the client holds (and what a NACK puts back),
//! and which names need another look. No behaviour of the protocol lives here beyond keeping
//! these records consistent; the rules are in `delta.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use smallvec::SmallVec;

use super::constraints::{ConstraintKey, Params};
use super::holdings::{Held, Holdings};
use super::resource::{CachedResource, Locator, Name};
use super::unacked::Unacked;
use super::xdstp;

/// One type's state on one stream. Held per client per type, so the rarely used sets are
/// B-trees (24 bytes empty, where a hash set is 48).
#[derive(Debug, Default, Clone)]
pub(super) struct TypeState {
    pub(super) wildcard: bool,
    /// name -> parameter set -> subscribed by plain name (true) or by locator (false).
    pub(super) explicit: BTreeMap<Name, ParamSets>,
    /// What the client holds, from our responses and its `initial_resource_versions`. Changed
    /// only through [`TypeState::hold`] / [`TypeState::unhold`] while building a response, so a
    /// NACK can put it back (A23: a client that rejects a version keeps the one before).
    /// Ordered by name, so a name's entries are one range (see [`first_of`]).
    pub(super) known: Holdings,
    /// What the responses not yet ACKed changed in `known`.
    pub(super) unacked: Unacked<Locator, Held>,
    /// What a NACKed response gave (`None`: removed) where the client kept its previous version:
    /// not sent again until it changes, a re-subscribe (A7) or a new stream (A31).
    pub(super) rejected: BTreeMap<Locator, Option<Held>>,
    /// Names to evaluate at the next build.
    pub(super) pending: BTreeSet<Name>,
    /// Evaluate every name of the type at the next build (wildcard start, wildcard sync).
    pub(super) pending_all: bool,
    /// Subscriptions that must be sent even if the client holds the current version (A6, A7).
    pub(super) forced: BTreeSet<Locator>,
    /// Subscriptions added since the adapter last reported the store sequence: their stamp
    /// (in `explicit`) is set by `DeltaStream::subscribed_at`. Emptied, capacity and all, then.
    pub(super) unstamped: Vec<Locator>,
    /// Names whose TTL the upstream refreshed: forward the heartbeat to holders of that version.
    pub(super) heartbeats: BTreeSet<Name>,
    /// Resource errors already reported to the client (TP3: sent once).
    pub(super) errors_sent: BTreeSet<Name>,
    /// An initial wildcard request waits for a response even if it is empty (A2).
    pub(super) owe_response: bool,
    /// Malformed xdstp names the client subscribed to, not yet reported (A29).
    pub(super) invalid: BTreeMap<Name, String>,
    /// Subscribed glob collections last reported empty (A28).
    pub(super) empty_globs: BTreeSet<Name>,
    /// A27: the wildcard covers only names under the stream's RDS route configurations.
    pub(super) scoped: bool,
    pub(super) last_nonce: Option<u64>,
    pub(super) last_ack: Option<String>,
    pub(super) last_nack: Option<(String, String)>,
}

impl TypeState {
    /// A wildcard subscription (not VHDS's scoped one) and nothing else: no name subscribed,
    /// forced, rejected or owed an error. What such a subscriber is due depends only on what it
    /// holds and the type's content.
    pub(super) fn only_the_wildcard(&self) -> bool {
        self.wildcard
            && !self.scoped
            && self.explicit.is_empty()
            && self.forced.is_empty()
            && self.rejected.is_empty()
            && self.heartbeats.is_empty()
            && self.errors_sent.is_empty()
            && self.invalid.is_empty()
            && self.empty_globs.is_empty()
    }

    pub(super) fn has_work(&self) -> bool {
        !self.pending.is_empty()
            || self.pending_all
            || self.owe_response
            || !self.heartbeats.is_empty()
            || !self.invalid.is_empty()
    }

    /// Records that the response being built gives the client `held` for `l`.
    pub(super) fn hold(&mut self, l: &Locator, held: Held) {
        self.unacked.record(l, self.known.get(l), self.last_nonce);
        self.known.insert(l.clone(), held);
        self.rejected.remove(l);
    }

    /// Records that the response being built takes `l` from the client (or sends it again later).
    pub(super) fn unhold(&mut self, l: &Locator) -> Option<Held> {
        let before = self.known.remove(l);
        if before.is_some() {
            self.unacked.record(l, before.as_ref(), self.last_nonce);
        }
        self.rejected.remove(l);
        before
    }

    /// A variant removal sent for `l` takes the variant (one wire identity: name and constraints)
    /// from the client, whichever of the name's locators selected it (E17): the name's other
    /// locators that held the same variant hold nothing now, and must not remove it again.
    pub(super) fn unhold_variant_elsewhere(&mut self, l: &Locator, key: &ConstraintKey) {
        let from = Locator::with_params(l.name.clone(), super::resource::no_params());
        let others: Vec<Locator> = self
            .known
            .from(&from)
            .take_while(|(k, _)| k.name == l.name)
            .filter(|(k, h)| *k != l && h.constraints().is_some() && h.key() == key)
            .map(|(k, _)| k.clone())
            .collect();
        for k in others {
            self.unhold(&k);
        }
    }

    /// The client dropped `l` itself: nothing of it is held or to restore.
    pub(super) fn forget(&mut self, l: &Locator) {
        self.known.remove(l);
        self.unacked.forget(l);
        self.rejected.remove(l);
    }

    /// Whether the client rejected exactly this outcome for `l` (`None`: a removal).
    pub(super) fn was_rejected(&self, l: &Locator, r: Option<&Arc<CachedResource>>) -> bool {
        match (self.rejected.get(l), r) {
            (Some(Some(h)), Some(r)) => h.is(r),
            (Some(None), None) => true,
            _ => false,
        }
    }

    /// Settles the response a request answers: an ACK keeps `known`, a NACK restores what the
    /// client held before the response, since it keeps that (A23, and what CSDS reports).
    /// `nonce`: the answered one, if this relay could have sent it.
    pub(super) fn settle(&mut self, nonce: Option<u64>, nacked: bool) {
        self.unacked.seal(self.last_nonce);
        let Some(nonce) = nonce else { return };
        if !nacked {
            self.unacked.ack(nonce);
            return;
        }
        for (l, before) in self.unacked.nack(nonce, false) {
            let after = self.known.get(&l).cloned();
            self.rejected.insert(l.clone(), after);
            match before {
                Some(h) => {
                    self.known.insert(l, h);
                }
                None => {
                    self.known.remove(&l);
                }
            }
        }
    }

    /// Whether a change to `name` can alter what this stream holds or is owed: it is covered by
    /// the wildcard, subscribed (by name or through its glob collection, A28), held, or forced.
    /// A change set names everything one upstream response changed; most of it concerns other
    /// streams of the group, and evaluating it here would cost per stream per name.
    pub(super) fn concerns(&self, name: &Name) -> bool {
        if self.wildcard || self.explicit.contains_key(name) {
            return true;
        }
        let first = first_of(name);
        let is_name = |l: Option<&Locator>| l.is_some_and(|l| l.name == *name);
        is_name(self.known.from(&first).next().map(|(l, _)| l))
            || is_name(self.forced.range(&first..).next())
            || xdstp::collection_of(name).is_some_and(|c| self.explicit.contains_key(c.as_str()))
    }

    pub(super) fn explicit_contains(&self, l: &Locator) -> bool {
        self.explicit
            .get(&l.name)
            .is_some_and(|m| m.contains_key(&l.params))
    }
}

/// The parameter sets a name is subscribed with on one stream: whether each came by plain name,
/// and the store sequence at which the group applied it (D2: `do_not_cache` content is served
/// only to subscriptions that were waiting when it arrived; `u64::MAX` until the adapter reports
/// it). Nearly always one, kept inline: a sorted list costs a tenth of a map per name, and this is
/// held per client per subscribed name, so a heap allocation each would cost 50 per client for 50
/// names. The stamp lives here, not in a map of its own, because a map per stream keyed by locator
/// cost ~2 KiB per client.
#[derive(Debug, Default, Clone)]
pub(super) struct ParamSets(SmallVec<[Subscription; 1]>);

#[derive(Debug, Clone)]
pub(super) struct Subscription {
    pub(super) params: Arc<Params>,
    pub(super) by_name: bool,
    pub(super) since: u64,
}

impl ParamSets {
    pub(super) fn find(&self, params: &Arc<Params>) -> Result<usize, usize> {
        self.0.binary_search_by(|s| s.params.cmp(params))
    }

    /// Adds `params` (not yet stamped); returns the previous `by_name` if it was there (its
    /// stamp stays: the subscription did not start again).
    pub(super) fn insert(&mut self, params: Arc<Params>, by_name: bool) -> Option<bool> {
        match self.find(&params) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].by_name, by_name)),
            Err(i) => {
                self.0.insert(
                    i,
                    Subscription {
                        params,
                        by_name,
                        since: u64::MAX,
                    },
                );
                None
            }
        }
    }

    pub(super) fn remove(&mut self, params: &Arc<Params>) -> Option<bool> {
        self.find(params).ok().map(|i| self.0.remove(i).by_name)
    }

    /// Stamps `params` with `seq` if it is still subscribed and not yet stamped.
    pub(super) fn stamp(&mut self, params: &Arc<Params>, seq: u64) {
        if let Ok(i) = self.find(params) {
            let since = &mut self.0[i].since;
            if *since == u64::MAX {
                *since = seq;
            }
        }
    }

    /// The store sequence at which the subscription with `params` was applied (`u64::MAX`: not
    /// yet, or not subscribed).
    pub(super) fn since(&self, params: &Arc<Params>) -> u64 {
        self.find(params).map_or(u64::MAX, |i| self.0[i].since)
    }

    pub(super) fn contains_key(&self, params: &Arc<Params>) -> bool {
        self.find(params).is_ok()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &Arc<Params>> {
        self.0.iter().map(|s| &s.params)
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'a> IntoIterator for &'a ParamSets {
    type Item = (&'a Arc<Params>, &'a bool);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, Subscription>,
        fn(&'a Subscription) -> (&'a Arc<Params>, &'a bool),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|s| (&s.params, &s.by_name))
    }
}

/// The smallest locator of `name`: locators order by name first and the empty parameter set sorts
/// before any other, so `range(first_of(name)..)` while the name matches is every locator of that
/// name. Builds run per name per response, so they must not scan everything the client holds.
pub(super) fn first_of(name: &Name) -> Locator {
    Locator::plain(name.clone())
}
