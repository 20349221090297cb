//! bench_estimates: how far the wait estimate is from the truth over a simulated day.
//!
//! A discrete-event simulation of a pool of three servers of different speeds and models, each
//! run's time drawn around its server's true seconds per step (±20 %), and a day of task arrivals
//! whose rate swings above and below what the pool can serve (a queue builds at the peak and
//! drains at night). Tasks are dispatched as the filler does (in queue order, each to a free server
//! offering its model). When each task arrives, its start is estimated by zhihui's estimator
//! ([`zhihui::tasks::estimate::estimate`]) from what the leader would know then: the step times
//! measured so far (per server and model, a moving mean capped at four times the median), what
//! runs on each server and how long it has run, and the tasks ahead. Beside it, the peer a simple service shows: place in the
//! queue times the mean task time so far, divided by the servers.
//!
//! The day is simulated twice. In the first world a run takes what the estimator assumes (a fixed
//! overhead plus steps times the server's seconds per step, ±20 %): it shows the estimator at its
//! best. The second world is not built on the estimator's model: a server that changes model
//! first loads it (2 s for sd15, 4 s for sdxl and flux), a step's time varies log-normally
//! (sigma 0.4) from run to run, one run in twenty straggles at three times its time (a slow
//! decode, memory swapped), and users pick the usual step counts (20, 25, 30, sometimes 50)
//! rather than any. Both estimates meet both worlds with the same arrivals.
//!
//! Usage: bench_estimates [TASKS] [SEED]; prints the median and p90 of |estimated start - actual
//! start| for both designs in both worlds, `RESULT bench_estimates_p90_error <seconds> s`
//! (zhihui's, first world) and `RESULT bench_estimates_other_world_p90_error <seconds> s`.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::VecDeque;

use zhihui::tasks::estimate::{ServerOutlook, StepTimes, Waiting, estimate};

struct Server {
    name: &'static str,
    models: &'static [&'static str],
    /// True seconds per step (unknown to the estimator).
    seconds_per_step: f64,
    /// (task, started at, ends at)
    running: Option<(usize, f64, f64)>,
    /// The model it ran last (loaded in memory).
    loaded: Option<&'static str>,
    /// Whether the run under way loaded its model first (as the dispatcher knows when it posts).
    switched: bool,
}

struct Task {
    arrives: f64,
    model: &'static str,
    steps: u32,
    estimated_start: Option<f64>,
    naive_start: f64,
    started: Option<f64>,
}

/// How long runs take in a simulated world.
#[derive(Clone, Copy, PartialEq)]
enum World {
    /// As the estimator assumes: overhead plus steps times seconds per step, ±20 %.
    Linear,
    /// Model loads on a switch, log-normal step times, stragglers, the usual step counts.
    Other,
}

impl World {
    fn steps(self, random: &mut Random) -> u32 {
        match self {
            World::Linear => 10 + (random.next() * 41.0) as u32,
            World::Other => {
                let roll = random.next();
                if roll < 0.35 {
                    20
                } else if roll < 0.6 {
                    25
                } else if roll < 0.9 {
                    30
                } else {
                    50
                }
            }
        }
    }

    fn run_seconds(self, server: &Server, model: &str, steps: u32, random: &mut Random) -> f64 {
        let steps = f64::from(steps);
        match self {
            World::Linear => 0.5 + steps * server.seconds_per_step * (0.8 + 0.4 * random.next()),
            World::Other => {
                let load = if server.loaded == Some(model) {
                    0.0
                } else if model == "sd15.safetensors" {
                    2.0
                } else {
                    4.0
                };
                // Box-Muller: a standard normal from two uniforms.
                let normal = (-2.0 * (1.0 - random.next()).ln()).sqrt()
                    * (std::f64::consts::TAU * random.next()).cos();
                let straggle = if random.next() < 0.05 { 3.0 } else { 1.0 };
                load + 0.5 + steps * server.seconds_per_step * (0.4 * normal).exp() * straggle
            }
        }
    }
}

