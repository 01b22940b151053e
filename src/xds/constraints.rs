//! TP2 dynamic parameters: matching a subscription's parameters against a resource variant's
//! constraints, a canonical identity for constraint sets (cache keys), and choosing one variant for
//! a subscriber. Pure: no I/O, no clock, no logging (callers log/count what [`select`] reports).
//!
//! Terms (conformance catalogue section E): `P` is [`Params`], the
//! `ResourceLocator.dynamic_parameters` of one subscription; `C` is a
//! [`DynamicParameterConstraints`] attached to one cached variant via `ResourceName`.
//!
//! # Semantics of [`matches`] (E1–E6)
//! - `constraint{key, value}`: `P[key]` exists and equals `value` byte for byte (case-sensitive) (E1).
//! - `constraint{key, exists}`: `key` is present in `P` with any value, **including the empty
//!   string**; only absence fails (E2, [derived]).
//! - `or_constraints`: any child matches. An **empty** list never matches (E6, [silent]: the
//!   identity of OR is `false`).
//! - `and_constraints`: every child matches. An **empty** list always matches (E6, [silent]:
//!   vacuous truth, the identity of AND).
//! - `not_constraints`: negation of the inner set (E3). An inner message with no `type` is
//!   unconstrained (matches everything), so `not({})` matches nothing; prost always materializes the
//!   inner message, so "unset inner" and "empty inner" are the same thing.
//! - No `type` set at the top level (or no constraints at all, `None`): unconstrained, matches every
//!   `P` (E6 rows 1–2, per TP2 "Unconstrained Parameters").
//! - A `SingleConstraint` with no `constraint_type` violates `validate.required`; the relay cannot
//!   know what it selects, so **a constraint set containing one anywhere never matches**, at any
//!   depth, including under `not` (E6 row 5, [silent]). Evaluation does not "negate" a malformed
//!   leaf into a match. [`validate`] reports such sets so the upstream side can log / NACK.
//! - Parameters in `P` that `C` does not mention never affect the result (E1 last row; TP2
//!   "Unconstrained Parameters").
//!
//! A subscription made by plain name (`resource_names_subscribe: ["foo"]`) has `P = {}` (E10).
//!
//! # Identity (E15, [silent])
//! [`key`] gives a [`ConstraintKey`]: the constraint tree with the children of every AND/OR list
//! sorted into a canonical order, so sets differing only in child order are equal. It is purely
//! structural otherwise: no deduplication of repeated children, no `not(not(x)) -> x`, no
//! flattening of nested ANDs. Two exceptions that are both "no constraints": `None` and a message
//! with no `type` set have the same key ([`ConstraintKey::UNCONSTRAINED`]). The key is only an
//! identity; the upstream's original message is what gets stored and forwarded (E9).
//!
//! # Selection (E7, [silent])
//! See [`select`]: the most specific matching variant wins, deterministically.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use prost::Message;

use crate::pb::discovery::dynamic_parameter_constraints::single_constraint::ConstraintType;
use crate::pb::discovery::dynamic_parameter_constraints::{ConstraintList, SingleConstraint, Type};
use crate::pb::discovery::{DynamicParameterConstraints, ResourceLocator};

/// The dynamic parameters of one subscription (`ResourceLocator.dynamic_parameters`).
///
/// A `BTreeMap` so that equal parameter sets compare and hash equal and iterate in a canonical
/// order (usable directly as part of an upstream-locator or subscriber key, E13).
pub type Params = BTreeMap<String, String>;

/// The parameters of a locator, in canonical form.
pub fn params_of(locator: &ResourceLocator) -> Params {
    locator
        .dynamic_parameters
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A constraint set the relay refuses to interpret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// A `SingleConstraint` with neither `value` nor `exists` (violates `validate.required`).
    #[error("dynamic parameter constraint on key {key:?} has no constraint_type (neither value nor exists)")]
    MissingConstraintType { key: String },
}

