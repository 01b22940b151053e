//! adsrelay: a caching xDS relay.
//!
//! # Layout
//! - [`xds`]: the protocol core, free of I/O (store, interest, per-stream Delta state machine).
//! - [`pb`]: generated protobuf types (proto/ is the wire contract).
#![forbid(unsafe_code)]

pub mod pb;
pub mod xds;
