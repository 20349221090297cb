//! Benchmark of redeem codes, on one PostgreSQL and one Redis, in one run:
//!
//! 1. **Issue**: a batch of ISSUE_COUNT codes from creation (what the 202 answers) to its last
//!    page, by the generator the leader runs (pages of `codes.page_size`), then the `codes`
//!    projection writing one row per code. A second batch is issued by a generator stopped after
//!    three pages and resumed by another: its rows must be exactly its serials, once each.
//! 2. **Forged codes**: FORGED random codes redeemed; every one must be refused, and the run
//!    counts what reached the servers meanwhile: Redis `INFO commandstats` calls and PostgreSQL
//!    transactions of the database (`pg_stat_database`, read after its statistics are flushed).
//!    The same counters over CONTROL genuine redemptions show that they do move.
//! 3. **Redemptions on distinct codes**, CLIENTS clients split over two instances (each its own
//!    pools and caches, as two `zhihui serve` processes), each redeeming fresh codes for
//!    `SECONDS_PER_CASE`; beside the naive design in the same run and database: one transaction
//!    per redemption that selects the code row `FOR UPDATE`, checks it, marks it redeemed and
//!    credits the account (upsert) with a ledger row. Redemptions/s, p50, p99.
//! 4. **One code, 100 users at once**, both designs: exactly one success each.
//!
//! Then every projection catches up and `audit verify` runs over everything: it must be clean.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo run --release -p zhihui-bench --bin bench_codes [-- SECONDS_PER_CASE]

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use secrecy::SecretString;
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, metadata};
use zhihui::platform::configuration::Settings;
use zhihui::points::codes::issuer::CodeIssuer;
use zhihui::points::codes::{CodeService, RedeemError};
use zhihui::state::AppState;
use zhihui_domain::points::Amount;
use zhihui_domain::redeem::BatchSpec;
use zhihui_domain::user::UserId;

const CLIENTS: usize = 64;
/// Connections of each side's pool (ours: half per instance).
const POOL_SIZE: usize = 32;
const ISSUE_COUNT: u32 = 100_000;
const FORGED: usize = 10_000;
const CONTROL: usize = 100;
/// Codes of the throughput batch: more than the clients can redeem in a case.
const THROUGHPUT_CODES: u32 = 400_000;
/// PostgreSQL flushes a backend's statistics within this long of its last transaction.
const PG_STATS_SETTLE: Duration = Duration::from_secs(11);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let seconds = zhihui::cli::bench_support::seconds_per_case()?;
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into());
    Box::pin(zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = POOL_SIZE / 2;
            settings.event_store.group_commit_writers = 2;
            settings.redis.url = SecretString::from(redis_url);
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        },
        |settings| async move { Box::pin(run(&settings, seconds)).await },
    ))
    .await
}

fn instance(settings: &Settings) -> anyhow::Result<AppState> {
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    AppState::build(settings, pool, Default::default())
}

fn spec(count: u32) -> BatchSpec {
    let now = chrono::Utc::now();
    BatchSpec {
        count,
        points: Amount::whole(10),
        valid_from: now - chrono::Duration::hours(1),
        valid_until: now + chrono::Duration::days(1),
        note: "bench".into(),
    }
}

