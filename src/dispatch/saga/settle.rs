//! Settling: a finished prompt frees its slot at once, its results are fetched, checked,
//! labelled and stored off the saga's path, and its end is recorded (`TaskSucceeded` /
//! `TaskFailed` / `TaskCancelled`) with the `dispatch` intent, then the hold is settled or released.

use super::*;

impl Saga {
    /// Free the task's slot (once) and fill it at once.
    pub(super) fn free_slot(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.phase == Phase::Finishing {
            return;
        }
        flight.phase = Phase::Finishing;
        let backend = flight.backend;
        // With a prompt posted ahead behind it, the server went on by itself: no idle GPU.
        let capacity = self.backends[backend].settings.capacity as usize;
        if self.busy(backend) < capacity {
            self.backends[backend].freed_at = Some(Instant::now());
        }
        // The staged task goes out first: its post needs nothing from Redis or the store.
        self.backends[backend].freeing = true;
        self.promote_staged(backend);
        self.backends[backend].freeing = false;
        self.releases.push((backend, task_id));
        self.fill_all();
    }

    /// A prompt ended on its server: free the slot, then fetch and record its results.
    pub(super) fn finishing(
        &mut self,
        task_id: TaskId,
        known: Option<HistoryOutcome>,
    ) -> anyhow::Result<()> {
        let Some(flight) = self.in_flight.get(&task_id) else {
            return Ok(());
        };
        if flight.phase == Phase::Finishing {
            return Ok(());
        }
        // It ran: a prompt posted ahead whose end is known before its `execution_start` was
        // read (`/history` can answer before the socket's messages are handled) is recorded as
        // started first; the end waits for that append.
        self.record_start(task_id);
        self.free_slot(task_id);
        if let Some(flight) = self.in_flight.get_mut(&task_id) {
            flight.effect_running = true;
        }
        self.complete(task_id, known);
        Ok(())
    }

    /// Spawn the completion: the history entry (unless known), then the images into the store.
    pub(super) fn complete(&mut self, task_id: TaskId, known: Option<HistoryOutcome>) {
        let Some(flight) = self.in_flight.get(&task_id) else {
            return;
        };
        let client = self.backends[flight.backend].client.clone();
        let images = self.dispatcher.images.clone();
        let labeller = self.dispatcher.labeller.clone();
        let owner = flight.owner;
        let prompt_id = flight.prompt_id;
        let expected = crate::dispatch::comfy::expected_images(&flight.workflow);
        let settings = self.dispatcher.settings.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(async move {
            let result = async {
                let outcome = match known {
                    // An error or interrupt says all there is; a success needs the outputs.
                    Some(
                        outcome @ (HistoryOutcome::Error { .. } | HistoryOutcome::Interrupted),
                    ) => outcome,
                    Some(HistoryOutcome::Success { .. }) | None => {
                        let mut found = None;
                        for _attempt in 0..settings.history_attempts_max {
                            if let Some(outcome) = client.history(prompt_id).await? {
                                found = Some(outcome);
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(settings.history_retry_ms))
                                .await;
                        }
                        match found {
                            Some(outcome) => outcome,
                            None => return Ok(Completion::Vanished),
                        }
                    }
                };
                Ok(match outcome {
                    HistoryOutcome::Success { images: outputs } => {
                        if outputs.is_empty() {
                            return Ok(Completion::Failed(
                                "the image server finished without producing an image".into(),
                            ));
                        }
                        // A server is not trusted: more images than asked for, or files
                        // outside the task's own, fail the task (nothing is downloaded).
                        if let Err(reason) =
                            crate::dispatch::comfy::check_outputs(task_id, &outputs, expected)
                        {
                            return Ok(Completion::Failed(reason));
                        }
                        let mut stored = Vec::with_capacity(outputs.len());
                        for (index, output) in outputs.iter().enumerate() {
                            let (bytes, _) = client
                                .view(output, crate::dispatch::comfy::IMAGE_BYTES_MAX)
                                .await?;
                            let id = image_id(task_id, index);
                            // Both labels before the store: no unlabelled image ever has a URL.
                            let image = match labeller.label(bytes, task_id, index, id).await {
                                Ok(image) => image,
                                // The same bytes would come back: fail now, points released.
                                Err(error @ LabelError::Unreadable(_)) => {
                                    tracing::warn!(%task_id, %error, "an output could not be labelled");
                                    return Ok(Completion::Failed(
                                        "the image server returned an image that cannot be read"
                                            .into(),
                                    ));
                                }
                                Err(LabelError::Internal(error)) => return Err(error),
                            };
                            images.put(id, owner, task_id, &image).await?;
                            stored.push(TaskImage {
                                image_id: id.to_string(),
                                content_type: image.content_type().to_owned(),
                            });
                        }
                        Completion::Succeeded(stored)
                    }
                    HistoryOutcome::Error { node_type, message } => {
                        Completion::Failed(failure_reason(&node_type, &message))
                    }
                    HistoryOutcome::Interrupted => Completion::Interrupted,
                })
            }
            .await;
            drop(sender.send(Input::Completed {
                task_id,
                prompt_id,
                result,
            }));
        });
    }

