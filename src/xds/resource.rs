//! A cached resource: the encoded `envoy.service.discovery.v3.Resource` exactly as the upstream sent
//! it, plus the few header fields the relay needs to route and version it.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use prost::Message;

use super::constraints::{self, ConstraintKey, Params};
use super::{names, xdstp};
use crate::pb::discovery::{DynamicParameterConstraints, ResourceName};
use crate::pb::wire::ResourceHeader;

pub use super::names::Name;

/// What a client subscribes to: a name and the dynamic parameters it subscribed with (empty for a
/// plain `resource_names_subscribe` entry). Equal parameter sets compare equal, so upstream
/// interest is deduplicated by exact set (E13).
#[derive(Debug, Clone)]
pub struct Locator {
    pub name: Name,
    pub params: Arc<Params>,
}

// Compared by content, as a derive would, but shared names and parameter sets (interned names,
// a stream's default parameters) are equal without reading them: every stream's maps are keyed
// by locators, and this comparison is most of a join's B-tree lookups.
impl PartialEq for Locator {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        (Name::ptr_eq(&self.name, &other.name) || self.name == other.name)
            && (Arc::ptr_eq(&self.params, &other.params) || self.params == other.params)
    }
}

impl Eq for Locator {}

// Hashes the content, so equal locators (by the comparison above) hash alike.
impl std::hash::Hash for Locator {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
        self.params.hash(state);
    }
}

impl Ord for Locator {
    // Inlined: B-tree searches of every stream's records call it in their inner loop.
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let name = if Name::ptr_eq(&self.name, &other.name) {
            std::cmp::Ordering::Equal
        } else {
            self.name.cmp(&other.name)
        };
        name.then_with(|| {
            if Arc::ptr_eq(&self.params, &other.params) {
                std::cmp::Ordering::Equal
            } else {
                self.params.cmp(&other.params)
            }
        })
    }
}

impl PartialOrd for Locator {
    #[inline]
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The empty parameter set, shared rather than allocated per plain locator.
pub fn no_params() -> Arc<Params> {
    static EMPTY: std::sync::LazyLock<Arc<Params>> = std::sync::LazyLock::new(Arc::default);
    EMPTY.clone()
}

/// `name`, or `name{k=v,...}` with parameters (logs, tests).
impl std::fmt::Display for Locator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)?;
        if !self.params.is_empty() {
            let params: Vec<String> = self
                .params
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            write!(f, "{{{}}}", params.join(","))?;
        }
        Ok(())
    }
}

impl Locator {
    pub fn plain(name: impl Into<Name>) -> Self {
        Locator {
            name: name.into(),
            params: no_params(),
        }
    }

    pub fn with_params(name: impl Into<Name>, params: Arc<Params>) -> Self {
        Locator {
            name: name.into(),
            params,
        }
    }

    pub fn is_plain(&self) -> bool {
        self.params.is_empty()
    }

    /// The subscriptions of one request list: plain names (with the stream's default parameters,
    /// `true`: answered by name) followed by `ResourceLocator`s (`false`: answered with
    /// `resource_name`). xdstp names are keyed by their canonical form (A29); a malformed one is
    /// kept as sent (it matches nothing; the Delta stream reports it, see [`canonical_name`]).
    pub fn from_request(
        names: &[String],
        locators: &[crate::pb::discovery::ResourceLocator],
        defaults: &Arc<Params>,
    ) -> Vec<(Locator, bool)> {
        names
            .iter()
            .map(|n| {
                (
                    Locator::with_params(canonical_name(n), defaults.clone()),
                    true,
                )
            })
            .chain(locators.iter().map(|l| {
                let params = Arc::new(constraints::params_of(l));
                (Locator::with_params(canonical_name(&l.name), params), false)
            }))
            .collect()
    }
}

