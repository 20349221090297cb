//! Benchmark of daily active users (HyperLogLog per day), on one Redis:
//!
//! USERS synthetic users over DAYS days, each day a different share of them active (a seeded
//! random draw per user and day). Every day's users are counted through `ActiveUsers::record`
//! (PFADD, CHUNK users per call), then `ActiveUsers::report` answers each day and the distinct
//! users over the week (PFCOUNT of the days' keys). The run compares each with the exact count
//! and prints the relative error (target: under 1 %), the memory of one day (`MEMORY USAGE` of
//! its keys) and the time to count; once with one HyperLogLog per day, once with the default
//! shards (`stats.active_users_shards`). The peer, same run and Redis: the exact design, one
//! Redis SET per day (SADD, SCARD), for the first day: its memory and its time.
//!
//!     REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo run --release -p zhihui-bench --bin bench_active_users [-- USERS]

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Instant;

use anyhow::Context;
use chrono::NaiveDate;
use rand::{Rng, SeedableRng};
use secrecy::SecretString;
use uuid::Uuid;
use zhihui::identity::active_users::ActiveUsers;
use zhihui::platform::clock::Clock;
use zhihui::platform::configuration::Settings;
use zhihui::platform::redis_store::RedisConnection;
use zhihui::platform::redis_store::RedisStore;

const DAYS: usize = 7;
/// The share of users active on each day.
const SHARES: [f64; DAYS] = [0.30, 0.45, 0.60, 0.75, 0.90, 0.20, 0.50];
/// Users per `record` call (PFADD) and per SADD.
const CHUNK: usize = 10_000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let users: usize = match std::env::args().nth(1) {
        Some(text) => text.parse().context("USERS must be a number")?,
        None => 1_000_000,
    };
    let mut settings = Settings::load(None)?;
    settings.redis.url = SecretString::from(
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
    );
    settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
    let redis = RedisStore::new(&settings.redis)?;
    let result = run(&redis, &settings, users).await;
    // Leave nothing behind.
    let mut connection = redis.connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", redis.key_prefix()))
        .query_async(&mut connection)
        .await?;
    if !keys.is_empty() {
        redis::cmd("DEL")
            .arg(&keys)
            .query_async::<i64>(&mut connection)
            .await?;
    }
    result
}

/// The synthetic population: ids, and per user a mask of the days it is active (bit d: day d).
struct Population {
    ids: Vec<Uuid>,
    masks: Vec<u8>,
    days: Vec<NaiveDate>,
}

impl Population {
    fn active_on(&self, day: usize) -> Vec<Uuid> {
        self.ids
            .iter()
            .zip(&self.masks)
            .filter(|(_, mask)| *mask & (1 << day) != 0)
            .map(|(id, _)| *id)
            .collect()
    }

    fn exact(&self, day: usize) -> usize {
        self.masks
            .iter()
            .filter(|mask| *mask & (1 << day) != 0)
            .count()
    }
}

