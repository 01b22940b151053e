//! The upstream protocol of one group over state-of-the-world ADS, for control planes without
//! Delta (issue 33), beside [`super::upstream_session`]'s Delta one and sharing its outcome types:
//! what to send when a stream opens, how to take a response and answer it, and what to send when
//! the group's interest changed. No I/O; the runtime task (`upstream.rs`) drives it.
//!
//! SotW names the whole subscription in every request, so each request of a type carries the
//! union of what the group's clients want (the legacy wildcard, an empty list, for Listener and
//! Cluster and any other type when `"*"` is all that is wanted; an explicit `"*"` beside names). A response is the
//! server's state of the names requested; it becomes a per-resource cache update:
//! - each resource keeps its bytes; a plain `Any` is wrapped in an `envoy...discovery.v3.Resource`
//!   named after its field 1 (every xDS resource type names itself there) with a version derived
//!   from its bytes, stable across relay restarts (so warm restart and downstream
//!   `initial_resource_versions` work); a `Resource`-wrapped one keeps its TTL, `do_not_cache`,
//!   aliases and variant constraints as sent;
//! - for Listener, Cluster and any type subscribed by wildcard the response is the whole state:
//!   a cached name it lacks is removed; for other types absence changes nothing;
//! - unchanged resources (the same bytes) tell no one, so a control plane resending 1,000
//!   Clusters for one change fans out one.

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use bytes::Bytes;
use prost::Message;
use sha2::{Digest, Sha256};

use super::group::GroupState;
use super::interest::WILDCARD;
use super::names::type_urls;
use super::resource::{field_slice, Locator, RESOURCE_TYPE_URL};
use super::store::UpstreamUpdate;
use super::upstream_session::{truncate_message, ProtocolViolation, Verdict, INTERNAL, NOT_FOUND};
use crate::pb::core::Node;
use crate::pb::discovery::{DiscoveryRequest, Resource, ResourceLocator};
use crate::pb::rpc;
use crate::pb::wire::DiscoveryResponse;

/// What one type's subscription looks like on the current stream.
#[derive(Debug, Default, Clone, PartialEq)]
struct TypeSubscription {
    names: Vec<String>,
    locators: Vec<ResourceLocator>,
    /// The `version_info` of the last response accepted (sent back with every request).
    version: String,
    /// The nonce of the last response received.
    nonce: String,
}

/// The answer to one SotW response.
#[derive(Debug)]
pub struct SotwOutcome {
    pub reply: DiscoveryRequest,
    pub verdict: Verdict,
}

/// One group's SotW upstream protocol on one stream: the node it presents (D1) and, per type,
/// what was last requested and accepted.
#[derive(Debug, Clone)]
pub struct SotwUpstream {
    node: Node,
    types: BTreeMap<String, TypeSubscription>,
}

impl SotwUpstream {
    pub fn new(node: Node) -> Self {
        SotwUpstream {
            node,
            types: BTreeMap::new(),
        }
    }

    /// A new stream: one request per type with everything wanted (C4; SotW has no versions to
    /// resume with, the server resends its state and unchanged resources tell no one).
    pub fn initial_requests(&mut self, state: &mut GroupState) -> Vec<DiscoveryRequest> {
        self.types.clear();
        let wanted = state.interest.resubscribe_all();
        wanted
            .into_iter()
            .filter_map(|(type_url, locators)| {
                let sub = subscription(&locators)?;
                self.types.insert(type_url.clone(), sub);
                Some(self.request(&type_url, None))
            })
            .collect()
    }

    /// The interest changed: each type whose union changed is requested again in full, as SotW
    /// requires. A `"*"` sent now is waited for from `now` on, as on the Delta path.
    pub fn interest_requests(
        &mut self,
        state: &mut GroupState,
        now: Instant,
    ) -> Vec<DiscoveryRequest> {
        let changed: HashSet<String> = state
            .take_upstream_changes()
            .into_iter()
            .map(|c| c.type_url)
            .collect();
        state.interest.arm_wildcard_waits(now);
        if changed.is_empty() {
            return Vec::new();
        }
        let held = state.interest.held_locators();
        let mut out = Vec::new();
        for type_url in changed {
            let locators = held
                .iter()
                .find(|(t, _)| *t == type_url)
                .map(|(_, l)| l.as_slice())
                .unwrap_or_default();
            // SotW cannot say "nothing" for every type (an empty list is Listener's and Cluster's
            // wildcard): a type nobody wants any more stays as it was; its responses are ignored.
            let Some(sub) = subscription(locators) else {
                continue;
            };
            // A type new on the stream always goes out: its legacy wildcard is an empty list,
            // which equals an empty record.
            let new = !self.types.contains_key(&type_url);
            let entry = self.types.entry(type_url.clone()).or_default();
            if !new && entry.names == sub.names && entry.locators == sub.locators {
                continue;
            }
            entry.names = sub.names;
            entry.locators = sub.locators;
            out.push(self.request(&type_url, None));
        }
        out
    }

