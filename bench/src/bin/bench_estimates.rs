//! bench_estimates: how far the wait estimate is from the truth over a simulated day.
//!
//! A discrete-event simulation of a pool of three servers of different speeds and models, each
//! run's time drawn around its server's true seconds per step (±20 %), and a day of task arrivals
//! whose rate swings above and below what the pool can serve (a queue builds at the peak and
//! drains at night). Tasks are dispatched as the filler does (in queue order, each to a free server
//! offering its model). When each task arrives, its start is estimated by zhihui's estimator
//! ([`zhihui::tasks::estimate::estimate`]) from what the leader would know then: the step times
//! measured so far (moving median per server and model), what runs on each server and how long
//! it has run, and the tasks ahead. Beside it, the peer a simple service shows: place in the
//! queue times the mean task time so far, divided by the servers.
//!
//! Usage: bench_estimates [TASKS] [SEED]; prints the median and p90 of |estimated start - actual
//! start| for both, and `RESULT bench_estimates_p90_error <seconds> s` (zhihui's).

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
}

struct Task {
    arrives: f64,
    model: &'static str,
    steps: u32,
    estimated_start: Option<f64>,
    naive_start: f64,
    started: Option<f64>,
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
    let mut random = Random(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let models = ["sd15.safetensors", "sdxl.safetensors", "flux.safetensors"];
    let mut servers = vec![
        Server {
            name: "fast",
            models: &["sd15.safetensors", "sdxl.safetensors"],
            seconds_per_step: 0.05,
            running: None,
        },
        Server {
            name: "mid",
            models: &["sd15.safetensors", "sdxl.safetensors", "flux.safetensors"],
            seconds_per_step: 0.09,
            running: None,
        },
        Server {
            name: "slow",
            models: &["sdxl.safetensors", "flux.safetensors"],
            seconds_per_step: 0.16,
            running: None,
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
        let steps = 10 + (random.next() * 41.0) as u32;
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
                    };
                    let free_in = server.running.map_or(0.0, |(task, started, _)| {
                        let expected =
                            outlook.run_seconds(Some(tasks[task].model), tasks[task].steps);
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
                    let noise = 0.8 + 0.4 * random.next();
                    let run = 0.5
                        + f64::from(tasks[task].steps) * servers[server].seconds_per_step * noise;
                    servers[server].running = Some((task, now, now + run));
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
    let (our_median, our_p90) = (percentile(&mut ours, 0.5), percentile(&mut ours, 0.9));
    let (naive_median, naive_p90) = (percentile(&mut naive, 0.5), percentile(&mut naive, 0.9));
    let (wait_median, wait_p90) = (percentile(&mut waits, 0.5), percentile(&mut waits, 0.9));
    println!(
        "simulated day: {count} tasks over {:.0} s on 3 servers (0.05, 0.09, 0.16 s/step, runs ±20 %), seed {seed}",
        now
    );
    println!("actual wait before start: median {wait_median:.1} s, p90 {wait_p90:.1} s");
    println!(
        "zhihui estimate |estimated start - actual start|: median {our_median:.2} s, p90 {our_p90:.2} s ({} tasks)",
        ours.len()
    );
    println!(
        "peer (place x mean run / servers):                median {naive_median:.2} s, p90 {naive_p90:.2} s"
    );
    println!("RESULT bench_estimates_p90_error {our_p90:.2} s");
    Ok(())
}
