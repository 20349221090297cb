//! `tasks` (one row per recorded task: status, prompts, parameters, queue score, images, failure
//! reason) from the task streams. Tasks change a few times each, so one statement per event; the
//! `stream_version` guard makes each statement apply at most once.

use anyhow::Context;
use zhihui_domain::DomainEvent;
use zhihui_domain::task::{TaskEvent, task_id_of_stream};

use crate::{ProjectedEvent, Tables};

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let table = tables.name("tasks");
    for recorded in events {
        let Some(task_id) = task_id_of_stream(&recorded.stream) else {
            continue;
        };
        let event = TaskEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )
        .with_context(|| format!("event {} of {}", recorded.id, recorded.stream))?;
        let version = i64::try_from(recorded.stream_version)?;
        let at = recorded.recorded_at;
        if let TaskEvent::Submitted(e) = &event {
            let spec = serde_json::to_value(&e.spec).context("encoding the task spec")?;
            transaction
                .execute(
                    &format!(
                        "INSERT INTO {table} (task_id, user_id, status, prompt, negative_prompt,
                                              spec, price, submitted_at, stream_version, updated_at)
                         VALUES ($1, $2, 'submitted', $3, $4, $5, $6, $7, $8, $9)
                         ON CONFLICT (task_id) DO NOTHING"
                    ),
                    &[
                        &task_id,
                        &e.user_id.as_uuid(),
                        &e.prompt.as_str(),
                        &e.negative_prompt.as_str(),
                        &spec,
                        &e.price.as_decimal(),
                        &e.at,
                        &version,
                        &at,
                    ],
                )
                .await
                .context("inserting a task")?;
            continue;
        }
        // Every other event updates the row (an abandoned task never had one: nothing happens).
        let (assignments, values): (
            &str,
            Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>,
        ) = match &event {
            TaskEvent::Submitted(_) => unreachable!("handled above"),
            TaskEvent::Queued(e) => (
                "status = 'queued', queue_score = $4",
                vec![Box::new(e.score)],
            ),
            TaskEvent::Prioritised(e) => (
                "queue_score = $4, prioritised = prioritised + 1",
                vec![Box::new(e.to_score)],
            ),
            TaskEvent::PrioritisationAbandoned(_)
            | TaskEvent::Abandoned(_)
            | TaskEvent::Adopted(_) => ("", vec![]),
            TaskEvent::CancelRequested(_) => ("cancel_requested = true", vec![]),
            TaskEvent::Cancelled(e) => (
                "status = 'cancelled', queue_score = NULL, finished_at = $4",
                vec![Box::new(e.at)],
            ),
            TaskEvent::Dispatched(e) => (
                "status = 'dispatched', queue_score = NULL, backend = $4, prompt_id = $5",
                vec![Box::new(e.backend.clone()), Box::new(e.prompt_id)],
            ),
            TaskEvent::Started(_) => ("status = 'running'", vec![]),
            TaskEvent::Succeeded(e) => (
                "status = 'succeeded', images = $4, finished_at = $5",
                vec![
                    Box::new(serde_json::to_value(&e.images).context("encoding images")?),
                    Box::new(e.at),
                ],
            ),
            TaskEvent::Failed(e) => (
                "status = 'failed', failure_reason = $4, finished_at = $5",
                vec![Box::new(e.reason.clone()), Box::new(e.at)],
            ),
        };
        let separator = if assignments.is_empty() { "" } else { ", " };
        let statement = format!(
            "UPDATE {table} SET {assignments}{separator}stream_version = $2, updated_at = $3
              WHERE task_id = $1 AND stream_version < $2"
        );
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            vec![&task_id, &version, &at];
        for value in &values {
            params.push(value.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync));
        }
        transaction
            .execute(&statement, &params)
            .await
            .with_context(|| format!("applying {} to a task", recorded.event_type))?;
    }
    Ok(())
}
