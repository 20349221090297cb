//! Claiming: the filler (one Lua step per round: release ended leases, renew held ones, fill
//! free slots, stage ahead), recording each claim (`TaskDispatched` with a fresh prompt id, the
//! workflow rendered), and staging until the server has room.

use super::*;

impl Saga {
    /// The slot leases this saga holds, per server: every task in flight that has not ended.
    pub(super) fn held_slots(&self) -> Vec<Vec<TaskId>> {
        (0..self.backends.len())
            .map(|index| {
                self.in_flight
                    .iter()
                    .filter(|(_, f)| f.backend == index && f.phase != Phase::Finishing)
                    .map(|(task_id, _)| *task_id)
                    .collect()
            })
            .collect()
    }

    /// Every server's name, in the saga's order (removed ones too: an index stays its server's).
    pub(super) fn backend_names(&self) -> Vec<String> {
        self.backends
            .iter()
            .map(|backend| backend.settings.name.clone())
            .collect()
    }

    /// Prompts posted (or being posted) to `backend`: its occupied slots.
    pub(super) fn busy(&self, backend: usize) -> usize {
        self.in_flight
            .values()
            .filter(|f| f.backend == backend && matches!(f.phase, Phase::Posting | Phase::Accepted))
            .count()
    }

    /// `backend`'s staged task claimed first (it was first in the queue), unless a task claimed
    /// before it is still being recorded: dispatch records finish in any order, and a later
    /// claim must not overtake an earlier one (the earlier one's `Prepared` fills the slot).
    pub(super) fn staged_on(&self, backend: usize) -> Option<TaskId> {
        let (task_id, first) = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.backend == backend && f.phase == Phase::Staged)
            .min_by_key(|(_, f)| f.claim_seq)?;
        let earlier_being_recorded = self.backends[backend]
            .staging
            .values()
            .any(|&claim_seq| claim_seq < first.claim_seq);
        (!earlier_being_recorded).then_some(*task_id)
    }

    /// Tasks staged on `backend` or being staged there.
    pub(super) fn staged_count(&self, backend: usize) -> usize {
        self.in_flight
            .values()
            .filter(|f| f.backend == backend && f.phase == Phase::Staged)
            .count()
            + self.backends[backend].staging.len()
    }

    /// Post staged tasks into every free slot now, then have the filler claim what more can be
    /// claimed. Never waits: the claims are the filler's round trips, not the saga's.
    pub(super) fn fill_all(&mut self) {
        for backend in 0..self.backends.len() {
            while self.promote_staged(backend) {}
        }
        self.fill_wanted = true;
        self.spawn_filler();
    }

    /// Start the filler unless one is out (it runs again when that one is done).
    pub(super) fn spawn_filler(&mut self) {
        if self.filling || !((self.fill_wanted && !self.pool_loading) || self.slot_renew_wanted) {
            return;
        }
        let renew_slots = std::mem::take(&mut self.slot_renew_wanted).then(|| self.held_slots());
        // While the pool is being read again (an admin changed it), nothing is claimed: a
        // drained server must not get a task the admin's drain came before. Claims resume once
        // the pool is read (`on_pool_loaded` fills again).
        let claim = !self.pool_loading && std::mem::take(&mut self.fill_wanted);
        let servers = (0..self.backends.len())
            .map(|backend| {
                let state = &self.backends[backend];
                (claim && state.claimable()).then(|| ServerSlots {
                    capacity: state.settings.capacity,
                    busy: self.busy(backend),
                    staged: self.staged_count(backend),
                    last_model: state.last_claimed_model.clone(),
                    models: state.models.clone(),
                })
            })
            .collect();
        let filler = Filler {
            tasks: self.dispatcher.tasks.clone(),
            leases: self.dispatcher.leases.clone(),
            clock: self.dispatcher.clock.clone(),
            work: self.dispatcher.work.clone(),
            term: self.term.clone(),
            names: self.backend_names(),
            slot_lease_ms: self.dispatcher.settings.slot_lease_ms,
            depth: self.dispatcher.settings.staged_per_backend,
            scan_max: self.dispatcher.settings.queue_scan_max,
            prefer_same_model: self.dispatcher.settings.prefer_same_model,
            affinity_window: self.dispatcher.settings.model_affinity_window,
            affinity_wait_max_ms: self.dispatcher.settings.model_affinity_wait_max_ms,
            releases: std::mem::take(&mut self.releases),
            renew_slots,
            servers,
        };
        self.filling = true;
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(filler.run(sender));
    }

    pub(super) fn on_filled(&mut self, outcome: FillOutcome) -> anyhow::Result<()> {
        self.filling = false;
        let FillOutcome {
            mut unreleased,
            renew_failed,
            queue_empty,
            result,
        } = outcome;
        if !unreleased.is_empty() {
            // Released first next time, before anything else is claimed.
            unreleased.append(&mut self.releases);
            self.releases = unreleased;
        }
        if renew_failed {
            self.slot_renew_wanted = true;
        }
        if queue_empty {
            // Nothing waited: a slot that stays free is not a dispatch gap.
            for backend in 0..self.backends.len() {
                let capacity = self.backends[backend].settings.capacity as usize;
                if self.busy(backend) + self.staged_count(backend) < capacity {
                    self.backends[backend].freed_at = None;
                }
            }
        }
        result?;
        self.spawn_filler();
        Ok(())
    }

    /// Post `backend`'s staged task if it has a socket and room: a free slot, or a place in
    /// its own queue (`posted_ahead_per_backend`); whether it did.
    pub(super) fn promote_staged(&mut self, backend: usize) -> bool {
        let capacity = self.backends[backend].settings.capacity as usize;
        let posted_max = capacity + self.dispatcher.settings.posted_ahead_per_backend as usize;
        if self.backends[backend].client_id.is_none()
            || self.busy(backend) >= posted_max
            || self.post_unanswered(backend)
        {
            return false;
        }
        let Some(task_id) = self.staged_on(backend) else {
            return false;
        };
        // Behind prompts the server runs, it may wait for each of them to end (or time out).
        let waits_behind = self.waits_behind(backend, task_id);
        let timeout = Duration::from_millis(self.dispatcher.settings.task_timeout_ms);
        let mut model = None;
        if let Some(flight) = self.in_flight.get_mut(&task_id) {
            flight.phase = Phase::Posting;
            flight.deadline = Instant::now() + timeout * (1 + waits_behind);
            model = Some(settle::model_of(&flight.workflow));
        }
        if let Some(model) = model {
            let switched = self.note_posted_model(backend, model);
            if let Some(flight) = self.in_flight.get_mut(&task_id) {
                flight.loads_model = switched;
            }
        }
        self.post(task_id);
        true
    }

    /// Follow a task recorded as dispatched to `backend`: staged until a slot of it is free.
    pub(super) fn admit(&mut self, backend: usize, task_id: TaskId, prepared: Option<Prepared>) {
        let Some(Prepared {
            owner,
            workflow,
            prompt_id,
        }) = prepared
        else {
            return;
        };
        if self.in_flight.contains_key(&task_id) {
            // Adopted meanwhile by the orphan scan: that entry stands.
            return;
        }
        let timeout = Duration::from_millis(self.dispatcher.settings.task_timeout_ms);
        self.backends[backend].last_claimed_model = Some(settle::model_of(&workflow));
        let mut flight = InFlight::new(owner, backend, prompt_id, workflow, Phase::Staged, timeout);
        // A cancel that arrived while the dispatch was being recorded.
        if self.early_cancels.remove(&task_id) {
            flight.stop = Some(Stop::Cancel);
        }
        self.in_flight.insert(task_id, flight);
        self.by_prompt.insert(prompt_id, task_id);
        let notifier = self.dispatcher.notifier.clone();
        self.dispatcher.work.spawn(async move {
            notifier.tell(owner, task_id, TaskNotice::Dispatched).await;
            notifier.queue_moved().await;
        });
    }
}

