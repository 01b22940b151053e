//! The upstream protocol of one group, without I/O, in the spirit of quilkin's `ClientState`:
//! what to send when a stream opens (C4), what a response changes and how to answer it (C7, C8,
//! C10, C14, F8), and what to send when the group's interest changed. The runtime task
//! (`upstream.rs`) only connects, sends what this returns, feeds back what it receives and backs
//! off; tests and the fuzz target drive these functions directly.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Instant;

use bytes::Bytes;

use super::group::GroupState;
use super::resource::{Locator, Name};
use super::store::{ChangeSet, UpstreamUpdate};
use super::subscribers::Affected;
use crate::pb::core::Node;
use crate::pb::discovery::{DeltaDiscoveryRequest, ResourceLocator};
use crate::pb::rpc;
use crate::pb::wire::DeltaDiscoveryResponse;

/// gRPC status code NOT_FOUND, which TP3 `resource_errors` use to say a resource does not exist.
pub(super) const NOT_FOUND: i32 = 5;
/// gRPC status code INTERNAL, used in NACKs as Envoy does.
pub(super) const INTERNAL: i32 = 13;
/// NACK messages are truncated like Envoy's so a huge error cannot bloat the upstream request.
pub const MAX_NACK_MESSAGE: usize = 4096;

/// A response that ends the upstream stream: it cannot be answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolViolation {
    /// F8: a response without a nonce cannot be acknowledged.
    #[error("DeltaDiscoveryResponse for {0:?} has no nonce")]
    NoNonce(String),
}

/// What one upstream response did.
#[derive(Debug)]
pub enum Verdict {
    /// Applied to the cache; `changes` (possibly empty) go to `affected` streams.
    Applied {
        changes: ChangeSet,
        affected: Affected,
    },
    /// C10: a type the group never asked for; ACKed and dropped.
    NotSubscribed,
    /// Refused as a whole (the cache keeps its last good state) and NACKed with this message.
    Rejected { message: String },
}

/// The answer to one upstream response.
#[derive(Debug)]
pub struct ResponseOutcome {
    /// The ACK or NACK to send back.
    pub reply: DeltaDiscoveryRequest,
    pub verdict: Verdict,
    /// The response changed the interest (kept names evicted over the cache budget): send
    /// [`UpstreamSession::interest_requests`] now rather than at the next wake-up.
    pub interest_changed: bool,
}

/// A reconciliation (C18): a stream opened without `initial_resource_versions`, so the server's
/// first answer of each wildcard type is its whole current state of that type. That answer is
/// compared with the cache: unchanged resources change nothing, cached names it does not carry
/// are removed. Named subscriptions prove less: a server answers the names it has, and one that
/// ignores versions still resends them, but a name it does not mention may just not be answered
/// (go-control-plane never answers a name it lacks), so only an explicit removal or NOT_FOUND
/// removes one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reconciliation {
    /// Types whose first answer on the stream has not arrived yet: what it repairs is counted.
    awaiting: BTreeSet<String>,
    /// The wildcard ones among them: their first answer is the server's whole state.
    full_state: BTreeSet<String>,
    /// What the answers repaired, per type.
    pub repairs: BTreeMap<String, Repairs>,
}

/// What a reconciliation found different from the cache in one type, and repaired.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Repairs {
    pub added: u64,
    pub changed: u64,
    pub removed: u64,
}

impl Repairs {
    pub fn total(&self) -> u64 {
        self.added + self.changed + self.removed
    }
}

impl Reconciliation {
    /// Whether a type the stream subscribed still waits for its first answer.
    pub fn is_awaiting(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// Whether every wildcard type got its full-state answer (a server need not answer a named
    /// type it has nothing of, so those do not count).
    pub fn is_complete(&self) -> bool {
        self.full_state.is_empty()
    }
}

/// One group's upstream protocol: the node it presents (D1) and the rules above.
#[derive(Debug, Clone)]
pub struct UpstreamSession {
    node: Node,
}

impl UpstreamSession {
    pub fn new(node: Node) -> Self {
        UpstreamSession { node }
    }

