//! The task half of `audit verify`: the `tasks` read model against the task streams, and every
//! task against the money that belongs to it on its owner's account: its hold (hold id = task id)
//! and its prioritise fees (operation ids named by `TaskPrioritised` / `PrioritisationAbandoned`).
//!
//! What is checked, from one consistent prefix of the log (a hold is settled only after the end
//! of its task is recorded, so a settle in the prefix implies the end is in it too):
//! - a hold is settled only for a task that succeeded and released only for one that failed, was
//!   cancelled or abandoned; never while its task still waits or runs; at most once; for the
//!   task's price, on its owner's account;
//! - a task that ended has its hold settled or released, and a hold without a task was released
//!   (the sweeper abandons such a task), each within the settlement bound (a request or a
//!   dispatcher that died in between is resolved by the intent sweeper within
//!   `intent_resolve_after_ms + intent_sweep_interval_ms`); younger ones are still pending, not
//!   differences;
//! - a recorded move was charged once and never refunded; the fee of an abandoned move, if it was
//!   charged, was refunded (within the bound);
//! - each account's frozen points equal the sum of its open holds.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::Value;
use uuid::Uuid;
use zhihui_domain::account::{AccountEvent, AccountState, HoldStatus};
use zhihui_domain::task::{PrioritisationOutcome, Task, TaskEvent, TaskState, TaskStatus};
use zhihui_domain::{Decider, DomainEvent};

use super::Difference;
use crate::platform::event_store::RecordedEvent;

/// A `tasks` row: as read, or as its events say it must be (folded by the projection's rules).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TaskRow {
    user_id: Uuid,
    status: String,
    prompt: String,
    negative_prompt: String,
    spec: Value,
    price: Decimal,
    queue_score: Option<i64>,
    cancel_requested: bool,
    prioritised: i32,
    backend: Option<String>,
    prompt_id: Option<Uuid>,
    images: Value,
    failure_reason: Option<String>,
    stream_version: i64,
}

#[derive(Debug)]
struct FoldedTask {
    state: TaskState,
    /// `None`: no row is expected (a task abandoned before it was recorded has none).
    row: Option<TaskRow>,
    /// When its end (or its abandonment) was recorded.
    ended_at: Option<DateTime<Utc>>,
    /// When each abandoned move was recorded.
    abandoned_moves: HashMap<Uuid, DateTime<Utc>>,
}

#[derive(Debug)]
struct FoldedHold {
    owner: Uuid,
    amount: Decimal,
    frozen_at: DateTime<Utc>,
    settled: u32,
    released: u32,
}

#[derive(Debug)]
struct FoldedCharge {
    owner: Uuid,
    refunds: u32,
}

/// Task streams and the holds and charges of the account streams, folded side by side.
#[derive(Debug, Default)]
pub(super) struct TaskFold {
    tasks: HashMap<Uuid, FoldedTask>,
    holds: HashMap<Uuid, FoldedHold>,
    charges: HashMap<Uuid, FoldedCharge>,
}

impl TaskFold {
    /// `tasks_waiting` beside the rows the events make: each user's count of waiting tasks is
    /// the number of their tasks submitted or queued. A user whose count is 0 may have a row or
    /// none.
    pub(super) fn compare_waiting(
        &self,
        counted: &HashMap<Uuid, i32>,
        differences: &mut Vec<Difference>,
    ) {
        let mut expected: HashMap<Uuid, i32> = HashMap::new();
        for row in self.tasks.values().filter_map(|task| task.row.as_ref()) {
            if matches!(row.status.as_str(), "submitted" | "queued") {
                *expected.entry(row.user_id).or_default() += 1;
            }
        }
        let users: std::collections::BTreeSet<&Uuid> =
            expected.keys().chain(counted.keys()).collect();
        for user in users {
            let (events, count) = (
                expected.get(user).copied().unwrap_or(0),
                counted.get(user).copied().unwrap_or(0),
            );
            if events != count {
                differences.push(Difference {
                    read_model: "tasks_waiting",
                    key: user.to_string(),
                    detail: format!("counts {count} waiting tasks, the events {events}"),
                });
            }
        }
    }

