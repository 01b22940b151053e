//! A real go-control-plane (v0.14.0) management server as the relay's upstream:
//! tests/interop/go-control-plane, built into target/interop/gcp-server by
//! scripts/setup-go-interop.sh. ADS and the per-type xDS services, SotW and Delta, over a MuxCache
//! (EDS in a LinearCache, everything else in an ADS SnapshotCache keyed by the node id).
//! [`ControlPlaneProcess::start_with_args`] passes extra flags: `--sotw-only` (only the
//! state-of-the-world methods; a Delta call gets UNIMPLEMENTED), `--classify-only` (the MuxCache
//! without `ClassifyDelta`: a Delta request crashes the process) and `--snapshot-ads=false` (the
//! SnapshotCache's ads flag, true by default).
//!
//! The state is a JSON value `{"version": "v1", "resources": [protojson Any, ...]}` (build it with
//! [`state`] and the resource helpers below). The server's callbacks come back as JSON events
//! ([`GoControlPlane::events`]): `listening`, `stream_open`, `stream_closed`, `request`,
//! `response`, `applied`, `error`. Events accumulate across [`GoControlPlane::restart`]s; each
//! process's events begin with its `listening` event (stream ids restart at 1 in each process).
//!
//! The process and event plumbing ([`ControlPlaneProcess`]) is generic over the server
//! ([`ServerKind`]): tests/support/jcp.rs runs java-control-plane through the same protocol, with
//! the same state and resource helpers.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::Notify;

pub const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE_TYPE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT_TYPE: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// How long to wait for the server to start or to apply a state.
const WAIT: Duration = Duration::from_secs(15);

/// target/interop/gcp-server, or a panic saying how to build it.
pub fn server_binary() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/interop/gcp-server");
    assert!(
        path.exists(),
        "{} not found: these tests need the go-control-plane test server. Build it with \
         scripts/setup-go-interop.sh (needs Go >= 1.26 and the Go module proxy).",
        path.display()
    );
    path
}

/// A control-plane server that speaks the test protocol: flags `--listen ADDR --node-id ID
/// --state FILE`; stdin commands `set FILE` and `quit`; JSON events on stdout, one a line.
pub trait ServerKind {
    /// The server's name in messages ("go-control-plane").
    const NAME: &'static str;
    /// The prefix of its scratch directory's name.
    const DIR_PREFIX: &'static str;
    /// The command that runs it, before the protocol's flags; panics saying how to build it if it
    /// is missing.
    fn command() -> Command;
}

/// go-control-plane: target/interop/gcp-server.
pub struct Go;

impl ServerKind for Go {
    const NAME: &'static str = "go-control-plane";
    const DIR_PREFIX: &'static str = "adsrelay-gcp-";
    fn command() -> Command {
        Command::new(server_binary())
    }
}

pub type GoControlPlane = ControlPlaneProcess<Go>;

#[derive(Default)]
struct Events {
    lines: Mutex<Vec<Value>>,
    changed: Notify,
}

/// A control-plane server process of kind `K`, restartable on the same port.
pub struct ControlPlaneProcess<K: ServerKind> {
    pub addr: SocketAddr,
    node_id: String,
    dir: PathBuf,
    state_path: PathBuf,
    sets: u32,
    /// Flags after the protocol's, on every start and restart.
    extra_args: Vec<String>,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    events: Arc<Events>,
    kind: PhantomData<K>,
}

impl<K: ServerKind> ControlPlaneProcess<K> {
    /// Starts the server (for go-control-plane target/interop/gcp-server; panics with a clear
    /// message naming its setup script if missing) on a free port, node id `node_id`, with `state`.
    pub async fn start(node_id: &str, state: &Value) -> Self {
        Self::start_with_args(node_id, state, &[]).await
    }

