//! HTTP under load from a second process, and zhihui's memory meanwhile.
//!
//! Starts `zhihui serve` (the release binary next to this one, or `ZHIHUI_BIN`) as a child
//! process on a fresh database and Redis prefix, dispatcher off (tasks stay queued), registers
//! and logs in CLIENTS users over HTTP, grants them points, then for SECONDS each client loops:
//! `POST /api/v1/tasks` (freezes its price: appends to the account and the task streams), then
//! `GET /api/v1/tasks/{id}` of the task it just submitted (read model, with the submitted state
//! folded in until the projection has it). It reports throughput and p50/p99 of both, every
//! non-2xx answer, and the server's resident memory: its peak while under load (sampled every
//! 50 ms) and its high-water mark over the whole run (`VmHWM`, registration included).
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo build --release -p zhihui -p zhihui-bench && \
//!         target/release/bench_http [SECONDS (default 10)] [CLIENTS (default 64)]
//!
//! Then, when `wrk` is installed, the routes of the request path one by one under wrk (2 threads,
//! 64 connections, SECONDS / 2 each, once the projections caught up), each beside `GET /health`
//! (the framework's ceiling) measured against the same server in the same run: requests/s, p99,
//! the share of the ceiling, and CPU time per request: the server's, PostgreSQL's (every
//! `postgres` process), Redis's and the whole machine's (the rest is wrk and the kernel), each
//! read from `/proc` around the route's run.

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../serve/mod.rs"]
mod serve;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use secrecy::SecretString;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::cli::bench_support::metadata;
use zhihui::platform::configuration::Settings;
use zhihui::state::{AppState, Overrides};
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

/// Resident memory under load: the target is under 150 MB.
const MEMORY_TARGET_MB: f64 = 150.0;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let seconds: u64 = arg(1, "seconds of load")?.unwrap_or(10);
    let clients: usize = arg(2, "concurrent clients")?.unwrap_or(64);
    Box::pin(zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
            );
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
            settings.log.filter = "warn".into();
        },
        |settings| async move { Box::pin(run(settings, seconds, clients)).await },
    ))
    .await
}

fn arg<T: std::str::FromStr>(index: usize, what: &str) -> anyhow::Result<Option<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    std::env::args()
        .nth(index)
        .map(|value| value.parse::<T>())
        .transpose()
        .with_context(|| format!("argument {index} is the number of {what}"))
}

/// `VmRSS` or `VmHWM` of a process, in MB.
fn memory_mb(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
        .context("no such field in /proc/<pid>/status")?
        .parse()?;
    Ok(kb / 1024.0)
}

/// Register and log in a user; its id and token.
async fn user(http: &reqwest::Client, base: &str, index: usize) -> anyhow::Result<(Uuid, String)> {
    let credentials =
        json!({"username": format!("bench{index}"), "password": "correct horse battery staple"});
    let registered = http
        .post(format!("{base}/api/v1/auth/register"))
        .json(&credentials)
        .send()
        .await?;
    anyhow::ensure!(
        registered.status().is_success(),
        "register: {}",
        registered.status()
    );
    login(http, base, index).await
}

/// Log bench user `index` in: its id and a new token.
async fn login(http: &reqwest::Client, base: &str, index: usize) -> anyhow::Result<(Uuid, String)> {
    let credentials =
        json!({"username": format!("bench{index}"), "password": "correct horse battery staple"});
    let login: Value = http
        .post(format!("{base}/api/v1/auth/login"))
        .json(&credentials)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let id = Uuid::parse_str(login["user"]["id"].as_str().context("no user id")?)?;
    let token = login["token"].as_str().context("no token")?.to_owned();
    Ok((id, token))
}

#[derive(Default)]
struct Samples {
    submit: Vec<Duration>,
    query: Vec<Duration>,
}