    /// C4: when a stream opens, one request per type with everything still wanted and, when
    /// `send_versions` (the same server as before, C6), the versions the cache holds for it.
    pub fn initial_requests(
        &self,
        state: &mut GroupState,
        send_versions: bool,
    ) -> Vec<DeltaDiscoveryRequest> {
        let types = state.interest.resubscribe_all();
        types
            .into_iter()
            .map(|(type_url, names)| {
                let wildcard = state.interest.is_wildcard(&type_url);
                // Glob members and aliased resources count too (A25, A28): kept by their
                // collection or alias, so the upstream reports their removals while away.
                let irv = if send_versions {
                    state
                        .store
                        .initial_versions(&type_url, |n| wildcard || state.keeps(&type_url, n))
                } else {
                    Default::default()
                };
                let (names, locators) = split_locators(&names);
                DeltaDiscoveryRequest {
                    node: Some(self.node.clone()),
                    resource_names_subscribe: names,
                    resource_locators_subscribe: locators,
                    initial_resource_versions: irv,
                    type_url,
                    ..Default::default()
                }
            })
            .collect()
    }

    /// A reconciliation's first requests: everything wanted, no versions (C18), so the server
    /// sends its whole state of each wildcard type.
    pub fn reconciling_requests(
        &self,
        state: &mut GroupState,
    ) -> (Vec<DeltaDiscoveryRequest>, Reconciliation) {
        let requests = self.initial_requests(state, false);
        let awaiting: BTreeSet<String> = requests.iter().map(|r| r.type_url.clone()).collect();
        let full_state = awaiting
            .iter()
            .filter(|t| state.interest.is_wildcard(t))
            .cloned()
            .collect();
        let reconciliation = Reconciliation {
            awaiting,
            full_state,
            repairs: BTreeMap::new(),
        };
        (requests, reconciliation)
    }

    /// Applies one response to the group's state and returns the ACK or NACK for it.
    pub fn on_response(
        &self,
        state: &mut GroupState,
        resp: DeltaDiscoveryResponse,
        now: Instant,
    ) -> Result<ResponseOutcome, ProtocolViolation> {
        self.answer(state, resp, now, None)
    }

    /// [`Self::on_response`] on a reconciliation's stream: a wildcard type's first answer is the
    /// server's whole state of it; what it repaired is added to `reconciliation`.
    pub fn on_reconciling_response(
        &self,
        state: &mut GroupState,
        resp: DeltaDiscoveryResponse,
        now: Instant,
        reconciliation: &mut Reconciliation,
    ) -> Result<ResponseOutcome, ProtocolViolation> {
        self.answer(state, resp, now, Some(reconciliation))
    }

    fn answer(
        &self,
        state: &mut GroupState,
        resp: DeltaDiscoveryResponse,
        now: Instant,
        reconciliation: Option<&mut Reconciliation>,
    ) -> Result<ResponseOutcome, ProtocolViolation> {
        if resp.nonce.is_empty() {
            return Err(ProtocolViolation::NoNonce(resp.type_url));
        }
        let mut reply = DeltaDiscoveryRequest {
            node: Some(self.node.clone()),
            type_url: resp.type_url.clone(),
            response_nonce: resp.nonce.clone(),
            ..Default::default()
        };
        if !state.interest.has_type(&resp.type_url) {
            return Ok(ResponseOutcome {
                reply,
                verdict: Verdict::NotSubscribed,
                interest_changed: false,
            });
        }
        let type_url = resp.type_url.clone();
        let mut update = upstream_update(resp, now);
        // A reconciliation's full-state answer: what the cache held before, to tell repairs apart.
        let mut first_answer = None;
        if let Some(r) = reconciliation {
            if r.awaiting.remove(&type_url) {
                update.full_state =
                    r.full_state.remove(&type_url) && state.interest.is_wildcard(&type_url);
                let held: HashSet<Name> = state
                    .store
                    .resources(&type_url)
                    .map(|c| c.name.clone())
                    .collect();
                first_answer = Some((r, held));
            }
        }
        let evicted = state.unsubscribed.evicted_budget;
        let verdict = match state.apply_upstream(&type_url, update) {
            Ok(mut changes) => {
                if let Some((r, held)) = first_answer {
                    let repairs = r.repairs.entry(type_url.clone()).or_default();
                    for n in &changes.names {
                        let present = state.store.holds_name(&type_url, n);
                        match (held.contains(n), present) {
                            (true, true) => repairs.changed += 1,
                            (true, false) => repairs.removed += 1,
                            (false, true) => repairs.added += 1,
                            (false, false) => {}
                        }
                    }
                }
                changes.received_at = Some(now);
                let affected = state.affected(&changes);
                Verdict::Applied { changes, affected }
            }
            Err(e) => {
                let message = truncate_message(e.to_string());
                reply.error_detail = Some(rpc::Status {
                    code: INTERNAL,
                    message: message.clone(),
                    details: vec![],
                });
                Verdict::Rejected { message }
            }
        };
        Ok(ResponseOutcome {
            reply,
            verdict,
            interest_changed: state.unsubscribed.evicted_budget != evicted,
        })
    }