async fn run(settings: &Settings, seconds: u64) -> anyhow::Result<Vec<Figure>> {
    let a = instance(settings)?;
    let b = instance(settings)?;
    zhihui::platform::postgres::migrate(&a.pg_pool).await?;
    let mut figures: Vec<Figure> = Vec::new();

    // 1. Issue.
    let started = Instant::now();
    let batch = a
        .codes
        .create_batch(Uuid::now_v7(), spec(ISSUE_COUNT), &metadata())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let accepted = started.elapsed();
    let pages = CodeIssuer::new(a.codes.clone())
        .issue_batch(batch.batch_id, None)
        .await?;
    let issued = started.elapsed();
    let projecting = Instant::now();
    project_codes(&a).await?;
    let projected = projecting.elapsed();
    println!(
        "issue: {ISSUE_COUNT} codes in {pages} pages: created in {:.1} ms, last page {:.2} s after, rows projected in {:.2} s",
        zhihui::cli::bench_support::ms(accepted),
        issued.as_secs_f64(),
        projected.as_secs_f64()
    );
    figures.push((
        "codes_issue_100k_ms".into(),
        zhihui::cli::bench_support::ms(issued),
        "ms",
    ));
    figures.push((
        "codes_issue_100k_rows_projected_ms".into(),
        zhihui::cli::bench_support::ms(projected),
        "ms",
    ));

    let resumed = a
        .codes
        .create_batch(Uuid::now_v7(), spec(ISSUE_COUNT), &metadata())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let dying = CodeIssuer::new(a.codes.clone());
    dying.issue_batch(resumed.batch_id, Some(3)).await?;
    drop(dying);
    CodeIssuer::new(b.codes.clone())
        .issue_batch(resumed.batch_id, None)
        .await?;
    project_codes(&a).await?;
    let (rows, distinct, low, high): (i64, i64, i32, i32) = {
        let client = a.pg_pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*), count(DISTINCT serial), min(serial), max(serial)
                   FROM redeem_codes WHERE batch_id = $1",
                &[&resumed.batch_id],
            )
            .await?;
        (row.get(0), row.get(1), row.get(2), row.get(3))
    };
    let expected_low = i32::try_from(resumed.first_serial)?;
    let gapless = rows == i64::from(ISSUE_COUNT)
        && distinct == rows
        && low == expected_low
        && high == expected_low + i32::try_from(ISSUE_COUNT)? - 1;
    println!(
        "resumed after 3 pages: {rows} rows, {distinct} distinct serials, {low}..={high}: {}",
        if gapless {
            "no repeat, no gap"
        } else {
            "WRONG"
        }
    );
    anyhow::ensure!(gapless, "the resumed batch has a repeat or a gap");

    // 2. Forged codes.
    let keys = a.codes.keys().clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let forged: Vec<String> = std::iter::repeat_with(|| {
        (0..10)
            .map(|_| char::from(ALPHABET[rng.random_range(0..32)]))
            .collect::<String>()
    })
    .filter(|text| keys.decode(text).is_err())
    .take(FORGED)
    .collect();
    let counting = pg_counting(&a).await;
    let unit = match counting {
        PgCounting::Statements => "statements",
        PgCounting::Transactions => "transactions",
    };
    let counters_before = counters(&a, counting).await?;
    let mut refused = 0usize;
    let forging = Instant::now();
    for (n, text) in forged.iter().enumerate() {
        // A user per attempt: the in-memory limit would refuse a single user after 10.
        let user = UserId::from_uuid(Uuid::from_u128(n as u128 + 1));
        if matches!(
            a.codes.redeem(user, text, &metadata()).await,
            Err(RedeemError::Invalid)
        ) {
            refused += 1;
        }
    }
    let forging = forging.elapsed();
    let counters_after = counters(&a, counting).await?;
    let (redis_calls, pg_transactions) = counters_after.since(&counters_before);
    println!(
        "forged: {refused} of {FORGED} refused in {:.1} ms; meanwhile Redis calls {redis_calls}, PostgreSQL {unit} {pg_transactions}",
        zhihui::cli::bench_support::ms(forging)
    );
    anyhow::ensure!(refused == FORGED, "a forged code was not refused");

    let control_codes = first_codes(&a.codes, batch.first_serial, CONTROL);
    let control_before = counters(&a, counting).await?;
    for (n, code) in control_codes.iter().enumerate() {
        let user = UserId::from_uuid(Uuid::from_u128(1_000_000 + n as u128));
        a.codes
            .redeem(user, code, &metadata())
            .await
            .map_err(|e| anyhow::anyhow!("control redemption: {e}"))?;
    }
    let control_after = counters(&a, counting).await?;
    let (control_redis, control_pg) = control_after.since(&control_before);
    println!(
        "control: {CONTROL} genuine redemptions: Redis calls {control_redis}, PostgreSQL {unit} {control_pg}"
    );
    figures.push(("codes_forged_refused".into(), refused as f64, "codes"));
    figures.push((
        "codes_forged_redis_calls".into(),
        redis_calls as f64,
        "calls",
    ));
    figures.push((
        format!("codes_forged_pg_{unit}"),
        pg_transactions as f64,
        unit,
    ));

    // 3. Throughput on distinct codes, beside the naive design.
    let big = a
        .codes
        .create_batch(Uuid::now_v7(), spec(THROUGHPUT_CODES), &metadata())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    CodeIssuer::new(a.codes.clone())
        .issue_batch(big.batch_id, None)
        .await?;
    let (big, _) = a.codes.batch(big.batch_id).await?.context("the batch")?;
    let ours = redeem_distinct(&[a.codes.clone(), b.codes.clone()], &big, seconds).await?;
    ours.print("ours (two instances)");
    setup_naive(&a, THROUGHPUT_CODES).await?;
    let naive_pool = {
        let mut naive = settings.clone();
        naive.database.pool_max_size = POOL_SIZE;
        zhihui::platform::postgres::build_pool(&naive.database)?
    };
    let theirs = naive_distinct(&naive_pool, seconds).await?;
    theirs.print("naive FOR UPDATE");
    println!(
        "distinct codes: ours / naive = {:.2} x",
        ours.per_second / theirs.per_second
    );
    figures.push((
        "codes_redeem_distinct_64_clients".into(),
        ours.per_second,
        "redemptions/s",
    ));
    figures.push(("codes_redeem_p50".into(), ours.p50_ms, "ms"));
    figures.push(("codes_redeem_p99".into(), ours.p99_ms, "ms"));
    figures.push(("codes_redeem_errors".into(), ours.errors as f64, "errors"));
    figures.push((
        "naive_redeem_distinct_64_clients".into(),
        theirs.per_second,
        "redemptions/s",
    ));
    figures.push(("naive_redeem_p50".into(), theirs.p50_ms, "ms"));
    figures.push(("naive_redeem_p99".into(), theirs.p99_ms, "ms"));
    figures.push((
        "codes_redeem_ratio_vs_naive".into(),
        ours.per_second / theirs.per_second,
        "x",
    ));

    // 4. One code, 100 users at once.
    let contested = first_codes(&a.codes, big.first_serial + THROUGHPUT_CODES - 1, 1)
        .pop()
        .context("a code")?;
    let attempts = (0..100u128).map(|n| {
        let codes = if n % 2 == 0 { &a.codes } else { &b.codes };
        let contested = contested.clone();
        async move {
            let user = UserId::from_uuid(Uuid::from_u128(2_000_000 + n));
            codes.redeem(user, &contested, &metadata()).await
        }
    });
    let outcomes = futures::future::join_all(attempts).await;
    let won = outcomes.iter().filter(|o| o.is_ok()).count();
    let taken = outcomes
        .iter()
        .filter(|o| matches!(o, Err(RedeemError::RedeemedByAnother)))
        .count();
    println!("one code, 100 users on two instances: {won} redeemed, {taken} refused as redeemed");
    anyhow::ensure!(
        won == 1 && taken == 99,
        "one code must be redeemed exactly once"
    );
    let naive_won = naive_contested(&naive_pool).await?;
    println!("one code, 100 users, naive: {naive_won} redeemed");
    figures.push((
        "codes_one_code_100_users_successes".into(),
        won as f64,
        "successes",
    ));

    // Everything projected, then audited.
    let verified = zhihui::cli::bench_support::project_and_audit(&a, settings).await?;
    figures.push((
        "codes_audit_differences".into(),
        verified.differences.len() as f64,
        "differences",
    ));
    zhihui::cli::bench_support::clean_redis(&a).await?;
    Ok(figures)
}

