//! `xdstp://` resource names (TP1, federation): parsing, canonical form and glob collections.
//!
//! `xdstp://{authority}/{type}/{id}?{context parameters}` names one resource; an id ending in `/*`
//! names a glob collection: every resource with the same authority, type and context parameters
//! whose id is the collection's path plus exactly one more segment (A28). Context parameters are
//! matched as a set, so the canonical form sorts them by key (A29); the relay keys everything by
//! the canonical form and emits it. Names without the `xdstp:` scheme are opaque and unchanged.
//!
//! Pure string handling: no percent-decoding (names compare as the control plane spells them) and
//! processing directives (`#...`, deprecated) are kept verbatim after the parameters.

use std::borrow::Cow;

pub const SCHEME: &str = "xdstp://";

/// Why a name that starts with `xdstp:` is not a valid xdstp name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum XdstpError {
    #[error("xdstp name {0:?} does not start with \"xdstp://\"")]
    Scheme(String),
    #[error("xdstp name {0:?} has no resource type")]
    MissingType(String),
    #[error("xdstp name {0:?} has no id")]
    MissingId(String),
    #[error("xdstp name {0:?} has an empty path segment")]
    EmptySegment(String),
    #[error("xdstp name {0:?} has a context parameter with an empty key")]
    EmptyParamKey(String),
    #[error("xdstp name {name:?} repeats context parameter {key:?}")]
    DuplicateParam { name: String, key: String },
}

/// A parsed xdstp name, borrowing from the original string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdstpName<'a> {
    pub authority: &'a str,
    pub resource_type: &'a str,
    /// The id path (`foo/bar`, or `foo/*` for a glob collection).
    pub id: &'a str,
    /// Context parameters, sorted by key.
    pub params: Vec<(&'a str, &'a str)>,
    /// A processing directive after `#`, if any (kept verbatim).
    pub directive: Option<&'a str>,
}

/// Whether `name` claims to be an xdstp name (and so must parse as one).
pub fn is_xdstp(name: &str) -> bool {
    name.starts_with("xdstp:")
}

impl<'a> XdstpName<'a> {
    pub fn parse(name: &'a str) -> Result<Self, XdstpError> {
        let err = |f: fn(String) -> XdstpError| f(name.to_string());
        let rest = name
            .strip_prefix(SCHEME)
            .ok_or_else(|| err(XdstpError::Scheme))?;
        let (rest, directive) = match rest.split_once('#') {
            Some((r, d)) => (r, Some(d)),
            None => (rest, None),
        };
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, q),
            None => (rest, ""),
        };
        // The authority may be empty (`xdstp:///type/id`); type and id may not.
        let (authority, path) = path
            .split_once('/')
            .ok_or_else(|| err(XdstpError::MissingType))?;
        let (resource_type, id) = path
            .split_once('/')
            .ok_or_else(|| err(XdstpError::MissingId))?;
        if resource_type.is_empty() {
            return Err(err(XdstpError::MissingType));
        }
        if id.is_empty() {
            return Err(err(XdstpError::MissingId));
        }
        if id.split('/').any(str::is_empty) {
            return Err(err(XdstpError::EmptySegment));
        }
        let mut params = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k.is_empty() {
                return Err(err(XdstpError::EmptyParamKey));
            }
            params.push((k, v));
        }
        params.sort_unstable();
        if let Some(w) = params.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(XdstpError::DuplicateParam {
                name: name.to_string(),
                key: w[0].0.to_string(),
            });
        }
        Ok(XdstpName {
            authority,
            resource_type,
            id,
            params,
            directive,
        })
    }

    /// Whether this names a glob collection (`.../*`).
    pub fn is_glob(&self) -> bool {
        self.id == "*" || self.id.ends_with("/*")
    }

    /// The canonical spelling: parameters sorted by key, no empty query.
    pub fn canonical(&self) -> String {
        self.render(self.id)
    }

    /// The glob collection this resource belongs to (`foo/bar` -> `foo/*`, `bar` -> `*`); `None`
    /// for a glob itself.
    pub fn collection(&self) -> Option<String> {
        if self.is_glob() {
            return None;
        }
        let glob = match self.id.rsplit_once('/') {
            Some((dir, _)) => format!("{dir}/*"),
            None => "*".to_string(),
        };
        Some(self.render(&glob))
    }

    fn render(&self, id: &str) -> String {
        let mut out = format!("{SCHEME}{}/{}/{id}", self.authority, self.resource_type);
        for (i, (k, v)) in self.params.iter().enumerate() {
            out.push(if i == 0 { '?' } else { '&' });
            out.push_str(k);
            out.push('=');
            out.push_str(v);
        }
        if let Some(d) = self.directive {
            out.push('#');
            out.push_str(d);
        }
        out
    }
}

/// The form under which the relay keys and emits `name`: canonical for xdstp names, unchanged for
/// anything else. Borrowed when nothing changes (the common case).
pub fn canonical(name: &str) -> Result<Cow<'_, str>, XdstpError> {
    if !is_xdstp(name) {
        return Ok(Cow::Borrowed(name));
    }
    let c = XdstpName::parse(name)?.canonical();
    Ok(if c == name {
        Cow::Borrowed(name)
    } else {
        Cow::Owned(c)
    })
}

/// The canonical name of the glob collection a (canonical) resource name belongs to, if it is an
/// xdstp name that is not itself a glob.
pub fn collection_of(name: &str) -> Option<String> {
    if !is_xdstp(name) {
        return None;
    }
    XdstpName::parse(name).ok()?.collection()
}

