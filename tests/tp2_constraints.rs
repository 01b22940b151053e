//! TP2 dynamic-parameter matching, identity and variant selection (conformance section E):
//! golden truth tables E1–E7 and E15, degenerate forms (E6), and property tests.

use std::collections::BTreeSet;

use adsrelay::pb::discovery::dynamic_parameter_constraints::single_constraint::{
    ConstraintType, Exists,
};
use adsrelay::pb::discovery::dynamic_parameter_constraints::{
    ConstraintList, SingleConstraint, Type,
};
use adsrelay::pb::discovery::{DynamicParameterConstraints as C, ResourceName};
use adsrelay::xds::constraints::*;
use proptest::prelude::*;

// ---- builders ---------------------------------------------------------------------------------

fn single(k: &str, t: Option<ConstraintType>) -> C {
    C {
        r#type: Some(Type::Constraint(SingleConstraint {
            key: k.into(),
            constraint_type: t,
        })),
    }
}
fn val(k: &str, v: &str) -> C {
    single(k, Some(ConstraintType::Value(v.into())))
}
fn exists(k: &str) -> C {
    single(k, Some(ConstraintType::Exists(Exists {})))
}
fn malformed(k: &str) -> C {
    single(k, None)
}
fn and(v: Vec<C>) -> C {
    C {
        r#type: Some(Type::AndConstraints(ConstraintList { constraints: v })),
    }
}
fn or(v: Vec<C>) -> C {
    C {
        r#type: Some(Type::OrConstraints(ConstraintList { constraints: v })),
    }
}
fn not(c: C) -> C {
    C {
        r#type: Some(Type::NotConstraints(Box::new(c))),
    }
}
fn unset() -> C {
    C { r#type: None }
}
fn p(kv: &[(&str, &str)]) -> Params {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn check_table(name: &str, rows: &[(&C, Params, bool)]) {
    for (i, (c, params, want)) in rows.iter().enumerate() {
        assert_eq!(
            matches(c, params),
            *want,
            "{name} row {i}: C={} P={params:?}",
            key(Some(c))
        );
    }
}

// ---- golden tables ----------------------------------------------------------------------------

#[test]
fn e1_value() {
    let c = val("env", "prod");
    check_table(
        "E1",
        &[
            (&c, p(&[("env", "prod")]), true),
            (&c, p(&[("env", "test")]), false),
            (&c, p(&[]), false),
            (&c, p(&[("env", "Prod")]), false),
            (&c, p(&[("env", "prod"), ("version", "v1")]), true),
        ],
    );
}

#[test]
fn e2_exists() {
    let c = exists("version");
    check_table(
        "E2",
        &[
            (&c, p(&[("version", "v1")]), true),
            (&c, p(&[("version", "")]), true),
            (&c, p(&[]), false),
        ],
    );
}

#[test]
fn e3_not() {
    let a = not(val("env", "prod"));
    let b = not(exists("version"));
    check_table(
        "E3",
        &[
            (&a, p(&[]), true),
            (&a, p(&[("env", "test")]), true),
            (&a, p(&[("env", "prod")]), false),
            (&b, p(&[("env", "prod")]), true),
            (&b, p(&[("version", "v1")]), false),
        ],
    );
    // not(not(X)) = X over a handful of P.
    let ps = [
        p(&[]),
        p(&[("env", "prod")]),
        p(&[("env", "test")]),
        p(&[("version", "v1")]),
        p(&[("env", "prod"), ("version", "")]),
    ];
    for x in [val("env", "prod"), exists("version"), a.clone(), b.clone()] {
        let nn = not(not(x.clone()));
        for params in &ps {
            assert_eq!(matches(&nn, params), matches(&x, params));
        }
    }
}

/// E4: the TP2 four-variant example. Each row matches exactly one variant, and `select` returns
/// it as `One` (no ambiguity) whatever the order of the variant list.
#[test]
fn e4_tp2_four_variants() {
    let v1 = and(vec![not(val("env", "prod")), not(val("version", "v1"))]);
    let v2 = and(vec![val("env", "prod"), not(val("version", "v1"))]);
    let v3 = and(vec![not(val("env", "prod")), val("version", "v1")]);
    let v4 = and(vec![val("env", "prod"), val("version", "v1")]);
    let named = [("V1", &v1), ("V2", &v2), ("V3", &v3), ("V4", &v4)];
    let keys: Vec<ConstraintKey> = named.iter().map(|(_, c)| key(Some(c))).collect();
    let rows = [
        (p(&[("env", "prod"), ("version", "v1")]), "V4"),
        (p(&[("env", "prod"), ("version", "v2")]), "V2"),
        (p(&[("env", "test"), ("version", "v1")]), "V3"),
        (p(&[("env", "canary"), ("version", "v3")]), "V1"),
        (p(&[]), "V1"),
        (p(&[("env", "prod")]), "V2"),
    ];
    for (params, want) in &rows {
        let hits: Vec<&str> = named
            .iter()
            .filter(|(_, c)| matches(c, params))
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(hits, vec![*want], "P={params:?}");
        let fwd: Vec<_> = named
            .iter()
            .zip(&keys)
            .map(|((n, c), k)| (k, Some(*c), n))
            .collect();
        assert_eq!(select(fwd.clone(), params), Selection::One(want));
        let rev: Vec<_> = fwd.into_iter().rev().collect();
        assert_eq!(select(rev, params), Selection::One(want));
    }
}

#[test]
fn e5_or() {
    let c = or(vec![val("env", "prod"), val("env", "test")]);
    check_table(
        "E5",
        &[
            (&c, p(&[("env", "test")]), true),
            (&c, p(&[("env", "qa")]), false),
            (&c, p(&[]), false),
        ],
    );
}

/// E6 degenerate forms, and the choice for an unset inner `not`.
#[test]
fn e6_degenerate_forms() {
    let ps = [p(&[]), p(&[("env", "prod")]), p(&[("env", ""), ("x", "y")])];
    for params in &ps {
        // No `type`: unconstrained.
        assert!(matches(&unset(), params));
        // Name only / resource_name without constraints.
        assert!(matches_opt(None, params));
        let rn = ResourceName {
            name: "foo".into(),
            dynamic_parameter_constraints: None,
        };
        assert!(matches_opt(
            rn.dynamic_parameter_constraints.as_ref(),
            params
        ));
        // Empty AND: vacuous match. Empty OR: no match.
        assert!(matches(&and(vec![]), params));
        assert!(!matches(&or(vec![]), params));
        // not(unconstrained) matches nothing; not(empty OR) matches everything.
        assert!(!matches(&not(unset()), params));
        assert!(matches(&not(or(vec![])), params));
        // SingleConstraint without constraint_type: never matches, at any depth, even negated.
        assert!(!matches(&malformed("env"), params));
        assert!(!matches(&not(malformed("env")), params));
        assert!(!matches(&and(vec![not(malformed("zz"))]), params));
        assert!(!matches(&or(vec![and(vec![]), malformed("zz")]), params));
    }
    assert!(validate(&unset()).is_ok());
    assert!(validate(&and(vec![or(vec![]), not(unset())])).is_ok());
    assert_eq!(
        validate(&or(vec![exists("a"), not(malformed("b"))])),
        Err(ConstraintError::MissingConstraintType { key: "b".into() })
    );
    // Malformed sets have their own identity; they never alias a valid set.
    assert_ne!(key(Some(&malformed("a"))), key(Some(&exists("a"))));
}

/// E7: overlapping variants resolve deterministically to the most specific one, and the caller is
/// told there was ambiguity.
#[test]
fn e7_ambiguity() {
    let a = val("env", "prod");
    let b = and(vec![val("env", "prod"), val("version", "v1")]);
    let (ka, kb) = (key(Some(&a)), key(Some(&b)));
    let params = p(&[("env", "prod"), ("version", "v1")]);
    let want = Selection::Ambiguous {
        chosen: &"B",
        candidates: 2,
    };
    assert_eq!(
        select([(&ka, Some(&a), &"A"), (&kb, Some(&b), &"B")], &params),
        want
    );
    assert_eq!(
        select([(&kb, Some(&b), &"B"), (&ka, Some(&a), &"A")], &params),
        want
    );
    // Unconstrained variant loses to anything more specific, and wins alone.
    let kn = key(None);
    let vs = [(&kn, None, &"N"), (&ka, Some(&a), &"A")];
    assert_eq!(select(vs, &p(&[("env", "prod")])).chosen(), Some(&"A"));
    assert_eq!(select(vs, &p(&[("env", "qa")])), Selection::One(&"N"));
}

/// E8: nothing matches -> `Selection::None` (a cache miss; the caller asks upstream).
#[test]
fn e8_no_match_is_none() {
    let a = val("env", "prod");
    let b = val("env", "test");
    let (ka, kb) = (key(Some(&a)), key(Some(&b)));
    let s = select(
        [(&ka, Some(&a), &1), (&kb, Some(&b), &2)],
        &p(&[("env", "qa")]),
    );
    assert_eq!(s, Selection::None);
    assert_eq!(s.chosen(), None);
}

/// E15: identity is structural up to AND/OR child order; the original form is left untouched.
#[test]
fn e15_identity() {
    let x = and(vec![
        val("env", "prod"),
        not(exists("version")),
        or(vec![val("r", "1"), val("r", "2")]),
    ]);
    let y = and(vec![
        or(vec![val("r", "2"), val("r", "1")]),
        val("env", "prod"),
        not(exists("version")),
    ]);
    let before = x.clone();
    assert_eq!(key(Some(&x)), key(Some(&y)));
    assert_eq!(x, before, "key() must not modify the forwarded form");
    let set: BTreeSet<ConstraintKey> = [key(Some(&x)), key(Some(&y))].into_iter().collect();
    assert_eq!(set.len(), 1);
    let hset: std::collections::HashSet<ConstraintKey> =
        [key(Some(&x)), key(Some(&y))].into_iter().collect();
    assert_eq!(hset.len(), 1);
    // Different structure -> different keys.
    assert_ne!(
        key(Some(&and(vec![exists("a")]))),
        key(Some(&or(vec![exists("a")])))
    );
    assert_ne!(key(Some(&not(not(exists("a"))))), key(Some(&exists("a"))));
    assert_ne!(key(Some(&val("a", ""))), key(Some(&exists("a"))));
    assert_eq!(key(None), key(Some(&unset())));
    assert_eq!(key(None), ConstraintKey::UNCONSTRAINED);
}

// ---- property tests ---------------------------------------------------------------------------

/// Keys constraints may mention. Parameters may also use "d" and "e", which constraints never do.
const CKEYS: [&str; 3] = ["a", "b", "c"];
const VALUES: [&str; 3] = ["x", "y", ""];

fn arb_leaf(allow_malformed: bool) -> BoxedStrategy<C> {
    let k = prop::sample::select(&CKEYS[..]);
    let v = prop::sample::select(&VALUES[..]);
    let mut choices = vec![
        (4, (k.clone(), v).prop_map(|(k, v)| val(k, v)).boxed()),
        (2, k.clone().prop_map(exists).boxed()),
        (1, Just(unset()).boxed()),
    ];
    if allow_malformed {
        choices.push((1, k.prop_map(malformed).boxed()));
    }
    prop::strategy::Union::new_weighted(choices).boxed()
}

fn arb_constraints(allow_malformed: bool) -> impl Strategy<Value = C> {
    arb_leaf(allow_malformed).prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(and),
            prop::collection::vec(inner.clone(), 0..4).prop_map(or),
            inner.prop_map(not),
        ]
    })
}

