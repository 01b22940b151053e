//! Hostile and broken clients against a real relay: each bad input ends only its own stream with a
//! status naming the problem, is counted in `adsrelay_downstream_streams_rejected_total{reason}`,
//! and a well-behaved client on the same relay sees nothing but its own updates.

mod support;

use std::time::Duration;

use adsrelay::config::Config;
use adsrelay::pb::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, ResourceLocator};
use bytes::{BufMut, Bytes};
use prost::Message;
use support::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Code;

/// Sends raw bytes as request messages; decodes responses normally.
#[derive(Default)]
struct RawCodec;

struct RawEncoder;
struct RespDecoder;

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = tonic::Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RespDecoder {
    type Item = DeltaDiscoveryResponse;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut DecodeBuf<'_>,
    ) -> Result<Option<DeltaDiscoveryResponse>, tonic::Status> {
        DeltaDiscoveryResponse::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = DeltaDiscoveryResponse;
    type Encoder = RawEncoder;
    type Decoder = RespDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RespDecoder {
        RespDecoder
    }
}

/// Opens a Delta ADS stream that sends `messages` verbatim, and returns the terminal status.
async fn raw_stream_status(addr: std::net::SocketAddr, messages: Vec<Bytes>) -> tonic::Status {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let (tx, rx) = mpsc::channel(16);
    for m in messages {
        tx.send(m).await.unwrap();
    }
    let path = http::uri::PathAndQuery::from_static(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
    );
    let result = grpc
        .streaming(tonic::Request::new(ReceiverStream::new(rx)), path, RawCodec)
        .await;
    let status = match result {
        Err(status) => status,
        Ok(resp) => {
            let mut inbound = resp.into_inner();
            loop {
                match tokio::time::timeout(TIMEOUT, inbound.message()).await {
                    Ok(Err(status)) => break status,
                    Ok(Ok(Some(_))) => continue,
                    other => panic!("expected an error status, got {other:?}"),
                }
            }
        }
    };
    drop(tx);
    status
}

/// Skips responses until the stream ends with a status.
async fn final_status(c: &mut DeltaClient) -> tonic::Status {
    loop {
        match c.try_recv().await {
            Ok(_) => continue,
            Err(status) => return status,
        }
    }
}

struct Setup {
    upstream: Upstream,
    relay: RelayUnderTest,
    bystander: DeltaClient,
}

/// An upstream with c1, a relay with `adjust` applied, and a bystander subscribed to c1.
async fn setup(adjust: impl FnOnce(&mut Config)) -> Setup {
    let upstream = Upstream::start(vec![resource(CDS, "c1", "1")]).await;
    let relay = RelayUnderTest::start_with(upstream.addr, adjust).await;
    let mut bystander =
        DeltaClient::connect(relay.xds, node("bystander", "g"), subscribe(CDS, &["c1"])).await;
    assert_eq!(
        names(&bystander.recv_ack().await),
        [("c1".into(), "1".into())]
    );
    Setup {
        upstream,
        relay,
        bystander,
    }
}

impl Setup {
    /// The bystander saw nothing of the hostile client, and still gets its updates.
    async fn bystander_unaffected(&mut self) {
        self.bystander
            .expect_silence(Duration::from_millis(200))
            .await;
        self.upstream
            .cp
            .set_resources(vec![resource(CDS, "c1", "2")]);
        let r = self.bystander.recv_ack().await;
        assert_eq!(names(&r), [("c1".into(), "2".into())]);
    }

    async fn rejected(&self, reason: &str) -> f64 {
        let (status, body) = http_request(self.relay.admin, "GET", "/metrics").await;
        assert_eq!(status, 200);
        let series = format!("adsrelay_downstream_streams_rejected_total{{reason=\"{reason}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    async fn hostile(&self, first: DeltaDiscoveryRequest) -> DeltaClient {
        DeltaClient::connect(self.relay.xds, node("hostile", "g"), first).await
    }
}

#[tokio::test]
async fn malformed_protobuf_is_invalid_argument() {
    let mut s = setup(|_| {}).await;
    // Field 1 (node) as a length-delimited field claiming 100 bytes, with 3 present.
    let garbage = Bytes::from_static(&[0x0a, 0x64, 0x01, 0x02, 0x03]);
    let status = raw_stream_status(s.relay.xds, vec![garbage]).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("malformed request"), "{status:?}");
    assert_eq!(s.rejected("malformed_request").await, 1.0);

    // Malformed after a valid first request, too.
    let valid = DeltaDiscoveryRequest {
        node: Some(node("hostile", "g")),
        ..subscribe(CDS, &["c1"])
    };
    let status = raw_stream_status(
        s.relay.xds,
        vec![
            valid.encode_to_vec().into(),
            Bytes::from_static(&[0xff, 0xff]),
        ],
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(s.rejected("malformed_request").await, 2.0);
    s.bystander_unaffected().await;
}

#[tokio::test]
async fn oversize_request_is_resource_exhausted() {
    let mut s = setup(|c| c.max_message_bytes = 64 * 1024).await;
    let names: Vec<String> = (0..100)
        .map(|i| format!("{i}-{}", "n".repeat(1000)))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut c = s.hostile(subscribe(CDS, &names)).await;
    let status = c.recv_status().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");
    assert_eq!(s.rejected("message_too_large").await, 1.0);
    s.bystander_unaffected().await;
}

#[tokio::test]
async fn absurdly_long_names_are_refused() {
    let mut s = setup(|c| c.limits.max_name_bytes = 1024).await;
    let long = "x".repeat(5000);
    let mut c = s.hostile(subscribe(CDS, &[&long])).await;
    let status = c.recv_status().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("resource name of 5000 bytes exceeds the limit of 1024 bytes"),
        "{status:?}"
    );
    // A long type_url, on a stream that was fine until then.
    let mut c = s.hostile(subscribe(CDS, &["c1"])).await;
    c.recv_ack().await;
    c.send(subscribe(&long, &["a"])).await;
    let status = c.recv_status().await;
    assert!(
        status.message().contains("type_url of 5000 bytes"),
        "{status:?}"
    );
    assert_eq!(s.rejected("name_too_long").await, 2.0);
    s.bystander_unaffected().await;
}

