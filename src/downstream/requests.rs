//! Reads a stream's requests: gRPC length-prefixed protobuf messages from the HTTP/2 request body.
//!
//! Written here rather than with tonic's `Streaming`, which keeps a per-stream buffer with the
//! capacity of the largest request it has read (a join's subscribe list): ~2 KiB on each of
//! 10,000 mostly idle streams. Here a message that lies within one DATA frame (nearly all of
//! them: HTTP/2 frames are 16 KiB) is decoded straight from the frame's bytes; a message split
//! across frames is gathered in a buffer sized once from its length prefix and dropped as soon as
//! the message is complete. Between requests a stream holds no buffer at all.

use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Body as _;
use tonic::body::Body;

/// gRPC's message prefix: a compressed flag and a big-endian length.
const PREFIX_BYTES: usize = 5;

/// Why a stream's requests cannot be read further.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{len} bytes, over the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("{0}")]
    Malformed(#[from] prost::DecodeError),
    #[error("a message is marked compressed, but the stream declared no grpc-encoding")]
    Compressed,
    #[error("invalid compressed flag {0} in a message prefix")]
    BadPrefix(u8),
    #[error("the request stream ended inside a message")]
    Truncated,
    /// The client reset the stream or the connection went away (every Envoy reconnect: kept
    /// as it came and formatted only if logged).
    #[error("{0}")]
    Transport(Box<tonic::Status>),
}

/// The requests of one stream, decoded as they arrive.
pub struct RequestReader<T> {
    body: Body,
    /// Received bytes not yet decoded: usually the rest of the last DATA frame, shared with it.
    unread: Bytes,
    /// A message split across DATA frames (prefix included), until it is complete.
    gathering: BytesMut,
    max_message_bytes: usize,
    ended: bool,
    message: PhantomData<fn() -> T>,
}

impl<T: prost::Message + Default> RequestReader<T> {
    pub fn new(body: Body, max_message_bytes: usize) -> Self {
        RequestReader {
            body,
            unread: Bytes::new(),
            gathering: BytesMut::new(),
            max_message_bytes,
            ended: false,
            message: PhantomData,
        }
    }

    /// The next request; `None` when the client ended its side of the stream cleanly.
    pub async fn message(&mut self) -> Result<Option<T>, ReadError> {
        std::future::poll_fn(|cx| self.poll_message(cx)).await
    }

    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<T>, ReadError>> {
        loop {
            if let Some(encoded) = self.next_encoded()? {
                return Poll::Ready(T::decode(encoded).map(Some).map_err(ReadError::from));
            }
            if self.ended {
                let clean = self.unread.is_empty() && self.gathering.is_empty();
                return Poll::Ready(if clean {
                    Ok(None)
                } else {
                    Err(ReadError::Truncated)
                });
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Request trailers carry nothing gRPC uses.
                    if let Ok(data) = frame.into_data() {
                        self.receive(data);
                    }
                }
                Some(Err(e)) => return Poll::Ready(Err(ReadError::Transport(Box::new(e)))),
                None => self.ended = true,
            }
        }
    }

    fn receive(&mut self, data: Bytes) {
        // While gathering, every received byte went into `gathering`, so `unread` is empty; it is
        // also empty, or a prefix shorter than five bytes, otherwise.
        if self.unread.is_empty() {
            self.unread = data;
        } else {
            // Only a prefix split across frames is left over here: a few bytes.
            let mut joined = BytesMut::with_capacity(self.unread.len() + data.len());
            joined.put(std::mem::take(&mut self.unread));
            joined.put(data);
            self.unread = joined.freeze();
        }
    }

    /// The next complete message's protobuf bytes, if the bytes received hold one.
    fn next_encoded(&mut self) -> Result<Option<Bytes>, ReadError> {
        if !self.gathering.is_empty() {
            let total = PREFIX_BYTES + prefix_len(&self.gathering);
            let take = (total - self.gathering.len()).min(self.unread.len());
            self.gathering.put(self.unread.split_to(take));
            if self.gathering.len() < total {
                return Ok(None);
            }
            let mut message = std::mem::take(&mut self.gathering).freeze();
            message.advance(PREFIX_BYTES);
            return Ok(Some(message));
        }
        if self.unread.len() < PREFIX_BYTES {
            return Ok(None);
        }
        match self.unread[0] {
            0 => {}
            1 => return Err(ReadError::Compressed),
            flag => return Err(ReadError::BadPrefix(flag)),
        }
        let len = prefix_len(&self.unread);
        if len > self.max_message_bytes {
            return Err(ReadError::TooLarge {
                len,
                max: self.max_message_bytes,
            });
        }
        if self.unread.len() >= PREFIX_BYTES + len {
            self.unread.advance(PREFIX_BYTES);
            let message = self.unread.split_to(len);
            if self.unread.is_empty() {
                // An empty slice would still keep the whole frame's allocation alive.
                self.unread = Bytes::new();
            }
            return Ok(Some(message));
        }
        // Sized once: the length was checked against the limit above.
        self.gathering = BytesMut::with_capacity(PREFIX_BYTES + len);
        self.gathering.put(std::mem::take(&mut self.unread));
        Ok(None)
    }
}

