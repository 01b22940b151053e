//! The user-facing guides (README.md, docs/*.md, ARCHITECTURE.md) checked against the repository
//! and the `adsrelay` binary, so that what a user copies from them works:
//! - every relative link points to a file that exists, and every `#anchor` to a heading of it
//!   (GitHub's slugs);
//! - every `--flag` in an `adsrelay ...` command line (code blocks and inline code) and in a
//!   table's flag column is one the binary (or its `check-config` / `demo` subcommand) accepts,
//!   and every relay flag is documented in docs/configure.md;
//! - every `ADSRELAY_*` variable named is one the binary reads (or, for the build, build.rs);
//! - every `adsrelay_*` metric named exists, and docs/metrics.md's table lists every metric;
//! - every ```toml block is a complete config that `adsrelay check-config` accepts (TLS files
//!   under /etc/adsrelay/ are minted for the check);
//! - README.md stays a front page: short, with the demo and the test commands CI relies on.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The demo command and the setup-and-test command, exactly as README.md shows them.
const DEMO_COMMAND: &str = "cargo run --release -- demo";
const TEST_COMMAND: &str = "scripts/test.sh";

/// (path relative to the repository root, text) of every checked Markdown file.
fn guides() -> Vec<(String, String)> {
    let mut paths = vec!["README.md".to_string(), "ARCHITECTURE.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(Path::new(ROOT).join(&p))
                .unwrap_or_else(|e| panic!("{p}: {e}"));
            (p, text)
        })
        .collect()
}

/// A fenced code block: its info string (`toml`, `sh`, ...), first line number and content.
struct Fence {
    info: String,
    line: usize,
    body: String,
}

/// Splits Markdown into prose lines (with their 1-based numbers) and fenced code blocks.
fn split(text: &str) -> (Vec<(usize, &str)>, Vec<Fence>) {
    let mut prose = Vec::new();
    let mut fences = Vec::new();
    let mut open: Option<(String, Fence)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (&mut open, marker) {
            (None, Some(m)) => {
                let run = trimmed.len() - trimmed.trim_start_matches(&m[..1]).len();
                let info = trimmed[run..].trim().to_string();
                let fence = Fence {
                    info,
                    line: i + 1,
                    body: String::new(),
                };
                open = Some((m[..1].repeat(run), fence));
            }
            (Some((close, _)), Some(_)) if trimmed.trim_end() == close.as_str() => {
                fences.push(open.take().unwrap().1);
            }
            (Some((_, fence)), _) => {
                fence.body.push_str(line);
                fence.body.push('\n');
            }
            (None, None) => prose.push((i + 1, line)),
        }
    }
    assert!(open.is_none(), "unclosed code fence");
    (prose, fences)
}

/// The inline code spans of a prose line.
fn code_spans(line: &str) -> Vec<&str> {
    let mut spans = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].len() - rest[start..].trim_start_matches('`').len();
        let after = &rest[start + ticks..];
        let close = "`".repeat(ticks);
        let Some(end) = after.find(&close) else { break };
        spans.push(after[..end].trim());
        rest = &after[end + ticks..];
    }
    spans
}

/// A prose line without its inline code spans.
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].len() - rest[start..].trim_start_matches('`').len();
        let after = &rest[start + ticks..];
        let Some(end) = after.find(&"`".repeat(ticks)) else {
            break;
        };
        out.push_str(&rest[..start]);
        out.push_str(&after[..end]);
        rest = &after[end + ticks..];
    }
    out.push_str(rest);
    out
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces turned into `-`.
fn slug(heading: &str) -> String {
    let text = markdown_text(heading);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The rendered text of inline Markdown: code ticks dropped, links reduced to their text.
fn markdown_text(s: &str) -> String {
    let s = s.replace('`', "");
    let mut out = String::new();
    let mut rest = s.as_str();
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](") else {
            break;
        };
        let Some(close) = rest[open + mid..].find(')') else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..open + mid]);
        rest = &rest[open + mid + close + 1..];
    }
    out.push_str(rest);
    out
}

/// Every anchor of a Markdown file, duplicates numbered as GitHub does (`-1`, `-2`).
fn anchors(text: &str) -> BTreeSet<String> {
    let (prose, _) = split(text);
    let mut seen = BTreeSet::new();
    for (_, line) in prose {
        let hashes = line.len() - line.trim_start_matches('#').len();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of the inline links `[text](target)` and reference definitions `[x]: target` of
/// a prose line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        if let Some(p) = trimmed.find("]: ") {
            targets.push(
                trimmed[p + 3..]
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .into(),
            );
        }
    }
    let mut rest = line.as_str();
    while let Some(p) = rest.find("](") {
        let after = &rest[p + 2..];
        let mut depth = 0;
        let end = after
            .char_indices()
            .find(|&(_, c)| match c {
                '(' => {
                    depth += 1;
                    false
                }
                ')' if depth == 0 => true,
                ')' => {
                    depth -= 1;
                    false
                }
                _ => false,
            })
            .map(|(i, _)| i)
            .unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_string());
        rest = &after[end..];
    }
    targets
}

