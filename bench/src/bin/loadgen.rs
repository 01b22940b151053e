//! `loadgen`: see bench/README.md. Exit status: 0 done, 1 a phase failed, 2 --max-run-secs
//! exceeded, 64 bad flags or limits.

use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;

use adsrelay_bench::cli::Args;
use adsrelay_bench::phase::{self, Target};
use adsrelay_bench::progress::Progress;
use adsrelay_bench::relay_proc::CHILD_PID;
use adsrelay_bench::report::{self, RunReport};
use adsrelay_bench::server_proc::{self, Baseline};
use adsrelay_bench::workload::Workload;
use adsrelay_bench::{plot, procfs};

/// Files the loadgen process needs: its end of every connection (every server runs in a process
/// of its own), plus some slack.
fn files_needed(args: &Args) -> u64 {
    u64::from(args.connections()) + 256
}

fn watchdog(max: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(max);
        eprintln!("loadgen: --max-run-secs ({max:?}) exceeded; stopping");
        let pid = CHILD_PID.load(Ordering::SeqCst);
        if pid != 0 {
            procfs::signal(pid, true);
        }
        std::process::exit(2);
    });
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(which) = args.serve {
        // A baseline's child process (see server_proc).
        procfs::raise_nofile();
        let Some(w) = args.serve_workload.as_deref() else {
            eprintln!("loadgen: --serve needs --serve-workload");
            return ExitCode::from(64);
        };
        return match serde_json::from_str(w) {
            Ok(w) => server_proc::serve(which, w).await,
            Err(e) => {
                eprintln!("loadgen: --serve-workload: {e}");
                ExitCode::from(64)
            }
        };
    }
    if let Err(e) = args.validate() {
        eprintln!("loadgen: {e}");
        return ExitCode::from(64);
    }
    procfs::keep_freed_memory();
    if args.pin {
        if let Err(e) = procfs::pin_own_threads(procfs::LOADGEN_CPU) {
            eprintln!("loadgen: --pin: {e} (needs CPUs 0 and 1)");
            return ExitCode::from(64);
        }
    }
    let limit = procfs::raise_nofile();
    let need = files_needed(&args);
    if need > limit {
        let k = args.streams_per_connection;
        let per_conn = need.saturating_sub(256) / u64::from(args.connections()).max(1);
        let suggest =
            (u64::from(args.clients) * per_conn).div_ceil(limit.saturating_sub(256).max(1));
        eprintln!(
            "loadgen: {} clients on {} connections (--streams-per-connection {k}) need about {need} open files \
             in this process, but the limit is {limit}.\n\
             Share connections: --streams-per-connection {} or more, or lower --clients.",
            args.clients,
            args.connections(),
            suggest.max(u64::from(k) + 1)
        );
        return ExitCode::from(64);
    }
    watchdog(Duration::from_secs(args.max_run_secs));

    let workload = Arc::new(Workload {
        clusters: args.resources,
        listeners: args.listeners,
        eds_pool: args.eds_pool,
        eds_per_client: args.eds_per_client,
        resource_bytes: args.resource_bytes,
        seed: args.seed,
    });
    let name = args.name.clone().unwrap_or_else(|| {
        args.out
            .as_ref()
            .and_then(|p| p.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "loadgen".into())
    });
    let progress = Progress::new();
    progress.line(format!(
        "loadgen {name}: {} {:?} clients, {} connections, open-file limit {limit}",
        args.clients,
        args.protocol,
        args.connections()
    ));
    let mut targets = vec![Target::Relay];
    if args.also_sotw_upstream {
        targets.push(Target::RelaySotwUpstream);
    }
    if args.with_gcp {
        targets.push(Target::Baseline(Baseline::Gcp));
    }
    if args.compare {
        if !args.no_plain {
            targets.push(Target::Baseline(Baseline::Plain));
        }
        targets.push(Target::Baseline(Baseline::Floor));
        if args.with_demo {
            targets.push(Target::Baseline(Baseline::Demo));
        }
    }
    let mut phases = Vec::new();
    let mut failed = false;
    for t in targets {
        match phase::run(t, &args, workload.clone(), &progress).await {
            Ok(p) => phases.push(p),
            Err(e) => {
                eprintln!("loadgen: {} phase failed: {e}", t.name());
                failed = true;
            }
        }
    }
    let ratios = report::ratios(&phases);
    let result = RunReport {
        name,
        unix_time: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        open_file_limit: limit,
        args: args.clone(),
        workload: (*workload).clone(),
        phases,
        ratios,
    };
    print!("{}", report::summary(&result));
    if let Some(out) = &args.out {
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        let json = serde_json::to_string_pretty(&result).expect("report serialises");
        match std::fs::write(out, json) {
            Ok(()) => println!("wrote {}", out.display()),
            Err(e) => {
                eprintln!("loadgen: {}: {e}", out.display());
                failed = true;
            }
        }
    }
    if let Some(path) = &args.plot {
        match std::fs::write(path, plot::svg(&result)) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(e) => {
                eprintln!("loadgen: {}: {e}", path.display());
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
