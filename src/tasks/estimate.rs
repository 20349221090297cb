//! Wait estimates: when a queued task will start and end, from the measured step times of each
//! server and model, the tasks ahead of it, and the servers that can run it.
//!
//! [`estimate`] is a pure function: it replays the dispatcher's order on the servers' slots (each
//! task in queue order takes the slot, among the servers offering its model, that frees first;
//! its run is its steps times the measured seconds per step there, plus the model's measured load
//! when the server held another). [`StepTimes`] is what the leader measures: per server and
//! model, the mean of the last [`STEP_SAMPLES_MAX`] seconds per step of finished runs that found
//! their model loaded, each sample capped at [`STEP_SAMPLE_CAP`] times their median, and the mean
//! time the runs that loaded it first took beyond that. A wait is a sum of the runs ahead, and a
//! sum grows by the mean: a median misses the slow runs (a straggler) that real servers make
//! every so often, and the estimates behind a long queue fall short by that much times its
//! length. The cap keeps one hung run from moving the measure for the next 32 tasks.

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
    /// The model it holds loaded once what runs and waits there is done (`None`: unknown).
    #[serde(default)]
    pub loaded_model: Option<String>,
    /// Measured seconds a run spends loading its model when the run before had another, by model.
    #[serde(default)]
    pub load_seconds: BTreeMap<String, f64>,
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

    /// Seconds a run of `model` adds here for loading it after a run of another model.
    pub fn switch_seconds(&self, model: Option<&str>) -> f64 {
        model
            .and_then(|model| self.load_seconds.get(model).copied())
            .unwrap_or(0.0)
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
    // The model each server holds after the runs given to it so far: a run of another loads its
    // own first.
    let mut loaded: Vec<Option<&str>> = servers
        .iter()
        .map(|server| server.loaded_model.as_deref())
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
            let server = &servers[index];
            let switch = if model.is_some() && loaded[index] != model {
                server.switch_seconds(model)
            } else {
                0.0
            };
            let end_in = start_in + server.run_seconds(model, task.steps) + switch;
            slots[index][slot] = end_in;
            if model.is_some() {
                loaded[index] = model;
            }
            Some(Estimate { start_in, end_in })
        })
        .collect()
}

/// The leader's measures, per server and model: seconds per step of finished runs that found
/// their model loaded, and what the runs that had to load it first took beyond that.
///
/// A load is a cost per run, not per step: spread over the steps of the run that paid it (as one
/// measure of both would), it is charged again in proportion to steps to every run ahead,
/// switch or not, and the estimates behind a queue of long runs come out late.
#[derive(Debug, Clone, Default)]
pub struct StepTimes {
    samples: HashMap<(String, String), VecDeque<f64>>,
    /// Runs that loaded their model first: (steps, seconds).
    switched: HashMap<(String, String), VecDeque<(u32, f64)>>,
}

impl StepTimes {
    /// A task of `steps` steps of `model` ran `seconds` on `server`; `switched`: the run before
    /// it there was of another model (or none was known), so it loaded its own first.
    pub fn record(&mut self, server: &str, model: &str, steps: u32, seconds: f64, switched: bool) {
        if steps == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let key = (server.to_owned(), model.to_owned());
        if switched {
            let runs = self.switched.entry(key).or_default();
            if runs.len() == STEP_SAMPLES_MAX {
                runs.pop_front();
            }
            runs.push_back((steps, seconds));
            return;
        }
        let samples = self.samples.entry(key).or_default();
        if samples.len() == STEP_SAMPLES_MAX {
            samples.pop_front();
        }
        samples.push_back(per_step(steps, seconds));
    }

    /// The seconds per step of each model measured on `server`: the capped mean of the runs that
    /// found it loaded; until there is one, of the runs that loaded it (their loads spread over
    /// their steps, the best guess there is).
    pub fn of(&self, server: &str) -> BTreeMap<String, f64> {
        let mut rates: BTreeMap<String, f64> = self
            .switched
            .iter()
            .filter(|((name, _), _)| name == server)
            .map(|((_, model), runs)| {
                let spread: VecDeque<f64> = runs
                    .iter()
                    .map(|(steps, seconds)| per_step(*steps, *seconds))
                    .collect();
                (model.clone(), capped_mean(&spread))
            })
            .collect();
        rates.extend(
            self.samples
                .iter()
                .filter(|((name, _), _)| name == server)
                .map(|((_, model), samples)| (model.clone(), capped_mean(samples))),
        );
        rates
    }

