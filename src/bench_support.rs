//! What the benchmark programs (`src/bin/bench_*.rs`) share: a throw-away database next to
//! `DATABASE_URL`'s, the seconds-per-case argument, and the `RESULT` lines.

#![allow(clippy::print_stdout)]

use anyhow::Context;
use secrecy::SecretString;
use uuid::Uuid;

use crate::configuration::Settings;

/// One figure: name, value, unit.
pub type Figure = (String, f64, &'static str);

/// Metadata of the events a benchmark makes.
pub fn metadata() -> crate::event_store::EventMetadata {
    crate::event_store::EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: "bench".into(),
    }
}

/// The `p` quantile (0 to 1) of `sorted` (ascending), by nearest rank; `None` when empty.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    let last = sorted.len().checked_sub(1)?;
    sorted.get(((last as f64) * p).round() as usize).copied()
}

/// CPU time (user + system) a process has used so far, in µs (`/proc/<pid>/stat`, 100 Hz ticks):
/// the server's cost per request, read before and after a span of requests.
pub fn process_cpu_us(pid: u32) -> anyhow::Result<f64> {
    use anyhow::Context as _;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    stat_cpu_us(&stat)
}

/// CPU time used so far by every process whose name is `name` (`postgres`: the server and all
/// its backends and workers; `redis-server`), in µs. A process that ends between two readings
/// takes its time with it, so read around a span in which the processes stay (a pool's backends).
pub fn processes_cpu_us(name: &str) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for entry in std::fs::read_dir("/proc")? {
        let path = entry?.path();
        let is_pid = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()));
        if !is_pid {
            continue;
        }
        // A process may end while being read: skip it.
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue;
        };
        let named = stat
            .split_once('(')
            .and_then(|(_, rest)| rest.rsplit_once(')'))
            .is_some_and(|(comm, _)| comm == name);
        if named {
            total += stat_cpu_us(&stat)?;
        }
    }
    Ok(total)
}

/// Busy time of the whole machine so far (every core's user, nice, system, irq, softirq and
/// steal time in `/proc/stat`), in µs: with [`process_cpu_us`], what a request costs besides
/// the server.
pub fn machine_busy_us() -> anyhow::Result<f64> {
    use anyhow::Context as _;
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("parsing /proc/stat")?;
    // user nice system idle iowait irq softirq steal ...
    let busy: f64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .sum();
    Ok(busy * 10_000.0)
}

fn stat_cpu_us(stat: &str) -> anyhow::Result<f64> {
    use anyhow::Context as _;
    // After the name (in parentheses, which may hold spaces): utime and stime are fields 14, 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("no name in stat")?
        .1
        .split_whitespace()
        .collect();
    let utime: f64 = fields.get(11).context("utime")?.parse()?;
    let stime: f64 = fields.get(12).context("stime")?.parse()?;
    Ok((utime + stime) * 10_000.0)
}

/// A duration in milliseconds (the unit every benchmark prints).
pub fn ms(duration: std::time::Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

/// The first argument as seconds per case (default 5).
pub fn seconds_per_case() -> anyhow::Result<u64> {
    Ok(std::env::args()
        .nth(1)
        .map(|arg| arg.parse())
        .transpose()
        .context("the argument is the number of seconds per case")?
        .unwrap_or(5))
}

/// The `index`-th command-line argument as a number, `None` when absent.
pub fn arg(index: usize) -> anyhow::Result<Option<usize>> {
    std::env::args()
        .nth(index)
        .map(|value| value.parse::<usize>())
        .transpose()
        .with_context(|| format!("argument {index} must be a number"))
}

/// Create `zhihui_bench_<uuid>` next to `DATABASE_URL`'s database, run `body` with settings
/// pointing at it (adjusted by `customise`), drop it, print the `RESULT` lines.
pub async fn with_fresh_database<F, Fut>(
    customise: impl FnOnce(&mut Settings),
    body: F,
) -> anyhow::Result<()>
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<Vec<Figure>>>,
{
    let admin_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://zhihui@127.0.0.1:55432/zhihui".into());
    let database = format!("zhihui_bench_{}", Uuid::new_v4().simple());
    let (admin, connection) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls)
        .await
        .context("connecting to DATABASE_URL")?;
    tokio::spawn(connection);
    admin
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .await?;
    let mut settings = Settings::load(None)?;
    let base = admin_url
        .rsplit_once('/')
        .map(|(base, _)| base)
        .context("DATABASE_URL has no database name")?;
    settings.database.url = SecretString::from(format!("{base}/{database}"));
    customise(&mut settings);
    let outcome = body(settings).await;
    admin
        .batch_execute(&format!("DROP DATABASE {database} WITH (FORCE)"))
        .await?;
    let results = outcome?;
    println!();
    for (name, value, unit) in results {
        println!("RESULT {name} {value:.1} {unit}");
    }
    Ok(())
}

