//! What puts things right after a crash: `reconcile` makes the account and the Redis queue
//! agree with the task's stream (fencing first what was never recorded), the intent sweeper runs
//! it for requests that died midway, and `rebuild_queue` refills the queue from the events after
//! Redis lost it.

use super::*;

impl TaskService {
    /// Bring the account, the Redis queue and (for `operation`) the prioritise fee in line with
    /// the task stream; fence first what was never recorded. Idempotent.
    pub async fn reconcile(
        &self,
        task_id: TaskId,
        user_id: UserId,
        operation: Option<OperationId>,
        correlation_id: Uuid,
    ) -> anyhow::Result<TaskState> {
        let (state, _moves) = self
            .reconcile_reporting(
                task_id,
                user_id,
                operation,
                correlation_id,
                "system:task-intents",
            )
            .await?;
        Ok(state)
    }

    /// [`TaskService::reconcile`], saying which account movements it made itself (`actor` is
    /// written into their metadata): the settlement reconciler counts these as its repairs.
    ///
    /// "No such hold" or "no such charge" is accepted only where the task stream allows it: the
    /// account refuses only on its stream's latest version (see `src/platform/aggregate.rs`), and a task
    /// that was ever recorded had its points frozen first, so an unknown hold of a recorded task
    /// is reported as an error, never read as "settled". A task abandoned before it was recorded
    /// may truly have no hold (the request died before freezing) or one still to come (the
    /// request is slow): the settlement reconciler releases such a late hold.
    pub async fn reconcile_reporting(
        &self,
        task_id: TaskId,
        user_id: UserId,
        operation: Option<OperationId>,
        correlation_id: Uuid,
        actor: &str,
    ) -> anyhow::Result<(TaskState, AccountMoves)> {
        let metadata = EventMetadata {
            correlation_id,
            causation_id: None,
            actor: actor.to_owned(),
        };
        let now = self.clock.now();
        let mut moves = AccountMoves::default();
        let mut state = self.load(task_id).await?;
        if state.status == TaskStatus::Unknown {
            let abandon = TaskCommand::Abandon {
                reason: "the request that submitted this task failed before recording it".into(),
                at: now,
            };
            state = self
                .execute_task(task_id, &abandon, &metadata)
                .await
                .context("abandoning an unrecorded task")?
                .state;
        }
        let owner = state.owner.unwrap_or(user_id);
        if let Some(operation_id) = operation {
            if !state.prioritisations.contains_key(&operation_id) {
                let abandon = TaskCommand::AbandonPrioritisation {
                    operation_id,
                    at: now,
                };
                state = self
                    .execute_task(task_id, &abandon, &metadata)
                    .await
                    .context("abandoning a prioritise")?
                    .state;
            }
            if state.prioritisations.get(&operation_id) == Some(&PrioritisationOutcome::Abandoned) {
                let refund = AccountCommand::Refund {
                    operation_id: refund_operation_id(operation_id),
                    charge_operation_id: operation_id,
                    reason: format!("prioritise of task {task_id} did not happen"),
                    at: now,
                };
                match self
                    .accounts
                    .execute(&account_stream(owner), refund, metadata.clone())
                    .await
                {
                    Ok(handled) => moves.fee_refunded = !handled.new_events.is_empty(),
                    // Refused on the account's latest version: refunded already, or the request
                    // died before charging (the prioritise is abandoned, so it never will).
                    Err(CommandError::Rejected(
                        AccountError::UnknownCharge(_) | AccountError::ChargeAlreadyRefunded(_),
                    )) => {}
                    Err(other) => return Err(anyhow::Error::new(other).context("refunding a fee")),
                }
            }
        }
        match (state.status, state.score) {
            (TaskStatus::Queued, Some(score)) => {
                self.queue.enqueue(task_id, score, state.work()).await?;
            }
            _ => self.queue.remove(task_id).await?,
        }
        let account = account_stream(owner);
        let settled = match state.hold_outcome() {
            HoldOutcome::Keep => return Ok((state, moves)),
            HoldOutcome::Release => {
                let release = AccountCommand::ReleaseHold {
                    hold_id: task_id,
                    reason: format!("task {}", state.status.as_str()),
                    at: now,
                };
                self.accounts
                    .execute(&account, release, metadata.clone())
                    .await
                    .map(|handled| moves.hold_released = !handled.new_events.is_empty())
            }
            HoldOutcome::Settle => {
                let settle = AccountCommand::SettleHold {
                    hold_id: task_id,
                    at: now,
                };
                self.accounts
                    .execute(&account, settle, metadata.clone())
                    .await
                    .map(|handled| moves.hold_settled = !handled.new_events.is_empty())
            }
        };
        match settled {
            Ok(()) => Ok((state, moves)),
            // No hold at the account's latest version, and the task was never recorded: the
            // request died before freezing (or freezes late, which the reconciler repairs).
            Err(CommandError::Rejected(AccountError::UnknownHold(_)))
                if state.status == TaskStatus::Abandoned =>
            {
                Ok((state, moves))
            }
            Err(other) => Err(anyhow::Error::new(other).context(format!(
                "settling the hold of task {task_id} ({})",
                state.status.as_str()
            ))),
        }
    }

