//! Checks of deploy/ (issue 8):
//! - `scripts/check-deploy.sh` passes: kustomize renders every overlay, the manifests validate
//!   against the Kubernetes schemas, hadolint passes on the Dockerfile, promtool checks and tests
//!   the alerting rules (it installs its tools on first use);
//! - `scripts/check-helm.sh` passes: the Helm chart deploy/helm/adsrelay lints and renders with the
//!   default and every region's values, validates against the Kubernetes schemas, and renders the
//!   same objects as the kustomize base and each overlay (it builds its pinned helm on first use);
//! - every `adsrelay_*` metric the Grafana dashboard and the alerting rules name is exported by a
//!   live relay's /metrics (a relay started in-process, with clients connected so the labelled
//!   series exist);
//! - every relay.toml the manifests ship is accepted by the relay's own config parser, and listens
//!   on the ports the Dockerfile exposes and the Deployment probes.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// scripts/check-deploy.sh and scripts/check-helm.sh install tools into the same .venv on first
/// use (pip is not safe to run twice at once there), and both are CPU-bound: one at a time.
static DEPLOY_SCRIPTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn check_deploy_script_passes() {
    let _one_at_a_time = DEPLOY_SCRIPTS.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new("bash")
        .arg(root().join("scripts/check-deploy.sh"))
        .current_dir(root())
        .output()
        .expect("run scripts/check-deploy.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "scripts/check-deploy.sh failed ({}).\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("check-deploy: all deploy checks passed"),
        "scripts/check-deploy.sh did not finish its checks.\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
}

#[test]
fn helm_chart_lints_renders_validates_and_matches_kustomize() {
    let _one_at_a_time = DEPLOY_SCRIPTS.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new("bash")
        .arg(root().join("scripts/check-helm.sh"))
        .current_dir(root())
        .output()
        .expect("run scripts/check-helm.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "scripts/check-helm.sh failed ({}).\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("check-helm: all helm checks passed"),
        "scripts/check-helm.sh did not finish its checks.\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
}

/// Every `adsrelay_*` identifier in `text` (PromQL, or a whole file of it).
fn metric_names(text: &str) -> BTreeSet<String> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = BTreeSet::new();
    let mut rest = text;
    let mut offset = 0;
    while let Some(i) = rest.find("adsrelay_") {
        let start = offset + i;
        let before_ok = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !is_ident(c));
        let len = text[start..]
            .find(|c: char| !is_ident(c))
            .unwrap_or(text.len() - start);
        // A bare `adsrelay_` (prose such as "every adsrelay_* name") is not a metric.
        if before_ok && len > "adsrelay_".len() {
            out.insert(text[start..start + len].to_string());
        }
        offset = start + len;
        rest = &text[offset..];
    }
    out
}

/// Metric families in a Prometheus text exposition: name -> type.
fn exported(exposition: &str) -> HashMap<String, String> {
    let mut families = HashMap::new();
    for line in exposition.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let mut parts = t.split_whitespace();
            if let (Some(n), Some(ty)) = (parts.next(), parts.next()) {
                families.insert(n.to_string(), ty.to_string());
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let n = line.split(['{', ' ']).next().unwrap_or_default();
            families
                .entry(n.to_string())
                .or_insert_with(|| "untyped".into());
        }
    }
    families
}

/// The names in `referenced` that `families` does not export (histogram/summary series
/// `_bucket`, `_sum`, `_count` resolve to their family).
fn missing(referenced: &BTreeSet<String>, families: &HashMap<String, String>) -> Vec<String> {
    referenced
        .iter()
        .filter(|n| {
            if families.contains_key(n.as_str()) {
                return false;
            }
            !["_bucket", "_sum", "_count"].iter().any(|s| {
                n.strip_suffix(s).is_some_and(|base| {
                    matches!(
                        families.get(base).map(String::as_str),
                        Some("histogram" | "summary")
                    )
                })
            })
        })
        .cloned()
        .collect()
}

