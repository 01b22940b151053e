//! One downstream state-of-the-world stream against a small pre-populated group, driven by the same
//! kind of op sequence as `delta_requests`: requests (raw protobuf or shaped), response builds with
//! ACK/NACK (an ACK repeats the request's names, as SotW clients do), upstream changes fanned out
//! through the subscriber index, TTL expiry and refetches. Checked against a model of the client:
//! - the core's subscriptions follow the B5/B11 rules (legacy wildcard, superseding lists), the
//!   adapter's running count equals their number, the group holds one reference for each;
//! - every resource sent is in the store at that version and subscribed (explicitly or wildcard);
//! - a Listener/Cluster response holds exactly the subscribed names the store has (B1/B2);
//! - resource errors only for subscribed names; nonces unique;
//! - after a final drain, every plain-name subscription of a partial type whose resource the store
//!   holds was delivered at the current version (unless another subscription of the name selects
//!   a different resource);
//! - when the stream ends, the group holds nothing of it.
#![no_main]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adsrelay::downstream::limits::StreamLimits;
use adsrelay::pb::core::Node;
use adsrelay::pb::discovery::{DiscoveryRequest, ResourceLocator};
use adsrelay::pb::rpc;
use adsrelay::pb::wire;
use adsrelay::xds::constraints::Params;
use adsrelay::xds::resource::RESOURCE_TYPE_URL;
use adsrelay::xds::sotw::is_full_state;
use adsrelay::xds::{GroupState, Locator, Lookup, Name, SotwStream, WILDCARD};
use adsrelay_fuzz::*;
use libfuzzer_sys::fuzz_target;
use prost::Message;

const STREAM: u32 = 1;

fuzz_target!(|data: &[u8]| run(data));

#[derive(Default)]
struct Model {
    seen: BTreeSet<String>,
    /// Types for which a non-empty resource list was sent (B5).
    seen_names: BTreeSet<String>,
    wildcard: BTreeSet<String>,
    subs: BTreeMap<String, BTreeSet<Locator>>,
    /// The names and locators of the latest request per type, repeated in ACKs.
    last_request: BTreeMap<String, (Vec<String>, Vec<ResourceLocator>)>,
    /// What the client holds counting only the responses it accepted (a NACKed response changes
    /// nothing, B7).
    answers: Answers,
    nonces: HashSet<String>,
    last_nonce: BTreeMap<String, String>,
}

impl Model {
    fn subscribed_name(&self, type_url: &str, name: &str) -> bool {
        self.subs
            .get(type_url)
            .is_some_and(|s| s.iter().any(|l| &*l.name == name))
    }
}

struct Harness {
    stream: SotwStream,
    group: GroupState,
    defaults: Arc<Params>,
    limits: StreamLimits,
    subscriptions: usize,
    model: Model,
    now: Instant,
    version: u64,
}

enum End {
    Refused,
}

