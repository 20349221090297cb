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
use zhihui::bench_support::metadata;
use zhihui::configuration::Settings;
use zhihui::startup::{AppState, Overrides};
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

/// PRODUCT.md section 6: resident memory under load.
const MEMORY_TARGET_MB: f64 = 150.0;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seconds: u64 = arg(1, "seconds of load")?.unwrap_or(10);
    let clients: usize = arg(2, "concurrent clients")?.unwrap_or(64);
    Box::pin(zhihui::bench_support::with_fresh_database(
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
    zhihui::telemetry::init(&settings.log)?;
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
    let pool = zhihui::postgres::build_pool(&settings.database)?;
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
    Ok(vec![
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
    ])
}

/// p50 and p99 of `samples`, in ms.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |p: f64| {
        zhihui::bench_support::percentile(samples, p).map_or(0.0, zhihui::bench_support::ms)
    };
    (at(0.5), at(0.99))
}
