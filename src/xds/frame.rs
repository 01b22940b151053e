//! Responses framed once and shared: the fan-out's hot path.
//!
//! A response is a complete gRPC message (1 flag byte, 4 length bytes, the protobuf) held as
//! shared [`Bytes`]; a stream hands it to HTTP/2 as its body with no per-stream copy or encode
//! buffer. When many clients of a group are due the same response (the same resources at the same
//! versions, the same removals and errors, the same `version_info`), the first one to build it
//! encodes it and the rest take the same bytes from this cache.
//!
//! **Keyed on content.** A frame is found by a hash of its content and confirmed by comparing the
//! content exactly: the type, `version_info`, the removals and errors by value, and each resource
//! by the address and length of its cached bytes. An entry keeps those bytes alive, so an address
//! cannot be reused for other bytes while the entry exists: equal addresses mean equal bytes.
//!
//! **Nonces.** A nonce has to be unique within a stream only, so the group hands out nonces from
//! one increasing counter and identical responses share one. A stream takes a cached frame only if
//! its nonce is newer than the last one the stream sent; otherwise it frames the content again with
//! a fresh nonce (which then replaces the cached frame, so the streams after it share that one).
//! A stream's nonces therefore strictly increase.
//!
//! **Freed** least recently used first, past [`MAX_FRAMES`] entries or [`MAX_FRAME_BYTES`] of
//! frames; a frame larger than that budget is built for its stream and not kept.
//!
//! **Per worker thread**, the last few frames taken are remembered ([`RECENT_FRAMES`]), so the
//! streams of a fan-out running on one worker take the frame without the cache's lock: taken from
//! the cache every time, every worker wrote the lock's (and the LRU list's) cache lines once per
//! stream, and the fan-out on two threads was no faster than on one.

use std::cell::RefCell;
use std::hash::{Hash, Hasher};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};
use lru::LruCache;
use prost::Message;

use crate::pb::wire;
use crate::sync::lock;

/// Frames kept per group. A change fans out as one frame per distinct content; a handful of
/// contents are live at a time (one per type and subscription shape).
pub const MAX_FRAMES: usize = 64;
/// Bytes of frames kept per group (besides the resources themselves, which the store holds).
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// A response ready for the wire.
#[derive(Debug, Clone)]
pub struct Frame {
    /// The complete gRPC message: flag, length, protobuf.
    pub bytes: Bytes,
    pub nonce: u64,
}

impl Frame {
    /// The protobuf's length (without the 5-byte gRPC prefix).
    pub fn message_len(&self) -> usize {
        self.bytes.len().saturating_sub(GRPC_PREFIX)
    }
}

const GRPC_PREFIX: usize = 5;

/// A framed response with what the adapter reports about it.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub frame: Frame,
    pub type_url: String,
    /// Resources plus removals in it.
    pub resources: usize,
    /// Taken from the cache rather than encoded for this stream.
    pub shared: bool,
}

/// A nonce from a client's request, if it is one this relay could have written (decimal, as
/// [`u64`]'s `to_string`, no sign or leading zero); any other string was never sent and matches
/// no response.
pub fn parse_nonce(s: &str) -> Option<u64> {
    let canonical = s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    canonical.then(|| s.parse().ok()).flatten()
}

/// A response's content: everything but the nonce.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Delta(wire::DeltaDiscoveryResponse),
    Sotw(wire::DiscoveryResponse),
}

impl Content {
    fn type_url(&self) -> &str {
        match self {
            Content::Delta(r) => &r.type_url,
            Content::Sotw(r) => &r.type_url,
        }
    }

    fn resources(&self) -> &[Bytes] {
        match self {
            Content::Delta(r) => &r.resources,
            Content::Sotw(r) => &r.resources,
        }
    }

    fn key(&self) -> u64 {
        // foldhash, not SipHash: this hashes every resource's address per stream per response,
        // and the keys never leave the process.
        let mut h = std::hash::BuildHasher::build_hasher(&foldhash::fast::FixedState::default());
        match self {
            Content::Delta(r) => {
                0u8.hash(&mut h);
                r.type_url.hash(&mut h);
                r.removed_resources.hash(&mut h);
                r.removed_resource_names.len().hash(&mut h);
                r.resource_errors.len().hash(&mut h);
            }
            Content::Sotw(r) => {
                1u8.hash(&mut h);
                r.type_url.hash(&mut h);
                r.version_info.hash(&mut h);
                r.resource_errors.len().hash(&mut h);
            }
        }
        for b in self.resources() {
            (b.as_ptr() as usize, b.len()).hash(&mut h);
        }
        h.finish()
    }

