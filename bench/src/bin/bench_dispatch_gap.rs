//! Benchmark of the GPU idle gap, with two ComfyUI simulators, capacity 1 each, and a queue that
//! never runs dry. The target: p99 under 5 ms, "with the simulator at zero latency".
//!
//! The gap is measured where the GPU idles: in each simulator, from every prompt's end to the
//! start of the next (near zero when zhihui had posted the next one ahead into the server's
//! queue). The saga's own view is printed too, for slots that freed with nothing posted ahead:
//! from the terminal message reaching the saga to `POST /prompt` answered. Then the reference
//! design runs on the same simulators: a dispatcher that looks for free servers once a second.
//! zhihui runs with its default settings (`staged_per_backend`, `posted_ahead_per_backend`)
//! unless they are set in the environment (`ZHIHUI_DISPATCH__...`).
//!
//! Cases: one per simulated step time (default: 0, the zero-latency case, then 20 ms), each with
//! its own queue of one-step tasks (the later cases half as many). For each case the program also
//! counts the CPU time spent per task on each side (threads of this process by name: the
//! simulators' against zhihui's; every `postgres` process of this host; Redis by `INFO cpu`):
//! a GPU that needs less time per prompt than the dispatcher side needs CPU per task cannot be
//! kept busy by any dispatcher that records every task, and on a machine whose cores the
//! simulators share with zhihui and PostgreSQL that is what zero latency means.
//!
//! The whole path is real: Lua fill, `TaskDispatched` appended to PostgreSQL, the
//! post over HTTP, the socket, completions recorded and settled alongside. The simulators run on
//! threads of their own and encode PNGs with the fastest compression, as a GPU server's work
//! happens elsewhere; they still share this machine's cores with zhihui and PostgreSQL.
//!
//! Files go to memory (`/dev/shm` where there is one, else the project's `target/tmp`): the
//! simulators' outputs, as a GPU server writes to its own disk, and zhihui's image store, as
//! README advises (off PostgreSQL's WAL disk). On the disk PostgreSQL commits to, these writes
//! made WAL fsyncs stall for up to half a second (ext4 flushes new files' data, and zhihui
//! flushes every image before recording it, with the journal commits a WAL fsync waits for).
//! `BENCH_IMAGES_DIRECTORY=<dir>` puts zhihui's image store there instead, to measure that.
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo run --release -p zhihui-bench --bin bench_dispatch_gap [-- TASKS [STEP_DELAY_MS ...]]
//!
//! It creates a fresh database `zhihui_bench_<uuid>` next to DATABASE_URL's (dropped at the end)
//! and uses a fresh Redis key prefix.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use comfyui_sim::{Faults, SimConfig, Simulator};
use secrecy::{ExposeSecret, SecretString};
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, metadata};
use zhihui::dispatch::comfy::{ComfyClient, PostOutcome};
use zhihui::dispatch::{GapSample, Saga};
use zhihui::platform::configuration::Settings;
use zhihui::state::{AppState, Overrides};
use zhihui::tasks::catalog::RequestedTask;
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