    /// [`ControlPlaneProcess::start`] with `args` after the protocol's flags (kept for restarts),
    /// e.g. `&["--sotw-only"]` for go-control-plane.
    pub async fn start_with_args(node_id: &str, state: &Value, args: &[&str]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(K::DIR_PREFIX)
            .tempdir()
            .unwrap()
            .keep();
        let state_path = dir.join("state-0.json");
        std::fs::write(&state_path, state.to_string()).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut cp = ControlPlaneProcess {
            addr: ([127, 0, 0, 1], port).into(),
            node_id: node_id.to_string(),
            dir,
            state_path,
            sets: 0,
            extra_args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
            stdin: None,
            events: Arc::default(),
            kind: PhantomData,
        };
        cp.spawn().await;
        cp
    }

    /// Replaces the state (the `set` command) and waits for "applied". While stopped, only
    /// records it for the next [`ControlPlaneProcess::restart`].
    pub async fn set(&mut self, state: &Value) {
        self.sets += 1;
        let path = self.dir.join(format!("state-{}.json", self.sets));
        std::fs::write(&path, state.to_string()).unwrap();
        let seen = self.events.lines.lock().unwrap().len();
        let Some(stdin) = self.stdin.as_mut() else {
            self.state_path = path;
            return;
        };
        stdin
            .write_all(format!("set {}\n", path.display()).as_bytes())
            .await
            .unwrap_or_else(|e| panic!("write to {}'s stdin: {e}", K::NAME));
        stdin.flush().await.unwrap();
        let outcome = self
            .wait_event(seen, |e| e["event"] == "applied" || e["event"] == "error")
            .await;
        assert_eq!(
            outcome["event"],
            "applied",
            "{} rejected the state: {outcome}",
            K::NAME
        );
        self.state_path = path;
    }

    /// Every event line so far, parsed.
    pub fn events(&self) -> Vec<Value> {
        self.events.lines.lock().unwrap().clone()
    }

    /// Kills the process (as a crash would).
    pub async fn stop(&mut self) {
        self.stdin = None;
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Starts a fresh process on the same port with the last state.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.spawn().await;
    }

    /// Writes every event so far to `path`, one JSON object a line (for a look at a run).
    pub fn dump_events(&self, path: &std::path::Path) {
        let lines: Vec<String> = self.events().iter().map(Value::to_string).collect();
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    }

