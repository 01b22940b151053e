//! The upstream protocol of one group, without I/O, in the spirit of quilkin's `ClientState`:
//! what to send when a stream opens (C4), what a response changes and how to answer it (C7, C8,
//! C10, C14, F8), and what to send when the group's interest changed. The runtime task
//! (`upstream.rs`) only connects, sends what this returns, feeds back what it receives and backs
//! off; tests and the fuzz target drive these functions directly.

use std::collections::HashSet;
use std::time::Instant;

use bytes::Bytes;

use super::group::{GroupState, StreamId};
use super::resource::Locator;
use super::store::{ChangeSet, UpstreamUpdate};
use crate::pb::core::Node;
use crate::pb::discovery::{DeltaDiscoveryRequest, ResourceLocator};
use crate::pb::rpc;
use crate::pb::wire::DeltaDiscoveryResponse;

/// gRPC status code NOT_FOUND, which TP3 `resource_errors` use to say a resource does not exist.
const NOT_FOUND: i32 = 5;
/// gRPC status code INTERNAL, used in NACKs as Envoy does.
const INTERNAL: i32 = 13;
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
        affected: HashSet<StreamId>,
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

    /// Applies one response to the group's state and returns the ACK or NACK for it.
    pub fn on_response(
        &self,
        state: &mut GroupState,
        resp: DeltaDiscoveryResponse,
        now: Instant,
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
        let update = upstream_update(resp, now);
        let evicted = state.unsubscribed.evicted_budget;
        let verdict = match state.apply_upstream(&type_url, update) {
            Ok(mut changes) => {
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
    }
}

fn truncate_message(mut message: String) -> String {
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
}