    /// Applies one response and returns the ACK or NACK for it.
    pub fn on_response(
        &mut self,
        state: &mut GroupState,
        resp: DiscoveryResponse,
        now: Instant,
    ) -> Result<SotwOutcome, ProtocolViolation> {
        if resp.nonce.is_empty() {
            return Err(ProtocolViolation::NoNonce(resp.type_url));
        }
        let type_url = resp.type_url.clone();
        let Some(sub) = self.types.get_mut(&type_url) else {
            // Nobody asked for it: refused, so a server that sends it learns (issue 33).
            let message = format!("response of type {type_url:?}, which the relay did not request");
            return Ok(self.nack(&type_url, &resp.nonce, message));
        };
        sub.nonce = resp.nonce.clone();
        if !state.interest.has_type(&type_url) {
            let reply = self.request(&type_url, Some(&resp.version_info));
            return Ok(SotwOutcome {
                reply,
                verdict: Verdict::NotSubscribed,
            });
        }
        let full_state = type_url == type_urls::LISTENER
            || type_url == type_urls::CLUSTER
            || state.interest.is_wildcard(&type_url);
        let update = match update_from(&resp, now, full_state) {
            Ok(u) => u,
            Err(message) => return Ok(self.nack(&type_url, &resp.nonce, message)),
        };
        match state.apply_upstream(&type_url, update) {
            Ok(mut changes) => {
                changes.received_at = Some(now);
                let affected = state.affected(&changes);
                if let Some(sub) = self.types.get_mut(&type_url) {
                    sub.version = resp.version_info.clone();
                }
                Ok(SotwOutcome {
                    reply: self.request(&type_url, None),
                    verdict: Verdict::Applied { changes, affected },
                })
            }
            Err(e) => Ok(self.nack(&type_url, &resp.nonce, e.to_string())),
        }
    }

    /// The type's request: its whole subscription, the last accepted version and the last nonce.
    fn request(&self, type_url: &str, version: Option<&str>) -> DiscoveryRequest {
        let sub = self.types.get(type_url).cloned().unwrap_or_default();
        DiscoveryRequest {
            version_info: version.map_or(sub.version, str::to_string),
            node: Some(self.node.clone()),
            resource_names: sub.names,
            resource_locators: sub.locators,
            type_url: type_url.to_string(),
            response_nonce: sub.nonce,
            error_detail: None,
        }
    }

    fn nack(&self, type_url: &str, nonce: &str, message: String) -> SotwOutcome {
        let message = truncate_message(message);
        let mut reply = self.request(type_url, None);
        reply.response_nonce = nonce.to_string();
        reply.error_detail = Some(rpc::Status {
            code: INTERNAL,
            message: message.clone(),
            details: vec![],
        });
        SotwOutcome {
            reply,
            verdict: Verdict::Rejected { message },
        }
    }
}

/// A type's SotW subscription from the locators wanted; `None` when nothing is.
fn subscription(locators: &[Locator]) -> Option<TypeSubscription> {
    if locators.is_empty() {
        return None;
    }
    let wildcard = locators.iter().any(|l| &*l.name == WILDCARD);
    let mut names: Vec<String> = locators
        .iter()
        .filter(|l| l.is_plain())
        .map(|l| l.name.to_string())
        .collect();
    let with_params: Vec<ResourceLocator> = locators
        .iter()
        .filter(|l| !l.is_plain())
        .map(|l| ResourceLocator {
            name: l.name.to_string(),
            dynamic_parameters: l
                .params
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        })
        .collect();
    // The legacy wildcard (an empty list) when `"*"` is all that is wanted, for every type: Envoy
    // sends it so, and go-control-plane's SotW caches understand only that form (an explicit
    // `"*"` alone is never answered in ADS mode, and answered empty otherwise).
    if wildcard && names.len() == 1 && with_params.is_empty() {
        names.clear();
    }
    names.sort();
    Some(TypeSubscription {
        names,
        locators: with_params,
        ..Default::default()
    })
}

