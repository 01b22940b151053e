//! The per-stream Delta xDS state machine (conformance section A), shared by the relay's downstream
//! streams and the demo control plane. It is fed requests and change notifications and produces
//! responses from a [`Store`]; it never blocks, reads a clock or touches a socket.
//!
//! Per type it tracks what the client subscribed to, which version of each resource the client
//! holds (as far as the relay knows), and which names need another look. Responses are built only
//! when the adapter is ready to write, from the store's current content, so a slow client holds at
//! most its pending name set, never a queue of outdated responses (D10).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use bytes::Bytes;

use super::interest::WILDCARD;
use super::resource::Name;
use super::store::{ChangeSet, Lookup, Store};
use crate::pb::discovery::DeltaDiscoveryRequest;
use crate::pb::wire;

/// A request the relay refuses; the adapter ends the stream with INVALID_ARGUMENT.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("type_url is required for ADS (request had an empty type_url)")]
    MissingTypeUrl,
}

/// What a request acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckStatus {
    /// The request carried no `response_nonce`: a pure subscription change.
    None,
    Ack {
        nonce: String,
    },
    Nack {
        nonce: String,
        message: String,
    },
    /// A nonce that is not the latest one sent for this type (F6); subscription changes still apply.
    Stale {
        nonce: String,
    },
}

/// The effects of one request that reach beyond this stream: names to add to and remove from the
/// group's interest and subscriber index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEffects {
    pub type_url: String,
    pub acquire: Vec<Name>,
    pub release: Vec<Name>,
    pub ack: AckStatus,
}

#[derive(Debug, Default)]
struct TypeState {
    wildcard: bool,
    explicit: HashSet<Name>,
    /// Versions the client holds, from our responses and its `initial_resource_versions`.
    known: HashMap<Name, String>,
    /// Names to evaluate at the next build.
    pending: BTreeSet<Name>,
    /// Evaluate every name of the type at the next build (wildcard start, wildcard sync).
    pending_all: bool,
    /// Names that must be sent even if the client holds the current version (A6, A7).
    forced: HashSet<Name>,
    /// An initial wildcard request waits for a response even if it is empty (A2).
    owe_response: bool,
    last_nonce: Option<String>,
    last_ack: Option<String>,
    last_nack: Option<(String, String)>,
}

/// Per-type ACK/NACK state, for logs and introspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeStatus {
    pub type_url: String,
    pub wildcard: bool,
    pub explicit: usize,
    pub last_nonce: Option<String>,
    pub last_ack: Option<String>,
    pub last_nack: Option<(String, String)>,
}

#[derive(Debug, Default)]
pub struct DeltaStream {
    types: BTreeMap<String, TypeState>,
    nonce_seq: u64,
}

/// B14: clusters before endpoints before listeners before routes, so a client never sees a
/// reference before its target. Other types follow in name order.
pub(crate) fn type_rank(type_url: &str) -> u8 {
    match type_url.rsplit('/').next().unwrap_or("") {
        "envoy.config.cluster.v3.Cluster" => 0,
        "envoy.config.endpoint.v3.ClusterLoadAssignment" => 1,
        "envoy.config.listener.v3.Listener" => 2,
        "envoy.config.route.v3.RouteConfiguration" => 3,
        "envoy.config.route.v3.ScopedRouteConfiguration" => 4,
        "envoy.config.route.v3.VirtualHost" => 5,
        _ => 6,
    }
}

