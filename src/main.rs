//! The `adsrelay` binary: parse flags, set up logging, run the relay (or the demo) until SIGINT or
//! SIGTERM. Config errors exit with 64 (EX_USAGE).

use std::process::ExitCode;

use clap::Parser;
use tokio::net::TcpListener;

use adsrelay::config::{Cli, Command, LogFormat};

fn init_tracing(format: LogFormat) {
    // Reloadable, so `POST /debug/log-level` can change the level at run time.
    adsrelay::config::logging::init(format);
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return ctrl_c.await.unwrap_or(()),
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Demo(args)) = cli.command {
        init_tracing(args.log_format);
        return match adsrelay::demo::run(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("adsrelay demo: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let config = match cli.relay.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("adsrelay: config error: {e}");
            return ExitCode::from(64);
        }
    };
    init_tracing(config.log_format);
    // Each client costs a descriptor: use all the hard limit allows.
    adsrelay::process::raise_fd_limit(config.limits.max_connections, config.limits.fd_reserve);
    let xds = match TcpListener::bind(config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("adsrelay: listen {}: {e}", config.listen);
            return ExitCode::from(64);
        }
    };
    let admin = match TcpListener::bind(config.admin).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("adsrelay: admin {}: {e}", config.admin);
            return ExitCode::from(64);
        }
    };
    tracing::info!(listen = %config.listen, admin = %config.admin, upstream = %config.upstream, "adsrelay starting");
    match adsrelay::run(config, xds, admin, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("adsrelay: {e}");
            ExitCode::FAILURE
        }
    }
}
