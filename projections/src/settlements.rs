//! `open_settlements`: the holds and prioritise fees not settled yet, from the account and the
//! task streams in global order (see `migrations/V6__settlements.sql`). The settlement
//! reconciler reads the rows that are owed (the task ended, the hold is still open) and repairs
//! them; everything else here only opens and closes rows.
//!
//! The order of events makes the rules simple: a hold is frozen before its task is recorded and
//! settled or released only after its task's end is recorded; a fee is charged before its move is
//! recorded and refunded only after its prioritise is abandoned. A task abandoned before it was
//! recorded may see its freeze later (a slow request): the row then opens already owed.

use anyhow::Context;
use chrono::{DateTime, Utc};
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::AccountEvent;
use zhihui_domain::task::{TaskEvent, task_id_of_stream};

use crate::accounts::account_user_id;
use crate::{ProjectedEvent, Tables};

/// What one event does to the rows.
enum Change {
    /// A freeze or a charge: the row is open on this account.
    Open {
        kind: &'static str,
        id: Uuid,
        task_id: Option<Uuid>,
        user_id: Uuid,
    },
    /// A task ended or a prioritise was abandoned: the row is owed from now on.
    Due {
        kind: &'static str,
        id: Uuid,
        task_id: Uuid,
        at: DateTime<Utc>,
    },
    /// Settled, released, refunded, or the fee earned by a recorded move.
    Close { kind: &'static str, id: Uuid },
}

fn change_of(recorded: &ProjectedEvent) -> anyhow::Result<Option<Change>> {
    let context = || format!("event {} of {}", recorded.id, recorded.stream);
    if let Some(user_id) = account_user_id(&recorded.stream) {
        let event = AccountEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )
        .with_context(context)?;
        return Ok(match event {
            AccountEvent::Frozen(e) => Some(Change::Open {
                kind: "hold",
                id: e.hold_id,
                task_id: Some(e.hold_id),
                user_id,
            }),
            AccountEvent::HoldSettled(e) => Some(Change::Close {
                kind: "hold",
                id: e.hold_id,
            }),
            AccountEvent::HoldReleased(e) => Some(Change::Close {
                kind: "hold",
                id: e.hold_id,
            }),
            AccountEvent::Charged(e) => Some(Change::Open {
                kind: "fee",
                id: e.operation_id,
                task_id: None,
                user_id,
            }),
            AccountEvent::Refunded(e) => Some(Change::Close {
                kind: "fee",
                id: e.charge_operation_id,
            }),
            AccountEvent::Granted(_) | AccountEvent::Credited(_) => None,
        });
    }
    let Some(task_id) = task_id_of_stream(&recorded.stream) else {
        return Ok(None);
    };
    let event = TaskEvent::from_stored(
        &recorded.event_type,
        recorded.schema_version,
        &recorded.payload,
    )
    .with_context(context)?;
    let ended = |at| {
        Some(Change::Due {
            kind: "hold",
            id: task_id,
            task_id,
            at,
        })
    };
    Ok(match event {
        TaskEvent::Succeeded(e) => ended(e.at),
        TaskEvent::Failed(e) => ended(e.at),
        TaskEvent::Cancelled(e) => ended(e.at),
        TaskEvent::Abandoned(e) => ended(e.at),
        TaskEvent::Prioritised(e) => Some(Change::Close {
            kind: "fee",
            id: e.operation_id,
        }),
        TaskEvent::PrioritisationAbandoned(e) => Some(Change::Due {
            kind: "fee",
            id: e.operation_id,
            task_id,
            at: e.at,
        }),
        TaskEvent::Submitted(_)
        | TaskEvent::Queued(_)
        | TaskEvent::CancelRequested(_)
        | TaskEvent::Dispatched(_)
        | TaskEvent::Adopted(_)
        | TaskEvent::Started(_) => None,
    })
}

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let table = tables.name("open_settlements");
    let changes: Vec<Change> = events
        .iter()
        .map(change_of)
        .filter_map(Result::transpose)
        .collect::<anyhow::Result<_>>()?;
    if changes.is_empty() {
        return Ok(());
    }
    // Each statement is idempotent, so a batch applied again (it never is: the checkpoint
    // commits with it) would leave the same rows. Prepared once per batch and sent together:
    // the server runs them in the order sent (the order of the events, which the rules need),
    // in one round trip instead of two per event.
    let (open, due, close) = futures::future::try_join3(
        transaction.prepare(&format!(
            "INSERT INTO {table} (kind, id, task_id, user_id, opened)
             VALUES ($1, $2, $3, $4, true)
             ON CONFLICT (kind, id) DO UPDATE
                SET opened = true, user_id = EXCLUDED.user_id,
                    task_id = COALESCE({table}.task_id, EXCLUDED.task_id)"
        )),
        transaction.prepare(&format!(
            "INSERT INTO {table} (kind, id, task_id, due_since)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (kind, id) DO UPDATE
                SET task_id = EXCLUDED.task_id,
                    due_since = COALESCE({table}.due_since, EXCLUDED.due_since)"
        )),
        transaction.prepare(&format!("DELETE FROM {table} WHERE kind = $1 AND id = $2")),
    )
    .await
    .context("preparing the settlements' statements")?;
    type Params<'a> = Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)>;
    let statements: Vec<(&tokio_postgres::Statement, Params<'_>)> = changes
        .iter()
        .map(|change| match change {
            Change::Open {
                kind,
                id,
                task_id,
                user_id,
            } => (&open, vec![kind as _, id as _, task_id as _, user_id as _]),
            Change::Due {
                kind,
                id,
                task_id,
                at,
            } => (&due, vec![kind as _, id as _, task_id as _, at as _]),
            Change::Close { kind, id } => (&close, vec![kind as _, id as _]),
        })
        .collect();
    let writes = statements
        .iter()
        .map(|(statement, params)| transaction.execute(*statement, params));
    futures::future::try_join_all(writes)
        .await
        .context("writing settlements")?;
    Ok(())
}
