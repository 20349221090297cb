//! Submitting: posting a staged task's prompt (into a free slot, or into the server's own queue
//! behind the prompts it runs), the server's answer, and the task's start.

use super::*;

impl Saga {
    /// A post to `backend` is not answered yet: the next waits for it. Two posts in flight to
    /// one server can arrive in either order, and the server runs its queue in arrival order.
    pub(super) fn post_unanswered(&self, backend: usize) -> bool {
        self.in_flight
            .values()
            .any(|f| f.backend == backend && f.phase == Phase::Posting)
    }

    /// How many prompts a prompt posted to `backend` now would wait behind in its queue: 0 when
    /// a slot is free.
    pub(super) fn waits_behind(&self, backend: usize, task_id: TaskId) -> u32 {
        let capacity = self.backends[backend].settings.capacity as usize;
        let others = self
            .in_flight
            .iter()
            .filter(|(other, f)| {
                **other != task_id
                    && f.backend == backend
                    && matches!(f.phase, Phase::Posting | Phase::Accepted)
            })
            .count();
        u32::try_from((others + 1).saturating_sub(capacity)).unwrap_or(u32::MAX)
    }

    /// Spawn the post of a task's prompt to its server.
    pub(super) fn post(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        let backend = flight.backend;
        let Some(client_id) = self.backends[backend].client_id.clone() else {
            // Posted when the socket opens (its reconcile finds the prompt unknown).
            return;
        };
        let posted_ahead = self.waits_behind(backend, task_id) > 0;
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        flight.posted_ahead = posted_ahead;
        flight.effect_running = true;
        let client = self.backends[backend].client.clone();
        let freed_at = self.backends[backend].freed_at.take();
        let staged_ready = self.backends[backend].freeing;
        let prompt_id = flight.prompt_id;
        let workflow = flight.workflow.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.lane.handle.spawn(async move {
            let outcome = client.post_prompt(prompt_id, &client_id, &workflow).await;
            let gap = freed_at.map(|freed| GapSample {
                duration: freed.elapsed(),
                staged_ready,
            });
            drop(sender.send(Input::Posted {
                task_id,
                prompt_id,
                outcome,
                gap,
            }));
        });
    }

    pub(super) fn on_posted(
        &mut self,
        task_id: TaskId,
        prompt_id: Uuid,
        outcome: PostOutcome,
        gap: Option<GapSample>,
    ) -> anyhow::Result<()> {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return Ok(());
        };
        if flight.prompt_id != prompt_id || flight.phase == Phase::Finishing {
            return Ok(());
        }
        flight.effect_running = false;
        let backend = flight.backend;
        match outcome {
            PostOutcome::Accepted => {
                if flight.reposting {
                    flight.reposting = false;
                    flight.resubmitted = true;
                }
                if let Some(gap) = gap {
                    metrics::histogram!(
                        "zhihui_dispatch_gap_seconds",
                        "staged" => if gap.staged_ready { "true" } else { "false" }
                    )
                    .record(gap.duration.as_secs_f64());
                    if self.gaps.len() < GAP_SAMPLES_MAX {
                        self.gaps.push(gap);
                    }
                }
                self.accepted(task_id);
                if self
                    .in_flight
                    .get(&task_id)
                    .is_some_and(|f| f.stop.is_some())
                {
                    self.check_on(task_id);
                }
                Ok(())
            }
            PostOutcome::Rejected(reason) => {
                self.count_error(backend, "prompt_rejected");
                self.free_slot(task_id);
                self.record(task_id, Completion::Failed(reason))
            }
            PostOutcome::Unreachable(error) => {
                self.count_error(backend, "unreachable");
                // Maybe queued there, maybe not: the next reconcile finds out before posting again.
                tracing::warn!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "posting failed");
                Ok(())
            }
        }
    }

    /// The server has the prompt. In a free slot it runs at once: recorded as started. Posted
    /// ahead, it waits in the server's queue until its `execution_start` ([`Saga::running`]).
    pub(super) fn accepted(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.phase != Phase::Posting {
            return;
        }
        flight.phase = Phase::Accepted;
        let backend = flight.backend;
        if !flight.posted_ahead {
            self.record_start(task_id);
        }
        // The next staged task may follow it now.
        self.promote_staged(backend);
    }

    /// The prompt runs on its server now (its `execution_start`, or `/queue` says so).
    pub(super) fn running(&mut self, task_id: TaskId) {
        self.accepted(task_id);
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.phase == Phase::Accepted && flight.posted_ahead {
            flight.posted_ahead = false;
            self.record_start(task_id);
        }
    }

    /// Record the task as started (once), off the saga's path (a slot that frees meanwhile must
    /// not wait for this append).
    pub(super) fn record_start(&mut self, task_id: TaskId) {
        let metadata = self.metadata(task_id);
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.start_recorded {
            return;
        }
        flight.start_recorded = true;
        flight.ran_at = Some(Instant::now());
        let command = TaskCommand::Start {
            fencing_token: self.term.fencing_token,
            at: self.dispatcher.clock.now(),
        };
        let tasks = self.dispatcher.tasks.clone();
        let sender = self.inputs_sender.clone();
        flight.starting = Some(self.dispatcher.work.spawn(async move {
            let result = match tasks.execute_task(task_id, &command, &metadata).await {
                // Already ended (recorded by an earlier leader): nothing to start.
                Ok(_) | Err(CommandError::Rejected(TaskError::InvalidTransition { .. })) => Ok(()),
                Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                    Err(LostLeadership.into())
                }
                Err(other) => Err(anyhow::Error::new(other).context("recording a start")),
            };
            drop(sender.send(Input::Started(result)));
        }));
    }
}