/// The name under which the relay keys `name`: the canonical form of a valid xdstp name (A29),
/// anything else as it is; interned, so every holder of a name shares one allocation.
pub fn canonical_name(name: &str) -> Name {
    match xdstp::canonical(name) {
        Ok(c) => names::intern(&c),
        Err(_) => names::intern(name),
    }
}

/// One resource as received from the upstream. `encoded` is written to every subscriber verbatim.
#[derive(Debug, Clone)]
pub struct CachedResource {
    pub name: Name,
    pub version: String,
    /// `type_url` of the embedded `Any`, empty for a body-less (heartbeat) resource.
    pub body_type_url: String,
    pub do_not_cache: bool,
    /// The whole `Resource` message, as sent by the upstream (what Delta clients receive).
    pub encoded: Bytes,
    /// The embedded `google.protobuf.Any`, a zero-copy slice of `encoded` (what SotW clients
    /// receive).
    pub any: Bytes,
    /// The variant's constraints (from `resource_name`), `None` for a plain-named resource.
    pub constraints: Option<DynamicParameterConstraints>,
    /// `Resource.aliases` (VHDS): other names that resolve to this resource (A25).
    pub aliases: Vec<Name>,
    /// A body-less resource whose aliases include its own name: the upstream's answer for an alias
    /// it cannot resolve (A25), passed through as it is; not a heartbeat.
    pub unresolved_alias: bool,
    /// `Resource.ttl`: clients drop the resource if it is not refreshed in time; so does the
    /// relay's cache (D6).
    pub ttl: Option<std::time::Duration>,
    /// Canonical identity of `constraints` within the name (E15).
    pub key: ConstraintKey,
    /// `cache_control.do_not_cache`: served only to subscribers that were waiting when it arrived.
    /// Set by the store: the store sequence number of the response that delivered it.
    pub arrival: u64,
    /// `encoded` wrapped in an `Any` of type `Resource`, for SotW clients that accept wrappers;
    /// built on first use, then shared.
    wrapped: OnceLock<Bytes>,
    /// `encoded` with `resource_name` replaced by `name`, for clients that subscribed by plain
    /// name (E10); built on first use, then shared. Same as `encoded` for unconstrained resources.
    named: OnceLock<Bytes>,
    named_wrapped: OnceLock<Bytes>,
}

impl PartialEq for CachedResource {
    fn eq(&self, other: &Self) -> bool {
        self.encoded == other.encoded
    }
}

pub const RESOURCE_TYPE_URL: &str = "type.googleapis.com/envoy.service.discovery.v3.Resource";

/// Why a single upstream `Resource` cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    #[error("resource is not a valid envoy.service.discovery.v3.Resource: {0}")]
    Malformed(String),
    #[error("resource has neither name nor resource_name")]
    MissingName,
    #[error("resource {0:?} sets both name and resource_name")]
    NameAndResourceName(String),
}

