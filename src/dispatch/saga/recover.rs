//! Recovering: a new leader adopts every task a dead one left in flight (`TaskAdopted` fences
//! the old leader out), and tasks whose claim was never recorded give their slot back.

use super::*;

impl Saga {
    /// Adopt tasks in flight that no saga of ours follows: another leader's, or ours from before
    /// a restart. The read model lists them; the task stream decides.
    pub(super) async fn adopt_orphans(&mut self) -> anyhow::Result<()> {
        let rows = {
            let client = self
                .dispatcher
                .pool
                .get()
                .await
                .context("getting a connection")?;
            client
                .query(
                    "SELECT task_id FROM tasks WHERE status IN ('dispatched', 'running')
                      ORDER BY updated_at LIMIT $1",
                    &[&ADOPT_PER_SCAN_MAX],
                )
                .await
                .context("reading tasks in flight")?
        };
        for row in rows {
            let task_id: TaskId = row.get(0);
            if self.in_flight.contains_key(&task_id)
                || self
                    .backends
                    .iter()
                    .any(|b| b.staging.contains_key(&task_id))
            {
                continue;
            }
            self.adopt(task_id).await?;
        }
        Ok(())
    }

    /// At takeover, before this saga claims anything: each slot lease left behind belongs to a
    /// task in flight (adopted here when the read model did not list it yet) or to a claim the
    /// previous leader never recorded (its task is queued again by the rebuild). Such a lease is
    /// released now: until it ran out, its slot would stay taken with nothing running there.
    pub(super) async fn adopt_leased(&mut self) -> anyhow::Result<()> {
        for name in self.backend_names() {
            for task_id in self.dispatcher.leases.busy_slots(&name).await? {
                if !self.in_flight.contains_key(&task_id) {
                    self.adopt(task_id).await?;
                }
                if !self.in_flight.contains_key(&task_id) {
                    tracing::info!(%task_id, backend = %name, "released a slot lease of a claim never recorded");
                    self.dispatcher.leases.release_slot(&name, task_id).await?;
                }
            }
        }
        Ok(())
    }

    pub(super) async fn adopt(&mut self, task_id: TaskId) -> anyhow::Result<()> {
        let tasks = self.dispatcher.tasks.clone();
        let (loaded, workflow) = tasks.load_with_workflow(task_id).await?;
        let state = loaded.state;
        let (Some(owner), Some(workflow), Some(prompt_id), Some(backend_name)) = (
            state.owner,
            workflow,
            state.prompt_id,
            state.backend.clone(),
        ) else {
            return Ok(());
        };
        if !matches!(state.status, TaskStatus::Dispatched | TaskStatus::Running) {
            return Ok(());
        }
        let metadata = self.metadata(task_id);
        let token = self.term.fencing_token;
        let at = self.dispatcher.clock.now();
        let Some(backend) = self
            .backends
            .iter()
            .position(|b| !b.removed && b.settings.name == backend_name)
        else {
            // Its server left the pool: nobody can finish it.
            let intent = tasks
                .begin_intent(IntentKind::Dispatch, task_id, owner, None)
                .await?;
            let command = TaskCommand::Fail {
                reason: "its image server was removed from service".into(),
                fencing_token: token,
                at,
            };
            match tasks.execute_task(task_id, &command, &metadata).await {
                Ok(_) | Err(CommandError::Rejected(TaskError::InvalidTransition { .. })) => {}
                Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                    return Err(LostLeadership.into());
                }
                Err(other) => return Err(anyhow::Error::new(other).context("failing a task")),
            }
            tasks.reconcile(task_id, owner, None, task_id).await?;
            tasks.end_intent(intent).await?;
            return Ok(());
        };
        let adopt = TaskCommand::Adopt {
            fencing_token: token,
            at,
        };
        match tasks.execute_task(task_id, &adopt, &metadata).await {
            Ok(_) => {}
            Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                return Err(LostLeadership.into());
            }
            // Ended meanwhile.
            Err(CommandError::Rejected(_)) => return Ok(()),
            Err(other) => return Err(anyhow::Error::new(other).context("adopting a task")),
        }
        let left = adopted_time_left(
            &state,
            Duration::from_millis(self.dispatcher.settings.task_timeout_ms),
            self.dispatcher.settings.posted_ahead_per_backend,
            at,
        );
        tracing::info!(%task_id, %prompt_id, backend = %backend_name, "adopted a task in flight");
        let phase = if state.status == TaskStatus::Running {
            Phase::Accepted
        } else {
            Phase::Posting
        };
        let mut flight = InFlight::new(owner, backend, prompt_id, workflow, phase, left);
        flight.start_recorded = state.status == TaskStatus::Running;
        flight.stop = state.cancel_requested.then_some(Stop::Cancel);
        self.in_flight.insert(task_id, flight);
        self.by_prompt.insert(prompt_id, task_id);
        if !self
            .dispatcher
            .leases
            .renew_slots(
                &self.term,
                &backend_name,
                &[task_id],
                self.dispatcher.settings.slot_lease_ms,
            )
            .await?
        {
            return Err(LostLeadership.into());
        }
        if self.backends[backend].client_id.is_some() {
            self.check_on(task_id);
        }
        Ok(())
    }
}

/// The time an adopted task has left. Running: its limit counts from its start. Not started: it
/// may wait in its server's queue behind the prompts posted before it (at most
/// `posted_ahead_per_backend`), each up to its own limit; its `execution_start` restarts the count.
pub(super) fn adopted_time_left(
    state: &zhihui_domain::task::TaskState,
    timeout: Duration,
    posted_ahead_per_backend: u32,
    now: chrono::DateTime<chrono::Utc>,
) -> Duration {
    let limit = |waits: u32| {
        chrono::Duration::from_std(timeout.saturating_mul(waits)).unwrap_or(chrono::Duration::MAX)
    };
    let ends_at = match (state.started_at, state.dispatched_at) {
        (Some(started), _) => started.checked_add_signed(limit(1)),
        (None, Some(dispatched)) => {
            dispatched.checked_add_signed(limit(posted_ahead_per_backend.saturating_add(1)))
        }
        (None, None) => return timeout,
    };
    ends_at.map_or(timeout, |ends_at| {
        (ends_at - now).to_std().unwrap_or(Duration::ZERO)
    })
}
