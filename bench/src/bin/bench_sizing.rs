//! Sizing: what each request kind and each task costs the shared stores, and
//! how many tasks one `zhihui serve` carries end to end, on this machine.
//!
//! 1. Per request kind (login, GET /me, GET /account, POST /tasks, GET /tasks/{id}, prioritise,
//!    cancel, the ledger page), through one `zhihui serve` with the dispatcher off: Redis
//!    commands (`INFO commandstats`, reset before each kind), PostgreSQL statements
//!    (`pg_stat_statements` of the run's database) and events appended, per request, with the
//!    process's background (leases, boards: measured idle over the same time) taken off.
//! 2. Per task, end to end (submitted, dispatched to a ComfyUI simulator with no step delay,
//!    labelled, charged, projected), through one `zhihui serve` with the dispatcher on: Redis
//!    commands, PostgreSQL statements and events per task, and tasks/s sustained (the simulator
//!    runs on the same two cores: a ceiling of zhihui and simulator together).
//!
//! Run it so:
//!
//! ```text
//! DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!     cargo build --release -p zhihui -p zhihui-bench && target/release/bench_sizing [REQUESTS] [TASKS]
//! ```
//!
//! Needs its own Redis (its statistics are reset) and `pg_stat_statements` preloaded, as
//! `scripts/services.sh` starts them.
//!
//! With `BENCH_ALLOCATIONS=1` (root, and `perf` from Debian's `linux-perf`), part 1 also counts the
//! server's heap allocations per request: uprobes on glibc's `malloc`, `calloc`, `realloc` and
//! `posix_memalign` (every allocation Rust's system allocator makes goes through one of them),
//! counted by `perf stat` attached to the server. A probe costs a trap into the kernel on every
//! call, so the CPU column of such a run is inflated: read CPU from a run without it.

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../serve/mod.rs"]
mod serve;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use comfyui_sim::{Faults, SimConfig, Simulator};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, arg};
use zhihui::platform::configuration::Settings;

/// Redis's own time in its commands since the last reset, µs (`INFO commandstats` usec).
async fn redis_usec(redis: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(redis)
        .await?;
    let mut total = 0.0;
    for line in info.lines() {
        if let Some(rest) = line.strip_prefix("cmdstat_")
            && !rest.starts_with("info:")
            && !rest.starts_with("config|resetstat:")
            && let Some(usec) = rest
                .split(',')
                .find_map(|field| field.split_once("usec=").map(|(_, value)| value))
        {
            total += usec.parse::<f64>()?;
        }
    }
    Ok(total)
}

/// Every Redis command counted since the last reset, by command.
async fn redis_commands(
    redis: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<BTreeMap<String, u64>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(redis)
        .await?;
    let mut counts = BTreeMap::new();
    for line in info.lines() {
        // cmdstat_get:calls=3,usec=...
        if let Some(rest) = line.strip_prefix("cmdstat_")
            && let Some((command, stats)) = rest.split_once(':')
            && let Some(calls) = stats
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))
        {
            counts.insert(command.to_owned(), calls.parse()?);
        }
    }
    // The reading itself and the resets are the bench's, not zhihui's.
    for own in ["info", "config|resetstat"] {
        counts.remove(own);
    }
    Ok(counts)
}

async fn reset(
    redis: &mut redis::aio::MultiplexedConnection,
    pg: &tokio_postgres::Client,
) -> anyhow::Result<()> {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(redis)
        .await?;
    pg.execute("SELECT pg_stat_statements_reset()", &[]).await?;
    Ok(())
}