/// Checks that every `SingleConstraint` in `c` has a `constraint_type`. A set that fails never
/// [`matches`] anything; the caller should log it and may NACK the upstream response (E6).
pub fn validate(c: &DynamicParameterConstraints) -> Result<(), ConstraintError> {
    match &c.r#type {
        None => Ok(()),
        Some(Type::Constraint(SingleConstraint {
            key,
            constraint_type: None,
        })) => Err(ConstraintError::MissingConstraintType { key: key.clone() }),
        Some(Type::Constraint(_)) => Ok(()),
        Some(Type::OrConstraints(l)) | Some(Type::AndConstraints(l)) => {
            l.constraints.iter().try_for_each(validate)
        }
        Some(Type::NotConstraints(inner)) => validate(inner),
    }
}

/// Whether a subscription with parameters `p` matches a variant with constraints `c`.
/// See the module docs for the exact rules, including the degenerate forms.
pub fn matches(c: &DynamicParameterConstraints, p: &Params) -> bool {
    validate(c).is_ok() && eval(c, p)
}

/// Like [`matches`], with `None` meaning "the variant has no constraints" (always matches).
pub fn matches_opt(c: Option<&DynamicParameterConstraints>, p: &Params) -> bool {
    c.is_none_or(|c| matches(c, p))
}

/// Evaluation of a well-formed set (malformed leaves are excluded by [`matches`] beforehand).
fn eval(c: &DynamicParameterConstraints, p: &Params) -> bool {
    match &c.r#type {
        None => true,
        Some(Type::Constraint(s)) => match &s.constraint_type {
            Some(ConstraintType::Value(v)) => p.get(&s.key) == Some(v),
            Some(ConstraintType::Exists(_)) => p.contains_key(&s.key),
            None => false,
        },
        Some(Type::OrConstraints(l)) => l.constraints.iter().any(|c| eval(c, p)),
        Some(Type::AndConstraints(l)) => l.constraints.iter().all(|c| eval(c, p)),
        Some(Type::NotConstraints(inner)) => !eval(inner, p),
    }
}

/// Every parameter key `c` mentions, at any depth (also under `not`, and in malformed leaves).
pub fn mentioned_keys(c: &DynamicParameterConstraints) -> BTreeSet<&str> {
    fn walk<'a>(c: &'a DynamicParameterConstraints, out: &mut BTreeSet<&'a str>) {
        match &c.r#type {
            None => {}
            Some(Type::Constraint(s)) => {
                out.insert(s.key.as_str());
            }
            Some(Type::OrConstraints(l)) | Some(Type::AndConstraints(l)) => {
                l.constraints.iter().for_each(|c| walk(c, out))
            }
            Some(Type::NotConstraints(inner)) => walk(inner, out),
        }
    }
    let mut out = BTreeSet::new();
    walk(c, &mut out);
    out
}

/// How specific a variant is for `p`: the number of distinct keys `c` mentions that are present
/// in `p`. Unconstrained variants score 0.
pub fn specificity(c: Option<&DynamicParameterConstraints>, p: &Params) -> usize {
    c.map_or(0, |c| {
        mentioned_keys(c)
            .into_iter()
            .filter(|k| p.contains_key(*k))
            .count()
    })
}

/// Canonical structural identity of a constraint set, for cache keys (E15).
///
/// Equal iff the two sets are the same tree up to the order of children in AND/OR lists. The
/// `Ord` is total and stable (derived over the canonical tree, strings compared bytewise); it is
/// the final tie-break of [`select`]. [`ConstraintKey::UNCONSTRAINED`] sorts after every
/// constrained key. `Display` renders it compactly for logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConstraintKey(Node);

/// The canonical tree. Declaration order is the `Ord`: `Unconstrained` last.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Node {
    Value {
        key: String,
        value: String,
    },
    Exists {
        key: String,
    },
    /// `SingleConstraint` without `constraint_type`: kept distinct so it never aliases a valid set.
    Malformed {
        key: String,
    },
    Or(Vec<Node>),
    And(Vec<Node>),
    Not(Box<Node>),
    Unconstrained,
}

impl ConstraintKey {
    /// The key of a variant without constraints (`None`, or a message with no `type`).
    pub const UNCONSTRAINED: ConstraintKey = ConstraintKey(Node::Unconstrained);

