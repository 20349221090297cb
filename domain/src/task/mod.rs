//! A text-to-image task: one stream per task (`task-<task id>`).
//!
//! Lifecycle: `Submitted -> Queued -> Dispatched -> Running -> Succeeded | Failed | Cancelled`.
//! A submission is recorded as `TaskSubmitted` and `TaskQueued` in one append, after its points
//! were frozen under a hold whose id is the task id. A crash between the freeze and that append
//! leaves a hold without a task: the application's intent sweeper then records `TaskAbandoned` on
//! the still empty stream (the fence: exactly one of "the task is recorded" and "the task is
//! abandoned" can happen, since both need the stream not to exist) and releases the hold.
//!
//! Rules:
//! - only the owner prioritises or cancels (anyone else is told the task does not exist);
//! - prioritise needs a queued task and a score ahead of its current one; each prioritise is an
//!   operation id, recorded once; a prioritise the sweeper abandoned (its request crashed after
//!   charging) can never be recorded afterwards, so the fee is refunded exactly when no move
//!   happened;
//! - cancel: a submitted or queued task is cancelled at once; a dispatched or running one gets a
//!   cancel request the dispatcher acts on (it confirms with a system cancel); a finished task
//!   cannot be cancelled (cancelling a cancelled task again changes nothing);
//! - the dispatcher moves a queued task to dispatched, then running, then to exactly one end.
//!
//! The queue's order lives in the events (`score` in `TaskQueued` and `TaskPrioritised`), so the
//! Redis queue can be rebuilt from them in the same order.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::points::Amount;
use crate::user::UserId;

mod events;
mod spec;
pub use events::*;
pub use spec::*;

/// Task ids are also the ids of their holds on the owner's account.
pub type TaskId = Uuid;
/// Idempotency handle of a prioritise.
pub type OperationId = Uuid;

/// The stream of a task.
pub fn task_stream(task_id: TaskId) -> String {
    format!("task-{task_id}")
}

/// The task id of a task stream name.
pub fn task_id_of_stream(stream: &str) -> Option<TaskId> {
    stream
        .strip_prefix("task-")
        .and_then(|id| Uuid::parse_str(id).ok())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    /// No event yet.
    Unknown,
    Submitted,
    Queued,
    Dispatched,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    /// Its request crashed before the task was recorded; the hold was released.
    Abandoned,
}

impl TaskStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            TaskStatus::Unknown => "unknown",
            TaskStatus::Submitted => "submitted",
            TaskStatus::Queued => "queued",
            TaskStatus::Dispatched => "dispatched",
            TaskStatus::Running => "running",
            TaskStatus::Succeeded => "succeeded",
            TaskStatus::Failed => "failed",
            TaskStatus::Cancelled => "cancelled",
            TaskStatus::Abandoned => "abandoned",
        }
    }

    /// Every status a recorded task can have (the read model's values).
    pub const RECORDED: [TaskStatus; 7] = [
        TaskStatus::Submitted,
        TaskStatus::Queued,
        TaskStatus::Dispatched,
        TaskStatus::Running,
        TaskStatus::Succeeded,
        TaskStatus::Failed,
        TaskStatus::Cancelled,
    ];

    /// The status named by [`TaskStatus::as_str`] (as the read model stores it).
    pub fn parse(name: &str) -> Option<TaskStatus> {
        [TaskStatus::Unknown, TaskStatus::Abandoned]
            .into_iter()
            .chain(TaskStatus::RECORDED)
            .find(|status| status.as_str() == name)
    }

    /// No event can change it any more.
    pub fn is_finished(&self) -> bool {
        matches!(
            self,
            TaskStatus::Succeeded
                | TaskStatus::Failed
                | TaskStatus::Cancelled
                | TaskStatus::Abandoned
        )
    }
}

/// What became of a prioritise operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrioritisationOutcome {
    Moved,
    Abandoned,
}

/// What the hold of a task should become, from the task's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldOutcome {
    /// The task may still run: keep the hold.
    Keep,
    /// Succeeded: deduct it.
    Settle,
    /// Failed, cancelled or abandoned: return it.
    Release,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskState {
    pub status: TaskStatus,
    pub owner: Option<UserId>,
    pub price: Option<Amount>,
    pub score: Option<i64>,
    pub cancel_requested: bool,
    pub request_digest: Option<String>,
    pub prioritisations: HashMap<OperationId, PrioritisationOutcome>,
    pub backend: Option<String>,
    pub prompt_id: Option<Uuid>,
    /// The checkpoint it runs on (the queue routes by it).
    pub model: Option<String>,
    /// Its sampler steps (one pass for the whole batch): its work, for wait estimates.
    pub steps: Option<u32>,
    /// The highest dispatcher fencing token recorded on this task (0: none yet).
    pub fencing_token: u64,
    /// When it was dispatched (a prompt posted into a busy server's queue waits from here).
    pub dispatched_at: Option<DateTime<Utc>>,
    /// When it started running on its server (its time limit counts from here).
    pub started_at: Option<DateTime<Utc>>,
}