impl CachedResource {
    /// Parses the header of an encoded `Resource`. The bytes are kept as they are; callers must pass
    /// bytes they own (not a slice of a receive buffer) since the cache may hold them for a long time.
    pub fn decode(encoded: Bytes) -> Result<Self, ResourceError> {
        let header = ResourceHeader::decode(encoded.clone())
            .map_err(|e| ResourceError::Malformed(e.to_string()))?;
        // A29: an upstream spelling an xdstp name differently is re-encoded once, here, so that
        // clients receive (and the store keys) the canonical form. A malformed xdstp name stays as
        // sent: no client can subscribe to it, so it is never delivered.
        if header.resource_name.is_none() {
            if let Ok(std::borrow::Cow::Owned(c)) = xdstp::canonical(&header.name) {
                let mut r = crate::pb::discovery::Resource::decode(encoded)
                    .map_err(|e| ResourceError::Malformed(e.to_string()))?;
                r.name = c;
                return Self::decode(Bytes::from(r.encode_to_vec()));
            }
        }
        let constraints = header
            .resource_name
            .as_ref()
            .and_then(|rn| rn.dynamic_parameter_constraints.clone());
        let name = match (&header.name[..], &header.resource_name) {
            ("", None) => return Err(ResourceError::MissingName),
            ("", Some(rn)) if rn.name.is_empty() => return Err(ResourceError::MissingName),
            ("", Some(rn)) => rn.name.clone(),
            (n, Some(_)) => return Err(ResourceError::NameAndResourceName(n.to_string())),
            (n, None) => n.to_string(),
        };
        let any = field_slice(&encoded, 2).unwrap_or_default();
        let ttl = if header.ttl.is_empty() {
            None
        } else {
            prost_types::Duration::decode(header.ttl.clone())
                .ok()
                .and_then(|d| std::time::Duration::try_from(d).ok())
        };
        let unresolved_alias = header.resource.is_none() && header.aliases.contains(&name);
        Ok(CachedResource {
            aliases: header.aliases.iter().map(|a| canonical_name(a)).collect(),
            unresolved_alias,
            name: names::intern(&name),
            version: header.version,
            body_type_url: header.resource.map(|a| a.type_url).unwrap_or_default(),
            do_not_cache: header.cache_control.is_some_and(|c| c.do_not_cache),
            encoded,
            any,
            ttl,
            key: constraints::key(constraints.as_ref()),
            constraints,
            arrival: 0,
            wrapped: OnceLock::new(),
            named: OnceLock::new(),
            named_wrapped: OnceLock::new(),
        })
    }

    /// The same resource with the TTL of a heartbeat (A24: a heartbeat may change the TTL without
    /// changing the version). Re-encoded once per heartbeat that changes it, not per client.
    pub fn with_ttl_of(&self, heartbeat: &CachedResource) -> CachedResource {
        if self.ttl == heartbeat.ttl {
            return self.clone();
        }
        let Ok(mut r) = crate::pb::discovery::Resource::decode(self.encoded.clone()) else {
            return self.clone();
        };
        r.ttl = heartbeat
            .ttl
            .and_then(|d| prost_types::Duration::try_from(d).ok());
        match CachedResource::decode(Bytes::from(r.encode_to_vec())) {
            Ok(mut c) => {
                c.arrival = self.arrival;
                c
            }
            Err(_) => self.clone(),
        }
    }

    /// The `ResourceName` that identifies this variant to locator-aware clients (E9, E11).
    pub fn resource_name(&self) -> ResourceName {
        ResourceName {
            name: self.name.to_string(),
            dynamic_parameter_constraints: self.constraints.clone(),
        }
    }

    /// The encoded `Resource` for a Delta client: verbatim for locator subscribers, with a plain
    /// `name` for clients that subscribed by name (E10).
    pub fn delta_bytes(&self, by_name: bool) -> &Bytes {
        if by_name && self.constraints.is_some() {
            self.named()
        } else {
            &self.encoded
        }
    }

    /// The `Any` for a SotW client: the bare resource, or the `Resource` wrapper (B16) in the
    /// form that matches how it subscribed.
    pub fn sotw_bytes(&self, wrap: bool, by_name: bool) -> &Bytes {
        match (wrap, by_name && self.constraints.is_some()) {
            (false, _) => &self.any,
            (true, false) => self.wrapped(),
            (true, true) => self.named_wrapped.get_or_init(|| wrap_in_any(self.named())),
        }
    }

    fn named(&self) -> &Bytes {
        self.named.get_or_init(|| {
            let mut r = match crate::pb::discovery::Resource::decode(self.encoded.clone()) {
                Ok(r) => r,
                // Decoded once already (header), so this cannot fail; fall back to verbatim.
                Err(_) => return self.encoded.clone(),
            };
            r.name = self.name.to_string();
            r.resource_name = None;
            Bytes::from(r.encode_to_vec())
        })
    }

    /// This resource as an `Any` wrapping the whole `Resource` (SotW with
    /// `xds.config.resource-in-sotw`).
    pub fn wrapped(&self) -> &Bytes {
        self.wrapped.get_or_init(|| wrap_in_any(&self.encoded))
    }