fn first_codes(codes: &CodeService, first: u32, count: usize) -> Vec<String> {
    let keys = codes.keys();
    (first..)
        .take(count)
        .filter_map(|serial| keys.encode(keys.active_slot(), serial))
        .map(|code| code.to_string())
        .collect()
}

async fn project_codes(state: &AppState) -> anyhow::Result<()> {
    zhihui::platform::projector::Projector::live(
        zhihui_projections::ProjectionName::Codes,
        state.pg_pool.clone(),
        state.event_store.clone(),
        zhihui::platform::configuration::Settings::load(None)?.projections,
    )
    .catch_up()
    .await?;
    Ok(())
}

struct Counters {
    redis_calls: u64,
    /// Statements of this database (pg_stat_statements), else its transactions.
    pg: i64,
}

impl Counters {
    fn since(&self, before: &Counters) -> (u64, i64) {
        // The INFO call that read `self` is one call; the reads of `before` are one statement
        // or (statistics views) two transactions.
        (
            self.redis_calls.saturating_sub(before.redis_calls + 1),
            self.pg - before.pg,
        )
    }
}

/// How PostgreSQL work is counted: statements through pg_stat_statements when the server loads
/// it (scripts/services.sh does), else transactions of the database once their statistics are
/// flushed (which also counts autovacuum's: an upper bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PgCounting {
    Statements,
    Transactions,
}

async fn pg_counting(state: &AppState) -> PgCounting {
    let Ok(client) = state.pg_pool.get().await else {
        return PgCounting::Transactions;
    };
    match client
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset();",
        )
        .await
    {
        Ok(()) => PgCounting::Statements,
        Err(error) => {
            println!("pg_stat_statements unavailable ({error}); counting transactions instead");
            PgCounting::Transactions
        }
    }
}

