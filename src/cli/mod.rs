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

mod backends;
mod commands;
use backends::*;
pub use commands::*;

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
        Command::Gallery {
            command: GalleryCommand::Rebuild,
        } => gallery_rebuild(&settings).await,
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

async fn gallery_rebuild(settings: &Settings) -> anyhow::Result<()> {
    let state = app_state(settings)?;
    let worker = crate::gallery::worker::GalleryWorker::new(
        state.gallery.clone(),
        settings.projections.clone(),
    );
    let started = std::time::Instant::now();
    let applied = worker.rebuild().await?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "rebuilt the gallery in Redis from {applied} event(s) in {:.1} s",
        started.elapsed().as_secs_f64()
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