fn run(data: &[u8]) {
    let mut r = Reader::new(data);
    let flags = r.byte();
    let group = GroupState::new(Duration::ZERO).with_store(if flags & 1 != 0 {
        complete_store()
    } else {
        cache_store()
    });
    let defaults = default_params(flags & 2 != 0);
    let limits = if flags & 4 != 0 {
        StreamLimits {
            max_subscriptions: 5,
            max_name_bytes: 80,
            ..StreamLimits::default()
        }
    } else {
        StreamLimits {
            max_subscriptions: 10_000,
            max_name_bytes: 1024,
            ..StreamLimits::default()
        }
    };
    let node = Node {
        id: "fuzz".into(),
        client_features: if flags & 8 != 0 {
            vec!["xds.config.resource-in-sotw".into()]
        } else {
            vec![]
        },
        ..Default::default()
    };
    let mut h = Harness {
        stream: SotwStream::for_node(&node, defaults.clone()),
        group,
        defaults: Arc::new(defaults),
        limits,
        subscriptions: 0,
        model: Model::default(),
        now: epoch(),
        version: 100,
    };
    let mut ended = None;
    let mut ops = 0;
    while !r.is_empty() && ended.is_none() && ops < 200 {
        ops += 1;
        ended = match r.byte() % 8 {
            0 => match DiscoveryRequest::decode(r.chunk()) {
                Ok(req) => h.request(req).err(),
                Err(_) => None,
            },
            1 => {
                let req = shaped_request(&mut r, &h.model);
                h.request(req).err()
            }
            2 => h.respond(r.byte()).err(),
            3 => {
                h.upstream(r.byte());
                None
            }
            4 => {
                h.stream.mark_all_pending(TYPES[(r.byte() & 3) as usize]);
                None
            }
            5 => {
                h.expire();
                None
            }
            6 => {
                for (t, l) in h.stream.take_refetch() {
                    h.group.refetch(&t, &l, h.now);
                }
                h.group.take_upstream_changes();
                None
            }
            _ => {
                let b = r.byte();
                let req = h.model.reply(TYPES[(b & 3) as usize], None, b & 4 != 0);
                h.request(req).err()
            }
        };
    }
    match ended {
        None => {
            let mut drained = false;
            for _ in 0..256 {
                let Some(resp) = h.stream.next_response(h.group.store()) else {
                    drained = true;
                    break;
                };
                h.check_response(&resp);
                let ack = h.model.reply(&resp.type_url, Some(resp.nonce), false);
                assert!(h.request(ack).is_ok(), "an ACK was refused");
            }
            assert!(
                drained,
                "the stream keeps producing responses with nothing changing"
            );
            h.model.answers.settle_all();
            h.check_delivered();
            let held = h.stream.subscriptions();
            h.close(held);
        }
        Some(End::Refused) => {
            let held = h.stream.subscriptions();
            h.close(held);
        }
    }
}

fn shaped_request(r: &mut Reader, model: &Model) -> DiscoveryRequest {
    let b0 = r.byte();
    let type_url = TYPES[(b0 & 3) as usize];
    let mask = r.byte();
    let mut req = DiscoveryRequest {
        type_url: type_url.into(),
        resource_names: (0..8)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| NAMES[i].to_string())
            .collect(),
        ..Default::default()
    };
    let loc = r.byte();
    if loc & 0x20 != 0 {
        req.resource_locators.push(ResourceLocator {
            name: NAMES[(loc & 7) as usize].into(),
            dynamic_parameters: param_set(loc >> 3).into_iter().collect(),
        });
    }
    if b0 & 4 != 0 {
        req.response_nonce = model.last_nonce.get(type_url).cloned().unwrap_or_default();
        if b0 & 8 != 0 {
            req.error_detail = Some(nack_status());
        }
    }
    req
}

fn nack_status() -> rpc::Status {
    rpc::Status {
        code: 3,
        message: "rejected by fuzz client".into(),
        details: vec![],
    }
}

impl Model {
    /// An ACK/NACK of `nonce` (default: the latest received) that repeats the current request.
    fn reply(&self, type_url: &str, nonce: Option<String>, nack: bool) -> DiscoveryRequest {
        let (names, locators) = self.last_request.get(type_url).cloned().unwrap_or_default();
        DiscoveryRequest {
            type_url: type_url.into(),
            resource_names: names,
            resource_locators: locators,
            response_nonce: nonce
                .or_else(|| self.last_nonce.get(type_url).cloned())
                .unwrap_or_default(),
            error_detail: nack.then(nack_status),
            ..Default::default()
        }
    }
}