#[test]
fn metric_name_extraction() {
    let q = r#"histogram_quantile(0.99, sum by (le) (rate(adsrelay_fanout_latency_seconds_bucket{region=~"$region"}[5m]))) / xadsrelay_not "adsrelay_build_info" adsrelay_*"#;
    let names: Vec<_> = metric_names(q).into_iter().collect();
    assert_eq!(
        names,
        vec![
            "adsrelay_build_info",
            "adsrelay_fanout_latency_seconds_bucket"
        ]
    );
    let fams = exported(
        "# TYPE adsrelay_fanout_latency_seconds histogram\nadsrelay_fanout_latency_seconds_bucket{le=\"1\"} 0\n",
    );
    assert!(missing(&metric_names(q), &fams) == vec!["adsrelay_build_info".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alerts_use_only_exported_metrics() {
    let up = Upstream::start(vec![
        resource(CDS, "c1", "1"),
        resource(CDS, "c2", "1"),
        resource(EDS, "e1", "1"),
    ])
    .await;
    let relay = RelayUnderTest::start(up.addr, Duration::from_secs(30)).await;

    // Two clients of one group: wildcard clusters and a named endpoint assignment, both ACKed,
    // then an update fanned out to both, so per-type, per-group and histogram series exist.
    let mut a =
        DeltaClient::connect(relay.xds, node("deploy-a", "deploy"), subscribe(CDS, &[])).await;
    a.recv_ack().await;
    a.send(subscribe(EDS, &["e1"])).await;
    a.recv_ack().await;
    let mut b =
        DeltaClient::connect(relay.xds, node("deploy-b", "deploy"), subscribe(CDS, &[])).await;
    b.recv_ack().await;
    up.cp.set_resources(vec![
        resource(CDS, "c1", "2"),
        resource(CDS, "c2", "1"),
        resource(EDS, "e1", "1"),
    ]);
    a.recv_ack().await;
    b.recv_ack().await;

    let (status, response) = relay.admin_get("/metrics").await;
    assert_eq!(status, 200, "{response}");
    let text = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .unwrap_or(&response);
    let families = exported(text);
    assert!(
        families.contains_key("adsrelay_upstream_connected"),
        "no per-group series in /metrics:\n{text}"
    );

    for file in [
        "deploy/grafana/adsrelay-dashboard.json",
        "deploy/prometheus/alerts.yaml",
    ] {
        let referenced = metric_names(&read(file));
        assert!(!referenced.is_empty(), "{file} names no adsrelay_ metric");
        let unknown = missing(&referenced, &families);
        assert!(
            unknown.is_empty(),
            "{file} uses metrics the relay does not export: {unknown:?}\n\
             exported: {:?}\n--- /metrics ---\n{text}",
            families.keys().collect::<BTreeSet<_>>()
        );
        // Also named in the relay's own list (src/metrics.rs), for a clearer hint.
        let described: BTreeSet<&str> = adsrelay::metrics::DESCRIPTIONS
            .iter()
            .map(|(n, _)| *n)
            .collect();
        for n in &referenced {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s).filter(|b| described.contains(b)))
                .unwrap_or(n);
            assert!(
                described.contains(base),
                "{file}: {n} is not in src/metrics.rs DESCRIPTIONS"
            );
        }
    }

    // The dashboard shows what issue 8 asks for.
    let dashboard = metric_names(&read("deploy/grafana/adsrelay-dashboard.json"));
    for want in [
        "adsrelay_downstream_streams",
        "adsrelay_downstream_subscriptions",
        "adsrelay_upstream_connected",
        "adsrelay_upstream_reconnects_total",
        "adsrelay_downstream_responses_total",
        "adsrelay_downstream_sent_bytes_total",
        "adsrelay_downstream_nacks_total",
        "adsrelay_fanout_latency_seconds_bucket",
        "adsrelay_cache_resources",
        "adsrelay_cache_bytes",
        "adsrelay_upstream_last_response_age_seconds",
        // Issue 14: cache budget, TLS, snapshots, accept errors.
        "adsrelay_unsubscribed_cache_bytes",
        "adsrelay_unsubscribed_cache_budget_bytes",
        "adsrelay_tls_handshake_failures_total",
        "adsrelay_tls_certificate_reloads_total",
        "adsrelay_snapshot_writes_total",
        "adsrelay_snapshot_write_failures_total",
        "adsrelay_accept_errors_total",
        "adsrelay_drift_repairs_total",
    ] {
        assert!(dashboard.contains(want), "dashboard does not show {want}");
    }
    // Issue 14: the alerts cover drift, rejections, TLS reloads, snapshot writes, accept errors,
    // and the flapping alert discounts periodic resyncs.
    let alerts = read("deploy/prometheus/alerts.yaml");
    for want in [
        "adsrelay_drift_repairs_total",
        "adsrelay_upstream_resyncs_total",
        "adsrelay_downstream_connections_rejected_total",
        "adsrelay_downstream_streams_rejected_total",
        "adsrelay_tls_certificate_reloads_total",
        "adsrelay_snapshot_write_failures_total",
        "adsrelay_accept_errors_total",
    ] {
        assert!(
            metric_names(&alerts).contains(want),
            "alerts.yaml does not alert on {want}"
        );
    }
}

/// relay.toml files shipped in the manifests (base and each overlay).
fn shipped_configs() -> Vec<PathBuf> {
    let mut out = vec![root().join("deploy/k8s/base/relay.toml")];
    let overlays = root().join("deploy/k8s/overlays");
    let mut dirs: Vec<_> = std::fs::read_dir(&overlays)
        .unwrap_or_else(|e| panic!("{}: {e}", overlays.display()))
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    for d in dirs {
        let p = d.join("relay.toml");
        assert!(p.exists(), "overlay {} has no relay.toml", d.display());
        out.push(p);
    }
    assert!(out.len() >= 3, "expected at least two region overlays");
    out
}

fn load(path: &Path) -> adsrelay::config::Config {
    adsrelay::config::Settings {
        config: Some(path.to_path_buf()),
        ..Default::default()
    }
    .into_config()
    .unwrap_or_else(|e| panic!("{}: rejected by the relay: {e}", path.display()))
}

#[test]
fn shipped_configs_parse_and_match_the_image_ports() {
    let dockerfile = read("deploy/Dockerfile");
    let expose = dockerfile
        .lines()
        .find(|l| l.starts_with("EXPOSE "))
        .expect("EXPOSE in deploy/Dockerfile");
    let deployment = read("deploy/k8s/base/deployment.yaml");
    let mut upstreams = BTreeSet::new();
    for path in shipped_configs() {
        let cfg = load(&path);
        for (what, addr) in [("listen", cfg.listen), ("admin", cfg.admin)] {
            assert!(
                addr.ip().is_unspecified(),
                "{}: {what} {addr} must bind all interfaces in a pod",
                path.display()
            );
            let port = addr.port().to_string();
            assert!(
                expose.split_whitespace().any(|p| p == port),
                "{}: {what} port {port} not in the Dockerfile's `{expose}`",
                path.display()
            );
            assert!(
                deployment.contains(&format!("containerPort: {port}")),
                "{}: {what} port {port} is not a containerPort in deployment.yaml",
                path.display()
            );
        }
        upstreams.insert(cfg.upstream.to_string());
        assert!(
            cfg.limits.max_connection_age.is_some(),
            "{}: set max_connection_age so clients rebalance over the replicas the HPA adds",
            path.display()
        );
    }
    assert!(
        upstreams.len() >= 3,
        "each region overlay should point at its own control plane: {upstreams:?}"
    );
}

/// A .dockerignore rule: `!` re-includes; the pattern is matched per path segment (`*` within a
/// segment), and a pattern that matches a directory covers everything under it, as Docker does.
struct IgnoreRule {
    include: bool,
    segments: Vec<String>,
}

fn dockerignore_rules(text: &str) -> Vec<IgnoreRule> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (include, pattern) = match l.strip_prefix('!') {
                Some(p) => (true, p),
                None => (false, l),
            };
            assert!(
                !pattern.contains("**") && !pattern.contains(['?', '[', '\\']),
                "deploy/Dockerfile.dockerignore: {l:?} uses syntax this check does not model; \
                 extend image_build_context_is_complete"
            );
            let segments = pattern
                .trim_matches('/')
                .split('/')
                .map(str::to_string)
                .collect();
            IgnoreRule { include, segments }
        })
        .collect()
}

