//! The settlement reconciler: whatever a dead request, a dead dispatcher or a lost intent left
//! unsettled is settled, released or refunded once it is owed for `settlement_after_ms`, each
//! repair listed; nothing younger is touched.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;
use uuid::Uuid;
use zhihui::platform::command::RetryPolicy;
use zhihui::points::settlements::{RepairKind, SettlementReconciler};
use zhihui::tasks::service::{CrashPoint, TaskServiceError};
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::{Amount, Points};
use zhihui_domain::task::{Task, TaskCommand, TaskStatus, task_stream};
use zhihui_domain::user::UserId;

use crate::helpers::spawn_app;
use crate::tasks::{account_of, funded_user, metadata, project_and_verify, submitted_id};

async fn run_task_command(services: &zhihui::state::AppState, task_id: Uuid, command: TaskCommand) {
    zhihui::platform::command::execute::<Task>(
        &services.event_store,
        &task_stream(task_id),
        &command,
        &metadata(),
        RetryPolicy::default(),
    )
    .await
    .unwrap();
}

/// Intents are the normal net under crashed requests; here they are lost too (deleted), so only
/// the reconciler is left.
async fn lose_every_intent(app: &crate::helpers::TestApp) {
    crate::helpers::connect(&app.settings)
        .await
        .execute("DELETE FROM task_intents", &[])
        .await
        .unwrap();
}

#[tokio::test]
async fn the_reconciler_repairs_every_unsettled_end_once_it_is_owed_and_lists_each_repair() {
    let app = spawn_app().await;
    let other = app.another_instance().await;
    let (user, token) = funded_user(&app, "left-behind", "30").await;
    let user_id = UserId::from_uuid(Uuid::parse_str(&user).unwrap());
    let services = app.services_on_app_clock();

    // 1. Succeeded, never settled: the dispatcher died between the task and the account.
    let succeeded = Uuid::parse_str(&submitted_id(&other, &token, "succeeded").await).unwrap();
    let claimed = services
        .tasks
        .claim_next("gpu-0", 0, &metadata())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.task_id, succeeded);
    for command in [
        TaskCommand::Start {
            fencing_token: 0,
            at: app.clock.now(),
        },
        TaskCommand::Succeed {
            images: vec![],
            fencing_token: 0,
            at: app.clock.now(),
        },
    ] {
        run_task_command(&services, succeeded, command).await;
    }

    // 2. Cancelled in its stream; the request died before releasing.
    let cancelled = Uuid::parse_str(&submitted_id(&app, &token, "cancelled").await).unwrap();
    let crashed = services
        .tasks
        .crashing_at(CrashPoint::AfterCancelRecorded)
        .cancel(user_id, cancelled, &metadata())
        .await;
    assert!(matches!(crashed, Err(TaskServiceError::Crashed(_))));

    // 3. A prioritise charged, then abandoned; the request died before the refund.
    let _ahead = submitted_id(&other, &token, "ahead").await;
    let moved = Uuid::parse_str(&submitted_id(&app, &token, "moved").await).unwrap();
    let crashed = services
        .tasks
        .crashing_at(CrashPoint::AfterCharge)
        .prioritise(user_id, moved, None, &metadata())
        .await;
    assert!(matches!(crashed, Err(TaskServiceError::Crashed(_))));
    let operation = fee_operation(&app, &user).await;
    run_task_command(
        &services,
        moved,
        TaskCommand::AbandonPrioritisation {
            operation_id: operation,
            at: app.clock.now(),
        },
    )
    .await;

    // 4. A task abandoned as never recorded, whose slow request froze its points afterwards.
    let late = Uuid::now_v7();
    run_task_command(
        &services,
        late,
        TaskCommand::Abandon {
            reason: "the request that submitted this task failed before recording it".into(),
            at: app.clock.now(),
        },
    )
    .await;
    services
        .accounts
        .execute(
            &account_stream(user_id),
            AccountCommand::Freeze {
                hold_id: late,
                amount: Amount::whole(2),
                at: app.clock.now(),
            },
            metadata(),
        )
        .await
        .unwrap();
    lose_every_intent(&app).await;

    let account = account_of(&app, &user).await;
    // 30 - 4 tasks (one of two points) - the fee.
    assert_eq!(account.balance.available, Points::whole(30 - 6 - 5));
    assert_eq!(account.balance.frozen, Points::whole(6));

    // In a third process: nothing is owed for long enough yet, so nothing is touched.
    app.project().await;
    let reconciler_process = app.services_on_app_clock();
    let reconciler = SettlementReconciler::new(
        reconciler_process.tasks.clone(),
        reconciler_process.codes.clone(),
        reconciler_process.checkins.clone(),
        reconciler_process.promotions.clone(),
        reconciler_process.pg_pool.clone(),
        reconciler_process.clock.clone(),
    );
    let early = reconciler.reconcile_once().await.unwrap();
    assert_eq!((early.examined, early.repairs.len()), (0, 0));

    app.clock.advance(Duration::from_millis(
        app.settings.tasks.settlement_after_ms + 1,
    ));
    let pass = reconciler.reconcile_once().await.unwrap();
    assert_eq!(pass.failures, 0);
    let repaired: HashSet<(RepairKind, Uuid)> = pass
        .repairs
        .iter()
        .filter_map(|repair| Some((repair.kind, repair.task_id?)))
        .collect();
    assert_eq!(
        repaired,
        HashSet::from([
            (RepairKind::HoldSettled, succeeded),
            (RepairKind::HoldReleased, cancelled),
            (RepairKind::FeeRefunded, moved),
            (RepairKind::HoldReleased, late),
        ])
    );
    assert_eq!(reconciler.repairs_total(), 4);
    // Two tasks still queued keep their points frozen; everything else is settled.
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.available, Points::whole(30 - 1 - 2));
    assert_eq!(account.balance.frozen, Points::whole(2));
    assert_eq!(
        services.tasks.load(cancelled).await.unwrap().status,
        TaskStatus::Cancelled
    );

    // Repaired rows close once projected: the next pass finds nothing, and the books agree.
    app.project().await;
    let again = reconciler.reconcile_once().await.unwrap();
    assert_eq!((again.examined, again.repairs.len()), (0, 0));
    project_and_verify(&app).await;
    let listed = app.cli(&["audit", "repairs", "--json"]);
    assert!(listed.status.success());
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 4, "{listed}");
    assert!(listed.as_array().unwrap().iter().any(|repair| {
        repair["kind"] == "fee_refunded" && repair["operation_id"] == operation.to_string()
    }));
}

