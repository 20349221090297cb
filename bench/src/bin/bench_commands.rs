//! Benchmark of account commands through the real command path (`AggregateService<Account>` on
//! the PostgreSQL event store): freeze/release pairs
//! - on distinct accounts (each client its own account), and
//! - on one hot account shared by 64 clients,
//!
//! printing commands/s, p50/p99 latency and the errors clients saw (conflicts must be zero), then
//! `RESULT <name> <value> <unit>` lines.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui \
//!         cargo run --release --bin bench_commands [-- SECONDS_PER_CASE]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's and drops it at the end.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use uuid::Uuid;
use zhihui::aggregate::AggregateService;
use zhihui::bench_support::metadata;
use zhihui::command::RetryPolicy;
use zhihui::configuration::Settings;
use zhihui_domain::account::{Account, AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

const CLIENTS: usize = 64;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seconds = zhihui::bench_support::seconds_per_case()?;
    zhihui::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = 32;
            settings.event_store.group_commit_writers = 4;
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
    let store = zhihui::event_store::from_settings(settings, pool)?;
    let accounts: AggregateService<Account> =
        AggregateService::new(store, RetryPolicy::default(), Duration::from_secs(60));
    let mut results = Vec::new();
    for (case, hot) in [("distinct", false), ("hot", true)] {
        let hot_account = UserId::from_uuid(Uuid::now_v7());
        let streams: Vec<String> = (0..CLIENTS)
            .map(|_| {
                account_stream(if hot {
                    hot_account
                } else {
                    UserId::from_uuid(Uuid::now_v7())
                })
            })
            .collect();
        for stream in &streams {
            accounts
                .execute(
                    stream,
                    AccountCommand::Grant {
                        operation_id: Uuid::now_v7(),
                        amount: Amount::whole(1_000_000),
                        reason: "bench".into(),
                        at: chrono::Utc::now(),
                    },
                    metadata(),
                )
                .await
                .map_err(|error| anyhow::anyhow!("{error}"))?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let clients: Vec<_> = streams
            .into_iter()
            .map(|stream| {
                let accounts = accounts.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut latencies_us = Vec::new();
                    let mut errors = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let hold_id = Uuid::now_v7();
                        for command in [
                            AccountCommand::Freeze {
                                hold_id,
                                amount: Amount::whole(1),
                                at: chrono::Utc::now(),
                            },
                            AccountCommand::ReleaseHold {
                                hold_id,
                                reason: "bench".into(),
                                at: chrono::Utc::now(),
                            },
                        ] {
                            let sent = Instant::now();
                            match accounts.execute(&stream, command, metadata()).await {
                                Ok(_) => latencies_us.push(sent.elapsed().as_micros() as u64),
                                Err(_) => errors += 1,
                            }
                        }
                    }
                    (latencies_us, errors)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        stop.store(true, Ordering::Relaxed);
        let mut latencies = Vec::new();
        let mut errors = 0;
        for client in clients {
            let (client_latencies, client_errors) = client.await?;
            latencies.extend(client_latencies);
            errors += client_errors;
        }
        let elapsed = started.elapsed().as_secs_f64();
        latencies.sort_unstable();
        let per_second = latencies.len() as f64 / elapsed;
        let percentile = |p: f64| {
            latencies
                .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0) as f64
                / 1000.0
        };
        println!(
            "{case:>8} accounts, {CLIENTS} clients: {per_second:>8.0} commands/s  p50 {:.2} ms  p99 {:.2} ms  errors seen by clients {errors}",
            percentile(0.50),
            percentile(0.99)
        );
        results.push((
            format!("commands_{case}_64_clients"),
            per_second,
            "commands/s",
        ));
        results.push((format!("commands_{case}_errors"), errors as f64, "errors"));
    }
    Ok(results)
}