/// What a filler effect did not finish, and how it ended.
#[derive(Debug)]
pub(super) struct FillOutcome {
    /// Releases not done (Redis failed): done first by the next filler.
    pub(super) unreleased: Vec<(usize, TaskId)>,
    /// The slot renewal was due and did not happen: the next filler tries again.
    pub(super) renew_failed: bool,
    /// The queue ran dry.
    pub(super) queue_empty: bool,
    pub(super) result: anyhow::Result<()>,
}

/// One pass of the saga's slot-lease work, off its path: release the leases of ended tasks,
/// renew the held ones when due, then claim queued tasks (free slots on every server first,
/// then one staged task per server per round, up to the staging depth) and start recording
/// each claimed task's dispatch at once. The saga runs one filler at a time.
pub(super) struct Filler {
    pub(super) tasks: TaskService,
    pub(super) leases: Leases,
    pub(super) clock: Clock,
    pub(super) work: tokio::runtime::Handle,
    pub(super) term: Term,
    pub(super) names: Vec<String>,
    pub(super) slot_lease_ms: u64,
    pub(super) depth: u32,
    pub(super) scan_max: usize,
    pub(super) prefer_same_model: bool,
    pub(super) affinity_window: u32,
    pub(super) affinity_wait_max_ms: u64,
    pub(super) releases: Vec<(usize, TaskId)>,
    /// Per server, the tasks whose leases to renew (when due).
    pub(super) renew_slots: Option<Vec<Vec<TaskId>>>,
    /// Per server; `None`: nothing is claimed for it (no socket, or only releasing/renewing).
    pub(super) servers: Vec<Option<ServerSlots>>,
}

