//! Who is told about a change (the group's subscriber index, src/xds/subscribers.rs), against a
//! simple model: for any sequence of subscribe, unsubscribe, wildcard on and off, ACK, NACK,
//! disconnect and resume by a few clients, a change to a name reaches exactly the open streams
//! subscribed to it or to the type's wildcard, the group's count per name agrees, and the group
//! holds upstream exactly the names some open stream wants. Streams are driven through the real
//! Delta state machine, and their slots are handed out and reused as the relay does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, Resource};
use adsrelay::pb::google::rpc::Status;
use adsrelay::xds::{ChangeSet, DeltaStream, GroupState, Name, Slot, SlotAllocator, Store};
use bytes::Bytes;
use proptest::prelude::*;
use prost::Message;

const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const NAMES: [&str; 4] = ["a", "b", "c", "d"];
const CLIENTS: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    Subscribe(usize, usize),
    Unsubscribe(usize, usize),
    WildcardOn(usize),
    WildcardOff(usize),
    Ack(usize),
    Nack(usize),
    Disconnect(usize),
    /// The client drops its stream and opens a new one asking for what it had, with the
    /// versions it holds (as Envoy resumes).
    Resume(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let c = || 0..CLIENTS;
    prop_oneof![
        (c(), 0..NAMES.len()).prop_map(|(c, n)| Op::Subscribe(c, n)),
        (c(), 0..NAMES.len()).prop_map(|(c, n)| Op::Unsubscribe(c, n)),
        c().prop_map(Op::WildcardOn),
        c().prop_map(Op::WildcardOff),
        c().prop_map(Op::Ack),
        c().prop_map(Op::Nack),
        c().prop_map(Op::Disconnect),
        c().prop_map(Op::Resume),
    ]
}

/// What a client wants, as the model sees it.
#[derive(Debug, Default, Clone)]
struct Wants {
    names: BTreeSet<&'static str>,
    wildcard: bool,
}

struct Client {
    slot: Slot,
    stream: DeltaStream,
    /// Nonces of responses not yet answered, oldest first.
    unanswered: Vec<String>,
    /// Versions of what it was sent (for a resume).
    versions: BTreeMap<String, String>,
}

struct World {
    group: GroupState,
    slots: SlotAllocator,
    clients: Vec<Option<Client>>,
    model: Vec<Wants>,
    now: Instant,
}

fn store() -> Store {
    let mut store = Store::new();
    let resources = NAMES
        .iter()
        .map(|n| -> Bytes {
            Resource {
                name: n.to_string(),
                version: "1".into(),
                resource: Some(prost_types::Any {
                    type_url: T.into(),
                    value: vec![1; 8],
                }),
                ..Default::default()
            }
            .encode_to_vec()
            .into()
        })
        .collect();
    store
        .apply_delta(T, resources, vec![], true)
        .expect("valid resources");
    store
}

impl World {
    fn request(&mut self, c: usize, req: DeltaDiscoveryRequest) {
        let client = self.clients[c].as_mut().expect("connected");
        let effects = client.stream.on_request(&req).expect("a valid request");
        let applied = self.group.apply_effects(client.slot, &effects, self.now);
        client.stream.subscribed_at(applied.seq);
        while let Some(out) = client.stream.next_frame(self.group.store()) {
            client.unanswered.push(out.frame.nonce.to_string());
            let sent =
                adsrelay::pb::discovery::DeltaDiscoveryResponse::decode(&out.frame.bytes[5..])
                    .expect("a response the relay framed");
            for r in sent.resources {
                client.versions.insert(r.name, r.version);
            }
            for n in sent.removed_resources {
                client.versions.remove(&n);
            }
        }
    }

    /// Opens a stream for client `c` whose first request asks for what the model says it wants.
    fn connect(&mut self, c: usize, versions: BTreeMap<String, String>) {
        let w = &self.model[c];
        let mut subscribe: Vec<String> = w.names.iter().map(|n| n.to_string()).collect();
        if w.wildcard {
            subscribe.push("*".into());
        }
        self.clients[c] = Some(Client {
            slot: self.slots.take(),
            stream: DeltaStream::new(),
            unanswered: vec![],
            versions: BTreeMap::new(),
        });
        self.request(
            c,
            DeltaDiscoveryRequest {
                type_url: T.into(),
                resource_names_subscribe: subscribe,
                initial_resource_versions: versions.into_iter().collect(),
                ..Default::default()
            },
        );
    }

    fn disconnect(&mut self, c: usize) -> Option<BTreeMap<String, String>> {
        let client = self.clients[c].take()?;
        self.group
            .remove_stream(client.slot, &client.stream.subscriptions(), self.now);
        self.slots.give_back(client.slot);
        Some(client.versions)
    }

