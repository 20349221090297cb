//! The pool as the saga follows it: servers added, drained, resumed and removed at run time (the
//! `backend-pool` stream), what each server offers (`/object_info`, read at connect and on a
//! timer, recorded in the pool when it changed), and the leader's view of each server published
//! for `GET /admin/backends`.

use super::*;
use crate::tasks::estimate::ServerOutlook;
use crate::tasks::pool::BackendStatus;
use zhihui_domain::pool::PoolBackend;

/// What a server said of itself.
#[derive(Debug, Clone)]
pub(super) struct Inspection {
    pub(super) models: Vec<String>,
    pub(super) version: String,
}

impl Saga {
    /// Follow `pool`: open the servers it has that the saga does not, mark draining ones, and
    /// mark the ones it no longer has as removed (nothing new goes there; what runs there is
    /// still followed to its end).
    pub(super) fn follow_pool(&mut self, pool: &PoolState) -> anyhow::Result<()> {
        for wanted in &pool.backends {
            let current = self.backends.iter().position(|backend| {
                !backend.removed
                    && backend.settings.name == wanted.name
                    && backend.settings.url == wanted.url
                    && backend.settings.capacity == wanted.capacity
            });
            let index = match current {
                Some(index) => index,
                None => {
                    // Removed and added again with other settings: a new server of that name.
                    for backend in &mut self.backends {
                        if backend.settings.name == wanted.name {
                            backend.removed = true;
                        }
                    }
                    self.open_backend(wanted)?
                }
            };
            let backend = &mut self.backends[index];
            if backend.draining != wanted.draining {
                tracing::info!(backend = %wanted.name, draining = wanted.draining, "server drain changed");
            }
            backend.draining = wanted.draining;
            if backend.models.is_none() {
                backend.models.clone_from(&wanted.models);
            }
            if backend.version.is_none() {
                backend.version.clone_from(&wanted.version);
            }
        }
        for backend in &mut self.backends {
            if !backend.removed && pool.backend(&backend.settings.name).is_none() {
                tracing::info!(backend = %backend.settings.name, "server removed from the pool");
                backend.removed = true;
            }
        }
        self.close_idle_removed();
        Ok(())
    }

    /// Start following a server: its entry and its socket.
    fn open_backend(&mut self, wanted: &PoolBackend) -> anyhow::Result<usize> {
        let timeout = Duration::from_millis(self.dispatcher.settings.http_timeout_ms);
        let client = ComfyClient::new(&wanted.url, timeout)?;
        let settings = BackendSettings {
            name: wanted.name.clone(),
            url: wanted.url.clone(),
            capacity: wanted.capacity,
        };
        let index = self.backends.len();
        let socket = self
            .dispatcher
            .lane
            .handle
            .spawn(socket::run(
                index,
                client.clone(),
                self.timings,
                self.socket_sender.clone(),
            ))
            .abort_handle();
        crate::platform::metrics::start_backend_at_zero(
            &wanted.name,
            &self.dispatcher.tasks.settings().models,
        );
        let mut backend = BackendState::new(settings, client);
        backend.socket = Some(socket.clone());
        self.backends.push(backend);
        self.background.push(socket);
        tracing::info!(backend = %wanted.name, url = %wanted.url, "following a server");
        Ok(index)
    }

    /// A removed server's socket closes once nothing of ours runs there.
    fn close_idle_removed(&mut self) {
        for index in 0..self.backends.len() {
            let idle = !self.in_flight.values().any(|f| f.backend == index)
                && self.backends[index].staging.is_empty();
            let backend = &mut self.backends[index];
            if backend.removed
                && idle
                && let Some(socket) = backend.socket.take()
            {
                socket.abort();
                backend.client_id = None;
            }
        }
    }

    /// The pool changed: read it again (once more after the read out, if it changed meanwhile).
    pub(super) fn reload_pool(&mut self) {
        if self.pool_loading {
            self.pool_reload_wanted = true;
            return;
        }
        self.pool_loading = true;
        let pool = self.dispatcher.backend_pool.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(async move {
            let loaded = pool.load().await;
            if let Ok(state) = &loaded
                && let Err(error) = pool.hold(state).await
            {
                tracing::warn!(%error, "could not hold the drained servers");
            }
            drop(sender.send(Input::PoolLoaded(loaded)));
        });
    }

