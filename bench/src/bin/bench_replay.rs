//! Benchmark of `zhihui replay`: rebuild the ledger read models (`accounts`, `ledger_entries`)
//! from N account events (default 1,000,000) and swap them in, printing events/s, then
//! `RESULT replay_events_per_second <value> events/s`.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui \
//!         cargo run --release --bin bench_replay [-- EVENTS [BATCH_SIZE]]
//!
//! The events are real: decided by the account decider (a grant, then freeze/release and
//! freeze/settle pairs, 100 events per account, the last hold left open) and appended through the event store, 100 per
//! append. The live projection first applies them all, so the replay also proves equal to it:
//! the row counts and the sum of balances are compared after the swap. Then where the time goes:
//! each stage of a replay (read, decode, fold, write) timed alone over the same events. It
//! creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's and drops it at the end.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Instant;

use anyhow::Context;
use futures::StreamExt;
use uuid::Uuid;
use zhihui::cli::replay::Quiet;
use zhihui::platform::event_store::{EventStore, ExpectedVersion};
use zhihui_domain::Decider;
use zhihui_domain::account::{Account, AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;
use zhihui_projections::ProjectionName;

/// Events per account stream (and per append).
const EVENTS_PER_ACCOUNT: usize = 100;
/// Appends in flight while loading.
const LOAD_CONCURRENCY: usize = 64;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let mut args = std::env::args().skip(1);
    let events: usize = args
        .next()
        .map(|arg| arg.parse())
        .transpose()
        .context("the first argument is the number of events")?
        .unwrap_or(1_000_000);
    let batch_size: usize = args
        .next()
        .map(|arg| arg.parse())
        .transpose()
        .context("the second argument is the replay batch size")?
        .unwrap_or(zhihui::cli::REPLAY_BATCH_SIZE_DEFAULT);
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = 32;
            settings.event_store.group_commit_writers = 4;
        },
        |settings| async move { run(&settings, events, batch_size).await },
    )
    .await
}

/// One account's events, decided by the domain: a grant, then freeze + settle or release pairs.
fn account_events(at: chrono::DateTime<chrono::Utc>) -> Vec<zhihui_domain::account::AccountEvent> {
    let mut state = Account::initial_state();
    let mut events = Vec::with_capacity(EVENTS_PER_ACCOUNT);
    let mut decide = |command: AccountCommand, events: &mut Vec<_>| {
        for event in Account::decide(&state, &command).unwrap_or_default() {
            state = Account::evolve(std::mem::take(&mut state), &event);
            events.push(event);
        }
    };
    decide(
        AccountCommand::Grant {
            operation_id: Uuid::now_v7(),
            amount: Amount::whole(1_000_000),
            reason: "bench".into(),
            at,
        },
        &mut events,
    );
    let mut n = 0;
    while events.len() < EVENTS_PER_ACCOUNT {
        let hold_id = Uuid::now_v7();
        decide(
            AccountCommand::Freeze {
                hold_id,
                amount: Amount::whole(3),
                at,
            },
            &mut events,
        );
        let end = if n % 2 == 0 {
            AccountCommand::SettleHold { hold_id, at }
        } else {
            AccountCommand::ReleaseHold {
                hold_id,
                reason: "bench".into(),
                at,
            }
        };
        if events.len() < EVENTS_PER_ACCOUNT {
            decide(end, &mut events);
        }
        n += 1;
    }
    events
}

