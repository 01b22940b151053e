//! The contract both per-stream state machines (Delta and SotW) implement, and the types it is
//! spoken in, so one adapter drives both. The machines implement [`StreamCore`] beside their code;
//! this module depends on neither.

use super::constraints::Params;
use super::frame::Outgoing;
use super::resource::{Locator, Name};
use super::store::{ChangeSet, Store};
use crate::pb::core::Node;
use crate::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};

/// The two variants of the discovery protocol a stream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Delta,
    /// State of the world.
    Sotw,
}

impl Protocol {
    pub const ALL: [Protocol; 2] = [Protocol::Delta, Protocol::Sotw];

    /// The `protocol` label of metrics and logs.
    pub const fn label(self) -> &'static str {
        match self {
            Protocol::Delta => "delta",
            Protocol::Sotw => "sotw",
        }
    }
}

/// A request the relay refuses; the adapter ends the stream with INVALID_ARGUMENT.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("type_url is required for ADS (request had an empty type_url)")]
    MissingTypeUrl,
    /// The request would leave the stream holding more subscriptions than it may; it was not
    /// applied (see [`StreamCore::on_request_within`]).
    #[error("stream would hold {total} subscriptions; the limit is {max} per stream")]
    TooManySubscriptions { total: usize, max: usize },
}

/// What a request acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckStatus {
    /// The request carried no `response_nonce`: a pure subscription change.
    None,
    Ack {
        nonce: String,
    },
    Nack {
        nonce: String,
        message: String,
    },
    /// A nonce that is not the latest one sent for this type (F6); subscription changes still apply.
    Stale {
        nonce: String,
    },
}

/// The effects of one request that reach beyond this stream: locators to add to and remove from
/// the group's interest and subscriber index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEffects {
    pub type_url: String,
    pub acquire: Vec<Locator>,
    pub release: Vec<Locator>,
    pub ack: AckStatus,
}

impl RequestEffects {
    pub(crate) fn new(type_url: &str) -> Self {
        RequestEffects {
            type_url: type_url.to_string(),
            acquire: Vec::new(),
            release: Vec::new(),
            ack: AckStatus::None,
        }
    }
}

/// `Clone` so a refused request can leave the stream as it was ([`StreamCore::on_request_within`]).
pub trait StreamCore: Clone {
    type Request;

    /// A fresh state machine for a stream opened by `node`; plain-name subscriptions carry
    /// `default_params` (empty unless derived from node metadata).
    fn for_node(node: &Node, default_params: Params) -> Self;
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError>;
    /// [`StreamCore::on_request`] for a stream that holds `held` subscriptions and may hold at
    /// most `max`: a request that would exceed it is refused and leaves the stream exactly as it
    /// was, so what the stream holds stays what its group holds for it. `may_add` bounds what the
    /// request can add (its subscribe entries; one more for a wildcard); only a request that could
    /// reach the limit pays for keeping the state to return to.
    fn on_request_within(
        &mut self,
        req: &Self::Request,
        held: usize,
        may_add: usize,
        max: usize,
    ) -> Result<RequestEffects, ProtocolError> {
        let before = (held + may_add + 1 > max).then(|| self.clone());
        let effects = self.on_request(req)?;
        let total = (held + effects.acquire.len()).saturating_sub(effects.release.len());
        if total > max {
            if let Some(before) = before {
                *self = before;
            }
            return Err(ProtocolError::TooManySubscriptions { total, max });
        }
        Ok(effects)
    }
    fn on_change(&mut self, changes: &ChangeSet);
    /// Re-examine everything of a type (the change notifications for it were collapsed).
    fn mark_all_pending(&mut self, type_url: &str);
    /// The next response to write, built from the store now and framed through its shared frame
    /// cache; `None` if nothing is due.
    fn next_frame(&mut self, store: &Store) -> Option<Outgoing>;
    /// Whether a response may be due: cheap, and conservative (`next_frame` may still find
    /// nothing to send). Lets the stream's task skip asking for a write slot when nothing is.
    fn has_work(&self) -> bool;
    /// Keep responses within the client's receive limit where the protocol allows splitting.
    fn limit_response_bytes(&mut self, _bytes: usize) {}
    /// The stream is a per-type discovery service's, not ADS: it carries `type_url` only.
    fn serve_single_type(&mut self) {}
    /// Every subscription the stream holds, released when it ends.
    fn subscriptions(&self) -> Vec<(Name, Locator)>;
    /// The group applied the latest subscriptions when its store was at `seq` (D2).
    fn subscribed_at(&mut self, _seq: u64) {}
    /// Subscriptions whose `do_not_cache` content the upstream must send again (C3).
    fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        Vec::new()
    }
    /// Per-type ACK/NACK state for introspection (admin, CSDS); with `resources`, also every
    /// (name, version) the client holds as far as the relay knows and the names it still waits for.
    fn view(&self, resources: bool) -> Vec<TypeView>;
}

/// One type of one stream, as the admin API and CSDS report it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TypeView {
    pub type_url: String,
    pub wildcard: bool,
    /// Explicitly subscribed names.
    pub subscribed: usize,
    /// Resources the client holds (sent by the relay or reported in initial versions).
    pub held: usize,
    pub last_nonce: Option<String>,
    pub last_ack: Option<String>,
    /// (nonce, error message) of the last NACK.
    pub last_nack: Option<(String, String)>,
    /// (name, version) held; filled only when asked for resources.
    pub resources: Vec<(Name, String)>,
    /// Explicitly subscribed names not sent yet; filled only when asked for resources.
    pub waiting: Vec<Name>,
    /// (name, version) the client rejected and did not take: it still holds what `resources`
    /// says (or nothing). Filled only when asked for resources.
    pub rejected: Vec<(Name, String)>,
}

/// What the adapter reads from any xDS request.
pub trait XdsRequest {
    fn node(&self) -> Option<&Node>;
    /// Per-type (non-ADS) services imply the type; requests may leave it empty.
    fn type_url_mut(&mut self) -> &mut String;
    /// The request as Delta, if it is one.
    fn as_delta(&self) -> Option<&DeltaDiscoveryRequest> {
        None
    }
}

impl XdsRequest for DeltaDiscoveryRequest {
    fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }
    fn type_url_mut(&mut self) -> &mut String {
        &mut self.type_url
    }
    fn as_delta(&self) -> Option<&DeltaDiscoveryRequest> {
        Some(self)
    }
}

impl XdsRequest for DiscoveryRequest {
    fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }
    fn type_url_mut(&mut self) -> &mut String {
        &mut self.type_url
    }
}