/// Step times of the default cases: zero latency (the target's case), then a GPU that does some work.
const DEFAULT_STEP_DELAYS_MS: [u64; 2] = [0, 20];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let mut args = std::env::args().skip(1);
    let tasks: usize = args
        .next()
        .map(|arg| arg.parse())
        .transpose()
        .context("the first argument is the number of tasks")?
        .unwrap_or(2_000);
    let mut step_delays_ms: Vec<u64> = args
        .map(|arg| arg.parse())
        .collect::<Result<_, _>>()
        .context("the further arguments are simulated step times in ms")?;
    if step_delays_ms.is_empty() {
        step_delays_ms = DEFAULT_STEP_DELAYS_MS.to_vec();
    }
    // Scratch files in memory (see above); without /dev/shm under the project's target/ (next to
    // this program): this machine's /tmp is where every test run creates and deletes files, and
    // creating a file there costs several times more.
    let scratch = format!("zhihui-bench-gap-{}", Uuid::now_v7());
    let directory = match std::path::Path::new("/dev/shm") {
        memory if memory.is_dir() => memory.join(&scratch),
        _ => std::env::current_exe()?
            .parent()
            .and_then(std::path::Path::parent)
            .context("the program runs from target/<profile>/")?
            .join("tmp")
            .join(&scratch),
    };
    let images = match std::env::var_os("BENCH_IMAGES_DIRECTORY") {
        Some(chosen) => std::path::PathBuf::from(chosen).join(&scratch),
        None => directory.join("images"),
    };
    // The simulators run on their own threads, as a real ComfyUI runs in its own process on its
    // own machine: their synchronous PNG work must not stall the runtime that zhihui (and the
    // measured saga) runs on.
    let sim_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(SIM_THREAD_PREFIX)
        .enable_all()
        .build()?;
    let mut sims = Vec::new();
    for index in 0..2 {
        let config = SimConfig {
            bind: "127.0.0.1:0".parse()?,
            output_dir: directory.join(format!("sim-{index}")),
            models: vec!["majicmixRealistic_v7.safetensors".into()],
            faults: sim_faults(0),
        };
        sims.push(sim_runtime.spawn(Simulator::start(config)).await??);
    }
    let backends: Vec<String> = sims
        .iter()
        .enumerate()
        .map(|(index, sim)| format!("gpu-{index} {} 1", sim.base_url()))
        .collect();
    let images_directory = images.to_string_lossy().into_owned();
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into());
    let sims_ref = &sims;
    let outcome = Box::pin(zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(redis_url);
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
            settings.translation.enabled = false;
            settings.tasks.queued_per_user_max = u32::MAX;
            settings.dispatch.backends = backends;
            settings.dispatch.images_directory = images_directory;
            settings.database.pool_max_size = 16;
            settings.log.filter =
                std::env::var("ZHIHUI_LOG__FILTER").unwrap_or_else(|_| "warn".into());
        },
        |settings| async move { Box::pin(run(&settings, tasks, &step_delays_ms, sims_ref)).await },
    ))
    .await;
    for sim in sims {
        sim_runtime.spawn(sim.stop()).await?;
    }
    sim_runtime.shutdown_background();
    for scratch in [&directory, &images] {
        drop(std::fs::remove_dir_all(scratch));
    }
    outcome
}

fn sim_faults(step_delay_ms: u64) -> Faults {
    Faults {
        step_delay_ms,
        // The simulated GPU should not take the CPU this measures from.
        fast_png: true,
        ..Faults::default()
    }
}

async fn run(
    settings: &Settings,
    tasks: usize,
    step_delays_ms: &[u64],
    sims: &[Simulator],
) -> anyhow::Result<Vec<Figure>> {
    zhihui::platform::telemetry::init(&settings.log)?;
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    zhihui::platform::postgres::migrate(&pool).await?;
    let state = AppState::build(settings, pool, Overrides::default())?;
    let cases: Vec<(u64, usize)> = step_delays_ms
        .iter()
        .enumerate()
        .map(|(index, &delay)| (delay, if index == 0 { tasks } else { tasks / 2 }))
        .collect();
    let user = UserId::from_uuid(Uuid::now_v7());
    let total_tasks: usize = cases.iter().map(|(_, count)| count).sum();
    state
        .accounts
        .execute(
            &account_stream(user),
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(i64::try_from(total_tasks)? + 10),
                reason: "bench".into(),
                at: state.clock.now(),
            },
            metadata(),
        )
        .await?;
    let mut redis = redis::Client::open(settings.redis.url.expose_secret())?
        .get_multiplexed_async_connection()
        .await
        .context("connecting to Redis")?;
    let mut figures = Vec::new();
    let mut workflow = None;
    for (step_delay_ms, count) in cases {
        for sim in sims {
            sim.set_faults(sim_faults(step_delay_ms));
        }
        println!();
        println!("== {count} one-step tasks, simulated step time {step_delay_ms} ms");
        let first = submit(&state, user, count).await?;
        if workflow.is_none() {
            workflow = state.tasks.load_with_workflow(first).await?.1;
        }
        // A leader per case: an idle saga does not renew its lease while the next case's tasks
        // are submitted.
        let saga = state
            .dispatcher
            .lead()
            .await?
            .context("another dispatcher leads on this Redis prefix")?;
        let (saga, case_figures) = Box::pin(dispatch_case(
            &state,
            saga,
            sims,
            &mut redis,
            count,
            step_delay_ms,
        ))
        .await?;
        saga.resign().await;
        figures.extend(case_figures);
    }
    // The reference design: a dispatcher that looks for free servers once a second.
    for sim in sims {
        sim.set_faults(sim_faults(0));
    }
    let workflow = workflow.context("the task has no workflow")?;
    let poller_tasks = POLLER_TASKS_PER_SERVER * sims.len();
    println!();
    println!("== one-second poller: {poller_tasks} prompts, zero latency");
    let poller_started = Instant::now();
    poll_once_a_second(sims, &workflow, poller_tasks).await?;
    let poller_elapsed = poller_started.elapsed();
    let mut poller: Vec<Duration> = sims.iter().flat_map(Simulator::take_idle_gaps).collect();
    anyhow::ensure!(!poller.is_empty(), "no poller gap was measured");
    let (poller_p50, poller_p99, poller_max) = percentiles(&mut poller);
    println!(
        "poller idle gap ({} gaps, {:.1} prompts/s): p50 {poller_p50:.2} ms, p99 {poller_p99:.2} ms, max {poller_max:.2} ms",
        poller.len(),
        poller_tasks as f64 / poller_elapsed.as_secs_f64()
    );
    if let Some((_, zero_latency_p99, _)) = figures
        .iter()
        .find(|(name, _, _)| name == "dispatch_gap_p99")
    {
        println!(
            "p99 idle gap at zero latency: zhihui {zero_latency_p99:.2} ms, one-second poller {poller_p99:.2} ms ({:.0}x shorter)",
            poller_p99 / zero_latency_p99
        );
    }
    figures.push(("dispatch_gap_poller_p50".into(), poller_p50, "ms"));
    figures.push(("dispatch_gap_poller_p99".into(), poller_p99, "ms"));
    Ok(figures)
}

