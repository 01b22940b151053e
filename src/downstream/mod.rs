//! Downstream adapters: one task per client stream driving the protocol core, the reader of its
//! requests, the bounded change mailboxes that feed them, and the slot that hands responses to
//! the HTTP/2 body.

pub mod limits;
pub mod mailbox;
pub mod requests;
pub mod services;
pub mod slot;
pub mod stream;

pub use mailbox::Mailbox;
pub use stream::{serve, AckTimes, ClientEntry, Introspect, Responses, StreamEvent, StreamHost};