fn segment_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            name.starts_with(head)
                && (head.len()..=name.len())
                    .any(|i| segment_matches(tail, &name[i..]) && name.is_char_boundary(i))
        }
    }
}

/// Whether Docker leaves `rel` (a file path relative to the context) out of the build context:
/// the last rule matching the path or one of its parent directories decides.
fn docker_ignores(rules: &[IgnoreRule], rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    let mut ignored = false;
    for r in rules {
        let hit = r.segments.len() <= parts.len()
            && r.segments
                .iter()
                .zip(&parts)
                .all(|(p, n)| segment_matches(p, n));
        if hit {
            ignored = !r.include;
        }
    }
    ignored
}

/// Files under `path` (a file or directory), as paths relative to the repository root.
fn files_under(path: &str) -> Vec<String> {
    let full = root().join(path);
    if !full.is_dir() {
        return if full.exists() {
            vec![path.to_string()]
        } else {
            vec![]
        };
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&full).unwrap_or_else(|e| panic!("{path}: {e}")) {
        let name = entry.unwrap().file_name().into_string().unwrap();
        out.extend(files_under(&format!("{path}/{name}")));
    }
    out
}

#[test]
fn dockerignore_model_matches_docker_semantics() {
    let rules = dockerignore_rules("*\n!src/\n!bench/Cargo.toml\nsrc/gen*.rs\n");
    assert!(docker_ignores(&rules, "target/debug/adsrelay"));
    assert!(docker_ignores(&rules, "README.md"));
    assert!(!docker_ignores(&rules, "src/xds/delta.rs"));
    assert!(docker_ignores(&rules, "src/generated.rs"));
    assert!(!docker_ignores(&rules, "bench/Cargo.toml"));
    assert!(docker_ignores(&rules, "bench/README.md"));
}