impl Harness {
    fn request(&mut self, req: DiscoveryRequest) -> Result<(), End> {
        let effects = admit_request(&mut self.stream, &req, self.subscriptions, &self.limits)
            .ok_or(End::Refused)?;
        self.model_request(&req);
        if !req.response_nonce.is_empty() {
            let nacked = req.error_detail.is_some();
            self.model
                .answers
                .answered(&req.type_url, &req.response_nonce, nacked);
        }
        let subs = self.stream.subscriptions();
        let expected: BTreeSet<(String, Locator)> = self
            .model
            .subs
            .iter()
            .flat_map(|(t, s)| s.iter().map(move |l| (t.clone(), l.clone())))
            .chain(
                self.model
                    .wildcard
                    .iter()
                    .map(|t| (t.clone(), Locator::plain(WILDCARD))),
            )
            .collect();
        let actual: BTreeSet<(String, Locator)> = subs
            .iter()
            .map(|(t, l)| (t.to_string(), l.clone()))
            .collect();
        assert_eq!(actual, expected, "core subscriptions differ from the model");
        assert_eq!(subs.len(), actual.len(), "duplicate subscriptions");
        let total =
            (self.subscriptions + effects.acquire.len()).saturating_sub(effects.release.len());
        assert_eq!(
            total,
            subs.len(),
            "acquire/release effects do not add up to the subscriptions held: {effects:?}"
        );
        self.subscriptions = total;
        if !effects.acquire.is_empty() || !effects.release.is_empty() {
            let seq = self.group.apply_effects(STREAM, &effects, self.now).seq;
            self.stream.subscribed_at(seq);
            self.group.take_upstream_changes();
        }
        for (t, l) in &subs {
            assert_eq!(
                self.group.interest().refcount(t, l),
                1,
                "group interest refcount for {t} {l}"
            );
            assert!(
                self.group.subscribers(t, &l.name) == 1,
                "index misses {t} {l}"
            );
        }
        Ok(())
    }

    /// B5/B11: each request's list replaces the previous one; an empty list is a wildcard only on
    /// the first request of a type, or while a legacy wildcard has never seen names.
    fn model_request(&mut self, req: &DiscoveryRequest) {
        let m = &mut self.model;
        let t = req.type_url.clone();
        let first = m.seen.insert(t.clone());
        let requested =
            Locator::from_request(&req.resource_names, &req.resource_locators, &self.defaults);
        let (wildcard, subs) = if requested.is_empty() {
            (
                first || (m.wildcard.contains(&t) && !m.seen_names.contains(&t)),
                BTreeSet::new(),
            )
        } else {
            m.seen_names.insert(t.clone());
            (
                requested.iter().any(|(l, _)| &*l.name == WILDCARD),
                requested
                    .into_iter()
                    .map(|(l, _)| l)
                    .filter(|l| &*l.name != WILDCARD)
                    .collect(),
            )
        };
        if wildcard {
            m.wildcard.insert(t.clone());
        } else {
            m.wildcard.remove(&t);
        }
        m.subs.insert(t.clone(), subs);
        m.last_request.insert(
            t,
            (req.resource_names.clone(), req.resource_locators.clone()),
        );
    }

    fn respond(&mut self, b: u8) -> Result<(), End> {
        let n = (b & 7) + 1;
        let mode = (b >> 3) & 3;
        for i in 0..n {
            let Some(resp) = self.stream.next_response(self.group.store()) else {
                break;
            };
            self.check_response(&resp);
            let nonce = Some(resp.nonce.clone());
            let last = i + 1 == n;
            let reply = match mode {
                0 => Some(self.model.reply(&resp.type_url, nonce, false)),
                1 => Some(self.model.reply(&resp.type_url, nonce, true)),
                2 => None,
                _ => last.then(|| self.model.reply(&resp.type_url, nonce, false)),
            };
            if let Some(req) = reply {
                self.request(req)?;
            }
        }
        Ok(())
    }

