//! Benchmark of event-store appends on PostgreSQL: 1, 8 and 32 concurrent writers, one event per
//! append, each writer on its own stream with an exact expected version, with and without group
//! commit (a batch as one `zhihui_append_batch` statement, the default, and as one
//! `zhihui_append` per append, pipelined, the design before it), beside a baseline in the same
//! run: plain single-row `INSERT`s (one transaction each, a primary key on (stream, version), the
//! same payload), the least a durable append can cost.
//! Prints events/s and p50/p99 latency, then one `RESULT <name> <value> <unit>` line per figure.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui \
//!         cargo run --release -p zhihui-bench --bin bench_event_store [-- SECONDS_PER_CASE]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's and drops it at the end.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use anyhow::Context;
use uuid::Uuid;
use zhihui::platform::configuration::Settings;
use zhihui::platform::event_store::postgres::{PostgresEventStore, PostgresEventStoreOptions};
use zhihui::platform::event_store::{EventMetadata, EventStore, ExpectedVersion, NewEvent};

const WRITER_COUNTS: [usize; 3] = [1, 8, 32];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let seconds = zhihui::cli::bench_support::seconds_per_case()?;
    zhihui::cli::bench_support::with_fresh_database(
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
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    zhihui::platform::postgres::migrate(&pool).await?;
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
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE bench_raw_events (stream_id text NOT NULL, stream_version bigint NOT NULL, \
               payload jsonb NOT NULL, PRIMARY KEY (stream_id, stream_version))",
        )
        .await?;
    let mut raw_per_second = Vec::new();
    for writers in WRITER_COUNTS {
        let run = Uuid::now_v7().simple();
        let pool = pool.clone();
        let (events_per_second, p50, p99) =
            measure(writers, Duration::from_secs(seconds), move |writer, n| {
                let pool = pool.clone();
                async move {
                    let client = pool.get().await?;
                    let insert = client
                        .prepare_cached(
                            "INSERT INTO bench_raw_events (stream_id, stream_version, payload) \
                             VALUES ($1, $2, $3)",
                        )
                        .await?;
                    client
                        .execute(
                            &insert,
                            &[
                                &format!("bench-{run}-{writer}"),
                                &i64::try_from(n)?,
                                &serde_json::json!({ "n": n }),
                            ],
                        )
                        .await?;
                    anyhow::Ok(())
                }
            })
            .await?;
        print_case("raw_insert", writers, events_per_second, p50, p99);
        raw_per_second.push(events_per_second);
        results.push((
            format!("raw_insert_{writers}w"),
            events_per_second,
            "events/s",
        ));
        results.push((
            format!("raw_insert_{writers}w_p99"),
            p99.as_secs_f64() * 1e6,
            "us",
        ));
    }
    // The group-commit batch as one statement (the default) beside the design before it: one
    // `zhihui_append` per append, pipelined in the batch's transaction.
    let mut pipelined_per_second = Vec::new();
    for (mode, group_commit, one_statement) in [
        ("single", false, true),
        ("group_pipelined", true, false),
        ("group_commit", true, true),
    ] {
        let store = PostgresEventStore::start(
            pool.clone(),
            PostgresEventStoreOptions {
                group_commit,
                group_commit_max_batch: 256,
                group_commit_writers: 2,
                group_commit_one_statement: one_statement,
                append_retries_max: 16,
                subscription_batch_size: 512,
                subscription_tail_events: 2048,
                held_back_recheck_max_ms: 50,
                subscription_idle_recheck_ms: 1_000,
                read_all_settle_max_ms: 5_000,
                listen_config: settings.database.pg_config()?,
                unknown_outcome_retry_max_ms: 30_000,
            },
        );
        for (case, writers) in WRITER_COUNTS.into_iter().enumerate() {
            let run = Uuid::now_v7().simple();
            let store = store.clone();
            let (events_per_second, p50, p99) =
                measure(writers, Duration::from_secs(seconds), move |writer, n| {
                    let store = store.clone();
                    async move {
                        let expected = match n {
                            0 => ExpectedVersion::NoStream,
                            n => ExpectedVersion::Exact(n - 1),
                        };
                        store
                            .append(&format!("bench-{run}-{writer}"), expected, vec![event(n)])
                            .await?;
                        anyhow::Ok(())
                    }
                })
                .await?;
            print_case(mode, writers, events_per_second, p50, p99);
            if mode == "group_pipelined" {
                pipelined_per_second.push(events_per_second);
            }
            if mode == "group_commit" {
                results.push((
                    format!("append_group_commit_{writers}w_ratio_vs_pipelined"),
                    events_per_second / pipelined_per_second[case],
                    "x",
                ));
            }
            results.push((
                format!("append_{mode}_{writers}w_ratio_vs_raw_insert"),
                events_per_second / raw_per_second[case],
                "x",
            ));
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

fn print_case(mode: &str, writers: usize, events_per_second: f64, p50: Duration, p99: Duration) {
    println!(
        "{mode:<14} {writers:>8} {events_per_second:>12.0} {:>10.2} {:>10.2}",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    );
}

fn event(n: u64) -> NewEvent {
    NewEvent {
        id: Uuid::now_v7(),
        event_type: "BenchmarkEventAppended".into(),
        schema_version: 1,
        payload: serde_json::json!({ "n": n }).into(),
        metadata: EventMetadata {
            correlation_id: Uuid::now_v7(),
            causation_id: None,
            actor: "system:bench".into(),
        },
    }
}

/// Run `writers` loops for `duration`; writer `w` calls `append(w, n)` for n = 0, 1, 2, ...
/// (one event each, on its own stream) and each call's latency is kept.
async fn measure<F, Fut>(
    writers: usize,
    duration: Duration,
    append: F,
) -> anyhow::Result<(f64, Duration, Duration)>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let tasks = (0..writers).map(|writer| {
        let append = append.clone();
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = 0;
            while Instant::now() < deadline {
                let begun = Instant::now();
                append(writer, n).await?;
                latencies.push(begun.elapsed());
                n += 1;
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
    let percentile =
        |p: f64| zhihui::cli::bench_support::percentile(&latencies, p).unwrap_or_default();
    Ok((
        latencies.len() as f64 / elapsed.as_secs_f64(),
        percentile(0.50),
        percentile(0.99),
    ))
}