    /// Equal content; resources compared by identity (see the module docs).
    fn same(&self, other: &Content) -> bool {
        let same_resources = |a: &[Bytes], b: &[Bytes]| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| x.as_ptr() == y.as_ptr() && x.len() == y.len())
        };
        match (self, other) {
            (Content::Delta(a), Content::Delta(b)) => {
                a.type_url == b.type_url
                    && a.system_version_info == b.system_version_info
                    && a.removed_resources == b.removed_resources
                    && a.removed_resource_names == b.removed_resource_names
                    && a.resource_errors == b.resource_errors
                    && a.control_plane == b.control_plane
                    && same_resources(&a.resources, &b.resources)
            }
            (Content::Sotw(a), Content::Sotw(b)) => {
                a.type_url == b.type_url
                    && a.version_info == b.version_info
                    && a.canary == b.canary
                    && a.resource_errors == b.resource_errors
                    && a.control_plane == b.control_plane
                    && same_resources(&a.resources, &b.resources)
            }
            _ => false,
        }
    }

    /// Encodes with `nonce` as one exactly sized gRPC message.
    fn encode(&self, nonce: u64) -> Bytes {
        match self {
            Content::Delta(r) => {
                let mut r = r.clone();
                r.nonce = nonce.to_string();
                grpc_message(&r)
            }
            Content::Sotw(r) => {
                let mut r = r.clone();
                r.nonce = nonce.to_string();
                grpc_message(&r)
            }
        }
    }
}

/// `msg` as a gRPC message: uncompressed flag, big-endian length, protobuf.
pub fn grpc_message(msg: &impl Message) -> Bytes {
    let len = msg.encoded_len();
    let mut buf = BytesMut::with_capacity(GRPC_PREFIX + len);
    buf.put_u8(0);
    // A message over 4 GiB cannot be framed; the response budget keeps them far smaller.
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    msg.encode_raw(&mut buf);
    buf.freeze()
}

#[derive(Debug)]
struct Entry {
    content: Content,
    frame: Frame,
}

/// Frames each worker thread remembers (see the module docs): a few, as streams due different
/// contents (a type's change, another type's) interleave on a worker.
const RECENT_FRAMES: usize = 4;

/// A frame a thread took recently, with the cache it came from and its content key.
struct Recent {
    cache: u64,
    key: u64,
    entry: Arc<Entry>,
}

thread_local! {
    static RECENT: RefCell<(usize, [Option<Recent>; RECENT_FRAMES])> =
        const { RefCell::new((0, [const { None }; RECENT_FRAMES])) };
}

/// Tells caches apart in the per-thread memory (an address could be reused by a later group).
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
struct Frames {
    entries: LruCache<u64, Arc<Entry>>,
    bytes: usize,
    /// The newest nonce handed out.
    last_nonce: u64,
}

/// A group's shared frames and nonce counter.
#[derive(Debug)]
pub struct FrameCache {
    id: u64,
    inner: Mutex<Frames>,
}

impl Default for FrameCache {
    fn default() -> Self {
        FrameCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            inner: Mutex::new(Frames {
                entries: LruCache::new(NonZeroUsize::new(MAX_FRAMES).unwrap_or(NonZeroUsize::MIN)),
                bytes: 0,
                last_nonce: 0,
            }),
        }
    }
}

/// Counts of how frames were obtained, for tests and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FrameStats {
    pub shared: u64,
    pub encoded: u64,
}

impl FrameCache {
    /// The frame for `content`, for a stream whose last nonce was `after`: shared if an identical
    /// one with a newer nonce exists, else encoded now. The returned nonce is always > `after`.
    /// The flag says whether the frame was shared.
    pub fn frame(&self, content: Content, after: u64) -> (Frame, bool) {
        let key = content.key();
        let usable = |e: &Entry| e.frame.nonce > after && e.content.same(&content);
        let recent = RECENT.with_borrow(|(_, slots)| {
            slots
                .iter()
                .flatten()
                .find(|r| r.cache == self.id && r.key == key && usable(&r.entry))
                .map(|r| r.entry.frame.clone())
        });
        if let Some(frame) = recent {
            return (frame, true);
        }
        let (entry, shared) = self.frame_locked(content, key, after);
        let frame = entry.frame.clone();
        if frame.bytes.len() <= MAX_FRAME_BYTES {
            RECENT.with_borrow_mut(|(next, slots)| {
                slots[*next] = Some(Recent {
                    cache: self.id,
                    key,
                    entry,
                });
                *next = (*next + 1) % RECENT_FRAMES;
            });
        }
        (frame, shared)
    }

    fn frame_locked(&self, content: Content, key: u64, after: u64) -> (Arc<Entry>, bool) {
        let mut f = lock(&self.inner);
        if let Some(e) = f.entries.get(&key) {
            if e.frame.nonce > after && e.content.same(&content) {
                return (e.clone(), true);
            }
        }
        let nonce = f.last_nonce.max(after) + 1;
        f.last_nonce = nonce;
        // Encoding under the lock keeps a burst of identical requests to one encode.
        let frame = Frame {
            bytes: content.encode(nonce),
            nonce,
        };
        let entry = Arc::new(Entry { content, frame });
        if let Some(old) = f.entries.pop(&key) {
            f.bytes -= old.frame.bytes.len();
        }
        let len = entry.frame.bytes.len();
        if len <= MAX_FRAME_BYTES {
            f.bytes += len;
            if let Some((_, old)) = f.entries.push(key, entry.clone()) {
                f.bytes -= old.frame.bytes.len();
            }
            while f.bytes > MAX_FRAME_BYTES {
                match f.entries.pop_lru() {
                    Some((_, old)) => f.bytes -= old.frame.bytes.len(),
                    None => break,
                }
            }
        }
        (entry, false)
    }