/// Submit `count` one-step tasks for `user`; the first one's id.
async fn submit(state: &AppState, user: UserId, count: usize) -> anyhow::Result<Uuid> {
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
    let mut first = None;
    for _ in 0..count {
        let submitted = state
            .tasks
            .submit(user, &request, None, &metadata())
            .await
            .map_err(|error| anyhow::anyhow!("submit: {error}"))?;
        first.get_or_insert(submitted.task_id);
    }
    first.context("no task was submitted")
}

/// Run the saga until the queue is empty and nothing is in flight; the gap and CPU figures.
async fn dispatch_case(
    state: &AppState,
    mut saga: Saga,
    sims: &[Simulator],
    redis: &mut redis::aio::MultiplexedConnection,
    tasks: usize,
    step_delay_ms: u64,
) -> anyhow::Result<(Saga, Vec<Figure>)> {
    for sim in sims {
        // Idle before the run began is not a gap.
        sim.take_idle_gaps();
    }
    let cpu_before = CpuTimes::read(redis).await?;
    let started = Instant::now();
    // Stepped on the dispatch lane's thread, as `serve` runs it; the queue is asked only once
    // nothing is in flight (a round trip after every step would hold the saga up).
    let queue = state.tasks.queue.clone();
    let (saga, gaps) = state
        .dispatcher
        .spawn_on_lane(async move {
            let mut gaps: Vec<GapSample> = Vec::new();
            loop {
                saga.step().await?;
                gaps.extend(saga.take_gaps());
                if saga.in_flight() == 0 && queue.len().await? == 0 {
                    return anyhow::Ok((saga, gaps));
                }
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(600),
                    "the run did not finish in 10 minutes"
                );
            }
        })
        .await??;
    let elapsed = started.elapsed();
    let cpu = CpuTimes::read(redis).await?.since(&cpu_before);
    // The server's view (the product's definition): from a prompt's end to the next prompt's
    // start. The saga's view: from the terminal message reaching the saga to `POST /prompt`
    // answered (later at both ends: the message's delivery is not in it, the answer's return is).
    let mut idle: Vec<Duration> = sims.iter().flat_map(Simulator::take_idle_gaps).collect();
    anyhow::ensure!(!idle.is_empty(), "no gap was measured");
    let (idle_p50, idle_p99, idle_max) = percentiles(&mut idle);
    let idle_p90 = zhihui::cli::bench_support::percentile(&idle, 0.9)
        .map_or(0.0, zhihui::cli::bench_support::ms);
    let under_target = idle
        .iter()
        .filter(|gap| **gap < Duration::from_millis(5))
        .count() as f64
        / idle.len() as f64
        * 100.0;
    // The saga's view, only where a slot freed with nothing posted ahead behind it, split by
    // cause: a staged task ready when the slot freed (the saga's reaction) or not yet recorded as
    // dispatched (the pipeline behind the GPU did not keep up).
    let mut saga_gaps: Vec<Duration> = gaps.iter().map(|gap| gap.duration).collect();
    let (p50, p99, max) = percentiles(&mut saga_gaps);
    let mut ready: Vec<Duration> = gaps
        .iter()
        .filter(|gap| gap.staged_ready)
        .map(|gap| gap.duration)
        .collect();
    let mut waited: Vec<Duration> = gaps
        .iter()
        .filter(|gap| !gap.staged_ready)
        .map(|gap| gap.duration)
        .collect();
    let (ready_p50, ready_p99, _) = percentiles(&mut ready);
    let (waited_p50, waited_p99, _) = percentiles(&mut waited);
    let tasks_per_second = tasks as f64 / elapsed.as_secs_f64();
    println!(
        "{tasks} tasks on 2 servers in {:.1} s ({tasks_per_second:.0} tasks/s)",
        elapsed.as_secs_f64(),
    );
    println!(
        "server idle gap (prompt end -> next prompt start, {} gaps): p50 {idle_p50:.2} ms, p90 {idle_p90:.2} ms, p99 {idle_p99:.2} ms, max {idle_max:.2} ms; {under_target:.1} % under 5 ms (target p99 < 5 ms)",
        idle.len()
    );
    println!(
        "saga gap where a slot freed with nothing posted ahead ({} of {tasks} prompts): end message handled -> next POST /prompt answered p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms",
        gaps.len(),
    );
    println!(
        "  a staged task was ready ({} gaps): p50 {ready_p50:.2} ms, p99 {ready_p99:.2} ms; \
         waiting for its dispatch to be recorded ({} gaps): p50 {waited_p50:.2} ms, p99 {waited_p99:.2} ms",
        ready.len(),
        waited.len()
    );
    let per_task = |seconds: f64| seconds * 1_000.0 / tasks as f64;
    let dispatcher_side = cpu.zhihui + cpu.postgres.unwrap_or(0.0) + cpu.redis;
    println!(
        "CPU per task: zhihui {:.2} ms, PostgreSQL {}, Redis {:.2} ms: dispatcher side {:.2} ms; \
         the simulated GPUs {:.2} ms per prompt; {:.0} % of {} cores busy",
        per_task(cpu.zhihui),
        cpu.postgres.map_or_else(
            || "not on this host".to_owned(),
            |seconds| format!("{:.2} ms", per_task(seconds))
        ),
        per_task(cpu.redis),
        per_task(dispatcher_side),
        per_task(cpu.simulators),
        cpu.busy_share * 100.0,
        cpu.cores,
    );
    let suffix = if step_delay_ms == 0 {
        String::new()
    } else {
        format!("_step{step_delay_ms}ms")
    };
    let figures = vec![
        (format!("dispatch_gap{suffix}_p50"), idle_p50, "ms"),
        (format!("dispatch_gap{suffix}_p90"), idle_p90, "ms"),
        (format!("dispatch_gap{suffix}_p99"), idle_p99, "ms"),
        (
            format!("dispatch_gap{suffix}_under_5ms_share"),
            under_target,
            "%",
        ),
        (
            format!("dispatch{suffix}_tasks_per_second"),
            tasks_per_second,
            "tasks/s",
        ),
        (
            format!("dispatch{suffix}_cpu_dispatcher_side_per_task"),
            per_task(dispatcher_side),
            "ms",
        ),
        (
            format!("dispatch{suffix}_cpu_simulators_per_prompt"),
            per_task(cpu.simulators),
            "ms",
        ),
    ];
    Ok((saga, figures))
}