    /// Whether this is the key of a variant without constraints.
    pub fn is_unconstrained(&self) -> bool {
        matches!(self.0, Node::Unconstrained)
    }
}

impl Default for ConstraintKey {
    fn default() -> Self {
        Self::UNCONSTRAINED
    }
}

/// The canonical identity of `c`; `None` is the unconstrained variant.
pub fn key(c: Option<&DynamicParameterConstraints>) -> ConstraintKey {
    ConstraintKey(c.map_or(Node::Unconstrained, canon))
}

fn canon(c: &DynamicParameterConstraints) -> Node {
    fn list(l: &ConstraintList) -> Vec<Node> {
        let mut v: Vec<Node> = l.constraints.iter().map(canon).collect();
        v.sort();
        v
    }
    match &c.r#type {
        None => Node::Unconstrained,
        Some(Type::Constraint(s)) => {
            let key = s.key.clone();
            match &s.constraint_type {
                Some(ConstraintType::Value(value)) => Node::Value {
                    key,
                    value: value.clone(),
                },
                Some(ConstraintType::Exists(_)) => Node::Exists { key },
                None => Node::Malformed { key },
            }
        }
        Some(Type::OrConstraints(l)) => Node::Or(list(l)),
        Some(Type::AndConstraints(l)) => Node::And(list(l)),
        Some(Type::NotConstraints(inner)) => Node::Not(Box::new(canon(inner))),
    }
}

impl fmt::Display for ConstraintKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn list(f: &mut fmt::Formatter<'_>, op: &str, v: &[Node]) -> fmt::Result {
            write!(f, "{op}[")?;
            for (i, n) in v.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                node(f, n)?;
            }
            f.write_str("]")
        }
        fn node(f: &mut fmt::Formatter<'_>, n: &Node) -> fmt::Result {
            match n {
                Node::Value { key, value } => write!(f, "{key:?}={value:?}"),
                Node::Exists { key } => write!(f, "{key:?} exists"),
                Node::Malformed { key } => write!(f, "{key:?} <no constraint_type>"),
                Node::Or(v) => list(f, "or", v),
                Node::And(v) => list(f, "and", v),
                Node::Not(inner) => {
                    f.write_str("not(")?;
                    node(f, inner)?;
                    f.write_str(")")
                }
                Node::Unconstrained => f.write_str("<unconstrained>"),
            }
        }
        node(f, &self.0)
    }
}

/// The outcome of [`select`].
#[derive(Debug, PartialEq, Eq)]
pub enum Selection<'a, V> {
    /// No variant matches: a cache miss for these parameters, not "does not exist" (E8).
    None,
    /// Exactly one variant matches.
    One(&'a V),
    /// Several variants match (`candidates >= 2`), which [TP2] calls undefined and control planes
    /// must not produce. `chosen` is picked by the deterministic rule of [`select`]; the caller
    /// should log / count this (E7c) and still send only `chosen` to a leaf subscriber (E7b).
    Ambiguous { chosen: &'a V, candidates: usize },
}

impl<V> Clone for Selection<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V> Copy for Selection<'_, V> {}

impl<'a, V> Selection<'a, V> {
    /// The selected variant, if any (ambiguous or not).
    pub fn chosen(&self) -> Option<&'a V> {
        match *self {
            Selection::None => None,
            Selection::One(v) | Selection::Ambiguous { chosen: v, .. } => Some(v),
        }
    }

    /// Whether more than one variant matched.
    pub fn is_ambiguous(&self) -> bool {
        matches!(self, Selection::Ambiguous { .. })
    }
}

