//! What the benchmark programs (`src/bin/bench_*.rs`) share: a throw-away database next to
//! `DATABASE_URL`'s, the seconds-per-case argument, and the `RESULT` lines.

#![allow(clippy::print_stdout)]

use anyhow::Context;
use secrecy::SecretString;
use uuid::Uuid;

use crate::platform::configuration::Settings;

/// One figure: name, value, unit.
pub type Figure = (String, f64, &'static str);

/// Metadata of the events a benchmark makes.
pub fn metadata() -> crate::platform::event_store::EventMetadata {
    crate::platform::event_store::EventMetadata {
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

/// Clock ticks per second of `/proc`'s CPU times (USER_HZ, fixed at 100 for Linux userland).
const USER_HZ: f64 = 100.0;

/// A process's or thread's name and the CPU time (user + system) it has used so far, in µs, from
/// its `/proc/<pid>/stat` (or `/proc/<pid>/task/<tid>/stat`) line; `None` when malformed.
pub fn parse_proc_stat(stat: &str) -> Option<(&str, f64)> {
    // "pid (comm) state ...": comm may hold spaces and parentheses, so it ends at the last ')'.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((name, (utime + stime) * 1_000_000.0 / USER_HZ))
}

/// CPU time (user + system) a process has used so far, in µs (`/proc/<pid>/stat`, 100 Hz ticks):
/// the server's cost per request, read before and after a span of requests.
pub fn process_cpu_us(pid: u32) -> anyhow::Result<f64> {
    use anyhow::Context as _;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    parse_proc_stat(&stat)
        .map(|(_, cpu_us)| cpu_us)
        .with_context(|| format!("parsing /proc/{pid}/stat"))
}

/// CPU time used so far by every process whose name is `name` (`postgres`: the server and all
/// its backends and workers; `redis-server`), in µs; `None` when none runs on this host (a
/// remote server is not counted). A process that ends between two readings takes its time with
/// it, so read around a span in which the processes stay (a pool's backends).
pub fn processes_cpu_us(name: &str) -> anyhow::Result<Option<f64>> {
    use anyhow::Context as _;
    let mut total = None;
    for entry in std::fs::read_dir("/proc").context("reading /proc")? {
        // A process may end while being read, and not every entry is one: skip those.
        let Ok(stat) = std::fs::read_to_string(entry?.path().join("stat")) else {
            continue;
        };
        if let Some((comm, cpu_us)) = parse_proc_stat(&stat)
            && comm == name
        {
            *total.get_or_insert(0.0) += cpu_us;
        }
    }
    Ok(total)
}

/// What `wrk --latency` printed for one run. Only 2xx (and 3xx) answers count as served: a route
/// that answers errors fast must not look fast.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WrkOutput {
    /// Answers received, whatever their status.
    pub answers: f64,
    pub duration_s: f64,
    pub p99_ms: f64,
    /// Answers whose status was neither 2xx nor 3xx.
    pub non_2xx: u64,
    /// Requests that got no answer: connect, read and write errors, timeouts.
    pub socket_errors: u64,
}

impl WrkOutput {
    pub fn parse(text: &str) -> anyhow::Result<WrkOutput> {
        use anyhow::Context as _;
        let mut run = WrkOutput::default();
        for line in text.lines() {
            let words: Vec<&str> = line
                .split(|c: char| c.is_whitespace() || c == ',')
                .filter(|word| !word.is_empty())
                .collect();
            match words.as_slice() {
                ["99%", value] => run.p99_ms = wrk_ms(value).context("wrk's p99")?,
                ["Non-2xx", "or", "3xx", "responses:", value] => run.non_2xx = value.parse()?,
                ["Socket", "errors:", rest @ ..] => {
                    // connect N read N write N timeout N
                    run.socket_errors = rest
                        .chunks(2)
                        .filter_map(|pair| pair.get(1)?.parse::<u64>().ok())
                        .sum();
                }
                [count, "requests", "in", took, ..] => {
                    run.answers = count.parse()?;
                    run.duration_s = wrk_ms(took).context("wrk's duration")? / 1000.0;
                }
                _ => {}
            }
        }
        anyhow::ensure!(
            run.answers > 0.0 && run.duration_s > 0.0,
            "wrk made no request: {text}"
        );
        Ok(run)
    }

    /// Answers with a 2xx or 3xx status, per second.
    pub fn ok_per_second(&self) -> f64 {
        (self.answers - self.non_2xx as f64).max(0.0) / self.duration_s
    }

    /// Requests that were not served: error statuses and requests without an answer.
    pub fn errors(&self) -> u64 {
        self.non_2xx + self.socket_errors
    }
}

/// A wrk time such as `812.00us`, `3.41ms`, `1.02s` or `10.00s`, in ms.
pub fn wrk_ms(value: &str) -> Option<f64> {
    let split = value.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = value.split_at(split);
    let number: f64 = number.parse().ok()?;
    match unit {
        "us" => Some(number / 1000.0),
        "ms" => Some(number),
        "s" => Some(number * 1000.0),
        "m" => Some(number * 60_000.0),
        _ => None,
    }
}

/// The whole machine's CPU time so far (`/proc/stat`, every core), in µs.
#[derive(Debug, Clone, Copy, Default)]
pub struct MachineCpu {
    /// User, nice, system, irq, softirq and steal time.
    pub busy_us: f64,
    /// Busy, idle and iowait time together.
    pub total_us: f64,
}

/// Read [`MachineCpu`]: with [`process_cpu_us`], what a request costs besides the server.
pub fn machine_cpu_us() -> anyhow::Result<MachineCpu> {
    use anyhow::Context as _;
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .context("empty /proc/stat")?
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("parsing /proc/stat")?;
    // user nice system idle iowait irq softirq steal ...
    let total: f64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    let us = 1_000_000.0 / USER_HZ;
    Ok(MachineCpu {
        busy_us: (total - idle) * us,
        total_us: total * us,
    })
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
    accounts: &crate::platform::aggregate::AggregateService<zhihui_domain::account::Account>,
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
    state: &crate::state::AppState,
    settings: &Settings,
) -> anyhow::Result<crate::cli::audit::Verified> {
    use secrecy::ExposeSecret;
    for projection in zhihui_projections::ProjectionName::ALL {
        crate::platform::projector::Projector::live(
            projection,
            state.pg_pool.clone(),
            state.event_store.clone(),
            settings.projections.clone(),
        )
        .catch_up()
        .await?;
    }
    crate::points::revenue::RevenueRecorder::new(
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
    let verified = crate::cli::audit::verify(
        &state.event_store,
        &client,
        crate::cli::audit::settlement_bound(&settings.tasks),
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
pub async fn clean_redis(state: &crate::state::AppState) -> anyhow::Result<()> {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// wrk 4.2's output, as `--latency` prints it.
    const WRK_OUTPUT: &str = "Running 10s test @ http://127.0.0.1:8080/api/v1/me
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     4.12ms    2.01ms  41.30ms   80.11%
    Req/Sec     7.91k   512.33     9.02k    70.50%
  Latency Distribution
     50%    3.80ms
     75%    4.90ms
     90%    6.40ms
     99%   11.25ms
  157400 requests in 10.00s, 41.23MB read
  Socket errors: connect 0, read 3, write 0, timeout 12
  Non-2xx or 3xx responses: 400
Requests/sec:  15740.00
Transfer/sec:      4.12MB
";

    #[test]
    fn a_wrk_rate_counts_only_the_answers_that_served() {
        let run = WrkOutput::parse(WRK_OUTPUT).unwrap();
        assert_eq!(
            (
                run.answers,
                run.duration_s,
                run.p99_ms,
                run.non_2xx,
                run.socket_errors
            ),
            (157_400.0, 10.0, 11.25, 400, 15)
        );
        // wrk's own Requests/sec (15,740) counts the 400 error answers too.
        assert_eq!(run.ok_per_second(), 15_700.0);
        assert_eq!(run.errors(), 415);
        assert!(WrkOutput::parse("Running 1s test\n").is_err());
    }
}
