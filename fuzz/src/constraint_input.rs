//! The structured input of the `constraints` target: constraint trees and parameters over small
//! key/value pools (plus arbitrary strings), decoded with `arbitrary`.

use adsrelay::pb::discovery::dynamic_parameter_constraints::single_constraint::{
    ConstraintType, Exists,
};
use adsrelay::pb::discovery::dynamic_parameter_constraints::{
    ConstraintList, SingleConstraint, Type,
};
use adsrelay::pb::discovery::DynamicParameterConstraints;
use arbitrary::Arbitrary;

/// Deeper trees add nothing the rules do not already cover, and would only slow the target.
const MAX_DEPTH: usize = 6;

#[derive(Arbitrary, Debug, Clone)]
pub enum Key {
    Env,
    Zone,
    Region,
    Empty,
    Other(String),
}

impl Key {
    pub fn as_string(&self) -> String {
        match self {
            Key::Env => "env".into(),
            Key::Zone => "zone".into(),
            Key::Region => "region".into(),
            Key::Empty => String::new(),
            Key::Other(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Value {
    Prod,
    Dev,
    Empty,
    Other(String),
}

impl Value {
    pub fn as_string(&self) -> String {
        match self {
            Value::Prod => "prod".into(),
            Value::Dev => "dev".into(),
            Value::Empty => String::new(),
            Value::Other(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Tree {
    Value(Key, Value),
    Exists(Key),
    /// A `SingleConstraint` without `constraint_type`.
    Malformed(Key),
    Or(Vec<Tree>),
    And(Vec<Tree>),
    Not(Box<Tree>),
    /// A message with no `type`: unconstrained.
    Empty,
}

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub variants: Vec<Tree>,
    /// Whether each variant is offered as `None` (no constraints) instead.
    pub unconstrained: Vec<bool>,
    pub params: Vec<(Key, Value)>,
    /// Drives the shuffles of AND/OR children and of the variant order.
    pub seed: u64,
}

pub fn to_proto(t: &Tree, depth: usize) -> DynamicParameterConstraints {
    let single = |key: &Key, constraint_type| DynamicParameterConstraints {
        r#type: Some(Type::Constraint(SingleConstraint {
            key: key.as_string(),
            constraint_type,
        })),
    };
    let list = |v: &[Tree]| ConstraintList {
        constraints: v.iter().take(4).map(|c| to_proto(c, depth + 1)).collect(),
    };
    if depth >= MAX_DEPTH {
        return DynamicParameterConstraints { r#type: None };
    }
    match t {
        Tree::Value(k, v) => single(k, Some(ConstraintType::Value(v.as_string()))),
        Tree::Exists(k) => single(k, Some(ConstraintType::Exists(Exists {}))),
        Tree::Malformed(k) => single(k, None),
        Tree::Or(v) => DynamicParameterConstraints {
            r#type: Some(Type::OrConstraints(list(v))),
        },
        Tree::And(v) => DynamicParameterConstraints {
            r#type: Some(Type::AndConstraints(list(v))),
        },
        Tree::Not(inner) => DynamicParameterConstraints {
            r#type: Some(Type::NotConstraints(Box::new(to_proto(inner, depth + 1)))),
        },
        Tree::Empty => DynamicParameterConstraints { r#type: None },
    }
}
