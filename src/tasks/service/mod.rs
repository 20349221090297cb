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
    #[error("the task is {status}: it cannot be cancelled")]
    Finished { status: &'static str },
    #[error("injected crash at {0:?}")]
    Crashed(CrashPoint),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

impl<E: std::error::Error + Send + Sync + 'static> From<CommandError<E>> for TaskServiceError {
    fn from(error: CommandError<E>) -> TaskServiceError {
        TaskServiceError::Unexpected(anyhow::Error::new(error))
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
        // Fresh for every request: an intent belongs to the request that wrote it, so a refused
        // duplicate (the same Idempotency-Key with another body) ends its own intent, never
        // the one of the request that won and may still crash.
        let intent_id = Uuid::now_v7();
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        crate::platform::postgres::execute_cached(
            &client,
            "INSERT INTO task_intents (intent_id, kind, task_id, user_id, operation_id, created_at)
                 VALUES ($1, $2, $3, $4, $5, $6)",
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
        Ok(intent_id)
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

    /// Delete an intent: its request is done. Returns once the row is gone; requests that end
    /// together share one statement (`intent_ends`).
    pub(crate) async fn end_intent(&self, intent_id: Uuid) -> anyhow::Result<()> {
        self.intent_ends.end(intent_id).await
    }

    /// Run a paying account command (freeze, charge) of a request with an intent; on a refusal
    /// nothing was paid, so the intent ends with it.
    async fn pay(
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
    async fn at_queue_limit(&self, user_id: UserId) -> anyhow::Result<bool> {
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

    async fn repeated_submit(
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
        match state.prioritisations.get(&operation_id) {
            Some(PrioritisationOutcome::Moved) => {
                return Ok(PrioritiseOutcome {
                    operation_id,
                    position: self.queue.rank(task_id).await?.map(|rank| rank + 1),
                    fee,
                    charged_now: false,
                });
            }
            Some(PrioritisationOutcome::Abandoned) => return Err(TaskServiceError::RolledBack),
            None => {}
        }
        if state.status != TaskStatus::Queued {
            return Err(TaskServiceError::NotQueued {
                status: state.status.as_str(),
            });
        }
        let to_score = match self
            .queue
            .prioritise_target(task_id, settings.prioritise_jump_max)
            .await?
        {
            PrioritiseTarget::Ahead { to_score, .. } => to_score,
            PrioritiseTarget::AlreadyFirst => return Err(TaskServiceError::AlreadyFirst),
            PrioritiseTarget::NoRoom => return Err(TaskServiceError::NoRoom),
            // Queued by its events but not in the queue: a dispatcher holds it right now.
            PrioritiseTarget::NotQueued => {
                return Err(TaskServiceError::NotQueued {
                    status: TaskStatus::Dispatched.as_str(),
                });
            }
        };
        let intent = self
            .begin_intent(IntentKind::Prioritise, task_id, user_id, Some(operation_id))
            .await?;
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
                let state = if executed.state.status == TaskStatus::Cancelled {
                    self.reconcile(task_id, user_id, None, metadata.correlation_id)
                        .await?
                } else {
                    executed.state
                };
                self.end_intent(intent).await?;
                Ok(CancelOutcome {
                    status: state.status,
                    cancel_requested: state.cancel_requested,
                })
            }
            Err(CommandError::Rejected(error)) => {
                self.end_intent(intent).await?;
                Err(task_error(error))
            }
            Err(other) => Err(other.into()),
        }
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
    /// account refuses only on its stream's latest version (see `src/aggregate.rs`), and a task
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
