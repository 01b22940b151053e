//! Upstream Delta responses (the shadow `adsrelay.wire.DeltaDiscoveryResponse`, resources kept as
//! bytes) taken by the relay's own `UpstreamSession::on_response` into a pre-populated group, as
//! the upstream task does: nonce rule, NOT_FOUND translation, apply, ACK or NACK.
//!
//! Input: one flags byte (interest: wildcard or named; which type), then length-prefixed encoded
//! responses applied in sequence. Invariants per response:
//! - rejected: the store (every variant's bytes, arrival, TTL, heartbeats, lookups, errors, sync
//!   state, sequence) and the group's interest are exactly as before;
//! - accepted: for every wanted name the store holds exactly the response's bytes for each
//!   (name, variant) it sent, a removal leaves no variant, a removed variant is gone, a reported
//!   error is held; names the response did not mention are untouched; every name whose content
//!   changed is reported in the change set (or fan-out would never tell subscribers).
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use adsrelay::pb::discovery::ResourceError;
use adsrelay::pb::wire;
use adsrelay::xds::constraints;
use adsrelay::xds::upstream_session::upstream_update;
use adsrelay::xds::{
    AckStatus, CachedResource, GroupState, Locator, Lookup, RequestEffects, Store, UpstreamSession,
    Verdict, WILDCARD,
};
use adsrelay_fuzz::*;
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| run(data));

fn run(data: &[u8]) {
    let mut r = Reader::new(data);
    let flags = r.byte();
    let mut group = GroupState::new(Duration::ZERO).with_store(cache_store());
    let wildcard = flags & 1 != 0;
    for t in TYPES {
        let acquire = if wildcard {
            vec![Locator::plain(WILDCARD)]
        } else {
            let mut named: Vec<Locator> = NAMES[..6].iter().map(|n| Locator::plain(*n)).collect();
            named.push(Locator::with_params("c", arc_params(param_set(1))));
            named
        };
        let effects = RequestEffects {
            type_url: t.to_string(),
            acquire,
            release: vec![],
            ack: AckStatus::None,
        };
        group.apply_effects(1, &effects, epoch());
    }
    let session = UpstreamSession::new(Default::default());
    if flags & 2 == 0 {
        // The subscriptions went out upstream (so a wildcard response completes the sync).
        session.initial_requests(&mut group, true);
    }
    let mut responses = 0;
    while !r.is_empty() && responses < 16 {
        responses += 1;
        let Ok(resp) = wire::DeltaDiscoveryResponse::decode(r.chunk()) else {
            continue;
        };
        apply_and_check(&session, &mut group, resp);
    }
}