    fn change(&mut self, c: usize, subscribe: Vec<String>, unsubscribe: Vec<String>) {
        self.request(
            c,
            DeltaDiscoveryRequest {
                type_url: T.into(),
                resource_names_subscribe: subscribe,
                resource_names_unsubscribe: unsubscribe,
                ..Default::default()
            },
        );
    }

    fn apply(&mut self, op: Op) {
        match op {
            // A client that is not connected connects, asking for this.
            Op::Subscribe(c, n) if self.clients[c].is_none() => {
                self.model[c] = Wants::default();
                self.model[c].names.insert(NAMES[n]);
                self.connect(c, BTreeMap::new());
            }
            Op::WildcardOn(c) if self.clients[c].is_none() => {
                self.model[c] = Wants {
                    wildcard: true,
                    ..Wants::default()
                };
                self.connect(c, BTreeMap::new());
            }
            Op::Subscribe(c, n) => {
                self.model[c].names.insert(NAMES[n]);
                self.change(c, vec![NAMES[n].into()], vec![]);
            }
            Op::WildcardOn(c) => {
                self.model[c].wildcard = true;
                self.change(c, vec!["*".into()], vec![]);
            }
            Op::Unsubscribe(c, n) if self.clients[c].is_some() => {
                self.model[c].names.remove(NAMES[n]);
                self.change(c, vec![], vec![NAMES[n].into()]);
            }
            Op::WildcardOff(c) if self.clients[c].is_some() => {
                self.model[c].wildcard = false;
                self.change(c, vec![], vec!["*".into()]);
            }
            Op::Ack(c) | Op::Nack(c) => {
                let Some(client) = self.clients[c].as_mut() else {
                    return;
                };
                if client.unanswered.is_empty() {
                    return;
                }
                let nonce = client.unanswered.remove(0);
                let error_detail = matches!(op, Op::Nack(_)).then(|| Status {
                    code: 3,
                    message: "rejected".into(),
                    ..Default::default()
                });
                self.request(
                    c,
                    DeltaDiscoveryRequest {
                        type_url: T.into(),
                        response_nonce: nonce,
                        error_detail,
                        ..Default::default()
                    },
                );
            }
            Op::Disconnect(c) => {
                self.disconnect(c);
            }
            Op::Resume(c) => {
                // A client that wants nothing does not come back (its empty first request
                // would be a legacy wildcard, another scenario).
                if let Some(versions) = self.disconnect(c) {
                    let w = &self.model[c];
                    if w.wildcard || !w.names.is_empty() {
                        self.connect(c, versions);
                    }
                }
            }
            Op::Unsubscribe(..) | Op::WildcardOff(_) => {}
        }
    }

    /// The model's answer: the slots of the open streams that want `name` (itself or by the
    /// wildcard).
    fn due(&self, name: &str) -> BTreeSet<Slot> {
        self.clients
            .iter()
            .zip(&self.model)
            .filter_map(|(c, w)| {
                let c = c.as_ref()?;
                (w.wildcard || w.names.contains(name)).then_some(c.slot)
            })
            .collect()
    }
}

fn change_of(name: &str) -> ChangeSet {
    ChangeSet {
        type_url: T.into(),
        names: vec![Name::from(name)],
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_change_reaches_exactly_the_open_streams_that_want_it(
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut w = World {
            group: GroupState::new(Duration::ZERO).with_store(store()),
            slots: SlotAllocator::default(),
            clients: (0..CLIENTS).map(|_| None).collect(),
            model: vec![Wants::default(); CLIENTS],
            now: Instant::now(),
        };
        for op in ops {
            w.apply(op.clone());
            for name in NAMES {
                let told: BTreeSet<Slot> = w.group.affected(&change_of(name)).into_iter().collect();
                prop_assert_eq!(&told, &w.due(name), "after {:?}, a change to {}", op, name);
                let explicit = w
                    .clients
                    .iter()
                    .zip(&w.model)
                    .filter(|(c, m)| c.is_some() && m.names.contains(name))
                    .count();
                prop_assert_eq!(w.group.subscribers(T, name), explicit, "subscribers of {}", name);
                let wanted = explicit > 0 || w.group.subscribers(T, "*") > 0;
                prop_assert_eq!(
                    w.group.interest().wants(T, name) || w.group.interest().is_wildcard(T),
                    wanted,
                    "upstream interest in {} after {:?}", name, op
                );
            }
            let wildcards = w
                .clients
                .iter()
                .zip(&w.model)
                .filter(|(c, m)| c.is_some() && m.wildcard)
                .count();
            prop_assert_eq!(w.group.subscribers(T, "*"), wildcards);
        }
    }
}