    pub(super) fn task_event(
        &mut self,
        task_id: Uuid,
        recorded: &RecordedEvent,
        event: &TaskEvent,
    ) {
        let folded = self.tasks.entry(task_id).or_insert_with(|| FoldedTask {
            state: Task::initial_state(),
            row: None,
            ended_at: None,
            abandoned_moves: HashMap::new(),
        });
        let state = std::mem::take(&mut folded.state);
        folded.state = Task::evolve(state, event);
        let version = i64::try_from(recorded.stream_version).unwrap_or(i64::MAX);
        if let TaskEvent::Submitted(submitted) = event {
            folded.row = Some(TaskRow {
                user_id: submitted.user_id.as_uuid(),
                status: TaskStatus::Submitted.as_str().to_owned(),
                prompt: submitted.prompt.as_str().to_owned(),
                negative_prompt: submitted.negative_prompt.as_str().to_owned(),
                spec: serde_json::to_value(&submitted.spec).unwrap_or(Value::Null),
                price: submitted.price.as_decimal(),
                queue_score: None,
                cancel_requested: false,
                prioritised: 0,
                backend: None,
                prompt_id: None,
                images: Value::Array(Vec::new()),
                failure_reason: None,
                stream_version: version,
            });
        } else if let Some(row) = folded.row.as_mut() {
            row.stream_version = version;
            match event {
                TaskEvent::Submitted(_)
                | TaskEvent::PrioritisationAbandoned(_)
                | TaskEvent::Abandoned(_)
                | TaskEvent::Adopted(_) => {}
                TaskEvent::Queued(e) => {
                    row.status = TaskStatus::Queued.as_str().to_owned();
                    row.queue_score = Some(e.score);
                }
                TaskEvent::Prioritised(e) => {
                    row.queue_score = Some(e.to_score);
                    row.prioritised += 1;
                }
                TaskEvent::CancelRequested(_) => row.cancel_requested = true,
                TaskEvent::Cancelled(_) => {
                    row.status = TaskStatus::Cancelled.as_str().to_owned();
                    row.queue_score = None;
                }
                TaskEvent::Dispatched(e) => {
                    row.status = TaskStatus::Dispatched.as_str().to_owned();
                    row.queue_score = None;
                    row.backend = Some(e.backend.clone());
                    row.prompt_id = Some(e.prompt_id);
                }
                TaskEvent::Started(_) => row.status = TaskStatus::Running.as_str().to_owned(),
                TaskEvent::Succeeded(e) => {
                    row.status = TaskStatus::Succeeded.as_str().to_owned();
                    row.images = serde_json::to_value(&e.images).unwrap_or(Value::Null);
                }
                TaskEvent::Failed(e) => {
                    row.status = TaskStatus::Failed.as_str().to_owned();
                    row.failure_reason = Some(e.reason.clone());
                }
            }
        }
        match event {
            TaskEvent::Succeeded(_)
            | TaskEvent::Failed(_)
            | TaskEvent::Cancelled(_)
            | TaskEvent::Abandoned(_) => folded.ended_at = Some(recorded.recorded_at),
            TaskEvent::PrioritisationAbandoned(e) => {
                folded
                    .abandoned_moves
                    .insert(e.operation_id, recorded.recorded_at);
            }
            _ => {}
        }
    }

    pub(super) fn account_event(
        &mut self,
        owner: Uuid,
        recorded: &RecordedEvent,
        event: &AccountEvent,
    ) {
        match event {
            AccountEvent::Frozen(e) => {
                self.holds.insert(
                    e.hold_id,
                    FoldedHold {
                        owner,
                        amount: e.amount.as_decimal(),
                        frozen_at: recorded.recorded_at,
                        settled: 0,
                        released: 0,
                    },
                );
            }
            AccountEvent::HoldSettled(e) => {
                if let Some(hold) = self.holds.get_mut(&e.hold_id) {
                    hold.settled += 1;
                }
            }
            AccountEvent::HoldReleased(e) => {
                if let Some(hold) = self.holds.get_mut(&e.hold_id) {
                    hold.released += 1;
                }
            }
            AccountEvent::Charged(e) => {
                self.charges
                    .insert(e.operation_id, FoldedCharge { owner, refunds: 0 });
            }
            AccountEvent::Refunded(e) => {
                if let Some(charge) = self.charges.get_mut(&e.charge_operation_id) {
                    charge.refunds += 1;
                }
            }
            AccountEvent::Granted(_) | AccountEvent::Credited(_) => {}
        }
    }