impl Filler {
    pub(super) async fn run(mut self, sender: mpsc::UnboundedSender<Input>) {
        let outcome = self.work_through(&sender).await;
        drop(sender.send(Input::Filled(outcome)));
    }

    pub(super) async fn work_through(
        &mut self,
        sender: &mpsc::UnboundedSender<Input>,
    ) -> FillOutcome {
        let releases = std::mem::take(&mut self.releases);
        if let Some(held) = self.renew_slots.take() {
            for (backend, tasks) in held.iter().enumerate() {
                let renewed = self
                    .leases
                    .renew_slots(&self.term, &self.names[backend], tasks, self.slot_lease_ms)
                    .await;
                let result = match renewed {
                    Ok(true) => continue,
                    Ok(false) => Err(LostLeadership.into()),
                    Err(error) => Err(error),
                };
                return FillOutcome {
                    unreleased: releases,
                    renew_failed: true,
                    queue_empty: false,
                    result,
                };
            }
        }
        let filled = self
            .leases
            .fill(
                &self.term,
                &FillPlan {
                    names: &self.names,
                    releases: &releases,
                    servers: &self.servers,
                    depth: self.depth,
                    slot_lease_ms: self.slot_lease_ms,
                    scan_max: self.scan_max,
                    prefer_same_model: self.prefer_same_model,
                    affinity_window: self.affinity_window,
                    affinity_wait_max_ms: self.affinity_wait_max_ms,
                },
            )
            .await;
        let (claims, queue_empty) = match filled {
            Ok(Fill::Claimed {
                claims,
                queue_empty,
            }) => (claims, queue_empty),
            Ok(Fill::NotLeader) => {
                return FillOutcome {
                    unreleased: Vec::new(),
                    renew_failed: false,
                    queue_empty: false,
                    result: Err(LostLeadership.into()),
                };
            }
            Err(error) => {
                return FillOutcome {
                    unreleased: releases,
                    renew_failed: false,
                    queue_empty: false,
                    result: Err(error),
                };
            }
        };
        for Claimed {
            backend,
            task_id,
            score,
        } in claims
        {
            // Told first, so the saga knows of the task before its `Prepared` arrives. The
            // recording runs even if the saga is gone: the next leader adopts what it recorded.
            drop(sender.send(Input::Claimed { backend, task_id }));
            let preparation = Preparation {
                tasks: self.tasks.clone(),
                leases: self.leases.clone(),
                backend_name: self.names[backend].clone(),
                task_id,
                score,
                fencing_token: self.term.fencing_token,
                at: self.clock.now(),
                metadata: dispatcher_metadata(self.term.fencing_token, task_id),
            };
            let sender = sender.clone();
            self.work.spawn(async move {
                let result = preparation.run().await;
                drop(sender.send(Input::Prepared {
                    backend,
                    task_id,
                    result,
                }));
            });
        }
        FillOutcome {
            unreleased: Vec::new(),
            renew_failed: false,
            queue_empty,
            result: Ok(()),
        }
    }
}

