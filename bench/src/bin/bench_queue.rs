//! Benchmark of the task queue in Redis (`zhihui::tasks::queue::TaskQueue`) against BullMQ on the
//! same Redis, in one run: enqueue, claim + complete, prioritise and cancel, with the same number
//! of jobs and the same concurrency on both sides. Prints a side-by-side table, then one
//! `RESULT <name> <value> <unit>` line per figure.
//!
//!     REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo run --release -p zhihui-bench --bin bench_queue [-- JOBS [CONCURRENCY]]
//!
//! With `REDIS_CLUSTER_NODES` (seed URLs of a Redis Cluster, e.g. from
//! `scripts/services.sh start-redis-cluster`) our side runs a third time, on the cluster, after
//! BullMQ's, and a second table sets it beside our side on the one node of REDIS_URL (BullMQ
//! runs on the one node only: its keys of one queue share a hash tag, so a cluster gives it one
//! node as well).
//!
//! Defaults: 50,000 jobs, concurrency 100. Needs `node` (20+) and `npm`: the BullMQ side is
//! `bench/bullmq/bench.mjs` (BullMQ and ioredis pinned in its `package-lock.json`; `npm ci` runs
//! first when `node_modules` is missing). Our side runs first, then BullMQ's, one after the
//! other, never at the same time. Keys: ours under a fresh prefix `bench:<uuid>`, deleted before
//! BullMQ's side starts; BullMQ's under `bench:<uuid>:bullmq`, obliterated by `bench.mjs`, and
//! whatever is left under the prefix is deleted at the end.
//!
//! Only `TaskQueue`'s public methods are called, and none of them touches PostgreSQL: the queue
//! holds task ids (UUIDs) only, so no task has to exist anywhere else.
//!
//! What each side does (ours / BullMQ):
//! - enqueue: CONCURRENCY concurrent enqueuers, each enqueue being what a submit does to Redis,
//!   `next_score` (a score ticket, one script) then `enqueue` (one script) — two round trips;
//!   our API has no batch enqueue. / CONCURRENCY concurrent producers, one `queue.add` each (one
//!   script), every job with a priority so that it lives in BullMQ's prioritized sorted set, like
//!   ours in a sorted set (prioritise and remove on BullMQ's plain wait list are O(n) LREMs).
//!   BullMQ's batched `addBulk` (1000 per call) is reported too; we have nothing to set against it.
//! - process: CONCURRENCY workers, each looping `claim` (lease 30 s, the setting's default) then
//!   `release_lease` (the completion), until the queue is empty; per-job latency from the claim's
//!   start to the release's answer (two round trips). The dispatcher itself claims through
//!   `dispatch_fill.lua` instead, which also releases ended prompts' slots, checks its leader
//!   lease and fills every server's free slots in the same script. / a `Worker` with concurrency CONCURRENCY, a
//!   no-op processor and `removeOnComplete`; per-job latency from the processor's start to the
//!   'completed' event: one round trip (`moveToFinished`), which also fetches that slot's next job
//!   (BullMQ bundles the next claim into the completion). Jobs/s from the first completion to the
//!   last on both sides. BullMQ drains the jobs its `addBulk` added (no priority: its wait list,
//!   not its prioritized sorted set); ours drains the tasks of our first enqueue pass.
//! - prioritise: a random sample (JOBS / 5) of waiting tasks: `prioritise_target` (jump up to the
//!   setting's `prioritise_jump_max` places, read only, given the score the task's events give
//!   it, as the product gives it: ZSCORE and ZRANGE BYSCORE in one round trip, the script by rank
//!   where that cannot answer) then `move_to` (ZADD XX), two round trips.
//!   / `job.changePriority({ priority: 1 })`, one script.
//! - cancel: another sample, disjoint: `remove` (ZREM). / `job.remove()` (one script that also
//!   deletes the job's hash).
//!
//! Not equal, either way: a BullMQ job carries data (here one UUID as JSON) in a hash of its own,
//! keeps a lock, an events stream and counters, and its scripts do that bookkeeping; our queue
//! holds the task id only (the task itself lives in the event store). The product's prioritise
//! and cancel also append events to PostgreSQL and charge points; only their Redis part is
//! measured here. Our side runs on Tokio (a worker thread per core) over one multiplexed
//! connection; BullMQ runs on one Node.js thread with one connection for the queue and two for
//! the worker. Redis, the client and whatever else runs on the machine share its cores.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::seq::SliceRandom;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use uuid::Uuid;
use zhihui::platform::clock::Clock;
use zhihui::platform::configuration::Settings;
use zhihui::platform::redis_store::RedisStore;
use zhihui::tasks::queue::{PrioritiseTarget, TaskQueue};
use zhihui_domain::task::TaskId;