/// A response as the store takes it, or why it is refused.
fn update_from(
    resp: &DiscoveryResponse,
    now: Instant,
    full_state: bool,
) -> Result<UpstreamUpdate, String> {
    let mut resources = Vec::with_capacity(resp.resources.len());
    for (index, bytes) in resp.resources.iter().enumerate() {
        let any = prost_types::Any::decode(bytes.as_ref())
            .map_err(|e| format!("resource #{index} does not decode as an Any: {e}"))?;
        if any.type_url == RESOURCE_TYPE_URL {
            // Wrapped: TTL, cache control, aliases and constraints as the server sent them.
            resources.push(Bytes::from(any.value));
            continue;
        }
        if any.type_url != resp.type_url {
            return Err(format!(
                "resource #{index} has type {:?} in a response of type {:?}",
                any.type_url, resp.type_url
            ));
        }
        let value = Bytes::from(any.value);
        let name = field_slice(&value, 1)
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                format!(
                    "resource #{index} of type {:?} has no name (field 1)",
                    resp.type_url
                )
            })?;
        let version = version_of(&resp.type_url, &value);
        let wrapped = Resource {
            name,
            version,
            resource: Some(prost_types::Any {
                type_url: any.type_url,
                value: value.to_vec(),
            }),
            ..Default::default()
        };
        resources.push(Bytes::from(wrapped.encode_to_vec()));
    }
    let (not_found, errors): (Vec<_>, Vec<_>) = resp
        .resource_errors
        .iter()
        .cloned()
        .partition(|e| e.error_detail.as_ref().is_some_and(|s| s.code == NOT_FOUND));
    Ok(UpstreamUpdate {
        resources,
        removed: not_found
            .into_iter()
            .filter_map(|e| e.resource_name.map(|r| r.name))
            .collect(),
        removed_variants: Vec::new(),
        errors,
        received_at: Some(now),
        full_state,
    })
}

