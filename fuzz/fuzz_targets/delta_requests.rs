//! One downstream Delta stream against a small pre-populated group, driven by an op sequence:
//! client requests (raw protobuf or shaped from a few bytes), response builds with ACK/NACK,
//! upstream changes fanned out through the group's subscriber index, TTL expiry and refetches.
//! Requests go through the same steps as the stream adapter (limits check, core, subscription
//! count, group effects). Checked against an independent model of the client:
//! - the core's subscriptions equal the model's, the adapter's running count equals their number,
//!   and the group holds exactly one reference per subscription;
//! - every resource sent is in the store at that version and the client subscribed to it
//!   (explicitly or by wildcard); no name is both added and removed in one response;
//! - a removal names only something the client held or asked for (A6/A10/A12), a variant removal
//!   only a variant it holds (E17: including one it kept by rejecting the response that removed
//!   it); resource errors only subscribed names;
//! - nonces are unique;
//! - after a final drain, every plain-name subscription whose resource the store holds was
//!   delivered at the current version (fan-out reached the stream), unless another subscription of
//!   the name selects a different resource;
//! - when the stream ends, the group holds no interest and no index entry for it.
#![no_main]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adsrelay::downstream::limits::StreamLimits;
use adsrelay::pb::discovery::{DeltaDiscoveryRequest, ResourceLocator};
use adsrelay::pb::rpc;
use adsrelay::pb::wire;
use adsrelay::xds::constraints::{self, Params};
use adsrelay::xds::{DeltaStream, GroupState, Locator, Lookup, Name, WILDCARD};
use adsrelay_fuzz::*;
use libfuzzer_sys::fuzz_target;
use prost::Message;

const STREAM: u32 = 1;

fuzz_target!(|data: &[u8]| run(data));

#[derive(Default)]
struct Model {
    /// Types the client has sent a request for.
    seen: BTreeSet<String>,
    wildcard: BTreeSet<String>,
    explicit: BTreeSet<(String, Locator)>,
    /// Every (type, name) the client ever subscribed to explicitly.
    asked: BTreeSet<(String, String)>,
    held: HeldModel,
    /// What the client holds counting only the responses it accepted.
    answers: Answers,
    nonces: HashSet<String>,
    /// Latest nonce received per type, for delayed ACKs.
    last_nonce: BTreeMap<String, String>,
}

impl Model {
    fn subscribed_name(&self, type_url: &str, name: &str) -> bool {
        self.explicit
            .iter()
            .any(|(t, l)| t == type_url && &*l.name == name)
    }

    /// A removal may name what the client holds, a name it subscribes to that does not exist
    /// (A10/A12), or one it unsubscribed from while still wildcard (A6: held ambiguously).
    fn may_remove(&self, type_url: &str, name: &str) -> bool {
        self.held.holds(type_url, name)
            || self.subscribed_name(type_url, name)
            || (self.wildcard.contains(type_url)
                && self
                    .asked
                    .contains(&(type_url.to_string(), name.to_string())))
    }
}

struct Harness {
    stream: DeltaStream,
    group: GroupState,
    defaults: Arc<Params>,
    limits: StreamLimits,
    /// The adapter's running subscription count (acquired minus released).
    subscriptions: usize,
    model: Model,
    now: Instant,
    version: u64,
}