    /// Record how the task ended, settle or release its hold, tell its owner, forget it.
    /// A task's end in the metrics: its time on the server by server, model and outcome, and
    /// the server's part in a failure.
    /// Returns the server's error kind, if the server failed it.
    fn count_end(&self, flight: &InFlight, completion: &Completion) -> Option<&'static str> {
        let outcome = match (completion, flight.stop) {
            (Completion::Succeeded(_), _) => "succeeded",
            (Completion::Failed(_), _) => "failed",
            (_, Some(Stop::Cancel)) => "cancelled",
            (_, Some(Stop::Timeout)) => "timed_out",
            (Completion::Interrupted, None) => "interrupted",
            (Completion::Vanished, None) => "lost",
        };
        let error = match (completion, flight.stop) {
            (Completion::Failed(_), _) => Some("execution_error"),
            (Completion::Interrupted, None) => Some("interrupted"),
            (Completion::Vanished, None) => Some("lost_prompt"),
            _ => None,
        };
        let Some(ran_at) = flight.ran_at else {
            return error;
        };
        metrics::histogram!(
            "zhihui_task_duration_seconds",
            "backend" => self.backends[flight.backend].settings.name.clone(),
            "model" => model_of(&flight.workflow),
            "outcome" => outcome
        )
        .record(ran_at.elapsed().as_secs_f64());
        error
    }

    pub(super) fn record(&mut self, task_id: TaskId, completion: Completion) -> anyhow::Result<()> {
        let Some(flight) = self.in_flight.get(&task_id) else {
            return Ok(());
        };
        let token = self.term.fencing_token;
        let at = self.dispatcher.clock.now();
        let timeout_s = self.dispatcher.settings.task_timeout_ms / 1000;
        let (command, notice) = match (&completion, flight.stop) {
            (Completion::Succeeded(images), _) => (
                TaskCommand::Succeed {
                    images: images.clone(),
                    fencing_token: token,
                    at,
                },
                TaskNotice::Succeeded {
                    images: images
                        .iter()
                        .filter_map(|image| Uuid::parse_str(&image.image_id).ok())
                        .collect(),
                },
            ),
            (Completion::Failed(reason), _) => failed(reason.clone(), token, at),
            (Completion::Interrupted | Completion::Vanished, Some(Stop::Cancel)) => (
                TaskCommand::Cancel {
                    by: Canceller::Dispatcher {
                        fencing_token: token,
                    },
                    at,
                },
                TaskNotice::Cancelled,
            ),
            (Completion::Interrupted | Completion::Vanished, Some(Stop::Timeout)) => failed(
                format!("the task ran longer than the limit of {timeout_s} s and was stopped"),
                token,
                at,
            ),
            (Completion::Interrupted, None) => {
                failed("the image server interrupted the task".into(), token, at)
            }
            (Completion::Vanished, None) => failed(
                "the image server lost the task (it restarted or dropped it)".into(),
                token,
                at,
            ),
        };
        let owner = flight.owner;
        let backend = flight.backend;
        // A success's run, for the wait estimates' step times.
        let run = match (&completion, flight.ran_at, steps_of(&flight.workflow)) {
            (Completion::Succeeded(_), Some(ran_at), Some(steps)) if !flight.end_counted => Some((
                model_of(&flight.workflow),
                steps,
                ran_at.elapsed(),
                flight.loads_model,
            )),
            _ => None,
        };
        if !flight.end_counted
            && let Some(kind) = self.count_end(flight, &completion)
        {
            self.count_error(backend, kind);
        }
        if let Some((model, steps, ran, loads_model)) = run {
            let name = self.backends[backend].settings.name.clone();
            self.step_times
                .record(&name, &model, steps, ran.as_secs_f64(), loads_model);
        }
        // Recorded off the saga's path: the next dispatch must not wait for this one's writes.
        let starting = self.in_flight.get_mut(&task_id).and_then(|flight| {
            flight.end_counted = true;
            flight.effect_running = true;
            flight.starting.take()
        });
        let tasks = self.dispatcher.tasks.clone();
        let metadata = self.metadata(task_id);
        let notifier = self.dispatcher.notifier.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(async move {
            let result = async {
                if let Some(starting) = starting {
                    // Its outcome reaches the saga on its own; only the order matters here.
                    drop(starting.await);
                }
                // Begun before the end is recorded: if this process dies between the end and the
                // settlement, the intent sweeper settles the hold (before the end, the task is
                // in flight, and the next leader adopts it).
                let intent = tasks
                    .begin_intent(IntentKind::Dispatch, task_id, owner, None)
                    .await?;
                let recorded = match tasks.execute_task(task_id, &command, &metadata).await {
                    // A repeat records nothing new and tells nobody twice.
                    Ok(executed) => !executed.new_events.is_empty(),
                    Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                        return Err(LostLeadership.into());
                    }
                    // Already ended otherwise (a repeat after a crash): settle by what is recorded.
                    Err(CommandError::Rejected(_)) => false,
                    Err(other) => {
                        return Err(anyhow::Error::new(other).context("recording a task's end"));
                    }
                };
                tasks
                    .reconcile(task_id, owner, None, metadata.correlation_id)
                    .await
                    .context("settling a task's hold")?;
                tasks.end_intent(intent).await?;
                drop(tasks.queue.clear_progress(task_id).await);
                if recorded {
                    notifier.tell(owner, task_id, notice).await;
                }
                anyhow::Ok(())
            }
            .await;
            drop(sender.send(Input::Recorded {
                task_id,
                completion,
                result,
            }));
        });
        Ok(())
    }
}

