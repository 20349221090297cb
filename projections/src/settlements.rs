//! `open_settlements`: the holds and prioritise fees not settled yet, from the account and the
//! task streams in global order (see `migrations/V6__settlements.sql`). The settlement
//! reconciler reads the rows that are owed (the task ended, the hold is still open) and repairs
//! them; everything else here only opens and closes rows.
//!
//! The order of events makes the rules simple: a hold is frozen before its task is recorded and
//! settled or released only after its task's end is recorded; a fee is charged before its move is
//! recorded and refunded only after its prioritise is abandoned. A task abandoned before it was
//! recorded may see its freeze later (a slow request): the row then opens already owed.

use std::collections::HashMap;

use anyhow::Context;
use chrono::{DateTime, Utc};
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::AccountEvent;
use zhihui_domain::task::{TaskEvent, task_id_of_stream};

use crate::accounts::account_user_id;
use crate::{ProjectedEvent, Tables};

/// What one event does to the rows.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub enum Change {
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
    let changes: Vec<Change> = events
        .iter()
        .map(change_of)
        .filter_map(Result::transpose)
        .collect::<anyhow::Result<_>>()?;
    apply_changes(transaction, tables, &changes).await
}

/// A row of `open_settlements`: its kind and id.
type Key = (&'static str, Uuid);

/// One row's net change over a batch (see [`fold`]).
#[derive(Debug, Default)]
struct Net {
    /// A close came: the row is deleted before anything after it is written.
    deleted: bool,
    /// Anything after the last close: the row is then written.
    written: bool,
    opened: bool,
    /// The last open's account.
    user_id: Option<Uuid>,
    /// The last due's task: it replaces the row's.
    due_task_id: Option<Uuid>,
    /// The first open's task (a fee has none): it fills the row's only where that has none.
    open_task_id: Option<Uuid>,
    /// The first due's time: it fills the row's only where that has none.
    due_since: Option<DateTime<Utc>>,
}

/// The rows to delete and the rows to write of a batch of changes, one entry per row: what
/// applying the changes one by one, in order, leaves, given the rules of each (an open sets
/// `opened`, the account, and the task where the row has none; a due sets the task and the due
/// time where the row has none; a close deletes the row). A close makes whatever came before it
/// in the batch moot; what comes after starts from no row.
fn fold(changes: &[Change]) -> (Vec<Key>, Vec<(Key, Net)>) {
    let mut order: Vec<Key> = Vec::new();
    let mut nets: HashMap<Key, Net> = HashMap::new();
    for change in changes {
        let key = match change {
            Change::Open { kind, id, .. } | Change::Due { kind, id, .. } => (*kind, *id),
            Change::Close { kind, id } => (*kind, *id),
        };
        let net = nets.entry(key).or_insert_with(|| {
            order.push(key);
            Net::default()
        });
        match change {
            Change::Open {
                task_id, user_id, ..
            } => {
                net.written = true;
                net.opened = true;
                net.user_id = Some(*user_id);
                net.open_task_id = net.open_task_id.or(*task_id);
            }
            Change::Due { task_id, at, .. } => {
                net.written = true;
                net.due_task_id = Some(*task_id);
                net.due_since = net.due_since.or(Some(*at));
            }
            Change::Close { .. } => {
                *net = Net {
                    deleted: true,
                    ..Net::default()
                }
            }
        }
    }
    let deletes = order
        .iter()
        .filter(|key| nets[*key].deleted)
        .copied()
        .collect();
    let writes = order
        .into_iter()
        .filter_map(|key| {
            let net = nets.remove(&key)?;
            net.written.then_some((key, net))
        })
        .collect();
    (deletes, writes)
}

/// Apply `changes`, in their order, as two statements whatever their number: the deletes, then
/// one upsert of every row written (see [`fold`]). A due's task replaces the row's, an open's
/// only fills it, so the upsert tells them apart by the due time, which every due brings.
#[doc(hidden)]
pub async fn apply_changes(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    changes: &[Change],
) -> anyhow::Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    let table = tables.name("open_settlements");
    let (deletes, writes) = fold(changes);
    // Each statement is idempotent, so a batch applied again (it never is: the checkpoint
    // commits with it) would leave the same rows. Sent together, they run in the order sent.
    let delete_kinds: Vec<&str> = deletes.iter().map(|(kind, _)| *kind).collect();
    let delete_ids: Vec<Uuid> = deletes.iter().map(|(_, id)| *id).collect();
    let delete = async {
        if deletes.is_empty() {
            return Ok(0);
        }
        transaction
            .execute(
                &format!(
                    "DELETE FROM {table} AS s USING unnest($1::text[], $2::uuid[]) AS d(kind, id)
                      WHERE s.kind = d.kind AND s.id = d.id"
                ),
                &[&delete_kinds, &delete_ids],
            )
            .await
    };
    let kinds: Vec<&str> = writes.iter().map(|((kind, _), _)| *kind).collect();
    let ids: Vec<Uuid> = writes.iter().map(|((_, id), _)| *id).collect();
    let task_ids: Vec<Option<Uuid>> = writes
        .iter()
        .map(|(_, net)| net.due_task_id.or(net.open_task_id))
        .collect();
    let user_ids: Vec<Option<Uuid>> = writes.iter().map(|(_, net)| net.user_id).collect();
    let opened: Vec<bool> = writes.iter().map(|(_, net)| net.opened).collect();
    let due_since: Vec<Option<DateTime<Utc>>> =
        writes.iter().map(|(_, net)| net.due_since).collect();
    let write = async {
        if writes.is_empty() {
            return Ok(0);
        }
        transaction
            .execute(
                &format!(
                    "INSERT INTO {table} AS s (kind, id, task_id, user_id, opened, due_since)
                     SELECT * FROM unnest($1::text[], $2::uuid[], $3::uuid[], $4::uuid[],
                                          $5::bool[], $6::timestamptz[])
                     ON CONFLICT (kind, id) DO UPDATE
                        SET opened = s.opened OR EXCLUDED.opened,
                            user_id = COALESCE(EXCLUDED.user_id, s.user_id),
                            task_id = CASE WHEN EXCLUDED.due_since IS NOT NULL
                                           THEN EXCLUDED.task_id
                                           ELSE COALESCE(s.task_id, EXCLUDED.task_id) END,
                            due_since = COALESCE(s.due_since, EXCLUDED.due_since)"
                ),
                &[&kinds, &ids, &task_ids, &user_ids, &opened, &due_since],
            )
            .await
    };
    futures::future::try_join(delete, write)
        .await
        .context("writing settlements")?;
    Ok(())
}
