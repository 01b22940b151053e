//! The one-slot hand-off between a stream's task and its HTTP/2 response body: at most one
//! response in flight, so the next one is built from the newest state only when the transport
//! took the previous one.
//!
//! Written here rather than taken from tokio: an `mpsc` channel of capacity 1 allocates its slots
//! 32 at a time, keeps cache-padded bookkeeping and a semaphore (~0.7 KiB per stream with ten
//! thousand streams open) and wants items boxed to stay small. This is one small allocation per
//! stream: a mutex-guarded option and the two sides' wakers.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use tonic::Status;

use crate::sync::lock;

/// A complete gRPC message (shared frame) or the status that ends the stream.
pub type Item = Result<Bytes, Box<Status>>;

/// The body went away (the client reset the stream or the connection closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

#[derive(Default)]
struct State {
    item: Option<Item>,
    sender_gone: bool,
    receiver_gone: bool,
    /// The body waiting for an item.
    receiver: Option<Waker>,
    /// The stream task waiting for the slot to empty.
    sender: Option<Waker>,
}

/// A new slot: the stream task's end and the body's end.
pub fn slot() -> (Sender, Receiver) {
    let shared = Arc::new(Mutex::new(State::default()));
    (Sender(shared.clone()), Receiver(shared))
}

/// The stream task's end.
pub struct Sender(Arc<Mutex<State>>);

impl Sender {
    /// Whether an item can go in now; `Err` once the body is gone.
    pub fn is_free(&self) -> Result<bool, Closed> {
        let state = lock(&self.0);
        if state.receiver_gone {
            return Err(Closed);
        }
        Ok(state.item.is_none())
    }

    /// Waits until the body took the previous item.
    pub async fn ready(&self) -> Result<(), Closed> {
        std::future::poll_fn(|cx| self.poll_ready(cx)).await
    }

    fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<Result<(), Closed>> {
        let mut state = lock(&self.0);
        if state.receiver_gone {
            return Poll::Ready(Err(Closed));
        }
        if state.item.is_none() {
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

    /// Puts `item` in the slot, which the caller saw free (this task is its only producer).
    pub fn put(&self, item: Item) {
        let waker = {
            let mut state = lock(&self.0);
            debug_assert!(state.item.is_none(), "put into a full slot");
            state.item = Some(item);
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
    /// The next item; `None` once the sender is gone and the slot is empty.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let (item, waker) = {
            let mut state = lock(&self.0);
            match state.item.take() {
                Some(item) => (item, state.sender.take()),
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
            }
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
            state.item = None;
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

    #[tokio::test]
    async fn one_item_in_flight_then_the_end() {
        let (tx, mut rx) = slot();
        assert_eq!(tx.is_free(), Ok(true));
        assert!(recv(&mut rx).is_pending());
        tx.put(Ok(Bytes::from_static(b"a")));
        assert_eq!(tx.is_free(), Ok(false), "one item in flight");
        let waiting = tokio::spawn(async move {
            tx.send(Ok(Bytes::from_static(b"b"))).await.unwrap();
            // Dropped here: the body ends after what it holds.
        });
        tokio::task::yield_now().await;
        assert!(matches!(recv(&mut rx), Poll::Ready(Some(Ok(b))) if b == "a"));
        waiting.await.unwrap();
        assert!(matches!(recv(&mut rx), Poll::Ready(Some(Ok(b))) if b == "b"));
        assert!(matches!(recv(&mut rx), Poll::Ready(None)));
    }

    #[tokio::test]
    async fn a_gone_body_frees_the_waiting_sender() {
        let (tx, rx) = slot();
        tx.put(Ok(Bytes::from_static(b"a")));
        let waiting = tokio::spawn(async move { tx.ready().await });
        tokio::task::yield_now().await;
        drop(rx);
        assert_eq!(waiting.await.unwrap(), Err(Closed));
    }
}