const BULLMQ_DIRECTORY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/bullmq");

/// One measured phase: how many operations, how long, and the latency of each.
#[derive(Debug, Clone, Copy)]
struct Phase {
    count: usize,
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// The figures of one operation on both sides, as printed and as `RESULT` lines.
#[derive(Debug)]
struct Row {
    op: &'static str,
    label: &'static str,
    ours: Option<Phase>,
    theirs: Phase,
    unit: &'static str,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let jobs: usize = argument(1, "the first argument is the number of jobs")?.unwrap_or(50_000);
    let concurrency: usize = argument(2, "the second argument is the concurrency")?.unwrap_or(100);
    anyhow::ensure!(
        jobs >= 2 && concurrency >= 1,
        "JOBS must be at least 2 and CONCURRENCY at least 1"
    );
    let sample = (jobs / 5).max(1);

    let mut settings = Settings::load(None)?;
    if let Ok(url) = std::env::var("REDIS_URL") {
        settings.redis.url = SecretString::from(url);
    }
    // The first two sides run on the one node of REDIS_URL (the cluster comes last).
    settings.redis.cluster_nodes = SecretString::from(String::new());
    settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
    let store = RedisStore::new(&settings.redis)?;
    store.ping().await.context("Redis does not answer")?;
    let queue = TaskQueue::new(store.clone(), Clock::System);
    let bullmq_prefix = format!("{}:bullmq", settings.redis.key_prefix);
    println!(
        "{jobs} jobs, concurrency {concurrency}, prioritise/cancel samples of {sample}; keys under {}",
        settings.redis.key_prefix
    );

    let ours = ours_run(&settings, &queue, jobs, concurrency, sample).await;
    // Our keys go before BullMQ runs: it should not share Redis with our leftover tasks.
    let deleted = delete_keys(&store).await;
    let theirs = match (&ours, &deleted) {
        (Ok(_), Ok(_)) => bullmq(&settings, &bullmq_prefix, jobs, concurrency, sample).await,
        _ => Err(anyhow::anyhow!("not run: our side or its cleanup failed")),
    };
    // Whatever BullMQ's obliterate left (nothing, so far), or its keys if it failed.
    let deleted_after = delete_keys(&store).await;
    let ours = ours?;
    println!("cleanup after our side: {}", deleted?);
    let theirs = theirs?;
    println!("cleanup after BullMQ's: {}", deleted_after?);

    let bullmq_phase = |name: &str| phase_from_json(&theirs, name);
    let rows = [
        Row {
            op: "enqueue",
            label: "enqueue, one at a time",
            ours: Some(ours.enqueue),
            theirs: bullmq_phase("enqueue")?,
            unit: "jobs/s",
        },
        Row {
            op: "enqueue_bulk",
            label: "enqueue, batches of 1000",
            ours: None,
            theirs: bullmq_phase("enqueue_bulk")?,
            unit: "jobs/s",
        },
        Row {
            op: "process",
            label: "claim + complete",
            ours: Some(ours.process),
            theirs: bullmq_phase("process")?,
            unit: "jobs/s",
        },
        Row {
            op: "prioritise",
            label: "prioritise a waiting job",
            ours: Some(ours.prioritise),
            theirs: bullmq_phase("prioritise")?,
            unit: "ops/s",
        },
        Row {
            op: "cancel",
            label: "cancel a waiting job",
            ours: Some(ours.cancel),
            theirs: bullmq_phase("cancel")?,
            unit: "ops/s",
        },
    ];