/// Redis calls (every command since the server started) and PostgreSQL work so far.
async fn counters(state: &AppState, counting: PgCounting) -> anyhow::Result<Counters> {
    let client = state.pg_pool.get().await?;
    let pg = match counting {
        PgCounting::Statements => client
            .query_one(
                "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
                  WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND query NOT LIKE '%pg_stat_statements%'",
                &[],
            )
            .await?
            .get(0),
        PgCounting::Transactions => {
            tokio::time::sleep(PG_STATS_SETTLE).await;
            client
                .execute("SELECT pg_stat_clear_snapshot()", &[])
                .await?;
            let transactions: i64 = client
                .query_one(
                    "SELECT xact_commit + xact_rollback FROM pg_stat_database
                      WHERE datname = current_database()",
                    &[],
                )
                .await?
                .get(0);
            // The clear and this read are two transactions, flushed before the next read.
            transactions - 2
        }
    };
    let mut connection = state.redis.connection().await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut connection)
        .await?;
    let redis_calls = info
        .lines()
        .filter_map(|line| {
            line.split_once("calls=")?
                .1
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    Ok(Counters { redis_calls, pg })
}

struct CaseFigures {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    done: usize,
    errors: u64,
}

impl CaseFigures {
    fn new(mut latencies_us: Vec<u64>, elapsed: Duration, errors: u64) -> CaseFigures {
        latencies_us.sort_unstable();
        let percentile = |p: f64| {
            zhihui::cli::bench_support::percentile(&latencies_us, p).unwrap_or(0) as f64 / 1000.0
        };
        CaseFigures {
            per_second: latencies_us.len() as f64 / elapsed.as_secs_f64(),
            p50_ms: percentile(0.5),
            p99_ms: percentile(0.99),
            done: latencies_us.len(),
            errors,
        }
    }

    fn print(&self, side: &str) {
        println!(
            "{side:>22}: {:>7.0} redemptions/s ({} in all)  p50 {:.2} ms  p99 {:.2} ms  errors {}",
            self.per_second, self.done, self.p50_ms, self.p99_ms, self.errors
        );
    }
}

/// CLIENTS clients, each redeeming the next unused serial of `first..end` for `seconds`:
/// `redeem(client, serial)` answers whether the code was redeemed.
async fn run_clients<F, Fut>(
    seconds: u64,
    first: u32,
    end: u32,
    redeem: F,
) -> anyhow::Result<CaseFigures>
where
    F: Fn(usize, u32) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<bool>> + Send,
{
    let next = Arc::new(AtomicU32::new(first));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|index| {
            let (next, stop, redeem) = (next.clone(), stop.clone(), redeem.clone());
            tokio::spawn(async move {
                let mut latencies_us = Vec::new();
                let mut errors = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let serial = next.fetch_add(1, Ordering::Relaxed);
                    if serial >= end {
                        break;
                    }
                    let sent = Instant::now();
                    match redeem(index, serial).await {
                        Ok(true) => latencies_us.push(sent.elapsed().as_micros() as u64),
                        Ok(false) => errors += 1,
                        Err(error) => {
                            if errors == 0 {
                                eprintln!("client {index}: {error}");
                            }
                            errors += 1;
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
    Ok(CaseFigures::new(latencies, started.elapsed(), errors))
}

/// Ours: client `i` redeems through instance `i % 2`, as its own user.
async fn redeem_distinct(
    instances: &[CodeService],
    batch: &zhihui_domain::redeem::Batch,
    seconds: u64,
) -> anyhow::Result<CaseFigures> {
    let instances: Arc<Vec<CodeService>> = Arc::new(instances.to_vec());
    let users: Arc<Vec<UserId>> = Arc::new(
        (0..CLIENTS)
            .map(|_| UserId::from_uuid(Uuid::now_v7()))
            .collect(),
    );
    run_clients(
        seconds,
        batch.first_serial,
        batch.first_serial + batch.issued,
        move |index, serial| {
            let codes = instances[index % instances.len()].clone();
            let user = users[index];
            async move {
                let keys = codes.keys();
                let code = keys
                    .encode(keys.active_slot(), serial)
                    .context("a serial of the batch")?
                    .to_string();
                codes
                    .redeem(user, &code, &metadata())
                    .await
                    .map(|_| true)
                    .map_err(|error| anyhow::anyhow!("{error}"))
            }
        },
    )
    .await
}

/// The naive design's tables, in their own schema, with the same number of codes.
async fn setup_naive(state: &AppState, count: u32) -> anyhow::Result<()> {
    let client = state.pg_pool.get().await?;
    client
        .batch_execute(&format!(
            "CREATE SCHEMA naive;
             CREATE TABLE naive.codes (serial integer PRIMARY KEY, points numeric(20,2) NOT NULL,
                 valid_from timestamptz NOT NULL, valid_until timestamptz NOT NULL,
                 revoked boolean NOT NULL DEFAULT false, redeemed_by uuid, redeemed_at timestamptz);
             CREATE TABLE naive.accounts (user_id uuid PRIMARY KEY, available numeric(20,2) NOT NULL);
             CREATE TABLE naive.ledger (id bigserial PRIMARY KEY, user_id uuid NOT NULL,
                 serial integer NOT NULL, amount numeric(20,2) NOT NULL, available_after numeric(20,2) NOT NULL,
                 at timestamptz NOT NULL);
             INSERT INTO naive.codes (serial, points, valid_from, valid_until)
                  SELECT s, 10, now() - interval '1 hour', now() + interval '1 day'
                    FROM generate_series(1, {count}) s;"
        ))
        .await
        .context("creating the naive design's tables")?;
    Ok(())
}

/// One naive redemption: the code row locked, checked, marked; the account credited. Its
/// statements are prepared once per connection, as any pool with a statement cache does (sent
/// unprepared, each cost a Parse round trip and a plan per call: 116 µs of planning per
/// redemption in `pg_stat_statements`, a handicap no real implementation would carry).
async fn naive_redeem(
    pool: &deadpool_postgres::Pool,
    serial: i32,
    user: Uuid,
) -> anyhow::Result<bool> {
    let mut client = pool.get().await?;
    let transaction = client.transaction().await?;
    let lock = transaction
        .prepare_cached(
            "SELECT points, redeemed_by, revoked, valid_from <= now() AND now() < valid_until
               FROM naive.codes WHERE serial = $1 FOR UPDATE",
        )
        .await?;
    let row = transaction
        .query_opt(&lock, &[&serial])
        .await?
        .context("no such code")?;
    let points: rust_decimal::Decimal = row.get(0);
    let redeemed_by: Option<Uuid> = row.get(1);
    if redeemed_by.is_some() || row.get::<_, bool>(2) || !row.get::<_, bool>(3) {
        transaction.rollback().await?;
        return Ok(false);
    }
    let mark = transaction
        .prepare_cached(
            "UPDATE naive.codes SET redeemed_by = $2, redeemed_at = now() WHERE serial = $1",
        )
        .await?;
    transaction.execute(&mark, &[&serial, &user]).await?;
    let credit = transaction
        .prepare_cached(
            "INSERT INTO naive.accounts (user_id, available) VALUES ($1, $2)
             ON CONFLICT (user_id) DO UPDATE
             SET available = naive.accounts.available + EXCLUDED.available
             RETURNING available",
        )
        .await?;
    let available: rust_decimal::Decimal = transaction
        .query_one(&credit, &[&user, &points])
        .await?
        .get(0);
    let record = transaction
        .prepare_cached(
            "INSERT INTO naive.ledger (user_id, serial, amount, available_after, at)
             VALUES ($1, $2, $3, $4, now())",
        )
        .await?;
    transaction
        .execute(&record, &[&user, &serial, &points, &available])
        .await?;
    transaction.commit().await?;
    Ok(true)
}

async fn naive_distinct(
    pool: &deadpool_postgres::Pool,
    seconds: u64,
) -> anyhow::Result<CaseFigures> {
    let pool = pool.clone();
    let users: Arc<Vec<Uuid>> = Arc::new((0..CLIENTS).map(|_| Uuid::now_v7()).collect());
    run_clients(seconds, 1, THROUGHPUT_CODES, move |index, serial| {
        let pool = pool.clone();
        let user = users[index];
        async move { naive_redeem(&pool, i32::try_from(serial)?, user).await }
    })
    .await
}

/// 100 naive redemptions of one code by 100 users at once: the successes.
async fn naive_contested(pool: &deadpool_postgres::Pool) -> anyhow::Result<usize> {
    let serial = i32::try_from(THROUGHPUT_CODES)?;
    let attempts = (0..100).map(|_| naive_redeem(pool, serial, Uuid::now_v7()));
    let outcomes = futures::future::join_all(attempts).await;
    let mut won = 0;
    let mut failures: HashMap<String, usize> = HashMap::new();
    for outcome in outcomes {
        match outcome {
            Ok(true) => won += 1,
            Ok(false) => {}
            Err(error) => *failures.entry(error.to_string()).or_default() += 1,
        }
    }
    for (error, count) in failures {
        println!("naive contested: {count} x {error}");
    }
    Ok(won)
}