    fn check_response(&mut self, resp: &wire::DiscoveryResponse) {
        let t = resp.type_url.as_str();
        let store = self.group.store();
        let m = &mut self.model;
        assert!(!resp.nonce.is_empty(), "response without nonce");
        assert!(
            m.nonces.insert(resp.nonce.clone()),
            "nonce {} reused",
            resp.nonce
        );
        m.last_nonce.insert(t.into(), resp.nonce.clone());
        assert!(
            m.seen.contains(t),
            "response for a type never requested: {t}"
        );
        let mut names = BTreeSet::new();
        let mut sent = Vec::new();
        for b in &resp.resources {
            let any = prost_types::Any::decode(b.clone()).expect("a SotW resource is an Any");
            let (name, form, version) = if any.type_url == RESOURCE_TYPE_URL {
                let (name, form, version, body) = resource_identity(&any.value);
                assert!(body, "a SotW client got a body-less resource (B17)");
                (name, form, version)
            } else {
                assert_eq!(any.type_url, t, "resource of another type");
                let text = String::from_utf8(any.value).expect("fixture bodies are text");
                let (n, v) = text
                    .split_once('\0')
                    .expect("fixture body is name\\0version");
                (n.to_string(), Form::Plain, v.to_string())
            };
            assert!(
                store_has_version(store, t, &name, &version),
                "sent {t} {name} v{version}, which the store does not hold"
            );
            assert!(
                m.wildcard.contains(t) || m.subscribed_name(t, &name),
                "sent {t} {name}, which the client did not subscribe to"
            );
            names.insert(name.clone());
            sent.push((name, form, version));
        }
        if is_full_state(t) {
            // B1/B2: the full subscribed state the store holds, nothing less, nothing more.
            let mut scope: BTreeSet<Locator> = m.subs.get(t).cloned().unwrap_or_default();
            if m.wildcard.contains(t) {
                for n in store.names(t) {
                    scope.insert(Locator::with_params(n.clone(), self.defaults.clone()));
                }
            }
            let expected: BTreeSet<String> = scope
                .iter()
                .filter(|l| matches!(store.lookup_for(t, &l.name, &l.params), Lookup::Present(_)))
                .map(|l| l.name.to_string())
                .collect();
            assert_eq!(
                names, expected,
                "full-state {t} response is not the subscribed state"
            );
        }
        let mut changes = Vec::new();
        if is_full_state(t) {
            changes.push(HeldChange::Clear);
        }
        changes.extend(
            sent.into_iter()
                .map(|(name, form, version)| HeldChange::Set(name, form, version)),
        );
        m.answers.sent(t, &resp.nonce, changes);
        for e in &resp.resource_errors {
            let n = e
                .resource_name
                .as_ref()
                .map(|r| r.name.as_str())
                .unwrap_or("");
            assert!(
                m.subscribed_name(t, n),
                "resource error for {t} {n:?}, which the client did not subscribe to"
            );
        }
    }

    fn upstream(&mut self, b: u8) {
        self.version += 1;
        let (type_url, update) = upstream_change(b, self.version);
        if let Ok(changes) = self.group.apply_upstream(type_url, update) {
            if !changes.is_empty() && self.group.affected(&changes).contains(&STREAM) {
                self.stream.on_change(&changes);
            }
        }
    }

    fn expire(&mut self) {
        self.now += TTL_STEP;
        for (changes, affected) in self.group.expire(self.now) {
            if affected.contains(&STREAM) {
                self.stream.on_change(&changes);
            }
        }
        self.group.take_upstream_changes();
    }

    /// Partial types: every plain-name subscription whose resource the store may serve reached
    /// the client at the store's version. (Full-state types may legitimately wait, B2.)
    fn check_delivered(&self) {
        let store = self.group.store();
        for (t, subs) in &self.model.subs {
            if is_full_state(t) {
                continue;
            }
            for l in subs.iter().filter(|l| l.params == self.defaults) {
                let params = subs
                    .iter()
                    .filter(|o| o.name == l.name)
                    .map(|o| &*o.params)
                    .chain(self.model.wildcard.contains(t).then_some(&*self.defaults));
                if selections_differ(store, t, &l.name, params) {
                    continue;
                }
                if let Lookup::Present(r) = store.lookup_for(t, &l.name, &l.params) {
                    if r.do_not_cache && !store.is_source() {
                        continue;
                    }
                    assert!(
                        self.model.answers.has_or_rejected(t, &l.name, &r.version),
                        "subscribed {t} {l} never received v{} held by the store",
                        r.version
                    );
                }
            }
        }
    }

    fn close(&mut self, held: Vec<(Name, Locator)>) {
        self.group.remove_stream(STREAM, &held, self.now);
        assert_eq!(
            self.group.interest().upstream_subscription_count(),
            0,
            "interest left behind by a closed stream"
        );
        let indexed: usize = self.group.subscriptions_by_type().map(|(_, n)| n).sum();
        assert_eq!(indexed, 0, "index entries left behind by a closed stream");
    }
}
