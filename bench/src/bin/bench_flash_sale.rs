//! Benchmark of flash-sale claims, on one PostgreSQL and one Redis, in one run:
//!
//! 1. **Ours**: CLAIMS claims from CLAIMS distinct users on a stock of CLAIMS, CLIENTS clients
//!    split over two instances (each its own pools and caches, as two `zhihui serve` processes),
//!    while both instances' claims consumers run. Accepted claims/s at the gate and the gate's
//!    p50/p99; claims persisted/s end to end (reserved, granted, credited: from the first claim
//!    to the last `claim_granted` notification) and the p50/p99 of each claim's gate-to-granted
//!    time. A burst offered faster than it is persisted queues, so its p99 is the burst's length;
//!    then **paced**: PACED_RATE claims a second (default 2,000) for PACED_SECONDS on a second
//!    promotion, each sent at its due time whether or not earlier ones were answered (an open
//!    loop), and the p50/p99 from each claim's due time to its `claim_granted` notification.
//!    `flash_paced_offered_per_second` is the rate the sender achieved (claims over the time it
//!    took to send them), not the one it was asked for.
//! 2. **The seed's approach**, same run and database: one transaction per claim that inserts the
//!    (promotion, user) row (unique: one per user), decrements `stock` with `WHERE stock > 0` on
//!    the promotion's row and credits the account row. Claims/s, p50/p99.
//! 3. **2,000 claims on a stock of 100**, both designs: exactly 100 granted, no user twice.
//!
//! Then every projection catches up and `audit verify` runs over everything: it must be clean.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo run --release -p zhihui-bench --bin bench_flash_sale [-- CLAIMS [PACED_RATE]]

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use secrecy::SecretString;
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, metadata, ms, percentile};
use zhihui::platform::configuration::Settings;
use zhihui::platform::notify::Envelope;
use zhihui::points::promotions::ClaimError;
use zhihui::state::AppState;
use zhihui_domain::points::Amount;
use zhihui_domain::promotion::PromotionSpec;
use zhihui_domain::user::UserId;

const CLIENTS: usize = 64;
/// Connections of each side's pool (ours: half per instance).
const POOL_SIZE: usize = 32;
/// How long the persistence may take before the run gives up.
const PERSIST_LIMIT: Duration = Duration::from_secs(300);
/// How long the paced phase offers claims.
const PACED_SECONDS: u32 = 5;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let claims: usize = match std::env::args().nth(1) {
        Some(text) => text.parse().context("CLAIMS must be a number")?,
        None => 20_000,
    };
    let paced_rate: u32 = match std::env::args().nth(2) {
        Some(text) => text.parse().context("PACED_RATE must be a number")?,
        None => 2_000,
    };
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into());
    Box::pin(zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = POOL_SIZE / 2;
            settings.redis.url = SecretString::from(redis_url);
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        },
        |settings| async move { Box::pin(run(&settings, claims, paced_rate)).await },
    ))
    .await
}

fn instance(settings: &Settings) -> anyhow::Result<AppState> {
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    AppState::build(settings, pool, Default::default())
}

fn spec(stock: u32) -> PromotionSpec {
    let now = chrono::Utc::now();
    PromotionSpec {
        title: "bench pack".into(),
        points: Amount::whole(10),
        price: None,
        stock,
        starts_at: now - chrono::Duration::hours(1),
        ends_at: now + chrono::Duration::hours(1),
    }
}

struct Latencies {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

impl Latencies {
    fn of(count: usize, elapsed: Duration, mut latencies: Vec<Duration>) -> Latencies {
        latencies.sort();
        Latencies {
            per_second: count as f64 / elapsed.as_secs_f64(),
            p50_ms: percentile(&latencies, 0.50).map_or(0.0, ms),
            p99_ms: percentile(&latencies, 0.99).map_or(0.0, ms),
        }
    }

