//! The unsubscribed set of one group: names (and lingering wildcards) no client subscribes to any
//! more that the relay still holds subscribed upstream, so they stay fresh and a returning client
//! is served at once. Ordered by when the last client left; the least recently left goes first
//! when the encoded bytes held exceed the budget. Pure bookkeeping: [`super::GroupState`] decides
//! what belongs here and what an eviction does (upstream unsubscribe, store forgets: D5).

use lru::LruCache;

use super::resource::Name;

/// Default budget per group: enough for tens of thousands of typical EDS/CDS resources.
pub const DEFAULT_UNSUBSCRIBED_CACHE_BYTES: usize = 64 << 20;

/// (type_url, name or `"*"`).
type Key = (String, Name);

#[derive(Debug)]
pub struct UnsubscribedSet {
    /// Entry -> the encoded bytes it keeps in the store.
    entries: LruCache<Key, usize>,
    bytes: usize,
    budget: usize,
    /// Entries that left because the budget was exceeded / because they aged past the linger.
    pub evicted_budget: u64,
    pub evicted_linger: u64,
    /// Subscriptions that found their name here (served from cache, no upstream subscribe).
    pub resubscriptions: u64,
}

impl Default for UnsubscribedSet {
    fn default() -> Self {
        Self::new(DEFAULT_UNSUBSCRIBED_CACHE_BYTES)
    }
}

fn key(type_url: &str, name: &Name) -> Key {
    (type_url.to_string(), name.clone())
}

impl UnsubscribedSet {
    pub fn new(budget: usize) -> Self {
        UnsubscribedSet {
            entries: LruCache::unbounded(),
            bytes: 0,
            budget,
            evicted_budget: 0,
            evicted_linger: 0,
            resubscriptions: 0,
        }
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Encoded bytes held by the entries now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, type_url: &str, name: &Name) -> bool {
        // Checked for every new subscription and updated name: skip building a key when empty.
        !self.entries.is_empty() && self.entries.contains(&key(type_url, name))
    }

    /// Adds an entry as the most recently left, or re-accounts one already here without changing
    /// its place (an update from the upstream is not a client leaving).
    pub fn insert(&mut self, type_url: &str, name: &Name, bytes: usize) {
        if !self.set_bytes(type_url, name, bytes) {
            self.entries.push(key(type_url, name), bytes);
            self.bytes += bytes;
        }
    }

    /// Re-accounts an entry in place; false if it is not here.
    pub fn set_bytes(&mut self, type_url: &str, name: &Name, bytes: usize) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        match self.entries.peek_mut(&key(type_url, name)) {
            Some(held) => {
                self.bytes = self.bytes - *held + bytes;
                *held = bytes;
                true
            }
            None => false,
        }
    }

    /// Removes an entry; false if it was not here.
    pub fn remove(&mut self, type_url: &str, name: &Name) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        match self.entries.pop(&key(type_url, name)) {
            Some(bytes) => {
                self.bytes -= bytes;
                true
            }
            None => false,
        }
    }

    /// The least recently left entry, removed, while the set is over its budget. A zero budget
    /// keeps nothing, not even entries with nothing cached yet.
    pub fn pop_over_budget(&mut self) -> Option<Key> {
        if self.bytes <= self.budget && (self.budget > 0 || self.entries.is_empty()) {
            return None;
        }
        let (k, bytes) = self.entries.pop_lru()?;
        self.bytes -= bytes;
        Some(k)
    }

    /// The entries of one type (names and `"*"`).
    pub fn names_of_type(&self, type_url: &str) -> Vec<Name> {
        self.entries
            .iter()
            .filter(|((t, _), _)| t == type_url)
            .map(|((_, n), _)| n.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_left_first_and_updates_keep_their_place() {
        let mut s = UnsubscribedSet::new(100);
        let (a, b, c) = (Name::from("a"), Name::from("b"), Name::from("c"));
        s.insert("t", &a, 40);
        s.insert("t", &b, 40);
        assert_eq!(s.pop_over_budget(), None);
        // Re-accounting `a` does not make it recent.
        s.insert("t", &a, 50);
        s.insert("t", &c, 20);
        assert_eq!(s.bytes(), 110);
        assert_eq!(s.pop_over_budget(), Some(("t".into(), a)));
        assert_eq!(s.pop_over_budget(), None);
        assert_eq!(s.bytes(), 60);
        assert!(s.remove("t", &b));
        assert!(!s.remove("t", &b));
        assert_eq!((s.bytes(), s.len()), (20, 1));
    }

    #[test]
    fn zero_budget_keeps_nothing() {
        let mut s = UnsubscribedSet::new(0);
        s.insert("t", &Name::from("a"), 0);
        assert!(s.pop_over_budget().is_some());
        assert!(s.is_empty());
    }
}
