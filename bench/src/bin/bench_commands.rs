//! Benchmark of account commands: our command path against the cqrs-es framework, on the same
//! PostgreSQL in the same run, with the same workload: 64 clients doing freeze/release pairs of 1
//! point
//! - on distinct accounts (each client its own account, granted 1,000,000 points first), and
//! - on one hot account shared by the 64 clients, and (ours only)
//! - on one hot account with the clients split over two instances (each its own pool and account
//!   actor), every pair frozen through one and released through the other,
//!
//! for SECONDS_PER_CASE per case.
//!
//! - Ours: `AggregateService<Account>` on the PostgreSQL event store (pool of 32 connections,
//!   group commit with 4 writers). Every error a client sees is counted; there must be none.
//! - The peer, after ours: a cqrs-es `Aggregate` with the same rules and event payloads, through
//!   `postgres_es::postgres_cqrs` (the crate's default: no snapshots; no queries, as ours runs no
//!   projections here), its tables in their own schema `cqrs_peer` of the same database, a pool of
//!   32 connections (see `bench/src/cqrs_peer`). Its clients do not retry: the optimistic
//!   concurrency conflicts (`AggregateError::AggregateConflict`) they see are counted apart from
//!   other errors, and a pair whose freeze failed skips its release.
//!
//! Both sides count successful commands/s and their p50/p99 latency. It prints a table, then
//! `RESULT <name> <value> <unit>` lines, the ratios `commands_*_ratio_vs_cqrs_es` being ours /
//! theirs.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui \
//!         cargo run --release --bin bench_commands [-- SECONDS_PER_CASE]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's and drops it at the end.

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../cqrs_peer/mod.rs"]
mod cqrs_peer;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use secrecy::ExposeSecret;
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, metadata};
use zhihui::platform::aggregate::AggregateService;
use zhihui::platform::command::{CommandError, RetryPolicy};
use zhihui::platform::configuration::Settings;
use zhihui_domain::account::{Account, account_stream};
use zhihui_domain::user::UserId;

const CLIENTS: usize = 64;
/// Connections of each side's pool.
const POOL_SIZE: usize = 32;
const CASES: [(&str, bool); 2] = [("distinct", false), ("hot", true)];
/// Ours only: cqrs-es keeps no state between commands, so its `hot` case is already what any
/// number of its instances would do.
const SPLIT_CASE: &str = "hot_split";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let seconds = zhihui::cli::bench_support::seconds_per_case()?;
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = POOL_SIZE;
            settings.event_store.group_commit_writers = 4;
        },
        |settings| async move { run(&settings, seconds).await },
    )
    .await
}

/// What the clients of one case saw.
#[derive(Debug, Clone, Copy)]
struct CaseFigures {
    succeeded: usize,
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    conflicts: u64,
    other_errors: u64,
}

impl CaseFigures {
    fn new(
        mut latencies_us: Vec<u64>,
        elapsed: Duration,
        conflicts: u64,
        other_errors: u64,
    ) -> CaseFigures {
        latencies_us.sort_unstable();
        let percentile = |p: f64| {
            zhihui::cli::bench_support::percentile(&latencies_us, p).unwrap_or(0) as f64 / 1000.0
        };
        CaseFigures {
            succeeded: latencies_us.len(),
            per_second: latencies_us.len() as f64 / elapsed.as_secs_f64(),
            p50_ms: percentile(0.50),
            p99_ms: percentile(0.99),
            conflicts,
            other_errors,
        }
    }

    fn errors(&self) -> u64 {
        self.conflicts + self.other_errors
    }

    fn print(&self, side: &str, case: &str) {
        println!(
            "{side:>8} {case:>8} accounts, {CLIENTS} clients: {:>8.0} commands/s  p50 {:.2} ms  p99 {:.2} ms  errors seen by clients {} ({} conflicts)",
            self.per_second,
            self.p50_ms,
            self.p99_ms,
            self.errors(),
            self.conflicts,
        );
    }
}

