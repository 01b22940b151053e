//! Per-stream defences against hostile or broken clients: request validation (name lengths,
//! subscription list sizes, locator parameters), a request-rate token bucket, and the mapping of
//! transport errors (malformed protobuf, oversize messages) to a clear status. Pure functions and
//! small state; the stream driver (`downstream/stream.rs`) applies them. Every refusal names the
//! problem, ends only the offending stream, and is counted by [`StreamRejection`] reason.

use std::time::{Duration, Instant};

use tonic::Status;

use super::requests::ReadError;
use crate::metrics::StreamRejection;
use crate::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest, ResourceLocator};

/// Largest number of dynamic parameters accepted on one resource locator.
pub const MAX_LOCATOR_PARAMS: usize = 64;

/// The per-stream limits a host enforces. [`StreamLimits::default`] is unlimited (the demo control
/// plane); the relay takes its values from its `[limits]` settings ([`StreamLimits::from_settings`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StreamLimits {
    /// Subscriptions (names, locators, a wildcard counting as one) held by one stream, all types.
    pub max_subscriptions: usize,
    /// Bytes of any resource name, type_url, locator parameter key or value in a request.
    pub max_name_bytes: usize,
    /// Sustained requests per second per stream; 0 disables the limit.
    pub requests_per_second: u32,
    /// Requests a stream may send in a burst above the sustained rate.
    pub request_burst: u32,
    /// A stream whose responses have not been taken by the transport for this long is ended; zero
    /// disables it.
    pub stuck_timeout: Duration,
    /// The largest response a client accepts (its gRPC receive limit); larger Delta states are
    /// split over several responses.
    pub max_response_bytes: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            max_subscriptions: usize::MAX,
            max_name_bytes: usize::MAX,
            requests_per_second: 0,
            request_burst: 0,
            stuck_timeout: Duration::ZERO,
            max_response_bytes: crate::xds::delta::DEFAULT_MAX_RESPONSE_BYTES,
        }
    }
}

impl StreamLimits {
    /// The per-stream part of the relay's `[limits]` settings.
    pub fn from_settings(l: &crate::config::Limits) -> Self {
        StreamLimits {
            max_subscriptions: l.max_subscriptions_per_stream,
            max_name_bytes: l.max_name_bytes,
            requests_per_second: l.max_requests_per_second,
            request_burst: l.request_burst,
            stuck_timeout: l.stuck_client_timeout,
            max_response_bytes: l.max_response_bytes,
        }
    }
}

/// A refusal: the reason (for the metric) and the status sent to the client.
#[derive(Debug)]
pub struct Refusal {
    pub reason: Option<StreamRejection>,
    pub status: Status,
}

impl Refusal {
    pub fn new(reason: StreamRejection, status: Status) -> Self {
        Refusal {
            reason: Some(reason),
            status,
        }
    }
}

/// Any other way a stream ends with a status (a mailbox close): not a client's fault, not counted.
impl From<Status> for Refusal {
    fn from(status: Status) -> Self {
        Refusal {
            reason: None,
            status,
        }
    }
}

/// The names and locators of a request, whatever its protocol, for validation.
pub trait RequestShape {
    fn type_url(&self) -> &str;
    /// Every resource name the request carries (subscribe, unsubscribe, initial versions).
    fn names(&self) -> Box<dyn Iterator<Item = &str> + '_>;
    /// Every resource locator the request carries.
    fn locators(&self) -> Box<dyn Iterator<Item = &ResourceLocator> + '_>;
    /// Entries that may add subscriptions (names and locators to subscribe, initial versions).
    fn subscribe_entries(&self) -> usize;
}

impl RequestShape for DeltaDiscoveryRequest {
    fn type_url(&self) -> &str {
        &self.type_url
    }
    fn names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(
            self.resource_names_subscribe
                .iter()
                .chain(&self.resource_names_unsubscribe)
                .chain(self.initial_resource_versions.keys())
                .map(String::as_str),
        )
    }
    fn locators(&self) -> Box<dyn Iterator<Item = &ResourceLocator> + '_> {
        Box::new(
            self.resource_locators_subscribe
                .iter()
                .chain(&self.resource_locators_unsubscribe),
        )
    }
    fn subscribe_entries(&self) -> usize {
        self.resource_names_subscribe.len()
            + self.resource_locators_subscribe.len()
            + self.initial_resource_versions.len()
    }
}

impl RequestShape for DiscoveryRequest {
    fn type_url(&self) -> &str {
        &self.type_url
    }
    fn names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.resource_names.iter().map(String::as_str))
    }
    fn locators(&self) -> Box<dyn Iterator<Item = &ResourceLocator> + '_> {
        Box::new(self.resource_locators.iter())
    }
    fn subscribe_entries(&self) -> usize {
        self.resource_names.len() + self.resource_locators.len()
    }
}

fn shorten(s: &str) -> String {
    const SHOWN: usize = 64;
    if s.len() <= SHOWN {
        return format!("{s:?}");
    }
    let mut cut = SHOWN;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{:?}...", &s[..cut])
}

