//! Submit: check the request against the catalog and the queue limit, freeze the price under a
//! hold whose id is the task id, record the task and queue it; a retry with the same key answers
//! the first submission.

use super::*;

impl TaskService {
    /// Run a paying account command (freeze, charge) of a request with an intent; on a refusal
    /// nothing was paid, so the intent ends with it.
    pub(super) async fn pay(
        &self,
        intent: Uuid,
        user_id: UserId,
        command: AccountCommand,
        metadata: &EventMetadata,
    ) -> Result<crate::platform::aggregate::Handled<Account>, TaskServiceError> {
        let refusal = match self
            .accounts
            .execute(&account_stream(user_id), command, metadata.clone())
            .await
        {
            Ok(handled) => return Ok(handled),
            Err(CommandError::Rejected(AccountError::InsufficientPoints {
                available,
                required,
            })) => TaskServiceError::InsufficientPoints {
                available,
                required,
            },
            // The same hold or operation id with other terms: the key was reused.
            Err(CommandError::Rejected(
                AccountError::HoldIdReused(_) | AccountError::OperationIdReused(_),
            )) => TaskServiceError::IdempotencyKeyReused,
            Err(other) => return Err(other.into()),
        };
        self.end_intent(intent).await?;
        Err(refusal)
    }

    /// Whether the user already has `queued_per_user_max` tasks waiting, asked when the read
    /// model's count of the user's waiting tasks (`tasks_waiting`, one row, read by
    /// [`TaskService::begin_submit_intent`]) is at the limit: one lookup decides an acceptance,
    /// the same however many tasks the user has or had. The count may lag (a task that has left
    /// the queue may still be counted), so a refusal is confirmed here on the streams of the
    /// tasks the read model lists as waiting, at most twice the limit of them. A task submitted
    /// through another process and not yet projected is not counted: the limit is soft, and
    /// only ever errs towards accepting.
    pub(super) async fn at_queue_limit(&self, user_id: UserId) -> anyhow::Result<bool> {
        let max = self.catalog.settings().queued_per_user_max;
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let candidates: Vec<TaskId> = crate::platform::postgres::query_cached(
            &client,
            "SELECT task_id FROM tasks \
              WHERE user_id = $1 AND status IN ('submitted', 'queued') LIMIT $2",
            &[&user_id.as_uuid(), &(2 * i64::from(max))],
        )
        .await
        .context("listing waiting tasks")?
        .iter()
        .map(|row| row.get(0))
        .collect();
        drop(client);
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        let mut waiting = 0;
        for task_id in candidates {
            let status = self.load(task_id).await?.status;
            if zhihui_projections::tasks::is_waiting(status) {
                waiting += 1;
                if waiting >= max {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Submit a task (see the module comment for the order of steps and what a crash leaves).
    pub async fn submit(
        &self,
        user_id: UserId,
        request: &RequestedTask,
        idempotency_key: Option<&str>,
        metadata: &EventMetadata,
    ) -> Result<SubmitOutcome, TaskServiceError> {
        let checked = self
            .catalog
            .check(request, rand::random())
            .map_err(TaskServiceError::Invalid)?;
        let digest = request_digest(request);
        let task_id = match idempotency_key {
            Some(key) => Uuid::new_v5(&SUBMIT_NAMESPACE, format!("{user_id}:{key}").as_bytes()),
            None => Uuid::now_v7(),
        };
        // What the task's stream holds now. A task id without a key is fresh (UUIDv7: time and
        // 74 random bits), so its stream is known to be empty without a read; should it not be,
        // the append's expected version ("no stream") refuses and the command reads and decides
        // again. A keyed id is read once here and that state is what the append expects.
        let loaded = match idempotency_key {
            Some(_) => {
                let loaded = command::load::<Task>(&self.store, &task_stream(task_id)).await?;
                if loaded.state.status != TaskStatus::Unknown {
                    return self.repeated_submit(task_id, &loaded.state, &digest).await;
                }
                loaded
            }
            None => command::unwritten::<Task>(),
        };
        // Refused before any point moves; a repeat of a recorded submit (above) is answered as
        // recorded whatever the pool says now.
        if let Some(pool) = &self.backend_pool
            && !pool.may_run(&checked.spec.model).await?
        {
            return Err(TaskServiceError::ModelUnavailable {
                model: checked.spec.model.clone(),
            });
        }
        let settings = self.catalog.settings();
        let intent = match self.begin_submit_intent(task_id, user_id).await? {
            Some(intent) => intent,
            None if self.at_queue_limit(user_id).await? => {
                return Err(TaskServiceError::QueueLimit {
                    max: settings.queued_per_user_max,
                });
            }
            None => {
                self.begin_intent(IntentKind::Submit, task_id, user_id, None)
                    .await?
            }
        };
        let freeze = AccountCommand::Freeze {
            hold_id: task_id,
            amount: checked.price,
            at: self.clock.now(),
        };
        self.pay(intent, user_id, freeze, metadata).await?;
        self.crash_if(CrashPoint::AfterFreeze)?;

        let (prompt, negative_prompt) = futures::join!(
            self.translator.to_english(checked.prompt.as_str()),
            self.translator.to_english(checked.negative_prompt.as_str())
        );
        let prompt_used = format!("{}{}", settings.prompt_prefix, prompt.text);
        let negative_prompt_used = format!(
            "{}{}",
            negative_prompt.text, settings.negative_prompt_suffix
        );
        let workflow =
            match self
                .workflows
                .render(task_id, &checked.spec, &prompt_used, &negative_prompt_used)
            {
                Ok(workflow) => workflow,
                Err(error) => {
                    // A template bug: give the points back now rather than after the sweep.
                    self.reconcile(task_id, user_id, None, metadata.correlation_id)
                        .await?;
                    self.end_intent(intent).await?;
                    return Err(anyhow::Error::new(error).into());
                }
            };
        let score = self.queue.next_score().await?;
        let work = (checked.spec.model.clone(), checked.spec.steps);
        let submitted = TaskSubmitted {
            task_id,
            user_id,
            spec: checked.spec,
            prompt: checked.prompt,
            negative_prompt: checked.negative_prompt,
            prompt_used,
            negative_prompt_used,
            price: checked.price,
            workflow: workflow.into(),
            request_digest: digest.clone(),
            at: self.clock.now(),
        };
        let command = TaskCommand::Submit {
            submitted: Box::new(submitted),
            score,
        };
        match self
            .execute_task_on(task_id, loaded, &command, metadata)
            .await
        {
            Ok(_) => {}
            Err(CommandError::Rejected(TaskError::AlreadySubmitted)) => {
                // A concurrent retry recorded it first, or the sweeper abandoned it.
                let state = self
                    .reconcile(task_id, user_id, None, metadata.correlation_id)
                    .await?;
                self.end_intent(intent).await?;
                return self.repeated_submit(task_id, &state, &digest).await;
            }
            Err(other) => return Err(other.into()),
        }
        let rank = self
            .queue
            .enqueue(task_id, score, Some((&work.0, work.1)))
            .await?;
        self.end_intent(intent).await?;
        Ok(SubmitOutcome {
            task_id,
            status: TaskStatus::Queued,
            position: rank.map(|rank| rank + 1),
            price: checked.price,
            submitted_now: true,
        })
    }

    pub(super) async fn repeated_submit(
        &self,
        task_id: TaskId,
        state: &TaskState,
        digest: &str,
    ) -> Result<SubmitOutcome, TaskServiceError> {
        if state.status == TaskStatus::Abandoned {
            return Err(TaskServiceError::RolledBack);
        }
        if state.request_digest.as_deref() != Some(digest) {
            return Err(TaskServiceError::IdempotencyKeyReused);
        }
        let mut position = None;
        if state.status == TaskStatus::Queued {
            position = self.queue.rank(task_id).await?;
            if position.is_none()
                && let Some(score) = state.score
            {
                // The first attempt died before queueing it: queue it now.
                position = self.queue.enqueue(task_id, score, state.work()).await?;
            }
        }
        Ok(SubmitOutcome {
            task_id,
            status: state.status,
            position: position.map(|rank| rank + 1),
            price: state
                .price
                .unwrap_or_else(|| unreachable!("a submitted task has a price")),
            submitted_now: false,
        })
    }
}