fn arb_params() -> impl Strategy<Value = Params> {
    prop::collection::btree_map(
        prop::sample::select(&["a", "b", "c", "d", "e"][..]).prop_map(String::from),
        prop::sample::select(&VALUES[..]).prop_map(String::from),
        0..5,
    )
}

/// Deterministically permutes every AND/OR child list of `c`, driven by `seed`.
fn permute(c: &C, seed: &mut u64) -> C {
    fn next(seed: &mut u64) -> u64 {
        // xorshift64*
        *seed ^= *seed >> 12;
        *seed ^= *seed << 25;
        *seed ^= *seed >> 27;
        seed.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    let shuffle = |l: &ConstraintList, seed: &mut u64| {
        let mut v: Vec<C> = l.constraints.iter().map(|c| permute(c, seed)).collect();
        for i in (1..v.len()).rev() {
            let j = (next(seed) % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        ConstraintList { constraints: v }
    };
    C {
        r#type: match &c.r#type {
            None => None,
            Some(Type::Constraint(s)) => Some(Type::Constraint(s.clone())),
            Some(Type::AndConstraints(l)) => Some(Type::AndConstraints(shuffle(l, seed))),
            Some(Type::OrConstraints(l)) => Some(Type::OrConstraints(shuffle(l, seed))),
            Some(Type::NotConstraints(inner)) => {
                Some(Type::NotConstraints(Box::new(permute(inner, seed))))
            }
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// (a) Parameters C does not mention never change matches(C, P): adding one, or changing its
    /// value.
    #[test]
    fn prop_unmentioned_params_are_irrelevant(
        c in arb_constraints(true),
        params in arb_params(),
        extra_key in prop::sample::select(&["a", "b", "c", "d", "e", "zz"][..]),
        extra_val in prop::sample::select(&["x", "y", "", "w"][..]),
    ) {
        prop_assume!(!mentioned_keys(&c).contains(extra_key));
        let mut more = params.clone();
        more.insert(extra_key.to_string(), extra_val.to_string());
        prop_assert_eq!(matches(&c, &more), matches(&c, &params));
    }

    /// (b) not(not(C)) == C, for well-formed and malformed sets alike.
    #[test]
    fn prop_double_negation(c in arb_constraints(true), params in arb_params()) {
        prop_assert_eq!(matches(&not(not(c.clone())), &params), matches(&c, &params));
    }

    /// For well-formed sets, not(C) is exactly the complement of C.
    #[test]
    fn prop_negation_complements(c in arb_constraints(false), params in arb_params()) {
        prop_assert!(validate(&c).is_ok());
        prop_assert_eq!(matches(&not(c.clone()), &params), !matches(&c, &params));
    }

    /// (c) key() is invariant under permutation of AND/OR children (and so is matches()).
    #[test]
    fn prop_key_permutation_invariant(
        c in arb_constraints(true),
        seed in 1u64..,
        params in arb_params(),
    ) {
        let mut s = seed;
        let d = permute(&c, &mut s);
        prop_assert_eq!(key(Some(&c)), key(Some(&d)));
        prop_assert_eq!(matches(&c, &params), matches(&d, &params));
    }

    /// (d) select() is deterministic under permutation of the variant list, and consistent with
    /// matches(): it picks a matching variant and counts every matching one.
    #[test]
    fn prop_select_permutation_deterministic(
        (variants, shuffled) in prop::collection::vec(
            prop::option::weighted(0.85, arb_constraints(true)), 0..7,
        )
        .prop_map(|vs| {
            // One variant per key, as in a cache keyed by ConstraintKey.
            let mut seen = BTreeSet::new();
            vs.into_iter()
                .filter(|c| seen.insert(key(c.as_ref())))
                .enumerate()
                .collect::<Vec<(usize, Option<C>)>>()
        })
        .prop_flat_map(|vs| (Just(vs.clone()), Just(vs).prop_shuffle())),
        params in arb_params(),
    ) {
        let keys = |vs: &[(usize, Option<C>)]| -> Vec<ConstraintKey> {
            vs.iter().map(|(_, c)| key(c.as_ref())).collect()
        };
        let (k1, k2) = (keys(&variants), keys(&shuffled));
        let run = |vs: &'_ [(usize, Option<C>)], ks: &'_ [ConstraintKey]| {
            let items = vs.iter().zip(ks).map(|((id, c), k)| (k, c.as_ref(), id));
            match select(items, &params) {
                Selection::None => (None, 0),
                Selection::One(id) => (Some(*id), 1),
                Selection::Ambiguous { chosen, candidates } => (Some(*chosen), candidates),
            }
        };
        let a = run(&variants, &k1);
        let b = run(&shuffled, &k2);
        prop_assert_eq!(a, b);

        let matching: Vec<usize> = variants
            .iter()
            .filter(|(_, c)| matches_opt(c.as_ref(), &params))
            .map(|(id, _)| *id)
            .collect();
        prop_assert_eq!(a.1, matching.len());
        match a.0 {
            None => prop_assert!(matching.is_empty()),
            Some(id) => {
                prop_assert!(matching.contains(&id));
                // Nothing matching is strictly more specific than the chosen variant.
                let spec = |id: usize| specificity(variants[id].1.as_ref(), &params);
                prop_assert!(matching.iter().all(|m| spec(*m) <= spec(id)));
            }
        }
    }
}
