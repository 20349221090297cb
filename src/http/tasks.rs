//! `/api/v1/tasks*`: submit, query, prioritise and cancel text-to-image tasks (the caller's own
//! only: another user's task answers 404 everywhere), and `/api/v1/admin/queue*`.

use actix_web::{HttpRequest, HttpResponse, web};
use anyhow::Context;
use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::task::{TaskId, TaskStatus};
use zhihui_domain::task_record::TaskRecord;
use zhihui_projections::tasks::{RECORD_COLUMNS, record_of_row};

use crate::http::accounts::idempotency_key;
use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::state::AppState;
use crate::tasks::catalog::RequestedTask;
use crate::tasks::service::TaskServiceError;
pub use crate::tasks::view::{ProgressView, TaskView, record_at, view_of};

/// Most tasks per page of the task list.
pub const TASK_PAGE_MAX: i64 = 100;
/// Tasks per page when the client does not say.
pub const TASK_PAGE_DEFAULT: i64 = 20;
/// Queue entries shown by the admin queue view.
pub const QUEUE_VIEW_MAX: usize = 100;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitTaskRequest {
    /// What to draw; any language (non-English text is translated).
    pub prompt: String,
    pub negative_prompt: Option<String>,
    /// Images to generate, 1 to `tasks.images_per_task_max` (default 1).
    #[schema(value_type = Option<i64>)]
    pub images: Option<serde_json::Number>,
    /// A checkpoint of the catalog (default: its first).
    pub model: Option<String>,
    /// `512x512`, `512x768` or `768x512` (default `512x512`).
    pub resolution: Option<String>,
    #[schema(value_type = Option<i64>)]
    pub steps: Option<serde_json::Number>,
    /// A number or a decimal string with at most one decimal place.
    #[schema(value_type = Option<String>, example = "7.5")]
    pub cfg: Option<Decimal>,
    pub sampler: Option<String>,
    pub scheduler: Option<String>,
    /// 0 to 2^53 - 1; random when absent.
    #[schema(value_type = Option<i64>)]
    pub seed: Option<serde_json::Number>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SubmitTaskResponse {
    pub task_id: Uuid,
    pub status: String,
    /// 1-based position in the queue.
    pub position: Option<u64>,
    #[schema(value_type = String)]
    pub price: Decimal,
    /// False when this answers a retry (same `Idempotency-Key`) of an earlier submit.
    pub submitted_now: bool,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TaskPage {
    pub tasks: Vec<TaskView>,
    /// Pass as `cursor` for the next (older) page; absent on the last page.
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct TaskListQuery {
    /// 1 to 100, default 20.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    #[param(
        pattern = "^[0-9]{1,17}_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
    )]
    pub cursor: Option<String>,
    /// Only tasks in this status (`queued`, `running`, `succeeded`, `failed`, `cancelled`, ...).
    #[param(pattern = "^(submitted|queued|dispatched|running|succeeded|failed|cancelled)$")]
    pub status: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PrioritiseResponse {
    pub task_id: Uuid,
    pub operation_id: Uuid,
    /// 1-based queue position after the move.
    pub position: Option<u64>,
    #[schema(value_type = String)]
    pub fee: Decimal,
    /// False when this answers a retry (same `Idempotency-Key`): the fee was charged once.
    pub charged_now: bool,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CancelResponse {
    pub task_id: Uuid,
    /// `cancelled`, or the running status when the cancel was requested from the dispatcher.
    pub status: String,
    pub cancel_requested: bool,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct QueueEntryView {
    pub task_id: Uuid,
    pub score: i64,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct QueueView {
    pub length: u64,
    /// The first entries, in queue order.
    pub entries: Vec<QueueEntryView>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RebuildResponse {
    pub queued: usize,
    pub removed: usize,
}

pub(crate) fn task_error(error: TaskServiceError) -> ApiError {
    let conflict = |rule: &'static str, error: &TaskServiceError| ApiError::Conflict {
        rule,
        detail: error.to_string(),
    };
    match error {
        TaskServiceError::Invalid(fields) => ApiError::InvalidFields(
            fields
                .into_iter()
                .map(|field| (field.field.to_owned(), field.broken))
                .collect(),
        ),
        TaskServiceError::NotFound => ApiError::NotFound("no such task".into()),
        ref e @ TaskServiceError::InsufficientPoints { .. } => conflict("insufficient-points", e),
        ref e @ TaskServiceError::IdempotencyKeyReused => conflict("idempotency-key-reused", e),
        ref e @ TaskServiceError::RolledBack => conflict("request-rolled-back", e),
        ref e @ TaskServiceError::QueueLimit { .. } => conflict("queue-limit", e),
        ref e @ TaskServiceError::ModelUnavailable { .. } => conflict("model-unavailable", e),
        ref e @ TaskServiceError::NotQueued { .. } => conflict("task-not-queued", e),
        ref e @ TaskServiceError::AlreadyFirst => conflict("already-first", e),
        ref e @ TaskServiceError::NoRoom => conflict("no-room-ahead", e),
        ref e @ TaskServiceError::PrioritiseUnderWay => conflict("prioritise-under-way", e),
        ref e @ TaskServiceError::Finished { .. } => conflict("task-finished", e),
        TaskServiceError::Crashed(point) => {
            ApiError::Unexpected(anyhow::anyhow!("injected crash at {point:?}"))
        }
        TaskServiceError::Unexpected(error) => error.into(),
    }
}

pub(crate) fn parse_task_id(raw: &str) -> Result<TaskId, ApiError> {
    // A malformed id names no task: 404 like any other unknown id.
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("no such task".into()))
}

/// The view of `owner`'s task from its stream, never the read model: what a page shows right
/// after its reader acted on the task (or heard it end), when the projection may not have caught
/// up yet. One stream read.
pub(crate) async fn task_view_from_stream(
    state: &AppState,
    owner: zhihui_domain::user::UserId,
    task_id: TaskId,
) -> Result<TaskView, ApiError> {
    let record = record_from_events(state, task_id)
        .await?
        .filter(|record| record.user_id == owner)
        .ok_or_else(|| ApiError::NotFound("no such task".into()))?;
    let mut view = view_of(record);
    add_live_parts(state, &mut view).await?;
    add_estimates(state, std::slice::from_mut(&mut view)).await;
    Ok(view)
}

/// A task the read model does not have yet (just submitted), folded from its stream; `None` if
/// the stream has no submission.
pub(crate) async fn record_from_events(
    state: &AppState,
    task_id: TaskId,
) -> Result<Option<TaskRecord>, ApiError> {
    Ok(record_at(&state.event_store, task_id, None).await?)
}

/// A whole number as JSON Schema's `integer` counts it (`20` and `20.0` alike): the catalog
/// checks its range; a fraction is refused here, naming the field.
fn whole(field: &str, value: Option<serde_json::Number>) -> Result<Option<i64>, ApiError> {
    let Some(number) = value else {
        return Ok(None);
    };
    crate::http::extract::whole::of_number::<i64>(&number)
        .map(Some)
        .map_err(|broken| ApiError::invalid(field, broken))
}

/// The wait estimates of the queued views (one read of the queue's head for them all). An
/// estimate that cannot be read leaves them without one: the view still answers.
async fn add_estimates(state: &AppState, views: &mut [TaskView]) {
    if views.iter().all(|view| view.position.is_none()) {
        return;
    }
    let places = views
        .iter()
        .filter_map(|view| view.position.map(|position| (view.task_id, position)));
    let estimates = match state
        .dispatcher
        .backend_pool()
        .estimates(&state.tasks.queue, places)
        .await
    {
        Ok(estimates) => estimates,
        Err(error) => {
            tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "wait estimates unavailable");
            return;
        }
    };
    for view in views.iter_mut().filter(|view| view.position.is_some()) {
        match estimates.get(&view.task_id) {
            Some(crate::tasks::pool::WaitEstimate::At { start, end }) => {
                view.estimated_start_at = Some(*start);
                view.estimated_end_at = Some(*end);
            }
            Some(unknown) => {
                view.estimate_note = unknown.unknown_note();
                view.estimate_reason = unknown.unknown_reason();
            }
            None => {
                view.estimate_note = Some(format!(
                    "only the first {} queued tasks are estimated",
                    crate::tasks::pool::ESTIMATE_QUEUE_MAX
                ));
                view.estimate_reason = Some("too_far_back");
            }
        }
    }
}

/// Live parts of a view: queue position while queued, progress while running.
/// The view of a read-model row, as new as its task's stream.
///
/// The read model trails the streams by a projection's batch: a client told by its socket that
/// its task ended, reading the task next, must not be shown it still running. A row of a task
/// still waiting in the queue at the score the row has is as new as its stream (leaving the
/// queue, by dispatch or cancel, and a prioritise, which moves the score, all change the
/// queue): its place comes from the same read, and the stream is not read. Any other unfinished
/// row has the stream's newer events folded in (one more read); a finished one is as it is.
async fn view_of_row(state: &AppState, record: TaskRecord) -> Result<TaskView, ApiError> {
    if record.status == TaskStatus::Queued
        && let Some((rank, score)) = state.tasks.queue.place(record.task_id).await?
        && record.queue_score.map(|recorded| recorded as f64) == Some(score)
    {
        let mut view = view_of(record);
        view.position = Some(rank + 1);
        return Ok(view);
    }
    let record = crate::tasks::view::caught_up(&state.event_store, record).await?;
    let mut view = view_of(record);
    add_live_parts(state, &mut view).await?;
    Ok(view)
}

async fn add_live_parts(state: &AppState, view: &mut TaskView) -> Result<(), ApiError> {
    match view.status.as_str() {
        "queued" => {
            view.position = state
                .tasks
                .queue
                .rank(view.task_id)
                .await?
                .map(|rank| rank + 1);
        }
        "dispatched" | "running" => {
            view.progress = state
                .tasks
                .queue
                .progress(view.task_id)
                .await?
                .map(|(value, max)| ProgressView { value, max });
        }
        _ => {}
    }
    Ok(())
}

/// Submit a text-to-image task: checked against the catalog, priced, paid for (frozen),
/// translated, rendered and queued. Send an `Idempotency-Key` header to make retries safe.
#[utoipa::path(
    post, path = "/api/v1/tasks", tag = "tasks", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "same key, same request: one task, one freeze")),
    request_body = SubmitTaskRequest,
    responses(
        (status = 201, body = SubmitTaskResponse),
        (status = 401, body = crate::http::problem::Problem),
        (status = 409, description = "`insufficient-points`, `queue-limit`, `model-unavailable` (no server of the pool offers the model), `idempotency-key-reused`, `request-rolled-back`", body = crate::http::problem::Problem),
        (status = 422, description = "fields that break the catalog, each named in `errors`", body = crate::http::problem::Problem),
    )
)]
pub async fn submit(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<SubmitTaskRequest>,
) -> Result<HttpResponse, ApiError> {
    let key = idempotency_key(&request)?;
    let body = body.into_inner();
    let requested = RequestedTask {
        prompt: body.prompt,
        negative_prompt: body.negative_prompt,
        images: whole("images", body.images)?,
        model: body.model,
        resolution: body.resolution,
        steps: whole("steps", body.steps)?,
        cfg: body.cfg,
        sampler: body.sampler,
        scheduler: body.scheduler,
        seed: whole("seed", body.seed)?,
    };
    let outcome = submit_and_tell(
        &state,
        caller.user_id(),
        &requested,
        key.as_deref(),
        &event_metadata(&request, caller.actor()),
    )
    .await
    .map_err(task_error)?;
    Ok(HttpResponse::Created().json(SubmitTaskResponse {
        task_id: outcome.task_id,
        status: outcome.status.as_str().into(),
        position: outcome.position,
        price: outcome.price.as_decimal(),
        submitted_now: outcome.submitted_now,
    }))
}

