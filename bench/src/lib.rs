//! adsrelay-bench: the `loadgen` load generator. Simulated Delta xDS clients (Envoy-like: one
//! connection each, wildcard Clusters and Listeners, named ClusterLoadAssignments, ACK every
//! response), an in-process synthetic control plane (`adsrelay::demo::ControlPlane`), the relay
//! under test as a child process, and a raw HTTP/2 floor, with per-update fan-out latency and the
//! relay's CPU and RSS from /proc. See bench/README.md.
//!
//! - [`workload`]: the synthetic resources, names, versions and update patterns.
//! - [`client`]: what a client holds and the Delta session ([`client::Protocol`] picks the variant).
//! - [`floor`]: the raw HTTP/2 push server and its client.
//! - [`measure`]: the update in flight, per-phase counters, latency distributions.
//! - [`phase`]: one target end to end (upstream, relay, clients, updates, figures).
//! - [`relay_proc`], [`procfs`]: the relay child process, /proc sampling, the open-file limit.
//! - [`report`], [`plot`], [`progress`]: JSON result and summary, the SVG, progress output.

pub mod cli;
pub mod client;
pub mod floor;
pub mod measure;
pub mod phase;
pub mod plot;
pub mod procfs;
pub mod progress;
pub mod relay_proc;
pub mod report;
pub mod sync;
pub mod workload;
