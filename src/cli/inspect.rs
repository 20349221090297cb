//! The admin CLI's read and repair tools: `audit account`, `events show`, `events tail` and
//! `replay`. Everything here reads the events through the `EventStore` trait (either store) and
//! writes to standard output as text or JSON; `cli.rs` only parses arguments.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::Serialize;
use uuid::Uuid;
use zhihui_domain::claim::Identifier;
use zhihui_domain::user::{UserId, Username};
use zhihui_projections::ProjectionName;

use crate::cli::replay::{ReplayProgress, replay as replay_projection};
use crate::platform::configuration::Settings;
use crate::platform::event_store::read_whole_stream;
use crate::platform::event_store::{
    AnyEventStore, EventFilter, EventStore, RecordedEvent, SubscriptionMessage,
};
use crate::points::ledger::account_movements;

async fn connect(settings: &Settings) -> anyhow::Result<(deadpool_postgres::Pool, AnyEventStore)> {
    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    if settings.database.migrate_on_start {
        crate::platform::postgres::migrate(&pool).await?;
    }
    let store = crate::platform::event_store::from_settings(settings, pool.clone())?;
    Ok((pool, store))
}

/// A user id, or the owner of a username.
async fn resolve_user(
    settings: &Settings,
    store: &AnyEventStore,
    user: &str,
) -> anyhow::Result<UserId> {
    if let Ok(id) = Uuid::parse_str(user) {
        return Ok(UserId::from_uuid(id));
    }
    let username = Username::parse(user).map_err(|error| {
        anyhow::anyhow!("{user:?} is neither a user id nor a username: {error}")
    })?;
    let users = crate::identity::users::Users::new(
        store.clone(),
        crate::platform::clock::Clock::System,
        crate::platform::command::RetryPolicy::default(),
        std::time::Duration::from_millis(settings.auth.orphan_claim_release_ms),
    );
    let found = users
        .find(&Identifier::Username(username))
        .await?
        .with_context(|| format!("no user named {user:?}"))?;
    Ok(found.user_id)
}

/// `zhihui audit account <user> [--since T] [--kind K] [--json]`.
pub async fn audit_account(
    settings: &Settings,
    user: &str,
    since: Option<DateTime<Utc>>,
    kind: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    let (_pool, store) = connect(settings).await?;
    let user_id = resolve_user(settings, &store, user).await?;
    let movements = account_movements(&store, user_id, since, kind).await?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &movements).context("writing JSON")?;
        writeln!(out).context("writing to standard output")?;
        return Ok(());
    }
    writeln!(out, "account {user_id}: {} movement(s)", movements.len())?;
    writeln!(
        out,
        "{:>5}  {:<25}  {:<14}  {:>12}  {:>12}  {:>12}  {:<36}  {:<20}  reason",
        "#", "at", "kind", "amount", "available", "frozen", "reference", "actor"
    )?;
    for m in &movements {
        writeln!(
            out,
            "{:>5}  {:<25}  {:<14}  {:>12}  {:>12}  {:>12}  {:<36}  {:<20}  {}",
            m.version,
            m.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            m.kind,
            m.amount,
            m.available_after,
            m.frozen_after,
            m.reference,
            m.actor,
            m.reason.as_deref().unwrap_or("")
        )?;
    }
    Ok(())
}

/// An event as `events show` and `events tail` print it.
#[derive(Debug, Serialize)]
struct ShownEvent<'a> {
    stream: &'a str,
    version: u64,
    position: String,
    event_type: &'a str,
    schema_version: u32,
    recorded_at: DateTime<Utc>,
    event_id: Uuid,
    actor: &'a str,
    correlation_id: Uuid,
    causation_id: Option<Uuid>,
    payload: &'a zhihui_domain::event::Payload,
}