/// Thread names of the simulators' runtime (the actix workers of their HTTP servers are named
/// by actix).
const SIM_THREAD_PREFIX: &str = "comfyui-sim";

/// CPU seconds spent so far, by side.
#[derive(Debug, Clone, Copy, Default)]
struct CpuTimes {
    zhihui: f64,
    simulators: f64,
    /// `None` when no `postgres` process runs on this host (a remote server is not counted).
    postgres: Option<f64>,
    redis: f64,
    /// Whole machine: busy and all (from /proc/stat), for the busy share.
    machine_busy: f64,
    machine_total: f64,
    busy_share: f64,
    cores: usize,
}

impl CpuTimes {
    async fn read(redis: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<CpuTimes> {
        let mut times = CpuTimes::default();
        // This process's threads by name: the simulators' runtime and actix's server threads
        // (only the simulators serve HTTP here) against everything else, which is zhihui.
        for entry in std::fs::read_dir("/proc/self/task").context("reading /proc/self/task")? {
            let Ok(stat) = std::fs::read_to_string(entry?.path().join("stat")) else {
                continue;
            };
            let Some((name, cpu_us)) = zhihui::cli::bench_support::parse_proc_stat(&stat) else {
                continue;
            };
            let seconds = cpu_us / 1_000_000.0;
            if name.starts_with(SIM_THREAD_PREFIX) || name.starts_with("actix") {
                times.simulators += seconds;
            } else {
                times.zhihui += seconds;
            }
        }
        times.postgres = zhihui::cli::bench_support::processes_cpu_us("postgres")?
            .map(|cpu_us| cpu_us / 1_000_000.0);
        let info: String = redis::cmd("INFO")
            .arg("cpu")
            .query_async(redis)
            .await
            .context("reading Redis's CPU times")?;
        let values: HashMap<&str, f64> = info
            .lines()
            .filter_map(|line| line.trim().split_once(':'))
            .filter_map(|(key, value)| Some((key, value.parse().ok()?)))
            .collect();
        times.redis = ["used_cpu_sys", "used_cpu_user"]
            .iter()
            .filter_map(|key| values.get(key))
            .sum();
        let machine = zhihui::cli::bench_support::machine_cpu_us()?;
        times.machine_total = machine.total_us / 1_000_000.0;
        times.machine_busy = machine.busy_us / 1_000_000.0;
        times.cores = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(times)
    }

    /// What was spent between `earlier` and this reading.
    fn since(&self, earlier: &CpuTimes) -> CpuTimes {
        let total = self.machine_total - earlier.machine_total;
        let busy = self.machine_busy - earlier.machine_busy;
        CpuTimes {
            zhihui: self.zhihui - earlier.zhihui,
            simulators: self.simulators - earlier.simulators,
            postgres: self
                .postgres
                .zip(earlier.postgres)
                .map(|(now, then)| now - then),
            redis: self.redis - earlier.redis,
            machine_busy: busy,
            machine_total: total,
            busy_share: if total > 0.0 { busy / total } else { 0.0 },
            cores: self.cores,
        }
    }
}

/// p50, p99 and max of `samples`, in ms.
fn percentiles(samples: &mut [Duration]) -> (f64, f64, f64) {
    samples.sort();
    let at = |p: f64| {
        zhihui::cli::bench_support::percentile(samples, p)
            .map_or(0.0, zhihui::cli::bench_support::ms)
    };
    (at(0.5), at(0.99), at(1.0))
}

/// Prompts per server in the poller's run (at about one per second per server).
const POLLER_TASKS_PER_SERVER: usize = 15;

/// The reference design's dispatcher: once a second, each server whose `/queue` is empty gets
/// the next prompt. Its bookkeeping is left out: only when it posts matters for the gap.
async fn poll_once_a_second(
    sims: &[Simulator],
    workflow: &serde_json::Value,
    prompts: usize,
) -> anyhow::Result<()> {
    let clients = sims
        .iter()
        .map(|sim| ComfyClient::new(&sim.base_url(), Duration::from_secs(10)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut posted = 0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while posted < prompts {
        tick.tick().await;
        for client in &clients {
            let (running, pending) = client.queue().await?;
            if running.is_empty() && pending.is_empty() && posted < prompts {
                match client.post_prompt(Uuid::now_v7(), "poller", workflow).await {
                    PostOutcome::Accepted => posted += 1,
                    other => anyhow::bail!("the poller's post failed: {other:?}"),
                }
            }
        }
    }
    // Let the last prompts finish, so that they count as ended.
    for client in &clients {
        loop {
            let (running, pending) = client.queue().await?;
            if running.is_empty() && pending.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(())
}
