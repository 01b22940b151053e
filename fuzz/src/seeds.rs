//! The seed corpus: a few small, realistic programs per target, built from the same fixtures the
//! targets use so the encodings are real. Written to `<dir>/<target>/seed-<n>`.

use std::path::Path;

use adsrelay::pb::core::Node;
use adsrelay::pb::discovery::dynamic_parameter_constraints::{SingleConstraint, Type};
use adsrelay::pb::discovery::{
    DeltaDiscoveryRequest, DiscoveryRequest, DynamicParameterConstraints, ResourceLocator,
    ResourceName,
};
use adsrelay::pb::wire;
use arbitrary::{Arbitrary, Unstructured};
use prost::Message;

use crate::constraint_input::{Input, Tree};
use crate::*;

/// Op codes of the request targets (`op % 8` in delta_requests / sotw_requests).
const RAW: u8 = 0;
const RESPOND: u8 = 2;
const UPSTREAM: u8 = 3;
const EXPIRE: u8 = 5;
const REFETCH: u8 = 6;
const ACK_LATEST: u8 = 7;
/// Respond modes: build up to 8 responses and ACK / NACK each.
const ACK_ALL: u8 = 7;
const NACK_ALL: u8 = 7 | (1 << 3);

/// The byte of an upstream change: type index, name index, action (see `upstream_change`).
fn change(type_idx: u8, name_idx: u8, action: u8) -> u8 {
    type_idx | (name_idx << 2) | (action << 5)
}

fn node() -> Node {
    Node {
        id: "envoy-1".into(),
        cluster: "edge".into(),
        ..Default::default()
    }
}

fn raw(out: &mut Vec<u8>, msg: &impl Message) {
    out.push(RAW);
    push_chunk(out, &msg.encode_to_vec());
}

fn delta(type_url: &str, subscribe: &[&str], unsubscribe: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(node()),
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn locator(name: &str, env: &str) -> ResourceLocator {
    ResourceLocator {
        name: name.into(),
        dynamic_parameters: [("env".to_string(), env.to_string())].into_iter().collect(),
    }
}

fn delta_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    // Envoy start-up: CDS wildcard, EDS by name, an update, an unsubscribe.
    let mut s = vec![0];
    raw(&mut s, &delta(CLUSTER, &[], &[]));
    s.extend([RESPOND, ACK_ALL]);
    raw(&mut s, &delta(ENDPOINT, &["a", "c"], &[]));
    s.extend([
        RESPOND,
        ACK_ALL,
        UPSTREAM,
        change(2, 0, 0),
        RESPOND,
        ACK_ALL,
    ]);
    raw(&mut s, &delta(ENDPOINT, &[], &["a"]));
    s.extend([UPSTREAM, change(2, 0, 2), RESPOND, ACK_ALL]);
    seeds.push(s);
    // Reconnect with initial versions, then locators (TP2) and a variant removal upstream.
    let mut s = vec![2];
    let mut req = delta(CUSTOM, &["a", "b"], &[]);
    req.initial_resource_versions = [("a".to_string(), "1".to_string())].into_iter().collect();
    req.resource_locators_subscribe = vec![locator("c", "prod"), locator("c", "dev")];
    raw(&mut s, &req);
    s.extend([
        RESPOND,
        ACK_ALL,
        UPSTREAM,
        change(3, 2, 4),
        RESPOND,
        ACK_ALL,
    ]);
    s.extend([UPSTREAM, change(3, 2, 3), RESPOND, NACK_ALL, ACK_LATEST, 3]);
    seeds.push(s);
    // Wildcard plus an explicit name, then the wildcard dropped (A4, A6); TTL heartbeats.
    let mut s = vec![0];
    raw(&mut s, &delta(CUSTOM, &["*", "a"], &[]));
    s.extend([
        RESPOND,
        ACK_ALL,
        UPSTREAM,
        change(3, 1, 6),
        RESPOND,
        ACK_ALL,
    ]);
    raw(&mut s, &delta(CUSTOM, &[], &["a"]));
    s.extend([RESPOND, ACK_ALL]);
    raw(&mut s, &delta(CUSTOM, &[], &["*"]));
    s.extend([EXPIRE, EXPIRE, EXPIRE, EXPIRE, EXPIRE, RESPOND, ACK_ALL]);
    seeds.push(s);
    // do_not_cache content and refetch; the source-of-truth store; tight limits.
    let mut s = vec![1 | 4];
    raw(&mut s, &delta(LISTENER, &["a", "b", "d", "f"], &[]));
    s.extend([UPSTREAM, change(1, 1, 1), REFETCH, RESPOND, ACK_ALL]);
    raw(&mut s, &delta(LISTENER, &["e"], &["b"]));
    s.extend([RESPOND, ACK_ALL]);
    seeds.push(s);
    // Shaped requests (op 1): subscribe a,b,c on EDS, NACK, then unsubscribe b.
    seeds.push(vec![
        0,
        1,
        2,
        0b111,
        0,
        0,
        RESPOND,
        NACK_ALL,
        1,
        2 | 4,
        0,
        0b10,
        0,
        RESPOND,
        ACK_ALL,
    ]);
    seeds
}