    /// Compare with the `tasks` rows (task id -> row as read) and check every task against its
    /// money. `now` and `settle_within` decide what is still pending. Returns the number of
    /// pending settlements (younger than the bound; not differences).
    pub(super) fn compare<'a>(
        &self,
        rows: &HashMap<Uuid, TaskRow>,
        accounts: impl Iterator<Item = (Uuid, &'a AccountState)>,
        now: DateTime<Utc>,
        settle_within: chrono::Duration,
        differences: &mut Vec<Difference>,
    ) -> usize {
        let mut difference = |read_model: &'static str, key: String, detail: String| {
            differences.push(Difference {
                read_model,
                key,
                detail,
            });
        };
        let overdue = |since: DateTime<Utc>| now - since > settle_within;
        let mut pending = 0;

        // The read model.
        for (task_id, folded) in &self.tasks {
            match (rows.get(task_id), &folded.row) {
                (None, None) => {}
                (Some(_), None) => difference(
                    "tasks",
                    task_id.to_string(),
                    format!(
                        "row for a task the events say is {}",
                        folded.state.status.as_str()
                    ),
                ),
                (None, Some(_)) => {
                    difference("tasks", task_id.to_string(), "events without a row".into());
                }
                (Some(shown), Some(expected)) => {
                    if shown != expected {
                        difference(
                            "tasks",
                            task_id.to_string(),
                            format!("row says {shown:?}; the events say {expected:?}"),
                        );
                    }
                }
            }
        }
        for task_id in rows.keys().filter(|id| !self.tasks.contains_key(id)) {
            difference("tasks", task_id.to_string(), "row without any event".into());
        }

        // Each task against its hold.
        for (task_id, folded) in &self.tasks {
            let key = format!("task {task_id}");
            let status = folded.state.status;
            let Some(hold) = self.holds.get(task_id) else {
                // Submitted tasks froze their price first; only a task abandoned before its
                // freeze has no hold.
                if status != TaskStatus::Abandoned {
                    difference(
                        "holds",
                        key,
                        format!(
                            "the task is {} but no points were ever frozen for it",
                            status.as_str()
                        ),
                    );
                }
                continue;
            };
            if hold.settled + hold.released > 1 {
                difference(
                    "holds",
                    key.clone(),
                    format!(
                        "its hold was settled {} and released {} time(s): more than once",
                        hold.settled, hold.released
                    ),
                );
            }
            if let Some(owner) = folded.state.owner
                && owner.as_uuid() != hold.owner
            {
                difference(
                    "holds",
                    key.clone(),
                    format!(
                        "its hold is on account {} but the task is of user {owner}",
                        hold.owner
                    ),
                );
            }
            if let Some(price) = folded.state.price
                && price.as_decimal() != hold.amount
            {
                difference(
                    "holds",
                    key.clone(),
                    format!("its hold froze {} but the task costs {price}", hold.amount),
                );
            }
            let (should_settle, should_release) = match status {
                TaskStatus::Succeeded => (true, false),
                TaskStatus::Failed | TaskStatus::Cancelled | TaskStatus::Abandoned => (false, true),
                TaskStatus::Unknown
                | TaskStatus::Submitted
                | TaskStatus::Queued
                | TaskStatus::Dispatched
                | TaskStatus::Running => (false, false),
            };
            if hold.settled > 0 && !should_settle {
                difference(
                    "holds",
                    key.clone(),
                    format!(
                        "its points were deducted but the task is {}",
                        status.as_str()
                    ),
                );
            }
            if hold.released > 0 && !should_release {
                difference(
                    "holds",
                    key.clone(),
                    format!(
                        "its points were returned but the task is {}",
                        status.as_str()
                    ),
                );
            }
            let open = hold.settled == 0 && hold.released == 0;
            if open && (should_settle || should_release) {
                let since = folded.ended_at.unwrap_or(hold.frozen_at);
                if overdue(since) {
                    difference(
                        "holds",
                        key,
                        format!(
                            "the task is {} since {since} but its hold was never {}",
                            status.as_str(),
                            if should_settle { "settled" } else { "released" }
                        ),
                    );
                } else {
                    pending += 1;
                }
            }
        }
        // Holds whose task was never recorded: the sweeper abandons the task and releases them.
        for (hold_id, hold) in &self.holds {
            if self.tasks.contains_key(hold_id) {
                continue;
            }
            // (Holds of the account machinery's own tests have no task and end either way;
            // only one left open is a product failure.)
            if hold.settled == 0 && hold.released == 0 {
                if overdue(hold.frozen_at) {
                    difference(
                        "holds",
                        format!("hold {hold_id}"),
                        format!(
                            "frozen since {} for a task that was never recorded, never released",
                            hold.frozen_at
                        ),
                    );
                } else {
                    pending += 1;
                }
            }
        }