fn write_event(out: &mut impl Write, event: &RecordedEvent, json: bool) -> anyhow::Result<()> {
    if json {
        let shown = ShownEvent {
            stream: &event.stream,
            version: event.stream_version,
            position: event.position.to_string(),
            event_type: &event.event_type,
            schema_version: event.schema_version,
            recorded_at: event.recorded_at,
            event_id: event.id,
            actor: &event.metadata.actor,
            correlation_id: event.metadata.correlation_id,
            causation_id: event.metadata.causation_id,
            payload: &event.payload,
        };
        serde_json::to_writer(&mut *out, &shown).context("writing JSON")?;
        writeln!(out)?;
    } else {
        writeln!(
            out,
            "{} {}#{} {} v{} at {} by {} (correlation {}) {}",
            event.position,
            event.stream,
            event.stream_version,
            event.event_type,
            event.schema_version,
            event
                .recorded_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            event.metadata.actor,
            event.metadata.correlation_id,
            // Compact, keys in order, whatever spacing the store gave the text back with.
            event.payload.to_value()
        )?;
    }
    Ok(())
}

/// `zhihui events show <stream> [--json]`.
pub async fn events_show(settings: &Settings, stream: &str, json: bool) -> anyhow::Result<()> {
    let (_pool, store) = connect(settings).await?;
    let events = read_whole_stream(&store, stream).await?;
    anyhow::ensure!(!events.is_empty(), "stream {stream:?} has no events");
    let mut out = std::io::stdout().lock();
    for event in &events {
        write_event(&mut out, event, json)?;
    }
    Ok(())
}

/// `zhihui events tail [--from-start] [--stream-prefix P]... [--count N] [--json]`.
pub async fn events_tail(
    settings: &Settings,
    from_start: bool,
    stream_prefixes: Vec<String>,
    count: Option<u64>,
    json: bool,
) -> anyhow::Result<()> {
    let (_pool, store) = connect(settings).await?;
    let after = if from_start {
        None
    } else {
        store.head().await.context("finding the end of the log")?
    };
    let filter = if stream_prefixes.is_empty() {
        EventFilter::All
    } else {
        EventFilter::StreamPrefixes(stream_prefixes)
    };
    let mut subscription = store.subscribe_all(after, filter);
    let mut shown = 0u64;
    while count.is_none_or(|count| shown < count) {
        let Some(message) = subscription.next().await else {
            anyhow::bail!("the subscription ended");
        };
        if let SubscriptionMessage::Event(event) = message.context("following the log")? {
            let mut out = std::io::stdout().lock();
            write_event(&mut out, &event, json)?;
            out.flush()?;
            shown += 1;
        }
    }
    Ok(())
}

/// A progress bar on standard error for `replay`.
struct Bar {
    bar: Option<indicatif::ProgressBar>,
    quiet: bool,
}

impl ReplayProgress for Bar {
    fn start(&mut self, projection: ProjectionName, events_expected: Option<u64>) {
        if self.quiet {
            return;
        }
        let bar = match events_expected {
            Some(total) => indicatif::ProgressBar::new(total),
            None => indicatif::ProgressBar::no_length(),
        };
        let template = "{msg:8} [{elapsed_precise}] {wide_bar} {human_pos}/{human_len} events, {per_sec}, eta {eta}";
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.set_message(projection.as_str());
        self.bar = Some(bar);
    }

    fn applied(&mut self, events_so_far: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(events_so_far);
        }
    }
}

/// `zhihui replay [--projection NAME] [--batch-size N] [--quiet]`.
pub async fn replay(
    settings: &Settings,
    projection: Option<ProjectionName>,
    batch_size: usize,
    quiet: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(batch_size >= 1, "--batch-size must be at least 1");
    let (pool, store) = connect(settings).await?;
    let projections = match projection {
        Some(projection) => vec![projection],
        None => ProjectionName::ALL.to_vec(),
    };
    for projection in projections {
        let mut bar = Bar { bar: None, quiet };
        let report = replay_projection(
            &pool,
            &store,
            projection,
            &settings.projections,
            batch_size,
            &mut bar,
        )
        .await
        .with_context(|| format!("replaying {}", projection.as_str()))?;
        if let Some(bar) = bar.bar {
            bar.finish();
        }
        writeln!(
            std::io::stdout().lock(),
            "replayed {}: {} events in {:.2} s ({:.0} events/s), swapped in at {}",
            projection.as_str(),
            report.events,
            report.elapsed.as_secs_f64(),
            report.events_per_second(),
            report
                .checkpoint
                .map_or_else(|| "the start".to_owned(), |position| position.to_string())
        )?;
    }
    Ok(())
}