/// Grant each account stream a million points (the benchmarks' accounts never run dry).
pub async fn fund(
    accounts: &crate::aggregate::AggregateService<zhihui_domain::account::Account>,
    streams: &[String],
) -> anyhow::Result<()> {
    for stream in streams {
        accounts
            .execute(
                stream,
                zhihui_domain::account::AccountCommand::Grant {
                    operation_id: Uuid::now_v7(),
                    amount: zhihui_domain::points::Amount::whole(1_000_000),
                    reason: "bench".into(),
                    at: chrono::Utc::now(),
                },
                metadata(),
            )
            .await
            .map_err(|error| anyhow::anyhow!("{error}"))?;
    }
    Ok(())
}

/// The benchmarks' unit of account work: freeze one point under a fresh hold, then release it.
pub fn freeze_release_pair() -> [zhihui_domain::account::AccountCommand; 2] {
    let hold_id = Uuid::now_v7();
    [
        zhihui_domain::account::AccountCommand::Freeze {
            hold_id,
            amount: zhihui_domain::points::Amount::whole(1),
            at: chrono::Utc::now(),
        },
        zhihui_domain::account::AccountCommand::ReleaseHold {
            hold_id,
            reason: "bench".into(),
            at: chrono::Utc::now(),
        },
    ]
}

/// Every projection and the revenue recorder caught up, then `audit verify` over everything;
/// prints the first differences and the summary line.
pub async fn project_and_audit(
    state: &crate::startup::AppState,
    settings: &Settings,
) -> anyhow::Result<crate::audit::Verified> {
    use secrecy::ExposeSecret;
    for projection in zhihui_projections::ProjectionName::ALL {
        crate::projector::Projector::live(
            projection,
            state.pg_pool.clone(),
            state.event_store.clone(),
            settings.projections.clone(),
        )
        .catch_up()
        .await?;
    }
    crate::revenue::RevenueRecorder::new(
        state.event_store.clone(),
        state.pg_pool.clone(),
        settings.projections.clone(),
    )
    .catch_up()
    .await?;
    let (client, connection) =
        tokio_postgres::connect(settings.database.url.expose_secret(), tokio_postgres::NoTls)
            .await?;
    tokio::spawn(connection);
    let verified = crate::audit::verify(
        &state.event_store,
        &client,
        crate::audit::settlement_bound(&settings.tasks),
    )
    .await?;
    for difference in verified.differences.iter().take(10) {
        println!("DIFFERENCE {difference}");
    }
    println!(
        "audit verify: {} events, {} difference(s), {} pending",
        verified.events_read,
        verified.differences.len(),
        verified.pending_settlements
    );
    Ok(verified)
}

/// Delete every Redis key under the run's prefix.
pub async fn clean_redis(state: &crate::startup::AppState) -> anyhow::Result<()> {
    let mut connection = state.redis.connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}*", state.redis.key_prefix()))
        .query_async(&mut connection)
        .await?;
    for chunk in keys.chunks(1_000) {
        let _: i64 = redis::cmd("DEL")
            .arg(chunk)
            .query_async(&mut connection)
            .await?;
    }
    Ok(())
}
