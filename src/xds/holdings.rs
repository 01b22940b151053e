//! What a Delta client holds of one type: its own record, or, while it holds exactly a type's
//! shared wildcard content, a reference to that content.
//!
//! A wildcard-only subscriber with the group's usual parameters holds what every other one holds:
//! the type's whole content. Kept per stream that is a B-tree of ~60 entries per Envoy (~2.5 KiB
//! of 43 per client in a 10,000-client run) and a reference count taken per entry per join;
//! shared, it is one pointer. A stream's record is copied out of the shared content the first
//! time anything changes it on its own (a NACK, an unsubscribe, a subscription by name), and a
//! wildcard-only stream moves from one shared content to the next as updates reach it (see
//! `DeltaStream::follow_shared`).

use std::collections::btree_map;
use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use super::constraints::ConstraintKey;
use super::packed;
use super::resource::{CachedResource, Locator, Name};

/// What a client holds for one subscription. Kept small (16 bytes): a stream holds one per
/// resource, and a relay holds thousands of streams.
#[derive(Debug, Clone)]
pub enum Held {
    /// A variant the relay sent; it names the version, the variant key and its constraints.
    /// Sharing the cached resource costs nothing extra; an outdated one stays alive only until
    /// this client receives the new version.
    Sent(Arc<CachedResource>),
    /// A version the client reported in `initial_resource_versions` (plain name, no variant).
    Reported(Name),
}

static UNCONSTRAINED: ConstraintKey = ConstraintKey::UNCONSTRAINED;

impl Held {
    pub fn version(&self) -> &str {
        match self {
            Held::Sent(r) => &r.version,
            Held::Reported(v) => v,
        }
    }

    pub fn key(&self) -> &ConstraintKey {
        match self {
            Held::Sent(r) => &r.key,
            Held::Reported(_) => &UNCONSTRAINED,
        }
    }

    /// The variant's constraints, to name it in `removed_resource_names`.
    pub fn constraints(&self) -> Option<&crate::pb::discovery::DynamicParameterConstraints> {
        match self {
            Held::Sent(r) => r.constraints.as_ref(),
            Held::Reported(_) => None,
        }
    }

    pub(super) fn is(&self, r: &Arc<CachedResource>) -> bool {
        match self {
            Held::Sent(h) => Arc::ptr_eq(h, r) || (h.version == r.version && h.key == r.key),
            Held::Reported(v) => **v == *r.version && r.key.is_unconstrained(),
        }
    }
}

/// One type's whole content for a Delta wildcard-only subscriber, built once per store change and
/// shared by every such stream of the group (see `wildcard_state`).
#[derive(Debug)]
pub struct DeltaWildcard {
    /// What the client holds after receiving it, in locator order; every entry is `Sent`
    /// ([`DeltaWildcard::new`]). Nothing else is kept: where a group's clients carry more parameter sets than the memo
    /// keeps, streams may each hold their own copy, which must cost no more than a record.
    pub held: Vec<(Locator, Held)>,
    /// The encoded size of its resources, against the stream's response size limit.
    pub bytes: usize,
}

impl DeltaWildcard {
    /// The shared content of `content` (in locator order), as wildcard subscribers receive it.
    pub fn new<'a>(content: impl IntoIterator<Item = (Locator, &'a Arc<CachedResource>)>) -> Self {
        let held: Vec<(Locator, Held)> = content
            .into_iter()
            .map(|(l, r)| (l, Held::Sent(r.clone())))
            .collect();
        let bytes = held
            .iter()
            .filter_map(|(_, h)| Self::wire_bytes(h))
            .map(Bytes::len)
            .sum();
        DeltaWildcard { held, bytes }
    }

    /// The bytes a wildcard subscriber (by plain name) received for `held`: every entry of a
    /// shared content is `Sent`.
    pub fn wire_bytes(held: &Held) -> Option<&Bytes> {
        match held {
            Held::Sent(r) => Some(r.delta_bytes(true)),
            Held::Reported(_) => None,
        }
    }

    /// The wire bytes of every resource, in order.
    pub fn resources(&self) -> Vec<Bytes> {
        self.held
            .iter()
            .filter_map(|(_, h)| Self::wire_bytes(h).cloned())
            .collect()
    }

    /// The index of the first entry at or after `from`.
    fn start(&self, from: &Locator) -> usize {
        self.held.partition_point(|(l, _)| l < from)
    }

    fn find(&self, l: &Locator) -> Option<usize> {
        self.held.binary_search_by(|(k, _)| k.cmp(l)).ok()
    }
}

/// A client's holdings of one type, in locator order.
#[derive(Debug, Clone)]
pub(super) enum Holdings {
    Own(BTreeMap<Locator, Held>),
    /// Exactly a shared wildcard content, nothing else.
    Shared(Arc<DeltaWildcard>),
}

impl Default for Holdings {
    fn default() -> Self {
        Holdings::Own(BTreeMap::new())
    }
}

impl FromIterator<(Locator, Held)> for Holdings {
    fn from_iter<I: IntoIterator<Item = (Locator, Held)>>(iter: I) -> Self {
        Holdings::Own(iter.into_iter().collect())
    }
}

/// Entries of [`Holdings`] in locator order.
pub(super) enum Entries<'a> {
    Own(btree_map::Range<'a, Locator, Held>),
    Shared(std::slice::Iter<'a, (Locator, Held)>),
}

impl<'a> Iterator for Entries<'a> {
    type Item = (&'a Locator, &'a Held);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Entries::Own(r) => r.next(),
            Entries::Shared(s) => s.next().map(|(l, h)| (l, h)),
        }
    }
}