    /// [`FrameCache::frame`] for a stream whose last nonce is `*last_nonce`, which it advances;
    /// with what the adapter reports about the response.
    pub fn frame_for_stream(&self, content: Content, last_nonce: &mut u64) -> Outgoing {
        let type_url = content.type_url().to_string();
        let resources = match &content {
            Content::Delta(r) => r.resources.len() + r.removed_resources.len(),
            Content::Sotw(r) => r.resources.len(),
        };
        let (frame, shared) = self.frame(content, *last_nonce);
        *last_nonce = frame.nonce;
        Outgoing {
            frame,
            type_url,
            resources,
            shared,
        }
    }

    /// Frames held and their bytes.
    pub fn held(&self) -> (usize, usize) {
        let f = lock(&self.inner);
        (f.entries.len(), f.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nonces_the_relay_writes_parse() {
        for n in [0, 7, 1234, u64::MAX] {
            assert_eq!(parse_nonce(&n.to_string()), Some(n));
        }
        for s in ["", "07", "+7", "-1", "7 ", "x", "18446744073709551616"] {
            assert_eq!(parse_nonce(s), None, "{s:?}");
        }
    }

    fn delta(resources: Vec<Bytes>) -> Content {
        Content::Delta(wire::DeltaDiscoveryResponse {
            type_url: "t".into(),
            resources,
            ..Default::default()
        })
    }

    #[test]
    fn identical_content_shares_one_frame_and_nonce() {
        let cache = FrameCache::default();
        let r = Bytes::from_static(b"resource-bytes");
        let (a, shared_a) = cache.frame(delta(vec![r.clone()]), 0);
        let (b, shared_b) = cache.frame(delta(vec![r.clone()]), 0);
        assert!(!shared_a);
        assert!(shared_b);
        assert_eq!(a.bytes, b.bytes);
        assert_eq!(
            a.bytes.as_ptr(),
            b.bytes.as_ptr(),
            "the same allocation, not a copy"
        );
        let decoded =
            wire::DeltaDiscoveryResponse::decode(&a.bytes[GRPC_PREFIX..]).expect("decodes");
        assert_eq!(decoded.nonce, a.nonce.to_string());
        assert_eq!(decoded.resources, vec![r]);
        assert_eq!(
            u32::from_be_bytes(a.bytes[1..5].try_into().unwrap()) as usize,
            a.message_len()
        );
    }

    #[test]
    fn a_stream_never_reuses_a_nonce() {
        let cache = FrameCache::default();
        let r = Bytes::from_static(b"x");
        let (first, _) = cache.frame(delta(vec![r.clone()]), 0);
        // The same stream asks for the same content again (A7 resend): a new nonce.
        let (again, shared) = cache.frame(delta(vec![r.clone()]), first.nonce);
        assert!(!shared);
        assert!(again.nonce > first.nonce);
        // A stream that is ahead of the counter (its frames came from another cache) stays ahead.
        let (ahead, _) = cache.frame(delta(vec![r]), 1000);
        assert_eq!(ahead.nonce, 1001);
    }

    #[test]
    fn a_frame_remembered_by_the_thread_is_not_served_for_another_group() {
        let (a, b) = (FrameCache::default(), FrameCache::default());
        let r = Bytes::from_static(b"same-bytes");
        let (from_a, _) = a.frame(delta(vec![r.clone()]), 0);
        let (from_b, shared) = b.frame(delta(vec![r.clone()]), 0);
        assert!(
            !shared,
            "group b frames its own response with its own nonce"
        );
        assert_ne!(from_a.bytes.as_ptr(), from_b.bytes.as_ptr());
        // Back on group a, the remembered frame is shared again.
        let (again, shared) = a.frame(delta(vec![r]), 0);
        assert!(shared);
        assert_eq!(again.bytes.as_ptr(), from_a.bytes.as_ptr());
    }

    #[test]
    fn different_bytes_with_equal_content_are_not_confused() {
        let cache = FrameCache::default();
        let (a, _) = cache.frame(delta(vec![Bytes::from(vec![1u8, 2])]), 0);
        let (b, shared) = cache.frame(delta(vec![Bytes::from(vec![3u8, 4])]), 0);
        assert!(!shared);
        assert_ne!(a.bytes, b.bytes);
    }

    #[test]
    fn frames_are_freed_past_the_budget() {
        let cache = FrameCache::default();
        for i in 0..(MAX_FRAMES + 10) {
            cache.frame(delta(vec![Bytes::from(i.to_string())]), 0);
        }
        let (n, _) = cache.held();
        assert_eq!(n, MAX_FRAMES);
        let big = Bytes::from(vec![0u8; MAX_FRAME_BYTES + 1]);
        let (f, _) = cache.frame(delta(vec![big]), 0);
        assert!(f.bytes.len() > MAX_FRAME_BYTES);
        let (_, bytes) = cache.held();
        assert!(bytes <= MAX_FRAME_BYTES, "an oversized frame is not kept");
    }
}
