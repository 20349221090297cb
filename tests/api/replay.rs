//! `zhihui replay` rebuilds read models equal to the live ones and swaps them in, also when the
//! live runner moved on during the rebuild; the inspection commands (`audit account`,
//! `events show`, `events tail`) run as the real binary.

#![allow(clippy::unwrap_used)]

use serde_json::Value;
use uuid::Uuid;
use zhihui::cli::replay::Quiet;
use zhihui::platform::event_store::EventMetadata;
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;
use zhihui_projections::ProjectionName;

use crate::helpers::{TestApp, spawn_app};

fn metadata() -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: "test:replay".into(),
    }
}

/// `accounts`: a grant, then `holds` freezes of 1 point, every other one settled, the rest
/// released.
async fn activity(app: &TestApp, user: UserId, holds: usize) {
    let services = app.services();
    let at = app.clock.now();
    let stream = account_stream(user);
    let grant = AccountCommand::Grant {
        operation_id: Uuid::now_v7(),
        amount: Amount::whole(1_000),
        reason: "welcome".into(),
        at,
    };
    services
        .accounts
        .execute(&stream, grant, metadata())
        .await
        .unwrap();
    for n in 0..holds {
        let hold_id = Uuid::now_v7();
        let freeze = AccountCommand::Freeze {
            hold_id,
            amount: Amount::whole(1),
            at,
        };
        services
            .accounts
            .execute(&stream, freeze, metadata())
            .await
            .unwrap();
        let end = if n % 2 == 0 {
            AccountCommand::SettleHold { hold_id, at }
        } else {
            AccountCommand::ReleaseHold {
                hold_id,
                reason: "failed".into(),
                at,
            }
        };
        services
            .accounts
            .execute(&stream, end, metadata())
            .await
            .unwrap();
    }
}

/// Tasks of a new user: a grant of 10, three submits, one cancelled, one prioritised (6 account
/// events).
async fn task_activity(app: &TestApp) {
    let services = app.services();
    let user = UserId::from_uuid(Uuid::now_v7());
    services
        .accounts
        .execute(
            &zhihui_domain::account::account_stream(user),
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(10),
                reason: "tasks".into(),
                at: app.clock.now(),
            },
            metadata(),
        )
        .await
        .unwrap();
    let request = zhihui::tasks::catalog::RequestedTask {
        prompt: "a replayed cat".into(),
        ..Default::default()
    };
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let submitted = services
            .tasks
            .submit(user, &request, None, &metadata())
            .await
            .unwrap();
        tasks.push(submitted.task_id);
    }
    services
        .tasks
        .cancel(user, tasks[0], &metadata())
        .await
        .unwrap();
    services
        .tasks
        .prioritise(user, tasks[2], None, &metadata())
        .await
        .unwrap();
}

/// Every row of the read models and the live index names, in a stable order.
async fn snapshot(app: &TestApp) -> Vec<String> {
    let client = crate::helpers::connect(&app.settings).await;
    let mut rows = Vec::new();
    for query in [
        "SELECT row_to_json(a)::text FROM accounts a ORDER BY user_id",
        "SELECT row_to_json(l)::text FROM ledger_entries l ORDER BY user_id, stream_version",
        "SELECT row_to_json(u)::text FROM users u ORDER BY user_id",
        "SELECT row_to_json(t)::text FROM tasks t ORDER BY task_id",
        // A user whose count went back to 0 keeps a row live; a rebuild whose batch held both
        // moves writes none.
        "SELECT row_to_json(w)::text FROM tasks_waiting w WHERE waiting <> 0 ORDER BY user_id",
        "SELECT indexname || ' ' || tablename || ' ' || indexdef FROM pg_indexes
          WHERE tablename IN ('accounts', 'ledger_entries', 'users', 'tasks', 'tasks_waiting')
          ORDER BY indexname",
    ] {
        for row in client.query(query, &[]).await.unwrap() {
            rows.push(row.get::<_, String>(0));
        }
    }
    rows
}