/// The most called statements of this database since the last reset, each shortened.
async fn top_statements(pg: &tokio_postgres::Client, units: f64) -> anyhow::Result<String> {
    let rows = pg
        .query(
            "SELECT s.calls::bigint, regexp_replace(left(s.query, 70), '\\s+', ' ', 'g') \
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
              WHERE d.datname = current_database() \
                AND s.query NOT LIKE '%pg_stat_statements%' AND s.query NOT LIKE '%count(*) FROM events%' \
              ORDER BY s.calls DESC LIMIT 4",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            format!(
                "{:.1}x {}",
                row.get::<_, i64>(0) as f64 / units,
                row.get::<_, String>(1)
            )
        })
        .collect::<Vec<_>>()
        .join(" | "))
}

/// Statements of this database since the last reset (the bench's own excluded), and their
/// execution time in ms.
async fn statements(pg: &tokio_postgres::Client) -> anyhow::Result<(u64, f64)> {
    let row = pg
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(total_exec_time), 0)::float8 \
               FROM pg_stat_statements s \
               JOIN pg_database d ON d.oid = s.dbid \
              WHERE d.datname = current_database() \
                AND s.query NOT LIKE '%pg_stat_statements%' AND s.query NOT LIKE '%count(*) FROM events%'",
            &[],
        )
        .await?;
    Ok((u64::try_from(row.get::<_, i64>(0))?, row.get(1)))
}

async fn events(pg: &tokio_postgres::Client) -> anyhow::Result<u64> {
    let row = pg.query_one("SELECT count(*) FROM events", &[]).await?;
    Ok(u64::try_from(row.get::<_, i64>(0))?)
}

/// What the server and the stores spent over a span, per unit, the idle background taken off.
struct Cost {
    /// The server process's CPU time (user + system), µs.
    cpu_us: f64,
    redis: f64,
    /// Redis's own time in those commands, µs.
    redis_us: f64,
    redis_top: String,
    statements: f64,
    /// PostgreSQL's execution time of those statements, µs.
    statement_us: f64,
    statements_top: String,
    events: f64,
    /// Heap allocations by the server (None unless BENCH_ALLOCATIONS=1).
    allocations: Option<f64>,
}

/// glibc's allocation entry points: every allocation of Rust's system allocator goes through one.
const ALLOCATION_PROBES: [&str; 4] = ["malloc", "calloc", "realloc", "posix_memalign"];

/// How long `perf stat` is given to attach before the work starts (what it counts meanwhile is
/// the idle background, taken off with the rest of it).
const PERF_ATTACH: Duration = Duration::from_millis(300);

/// Heap allocations of the server, counted by `perf stat` on uprobes on its glibc's allocator.
/// The probes are removed when this is dropped.
struct Allocations {
    pid: u32,
    /// The idle server's allocations per second.
    idle_per_s: f64,
}

/// A `perf stat` attached to the server, counting until stopped.
struct Counting {
    child: std::process::Child,
    started: Instant,
}

fn perf() -> std::process::Command {
    std::process::Command::new("perf")
}

fn remove_allocation_probes() {
    // Quiet: there are none the first time.
    drop(
        perf()
            .args(["probe", "-q", "-d", "probe_libc:*"])
            .stderr(std::process::Stdio::null())
            .output(),
    );
}

impl Allocations {
    /// Probe the glibc the server maps (its path from `/proc/PID/maps`).
    fn probe(pid: u32) -> anyhow::Result<Allocations> {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let libc = maps
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .find(|path| path.contains("/libc.so"))
            .context("the server maps no glibc: its allocations cannot be probed")?
            .to_owned();
        // A run stopped early leaves its probes behind: start from none.
        remove_allocation_probes();
        let mut add = perf();
        add.args(["probe", "-q", "-x", &libc]);
        for function in ALLOCATION_PROBES {
            add.args(["-a", function]);
        }
        let added = add
            .output()
            .context("running perf (Debian's linux-perf) to count allocations")?;
        anyhow::ensure!(
            added.status.success(),
            "perf probe on {libc} failed (BENCH_ALLOCATIONS needs root): {}",
            String::from_utf8_lossy(&added.stderr).trim()
        );
        Ok(Allocations {
            pid,
            idle_per_s: 0.0,
        })
    }