async fn run(settings: &Settings, seconds: u64) -> anyhow::Result<Vec<Figure>> {
    let ours = run_ours(settings, seconds).await?;
    let split = run_split(settings, seconds).await?;
    let theirs = run_cqrs_es(settings, seconds).await?;

    println!();
    println!(
        "| side | case | commands/s | commands succeeded | p50 ms | p99 ms | conflicts | other errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (side, figures) in [("ours", &ours), ("cqrs-es", &theirs)] {
        for ((case, _), f) in CASES.iter().zip(figures) {
            println!(
                "| {side} | {case} | {:.0} | {} | {:.2} | {:.2} | {} | {} |",
                f.per_second, f.succeeded, f.p50_ms, f.p99_ms, f.conflicts, f.other_errors
            );
        }
    }
    println!(
        "| ours | {SPLIT_CASE} (two instances) | {:.0} | {} | {:.2} | {:.2} | {} | {} |",
        split.per_second,
        split.succeeded,
        split.p50_ms,
        split.p99_ms,
        split.conflicts,
        split.other_errors
    );
    for ((case, _), (ours, theirs)) in CASES.iter().zip(ours.iter().zip(&theirs)) {
        println!(
            "{case}: ours / cqrs-es = {:.1} x",
            ours.per_second / theirs.per_second
        );
    }
    println!(
        "{SPLIT_CASE}: ours on two instances / cqrs-es hot = {:.1} x, / ours hot on one = {:.2} x",
        split.per_second / theirs[1].per_second,
        split.per_second / ours[1].per_second
    );

    let mut results: Vec<Figure> = Vec::new();
    for ((case, _), f) in CASES.iter().zip(&ours) {
        results.push((
            format!("commands_{case}_64_clients"),
            f.per_second,
            "commands/s",
        ));
        results.push((
            format!("commands_{case}_errors"),
            f.errors() as f64,
            "errors",
        ));
    }
    results.push((
        format!("commands_{SPLIT_CASE}_64_clients"),
        split.per_second,
        "commands/s",
    ));
    results.push((
        format!("commands_{SPLIT_CASE}_errors"),
        split.errors() as f64,
        "errors",
    ));
    for ((case, _), f) in CASES.iter().zip(&theirs) {
        results.push((
            format!("cqrs_es_{case}_commands_per_second"),
            f.per_second,
            "commands/s",
        ));
        results.push((
            format!("cqrs_es_{case}_conflicts"),
            f.conflicts as f64,
            "conflicts",
        ));
        results.push((
            format!("cqrs_es_{case}_other_errors"),
            f.other_errors as f64,
            "errors",
        ));
    }
    for ((case, _), (ours, theirs)) in CASES.iter().zip(ours.iter().zip(&theirs)) {
        results.push((
            format!("commands_{case}_ratio_vs_cqrs_es"),
            ours.per_second / theirs.per_second,
            "x",
        ));
    }
    Ok(results)
}

/// Our side: `AggregateService<Account>` on the PostgreSQL event store, then the hot account
/// split over two instances.
async fn run_ours(settings: &Settings, seconds: u64) -> anyhow::Result<Vec<CaseFigures>> {
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    zhihui::platform::postgres::migrate(&pool).await?;
    let store = zhihui::platform::event_store::from_settings(settings, pool)?;
    let accounts: AggregateService<Account> =
        AggregateService::new(store, RetryPolicy::default(), Duration::from_secs(60));
    let mut figures = Vec::new();
    for (case, hot) in CASES {
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
        zhihui::cli::bench_support::fund(&accounts, &streams).await?;
        let case_figures = run_clients(std::slice::from_ref(&accounts), streams, seconds).await?;
        case_figures.print("ours", case);
        figures.push(case_figures);
    }
    Ok(figures)
}