async fn checkpoint_events(app: &TestApp, name: &str) -> i64 {
    let client = crate::helpers::connect(&app.settings).await;
    client
        .query_one(
            "SELECT events_applied FROM projection_checkpoints WHERE projection = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn replay_produces_read_models_equal_to_the_live_ones_and_keeps_index_names() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    app.register("bob", "correct horse battery").await;
    let alice = UserId::from_uuid(Uuid::parse_str(&alice).unwrap());
    activity(&app, alice, 30).await;
    activity(&app, UserId::from_uuid(Uuid::now_v7()), 5).await;
    Box::pin(task_activity(&app)).await;
    app.project().await;
    let live = snapshot(&app).await;
    assert!(live.len() > 70, "{}", live.len());

    let services = app.services();
    for projection in ProjectionName::ALL {
        // A small page size, so that the rebuild takes many pages.
        let report = zhihui::cli::replay::replay(
            &services.pg_pool,
            &services.event_store,
            projection,
            &app.settings.projections,
            7,
            &mut Quiet,
        )
        .await
        .unwrap();
        // This test makes no redeem codes, check-ins, promotions or works: those projections have
        // nothing to rebuild.
        assert!(
            report.events > 0
                || matches!(
                    projection,
                    ProjectionName::Codes
                        | ProjectionName::Checkins
                        | ProjectionName::Promotions
                        | ProjectionName::Gallery
                )
        );
    }
    assert_eq!(snapshot(&app).await, live);
    assert_eq!(
        checkpoint_events(&app, "ledger").await,
        1 + 2 * 30 + 1 + 2 * 5 + 6
    );
    // The live runner goes on from the swapped-in checkpoint.
    activity(&app, alice, 1).await;
    app.project().await;
    let differences = app.verify(None).await.differences;
    assert!(differences.is_empty(), "{differences:?}");
}

/// A page the replay cannot prepare (an event this build cannot read) is applied with the
/// runner's retries, which name the event; nothing is swapped in and the live tables stay.
#[tokio::test]
async fn a_replay_stops_at_a_poison_event_naming_it_and_swaps_nothing_in() {
    let app = spawn_app().await;
    let user = UserId::from_uuid(Uuid::now_v7());
    activity(&app, user, 4).await;
    app.project().await;
    let live = snapshot(&app).await;
    let services = app.services();
    let stream = account_stream(user);
    use zhihui::platform::event_store::EventStore;
    // Stored after the live runner passed (it never sees it in this test).
    services
        .event_store
        .append(
            &stream,
            zhihui::platform::event_store::ExpectedVersion::Any,
            vec![zhihui::platform::event_store::NewEvent {
                id: Uuid::now_v7(),
                event_type: "PointsGranted".into(),
                schema_version: 1,
                payload: serde_json::json!({"operation_id": "不是一个 uuid"}).into(),
                metadata: metadata(),
            }],
        )
        .await
        .unwrap();
    let error = zhihui::cli::replay::replay(
        &services.pg_pool,
        &services.event_store,
        ProjectionName::Ledger,
        &app.settings.projections,
        3,
        &mut Quiet,
    )
    .await
    .unwrap_err();
    let error = format!("{error:#}");
    assert!(
        error.contains("stopped") && error.contains(&format!("of stream {stream}")),
        "{error}"
    );
    assert_eq!(snapshot(&app).await, live);
}

#[tokio::test]
async fn a_swap_closes_the_gap_when_the_live_runner_moved_on_during_the_rebuild() {
    let app = spawn_app().await;
    let user = UserId::from_uuid(Uuid::now_v7());
    activity(&app, user, 10).await;
    app.project().await;
    let services = app.services();
    let projection = ProjectionName::Ledger;
    zhihui::cli::replay::prepare_tables(&services.pg_pool, projection)
        .await
        .unwrap();
    zhihui::cli::replay::build_all(
        &services.pg_pool,
        &services.event_store,
        projection,
        &app.settings.projections,
        1_000,
        &mut Quiet,
    )
    .await
    .unwrap();
    // Meanwhile: more commands, applied by the live runner only.
    activity(&app, user, 4).await;
    app.project().await;
    let live = snapshot(&app).await;
    let (_, gap) = zhihui::cli::replay::swap(&services.pg_pool, &services.event_store, projection)
        .await
        .unwrap();
    assert_eq!(gap, 1 + 8);
    assert_eq!(snapshot(&app).await, live);
}

#[tokio::test]
async fn the_cli_replays_and_shows_accounts_streams_and_the_tail_of_the_log() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let user = UserId::from_uuid(Uuid::parse_str(&alice).unwrap());
    activity(&app, user, 2).await;
    app.project().await;

    let output = app.cli(&["replay", "--projection", "ledger", "--quiet"]);
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("replayed ledger: 5 events"), "{stdout}");
    let output = app.cli(&["replay", "--projection", "nonsense"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown projection \"nonsense\""));

    // audit account, by username, as JSON, filtered by kind.
    let output = app.cli(&["audit", "account", "alice", "--json"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let movements: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    let kinds: Vec<&str> = movements
        .iter()
        .map(|m| m["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["grant", "freeze", "deduct", "freeze", "return"]);
    assert_eq!(movements[2]["available_after"], "999.00");
    assert_eq!(movements[4]["reason"], "failed");
    let output = app.cli(&["audit", "account", &alice, "--kind", "freeze"]);
    let table = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(table.contains("2 movement(s)"), "{table}");
    let output = app.cli(&["audit", "account", "nobody"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("no user named \"nobody\""));
    let future = "2100-01-01T00:00:00Z";
    let output = app.cli(&["audit", "account", &alice, "--since", future, "--json"]);
    let movements: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert!(movements.is_empty());

    // events show: the account stream, one JSON object per event.
    let stream = account_stream(user);
    let output = app.cli(&["events", "show", &stream, "--json"]);
    let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    assert_eq!(lines[1]["event_type"], "PointsFrozen");
    assert_eq!(lines[1]["version"], 1);
    assert_eq!(lines[0]["actor"], "test:replay");
    let output = app.cli(&["events", "show", "account-nothing-here"]);
    assert!(!output.status.success());

    // events tail from the start, account streams only, stops after 3.
    let output = app.cli(&[
        "events",
        "tail",
        "--from-start",
        "--stream-prefix",
        "account-",
        "--count",
        "3",
    ]);
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(output.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].contains(&format!("{stream}#0 PointsGranted")),
        "{text}"
    );
}

#[tokio::test]
async fn events_tail_follows_what_is_committed_after_it_started() {
    let app = spawn_app().await;
    let user = UserId::from_uuid(Uuid::now_v7());
    activity(&app, user, 1).await;
    let settings = app.settings.clone();
    let tail = tokio::task::spawn_blocking(move || {
        use secrecy::ExposeSecret;
        std::process::Command::new(env!("CARGO_BIN_EXE_zhihui"))
            .args(["events", "tail", "--count", "1", "--json"])
            .env(
                "ZHIHUI_DATABASE__URL",
                settings.database.url.expose_secret(),
            )
            .env("ZHIHUI_DATABASE__MIGRATE_ON_START", "false")
            .env("ZHIHUI_LOG__FILTER", "warn")
            .output()
            .unwrap()
    });
    // Keep committing until the tail has seen one (it starts at the end of the log, whenever
    // the process gets there): each is a new event after the ones that were there before.
    let services = app.services();
    let stream = account_stream(user);
    let mut appended = 0;
    while !tail.is_finished() {
        let hold_id = Uuid::now_v7();
        let freeze = AccountCommand::Freeze {
            hold_id,
            amount: Amount::whole(1),
            at: app.clock.now(),
        };
        services
            .accounts
            .execute(&stream, freeze, metadata())
            .await
            .unwrap();
        appended += 1;
        assert!(appended < 10_000, "the tail never printed anything");
        tokio::task::yield_now().await;
    }
    let output = tail.await.unwrap();
    let line: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(line["event_type"], "PointsFrozen");
    assert!(line["version"].as_u64().unwrap() >= 3, "{line}");
}

/// PostgreSQL away while a batch is applied (here a trigger answers as a server shutting down
/// does) is no poison event: the batch fails, nothing is recorded as stopped, and the same
/// runner applies everything once the server answers again.
#[tokio::test]
async fn a_batch_failing_because_postgres_is_away_names_no_poison_event() {
    let app = spawn_app().await;
    let user = UserId::from_uuid(Uuid::now_v7());
    activity(&app, user, 2).await;
    let client = crate::helpers::connect(&app.settings).await;
    client
        .batch_execute(
            "CREATE FUNCTION away() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 RAISE EXCEPTION 'terminating connection due to administrator command'
                     USING ERRCODE = 'admin_shutdown';
             END $$;
             CREATE TRIGGER away BEFORE INSERT ON ledger_entries
                 FOR EACH ROW EXECUTE FUNCTION away();",
        )
        .await
        .unwrap();
    let projector = app.projector(ProjectionName::Ledger);
    let error = projector.catch_up().await.expect_err("PostgreSQL is away");
    assert!(zhihui::platform::postgres::away(&error), "{error:#}");
    let stopped = crate::helpers::stopped_reason(&client, "ledger").await;
    assert_eq!(stopped, None);

    client
        .batch_execute("DROP TRIGGER away ON ledger_entries")
        .await
        .unwrap();
    assert_eq!(projector.catch_up().await.unwrap(), 1 + 2 * 2);
    assert_eq!(checkpoint_events(&app, "ledger").await, 1 + 2 * 2);
}
