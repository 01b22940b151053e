//! Client Status Discovery Service (`envoy.service.status.v3.ClientStatusDiscoveryService`) on the
//! xDS port: for each downstream client, the resources the relay sent it and whether the client
//! accepted them, so xDS debugging tools work against the relay.
//!
//! ACK state is tracked per response (nonce) and type, as the protocol does: after a NACK, every
//! resource of that type the client holds is reported `NACKED` (with the client's error message)
//! until the client ACKs a later response of the type. Versions are what the relay believes the
//! client holds: what it sent last, or what the client reported in `initial_resource_versions`.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use crate::downstream::ClientEntry;
use crate::pb::csds::client_config::GenericXdsConfig;
use crate::pb::csds::client_status_discovery_service_server::{
    ClientStatusDiscoveryService, ClientStatusDiscoveryServiceServer,
};
use crate::pb::csds::{ClientConfig, ClientStatusRequest, ClientStatusResponse, ConfigStatus};
use crate::pb::envoy::admin::v3::{ClientResourceStatus, UpdateFailureState};
use crate::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, NodeMatcher};
use crate::relay::Relay;
use crate::sync::read;
use crate::xds::{Lookup, TypeView};

/// Where a type of one client stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeAck {
    /// Nothing sent yet for this type.
    NotSent,
    /// The latest response was sent and not answered yet.
    Pending,
    Acked,
    Nacked,
}

