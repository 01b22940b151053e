//! What each unacknowledged response changed in a stream's record of what the client holds, so a
//! NACK can put the record back (A23, C4: a client that rejects a response keeps what it had).
//!
//! The state machines update their record (`known` in Delta, `sent` in SotW) optimistically while
//! building a response, and call [`Unacked::record`] with the value each entry had before. The
//! changes staged this way belong to the response built next; they are sealed under that
//! response's nonce lazily, by [`Unacked::seal`] at the start of the next build or request, so the
//! nonce assignment itself stays untouched. Changes made by a build that produced no response
//! (bookkeeping only, e.g. forgetting a partial-type name that is absent) are not undoable and are
//! dropped at sealing.
//!
//! Several responses may be in flight: an ACK of nonce `n` settles `n` and everything older (a
//! client answers responses in order); a NACK undoes `n` only. A later response that touched the
//! same entry inherits the pre-`n` value, since that is what the client held when it applied the
//! later one. For SotW Listener/Cluster a later response carries the whole state, so once one is
//! in flight a rejected earlier one changes nothing but the later one's undo values. At most
//! [`MAX_IN_FLIGHT`] responses are tracked; a client that leaves more unanswered has the oldest
//! taken as accepted.

use std::collections::VecDeque;

/// Unanswered responses remembered per type before the oldest is taken as accepted.
pub const MAX_IN_FLIGHT: usize = 16;

/// Key -> value before a response, sorted by key, one entry per key. A sorted vector, not a map:
/// most responses after the join change one or two entries, and this runs per response per stream.
type Undo<K, V> = Vec<(K, Option<V>)>;

#[derive(Debug, Clone)]
pub struct Unacked<K: Ord, V> {
    /// Key -> value before the response under construction, in recording order; the first
    /// change of a key wins when sealed.
    staged: Undo<K, V>,
    /// The type's last nonce when staging began: if it is still the last nonce at sealing, no
    /// response carried the staged changes.
    staged_after: Option<u64>,
    /// (nonce, what that response changed), oldest first.
    in_flight: VecDeque<(u64, Undo<K, V>)>,
}

impl<K: Ord, V> Default for Unacked<K, V> {
    fn default() -> Self {
        Unacked {
            staged: Vec::new(),
            staged_after: None,
            in_flight: VecDeque::new(),
        }
    }
}

impl<K: Ord + Clone, V: Clone> Unacked<K, V> {
    /// Notes that `key` is about to change in the response being built; `before` is its value now.
    pub fn record(&mut self, key: &K, before: Option<&V>, last_nonce: Option<u64>) {
        if self.staged.is_empty() {
            self.staged_after = last_nonce;
        }
        self.staged.push((key.clone(), before.cloned()));
    }

    /// Files the staged changes under `last_nonce` if a response was built since they began.
    pub fn seal(&mut self, last_nonce: Option<u64>) {
        if self.staged.is_empty() {
            return;
        }
        let mut staged = std::mem::take(&mut self.staged);
        let after = self.staged_after.take();
        match last_nonce {
            Some(n) if after != Some(n) => {
                // Stable: of several changes to one key, the first (the value the client held)
                // stays.
                staged.sort_by(|a, b| a.0.cmp(&b.0));
                staged.dedup_by(|later, first| later.0 == first.0);
                if self.in_flight.len() == MAX_IN_FLIGHT {
                    self.in_flight.pop_front();
                }
                self.in_flight.push_back((n, staged));
            }
            _ => {}
        }
    }

    /// The client accepted `nonce`, and so answered everything before it.
    pub fn ack(&mut self, nonce: u64) {
        if let Some(i) = self.position(nonce) {
            self.in_flight.drain(..=i);
        }
        if self.in_flight.is_empty() {
            // Most of a stream's life nothing is in flight: keep no capacity for it (three types
            // on ten thousand streams would keep ~5 MiB).
            self.in_flight = VecDeque::new();
        }
    }

