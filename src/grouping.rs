//! Aggregation groups: which downstream nodes share one upstream stream and one cache, and the node
//! identity the relay presents upstream for them (D1, C11). Pure: no I/O, no locks.
//!
//! A [`GroupRule`] matches a downstream [`Node`] by cluster, id, locality, metadata and user agent
//! (globs with `*` and `?`); the first matching rule wins. It renders the upstream node from
//! templates over the matched node (`{cluster}`, `{id}`, `{region}`, `{zone}`, `{sub_zone}`,
//! `{user_agent}`, `{metadata.KEY}`, `{node_id}` = the relay's `node_id`), copies the rule's
//! significant `metadata_keys` (and the locality, with `copy_locality`) into it, and names the
//! group. Two nodes share a group only if the relay would present the *same* upstream node for
//! them: the group is keyed by that identity, so a template cannot merge nodes the control plane
//! could tell apart.
//!
//! With no rules, one implicit rule applies: group by `node.cluster` plus the top-level
//! `group_metadata_keys`. A node that matches no rule is refused or gets a pass-through group of its
//! own, per [`Unmatched`].

use std::collections::BTreeMap;
use std::fmt::Write as _;

use prost::Message as _;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::pb::core::{node::UserAgentVersionType, Locality, Node};

/// What happens to a client whose node matches no `[[groups]]` rule.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    /// The stream is ended with PERMISSION_DENIED naming the node (the default).
    #[default]
    Reject,
    /// The client gets a group of its own that presents its own node upstream.
    Passthrough,
}

/// Locality globs; an absent field matches anything.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LocalityMatch {
    pub region: Option<String>,
    pub zone: Option<String>,
    pub sub_zone: Option<String>,
}

/// One `[[groups]]` entry of the config file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GroupRule {
    /// Group name template (metrics label, logs, admin). Default: the upstream cluster, followed by
    /// `;key=value` for each significant metadata key and `;locality=r/z/s` with `copy_locality`.
    pub name: Option<String>,
    /// Glob over `node.cluster`.
    pub cluster: Option<String>,
    /// Glob over `node.id`.
    pub id: Option<String>,
    /// Glob over `node.user_agent_name`.
    pub user_agent: Option<String>,
    pub locality: Option<LocalityMatch>,
    /// Metadata key -> glob over its value (strings as is, numbers and booleans printed); the key
    /// must be present.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Template for the upstream `node.id`. Default `{node_id}` (the relay's `node_id`).
    pub upstream_id: Option<String>,
    /// Template for the upstream `node.cluster`. Default `{cluster}`.
    pub upstream_cluster: Option<String>,
    /// Significant metadata keys: part of the group key and copied into the upstream node.
    #[serde(default)]
    pub metadata_keys: Vec<String>,
    /// The locality is part of the group key and copied into the upstream node.
    #[serde(default)]
    pub copy_locality: bool,
}

/// Where a node goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// Group name before any collision suffix.
    pub name: String,
    /// The node the relay presents upstream for the group; the group's identity.
    pub upstream: Node,
    /// Fields of the member's node the group does not key on, compared across members.
    pub ignored: IgnoredFields,
    pub passthrough: bool,
}

/// The node fields a group ignores (not part of its key), as seen on one member.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IgnoredFields {
    pub cluster: Option<String>,
    /// Encoded metadata without the significant keys.
    pub metadata: Vec<u8>,
    pub locality: Option<Locality>,
    pub user_agent: (String, String),
}

impl IgnoredFields {
    /// Names of the fields that differ between two members.
    pub fn differences(&self, other: &IgnoredFields) -> Vec<&'static str> {
        let mut d = Vec::new();
        if self.cluster != other.cluster {
            d.push("cluster");
        }
        if self.metadata != other.metadata {
            d.push("metadata");
        }
        if self.locality != other.locality {
            d.push("locality");
        }
        if self.user_agent != other.user_agent {
            d.push("user_agent");
        }
        d
    }
}

#[derive(Debug, Clone)]
pub struct Grouping {
    rules: Vec<GroupRule>,
    node_id: String,
    unmatched: Unmatched,
}

const FIELDS: &[&str] = &[
    "cluster",
    "id",
    "region",
    "zone",
    "sub_zone",
    "user_agent",
    "node_id",
];

