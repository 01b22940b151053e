//! /proc sampling (CPU time, RSS) and the open-file limit.

use serde::Serialize;

/// A process's CPU time so far and its resident set.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcSample {
    /// utime + stime, seconds.
    pub cpu_s: f64,
    pub rss_kb: u64,
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Samples `/proc/PID/stat` (utime, stime) and `/proc/PID/status` (VmRSS). `None` if the process
/// is gone.
pub fn sample(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    Some(ProcSample {
        cpu_s: (utime + stime) as f64 / clock_ticks(),
        rss_kb,
    })
}

/// Connections the kernel dropped so far because a listener's accept queue was full
/// (`TcpExt ListenOverflows` in /proc/net/netstat, for the whole machine); each costs its client a
/// SYN retransmission a second or more later. `None` off Linux.
pub fn listen_overflows() -> Option<u64> {
    let netstat = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut tcp_ext = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (tcp_ext.next()?, tcp_ext.next()?);
    let at = names
        .split_whitespace()
        .position(|n| n == "ListenOverflows")?;
    values.split_whitespace().nth(at)?.parse().ok()
}

pub fn sample_self() -> ProcSample {
    sample(std::process::id()).unwrap_or_default()
}

/// Keeps freed heap memory in this process instead of returning it to the kernel, so that the
/// simulated clients do not pay page faults again on every update (glibc trims an arena's top
/// beyond 128 KiB by default). Only for the clients' process: the servers under test keep their
/// allocator's defaults. Setting the trim threshold turns off glibc's sliding mmap threshold,
/// hence the explicit one.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator tunables; any value is valid for these two.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        // glibc's largest: messages up to 32 MiB come from the heap, not a fresh mmap each.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force.
pub fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write/read the struct we pass and nothing else.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is not u64 on every target
    let soft = lim.rlim_cur as u64;
    soft
}

/// Sends SIGTERM (or SIGKILL) to a process this program started.
pub fn signal(pid: u32, kill: bool) {
    let sig = if kill { libc::SIGKILL } else { libc::SIGTERM };
    // SAFETY: kill(2) with a pid we spawned ourselves.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// The server under test's CPU and loadgen's with `--pin`.
pub const SERVER_CPU: usize = 0;
pub const LOADGEN_CPU: usize = 1;

/// Pins the calling thread (and the threads it starts later, or the process it `exec`s) to `cpu`.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    pin_thread(0, cpu)
}

/// Pins every thread of this process to `cpu` (tokio's workers already run when `main` starts;
/// threads started later inherit the affinity of the thread that starts them).
pub fn pin_own_threads(cpu: usize) -> std::io::Result<()> {
    for task in std::fs::read_dir("/proc/self/task")? {
        let tid: libc::pid_t = task?
            .file_name()
            .to_string_lossy()
            .parse()
            .map_err(|e| std::io::Error::other(format!("task id: {e}")))?;
        pin_thread(tid, cpu)?;
    }
    Ok(())
}

fn pin_thread(tid: libc::pid_t, cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it for cpu < 1024;
    // sched_setaffinity reads the set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn samples_itself() {
        let s = super::sample_self();
        assert!(s.rss_kb > 0);
        assert!(s.cpu_s >= 0.0);
        if cfg!(target_os = "linux") {
            assert!(
                super::listen_overflows().is_some(),
                "/proc/net/netstat has TcpExt ListenOverflows"
            );
        }
    }
    #[test]
    fn a_pinned_thread_runs_only_on_its_cpu() {
        std::thread::spawn(|| {
            super::pin_current_thread(0).unwrap();
            // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by the kernel.
            let set = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                assert_eq!(
                    libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                    0
                );
                set
            };
            assert_eq!(unsafe { libc::CPU_COUNT(&set) }, 1);
            assert!(unsafe { libc::CPU_ISSET(0, &set) });
        })
        .join()
        .unwrap();
    }
}