    /// A resource with no body is a TTL heartbeat (it only refreshes the resource's timer).
    pub fn is_heartbeat(&self) -> bool {
        self.body_type_url.is_empty() && !self.unresolved_alias
    }
}

fn wrap_in_any(resource: &Bytes) -> Bytes {
    Bytes::from(
        prost_types::Any {
            type_url: RESOURCE_TYPE_URL.into(),
            value: resource.to_vec(),
        }
        .encode_to_vec(),
    )
}

/// The bytes of the last occurrence of length-delimited top-level `field` in an encoded message,
/// as a zero-copy slice. `None` if absent or if the message does not parse.
pub(super) fn field_slice(msg: &Bytes, field: u32) -> Option<Bytes> {
    use prost::encoding::{decode_key, decode_varint, WireType};
    let mut buf: &[u8] = msg;
    let mut found = None;
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf).ok()?;
        match wire_type {
            WireType::Varint => {
                decode_varint(&mut buf).ok()?;
            }
            WireType::SixtyFourBit => buf = buf.get(8..)?,
            WireType::ThirtyTwoBit => buf = buf.get(4..)?,
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                let start = msg.len() - buf.len();
                let body = buf.get(..len)?;
                if tag == field {
                    found = Some(msg.slice(start..start + body.len()));
                }
                buf = &buf[len..];
            }
            WireType::StartGroup | WireType::EndGroup => return None,
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locator_is_two_pointers() {
        // Every stream keys its records by locators (~160 per client in a mesh of 50 clusters and
        // 50 endpoints): a fat name pointer would cost ~1.3 KiB per client.
        assert_eq!(std::mem::size_of::<Locator>(), 16);
        assert_eq!(std::mem::size_of::<Name>(), 8);
    }
    use crate::pb::discovery::{resource::CacheControl, Resource, ResourceName};

    fn encode(r: &Resource) -> Bytes {
        Bytes::from(r.encode_to_vec())
    }

    #[test]
    fn decodes_header_and_keeps_bytes_verbatim() {
        let r = Resource {
            name: "c1".into(),
            version: "v1".into(),
            resource: Some(prost_types::Any {
                type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
                value: vec![10, 2, b'c', b'1'],
            }),
            cache_control: Some(CacheControl { do_not_cache: true }),
            aliases: vec!["alias".into()],
            ..Default::default()
        };
        let bytes = encode(&r);
        let cached = CachedResource::decode(bytes.clone()).unwrap();
        assert_eq!(&*cached.name, "c1");
        assert_eq!(cached.version, "v1");
        assert!(cached.do_not_cache);
        assert!(!cached.is_heartbeat());
        assert_eq!(cached.encoded, bytes);
        assert_eq!(
            prost_types::Any::decode(cached.any.clone()).unwrap(),
            r.resource.clone().unwrap()
        );
        let wrapped = prost_types::Any::decode(cached.wrapped().clone()).unwrap();
        assert_eq!(wrapped.type_url, RESOURCE_TYPE_URL);
        assert_eq!(Resource::decode(&wrapped.value[..]).unwrap(), r);
        assert_eq!(Resource::decode(cached.encoded).unwrap(), r);
    }

    #[test]
    fn rejects_missing_or_double_names() {
        assert_eq!(
            CachedResource::decode(encode(&Resource::default())),
            Err(ResourceError::MissingName)
        );
        let both = Resource {
            name: "a".into(),
            resource_name: Some(ResourceName {
                name: "a".into(),
                dynamic_parameter_constraints: None,
            }),
            ..Default::default()
        };
        assert!(matches!(
            CachedResource::decode(encode(&both)),
            Err(ResourceError::NameAndResourceName(_))
        ));
        assert!(matches!(
            CachedResource::decode(Bytes::from_static(&[0xff, 0xff])),
            Err(ResourceError::Malformed(_))
        ));
    }
}
