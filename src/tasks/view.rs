//! A task as programs see it: the view the API answers with and the webhooks deliver, the same
//! JSON in both (a webhook's `data` is what `GET /api/v1/tasks/{id}` answered at that event).
//! It is the one JSON shape outside `http`, because the webhooks' process manager writes it too.

use anyhow::Context;
use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::task::{TaskEvent, TaskId, TaskImage, task_stream};
use zhihui_domain::task_record::TaskRecord;

use crate::platform::event_store::{Direction, EventStore, ReadFrom};

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ProgressView {
    pub value: u64,
    pub max: u64,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ImageView {
    pub image_id: String,
    pub content_type: String,
    /// Served by zhihui to the owner (never a ComfyUI address).
    pub url: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TaskView {
    pub task_id: Uuid,
    /// submitted, queued, dispatched, running, succeeded, failed or cancelled.
    pub status: String,
    pub prompt: String,
    pub negative_prompt: String,
    pub model: String,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    #[schema(value_type = String)]
    pub cfg: Decimal,
    pub sampler: String,
    pub scheduler: String,
    pub seed: u64,
    /// Images asked for.
    pub image_count: u32,
    #[schema(value_type = String)]
    pub price: Decimal,
    /// 1-based queue position while queued.
    pub position: Option<u64>,
    /// While queued: when it should start and end, from the measured step times of the servers
    /// that offer its model and the tasks ahead of it.
    pub estimated_start_at: Option<DateTime<Utc>>,
    pub estimated_end_at: Option<DateTime<Utc>>,
    /// While queued without an estimate: why (no server in service offers its model, ...).
    pub estimate_note: Option<String>,
    /// The same as a code: `no_server`, `no_server_for_model` or `too_far_back`.
    pub estimate_reason: Option<&'static str>,
    /// The server it was sent to, once dispatched: waiting there to run next (`dispatched`),
    /// running there (`running`), or where it ran.
    pub backend: Option<String>,
    /// Sampling progress while running.
    pub progress: Option<ProgressView>,
    pub images: Vec<ImageView>,
    pub failure_reason: Option<String>,
    pub cancel_requested: bool,
    /// Times it was prioritised.
    pub prioritised: u32,
    pub submitted_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

fn image_views(images: Vec<TaskImage>) -> Vec<ImageView> {
    images
        .into_iter()
        .map(|image| ImageView {
            url: format!("/api/v1/images/{}", image.image_id),
            image_id: image.image_id,
            content_type: image.content_type,
        })
        .collect()
}

/// A task's view (without its live parts) from its record, the read model's row or the stream
/// folded by the same fold ([`TaskRecord::evolve`]).
pub fn view_of(record: TaskRecord) -> TaskView {
    TaskView {
        task_id: record.task_id,
        status: record.status.as_str().into(),
        prompt: record.prompt,
        negative_prompt: record.negative_prompt,
        model: record.spec.model,
        width: record.spec.width,
        height: record.spec.height,
        steps: record.spec.steps,
        cfg: record.spec.cfg,
        sampler: record.spec.sampler,
        scheduler: record.spec.scheduler,
        seed: record.spec.seed,
        image_count: record.spec.images,
        price: record.price.as_decimal(),
        position: None,
        estimated_start_at: None,
        estimated_end_at: None,
        estimate_note: None,
        estimate_reason: None,
        backend: record.backend,
        progress: None,
        images: image_views(record.images),
        failure_reason: record.failure_reason,
        cancel_requested: record.cancel_requested,
        prioritised: record.prioritised,
        submitted_at: record.submitted_at,
        finished_at: record.finished_at,
    }
}

/// A task's read-model record brought up to its stream: the events after the row's version
/// folded in. The read model trails its streams by a projection's batch; a client told by its
/// socket that a task ended reads the task next, and must not be shown it still running. A
/// finished task's stream takes no more events: its row is returned as it is, with no read.
pub async fn caught_up(
    store: &crate::platform::event_store::AnyEventStore,
    record: TaskRecord,
) -> anyhow::Result<TaskRecord> {
    if record.status.is_finished() {
        return Ok(record);
    }
    let task_id = record.task_id;
    let events = store
        .read_stream(
            &task_stream(task_id),
            Direction::Forwards,
            ReadFrom::Version(record.version + 1),
            crate::platform::command::STREAM_READ_PAGE_MAX,
        )
        .await
        .context("reading a task stream's newest events")?;
    fold(Some(record), task_id, &events)?.context("a task record folded away")
}

/// A task folded from its stream up to `version` (all of it when `None`): a view as of an event,
/// the same on every replay.
pub async fn record_at(
    store: &crate::platform::event_store::AnyEventStore,
    task_id: TaskId,
    version: Option<u64>,
) -> anyhow::Result<Option<TaskRecord>> {
    let events = store
        .read_stream(
            &task_stream(task_id),
            Direction::Forwards,
            ReadFrom::Start,
            crate::platform::command::STREAM_READ_PAGE_MAX,
        )
        .await
        .context("reading a task stream")?;
    let upto = events
        .iter()
        .take_while(|recorded| version.is_none_or(|version| recorded.stream_version <= version))
        .count();
    fold(None, task_id, &events[..upto])
}

/// `events` of task `task_id`'s stream folded into `record`.
fn fold(
    mut record: Option<TaskRecord>,
    task_id: TaskId,
    events: &[crate::platform::event_store::RecordedEvent],
) -> anyhow::Result<Option<TaskRecord>> {
    for recorded in events {
        let event = TaskEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )
        .context("decoding a task event")?;
        record = TaskRecord::evolve(record, task_id, &event, recorded.stream_version);
    }
    Ok(record)
}