/// Whether `name` is an xdstp glob collection.
pub fn is_glob(name: &str) -> bool {
    is_xdstp(name) && XdstpName::parse(name).is_ok_and(|n| n.is_glob())
}

/// The prefix every member of glob `collection` starts with (`xdstp://a/T/foo/`), for range scans
/// over sorted names; `None` if `collection` is not a glob.
pub fn glob_prefix(collection: &str) -> Option<String> {
    let n = XdstpName::parse(collection).ok().filter(|n| n.is_glob())?;
    let dir = &n.id[..n.id.len() - 1];
    Some(format!("{SCHEME}{}/{}/{dir}", n.authority, n.resource_type))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const L: &str = "envoy.config.listener.v3.Listener";

    #[test]
    fn parses_components() {
        let n = XdstpName::parse("xdstp://auth/T/foo/bar?b=2&a=1").unwrap();
        assert_eq!(n.authority, "auth");
        assert_eq!(n.resource_type, "T");
        assert_eq!(n.id, "foo/bar");
        assert_eq!(n.params, vec![("a", "1"), ("b", "2")]);
        assert!(!n.is_glob());
        assert_eq!(n.canonical(), "xdstp://auth/T/foo/bar?a=1&b=2");
    }

    #[test]
    fn canonical_sorts_params_and_leaves_other_names_alone() {
        assert_eq!(
            canonical("xdstp://a/T/x?b=2&a=1").unwrap(),
            "xdstp://a/T/x?a=1&b=2"
        );
        assert!(matches!(
            canonical("xdstp://a/T/x?a=1&b=2").unwrap(),
            Cow::Borrowed(_)
        ));
        assert_eq!(canonical("xdstp://a/T/x?").unwrap(), "xdstp://a/T/x");
        assert_eq!(canonical("xdstp:///T/x").unwrap(), "xdstp:///T/x");
        assert_eq!(canonical("rc1/foo.com").unwrap(), "rc1/foo.com");
        assert_eq!(canonical("*").unwrap(), "*");
    }

    #[test]
    fn malformed_names_say_why() {
        for (bad, want) in [
            ("xdstp:/a/T/x", XdstpError::Scheme("xdstp:/a/T/x".into())),
            (
                "xdstp://auth",
                XdstpError::MissingType("xdstp://auth".into()),
            ),
            (
                "xdstp://auth/T",
                XdstpError::MissingId("xdstp://auth/T".into()),
            ),
            (
                "xdstp://auth//x",
                XdstpError::MissingType("xdstp://auth//x".into()),
            ),
            (
                "xdstp://a/T/x//y",
                XdstpError::EmptySegment("xdstp://a/T/x//y".into()),
            ),
            (
                "xdstp://a/T/x?=1",
                XdstpError::EmptyParamKey("xdstp://a/T/x?=1".into()),
            ),
        ] {
            assert_eq!(canonical(bad), Err(want));
        }
        assert!(matches!(
            canonical("xdstp://a/T/x?k=1&k=2"),
            Err(XdstpError::DuplicateParam { key, .. }) if key == "k"
        ));
    }

    #[test]
    fn collections() {
        let glob = format!("xdstp://auth/{L}/foo/*?node_type=ingress");
        assert!(is_glob(&glob));
        assert_eq!(
            collection_of(&format!("xdstp://auth/{L}/foo/a?node_type=ingress")).as_deref(),
            Some(glob.as_str())
        );
        assert_ne!(
            collection_of(&format!("xdstp://auth/{L}/foo/a?node_type=egress")).as_deref(),
            Some(glob.as_str())
        );
        assert_ne!(
            collection_of(&format!("xdstp://auth/{L}/foo/x/a?node_type=ingress")).as_deref(),
            Some(glob.as_str())
        );
        assert_eq!(collection_of(&glob), None);
        assert_eq!(collection_of("foo/a"), None);
        assert_eq!(
            collection_of("xdstp://auth/T/a").as_deref(),
            Some("xdstp://auth/T/*")
        );
        assert_eq!(
            glob_prefix(&glob).as_deref(),
            Some(format!("xdstp://auth/{L}/foo/").as_str())
        );
        assert_eq!(
            glob_prefix("xdstp://auth/T/*").as_deref(),
            Some("xdstp://auth/T/")
        );
    }

    proptest! {
        /// Canonicalization is idempotent and does not depend on the order of the parameters.
        #[test]
        fn normalization_is_idempotent_and_order_insensitive(
            params in proptest::collection::btree_map("[a-z]{1,4}", "[a-z0-9]{0,3}", 0..5),
            id in "[a-z]{1,3}(/[a-z*]{1,3}){0,2}",
            seed in any::<u64>(),
        ) {
            let mut pairs: Vec<String> = params.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let forward = format!("xdstp://auth/T/{id}?{}", pairs.join("&"));
            // A deterministic shuffle from the seed.
            let len = pairs.len();
            for i in (1..len).rev() {
                let j = (seed.rotate_left(i as u32) as usize) % (i + 1);
                pairs.swap(i, j);
            }
            let shuffled = format!("xdstp://auth/T/{id}?{}", pairs.join("&"));
            let a = canonical(&forward).unwrap().into_owned();
            let b = canonical(&shuffled).unwrap().into_owned();
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(canonical(&a).unwrap(), Cow::Borrowed(a.as_str()));
            if let Some(c) = collection_of(&a) {
                prop_assert_eq!(canonical(&c).unwrap().into_owned(), c.clone());
                prop_assert!(a.starts_with(&glob_prefix(&c).unwrap()));
            }
        }
    }
}