    /// One step of the intent sweeper: resolve intents older than `intent_resolve_after_ms`
    /// (requests that crashed) and queue again the tasks whose dispatcher lease ran out.
    pub async fn sweep_once(&self) -> anyhow::Result<SweepOutcome> {
        let settings = self.catalog.settings();
        let cutoff = self.clock.now()
            - chrono::Duration::milliseconds(
                i64::try_from(settings.intent_resolve_after_ms).unwrap_or(i64::MAX),
            );
        let rows = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query(
                    // Dispatch intents of tasks in flight stay (their dispatcher ends them); they
                    // are left out here so that many long runs cannot fill every sweep.
                    "SELECT i.intent_id, i.task_id, i.user_id, i.operation_id, i.kind
                       FROM task_intents i
                      WHERE i.created_at <= $1
                        AND NOT (i.kind = 'dispatch' AND EXISTS (
                            SELECT 1 FROM tasks t
                             WHERE t.task_id = i.task_id AND t.status IN ('dispatched', 'running')))
                      ORDER BY i.created_at LIMIT $2",
                    &[&cutoff, &SWEEP_INTENTS_MAX],
                )
                .await
                .context("reading stale intents")?
        };
        let mut outcome = SweepOutcome::default();
        for row in rows {
            let intent_id: Uuid = row.get(0);
            let task_id: TaskId = row.get(1);
            let user_id = UserId::from_uuid(row.get(2));
            let operation: Option<Uuid> = row.get(3);
            let kind: String = row.get(4);
            let state = self
                .reconcile(task_id, user_id, operation, intent_id)
                .await
                .with_context(|| format!("resolving intent {intent_id} of task {task_id}"))?;
            // A dispatch whose task is still in flight belongs to a dispatcher (or the next
            // leader, who adopts it): its hold is settled when the task ends.
            if kind == IntentKind::Dispatch.as_str()
                && matches!(state.status, TaskStatus::Dispatched | TaskStatus::Running)
            {
                continue;
            }
            self.end_intent(intent_id).await?;
            tracing::info!(%task_id, %intent_id, "resolved the intent of a crashed request");
            outcome.intents_resolved += 1;
        }
        for task_id in self.queue.expired_leases(SWEEP_LEASES_MAX).await? {
            let state = self.load(task_id).await?;
            match (state.status, state.score) {
                (TaskStatus::Queued, Some(score)) => {
                    if self.queue.requeue_expired(task_id, score).await? {
                        outcome.leases_requeued += 1;
                    }
                }
                _ => {
                    self.queue.release_lease(task_id).await?;
                    outcome.leases_dropped += 1;
                }
            }
        }
        Ok(outcome)
    }

    /// Run the sweeper forever (one per process; every step is idempotent and fenced, so two
    /// processes sweeping at once do no harm).
    pub async fn run_sweeper(self) {
        let interval = Duration::from_millis(self.catalog.settings().intent_sweep_interval_ms);
        loop {
            if let Err(error) = self.sweep_once().await {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "intent sweep failed");
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// Put every queued task back in the Redis queue at the score its events give it, and take out
    /// what the events say has left. From the `tasks` read model as of its checkpoint, then the
    /// task events after that checkpoint (so nothing the projection has not applied yet is
    /// missed). Entries the events do not know (a submit in flight) are left alone.
    pub async fn rebuild_queue(&self) -> anyhow::Result<RebuildReport> {
        let mut queued: HashMap<TaskId, i64> = HashMap::new();
        let mut works: HashMap<TaskId, (String, u32)> = HashMap::new();
        let mut left: HashSet<TaskId> = HashSet::new();
        let mut after = {
            let mut client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            let transaction = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .context("starting a snapshot")?;
            let checkpoint = transaction
                .query_opt(
                    "SELECT commit_position, prepare_position FROM projection_checkpoints
                      WHERE projection = 'tasks'",
                    &[],
                )
                .await
                .context("reading the tasks checkpoint")?;
            let rows = transaction
                .query(
                    "SELECT task_id, queue_score, spec->>'model', (spec->>'steps')::int FROM tasks
                      WHERE status = 'queued' AND queue_score IS NOT NULL",
                    &[],
                )
                .await
                .context("reading queued tasks")?;
            transaction.commit().await.context("ending the snapshot")?;
            for row in rows {
                queued.insert(row.get(0), row.get(1));
                if let (Some(model), Some(steps)) = (
                    row.get::<_, Option<String>>(2),
                    row.get::<_, Option<i32>>(3),
                ) {
                    works.insert(row.get(0), (model, u32::try_from(steps).unwrap_or(0)));
                }
            }
            match checkpoint {
                Some(row) => crate::platform::projector::position_from_sql(row.get(0), row.get(1))?,
                None => None,
            }
        };
        let filter = EventFilter::StreamPrefixes(vec!["task-".into()]);
        loop {
            let slice = self
                .store
                .read_all(after, REBUILD_PAGE_MAX, &filter)
                .await
                .context("reading task events")?;
            for recorded in &slice.events {
                let Some(task_id) = zhihui_domain::task::task_id_of_stream(&recorded.stream) else {
                    continue;
                };
                let event = TaskEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("decoding event {}", recorded.id))?;
                match event {
                    TaskEvent::Submitted(e) => {
                        works.insert(task_id, (e.spec.model, e.spec.steps));
                    }
                    TaskEvent::Queued(e) => {
                        queued.insert(task_id, e.score);
                        left.remove(&task_id);
                    }
                    TaskEvent::Prioritised(e) => {
                        if let Some(score) = queued.get_mut(&task_id) {
                            *score = e.to_score;
                        }
                    }
                    TaskEvent::Abandoned(_)
                    | TaskEvent::Cancelled(_)
                    | TaskEvent::Dispatched(_)
                    | TaskEvent::Started(_)
                    | TaskEvent::Succeeded(_)
                    | TaskEvent::Failed(_) => {
                        queued.remove(&task_id);
                        left.insert(task_id);
                    }
                    TaskEvent::PrioritisationAbandoned(_)
                    | TaskEvent::CancelRequested(_)
                    | TaskEvent::Adopted(_) => {}
                }
            }
            if slice.scanned_to.is_none() || slice.scanned_to == after || slice.end_of_log {
                break;
            }
            after = slice.scanned_to;
        }
        let mut report = RebuildReport::default();
        let mut in_order: Vec<(TaskId, i64)> = queued.into_iter().collect();
        in_order.sort_by_key(|(task_id, score)| (*score, *task_id));
        for (task_id, score) in &in_order {
            let work = works
                .get(task_id)
                .map(|(model, steps)| (model.as_str(), *steps));
            if self.queue.enqueue(*task_id, *score, work).await?.is_some() {
                report.queued += 1;
            }
        }
        // Entries the events do not queue: out if the events or the read model say they left.
        let unknown: Vec<TaskId> = self
            .queue
            .entries()
            .await?
            .into_iter()
            .map(|(task_id, _)| task_id)
            .filter(|task_id| !in_order.iter().any(|(queued, _)| queued == task_id))
            .collect();
        if !unknown.is_empty() {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            let finished = client
                .query(
                    "SELECT task_id FROM tasks WHERE task_id = ANY($1) AND status <> 'queued'",
                    &[&unknown],
                )
                .await
                .context("reading tasks that left the queue")?;
            left.extend(finished.iter().map(|row| row.get::<_, TaskId>(0)));
        }
        for task_id in unknown {
            if left.contains(&task_id) {
                self.queue.remove(task_id).await?;
                report.removed += 1;
            }
        }
        if let Some((_, highest)) = in_order.iter().max_by_key(|(_, score)| *score) {
            self.queue.ensure_scores_after(*highest).await?;
        }
        Ok(report)
    }
}
