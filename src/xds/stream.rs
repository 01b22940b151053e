//! The contract shared by the Delta and SotW per-stream state machines, so one adapter drives both.

use super::constraints::Params;
use super::delta::{ProtocolError, RequestEffects};
use super::frame::Outgoing;
use super::resource::{Locator, Name};
use super::store::{ChangeSet, Store};
use crate::pb::core::Node;
use crate::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};

pub trait StreamCore {
    type Request;

    /// A fresh state machine for a stream opened by `node`; plain-name subscriptions carry
    /// `default_params` (empty unless derived from node metadata).
    fn for_node(node: &Node, default_params: Params) -> Self;
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError>;
    fn on_change(&mut self, changes: &ChangeSet);
    /// Re-examine everything of a type (the change notifications for it were collapsed).
    fn mark_all_pending(&mut self, type_url: &str);
    /// The next response to write, built from the store now and framed through its shared frame
    /// cache; `None` if nothing is due.
    fn next_frame(&mut self, store: &Store) -> Option<Outgoing>;
    /// Keep responses within the client's receive limit where the protocol allows splitting.
    fn limit_response_bytes(&mut self, _bytes: usize) {}
    /// Every subscription the stream holds, released when it ends.
    fn subscriptions(&self) -> Vec<(String, Locator)>;
    /// The group applied the latest subscriptions when its store was at `seq` (D2).
    fn subscribed_at(&mut self, _seq: u64) {}
    /// Subscriptions whose `do_not_cache` content the upstream must send again (C3).
    fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        Vec::new()
    }
    /// Per-type ACK/NACK state for introspection (admin, CSDS); with `resources`, also every
    /// (name, version) the client holds as far as the relay knows and the names it still waits for.
    fn snapshot(&self, resources: bool) -> Vec<TypeSnapshot>;
}

/// One type of one stream, as the admin API and CSDS report it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TypeSnapshot {
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

impl StreamCore for super::DeltaStream {
    type Request = DeltaDiscoveryRequest;

    fn for_node(_: &Node, default_params: Params) -> Self {
        Self::with_default_params(default_params)
    }
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError> {
        super::DeltaStream::on_request(self, req)
    }
    fn on_change(&mut self, changes: &ChangeSet) {
        super::DeltaStream::on_change(self, changes)
    }
    fn mark_all_pending(&mut self, type_url: &str) {
        super::DeltaStream::mark_all_pending(self, type_url)
    }
    fn next_frame(&mut self, store: &Store) -> Option<Outgoing> {
        super::DeltaStream::next_frame(self, store)
    }
    fn limit_response_bytes(&mut self, bytes: usize) {
        self.max_response_bytes = bytes;
    }
    fn subscriptions(&self) -> Vec<(String, Locator)> {
        super::DeltaStream::subscriptions(self)
    }
    fn subscribed_at(&mut self, seq: u64) {
        super::DeltaStream::subscribed_at(self, seq)
    }
    fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        super::DeltaStream::take_refetch(self)
    }
    fn snapshot(&self, resources: bool) -> Vec<TypeSnapshot> {
        super::DeltaStream::snapshot(self, resources)
    }
}

impl StreamCore for super::SotwStream {
    type Request = DiscoveryRequest;

    fn for_node(node: &Node, default_params: Params) -> Self {
        super::SotwStream::for_node(node, default_params)
    }
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError> {
        super::SotwStream::on_request(self, req)
    }
    fn on_change(&mut self, changes: &ChangeSet) {
        super::SotwStream::on_change(self, changes)
    }
    fn mark_all_pending(&mut self, type_url: &str) {
        super::SotwStream::mark_all_pending(self, type_url)
    }
    fn next_frame(&mut self, store: &Store) -> Option<Outgoing> {
        super::SotwStream::next_frame(self, store)
    }
    fn subscriptions(&self) -> Vec<(String, Locator)> {
        super::SotwStream::subscriptions(self)
    }
    fn subscribed_at(&mut self, seq: u64) {
        super::SotwStream::subscribed_at(self, seq)
    }
    fn take_refetch(&mut self) -> Vec<(String, Locator)> {
        super::SotwStream::take_refetch(self)
    }
    fn snapshot(&self, resources: bool) -> Vec<TypeSnapshot> {
        super::SotwStream::snapshot(self, resources)
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
