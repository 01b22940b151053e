//! Downstream adapters: tonic services and one task per client stream, driving the protocol core.

pub mod delta;
pub mod mailbox;

pub use delta::DeltaHost;
pub use mailbox::Mailbox;