    println!();
    println!(
        "BullMQ {} with ioredis {} on Node.js {}",
        theirs["bullmq_version"].as_str().unwrap_or("?"),
        theirs["ioredis_version"].as_str().unwrap_or("?"),
        theirs["node_version"].as_str().unwrap_or("?"),
    );
    println!(
        "ours, first enqueue pass (the tasks then processed): {:.0} jobs/s, p50 {:.2} ms, p99 {:.2} ms",
        ours.enqueue_first.per_second, ours.enqueue_first.p50_ms, ours.enqueue_first.p99_ms
    );
    println!(
        "prioritise outcomes (ours): {} moved ahead, {} already first, {} other",
        ours.moved, ours.already_first, ours.not_moved
    );
    println!();
    println!(
        "{:<26} {:>8} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>7}",
        "operation", "n", "ours/s", "p50 ms", "p99 ms", "BullMQ/s", "p50 ms", "p99 ms", "ratio"
    );
    for row in &rows {
        let theirs = row.theirs;
        match row.ours {
            Some(ours) => println!(
                "{:<26} {:>8} | {:>10.0} {:>8.2} {:>8.2} | {:>10.0} {:>8.2} {:>8.2} | {:>6.2}x",
                row.label,
                ours.count,
                ours.per_second,
                ours.p50_ms,
                ours.p99_ms,
                theirs.per_second,
                theirs.p50_ms,
                theirs.p99_ms,
                ours.per_second / theirs.per_second
            ),
            None => println!(
                "{:<26} {:>8} | {:>10} {:>8} {:>8} | {:>10.0} {:>8.2} {:>8.2} | {:>7}",
                row.label,
                theirs.count,
                "n/a",
                "",
                "",
                theirs.per_second,
                theirs.p50_ms,
                theirs.p99_ms,
                ""
            ),
        }
    }
    println!(
        "latency: enqueue per call (BullMQ batches: per addBulk call of 1000); claim + complete \
         per job, ours claim start -> lease released, BullMQ processor start -> 'completed' event"
    );
    let bulk = rows
        .iter()
        .find(|row| row.op == "enqueue_bulk")
        .map(|row| row.theirs)
        .context("no addBulk row")?;
    println!(
        "ours (one at a time) / BullMQ addBulk: {:.2}x",
        ours.enqueue.per_second / bulk.per_second
    );

    println!();
    for row in &rows {
        if let Some(ours) = row.ours {
            println!(
                "RESULT queue_{}_per_second {:.1} {}",
                row.op, ours.per_second, row.unit
            );
        }
        println!(
            "RESULT bullmq_{}_per_second {:.1} {}",
            row.op, row.theirs.per_second, row.unit
        );
        if let Some(ours) = row.ours {
            println!("RESULT queue_{}_p99 {:.2} ms", row.op, ours.p99_ms);
        }
        println!("RESULT bullmq_{}_p99 {:.2} ms", row.op, row.theirs.p99_ms);
        if let Some(ours) = row.ours {
            println!(
                "RESULT queue_{}_ratio_vs_bullmq {:.2} x",
                row.op,
                ours.per_second / row.theirs.per_second
            );
        }
    }
    println!(
        "RESULT queue_enqueue_ratio_vs_bullmq_bulk {:.2} x",
        ours.enqueue.per_second / bulk.per_second
    );

