//! TP2 dynamic-parameter constraints (src/xds/constraints.rs): matching, the canonical key and
//! variant selection, on arbitrary constraint trees (structured input via `arbitrary`) and
//! parameter sets over a small key pool. Invariants:
//! - `key` is deterministic, survives a protobuf round trip, and ignores the order of AND/OR
//!   children (a shuffled tree has the same key and matches the same parameters);
//! - equal keys match the same parameters;
//! - `not(not(x))` matches like `x`; `not(x)` is the negation of a valid `x`; `and[x]`/`or[x]` match
//!   like `x`; De Morgan holds; an invalid set (malformed leaf anywhere) never matches;
//! - parameters a set does not mention never change the result;
//! - `select` picks a matching variant of the highest specificity, or none when nothing matches,
//!   counts candidates right, and does not depend on the order variants are offered in.
#![no_main]

use adsrelay::pb::discovery::dynamic_parameter_constraints::{ConstraintList, Type};
use adsrelay::pb::discovery::DynamicParameterConstraints;
use adsrelay::xds::constraints::{self, ConstraintKey, Params, Selection};
use adsrelay_fuzz::constraint_input::{to_proto, Input};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn not(c: DynamicParameterConstraints) -> DynamicParameterConstraints {
    DynamicParameterConstraints {
        r#type: Some(Type::NotConstraints(Box::new(c))),
    }
}

fn and(v: Vec<DynamicParameterConstraints>) -> DynamicParameterConstraints {
    DynamicParameterConstraints {
        r#type: Some(Type::AndConstraints(ConstraintList { constraints: v })),
    }
}

fn or(v: Vec<DynamicParameterConstraints>) -> DynamicParameterConstraints {
    DynamicParameterConstraints {
        r#type: Some(Type::OrConstraints(ConstraintList { constraints: v })),
    }
}

/// A small deterministic generator (xorshift) for the shuffles.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0 | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// The same tree with the children of every AND/OR list reordered.
fn shuffled(c: &DynamicParameterConstraints, rng: &mut Rng) -> DynamicParameterConstraints {
    let r#type = match &c.r#type {
        Some(Type::OrConstraints(l)) | Some(Type::AndConstraints(l)) => {
            let mut children: Vec<_> = l.constraints.iter().map(|c| shuffled(c, rng)).collect();
            rng.shuffle(&mut children);
            let l = ConstraintList {
                constraints: children,
            };
            Some(match &c.r#type {
                Some(Type::OrConstraints(_)) => Type::OrConstraints(l),
                _ => Type::AndConstraints(l),
            })
        }
        Some(Type::NotConstraints(inner)) => {
            Some(Type::NotConstraints(Box::new(shuffled(inner, rng))))
        }
        other => other.clone(),
    };
    DynamicParameterConstraints { r#type }
}

fuzz_target!(|input: Input| run(input));