/// Why the stream ended early (the adapter would close it with a status).
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
    let mut h = Harness {
        stream: DeltaStream::with_default_params(defaults.clone()),
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
        let op = r.byte();
        ended = match op % 8 {
            0 => match DeltaDiscoveryRequest::decode(r.chunk()) {
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
                let type_url = TYPES[(b & 3) as usize];
                let nonce = h
                    .model
                    .last_nonce
                    .get(type_url)
                    .cloned()
                    .unwrap_or_default();
                h.request(reply(type_url, nonce, b & 4 != 0)).err()
            }
        };
    }
    match ended {
        None => {
            // Drain everything due; then every plain-name subscription the store can serve must
            // have reached the client at the current version.
            let mut drained = false;
            for _ in 0..256 {
                let Some(resp) = h.stream.next_response(h.group.store()) else {
                    drained = true;
                    break;
                };
                h.check_response(&resp);
                assert!(
                    h.request(reply(&resp.type_url, resp.nonce, false)).is_ok(),
                    "an ACK was refused"
                );
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

/// With `FUZZ_TRACE` set, prints each step, to read how a reproducer gets where it fails.
fn trace(line: impl FnOnce() -> String) {
    if std::env::var_os("FUZZ_TRACE").is_some() {
        eprintln!("{}", line());
    }
}

/// A request built from a few bytes over the fixed name and parameter pools, so subscriptions hit
/// names the store holds.
fn shaped_request(r: &mut Reader, model: &Model) -> DeltaDiscoveryRequest {
    let b0 = r.byte();
    let type_url = TYPES[(b0 & 3) as usize];
    let pick = |mask: u8| -> Vec<String> {
        (0..8)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| NAMES[i].to_string())
            .collect()
    };
    let mut req = DeltaDiscoveryRequest {
        type_url: type_url.into(),
        resource_names_subscribe: pick(r.byte()),
        resource_names_unsubscribe: pick(r.byte()),
        ..Default::default()
    };
    let loc = r.byte();
    if loc & 0x60 != 0 {
        let l = ResourceLocator {
            name: NAMES[(loc & 7) as usize].into(),
            dynamic_parameters: param_set(loc >> 3).into_iter().collect(),
        };
        if loc & 0x20 != 0 {
            req.resource_locators_subscribe.push(l.clone());
        }
        if loc & 0x40 != 0 {
            req.resource_locators_unsubscribe.push(l);
        }
    }
    if b0 & 4 != 0 {
        req.response_nonce = model.last_nonce.get(type_url).cloned().unwrap_or_default();
        if b0 & 8 != 0 {
            req.error_detail = Some(nack_status());
        }
    }
    if b0 & 16 != 0 {
        let versions = r.byte();
        for (i, n) in NAMES.iter().enumerate().take(6) {
            if versions & (1 << i) != 0 {
                let v = if versions & 0x80 != 0 { "1" } else { "0" };
                req.initial_resource_versions
                    .insert(n.to_string(), v.into());
            }
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

fn reply(type_url: &str, nonce: String, nack: bool) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: type_url.into(),
        response_nonce: nonce,
        error_detail: nack.then(nack_status),
        ..Default::default()
    }
}

impl Harness {
    /// The adapter's request path (downstream/stream.rs handle_request), plus model checks.
    fn request(&mut self, req: DeltaDiscoveryRequest) -> Result<(), End> {
        trace(|| format!("request {req:?}"));
        let effects = admit_request(&mut self.stream, &req, self.subscriptions, &self.limits)
            .ok_or(End::Refused)?;
        self.model_request(&req);
        if !req.response_nonce.is_empty() {
            let nacked = req.error_detail.is_some();
            self.model
                .answers
                .answered(&req.type_url, &req.response_nonce, nacked);
            if nacked {
                // A client that rejects a response keeps what it held before it (A23), including
                // what that response removed: the relay may remove it again later.
                let holds = self.model.answers.client_holds(&req.type_url);
                self.model.held.held.insert(req.type_url.clone(), holds);
            }
        }
        let subs = self.stream.subscriptions();
        let expected: BTreeSet<(String, Locator)> = self
            .model
            .explicit
            .iter()
            .cloned()
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

    fn model_request(&mut self, req: &DeltaDiscoveryRequest) {
        let m = &mut self.model;
        let t = req.type_url.clone();
        let first = m.seen.insert(t.clone());
        let sub = Locator::from_request(
            &req.resource_names_subscribe,
            &req.resource_locators_subscribe,
            &self.defaults,
        );
        let unsub = Locator::from_request(
            &req.resource_names_unsubscribe,
            &req.resource_locators_unsubscribe,
            &self.defaults,
        );
        if first {
            if sub.is_empty() {
                m.wildcard.insert(t.clone());
            }
            for (n, v) in &req.initial_resource_versions {
                m.held.insert(&t, n, Form::Plain, v);
                m.answers.accepted.insert(&t, n, Form::Plain, v);
            }
        }
        for (l, _) in sub {
            if &*l.name == WILDCARD {
                m.wildcard.insert(t.clone());
            } else {
                m.asked.insert((t.clone(), l.name.to_string()));
                m.explicit.insert((t.clone(), l));
            }
        }
        for (l, _) in unsub {
            if &*l.name == WILDCARD {
                if m.wildcard.remove(&t) {
                    let explicit: BTreeSet<String> = m
                        .explicit
                        .iter()
                        .filter(|(et, _)| *et == t)
                        .map(|(_, l)| l.name.to_string())
                        .collect();
                    m.held.retain_names(&t, |n| explicit.contains(n));
                    m.answers
                        .accepted
                        .retain_names(&t, |n| explicit.contains(n));
                }
            } else {
                m.explicit.remove(&(t.clone(), l));
            }
        }
    }

    /// Builds up to `n` responses, checks each, and answers them as `b` says.
    fn respond(&mut self, b: u8) -> Result<(), End> {
        let n = (b & 7) + 1;
        let mode = (b >> 3) & 3;
        for i in 0..n {
            let Some(resp) = self.stream.next_response(self.group.store()) else {
                break;
            };
            self.check_response(&resp);
            let last = i + 1 == n;
            match mode {
                0 => self.request(reply(&resp.type_url, resp.nonce.clone(), false))?,
                1 => self.request(reply(&resp.type_url, resp.nonce.clone(), true))?,
                2 => {}
                _ if last => self.request(reply(&resp.type_url, resp.nonce.clone(), false))?,
                _ => {}
            }
        }
        Ok(())
    }

    fn check_response(&mut self, resp: &wire::DeltaDiscoveryResponse) {
        trace(|| {
            let names: Vec<_> = resp
                .resources
                .iter()
                .map(|b| resource_identity(b))
                .collect();
            format!(
                "response {} nonce {} resources {names:?} removed {:?} removed_variants {:?} errors {:?}",
                resp.type_url, resp.nonce, resp.removed_resources, resp.removed_resource_names,
                resp.resource_errors
            )
        });
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
        let mut added = BTreeSet::new();
        let mut changes: Vec<HeldChange> = Vec::new();
        for b in &resp.resources {
            let (name, form, version, _body) = resource_identity(b);
            assert!(
                store_has_version(store, t, &name, &version),
                "sent {t} {name} v{version}, which the store does not hold"
            );
            assert!(
                m.wildcard.contains(t) || m.subscribed_name(t, &name),
                "sent {t} {name}, which the client did not subscribe to"
            );
            assert!(
                added.insert((name.clone(), form.clone())),
                "{t} {name} {form:?} twice in one response"
            );
            changes.push(HeldChange::Set(name.clone(), form.clone(), version.clone()));
            m.held.insert(t, &name, form, &version);
        }
        for n in &resp.removed_resources {
            // A20, by wire identity: a plain removal conflicts with a plain add of the name.
            assert!(
                !added.contains(&(n.clone(), Form::Plain)),
                "{t} {n} both added and removed (A20)"
            );
            assert!(
                m.may_remove(t, n),
                "removal of {t} {n}, which the client neither held nor asked for"
            );
            changes.push(HeldChange::Remove(n.clone(), Form::Plain));
            m.held.remove(t, n, Some(&Form::Plain));
        }
        for rn in &resp.removed_resource_names {
            let c = rn
                .dynamic_parameter_constraints
                .as_ref()
                .expect("a variant removal carries constraints");
            let form = Form::Variant(constraints::key(Some(c)));
            assert!(
                !added.contains(&(rn.name.clone(), form.clone())),
                "{t} {} {form:?} both added and removed (A20)",
                rn.name
            );
            assert!(
                m.held.holds(t, &rn.name),
                "variant removal of {t} {}, which the client never held",
                rn.name
            );
            assert!(
                m.held.held[t][&rn.name].contains_key(&form),
                "variant removal of {t} {} {form:?}, a variant the client never held",
                rn.name
            );
            changes.push(HeldChange::Remove(rn.name.clone(), form.clone()));
            m.held.remove(t, &rn.name, Some(&form));
        }
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
        trace(|| format!("upstream {type_url} {update:?}"));
        if let Ok(changes) = self.group.apply_upstream(type_url, update) {
            if !changes.is_empty() && self.group.affected(&changes).contains(&STREAM) {
                self.stream.on_change(&changes);
            }
        }
    }

    fn expire(&mut self) {
        trace(|| "expire".into());
        self.now += TTL_STEP;
        for (changes, affected) in self.group.expire(self.now) {
            if affected.contains(&STREAM) {
                self.stream.on_change(&changes);
            }
        }
        self.group.take_upstream_changes();
    }

    /// Every plain-name subscription whose resource the store holds (and may serve to anyone) is
    /// held by the client at that version.
    fn check_delivered(&self) {
        let store = self.group.store();
        for (t, l) in &self.model.explicit {
            if l.params != self.defaults {
                continue;
            }
            let params = self
                .model
                .explicit
                .iter()
                .filter(|(et, el)| et == t && el.name == l.name)
                .map(|(_, el)| &*el.params)
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

    /// The stream ends: the group must be left with nothing of it (F9).
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