/// The image's build context, assembled exactly as deploy/Dockerfile sees it (the repository root
/// filtered by deploy/Dockerfile.dockerignore, then the builder stage's COPY instructions), resolves
/// with `cargo metadata --locked` and compiles with `cargo check --locked` (build.rs, proto/,
/// every source and embedded file: what a missing file breaks). This is what a `docker build`
/// runs; no Docker engine runs in CI here, so the engine itself is not used.
/// The check has a target directory of its own under target/: cargo hashes a path package by its
/// place in the workspace, so in the repository's target directory this copy of `adsrelay`
/// would overwrite the repository's own build. Its first run compiles the dependencies (in check
/// mode); the context lives at a fixed path with the files' own modification times, so later runs
/// redo only what changed. git is kept from finding this repository there
/// (GIT_CEILING_DIRECTORIES), as in a Docker build, which has no .git.
#[test]
fn image_build_context_is_complete() {
    let rules = dockerignore_rules(&read("deploy/Dockerfile.dockerignore"));
    for heavy in [
        "target/debug/x",
        ".git/HEAD",
        ".venv/bin/python",
        "fuzz/Cargo.toml",
    ] {
        assert!(
            docker_ignores(&rules, heavy),
            "{heavy} would be sent in the image build context"
        );
    }
    let dockerfile = read("deploy/Dockerfile");
    let stages: Vec<&str> = dockerfile.split("\nFROM ").skip(1).collect();
    assert_eq!(
        stages.len(),
        2,
        "deploy/Dockerfile: expected a builder and a runtime stage"
    );
    let workdir = stages[0]
        .lines()
        .find_map(|l| l.strip_prefix("WORKDIR "))
        .expect("WORKDIR in the builder stage")
        .trim();

    let context = root().join("target/image-build-context");
    let _ = std::fs::remove_dir_all(&context);
    let mut copied = Vec::new();
    for (i, stage) in stages.iter().enumerate() {
        for line in stage.lines().filter(|l| l.starts_with("COPY ")) {
            let args: Vec<&str> = line.split_whitespace().skip(1).collect();
            if args.iter().any(|a| a.starts_with("--from")) {
                continue;
            }
            let (dest, sources) = args.split_last().expect("COPY with a destination");
            for src in sources {
                let src = src.trim_end_matches('/');
                let sent: Vec<String> = files_under(src)
                    .into_iter()
                    .filter(|f| !docker_ignores(&rules, f))
                    .collect();
                assert!(
                    !sent.is_empty(),
                    "deploy/Dockerfile: `{line}`: {src} is not in the build context \
                     (missing, or excluded by deploy/Dockerfile.dockerignore)"
                );
                // Only the builder stage's files are compiled; the runtime stage's need only be
                // in the context.
                if i != 0 {
                    continue;
                }
                let dir = root().join(src).is_dir();
                let base = Path::new(workdir).join(dest);
                for f in sent {
                    // `COPY dir dest` copies dir's contents into dest; `COPY file dir/` keeps the
                    // file's name.
                    let target = if dir {
                        base.join(&f[src.len() + 1..])
                    } else if dest.ends_with('/') {
                        base.join(f.rsplit('/').next().unwrap())
                    } else {
                        base.clone()
                    };
                    let target = context.join(target.strip_prefix("/").unwrap_or(&target));
                    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
                    std::fs::copy(root().join(&f), &target).unwrap_or_else(|e| panic!("{f}: {e}"));
                    let mtime = std::fs::metadata(root().join(&f))
                        .and_then(|m| m.modified())
                        .unwrap_or_else(|e| panic!("{f}: {e}"));
                    std::fs::File::options()
                        .write(true)
                        .open(&target)
                        .and_then(|t| t.set_modified(mtime))
                        .unwrap_or_else(|e| panic!("{f}: {e}"));
                    copied.push(f);
                }
            }
        }
    }
    let src_dir = context.join(Path::new(workdir).strip_prefix("/").unwrap());
    assert!(
        copied.iter().any(|f| f.starts_with("bench/")),
        "the workspace member bench/ is not in the builder stage: {copied:?}"
    );

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let metadata = Command::new(&cargo)
        .args(["metadata", "--locked", "--format-version", "1"])
        .current_dir(&src_dir)
        .output()
        .expect("run cargo metadata");
    assert!(
        metadata.status.success(),
        "cargo metadata --locked fails in the image build context: {}\ncontext: {copied:?}",
        String::from_utf8_lossy(&metadata.stderr)
    );
    let mut build = Command::new(&cargo);
    // The variables cargo sets for this test (CARGO_MANIFEST_DIR, OUT_DIR, ...) must not reach
    // the build: build scripts that watch them (ring's) would re-run on every run.
    for (k, _) in std::env::vars()
        .filter(|(k, _)| (k.starts_with("CARGO_") && k != "CARGO_HOME") || k == "OUT_DIR")
    {
        build.env_remove(k);
    }
    let build = build
        .args(["check", "--locked", "--lib", "--bins", "-p", "adsrelay"])
        .env("CARGO_TARGET_DIR", root().join("target/image-build-check"))
        .env("GIT_CEILING_DIRECTORIES", &context)
        .env_remove("ADSRELAY_GIT_COMMIT")
        .current_dir(&src_dir)
        .output()
        .expect("run cargo check");
    assert!(
        build.status.success(),
        "cargo check --locked fails in the image build context: {}",
        String::from_utf8_lossy(&build.stderr)
    );
}