fn sotw(type_url: &str, names: &[&str], nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(node()),
        type_url: type_url.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn sotw_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    // Envoy on api_type GRPC: CDS and LDS wildcard, EDS and RDS by name, updates.
    let mut s = vec![0];
    raw(&mut s, &sotw(CLUSTER, &[], ""));
    s.extend([RESPOND, ACK_ALL]);
    raw(&mut s, &sotw(ENDPOINT, &["a", "c"], ""));
    s.extend([RESPOND, ACK_ALL]);
    raw(&mut s, &sotw(LISTENER, &[], ""));
    s.extend([
        RESPOND,
        ACK_ALL,
        UPSTREAM,
        change(2, 0, 0),
        UPSTREAM,
        change(0, 1, 2),
    ]);
    s.extend([RESPOND, ACK_ALL]);
    raw(&mut s, &sotw(ENDPOINT, &["c"], "2"));
    s.extend([RESPOND, ACK_ALL]);
    seeds.push(s);
    // gRPC client with resource-in-sotw, locators, a NACK and a B13 re-request.
    let mut s = vec![8 | 2];
    let mut req = sotw(CUSTOM, &["a"], "");
    req.resource_locators = vec![locator("c", "dev")];
    raw(&mut s, &req);
    s.extend([RESPOND, NACK_ALL, ACK_LATEST, 3, ACK_LATEST, 3]);
    s.extend([UPSTREAM, change(3, 2, 7), EXPIRE, RESPOND, ACK_ALL]);
    seeds.push(s);
    // Full-state listener with names the cache does not know yet, then they arrive.
    let mut s = vec![0];
    raw(&mut s, &sotw(LISTENER, &["a", "f"], ""));
    s.extend([
        RESPOND,
        ACK_ALL,
        UPSTREAM,
        change(1, 5, 0),
        RESPOND,
        ACK_ALL,
    ]);
    s.extend([UPSTREAM, change(1, 5, 1), REFETCH, RESPOND, ACK_ALL]);
    seeds.push(s);
    seeds
}

fn response(type_url: &str, nonce: &str) -> wire::DeltaDiscoveryResponse {
    wire::DeltaDiscoveryResponse {
        type_url: type_url.into(),
        nonce: nonce.into(),
        ..Default::default()
    }
}

fn responses(flags: u8, list: &[wire::DeltaDiscoveryResponse]) -> Vec<u8> {
    let mut s = vec![flags];
    for r in list {
        push_chunk(&mut s, &r.encode_to_vec());
    }
    s
}

