//! Watching: the socket's messages (progress, the first terminal message), and locating a
//! prompt through `/queue` + `/history` when the socket cannot be trusted (a reconnect, the
//! watchdog, a stop).

use super::*;

impl Saga {
    /// Find out where a prompt is (or, for a task being stopped, stop it and then find out).
    pub(super) fn check_on(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        // A staged task is not on any server yet: nothing to look up.
        if flight.effect_running || flight.phase == Phase::Staged {
            return;
        }
        let client = self.backends[flight.backend].client.clone();
        let prompt_id = flight.prompt_id;
        let sender = self.inputs_sender.clone();
        flight.effect_running = true;
        if flight.phase == Phase::Finishing {
            // Results not fetched yet (an earlier attempt failed): fetch again.
            self.complete(task_id, None);
            return;
        }
        let stopping = flight.stop.is_some();
        if stopping {
            flight.stop_attempts += 1;
        }
        self.dispatcher.work.spawn(async move {
            let result = async {
                if stopping {
                    // Pending: out of the queue. Running: interrupted, and only then: a targeted
                    // interrupt that races the prompt's end hits the next prompt (recorded in
                    // comfyui-sim/transcripts/d_interrupt), and the next prompt is often ours, posted ahead.
                    client.delete_pending(prompt_id).await?;
                    let whereabouts = client.whereabouts(prompt_id).await?;
                    if matches!(whereabouts, PromptWhereabouts::Running) {
                        client.interrupt(prompt_id).await?;
                    }
                    return Ok(whereabouts);
                }
                client.whereabouts(prompt_id).await
            }
            .await;
            drop(sender.send(Input::Located {
                task_id,
                prompt_id,
                result,
            }));
        });
    }

    pub(super) fn on_located(
        &mut self,
        task_id: TaskId,
        prompt_id: Uuid,
        result: anyhow::Result<PromptWhereabouts>,
    ) -> anyhow::Result<()> {
        let settings = self.dispatcher.settings.clone();
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return Ok(());
        };
        if flight.prompt_id != prompt_id || flight.phase == Phase::Finishing {
            // Late: the task ended meanwhile and its completion owns it now.
            return Ok(());
        }
        flight.effect_running = false;
        let whereabouts = match result {
            Ok(whereabouts) => whereabouts,
            Err(error) => {
                tracing::debug!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "server unreachable");
                if flight.stop.is_some() && flight.stop_attempts >= settings.cancel_attempts_max {
                    // The server stays unreachable: record the stop without its confirmation.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Interrupted);
                }
                return Ok(());
            }
        };
        match whereabouts {
            PromptWhereabouts::Running | PromptWhereabouts::Pending => {
                if matches!(whereabouts, PromptWhereabouts::Running) {
                    self.running(task_id);
                } else {
                    // In the server's queue behind other prompts (adopted, or posted ahead):
                    // started when it runs.
                    if let Some(flight) = self.in_flight.get_mut(&task_id)
                        && flight.phase == Phase::Posting
                    {
                        flight.posted_ahead = true;
                    }
                    self.accepted(task_id);
                }
                let exhausted = self.in_flight.get(&task_id).is_some_and(|f| {
                    f.stop.is_some() && f.stop_attempts >= settings.cancel_attempts_max
                });
                if exhausted {
                    // An interrupt that never lands (a node that reports no progress): give up
                    // on the confirmation; a late result is ignored.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Interrupted);
                }
                Ok(())
            }
            PromptWhereabouts::Finished(outcome) => self.finishing(task_id, Some(outcome)),
            PromptWhereabouts::Unknown => {
                let (phase, stopping, resubmitted) =
                    (flight.phase, flight.stop.is_some(), flight.resubmitted);
                if stopping {
                    // Deleted by our stop before it ran (or lost): nothing will ever come.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Vanished);
                }
                match phase {
                    // Never accepted: post it now.
                    Phase::Staged | Phase::Posting => {
                        self.post(task_id);
                        Ok(())
                    }
                    Phase::Accepted if !resubmitted => {
                        // Back to posting. A server back from a restart answers HTTP before its
                        // socket: no post can be made until the socket opens (then its reconcile
                        // finds the prompt unknown again and posts it), so only a post the
                        // server accepts spends the one resubmission (`on_posted`).
                        tracing::warn!(%task_id, %prompt_id, "the server lost the prompt; posting it once more");
                        if let Some(flight) = self.in_flight.get_mut(&task_id) {
                            flight.phase = Phase::Posting;
                            flight.reposting = true;
                        }
                        self.post(task_id);
                        Ok(())
                    }
                    Phase::Accepted | Phase::Finishing => {
                        self.free_slot(task_id);
                        self.record(task_id, Completion::Vanished)
                    }
                }
            }
        }
    }

    pub(super) fn on_message(
        &mut self,
        backend: usize,
        message: ComfyMessage,
    ) -> anyhow::Result<()> {
        let Some(prompt_id) = message.prompt_id() else {
            return Ok(());
        };
        let Some(&task_id) = self.by_prompt.get(&prompt_id) else {
            return Ok(());
        };
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return Ok(());
        };
        if flight.backend != backend {
            return Ok(());
        }
        match message {
            ComfyMessage::ExecutionStart { .. } => {
                // A prompt posted ahead waited in the server's queue: its time limit counts
                // from now.
                if flight.posted_ahead {
                    flight.deadline = Instant::now()
                        + Duration::from_millis(self.dispatcher.settings.task_timeout_ms);
                }
                self.running(task_id);
                Ok(())
            }
            ComfyMessage::Progress { value, max, .. } => {
                let interval =
                    Duration::from_millis(self.dispatcher.settings.progress_notify_interval_ms);
                let due = flight
                    .last_progress
                    .is_none_or(|last| last.elapsed() >= interval)
                    || value >= max;
                if !due {
                    return Ok(());
                }
                flight.last_progress = Some(Instant::now());
                let owner = flight.owner;
                let ttl_ms = self.dispatcher.settings.task_timeout_ms;
                let queue = self.dispatcher.tasks.queue.clone();
                let notifier = self.dispatcher.notifier.clone();
                // Progress is a hint: written and told off the saga's path.
                self.dispatcher.work.spawn(async move {
                    // ComfyUI may send floats; users get whole steps.
                    let (whole, whole_max) =
                        (value.max(0.0).round() as u64, max.max(0.0).round() as u64);
                    if let Err(error) = queue.set_progress(task_id, whole, whole_max, ttl_ms).await
                    {
                        tracing::debug!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "progress not recorded");
                    }
                    notifier
                        .tell(owner, task_id, TaskNotice::Progress { value, max })
                        .await;
                });
                Ok(())
            }
            // The first terminal message: the GPU is free now.
            ComfyMessage::ExecutionSuccess { .. } => self.finishing(task_id, None),
            ComfyMessage::ExecutionError {
                node_type,
                exception_message,
                ..
            } => {
                let outcome = HistoryOutcome::Error {
                    node_type,
                    message: exception_message,
                };
                self.finishing(task_id, Some(outcome))
            }
            ComfyMessage::ExecutionInterrupted { .. } => {
                self.finishing(task_id, Some(HistoryOutcome::Interrupted))
            }
            // The end of a prompt whose terminal message we missed.
            ComfyMessage::Executing { node: None, .. } => self.finishing(task_id, None),
            ComfyMessage::Executing { .. } | ComfyMessage::Status { .. } | ComfyMessage::Other => {
                Ok(())
            }
        }
    }
}