    let cluster_nodes = std::env::var("REDIS_CLUSTER_NODES").unwrap_or_default();
    if !cluster_nodes.trim().is_empty() {
        let mut on_cluster = settings.clone();
        on_cluster.redis.cluster_nodes = SecretString::from(cluster_nodes);
        on_cluster.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        let cluster_store = RedisStore::new(&on_cluster.redis)?;
        cluster_store
            .ping()
            .await
            .context("the Redis Cluster does not answer")?;
        let cluster_queue = TaskQueue::new(cluster_store.clone(), Clock::System);
        eprintln!("[ours] again, on the Redis Cluster");
        let clustered = ours_run(&on_cluster, &cluster_queue, jobs, concurrency, sample).await;
        let cleaned = delete_keys(&cluster_store).await;
        let clustered = clustered?;
        println!("cleanup after our side on the cluster: {}", cleaned?);
        println!();
        println!(
            "{:<26} {:>8} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>7}",
            "ours: one node vs cluster",
            "n",
            "node/s",
            "p50 ms",
            "p99 ms",
            "cluster/s",
            "p50 ms",
            "p99 ms",
            "ratio"
        );
        let pairs = [
            (
                "enqueue",
                "enqueue, one at a time",
                ours.enqueue,
                clustered.enqueue,
            ),
            (
                "process",
                "claim + complete",
                ours.process,
                clustered.process,
            ),
            (
                "prioritise",
                "prioritise a waiting job",
                ours.prioritise,
                clustered.prioritise,
            ),
            (
                "cancel",
                "cancel a waiting job",
                ours.cancel,
                clustered.cancel,
            ),
        ];
        for (_, label, node, cluster) in &pairs {
            println!(
                "{:<26} {:>8} | {:>10.0} {:>8.2} {:>8.2} | {:>10.0} {:>8.2} {:>8.2} | {:>6.2}x",
                label,
                cluster.count,
                node.per_second,
                node.p50_ms,
                node.p99_ms,
                cluster.per_second,
                cluster.p50_ms,
                cluster.p99_ms,
                cluster.per_second / node.per_second
            );
        }
        println!();
        for (op, _, node, cluster) in &pairs {
            println!(
                "RESULT queue_{op}_cluster_per_second {:.1} ops/s",
                cluster.per_second
            );
            println!("RESULT queue_{op}_cluster_p99 {:.2} ms", cluster.p99_ms);
            println!(
                "RESULT queue_{op}_cluster_vs_node_ratio {:.2} x",
                cluster.per_second / node.per_second
            );
        }
    }
    Ok(())
}

fn argument(position: usize, meaning: &str) -> anyhow::Result<Option<usize>> {
    std::env::args()
        .nth(position)
        .map(|arg| arg.parse())
        .transpose()
        .context(meaning.to_owned())
}

/// Our side's figures.
#[derive(Debug)]
struct Ours {
    enqueue_first: Phase,
    enqueue: Phase,
    process: Phase,
    prioritise: Phase,
    cancel: Phase,
    moved: usize,
    already_first: usize,
    not_moved: usize,
}

async fn ours_run(
    settings: &Settings,
    queue: &TaskQueue,
    jobs: usize,
    concurrency: usize,
    sample: usize,
) -> anyhow::Result<Ours> {
    let lease_ms = settings.tasks.claim_lease_ms;
    let jump_max = settings.tasks.prioritise_jump_max;

    eprintln!("[ours] enqueue: {jobs} tasks, {concurrency} concurrent enqueuers");
    let enqueue_first = enqueue(queue, jobs, concurrency).await?.0;
    anyhow::ensure!(
        queue.len().await? == jobs as u64,
        "not every task was queued"
    );

    eprintln!(
        "[ours] process: {jobs} tasks, {concurrency} workers (claim, then release the lease)"
    );
    let process = process(queue, concurrency, lease_ms).await?;
    anyhow::ensure!(
        process.count == jobs && queue.len().await? == 0,
        "processed {} tasks of {jobs}",
        process.count
    );

    eprintln!("[ours] enqueue: {jobs} tasks again, {concurrency} concurrent enqueuers");
    let (enqueue, mut ids) = enqueue(queue, jobs, concurrency).await?;

    ids.shuffle(&mut rand::rng());
    let to_cancel = ids.split_off(ids.len() - sample);
    ids.truncate(sample);
    let to_prioritise = ids;
    // Each task's score, as the product knows it from the task's events; read before the phase.
    let known_scores: Arc<std::collections::HashMap<TaskId, i64>> =
        Arc::new(queue.entries().await?.into_iter().collect());

    eprintln!("[ours] prioritise: {sample} tasks (jump up to {jump_max} places)");
    let moved = Arc::new(AtomicUsize::new(0));
    let already_first = Arc::new(AtomicUsize::new(0));
    let prioritise = {
        let queue = queue.clone();
        let moved = moved.clone();
        let already_first = already_first.clone();
        concurrently(to_prioritise, concurrency, move |task_id| {
            let queue = queue.clone();
            let moved = moved.clone();
            let already_first = already_first.clone();
            let known_score = known_scores.get(&task_id).copied();
            async move {
                match queue
                    .prioritise_target(task_id, known_score, jump_max)
                    .await?
                {
                    PrioritiseTarget::Ahead { to_score, .. } => {
                        queue.move_to(task_id, to_score).await?;
                        moved.fetch_add(1, Ordering::Relaxed);
                    }
                    PrioritiseTarget::AlreadyFirst => {
                        already_first.fetch_add(1, Ordering::Relaxed);
                    }
                    PrioritiseTarget::NotQueued | PrioritiseTarget::NoRoom => {}
                }
                Ok(())
            }
        })
        .await?
    };
    let moved = moved.load(Ordering::Relaxed);
    let already_first = already_first.load(Ordering::Relaxed);

    eprintln!("[ours] cancel: {sample} other tasks");
    let cancel = {
        let queue = queue.clone();
        concurrently(to_cancel, concurrency, move |task_id| {
            let queue = queue.clone();
            async move { queue.remove(task_id).await }
        })
        .await?
    };
    let left = queue.len().await?;
    anyhow::ensure!(
        left == (jobs - sample) as u64,
        "expected {} queued tasks after the cancels, found {left}",
        jobs - sample
    );
    Ok(Ours {
        enqueue_first,
        enqueue,
        process,
        prioritise,
        cancel,
        moved,
        already_first,
        not_moved: sample - moved - already_first,
    })
}

/// Queue `jobs` fresh task ids, each as a submit does: a score ticket, then the enqueue.
async fn enqueue(
    queue: &TaskQueue,
    jobs: usize,
    concurrency: usize,
) -> anyhow::Result<(Phase, Vec<TaskId>)> {
    let ids: Vec<TaskId> = (0..jobs).map(|_| Uuid::now_v7()).collect();
    let queue = queue.clone();
    let phase = concurrently(ids.clone(), concurrency, move |task_id| {
        let queue = queue.clone();
        async move {
            let score = queue.next_score().await?;
            queue.enqueue(task_id, score, None).await?;
            Ok(())
        }
    })
    .await?;
    Ok((phase, ids))
}

/// Run `operation` on every item with `concurrency` concurrent callers; latency per call.
async fn concurrently<F, Fut>(
    items: Vec<TaskId>,
    concurrency: usize,
    operation: F,
) -> anyhow::Result<Phase>
where
    F: Fn(TaskId) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let items = Arc::new(items);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let callers = (0..concurrency.min(items.len())).map(|_| {
        let items = items.clone();
        let next = next.clone();
        let operation = operation.clone();
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(&item) = items.get(index) else {
                    return anyhow::Ok(latencies);
                };
                let begun = Instant::now();
                operation(item).await?;
                latencies.push(begun.elapsed());
            }
        })
    });
    let mut latencies = Vec::with_capacity(items.len());
    for caller in futures::future::join_all(callers).await {
        latencies.extend(caller.context("a caller panicked")??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let per_second = latencies.len() as f64 / seconds;
    Ok(phase(&mut latencies, per_second))
}

/// `concurrency` workers claim and complete (release the lease of) tasks until the queue is
/// empty. Throughput from the first completion to the last, as on BullMQ's side.
async fn process(queue: &TaskQueue, concurrency: usize, lease_ms: u64) -> anyhow::Result<Phase> {
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let queue = queue.clone();
        tokio::spawn(async move {
            // (claim start -> released, released at)
            let mut done: Vec<(Duration, Instant)> = Vec::new();
            loop {
                let begun = Instant::now();
                let Some(claimed) = queue.claim(lease_ms).await? else {
                    return anyhow::Ok(done);
                };
                // The no-op job; then the completion.
                queue.release_lease(claimed.task_id).await?;
                let now = Instant::now();
                done.push((now - begun, now));
            }
        })
    });
    let mut latencies = Vec::new();
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    for worker in futures::future::join_all(workers).await {
        for (latency, at) in worker.context("a worker panicked")?? {
            latencies.push(latency);
            first = Some(first.map_or(at, |first| first.min(at)));
            last = Some(last.map_or(at, |last| last.max(at)));
        }
    }
    let (Some(first), Some(last)) = (first, last) else {
        anyhow::bail!("no task was processed");
    };
    let count = latencies.len();
    let per_second = (count - 1) as f64 / (last - first).as_secs_f64();
    eprintln!(
        "[ours] process: {count} in {:.2} s from the first completion to the last, {:.2} s from the start",
        (last - first).as_secs_f64(),
        (last - started).as_secs_f64()
    );
    Ok(phase(&mut latencies, per_second))
}