#[tokio::test]
async fn huge_subscription_lists_are_resource_exhausted() {
    let mut s = setup(|c| c.limits.max_subscriptions_per_stream = 100).await;
    let many: Vec<String> = (0..101).map(|i| format!("n{i}")).collect();
    let many_refs: Vec<&str> = many.iter().map(String::as_str).collect();
    let mut c = s.hostile(subscribe(CDS, &many_refs)).await;
    let status = c.recv_status().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("limit is 100"), "{status:?}");

    // Growing past the limit over several requests (of two types) is refused as well, and what
    // the stream held is released.
    let mut c = s.hostile(subscribe(CDS, &many_refs[..60])).await;
    c.send(subscribe(EDS, &many_refs[60..100])).await;
    c.send(subscribe(CDS, &["c1", "one-more"])).await;
    let status = final_status(&mut c).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("102 subscriptions"), "{status:?}");
    assert_eq!(s.rejected("too_many_subscriptions").await, 2.0);
    // Only the bystander's c1 stays subscribed downstream.
    let (_, body) = http_request(s.relay.admin, "GET", "/metrics").await;
    assert!(
        body.contains(&format!(
            "adsrelay_downstream_subscriptions{{type_url=\"{CDS}\"}} 1\n"
        )),
        "{body}"
    );
    s.bystander_unaffected().await;
}

#[tokio::test]
async fn invalid_locator_parameters_are_refused() {
    let mut s = setup(|_| {}).await;
    let req = DeltaDiscoveryRequest {
        type_url: CDS.into(),
        resource_locators_subscribe: vec![ResourceLocator {
            name: "c1".into(),
            dynamic_parameters: [(String::new(), "prod".to_string())].into(),
        }],
        ..Default::default()
    };
    let mut c = s.hostile(req).await;
    let status = c.recv_status().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("empty key"), "{status:?}");
    let req = DeltaDiscoveryRequest {
        type_url: CDS.into(),
        resource_locators_subscribe: vec![ResourceLocator {
            name: "c1".into(),
            dynamic_parameters: (0..65)
                .map(|i| (format!("k{i}"), "v".to_string()))
                .collect(),
        }],
        ..Default::default()
    };
    let mut c = s.hostile(req).await;
    let status = c.recv_status().await;
    assert!(
        status.message().contains("65 dynamic parameters"),
        "{status:?}"
    );
    assert_eq!(s.rejected("invalid_locator").await, 2.0);
    s.bystander_unaffected().await;
}

#[tokio::test]
async fn garbage_nonces_are_harmless() {
    let mut s = setup(|_| {}).await;
    let mut c = s.hostile(subscribe(CDS, &["c1"])).await;
    c.recv().await;
    for nonce in ["", "garbage", "\u{0}\u{1}", &"9".repeat(1000)] {
        c.send(DeltaDiscoveryRequest {
            type_url: CDS.into(),
            response_nonce: nonce.into(),
            error_detail: Some(adsrelay::pb::rpc::Status {
                code: 3,
                message: "nope".into(),
                details: vec![],
            }),
            ..Default::default()
        })
        .await;
    }
    c.expect_silence(Duration::from_millis(200)).await;
    s.bystander_unaffected().await;
    // The stream with garbage nonces still gets the update too.
    assert_eq!(names(&c.recv().await), [("c1".into(), "2".into())]);
}

#[tokio::test]
async fn request_floods_are_rate_limited() {
    let mut s = setup(|c| {
        c.limits.max_requests_per_second = 5;
        c.limits.request_burst = 10;
    })
    .await;
    let mut c = s.hostile(subscribe(CDS, &["c1"])).await;
    let r = c.recv().await;
    // A NACK loop: the same NACK, as fast as possible.
    let nack = DeltaDiscoveryRequest {
        type_url: CDS.into(),
        response_nonce: r.nonce.clone(),
        error_detail: Some(adsrelay::pb::rpc::Status {
            code: 3,
            message: "rejected".into(),
            details: vec![],
        }),
        ..Default::default()
    };
    for _ in 0..15 {
        c.send(nack.clone()).await;
    }
    let status = c.recv_status().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("request rate"), "{status:?}");
    assert_eq!(s.rejected("rate_limited").await, 1.0);
    s.bystander_unaffected().await;
}

#[tokio::test]
async fn connections_beyond_the_limit_are_closed() {
    let mut s = setup(|c| c.limits.max_connections = 1).await;
    let refused = DeltaClient::try_connect(
        s.relay.xds,
        Some(node("second", "g")),
        subscribe(CDS, &["c1"]),
    )
    .await;
    assert!(refused.is_err(), "second connection must be refused");
    let (_, body) = http_request(s.relay.admin, "GET", "/metrics").await;
    let rejected = body
        .lines()
        .find(|l| l.starts_with("adsrelay_downstream_connections_rejected_total "))
        .unwrap_or("missing");
    assert_ne!(
        rejected, "adsrelay_downstream_connections_rejected_total 0",
        "{body}"
    );
    assert_ne!(rejected, "missing", "{body}");
    s.bystander_unaffected().await;
}