struct Errors {
    ours_median: f64,
    ours_p90: f64,
    naive_median: f64,
    naive_p90: f64,
    wait_median: f64,
    wait_p90: f64,
    estimated: usize,
    seconds: f64,
}

/// xorshift64*: a fixed, dependency-free sequence (the run is reproducible by its seed).
struct Random(u64);

impl Random {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let value = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (value >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn percentile(values: &mut [f64], fraction: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * fraction).round() as usize;
    values[index]
}

fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let mut args = std::env::args().skip(1);
    let count: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(2_000);
    let seed: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let mut p90s = Vec::new();
    for (world, name) in [
        (World::Linear, "the estimator's own model (runs ±20 %)"),
        (
            World::Other,
            "another world (model loads, log-normal steps, 5 % stragglers at 3x, usual step counts)",
        ),
    ] {
        let errors = simulate(world, count, seed);
        println!(
            "simulated day, {name}: {count} tasks over {:.0} s on 3 servers (0.05, 0.09, 0.16 s/step), seed {seed}",
            errors.seconds
        );
        println!(
            "  actual wait before start: median {:.1} s, p90 {:.1} s",
            errors.wait_median, errors.wait_p90
        );
        println!(
            "  zhihui estimate |estimated start - actual start|: median {:.2} s, p90 {:.2} s ({} tasks)",
            errors.ours_median, errors.ours_p90, errors.estimated
        );
        println!(
            "  peer (place x mean run / servers):                median {:.2} s, p90 {:.2} s",
            errors.naive_median, errors.naive_p90
        );
        p90s.push((errors.ours_p90, errors.naive_p90));
    }
    let [(linear, linear_peer), (other, other_peer)] = p90s[..] else {
        anyhow::bail!("two worlds were simulated");
    };
    println!("RESULT bench_estimates_peer_p90_error {linear_peer:.2} s");
    println!("RESULT bench_estimates_other_world_p90_error {other:.2} s");
    println!("RESULT bench_estimates_other_world_peer_p90_error {other_peer:.2} s");
    println!("RESULT bench_estimates_p90_error {linear:.2} s");
    Ok(())
}

