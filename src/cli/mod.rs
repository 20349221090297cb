//! The `zhihui` command line: one closed enum of subcommands, each a thin call into the library.

pub mod audit;
pub mod bench_support;
pub mod codes;
pub mod inspect;
pub mod replay;

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use zhihui_projections::ProjectionName;

use crate::platform::configuration::{LogFormat, Settings};

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
    /// Rebuild read models from the events into fresh tables, swapped in only when complete.
    Replay {
        /// One projection (`ledger`, `users`); all of them when absent.
        #[arg(long, value_parser = parse_projection)]
        projection: Option<ProjectionName>,
        /// Events per transaction while rebuilding.
        #[arg(long, default_value_t = REPLAY_BATCH_SIZE_DEFAULT)]
        batch_size: usize,
        /// No progress bar (logs and scripts).
        #[arg(long)]
        quiet: bool,
    },
    /// Read the event log.
    Events {
        #[command(subcommand)]
        command: EventsCommand,
    },
    /// The task queue in Redis.
    Queue {
        #[command(subcommand)]
        command: QueueCommand,
    },
    /// Redeem code batches.
    Codes {
        #[command(subcommand)]
        command: CodesCommand,
    },
    /// Daily check-in.
    Checkins {
        #[command(subcommand)]
        command: CheckinsCommand,
    },
    /// Flash-sale promotions.
    Promotions {
        #[command(subcommand)]
        command: PromotionsCommand,
    },
    /// Statistics for admins.
    Stats {
        #[command(subcommand)]
        command: StatsCommand,
    },
    /// Stored images.
    Images {
        #[command(subcommand)]
        command: ImagesCommand,
    },
    /// The pool of ComfyUI servers, changed at run time (every process follows).
    Backends {
        #[command(subcommand)]
        command: BackendsCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum BackendsCommand {
    /// Every server: state, capacity, prompts in flight, models, version, last error, tasks.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Add a server (the leader connects to it and reads its models).
    Add {
        name: String,
        url: String,
        #[arg(long, default_value_t = 1)]
        capacity: u32,
    },
    /// No new prompt goes to it; what runs there finishes.
    Drain { name: String },
    /// Back in service after a drain.
    Resume { name: String },
    /// Remove a server nothing runs on.
    Remove { name: String },
    /// Give a server another address or capacity (refused while a prompt runs there).
    Reconfigure {
        name: String,
        url: String,
        #[arg(long, default_value_t = 1)]
        capacity: u32,
    },
    /// Make the pool what `dispatch.backends` says (the configuration seeds the pool only at
    /// the first start): add, reconfigure and remove servers, each recorded as a pool event. A
    /// server still running a prompt is left as it is and reported; exits non-zero then.
    ApplyConfig,
}

#[derive(Debug, Subcommand)]
pub enum ImagesCommand {
    /// Print an image's AI-generated labels (the PNG `AIGC` text and the XMP) and whether each
    /// one's ReservedCode1 checks out under `labels.signing_key`. Exits non-zero when the label
    /// the format needs is missing or does not check out.
    Inspect {
        /// A file, or the id of a stored image (read from `dispatch.images_directory`).
        target: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CheckinsCommand {
    /// Write the Redis month bitmaps back from the check-in streams (after Redis lost them;
    /// reads also rebuild them lazily). Bits are only ever set: nothing is lost by running it
    /// while users check in.
    Rebuild {
        /// One user (id); every user the `checkins` read model knows when absent.
        #[arg(long)]
        user: Option<uuid::Uuid>,
    },
}

#[derive(Debug, Subcommand)]
pub enum PromotionsCommand {
    /// A promotion from its stream, with its claims (from the read model) and the claims parked.
    Show {
        promotion: uuid::Uuid,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum StatsCommand {
    /// Daily active users: each day's count and the distinct users over the range
    /// (HyperLogLog estimates).
    ActiveUsers {
        /// First day (YYYY-MM-DD); six days before --to when absent.
        #[arg(long)]
        from: Option<chrono::NaiveDate>,
        /// Last day (YYYY-MM-DD, included); today when absent.
        #[arg(long)]
        to: Option<chrono::NaiveDate>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CodesCommand {
    /// Create a batch and issue its codes (in pages, here; a running server's generator may
    /// share the work: pages are fenced, no serial is issued twice).
    Issue {
        /// 1 to 1,000,000 codes.
        #[arg(long)]
        count: u32,
        /// Points per code (e.g. 50 or 12.5).
        #[arg(long)]
        points: rust_decimal::Decimal,
        /// Start of the window (RFC 3339); now when absent.
        #[arg(long)]
        valid_from: Option<chrono::DateTime<chrono::Utc>>,
        /// End of the window (RFC 3339, excluded).
        #[arg(long)]
        valid_until: chrono::DateTime<chrono::Utc>,
        #[arg(long, default_value = "")]
        note: String,
    },
    /// Write a batch's issued codes as CSV (to standard output, or --output).
    Export {
        batch: uuid::Uuid,
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// A batch and its progress.
    Show { batch: uuid::Uuid },
    /// Revoke a batch: its unredeemed codes stop working.
    Revoke {
        batch: uuid::Uuid,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Put every queued task back in the Redis queue at the score its events give it (after
    /// Redis lost its data), and take out what has left.
    Rebuild,
}

/// Replay page size: one transaction per page. Large enough to amortise the commit and the two
/// set-based statements of a page; small enough that each transaction is short (a long one holds
/// the global log's horizon back for every reader).
pub const REPLAY_BATCH_SIZE_DEFAULT: usize = 10_000;

fn parse_projection(name: &str) -> Result<ProjectionName, String> {
    ProjectionName::parse(name).ok_or_else(|| {
        let known: Vec<&str> = ProjectionName::ALL.iter().map(|p| p.as_str()).collect();
        format!("unknown projection {name:?}; known: {}", known.join(", "))
    })
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Every event of one stream, oldest first.
    Show {
        /// The stream, e.g. `account-<user id>`, `revenue`, `user-name-alice`.
        stream: String,
        /// One JSON object per line instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Follow the global log: print events as they are committed.
    Tail {
        /// Start from the beginning of the log instead of from now.
        #[arg(long)]
        from_start: bool,
        /// Only streams starting with this prefix (repeatable).
        #[arg(long = "stream-prefix")]
        stream_prefixes: Vec<String>,
        /// Exit after this many events.
        #[arg(long)]
        count: Option<u64>,
        /// One JSON object per line instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Fold every stream again and compare with every read model; prints each difference and
    /// exits non-zero if there is one.
    Verify,
    /// One account's movements, from its events, oldest first.
    Account {
        /// The user: a user id or a username.
        user: String,
        /// Only movements at or after this time (RFC 3339, e.g. 2027-01-15T00:00:00Z).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Only movements of this kind (grant, freeze, deduct, return, charge, refund,
        /// redeem_code, check_in_bonus, promotion).
        #[arg(long)]
        kind: Option<String>,
        /// JSON (one array) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One redeem code's life: its batch, its redemption and its credit, from their streams.
    Code {
        /// The code as printed (case, hyphens and spaces do not matter).
        code: String,
    },
    /// The settlements the settlement reconciler made itself (holds of finished tasks settled or
    /// released, fees of abandoned prioritises refunded), oldest first.
    Repairs {
        /// Only repairs made at or after this time (RFC 3339).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// JSON (one array) instead of a table.
        #[arg(long)]
        json: bool,
    },
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
    crate::startup::check_settings(&settings)?;
    if let Some(format) = cli.log_format {
        settings.log.format = format;
    }
    crate::platform::telemetry::init(&settings.log)?;
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
        Command::Audit {
            command:
                AuditCommand::Account {
                    user,
                    since,
                    kind,
                    json,
                },
        } => {
            crate::cli::inspect::audit_account(&settings, &user, since, kind.as_deref(), json).await
        }
        Command::Audit {
            command: AuditCommand::Repairs { since, json },
        } => audit_repairs(&settings, since, json).await,
        Command::Audit {
            command: AuditCommand::Code { code },
        } => crate::cli::codes::audit_code(&settings, &code).await,
        Command::Codes { command } => Box::pin(crate::cli::codes::run(&settings, command)).await,
        Command::Checkins {
            command: CheckinsCommand::Rebuild { user },
        } => checkins_rebuild(&settings, user).await,
        Command::Promotions {
            command: PromotionsCommand::Show { promotion, json },
        } => promotions_show(&settings, promotion, json).await,
        Command::Stats {
            command: StatsCommand::ActiveUsers { from, to, json },
        } => stats_active_users(&settings, from, to, json).await,
        Command::Images {
            command: ImagesCommand::Inspect { target, json },
        } => images_inspect(&settings, &target, json).await,
        Command::Replay {
            projection,
            batch_size,
            quiet,
        } => crate::cli::inspect::replay(&settings, projection, batch_size, quiet).await,
        Command::Events {
            command: EventsCommand::Show { stream, json },
        } => crate::cli::inspect::events_show(&settings, &stream, json).await,
        Command::Events {
            command:
                EventsCommand::Tail {
                    from_start,
                    stream_prefixes,
                    count,
                    json,
                },
        } => {
            crate::cli::inspect::events_tail(&settings, from_start, stream_prefixes, count, json)
                .await
        }
        Command::Queue {
            command: QueueCommand::Rebuild,
        } => queue_rebuild(&settings).await,
        Command::Backends { command } => Box::pin(backends(&settings, command)).await,
        Command::Migrate => {
            let pool = crate::platform::postgres::build_pool(&settings.database)?;
            let report = crate::platform::postgres::migrate(&pool).await?;
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
    let password = crate::identity::password::PlainPassword::parse(&raw_password)
        .map_err(|message| anyhow::anyhow!("password: {message}"))?;

    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    if settings.database.migrate_on_start {
        crate::platform::postgres::migrate(&pool).await?;
    }
    let state = crate::state::AppState::build(settings, pool, Default::default())?;
    let metadata = crate::platform::event_store::EventMetadata {
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

/// `zhihui queue rebuild`.
async fn queue_rebuild(settings: &Settings) -> anyhow::Result<()> {
    use std::io::Write;

    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    let state = crate::state::AppState::build(settings, pool, crate::state::Overrides::default())?;
    let report = state.tasks.rebuild_queue().await?;
    writeln!(
        std::io::stdout().lock(),
        "queue rebuilt: {} task(s) queued, {} stale entr(ies) removed",
        report.queued,
        report.removed
    )
    .context("writing to standard output")?;
    Ok(())
}

/// `zhihui backends ...`.
async fn backends(settings: &Settings, command: BackendsCommand) -> anyhow::Result<()> {
    use std::io::Write;

    let state = app_state(settings)?;
    let pool = state.dispatcher.backend_pool();
    let actor = "cli:backends";
    let configured = settings.dispatch.parsed_backends()?;
    let changed = match command {
        BackendsCommand::List { json } => {
            let views = pool.list().await?;
            let differences = pool.differences(&configured).await?;
            let mut out = std::io::stdout().lock();
            if json {
                let differences: Vec<serde_json::Value> = differences
                    .iter()
                    .map(|difference| {
                        serde_json::json!({
                            "difference": difference.to_string(),
                            "apply": difference.command(),
                        })
                    })
                    .collect();
                let listing = serde_json::json!({
                    "backends": views,
                    "configuration_differences": differences,
                });
                serde_json::to_writer_pretty(&mut out, &listing).context("writing JSON")?;
                writeln!(out).context("writing to standard output")?;
                return Ok(());
            }
            writeln!(
                out,
                "{:<16} {:<9} {:>8} {:>9} {:>9} {:>7} {:<10} {:<28} last error",
                "name",
                "state",
                "capacity",
                "in flight",
                "succeeded",
                "failed",
                "version",
                "models"
            )
            .context("writing to standard output")?;
            for view in views {
                let status = view.status.as_ref();
                writeln!(
                    out,
                    "{:<16} {:<9} {:>8} {:>9} {:>9} {:>7} {:<10} {:<28} {}",
                    view.backend.name,
                    view.state,
                    view.backend.capacity,
                    status.map_or("-".to_owned(), |s| s.prompts_in_flight.to_string()),
                    view.tasks_succeeded,
                    view.tasks_failed,
                    view.backend.version.as_deref().unwrap_or("-"),
                    view.backend
                        .models
                        .as_ref()
                        .map_or("-".to_owned(), |models| models.join(",")),
                    status.and_then(|s| s.last_error.as_deref()).unwrap_or("-"),
                )
                .context("writing to standard output")?;
            }
            if !differences.is_empty() {
                writeln!(
                    out,
                    "\ndispatch.backends differs from the pool (the pool is used; `zhihui backends apply-config` applies them all):"
                )
                .context("writing to standard output")?;
                for difference in &differences {
                    writeln!(out, "  {difference}\n    apply: {}", difference.command())
                        .context("writing to standard output")?;
                }
            }
            return Ok(());
        }
        BackendsCommand::ApplyConfig => {
            let applied = pool.apply_configuration(&configured, actor).await?;
            let mut out = std::io::stdout().lock();
            if applied.is_empty() {
                writeln!(
                    out,
                    "the pool is what dispatch.backends says: nothing to apply"
                )
                .context("writing to standard output")?;
                return Ok(());
            }
            let mut refused = 0;
            for (difference, outcome) in &applied {
                match outcome {
                    Ok(()) => writeln!(out, "applied: {difference}"),
                    Err(error) => {
                        refused += 1;
                        writeln!(out, "not applied: {difference}: {error}")
                    }
                }
                .context("writing to standard output")?;
            }
            if refused > 0 {
                anyhow::bail!(
                    "{refused} difference(s) not applied: a server configured away is drained meanwhile; apply again once its prompts have ended"
                );
            }
            return Ok(());
        }
        BackendsCommand::Reconfigure {
            name,
            url,
            capacity,
        } => {
            let backend = zhihui_domain::pool::NewBackend::parse(&name, &url, capacity)?;
            pool.reconfigure(backend, actor)
                .await
                .map(|_| format!("{name} is now {url} with capacity {capacity}"))
        }
        BackendsCommand::Add {
            name,
            url,
            capacity,
        } => {
            let backend = zhihui_domain::pool::NewBackend::parse(&name, &url, capacity)?;
            pool.add(backend, actor)
                .await
                .map(|_| format!("added {name}"))
        }
        BackendsCommand::Drain { name } => pool
            .drain(&name, actor)
            .await
            .map(|_| format!("draining {name}: no new prompt goes there")),
        BackendsCommand::Resume { name } => pool
            .resume(&name, actor)
            .await
            .map(|_| format!("{name} is back in service")),
        BackendsCommand::Remove { name } => pool
            .remove(&name, actor)
            .await
            .map(|_| format!("removed {name}")),
    };
    let message = changed.map_err(|error| anyhow::anyhow!("{error}"))?;
    writeln!(std::io::stdout().lock(), "{message}").context("writing to standard output")?;
    Ok(())
}

/// `zhihui audit repairs`.
async fn audit_repairs(
    settings: &Settings,
    since: Option<chrono::DateTime<chrono::Utc>>,
    json: bool,
) -> anyhow::Result<()> {
    use std::io::Write;

    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    let repairs = crate::points::settlements::repairs(&pool, since).await?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &repairs).context("writing JSON")?;
        writeln!(out).context("writing to standard output")?;
        return Ok(());
    }
    writeln!(out, "{} repair(s)", repairs.len()).context("writing to standard output")?;
    writeln!(
        out,
        "{:<25}  {:<14}  {:<36}  {:<36}  {:<25}  operation",
        "repaired at", "kind", "task or code serial", "user", "owed since"
    )?;
    for repair in &repairs {
        writeln!(
            out,
            "{:<25}  {:<14}  {:<36}  {:<36}  {:<25}  {}",
            repair
                .repaired_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            repair.kind.as_str(),
            repair
                .task_id
                .map(|id| id.to_string())
                .or_else(|| repair.code_serial.map(|serial| format!("code {serial}")))
                .or_else(|| repair.checkin_day.map(|day| format!("check-in {day}")))
                .unwrap_or_default(),
            repair.user_id,
            repair
                .due_since
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            repair
                .operation_id
                .map(|id| id.to_string())
                .unwrap_or_default()
        )?;
    }
    Ok(())
}

/// `zhihui audit verify`.
async fn audit_verify(settings: &Settings) -> anyhow::Result<()> {
    use std::io::Write;

    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    let store = crate::platform::event_store::from_settings(settings, pool.clone())?;
    let client = pool.get().await.context("connecting to PostgreSQL")?;
    let crate::cli::audit::Verified {
        events_read,
        differences,
        pending_settlements,
    } = crate::cli::audit::verify(
        &store,
        &client,
        crate::cli::audit::settlement_bound(&settings.tasks),
    )
    .await?;
    let mut out = std::io::stdout().lock();
    for difference in &differences {
        writeln!(out, "DIFFERENCE {difference}").context("writing to standard output")?;
    }
    writeln!(
        out,
        "audit verify: {events_read} events folded, {} difference(s), {pending_settlements} \
         settlement(s) pending within the bound",
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

fn app_state(settings: &Settings) -> anyhow::Result<crate::state::AppState> {
    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    crate::state::AppState::build(settings, pool, crate::state::Overrides::default())
}

async fn checkins_rebuild(settings: &Settings, user: Option<uuid::Uuid>) -> anyhow::Result<()> {
    let state = app_state(settings)?;
    let (users, months) = match user {
        Some(user) => (
            1,
            state
                .checkins
                .rebuild_user(zhihui_domain::user::UserId::from_uuid(user))
                .await?,
        ),
        None => state.checkins.rebuild_all().await?,
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "rebuilt {months} month(s) of check-ins for {users} user(s)"
    )?;
    Ok(())
}

async fn images_inspect(settings: &Settings, target: &str, json: bool) -> anyhow::Result<()> {
    let path = std::path::Path::new(target);
    let bytes = match uuid::Uuid::parse_str(target) {
        Ok(image_id) if !path.exists() => {
            crate::dispatch::images::ImageStore::new(&settings.dispatch.images_directory)
                .get(image_id)
                .await?
                .with_context(|| format!("no stored image {image_id}"))?
                .1
        }
        _ => std::fs::read(path).with_context(|| format!("reading {target}"))?,
    };
    let inspection = crate::labels::Labeller::new(&settings.labels)?.inspect(&bytes)?;
    let verdict = |checks: Option<bool>| match checks {
        Some(true) => "checks out",
        Some(false) => "DOES NOT check out",
        None => "absent",
    };
    let mut out = std::io::stdout().lock();
    if json {
        let value = serde_json::json!({
            "content_type": inspection.content_type,
            "png_text": inspection.labels.png_text,
            "png_text_checks_out": inspection.png_text_checks_out,
            "xmp": inspection.labels.xmp,
            "xmp_checks_out": inspection.xmp_checks_out,
            "other_text_chunks": inspection.labels.other_text_keywords,
            "labelled": inspection.is_ours(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        writeln!(out, "{target} ({})", inspection.content_type)?;
        let sources = [
            (
                "PNG tEXt AIGC",
                &inspection.labels.png_text,
                inspection.png_text_checks_out,
            ),
            (
                "XMP TC260:AIGC",
                &inspection.labels.xmp,
                inspection.xmp_checks_out,
            ),
        ];
        for (name, label, checks) in sources {
            if name.starts_with("PNG") && inspection.content_type != "image/png" {
                continue;
            }
            writeln!(out, "{name}: ReservedCode1 {}", verdict(checks))?;
            if let Some(label) = label {
                for (field, value) in [
                    ("Label", &label.label),
                    ("ContentProducer", &label.content_producer),
                    ("ProduceID", &label.produce_id),
                    ("ReservedCode1", &label.reserved_code1),
                    ("ContentPropagator", &label.content_propagator),
                    ("PropagateID", &label.propagate_id),
                    ("ReservedCode2", &label.reserved_code2),
                ] {
                    writeln!(out, "  {field:<18} {value}")?;
                }
            }
        }
        if inspection.content_type == "image/png" {
            let others = &inspection.labels.other_text_keywords;
            writeln!(
                out,
                "other text chunks: {}",
                if others.is_empty() {
                    "none".to_owned()
                } else {
                    others.join(", ")
                }
            )?;
        }
    }
    anyhow::ensure!(
        inspection.is_ours(),
        "{target}: the AI-generated label is missing or does not check out"
    );
    Ok(())
}

async fn stats_active_users(
    settings: &Settings,
    from: Option<chrono::NaiveDate>,
    to: Option<chrono::NaiveDate>,
    json: bool,
) -> anyhow::Result<()> {
    let state = app_state(settings)?;
    let to = to.unwrap_or_else(|| state.active_users.today());
    let from = from.unwrap_or(to - chrono::Duration::days(6));
    crate::identity::active_users::check_range(from, to)
        .map_err(|(field, message)| anyhow::anyhow!("--{field}: {message}"))?;
    let report = state.active_users.report(from, to).await?;
    let mut out = std::io::stdout().lock();
    if json {
        let days: Vec<serde_json::Value> = report
            .days
            .iter()
            .map(|(day, count)| serde_json::json!({"day": day, "active_users": count}))
            .collect();
        serde_json::to_writer_pretty(
            &mut out,
            &serde_json::json!({
                "from": from, "to": to, "days": days, "distinct_users": report.distinct,
            }),
        )?;
        writeln!(out)?;
    } else {
        writeln!(out, "{:<12} {:>14}", "day", "active users")?;
        for (day, count) in &report.days {
            writeln!(out, "{:<12} {:>14}", day.to_string(), count)?;
        }
        writeln!(out, "{:<12} {:>14}", "distinct", report.distinct)?;
    }
    Ok(())
}

async fn promotions_show(
    settings: &Settings,
    promotion_id: uuid::Uuid,
    json: bool,
) -> anyhow::Result<()> {
    let state = app_state(settings)?;
    let promotion = state
        .promotions
        .load(promotion_id)
        .await?
        .with_context(|| format!("no promotion {promotion_id}"))?;
    let left = state
        .promotions
        .left_in_redis(promotion_id)
        .await
        .ok()
        .flatten();
    let claims = {
        let client = state.pg_pool.get().await.context("getting a connection")?;
        client
            .query(
                "SELECT claim_id, user_id, status, reason, accepted_at, credited_at IS NOT NULL
                   FROM promotion_claims WHERE promotion_id = $1 ORDER BY accepted_at, claim_id",
                &[&promotion_id],
            )
            .await
            .context("reading claims")?
    };
    let parked = state.promotions.parked(Some(promotion_id)).await?;
    let mut out = std::io::stdout().lock();
    if json {
        let claims: Vec<serde_json::Value> = claims
            .iter()
            .map(|row| {
                serde_json::json!({
                    "claim_id": row.get::<_, uuid::Uuid>(0),
                    "user_id": row.get::<_, uuid::Uuid>(1),
                    "status": row.get::<_, String>(2),
                    "reason": row.get::<_, Option<String>>(3),
                    "accepted_at": row.get::<_, chrono::DateTime<chrono::Utc>>(4),
                    "credited": row.get::<_, bool>(5),
                })
            })
            .collect();
        serde_json::to_writer_pretty(
            &mut out,
            &serde_json::json!({
                "promotion_id": promotion_id,
                "title": promotion.spec.title,
                "points": promotion.spec.points.as_decimal(),
                "price": promotion.spec.price.map(|p| p.as_decimal()),
                "stock": promotion.spec.stock,
                "taken": promotion.taken,
                "granted": promotion.granted,
                "left_at_gate": left,
                "starts_at": promotion.spec.starts_at,
                "ends_at": promotion.spec.ends_at,
                "ended_at": promotion.ended_at,
                "claims": claims,
                "parked": parked,
            }),
        )?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(out, "promotion    {promotion_id}")?;
    writeln!(out, "title        {}", promotion.spec.title)?;
    writeln!(
        out,
        "points       {} each, price {}",
        promotion.spec.points,
        promotion
            .spec
            .price
            .map_or_else(|| "free".to_owned(), |p| p.to_string())
    )?;
    writeln!(
        out,
        "stock        {}: {} taken, {} granted, {} left at the gate",
        promotion.spec.stock,
        promotion.taken,
        promotion.granted,
        left.map_or_else(|| "? (not in Redis)".to_owned(), |left| left.to_string())
    )?;
    writeln!(
        out,
        "window       {} .. {}{}",
        promotion.spec.starts_at,
        promotion.spec.ends_at,
        promotion
            .ended_at
            .map_or_else(String::new, |at| format!(" (ended {at})"))
    )?;
    writeln!(out, "claims       {} persisted (read model)", claims.len())?;
    for row in &claims {
        writeln!(
            out,
            "  {}  {}  {:<8} {}{}",
            row.get::<_, uuid::Uuid>(0),
            row.get::<_, uuid::Uuid>(1),
            row.get::<_, String>(2),
            row.get::<_, Option<String>>(3).unwrap_or_default(),
            if row.get::<_, bool>(5) {
                " credited"
            } else {
                ""
            }
        )?;
    }
    writeln!(out, "parked       {}", parked.len())?;
    for claim in &parked {
        writeln!(
            out,
            "  {}  {} deliveries: {}",
            claim.get("claim_id").map_or("", String::as_str),
            claim.get("deliveries").map_or("", String::as_str),
            claim.get("reason").map_or("", String::as_str)
        )?;
    }
    Ok(())
}