/// Submit for `user_id` and tell their sockets the task's place (the API and the pages).
pub(crate) async fn submit_and_tell(
    state: &AppState,
    user_id: zhihui_domain::user::UserId,
    requested: &RequestedTask,
    key: Option<&str>,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<crate::tasks::service::SubmitOutcome, TaskServiceError> {
    let (tasks, notifier) = (state.tasks.clone(), state.notifier.clone());
    let (requested, key, metadata) = (requested.clone(), key.map(str::to_owned), metadata.clone());
    // Off an HTTP worker's thread: a submission's CPU would hold up the reads beside it.
    crate::platform::worker_local::off_worker(Box::pin(async move {
        let outcome = tasks
            .submit(user_id, &requested, key.as_deref(), &metadata)
            .await?;
        if let Some(position) = outcome.position {
            notifier
                .tell(
                    user_id,
                    outcome.task_id,
                    crate::platform::notify::TaskNotice::Position {
                        position,
                        estimated_start_at: None,
                        estimated_end_at: None,
                    },
                )
                .await;
        }
        Ok(outcome)
    }))
    .await
}

/// One of the caller's tasks.
#[utoipa::path(
    get, path = "/api/v1/tasks/{id}", tag = "tasks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "task id")),
    responses((status = 200, body = TaskView), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn task(
    state: web::Data<AppState>,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let task_id = parse_task_id(&path)?;
    Ok(HttpResponse::Ok().json(task_view(&state, caller.user_id(), task_id).await?))
}

/// A task whose id was drawn less than this long ago is read from its stream, not the read
/// model (see [`task_view`]).
pub const FRESH_TASK_MS: u128 = 1_000;

/// Whether `task_id` was drawn (a UUIDv7: the time it was made, then random bits) less than
/// [`FRESH_TASK_MS`] ago. A keyed submission's id is a UUIDv5, with no time in it: never fresh.
fn is_fresh(task_id: TaskId) -> bool {
    let Some((seconds, nanos)) = task_id.get_timestamp().map(|at| at.to_unix()) else {
        return false;
    };
    let drawn = std::time::Duration::new(seconds, nanos);
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .is_ok_and(|now| now.saturating_sub(drawn).as_millis() < FRESH_TASK_MS)
}

/// The view of `owner`'s task `task_id`: 404 when it is not theirs (the API and the pages).
///
/// From the read model, or from the task's stream when the model does not have it yet. A task
/// submitted within the last second is read from its stream straight away: a client reads its
/// task right after submitting it, before the tasks projection's next batch has committed (under
/// `bench_http`'s 64 users, 82 % of such reads missed the model and read the stream after it,
/// two statements each). Both fold the same events with `TaskRecord::evolve`: the view is the
/// same either way, the stream's at least as new. An unfinished task's row has its stream's
/// newer events folded in (one more read): what its socket said is never contradicted.
pub(crate) async fn task_view(
    state: &AppState,
    owner: zhihui_domain::user::UserId,
    task_id: TaskId,
) -> Result<TaskView, ApiError> {
    if is_fresh(task_id) {
        return task_view_from_stream(state, owner, task_id).await;
    }
    let row = {
        let client = crate::platform::postgres::checkout(&state.pg_pool)
            .await
            .context("getting a connection")?;
        crate::platform::postgres::query_opt_cached(
            &client,
            &format!("SELECT {RECORD_COLUMNS} FROM tasks WHERE task_id = $1"),
            &[&task_id],
        )
        .await
        .context("reading a task")?
    };
    let mut view = match row {
        Some(row) => {
            let record = record_of_row(&row)?;
            if record.user_id != owner {
                return Err(ApiError::NotFound("no such task".into()));
            }
            view_of_row(state, record).await?
        }
        None => return task_view_from_stream(state, owner, task_id).await,
    };
    add_estimates(state, std::slice::from_mut(&mut view)).await;
    Ok(view)
}

/// The caller's tasks, newest first.
#[utoipa::path(
    get, path = "/api/v1/tasks", tag = "tasks", security(("bearer" = [])),
    params(TaskListQuery),
    responses((status = 200, body = TaskPage), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn tasks(
    state: web::Data<AppState>,
    caller: Authenticated,
    query: crate::http::extract::Query<TaskListQuery>,
) -> Result<HttpResponse, ApiError> {
    let page = task_page(&state, caller.user_id(), &query).await?;
    Ok(HttpResponse::Ok().json(page))
}

/// A keyset cursor `<time in µs since the epoch>_<id>` of the last row a page showed (tasks by
/// submission, works by publication), read back: refused with 422 `cursor` unless it is one.
pub(crate) fn parse_time_cursor(cursor: &str) -> Result<(DateTime<Utc>, Uuid), ApiError> {
    /// 9999-12-31T23:59:59.999999Z in microseconds since the epoch.
    const CURSOR_MICROS_MAX: i64 = 253_402_300_799_999_999;
    let bad_cursor = || ApiError::invalid_by("cursor", Rule::Cursor);
    let (micros, id) = cursor.split_once('_').ok_or_else(bad_cursor)?;
    let micros: i64 = micros.parse().map_err(|_| bad_cursor())?;
    // Our cursors are times this API recorded; anything outside 1970..=9999 is not one (and
    // PostgreSQL refuses timestamps far enough out: that was a 500).
    if !(0..=CURSOR_MICROS_MAX).contains(&micros) {
        return Err(bad_cursor());
    }
    Ok((
        DateTime::from_timestamp_micros(micros).ok_or_else(bad_cursor)?,
        Uuid::parse_str(id).map_err(|_| bad_cursor())?,
    ))
}

/// The cursor [`parse_time_cursor`] reads.
pub(crate) fn time_cursor(at: DateTime<Utc>, id: Uuid) -> String {
    format!("{}_{id}", at.timestamp_micros())
}

/// How many unfinished tasks of one page read their streams' newest events at once.
const CATCH_UP_READS_AT_ONCE: usize = 4;

/// A page of `owner`'s tasks, newest first, optionally of one status (the API and the pages).
pub(crate) async fn task_page(
    state: &AppState,
    owner: zhihui_domain::user::UserId,
    query: &TaskListQuery,
) -> Result<TaskPage, ApiError> {
    let limit = query.limit.unwrap_or(TASK_PAGE_DEFAULT);
    if !(1..=TASK_PAGE_MAX).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            Broken::new(Rule::Between)
                .with("min", 1)
                .with("max", TASK_PAGE_MAX),
        ));
    }
    let (before_at, before_id) = match &query.cursor {
        None => (DateTime::<Utc>::MAX_UTC, Uuid::max()),
        Some(cursor) => parse_time_cursor(cursor)?,
    };
    let status = match &query.status {
        None => None,
        Some(text) => Some(
            TaskStatus::parse(text)
                .filter(|status| TaskStatus::RECORDED.contains(status))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "status",
                        Broken::new(Rule::NotTaskStatus).with("value", format!("{text:?}")),
                    )
                })?,
        ),
    };
    let page_rows = limit + 1;
    let rows = {
        let client = crate::platform::postgres::checkout(&state.pg_pool)
            .await
            .context("getting a connection")?;
        let owner = owner.as_uuid();
        let status = status.map(|status| status.as_str());
        // Two statements, each served by its own index (`tasks_by_user_newest`,
        // `tasks_by_user_status_newest`): a page never scans the user's other tasks.
        let (filter, parameters): (&str, Vec<&(dyn tokio_postgres::types::ToSql + Sync)>) =
            match &status {
                None => ("", vec![&owner, &before_at, &before_id, &page_rows]),
                Some(status) => (
                    "AND status = $5",
                    vec![&owner, &before_at, &before_id, &page_rows, status],
                ),
            };
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM tasks
              WHERE user_id = $1 {filter} AND (submitted_at, task_id) < ($2, $3)
              ORDER BY submitted_at DESC, task_id DESC LIMIT $4"
        );
        // A few shapes (with or without a status filter): each prepared once per connection.
        crate::platform::postgres::query_cached(&client, &sql, &parameters)
            .await
            .context("reading tasks")?
    };
    let has_more = rows.len() as i64 > limit;
    let shown = &rows[..rows.len().min(usize::try_from(limit).unwrap_or(0))];
    let records = shown
        .iter()
        .map(record_of_row)
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The next page starts after the last row read, shown or not.
    let next_cursor = if has_more {
        records
            .last()
            .map(|record| time_cursor(record.submitted_at, record.task_id))
    } else {
        None
    };
    // Each as new as its stream, a few at a time (a page of a hundred tasks on servers must not
    // take a hundred connections).
    let mut views: Vec<TaskView> = futures::stream::iter(records)
        .map(|record| view_of_row(state, record))
        .buffered(CATCH_UP_READS_AT_ONCE)
        .try_collect()
        .await?;
    // A task that has left the status asked for since its row was written is not listed.
    views.retain(|view| status.is_none_or(|status| view.status == status.as_str()));
    add_estimates(state, &mut views).await;
    Ok(TaskPage {
        tasks: views,
        next_cursor,
    })
}

