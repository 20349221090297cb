//! Cancel: record the cancel on the task's stream, then return its hold and take it off the
//! queue; a running task's server is asked to interrupt it by the dispatcher.

use super::*;

impl TaskService {
    /// Cancel a task: a queued one at once (its hold returns), a running one by request.
    pub async fn cancel(
        &self,
        user_id: UserId,
        task_id: TaskId,
        metadata: &EventMetadata,
    ) -> Result<CancelOutcome, TaskServiceError> {
        let state = self.load(task_id).await?;
        if state.owner != Some(user_id) {
            return Err(TaskServiceError::NotFound);
        }
        let intent = self
            .begin_intent(IntentKind::Cancel, task_id, user_id, None)
            .await?;
        let command = TaskCommand::Cancel {
            by: Canceller::User(user_id),
            at: self.clock.now(),
        };
        match self.execute_task(task_id, &command, metadata).await {
            Ok(executed) => {
                self.crash_if(CrashPoint::AfterCancelRecorded)?;
                let recorded = CancelOutcome {
                    status: executed.state.status,
                    cancel_requested: executed.state.cancel_requested,
                };
                // The cancel is recorded: it happened, whatever fails after this. Its follow-up
                // (the queue entry, the hold's release) is finished here, or, if a store is away
                // now, by the intent sweeper, which completes a recorded cancel as after a crash;
                // the answer says what happened, never an error for a done cancel.
                let followed_up = async {
                    let state = if executed.state.status == TaskStatus::Cancelled {
                        self.reconcile(task_id, user_id, None, metadata.correlation_id)
                            .await?
                    } else {
                        executed.state
                    };
                    self.end_intent(intent).await?;
                    anyhow::Ok(state)
                };
                match followed_up.await {
                    Ok(state) => Ok(CancelOutcome {
                        status: state.status,
                        cancel_requested: state.cancel_requested,
                    }),
                    Err(error) => {
                        tracing::warn!(
                            %task_id,
                            error = %crate::platform::telemetry::error_chain(&error),
                            "a cancel was recorded; the intent sweeper finishes what followed it"
                        );
                        Ok(recorded)
                    }
                }
            }
            Err(CommandError::Rejected(error)) => {
                self.end_intent(intent).await?;
                Err(task_error(error))
            }
            Err(other) => Err(other.into()),
        }
    }
}
