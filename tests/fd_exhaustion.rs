//! Running out of file descriptors (issue 13): the relay binary under a low descriptor limit
//! (`ulimit -n`), with more connections than it can hold, keeps updating its connected clients,
//! keeps answering /healthz and /metrics (the descriptor reserve), counts what it refused or
//! failed to accept, does not spin, and accepts again once clients leave.

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::*;
use tokio::net::TcpStream;

/// The relay binary, run through `sh -c 'ulimit -n N; exec ...'` (soft = hard = N).
struct Relay {
    child: tokio::process::Child,
    xds: SocketAddr,
    admin: SocketAddr,
    log: PathBuf,
}

/// GET over HTTP/1.1; (0, "") when the connection fails.
async fn try_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

impl Relay {
    async fn start(nofile: u64, upstream: SocketAddr, extra: &[&str], test: &str) -> Relay {
        let (xds, admin) = (free_port(), free_port());
        let log =
            std::env::temp_dir().join(format!("adsrelay-fd-{}-{test}.log", std::process::id()));
        let file = std::fs::File::create(&log).unwrap();
        let mut args: Vec<String> = vec![
            "-c".into(),
            format!("ulimit -n {nofile} && exec \"$0\" \"$@\""),
            env!("CARGO_BIN_EXE_adsrelay").into(),
            "--upstream".into(),
            format!("http://{upstream}"),
            "--listen".into(),
            xds.to_string(),
            "--admin".into(),
            admin.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = tokio::process::Command::new("sh")
            .args(&args)
            .env("RUST_LOG", "info")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the relay");
        let relay = Relay {
            child,
            xds,
            admin,
            log,
        };
        let deadline = Instant::now() + TIMEOUT;
        while tokio::time::timeout(Duration::from_secs(1), try_get(admin, "/healthz"))
            .await
            .map(|(s, _)| s)
            .unwrap_or(0)
            != 200
        {
            assert!(
                Instant::now() < deadline,
                "relay did not start: {}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        relay
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// (status, body) of an admin GET, 0 if it does not answer within 2 s.
    async fn get(&self, path: &str) -> (u16, String) {
        tokio::time::timeout(Duration::from_secs(2), try_get(self.admin, path))
            .await
            .unwrap_or((0, String::new()))
    }

    async fn metric(&self, series: &str) -> Option<f64> {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// CPU seconds the relay process used so far, read by the test from /proc.
    fn cpu_seconds(&self) -> f64 {
        let pid = self.child.id().expect("running");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let rest = &stat[stat.rfind(')').unwrap() + 1..];
        let f: Vec<u64> = rest
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|x| x.parse().unwrap())
            .collect();
        (f[0] + f[1]) as f64 / 100.0
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

/// `n` Delta clients subscribed to c1, each holding it at `version`.
async fn clients(relay: &Relay, n: usize, version: &str) -> Vec<DeltaClient> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut c = DeltaClient::connect(
            relay.xds,
            node(&format!("envoy-{i}"), "g"),
            subscribe(CDS, &["c1"]),
        )
        .await;
        assert_eq!(
            names(&c.recv_ack().await),
            vec![("c1".to_string(), version.to_string())]
        );
        out.push(c);
    }
    out
}

/// Connections that never speak: each costs the relay a descriptor once accepted.
async fn flood(relay: &Relay, n: usize) -> Vec<TcpStream> {
    let mut out = Vec::new();
    for _ in 0..n {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(relay.xds)).await
        {
            out.push(s);
        }
    }
    out
}

async fn update_reaches(upstream: &Upstream, clients: &mut [DeltaClient], version: &str) {
    upstream
        .cp
        .set_resources(vec![resource(CDS, "c1", version)]);
    for c in clients.iter_mut() {
        assert_eq!(
            names(&c.recv_ack().await),
            vec![("c1".to_string(), version.to_string())]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_descriptor_reserve_sheds_new_clients_and_keeps_the_relay_serving() {
    let upstream = Upstream::start(vec![resource(CDS, "c1", "1")]).await;
    let relay = Relay::start(128, upstream.addr, &["--fd-reserve", "48"], "reserve").await;
    let mut connected = clients(&relay, 5, "1").await;
    let flood = flood(&relay, 150).await;
    // The relay holds what its limit allows beside the reserve, and closes the rest at once.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let rejected = relay
            .metric("adsrelay_downstream_connections_rejected_total")
            .await;
        if rejected.is_some_and(|r| r >= 50.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rejected: {rejected:?}\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The admin port works: the reserve kept descriptors for it.
    assert_eq!(relay.get("/healthz").await.0, 200);
    let open = relay
        .metric("process_open_fds")
        .await
        .expect("process_open_fds");
    let max = relay
        .metric("process_max_fds")
        .await
        .expect("process_max_fds");
    assert_eq!(max, 128.0);
    assert!(open < max, "{open} of {max}");
    // Connected clients keep receiving updates.
    update_reaches(&upstream, &mut connected, "2").await;

    // Clients leave: new ones are accepted again.
    drop(flood);
    let deadline = Instant::now() + TIMEOUT;
    while relay.metric("adsrelay_downstream_connections").await != Some(5.0) {
        assert!(Instant::now() < deadline, "flood connections still open");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut late = clients(&relay, 1, "2").await;
    update_reaches(&upstream, &mut late, "3").await;
    drop(connected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_the_relay_pauses_accepting_and_recovers() {
    let upstream = Upstream::start(vec![resource(CDS, "c1", "1")]).await;
    // No reserve: the xDS listener itself runs out (EMFILE).
    let relay = Relay::start(64, upstream.addr, &["--fd-reserve", "0"], "emfile").await;
    let mut connected = clients(&relay, 3, "1").await;
    let flood = flood(&relay, 100).await;
    // Out of descriptors, accept fails; the relay must pause, not spin (it spun at 65-135 %).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cpu = relay.cpu_seconds();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = relay.cpu_seconds() - cpu;
    eprintln!("CPU while out of descriptors: {spent} s in 2 s");
    assert!(
        spent < 0.25,
        "{spent} CPU seconds in 2 s while out of descriptors"
    );
    // Existing streams keep working.
    update_reaches(&upstream, &mut connected, "2").await;

    drop(flood);
    // Once descriptors free up, the admin port and the xDS port accept again.
    let deadline = Instant::now() + TIMEOUT;
    let errors = loop {
        let e = relay
            .metric("adsrelay_accept_errors_total{listener=\"xds\",reason=\"emfile\"}")
            .await;
        if let Some(e) = e.filter(|e| *e > 0.0) {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "no emfile counted: {e:?}\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(errors >= 1.0);
    let mut late = clients(&relay, 1, "2").await;
    update_reaches(&upstream, &mut late, "3").await;
    // Logged, but at most about once a second (and once per pause).
    let log = relay.log();
    let lines = log.matches("accept failed").count();
    assert!(
        (1..=20).contains(&lines),
        "{lines} accept-failure lines:\n{log}"
    );
    assert!(log.contains("file descriptor limit"), "{log}");
    drop(connected);
}
