//! The hand-off between a stream's task and its HTTP/2 response body: the next response is built
//! from the newest state only when the transport took what came before, so a slow client holds
//! at most one large frame (plus a few small ones) and never a backlog.
//!
//! Small frames written one after another (a resume's two wildcard answers, a run of ACK-sized
//! updates) wait together and leave as one data chunk while they fit one HTTP/2 DATA frame of the
//! default maximum size: one frame and one socket write for the client to read instead of several,
//! as tonic's encoder batches the messages ready together. A frame larger than that is never
//! copied: it leaves alone, as the shared bytes it is.
//!
//! Written here rather than taken from tokio: an `mpsc` channel allocates its slots 32 at a time,
//! keeps cache-padded bookkeeping and a semaphore (~0.7 KiB per stream with ten thousand streams
//! open) and wants items boxed to stay small. This is one small allocation per stream: a
//! mutex-guarded queue and the two sides' wakers.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use tonic::Status;

use crate::sync::lock;

/// A complete gRPC message (shared frame) or the status that ends the stream.
pub type Item = Result<Bytes, Box<Status>>;

/// Queued frames are joined while together they fit this (HTTP/2's default maximum DATA frame
/// payload); the stream task may write while less than this waits.
pub const BATCH_BYTES: usize = 16 * 1024;

/// The body went away (the client reset the stream or the connection closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

#[derive(Default)]
struct State {
    /// Frames written and not yet taken by the body, oldest first.
    frames: VecDeque<Bytes>,
    /// Their total length.
    queued_bytes: usize,
    /// The status that ends the stream, after the frames.
    status: Option<Box<Status>>,
    sender_gone: bool,
    receiver_gone: bool,
    /// The body waiting for an item.
    receiver: Option<Waker>,
    /// The stream task waiting for room.
    sender: Option<Waker>,
}

impl State {
    fn has_room(&self) -> bool {
        self.status.is_none() && self.queued_bytes < BATCH_BYTES
    }

    /// The oldest frame, joined with those after it while together they fit [`BATCH_BYTES`]. A
    /// frame alone (the common case, and any large one) is returned as it is, without a copy.
    fn take_frames(&mut self) -> Option<Bytes> {
        let first = self.frames.pop_front()?;
        self.queued_bytes -= first.len();
        let fits =
            |len: usize, next: Option<&Bytes>| next.is_some_and(|n| len + n.len() <= BATCH_BYTES);
        if !fits(first.len(), self.frames.front()) {
            return Some(first);
        }
        let mut joined = BytesMut::with_capacity(BATCH_BYTES.min(first.len() + self.queued_bytes));
        joined.extend_from_slice(&first);
        while fits(joined.len(), self.frames.front()) {
            let Some(next) = self.frames.pop_front() else {
                break;
            };
            self.queued_bytes -= next.len();
            joined.extend_from_slice(&next);
        }
        Some(joined.freeze())
    }
}

/// A new slot: the stream task's end and the body's end.
pub fn slot() -> (Sender, Receiver) {
    let shared = Arc::new(Mutex::new(State::default()));
    (Sender(shared.clone()), Receiver(shared))
}

/// The stream task's end.
pub struct Sender(Arc<Mutex<State>>);

impl Sender {
    /// Whether an item can go in now (nothing large waits); `Err` once the body is gone.
    pub fn is_free(&self) -> Result<bool, Closed> {
        let state = lock(&self.0);
        if state.receiver_gone {
            return Err(Closed);
        }
        Ok(state.has_room())
    }

    /// Waits until the body took enough of what waits.
    pub async fn ready(&self) -> Result<(), Closed> {
        std::future::poll_fn(|cx| self.poll_ready(cx)).await
    }

    fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<Result<(), Closed>> {
        let mut state = lock(&self.0);
        if state.receiver_gone {
            return Poll::Ready(Err(Closed));
        }
        if state.has_room() {
            return Poll::Ready(Ok(()));
        }
        if !state
            .sender
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            state.sender = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Queues `item`; the caller saw room (this task is the only producer).
    pub fn put(&self, item: Item) {
        let waker = {
            let mut state = lock(&self.0);
            debug_assert!(state.has_room(), "put into a full slot");
            match item {
                Ok(frame) => {
                    state.queued_bytes += frame.len();
                    state.frames.push_back(frame);
                }
                Err(status) => state.status = Some(status),
            }
            state.receiver.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Waits for room, then puts `item`.
    pub async fn send(&self, item: Item) -> Result<(), Closed> {
        self.ready().await?;
        self.put(item);
        Ok(())
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let waker = {
            let mut state = lock(&self.0);
            state.sender_gone = true;
            state.receiver.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The body's end.
pub struct Receiver(Arc<Mutex<State>>);

impl Receiver {
    /// The next item: the oldest frame, joined with those after it while together they fit
    /// [`BATCH_BYTES`]; then the status; `None` once the sender is gone and nothing waits.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let (item, waker) = {
            let mut state = lock(&self.0);
            let item = match state.take_frames() {
                Some(frames) => Ok(frames),
                None => match state.status.take() {
                    Some(status) => Err(status),
                    None if state.sender_gone => return Poll::Ready(None),
                    None => {
                        if !state
                            .receiver
                            .as_ref()
                            .is_some_and(|w| w.will_wake(cx.waker()))
                        {
                            state.receiver = Some(cx.waker().clone());
                        }
                        return Poll::Pending;
                    }
                },
            };
            (item, state.sender.take())
        };
        if let Some(w) = waker {
            w.wake();
        }
        Poll::Ready(Some(item))
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let waker = {
            let mut state = lock(&self.0);
            state.receiver_gone = true;
            state.frames.clear();
            state.queued_bytes = 0;
            state.status = None;
            state.sender.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(rx: &mut Receiver) -> Poll<Option<Item>> {
        rx.poll_recv(&mut Context::from_waker(Waker::noop()))
    }

    fn large(byte: u8) -> Bytes {
        Bytes::from(vec![byte; BATCH_BYTES])
    }

    #[tokio::test]
    async fn a_large_frame_in_flight_leaves_no_room_then_the_end() {
        let (tx, mut rx) = slot();
        assert_eq!(tx.is_free(), Ok(true));
        assert!(recv(&mut rx).is_pending());
        tx.put(Ok(large(b'a')));
        assert_eq!(tx.is_free(), Ok(false), "a large frame waits alone");
        let waiting = tokio::spawn(async move {
            tx.send(Ok(Bytes::from_static(b"b"))).await.unwrap();
            // Dropped here: the body ends after what it holds.
        });
        tokio::task::yield_now().await;
        assert!(matches!(recv(&mut rx), Poll::Ready(Some(Ok(b))) if b == large(b'a')));
        waiting.await.unwrap();
        assert!(matches!(recv(&mut rx), Poll::Ready(Some(Ok(b))) if b == "b"));
        assert!(matches!(recv(&mut rx), Poll::Ready(None)));
    }

    #[test]
    fn small_frames_leave_together_large_ones_alone_and_uncopied_then_the_status() {
        let (tx, mut rx) = slot();
        tx.put(Ok(Bytes::from_static(b"first ")));
        assert_eq!(tx.is_free(), Ok(true), "a small frame leaves room");
        tx.put(Ok(Bytes::from_static(b"second")));
        let big = large(b'x');
        let big_at = big.as_ptr();
        tx.put(Ok(big));
        assert_eq!(tx.is_free(), Ok(false));
        assert!(matches!(recv(&mut rx), Poll::Ready(Some(Ok(b))) if b == "first second"));
        assert_eq!(tx.is_free(), Ok(false), "the large frame still waits");
        match recv(&mut rx) {
            Poll::Ready(Some(Ok(b))) => {
                assert_eq!(b.as_ptr(), big_at, "the shared bytes, not a copy")
            }
            other => panic!("expected the large frame, got {other:?}"),
        }
        tx.put(Ok(Bytes::from_static(b"after")));
        tx.put(Err(Box::new(Status::unavailable("draining"))));
        assert!(matches!(recv(&mut rx), Poll::Ready(Some(Ok(b))) if b == "after"));
        assert!(
            matches!(recv(&mut rx), Poll::Ready(Some(Err(s))) if s.message() == "draining"),
            "the status goes after every frame"
        );
    }

    #[tokio::test]
    async fn a_gone_body_frees_the_waiting_sender() {
        let (tx, rx) = slot();
        tx.put(Ok(large(b'a')));
        let waiting = tokio::spawn(async move { tx.ready().await });
        tokio::task::yield_now().await;
        drop(rx);
        assert_eq!(waiting.await.unwrap(), Err(Closed));
    }
}
