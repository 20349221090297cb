//! `zhihui audit verify` against tasks: sabotage of the money a task owns (a hold settled for a
//! task that never succeeded, a fee refunded though its move stands, a hold never released after
//! a cancel, an orphan hold) and of the `tasks` read model is found and named; settlements still
//! within the bound are pending, not differences.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use serde_json::Value;
use uuid::Uuid;
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::task::{Canceller, Task, TaskCommand, task_stream};
use zhihui_domain::user::UserId;

use crate::helpers::spawn_app;
use crate::tasks::{act, funded_user, metadata, project_and_verify, submitted_id};

#[tokio::test]
async fn audit_verify_finds_tasks_and_holds_that_disagree_with_their_money() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "mallory", "40").await;
    let user_id = UserId::from_uuid(Uuid::parse_str(&user).unwrap());
    let services = app.services_on_app_clock();
    let account = account_stream(user_id);
    let first = submitted_id(&app, &token, "first").await;
    let second = submitted_id(&app, &token, "second").await;
    let third = submitted_id(&app, &token, "third").await;
    let fourth = submitted_id(&app, &token, "fourth").await;
    let moved = act(&app, &token, "prioritise", &fourth).await;
    assert_eq!(moved.status(), 200);
    let moved: Value = moved.json().await.unwrap();
    let move_id = Uuid::parse_str(moved["operation_id"].as_str().unwrap()).unwrap();
    // Honest so far.
    project_and_verify(&app).await;

    // The first task waits in the queue, but its points were deducted.
    services
        .accounts
        .execute(
            &account,
            AccountCommand::SettleHold {
                hold_id: Uuid::parse_str(&first).unwrap(),
                at: app.clock.now(),
            },
            metadata(),
        )
        .await
        .unwrap();
    // The fourth was moved ahead, and its fee given back anyway.
    services
        .accounts
        .execute(
            &account,
            AccountCommand::Refund {
                operation_id: Uuid::now_v7(),
                charge_operation_id: move_id,
                reason: "sabotage".into(),
                at: app.clock.now(),
            },
            metadata(),
        )
        .await
        .unwrap();
    // The second is cancelled in its stream; the request died before releasing its points.
    zhihui::platform::command::execute::<Task>(
        &services.event_store,
        &task_stream(Uuid::parse_str(&second).unwrap()),
        &TaskCommand::Cancel {
            by: Canceller::User(user_id),
            at: app.clock.now(),
        },
        &metadata(),
        zhihui::platform::command::RetryPolicy::default(),
    )
    .await
    .unwrap();
    // Points frozen for a task that was never recorded (a submit that died at once).
    let orphan = Uuid::now_v7();
    services
        .accounts
        .execute(
            &account,
            AccountCommand::Freeze {
                hold_id: orphan,
                amount: Amount::whole(1),
                at: app.clock.now(),
            },
            metadata(),
        )
        .await
        .unwrap();
    app.project().await;
    // The third's row is edited behind the projection's back.
    let client = crate::helpers::connect(&app.settings).await;
    client
        .execute(
            "UPDATE tasks SET status = 'succeeded' WHERE task_id = $1",
            &[&Uuid::parse_str(&third).unwrap()],
        )
        .await
        .unwrap();

    let keys = |verified: &zhihui::cli::audit::Verified| -> BTreeSet<String> {
        verified
            .differences
            .iter()
            .map(|difference| format!("{} {}", difference.read_model, difference.key))
            .collect()
    };
    // Within the settlement bound the cancelled task's hold and the orphan are pending.
    let verified = app.verify(None).await;
    assert_eq!(
        keys(&verified),
        BTreeSet::from([
            format!("holds task {first}"),
            format!("fees task {fourth} move {move_id}"),
            format!("tasks {third}"),
        ]),
        "{:#?}",
        verified.differences
    );
    assert_eq!(verified.pending_settlements, 2);
    let deducted = verified
        .differences
        .iter()
        .find(|difference| difference.key == format!("task {first}"))
        .unwrap();
    assert!(
        deducted.detail.contains("deducted but the task is queued"),
        "{deducted}"
    );

    // Past the bound they are differences too.
    let verified = app.verify(Some(chrono::Duration::zero())).await;
    assert_eq!(
        keys(&verified),
        BTreeSet::from([
            format!("holds task {first}"),
            format!("holds task {second}"),
            format!("holds hold {orphan}"),
            format!("fees task {fourth} move {move_id}"),
            format!("tasks {third}"),
        ]),
        "{:#?}",
        verified.differences
    );
    assert_eq!(verified.pending_settlements, 0);

    // The user's count of waiting tasks (what the queue limit reads) moved behind the
    // projection's back: named too, beside what the events say.
    client
        .execute(
            "UPDATE tasks_waiting SET waiting = waiting + 5 WHERE user_id = $1",
            &[&user_id.as_uuid()],
        )
        .await
        .unwrap();
    let verified = app.verify(Some(chrono::Duration::zero())).await;
    let counted = verified
        .differences
        .iter()
        .find(|difference| difference.read_model == "tasks_waiting")
        .expect("the changed count is a difference");
    assert_eq!(counted.key, user_id.to_string());
    // First, third (its row edited, its events still queued) and fourth wait; second was cancelled.
    assert!(
        counted
            .detail
            .contains("counts 8 waiting tasks, the events 3"),
        "{counted}"
    );

    // The command names them and fails.
    let output = app.cli(&["audit", "verify"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("DIFFERENCE holds task {first}: ")),
        "{stdout}"
    );
    assert!(
        stdout.contains("2 settlement(s) pending within the bound"),
        "{stdout}"
    );
}