    /// What the group's interest changed since the last call, as requests. A "*" sent now that
    /// the upstream need not answer is waited for from `now` on (B2, D9).
    pub fn interest_requests(
        &self,
        state: &mut GroupState,
        now: Instant,
    ) -> Vec<DeltaDiscoveryRequest> {
        let changes = state.take_upstream_changes();
        state.interest.arm_wildcard_waits(now);
        changes
            .into_iter()
            .map(|c| {
                let (subscribe, subscribe_locators) = split_locators(&c.subscribe);
                let (unsubscribe, unsubscribe_locators) = split_locators(&c.unsubscribe);
                DeltaDiscoveryRequest {
                    node: Some(self.node.clone()),
                    type_url: c.type_url,
                    resource_names_subscribe: subscribe,
                    resource_names_unsubscribe: unsubscribe,
                    resource_locators_subscribe: subscribe_locators,
                    resource_locators_unsubscribe: unsubscribe_locators,
                    ..Default::default()
                }
            })
            .collect()
    }
}

/// A response as the store takes it. C14: NOT_FOUND in `resource_errors` means the same as
/// `removed_resources`; other errors are passed through to the subscribers of those names (TP3).
pub fn upstream_update(resp: DeltaDiscoveryResponse, received_at: Instant) -> UpstreamUpdate {
    // Received bytes share the stream's receive buffer; the cache keeps its own copy.
    let resources: Vec<Bytes> = resp
        .resources
        .iter()
        .map(|b| Bytes::copy_from_slice(b))
        .collect();
    let mut removed: Vec<String> = resp.removed_resources;
    let (not_found, errors): (Vec<_>, Vec<_>) = resp
        .resource_errors
        .into_iter()
        .partition(|e| e.error_detail.as_ref().is_some_and(|s| s.code == NOT_FOUND));
    removed.extend(
        not_found
            .into_iter()
            .filter_map(|e| e.resource_name.map(|r| r.name)),
    );
    removed.sort();
    removed.dedup();
    UpstreamUpdate {
        resources,
        removed,
        removed_variants: resp.removed_resource_names,
        errors,
        received_at: Some(received_at),
        full_state: false,
    }
}

pub(super) fn truncate_message(mut message: String) -> String {
    if message.len() > MAX_NACK_MESSAGE {
        let mut cut = MAX_NACK_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push_str("...(truncated)");
    }
    message
}

/// Plain locators go upstream as names, the rest as `ResourceLocator`s with their parameters (E13).
fn split_locators(locators: &[Locator]) -> (Vec<String>, Vec<ResourceLocator>) {
    let (plain, with_params): (Vec<&Locator>, Vec<&Locator>) =
        locators.iter().partition(|l| l.is_plain());
    (
        plain.iter().map(|l| l.name.to_string()).collect(),
        with_params
            .iter()
            .map(|l| ResourceLocator {
                name: l.name.to_string(),
                dynamic_parameters: l
                    .params
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::pb::discovery::{ResourceError, ResourceName};
    use crate::xds::contract::RequestEffects;

    const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

    fn subscribed(names: &[&str]) -> GroupState {
        let mut state = GroupState::new(Duration::ZERO);
        let mut effects = RequestEffects::new(CDS);
        effects.acquire = names.iter().map(|n| Locator::plain(*n)).collect();
        state.apply_effects(1, &effects, Instant::now());
        state.take_upstream_changes();
        state
    }

    fn session() -> UpstreamSession {
        UpstreamSession::new(Node {
            id: "relay".into(),
            ..Default::default()
        })
    }

    #[test]
    fn f8_a_response_without_nonce_ends_the_stream() {
        let mut state = subscribed(&["c1"]);
        let resp = DeltaDiscoveryResponse {
            type_url: CDS.into(),
            ..Default::default()
        };
        assert_eq!(
            session()
                .on_response(&mut state, resp, Instant::now())
                .unwrap_err(),
            ProtocolViolation::NoNonce(CDS.into())
        );
    }

    #[test]
    fn c10_an_unrequested_type_is_acked_and_dropped() {
        let mut state = subscribed(&["c1"]);
        let resp = DeltaDiscoveryResponse {
            type_url: "type.googleapis.com/other".into(),
            nonce: "n1".into(),
            ..Default::default()
        };
        let out = session()
            .on_response(&mut state, resp, Instant::now())
            .unwrap();
        assert!(matches!(out.verdict, Verdict::NotSubscribed));
        assert_eq!(out.reply.response_nonce, "n1");
        assert!(out.reply.error_detail.is_none());
    }

    #[test]
    fn c14_not_found_is_a_removal_and_other_errors_pass_through() {
        let error = |name: &str, code| ResourceError {
            resource_name: Some(ResourceName {
                name: name.into(),
                ..Default::default()
            }),
            error_detail: Some(rpc::Status {
                code,
                message: "x".into(),
                details: vec![],
            }),
        };
        let update = upstream_update(
            DeltaDiscoveryResponse {
                type_url: CDS.into(),
                nonce: "n".into(),
                removed_resources: vec!["b".into()],
                resource_errors: vec![error("a", NOT_FOUND), error("c", 14), error("b", 5)],
                ..Default::default()
            },
            Instant::now(),
        );
        assert_eq!(update.removed, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(update.errors.len(), 1);
    }

    #[test]
    fn c8_a_refused_response_is_nacked_with_a_bounded_message() {
        let mut state = subscribed(&["c1"]);
        let resp = DeltaDiscoveryResponse {
            type_url: CDS.into(),
            nonce: "n1".into(),
            resources: vec![vec![0xff; 10].into()],
            ..Default::default()
        };
        let out = session()
            .on_response(&mut state, resp, Instant::now())
            .unwrap();
        let Verdict::Rejected { message } = &out.verdict else {
            panic!("a garbage resource was accepted: {:?}", out.verdict);
        };
        let detail = out.reply.error_detail.expect("a NACK");
        assert_eq!(detail.code, INTERNAL);
        assert_eq!(&detail.message, message);
        assert_eq!(out.reply.response_nonce, "n1");
        let long = truncate_message("é".repeat(MAX_NACK_MESSAGE));
        assert!(long.len() <= MAX_NACK_MESSAGE + "...(truncated)".len());
        assert!(long.ends_with("...(truncated)"));
    }

    #[test]
    fn c4_a_new_stream_resubscribes_everything_with_versions_only_for_the_same_server() {
        let mut state = subscribed(&["c1", "c2"]);
        let with = session().initial_requests(&mut state, true);
        assert_eq!(with.len(), 1);
        let mut names = with[0].resource_names_subscribe.clone();
        names.sort();
        assert_eq!(names, vec!["c1".to_string(), "c2".to_string()]);
        assert_eq!(with[0].node.as_ref().map(|n| n.id.as_str()), Some("relay"));
        let without = session().initial_requests(&mut state, false);
        assert!(without[0].initial_resource_versions.is_empty());
    }

    fn cluster(name: &str, version: &str) -> Bytes {
        use prost::Message;
        crate::pb::discovery::Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(prost_types::Any {
                type_url: CDS.into(),
                value: format!("{name}@{version}").into_bytes(),
            }),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    fn response(nonce: &str, resources: Vec<Bytes>) -> DeltaDiscoveryResponse {
        DeltaDiscoveryResponse {
            type_url: CDS.into(),
            nonce: nonce.into(),
            resources,
            ..Default::default()
        }
    }

    fn changed_names(out: &ResponseOutcome) -> Vec<String> {
        let Verdict::Applied { changes, .. } = &out.verdict else {
            panic!("not applied: {:?}", out.verdict);
        };
        let mut names: Vec<String> = changes.names.iter().map(|n| n.to_string()).collect();
        names.sort();
        names
    }

    #[test]
    fn c18_a_reconciliation_removes_what_the_full_state_lacks_and_tells_only_real_changes() {
        let (s, now) = (session(), Instant::now());
        let mut state = subscribed(&["*"]);
        let first = vec![cluster("a", "1"), cluster("b", "1"), cluster("c", "1")];
        s.on_response(&mut state, response("n1", first), now)
            .unwrap();
        let (requests, mut rec) = s.reconciling_requests(&mut state);
        assert!(requests[0].initial_resource_versions.is_empty());
        assert!(rec.is_awaiting());
        // The server's whole state: a unchanged, b changed, d new, c gone with no removal sent.
        let full = vec![cluster("a", "1"), cluster("b", "2"), cluster("d", "1")];
        let out = s
            .on_reconciling_response(&mut state, response("n2", full), now, &mut rec)
            .unwrap();
        assert_eq!(changed_names(&out), ["b", "c", "d"], "a is not resent");
        assert!(!state.store.holds_name(CDS, "c"));
        assert!(!rec.is_awaiting());
        assert_eq!(
            rec.repairs[CDS],
            Repairs {
                added: 1,
                changed: 1,
                removed: 1
            }
        );
        // Later responses on the stream are ordinary deltas: what they omit stays.
        let out = s
            .on_reconciling_response(
                &mut state,
                response("n3", vec![cluster("e", "1")]),
                now,
                &mut rec,
            )
            .unwrap();
        assert_eq!(changed_names(&out), ["e"]);
        assert!(state.store.holds_name(CDS, "a"));
    }

    #[test]
    fn c18_a_named_subscription_loses_only_what_the_server_says_is_gone() {
        let (s, now) = (session(), Instant::now());
        let mut state = subscribed(&["a", "b"]);
        s.on_response(
            &mut state,
            response("n1", vec![cluster("a", "1"), cluster("b", "1")]),
            now,
        )
        .unwrap();
        let (_, mut rec) = s.reconciling_requests(&mut state);
        assert!(
            rec.is_complete(),
            "no wildcard type: nothing is a full state"
        );
        let out = s
            .on_reconciling_response(
                &mut state,
                response("n2", vec![cluster("a", "1")]),
                now,
                &mut rec,
            )
            .unwrap();
        assert!(changed_names(&out).is_empty());
        assert!(
            state.store.holds_name(CDS, "b"),
            "silence about a name proves nothing"
        );
    }

    #[test]
    fn c18_a_rejected_full_state_removes_nothing() {
        let (s, now) = (session(), Instant::now());
        let mut state = subscribed(&["*"]);
        s.on_response(&mut state, response("n1", vec![cluster("a", "1")]), now)
            .unwrap();
        let (_, mut rec) = s.reconciling_requests(&mut state);
        let garbage = response("n2", vec![vec![0xff; 4].into()]);
        let out = s
            .on_reconciling_response(&mut state, garbage, now, &mut rec)
            .unwrap();
        assert!(matches!(out.verdict, Verdict::Rejected { .. }));
        assert!(state.store.holds_name(CDS, "a"));
    }
}