/// What a dispatch records before its post, with what it needs; runs off the saga.
pub(super) struct Preparation {
    pub(super) tasks: TaskService,
    pub(super) leases: Leases,
    pub(super) backend_name: String,
    pub(super) task_id: TaskId,
    pub(super) score: i64,
    pub(super) fencing_token: u64,
    pub(super) at: chrono::DateTime<chrono::Utc>,
    pub(super) metadata: EventMetadata,
}

/// A task recorded as dispatched.
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) owner: UserId,
    pub(super) workflow: Value,
    pub(super) prompt_id: Uuid,
}

impl Preparation {
    /// `TaskDispatched` with a fresh prompt id, decided on one read of the task: two round
    /// trips. `None`: the queue entry was stale (the task was cancelled or dispatched
    /// meanwhile; its slot is freed). No intent row yet: until its end is recorded the task is
    /// in flight, and a leader that dies leaves it to the next one, which adopts it.
    pub(super) async fn run(self) -> anyhow::Result<Option<Prepared>> {
        let Preparation {
            tasks,
            leases,
            backend_name,
            task_id,
            score,
            fencing_token,
            at,
            metadata,
        } = self;
        // A claimed task that could not be recorded goes back to the queue at its score.
        let give_back = || async {
            // Its model is still beside it: the claim did not take it away.
            if let Err(error) = tasks.queue.enqueue(task_id, score, None).await {
                // The next leader's queue rebuild puts it back (the events say queued).
                tracing::warn!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "could not requeue a claimed task");
            }
            if let Err(error) = leases.release_slot(&backend_name, task_id).await {
                tracing::warn!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "could not free a slot");
            }
        };
        let (loaded, workflow) = match tasks.load_with_workflow(task_id).await {
            Ok(loaded) => loaded,
            Err(error) => {
                give_back().await;
                return Err(error);
            }
        };
        let (Some(owner), Some(workflow), TaskStatus::Queued) =
            (loaded.state.owner, workflow, loaded.state.status)
        else {
            leases.release_slot(&backend_name, task_id).await?;
            return Ok(None);
        };
        let prompt_id = Uuid::now_v7();
        let command = TaskCommand::Dispatch {
            backend: backend_name.clone(),
            prompt_id,
            fencing_token,
            at,
        };
        match tasks
            .execute_task_on(task_id, loaded, &command, &metadata)
            .await
        {
            Ok(_) => {
                // Dispatched: it is not queued again, its model beside the queue can go.
                if let Err(error) = tasks.queue.forget_model(task_id).await {
                    tracing::warn!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "could not forget a dispatched task's model");
                }
                Ok(Some(Prepared {
                    owner,
                    workflow,
                    prompt_id,
                }))
            }
            Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                leases.release_slot(&backend_name, task_id).await?;
                Err(LostLeadership.into())
            }
            Err(CommandError::Rejected(_)) => {
                leases.release_slot(&backend_name, task_id).await?;
                Ok(None)
            }
            Err(other) => {
                give_back().await;
                Err(anyhow::Error::new(other).context("recording a dispatch"))
            }
        }
    }
}
