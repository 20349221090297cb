//! `tasks` (one row per recorded task: status, prompts, parameters, queue score, images, failure
//! reason) from the task streams. The row is a [`TaskRecord`], folded by the domain's one fold:
//! a batch reads the rows of the tasks it touches, folds their events in memory and writes each
//! touched row once. The `stream_version` guard (in the fold and in the upsert) makes each event
//! apply at most once.
//!
//! `tasks_waiting` (one row per user: tasks submitted or queued) moves with the rows: a task
//! whose row changes from waiting to not (or back) moves its user's count in the same
//! transaction, so the count is the rows' own (the batches of a projection apply one at a time,
//! under its checkpoint's lock).

use std::collections::HashMap;

use anyhow::Context;
use rust_decimal::Decimal;
use zhihui_domain::DomainEvent;
use zhihui_domain::points::Amount;
use zhihui_domain::task::{TaskEvent, TaskId, TaskStatus, task_id_of_stream};
use zhihui_domain::task_record::TaskRecord;
use zhihui_domain::user::UserId;

use crate::{ProjectedEvent, Tables};

/// The columns [`record_of_row`] reads.
pub const RECORD_COLUMNS: &str = "task_id, user_id, status, prompt, negative_prompt, spec, price,
    queue_score, cancel_requested, prioritised, backend, prompt_id, images, failure_reason,
    submitted_at, finished_at, stream_version";

/// A `tasks` row (selected with [`RECORD_COLUMNS`]) as the record it stores.
pub fn record_of_row(row: &tokio_postgres::Row) -> anyhow::Result<TaskRecord> {
    let status: String = row.get("status");
    let price: Decimal = row.get("price");
    let prioritised: i32 = row.get("prioritised");
    let version: i64 = row.get("stream_version");
    Ok(TaskRecord {
        task_id: row.get("task_id"),
        user_id: UserId::from_uuid(row.get("user_id")),
        status: TaskStatus::parse(&status)
            .with_context(|| format!("a stored task status {status:?}"))?,
        prompt: row.get("prompt"),
        negative_prompt: row.get("negative_prompt"),
        spec: serde_json::from_value(row.get("spec")).context("decoding a stored task spec")?,
        price: Amount::parse(price).context("a stored task price")?,
        queue_score: row.get("queue_score"),
        cancel_requested: row.get("cancel_requested"),
        prioritised: u32::try_from(prioritised).context("a stored prioritise count")?,
        backend: row.get("backend"),
        prompt_id: row.get("prompt_id"),
        images: serde_json::from_value(row.get("images")).context("decoding stored task images")?,
        failure_reason: row.get("failure_reason"),
        submitted_at: row.get("submitted_at"),
        finished_at: row.get("finished_at"),
        version: u64::try_from(version).context("a stored stream version")?,
    })
}

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let table = tables.name("tasks");
    // The batch's events by task, in order; the task ids in the order first met.
    let mut order: Vec<TaskId> = Vec::new();
    let mut by_task: HashMap<TaskId, Vec<&ProjectedEvent>> = HashMap::new();
    for recorded in events {
        let Some(task_id) = task_id_of_stream(&recorded.stream) else {
            continue;
        };
        by_task
            .entry(task_id)
            .or_insert_with(|| {
                order.push(task_id);
                Vec::new()
            })
            .push(recorded);
    }
    if order.is_empty() {
        return Ok(());
    }
    let mut records: HashMap<TaskId, TaskRecord> = HashMap::new();
    let mut waiting: HashMap<UserId, i32> = HashMap::new();
    let mut rows = Rows::default();
    for row in transaction
        .query(
            &format!("SELECT {RECORD_COLUMNS} FROM {table} WHERE task_id = ANY($1)"),
            &[&order],
        )
        .await
        .context("reading the batch's tasks")?
    {
        let record = record_of_row(&row)?;
        records.insert(record.task_id, record);
    }
    for task_id in order {
        let before = records.remove(&task_id);
        let mut record = before.clone();
        let mut updated_at = None;
        for recorded in &by_task[&task_id] {
            let event = TaskEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(|| format!("event {} of {}", recorded.id, recorded.stream))?;
            record = TaskRecord::evolve(record, task_id, &event, recorded.stream_version);
            updated_at = Some(recorded.recorded_at);
        }
        // An abandoned task never had a row; a batch seen before changes nothing.
        let (Some(record), Some(updated_at)) = (record, updated_at) else {
            continue;
        };
        if before.as_ref() == Some(&record) {
            continue;
        }
        let was_waiting = before
            .as_ref()
            .is_some_and(|before| is_waiting(before.status));
        let change = i32::from(is_waiting(record.status)) - i32::from(was_waiting);
        if change != 0 {
            *waiting.entry(record.user_id).or_default() += change;
        }
        rows.push(&record, updated_at)?;
    }
    rows.write(transaction, &table).await?;
    let (users, changes): (Vec<uuid::Uuid>, Vec<i32>) = waiting
        .into_iter()
        .filter(|(_, change)| *change != 0)
        .map(|(user, change)| (user.as_uuid(), change))
        .unzip();
    if !users.is_empty() {
        let counts = tables.name("tasks_waiting");
        transaction
            .execute(
                &format!(
                    "INSERT INTO {counts} AS w (user_id, waiting) \
                     SELECT * FROM unnest($1::uuid[], $2::int[]) \
                     ON CONFLICT (user_id) DO UPDATE SET waiting = w.waiting + EXCLUDED.waiting"
                ),
                &[&users, &changes],
            )
            .await
            .context("counting users' waiting tasks")?;
    }
    Ok(())
}