/// Checks a template's placeholders; the error names the bad one.
pub fn check_template(t: &str) -> Result<(), String> {
    let mut rest = t;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            return Err(format!("{t:?}: unclosed '{{'"));
        };
        let field = &rest[open + 1..open + close];
        let ok = FIELDS.contains(&field)
            || field
                .strip_prefix("metadata.")
                .is_some_and(|k| !k.is_empty());
        if !ok {
            return Err(format!(
                "{t:?}: unknown placeholder {{{field}}} (use {{cluster}}, {{id}}, {{region}}, {{zone}}, {{sub_zone}}, {{user_agent}}, {{node_id}} or {{metadata.KEY}})"
            ));
        }
        rest = &rest[open + close + 1..];
    }
    Ok(())
}

impl GroupRule {
    /// Validates globs-free parts: templates and keys. The error is `(field, message)`.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        for (field, t) in [
            ("name", &self.name),
            ("upstream_id", &self.upstream_id),
            ("upstream_cluster", &self.upstream_cluster),
        ] {
            if let Some(t) = t {
                check_template(t).map_err(|m| (field, m))?;
            }
        }
        if let Some(t) = &self.upstream_id {
            if t.trim().is_empty() {
                return Err(("upstream_id", "must not be empty".into()));
            }
        }
        if self.metadata_keys.iter().any(String::is_empty) {
            return Err(("metadata_keys", "keys must not be empty".into()));
        }
        Ok(())
    }

    fn matches(&self, node: &Node) -> bool {
        let loc = node.locality.clone().unwrap_or_default();
        let ok = |pat: &Option<String>, v: &str| pat.as_deref().is_none_or(|p| glob(p, v));
        ok(&self.cluster, &node.cluster)
            && ok(&self.id, &node.id)
            && ok(&self.user_agent, &node.user_agent_name)
            && self.locality.as_ref().is_none_or(|l| {
                ok(&l.region, &loc.region)
                    && ok(&l.zone, &loc.zone)
                    && ok(&l.sub_zone, &loc.sub_zone)
            })
            && self
                .metadata
                .iter()
                .all(|(k, pat)| metadata_str(node, k).is_some_and(|v| glob(pat, &v)))
    }
}