async fn run(redis: &RedisStore, settings: &Settings, users: usize) -> anyhow::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(20_261_124);
    let masks: Vec<u8> = (0..users)
        .map(|_| {
            SHARES.iter().enumerate().fold(0u8, |mask, (day, share)| {
                if rng.random_bool(*share) {
                    mask | (1 << day)
                } else {
                    mask
                }
            })
        })
        .collect();
    let first_day = NaiveDate::from_ymd_opt(2027, 3, 1).context("a day")?;
    let population = Population {
        ids: (0..users).map(|_| Uuid::now_v7()).collect(),
        masks,
        days: first_day.iter_days().take(DAYS).collect(),
    };
    println!("{users} users over {DAYS} days");
    let mut connection = redis.connection().await?;
    let mut figures: Vec<(String, f64, &str)> = Vec::new();
    let mut day0_estimate = 0;
    for shards in [1, settings.stats.active_users_shards] {
        let mut stats = settings.stats.clone();
        stats.active_users_shards = shards;
        let mut scoped = settings.redis.clone();
        scoped.key_prefix = format!("{}:shards{shards}", redis.key_prefix());
        let active = ActiveUsers::new(
            RedisStore::new(&scoped)?,
            Clock::System,
            stats,
            settings.auth.day_utc_offset_minutes,
        );
        println!("stats.active_users_shards = {shards}:");
        let case = count_case(&active, &population, &mut connection).await?;
        day0_estimate = case.day0_estimate;
        let name = if shards == 1 {
            "1key".to_owned()
        } else {
            format!("{shards}shards")
        };
        figures.push((
            format!("active_users_{name}_worst_day_error_percent"),
            case.worst,
            "%",
        ));
        figures.push((
            format!("active_users_{name}_week_distinct_error_percent"),
            case.union_error.abs(),
            "%",
        ));
        figures.push((
            format!("active_users_{name}_day_bytes"),
            case.day_bytes as f64,
            "bytes",
        ));
        figures.push((
            format!("active_users_{name}_counted_per_second"),
            case.per_second,
            "pairs/s",
        ));
        figures.push((
            format!("active_users_{name}_report_ms"),
            case.report_ms,
            "ms",
        ));
    }

    // The exact peer: one SET of user ids for the first day.
    let first = population.active_on(0);
    let set_key = redis.key("exact:day0");
    let started = Instant::now();
    for chunk in first.chunks(CHUNK) {
        redis::cmd("SADD")
            .arg(&set_key)
            .arg(chunk.iter().map(Uuid::as_bytes).collect::<Vec<_>>())
            .query_async::<i64>(&mut connection)
            .await?;
    }
    let set_time = started.elapsed();
    let set_count: u64 = redis::cmd("SCARD")
        .arg(&set_key)
        .query_async(&mut connection)
        .await?;
    let set_bytes: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&set_key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut connection)
        .await?;
    println!(
        "exact peer, the first day as a SET: {set_bytes} bytes, {set_count} users ({day0_estimate} estimated), SADD {:.2} s",
        set_time.as_secs_f64(),
    );
    // The process side: the users it remembers as counted today (a HashSet of ids).
    let remembered: std::collections::HashSet<Uuid> = population.ids.iter().copied().collect();
    let remembered_bytes = remembered.capacity() * (std::mem::size_of::<Uuid>() + 1);
    println!(
        "a process remembering {users} users as counted today: about {:.1} MB (bounded by stats.active_users_remembered_max)",
        remembered_bytes as f64 / 1e6
    );
    println!();
    figures.push(("exact_set_day_bytes".into(), set_bytes as f64, "bytes"));
    for (name, value, unit) in figures {
        println!("RESULT {name} {value:.3} {unit}");
    }
    Ok(())
}

struct Case {
    worst: f64,
    union_error: f64,
    day_bytes: i64,
    per_second: f64,
    report_ms: f64,
    day0_estimate: u64,
}

async fn count_case(
    active: &ActiveUsers,
    population: &Population,
    connection: &mut RedisConnection,
) -> anyhow::Result<Case> {
    let started = Instant::now();
    let mut added = 0usize;
    for (index, day) in population.days.iter().enumerate() {
        let today = population.active_on(index);
        for chunk in today.chunks(CHUNK) {
            active.record(*day, chunk).await?;
        }
        added += today.len();
    }
    let counting = started.elapsed();
    let first_day = population.days[0];
    let queried = Instant::now();
    let report = active
        .report(first_day, *population.days.last().context("days")?)
        .await?;
    let query = queried.elapsed();
    println!(
        "  {added} (user, day) pairs counted in {:.2} s ({:.0} per second, {CHUNK} per call)",
        counting.as_secs_f64(),
        added as f64 / counting.as_secs_f64()
    );
    let mut worst = 0f64;
    for (index, (day, estimate)) in report.days.iter().enumerate() {
        let exact = population.exact(index);
        let error = relative_error(*estimate, exact);
        worst = worst.max(error.abs());
        println!("  {day}: exact {exact:>9}  estimate {estimate:>9}  error {error:+.3} %");
    }
    let exact_union = population.masks.iter().filter(|mask| **mask != 0).count();
    let union_error = relative_error(report.distinct, exact_union);
    println!(
        "  week distinct: exact {exact_union:>9}  estimate {:>9}  error {union_error:+.3} %  (report in {:.1} ms)",
        report.distinct,
        zhihui::cli::bench_support::ms(query)
    );
    let mut day_bytes = 0i64;
    for key in active.day_keys(first_day) {
        let bytes: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .query_async(connection)
            .await?;
        day_bytes += bytes.unwrap_or(0);
    }
    println!("  one day's keys: {day_bytes} bytes; worst day error {worst:.3} %");
    Ok(Case {
        worst,
        union_error,
        day_bytes,
        per_second: added as f64 / counting.as_secs_f64(),
        report_ms: zhihui::cli::bench_support::ms(query),
        day0_estimate: report.days.first().map_or(0, |(_, count)| *count),
    })
}

/// (estimate - exact) / exact, in percent.
fn relative_error(estimate: u64, exact: usize) -> f64 {
    (estimate as f64 - exact as f64) / exact as f64 * 100.0
}