/// p50 and p99 (nearest rank on the sorted samples, as bench.mjs does).
fn phase(latencies: &mut [Duration], per_second: f64) -> Phase {
    latencies.sort_unstable();
    let at = |p: f64| {
        zhihui::cli::bench_support::percentile(latencies, p)
            .map_or(0.0, zhihui::cli::bench_support::ms)
    };
    Phase {
        count: latencies.len(),
        per_second,
        p50_ms: at(0.5),
        p99_ms: at(0.99),
    }
}

/// Run `bench/bullmq/bench.mjs` (after `npm ci` if its dependencies are missing) and parse the
/// JSON object it prints.
async fn bullmq(
    settings: &Settings,
    prefix: &str,
    jobs: usize,
    concurrency: usize,
    sample: usize,
) -> anyhow::Result<Value> {
    let directory = Path::new(BULLMQ_DIRECTORY);
    let url = settings.redis.url.expose_secret().to_owned();
    let prefix = prefix.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        if !directory.join("node_modules").is_dir() {
            eprintln!("[bullmq] npm ci in {}", directory.display());
            let status = Command::new("npm")
                .args(["ci", "--silent"])
                .current_dir(directory)
                .status()
                .context("running npm ci (is npm installed?)")?;
            anyhow::ensure!(status.success(), "npm ci failed: {status}");
        }
        let output = Command::new("node")
            .arg(directory.join("bench.mjs"))
            .current_dir(directory)
            .env("REDIS_URL", url)
            .env("JOBS", jobs.to_string())
            .env("CONCURRENCY", concurrency.to_string())
            .env("SAMPLE", sample.to_string())
            .env("PREFIX", prefix)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .context("running node (is Node.js 20+ installed?)")?;
        anyhow::ensure!(
            output.status.success(),
            "bench.mjs failed: {}",
            output.status
        );
        Ok(output.stdout)
    })
    .await
    .context("the BullMQ runner panicked")??;
    serde_json::from_slice(&output).context("bench.mjs did not print one JSON object")
}

