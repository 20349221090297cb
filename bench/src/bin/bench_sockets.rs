//! Queue positions to many open sockets: what one queue change costs Redis.
//!
//! Starts `zhihui serve` (the release binary next to this one, or `ZHIHUI_BIN`: run it with an
//! older binary for the "before" figure) on a fresh database and Redis prefix, dispatcher off.
//! SOCKETS users (sessions made directly in Redis) each open one socket (`?token=`) and watch
//! TASKS queued tasks (put in the Redis queue and announced with a `position` notice, as a
//! submit does). Then CHANGES times: the queue's head is claimed and `queue_moved` published,
//! as the dispatcher does; every task behind it moves up one place, so every watched task still
//! queued gets a `position` message. For each change the program waits until they all arrived.
//!
//! Reported: Redis commands per queue change (`INFO commandstats`, all clients: the server's
//! socket fan-out, plus this program's claim and publish, 2 per change), the busiest commands,
//! and the time from the publish to the last socket's message (p50/p99 over the changes).
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo build --release -p zhihui -p zhihui-bench && \
//!         target/release/bench_sockets [SOCKETS (1000)] [TASKS (5)] [CHANGES (50)]

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../serve/mod.rs"]
mod serve;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use secrecy::SecretString;
use uuid::Uuid;
use zhihui::cli::bench_support::{arg, ms, percentile};
use zhihui::platform::configuration::Settings;
use zhihui::platform::notify::TaskNotice;
use zhihui::state::{AppState, Overrides};
use zhihui_domain::user::{Role, UserId};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let sockets: usize = arg(1)?.unwrap_or(1000);
    let tasks: usize = arg(2)?.unwrap_or(5);
    let changes: usize = arg(3)?.unwrap_or(50);
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
            );
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        },
        |settings| Box::pin(run(settings, sockets, tasks, changes)),
    )
    .await
}

/// `INFO commandstats`: calls per command.
async fn command_calls(state: &AppState) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut connection = state.redis.connection().await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut connection)
        .await?;
    Ok(info
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect())
}

/// Wait until `counter` reaches `target`; the time it took, `None` past 60 s.
async fn reached(counter: &AtomicU64, target: u64, since: Instant) -> Option<Duration> {
    while counter.load(Ordering::SeqCst) < target {
        if since.elapsed() > Duration::from_secs(60) {
            return None;
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    Some(since.elapsed())
}

async fn run(
    settings: Settings,
    sockets: usize,
    tasks: usize,
    changes: usize,
) -> anyhow::Result<Vec<zhihui::cli::bench_support::Figure>> {
    let server =
        serve::start_server(&settings, &[("ZHIHUI_HTTP__SOCKETS_PER_USER_MAX", "8")]).await?;
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    let state = AppState::build(&settings, pool, Overrides::default())?;
    let positions = Arc::new(AtomicU64::new(0));
    println!("opening {sockets} sockets");
    let mut users = Vec::with_capacity(sockets);
    for _ in 0..sockets {
        let user_id = UserId::from_uuid(Uuid::now_v7());
        let since = state.sessions.login_epoch().await?;
        let (token, _) = state
            .sessions
            .create(user_id, Role::User, since)
            .await?
            .context("a session")?;
        let url = format!(
            "{}/api/v1/ws?token={token}",
            server.base.replace("http://", "ws://")
        );
        let (mut socket, _) = async_tungstenite::tokio::connect_async(url.as_str())
            .await
            .context("opening a socket")?;
        let counter = positions.clone();
        tokio::spawn(async move {
            while let Some(Ok(frame)) = socket.next().await {
                if let async_tungstenite::tungstenite::Message::Text(text) = frame
                    && text.as_str().contains("\"position\"")
                {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        users.push(user_id);
    }
    println!("queueing {} tasks, {tasks} per socket", sockets * tasks);
    // Round-robin over users: every socket has tasks all along the queue.
    let mut queued = 0u64;
    for _round in 0..tasks {
        for &user_id in &users {
            let task_id = Uuid::now_v7();
            let score = state.tasks.queue.next_score().await?;
            let rank = state
                .tasks
                .queue
                .enqueue(task_id, score, None)
                .await?
                .context("enqueued")?;
            state
                .notifier
                .tell(
                    user_id,
                    task_id,
                    TaskNotice::Position {
                        position: rank + 1,
                        estimated_start_at: None,
                        estimated_end_at: None,
                    },
                )
                .await;
            queued += 1;
        }
    }
    // Each socket tells each task's first position once.
    reached(&positions, queued, Instant::now())
        .await
        .context("the first positions never all arrived")?;
    println!("every socket follows its tasks; {changes} queue changes");

    let before = command_calls(&state).await?;
    let mut fan_out = Vec::with_capacity(changes);
    let mut remaining = queued;
    for _ in 0..changes {
        let expected = positions.load(Ordering::SeqCst) + remaining - 1;
        let claimed = state.tasks.queue.claim(60_000).await?;
        anyhow::ensure!(claimed.is_some(), "the queue ran dry");
        remaining -= 1;
        let published = Instant::now();
        state.notifier.queue_moved().await;
        let took = reached(&positions, expected, published)
            .await
            .context("the positions of a queue change never all arrived")?;
        fan_out.push(took);
    }
    let after = command_calls(&state).await?;

    let mut deltas: Vec<(String, u64)> = after
        .iter()
        .map(|(name, calls)| (name.clone(), calls - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, delta)| *delta > 0)
        .collect();
    deltas.sort_by_key(|(_, delta)| std::cmp::Reverse(*delta));
    let total: u64 = deltas.iter().map(|(_, delta)| delta).sum();
    let per_change = total as f64 / changes as f64;
    fan_out.sort();
    let p50 = percentile(&fan_out, 0.50).map_or(0.0, ms);
    let p99 = percentile(&fan_out, 0.99).map_or(0.0, ms);
    println!(
        "{sockets} sockets x {tasks} tasks, {changes} queue changes: {per_change:.1} Redis commands per change (this program's claim and publish included)"
    );
    for (name, delta) in deltas.iter().take(6) {
        println!(
            "  {name:<12} {:>10.1} per change",
            *delta as f64 / changes as f64
        );
    }
    println!(
        "publish -> every socket told (up to {} position messages per change): p50 {p50:.1} ms, p99 {p99:.1} ms",
        remaining
    );
    Ok(vec![
        (
            "sockets_redis_commands_per_queue_change".into(),
            per_change,
            "commands",
        ),
        ("sockets_fan_out_p50".into(), p50, "ms"),
        ("sockets_fan_out_p99".into(), p99, "ms"),
    ])
}