    pub(super) fn on_pool_loaded(
        &mut self,
        result: anyhow::Result<PoolState>,
    ) -> anyhow::Result<()> {
        self.pool_loading = false;
        if std::mem::take(&mut self.pool_reload_wanted) {
            self.reload_pool();
        }
        let pool = match result {
            Ok(pool) => pool,
            Err(error) => {
                // Read again at the next tick.
                self.pool_reload_wanted = true;
                return Err(error);
            }
        };
        self.follow_pool(&pool)?;
        self.fill_all();
        Ok(())
    }

    /// Ask a server what it offers and which version it runs (one at a time per server).
    pub(super) fn inspect(&mut self, backend: usize) {
        let state = &mut self.backends[backend];
        if state.inspecting || state.removed {
            return;
        }
        state.inspecting = true;
        let client = state.client.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(async move {
            let result = async {
                let models = client.checkpoints().await?;
                let version = client.system_stats().await?;
                anyhow::Ok(Inspection { models, version })
            }
            .await;
            drop(sender.send(Input::Inspected { backend, result }));
        });
    }

    pub(super) fn on_inspected(
        &mut self,
        backend: usize,
        result: anyhow::Result<Inspection>,
    ) -> anyhow::Result<()> {
        let state = &mut self.backends[backend];
        state.inspecting = false;
        state.inspected_at = Some(Instant::now());
        let inspection = match result {
            Ok(inspection) => inspection,
            Err(error) => {
                tracing::warn!(backend = %state.settings.name, error = %crate::platform::telemetry::error_chain(&error), "could not read what the server offers");
                self.count_error(backend, "inspect_failed");
                return Ok(());
            }
        };
        let mut models = inspection.models.clone();
        models.sort();
        models.dedup();
        let changed = state.models.as_ref() != Some(&models)
            || state.version.as_ref() != Some(&inspection.version);
        state.models = Some(models);
        state.version = Some(inspection.version.clone());
        if changed {
            tracing::info!(backend = %state.settings.name, models = ?state.models, version = %inspection.version, "server inspected");
            // Recorded for every process (a submit for a model nobody offers is refused on it).
            let pool = self.dispatcher.backend_pool.clone();
            let name = state.settings.name.clone();
            self.dispatcher.work.spawn(async move {
                if let Err(error) = pool
                    .inspected(&name, inspection.models, inspection.version)
                    .await
                {
                    tracing::warn!(backend = %name, %error, "could not record what the server offers");
                }
            });
        }
        self.fill_all();
        Ok(())
    }

    /// Each tick: close removed servers' sockets once idle, inspect connected servers when due,
    /// publish the leader's view of the servers when due, read the pool again if a read failed.
    pub(super) fn pool_tick(&mut self, now: Instant) {
        self.close_idle_removed();
        if self.pool_reload_wanted && !self.pool_loading {
            self.pool_reload_wanted = false;
            self.reload_pool();
        }
        let every = Duration::from_millis(self.dispatcher.settings.inspect_interval_ms);
        let due: Vec<usize> = (0..self.backends.len())
            .filter(|&index| {
                let backend = &self.backends[index];
                backend.client_id.is_some()
                    && !backend.removed
                    && backend
                        .inspected_at
                        .is_none_or(|at| now.duration_since(at) >= every)
            })
            .collect();
        for backend in due {
            self.inspect(backend);
        }
        let publish_every =
            Duration::from_millis(self.dispatcher.settings.status_publish_interval_ms);
        if self
            .last_status_publish
            .is_none_or(|at| now.duration_since(at) >= publish_every)
        {
            self.last_status_publish = Some(now);
            let statuses = self.statuses();
            let pool = self.dispatcher.backend_pool.clone();
            self.dispatcher.work.spawn(async move {
                if let Err(error) = pool.publish_status(&statuses).await {
                    tracing::warn!(%error, "could not publish the servers' status");
                }
            });
        }
    }

