//! The `adsrelay` binary: parse flags, set up logging, run the relay (or the demo) until SIGINT or
//! SIGTERM. Config errors exit with 64 (EX_USAGE).

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use tokio::net::TcpListener;

use adsrelay::config::{Cli, Command, LogFormat, Merged, Settings};

fn init_tracing(format: LogFormat) {
    // Reloadable, so `POST /debug/log-level` can change the level at run time.
    adsrelay::logging::init(format);
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

/// `adsrelay check-config`: validate and print the effective configuration; binds nothing.
fn check_config(args: Settings, matches: Option<&clap::ArgMatches>) -> ExitCode {
    let loaded = Merged::load(args, matches).and_then(|m| Ok((m.to_config()?, m)));
    match loaded {
        Ok((config, merged)) => {
            print!(
                "{}",
                adsrelay::config::effective::report(&config, &merged.origins)
            );
            println!("# config OK");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("adsrelay check-config: invalid config: {e}");
            ExitCode::from(64)
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Some(Command::Demo(args)) => {
            init_tracing(args.log_format);
            return match adsrelay::demo::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("adsrelay demo: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::CheckConfig(args)) => {
            return check_config(*args, matches.subcommand_matches("check-config"));
        }
        None => {}
    }
    let config = match Merged::load(cli.relay, Some(&matches)).and_then(|m| m.to_config()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("adsrelay: config error: {e}");
            return ExitCode::from(64);
        }
    };
    init_tracing(config.log_format);
    // Each client costs a descriptor: use all the hard limit allows.
    adsrelay::process::raise_fd_limit(config.limits.max_connections, config.limits.fd_reserve);
    let xds = match adsrelay::accept::bind_xds(config.listen) {
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
