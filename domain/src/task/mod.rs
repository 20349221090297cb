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

/// A prompt as a user typed it: trimmed, not empty unless allowed, within a length, without
/// control characters other than line breaks and tabs. Valid by construction after `parse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PromptText(String);

/// Why a prompt was refused; the message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidPrompt(pub String);

impl PromptText {
    pub fn parse(
        text: &str,
        length_max: usize,
        may_be_empty: bool,
    ) -> Result<PromptText, InvalidPrompt> {
        let text = text.trim();
        if text.is_empty() && !may_be_empty {
            return Err(InvalidPrompt("must not be empty".into()));
        }
        let length = text.chars().count();
        if length > length_max {
            return Err(InvalidPrompt(format!(
                "must be at most {length_max} characters, got {length}"
            )));
        }
        if let Some(bad) = text
            .chars()
            .find(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
        {
            return Err(InvalidPrompt(format!(
                "must not contain the control character U+{:04X}",
                u32::from(bad)
            )));
        }
        Ok(PromptText(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The generation parameters, checked against the catalog by the application before they get
/// here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub model: String,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    /// Classifier-free guidance, a decimal (e.g. `7.5`) so that equality and storage are exact.
    pub cfg: Decimal,
    pub sampler: String,
    pub scheduler: String,
    pub seed: u64,
    pub images: u32,
}

/// An image a task produced, in zhihui's image store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskImage {
    pub image_id: String,
    pub content_type: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSubmitted {
    pub task_id: TaskId,
    pub user_id: UserId,
    pub spec: TaskSpec,
    /// As the user typed them.
    pub prompt: PromptText,
    pub negative_prompt: PromptText,
    /// What the workflow got: translated (when it was not English) with the prefix / suffix.
    pub prompt_used: String,
    pub negative_prompt_used: String,
    pub price: Amount,
    /// The rendered ComfyUI workflow (API format), checked; posted as it is. Kept as its text:
    /// only a dispatcher looks inside it, and every other reader of the event (the projections,
    /// a task's view) would otherwise build its whole graph on each read.
    pub workflow: crate::event::JsonText,
    /// A digest of the request, to tell a retry (same `Idempotency-Key`, same request) from a
    /// reuse of the key for another request.
    pub request_digest: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskQueued {
    /// Queue order: lower is served first.
    pub score: i64,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskPrioritised {
    pub operation_id: OperationId,
    pub fee: Amount,
    pub from_score: i64,
    pub to_score: i64,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrioritisationAbandoned {
    pub operation_id: OperationId,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskAbandoned {
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCancelRequested {
    pub by: UserId,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCancelled {
    /// Who cancelled: a user, or `None` when the dispatcher confirmed a cancel request.
    pub by: Option<UserId>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskDispatched {
    pub backend: String,
    /// Chosen and recorded before the prompt is posted, so a restart can find it on the server.
    pub prompt_id: Uuid,
    /// The dispatcher leader's fencing token: from here on, dispatcher commands with a smaller
    /// token are refused on this task.
    #[serde(default)]
    pub fencing_token: u64,
    pub at: DateTime<Utc>,
}

/// A new dispatcher leader took over a task in flight: commands of earlier leaders (smaller
/// tokens) are refused on it from here on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskAdopted {
    pub fencing_token: u64,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskStarted {
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSucceeded {
    pub images: Vec<TaskImage>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskFailed {
    /// Said to the user as it is.
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskEvent {
    Submitted(Box<TaskSubmitted>),
    Queued(TaskQueued),
    Prioritised(TaskPrioritised),
    PrioritisationAbandoned(PrioritisationAbandoned),
    Abandoned(TaskAbandoned),
    CancelRequested(TaskCancelRequested),
    Cancelled(TaskCancelled),
    Dispatched(TaskDispatched),
    Adopted(TaskAdopted),
    Started(TaskStarted),
    Succeeded(TaskSucceeded),
    Failed(TaskFailed),
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

const TASK_EVENT_TYPES: [&str; 12] = [
    "TaskSubmitted",
    "TaskQueued",
    "TaskPrioritised",
    "PrioritisationAbandoned",
    "TaskAbandoned",
    "TaskCancelRequested",
    "TaskCancelled",
    "TaskDispatched",
    "TaskAdopted",
    "TaskStarted",
    "TaskSucceeded",
    "TaskFailed",
];

impl DomainEvent for TaskEvent {
    fn event_type(&self) -> &'static str {
        match self {
            TaskEvent::Submitted(_) => "TaskSubmitted",
            TaskEvent::Queued(_) => "TaskQueued",
            TaskEvent::Prioritised(_) => "TaskPrioritised",
            TaskEvent::PrioritisationAbandoned(_) => "PrioritisationAbandoned",
            TaskEvent::Abandoned(_) => "TaskAbandoned",
            TaskEvent::CancelRequested(_) => "TaskCancelRequested",
            TaskEvent::Cancelled(_) => "TaskCancelled",
            TaskEvent::Dispatched(_) => "TaskDispatched",
            TaskEvent::Adopted(_) => "TaskAdopted",
            TaskEvent::Started(_) => "TaskStarted",
            TaskEvent::Succeeded(_) => "TaskSucceeded",
            TaskEvent::Failed(_) => "TaskFailed",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            TaskEvent::Submitted(e) => payload_of(e),
            TaskEvent::Queued(e) => payload_of(e),
            TaskEvent::Prioritised(e) => payload_of(e),
            TaskEvent::PrioritisationAbandoned(e) => payload_of(e),
            TaskEvent::Abandoned(e) => payload_of(e),
            TaskEvent::CancelRequested(e) => payload_of(e),
            TaskEvent::Cancelled(e) => payload_of(e),
            TaskEvent::Dispatched(e) => payload_of(e),
            TaskEvent::Adopted(e) => payload_of(e),
            TaskEvent::Started(e) => payload_of(e),
            TaskEvent::Succeeded(e) => payload_of(e),
            TaskEvent::Failed(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<TaskEvent, DecodeError> {
        if !TASK_EVENT_TYPES.contains(&event_type) {
            return Err(DecodeError::UnknownType {
                event_type: event_type.to_owned(),
            });
        }
        expect_version(event_type, schema_version, 1)?;
        let t = event_type;
        Ok(match event_type {
            "TaskSubmitted" => TaskEvent::Submitted(Box::new(parse_payload(t, payload)?)),
            "TaskQueued" => TaskEvent::Queued(parse_payload(t, payload)?),
            "TaskPrioritised" => TaskEvent::Prioritised(parse_payload(t, payload)?),
            "PrioritisationAbandoned" => {
                TaskEvent::PrioritisationAbandoned(parse_payload(t, payload)?)
            }
            "TaskAbandoned" => TaskEvent::Abandoned(parse_payload(t, payload)?),
            "TaskCancelRequested" => TaskEvent::CancelRequested(parse_payload(t, payload)?),
            "TaskCancelled" => TaskEvent::Cancelled(parse_payload(t, payload)?),
            "TaskDispatched" => TaskEvent::Dispatched(parse_payload(t, payload)?),
            "TaskAdopted" => TaskEvent::Adopted(parse_payload(t, payload)?),
            "TaskStarted" => TaskEvent::Started(parse_payload(t, payload)?),
            "TaskSucceeded" => TaskEvent::Succeeded(parse_payload(t, payload)?),
            _ => TaskEvent::Failed(parse_payload(t, payload)?),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::decider::given;

    fn at() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2027-01-15T01:00:00Z")
            .unwrap()
            .into()
    }

    fn alice() -> UserId {
        UserId::from_uuid(Uuid::from_u128(1))
    }

    fn bob() -> UserId {
        UserId::from_uuid(Uuid::from_u128(2))
    }

    /// Alice's task 10 (one image, 1 point), submitted at 01:00; other modules' tests use it.
    pub(crate) fn submitted() -> Box<TaskSubmitted> {
        Box::new(TaskSubmitted {
            task_id: Uuid::from_u128(10),
            user_id: alice(),
            spec: TaskSpec {
                model: "majicmixRealistic_v7.safetensors".into(),
                width: 512,
                height: 512,
                steps: 20,
                cfg: Decimal::new(70, 1),
                sampler: "euler".into(),
                scheduler: "karras".into(),
                seed: 42,
                images: 1,
            },
            prompt: PromptText::parse("a cat", 100, false).unwrap(),
            negative_prompt: PromptText::parse("", 100, true).unwrap(),
            prompt_used: "(8k),a cat".into(),
            negative_prompt_used: ",bad face".into(),
            price: Amount::whole(1),
            workflow: serde_json::json!({}).into(),
            request_digest: "d".into(),
            at: at(),
        })
    }

    fn queued_at(score: i64) -> Vec<TaskEvent> {
        vec![
            TaskEvent::Submitted(submitted()),
            TaskEvent::Queued(TaskQueued { score, at: at() }),
        ]
    }

    fn dispatched() -> Vec<TaskEvent> {
        let mut events = queued_at(100);
        events.push(TaskEvent::Dispatched(TaskDispatched {
            backend: "gpu-1".into(),
            prompt_id: Uuid::from_u128(99),
            fencing_token: 5,
            at: at(),
        }));
        events
    }

    #[test]
    fn a_submission_is_recorded_and_queued_once() {
        given::<Task>(&[])
            .when(TaskCommand::Submit {
                submitted: submitted(),
                score: 100,
            })
            .then(&queued_at(100));
        given::<Task>(&queued_at(100))
            .when(TaskCommand::Submit {
                submitted: submitted(),
                score: 100,
            })
            .then_error(TaskError::AlreadySubmitted);
    }

    #[test]
    fn abandon_fences_only_a_task_that_was_never_recorded() {
        let abandoned = TaskEvent::Abandoned(TaskAbandoned {
            reason: "crashed".into(),
            at: at(),
        });
        given::<Task>(&[])
            .when(TaskCommand::Abandon {
                reason: "crashed".into(),
                at: at(),
            })
            .then(std::slice::from_ref(&abandoned));
        given::<Task>(&queued_at(100))
            .when(TaskCommand::Abandon {
                reason: "crashed".into(),
                at: at(),
            })
            .then(&[]);
        // After the fence the submission can no longer be recorded.
        given::<Task>(&[abandoned])
            .when(TaskCommand::Submit {
                submitted: submitted(),
                score: 100,
            })
            .then_error(TaskError::AlreadySubmitted);
    }

    fn prioritise(by: UserId, operation: u128, to_score: i64) -> TaskCommand {
        TaskCommand::Prioritise {
            by,
            operation_id: Uuid::from_u128(operation),
            fee: Amount::whole(5),
            to_score,
            at: at(),
        }
    }

    #[test]
    fn prioritise_moves_a_queued_task_ahead_once_per_operation() {
        let moved = TaskEvent::Prioritised(TaskPrioritised {
            operation_id: Uuid::from_u128(7),
            fee: Amount::whole(5),
            from_score: 100,
            to_score: 50,
            at: at(),
        });
        given::<Task>(&queued_at(100))
            .when(prioritise(alice(), 7, 50))
            .then(std::slice::from_ref(&moved));
        let mut past = queued_at(100);
        past.push(moved);
        // A retry of the same operation changes nothing (and is not charged again).
        given::<Task>(&past)
            .when(prioritise(alice(), 7, 20))
            .then(&[]);
        let state = Task::fold(&past);
        assert_eq!(state.score, Some(50));
    }

    #[test]
    fn prioritise_is_refused_for_others_not_queued_or_not_ahead() {
        given::<Task>(&queued_at(100))
            .when(prioritise(bob(), 7, 50))
            .then_error(TaskError::NotOwner);
        given::<Task>(&[])
            .when(prioritise(alice(), 7, 50))
            .then_error(TaskError::NotFound);
        given::<Task>(&queued_at(100))
            .when(prioritise(alice(), 7, 100))
            .then_error(TaskError::NotAhead {
                current: 100,
                requested: 100,
            });
        given::<Task>(&dispatched())
            .when(prioritise(alice(), 7, 50))
            .then_error(TaskError::NotQueued {
                status: TaskStatus::Dispatched,
            });
    }

    #[test]
    fn an_abandoned_prioritisation_can_never_be_recorded() {
        let mut past = queued_at(100);
        past.push(TaskEvent::PrioritisationAbandoned(
            PrioritisationAbandoned {
                operation_id: Uuid::from_u128(7),
                at: at(),
            },
        ));
        given::<Task>(&past)
            .when(prioritise(alice(), 7, 50))
            .then_error(TaskError::PrioritisationAbandoned(Uuid::from_u128(7)));
        // Abandoning a prioritisation that moved the task changes nothing: it was paid for.
        let mut moved = queued_at(100);
        moved.push(TaskEvent::Prioritised(TaskPrioritised {
            operation_id: Uuid::from_u128(8),
            fee: Amount::whole(5),
            from_score: 100,
            to_score: 50,
            at: at(),
        }));
        given::<Task>(&moved)
            .when(TaskCommand::AbandonPrioritisation {
                operation_id: Uuid::from_u128(8),
                at: at(),
            })
            .then(&[]);
    }

    #[test]
    fn cancel_of_a_queued_task_cancels_it_and_a_running_one_asks_the_dispatcher() {
        let by_alice = TaskCommand::Cancel {
            by: Canceller::User(alice()),
            at: at(),
        };
        let cancelled = TaskEvent::Cancelled(TaskCancelled {
            by: Some(alice()),
            at: at(),
        });
        given::<Task>(&queued_at(100))
            .when(by_alice.clone())
            .then(std::slice::from_ref(&cancelled));
        let mut past = queued_at(100);
        past.push(cancelled);
        given::<Task>(&past).when(by_alice.clone()).then(&[]);
        let state = Task::fold(&past);
        assert_eq!(state.hold_outcome(), HoldOutcome::Release);

        let request = TaskEvent::CancelRequested(TaskCancelRequested {
            by: alice(),
            at: at(),
        });
        given::<Task>(&dispatched())
            .when(by_alice.clone())
            .then(std::slice::from_ref(&request));
        let mut running = dispatched();
        running.push(request);
        given::<Task>(&running).when(by_alice).then(&[]);
        given::<Task>(&running)
            .when(TaskCommand::Cancel {
                by: Canceller::Dispatcher { fencing_token: 5 },
                at: at(),
            })
            .then(&[TaskEvent::Cancelled(TaskCancelled { by: None, at: at() })]);
    }

    #[test]
    fn cancel_is_refused_for_others_and_for_finished_tasks() {
        given::<Task>(&queued_at(100))
            .when(TaskCommand::Cancel {
                by: Canceller::User(bob()),
                at: at(),
            })
            .then_error(TaskError::NotOwner);
        let mut succeeded = dispatched();
        succeeded.push(TaskEvent::Succeeded(TaskSucceeded {
            images: vec![],
            at: at(),
        }));
        given::<Task>(&succeeded)
            .when(TaskCommand::Cancel {
                by: Canceller::User(alice()),
                at: at(),
            })
            .then_error(TaskError::Finished {
                status: TaskStatus::Succeeded,
            });
        assert_eq!(Task::fold(&succeeded).hold_outcome(), HoldOutcome::Settle);
    }

    #[test]
    fn the_dispatcher_moves_a_task_to_exactly_one_end() {
        let cancelled = {
            let mut past = queued_at(100);
            past.push(TaskEvent::Cancelled(TaskCancelled {
                by: Some(alice()),
                at: at(),
            }));
            past
        };
        let dispatch = TaskCommand::Dispatch {
            backend: "gpu-1".into(),
            prompt_id: Uuid::from_u128(99),
            fencing_token: 5,
            at: at(),
        };
        given::<Task>(&cancelled)
            .when(dispatch.clone())
            .then_error(TaskError::NotQueued {
                status: TaskStatus::Cancelled,
            });
        // The same dispatch again (a retried append) is a repeat.
        given::<Task>(&dispatched()).when(dispatch).then(&[]);
        let mut failed = dispatched();
        failed.push(TaskEvent::Failed(TaskFailed {
            reason: "out of memory".into(),
            at: at(),
        }));
        given::<Task>(&failed)
            .when(TaskCommand::Succeed {
                images: vec![],
                fencing_token: 5,
                at: at(),
            })
            .then_error(TaskError::InvalidTransition {
                status: TaskStatus::Failed,
                action: "succeed",
            });
        given::<Task>(&dispatched())
            .when(TaskCommand::Start {
                fencing_token: 5,
                at: at(),
            })
            .then(&[TaskEvent::Started(TaskStarted { at: at() })]);
    }

    #[test]
    fn a_new_leader_adopts_a_task_and_the_old_one_is_refused() {
        let adopt = |fencing_token| TaskCommand::Adopt {
            fencing_token,
            at: at(),
        };
        let adopted = TaskEvent::Adopted(TaskAdopted {
            fencing_token: 6,
            at: at(),
        });
        given::<Task>(&dispatched())
            .when(adopt(6))
            .then(std::slice::from_ref(&adopted));
        let mut past = dispatched();
        past.push(adopted);
        // Adopting again with the same token is a repeat; an older leader cannot adopt back.
        given::<Task>(&past).when(adopt(6)).then(&[]);
        given::<Task>(&past)
            .when(adopt(5))
            .then_error(TaskError::StaleDispatcher { token: 5, fence: 6 });
        // Every dispatcher command of the old leader is refused; the new leader's are not.
        for stale in [
            TaskCommand::Start {
                fencing_token: 5,
                at: at(),
            },
            TaskCommand::Succeed {
                images: vec![],
                fencing_token: 5,
                at: at(),
            },
            TaskCommand::Fail {
                reason: "lost".into(),
                fencing_token: 5,
                at: at(),
            },
            TaskCommand::Cancel {
                by: Canceller::Dispatcher { fencing_token: 5 },
                at: at(),
            },
        ] {
            given::<Task>(&past)
                .when(stale)
                .then_error(TaskError::StaleDispatcher { token: 5, fence: 6 });
        }
        given::<Task>(&past)
            .when(TaskCommand::Fail {
                reason: "lost".into(),
                fencing_token: 6,
                at: at(),
            })
            .then(&[TaskEvent::Failed(TaskFailed {
                reason: "lost".into(),
                at: at(),
            })]);
        // A user's cancel carries no token: it is a request, carried out by the leader.
        given::<Task>(&past)
            .when(TaskCommand::Cancel {
                by: Canceller::User(alice()),
                at: at(),
            })
            .then(&[TaskEvent::CancelRequested(TaskCancelRequested {
                by: alice(),
                at: at(),
            })]);
        // A queued task cannot be adopted, and a dispatch with an older token than recorded
        // elsewhere on the task is refused.
        given::<Task>(&queued_at(100))
            .when(adopt(6))
            .then_error(TaskError::InvalidTransition {
                status: TaskStatus::Queued,
                action: "be adopted",
            });
    }

    #[test]
    fn prompts_are_trimmed_bounded_and_free_of_control_characters() {
        assert_eq!(
            PromptText::parse("  a cat \n", 10, false).unwrap().as_str(),
            "a cat"
        );
        assert!(PromptText::parse("   ", 10, false).is_err());
        assert!(PromptText::parse("", 10, true).is_ok());
        assert!(PromptText::parse("abcdefghijk", 10, false).is_err());
        assert!(PromptText::parse("a\u{0}b", 10, false).is_err());
        assert!(PromptText::parse("line\nbreak\t\"quote\"", 30, false).is_ok());
    }

    #[test]
    fn every_event_survives_storage() {
        let mut events = dispatched();
        events.extend([
            TaskEvent::Prioritised(TaskPrioritised {
                operation_id: Uuid::from_u128(7),
                fee: Amount::whole(5),
                from_score: 100,
                to_score: 50,
                at: at(),
            }),
            TaskEvent::PrioritisationAbandoned(PrioritisationAbandoned {
                operation_id: Uuid::from_u128(8),
                at: at(),
            }),
            TaskEvent::Abandoned(TaskAbandoned {
                reason: "r".into(),
                at: at(),
            }),
            TaskEvent::CancelRequested(TaskCancelRequested {
                by: alice(),
                at: at(),
            }),
            TaskEvent::Cancelled(TaskCancelled { by: None, at: at() }),
            TaskEvent::Adopted(TaskAdopted {
                fencing_token: 6,
                at: at(),
            }),
            TaskEvent::Started(TaskStarted { at: at() }),
            TaskEvent::Succeeded(TaskSucceeded {
                images: vec![TaskImage {
                    image_id: "abc".into(),
                    content_type: "image/png".into(),
                }],
                at: at(),
            }),
            TaskEvent::Failed(TaskFailed {
                reason: "r".into(),
                at: at(),
            }),
        ]);
        for event in events {
            let stored = TaskEvent::from_stored(
                event.event_type(),
                event.schema_version(),
                &event.to_payload(),
            )
            .unwrap();
            assert_eq!(stored, event);
        }
    }
}