/// Picks the one variant of a resource to serve to a subscriber with parameters `p`.
///
/// Each item is `(key, constraints, value)` where `key` must be [`key`]`(constraints)` (checked in
/// debug builds); `None` constraints mean an unconstrained variant.
///
/// Ambiguity rule (E7, [silent]; TP2 leaves it undefined), applied among matching variants only,
/// and independent of iteration order:
/// 1. most specific first: the highest [`specificity`] (distinct mentioned keys present in `p`);
/// 2. then the smallest [`ConstraintKey`]; as the unconstrained key sorts last, an unconstrained
///    variant is always the least specific and only wins when nothing else matches;
/// 3. then (only if the caller passes two variants with the same key, which a map keyed by
///    `ConstraintKey` never does) the smaller protobuf encoding of the original form, `None`
///    first; exact duplicates beyond that keep the first seen.
pub fn select<'a, V>(
    variants: impl IntoIterator<
        Item = (
            &'a ConstraintKey,
            Option<&'a DynamicParameterConstraints>,
            &'a V,
        ),
    >,
    p: &Params,
) -> Selection<'a, V> {
    type Best<'a, V> = (
        Reverse<usize>,
        &'a ConstraintKey,
        Option<&'a DynamicParameterConstraints>,
        &'a V,
    );
    let mut best: Option<Best<'a, V>> = None;
    let mut candidates = 0usize;
    for (k, c, v) in variants {
        debug_assert_eq!(*k, key(c), "ConstraintKey does not match its constraints");
        if !matches_opt(c, p) {
            continue;
        }
        candidates += 1;
        let rank = Reverse(specificity(c, p));
        let better = match &best {
            None => true,
            Some((brank, bk, bc, _)) => {
                let ord = rank
                    .cmp(brank)
                    .then_with(|| k.cmp(bk))
                    .then_with(|| encoded(c).cmp(&encoded(*bc)));
                ord == Ordering::Less
            }
        };
        if better {
            best = Some((rank, k, c, v));
        }
    }
    match (best, candidates) {
        (None, _) => Selection::None,
        (Some((_, _, _, v)), 1) => Selection::One(v),
        (Some((_, _, _, v)), n) => Selection::Ambiguous {
            chosen: v,
            candidates: n,
        },
    }
}