fn run(input: Input) {
    let mut rng = Rng(input.seed);
    let params: Params = input
        .params
        .iter()
        .take(6)
        .map(|(k, v)| (k.as_string(), v.as_string()))
        .collect();
    let variants: Vec<Option<DynamicParameterConstraints>> = input
        .variants
        .iter()
        .take(6)
        .enumerate()
        .map(|(i, t)| {
            (!input.unconstrained.get(i).copied().unwrap_or(false)).then(|| to_proto(t, 0))
        })
        .collect();

    assert_eq!(constraints::key(None), ConstraintKey::UNCONSTRAINED);
    assert!(
        constraints::key(Some(&DynamicParameterConstraints { r#type: None })).is_unconstrained()
    );

    for c in variants.iter().flatten() {
        check_one(c, &params, &mut rng);
    }
    for (i, a) in variants.iter().enumerate() {
        for b in &variants[i + 1..] {
            if constraints::key(a.as_ref()) == constraints::key(b.as_ref()) {
                assert_eq!(
                    constraints::matches_opt(a.as_ref(), &params),
                    constraints::matches_opt(b.as_ref(), &params),
                    "equal keys, different matches: {a:?} / {b:?}"
                );
            }
        }
    }
    check_select(&variants, &params, &mut rng);
}

fn check_one(c: &DynamicParameterConstraints, p: &Params, rng: &mut Rng) {
    let k = constraints::key(Some(c));
    let m = constraints::matches(c, p);
    let valid = constraints::validate(c).is_ok();
    let _ = k.to_string();

    // Identity: deterministic, protobuf round trip, order of AND/OR children irrelevant.
    assert_eq!(constraints::key(Some(&c.clone())), k);
    let decoded = DynamicParameterConstraints::decode(c.encode_to_vec().as_slice())
        .expect("an encoded constraint set decodes");
    assert_eq!(
        constraints::key(Some(&decoded)),
        k,
        "key changed across a round trip"
    );
    assert_eq!(constraints::matches(&decoded, p), m);
    let s = shuffled(c, rng);
    assert_eq!(
        constraints::key(Some(&s)),
        k,
        "reordered children changed the key"
    );
    assert_eq!(
        constraints::matches(&s, p),
        m,
        "reordered children changed the match"
    );

    // Logic.
    if !valid {
        assert!(!m, "an invalid set matched");
        assert!(
            !constraints::matches(&not(c.clone()), p),
            "not(invalid) matched"
        );
    } else {
        assert_eq!(constraints::matches(&not(c.clone()), p), !m, "not(x) != !x");
    }
    assert_eq!(
        constraints::matches(&not(not(c.clone())), p),
        m,
        "not(not(x)) != x"
    );
    assert_eq!(
        constraints::matches(&and(vec![c.clone()]), p),
        m,
        "and[x] != x"
    );
    assert_eq!(
        constraints::matches(&or(vec![c.clone()]), p),
        m,
        "or[x] != x"
    );
    if valid {
        assert!(constraints::matches(&and(vec![]), p), "and[] must match");
        assert!(!constraints::matches(&or(vec![]), p), "or[] must not match");
        let other = shuffled(c, rng);
        let a = constraints::matches(&not(and(vec![c.clone(), not(other.clone())])), p);
        let b = constraints::matches(&or(vec![not(c.clone()), other]), p);
        assert_eq!(a, b, "De Morgan");
    }

    // Parameters the set does not mention do not matter.
    let mentioned = constraints::mentioned_keys(c);
    let mut extra = p.clone();
    let fresh = (0..)
        .map(|i| format!("unmentioned-{i}"))
        .find(|k| !mentioned.contains(k.as_str()))
        .expect("some key is unmentioned");
    extra.insert(fresh, "x".into());
    let mut fewer = p.clone();
    fewer.retain(|k, _| mentioned.contains(k.as_str()));
    assert_eq!(
        constraints::matches(c, &extra),
        m,
        "an unmentioned parameter changed the match"
    );
    assert_eq!(
        constraints::matches(c, &fewer),
        m,
        "dropping unmentioned parameters changed it"
    );
}

fn check_select(variants: &[Option<DynamicParameterConstraints>], p: &Params, rng: &mut Rng) {
    // One variant per key, as the store holds them (first seen wins).
    let mut by_key: Vec<(ConstraintKey, Option<DynamicParameterConstraints>)> = Vec::new();
    for v in variants {
        let k = constraints::key(v.as_ref());
        if !by_key.iter().any(|(bk, _)| *bk == k) {
            by_key.push((k, v.clone()));
        }
    }
    let pick = |order: &[usize]| -> (Option<ConstraintKey>, usize) {
        let sel = constraints::select(
            order
                .iter()
                .map(|&i| (&by_key[i].0, by_key[i].1.as_ref(), &by_key[i].0)),
            p,
        );
        match sel {
            Selection::None => (None, 0),
            Selection::One(k) => (Some(k.clone()), 1),
            Selection::Ambiguous { chosen, candidates } => {
                assert!(candidates >= 2);
                (Some(chosen.clone()), candidates)
            }
        }
    };
    let mut order: Vec<usize> = (0..by_key.len()).collect();
    let (chosen, candidates) = pick(&order);
    rng.shuffle(&mut order);
    assert_eq!(
        pick(&order),
        (chosen.clone(), candidates),
        "selection depends on the order of variants"
    );
    let matching: Vec<&(ConstraintKey, Option<DynamicParameterConstraints>)> = by_key
        .iter()
        .filter(|(_, c)| constraints::matches_opt(c.as_ref(), p))
        .collect();
    assert_eq!(candidates, matching.len(), "candidate count");
    match chosen {
        None => assert!(
            matching.is_empty(),
            "nothing chosen though a variant matches"
        ),
        Some(k) => {
            let (_, c) = matching
                .iter()
                .find(|(mk, _)| *mk == k)
                .expect("the chosen variant matches");
            let best = matching
                .iter()
                .map(|(_, c)| constraints::specificity(c.as_ref(), p))
                .max()
                .unwrap_or(0);
            assert_eq!(
                constraints::specificity(c.as_ref(), p),
                best,
                "a less specific variant was chosen"
            );
        }
    }
}
