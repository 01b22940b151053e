//! adsrelay-bench: the `loadgen` load generator. Simulated Delta xDS clients (Envoy-like: one
//! connection each, wildcard Clusters and Listeners, named ClusterLoadAssignments, ACK every
//! response), an in-process synthetic control plane (`adsrelay::demo::ControlPlane`) upstream of
//! the relay under test (a child process), and the baselines it is compared with (`plain`,
//! `floor`, `demo`, each a child process), with per-update fan-out latency and each server's CPU
//! and RSS from /proc. See bench/README.md.
//!
//! - [`workload`]: the synthetic resources, names, versions and update patterns.
//! - [`client`]: what a client holds and the Delta session ([`client::Protocol`] picks the variant).
//! - [`plain`]: the minimal tonic control plane a user would write (the fair baseline).
//! - [`floor`]: pre-framed shared bytes through the same tonic/hyper/h2 stack, no xDS logic.
//! - [`server_proc`]: runs `plain`, `floor` and `demo` in a child process (`loadgen --serve`).
//! - [`measure`]: the update in flight, per-phase counters, latency distributions.
//! - [`phase`]: one target end to end (upstream, relay, clients, updates, figures).
//! - [`relay_proc`], [`procfs`]: the relay child process, /proc sampling, the open-file limit.
//! - [`report`], [`plot`], [`progress`]: JSON result and summary, the SVG, progress output.

pub mod cli;
pub mod client;
pub mod floor;
pub mod measure;
pub mod phase;
pub mod plain;
pub mod plot;
pub mod procfs;
pub mod progress;
pub mod relay_proc;
pub mod report;
pub mod server_proc;
pub mod sync;
pub mod workload;