/// One simulated day in `world`: how far each design's estimates were from the actual starts.
fn simulate(world: World, count: usize, seed: u64) -> Errors {
    let mut random = Random(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let models = ["sd15.safetensors", "sdxl.safetensors", "flux.safetensors"];
    let mut servers = vec![
        Server {
            name: "fast",
            models: &["sd15.safetensors", "sdxl.safetensors"],
            seconds_per_step: 0.05,
            running: None,
            loaded: None,
            switched: false,
        },
        Server {
            name: "mid",
            models: &["sd15.safetensors", "sdxl.safetensors", "flux.safetensors"],
            seconds_per_step: 0.09,
            running: None,
            loaded: None,
            switched: false,
        },
        Server {
            name: "slow",
            models: &["sdxl.safetensors", "flux.safetensors"],
            seconds_per_step: 0.16,
            running: None,
            loaded: None,
            switched: false,
        },
    ];
    // A day: the arrival rate swings between 0.35 and 1.45 tasks/s around the pool's ~0.9/s.
    let mut tasks = Vec::with_capacity(count);
    let mut clock = 0.0;
    for index in 0..count {
        let phase = index as f64 / count as f64 * std::f64::consts::TAU;
        let rate = 0.9 + 0.55 * phase.sin();
        clock += -(1.0 - random.next()).ln() / rate;
        let model = models[(random.next() * models.len() as f64) as usize % models.len()];
        let steps = world.steps(&mut random);
        tasks.push(Task {
            arrives: clock,
            model,
            steps,
            estimated_start: None,
            naive_start: 0.0,
            started: None,
        });
    }
    let mut measured = StepTimes::default();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut next_arrival = 0;
    let mut finished_runs: Vec<f64> = Vec::new();
    let mut now = 0.0;
    while next_arrival < count || !queue.is_empty() || servers.iter().any(|s| s.running.is_some()) {
        // The next event: an arrival or a run's end.
        let next_end = servers
            .iter()
            .filter_map(|s| s.running.map(|(_, _, ends)| ends))
            .fold(f64::INFINITY, f64::min);
        let arrival = tasks.get(next_arrival).map_or(f64::INFINITY, |t| t.arrives);
        now = next_end.min(arrival);
        for server in &mut servers {
            if let Some((task, started, ends)) = server.running
                && ends <= now
            {
                measured.record(
                    server.name,
                    tasks[task].model,
                    tasks[task].steps,
                    ends - started,
                    server.switched,
                );
                finished_runs.push(ends - started);
                server.running = None;
            }
        }
        if arrival <= now {
            let index = next_arrival;
            next_arrival += 1;
            queue.push_back(index);
            // What the leader would publish now, and the queue up to this task.
            let outlooks: Vec<ServerOutlook> = servers
                .iter()
                .map(|server| {
                    let seconds_per_step = measured.of(server.name);
                    let outlook = ServerOutlook {
                        name: server.name.into(),
                        models: Some(server.models.iter().map(|m| (*m).to_owned()).collect()),
                        slots_free_in: vec![0.0],
                        seconds_per_step,
                        loaded_model: server.loaded.map(str::to_owned),
                        load_seconds: measured.loads(server.name),
                    };
                    let free_in = server.running.map_or(0.0, |(task, started, _)| {
                        let model = Some(tasks[task].model);
                        let load = if server.switched {
                            outlook.switch_seconds(model)
                        } else {
                            0.0
                        };
                        let expected = outlook.run_seconds(model, tasks[task].steps) + load;
                        (expected - (now - started)).max(0.0)
                    });
                    ServerOutlook {
                        slots_free_in: vec![free_in],
                        ..outlook
                    }
                })
                .collect();
            let waiting: Vec<Waiting> = queue
                .iter()
                .map(|&task| Waiting {
                    model: Some(tasks[task].model.to_owned()),
                    steps: tasks[task].steps,
                })
                .collect();
            let estimates = estimate(&outlooks, &waiting);
            tasks[index].estimated_start = estimates
                .last()
                .copied()
                .flatten()
                .map(|e| now + e.start_in);
            let mean_run = if finished_runs.is_empty() {
                3.0
            } else {
                finished_runs.iter().sum::<f64>() / finished_runs.len() as f64
            };
            let ahead = queue.len() - 1 + servers.iter().filter(|s| s.running.is_some()).count();
            tasks[index].naive_start = now + ahead as f64 * mean_run / servers.len() as f64;
        }
        // Dispatch: in queue order, each task to a free server offering its model.
        let mut position = 0;
        while position < queue.len() {
            let task = queue[position];
            let free = servers
                .iter()
                .position(|s| s.running.is_none() && s.models.contains(&tasks[task].model));
            match free {
                Some(server) => {
                    let run = world.run_seconds(
                        &servers[server],
                        tasks[task].model,
                        tasks[task].steps,
                        &mut random,
                    );
                    servers[server].running = Some((task, now, now + run));
                    servers[server].switched = servers[server].loaded != Some(tasks[task].model);
                    servers[server].loaded = Some(tasks[task].model);
                    tasks[task].started = Some(now);
                    queue.remove(position);
                }
                None => position += 1,
            }
        }
    }
    let mut ours: Vec<f64> = Vec::new();
    let mut naive: Vec<f64> = Vec::new();
    let mut waits: Vec<f64> = Vec::new();
    for task in &tasks {
        let started = task.started.expect("every task ran");
        waits.push(started - task.arrives);
        if let Some(estimated) = task.estimated_start {
            ours.push((estimated - started).abs());
        }
        naive.push((task.naive_start - started).abs());
    }
    let (ours_median, ours_p90) = (percentile(&mut ours, 0.5), percentile(&mut ours, 0.9));
    let (naive_median, naive_p90) = (percentile(&mut naive, 0.5), percentile(&mut naive, 0.9));
    let (wait_median, wait_p90) = (percentile(&mut waits, 0.5), percentile(&mut waits, 0.9));
    Errors {
        ours_median,
        ours_p90,
        naive_median,
        naive_p90,
        wait_median,
        wait_p90,
        estimated: ours.len(),
        seconds: now,
    }
}
