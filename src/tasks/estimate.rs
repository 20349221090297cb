//! Wait estimates: when a queued task will start and end, from the measured step times of each
//! server and model, the tasks ahead of it, and the servers that can run it.
//!
//! [`estimate`] is a pure function: it replays the dispatcher's order on the servers' slots (each
//! task in queue order takes the slot, among the servers offering its model, that frees first;
//! its run is its steps times the measured seconds per step there). [`StepTimes`] is what the
//! leader measures: per server and model, the mean of the last [`STEP_SAMPLES_MAX`] seconds per
//! step of finished tasks, each sample capped at [`STEP_SAMPLE_CAP`] times their median. A wait is
//! a sum of the runs ahead, and a sum grows by the mean: a median misses the slow runs (a model
//! loaded, a straggler) that real servers make every so often, and the estimates behind a long
//! queue fall short by that much times its length. The cap keeps one hung run from moving the
//! measure for the next 32 tasks.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

/// A sample counts for at most this many times the median of its server and model.
pub const STEP_SAMPLE_CAP: f64 = 4.0;
/// Samples kept per server and model: enough for a stable mean, few enough to follow a change
/// of hardware or load within minutes.
pub const STEP_SAMPLES_MAX: usize = 32;
/// Seconds per step assumed for a server and model nothing was measured for yet (an SD 1.5 step
/// at 512x512 on a mid-range GPU); replaced by the first measurement.
pub const SECONDS_PER_STEP_UNMEASURED: f64 = 0.5;
/// A run's time beyond its steps: loading, encoding, saving (seconds).
pub const RUN_OVERHEAD_SECONDS: f64 = 0.5;

/// What one server can do for the queue, as the leader sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerOutlook {
    pub name: String,
    /// The models it offers (`None`: any).
    pub models: Option<Vec<String>>,
    /// Seconds from now until each of its slots is free for a queued task (its running prompts'
    /// remaining time, and the staged tasks behind them).
    pub slots_free_in: Vec<f64>,
    /// Measured seconds per step, by model.
    pub seconds_per_step: BTreeMap<String, f64>,
}

impl ServerOutlook {
    fn offers(&self, model: Option<&str>) -> bool {
        match (model, &self.models) {
            (Some(model), Some(models)) => models.iter().any(|offered| offered == model),
            _ => true,
        }
    }

    /// Seconds a run of `steps` takes here: its model's measure, else this server's mean over
    /// its models, else the unmeasured default.
    pub fn run_seconds(&self, model: Option<&str>, steps: u32) -> f64 {
        let rate = model
            .and_then(|model| self.seconds_per_step.get(model).copied())
            .or_else(|| {
                let rates: Vec<f64> = self.seconds_per_step.values().copied().collect();
                (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
            })
            .unwrap_or(SECONDS_PER_STEP_UNMEASURED);
        RUN_OVERHEAD_SECONDS + rate * f64::from(steps)
    }
}

/// A queued task, as the estimate needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    pub model: Option<String>,
    pub steps: u32,
}

/// Seconds from now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    pub start_in: f64,
    pub end_in: f64,
}

/// Each queued task's estimate, in queue order; `None` for a task no server in service offers
/// its model (it waits for one, and so does not hold up those behind it).
pub fn estimate(servers: &[ServerOutlook], queue: &[Waiting]) -> Vec<Option<Estimate>> {
    let mut slots: Vec<Vec<f64>> = servers
        .iter()
        .map(|server| {
            server
                .slots_free_in
                .iter()
                .map(|free_in| free_in.max(0.0))
                .collect()
        })
        .collect();
    queue
        .iter()
        .map(|task| {
            let model = task.model.as_deref();
            // The slot that frees first among the servers offering the model.
            let mut best: Option<(usize, usize, f64)> = None;
            for (index, server) in servers.iter().enumerate() {
                if !server.offers(model) {
                    continue;
                }
                for (slot, free_in) in slots[index].iter().enumerate() {
                    if best.is_none_or(|(_, _, earliest)| *free_in < earliest) {
                        best = Some((index, slot, *free_in));
                    }
                }
            }
            let (index, slot, start_in) = best?;
            let end_in = start_in + servers[index].run_seconds(model, task.steps);
            slots[index][slot] = end_in;
            Some(Estimate { start_in, end_in })
        })
        .collect()
}

/// The leader's measures: seconds per step of finished tasks, per server and model.
#[derive(Debug, Clone, Default)]
pub struct StepTimes {
    samples: HashMap<(String, String), VecDeque<f64>>,
}

