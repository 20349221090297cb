//! Tracing set-up in one place: human-readable lines locally, one JSON object per line in
//! production (`--log-format json` or `ZHIHUI_LOG__FORMAT=json`). `RUST_LOG` overrides the
//! configured filter.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

use crate::platform::configuration::{LogFormat, LogSettings};

/// Install the global subscriber. Call once, from `main`; tests install none (or their own).
pub fn init(settings: &LogSettings) -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.filter))
        .map_err(|error| anyhow::anyhow!("log.filter {:?} is invalid: {error}", settings.filter))?;
    let registry = tracing_subscriber::registry().with(filter);
    match settings.format {
        LogFormat::Pretty => registry
            .with(fmt::layer().with_writer(std::io::stderr))
            .try_init()?,
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_writer(std::io::stderr),
            )
            .try_init()?,
    }
    Ok(())
}

/// Log an error with its whole cause chain (anyhow's `{:#}` prints `a: b: c`).
pub fn error_chain(error: &anyhow::Error) -> String {
    format!("{error:#}")
}