/// Move a queued task ahead of up to `tasks.prioritise_jump_max` others for the prioritise fee,
/// charged once. Send an `Idempotency-Key` header to make retries safe.
#[utoipa::path(
    post, path = "/api/v1/tasks/{id}/prioritise", tag = "tasks", security(("bearer" = [])),
    params(
        ("id" = Uuid, Path, description = "task id"),
        ("Idempotency-Key" = Option<String>, Header, description = "same key: moved and charged once"),
    ),
    responses(
        (status = 200, body = PrioritiseResponse),
        (status = 404, body = crate::http::problem::Problem),
        (status = 409, description = "`task-not-queued`, `already-first`, `no-room-ahead`, `prioritise-under-way` (another prioritise of the task is being made), `insufficient-points`: nothing charged", body = crate::http::problem::Problem),
    )
)]
pub async fn prioritise(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let task_id = parse_task_id(&path)?;
    let key = idempotency_key(&request)?;
    let outcome = prioritise_and_tell(
        &state,
        caller.user_id(),
        task_id,
        key.as_deref(),
        &event_metadata(&request, caller.actor()),
    )
    .await
    .map_err(task_error)?;
    Ok(HttpResponse::Ok().json(PrioritiseResponse {
        task_id,
        operation_id: outcome.operation_id,
        position: outcome.position,
        fee: outcome.fee.as_decimal(),
        charged_now: outcome.charged_now,
    }))
}

