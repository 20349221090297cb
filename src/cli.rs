//! The `zhihui` command line: one closed enum of subcommands, each a thin call into the library.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::configuration::{LogFormat, Settings};

#[derive(Debug, Parser)]
#[command(
    name = "zhihui",
    version,
    about = "zhihui: text-to-image backend and its admin tools"
)]
pub struct Cli {
    /// A TOML settings file, layered over the built-in defaults and under ZHIHUI_* variables.
    #[arg(long, global = true, env = "ZHIHUI_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format; overrides `log.format`.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API (runs pending migrations first unless database.migrate_on_start=false).
    Serve,
    /// Apply pending database migrations and exit.
    Migrate,
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let mut settings = Settings::load(cli.config.as_deref())?;
    if let Some(format) = cli.log_format {
        settings.log.format = format;
    }
    crate::telemetry::init(&settings.log)?;
    match cli.command {
        Command::Serve => {
            let application = crate::startup::Application::build(&settings).await?;
            application.run_until_stopped().await?;
            tracing::info!("stopped");
            Ok(())
        }
        Command::Migrate => {
            let pool = crate::postgres::build_pool(&settings.database)?;
            let report = crate::postgres::migrate(&pool).await?;
            if report.applied.is_empty() {
                tracing::info!("no pending migrations");
            } else {
                tracing::info!(applied = ?report.applied, "migrations applied");
            }
            Ok(())
        }
    }
}