    async fn start(&self) -> anyhow::Result<Counting> {
        let events = ALLOCATION_PROBES
            .iter()
            .map(|function| format!("probe_libc:{function}"))
            .collect::<Vec<_>>()
            .join(",");
        let started = Instant::now();
        let child = perf()
            .args([
                "stat",
                "-x",
                ",",
                "-e",
                &events,
                "-p",
                &self.pid.to_string(),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("starting perf stat")?;
        tokio::time::sleep(PERF_ATTACH).await;
        Ok(Counting { child, started })
    }
}

impl Drop for Allocations {
    fn drop(&mut self) {
        remove_allocation_probes();
    }
}

impl Counting {
    /// Stop counting: the allocations counted, and over how many seconds.
    fn stop(self) -> anyhow::Result<(f64, f64)> {
        let seconds = self.started.elapsed().as_secs_f64();
        // perf stat prints its counts when interrupted.
        let interrupted = std::process::Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()?;
        anyhow::ensure!(interrupted.success(), "could not interrupt perf stat");
        let output = self.child.wait_with_output()?;
        let printed = String::from_utf8_lossy(&output.stderr);
        let mut total = 0.0;
        let mut probes = 0;
        // CSV lines: count,unit,event,...
        for line in printed.lines() {
            let fields: Vec<&str> = line.split(',').collect();
            if let [count, _, event, ..] = fields.as_slice()
                && event.starts_with("probe_libc:")
            {
                total += count
                    .parse::<f64>()
                    .with_context(|| format!("perf stat printed {line:?}"))?;
                probes += 1;
            }
        }
        anyhow::ensure!(
            probes == ALLOCATION_PROBES.len(),
            "perf stat counted {probes} probes of {}: {printed}",
            ALLOCATION_PROBES.len()
        );
        Ok((total, seconds))
    }
}

/// Counters read at one instant, to subtract.
struct Reading {
    cpu_us: f64,
    redis: u64,
    redis_us: f64,
    statements: u64,
    statement_ms: f64,
}

struct Meter<'a> {
    redis: &'a mut redis::aio::MultiplexedConnection,
    pg: &'a tokio_postgres::Client,
    /// The `zhihui serve` whose CPU time is counted.
    pid: u32,
    /// The idle server's background per second (leases, boards).
    idle: Reading,
    /// Counts the server's allocations, when asked to.
    allocations: Option<Allocations>,
}

/// Whether this run counts allocations (`BENCH_ALLOCATIONS=1`).
fn counting_allocations() -> bool {
    std::env::var("BENCH_ALLOCATIONS").is_ok_and(|value| value == "1")
}

/// How long the idle server's background is watched before each part.
const IDLE: Duration = Duration::from_secs(3);

impl<'a> Meter<'a> {
    async fn read(
        redis: &mut redis::aio::MultiplexedConnection,
        pg: &tokio_postgres::Client,
        pid: u32,
    ) -> anyhow::Result<Reading> {
        let (statements, statement_ms) = statements(pg).await?;
        Ok(Reading {
            cpu_us: zhihui::cli::bench_support::process_cpu_us(pid)?,
            redis: redis_commands(redis).await?.values().sum(),
            redis_us: redis_usec(redis).await?,
            statements,
            statement_ms,
        })
    }