/// The message length in a gRPC prefix (`bytes` holds at least [`PREFIX_BYTES`]).
fn prefix_len(bytes: &[u8]) -> usize {
    u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::discovery::DeltaDiscoveryRequest;
    use prost::Message;

    fn framed(m: &DeltaDiscoveryRequest) -> Vec<u8> {
        let body = m.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn request(names: usize) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            resource_names_subscribe: (0..names).map(|i| format!("cluster-{i}")).collect(),
            ..Default::default()
        }
    }

    /// A body that delivers `chunks` as its DATA frames, then ends.
    fn body_of(chunks: Vec<Vec<u8>>) -> Body {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(c))));
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames.collect::<Vec<_>>(),
        )))
    }

    async fn read_all(
        chunks: Vec<Vec<u8>>,
        max: usize,
    ) -> (Vec<DeltaDiscoveryRequest>, Option<ReadError>) {
        let mut reader = RequestReader::<DeltaDiscoveryRequest>::new(body_of(chunks), max);
        let mut got = Vec::new();
        loop {
            match reader.message().await {
                Ok(Some(m)) => got.push(m),
                Ok(None) => return (got, None),
                Err(e) => return (got, Some(e)),
            }
        }
    }

    #[tokio::test]
    async fn messages_split_and_joined_any_way_read_the_same() {
        let sent = [request(3), request(0), request(200), request(1)];
        let mut wire = Vec::new();
        for m in &sent {
            wire.extend(framed(m));
        }
        // Every message in one frame; then frames of 1, 3, 7 and 1000 bytes (prefixes and
        // messages cut anywhere).
        for size in [wire.len(), 1, 3, 7, 1000] {
            let chunks = wire.chunks(size).map(<[u8]>::to_vec).collect();
            let (got, err) = read_all(chunks, 1 << 20).await;
            assert!(err.is_none(), "chunk size {size}: {err:?}");
            assert_eq!(got, sent, "chunk size {size}");
        }
    }

    #[tokio::test]
    async fn a_length_over_the_limit_is_refused_before_it_is_read() {
        let mut wire = framed(&request(100));
        // Only the prefix arrives: the limit is checked on the declared length.
        wire.truncate(PREFIX_BYTES);
        let (got, err) = read_all(vec![wire], 64).await;
        assert!(got.is_empty());
        assert!(
            matches!(err, Some(ReadError::TooLarge { max: 64, .. })),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn bad_bytes_are_typed_errors() {
        let (_, err) = read_all(vec![vec![0, 0, 0, 0, 2, 0xff, 0xff]], 1024).await;
        assert!(matches!(err, Some(ReadError::Malformed(_))), "{err:?}");
        let (_, err) = read_all(vec![vec![1, 0, 0, 0, 0]], 1024).await;
        assert!(matches!(err, Some(ReadError::Compressed)), "{err:?}");
        let (_, err) = read_all(vec![vec![7, 0, 0, 0, 0]], 1024).await;
        assert!(matches!(err, Some(ReadError::BadPrefix(7))), "{err:?}");
        let mut cut = framed(&request(5));
        cut.pop();
        let (_, err) = read_all(vec![cut], 1024).await;
        assert!(matches!(err, Some(ReadError::Truncated)), "{err:?}");
    }

    proptest::proptest! {
        /// Whatever the client sends, however HTTP/2 cuts it into frames, the reader reads the
        /// same messages and stops at the same kind of error, and never panics.
        #[test]
        fn any_bytes_read_alike_however_framed(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            valid in proptest::collection::vec(0usize..20, 0..4),
            cut in 1usize..64,
        ) {
            let mut wire = Vec::new();
            for n in &valid {
                wire.extend(framed(&request(*n)));
            }
            wire.extend(&bytes);
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let (whole, whole_err) = rt.block_on(read_all(vec![wire.clone()], 4096));
            let chunks = wire.chunks(cut).map(<[u8]>::to_vec).collect();
            let (cut_up, cut_err) = rt.block_on(read_all(chunks, 4096));
            proptest::prop_assert_eq!(&whole, &cut_up);
            proptest::prop_assert!(whole.len() >= valid.len());
            proptest::prop_assert_eq!(
                whole_err.map(|e| std::mem::discriminant(&e)),
                cut_err.map(|e| std::mem::discriminant(&e))
            );
        }
    }

    #[tokio::test]
    async fn nothing_is_kept_between_messages() {
        let wire = framed(&request(50));
        let (first, rest) = wire.split_at(wire.len() / 2);
        let mut reader = RequestReader::<DeltaDiscoveryRequest>::new(
            body_of(vec![first.to_vec(), rest.to_vec()]),
            1 << 20,
        );
        assert_eq!(reader.message().await.ok().flatten(), Some(request(50)));
        assert!(reader.unread.is_empty());
        assert_eq!(reader.gathering.capacity(), 0);
    }
}