/// A resource's version, derived from its bytes: the same resource gets the same version on
/// every relay, before and after a restart. The first 8 bytes of SHA-256, in hex.
pub fn version_of(type_url: &str, value: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(type_url.as_bytes());
    h.update([0]);
    h.update(value);
    let digest = h.finalize();
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::xds::contract::RequestEffects;
    use crate::xds::store::Lookup;

    const CDS: &str = type_urls::CLUSTER;
    const LDS: &str = type_urls::LISTENER;
    const EDS: &str = type_urls::ENDPOINTS;
    const RDS: &str = type_urls::ROUTE;

    fn want(state: &mut GroupState, stream: u32, type_url: &str, names: &[&str]) {
        let mut effects = RequestEffects::new(type_url);
        effects.acquire = names.iter().map(|n| Locator::plain(*n)).collect();
        state.apply_effects(stream, &effects, Instant::now());
    }

    fn session() -> SotwUpstream {
        SotwUpstream::new(Node {
            id: "relay".into(),
            ..Default::default()
        })
    }

    /// A plain resource of `type_url` whose field 1 is `name` and whose body says `body`.
    fn plain(type_url: &str, name: &str, body: &str) -> Bytes {
        let mut value = Vec::new();
        prost::encoding::string::encode(1, &name.to_string(), &mut value);
        prost::encoding::string::encode(2, &body.to_string(), &mut value);
        prost_types::Any {
            type_url: type_url.into(),
            value,
        }
        .encode_to_vec()
        .into()
    }

    fn response(type_url: &str, nonce: &str, resources: Vec<Bytes>) -> DiscoveryResponse {
        DiscoveryResponse {
            version_info: format!("v-{nonce}"),
            resources,
            type_url: type_url.into(),
            nonce: nonce.into(),
            ..Default::default()
        }
    }

    fn changed(out: &SotwOutcome) -> Vec<String> {
        let Verdict::Applied { changes, .. } = &out.verdict else {
            panic!("not applied: {:?}", out.verdict);
        };
        let mut names: Vec<String> = changes.names.iter().map(|n| n.to_string()).collect();
        names.sort();
        names
    }

    fn nack_message(out: &SotwOutcome) -> String {
        assert!(
            matches!(out.verdict, Verdict::Rejected { .. }),
            "{:?}",
            out.verdict
        );
        out.reply
            .error_detail
            .as_ref()
            .expect("a NACK")
            .message
            .clone()
    }

    #[test]
    fn each_type_requests_the_union_with_the_legacy_wildcard_when_only_the_wildcard_is_wanted() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, LDS, &["*"]);
        want(&mut state, 1, CDS, &["*"]);
        want(&mut state, 2, CDS, &["c9"]);
        want(&mut state, 1, EDS, &["e2", "e1"]);
        want(&mut state, 2, EDS, &["e1"]);
        want(&mut state, 1, RDS, &["*"]);
        let requests = session().initial_requests(&mut state);
        let by_type: BTreeMap<&str, &DiscoveryRequest> =
            requests.iter().map(|r| (r.type_url.as_str(), r)).collect();
        assert!(by_type[LDS].resource_names.is_empty(), "legacy wildcard");
        assert_eq!(by_type[CDS].resource_names, ["*", "c9"]);
        assert_eq!(by_type[EDS].resource_names, ["e1", "e2"]);
        assert!(
            by_type[RDS].resource_names.is_empty(),
            "legacy wildcard, any type"
        );
        assert!(requests.iter().all(|r| r.version_info.is_empty()
            && r.response_nonce.is_empty()
            && r.node.as_ref().is_some_and(|n| n.id == "relay")));
    }

    #[test]
    fn a_full_state_response_becomes_one_change_per_changed_resource_and_removes_what_it_lacks() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, CDS, &["*"]);
        let mut s = session();
        s.initial_requests(&mut state);
        let now = Instant::now();
        let all = |b: &str| {
            (0..1000)
                .map(|i| plain(CDS, &format!("c{i:04}"), if i == 7 { b } else { "same" }))
                .collect::<Vec<_>>()
        };
        let out = s
            .on_response(&mut state, response(CDS, "n1", all("one")), now)
            .unwrap();
        assert_eq!(changed(&out).len(), 1000);
        assert_eq!(out.reply.version_info, "v-n1", "ACK names the version");
        assert_eq!(out.reply.response_nonce, "n1");
        assert!(out.reply.error_detail.is_none());
        // The server resends all 1,000 with one changed: one change reaches clients.
        let out = s
            .on_response(&mut state, response(CDS, "n2", all("two")), now)
            .unwrap();
        assert_eq!(changed(&out), ["c0007"]);
        // One missing from the next full state: removed.
        let mut fewer = all("two");
        fewer.remove(3);
        let out = s
            .on_response(&mut state, response(CDS, "n3", fewer), now)
            .unwrap();
        assert_eq!(changed(&out), ["c0003"]);
        assert!(!state.store.holds_name(CDS, "c0003"));
    }

    #[test]
    fn versions_come_from_the_bytes_and_are_the_same_on_every_relay() {
        let mut a = GroupState::new(Duration::ZERO);
        let mut b = GroupState::new(Duration::ZERO);
        for state in [&mut a, &mut b] {
            want(state, 1, CDS, &["*"]);
            let mut s = session();
            s.initial_requests(state);
            s.on_response(
                state,
                response(CDS, "n1", vec![plain(CDS, "c1", "x")]),
                Instant::now(),
            )
            .unwrap();
        }
        let version =
            |state: &GroupState| match state.store.lookup_for(CDS, "c1", &Default::default()) {
                Lookup::Present(r) => r.version.clone(),
                other => panic!("{other:?}"),
            };
        assert_eq!(version(&a), version(&b));
        assert_eq!(version(&a).len(), 16);
        assert_ne!(version_of(CDS, b"x"), version_of(CDS, b"y"));
    }

    #[test]
    fn absence_changes_nothing_for_named_types() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, EDS, &["e1", "e2"]);
        let mut s = session();
        s.initial_requests(&mut state);
        let now = Instant::now();
        let both = vec![plain(EDS, "e1", "1"), plain(EDS, "e2", "1")];
        s.on_response(&mut state, response(EDS, "n1", both), now)
            .unwrap();
        let out = s
            .on_response(
                &mut state,
                response(EDS, "n2", vec![plain(EDS, "e1", "2")]),
                now,
            )
            .unwrap();
        assert_eq!(changed(&out), ["e1"]);
        assert!(state.store.holds_name(EDS, "e2"));
    }

    #[test]
    fn wrapped_resources_keep_what_the_server_said() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, EDS, &["e1"]);
        let mut s = session();
        s.initial_requests(&mut state);
        let inner = Resource {
            name: "e1".into(),
            version: "server-v".into(),
            resource: Some(prost_types::Any {
                type_url: EDS.into(),
                value: b"body".to_vec(),
            }),
            ttl: Some(prost_types::Duration {
                seconds: 30,
                nanos: 0,
            }),
            cache_control: Some(crate::pb::discovery::resource::CacheControl {
                do_not_cache: true,
            }),
            ..Default::default()
        };
        let wrapped = prost_types::Any {
            type_url: RESOURCE_TYPE_URL.into(),
            value: inner.encode_to_vec(),
        };
        s.on_response(
            &mut state,
            response(EDS, "n1", vec![wrapped.encode_to_vec().into()]),
            Instant::now(),
        )
        .unwrap();
        let r = state.store.resources(EDS).next().expect("stored").clone();
        assert_eq!(r.version, "server-v");
        assert!(r.do_not_cache);
        assert_eq!(r.ttl, Some(Duration::from_secs(30)));
    }

    #[test]
    fn bad_responses_are_nacked_naming_the_resource_and_leave_the_cache_alone() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, CDS, &["*"]);
        let mut s = session();
        s.initial_requests(&mut state);
        let now = Instant::now();
        s.on_response(
            &mut state,
            response(CDS, "n1", vec![plain(CDS, "c1", "1")]),
            now,
        )
        .unwrap();
        let seq = state.store.seq();
        let cases: Vec<(DiscoveryResponse, &str)> = vec![
            (
                response(CDS, "n2", vec![plain(EDS, "e1", "1")]),
                "resource #0 has type",
            ),
            (
                response(
                    CDS,
                    "n3",
                    vec![plain(CDS, "c1", "2"), plain(CDS, "c1", "3")],
                ),
                "duplicate resource name \"c1\"",
            ),
            (
                response(CDS, "n4", vec![vec![0xff, 0xff].into()]),
                "resource #0 does not decode",
            ),
            (
                response(CDS, "n5", vec![plain(CDS, "", "1")]),
                "has no name",
            ),
            (
                response(EDS, "n6", vec![plain(EDS, "e1", "1")]),
                "did not request",
            ),
        ];
        for (resp, expected) in cases {
            let nonce = resp.nonce.clone();
            let out = s.on_response(&mut state, resp, now).unwrap();
            let message = nack_message(&out);
            assert!(message.contains(expected), "{message:?} lacks {expected:?}");
            assert_eq!(out.reply.response_nonce, nonce);
        }
        assert_eq!(state.store.seq(), seq, "the cache is unchanged");
        assert!(state.store.holds_name(CDS, "c1"));
        // A NACK names the last version accepted.
        let out = s
            .on_response(
                &mut state,
                response(CDS, "n7", vec![vec![0xff].into()]),
                now,
            )
            .unwrap();
        assert_eq!(out.reply.version_info, "v-n1");
    }

    #[test]
    fn a_change_of_the_union_sends_the_whole_list_with_the_last_version_and_nonce() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, EDS, &["e1"]);
        let mut s = session();
        s.initial_requests(&mut state);
        let now = Instant::now();
        s.on_response(
            &mut state,
            response(EDS, "n1", vec![plain(EDS, "e1", "1")]),
            now,
        )
        .unwrap();
        want(&mut state, 2, EDS, &["e2"]);
        let requests = s.interest_requests(&mut state, now);
        assert_eq!(requests.len(), 1);
        assert_eq!(requests[0].resource_names, ["e1", "e2"]);
        assert_eq!(requests[0].version_info, "v-n1");
        assert_eq!(requests[0].response_nonce, "n1");
        // A subscriber of a name already wanted changes nothing upstream.
        want(&mut state, 3, EDS, &["e1"]);
        assert!(s.interest_requests(&mut state, now).is_empty());
    }

    #[test]
    fn a_type_first_wanted_mid_stream_by_wildcard_alone_is_requested() {
        let mut state = GroupState::new(Duration::ZERO);
        want(&mut state, 1, CDS, &["*"]);
        let mut s = session();
        s.initial_requests(&mut state);
        want(&mut state, 1, LDS, &["*"]);
        let requests = s.interest_requests(&mut state, Instant::now());
        assert_eq!(requests.len(), 1, "{requests:?}");
        assert_eq!(requests[0].type_url, LDS);
        assert!(requests[0].resource_names.is_empty());
    }

    proptest::proptest! {
        /// Removals and changes derived from any sequence of full-state Cluster responses: after
        /// each, the cache holds exactly the response's resources, and the names reported changed
        /// are exactly those added, changed or removed since the one before.
        #[test]
        fn full_states_in_any_sequence_leave_exactly_the_last_one_and_report_only_differences(
            states in proptest::collection::vec(
                proptest::collection::btree_map(0u8..12, 0u8..3, 0..10),
                1..8,
            )
        ) {
            let mut state = GroupState::new(Duration::ZERO);
            want(&mut state, 1, CDS, &["*"]);
            let mut s = session();
            s.initial_requests(&mut state);
            let mut before: BTreeMap<u8, u8> = BTreeMap::new();
            for (i, full) in states.iter().enumerate() {
                let resources = full
                    .iter()
                    .map(|(n, b)| plain(CDS, &format!("c{n}"), &b.to_string()))
                    .collect();
                let out = s
                    .on_response(&mut state, response(CDS, &format!("n{i}"), resources), Instant::now())
                    .unwrap();
                let mut expected: Vec<String> = full
                    .keys()
                    .chain(before.keys())
                    .filter(|n| full.get(n) != before.get(n))
                    .map(|n| format!("c{n}"))
                    .collect();
                expected.sort();
                expected.dedup();
                proptest::prop_assert_eq!(changed(&out), expected);
                let mut held: Vec<String> =
                    state.store.resources(CDS).map(|r| r.name.to_string()).collect();
                held.sort();
                let mut want_held: Vec<String> = full.keys().map(|n| format!("c{n}")).collect();
                want_held.sort();
                proptest::prop_assert_eq!(held, want_held);
                before = full.clone();
            }
        }

        /// For any sequence of union changes, the last request of each type names exactly the
        /// union then wanted (the legacy wildcard aside), sorted, and nothing is sent when the
        /// union did not change.
        #[test]
        fn requests_follow_any_sequence_of_union_changes(
            steps in proptest::collection::vec((1u32..4, 0u8..6, proptest::bool::ANY), 1..30)
        ) {
            let mut state = GroupState::new(Duration::ZERO);
            want(&mut state, 1, EDS, &["e0"]);
            let mut s = session();
            s.initial_requests(&mut state);
            let mut held: BTreeMap<(u32, u8), ()> = BTreeMap::from([((1, 0), ())]);
            let mut last: Vec<String> = vec!["e0".into()];
            for (stream, name, subscribe) in steps {
                let l = Locator::plain(format!("e{name}"));
                let mut effects = RequestEffects::new(EDS);
                if subscribe && held.insert((stream, name), ()).is_none() {
                    effects.acquire.push(l);
                } else if !subscribe && held.remove(&(stream, name)).is_some() {
                    effects.release.push(l);
                }
                state.apply_effects(stream, &effects, Instant::now());
                let union: std::collections::BTreeSet<String> =
                    state.interest.held_locators().into_iter()
                        .filter(|(t, _)| t == EDS)
                        .flat_map(|(_, ls)| ls.into_iter().map(|l| l.name.to_string()))
                        .collect();
                let union: Vec<String> = union.into_iter().collect();
                let requests = s.interest_requests(&mut state, Instant::now());
                if union != last && !union.is_empty() {
                    proptest::prop_assert_eq!(requests.len(), 1);
                    proptest::prop_assert_eq!(&requests[0].resource_names, &union);
                    last = union;
                } else {
                    proptest::prop_assert!(requests.is_empty(), "{:?}", requests);
                }
            }
        }
    }
}