impl Default for TaskState {
    fn default() -> TaskState {
        TaskState {
            status: TaskStatus::Unknown,
            owner: None,
            price: None,
            score: None,
            cancel_requested: false,
            request_digest: None,
            prioritisations: HashMap::new(),
            backend: None,
            prompt_id: None,
            model: None,
            steps: None,
            fencing_token: 0,
            dispatched_at: None,
            started_at: None,
        }
    }
}

impl TaskState {
    /// Its model and steps, once submitted: what the queue routes and estimates by.
    pub fn work(&self) -> Option<(&str, u32)> {
        Some((self.model.as_deref()?, self.steps?))
    }

    pub fn hold_outcome(&self) -> HoldOutcome {
        match self.status {
            TaskStatus::Succeeded => HoldOutcome::Settle,
            TaskStatus::Failed | TaskStatus::Cancelled | TaskStatus::Abandoned => {
                HoldOutcome::Release
            }
            TaskStatus::Unknown
            | TaskStatus::Submitted
            | TaskStatus::Queued
            | TaskStatus::Dispatched
            | TaskStatus::Running => HoldOutcome::Keep,
        }
    }
}

/// Who asks for a cancel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Canceller {
    User(UserId),
    /// The dispatcher (leader with this fencing token), confirming a cancel it carried out on
    /// the server.
    Dispatcher {
        fencing_token: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskCommand {
    /// Record a paid-for submission and queue it.
    Submit {
        submitted: Box<TaskSubmitted>,
        score: i64,
    },
    /// The request that would have recorded this task is gone (the sweeper's fence).
    Abandon {
        reason: String,
        at: DateTime<Utc>,
    },
    Prioritise {
        by: UserId,
        operation_id: OperationId,
        fee: Amount,
        to_score: i64,
        at: DateTime<Utc>,
    },
    /// The request of this prioritise is gone: it can never be recorded now.
    AbandonPrioritisation {
        operation_id: OperationId,
        at: DateTime<Utc>,
    },
    Cancel {
        by: Canceller,
        at: DateTime<Utc>,
    },
    Dispatch {
        backend: String,
        prompt_id: Uuid,
        fencing_token: u64,
        at: DateTime<Utc>,
    },
    /// A new dispatcher leader takes over a task in flight.
    Adopt {
        fencing_token: u64,
        at: DateTime<Utc>,
    },
    /// The server accepted the prompt.
    Start {
        fencing_token: u64,
        at: DateTime<Utc>,
    },
    Succeed {
        images: Vec<TaskImage>,
        fencing_token: u64,
        at: DateTime<Utc>,
    },
    Fail {
        reason: String,
        fencing_token: u64,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    #[error("no such task")]
    NotFound,
    /// Told to users as "no such task": another user's task does not exist for them.
    #[error("no such task")]
    NotOwner,
    #[error("the task was already submitted")]
    AlreadySubmitted,
    #[error("the task is {}, not queued", .status.as_str())]
    NotQueued { status: TaskStatus },
    #[error("the task is already at score {current}; {requested} is not ahead of it")]
    NotAhead { current: i64, requested: i64 },
    #[error("prioritise {0} was abandoned after its request failed; send a new request")]
    PrioritisationAbandoned(OperationId),
    #[error("the task is {}: it cannot be cancelled", .status.as_str())]
    Finished { status: TaskStatus },
    #[error("the task is {}: it cannot {action}", .status.as_str())]
    InvalidTransition {
        status: TaskStatus,
        action: &'static str,
    },
    /// A dispatcher that lost its leadership: a later leader (higher token) owns this task.
    #[error("dispatcher token {token} is stale: the task belongs to token {fence}")]
    StaleDispatcher { token: u64, fence: u64 },
}

#[derive(Debug)]
pub struct Task;

impl Task {
    /// Refuse a dispatcher command from a leader older than the one the task last saw.
    fn fenced(state: &TaskState, token: u64) -> Result<(), TaskError> {
        if token < state.fencing_token {
            return Err(TaskError::StaleDispatcher {
                token,
                fence: state.fencing_token,
            });
        }
        Ok(())
    }

    fn owned_by(state: &TaskState, user: UserId) -> Result<(), TaskError> {
        match state.owner {
            None => Err(TaskError::NotFound),
            Some(owner) if owner == user => Ok(()),
            Some(_) => Err(TaskError::NotOwner),
        }
    }

    fn transition(
        state: &TaskState,
        allowed: &[TaskStatus],
        done: TaskStatus,
        action: &'static str,
    ) -> Result<bool, TaskError> {
        if state.status == TaskStatus::Unknown {
            return Err(TaskError::NotFound);
        }
        if state.status == done {
            return Ok(false);
        }
        if allowed.contains(&state.status) {
            Ok(true)
        } else {
            Err(TaskError::InvalidTransition {
                status: state.status,
                action,
            })
        }
    }
}

impl Decider for Task {
    type State = TaskState;
    type Command = TaskCommand;
    type Event = TaskEvent;
    type Error = TaskError;

    fn initial_state() -> TaskState {
        TaskState::default()
    }

    fn decide(state: &TaskState, command: &TaskCommand) -> Result<Vec<TaskEvent>, TaskError> {
        use TaskStatus as S;
        match command {
            TaskCommand::Submit { submitted, score } => {
                if state.status != S::Unknown {
                    return Err(TaskError::AlreadySubmitted);
                }
                Ok(vec![
                    TaskEvent::Submitted(submitted.clone()),
                    TaskEvent::Queued(TaskQueued {
                        score: *score,
                        at: submitted.at,
                    }),
                ])
            }
            TaskCommand::Abandon { reason, at } => {
                if state.status != S::Unknown {
                    // The task was recorded (or already abandoned): nothing to abandon.
                    return Ok(vec![]);
                }
                Ok(vec![TaskEvent::Abandoned(TaskAbandoned {
                    reason: reason.clone(),
                    at: *at,
                })])
            }
            TaskCommand::Prioritise {
                by,
                operation_id,
                fee,
                to_score,
                at,
            } => {
                Task::owned_by(state, *by)?;
                match state.prioritisations.get(operation_id) {
                    Some(PrioritisationOutcome::Moved) => return Ok(vec![]),
                    Some(PrioritisationOutcome::Abandoned) => {
                        return Err(TaskError::PrioritisationAbandoned(*operation_id));
                    }
                    None => {}
                }
                if state.status != S::Queued {
                    return Err(TaskError::NotQueued {
                        status: state.status,
                    });
                }
                let current = state
                    .score
                    .unwrap_or_else(|| unreachable!("a queued task has a score"));
                if *to_score >= current {
                    return Err(TaskError::NotAhead {
                        current,
                        requested: *to_score,
                    });
                }
                Ok(vec![TaskEvent::Prioritised(TaskPrioritised {
                    operation_id: *operation_id,
                    fee: *fee,
                    from_score: current,
                    to_score: *to_score,
                    at: *at,
                })])
            }
            TaskCommand::AbandonPrioritisation { operation_id, at } => {
                if state.prioritisations.contains_key(operation_id) {
                    return Ok(vec![]);
                }
                Ok(vec![TaskEvent::PrioritisationAbandoned(
                    PrioritisationAbandoned {
                        operation_id: *operation_id,
                        at: *at,
                    },
                )])
            }
            TaskCommand::Cancel { by, at } => {
                if let Canceller::User(user) = by {
                    Task::owned_by(state, *user)?;
                }
                match (state.status, by) {
                    (S::Unknown, _) => Err(TaskError::NotFound),
                    (S::Cancelled, _) => Ok(vec![]),
                    (S::Succeeded | S::Failed | S::Abandoned, _) => Err(TaskError::Finished {
                        status: state.status,
                    }),
                    (S::Submitted | S::Queued, Canceller::User(user)) => {
                        Ok(vec![TaskEvent::Cancelled(TaskCancelled {
                            by: Some(*user),
                            at: *at,
                        })])
                    }
                    (S::Dispatched | S::Running, Canceller::User(user)) => {
                        if state.cancel_requested {
                            Ok(vec![])
                        } else {
                            Ok(vec![TaskEvent::CancelRequested(TaskCancelRequested {
                                by: *user,
                                at: *at,
                            })])
                        }
                    }
                    (
                        S::Submitted | S::Queued | S::Dispatched | S::Running,
                        Canceller::Dispatcher { fencing_token },
                    ) => {
                        Task::fenced(state, *fencing_token)?;
                        Ok(vec![TaskEvent::Cancelled(TaskCancelled {
                            by: None,
                            at: *at,
                        })])
                    }
                }
            }
            TaskCommand::Dispatch {
                backend,
                prompt_id,
                fencing_token,
                at,
            } => {
                if state.status == S::Unknown {
                    return Err(TaskError::NotFound);
                }
                Task::fenced(state, *fencing_token)?;
                if state.status == S::Dispatched && state.prompt_id == Some(*prompt_id) {
                    return Ok(vec![]);
                }
                if state.status != S::Queued {
                    return Err(TaskError::NotQueued {
                        status: state.status,
                    });
                }
                Ok(vec![TaskEvent::Dispatched(TaskDispatched {
                    backend: backend.clone(),
                    prompt_id: *prompt_id,
                    fencing_token: *fencing_token,
                    at: *at,
                })])
            }
            TaskCommand::Adopt { fencing_token, at } => {
                if state.status == S::Unknown {
                    return Err(TaskError::NotFound);
                }
                Task::fenced(state, *fencing_token)?;
                if !matches!(state.status, S::Dispatched | S::Running) {
                    return Err(TaskError::InvalidTransition {
                        status: state.status,
                        action: "be adopted",
                    });
                }
                if *fencing_token == state.fencing_token {
                    return Ok(vec![]);
                }
                Ok(vec![TaskEvent::Adopted(TaskAdopted {
                    fencing_token: *fencing_token,
                    at: *at,
                })])
            }
            TaskCommand::Start { fencing_token, at } => {
                Task::fenced(state, *fencing_token)?;
                Ok(
                    Task::transition(state, &[S::Dispatched], S::Running, "start")?
                        .then_some(TaskEvent::Started(TaskStarted { at: *at }))
                        .into_iter()
                        .collect(),
                )
            }
            TaskCommand::Succeed {
                images,
                fencing_token,
                at,
            } => {
                Task::fenced(state, *fencing_token)?;
                Ok(
                    Task::transition(state, &[S::Dispatched, S::Running], S::Succeeded, "succeed")?
                        .then(|| {
                            TaskEvent::Succeeded(TaskSucceeded {
                                images: images.clone(),
                                at: *at,
                            })
                        })
                        .into_iter()
                        .collect(),
                )
            }
            TaskCommand::Fail {
                reason,
                fencing_token,
                at,
            } => {
                Task::fenced(state, *fencing_token)?;
                Ok(
                    Task::transition(state, &[S::Dispatched, S::Running], S::Failed, "fail")?
                        .then(|| {
                            TaskEvent::Failed(TaskFailed {
                                reason: reason.clone(),
                                at: *at,
                            })
                        })
                        .into_iter()
                        .collect(),
                )
            }
        }
    }

    fn evolve(mut state: TaskState, event: &TaskEvent) -> TaskState {
        match event {
            TaskEvent::Submitted(e) => {
                state.status = TaskStatus::Submitted;
                state.owner = Some(e.user_id);
                state.price = Some(e.price);
                state.request_digest = Some(e.request_digest.clone());
                state.model = Some(e.spec.model.clone());
                state.steps = Some(e.spec.steps);
            }
            TaskEvent::Queued(e) => {
                state.status = TaskStatus::Queued;
                state.score = Some(e.score);
            }
            TaskEvent::Prioritised(e) => {
                state.score = Some(e.to_score);
                state
                    .prioritisations
                    .insert(e.operation_id, PrioritisationOutcome::Moved);
            }
            TaskEvent::PrioritisationAbandoned(e) => {
                state
                    .prioritisations
                    .insert(e.operation_id, PrioritisationOutcome::Abandoned);
            }
            TaskEvent::Abandoned(_) => state.status = TaskStatus::Abandoned,
            TaskEvent::CancelRequested(_) => state.cancel_requested = true,
            TaskEvent::Cancelled(_) => state.status = TaskStatus::Cancelled,
            TaskEvent::Dispatched(e) => {
                state.status = TaskStatus::Dispatched;
                state.backend = Some(e.backend.clone());
                state.prompt_id = Some(e.prompt_id);
                state.fencing_token = state.fencing_token.max(e.fencing_token);
                state.dispatched_at = Some(e.at);
            }
            TaskEvent::Adopted(e) => {
                state.fencing_token = state.fencing_token.max(e.fencing_token);
            }
            TaskEvent::Started(e) => {
                state.status = TaskStatus::Running;
                state.started_at = Some(e.at);
            }
            TaskEvent::Succeeded(_) => state.status = TaskStatus::Succeeded,
            TaskEvent::Failed(_) => state.status = TaskStatus::Failed,
        }
        state
    }
}

#[cfg(test)]
pub(crate) mod tests;
