//! The contract shared by the Delta and SotW per-stream state machines, so one adapter drives both.

use super::delta::{ProtocolError, RequestEffects};
use super::resource::Name;
use super::store::{ChangeSet, Store};
use crate::pb::core::Node;
use crate::pb::discovery::{DeltaDiscoveryRequest, DiscoveryRequest};
use crate::pb::wire;

pub trait StreamCore {
    type Request;
    type Response;

    /// A fresh state machine for a stream opened by `node`.
    fn for_node(node: &Node) -> Self;
    fn on_request(&mut self, req: &Self::Request) -> Result<RequestEffects, ProtocolError>;
    fn on_change(&mut self, changes: &ChangeSet);
    /// Re-examine everything of a type (the change notifications for it were collapsed).
    fn mark_all_pending(&mut self, type_url: &str);
    /// The next response to write, built from the store now; `None` if nothing is due.
    fn next_response(&mut self, store: &Store) -> Option<Self::Response>;
    /// Every subscription the stream holds, released when it ends.
    fn subscriptions(&self) -> Vec<(String, Name)>;
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

/// What the adapter logs about any xDS response: (type_url, nonce, resources).
pub trait XdsResponse {
    fn summary(&self) -> (&str, &str, usize);
}

impl StreamCore for super::DeltaStream {
    type Request = DeltaDiscoveryRequest;
    type Response = wire::DeltaDiscoveryResponse;

    fn for_node(_: &Node) -> Self {
        Self::new()
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
    fn next_response(&mut self, store: &Store) -> Option<Self::Response> {
        super::DeltaStream::next_response(self, store)
    }
    fn subscriptions(&self) -> Vec<(String, Name)> {
        super::DeltaStream::subscriptions(self)
    }
}

impl StreamCore for super::SotwStream {
    type Request = DiscoveryRequest;
    type Response = wire::DiscoveryResponse;

    fn for_node(node: &Node) -> Self {
        super::SotwStream::for_node(node)
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
    fn next_response(&mut self, store: &Store) -> Option<Self::Response> {
        super::SotwStream::next_response(self, store)
    }
    fn subscriptions(&self) -> Vec<(String, Name)> {
        super::SotwStream::subscriptions(self)
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

impl XdsResponse for wire::DeltaDiscoveryResponse {
    fn summary(&self) -> (&str, &str, usize) {
        (
            &self.type_url,
            &self.nonce,
            self.resources.len() + self.removed_resources.len(),
        )
    }
}

impl XdsResponse for wire::DiscoveryResponse {
    fn summary(&self) -> (&str, &str, usize) {
        (&self.type_url, &self.nonce, self.resources.len())
    }
}
