//! The settlement reconciler: whatever a dead request, a dead dispatcher or a lost intent left
//! unsettled is settled, released or refunded once it is owed for `settlement_after_ms`, each
//! repair listed; nothing younger is touched.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;
use uuid::Uuid;
use zhihui::command::RetryPolicy;
use zhihui::settlements::{RepairKind, SettlementReconciler};
use zhihui::tasks::service::{CrashPoint, TaskServiceError};
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::{Amount, Points};
use zhihui_domain::task::{Task, TaskCommand, TaskStatus, task_stream};
use zhihui_domain::user::UserId;

use crate::helpers::spawn_app;
use crate::tasks::{account_of, funded_user, metadata, project_and_verify, submitted_id};

async fn run_task_command(
    services: &zhihui::startup::AppState,
    task_id: Uuid,
    command: TaskCommand,
) {
    zhihui::command::execute::<Task>(
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