    fn print(&self, what: &str) {
        println!(
            "  {what:<34} {:>8.0}/s  p50 {:>7.2} ms  p99 {:>7.2} ms",
            self.per_second, self.p50_ms, self.p99_ms
        );
    }
}

async fn run(settings: &Settings, claims: usize, paced_rate: u32) -> anyhow::Result<Vec<Figure>> {
    let a = instance(settings)?;
    let b = instance(settings)?;
    zhihui::platform::postgres::migrate(&a.pg_pool).await?;
    let mut figures: Vec<Figure> = Vec::new();
    let stock = u32::try_from(claims)?;

    // 1. Ours: the gate on two instances, both consumers running.
    let promotion = Uuid::now_v7();
    a.promotions
        .create(promotion, spec(stock), metadata())
        .await
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    let granted_at: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let mut notifications = a.hub.subscribe().await?;
    let listener = {
        let granted_at = granted_at.clone();
        tokio::spawn(async move {
            while let Ok(envelope) = notifications.recv().await {
                if let Envelope::Claim {
                    claim_id,
                    granted: true,
                    ..
                } = envelope
                {
                    granted_at
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(claim_id, Instant::now());
                }
            }
        })
    };
    let consumers = [
        tokio::spawn(a.promotions.clone().run_consumer("bench-a".into())),
        tokio::spawn(b.promotions.clone().run_consumer("bench-b".into())),
    ];
    let started = Instant::now();
    let gate: Vec<(Uuid, Instant, Duration)> = futures::stream::iter(0..claims)
        .map(|index| {
            let promotions = if index % 2 == 0 {
                a.promotions.clone()
            } else {
                b.promotions.clone()
            };
            async move {
                let user = UserId::from_uuid(Uuid::now_v7());
                let sent = Instant::now();
                let claim_id = promotions.claim(user, promotion).await?;
                anyhow::Ok((claim_id, sent, sent.elapsed()))
            }
        })
        .buffer_unordered(CLIENTS)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    let gate_elapsed = started.elapsed();
    let accepted = Latencies::of(
        gate.len(),
        gate_elapsed,
        gate.iter().map(|(_, _, latency)| *latency).collect(),
    );
    // Wait for every claim to be persisted (granted and credited: the notification follows the
    // credit).
    wait_for_grants(&granted_at, claims, started).await?;
    let persisted_elapsed = started.elapsed();
    let end_to_end = grant_latencies(&granted_at, &gate);
    let persisted = Latencies::of(claims, persisted_elapsed, end_to_end);
    println!(
        "{claims} claims from {claims} users on a stock of {stock}, {CLIENTS} clients on two instances:"
    );
    accepted.print("ours: accepted at the gate");
    persisted.print("ours: persisted end to end");

    // 1b. Paced: claims offered at `paced_rate` a second, on a promotion of their own.
    let paced_claims = usize::try_from(paced_rate * PACED_SECONDS)?;
    let paced_promotion = Uuid::now_v7();
    a.promotions
        .create(
            paced_promotion,
            spec(u32::try_from(paced_claims)?),
            metadata(),
        )
        .await
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    let every = Duration::from_secs(1) / paced_rate;
    let started = Instant::now();
    let mut sent = Vec::with_capacity(paced_claims);
    for index in 0..paced_claims {
        // Due at its place in the schedule, sent then without waiting for the ones before it: a
        // slow answer delays no later claim, and its latency counts from when it was due. A
        // sleep ends on the timer's next millisecond at the earliest, so each wake sends every
        // claim due by then.
        let due = started + every * u32::try_from(index)?;
        if due > Instant::now() {
            tokio::time::sleep_until(due.into()).await;
        }
        let promotions = if index % 2 == 0 {
            a.promotions.clone()
        } else {
            b.promotions.clone()
        };
        sent.push(tokio::spawn(async move {
            let claim_id = promotions
                .claim(UserId::from_uuid(Uuid::now_v7()), paced_promotion)
                .await?;
            anyhow::Ok((claim_id, due, due.elapsed()))
        }));
    }
    let sending = started.elapsed();
    let mut paced_gate = Vec::with_capacity(paced_claims);
    for claim in sent {
        paced_gate.push(claim.await??);
    }
    wait_for_grants(&granted_at, claims + paced_claims, started).await?;
    let paced_elapsed = started.elapsed();
    let paced_accepted = Latencies::of(
        paced_claims,
        paced_elapsed,
        paced_gate.iter().map(|(_, _, latency)| *latency).collect(),
    );
    let paced = Latencies::of(
        paced_claims,
        paced_elapsed,
        grant_latencies(&granted_at, &paced_gate),
    );
    // What was offered is what the sender achieved, not the rate it was asked for: a sender
    // that fell behind its schedule offered less, and the latencies are of that lower rate.
    let paced_offered = paced_claims as f64 / sending.as_secs_f64().max(f64::EPSILON);
    println!(
        "{paced_claims} claims scheduled at {paced_rate}/s for {PACED_SECONDS} s, sent in {:.2} s: offered {paced_offered:.0}/s:",
        sending.as_secs_f64()
    );
    paced_accepted.print("ours paced: accepted at the gate");
    paced.print("ours paced: persisted end to end");

    // 2. The seed's approach.
    let naive_pool = {
        let mut naive = settings.clone();
        naive.database.pool_max_size = POOL_SIZE;
        zhihui::platform::postgres::build_pool(&naive.database)?
    };
    setup_naive(&naive_pool).await?;
    let naive_promotion = create_naive(&naive_pool, stock).await?;
    let started = Instant::now();
    let outcomes: Vec<(bool, Duration)> = futures::stream::iter(0..claims)
        .map(|_| {
            let pool = naive_pool.clone();
            async move {
                let sent = Instant::now();
                let won = naive_claim(&pool, naive_promotion, Uuid::now_v7()).await?;
                anyhow::Ok((won, sent.elapsed()))
            }
        })
        .buffer_unordered(CLIENTS)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    let naive_elapsed = started.elapsed();
    anyhow::ensure!(
        outcomes.iter().all(|(won, _)| *won),
        "the naive design sold out early"
    );
    let naive = Latencies::of(
        claims,
        naive_elapsed,
        outcomes.iter().map(|(_, latency)| *latency).collect(),
    );
    naive.print("seed: transaction per claim");
    println!(
        "  ratios: gate / seed {:.2} x, persisted / seed {:.2} x",
        accepted.per_second / naive.per_second,
        persisted.per_second / naive.per_second
    );
    figures.push((
        "flash_gate_accepted_per_second".into(),
        accepted.per_second,
        "claims/s",
    ));
    figures.push(("flash_gate_p50".into(), accepted.p50_ms, "ms"));
    figures.push(("flash_gate_p99".into(), accepted.p99_ms, "ms"));
    figures.push((
        "flash_persisted_per_second".into(),
        persisted.per_second,
        "claims/s",
    ));
    figures.push(("flash_persisted_p50".into(), persisted.p50_ms, "ms"));
    figures.push(("flash_persisted_p99".into(), persisted.p99_ms, "ms"));
    figures.push((
        "flash_paced_offered_per_second".into(),
        paced_offered,
        "claims/s",
    ));
    figures.push(("flash_paced_gate_p99".into(), paced_accepted.p99_ms, "ms"));
    figures.push(("flash_paced_persisted_p50".into(), paced.p50_ms, "ms"));
    figures.push(("flash_paced_persisted_p99".into(), paced.p99_ms, "ms"));
    figures.push((
        "seed_claims_per_second".into(),
        naive.per_second,
        "claims/s",
    ));
    figures.push(("seed_claim_p50".into(), naive.p50_ms, "ms"));
    figures.push(("seed_claim_p99".into(), naive.p99_ms, "ms"));
    figures.push((
        "flash_gate_ratio_vs_seed".into(),
        accepted.per_second / naive.per_second,
        "x",
    ));

    // 3. 2,000 claims on a stock of 100, both designs.
    let small = Uuid::now_v7();
    a.promotions
        .create(small, spec(100), metadata())
        .await
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    let rush: Vec<Result<Uuid, ClaimError>> = futures::stream::iter(0..2_000)
        .map(|index| {
            let promotions = if index % 2 == 0 {
                a.promotions.clone()
            } else {
                b.promotions.clone()
            };
            async move {
                promotions
                    .claim(UserId::from_uuid(Uuid::now_v7()), small)
                    .await
            }
        })
        .buffer_unordered(CLIENTS)
        .collect()
        .await;
    let won = rush.iter().filter(|outcome| outcome.is_ok()).count();
    let sold_out = rush
        .iter()
        .filter(|outcome| matches!(outcome, Err(ClaimError::SoldOut)))
        .count();
    let naive_small = create_naive(&naive_pool, 100).await?;
    let naive_rush: Vec<bool> = futures::stream::iter(0..2_000)
        .map(|_| {
            let pool = naive_pool.clone();
            async move { naive_claim(&pool, naive_small, Uuid::now_v7()).await }
        })
        .buffer_unordered(CLIENTS)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    let naive_won = naive_rush.iter().filter(|won| **won).count();
    println!(
        "2000 claims on a stock of 100: ours {won} accepted, {sold_out} sold-out; seed {naive_won} granted"
    );
    anyhow::ensure!(
        won == 100 && sold_out == 1_900,
        "the gate must accept exactly the stock"
    );
    let started = Instant::now();
    loop {
        let state = a.promotions.load(small).await?.context("the promotion")?;
        if state.granted == 100 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < PERSIST_LIMIT,
            "{} of 100 granted",
            state.granted
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    figures.push(("flash_2000_on_100_granted".into(), won as f64, "claims"));
    figures.push((
        "seed_2000_on_100_granted".into(),
        naive_won as f64,
        "claims",
    ));
    for consumer in consumers {
        consumer.abort();
    }
    listener.abort();

    // Everything projected, then audited.
    let verified = zhihui::cli::bench_support::project_and_audit(&a, settings).await?;
    figures.push((
        "flash_audit_differences".into(),
        verified.differences.len() as f64,
        "differences",
    ));
    zhihui::cli::bench_support::clean_redis(&a).await?;
    Ok(figures)
}

/// Wait until `wanted` claims were granted (across every phase so far).
async fn wait_for_grants(
    granted_at: &Mutex<HashMap<Uuid, Instant>>,
    wanted: usize,
    started: Instant,
) -> anyhow::Result<()> {
    loop {
        let done = granted_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        if done >= wanted {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < PERSIST_LIMIT,
            "{done} of {wanted} claims persisted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Each claim's time from when it was sent (or due) to its grant.
fn grant_latencies(
    granted_at: &Mutex<HashMap<Uuid, Instant>>,
    claims: &[(Uuid, Instant, Duration)],
) -> Vec<Duration> {
    let granted_at = granted_at
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    claims
        .iter()
        .filter_map(|(claim_id, sent, _)| granted_at.get(claim_id).map(|at| *at - *sent))
        .collect()
}

async fn setup_naive(pool: &deadpool_postgres::Pool) -> anyhow::Result<()> {
    let client = pool.get().await?;
    client
        .batch_execute(
            "CREATE SCHEMA naive;
             CREATE TABLE naive.promotions (id uuid PRIMARY KEY, points numeric(20,2) NOT NULL,
                 stock integer NOT NULL);
             CREATE TABLE naive.claims (promotion_id uuid NOT NULL, user_id uuid NOT NULL,
                 at timestamptz NOT NULL, PRIMARY KEY (promotion_id, user_id));
             CREATE TABLE naive.accounts (user_id uuid PRIMARY KEY, available numeric(20,2) NOT NULL);",
        )
        .await
        .context("creating the seed design's tables")?;
    Ok(())
}

async fn create_naive(pool: &deadpool_postgres::Pool, stock: u32) -> anyhow::Result<Uuid> {
    let id = Uuid::now_v7();
    pool.get()
        .await?
        .execute(
            "INSERT INTO naive.promotions (id, points, stock) VALUES ($1, 10, $2)",
            &[&id, &i32::try_from(stock)?],
        )
        .await?;
    Ok(id)
}

/// One claim the seed's way: one per user (the primary key), the stock decremented only while
/// above zero, the account credited; all in one transaction. False when sold out or claimed.
/// Its statements are prepared once per connection, as any pool with a statement cache does.
async fn naive_claim(
    pool: &deadpool_postgres::Pool,
    promotion: Uuid,
    user: Uuid,
) -> anyhow::Result<bool> {
    let mut client = pool.get().await?;
    let transaction = client.transaction().await?;
    let claim = transaction
        .prepare_cached(
            "INSERT INTO naive.claims (promotion_id, user_id, at) VALUES ($1, $2, now())
             ON CONFLICT DO NOTHING",
        )
        .await?;
    let inserted = transaction.execute(&claim, &[&promotion, &user]).await?;
    if inserted == 0 {
        return Ok(false);
    }
    let decrement = transaction
        .prepare_cached(
            "UPDATE naive.promotions SET stock = stock - 1 WHERE id = $1 AND stock > 0
             RETURNING points",
        )
        .await?;
    let decremented = transaction.query_opt(&decrement, &[&promotion]).await?;
    let Some(row) = decremented else {
        transaction.rollback().await?;
        return Ok(false);
    };
    let points: rust_decimal::Decimal = row.get(0);
    let credit = transaction
        .prepare_cached(
            "INSERT INTO naive.accounts (user_id, available) VALUES ($1, $2)
             ON CONFLICT (user_id) DO UPDATE
             SET available = naive.accounts.available + EXCLUDED.available",
        )
        .await?;
    transaction.execute(&credit, &[&user, &points]).await?;
    transaction.commit().await?;
    Ok(true)
}