        // Prioritise fees.
        for (task_id, folded) in &self.tasks {
            for (operation_id, outcome) in &folded.state.prioritisations {
                let key = format!("task {task_id} move {operation_id}");
                let charge = self.charges.get(operation_id);
                match (outcome, charge) {
                    (PrioritisationOutcome::Moved, None) => difference(
                        "fees",
                        key,
                        "the task was moved but its fee was never charged".into(),
                    ),
                    (PrioritisationOutcome::Moved, Some(charge)) if charge.refunds > 0 => {
                        difference(
                            "fees",
                            key,
                            "the task was moved but its fee was refunded".into(),
                        );
                    }
                    (PrioritisationOutcome::Abandoned, Some(charge)) if charge.refunds == 0 => {
                        let since = folded
                            .abandoned_moves
                            .get(operation_id)
                            .copied()
                            .unwrap_or(now);
                        if overdue(since) {
                            difference(
                                "fees",
                                key,
                                "the move was abandoned but its fee was never refunded".into(),
                            );
                        } else {
                            pending += 1;
                        }
                    }
                    _ => {}
                }
                if let (Some(charge), Some(owner)) = (charge, folded.state.owner)
                    && charge.owner != owner.as_uuid()
                {
                    difference(
                        "fees",
                        format!("task {task_id} move {operation_id}"),
                        format!(
                            "the fee was charged to account {} but the task is of user {owner}",
                            charge.owner
                        ),
                    );
                }
            }
        }
        for (operation_id, charge) in &self.charges {
            if charge.refunds > 1 {
                difference(
                    "fees",
                    format!("charge {operation_id}"),
                    format!("refunded {} times", charge.refunds),
                );
            }
        }

        // Frozen points are the open holds.
        for (user_id, state) in accounts {
            let open: Decimal = state
                .holds
                .values()
                .filter(|hold| hold.status == HoldStatus::Open)
                .map(|hold| hold.amount.as_decimal())
                .sum();
            let frozen = state.balance.frozen.as_decimal();
            if open != frozen {
                difference(
                    "holds",
                    format!("account {user_id}"),
                    format!("frozen {frozen} but its open holds add up to {open}"),
                );
            }
        }
        pending
    }
}

impl TaskRow {
    pub(super) const COLUMNS: &'static str = "task_id, user_id, status, prompt, negative_prompt, \
        spec, price, queue_score, cancel_requested, prioritised, backend, prompt_id, images, \
        failure_reason, stream_version";

    /// From a row selected with [`TaskRow::COLUMNS`].
    pub(super) fn from_row(row: &tokio_postgres::Row) -> anyhow::Result<(Uuid, TaskRow)> {
        Ok((
            row.try_get(0)?,
            TaskRow {
                user_id: row.try_get(1)?,
                status: row.try_get(2)?,
                prompt: row.try_get(3)?,
                negative_prompt: row.try_get(4)?,
                spec: row.try_get(5)?,
                price: row.try_get(6)?,
                queue_score: row.try_get(7)?,
                cancel_requested: row.try_get(8)?,
                prioritised: row.try_get(9)?,
                backend: row.try_get(10)?,
                prompt_id: row.try_get(11)?,
                images: row.try_get(12)?,
                failure_reason: row.try_get(13)?,
                stream_version: row.try_get(14)?,
            },
        ))
    }
}

/// Decode a task event of the log.
pub(super) fn decode(recorded: &RecordedEvent) -> anyhow::Result<TaskEvent> {
    use anyhow::Context;
    TaskEvent::from_stored(
        &recorded.event_type,
        recorded.schema_version,
        &recorded.payload,
    )
    .with_context(|| format!("decoding event {}", recorded.id))
}