    /// A meter whose background rates are the idle server's, watched for [`IDLE`].
    async fn after_idle(
        redis: &'a mut redis::aio::MultiplexedConnection,
        pg: &'a tokio_postgres::Client,
        pid: u32,
    ) -> anyhow::Result<Meter<'a>> {
        let mut allocations = if counting_allocations() {
            Some(Allocations::probe(pid)?)
        } else {
            None
        };
        let counting = match &allocations {
            Some(allocations) => Some(allocations.start().await?),
            None => None,
        };
        reset(redis, pg).await?;
        let cpu_before = zhihui::cli::bench_support::process_cpu_us(pid)?;
        tokio::time::sleep(IDLE).await;
        let mut idle = Self::read(redis, pg, pid).await?;
        idle.cpu_us -= cpu_before;
        if let (Some(allocations), Some(counting)) = (&mut allocations, counting) {
            let (counted, seconds) = counting.stop()?;
            allocations.idle_per_s = counted / seconds;
        }
        let seconds = IDLE.as_secs_f64();
        Ok(Meter {
            redis,
            pg,
            pid,
            allocations,
            idle: Reading {
                cpu_us: idle.cpu_us / seconds,
                redis: idle.redis,
                redis_us: idle.redis_us / seconds,
                statements: idle.statements,
                statement_ms: idle.statement_ms / seconds,
            },
        })
    }

    fn idle_redis_per_s(&self) -> f64 {
        self.idle.redis as f64 / IDLE.as_secs_f64()
    }

    fn idle_statements_per_s(&self) -> f64 {
        self.idle.statements as f64 / IDLE.as_secs_f64()
    }

    async fn measure<F, Fut>(&mut self, units: usize, work: F) -> anyhow::Result<(Cost, Duration)>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        let events_before = events(self.pg).await?;
        reset(self.redis, self.pg).await?;
        let counting = match &self.allocations {
            Some(allocations) => Some(allocations.start().await?),
            None => None,
        };
        let cpu_before = zhihui::cli::bench_support::process_cpu_us(self.pid)?;
        let started = Instant::now();
        work().await?;
        let took = started.elapsed();
        let allocations = match (&self.allocations, counting) {
            (Some(allocations), Some(counting)) => {
                let (counted, seconds) = counting.stop()?;
                Some(((counted - allocations.idle_per_s * seconds) / units as f64).max(0.0))
            }
            _ => None,
        };
        let seconds = took.as_secs_f64();
        let after = Self::read(self.redis, self.pg, self.pid).await?;
        let counts = redis_commands(self.redis).await?;
        let statements_top = top_statements(self.pg, units as f64).await?;
        let events_after = events(self.pg).await?;
        let units = units as f64;
        let mut top: Vec<(&String, &u64)> = counts.iter().collect();
        top.sort_by(|left, right| right.1.cmp(left.1));
        let redis_top = top
            .iter()
            .take(6)
            .map(|(command, calls)| format!("{command} {:.1}", **calls as f64 / units))
            .collect::<Vec<_>>()
            .join(", ");
        let per_unit =
            |total: f64, idle_per_s: f64| ((total - idle_per_s * seconds) / units).max(0.0);
        Ok((
            Cost {
                cpu_us: per_unit(after.cpu_us - cpu_before, self.idle.cpu_us),
                redis: per_unit(after.redis as f64, self.idle_redis_per_s()),
                redis_us: per_unit(after.redis_us, self.idle.redis_us),
                redis_top,
                statements: per_unit(after.statements as f64, self.idle_statements_per_s()),
                statement_us: per_unit(after.statement_ms, self.idle.statement_ms) * 1000.0,
                statements_top,
                events: (events_after - events_before) as f64 / units,
                allocations,
            },
            took,
        ))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let requests = arg(1)?.unwrap_or(200);
    let tasks = arg(2)?.unwrap_or(400);
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
            );
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        },
        |settings| async move { Box::pin(run(settings, requests, tasks)).await },
    )
    .await
}

async fn json_of(response: reqwest::Response) -> anyhow::Result<Value> {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or_default();
    anyhow::ensure!(status.is_success(), "answered {status}: {body}");
    Ok(body)
}