impl TypeAck {
    pub fn of(ts: &TypeView) -> Self {
        match &ts.last_nonce {
            None => TypeAck::NotSent,
            Some(n) if ts.last_nack.as_ref().is_some_and(|(k, _)| k == n) => TypeAck::Nacked,
            Some(n) if ts.last_ack.as_ref() == Some(n) => TypeAck::Acked,
            Some(_) => TypeAck::Pending,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TypeAck::NotSent => "not_sent",
            TypeAck::Pending => "pending",
            TypeAck::Acked => "acked",
            TypeAck::Nacked => "nacked",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Csds {
    relay: Arc<Relay>,
}

impl Csds {
    pub fn server(relay: Arc<Relay>) -> ClientStatusDiscoveryServiceServer<Csds> {
        ClientStatusDiscoveryServiceServer::new(Csds { relay })
    }
}

fn string_match(m: &crate::pb::envoy::r#type::matcher::v3::StringMatcher, s: &str) -> Option<bool> {
    let (s, fold) = if m.ignore_case {
        (s.to_lowercase(), true)
    } else {
        (s.to_string(), false)
    };
    let p = |p: &str| {
        if fold {
            p.to_lowercase()
        } else {
            p.to_string()
        }
    };
    Some(match m.match_pattern.as_ref()? {
        MatchPattern::Exact(e) => s == p(e),
        MatchPattern::Prefix(e) => s.starts_with(&p(e)),
        MatchPattern::Suffix(e) => s.ends_with(&p(e)),
        MatchPattern::Contains(e) => s.contains(&p(e)),
    })
}

/// Whether a client matches the request's node matchers (any of them; none matches everyone).
fn matches(matchers: &[NodeMatcher], node_id: &str) -> Result<bool, Status> {
    if matchers.is_empty() {
        return Ok(true);
    }
    for m in matchers {
        let Some(id) = &m.node_id else {
            return Ok(true);
        };
        match string_match(id, node_id) {
            Some(true) => return Ok(true),
            Some(false) => {}
            None => {
                return Err(Status::unimplemented(
                    "only exact, prefix, suffix and contains node_id matchers are supported",
                ))
            }
        }
    }
    Ok(false)
}

/// The status of every matching client.
pub fn client_status(
    relay: &Relay,
    req: &ClientStatusRequest,
) -> Result<ClientStatusResponse, Status> {
    let mut clients: Vec<Arc<ClientEntry>> = relay.clients();
    clients.sort_by_key(|c| c.id);
    let mut config = Vec::new();
    for client in clients {
        if !matches(&req.node_matchers, &client.node.id)? {
            continue;
        }
        config.push(client_config(
            relay,
            &client,
            !req.exclude_resource_contents,
        ));
    }
    Ok(ClientStatusResponse { config })
}

fn client_config(relay: &Relay, client: &ClientEntry, contents: bool) -> ClientConfig {
    // Snapshot first (the stream's own lock), then look at the store (the group's lock): never
    // both at once.
    let view = client.core.view(true);
    let group = relay.group(&client.group);
    let mut out = Vec::new();
    for ts in view {
        let ack = TypeAck::of(&ts);
        let times = client.ack_times(&ts.type_url);
        let (config_status, client_status) = match ack {
            TypeAck::Acked => (ConfigStatus::Synced, ClientResourceStatus::Acked),
            TypeAck::Nacked => (ConfigStatus::Error, ClientResourceStatus::Nacked),
            TypeAck::Pending => (ConfigStatus::Stale, ClientResourceStatus::Unknown),
            // Only initial_resource_versions so far: what the client says it holds.
            TypeAck::NotSent => (ConfigStatus::Unknown, ClientResourceStatus::Unknown),
        };
        // Bodies and existence from the store, under the group lock, copying only what is needed.
        let (bodies, absent): (Vec<Option<prost_types::Any>>, Vec<bool>) = match &group {
            Some(g) => {
                let state = read(&g.state);
                let bodies = ts
                    .resources
                    .iter()
                    .map(
                        |(name, version)| match state.store().lookup(&ts.type_url, name) {
                            Lookup::Present(r) if contents && &r.version == version => {
                                prost_types::Any::decode(r.any.clone()).ok()
                            }
                            _ => None,
                        },
                    )
                    .collect();
                let absent = ts
                    .waiting
                    .iter()
                    .map(|n| matches!(state.store().lookup(&ts.type_url, n), Lookup::Absent))
                    .collect();
                (bodies, absent)
            }
            None => (
                vec![None; ts.resources.len()],
                vec![false; ts.waiting.len()],
            ),
        };
        // A NACKed resource reports the version the client kept as `version_info` and the one
        // it rejected in `error_state` (as Envoy's own CSDS does).
        let rejected = |name: &crate::xds::Name| {
            ts.rejected
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let failure = |version: String| UpdateFailureState {
            details: ts
                .last_nack
                .as_ref()
                .map(|(_, m)| m.clone())
                .unwrap_or_default(),
            version_info: version,
            last_update_attempt: times.last_nack.map(Into::into),
            failed_configuration: None,
        };
        for ((name, version), body) in ts.resources.iter().zip(bodies) {
            let error_state = (ack == TypeAck::Nacked)
                .then(|| failure(rejected(name).unwrap_or_else(|| version.clone())));
            out.push(GenericXdsConfig {
                type_url: ts.type_url.clone(),
                name: name.to_string(),
                version_info: version.clone(),
                xds_config: body,
                last_updated: times.last_ack.map(Into::into),
                config_status: config_status as i32,
                client_status: client_status as i32,
                error_state,
                is_static_resource: false,
            });
        }
        for (name, absent) in ts.waiting.iter().zip(absent) {
            if let Some(version) = rejected(name) {
                // Rejected with nothing accepted before: the client holds no version of it.
                out.push(GenericXdsConfig {
                    type_url: ts.type_url.clone(),
                    name: name.to_string(),
                    config_status: ConfigStatus::Error as i32,
                    client_status: ClientResourceStatus::Nacked as i32,
                    error_state: Some(failure(version)),
                    ..Default::default()
                });
                continue;
            }
            out.push(GenericXdsConfig {
                type_url: ts.type_url.clone(),
                name: name.to_string(),
                config_status: ConfigStatus::NotSent as i32,
                client_status: if absent {
                    ClientResourceStatus::DoesNotExist
                } else {
                    ClientResourceStatus::Requested
                } as i32,
                ..Default::default()
            });
        }
    }
    ClientConfig {
        node: Some(client.node.clone()),
        generic_xds_configs: out,
        client_scope: String::new(),
    }
}

type CsdsStream = Pin<Box<dyn Stream<Item = Result<ClientStatusResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ClientStatusDiscoveryService for Csds {
    type StreamClientStatusStream = CsdsStream;

    async fn stream_client_status(
        &self,
        request: Request<Streaming<ClientStatusRequest>>,
    ) -> Result<Response<CsdsStream>, Status> {
        let relay = self.relay.clone();
        let out = request.into_inner().map(move |req| {
            let req = req?;
            client_status(&relay, &req)
        });
        Ok(Response::new(Box::pin(out)))
    }

    async fn fetch_client_status(
        &self,
        request: Request<ClientStatusRequest>,
    ) -> Result<Response<ClientStatusResponse>, Status> {
        client_status(&self.relay, request.get_ref()).map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::envoy::r#type::matcher::v3::StringMatcher;

    fn m(p: MatchPattern, ignore_case: bool) -> NodeMatcher {
        NodeMatcher {
            node_id: Some(StringMatcher {
                match_pattern: Some(p),
                ignore_case,
            }),
        }
    }

    #[test]
    fn node_matchers() {
        assert!(matches(&[], "a").unwrap());
        assert!(matches(&[m(MatchPattern::Exact("a".into()), false)], "a").unwrap());
        assert!(!matches(&[m(MatchPattern::Exact("A".into()), false)], "a").unwrap());
        assert!(matches(&[m(MatchPattern::Exact("A".into()), true)], "a").unwrap());
        assert!(matches(&[m(MatchPattern::Prefix("en".into()), false)], "envoy-1").unwrap());
        assert!(matches(&[m(MatchPattern::Suffix("-1".into()), false)], "envoy-1").unwrap());
        assert!(!matches(&[m(MatchPattern::Contains("x".into()), false)], "envoy-1").unwrap());
        let none = NodeMatcher {
            node_id: Some(StringMatcher::default()),
        };
        assert!(matches(&[none], "a").is_err());
    }

    #[test]
    fn type_ack_state() {
        let mut ts = TypeView::default();
        assert_eq!(TypeAck::of(&ts), TypeAck::NotSent);
        ts.last_nonce = Some("2".into());
        ts.last_ack = Some("1".into());
        assert_eq!(TypeAck::of(&ts), TypeAck::Pending);
        ts.last_ack = Some("2".into());
        assert_eq!(TypeAck::of(&ts), TypeAck::Acked);
        ts.last_nack = Some(("2".into(), "bad".into()));
        assert_eq!(TypeAck::of(&ts), TypeAck::Nacked);
    }
}