#[test]
fn every_relative_link_points_to_an_existing_file_and_heading() {
    let root = Path::new(ROOT);
    let mut checked = 0;
    let mut broken = Vec::new();
    for (path, text) in guides() {
        let dir = Path::new(&path).parent().unwrap_or(Path::new(""));
        let (prose, _) = split(&text);
        for (n, line) in prose {
            for target in link_targets(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (file, anchor) = match target.split_once('#') {
                    Some((f, a)) => (f, Some(a)),
                    None => (target.as_str(), None),
                };
                let resolved: PathBuf = if file.is_empty() {
                    PathBuf::from(&path)
                } else {
                    dir.join(file)
                };
                let full = root.join(&resolved);
                if !full.exists() {
                    broken.push(format!(
                        "{path}:{n}: {target}: no file {}",
                        resolved.display()
                    ));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                let Ok(linked) = std::fs::read_to_string(&full) else {
                    broken.push(format!("{path}:{n}: {target}: anchor into a non-text file"));
                    continue;
                };
                if !anchors(&linked).contains(anchor) {
                    broken.push(format!(
                        "{path}:{n}: {target}: {} has no heading #{anchor}",
                        resolved.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked >= 40, "only {checked} relative links found");
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug("Metrics (`GET /metrics`)"),
        "metrics-get-metrics",
        "punctuation dropped, code ticks dropped"
    );
    assert_eq!(
        slug("State of the world (Envoy `api_type: GRPC`, gRPC clients)"),
        "state-of-the-world-envoy-api_type-grpc-grpc-clients"
    );
    assert_eq!(slug("B. SotW downstream"), "b-sotw-downstream");
    let a = anchors("# T\n## Tests\n```sh\n# not a heading\n```\n### Tests\n");
    assert!(a.contains("tests") && a.contains("tests-1") && !a.contains("not-a-heading"));
}

/// `adsrelay`, `adsrelay check-config` or `adsrelay demo` help output.
fn help(args: &[&str]) -> String {
    let out = adsrelay(args, &[]);
    assert!(out.status.success(), "adsrelay {args:?} failed: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn adsrelay(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_adsrelay"));
    cmd.args(args);
    // Only what the test sets: the developer's own ADSRELAY_* must not leak in.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("ADSRELAY_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied())
        .output()
        .expect("run adsrelay")
}

/// The long flags a `--help` output lists.
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix("-h, ")
                .or(l.strip_prefix("-V, "))
                .unwrap_or(l);
            let flag = l.strip_prefix("--")?;
            let name: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// The `--flags` of a shell line, as (subcommand, flag) pairs, if the line runs adsrelay
/// (`adsrelay ...`, `target/release/adsrelay ...`, `VAR=x adsrelay ...`, `cargo run ... -- ...`).
fn relay_invocation(line: &str) -> Option<(Option<String>, Vec<String>)> {
    let tokens: Vec<&str> = line
        .trim_start_matches(['$', ' '])
        .split_whitespace()
        .map(|t| t.trim_matches(['[', ']']))
        .collect();
    let command = tokens
        .iter()
        .position(|t| *t == "adsrelay" || t.ends_with("/adsrelay"));
    // The image: `docker run ... registry.example.com/adsrelay:TAG --flag ...`.
    let image = tokens.iter().position(|t| t.contains("/adsrelay:"));
    let start = if let Some(p) = command {
        // `adsrelay` as a command word: first, or after variable assignments (not the
        // `deploy/adsrelay` of a kubectl line, nor `-p adsrelay` of cargo).
        if !tokens[..p].iter().all(|t| t.contains('=')) {
            return None;
        }
        p + 1
    } else if let Some(p) = image.filter(|_| tokens.first() == Some(&"docker")) {
        p + 1
    } else if tokens.starts_with(&["cargo", "run"]) {
        tokens.iter().position(|t| *t == "--")? + 1
    } else {
        return None;
    };
    let args = &tokens[start..];
    let sub = args
        .first()
        .filter(|a| ["demo", "check-config"].contains(a))
        .map(|a| a.to_string());
    let flags = args
        .iter()
        .take_while(|t| !["|", "&&", ";", "#", "2>&1"].contains(t))
        .filter_map(|t| t.strip_prefix("--"))
        .map(|t| t.split('=').next().unwrap().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    Some((sub, flags))
}

/// Every relay command line of a guide: shell lines of code blocks (continuations joined) and
/// inline code spans.
fn command_lines(text: &str) -> Vec<(usize, String)> {
    let (prose, fences) = split(text);
    let mut lines = Vec::new();
    for fence in &fences {
        if !["sh", "console", "bash", "shell", "text", ""].contains(&fence.info.as_str()) {
            continue;
        }
        let mut joined = String::new();
        for (i, l) in fence.body.lines().enumerate() {
            joined.push_str(l.trim_end_matches('\\'));
            joined.push(' ');
            if !l.ends_with('\\') {
                lines.push((fence.line + 1 + i, std::mem::take(&mut joined)));
            }
        }
    }
    for (n, line) in prose {
        for span in code_spans(line) {
            lines.push((n, span.to_string()));
        }
    }
    lines
}

#[test]
fn every_documented_flag_is_one_the_relay_accepts() {
    let relay = help_flags(&help(&["--help"]));
    let check = help_flags(&help(&["check-config", "--help"]));
    let demo = help_flags(&help(&["demo", "--help"]));
    assert!(relay.contains("upstream") && relay.len() >= 40, "{relay:?}");
    let mut unknown = Vec::new();
    let mut checked = 0;
    for (path, text) in guides() {
        for (n, line) in command_lines(&text) {
            let Some((sub, flags)) = relay_invocation(&line) else {
                continue;
            };
            let (accepted, what) = match sub.as_deref() {
                Some("demo") => (&demo, "adsrelay demo"),
                Some(_) => (&check, "adsrelay check-config"),
                None => (&relay, "adsrelay"),
            };
            for flag in flags {
                checked += 1;
                if !accepted.contains(&flag) {
                    unknown.push(format!(
                        "{path}:{n}: {what} does not accept --{flag}: {line}"
                    ));
                }
            }
        }
        // Tables whose first column is a relay flag (`--flag VALUE`).
        let (prose, _) = split(&text);
        for (n, line) in prose {
            let Some(cell) = line.strip_prefix("| `--") else {
                continue;
            };
            let flag: String = cell
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            checked += 1;
            if !relay.contains(&flag) {
                unknown.push(format!("{path}:{n}: adsrelay does not accept --{flag}"));
            }
        }
    }
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
    assert!(checked >= 40, "only {checked} flags found in the guides");

    // And the other way: no relay flag is left undocumented.
    let configure = std::fs::read_to_string(Path::new(ROOT).join("docs/configure.md")).unwrap();
    let missing: Vec<_> = relay
        .iter()
        .filter(|f| !["help", "version"].contains(&f.as_str()))
        .filter(|f| {
            let f = format!("`--{f}");
            !configure.contains(&format!("{f}`")) && !configure.contains(&format!("{f} "))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "flags in `adsrelay --help` that docs/configure.md does not document: {missing:?}"
    );
}

/// `NAME` of every `ADSRELAY_NAME` in `text`.
fn env_vars(text: &str) -> BTreeSet<String> {
    let mut vars = BTreeSet::new();
    let mut rest = text;
    while let Some(p) = rest.find("ADSRELAY_") {
        let tail = &rest[p + "ADSRELAY_".len()..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !name.is_empty() {
            vars.insert(format!("ADSRELAY_{name}"));
        }
        rest = tail;
    }
    vars
}

#[test]
fn every_documented_environment_variable_exists() {
    let help = help(&["--help"]);
    let build = std::fs::read_to_string(Path::new(ROOT).join("build.rs")).unwrap();
    let read_by_relay: BTreeSet<String> = help
        .lines()
        .filter_map(|l| l.trim().strip_prefix("[env: "))
        .filter_map(|l| l.split('=').next())
        .map(str::to_string)
        .collect();
    assert!(read_by_relay.len() >= 40, "{read_by_relay:?}");
    let mut unknown = Vec::new();
    let mut checked = 0;
    for (path, text) in guides() {
        for var in env_vars(&text) {
            checked += 1;
            // Read by the relay at run time, or by the build (`ADSRELAY_GIT_COMMIT`).
            let build_time = build.contains(&format!("rerun-if-env-changed={var}"));
            if !read_by_relay.contains(&var) && !build_time {
                unknown.push(format!(
                    "{path}: {var} is read by neither adsrelay nor build.rs"
                ));
            }
        }
    }
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
    assert!(checked >= 5, "only {checked} variables found");
}

#[test]
fn every_documented_metric_exists_and_every_metric_is_documented() {
    let known: BTreeSet<&str> = adsrelay::metrics::DESCRIPTIONS
        .iter()
        .map(|(n, _)| *n)
        .collect();
    let mut unknown = Vec::new();
    for (path, text) in guides() {
        let mut rest = text.as_str();
        while let Some(p) = rest.find("adsrelay_") {
            let tail = &rest[p..];
            let name: String = tail
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            rest = &tail[name.len().max(1)..];
            if name.len() <= "adsrelay_".len() {
                continue;
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| known.contains(f)))
                .unwrap_or(&name);
            if !known.contains(family) {
                unknown.push(format!("{path}: {name}"));
            }
        }
    }
    let unknown: BTreeSet<_> = unknown.into_iter().collect();
    assert!(
        unknown.is_empty(),
        "metrics the relay does not export:\n{unknown:#?}"
    );

    let metrics = std::fs::read_to_string(Path::new(ROOT).join("docs/metrics.md")).unwrap();
    let missing: Vec<_> = known
        .iter()
        .filter(|n| !metrics.contains(&format!("| `{n}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/metrics.md's table lacks {missing:?}"
    );
}

/// A CA and one leaf certificate (with its key) standing in for the files a config names.
struct MintedTls {
    dir: tempfile::TempDir,
}

impl MintedTls {
    fn new() -> MintedTls {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let dir = tempfile::Builder::new()
            .prefix("adsrelay-docs-tls-")
            .tempdir()
            .unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["xds.example.internal".to_string()])
            .unwrap()
            .signed_by(&key, &*ca)
            .unwrap();
        std::fs::write(dir.path().join("ca.crt"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("leaf.crt"), leaf.pem()).unwrap();
        std::fs::write(dir.path().join("leaf.key"), key.serialize_pem()).unwrap();
        MintedTls { dir }
    }

    /// `toml` with every quoted `/etc/adsrelay/...crt|key` path replaced by a minted file:
    /// `*ca.crt` the CA, other `.crt` the leaf, `.key` its key.
    fn substitute(&self, toml: &str) -> String {
        let mut out = String::new();
        let mut rest = toml;
        while let Some(p) = rest.find("\"/etc/adsrelay/") {
            let end = rest[p + 1..].find('"').expect("closing quote") + p + 1;
            let path = &rest[p + 1..end];
            let file = if path.ends_with("ca.crt") {
                "ca.crt"
            } else if path.ends_with(".crt") {
                "leaf.crt"
            } else if path.ends_with(".key") {
                "leaf.key"
            } else {
                panic!("{path}: only certificates and keys are minted")
            };
            out.push_str(&rest[..p + 1]);
            out.push_str(&self.dir.path().join(file).to_string_lossy());
            rest = &rest[end..];
        }
        out.push_str(rest);
        out
    }
}

#[test]
fn every_toml_block_is_a_config_check_config_accepts() {
    let tls = MintedTls::new();
    let mut checked = 0;
    let mut failed = Vec::new();
    for (path, text) in guides() {
        let (_, fences) = split(&text);
        for fence in fences.iter().filter(|f| f.info == "toml") {
            checked += 1;
            let file = tempfile::Builder::new()
                .prefix("adsrelay-docs-")
                .suffix(".toml")
                .tempfile()
                .unwrap();
            std::fs::write(file.path(), tls.substitute(&fence.body)).unwrap();
            let out = adsrelay(
                &["check-config", "--config", file.path().to_str().unwrap()],
                &[],
            );
            if !out.status.success() {
                failed.push(format!(
                    "{path}:{}: check-config exits {:?}: {}{}",
                    fence.line,
                    out.status.code(),
                    String::from_utf8_lossy(&out.stderr),
                    String::from_utf8_lossy(&out.stdout)
                ));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert!(checked >= 3, "only {checked} toml blocks found");
}

#[test]
fn readme_is_a_front_page_with_the_demo_and_test_commands() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines; move detail to docs/"
    );
    let (_, fences) = split(&readme);
    for command in [DEMO_COMMAND, TEST_COMMAND] {
        assert!(
            fences
                .iter()
                .any(|f| f.info == "sh" && f.body.trim() == command),
            "README.md has no ```sh block holding exactly `{command}`"
        );
    }
    // CI runs the README's test command.
    let ci = std::fs::read_to_string(Path::new(ROOT).join(".ci/run")).unwrap();
    assert!(
        ci.contains(&format!("exec {TEST_COMMAND}")),
        ".ci/run:\n{ci}"
    );
    // The guides are linked from the front page.
    for guide in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let name = guide.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            assert!(
                readme.contains(&format!("](docs/{name})")),
                "README.md does not link docs/{name}"
            );
        }
    }
}
