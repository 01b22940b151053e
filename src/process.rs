//! The process's file-descriptor limit and its `process_*` metrics.
//!
//! Each client connection costs a descriptor, and container runtimes default the soft limit to
//! 1,024: at startup the soft `RLIMIT_NOFILE` is raised to the hard limit ([`raise_fd_limit`]).
//!
//! Process metrics are read from `/proc/self` at scrape time and rendered in the conventional
//! names of the Prometheus client libraries (`process_open_fds`, ...). A small reader rather than
//! a crate: it is five files, while `metrics-process` brings `procfs` and its dependencies and
//! would have to be routed through our per-relay recorder; `process_cpu_seconds_total` must be a
//! fractional counter, which the `metrics` facade (integer counters) cannot express. On systems
//! without `/proc` the families are left out.

use std::fmt::Write;

use tracing::{info, warn};

/// The soft and hard `RLIMIT_NOFILE` in force (`u64::MAX`: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    pub soft: u64,
    pub hard: u64,
}

/// The descriptor limit in force now.
pub fn fd_limit() -> Option<FdLimit> {
    rlimit::getrlimit(rlimit::Resource::NOFILE)
        .ok()
        .map(|(soft, hard)| FdLimit { soft, hard })
}

/// Raises the soft descriptor limit to the hard one, logs both, and warns when the hard limit
/// leaves fewer than `max_connections` descriptors beside the `reserve` and those open now.
pub fn raise_fd_limit(max_connections: usize, reserve: u64) -> Option<FdLimit> {
    let before = fd_limit()?;
    if let Err(e) = rlimit::increase_nofile_limit(u64::MAX) {
        warn!(error = %e, soft = before.soft, hard = before.hard,
            "could not raise the file descriptor limit");
    }
    let now = fd_limit()?;
    info!(
        soft_before = before.soft,
        soft = now.soft,
        hard = now.hard,
        "file descriptor limit"
    );
    let need = (max_connections as u64)
        .saturating_add(reserve)
        .saturating_add(open_fds().unwrap_or(0));
    if now.soft < need {
        warn!(
            limit = now.soft,
            needed = need,
            max_connections,
            fd_reserve = reserve,
            "the file descriptor limit is below what max_connections needs: clients past it will \
             be refused (raise the hard limit, e.g. `ulimit -Hn` or the container's nofile)"
        );
    }
    Some(now)
}

/// Descriptors open in this process (Linux: entries of `/proc/self/fd`).
pub fn open_fds() -> Option<u64> {
    let dir = std::fs::read_dir("/proc/self/fd").ok()?;
    // The directory handle itself is one of the entries.
    Some((dir.count() as u64).saturating_sub(1))
}

/// `/proc` reports CPU times and the start time in USER_HZ ticks, which Linux fixes at 100 for
/// user space on every mainstream architecture (x86, arm64, ...).
const TICKS_PER_SECOND: f64 = 100.0;

/// The `process_*` families in the Prometheus text format, or "" without `/proc`.
pub fn render() -> String {
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        );
    };
    if let Some((utime, stime, start_ticks)) = stat() {
        family(
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            (utime + stime) as f64 / TICKS_PER_SECOND,
        );
        if let Some(boot) = boot_time() {
            family(
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
                boot as f64 + start_ticks as f64 / TICKS_PER_SECOND,
            );
        }
    }
    if let Some(fds) = open_fds() {
        family(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            fds as f64,
        );
    }
    if let Some(limit) = fd_limit() {
        family(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            limit.soft as f64,
        );
    }
    if let Some((rss, vsize)) = memory() {
        family(
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            rss as f64,
        );
        family(
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            vsize as f64,
        );
    }
    out
}

/// (utime, stime, starttime) in ticks, from `/proc/self/stat`.
fn stat() -> Option<(u64, u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields restart after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Field 3 (state) is rest[0]; utime is field 14, stime 15, starttime 22.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)?, field(15)?, field(22)?))
}

/// Boot time, seconds since the epoch (`btime` in `/proc/stat`).
fn boot_time() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
}

/// (resident, virtual) bytes, from `/proc/self/status` (kB, whatever the page size).
fn memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| {
        text.lines().find_map(|l| {
            l.strip_prefix(key)?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
    };
    Some((kb("VmRSS:")? * 1024, kb("VmSize:")? * 1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_conventional_process_families() {
        let text = render();
        if std::fs::metadata("/proc/self/stat").is_err() {
            return;
        }
        for name in [
            "process_cpu_seconds_total",
            "process_start_time_seconds",
            "process_open_fds",
            "process_max_fds",
            "process_resident_memory_bytes",
        ] {
            let value: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {text}"));
            // A young process may not have used a whole tick of CPU yet.
            let floor = if name == "process_cpu_seconds_total" {
                0.0
            } else {
                1.0
            };
            assert!(value >= floor, "{name} = {value}");
        }
        let start: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_start_time_seconds ")?.parse().ok())
            .unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            start <= now + 1.0 && start > now - 3600.0,
            "{start} vs {now}"
        );
    }
}