fn phase_from_json(json: &Value, name: &str) -> anyhow::Result<Phase> {
    let object = &json[name];
    let number = |field: &str| {
        object[field]
            .as_f64()
            .with_context(|| format!("bench.mjs printed no {name}.{field}"))
    };
    Ok(Phase {
        count: object["count"]
            .as_u64()
            .and_then(|count| usize::try_from(count).ok())
            .with_context(|| format!("bench.mjs printed no {name}.count"))?,
        per_second: number("per_second")?,
        p50_ms: number("p50_ms")?,
        p99_ms: number("p99_ms")?,
    })
}

/// Delete every key under the run's prefix (ours, and whatever BullMQ's obliterate left under
/// `<prefix>:bullmq`); the prefix is `bench:<hex>`, free of glob characters.
async fn delete_keys(store: &RedisStore) -> anyhow::Result<String> {
    let pattern = format!("{}:*", store.key_prefix());
    let mut connection = store.connection().await?;
    // KEYS goes to every master of a cluster (answers joined); DEL of many keys is split by slot.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut connection)
        .await
        .context("listing keys to clean up")?;
    let mut deleted: u64 = 0;
    for chunk in keys.chunks(1_000) {
        deleted += redis::cmd("DEL")
            .arg(chunk)
            .query_async::<u64>(&mut connection)
            .await
            .context("cleaning up")?;
    }
    Ok(format!("deleted {deleted} keys under {pattern}"))
}