/// Checks a request's shape before it touches any state: sizes and locator parameters.
pub fn check_request(req: &impl RequestShape, limits: &StreamLimits) -> Result<(), Refusal> {
    let too_long = |what: &str, s: &str| {
        Refusal::new(
            StreamRejection::NameTooLong,
            Status::invalid_argument(format!(
                "{what} of {} bytes exceeds the limit of {} bytes: {}",
                s.len(),
                limits.max_name_bytes,
                shorten(s)
            )),
        )
    };
    if req.type_url().len() > limits.max_name_bytes {
        return Err(too_long("type_url", req.type_url()));
    }
    let entries = req.subscribe_entries();
    if entries > limits.max_subscriptions {
        return Err(Refusal::new(
            StreamRejection::TooManySubscriptions,
            Status::resource_exhausted(format!(
                "request subscribes to {entries} resources; the limit is {} per stream",
                limits.max_subscriptions
            )),
        ));
    }
    if let Some(n) = req.names().find(|n| n.len() > limits.max_name_bytes) {
        return Err(too_long("resource name", n));
    }
    for l in req.locators() {
        if l.name.len() > limits.max_name_bytes {
            return Err(too_long("resource locator name", &l.name));
        }
        let invalid = |msg: String| {
            Refusal::new(
                StreamRejection::InvalidLocator,
                Status::invalid_argument(format!("resource locator {}: {msg}", shorten(&l.name))),
            )
        };
        if l.name.is_empty() {
            return Err(invalid("empty name".into()));
        }
        if l.dynamic_parameters.len() > MAX_LOCATOR_PARAMS {
            return Err(invalid(format!(
                "{} dynamic parameters; the limit is {MAX_LOCATOR_PARAMS}",
                l.dynamic_parameters.len()
            )));
        }
        for (k, v) in &l.dynamic_parameters {
            if k.is_empty() {
                return Err(invalid("dynamic parameter with an empty key".into()));
            }
            if k.len() > limits.max_name_bytes || v.len() > limits.max_name_bytes {
                return Err(invalid(format!(
                    "dynamic parameter {} is longer than {} bytes",
                    shorten(k),
                    limits.max_name_bytes
                )));
            }
        }
    }
    Ok(())
}

/// The refusal for a stream whose subscriptions would exceed the limit.
pub fn too_many_subscriptions(total: usize, limits: &StreamLimits) -> Refusal {
    Refusal::new(
        StreamRejection::TooManySubscriptions,
        Status::resource_exhausted(format!(
            "stream would hold {total} subscriptions; the limit is {} per stream",
            limits.max_subscriptions
        )),
    )
}

/// The refusal for a request that cannot be read; `None` when the client went away (nothing to
/// tell it).
pub fn classify_read_error(error: &ReadError) -> Option<Refusal> {
    match error {
        ReadError::TooLarge { .. } => Some(Refusal::new(
            StreamRejection::MessageTooLarge,
            Status::resource_exhausted(format!("request message too large: {error}")),
        )),
        ReadError::Malformed(_)
        | ReadError::Compressed
        | ReadError::BadPrefix(_)
        | ReadError::Truncated => Some(Refusal::new(
            StreamRejection::MalformedRequest,
            Status::invalid_argument(format!(
                "malformed request (not a valid gRPC protobuf message): {error}"
            )),
        )),
        ReadError::Transport(_) => None,
    }
}

pub use crate::token_bucket::TokenBucket;

/// The request-rate bucket for one stream; `None` when the limit is disabled.
pub fn request_bucket(limits: &StreamLimits, now: Instant) -> Option<TokenBucket> {
    TokenBucket::new(
        f64::from(limits.requests_per_second),
        limits.request_burst,
        now,
    )
}

/// The refusal for a stream over its request rate.
pub fn rate_limited(limits: &StreamLimits) -> Refusal {
    Refusal::new(
        StreamRejection::RateLimited,
        Status::resource_exhausted(format!(
            "request rate over the limit of {}/s (burst {}) for one stream",
            limits.requests_per_second, limits.request_burst
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> StreamLimits {
        StreamLimits {
            max_subscriptions: 10,
            max_name_bytes: 16,
            requests_per_second: 10,
            request_burst: 5,
            stuck_timeout: Duration::ZERO,
            ..StreamLimits::default()
        }
    }

    #[test]
    fn bucket_allows_burst_then_rate() {
        let t0 = Instant::now();
        let mut b = request_bucket(&limits(), t0).unwrap();
        for _ in 0..5 {
            assert!(b.take(t0));
        }
        assert!(!b.take(t0));
        assert!(b.take(t0 + Duration::from_millis(100)));
        assert!(!b.take(t0 + Duration::from_millis(100)));
        assert!(request_bucket(
            &StreamLimits {
                requests_per_second: 0,
                ..StreamLimits::default()
            },
            t0
        )
        .is_none());
    }

    #[test]
    fn request_checks_name_each_problem() {
        let l = limits();
        let mut r = DeltaDiscoveryRequest {
            type_url: "t".into(),
            resource_names_subscribe: vec!["x".repeat(17)],
            ..Default::default()
        };
        let e = check_request(&r, &l).unwrap_err();
        assert_eq!(e.reason, Some(StreamRejection::NameTooLong));
        assert!(e.status.message().contains("17 bytes"), "{}", e.status);
        r.resource_names_subscribe = (0..11).map(|i| i.to_string()).collect();
        let e = check_request(&r, &l).unwrap_err();
        assert_eq!(e.status.code(), tonic::Code::ResourceExhausted);
        r.resource_names_subscribe.clear();
        r.resource_locators_subscribe = vec![ResourceLocator {
            name: "a".into(),
            dynamic_parameters: [(String::new(), "v".to_string())].into(),
        }];
        let e = check_request(&r, &l).unwrap_err();
        assert_eq!(e.reason, Some(StreamRejection::InvalidLocator));
        r.resource_locators_subscribe[0].dynamic_parameters = [("k".into(), "v".into())].into();
        assert!(check_request(&r, &l).is_ok());
    }
}
