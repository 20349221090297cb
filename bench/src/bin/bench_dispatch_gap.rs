//! Benchmark of the GPU idle gap: the time from a server's slot freeing (its prompt's first
//! terminal message reaching the saga) to the next queued prompt being accepted by that server
//! (`POST /prompt` answered), with two ComfyUI simulators at zero latency, capacity 1 each, and a
//! queue that never runs dry. PRODUCT.md's target: p99 under 5 ms (the reference design polls
//! once a second, so its gap averages 500 ms).
//!
//! The whole path is real: Lua claim, intent row, `TaskDispatched` appended to PostgreSQL, the
//! post over HTTP, the socket, completions recorded and settled alongside.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo run --release --bin bench_dispatch_gap [-- TASKS [STEP_DELAY_MS]]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's (dropped at the end)
//! and uses a fresh Redis key prefix.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use anyhow::Context;
use comfyui_sim::{Faults, SimConfig, Simulator};
use secrecy::SecretString;
use uuid::Uuid;
use zhihui::bench_support::metadata;
use zhihui::configuration::Settings;
use zhihui::startup::{AppState, Overrides};
use zhihui::tasks::catalog::RequestedTask;
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tasks: usize = std::env::args()
        .nth(1)
        .map(|arg| arg.parse())
        .transpose()
        .context("the argument is the number of tasks")?
        .unwrap_or(2_000);
    // Simulated time per sampler step; 0 (the default) is the "zero latency" case.
    let step_delay_ms: u64 = std::env::args()
        .nth(2)
        .map(|arg| arg.parse())
        .transpose()
        .context("the second argument is the simulator's step delay in ms")?
        .unwrap_or(0);
    let directory = std::env::temp_dir().join(format!("zhihui-bench-gap-{}", Uuid::now_v7()));
    let mut sims = Vec::new();
    for index in 0..2 {
        sims.push(
            Simulator::start(SimConfig {
                bind: "127.0.0.1:0".parse()?,
                output_dir: directory.join(format!("sim-{index}")),
                models: vec!["majicmixRealistic_v7.safetensors".into()],
                faults: Faults {
                    step_delay_ms,
                    ..Faults::default()
                },
            })
            .await?,
        );
    }
    let backends: Vec<String> = sims
        .iter()
        .enumerate()
        .map(|(index, sim)| format!("gpu-{index} {} 1", sim.base_url()))
        .collect();
    let images = directory.join("images").to_string_lossy().into_owned();
    let outcome = Box::pin(zhihui::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
            );
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
            settings.translation.enabled = false;
            settings.tasks.queued_per_user_max = u32::MAX;
            settings.dispatch.backends = backends;
            settings.dispatch.images_directory = images;
            settings.database.pool_max_size = 16;
            settings.log.filter =
                std::env::var("ZHIHUI_LOG__FILTER").unwrap_or_else(|_| "warn".into());
        },
        |settings| async move { Box::pin(run(&settings, tasks)).await },
    ))
    .await;
    for sim in sims {
        sim.stop().await;
    }
    drop(std::fs::remove_dir_all(&directory));
    outcome
}

async fn run(
    settings: &Settings,
    tasks: usize,
) -> anyhow::Result<Vec<(String, f64, &'static str)>> {
    zhihui::telemetry::init(&settings.log)?;
    let pool = zhihui::postgres::build_pool(&settings.database)?;
    zhihui::postgres::migrate(&pool).await?;
    let state = AppState::build(settings, pool, Overrides::default())?;
    let user = UserId::from_uuid(Uuid::now_v7());
    state
        .accounts
        .execute(
            &account_stream(user),
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(i64::try_from(tasks)? + 10),
                reason: "bench".into(),
                at: state.clock.now(),
            },
            metadata(),
        )
        .await?;
    let request = RequestedTask {
        prompt: "a lighthouse at dusk".into(),
        negative_prompt: None,
        images: Some(1),
        model: None,
        resolution: None,
        steps: Some(1),
        cfg: None,
        sampler: None,
        scheduler: None,
        seed: None,
    };
    println!("submitting {tasks} tasks");
    for _ in 0..tasks {
        state
            .tasks
            .submit(user, &request, None, &metadata())
            .await
            .map_err(|error| anyhow::anyhow!("submit: {error}"))?;
    }
    let mut saga = state
        .dispatcher
        .lead()
        .await?
        .context("another dispatcher leads on this Redis prefix")?;
    let started = Instant::now();
    let mut gaps: Vec<Duration> = Vec::new();
    // Run until the queue is empty and every task finished.
    loop {
        saga.step().await?;
        gaps.extend(saga.take_gaps());
        if saga.in_flight() == 0 && state.tasks.queue.len().await? == 0 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "the run did not finish in 10 minutes"
        );
    }
    let elapsed = started.elapsed();
    saga.resign().await;
    anyhow::ensure!(!gaps.is_empty(), "no gap was measured");
    gaps.sort();
    let percentile = |p: f64| {
        let index = ((gaps.len() as f64 - 1.0) * p).round() as usize;
        gaps[index].as_secs_f64() * 1_000.0
    };
    let (p50, p99, max) = (percentile(0.5), percentile(0.99), percentile(1.0));
    println!(
        "{tasks} tasks on 2 servers in {:.1} s ({:.0} tasks/s); {} gaps measured",
        elapsed.as_secs_f64(),
        tasks as f64 / elapsed.as_secs_f64(),
        gaps.len()
    );
    println!("gap p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms (target p99 < 5 ms)");
    Ok(vec![
        ("dispatch_gap_p50".into(), p50, "ms"),
        ("dispatch_gap_p99".into(), p99, "ms"),
        (
            "dispatch_tasks_per_second".into(),
            tasks as f64 / elapsed.as_secs_f64(),
            "tasks/s",
        ),
    ])
}