impl Holdings {
    pub(super) fn len(&self) -> usize {
        match self {
            Holdings::Own(m) => m.len(),
            Holdings::Shared(s) => s.held.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn get(&self, l: &Locator) -> Option<&Held> {
        match self {
            Holdings::Own(m) => m.get(l),
            Holdings::Shared(s) => s.find(l).map(|i| &s.held[i].1),
        }
    }

    pub(super) fn contains_key(&self, l: &Locator) -> bool {
        self.get(l).is_some()
    }

    pub(super) fn iter(&self) -> Entries<'_> {
        match self {
            Holdings::Own(m) => Entries::Own(m.range::<Locator, _>(..)),
            Holdings::Shared(s) => Entries::Shared(s.held.iter()),
        }
    }

    /// Every entry at or after `from`, in order.
    pub(super) fn from(&self, from: &Locator) -> Entries<'_> {
        match self {
            Holdings::Own(m) => Entries::Own(m.range(from..)),
            Holdings::Shared(s) => Entries::Shared(s.held[s.start(from)..].iter()),
        }
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &Locator> {
        self.iter().map(|(l, _)| l)
    }

    /// The shared content held, if that is all this is.
    pub(super) fn shared(&self) -> Option<&Arc<DeltaWildcard>> {
        match self {
            Holdings::Shared(s) => Some(s),
            Holdings::Own(_) => None,
        }
    }

    /// Takes the shared content out (leaving an empty record), if that is what this holds.
    pub(super) fn take_shared(&mut self) -> Option<Arc<DeltaWildcard>> {
        match std::mem::take(self) {
            Holdings::Shared(s) => Some(s),
            own => {
                *self = own;
                None
            }
        }
    }

    /// The stream's own record, copied out of the shared content first if need be (in order, so
    /// with full nodes).
    fn own(&mut self) -> &mut BTreeMap<Locator, Held> {
        if let Holdings::Shared(s) = self {
            *self = Holdings::Own(s.held.iter().cloned().collect());
        }
        match self {
            Holdings::Own(m) => m,
            Holdings::Shared(_) => unreachable!("made own above"),
        }
    }

    pub(super) fn insert(&mut self, l: Locator, held: Held) -> Option<Held> {
        self.own().insert(l, held)
    }

    /// Removing what is not held leaves shared content shared.
    pub(super) fn remove(&mut self, l: &Locator) -> Option<Held> {
        if matches!(self, Holdings::Shared(_)) && !self.contains_key(l) {
            return None;
        }
        self.own().remove(l)
    }

    /// Keeping everything leaves shared content shared.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Locator) -> bool) {
        if matches!(self, Holdings::Shared(_)) && self.keys().all(&mut keep) {
            return;
        }
        self.own().retain(|l, _| keep(l));
    }

    /// See [`packed::repack_after_bulk`]; shared content is packed already.
    pub(super) fn repack_after_bulk(&mut self, len_before: usize) {
        if let Holdings::Own(m) = self {
            packed::repack_after_bulk(m, len_before);
        }
    }

    /// Whether this holds exactly what `shared` gives: the same locators, each at the version sent.
    pub(super) fn holds_exactly(&self, shared: &Arc<DeltaWildcard>) -> bool {
        if self.shared().is_some_and(|s| Arc::ptr_eq(s, shared)) {
            return true;
        }
        self.len() == shared.held.len()
            && self
                .iter()
                .zip(&shared.held)
                .all(|((l, held), (sl, s))| l == sl && matches!(s, Held::Sent(r) if held.is(r)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::Resource;
    use prost::Message;

    fn sent(name: &str, version: &str) -> (Locator, Held) {
        let body = Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: "t".into(),
                value: vec![1],
            }),
            ..Default::default()
        }
        .encode_to_vec();
        let r = CachedResource::decode(body.into()).expect("valid resource");
        (Locator::plain(Name::from(name)), Held::Sent(Arc::new(r)))
    }

    fn shared(entries: &[(&str, &str)]) -> Arc<DeltaWildcard> {
        let held: Vec<_> = entries.iter().map(|(n, v)| sent(n, v)).collect();
        Arc::new(DeltaWildcard { held, bytes: 0 })
    }

    #[test]
    fn shared_holdings_read_like_the_record_they_stand_for() {
        let s = shared(&[("a", "1"), ("b", "1"), ("c", "2")]);
        let h = Holdings::Shared(s.clone());
        let own: Holdings = s.held.iter().cloned().collect();
        for x in [&h, &own] {
            assert_eq!(x.len(), 3);
            assert_eq!(x.get(&Locator::plain("c")).map(Held::version), Some("2"));
            assert!(!x.contains_key(&Locator::plain("d")));
            let from_b: Vec<&str> = x
                .from(&Locator::plain("b"))
                .map(|(l, _)| &*l.name)
                .collect();
            assert_eq!(from_b, ["b", "c"]);
            assert!(x.holds_exactly(&s));
        }
    }

    #[test]
    fn a_change_copies_the_shared_content_out_and_leaves_it_untouched() {
        let s = shared(&[("a", "1"), ("b", "1")]);
        let mut h = Holdings::Shared(s.clone());
        h.retain(|_| true);
        assert!(h.shared().is_some(), "keeping everything changes nothing");
        assert!(h.remove(&Locator::plain("zz")).is_none());
        assert!(
            h.shared().is_some(),
            "removing what is not held changes nothing"
        );
        h.remove(&Locator::plain("a"));
        assert!(h.shared().is_none());
        assert_eq!(h.keys().map(|l| &*l.name).collect::<Vec<_>>(), ["b"]);
        assert_eq!(
            s.held.len(),
            2,
            "other streams still hold the whole content"
        );
        assert!(!h.holds_exactly(&s));
    }
}
