//! The `zhihui` command line: one closed enum of subcommands, each a thin call into the library.

use std::path::PathBuf;

use anyhow::Context;
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
    /// Inspect the audit trail.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Manage users (bootstrap an admin).
    Users {
        #[command(subcommand)]
        command: UsersCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Fold every stream again and compare with every read model; prints each difference and
    /// exits non-zero if there is one.
    Verify,
}

#[derive(Debug, Subcommand)]
pub enum UsersCommand {
    /// Create a user with a username and password. Prompts for the password twice on a terminal.
    Create {
        /// The username (3 to 32 letters, digits, `_`, `-`, `.`; starts with a letter).
        name: String,
        /// Give the user the admin role.
        #[arg(long)]
        admin: bool,
        /// Read the password from the first line of standard input instead of prompting.
        #[arg(long)]
        password_stdin: bool,
    },
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
        Command::Users {
            command:
                UsersCommand::Create {
                    name,
                    admin,
                    password_stdin,
                },
        } => create_user(&settings, &name, admin, password_stdin).await,
        Command::Audit {
            command: AuditCommand::Verify,
        } => audit_verify(&settings).await,
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

/// `zhihui users create`: register a user directly through the users service, as the HTTP
/// registration would, but also while registration is switched off and with the admin role.
async fn create_user(
    settings: &Settings,
    name: &str,
    admin: bool,
    password_stdin: bool,
) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};

    use zhihui_domain::user::{Role, Username};

    let username = Username::parse(name).map_err(|error| anyhow::anyhow!("username: {error}"))?;
    let raw_password = if password_stdin {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .context("reading the password from standard input")?;
        line.trim_end_matches(['\r', '\n']).to_owned()
    } else {
        let first = rpassword::prompt_password(format!("Password for {username}: "))
            .context("reading the password (use --password-stdin without a terminal)")?;
        let second = rpassword::prompt_password("Again: ").context("reading the password")?;
        anyhow::ensure!(first == second, "the two passwords differ");
        first
    };
    let password = crate::auth::password::PlainPassword::parse(&raw_password)
        .map_err(|message| anyhow::anyhow!("password: {message}"))?;

    let pool = crate::postgres::build_pool(&settings.database)?;
    if settings.database.migrate_on_start {
        crate::postgres::migrate(&pool).await?;
    }
    let state = crate::startup::AppState::build(settings, pool, Default::default())?;
    let metadata = crate::event_store::EventMetadata {
        correlation_id: uuid::Uuid::now_v7(),
        causation_id: None,
        actor: "cli:users-create".into(),
    };
    let role = if admin { Role::Admin } else { Role::User };
    let user = state
        .users
        .register_with_password(username, &password, &state.passwords, role, &metadata)
        .await
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    writeln!(
        std::io::stdout(),
        "created {} {} ({})",
        role.as_str(),
        user.username
            .as_ref()
            .map(|name| name.as_str())
            .unwrap_or_default(),
        user.user_id
    )
    .context("writing to standard output")?;
    Ok(())
}

/// `zhihui audit verify`.
async fn audit_verify(settings: &Settings) -> anyhow::Result<()> {
    use std::io::Write;

    let pool = crate::postgres::build_pool(&settings.database)?;
    let store = crate::event_store::from_settings(settings, pool.clone())?;
    let client = pool.get().await.context("connecting to PostgreSQL")?;
    let (events, differences) = crate::audit::verify(&store, &client).await?;
    let mut out = std::io::stdout().lock();
    for difference in &differences {
        writeln!(out, "DIFFERENCE {difference}").context("writing to standard output")?;
    }
    writeln!(
        out,
        "audit verify: {events} events folded, {} difference(s)",
        differences.len()
    )
    .context("writing to standard output")?;
    anyhow::ensure!(
        differences.is_empty(),
        "{} read-model row(s) disagree with the events",
        differences.len()
    );
    Ok(())
}