async fn run(
    settings: Settings,
    seconds: u64,
    clients: usize,
) -> anyhow::Result<Vec<(String, f64, &'static str)>> {
    zhihui::platform::telemetry::init(&settings.log)?;
    let mut server = serve::start_server(
        &settings,
        &[
            ("ZHIHUI_TRANSLATION__ENABLED", "false"),
            ("ZHIHUI_TASKS__QUEUED_PER_USER_MAX", "100000000"),
            ("ZHIHUI_AUTH__LOGINS_PER_CLIENT_PER_MINUTE", "1000000"),
        ],
    )
    .await?;
    let base = server.base.clone();
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    let state = AppState::build(&settings, pool, Overrides::default())?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()?;
    println!("registering {clients} users");
    let mut users = Vec::new();
    for index in 0..clients {
        let (id, token) = user(&http, &base, index).await?;
        state
            .accounts
            .execute(
                &account_stream(UserId::from_uuid(id)),
                AccountCommand::Grant {
                    operation_id: Uuid::now_v7(),
                    amount: Amount::whole(1_000_000),
                    reason: "bench".into(),
                    at: state.clock.now(),
                },
                metadata(),
            )
            .await?;
        users.push(token);
    }
    let rss_before = memory_mb(server.pid, "VmRSS")?;
    println!(
        "server resident before the load: {rss_before:.1} MB; {clients} clients for {seconds} s"
    );

    let errors = Arc::new(AtomicU64::new(0));
    let peak_kb = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let sampler = {
        let peak_kb = peak_kb.clone();
        let pid = server.pid;
        tokio::spawn(async move {
            while Instant::now() < deadline {
                if let Ok(mb) = memory_mb(pid, "VmRSS") {
                    peak_kb.fetch_max((mb * 1024.0) as u64, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let started = Instant::now();
    let mut workers = Vec::new();
    for token in users {
        let http = http.clone();
        let base = base.clone();
        let errors = errors.clone();
        workers.push(tokio::spawn(async move {
            let mut samples = Samples::default();
            let body = json!({"prompt": "a lighthouse at dusk", "images": 1, "steps": 20});
            while Instant::now() < deadline {
                let at = Instant::now();
                let submitted = http
                    .post(format!("{base}/api/v1/tasks"))
                    .bearer_auth(&token)
                    .json(&body)
                    .send()
                    .await;
                let task_id = match submitted {
                    Ok(response) if response.status().is_success() => {
                        let answer: Value = response.json().await.unwrap_or_default();
                        samples.submit.push(at.elapsed());
                        answer["task_id"].as_str().map(str::to_owned)
                    }
                    _ => None,
                };
                let Some(task_id) = task_id else {
                    errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let at = Instant::now();
                match http
                    .get(format!("{base}/api/v1/tasks/{task_id}"))
                    .bearer_auth(&token)
                    .send()
                    .await
                {
                    Ok(response) if response.status().is_success() => {
                        drop(response.bytes().await);
                        samples.query.push(at.elapsed());
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            samples
        }));
    }
    let mut all = Samples::default();
    for worker in workers {
        let samples = worker.await?;
        all.submit.extend(samples.submit);
        all.query.extend(samples.query);
    }
    let elapsed = started.elapsed().as_secs_f64();
    sampler.await?;
    let peak_under_load = peak_kb.load(Ordering::Relaxed) as f64 / 1024.0;
    let high_water = memory_mb(server.pid, "VmHWM")?;
    // The projections catch up on the load before the routes are measured one by one (their
    // work would otherwise fall on the first routes).
    let client = state.pg_pool.get().await?;
    let mut last = -1_i64;
    loop {
        let projected: i64 = client
            .query_one("SELECT count(*) FROM tasks", &[])
            .await?
            .get(0);
        if projected == last {
            break;
        }
        last = projected;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(client);
    let external = match wrk_available() {
        true => external_load(&http, &base, server.pid, seconds).await?,
        false => {
            println!("wrk is not installed (apt-get install wrk): no external load generator run");
            Vec::new()
        }
    };
    drop(server.child.start_kill());
    drop(server.child.wait().await);

    anyhow::ensure!(
        !all.submit.is_empty() && !all.query.is_empty(),
        "no request succeeded"
    );
    let (submit_p50, submit_p99) = percentiles(&mut all.submit);
    let (query_p50, query_p99) = percentiles(&mut all.query);
    let submits = all.submit.len() as f64 / elapsed;
    let queries = all.query.len() as f64 / elapsed;
    let errors = errors.load(Ordering::Relaxed);
    println!("| request | per second | p50 ms | p99 ms |");
    println!("|---|---|---|---|");
    println!("| POST /api/v1/tasks | {submits:.0} | {submit_p50:.2} | {submit_p99:.2} |");
    println!("| GET /api/v1/tasks/{{id}} | {queries:.0} | {query_p50:.2} | {query_p99:.2} |");
    println!("non-2xx or failed requests: {errors}");
    println!(
        "server resident memory: peak under load {peak_under_load:.1} MB, high-water mark {high_water:.1} MB (target < {MEMORY_TARGET_MB} MB)"
    );
    let mut figures = vec![
        ("http_submit_per_second".into(), submits, "requests/s"),
        ("http_submit_p50".into(), submit_p50, "ms"),
        ("http_submit_p99".into(), submit_p99, "ms"),
        ("http_query_per_second".into(), queries, "requests/s"),
        ("http_query_p50".into(), query_p50, "ms"),
        ("http_query_p99".into(), query_p99, "ms"),
        ("http_errors".into(), errors as f64, "requests"),
        (
            "http_server_rss_peak_under_load".into(),
            peak_under_load,
            "MB",
        ),
        ("http_server_rss_high_water".into(), high_water, "MB"),
    ];
    figures.extend(external);
    Ok(figures)
}

fn wrk_available() -> bool {
    std::process::Command::new("wrk")
        .arg("--version")
        .output()
        .is_ok()
}

/// Connections wrk holds open, as many as the 64-client targets name.
const WRK_CONNECTIONS: usize = 64;

/// What wrk saw of one route.
struct WrkRun {
    /// Answers that served (2xx or 3xx) per second: wrk's own rate counts error answers too.
    per_second: f64,
    p99_ms: f64,
    /// Error answers and requests without an answer.
    errors: u64,
    /// The server's CPU time (user + system) per answered request, µs.
    server_cpu_us: f64,
    /// PostgreSQL's (every `postgres` process: backends, autovacuum, WAL writer) per request, µs.
    postgres_cpu_us: f64,
    /// Redis's per request, µs.
    redis_cpu_us: f64,
    /// The whole machine's busy time per request (server, stores, wrk, kernel), µs.
    machine_us: f64,
}

/// Run wrk (2 threads, [`WRK_CONNECTIONS`]) against `url` for `seconds`, with `args` before it.
async fn wrk(pid: u32, seconds: u64, args: &[String], url: &str) -> anyhow::Result<WrkRun> {
    use zhihui::cli::bench_support::{WrkOutput, machine_cpu_us, process_cpu_us, processes_cpu_us};
    // No such process on this host (a remote store): nothing of it is counted.
    let of = |name| processes_cpu_us(name).map(|cpu_us| cpu_us.unwrap_or(0.0));
    let cpu_before = process_cpu_us(pid)?;
    let postgres_before = of("postgres")?;
    let redis_before = of("redis-server")?;
    let machine_before = machine_cpu_us()?.busy_us;
    let output = tokio::process::Command::new("wrk")
        .args([
            "-t2",
            &format!("-c{WRK_CONNECTIONS}"),
            &format!("-d{seconds}s"),
            "--latency",
        ])
        .args(args)
        .arg(url)
        .output()
        .await
        .context("running wrk")?;
    let cpu = process_cpu_us(pid)? - cpu_before;
    let postgres = of("postgres")? - postgres_before;
    let redis = of("redis-server")? - redis_before;
    let machine = machine_cpu_us()?.busy_us - machine_before;
    let text = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(output.status.success(), "wrk failed: {text}");
    let parsed = WrkOutput::parse(&text)?;
    Ok(WrkRun {
        per_second: parsed.ok_per_second(),
        p99_ms: parsed.p99_ms,
        errors: parsed.errors(),
        server_cpu_us: cpu / parsed.answers,
        postgres_cpu_us: postgres / parsed.answers,
        redis_cpu_us: redis / parsed.answers,
        machine_us: machine / parsed.answers,
    })
}

/// The routes of the request path under an external load generator (wrk), each beside GET
/// /health (the framework's ceiling on this machine) measured in the same run.
async fn external_load(
    http: &reqwest::Client,
    base: &str,
    pid: u32,
    seconds: u64,
) -> anyhow::Result<Vec<(String, f64, &'static str)>> {
    // The first bench user (a million points, thousands of tasks queued by now) logs in again
    // for a token of its own: GET /tasks/{id} and POST /tasks meet a long queue and a user with
    // thousands of waiting tasks, what made them grow before.
    let (_, token) = login(http, base, 0).await?;
    let submitted: Value = http
        .post(format!("{base}/api/v1/tasks"))
        .bearer_auth(&token)
        .json(&json!({"prompt": "一只在雪地里奔跑的红狐狸", "steps": 20}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let task_id = submitted["task_id"]
        .as_str()
        .context("no task id")?
        .to_owned();
    let scratch = std::env::temp_dir().join(format!("bench-http-{}", Uuid::now_v7().simple()));
    std::fs::create_dir_all(&scratch)?;
    let post_script = scratch.join("submit.lua");
    std::fs::write(
        &post_script,
        "wrk.method = \"POST\"\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n\
         wrk.body = '{\"prompt\": \"一只在雪地里奔跑的红狐狸\", \"steps\": 20}'\n",
    )?;
    let bearer = vec!["-H".to_owned(), format!("Authorization: Bearer {token}")];
    let cookie = vec![
        "-H".to_owned(),
        format!("Cookie: {}={token}", zhihui::web::SESSION_COOKIE),
    ];
    let mut submit_args = bearer.clone();
    submit_args.extend(["-s".to_owned(), post_script.to_string_lossy().into_owned()]);
    let cases: Vec<(&str, &str, Vec<String>, String)> = vec![
        (
            "health",
            "GET /health (the ceiling)",
            Vec::new(),
            format!("{base}/health"),
        ),
        (
            "me",
            "GET /api/v1/me",
            bearer.clone(),
            format!("{base}/api/v1/me"),
        ),
        (
            "account",
            "GET /api/v1/account",
            bearer.clone(),
            format!("{base}/api/v1/account"),
        ),
        (
            "task",
            "GET /api/v1/tasks/{id}",
            bearer.clone(),
            format!("{base}/api/v1/tasks/{task_id}"),
        ),
        (
            "ledger",
            "GET /api/v1/account/ledger",
            bearer.clone(),
            format!("{base}/api/v1/account/ledger?limit=20"),
        ),
        (
            "generate_page",
            "GET /generate (web page)",
            cookie,
            format!("{base}/generate"),
        ),
        (
            "submit",
            "POST /api/v1/tasks, one user",
            submit_args,
            format!("{base}/api/v1/tasks"),
        ),
    ];
    let seconds = (seconds / 2).max(3);
    println!();
    println!("wrk, 2 threads, {WRK_CONNECTIONS} connections, {seconds} s per route, same server:");
    println!(
        "| route | 2xx per second | p99 ms | share of /health | CPU µs per request: server | PostgreSQL | Redis | machine | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut figures = Vec::new();
    let mut ceiling = 0.0;
    for (key, label, args, url) in cases {
        let run = wrk(pid, seconds, &args, &url).await?;
        if key == "health" {
            ceiling = run.per_second;
        }
        let share = if ceiling > 0.0 {
            run.per_second / ceiling
        } else {
            0.0
        };
        println!(
            "| {label} | {:.0} | {:.2} | {:.1} % | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
            run.per_second,
            run.p99_ms,
            share * 100.0,
            run.server_cpu_us,
            run.postgres_cpu_us,
            run.redis_cpu_us,
            run.machine_us,
            run.errors
        );
        figures.push((
            format!("http_wrk_{key}_per_second"),
            run.per_second,
            "requests/s",
        ));
        figures.push((format!("http_wrk_{key}_p99"), run.p99_ms, "ms"));
        figures.push((
            format!("http_wrk_{key}_server_cpu"),
            run.server_cpu_us,
            "µs",
        ));
        figures.push((
            format!("http_wrk_{key}_postgres_cpu"),
            run.postgres_cpu_us,
            "µs",
        ));
        figures.push((format!("http_wrk_{key}_redis_cpu"), run.redis_cpu_us, "µs"));
        figures.push((format!("http_wrk_{key}_machine"), run.machine_us, "µs"));
        figures.push((
            format!("http_wrk_{key}_errors"),
            run.errors as f64,
            "requests",
        ));
        if key != "health" {
            figures.push((
                format!("http_wrk_{key}_share_of_health"),
                share * 100.0,
                "%",
            ));
        }
    }
    drop(std::fs::remove_dir_all(&scratch));
    Ok(figures)
}

/// p50 and p99 of `samples`, in ms.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |p: f64| {
        zhihui::cli::bench_support::percentile(samples, p)
            .map_or(0.0, zhihui::cli::bench_support::ms)
    };
    (at(0.5), at(0.99))
}