/// The operation id of the one prioritise fee charged on the user's account.
async fn fee_operation(app: &crate::helpers::TestApp, user: &str) -> Uuid {
    let account = account_of(app, user).await;
    let charges: Vec<Uuid> = account
        .operations
        .iter()
        .filter(|(_, operation)| {
            matches!(operation, zhihui_domain::account::Operation::Charge { .. })
        })
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(charges.len(), 1);
    charges[0]
}

/// The settlements projection writes a batch as two statements (its deletes, then one upsert of
/// what the batch leaves of each row). Whatever the batch's length and order, that must leave
/// the rows that the rules applied one event at a time leave: here the oracle is the statements
/// the projection ran per event before (kept below as they were), run on the same database.
/// Random sequences over a few rows, each split into random batches; every change kind may
/// follow every other, a row may close and open again, and a due may come before its open (a
/// task abandoned before its freeze was seen).
#[tokio::test]
async fn a_batch_of_settlement_changes_leaves_the_rows_the_changes_leave_one_by_one() {
    use chrono::{Duration as Span, TimeZone, Utc};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use zhihui_projections::Tables;
    use zhihui_projections::settlements::{Change, apply_changes};

    let app = spawn_app().await;
    let mut client = crate::helpers::connect(&app.settings).await;
    // The oracle: the per-event statements as the projection ran them until it batched.
    client
        .batch_execute(
            "CREATE TABLE oracle (LIKE open_settlements INCLUDING ALL);
             CREATE FUNCTION oracle_open(k text, i uuid, t uuid, u uuid) RETURNS void
               LANGUAGE sql AS $$
                 INSERT INTO oracle (kind, id, task_id, user_id, opened) VALUES (k, i, t, u, true)
                 ON CONFLICT (kind, id) DO UPDATE
                    SET opened = true, user_id = EXCLUDED.user_id,
                        task_id = COALESCE(oracle.task_id, EXCLUDED.task_id) $$;
             CREATE FUNCTION oracle_due(k text, i uuid, t uuid, a timestamptz) RETURNS void
               LANGUAGE sql AS $$
                 INSERT INTO oracle (kind, id, task_id, due_since) VALUES (k, i, t, a)
                 ON CONFLICT (kind, id) DO UPDATE
                    SET task_id = EXCLUDED.task_id,
                        due_since = COALESCE(oracle.due_since, EXCLUDED.due_since) $$;
             CREATE FUNCTION oracle_close(k text, i uuid) RETURNS void
               LANGUAGE sql AS $$ DELETE FROM oracle WHERE kind = k AND id = i $$;",
        )
        .await
        .unwrap();
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    let tasks: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    let users: Vec<Uuid> = (0..2).map(|_| Uuid::now_v7()).collect();
    let epoch = Utc.with_ymd_and_hms(2026, 11, 27, 8, 0, 0).unwrap();
    let mut rng = StdRng::seed_from_u64(20_261_127);
    let rows = |table: &'static str| {
        format!(
            "SELECT kind, id, task_id, user_id, opened, due_since FROM {table} ORDER BY kind, id"
        )
    };
    let mut sequences_with_reopened_rows = 0;
    for sequence in 0..300 {
        let length = rng.random_range(1..=12);
        let changes: Vec<Change> = (0..length)
            .map(|step| {
                let kind = if rng.random_bool(0.5) { "hold" } else { "fee" };
                let id = ids[rng.random_range(0..ids.len())];
                let task_id = tasks[rng.random_range(0..tasks.len())];
                match rng.random_range(0..3) {
                    0 => Change::Open {
                        kind,
                        id,
                        task_id: (kind == "hold").then_some(task_id),
                        user_id: users[rng.random_range(0..users.len())],
                    },
                    1 => Change::Due {
                        kind,
                        id,
                        task_id,
                        at: epoch + Span::seconds(sequence * 100 + step),
                    },
                    _ => Change::Close { kind, id },
                }
            })
            .collect();
        let closes_then_writes = changes.iter().enumerate().any(|(at, change)| {
            matches!(change, Change::Close { .. })
                && changes[at + 1..]
                    .iter()
                    .any(|later| !matches!(later, Change::Close { .. }))
        });
        sequences_with_reopened_rows += usize::from(closes_then_writes);

        let transaction = client.transaction().await.unwrap();
        // Rows left from before the batch, as the projection meets them: some open, some owed.
        for (index, id) in ids.iter().enumerate() {
            if rng.random_bool(0.5) {
                for table in ["open_settlements", "oracle"] {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {table} (kind, id, task_id, user_id, opened, due_since)
                                 VALUES ('hold', $1, $2, $3, $4, $5)"
                            ),
                            &[
                                id,
                                &tasks[index],
                                &users[index % users.len()],
                                &(index != 1),
                                &(index == 2).then_some(epoch),
                            ],
                        )
                        .await
                        .unwrap();
                }
            }
        }
        for change in &changes {
            match change {
                Change::Open {
                    kind,
                    id,
                    task_id,
                    user_id,
                } => transaction
                    .execute(
                        "SELECT oracle_open($1, $2, $3, $4)",
                        &[kind, id, task_id, user_id],
                    )
                    .await
                    .unwrap(),
                Change::Due {
                    kind,
                    id,
                    task_id,
                    at,
                } => transaction
                    .execute(
                        "SELECT oracle_due($1, $2, $3, $4)",
                        &[kind, id, task_id, at],
                    )
                    .await
                    .unwrap(),
                Change::Close { kind, id } => transaction
                    .execute("SELECT oracle_close($1, $2)", &[kind, id])
                    .await
                    .unwrap(),
            };
        }
        // The same changes through the projection, cut into batches at random.
        let mut rest = changes.as_slice();
        while !rest.is_empty() {
            let (batch, after) = rest.split_at(rng.random_range(1..=rest.len()));
            apply_changes(&transaction, &Tables::LIVE, batch)
                .await
                .unwrap();
            rest = after;
        }
        let batched = transaction
            .query(&rows("open_settlements"), &[])
            .await
            .unwrap();
        let one_by_one = transaction.query(&rows("oracle"), &[]).await.unwrap();
        let shown = |rows: &[tokio_postgres::Row]| -> Vec<String> {
            rows.iter()
                .map(|row| {
                    format!(
                        "{} {} {:?} {:?} {} {:?}",
                        row.get::<_, String>(0),
                        row.get::<_, Uuid>(1),
                        row.get::<_, Option<Uuid>>(2),
                        row.get::<_, Option<Uuid>>(3),
                        row.get::<_, bool>(4),
                        row.get::<_, Option<chrono::DateTime<Utc>>>(5),
                    )
                })
                .collect()
        };
        assert_eq!(
            shown(&batched),
            shown(&one_by_one),
            "sequence {sequence}: {changes:?}"
        );
        transaction.rollback().await.unwrap();
    }
    // The sequences did reach the case a fold gets wrong most easily.
    assert!(
        sequences_with_reopened_rows > 20,
        "{sequences_with_reopened_rows}"
    );
}