async fn run(settings: Settings, requests: usize, tasks: usize) -> anyhow::Result<Vec<Figure>> {
    let scratch = std::env::current_dir()?
        .join("target")
        .join("tmp")
        .join(format!("bench-sizing-{}", Uuid::now_v7().simple()));
    let (pg, connection) =
        tokio_postgres::connect(settings.database.url.expose_secret(), tokio_postgres::NoTls)
            .await?;
    tokio::spawn(connection);
    pg.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
        .context("pg_stat_statements (scripts/services.sh preloads it)")?;
    let mut redis = redis::Client::open(settings.redis.url.expose_secret())?
        .get_multiplexed_async_connection()
        .await?;
    let http = reqwest::Client::new();
    let mut figures: Vec<Figure> = Vec::new();
    let mut route_figures: Vec<Figure> = Vec::new();

    // ---- 1. Request kinds, the dispatcher off (tasks stay queued).
    let common: Vec<(&str, &str)> = vec![
        ("ZHIHUI_TRANSLATION__ENABLED", "false"),
        ("ZHIHUI_TASKS__QUEUED_PER_USER_MAX", "100000"),
        ("ZHIHUI_AUTH__LOGINS_PER_CLIENT_PER_MINUTE", "1000000"),
        ("ZHIHUI_LOG__FILTER", "error"),
    ];
    let server = serve::start_server(&settings, &common).await?;
    let base = server.base.clone();
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    let state =
        zhihui::state::AppState::build(&settings, pool, zhihui::state::Overrides::default())?;
    let registered = json_of(
        http.post(format!("{base}/api/v1/auth/register"))
            .json(&json!({"username": "sizing", "password": "correct horse battery"}))
            .send()
            .await?,
    )
    .await?;
    let user = Uuid::parse_str(registered["id"].as_str().context("user id")?)?;
    zhihui::cli::bench_support::fund(
        &state.accounts,
        &[zhihui_domain::account::account_stream(
            zhihui_domain::user::UserId::from_uuid(user),
        )],
    )
    .await?;
    let login = || {
        http.post(format!("{base}/api/v1/auth/login"))
            .json(&json!({"username": "sizing", "password": "correct horse battery"}))
            .send()
    };
    let token = json_of(login().await?).await?["token"]
        .as_str()
        .context("token")?
        .to_owned();
    // Warm up (connections, caches), then the idle background.
    for _ in 0..20 {
        json_of(
            http.get(format!("{base}/api/v1/account"))
                .bearer_auth(&token)
                .send()
                .await?,
        )
        .await?;
    }
    let mut meter = Meter::after_idle(&mut redis, &pg, server.pid).await?;
    println!(
        "idle zhihui serve (dispatcher off): {:.1} Redis commands/s, {:.1} statements/s, {:.0} µs CPU/s (taken off below)",
        meter.idle_redis_per_s(),
        meter.idle_statements_per_s(),
        meter.idle.cpu_us
    );
    if let Some(allocations) = &meter.allocations {
        println!(
            "counting allocations: the idle server makes {:.0}/s (taken off below); the probes inflate the CPU column",
            allocations.idle_per_s
        );
    }
    println!();
    println!(
        "{:<28} {:>8} {:>6} {:>8} {:>11} {:>8} {:>7} {:>7}   top Redis commands per request",
        "request", "CPU µs", "Redis", "Redis µs", "statements", "PG µs", "events", "allocs"
    );
    let mut table = |name: &str, cost: &Cost| {
        let allocations = cost
            .allocations
            .map_or_else(|| "-".to_owned(), |count| format!("{count:.0}"));
        println!(
            "{name:<28} {:>8.0} {:>6.1} {:>8.1} {:>11.1} {:>8.0} {:>7.2} {allocations:>7}   {}",
            cost.cpu_us,
            cost.redis,
            cost.redis_us,
            cost.statements,
            cost.statement_us,
            cost.events,
            cost.redis_top
        );
        println!("{:<28} statements: {}", "", cost.statements_top);
        let key = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect::<String>()
            .split('_')
            .filter(|part| !part.is_empty())
            .collect::<Vec<_>>()
            .join("_");
        // A run that counts allocations reports them, not its CPU (which the probes inflate).
        match cost.allocations {
            Some(count) => {
                route_figures.push((format!("sizing_allocations_{key}"), count, "allocations"))
            }
            None => route_figures.push((format!("sizing_cpu_us_{key}"), cost.cpu_us, "µs")),
        }
    };

    let (cost, _) = meter
        .measure(20, || async {
            for _ in 0..20 {
                json_of(login().await?).await?;
            }
            Ok(())
        })
        .await?;
    table("POST /auth/login", &cost);
    figures.push(("sizing_redis_per_login".into(), cost.redis, "commands"));
    for (path, label) in [
        ("/api/v1/me", "GET /me"),
        ("/api/v1/account", "GET /account"),
        ("/api/v1/account/ledger?limit=20", "GET /account/ledger"),
    ] {
        let (cost, _) = meter
            .measure(requests, || async {
                for _ in 0..requests {
                    json_of(
                        http.get(format!("{base}{path}"))
                            .bearer_auth(&token)
                            .send()
                            .await?,
                    )
                    .await?;
                }
                Ok(())
            })
            .await?;
        table(label, &cost);
    }
    let mut task_ids = Vec::new();
    let (cost, _) = meter
        .measure(requests, || async {
            for _ in 0..requests {
                let body = json_of(
                    http.post(format!("{base}/api/v1/tasks"))
                        .bearer_auth(&token)
                        .json(&json!({"prompt": "一只在雪地里奔跑的红狐狸", "steps": 20}))
                        .send()
                        .await?,
                )
                .await?;
                task_ids.push(body["task_id"].as_str().context("task id")?.to_owned());
            }
            Ok(())
        })
        .await?;
    table("POST /tasks (queued)", &cost);
    figures.push(("sizing_redis_per_submit".into(), cost.redis, "commands"));
    figures.push((
        "sizing_statements_per_submit".into(),
        cost.statements,
        "statements",
    ));
    let (cost, _) = meter
        .measure(requests, || async {
            for task in &task_ids {
                json_of(
                    http.get(format!("{base}/api/v1/tasks/{task}"))
                        .bearer_auth(&token)
                        .send()
                        .await?,
                )
                .await?;
            }
            Ok(())
        })
        .await?;
    table("GET /tasks/{id}", &cost);
    let moves = requests.min(task_ids.len() / 2);
    for (action, label, offset) in [
        ("prioritise", "POST /tasks/{id}/prioritise", 0),
        ("cancel", "POST /tasks/{id}/cancel", moves),
    ] {
        let ids = &task_ids[offset..offset + moves];
        let (cost, _) = meter
            .measure(moves, || async {
                for task in ids.iter().rev() {
                    let answer = http
                        .post(format!("{base}/api/v1/tasks/{task}/{action}"))
                        .bearer_auth(&token)
                        .send()
                        .await?;
                    // 409 `already-first` is an answer too (the fee is not taken).
                    anyhow::ensure!(
                        answer.status().is_success() || answer.status() == 409,
                        "{action} answered {}",
                        answer.status()
                    );
                }
                Ok(())
            })
            .await?;
        table(label, &cost);
    }
    figures.append(&mut route_figures);
    drop(server);

    // ---- 2. Tasks end to end, the dispatcher on, one simulator with room for 8 at once.
    let sim = Simulator::start(SimConfig {
        bind: "127.0.0.1:0".parse()?,
        output_dir: scratch.join("sim"),
        models: vec!["majicmixRealistic_v7.safetensors".into()],
        faults: Faults {
            step_delay_ms: 0,
            fast_png: true,
            ..Faults::default()
        },
    })
    .await?;
    let backends = format!("gpu-0 {} 8", sim.base_url());
    let images = scratch.join("images").to_string_lossy().into_owned();
    let mut env = common.clone();
    env.extend([
        ("ZHIHUI_DISPATCH__ENABLED", "true"),
        ("ZHIHUI_DISPATCH__BACKENDS", backends.as_str()),
        ("ZHIHUI_DISPATCH__IMAGES_DIRECTORY", images.as_str()),
    ]);
    let server = serve::start_server(&settings, &env).await?;
    let base = server.base.clone();
    let token = json_of(
        http.post(format!("{base}/api/v1/auth/login"))
            .json(&json!({"username": "sizing", "password": "correct horse battery"}))
            .send()
            .await?,
    )
    .await?["token"]
        .as_str()
        .context("token")?
        .to_owned();
    // The queued tasks of part 1 run first; wait for them to end.
    let waiting = || async {
        let row = pg
            .query_one(
                "SELECT count(*) FROM tasks WHERE status IN ('submitted', 'queued', 'dispatched', 'running')",
                &[],
            )
            .await?;
        anyhow::Ok(row.get::<_, i64>(0))
    };
    let started = Instant::now();
    while waiting().await? > 0 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "part 1's tasks never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut meter = Meter::after_idle(&mut redis, &pg, server.pid).await?;
    println!();
    println!(
        "idle zhihui serve (dispatcher leading one server): {:.1} Redis commands/s, {:.1} statements/s (taken off below)",
        meter.idle_redis_per_s(),
        meter.idle_statements_per_s()
    );
    let succeeded = || async {
        let row = pg
            .query_one("SELECT count(*) FROM tasks WHERE status = 'succeeded'", &[])
            .await?;
        anyhow::Ok(row.get::<_, i64>(0))
    };
    let before = succeeded().await?;
    let (cost, took) = meter
        .measure(tasks, || async {
            // Eight clients submit; the queue stays full, the server's eight slots busy.
            let mut clients = Vec::new();
            for client in 0..8 {
                let (http, base, token) = (http.clone(), base.clone(), token.clone());
                let share = tasks / 8 + usize::from(client < tasks % 8);
                clients.push(tokio::spawn(async move {
                    for _ in 0..share {
                        json_of(
                            http.post(format!("{base}/api/v1/tasks"))
                                .bearer_auth(&token)
                                .json(
                                    &json!({"prompt": "a red fox running in the snow", "steps": 1}),
                                )
                                .send()
                                .await?,
                        )
                        .await?;
                    }
                    anyhow::Ok(())
                }));
            }
            for client in clients {
                client.await??;
            }
            let started = Instant::now();
            while succeeded().await? < before + i64::try_from(tasks)? {
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(600),
                    "the tasks never all succeeded"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(())
        })
        .await?;
    let per_second = tasks as f64 / took.as_secs_f64();
    println!(
        "{tasks} tasks end to end in {:.1} s: {per_second:.1} tasks/s; per task {:.1} Redis commands, {:.1} statements, {:.1} events",
        took.as_secs_f64(),
        cost.redis,
        cost.statements,
        cost.events
    );
    if let Some(count) = cost.allocations {
        println!("server allocations per task end to end: {count:.0}");
        figures.push(("sizing_allocations_per_task".into(), count, "allocations"));
    }
    println!("top Redis commands per task: {}", cost.redis_top);
    println!("top statements per task: {}", cost.statements_top);
    println!(
        "GPUs one zhihui serve keeps busy at this pace: {:.0} at 5 s per image, {:.0} at 30 s",
        per_second * 5.0,
        per_second * 30.0
    );
    figures.push(("sizing_redis_per_task".into(), cost.redis, "commands"));
    figures.push((
        "sizing_statements_per_task".into(),
        cost.statements,
        "statements",
    ));
    figures.push(("sizing_events_per_task".into(), cost.events, "events"));
    if cost.allocations.is_none() {
        figures.push(("sizing_tasks_end_to_end".into(), per_second, "tasks/s"));
    }
    drop(server);
    sim.stop().await;
    drop(std::fs::remove_dir_all(&scratch));
    Ok(figures)
}