/// The hot account with its clients split over two instances, as two `zhihui serve` processes
/// would be: each its own pool (half the connections) and event store, its own actor and cache.
/// Each pair freezes through one instance and releases through the other, so every release is
/// decided first on a cache that has not seen its freeze: the refusal must be confirmed on the
/// latest version and decided again, never reach the client.
async fn run_split(settings: &Settings, seconds: u64) -> anyhow::Result<CaseFigures> {
    let mut half = settings.clone();
    half.database.pool_max_size = POOL_SIZE / 2;
    half.event_store.group_commit_writers = 2;
    let mut instances = Vec::new();
    for _ in 0..2 {
        let pool = zhihui::platform::postgres::build_pool(&half.database)?;
        let store = zhihui::platform::event_store::from_settings(&half, pool)?;
        instances.push(AggregateService::<Account>::new(
            store,
            RetryPolicy::default(),
            Duration::from_secs(60),
        ));
    }
    let hot_account = account_stream(UserId::from_uuid(Uuid::now_v7()));
    let streams = vec![hot_account; CLIENTS];
    zhihui::cli::bench_support::fund(&instances[0], &streams[..1]).await?;
    let figures = run_clients(&instances, streams, seconds).await?;
    figures.print("ours", SPLIT_CASE);
    Ok(figures)
}

/// `CLIENTS` clients, client `i` on `streams[i]`, doing freeze/release pairs for `seconds`. With
/// several instances, client `i`'s freezes go through instance `i`, its releases through the next.
async fn run_clients(
    instances: &[AggregateService<Account>],
    streams: Vec<String>,
    seconds: u64,
) -> anyhow::Result<CaseFigures> {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let clients: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(index, stream)| {
            let through = [
                instances[index % instances.len()].clone(),
                instances[(index + 1) % instances.len()].clone(),
            ];
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut latencies_us = Vec::new();
                let mut conflicts = 0u64;
                let mut other_errors = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for (accounts, command) in through
                        .iter()
                        .zip(zhihui::cli::bench_support::freeze_release_pair())
                    {
                        let sent = Instant::now();
                        match accounts.execute(&stream, command, metadata()).await {
                            Ok(_) => latencies_us.push(sent.elapsed().as_micros() as u64),
                            Err(CommandError::Contended { .. }) => conflicts += 1,
                            Err(_) => other_errors += 1,
                        }
                    }
                }
                (latencies_us, conflicts, other_errors)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let (mut conflicts, mut other_errors) = (0, 0);
    for client in clients {
        let (client_latencies, client_conflicts, client_other_errors) = client.await?;
        latencies.extend(client_latencies);
        conflicts += client_conflicts;
        other_errors += client_other_errors;
    }
    Ok(CaseFigures::new(
        latencies,
        started.elapsed(),
        conflicts,
        other_errors,
    ))
}

/// The peer: the same workload through cqrs-es on postgres-es, in the same database.
async fn run_cqrs_es(settings: &Settings, seconds: u64) -> anyhow::Result<Vec<CaseFigures>> {
    let pool = cqrs_peer::connect(settings.database.url.expose_secret(), POOL_SIZE as u32).await?;
    let cqrs = Arc::new(postgres_es::postgres_cqrs::<cqrs_peer::BankAccount>(
        pool.clone(),
        vec![],
        (),
    ));
    let mut figures = Vec::new();
    for (case, hot) in CASES {
        let outcome = cqrs_peer::run_case(&cqrs, hot, CLIENTS, seconds).await?;
        if let Some(error) = &outcome.first_other_error {
            println!("cqrs-es {case}: first error other than a conflict: {error}");
        }
        println!(
            "cqrs-es {case}: {} releases skipped after a failed freeze",
            outcome.releases_skipped
        );
        let case_figures = CaseFigures::new(
            outcome.latencies_us,
            outcome.elapsed,
            outcome.conflicts,
            outcome.other_errors,
        );
        case_figures.print("cqrs-es", case);
        figures.push(case_figures);
    }
    drop(cqrs);
    pool.close().await;
    Ok(figures)
}
