//! The protocol core: no tokio, no tonic, no clock reads. Unit tests drive it directly.
//!
//! - [`resource`]: a cached resource, kept as the encoded bytes the upstream sent.
//! - [`names`]: resource names interned process-wide (one allocation per distinct name).
//! - [`store`]: one group's resources per type, and what the upstream said does not exist.
//! - [`interest`]: the refcounted union of downstream interest -> upstream subscribe/unsubscribe.
//! - [`contract`]: what both per-stream state machines implement ([`StreamCore`]) and speak in.
//! - [`delta`]: the per-stream Delta state machine: requests and changes in, responses out
//!   (its per-type records in `delta_record`).
//! - [`sotw`]: the same contract for state-of-the-world.
//! - [`wildcard_state`]: a wildcard SotW subscriber's full state, built once per store change.
//! - [`frame`]: responses encoded once as gRPC messages and shared by every stream due them.
//! - [`subscribers`]: who to tell about a change: per name, a bitmap of the streams' slots.
//! - [`group`]: one aggregation group's store, interest, subscriber index and unsubscribed set.
//! - [`packed`]: per-stream B-trees rebuilt dense after bulk inserts (a join fills them in order).
//! - [`per_type`]: a stream's state per type URL: a short sorted list, interned type URLs.
//! - [`unacked`]: what each unacknowledged response changed in a stream's record, undone on NACK.
//! - [`xdstp`]: `xdstp://` names: parsing, canonical form, glob collections (A28, A29).
//! - [`unsubscribed`]: names no client wants any more, kept fresh within a byte budget (LRU).
//! - [`upstream_session`]: the group's upstream protocol: requests when a stream opens, ACK/NACK
//!   and the change set of each response, requests when the interest changed; reconciliation.
//! - [`sotw_upstream`]: the same over state-of-the-world, for control planes without Delta.

pub mod constraints;
pub mod contract;
pub mod delta;
mod delta_record;
pub mod frame;
pub mod group;
mod holdings;
pub mod interest;
pub mod names;
mod packed;
mod per_type;
pub mod resource;
pub mod sotw;
pub mod sotw_upstream;
pub mod store;
pub mod subscribers;
pub mod unacked;
pub mod unsubscribed;
pub mod upstream_session;
pub mod wildcard_state;
pub mod xdstp;

pub use contract::{
    AckStatus, Protocol, ProtocolError, RequestEffects, StreamCore, TypeView, XdsRequest,
};
pub use delta::DeltaStream;
pub use frame::{Frame, FrameCache, Outgoing};
pub use group::{Applied, CacheStats, GroupState, GroupStats, StreamId, UnsubscribedStats};
pub use interest::{Interest, UpstreamChange, WILDCARD};
pub use resource::{CachedResource, Locator, Name};
pub use sotw::SotwStream;
pub use store::{ApplyError, ChangeSet, Lookup, Store, UpstreamUpdate};
pub use subscribers::{Affected, Slot, SlotAllocator};
pub use upstream_session::{ResponseOutcome, UpstreamSession, Verdict};
