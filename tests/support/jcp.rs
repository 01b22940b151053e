//! A real java-control-plane (1.0.49) management server as the relay's upstream:
//! tests/interop/java-control-plane, built into target/interop/jcp-server.jar by
//! scripts/setup-java-interop.sh. ADS and the per-type xDS services, SotW and Delta
//! (`V3DiscoveryServer`), over one `SimpleCache` keyed by the node id (a `NodeGroup` returning
//! `node.getId()`), whose `Snapshot` holds Clusters, ClusterLoadAssignments, Listeners and
//! RouteConfigurations at the state's version.
//!
//! The same protocol as go-control-plane's server (tests/support/gcp.rs, whose process plumbing
//! [`ControlPlaneProcess`] this reuses): the state is a JSON value built with
//! [`super::gcp::state`] and the resource helpers there; the `DiscoveryServerCallbacks` come back as
//! the same JSON events (`listening`, `stream_open`, `stream_closed`, `request`, `response`,
//! `applied`, `error`). Differences in the events: stream ids start at 0 in each process;
//! `node_id`/`node_cluster` are the stream's node (sent on its first request) on every request;
//! `stream_closed` carries `error` (empty for a clean close).

use std::path::PathBuf;

use tokio::process::Command;

use super::gcp::{ControlPlaneProcess, ServerKind};

/// target/interop/jcp-server.jar, or a panic saying how to build it.
pub fn server_jar() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/interop/jcp-server.jar");
    assert!(
        path.exists(),
        "{} not found: these tests need the java-control-plane test server. Build it with \
         scripts/setup-java-interop.sh (needs Java 17, Maven 3.8 and Maven Central).",
        path.display()
    );
    path
}

/// java-control-plane: `java -jar target/interop/jcp-server.jar`.
pub struct Java;

impl ServerKind for Java {
    const NAME: &'static str = "java-control-plane";
    const DIR_PREFIX: &'static str = "adsrelay-jcp-";
    fn command() -> Command {
        let mut java = Command::new("java");
        // A small test server on a 2-core machine: start fast, stay small.
        java.args([
            "-XX:TieredStopAtLevel=1",
            "-XX:+UseSerialGC",
            "-Xmx256m",
            "-jar",
        ])
        .arg(server_jar());
        java
    }
}

/// java-control-plane as a restartable process: the same API as
/// [`super::gcp::GoControlPlane`] (`start(node_id, state)`, `set`, `events`, `stop`, `restart`).
pub type JavaControlPlane = ControlPlaneProcess<Java>;