    /// The client rejected `nonce`: returns the entries to put back as they were before it.
    /// `supersedes`: a later response replaces the client's whole state (SotW Listener/Cluster),
    /// so entries of a rejected response are restored only when no later response is in flight.
    pub fn nack(&mut self, nonce: u64, supersedes: bool) -> Vec<(K, Option<V>)> {
        let Some(i) = self.position(nonce) else {
            return Vec::new();
        };
        let mut drained = self.in_flight.drain(..=i);
        let Some((_, undo)) = drained.next_back() else {
            return Vec::new();
        };
        drop(drained);
        let later = !self.in_flight.is_empty();
        let mut restore = Vec::new();
        for (k, before) in undo {
            // The first later response that changed `k` was applied on top of `before`.
            let later_change = self.in_flight.iter_mut().find_map(|(_, m)| {
                let i = m.binary_search_by(|(x, _)| x.cmp(&k)).ok()?;
                Some(&mut m[i].1)
            });
            if let Some(prev) = later_change {
                *prev = before;
            } else if !(supersedes && later) {
                restore.push((k, before));
            }
        }
        restore
    }

    /// The client dropped `key` itself (unsubscribe): nothing to restore for it any more.
    pub fn forget(&mut self, key: &K) {
        self.staged.retain(|(k, _)| k != key);
        for (_, m) in &mut self.in_flight {
            m.retain(|(k, _)| k != key);
        }
    }

    /// Forgets everything for keys that fail `keep`.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.staged.retain(|(k, _)| keep(k));
        for (_, m) in &mut self.in_flight {
            m.retain(|(k, _)| keep(k));
        }
    }

    fn position(&self, nonce: u64) -> Option<usize> {
        self.in_flight.iter().position(|(n, _)| *n == nonce)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type U = Unacked<&'static str, u32>;

    fn sent(u: &mut U, nonce: u64, changes: &[(&'static str, Option<u32>)]) {
        u.seal(Some(nonce - 1));
        for (k, before) in changes {
            u.record(k, before.as_ref(), Some(nonce - 1));
        }
        u.seal(Some(nonce));
    }

    #[test]
    fn nack_restores_the_values_before_the_response() {
        let mut u = U::default();
        sent(&mut u, 1, &[("a", Some(1)), ("b", None)]);
        assert_eq!(u.nack(1, false), vec![("a", Some(1)), ("b", None)]);
        assert!(u.nack(1, false).is_empty(), "settled once");
    }

    #[test]
    fn ack_settles_older_responses_too() {
        let mut u = U::default();
        sent(&mut u, 1, &[("a", Some(1))]);
        sent(&mut u, 2, &[("b", Some(1))]);
        u.ack(2);
        assert!(u.nack(1, false).is_empty());
    }

    #[test]
    fn a_later_response_inherits_the_value_before_a_rejected_one() {
        let mut u = U::default();
        sent(&mut u, 1, &[("a", Some(1)), ("b", Some(1))]);
        sent(&mut u, 2, &[("a", Some(2))]);
        // Only b goes back now; a's fate rests on response 2, applied over a@1.
        assert_eq!(u.nack(1, false), vec![("b", Some(1))]);
        assert_eq!(u.nack(2, false), vec![("a", Some(1))]);
    }

    #[test]
    fn full_state_responses_supersede_rejected_ones() {
        let mut u = U::default();
        sent(&mut u, 1, &[("a", Some(1)), ("b", Some(1))]);
        sent(&mut u, 2, &[("a", Some(2))]);
        assert!(u.nack(1, true).is_empty());
        assert_eq!(u.nack(2, true), vec![("a", Some(1))]);
    }

    #[test]
    fn changes_without_a_response_are_not_undoable() {
        let mut u = U::default();
        u.record(&"a", Some(&1), Some(1));
        u.seal(Some(1));
        assert!(u.nack(1, false).is_empty());
    }

    #[test]
    fn the_first_change_of_a_key_in_a_response_is_what_a_nack_restores() {
        let mut u = U::default();
        u.record(&"b", Some(&1), Some(1));
        u.record(&"a", None, Some(1));
        u.record(&"b", Some(&2), Some(1));
        u.seal(Some(2));
        assert_eq!(u.nack(2, false), vec![("a", None), ("b", Some(1))]);
    }

    #[test]
    fn tracking_is_bounded() {
        let mut u = U::default();
        for i in 1..=(MAX_IN_FLIGHT as u64 + 4) {
            sent(&mut u, i, &[("a", Some(i as u32))]);
        }
        assert!(u.nack(1, false).is_empty(), "oldest taken as accepted");
        assert_eq!(u.in_flight.len(), MAX_IN_FLIGHT);
    }
}