    /// The seconds each model's load adds to a run on `server`: the mean, over the runs that
    /// loaded it, of their time beyond what a run of their steps takes with it loaded (each
    /// counted for at most [`STEP_SAMPLE_CAP`] times that run; none when the mean is below zero).
    /// Only for models measured both ways. A run's time beyond its expected one is as often
    /// below: the mean is taken before anything is cut at zero, or noise would read as a load.
    pub fn loads(&self, server: &str) -> BTreeMap<String, f64> {
        self.switched
            .iter()
            .filter(|((name, _), _)| name == server)
            .filter_map(|((name, model), runs)| {
                let samples = self.samples.get(&(name.clone(), model.clone()))?;
                let rate = capped_mean(samples);
                let extra = runs
                    .iter()
                    .map(|(steps, seconds)| {
                        let expected = RUN_OVERHEAD_SECONDS + rate * f64::from(*steps);
                        (seconds - expected).min(STEP_SAMPLE_CAP * expected)
                    })
                    .sum::<f64>()
                    / runs.len() as f64;
                Some((model.clone(), extra.max(0.0)))
            })
            .collect()
    }
}

fn per_step(steps: u32, seconds: f64) -> f64 {
    (seconds - RUN_OVERHEAD_SECONDS).max(0.0) / f64::from(steps)
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
            loaded_model: None,
            load_seconds: BTreeMap::new(),
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
            times.record("gpu", "a", 10, seconds, false);
        }
        // A slow run counts in full: the queue's sum of runs grows by it.
        assert_eq!(times.of("gpu")["a"], 1.5);
        // A hung one counts for four times the median (1 s per step) at most.
        times.record("gpu", "a", 10, 1000.5, false);
        assert_eq!(times.of("gpu")["a"], (1.0 + 1.0 + 3.0 + 1.0 + 4.0) / 5.0);
        for _ in 0..STEP_SAMPLES_MAX {
            times.record("gpu", "a", 10, 20.5, false);
        }
        assert_eq!(times.of("gpu")["a"], 2.0, "old samples age out");
        assert!(times.of("other").is_empty());
        // Unmeasured model on a measured server: the server's mean.
        let outlook = ServerOutlook {
            name: "gpu".into(),
            models: None,
            slots_free_in: vec![0.0],
            seconds_per_step: times.of("gpu"),
            loaded_model: None,
            load_seconds: BTreeMap::new(),
        };
        assert_eq!(outlook.run_seconds(Some("z"), 10), 20.5);
    }

    /// A load is measured apart from the steps, from the runs that loaded their model, and
    /// charged once per switch: to a run whose server held another model, not to the runs of
    /// the same model behind it, and in full whatever the run's steps.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_model_load_is_charged_once_per_switch_not_spread_over_the_steps() {
        let mut times = StepTimes::default();
        // With the model loaded: 1 s per step. Loading it first: 4 s more, at 10 or 50 steps.
        for _ in 0..4 {
            times.record("gpu", "a", 10, 10.5, false);
            times.record("gpu", "a", 10, 14.5, true);
            times.record("gpu", "a", 50, 54.5, true);
        }
        assert_eq!(times.of("gpu")["a"], 1.0);
        assert_eq!(times.loads("gpu")["a"], 4.0);
        // Runs that loaded their model, never one that found it loaded: their time spread over
        // their steps (the best guess there is), no load of its own.
        times.record("gpu", "b", 10, 14.5, true);
        assert_eq!(times.of("gpu")["b"], 1.4);
        assert!(!times.loads("gpu").contains_key("b"));
        // Noise either way of the expected run is no load.
        let mut noisy = StepTimes::default();
        for seconds in [10.5, 9.5, 11.5] {
            noisy.record("gpu", "a", 10, seconds, false);
        }
        for seconds in [9.0, 11.5, 10.0] {
            noisy.record("gpu", "a", 10, seconds, true);
        }
        assert_eq!(noisy.loads("gpu")["a"], 0.0);

        let gpu = ServerOutlook {
            loaded_model: Some("a".into()),
            load_seconds: times.loads("gpu"),
            ..server("gpu", &["a", "b"], &[0.0], 1.0)
        };
        let queue = [
            waiting("a", 10),
            waiting("b", 10),
            waiting("b", 50),
            waiting("a", 10),
        ];
        let ends: Vec<f64> = estimate(&[gpu], &queue)
            .into_iter()
            .map(|estimate| estimate.unwrap().end_in)
            .collect();
        // a: loaded already; b: no load measured for it; b again: held; a: loaded again, 4 s.
        assert_eq!(ends, [10.5, 21.0, 71.5, 86.0]);
    }
}
