//! Keeps per-stream B-trees dense after bulk inserts.
//!
//! A stream's records (what the client holds, what it subscribes to) are filled in name order:
//! a join inserts a whole type's names at once, ascending. `BTreeMap` splits a full node in the
//! middle, so ascending inserts leave every node about half full: ~10.6 KiB for 110 entries of
//! 48 bytes where a packed tree takes ~6 KiB. Held per client, that is several KiB per client.
//! Collecting a map from its own sorted iterator builds full nodes, in linear time. Doing so once
//! per operation that grew a map by many entries costs far less than the operation itself.

use std::collections::BTreeMap;

/// Growth in one operation below which a map is left as it is: single subscribes and single new
/// resources land at random positions, which keeps nodes about two thirds full.
const BULK: usize = 16;

/// Rebuilds `map` with full nodes if one operation grew it from `len_before` by at least [`BULK`]
/// entries and by at least half its previous size (so repeated growth stays linear overall).
pub fn repack_after_bulk<K: Ord, V>(map: &mut BTreeMap<K, V>, len_before: usize) {
    if is_bulk(len_before, map.len()) {
        *map = std::mem::take(map).into_iter().collect();
    }
}

fn is_bulk(len_before: usize, len_now: usize) -> bool {
    let grown = len_now.saturating_sub(len_before);
    grown >= BULK && grown >= len_before / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repacking_keeps_every_entry_in_order() {
        let mut map: BTreeMap<u32, u32> = BTreeMap::new();
        for i in 0..200 {
            map.insert(i, i * 2);
        }
        repack_after_bulk(&mut map, 0);
        assert_eq!(map.len(), 200);
        assert!(map
            .iter()
            .enumerate()
            .all(|(i, (k, v))| *k == i as u32 && *v == k * 2));
        // Still a working map after the rebuild.
        map.insert(1000, 1);
        assert_eq!(map.remove(&5), Some(10));
        assert_eq!(map.len(), 200);
    }

    #[test]
    fn only_bulk_growth_repacks() {
        // A join: a type's names all at once.
        assert!(is_bulk(0, 110));
        // A client's first wildcard response on top of a few named subscriptions.
        assert!(is_bulk(20, 60));
        // One new resource, or a handful of subscribes.
        assert!(!is_bulk(110, 111));
        assert!(!is_bulk(0, 15));
        // 40 new entries on 100: the tree stays as dense as random inserts keep it.
        assert!(!is_bulk(100, 140));
        // Shrinking never repacks.
        assert!(!is_bulk(100, 10));
    }
}