impl StepTimes {
    /// A task of `steps` steps of `model` ran `seconds` on `server`.
    pub fn record(&mut self, server: &str, model: &str, steps: u32, seconds: f64) {
        if steps == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let per_step = (seconds - RUN_OVERHEAD_SECONDS).max(0.0) / f64::from(steps);
        let samples = self
            .samples
            .entry((server.to_owned(), model.to_owned()))
            .or_default();
        if samples.len() == STEP_SAMPLES_MAX {
            samples.pop_front();
        }
        samples.push_back(per_step);
    }

    /// The seconds per step of each model measured on `server`: the capped mean of its samples.
    pub fn of(&self, server: &str) -> BTreeMap<String, f64> {
        self.samples
            .iter()
            .filter(|((name, _), _)| name == server)
            .map(|((_, model), samples)| (model.clone(), capped_mean(samples)))
            .collect()
    }
}

fn capped_mean(samples: &VecDeque<f64>) -> f64 {
    let mut sorted: Vec<f64> = samples.iter().copied().collect();
    sorted.sort_by(f64::total_cmp);
    let median = match sorted.len() {
        0 => return SECONDS_PER_STEP_UNMEASURED,
        len if len % 2 == 1 => sorted[len / 2],
        len => (sorted[len / 2 - 1] + sorted[len / 2]) / 2.0,
    };
    let cap = median * STEP_SAMPLE_CAP;
    sorted.iter().map(|sample| sample.min(cap)).sum::<f64>() / sorted.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(name: &str, models: &[&str], slots: &[f64], rate: f64) -> ServerOutlook {
        ServerOutlook {
            name: name.into(),
            models: Some(models.iter().map(|model| (*model).to_owned()).collect()),
            slots_free_in: slots.to_vec(),
            seconds_per_step: models
                .iter()
                .map(|model| ((*model).to_owned(), rate))
                .collect(),
        }
    }

    fn waiting(model: &str, steps: u32) -> Waiting {
        Waiting {
            model: Some(model.into()),
            steps,
        }
    }

    #[test]
    fn tasks_take_the_slot_that_frees_first_among_the_servers_offering_their_model() {
        // fast: free in 2 s, 0.1 s/step; slow: free now, 1 s/step; only slow offers b.
        let servers = [
            server("fast", &["a"], &[2.0], 0.1),
            server("slow", &["a", "b"], &[0.0], 1.0),
        ];
        let queue = [
            waiting("a", 10),
            waiting("a", 10),
            waiting("b", 10),
            waiting("c", 10),
        ];
        let estimates = estimate(&servers, &queue);
        // 1st a: slow is free now (0 s), runs 0.5 + 10 s.
        assert_eq!(
            estimates[0],
            Some(Estimate {
                start_in: 0.0,
                end_in: 10.5
            })
        );
        // 2nd a: fast frees at 2 s, runs 0.5 + 1 s.
        assert_eq!(
            estimates[1],
            Some(Estimate {
                start_in: 2.0,
                end_in: 3.5
            })
        );
        // b: only slow, after the first a.
        assert_eq!(
            estimates[2],
            Some(Estimate {
                start_in: 10.5,
                end_in: 21.0
            })
        );
        // c: no server offers it: no estimate, and it holds nobody up.
        assert_eq!(estimates[3], None);
    }

    #[test]
    fn the_step_time_is_a_moving_capped_mean_per_server_and_model() {
        let mut times = StepTimes::default();
        for seconds in [10.5, 10.5, 30.5, 10.5] {
            times.record("gpu", "a", 10, seconds);
        }
        // A slow run counts in full: the queue's sum of runs grows by it.
        assert_eq!(times.of("gpu")["a"], 1.5);
        // A hung one counts for four times the median (1 s per step) at most.
        times.record("gpu", "a", 10, 1000.5);
        assert_eq!(times.of("gpu")["a"], (1.0 + 1.0 + 3.0 + 1.0 + 4.0) / 5.0);
        for _ in 0..STEP_SAMPLES_MAX {
            times.record("gpu", "a", 10, 20.5);
        }
        assert_eq!(times.of("gpu")["a"], 2.0, "old samples age out");
        assert!(times.of("other").is_empty());
        // Unmeasured model on a measured server: the server's mean.
        let outlook = ServerOutlook {
            name: "gpu".into(),
            models: None,
            slots_free_in: vec![0.0],
            seconds_per_step: times.of("gpu"),
        };
        assert_eq!(outlook.run_seconds(Some("z"), 10), 20.5);
    }
}