impl DeltaStream {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn on_request(
        &mut self,
        req: &DeltaDiscoveryRequest,
    ) -> Result<RequestEffects, ProtocolError> {
        if req.type_url.is_empty() {
            return Err(ProtocolError::MissingTypeUrl);
        }
        let subscribe: Vec<&str> = req
            .resource_names_subscribe
            .iter()
            .map(String::as_str)
            .chain(
                req.resource_locators_subscribe
                    .iter()
                    .map(|l| l.name.as_str()),
            )
            .collect();
        let unsubscribe: Vec<&str> = req
            .resource_names_unsubscribe
            .iter()
            .map(String::as_str)
            .chain(
                req.resource_locators_unsubscribe
                    .iter()
                    .map(|l| l.name.as_str()),
            )
            .collect();

        let mut effects = RequestEffects {
            type_url: req.type_url.clone(),
            acquire: Vec::new(),
            release: Vec::new(),
            ack: AckStatus::None,
        };
        let first = !self.types.contains_key(&req.type_url);
        let ts = self.types.entry(req.type_url.clone()).or_default();

        if first {
            // A1: an empty first subscribe list is a legacy wildcard.
            if subscribe.is_empty() {
                ts.start_wildcard(&mut effects);
            }
            // A11/A12/A14: the versions the client holds; they are not subscriptions.
            for (name, version) in &req.initial_resource_versions {
                let name: Name = name.as_str().into();
                ts.pending.insert(name.clone());
                ts.known.insert(name, version.clone());
            }
        }
        for name in subscribe {
            if name == WILDCARD {
                ts.start_wildcard(&mut effects);
                continue;
            }
            let name: Name = name.into();
            if ts.explicit.insert(name.clone()) {
                effects.acquire.push(name.clone());
            }
            ts.pending.insert(name.clone());
            // A7: resend even if the client has it — except on the first request of a stream,
            // where initial_resource_versions says what it has (A11).
            if !(first && req.initial_resource_versions.contains_key(&*name)) {
                ts.forced.insert(name);
            }
        }
        for name in unsubscribe {
            if name == WILDCARD {
                if ts.wildcard {
                    ts.wildcard = false;
                    ts.owe_response = false;
                    effects.release.push(WILDCARD.into());
                    // A4: the client drops wildcard-only resources itself.
                    let explicit = &ts.explicit;
                    ts.known.retain(|n, _| explicit.contains(n));
                }
                continue;
            }
            // A8: a name never subscribed is ignored.
            let Some(name) = ts.explicit.take(name) else {
                continue;
            };
            effects.release.push(name.clone());
            if ts.wildcard {
                // A6: the client now holds it ambiguously; answer with the resource or a removal.
                ts.pending.insert(name.clone());
                ts.forced.insert(name);
            } else {
                // A9: no response needed; stop tracking so a later subscribe starts fresh.
                ts.known.remove(&name);
                ts.forced.remove(&name);
            }
        }

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
                ts.last_ack = Some(nonce.clone());
                AckStatus::Ack { nonce }
            };
        }
        Ok(effects)
    }

    /// Records that names of a type changed in the store. Types this stream never asked for are
    /// ignored (A22).
    pub fn on_change(&mut self, changes: &ChangeSet) {
        if let Some(ts) = self.types.get_mut(&changes.type_url) {
            ts.pending.extend(changes.names.iter().cloned());
            if changes.wildcard_synced_now && ts.wildcard {
                ts.pending_all = true;
            }
        }
    }

    /// Marks every name of a type for evaluation: what it subscribes to and what it holds. Used when
    /// too many changes piled up to track them one by one.
    pub fn mark_all_pending(&mut self, type_url: &str) {
        if let Some(ts) = self.types.get_mut(type_url) {
            ts.pending_all = true;
        }
    }

    /// Whether a build might produce a response.
    pub fn has_work(&self) -> bool {
        self.types
            .values()
            .any(|t| !t.pending.is_empty() || t.pending_all || t.owe_response)
    }

    /// Builds the next response, trying types in B14 order. `None` means nothing to send now.
    pub fn next_response(&mut self, store: &Store) -> Option<wire::DeltaDiscoveryResponse> {
        let mut order: Vec<String> = self
            .types
            .iter()
            .filter(|(_, t)| !t.pending.is_empty() || t.pending_all || t.owe_response)
            .map(|(k, _)| k.clone())
            .collect();
        order.sort_by_key(|t| (type_rank(t), t.clone()));
        order
            .into_iter()
            .find_map(|type_url| self.build(&type_url, store))
    }

    fn build(&mut self, type_url: &str, store: &Store) -> Option<wire::DeltaDiscoveryResponse> {
        let synced = store.wildcard_synced(type_url);
        let ts = self.types.get_mut(type_url)?;
        let mut candidates = std::mem::take(&mut ts.pending);
        if ts.pending_all {
            ts.pending_all = false;
            if ts.wildcard {
                candidates.extend(store.resources(type_url).map(|r| r.name.clone()));
            }
            candidates.extend(ts.explicit.iter().cloned());
            candidates.extend(ts.known.keys().cloned());
        }

        let mut resources: Vec<Bytes> = Vec::new();
        let mut removed: Vec<String> = Vec::new();
        for name in candidates {
            if &*name == WILDCARD {
                continue;
            }
            let explicit = ts.explicit.contains(&name);
            let covered = explicit || ts.wildcard;
            let forced = ts.forced.contains(&name);
            match store.lookup(type_url, &name) {
                Lookup::Present(r) => {
                    ts.forced.remove(&name);
                    if covered && (forced || ts.known.get(&name) != Some(&r.version)) {
                        resources.push(r.encoded.clone());
                        ts.known.insert(name, r.version.clone());
                    }
                }
                Lookup::Absent => {
                    ts.forced.remove(&name);
                    // A10/A12: tell the client, once, that it does not exist.
                    if covered && (forced || ts.known.contains_key(&name)) {
                        ts.known.remove(&name);
                        removed.push(name.to_string());
                    }
                }
                Lookup::Unknown => {
                    // Only a synced wildcard makes a missing name authoritative (A12, D9);
                    // otherwise wait for the upstream.
                    let gone = ts.wildcard && !explicit && synced;
                    if gone && (forced || ts.known.contains_key(&name)) {
                        ts.forced.remove(&name);
                        ts.known.remove(&name);
                        removed.push(name.to_string());
                    } else if !covered {
                        ts.forced.remove(&name);
                    }
                }
            }
        }

        let answer_owed = ts.owe_response && synced;
        if resources.is_empty() && removed.is_empty() && !answer_owed {
            return None;
        }
        ts.owe_response = false;
        self.nonce_seq += 1;
        let nonce = self.nonce_seq.to_string();
        ts.last_nonce = Some(nonce.clone());
        Some(wire::DeltaDiscoveryResponse {
            type_url: type_url.to_string(),
            resources,
            removed_resources: removed,
            nonce,
            ..Default::default()
        })
    }

    /// Every subscription this stream holds (explicit names and `"*"`), to release when it ends.
    pub fn subscriptions(&self) -> Vec<(String, Name)> {
        self.types
            .iter()
            .flat_map(|(t, ts)| {
                ts.explicit
                    .iter()
                    .cloned()
                    .chain(ts.wildcard.then(|| Name::from(WILDCARD)))
                    .map(move |n| (t.clone(), n))
            })
            .collect()
    }

    /// Whether this stream is wildcard-subscribed to a type.
    pub fn is_wildcard(&self, type_url: &str) -> bool {
        self.types.get(type_url).is_some_and(|t| t.wildcard)
    }

    /// The version of `name` the client holds, as the relay believes.
    pub fn known_version(&self, type_url: &str, name: &str) -> Option<&str> {
        self.types
            .get(type_url)
            .and_then(|t| t.known.get(name))
            .map(String::as_str)
    }

    pub fn status(&self) -> Vec<TypeStatus> {
        self.types
            .iter()
            .map(|(t, ts)| TypeStatus {
                type_url: t.clone(),
                wildcard: ts.wildcard,
                explicit: ts.explicit.len(),
                last_nonce: ts.last_nonce.clone(),
                last_ack: ts.last_ack.clone(),
                last_nack: ts.last_nack.clone(),
            })
            .collect()
    }
}

impl TypeState {
    fn start_wildcard(&mut self, effects: &mut RequestEffects) {
        if !self.wildcard {
            self.wildcard = true;
            effects.acquire.push(WILDCARD.into());
        }
        self.pending_all = true;
        self.owe_response = true;
    }
}