/// Waiting for a server: what the per-user queue limit counts.
pub fn is_waiting(status: TaskStatus) -> bool {
    matches!(status, TaskStatus::Submitted | TaskStatus::Queued)
}

/// The batch's changed rows, by column (each task once: a batch writes a task's row once).
#[derive(Default)]
struct Rows {
    task_id: Vec<TaskId>,
    user_id: Vec<uuid::Uuid>,
    status: Vec<&'static str>,
    prompt: Vec<String>,
    negative_prompt: Vec<String>,
    spec: Vec<serde_json::Value>,
    price: Vec<Decimal>,
    queue_score: Vec<Option<i64>>,
    cancel_requested: Vec<bool>,
    prioritised: Vec<i32>,
    backend: Vec<Option<String>>,
    prompt_id: Vec<Option<uuid::Uuid>>,
    images: Vec<serde_json::Value>,
    failure_reason: Vec<Option<String>>,
    submitted_at: Vec<chrono::DateTime<chrono::Utc>>,
    finished_at: Vec<Option<chrono::DateTime<chrono::Utc>>>,
    stream_version: Vec<i64>,
    updated_at: Vec<chrono::DateTime<chrono::Utc>>,
}

impl Rows {
    fn push(
        &mut self,
        record: &TaskRecord,
        updated_at: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<()> {
        self.task_id.push(record.task_id);
        self.user_id.push(record.user_id.as_uuid());
        self.status.push(record.status.as_str());
        self.prompt.push(record.prompt.clone());
        self.negative_prompt.push(record.negative_prompt.clone());
        self.spec
            .push(serde_json::to_value(&record.spec).context("encoding the task spec")?);
        self.price.push(record.price.as_decimal());
        self.queue_score.push(record.queue_score);
        self.cancel_requested.push(record.cancel_requested);
        self.prioritised
            .push(i32::try_from(record.prioritised).context("a prioritise count")?);
        self.backend.push(record.backend.clone());
        self.prompt_id.push(record.prompt_id);
        self.images
            .push(serde_json::to_value(&record.images).context("encoding images")?);
        self.failure_reason.push(record.failure_reason.clone());
        self.submitted_at.push(record.submitted_at);
        self.finished_at.push(record.finished_at);
        self.stream_version.push(i64::try_from(record.version)?);
        self.updated_at.push(updated_at);
        Ok(())
    }

    /// One upsert for the whole batch (a statement per task cost two round trips each: the
    /// busiest projection's largest share of its batch).
    async fn write(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
        table: &str,
    ) -> anyhow::Result<()> {
        if self.task_id.is_empty() {
            return Ok(());
        }
        transaction
            .execute(
                &format!(
                    "INSERT INTO {table} AS t (task_id, user_id, status, prompt, negative_prompt,
                            spec, price, queue_score, cancel_requested, prioritised, backend,
                            prompt_id, images, failure_reason, submitted_at, finished_at,
                            stream_version, updated_at)
                     SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[],
                            $5::text[], $6::jsonb[], $7::numeric[], $8::bigint[], $9::boolean[],
                            $10::integer[], $11::text[], $12::uuid[], $13::jsonb[], $14::text[],
                            $15::timestamptz[], $16::timestamptz[], $17::bigint[],
                            $18::timestamptz[])
                     ON CONFLICT (task_id) DO UPDATE SET
                            status = EXCLUDED.status, queue_score = EXCLUDED.queue_score,
                            cancel_requested = EXCLUDED.cancel_requested,
                            prioritised = EXCLUDED.prioritised, backend = EXCLUDED.backend,
                            prompt_id = EXCLUDED.prompt_id, images = EXCLUDED.images,
                            failure_reason = EXCLUDED.failure_reason,
                            finished_at = EXCLUDED.finished_at,
                            stream_version = EXCLUDED.stream_version,
                            updated_at = EXCLUDED.updated_at
                      WHERE t.stream_version < EXCLUDED.stream_version"
                ),
                &[
                    &self.task_id,
                    &self.user_id,
                    &self.status,
                    &self.prompt,
                    &self.negative_prompt,
                    &self.spec,
                    &self.price,
                    &self.queue_score,
                    &self.cancel_requested,
                    &self.prioritised,
                    &self.backend,
                    &self.prompt_id,
                    &self.images,
                    &self.failure_reason,
                    &self.submitted_at,
                    &self.finished_at,
                    &self.stream_version,
                    &self.updated_at,
                ],
            )
            .await
            .with_context(|| format!("writing {} tasks", self.task_id.len()))?;
        Ok(())
    }
}
