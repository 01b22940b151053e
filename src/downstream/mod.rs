//! Downstream adapters: one task per client stream driving the protocol core, the reader of its
//! requests, and the bounded change mailboxes that feed them.

pub mod limits;
pub mod mailbox;
pub mod requests;
pub mod services;
pub mod stream;

pub use mailbox::Mailbox;
pub use stream::{serve, AckTimes, ClientEntry, Introspect, Responses, StreamEvent, StreamHost};
