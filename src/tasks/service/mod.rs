//! The task service: submit, prioritise, cancel, claim, and the process manager that keeps the
//! account, the task and the Redis queue in agreement when a request dies half way.
//!
//! Each request that writes to two streams (the account and the task) writes an intent row
//! (`task_intents`) first and deletes it when done. Every cross-stream step is idempotent (hold id
//! = task id, charge id = prioritise operation id, refund id derived from it), and
//! [`TaskService::reconcile`] brings everything in line with the task stream: it fences a task
//! that was never recorded (`TaskAbandoned` on the empty stream) and a prioritise that was never
//! recorded (`PrioritisationAbandoned`), then releases or settles the hold, refunds an abandoned
//! prioritise's fee, and puts the queue index right. Requests call it themselves when refused; the
//! intent sweeper ([`TaskService::sweep_once`]) calls it for intents older than
//! `tasks.intent_resolve_after_ms`, i.e. for requests that crashed. An orphan hold is therefore
//! released within `intent_resolve_after_ms + intent_sweep_interval_ms`.
//!
//! Races are settled by the task stream's expected version: cancel, prioritise and dispatch each
//! append to it, and the decider refuses whatever no longer applies, so exactly one of them wins.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::Pool;
use sha2::{Digest, Sha256};
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{Account, AccountCommand, AccountError, Operation, account_stream};
use zhihui_domain::points::{Amount, Points};
use zhihui_domain::task::{
    Canceller, HoldOutcome, OperationId, PrioritisationOutcome, Task, TaskCommand, TaskError,
    TaskEvent, TaskId, TaskState, TaskStatus, TaskSubmitted, task_stream,
};
use zhihui_domain::user::UserId;

use crate::platform::aggregate::AggregateService;
use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError, RetryPolicy};
use crate::platform::configuration::TaskSettings;
use crate::platform::event_store::{AnyEventStore, EventFilter, EventMetadata, EventStore};
use crate::tasks::catalog::{Catalog, FieldError, RequestedTask};
use crate::tasks::intent_ends::IntentEnds;
use crate::tasks::pool::PoolService;
use crate::tasks::queue::{PrioritiseTarget, TaskQueue};
use crate::tasks::translate::Translator;
use crate::tasks::workflow::Workflows;

mod cancel;
mod prioritise;
mod recovery;
mod submit;

/// Intents resolved per sweep step: bounds one step's work.
pub const SWEEP_INTENTS_MAX: i64 = 100;
/// Expired leases handled per sweep step.
pub const SWEEP_LEASES_MAX: usize = 100;
/// Claimed entries skipped (cancelled or abandoned meanwhile) before `claim_next` gives up for now.
pub const CLAIM_SKIPS_MAX: usize = 64;
/// Events per page when the queue is rebuilt from the log.
pub const REBUILD_PAGE_MAX: usize = 1_000;

/// Namespaces of ids derived from `Idempotency-Key` headers and operation ids.
const SUBMIT_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_7375_626d_6974);
const PRIORITISE_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_7072_696f_7269);
const REFUND_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_7265_6675_6e64);

/// Where a test makes a request die, as a crash would: nothing after it runs, its intent stays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// Submit: the points are frozen, the task is not recorded.
    AfterFreeze,
    /// Prioritise: the fee is charged, the move is not recorded.
    AfterCharge,
    /// Cancel: the cancel is recorded, the hold is not released.
    AfterCancelRecorded,
}