    /// The server's stderr (its warnings and errors), for diagnostics.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    /// Spawns the server on `self.addr` with `self.state_path`, retrying while the port is still
    /// held by a previous process, and waits for its `listening` event.
    async fn spawn(&mut self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen = self.events.lines.lock().unwrap().len();
            let stderr = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join("stderr.log"))
                .unwrap();
            let mut child = K::command()
                .arg("--listen")
                .arg(self.addr.to_string())
                .arg("--node-id")
                .arg(&self.node_id)
                .arg("--state")
                .arg(&self.state_path)
                .args(&self.extra_args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(stderr)
                .kill_on_drop(true)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", K::NAME));
            let stdout = child.stdout.take().unwrap();
            let events = self.events.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let value = serde_json::from_str(&line)
                        .unwrap_or_else(|_| json!({"event": "unparsed", "line": line}));
                    events.lines.lock().unwrap().push(value);
                    events.changed.notify_waiters();
                }
                events.changed.notify_waiters();
            });
            let listening = tokio::time::timeout(
                WAIT,
                self.wait_event_or_exit(&mut child, seen, |e| e["event"] == "listening"),
            )
            .await;
            match listening {
                Ok(true) => {
                    self.stdin = child.stdin.take();
                    self.child = Some(child);
                    return;
                }
                Ok(false) if tokio::time::Instant::now() < deadline => {
                    // Exited (e.g. the port is not free yet): try again shortly.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => panic!(
                    "{} did not start on {}:\n{}",
                    K::NAME,
                    self.addr,
                    self.stderr()
                ),
            }
        }
    }

    /// True once an event after index `seen` matches `want`; false if the process exits first.
    async fn wait_event_or_exit(
        &self,
        child: &mut Child,
        seen: usize,
        want: impl Fn(&Value) -> bool,
    ) -> bool {
        loop {
            let notified = self.events.changed.notified();
            if self.events.lines.lock().unwrap()[seen..].iter().any(&want) {
                return true;
            }
            if !matches!(child.try_wait(), Ok(None)) {
                return false;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }

    /// The first event after index `seen` matching `want`; panics after [`WAIT`].
    async fn wait_event(&self, seen: usize, want: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let notified = self.events.changed.notified();
            if let Some(e) = self.events.lines.lock().unwrap()[seen..]
                .iter()
                .find(|e| want(e))
            {
                return e.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no expected event from {}:\n{}",
                K::NAME,
                self.stderr()
            );
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }
}

impl<K: ServerKind> Drop for ControlPlaneProcess<K> {
    /// The process dies with the test (kill_on_drop); a passing test's scratch files go.
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        if std::thread::panicking() {
            let events: Vec<String> = self.events().iter().map(Value::to_string).collect();
            let events = events.join("\n");
            let _ = std::fs::write(self.dir.join("events.jsonl"), &events);
            eprintln!(
                "{}'s events and stderr are in {}",
                K::NAME,
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A state for [`ControlPlaneProcess::start`] / [`ControlPlaneProcess::set`].
pub fn state(version: &str, resources: Vec<Value>) -> Value {
    json!({ "version": version, "resources": resources })
}

/// An EDS Cluster whose endpoints come over ADS.
pub fn cluster(name: &str) -> Value {
    json!({
        "@type": CLUSTER_TYPE,
        "name": name,
        "type": "EDS",
        "connect_timeout": "1s",
        "eds_cluster_config": { "eds_config": { "ads": {}, "resource_api_version": "V3" } },
    })
}

/// A ClusterLoadAssignment for `cluster` with one endpoint per port on 127.0.0.1.
pub fn load_assignment(cluster: &str, ports: &[u16]) -> Value {
    let endpoints: Vec<Value> = ports
        .iter()
        .map(|p| {
            json!({ "endpoint": { "address": {
                "socket_address": { "address": "127.0.0.1", "port_value": p }
            } } })
        })
        .collect();
    json!({
        "@type": ENDPOINT_TYPE,
        "cluster_name": cluster,
        "endpoints": [{ "lb_endpoints": endpoints }],
    })
}

/// A Listener on 127.0.0.1:`port` with an HTTP connection manager whose routes come from
/// RouteConfiguration `route_config` over ADS.
pub fn listener(name: &str, port: u16, route_config: &str) -> Value {
    json!({
        "@type": LISTENER_TYPE,
        "name": name,
        "address": { "socket_address": { "address": "127.0.0.1", "port_value": port } },
        "filter_chains": [{ "filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "rds": {
                    "route_config_name": route_config,
                    "config_source": { "ads": {}, "resource_api_version": "V3" },
                },
                "http_filters": [{
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    },
                }],
            },
        }] }],
    })
}

/// A RouteConfiguration with one virtual host for every domain, routing each `(prefix, cluster)`
/// in order.
pub fn route_config(name: &str, routes: &[(&str, &str)]) -> Value {
    let routes: Vec<Value> = routes
        .iter()
        .map(|(prefix, cluster)| {
            json!({ "match": { "prefix": prefix }, "route": { "cluster": cluster } })
        })
        .collect();
    json!({
        "@type": ROUTE_TYPE,
        "name": name,
        "virtual_hosts": [{ "name": "all", "domains": ["*"], "routes": routes }],
    })
}

/// The `request` events for `type_url` (all processes so far).
pub fn requests<'a>(events: &'a [Value], type_url: &'a str) -> impl Iterator<Item = &'a Value> {
    events
        .iter()
        .filter(move |e| e["event"] == "request" && e["type"] == type_url)
}
