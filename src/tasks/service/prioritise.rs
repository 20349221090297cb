//! Prioritise: charge the fee once per operation, then record the move and reorder the queue;
//! refused, with nothing charged, when the task is not queued, first already, or another's.

use super::*;

impl TaskService {
    /// Move a queued task ahead of up to `prioritise_jump_max` others for the prioritise fee.
    pub async fn prioritise(
        &self,
        user_id: UserId,
        task_id: TaskId,
        idempotency_key: Option<&str>,
        metadata: &EventMetadata,
    ) -> Result<PrioritiseOutcome, TaskServiceError> {
        let settings = self.catalog.settings();
        let fee = Amount::parse(settings.prioritise_fee).context("tasks.prioritise_fee")?;
        let operation_id = match idempotency_key {
            Some(key) => Uuid::new_v5(
                &PRIORITISE_NAMESPACE,
                format!("{user_id}:{task_id}:{key}").as_bytes(),
            ),
            None => Uuid::now_v7(),
        };
        let state = self.load(task_id).await?;
        if state.owner != Some(user_id) {
            return Err(TaskServiceError::NotFound);
        }
        if let Some(answer) = self.recorded(&state, task_id, operation_id, fee).await? {
            return answer;
        }
        if state.status != TaskStatus::Queued {
            return Err(TaskServiceError::NotQueued {
                status: state.status.as_str(),
            });
        }
        // Claimed before the queue is read: a prioritise that ends meanwhile has moved the task
        // already, so the place read here is the one this request pays to leave. Another
        // request holding the claim, of whatever operation (its key sent again while it is under
        // way), is told so: only the holder's intent covers what it pays.
        let intent = self
            .claim_prioritise(task_id, user_id, operation_id)
            .await?;
        let target = match self
            .queue
            .prioritise_target(task_id, state.score, settings.prioritise_jump_max)
            .await
        {
            Ok(target) => target,
            Err(error) => {
                // Nothing was paid: the task is free for the next request at once.
                self.end_intent(intent).await?;
                return Err(error.into());
            }
        };
        let to_score = match target {
            PrioritiseTarget::Ahead { to_score, .. } => to_score,
            refused => {
                self.end_intent(intent).await?;
                return Err(match refused {
                    PrioritiseTarget::AlreadyFirst => TaskServiceError::AlreadyFirst,
                    // Queued by its events but not in the queue: a dispatcher holds it now.
                    PrioritiseTarget::NotQueued => TaskServiceError::NotQueued {
                        status: TaskStatus::Dispatched.as_str(),
                    },
                    PrioritiseTarget::NoRoom | PrioritiseTarget::Ahead { .. } => {
                        TaskServiceError::NoRoom
                    }
                });
            }
        };
        let charge = AccountCommand::Charge {
            operation_id,
            amount: fee,
            reason: format!("prioritise task {task_id}"),
            at: self.clock.now(),
        };
        let handled = self.pay(intent, user_id, charge, metadata).await?;
        if let Some(Operation::Charge { refunded: true, .. }) =
            handled.state_after.operations.get(&operation_id)
        {
            // A retry of a prioritise that was refused and refunded.
            self.end_intent(intent).await?;
            return Err(TaskServiceError::RolledBack);
        }
        self.crash_if(CrashPoint::AfterCharge)?;
        let command = TaskCommand::Prioritise {
            by: user_id,
            operation_id,
            fee,
            to_score,
            at: self.clock.now(),
        };
        match self.execute_task(task_id, &command, metadata).await {
            Ok(executed) => {
                if executed.state.status == TaskStatus::Queued
                    && let Some(score) = executed.state.score
                {
                    self.queue.move_to(task_id, score).await?;
                }
                self.end_intent(intent).await?;
                Ok(PrioritiseOutcome {
                    operation_id,
                    position: self.queue.rank(task_id).await?.map(|rank| rank + 1),
                    fee,
                    charged_now: !executed.new_events.is_empty(),
                })
            }
            Err(CommandError::Rejected(error)) => {
                // Lost a race (claimed, cancelled or moved meanwhile): refund the fee.
                self.reconcile(
                    task_id,
                    user_id,
                    Some(operation_id),
                    metadata.correlation_id,
                )
                .await?;
                self.end_intent(intent).await?;
                Err(task_error(error))
            }
            Err(other) => Err(other.into()),
        }
    }

    /// The answer of an operation the task has recorded already (moved, or abandoned after its
    /// request failed); `None` while it has not.
    async fn recorded(
        &self,
        state: &TaskState,
        task_id: TaskId,
        operation_id: OperationId,
        fee: Amount,
    ) -> anyhow::Result<Option<Result<PrioritiseOutcome, TaskServiceError>>> {
        Ok(match state.prioritisations.get(&operation_id) {
            Some(PrioritisationOutcome::Moved) => Some(Ok(PrioritiseOutcome {
                operation_id,
                position: self.queue.rank(task_id).await?.map(|rank| rank + 1),
                fee,
                charged_now: false,
            })),
            Some(PrioritisationOutcome::Abandoned) => Some(Err(TaskServiceError::RolledBack)),
            None => None,
        })
    }
}