/// Prioritise `user_id`'s task and tell every socket the queue moved (the API and the pages).
pub(crate) async fn prioritise_and_tell(
    state: &AppState,
    user_id: zhihui_domain::user::UserId,
    task_id: TaskId,
    key: Option<&str>,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<crate::tasks::service::PrioritiseOutcome, TaskServiceError> {
    let (tasks, notifier) = (state.tasks.clone(), state.notifier.clone());
    let (key, metadata) = (key.map(str::to_owned), metadata.clone());
    crate::platform::worker_local::off_worker(Box::pin(async move {
        let outcome = tasks
            .prioritise(user_id, task_id, key.as_deref(), &metadata)
            .await?;
        notifier.queue_moved().await;
        Ok(outcome)
    }))
    .await
}

/// Cancel `user_id`'s task and tell them (and the queue) when it left the queue at once (the API
/// and the pages).
pub(crate) async fn cancel_and_tell(
    state: &AppState,
    user_id: zhihui_domain::user::UserId,
    task_id: TaskId,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<crate::tasks::service::CancelOutcome, TaskServiceError> {
    let (tasks, notifier, metadata) = (
        state.tasks.clone(),
        state.notifier.clone(),
        metadata.clone(),
    );
    crate::platform::worker_local::off_worker(Box::pin(async move {
        let outcome = tasks.cancel(user_id, task_id, &metadata).await?;
        if outcome.status == TaskStatus::Cancelled {
            notifier
                .tell(
                    user_id,
                    task_id,
                    crate::platform::notify::TaskNotice::Cancelled,
                )
                .await;
            notifier.queue_moved().await;
        }
        Ok(outcome)
    }))
    .await
}

/// Cancel a task: a queued one leaves the queue and its points return (200); a dispatched or
/// running one is interrupted by the dispatcher (202); a finished one cannot be (409).
#[utoipa::path(
    post, path = "/api/v1/tasks/{id}/cancel", tag = "tasks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "task id")),
    responses(
        (status = 200, body = CancelResponse),
        (status = 202, description = "cancel requested from the dispatcher", body = CancelResponse),
        (status = 404, body = crate::http::problem::Problem),
        (status = 409, description = "`task-finished`", body = crate::http::problem::Problem),
    )
)]
pub async fn cancel(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let task_id = parse_task_id(&path)?;
    let outcome = cancel_and_tell(
        &state,
        caller.user_id(),
        task_id,
        &event_metadata(&request, caller.actor()),
    )
    .await
    .map_err(task_error)?;
    let body = CancelResponse {
        task_id,
        status: outcome.status.as_str().into(),
        cancel_requested: outcome.cancel_requested,
    };
    Ok(if outcome.status == TaskStatus::Cancelled {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::Accepted().json(body)
    })
}