fn encoded(c: Option<&DynamicParameterConstraints>) -> Option<Vec<u8>> {
    c.map(Message::encode_to_vec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::dynamic_parameter_constraints::single_constraint::Exists;

    fn single(k: &str, t: Option<ConstraintType>) -> DynamicParameterConstraints {
        DynamicParameterConstraints {
            r#type: Some(Type::Constraint(SingleConstraint {
                key: k.into(),
                constraint_type: t,
            })),
        }
    }
    fn val(k: &str, v: &str) -> DynamicParameterConstraints {
        single(k, Some(ConstraintType::Value(v.into())))
    }
    fn exists(k: &str) -> DynamicParameterConstraints {
        single(k, Some(ConstraintType::Exists(Exists {})))
    }
    fn malformed(k: &str) -> DynamicParameterConstraints {
        single(k, None)
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
    fn not(c: DynamicParameterConstraints) -> DynamicParameterConstraints {
        DynamicParameterConstraints {
            r#type: Some(Type::NotConstraints(Box::new(c))),
        }
    }
    fn unset() -> DynamicParameterConstraints {
        DynamicParameterConstraints { r#type: None }
    }
    fn p(kv: &[(&str, &str)]) -> Params {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn value_and_exists() {
        let c = val("env", "prod");
        assert!(matches(&c, &p(&[("env", "prod")])));
        assert!(!matches(&c, &p(&[("env", "Prod")])));
        assert!(!matches(&c, &p(&[])));
        assert!(matches(&c, &p(&[("env", "prod"), ("version", "v1")])));
        let e = exists("version");
        assert!(matches(&e, &p(&[("version", "")])));
        assert!(!matches(&e, &p(&[("env", "prod")])));
    }

    #[test]
    fn degenerate_forms() {
        let any = p(&[("env", "prod")]);
        assert!(matches(&unset(), &any));
        assert!(matches_opt(None, &any));
        assert!(matches(&and(vec![]), &any));
        assert!(!matches(&or(vec![]), &any));
        assert!(!matches(&not(unset()), &any));
        assert!(!matches(&malformed("env"), &any));
        // A malformed leaf poisons the whole set, even under `not` or beside a true OR branch.
        assert!(!matches(&not(malformed("env")), &any));
        assert!(!matches(
            &or(vec![val("env", "prod"), malformed("x")]),
            &any
        ));
        assert_eq!(
            validate(&and(vec![exists("a"), not(malformed("b"))])),
            Err(ConstraintError::MissingConstraintType { key: "b".into() })
        );
        assert_eq!(validate(&and(vec![exists("a"), not(unset())])), Ok(()));
    }

    #[test]
    fn key_ignores_child_order_only() {
        let a = and(vec![
            val("env", "prod"),
            or(vec![exists("x"), val("y", "1")]),
        ]);
        let b = and(vec![
            or(vec![val("y", "1"), exists("x")]),
            val("env", "prod"),
        ]);
        assert_eq!(key(Some(&a)), key(Some(&b)));
        assert_ne!(
            key(Some(&and(vec![exists("x"), exists("y")]))),
            key(Some(&or(vec![exists("x"), exists("y")])))
        );
        assert_ne!(key(Some(&not(not(exists("x"))))), key(Some(&exists("x"))));
        assert_ne!(key(Some(&val("x", ""))), key(Some(&exists("x"))));
        assert_ne!(key(Some(&malformed("x"))), key(Some(&exists("x"))));
        assert_eq!(key(None), key(Some(&unset())));
        assert!(key(None).is_unconstrained());
        assert!(key(Some(&val("a", "b"))) < ConstraintKey::UNCONSTRAINED);
        assert_eq!(ConstraintKey::default(), ConstraintKey::UNCONSTRAINED);
    }

    #[test]
    fn key_display() {
        let c = and(vec![not(exists("version")), val("env", "prod")]);
        assert_eq!(
            key(Some(&c)).to_string(),
            r#"and["env"="prod", not("version" exists)]"#
        );
        assert_eq!(key(None).to_string(), "<unconstrained>");
    }

    #[test]
    fn select_prefers_most_specific() {
        // E7: {env=prod} and and[env=prod, version=v1], P={env:prod, version:v1}.
        let a = val("env", "prod");
        let b = and(vec![val("env", "prod"), val("version", "v1")]);
        let (ka, kb, kn) = (key(Some(&a)), key(Some(&b)), key(None));
        let vs = [
            (&ka, Some(&a), &"A"),
            (&kb, Some(&b), &"B"),
            (&kn, None, &"N"),
        ];
        let s = select(vs, &p(&[("env", "prod"), ("version", "v1")]));
        assert_eq!(
            s,
            Selection::Ambiguous {
                chosen: &"B",
                candidates: 3
            }
        );
        let s = select(vs, &p(&[("env", "prod")]));
        assert_eq!(s.chosen(), Some(&"A"));
        assert_eq!(select(vs, &p(&[("env", "qa")])), Selection::One(&"N"));
        assert_eq!(select(vs[..2].iter().copied(), &p(&[])), Selection::None);
    }

    #[test]
    fn select_tie_breaks_by_key_and_unconstrained_last() {
        // Both mention only absent keys: specificity 0, like the unconstrained variant.
        let a = not(exists("x"));
        let b = not(exists("y"));
        let (ka, kb, kn) = (key(Some(&a)), key(Some(&b)), key(None));
        let want = if ka < kb { "A" } else { "B" };
        let vs = [
            (&kn, None, &"N"),
            (&kb, Some(&b), &"B"),
            (&ka, Some(&a), &"A"),
        ];
        let s = select(vs, &p(&[]));
        assert_eq!(s.chosen(), Some(&want));
        assert!(s.is_ambiguous());
        let mut rev = vs;
        rev.reverse();
        assert_eq!(select(rev, &p(&[])), s);
    }

    #[test]
    fn params_of_locator() {
        let loc = ResourceLocator {
            name: "foo".into(),
            dynamic_parameters: [("b", "2"), ("a", "1")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        assert_eq!(params_of(&loc), p(&[("a", "1"), ("b", "2")]));
    }

    #[test]
    fn mentioned_and_specificity() {
        let c = and(vec![
            val("env", "prod"),
            not(or(vec![exists("v"), exists("env")])),
        ]);
        assert_eq!(
            mentioned_keys(&c).into_iter().collect::<Vec<_>>(),
            vec!["env", "v"]
        );
        assert_eq!(specificity(Some(&c), &p(&[("env", "x"), ("zz", "y")])), 1);
        assert_eq!(specificity(None, &p(&[("env", "x")])), 0);
    }
}