async fn run(
    settings: &zhihui::platform::configuration::Settings,
    events: usize,
    batch_size: usize,
) -> anyhow::Result<Vec<zhihui::cli::bench_support::Figure>> {
    zhihui::platform::telemetry::init(&settings.log)?;
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    zhihui::platform::postgres::migrate(&pool).await?;
    let store = zhihui::platform::event_store::from_settings(settings, pool.clone())?;

    let accounts = events.div_ceil(EVENTS_PER_ACCOUNT);
    let at = chrono::Utc::now();
    let loading = Instant::now();
    let metadata = zhihui::cli::bench_support::metadata();
    let mut appends = futures::stream::iter(0..accounts)
        .map(|_| {
            let store = store.clone();
            let new_events =
                zhihui::platform::command::to_new_events(&account_events(at), &metadata);
            async move {
                let stream = account_stream(UserId::from_uuid(Uuid::now_v7()));
                store
                    .append(&stream, ExpectedVersion::NoStream, new_events)
                    .await
            }
        })
        .buffer_unordered(LOAD_CONCURRENCY);
    let mut appended = 0usize;
    while let Some(outcome) = appends.next().await {
        outcome.context("loading events")?;
        appended += EVENTS_PER_ACCOUNT;
        if appended.is_multiple_of(100_000) {
            eprintln!("loaded {appended} events");
        }
    }
    println!(
        "loaded {appended} events in {} accounts in {:.1} s",
        accounts,
        loading.elapsed().as_secs_f64()
    );

    let live = Instant::now();
    let projector = zhihui::platform::projector::Projector::live(
        ProjectionName::Ledger,
        pool.clone(),
        store.clone(),
        zhihui::platform::configuration::ProjectionSettings {
            batch_size,
            ..settings.projections.clone()
        },
    );
    let live_events = projector.catch_up().await?;
    let live_per_second = live_events as f64 / live.elapsed().as_secs_f64();
    println!(
        "live projection (project_batch, no read-ahead): {live_events} events in {:.1} s ({live_per_second:.0} events/s)",
        live.elapsed().as_secs_f64(),
    );
    let client = pool.get().await?;
    // Let the server settle after the load, as a database in service would have: statistics,
    // visibility maps, dirty pages written (CHECKPOINT needs a superuser; skipped otherwise).
    let settling = Instant::now();
    for table in ["events", "ledger_entries", "accounts"] {
        client
            .batch_execute(&format!("VACUUM (ANALYZE) {table}"))
            .await
            .with_context(|| format!("vacuuming {table} after the load"))?;
    }
    let checkpoint = client.batch_execute("CHECKPOINT").await;
    println!(
        "settled (VACUUM ANALYZE{}) in {:.1} s",
        if checkpoint.is_ok() {
            ", CHECKPOINT"
        } else {
            "; no CHECKPOINT: not a superuser"
        },
        settling.elapsed().as_secs_f64()
    );
    let totals = "SELECT (SELECT count(*) FROM ledger_entries), (SELECT count(*) FROM accounts),
                         (SELECT sum(available + frozen)::text FROM accounts)";
    let before = client.query_one(totals, &[]).await?;
    let before: (i64, i64, String) = (before.get(0), before.get(1), before.get(2));

    let report = zhihui::cli::replay::replay(
        &pool,
        &store,
        ProjectionName::Ledger,
        &settings.projections,
        batch_size,
        &mut Quiet,
    )
    .await?;
    let after = client.query_one(totals, &[]).await?;
    let after: (i64, i64, String) = (after.get(0), after.get(1), after.get(2));
    anyhow::ensure!(
        before == after,
        "replayed read models differ: {before:?} live, {after:?} replayed"
    );
    println!(
        "replay (batch {batch_size}): {} events in {:.2} s: {:.0} events/s; {} ledger rows, {} accounts, equal to live",
        report.events,
        report.elapsed.as_secs_f64(),
        report.events_per_second(),
        after.0,
        after.1
    );
    let mut figures = vec![
        (
            "replay_events_per_second".into(),
            report.events_per_second(),
            "events/s",
        ),
        (
            "replay_live_runner_events_per_second".into(),
            live_per_second,
            "events/s",
        ),
    ];
    figures.extend(time_split(&pool, &store, batch_size).await?);
    Ok(figures)
}