    /// Model switches per server so far (servers in the saga's order).
    pub fn model_switches(&self) -> Vec<(String, u64)> {
        self.backends
            .iter()
            .filter(|backend| !backend.removed)
            .map(|backend| (backend.settings.name.clone(), backend.model_switches))
            .collect()
    }

    /// The leader's view of every server in the pool.
    pub(super) fn statuses(&self) -> Vec<BackendStatus> {
        let now = self.dispatcher.clock.now();
        self.backends
            .iter()
            .enumerate()
            .filter(|(_, backend)| !backend.removed)
            .map(|(index, backend)| {
                let name = &backend.settings.name;
                let outlook = ServerOutlook {
                    name: name.clone(),
                    models: None,
                    slots_free_in: Vec::new(),
                    seconds_per_step: self.step_times.of(name),
                    loaded_model: backend.last_posted_model.clone(),
                    load_seconds: self.step_times.loads(name),
                };
                (index, backend, outlook)
            })
            .map(|(index, backend, outlook)| BackendStatus {
                name: backend.settings.name.clone(),
                up: backend.client_id.is_some(),
                draining: backend.draining,
                prompts_in_flight: u32::try_from(self.busy(index)).unwrap_or(u32::MAX),
                staged: u32::try_from(self.staged_count(index)).unwrap_or(u32::MAX),
                last_model: backend.last_posted_model.clone(),
                model_switches: backend.model_switches,
                last_error: backend.last_error.as_ref().map(|(text, _)| text.clone()),
                last_error_at: backend.last_error.as_ref().map(|(_, at)| *at),
                slots_free_in: self.slots_free_in(index, &outlook),
                seconds_per_step: outlook.seconds_per_step,
                load_seconds: outlook.load_seconds,
                published_at: now,
            })
            .collect()
    }

    /// Seconds until each slot of `backend` (its measures in `outlook`) is free for a queued
    /// task: what runs there has its expected run (with its model's load when it loads one)
    /// less the time it ran; what waits there (posted ahead, posting, staged) runs after it, in
    /// claim order, on the slot that frees first.
    pub(super) fn slots_free_in(&self, backend: usize, outlook: &ServerOutlook) -> Vec<f64> {
        let state = &self.backends[backend];
        let capacity = state.settings.capacity.max(1) as usize;
        let mut slots: Vec<f64> = Vec::with_capacity(capacity);
        let mut waiting: Vec<(u64, f64)> = Vec::new();
        for flight in self.in_flight.values() {
            if flight.backend != backend || flight.phase == Phase::Finishing {
                continue;
            }
            let model = settle::model_of(&flight.workflow);
            let steps = settle::steps_of(&flight.workflow).unwrap_or(0);
            let load = if flight.loads_model {
                outlook.switch_seconds(Some(&model))
            } else {
                0.0
            };
            let run = outlook.run_seconds(Some(&model), steps) + load;
            match flight.ran_at {
                Some(ran_at) if flight.phase == Phase::Accepted && slots.len() < capacity => {
                    slots.push((run - ran_at.elapsed().as_secs_f64()).max(0.0));
                }
                _ => waiting.push((flight.claim_seq, run)),
            }
        }
        slots.resize(capacity, 0.0);
        waiting.sort_by_key(|(claim_seq, _)| *claim_seq);
        for (_, run) in waiting {
            if let Some(first) = slots.iter_mut().min_by(|a, b| a.total_cmp(b)) {
                *first += run;
            }
        }
        slots
    }

    /// A prompt of `model` is posted to `backend`: a model switch there if the one before was
    /// another (a real GPU loads the new checkpoint first). Whether the prompt loads its model
    /// first: also when the model before is unknown (the first prompt this leader posts there).
    pub(super) fn note_posted_model(&mut self, backend: usize, model: String) -> bool {
        let state = &mut self.backends[backend];
        let loads = state.last_posted_model.as_ref() != Some(&model);
        if state
            .last_posted_model
            .as_ref()
            .is_some_and(|last| *last != model)
        {
            state.model_switches += 1;
            metrics::counter!(
                "zhihui_backend_model_switches_total",
                "backend" => state.settings.name.clone()
            )
            .increment(1);
        }
        state.last_posted_model = Some(model);
        loads
    }
}