fn upstream_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    // Updates, a heartbeat and removals (plain and NOT_FOUND).
    let mut r1 = response(CLUSTER, "1");
    r1.resources = vec![
        resource(CLUSTER, "a", "2", None, None, false),
        heartbeat("b", "1", 20),
        resource(CLUSTER, "f", "1", None, Some(60), true),
    ];
    r1.removed_resources = vec!["d".into(), "x".into()];
    r1.resource_errors = vec![resource_error("e", 5), resource_error("f", 14)];
    let mut r2 = response(CLUSTER, "2");
    r2.resources = vec![resource(CLUSTER, "a", "2", None, None, false)];
    seeds.push(responses(0, &[r1, r2]));
    // Variants: a new prod one, the dev one removed.
    let mut r = response(ENDPOINT, "7");
    r.resources = vec![resource(
        ENDPOINT,
        "c",
        "2",
        Some(env_is("prod")),
        None,
        false,
    )];
    r.removed_resource_names = vec![ResourceName {
        name: "c".into(),
        dynamic_parameter_constraints: Some(env_is("dev")),
    }];
    seeds.push(responses(0, &[r]));
    // Rejected: a duplicate name, a type mismatch, a malformed constraint, a stale heartbeat.
    let mut dup = response(LISTENER, "3");
    dup.resources = vec![
        resource(LISTENER, "a", "5", None, None, false),
        resource(LISTENER, "a", "6", None, None, false),
    ];
    let mut mismatch = response(LISTENER, "4");
    mismatch.resources = vec![resource(CLUSTER, "b", "2", None, None, false)];
    let mut malformed = response(LISTENER, "5");
    let bad = DynamicParameterConstraints {
        r#type: Some(Type::Constraint(SingleConstraint {
            key: "env".into(),
            constraint_type: None,
        })),
    };
    malformed.resources = vec![resource(LISTENER, "c", "9", Some(bad), None, false)];
    let mut stale = response(LISTENER, "6");
    stale.resources = vec![heartbeat("a", "0", 5)];
    seeds.push(responses(0, &[dup, mismatch, malformed, stale]));
    // Wildcard interest, the subscription not sent yet; then an unrequested name.
    let mut r = response(CUSTOM, "1");
    r.resources = vec![resource(CUSTOM, "zz", "1", None, None, false)];
    r.removed_resources = vec!["a".into()];
    seeds.push(responses(1 | 2, &[r]));
    seeds
}

/// Inputs of the `constraints` target whose decoded trees look like real constraint sets:
/// found by decoding deterministic pseudo-random bytes and keeping one per shape.
fn constraint_seeds() -> Vec<Vec<u8>> {
    fn shape(t: &Tree) -> &'static str {
        match t {
            Tree::Value(..) => "value",
            Tree::Exists(_) => "exists",
            Tree::Malformed(_) => "malformed",
            Tree::Or(v) if v.len() >= 2 => "or",
            Tree::And(v) if v.len() >= 2 => "and",
            Tree::Not(_) => "not",
            _ => "other",
        }
    }
    let mut seeds = Vec::new();
    let mut shapes = std::collections::BTreeSet::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        let bytes: Vec<u8> = (0..48)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(&bytes)) else {
            continue;
        };
        if input.variants.len() < 2 || input.params.is_empty() {
            continue;
        }
        let s = shape(&input.variants[0]);
        if s != "other" && shapes.insert(s) {
            seeds.push(bytes);
        }
    }
    seeds
}

/// Writes every target's seeds under `dir`.
pub fn write_all(dir: &Path) -> std::io::Result<()> {
    let sets = [
        ("delta_requests", delta_seeds()),
        ("sotw_requests", sotw_seeds()),
        ("upstream_response", upstream_seeds()),
        ("constraints", constraint_seeds()),
    ];
    for (target, seeds) in sets {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        for (i, s) in seeds.iter().enumerate() {
            std::fs::write(d.join(format!("seed-{i}")), s)?;
        }
        println!("{target}: {} seeds", seeds.len());
    }
    Ok(())
}