/// `*` matches any run of characters, `?` one character; everything else literally.
pub fn glob(pattern: &str, value: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let v: Vec<char> = value.chars().collect();
    let (mut pi, mut vi) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while vi < v.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == v[vi]) {
            pi += 1;
            vi += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, vi));
            pi += 1;
        } else if let Some((sp, sv)) = star {
            pi = sp + 1;
            vi = sv + 1;
            star = Some((sp, sv + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// A metadata value as a string: strings as is, numbers and booleans printed.
fn metadata_str(node: &Node, key: &str) -> Option<String> {
    use prost_types::value::Kind;
    match node.metadata.as_ref()?.fields.get(key)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        Kind::NumberValue(n) => Some(n.to_string()),
        Kind::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

fn user_agent(node: &Node) -> (String, String) {
    let version = match &node.user_agent_version_type {
        Some(UserAgentVersionType::UserAgentVersion(v)) => v.clone(),
        Some(UserAgentVersionType::UserAgentBuildVersion(b)) => format!("{b:?}"),
        None => String::new(),
    };
    (node.user_agent_name.clone(), version)
}

fn render(template: &str, node: &Node, node_id: &str) -> String {
    let loc = node.locality.clone().unwrap_or_default();
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let field = &rest[open + 1..open + close];
        match field {
            "cluster" => out.push_str(&node.cluster),
            "id" => out.push_str(&node.id),
            "region" => out.push_str(&loc.region),
            "zone" => out.push_str(&loc.zone),
            "sub_zone" => out.push_str(&loc.sub_zone),
            "user_agent" => out.push_str(&node.user_agent_name),
            "node_id" => out.push_str(node_id),
            f => {
                if let Some(v) = f
                    .strip_prefix("metadata.")
                    .and_then(|k| metadata_str(node, k))
                {
                    out.push_str(&v);
                }
            }
        }
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

impl Grouping {
    /// `rules` empty means the implicit rule: by cluster plus `default_metadata_keys`.
    pub fn new(
        rules: Vec<GroupRule>,
        default_metadata_keys: Vec<String>,
        node_id: String,
        unmatched: Unmatched,
    ) -> Self {
        let rules = if rules.is_empty() {
            vec![GroupRule {
                metadata_keys: default_metadata_keys,
                ..Default::default()
            }]
        } else {
            rules
        };
        Grouping {
            rules,
            node_id,
            unmatched,
        }
    }

    pub fn unmatched(&self) -> Unmatched {
        self.unmatched
    }

    /// The group of a node, or `None` if it matches no rule and unmatched nodes are refused.
    pub fn assign(&self, node: &Node) -> Option<Assignment> {
        let Some(rule) = self.rules.iter().find(|r| r.matches(node)) else {
            return match self.unmatched {
                Unmatched::Reject => None,
                Unmatched::Passthrough => Some(Assignment {
                    name: format!("passthrough/{}/{}", node.cluster, node.id),
                    upstream: node.clone(),
                    ignored: IgnoredFields::default(),
                    passthrough: true,
                }),
            };
        };
        let cluster = render(
            rule.upstream_cluster.as_deref().unwrap_or("{cluster}"),
            node,
            &self.node_id,
        );
        let id = render(
            rule.upstream_id.as_deref().unwrap_or("{node_id}"),
            node,
            &self.node_id,
        );
        let mut significant = prost_types::Struct::default();
        if let Some(md) = &node.metadata {
            for k in &rule.metadata_keys {
                if let Some(v) = md.fields.get(k) {
                    significant.fields.insert(k.clone(), v.clone());
                }
            }
        }
        let name = match &rule.name {
            Some(t) => render(t, node, &self.node_id),
            None => {
                let mut n = cluster.clone();
                for k in &rule.metadata_keys {
                    let _ = write!(n, ";{k}={}", metadata_str(node, k).unwrap_or_default());
                }
                if rule.copy_locality {
                    let l = node.locality.clone().unwrap_or_default();
                    let _ = write!(n, ";locality={}/{}/{}", l.region, l.zone, l.sub_zone);
                }
                n
            }
        };
        let upstream = Node {
            id,
            cluster,
            metadata: (!significant.fields.is_empty()).then_some(significant),
            locality: if rule.copy_locality {
                node.locality.clone()
            } else {
                None
            },
            user_agent_name: "adsrelay".into(),
            user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            )),
            ..Default::default()
        };
        let mut other_md = node.metadata.clone().unwrap_or_default();
        for k in &rule.metadata_keys {
            other_md.fields.remove(k);
        }
        // Fields in the key cannot differ within a group; a template that drops the cluster
        // (e.g. a fixed upstream_cluster) makes it an ignored field.
        let cluster_in_key = rule.upstream_cluster.is_none()
            || rule
                .upstream_cluster
                .as_deref()
                .is_some_and(|t| t.contains("{cluster}"))
            || rule
                .upstream_id
                .as_deref()
                .is_some_and(|t| t.contains("{cluster}"));
        let ignored = IgnoredFields {
            cluster: (!cluster_in_key).then(|| node.cluster.clone()),
            metadata: encode_struct(&other_md),
            locality: if rule.copy_locality {
                None
            } else {
                node.locality.clone().filter(|l| *l != Locality::default())
            },
            user_agent: user_agent(node),
        };
        Some(Assignment {
            name,
            upstream,
            ignored,
            passthrough: false,
        })
    }
}

/// Deterministic encoding of a Struct (sorted keys), for comparing members.
fn encode_struct(s: &prost_types::Struct) -> Vec<u8> {
    let mut keys: Vec<&String> = s.fields.keys().collect();
    keys.sort();
    let mut out = Vec::new();
    for k in keys {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend(s.fields[k].encode_to_vec());
        out.push(0);
    }
    out
}

/// A short, stable digest of an upstream node identity (for disambiguating group names).
pub fn identity_digest(node: &Node) -> String {
    let mut n = node.clone();
    let md = n
        .metadata
        .take()
        .map(|m| encode_struct(&m))
        .unwrap_or_default();
    let mut h = Sha256::new();
    h.update(n.encode_to_vec());
    h.update(md);
    h.finalize()[..4].iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Whether two upstream nodes are the same identity (metadata compared by content).
pub fn same_identity(a: &Node, b: &Node) -> bool {
    identity_digest(a) == identity_digest(b) && a.id == b.id && a.cluster == b.cluster
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_types::{value::Kind, Struct, Value};

    fn node(id: &str, cluster: &str, md: &[(&str, &str)]) -> Node {
        Node {
            id: id.into(),
            cluster: cluster.into(),
            metadata: Some(Struct {
                fields: md
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            Value {
                                kind: Some(Kind::StringValue(v.to_string())),
                            },
                        )
                    })
                    .collect(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn globs() {
        assert!(glob("prod-*", "prod-east"));
        assert!(glob("*", ""));
        assert!(glob("a?c", "abc"));
        assert!(glob("*-1*", "x-1-y-1"));
        assert!(!glob("prod-*", "staging"));
        assert!(!glob("a?c", "ac"));
    }

    #[test]
    fn default_groups_by_cluster_and_significant_metadata() {
        let g = Grouping::new(
            vec![],
            vec!["env".into()],
            "adsrelay".into(),
            Unmatched::Reject,
        );
        let a = g
            .assign(&node("a", "web", &[("env", "prod"), ("x", "1")]))
            .unwrap();
        let b = g
            .assign(&node("b", "web", &[("env", "prod"), ("x", "2")]))
            .unwrap();
        let c = g.assign(&node("c", "web", &[("env", "test")])).unwrap();
        assert_eq!(a.name, "web;env=prod");
        assert_eq!(a.name, b.name);
        assert!(same_identity(&a.upstream, &b.upstream));
        assert_ne!(a.name, c.name);
        assert_eq!(a.upstream.id, "adsrelay");
        assert_eq!(a.upstream.cluster, "web");
        assert!(a
            .upstream
            .metadata
            .as_ref()
            .unwrap()
            .fields
            .contains_key("env"));
        assert!(!a
            .upstream
            .metadata
            .as_ref()
            .unwrap()
            .fields
            .contains_key("x"));
        assert_eq!(a.ignored.differences(&b.ignored), vec!["metadata"]);
    }

    #[test]
    fn rules_match_in_order_and_render_templates() {
        let rules = vec![
            GroupRule {
                cluster: Some("edge-*".into()),
                metadata: [("tier".to_string(), "gold".to_string())].into(),
                upstream_id: Some("adsrelay-{cluster}".into()),
                name: Some("gold-{cluster}".into()),
                ..Default::default()
            },
            GroupRule {
                id: Some("sidecar~*".into()),
                upstream_cluster: Some("mesh".into()),
                ..Default::default()
            },
        ];
        for r in &rules {
            r.validate().unwrap();
        }
        let g = Grouping::new(rules, vec![], "adsrelay".into(), Unmatched::Reject);
        let a = g
            .assign(&node("e1", "edge-eu", &[("tier", "gold")]))
            .unwrap();
        assert_eq!(a.name, "gold-edge-eu");
        assert_eq!(a.upstream.id, "adsrelay-edge-eu");
        let b = g.assign(&node("sidecar~1", "svc-a", &[])).unwrap();
        let c = g.assign(&node("sidecar~2", "svc-b", &[])).unwrap();
        assert_eq!(
            (b.name.as_str(), b.upstream.cluster.as_str()),
            ("mesh", "mesh")
        );
        assert_eq!(b.ignored.differences(&c.ignored), vec!["cluster"]);
        assert!(g.assign(&node("other", "x", &[])).is_none());
        let p = Grouping::new(
            vec![rules_one()],
            vec![],
            "adsrelay".into(),
            Unmatched::Passthrough,
        )
        .assign(&node("lonely", "x", &[]))
        .unwrap();
        assert!(p.passthrough);
        assert_eq!(p.upstream.id, "lonely");
    }

    fn rules_one() -> GroupRule {
        GroupRule {
            cluster: Some("nope".into()),
            ..Default::default()
        }
    }

    #[test]
    fn bad_templates_are_named() {
        let r = GroupRule {
            upstream_id: Some("x-{clster}".into()),
            ..Default::default()
        };
        let (field, msg) = r.validate().unwrap_err();
        assert_eq!(field, "upstream_id");
        assert!(msg.contains("{clster}"), "{msg}");
    }
}