#[derive(Debug, thiserror::Error)]
pub enum TaskServiceError {
    #[error("the request has invalid fields")]
    Invalid(Vec<FieldError>),
    #[error("no such task")]
    NotFound,
    #[error("insufficient points: {available} available, {required} required")]
    InsufficientPoints { available: Points, required: Amount },
    #[error("this Idempotency-Key was used for another request")]
    IdempotencyKeyReused,
    #[error(
        "this request failed earlier and was rolled back (its points were returned); send it again with a new Idempotency-Key"
    )]
    RolledBack,
    #[error("you already have {max} tasks waiting; wait for one to start or cancel one")]
    QueueLimit { max: u32 },
    #[error("model {model}: no image server in the pool offers it now; choose another model")]
    ModelUnavailable { model: String },
    #[error("the task is {status}, not queued")]
    NotQueued { status: &'static str },
    #[error("the task is already first in the queue")]
    AlreadyFirst,
    #[error("the task cannot move ahead right now; try again")]
    NoRoom,
    #[error("another prioritise of this task is under way; look at its place in a moment")]
    PrioritiseUnderWay,
    #[error("the task is {status}: it cannot be cancelled")]
    Finished { status: &'static str },
    #[error("injected crash at {0:?}")]
    Crashed(CrashPoint),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

impl<E: std::error::Error + Send + Sync + 'static> From<CommandError<E>> for TaskServiceError {
    fn from(error: CommandError<E>) -> TaskServiceError {
        TaskServiceError::Unexpected(error.into_anyhow("a task command"))
    }
}

fn task_error(error: TaskError) -> TaskServiceError {
    match error {
        TaskError::NotFound | TaskError::NotOwner => TaskServiceError::NotFound,
        TaskError::NotQueued { status } => TaskServiceError::NotQueued {
            status: status.as_str(),
        },
        TaskError::NotAhead { .. } => TaskServiceError::NoRoom,
        TaskError::PrioritisationAbandoned(_) => TaskServiceError::RolledBack,
        TaskError::Finished { status } => TaskServiceError::Finished {
            status: status.as_str(),
        },
        other @ (TaskError::AlreadySubmitted
        | TaskError::InvalidTransition { .. }
        | TaskError::StaleDispatcher { .. }) => {
            TaskServiceError::Unexpected(anyhow::Error::new(other))
        }
    }
}

/// A submit's answer.
#[derive(Debug, Clone)]
pub struct SubmitOutcome {
    pub task_id: TaskId,
    pub status: TaskStatus,
    /// 1-based queue position while queued.
    pub position: Option<u64>,
    pub price: Amount,
    /// False for a retry that found its task already submitted.
    pub submitted_now: bool,
}

#[derive(Debug, Clone)]
pub struct PrioritiseOutcome {
    pub operation_id: OperationId,
    pub position: Option<u64>,
    pub fee: Amount,
    /// False for a retry of a prioritise that already moved the task (charged once).
    pub charged_now: bool,
}

#[derive(Debug, Clone)]
pub struct CancelOutcome {
    pub status: TaskStatus,
    pub cancel_requested: bool,
}

/// A task the dispatcher claimed and recorded as dispatched; its lease is the caller's.
#[derive(Debug, Clone)]
pub struct DispatchedTask {
    pub task_id: TaskId,
    pub prompt_id: Uuid,
    pub lease_expires_at_ms: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    pub intents_resolved: usize,
    pub leases_requeued: usize,
    pub leases_dropped: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RebuildReport {
    pub queued: usize,
    pub removed: usize,
}

/// The account movements one reconcile made itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AccountMoves {
    pub hold_settled: bool,
    pub hold_released: bool,
    pub fee_refunded: bool,
}

/// The operation id of the refund of an abandoned prioritise's fee (one per charge).
pub fn refund_operation_id(charge_operation_id: OperationId) -> OperationId {
    Uuid::new_v5(&REFUND_NAMESPACE, charge_operation_id.as_bytes())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntentKind {
    Submit,
    Prioritise,
    Cancel,
    /// A dispatcher claimed the task: ends when its hold is settled or released.
    Dispatch,
}

impl IntentKind {
    fn as_str(self) -> &'static str {
        match self {
            IntentKind::Submit => "submit",
            IntentKind::Prioritise => "prioritise",
            IntentKind::Cancel => "cancel",
            IntentKind::Dispatch => "dispatch",
        }
    }
}

#[derive(Debug, Clone)]
pub struct TaskService {
    store: AnyEventStore,
    accounts: AggregateService<Account>,
    pool: Pool,
    pub queue: TaskQueue,
    catalog: Catalog,
    workflows: Arc<Workflows>,
    translator: Translator,
    clock: Clock,
    retry: RetryPolicy,
    crash_point: Option<CrashPoint>,
    /// The servers' pool: a submit for a model none offers is refused (`None`: not checked,
    /// for tools that build a service without a pool).
    backend_pool: Option<PoolService>,
    /// Deletes finished requests' intents, many in one statement.
    intent_ends: IntentEnds,
}

/// A digest of what the user asked (not of the random seed drawn for them), to tell a retry from
/// a reuse of its `Idempotency-Key`.
fn request_digest(request: &RequestedTask) -> String {
    // JSON of the fields, not `Debug`: a stable form across releases, since digests are stored.
    let text = serde_json::to_string(request).unwrap_or_else(|error| {
        unreachable!("a request of strings and numbers serializes: {error}")
    });
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

impl TaskService {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: AnyEventStore,
        accounts: AggregateService<Account>,
        pool: Pool,
        queue: TaskQueue,
        settings: TaskSettings,
        translator: Translator,
        clock: Clock,
    ) -> anyhow::Result<TaskService> {
        Ok(TaskService {
            intent_ends: IntentEnds::new(pool.clone()),
            store,
            accounts,
            pool,
            queue,
            catalog: Catalog::new(settings),
            workflows: Arc::new(Workflows::new()?),
            translator,
            clock,
            retry: RetryPolicy::default(),
            crash_point: None,
            backend_pool: None,
        })
    }

    /// The same service, refusing submits for a model no server of `pool` offers.
    pub fn with_backend_pool(self, pool: PoolService) -> TaskService {
        TaskService {
            backend_pool: Some(pool),
            ..self
        }
    }

    /// The same service, dying at `point` (tests of crash recovery).
    pub fn crashing_at(&self, point: CrashPoint) -> TaskService {
        TaskService {
            crash_point: Some(point),
            ..self.clone()
        }
    }

    fn crash_if(&self, point: CrashPoint) -> Result<(), TaskServiceError> {
        if self.crash_point == Some(point) {
            return Err(TaskServiceError::Crashed(point));
        }
        Ok(())
    }

    pub fn settings(&self) -> &TaskSettings {
        self.catalog.settings()
    }

    pub async fn load(&self, task_id: TaskId) -> anyhow::Result<TaskState> {
        Ok(command::load::<Task>(&self.store, &task_stream(task_id))
            .await?
            .state)
    }

    /// A task's state and the workflow it was submitted with (what a dispatcher posts), in one
    /// read of its stream; the state comes with its version for [`TaskService::execute_task_on`].
    pub async fn load_with_workflow(
        &self,
        task_id: TaskId,
    ) -> anyhow::Result<(command::Loaded<TaskState>, Option<serde_json::Value>)> {
        let mut workflow = None;
        let loaded =
            command::load_inspecting::<Task>(&self.store, &task_stream(task_id), |event| {
                if let TaskEvent::Submitted(submitted) = event {
                    workflow = Some(submitted.workflow.to_value());
                }
            })
            .await?;
        Ok((loaded, workflow))
    }

    pub(crate) async fn execute_task(
        &self,
        task_id: TaskId,
        command: &TaskCommand,
        metadata: &EventMetadata,
    ) -> Result<command::Executed<Task>, CommandError<TaskError>> {
        command::execute::<Task>(
            &self.store,
            &task_stream(task_id),
            command,
            metadata,
            self.retry,
        )
        .await
    }

    /// [`TaskService::execute_task`] on a state just loaded: no second read before the append.
    pub(crate) async fn execute_task_on(
        &self,
        task_id: TaskId,
        loaded: command::Loaded<TaskState>,
        command: &TaskCommand,
        metadata: &EventMetadata,
    ) -> Result<command::Executed<Task>, CommandError<TaskError>> {
        command::execute_on::<Task>(
            &self.store,
            &task_stream(task_id),
            loaded,
            command,
            metadata,
            self.retry,
        )
        .await
    }

    pub(crate) async fn begin_intent(
        &self,
        kind: IntentKind,
        task_id: TaskId,
        user_id: UserId,
        operation_id: Option<OperationId>,
    ) -> anyhow::Result<Uuid> {
        self.write_intent(kind, task_id, user_id, operation_id)
            .await?
            .context("a prioritise's claim met by an intent of another kind")
    }

    /// Write an intent; `None` when it is a prioritise's and another prioritise of the task
    /// holds its claim (`task_intents_one_prioritise`, which no other kind meets).
    async fn write_intent(
        &self,
        kind: IntentKind,
        task_id: TaskId,
        user_id: UserId,
        operation_id: Option<OperationId>,
    ) -> anyhow::Result<Option<Uuid>> {
        // Fresh for every request: an intent belongs to the request that wrote it, so a refused
        // duplicate (the same Idempotency-Key with another body) ends its own intent, never
        // the one of the request that won and may still crash.
        let intent_id = Uuid::now_v7();
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let written = crate::platform::postgres::execute_cached(
            &client,
            "INSERT INTO task_intents (intent_id, kind, task_id, user_id, operation_id, created_at)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (task_id) WHERE kind = 'prioritise' DO NOTHING",
            &[
                &intent_id,
                &kind.as_str(),
                &task_id,
                &user_id.as_uuid(),
                &operation_id,
                &self.clock.now(),
            ],
        )
        .await
        .context("recording an intent")?;
        Ok((written == 1).then_some(intent_id))
    }

    /// A submission's intent, written only while the read model counts fewer than
    /// `queued_per_user_max` waiting tasks of the user: the queue-limit check and the intent in
    /// one statement. `None` when the count is at the limit; [`TaskService::at_queue_limit`]
    /// then confirms on the streams before a refusal.
    async fn begin_submit_intent(
        &self,
        task_id: TaskId,
        user_id: UserId,
    ) -> anyhow::Result<Option<Uuid>> {
        let intent_id = Uuid::now_v7();
        let max = i32::try_from(self.catalog.settings().queued_per_user_max).unwrap_or(i32::MAX);
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let written = crate::platform::postgres::execute_cached(
            &client,
            "INSERT INTO task_intents (intent_id, kind, task_id, user_id, operation_id, created_at)
             SELECT $1, $2, $3, $4, NULL, $5
              WHERE COALESCE((SELECT waiting FROM tasks_waiting WHERE user_id = $4), 0) < $6",
            &[
                &intent_id,
                &IntentKind::Submit.as_str(),
                &task_id,
                &user_id.as_uuid(),
                &self.clock.now(),
                &max,
            ],
        )
        .await
        .context("recording an intent")?;
        Ok((written == 1).then_some(intent_id))
    }

    /// A prioritise's intent, which is also its claim on the task: one prioritise of a task is
    /// under way at a time (`task_intents_one_prioritise`); while one is, another (of any
    /// operation) is refused [`TaskServiceError::PrioritiseUnderWay`] before it pays.
    async fn claim_prioritise(
        &self,
        task_id: TaskId,
        user_id: UserId,
        operation_id: OperationId,
    ) -> Result<Uuid, TaskServiceError> {
        self.write_intent(IntentKind::Prioritise, task_id, user_id, Some(operation_id))
            .await?
            .ok_or(TaskServiceError::PrioritiseUnderWay)
    }

    /// Delete an intent: its request is done. Returns once the row is gone; requests that end
    /// together share one statement (`intent_ends`).
    pub(crate) async fn end_intent(&self, intent_id: Uuid) -> anyhow::Result<()> {
        self.intent_ends.end(intent_id).await
    }

    /// Claim the first queued task for `backend` and record it as dispatched with a fresh
    /// prompt id; the lease stays with the caller. Entries whose task can no longer be
    /// dispatched (cancelled, abandoned) are dropped on the way.
    pub async fn claim_next(
        &self,
        backend: &str,
        fencing_token: u64,
        metadata: &EventMetadata,
    ) -> anyhow::Result<Option<DispatchedTask>> {
        for _skip in 0..CLAIM_SKIPS_MAX {
            let Some(claimed) = self
                .queue
                .claim(self.catalog.settings().claim_lease_ms)
                .await?
            else {
                return Ok(None);
            };
            let prompt_id = Uuid::now_v7();
            let command = TaskCommand::Dispatch {
                backend: backend.to_owned(),
                prompt_id,
                fencing_token,
                at: self.clock.now(),
            };
            match self.execute_task(claimed.task_id, &command, metadata).await {
                Ok(_) => {
                    return Ok(Some(DispatchedTask {
                        task_id: claimed.task_id,
                        prompt_id,
                        lease_expires_at_ms: claimed.lease_expires_at_ms,
                    }));
                }
                Err(CommandError::Rejected(_)) => {
                    self.queue.release_lease(claimed.task_id).await?;
                }
                // The lease stays and runs out; the sweeper then queues the task again.
                Err(other) => return Err(anyhow::Error::new(other)),
            }
        }
        Ok(None)
    }
}
