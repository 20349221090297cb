//! Every event of a task's stream as it is stored: the payloads, their type names and schema
//! versions, and the decoding of old versions (`DomainEvent for TaskEvent`).

use super::*;

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