/// Where a replay's time goes, each stage timed alone over the same events (one core's work
/// each, as the replay runs them): reading the log page by page; decoding every payload; folding
/// the pages into rows (decode included); writing the folded rows (one transaction per page, into
/// fresh rebuild tables, as the replay does).
async fn time_split(
    pool: &deadpool_postgres::Pool,
    store: &zhihui::platform::event_store::AnyEventStore,
    batch_size: usize,
) -> anyhow::Result<Vec<zhihui::cli::bench_support::Figure>> {
    use zhihui::cli::bench_support::{process_cpu_us, processes_cpu_us};
    use zhihui::platform::event_store::EventStore;
    let filter = zhihui::platform::event_store::filter_of(ProjectionName::Ledger);
    let own_before = process_cpu_us(std::process::id())?;
    let postgres_before = processes_cpu_us("postgres")?.unwrap_or(0.0);
    let reading = Instant::now();
    let mut pages = Vec::new();
    let mut after = None;
    loop {
        let slice = store.read_all(after, batch_size, &filter).await?;
        let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != after) else {
            break;
        };
        after = Some(scanned_to);
        let end = slice.end_of_log;
        pages.push((slice.events, scanned_to));
        if end {
            break;
        }
    }
    let read = reading.elapsed();
    let events: usize = pages.iter().map(|(page, _)| page.len()).sum();
    // Who spent the read's time: PostgreSQL (finding the rows, writing the JSON out) or this
    // process (parsing the rows).
    let read_postgres_us =
        (processes_cpu_us("postgres")?.unwrap_or(0.0) - postgres_before) / events.max(1) as f64;
    let read_own_us = (process_cpu_us(std::process::id())? - own_before) / events.max(1) as f64;

    let decoding = Instant::now();
    let mut decoded = 0usize;
    for (page, _) in &pages {
        for event in page {
            let _event =
                <zhihui_domain::account::AccountEvent as zhihui_domain::DomainEvent>::from_stored(
                    &event.event_type,
                    event.schema_version,
                    &event.payload,
                )?;
            decoded += 1;
        }
    }
    let decode = decoding.elapsed();

    let projected: Vec<Vec<zhihui_projections::ProjectedEvent>> = pages
        .iter()
        .map(|(page, _)| {
            page.iter()
                .map(zhihui::platform::projector::to_projected)
                .collect()
        })
        .collect();
    let folding = Instant::now();
    let mut rows = Vec::with_capacity(projected.len());
    for page in &projected {
        rows.push(zhihui_projections::accounts::fold(page)?);
    }
    let fold = folding.elapsed();

    zhihui::cli::replay::prepare_tables(pool, ProjectionName::Ledger).await?;
    let writing = Instant::now();
    for page in &rows {
        let mut client = pool.get().await?;
        let transaction = client.transaction().await?;
        zhihui_projections::accounts::write(
            &transaction,
            &zhihui_projections::Tables::REBUILD,
            page,
        )
        .await?;
        transaction.commit().await?;
    }
    let write = writing.elapsed();
    zhihui::cli::replay::prepare_tables(pool, ProjectionName::Ledger).await?;
    let per_event = |time: std::time::Duration| time.as_secs_f64() * 1e6 / events.max(1) as f64;
    println!(
        "time split over {events} events ({decoded} decoded), each stage alone: read {:.2} s ({:.2} µs/event; CPU: PostgreSQL {read_postgres_us:.2}, this process {read_own_us:.2}), decode {:.2} s ({:.2}), fold without decode {:.2} s ({:.2}), write {:.2} s ({:.2})",
        read.as_secs_f64(),
        per_event(read),
        decode.as_secs_f64(),
        per_event(decode),
        fold.saturating_sub(decode).as_secs_f64(),
        per_event(fold.saturating_sub(decode)),
        write.as_secs_f64(),
        per_event(write),
    );
    Ok(vec![
        (
            "replay_split_read_us_per_event".into(),
            per_event(read),
            "us",
        ),
        (
            "replay_split_read_postgres_cpu_us_per_event".into(),
            read_postgres_us,
            "us",
        ),
        (
            "replay_split_read_own_cpu_us_per_event".into(),
            read_own_us,
            "us",
        ),
        (
            "replay_split_decode_us_per_event".into(),
            per_event(decode),
            "us",
        ),
        (
            "replay_split_fold_us_per_event".into(),
            per_event(fold.saturating_sub(decode)),
            "us",
        ),
        (
            "replay_split_write_us_per_event".into(),
            per_event(write),
            "us",
        ),
    ])
}