/// The queue (admins): its length and first entries.
#[utoipa::path(
    get, path = "/api/v1/admin/queue", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = QueueView), (status = 403, body = crate::http::problem::Problem))
)]
pub async fn queue(state: web::Data<AppState>, _admin: Admin) -> Result<HttpResponse, ApiError> {
    let entries = state.tasks.queue.entries().await?;
    Ok(HttpResponse::Ok().json(QueueView {
        length: entries.len() as u64,
        entries: entries
            .into_iter()
            .take(QUEUE_VIEW_MAX)
            .map(|(task_id, score)| QueueEntryView { task_id, score })
            .collect(),
    }))
}

/// Rebuild the Redis queue from the events (admins), e.g. after Redis lost its data.
#[utoipa::path(
    post, path = "/api/v1/admin/queue/rebuild", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = RebuildResponse), (status = 403, body = crate::http::problem::Problem))
)]
pub async fn rebuild_queue(
    state: web::Data<AppState>,
    _admin: Admin,
) -> Result<HttpResponse, ApiError> {
    // To its end even past the request's deadline (a long queue): sent again, it finds the
    // queue rebuilt.
    let tasks = state.tasks.clone();
    let report =
        crate::platform::worker_local::off_worker(Box::pin(
            async move { tasks.rebuild_queue().await },
        ))
        .await?;
    Ok(HttpResponse::Ok().json(RebuildResponse {
        queued: report.queued,
        removed: report.removed,
    }))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use uuid::{NoContext, Timestamp, Uuid};

    use super::{FRESH_TASK_MS, is_fresh};

    fn drawn_ago(ago: Duration) -> Uuid {
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("the clock is past 1970")
            - ago;
        Uuid::new_v7(Timestamp::from_unix(
            NoContext,
            at.as_secs(),
            at.subsec_nanos(),
        ))
    }

    #[test]
    fn a_task_id_is_fresh_only_when_drawn_within_the_window_and_carrying_its_time() {
        assert!(is_fresh(Uuid::now_v7()));
        assert!(is_fresh(drawn_ago(Duration::from_millis(100))));
        let window = u64::try_from(FRESH_TASK_MS).expect("a second fits");
        assert!(!is_fresh(drawn_ago(Duration::from_millis(window + 50))));
        assert!(!is_fresh(drawn_ago(Duration::from_secs(86_400))));
        // A keyed submission's id (UUIDv5) and a random one carry no time.
        assert!(!is_fresh(Uuid::new_v5(
            &Uuid::NAMESPACE_OID,
            "用户:密钥".as_bytes()
        )));
        assert!(!is_fresh(Uuid::new_v4()));
    }
}