/// The checkpoint a workflow loads (`CheckpointLoaderSimple`'s `ckpt_name`): one of the
/// catalog's models, so a bounded label.
pub(super) fn model_of(workflow: &Value) -> String {
    workflow
        .as_object()
        .into_iter()
        .flat_map(|nodes| nodes.values())
        .find(|node| node["class_type"] == "CheckpointLoaderSimple")
        .and_then(|node| node["inputs"]["ckpt_name"].as_str())
        .unwrap_or("unknown")
        .to_owned()
}

/// The sampler steps a workflow runs (its `KSampler`'s `steps`).
pub(super) fn steps_of(workflow: &Value) -> Option<u32> {
    workflow
        .as_object()?
        .values()
        .find(|node| {
            node["class_type"]
                .as_str()
                .is_some_and(|class| class.starts_with("KSampler"))
        })
        .and_then(|node| node["inputs"]["steps"].as_u64())
        .and_then(|steps| u32::try_from(steps).ok())
}

pub(super) fn failed(
    reason: String,
    fencing_token: u64,
    at: chrono::DateTime<chrono::Utc>,
) -> (TaskCommand, TaskNotice) {
    (
        TaskCommand::Fail {
            reason: reason.clone(),
            fencing_token,
            at,
        },
        TaskNotice::Failed { reason },
    )
}

/// A runtime error, said to a user: what failed, without tracebacks or server paths.
pub(super) fn failure_reason(node_type: &str, message: &str) -> String {
    let first_line = message.lines().next().unwrap_or("").trim();
    // The server's own paths (its files, its Python) are not the user's business.
    let without_paths = first_line
        .split(' ')
        .map(|word| {
            if word.contains('/') || word.contains('\\') {
                "<path>"
            } else {
                word
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    let short: String = without_paths.chars().take(200).collect();
    let node_type: String = node_type.chars().take(60).collect();
    let node_type = node_type.as_str();
    match (node_type.is_empty(), short.is_empty()) {
        (true, true) => "generation failed on the image server".into(),
        (true, false) => format!("generation failed on the image server: {short}"),
        (false, true) => format!("generation failed on the image server at {node_type}"),
        (false, false) => format!("generation failed on the image server at {node_type}: {short}"),
    }
}

#[cfg(test)]
mod tests {
    use super::failure_reason;

    #[test]
    fn a_failure_reason_in_any_script_is_cut_on_a_character_and_loses_its_paths() {
        // Three bytes a character: 300 of them cut at 200 characters, never inside one.
        let message = format!("{} /opt/ComfyUI/模型.py", "显存不足".repeat(75));
        let reason = failure_reason("KSampler采样器", &message);
        let said = reason
            .strip_prefix("generation failed on the image server at KSampler采样器: ")
            .unwrap_or_else(|| panic!("{reason}"));
        assert_eq!(said.chars().count(), 200);
        assert!(said.chars().all(|c| "显存不足".contains(c)));
        assert!(!reason.contains("/opt"));
        let emoji = failure_reason("", &"🦊".repeat(201));
        assert_eq!(
            emoji,
            format!(
                "generation failed on the image server: {}",
                "🦊".repeat(200)
            )
        );
    }
}