fn apply_and_check(
    session: &UpstreamSession,
    group: &mut GroupState,
    resp: wire::DeltaDiscoveryResponse,
) {
    let t = resp.type_url.clone();
    let mentioned = mentioned_names(&resp);
    let probe: Vec<String> = mentioned.iter().cloned().collect();
    let before = store_digest(group.store(), &probe);
    let names_before: BTreeMap<String, String> = NAMES[..6]
        .iter()
        .map(|n| (n.to_string(), name_digest(group.store(), &t, n)))
        .chain(
            mentioned
                .iter()
                .map(|n| (n.clone(), name_digest(group.store(), &t, n))),
        )
        .collect();
    let interest_before = group.interest().upstream_subscriptions_by_type();

    // What the response asks of the store, as the session translates it (NOT_FOUND errors become
    // removals, C14).
    let update = upstream_update(resp.clone(), epoch());
    let (resources, removed, errors) = (update.resources, update.removed, update.errors);
    let subscribed = group.interest().has_type(&t);
    let outcome = session.on_response(group, resp.clone(), epoch());
    let verdict = match outcome {
        Err(_) => {
            // No nonce: the session ends the stream and applies nothing.
            assert!(resp.nonce.is_empty(), "a response with a nonce was refused");
            assert_eq!(store_digest(group.store(), &probe), before);
            return;
        }
        Ok(o) => {
            assert_eq!(
                o.reply.response_nonce, resp.nonce,
                "the reply answers this response"
            );
            assert_eq!(
                o.reply.error_detail.is_some(),
                matches!(o.verdict, Verdict::Rejected { .. }),
                "a NACK exactly when rejected"
            );
            o.verdict
        }
    };
    match verdict {
        Verdict::NotSubscribed => {
            assert!(!subscribed, "a subscribed type was ignored");
            assert_eq!(store_digest(group.store(), &probe), before);
        }
        Verdict::Rejected { message: e } => {
            assert!(!e.is_empty(), "a NACK says why");
            assert_eq!(
                store_digest(group.store(), &probe),
                before,
                "a rejected response ({e}) changed the store"
            );
            assert_eq!(
                group.interest().upstream_subscriptions_by_type(),
                interest_before,
                "a rejected response changed the interest"
            );
        }
        Verdict::Applied { changes, .. } => {
            let store = group.store();
            let wanted =
                |n: &str| group.interest().is_wildcard(&t) || group.interest().wants(&t, n);
            assert_eq!(changes.type_url, t);
            for n in changes.names.iter().chain(&changes.heartbeats) {
                assert!(
                    mentioned.contains(&**n),
                    "change set names {n}, not in the response"
                );
            }
            for b in &resources {
                let r = CachedResource::decode(b.clone()).expect("accepted, so it decodes");
                if !wanted(&r.name) {
                    continue;
                }
                if r.is_heartbeat() {
                    assert_eq!(
                        store.heartbeat(&t, &r.name, &r.key),
                        Some(b),
                        "heartbeat for {} not kept",
                        r.name
                    );
                    assert_eq!(store.has_variant(&t, &r.name, &r.key), Some(true));
                } else {
                    let held = store
                        .resources(&t)
                        .find(|h| h.name == r.name && h.key == r.key)
                        .unwrap_or_else(|| panic!("accepted {} {} not stored", r.name, r.key));
                    assert_eq!(&held.encoded, b, "stored bytes differ from the response's");
                }
            }
            for n in &removed {
                assert!(
                    store.resources(&t).all(|h| &*h.name != n.as_str()),
                    "removed {n} still has variants"
                );
                if wanted(n) {
                    assert_eq!(
                        store.lookup(&t, n),
                        Lookup::Absent,
                        "removed {n} not absent"
                    );
                }
            }
            for rn in &resp.removed_resource_names {
                let k = constraints::key(rn.dynamic_parameter_constraints.as_ref());
                assert_ne!(
                    store.has_variant(&t, &rn.name, &k),
                    Some(true),
                    "removed variant {} {k} still held",
                    rn.name
                );
            }
            let mut last_error: BTreeMap<&str, &ResourceError> = BTreeMap::new();
            for e in &errors {
                if let Some(rn) = &e.resource_name {
                    last_error.insert(rn.name.as_str(), e);
                }
            }
            for (n, e) in last_error {
                if wanted(n) {
                    assert_eq!(store.error(&t, n), Some(e), "error for {n} not held");
                }
            }
            // Untouched names stay as they were; changed ones are reported.
            let reported: BTreeSet<&str> = changes
                .names
                .iter()
                .chain(&changes.heartbeats)
                .map(|n| &**n)
                .collect();
            for (n, d) in &names_before {
                let now = name_digest(store, &t, n);
                if !mentioned.contains(n) {
                    assert_eq!(
                        &now, d,
                        "{n} changed though the response did not mention it"
                    );
                } else if &now != d && wanted(n) {
                    assert!(
                        reported.contains(n.as_str()),
                        "{n} changed silently:\n{d}\n->\n{now}"
                    );
                }
            }
        }
    }
}

/// Every name the response touches: resources (when they decode), removals, variant removals and
/// errors.
fn mentioned_names(resp: &wire::DeltaDiscoveryResponse) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for b in &resp.resources {
        if let Ok(r) = CachedResource::decode(Bytes::copy_from_slice(b)) {
            out.insert(r.name.to_string());
        }
    }
    out.extend(resp.removed_resources.iter().cloned());
    out.extend(resp.removed_resource_names.iter().map(|r| r.name.clone()));
    out.extend(
        resp.resource_errors
            .iter()
            .filter_map(|e| e.resource_name.as_ref().map(|r| r.name.clone())),
    );
    out
}

/// What a subscriber could observe about one name (heartbeats aside: a full resource replaces the
/// pending heartbeat without being a change).
fn name_digest(store: &Store, type_url: &str, name: &str) -> String {
    let mut out = format!(
        "{:?} err={:?}",
        match store.lookup(type_url, name) {
            Lookup::Present(r) => format!("present {}", r.version),
            Lookup::Absent => "absent".into(),
            Lookup::Unknown => "unknown".into(),
        },
        store.error(type_url, name)
    );
    for r in store.resources(type_url).filter(|r| &*r.name == name) {
        out.push_str(&format!(
            "\n  {} v={} arrival={} ttl={:?} bytes={:?}",
            r.key, r.version, r.arrival, r.ttl, r.encoded
        ));
    }
    out
}
