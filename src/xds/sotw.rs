//! The per-stream state-of-the-world state machine (conformance section B), for gRPC xDS clients
//! and Envoys on `api_type: GRPC`. Same contract as [`super::delta`]: requests and change sets in,
//! responses out, no I/O.
//!
//! Listener and Cluster responses carry the full subscribed state, so one is never built from an
//! incomplete cache (B2, D9): it waits until every requested name is known to exist or not and the
//! wildcard is synced. Other types are sent partially. `version_info` is a digest of the
//! (name, version) pairs the client holds after the response, so it changes exactly when the
//! content it would receive changes, and is the same on every relay replica (D8).

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::delta::{AckStatus, ProtocolError, RequestEffects};
use super::interest::WILDCARD;
use super::resource::Name;
use super::store::{ChangeSet, Lookup, Store};
use crate::pb::core::Node;
use crate::pb::discovery::DiscoveryRequest;
use crate::pb::wire;

/// Client features that announce support for `Resource` wrappers in SotW responses (B16); Envoy's
/// docs and gRPC disagree on the name, so both are accepted.
pub const RESOURCE_IN_SOTW_FEATURES: [&str; 2] = [
    "xds.config.resource-in-sotw",
    "xds.config.supports-resource-in-sotw",
];

/// Exactly these types need the full state in every SotW response (B1).
pub fn is_full_state(type_url: &str) -> bool {
    matches!(
        type_url,
        "type.googleapis.com/envoy.config.listener.v3.Listener"
            | "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    )
}

#[derive(Debug, Default)]
struct TypeState {
    wildcard: bool,
    names: BTreeSet<Name>,
    /// A non-empty `resource_names` was seen: an empty one now means "nothing", not wildcard (B5).
    seen_names: bool,
    /// name -> version the client holds from our responses.
    sent: BTreeMap<Name, String>,
    /// Something relevant changed since the last response.
    dirty: bool,
    /// Names to send even if unchanged: newly requested (B4), re-requested (B13).
    resend: BTreeSet<Name>,
    /// A response is owed even if nothing changed (first request B8, re-request B13).
    force: bool,
    last_nonce: Option<String>,
    acked_nonce: Option<String>,
    last_nack: Option<(String, String)>,
}

#[derive(Debug, Default)]
pub struct SotwStream {
    types: BTreeMap<String, TypeState>,
    nonce_seq: u64,
    /// Send each resource wrapped in a `Resource` (client announced the feature).
    wrap: bool,
}

impl SotwStream {
    pub fn new(wrap: bool) -> Self {
        SotwStream {
            wrap,
            ..Default::default()
        }
    }

    /// Wraps resources iff the node announces one of [`RESOURCE_IN_SOTW_FEATURES`].
    pub fn for_node(node: &Node) -> Self {
        let wrap = node
            .client_features
            .iter()
            .any(|f| RESOURCE_IN_SOTW_FEATURES.contains(&f.as_str()));
        Self::new(wrap)
    }

    pub fn on_request(&mut self, req: &DiscoveryRequest) -> Result<RequestEffects, ProtocolError> {
        if req.type_url.is_empty() {
            return Err(ProtocolError::MissingTypeUrl);
        }
        let requested: Vec<&str> = req
            .resource_names
            .iter()
            .map(String::as_str)
            .chain(req.resource_locators.iter().map(|l| l.name.as_str()))
            .collect();
        let first = !self.types.contains_key(&req.type_url);
        let ts = self.types.entry(req.type_url.clone()).or_default();
        let mut effects = RequestEffects {
            type_url: req.type_url.clone(),
            acquire: Vec::new(),
            release: Vec::new(),
            ack: AckStatus::None,
        };

        // ACK/NACK is judged by nonce and error_detail, never by version_info (B7, F5).
        if !req.response_nonce.is_empty() {
            let nonce = req.response_nonce.clone();
            effects.ack = if ts.last_nonce.as_deref() != Some(nonce.as_str()) {
                AckStatus::Stale { nonce }
            } else if let Some(err) = &req.error_detail {
                ts.last_nack = Some((nonce.clone(), err.message.clone()));
                AckStatus::Nack {
                    nonce,
                    message: err.message.clone(),
                }
            } else {
                if ts.acked_nonce.as_deref() == Some(nonce.as_str()) {
                    // B13: the same ACK again is a re-request (Envoy's EDS after a CDS update).
                    ts.force = true;
                    ts.resend.extend(ts.names.iter().cloned());
                }
                ts.acked_nonce = Some(nonce.clone());
                AckStatus::Ack { nonce }
            };
        } else {
            // B8: the first request of a type on a stream (fresh or reconnecting) gets an answer.
            ts.force = true;
        }

        // The requested set, superseding the previous one (B11); B5 legacy wildcard rules.
        let (wildcard, names): (bool, BTreeSet<Name>) = if requested.is_empty() {
            (first || (ts.wildcard && !ts.seen_names), BTreeSet::new())
        } else {
            ts.seen_names = true;
            (
                requested.contains(&WILDCARD),
                requested
                    .iter()
                    .filter(|n| **n != WILDCARD)
                    .map(|n| Name::from(*n))
                    .collect(),
            )
        };
        if wildcard && !ts.wildcard {
            effects.acquire.push(WILDCARD.into());
            ts.dirty = true;
        } else if !wildcard && ts.wildcard {
            effects.release.push(WILDCARD.into());
            let names_ref = &names;
            ts.sent.retain(|n, _| names_ref.contains(n));
        }
        for added in names.difference(&ts.names) {
            effects.acquire.push(added.clone());
            // B4: newly requested names are sent even if sent before and unchanged.
            ts.resend.insert(added.clone());
        }
        for removed in ts.names.difference(&names) {
            effects.release.push(removed.clone());
            if !wildcard {
                ts.sent.remove(removed);
            }
            ts.resend.remove(removed);
        }
        ts.wildcard = wildcard;
        ts.names = names;
        Ok(effects)
    }

    pub fn on_change(&mut self, changes: &ChangeSet) {
        if let Some(ts) = self.types.get_mut(&changes.type_url) {
            if ts.wildcard
                || changes.wildcard_synced_now
                || changes.names.iter().any(|n| ts.names.contains(n))
            {
                ts.dirty = true;
            }
        }
    }

    pub fn mark_all_pending(&mut self, type_url: &str) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.dirty = true;
        }
    }

    /// Builds the next response, in the same cross-type order as Delta (B14).
    pub fn next_response(&mut self, store: &Store) -> Option<wire::DiscoveryResponse> {
        let mut order: Vec<String> = self
            .types
            .iter()
            .filter(|(_, t)| t.dirty || t.force || !t.resend.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        order.sort_by_key(|t| (super::delta::type_rank(t), t.clone()));
        order.into_iter().find_map(|t| self.build(&t, store))
    }

    fn build(&mut self, type_url: &str, store: &Store) -> Option<wire::DiscoveryResponse> {
        let wrap = self.wrap;
        let ts = self.types.get_mut(type_url)?;
        let mut scope: BTreeSet<Name> = ts.names.clone();
        if ts.wildcard {
            scope.extend(store.resources(type_url).map(|r| r.name.clone()));
        }
        let mut out: Vec<Bytes> = Vec::new();
        if is_full_state(type_url) {
            // B2/D9: wait rather than omit something the client would take as deleted.
            let unknown = ts
                .names
                .iter()
                .any(|n| matches!(store.lookup(type_url, n), Lookup::Unknown));
            if unknown || (ts.wildcard && !store.wildcard_synced(type_url)) {
                return None;
            }
            let mut current = BTreeMap::new();
            for n in &scope {
                if let Lookup::Present(r) = store.lookup(type_url, n) {
                    current.insert(n.clone(), r.version.clone());
                    out.push(if wrap {
                        r.wrapped().clone()
                    } else {
                        r.any.clone()
                    });
                }
            }
            let owed = ts.force || !ts.resend.is_empty();
            ts.dirty = false;
            ts.resend.clear();
            if current == ts.sent && !owed {
                return None;
            }
            ts.sent = current;
        } else {
            for n in &scope {
                match store.lookup(type_url, n) {
                    Lookup::Present(r) => {
                        let resend = ts.resend.remove(n) || ts.force;
                        if resend || ts.sent.get(n) != Some(&r.version) {
                            ts.sent.insert(n.clone(), r.version.clone());
                            out.push(if wrap {
                                r.wrapped().clone()
                            } else {
                                r.any.clone()
                            });
                        }
                    }
                    // B3: a partial type cannot signal deletion; the client keeps what it has.
                    Lookup::Absent => {
                        ts.resend.remove(n);
                        ts.sent.remove(n);
                    }
                    // Wait for the upstream; the resend mark stays until it arrives.
                    Lookup::Unknown => {}
                }
            }
            ts.dirty = false;
            ts.force = false;
            if out.is_empty() {
                return None;
            }
        }
        ts.force = false;
        self.nonce_seq += 1;
        let nonce = self.nonce_seq.to_string();
        ts.last_nonce = Some(nonce.clone());
        Some(wire::DiscoveryResponse {
            version_info: version_of(&ts.sent),
            resources: out,
            type_url: type_url.to_string(),
            nonce,
            ..Default::default()
        })
    }

    pub fn subscriptions(&self) -> Vec<(String, Name)> {
        self.types
            .iter()
            .flat_map(|(t, ts)| {
                ts.names
                    .iter()
                    .cloned()
                    .chain(ts.wildcard.then(|| Name::from(WILDCARD)))
                    .map(move |n| (t.clone(), n))
            })
            .collect()
    }
}

/// A digest of what the client holds: equal content, equal version, on any replica (D8). Never
/// empty, so a client never mistakes it for "no state" (B7).
fn version_of(held: &BTreeMap<Name, String>) -> String {
    let mut h = Sha256::new();
    for (name, version) in held {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(version.as_bytes());
        h.update([0]);
    }
    let digest = h.finalize();
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}
