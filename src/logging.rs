//! Logging: the output format, and run-time level control (`POST /debug/log-level`): the binary
//! installs the global subscriber with a reloadable filter; the admin API swaps the filter.

use std::sync::{Mutex, OnceLock};

use serde::Deserialize;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{fmt, reload, EnvFilter, Registry};

/// `--log-format` / `log_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

struct Control {
    handle: reload::Handle<EnvFilter, Registry>,
    current: Mutex<String>,
}

static CONTROL: OnceLock<Control> = OnceLock::new();

/// Installs the global subscriber: `format`, filtered by `RUST_LOG` (default `info`), with a
/// filter the admin API can replace. Returns false if a subscriber was already installed.
pub fn init(format: LogFormat) -> bool {
    let initial = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| EnvFilter::try_new(s).is_ok())
        .unwrap_or_else(|| "info".to_string());
    let (filter, handle) = reload::Layer::new(EnvFilter::new(&initial));
    let text = (format == LogFormat::Text).then(fmt::layer);
    let json = (format == LogFormat::Json).then(|| fmt::layer().json().flatten_event(true));
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json)
        .try_init()
        .is_ok();
    if installed {
        let _ = CONTROL.set(Control {
            handle,
            current: Mutex::new(initial),
        });
    }
    installed
}

/// The current filter, if the binary installed a reloadable one.
pub fn level() -> Option<String> {
    CONTROL.get().map(|c| crate::sync::lock(&c.current).clone())
}

#[derive(Debug, thiserror::Error)]
pub enum LevelError {
    #[error("log level control is not available (logging was not set up by the binary)")]
    Unavailable,
    #[error("invalid level or filter {0:?}: {1}")]
    Invalid(String, String),
}

/// Replaces the filter: a level (`debug`) or any `RUST_LOG` directive (`info,adsrelay=debug`).
pub fn set_level(directive: &str) -> Result<(), LevelError> {
    let control = CONTROL.get().ok_or(LevelError::Unavailable)?;
    let filter = EnvFilter::try_new(directive)
        .map_err(|e| LevelError::Invalid(directive.to_string(), e.to_string()))?;
    control
        .handle
        .reload(filter)
        .map_err(|e| LevelError::Invalid(directive.to_string(), e.to_string()))?;
    *crate::sync::lock(&control.current) = directive.to_string();
    Ok(())
}
