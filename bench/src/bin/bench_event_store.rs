//! Benchmark of event-store appends on PostgreSQL: 1, 8 and 32 concurrent writers, one event per
//! append, each writer on its own stream with an exact expected version, with and without group
//! commit. Prints events/s and p50/p99 latency, then one `RESULT <name> <value> <unit>` line per
//! figure.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui \
//!         cargo run --release --bin bench_event_store [-- SECONDS_PER_CASE]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's and drops it at the end.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use anyhow::Context;
use uuid::Uuid;
use zhihui::configuration::Settings;
use zhihui::event_store::postgres::{PostgresEventStore, PostgresEventStoreOptions};
use zhihui::event_store::{EventMetadata, EventStore, ExpectedVersion, NewEvent};

const WRITER_COUNTS: [usize; 3] = [1, 8, 32];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seconds = zhihui::bench_support::seconds_per_case()?;
    zhihui::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = 48;
        },
        |settings| async move { run(&settings, seconds).await },
    )
    .await
}

async fn run(
    settings: &Settings,
    seconds: u64,
) -> anyhow::Result<Vec<(String, f64, &'static str)>> {
    let pool = zhihui::postgres::build_pool(&settings.database)?;
    zhihui::postgres::migrate(&pool).await?;
    let row = pool
        .get()
        .await?
        .query_one(
            "SELECT current_setting('server_version'), current_setting('fsync'), \
                    current_setting('synchronous_commit')",
            &[],
        )
        .await?;
    let (server_version, fsync, synchronous_commit): (String, String, String) =
        (row.get(0), row.get(1), row.get(2));
    println!(
        "PostgreSQL {server_version}, fsync={fsync}, synchronous_commit={synchronous_commit}, {} s per case",
        seconds
    );
    println!(
        "{:<14} {:>8} {:>12} {:>10} {:>10}",
        "mode", "writers", "events/s", "p50 ms", "p99 ms"
    );
    let mut results = Vec::new();
    for group_commit in [false, true] {
        let store = PostgresEventStore::start(
            pool.clone(),
            PostgresEventStoreOptions {
                group_commit,
                group_commit_max_batch: 256,
                group_commit_writers: 2,
                append_retries_max: 16,
                subscription_batch_size: 512,
                held_back_recheck_max_ms: 50,
                read_all_settle_max_ms: 5_000,
                listen_config: settings.database.pg_config()?,
            },
        );
        for writers in WRITER_COUNTS {
            let (events_per_second, p50, p99) =
                measure(&store, writers, Duration::from_secs(seconds)).await?;
            let mode = if group_commit {
                "group_commit"
            } else {
                "single"
            };
            println!(
                "{mode:<14} {writers:>8} {events_per_second:>12.0} {:>10.2} {:>10.2}",
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3
            );
            results.push((
                format!("append_{mode}_{writers}w"),
                events_per_second,
                "events/s",
            ));
            results.push((
                format!("append_{mode}_{writers}w_p99"),
                p99.as_secs_f64() * 1e6,
                "us",
            ));
        }
    }
    Ok(results)
}

/// Run `writers` loops for `duration`; each appends one event at a time to its own stream.
async fn measure(
    store: &PostgresEventStore,
    writers: usize,
    duration: Duration,
) -> anyhow::Result<(f64, Duration, Duration)> {
    let started = Instant::now();
    let deadline = started + duration;
    let tasks = (0..writers).map(|_| {
        let store = store.clone();
        tokio::spawn(async move {
            let stream = format!("bench-{}", Uuid::now_v7().simple());
            let mut latencies = Vec::new();
            let mut expected = ExpectedVersion::NoStream;
            while Instant::now() < deadline {
                let event = NewEvent {
                    id: Uuid::now_v7(),
                    event_type: "BenchmarkEventAppended".into(),
                    schema_version: 1,
                    payload: serde_json::json!({ "n": latencies.len() }),
                    metadata: EventMetadata {
                        correlation_id: Uuid::now_v7(),
                        causation_id: None,
                        actor: "system:bench".into(),
                    },
                };
                let begun = Instant::now();
                let outcome = store.append(&stream, expected, vec![event]).await?;
                latencies.push(begun.elapsed());
                expected = ExpectedVersion::Exact(outcome.stream_version);
            }
            anyhow::Ok(latencies)
        })
    });
    let mut latencies = Vec::new();
    for task in futures::future::join_all(tasks).await {
        latencies.extend(task.context("writer panicked")??);
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let percentile = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Ok((
        latencies.len() as f64 / elapsed.as_secs_f64(),
        percentile(0.50),
        percentile(0.99),
    ))
}
