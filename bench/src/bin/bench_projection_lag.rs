//! Benchmark of projection lag under load: the live ledger runner (`Projector::run`: leader lock,
//! subscription, batches) follows the log while clients run freeze/release commands, and every
//! event's lag is measured from its `recorded_at` (the start of the transaction that appended it,
//! so the append's own commit is included) to the commit of the read-model batch that applied it.
//!
//! Two cases, each SECONDS long (default 5): 64 clients as fast as they go (saturated, the
//! machine's two cores shared by clients, PostgreSQL and the runner), and a paced 1,000
//! commands/s. Every event appended in a case is measured in it: the case ends when the runner
//! has reported as many lags as the clients appended events (a case that cannot is an error). Prints p50/p99/max per case, then `RESULT projection_lag_p99_ms <value> ms` for the
//! saturated case.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui \
//!         cargo run --release --bin bench_projection_lag [-- SECONDS]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's and drops it at the end.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use uuid::Uuid;
use zhihui::cli::bench_support::metadata;
use zhihui::platform::aggregate::AggregateService;
use zhihui::platform::command::RetryPolicy;
use zhihui_domain::account::{Account, account_stream};
use zhihui_domain::user::UserId;
use zhihui_projections::ProjectionName;

const CLIENTS: usize = 64;
const PACED_COMMANDS_PER_SECOND: u64 = 1_000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let seconds = zhihui::cli::bench_support::seconds_per_case()?;
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = 32;
            settings.event_store.group_commit_writers = 4;
        },
        |settings| async move { run(&settings, seconds).await },
    )
    .await
}

async fn freeze_release(accounts: &AggregateService<Account>, stream: &str) -> anyhow::Result<()> {
    for command in zhihui::cli::bench_support::freeze_release_pair() {
        accounts
            .execute(stream, command, metadata())
            .await
            .map_err(|error| anyhow::anyhow!("{error}"))?;
    }
    Ok(())
}

async fn run(
    settings: &zhihui::platform::configuration::Settings,
    seconds: u64,
) -> anyhow::Result<Vec<zhihui::cli::bench_support::Figure>> {
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    zhihui::platform::postgres::migrate(&pool).await?;
    let store = zhihui::platform::event_store::from_settings(settings, pool.clone())?;
    let accounts: AggregateService<Account> = AggregateService::new(
        store.clone(),
        RetryPolicy::default(),
        Duration::from_secs(60),
    );
    let streams: Vec<String> = (0..CLIENTS)
        .map(|_| account_stream(UserId::from_uuid(Uuid::now_v7())))
        .collect();
    zhihui::cli::bench_support::fund(&accounts, &streams).await?;

    let (observer, mut lags) = tokio::sync::mpsc::unbounded_channel();
    let runner = zhihui::platform::projector::Projector::live(
        ProjectionName::Ledger,
        pool.clone(),
        store.clone(),
        settings.projections.clone(),
    )
    .with_lag_observer(observer);
    let statuses = zhihui::platform::projector::Statuses::default();
    let runner = tokio::spawn(runner.run(statuses));
    // Let it take the lead and apply the grants before measuring.
    tokio::time::sleep(Duration::from_secs(2)).await;
    while lags.try_recv().is_ok() {}

    let mut results = Vec::new();
    for (case, paced) in [("saturated", false), ("paced", true)] {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let clients: Vec<_> = streams
            .iter()
            .cloned()
            .enumerate()
            .map(|(client, stream)| {
                let accounts = accounts.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    // Paced: each client sends its share of the rate (two commands per pair).
                    let pair_every = Duration::from_micros(
                        2 * 1_000_000 * CLIENTS as u64 / PACED_COMMANDS_PER_SECOND,
                    );
                    // Spread the clients over the period: a steady rate, not bursts of 64.
                    let phase = pair_every * u32::try_from(client).unwrap_or(0)
                        / u32::try_from(CLIENTS).unwrap_or(1);
                    let mut ticks =
                        tokio::time::interval_at(tokio::time::Instant::now() + phase, pair_every);
                    let mut commands = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        if paced {
                            ticks.tick().await;
                        }
                        freeze_release(&accounts, &stream).await?;
                        commands += 2;
                    }
                    anyhow::Ok(commands)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        stop.store(true, Ordering::Relaxed);
        let mut commands = 0;
        for client in clients {
            commands += client.await??;
        }
        let elapsed = started.elapsed().as_secs_f64();
        // Every event counted: each command appended one, and the runner reports one lag per
        // event it applied, so wait for exactly as many lags as commands (the slowest come last;
        // a fixed wait would drop them from this case and count them in the next).
        let expected = usize::try_from(commands)?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut samples = Vec::with_capacity(expected);
        while samples.len() < expected {
            match tokio::time::timeout_at(deadline, lags.recv()).await {
                Ok(Some(batch)) => samples.extend(batch),
                Ok(None) => anyhow::bail!("the runner stopped"),
                Err(_) => anyhow::bail!(
                    "the runner applied {} of the {expected} events appended within 60 s",
                    samples.len()
                ),
            }
        }
        anyhow::ensure!(
            samples.len() == expected,
            "{} lags for {expected} events: the runner applied events nobody appended",
            samples.len()
        );
        samples.sort_unstable();
        let percentile = |p: f64| {
            zhihui::cli::bench_support::percentile(&samples, p).unwrap_or(0) as f64 / 1000.0
        };
        let (p50, p99, max) = (percentile(0.50), percentile(0.99), percentile(1.0));
        println!(
            "{case:>9}: {:.0} commands/s, {commands} events appended, {} applied and measured; lag p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms",
            commands as f64 / elapsed,
            samples.len()
        );
        if !paced {
            results.push(("projection_lag_p99_ms".into(), p99, "ms"));
        } else {
            results.push(("projection_lag_paced_p99_ms".into(), p99, "ms"));
        }
    }
    runner.abort();
    Ok(results)
}
