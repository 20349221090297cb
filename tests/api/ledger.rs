//! The points ledger end to end: grants over HTTP with idempotency keys, concurrent commands on
//! one account, projections (exactly once, even when killed mid-batch), balance and ledger reads.

#![allow(clippy::unwrap_used)]

use rust_decimal::Decimal;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::platform::command::CommandError;
use zhihui::platform::event_store::EventMetadata;
use zhihui_domain::account::{AccountCommand, AccountError, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;
use zhihui_projections::ProjectionName;

use crate::helpers::{TestApp, spawn_app};

fn metadata(actor: &str) -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: actor.into(),
    }
}

async fn grant(
    app: &TestApp,
    admin: &str,
    user: &str,
    amount: &str,
    key: Option<&str>,
) -> reqwest::Response {
    let mut request = app
        .http
        .post(format!(
            "{}/api/v1/admin/accounts/{user}/grants",
            app.address
        ))
        .bearer_auth(admin)
        .json(&json!({"amount": amount, "reason": "welcome"}));
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap()
}

async fn balance(app: &TestApp, token: &str) -> (Decimal, Decimal) {
    let body: Value = app
        .get_as(token, "/api/v1/account")
        .await
        .json()
        .await
        .unwrap();
    (
        body["available"].as_str().unwrap().parse().unwrap(),
        body["frozen"].as_str().unwrap().parse().unwrap(),
    )
}

#[tokio::test]
async fn a_grant_with_an_idempotency_key_counts_once_and_shows_in_balance_and_ledger() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let alice_token = app.login("alice", "correct horse battery").await;
    let admin = app.admin_token("root").await;

    let first = grant(&app, &admin, &alice, "100", Some("grant-1")).await;
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["granted_now"], true);
    assert_eq!(first["available"], "100.00");
    let again: Value = grant(&app, &admin, &alice, "100", Some("grant-1"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["granted_now"], false);
    assert_eq!(again["operation_id"], first["operation_id"]);
    // The same key for another amount is a client bug, refused.
    let reused = grant(&app, &admin, &alice, "5", Some("grant-1")).await;
    assert_eq!(reused.status(), 409);
    // Bad amounts name the field.
    for bad in ["0", "-3", "1.001", "abc"] {
        let response = grant(&app, &admin, &alice, bad, None).await;
        assert_eq!(response.status(), 422, "{bad}");
    }
    let user_grant = grant(&app, &alice_token, &alice, "5", None).await;
    assert_eq!(user_grant.status(), 403);

    app.project().await;
    assert_eq!(
        balance(&app, &alice_token).await,
        (Decimal::new(10000, 2), Decimal::ZERO)
    );
    let ledger: Value = app
        .get_as(&alice_token, "/api/v1/account/ledger")
        .await
        .json()
        .await
        .unwrap();
    let entries = ledger["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{ledger}");
    assert_eq!(entries[0]["kind"], "grant");
    assert_eq!(entries[0]["amount"], "100.00");
    assert_eq!(entries[0]["available_after"], "100.00");
    assert_eq!(entries[0]["reason"], "welcome");
}

#[tokio::test]
async fn the_ledger_pages_newest_first_and_is_only_ones_own() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    app.register("bob", "correct horse battery").await;
    let alice_token = app.login("alice", "correct horse battery").await;
    let bob_token = app.login("bob", "correct horse battery").await;
    let admin = app.admin_token("root").await;
    for i in 1..=5 {
        assert_eq!(
            grant(&app, &admin, &alice, &i.to_string(), None)
                .await
                .status(),
            201
        );
    }
    app.project().await;
    let mut amounts = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(cursor) => format!("/api/v1/account/ledger?limit=2&cursor={cursor}"),
            None => "/api/v1/account/ledger?limit=2".into(),
        };
        let page: Value = app.get_as(&alice_token, &path).await.json().await.unwrap();
        for entry in page["entries"].as_array().unwrap() {
            amounts.push(entry["amount"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(amounts, ["5.00", "4.00", "3.00", "2.00", "1.00"]);
    let bobs: Value = app
        .get_as(&bob_token, "/api/v1/account/ledger")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(bobs["entries"].as_array().unwrap().len(), 0);
    assert_eq!(
        balance(&app, &bob_token).await,
        (Decimal::ZERO, Decimal::ZERO)
    );
    assert_eq!(
        app.get_as(&alice_token, "/api/v1/account/ledger?limit=101")
            .await
            .status(),
        422
    );
    // A cursor this server never handed out is refused, not answered with an empty page.
    for cursor in ["-1", "%2B3", "abc", "1.5"] {
        let response = app
            .get_as(
                &alice_token,
                &format!("/api/v1/account/ledger?cursor={cursor}"),
            )
            .await;
        assert_eq!(response.status(), 422, "{cursor}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], "cursor", "{cursor}: {problem}");
    }
}

#[tokio::test]
async fn a_thousand_concurrent_freezes_of_ten_on_a_hundred_points_give_exactly_ten() {
    let app = spawn_app().await;
    let services = app.services();
    let user = UserId::from_uuid(Uuid::now_v7());
    let stream = account_stream(user);
    services
        .accounts
        .execute(
            &stream,
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(100),
                reason: "test".into(),
                at: app.clock.now(),
            },
            metadata("test"),
        )
        .await
        .unwrap();
    // Two "processes" (two service instances) race, so cross-process conflicts happen too.
    let other = app.services();
    let attempts = (0..1_000).map(|i| {
        let accounts = if i % 2 == 0 {
            services.accounts.clone()
        } else {
            other.accounts.clone()
        };
        let stream = stream.clone();
        let at = app.clock.now();
        tokio::spawn(async move {
            accounts
                .execute(
                    &stream,
                    AccountCommand::Freeze {
                        hold_id: Uuid::now_v7(),
                        amount: Amount::whole(10),
                        at,
                    },
                    metadata("test"),
                )
                .await
        })
    });
    let results = futures::future::join_all(attempts).await;
    let mut frozen = 0;
    let mut insufficient = 0;
    for result in results {
        match result.unwrap() {
            Ok(handled) => {
                assert_eq!(handled.new_events.len(), 1);
                frozen += 1;
            }
            Err(CommandError::Rejected(AccountError::InsufficientPoints { .. })) => {
                insufficient += 1
            }
            Err(other) => panic!("a client saw {other}"),
        }
    }
    assert_eq!((frozen, insufficient), (10, 990));

    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    let row = client
        .query_one(
            "SELECT available, frozen FROM accounts WHERE user_id = $1",
            &[&user.as_uuid()],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Decimal>(0), Decimal::ZERO);
    assert_eq!(row.get::<_, Decimal>(1), Decimal::new(10000, 2));
    let negative: i64 = client
        .query_one(
            "SELECT count(*) FROM ledger_entries WHERE available_after < 0 OR frozen_after < 0",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(negative, 0);
    let entries: i64 = client
        .query_one(
            "SELECT count(*) FROM ledger_entries WHERE user_id = $1",
            &[&user.as_uuid()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(entries, 11);
}

/// A command whose event carries a unique id (a code's credit) already stored on another
/// account is refused alone: the commands batched with it on the same account append.
#[tokio::test]
async fn a_credit_whose_unique_id_another_account_holds_is_refused_alone_in_its_batch() {
    let app = spawn_app().await;
    let services = app.services();
    let code_credit = |serial: u32| AccountCommand::Credit {
        operation_id: zhihui_domain::redeem::credit_operation_id(serial),
        kind: zhihui_domain::account::CreditKind::RedeemCode,
        amount: Amount::whole(30),
        reference: zhihui_domain::redeem::credit_reference(Uuid::nil(), serial),
        at: app.clock.now(),
    };
    let grant = |points: i64| AccountCommand::Grant {
        operation_id: Uuid::now_v7(),
        amount: Amount::whole(points),
        reason: "奖励".into(),
        at: app.clock.now(),
    };
    let first = account_stream(UserId::from_uuid(Uuid::now_v7()));
    let second = account_stream(UserId::from_uuid(Uuid::now_v7()));
    services
        .accounts
        .execute(&first, code_credit(7), metadata("test"))
        .await
        .unwrap();
    // One batch on the second account (queued before its actor first runs): a grant, the
    // taken credit, another code's credit, a grant.
    let on_second = |command| {
        services
            .accounts
            .execute(&second, command, metadata("test"))
    };
    let (before, taken, other_code, after) = tokio::join!(
        on_second(grant(5)),
        on_second(code_credit(7)),
        on_second(code_credit(8)),
        on_second(grant(2)),
    );
    assert!(
        matches!(&taken, Err(CommandError::Store(error)) if error.to_string().contains("already used by a different append")),
        "{taken:?}"
    );
    for handled in [&before, &other_code, &after] {
        assert_eq!(handled.as_ref().unwrap().new_events.len(), 1);
    }
    let state = after.unwrap().state_after;
    assert_eq!(state.balance.available.as_decimal(), Decimal::from(37));
    // The stored stream says the same: three events, 37 points.
    let loaded = zhihui::platform::command::load::<zhihui_domain::account::Account>(
        &services.event_store,
        &second,
    )
    .await
    .unwrap();
    assert_eq!(loaded.version, Some(2));
    assert_eq!(
        loaded.state.balance.available.as_decimal(),
        Decimal::from(37)
    );
}

#[tokio::test]
async fn sixty_four_clients_on_one_account_never_see_a_concurrency_error() {
    let app = spawn_app().await;
    let first = app.services();
    let second = app.services();
    let user = UserId::from_uuid(Uuid::now_v7());
    let stream = account_stream(user);
    first
        .accounts
        .execute(
            &stream,
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(1_000_000),
                reason: "test".into(),
                at: app.clock.now(),
            },
            metadata("test"),
        )
        .await
        .unwrap();
    // 64 clients, half through each "process", each freezing then releasing 20 times.
    let clients = (0..64).map(|client| {
        let accounts = if client % 2 == 0 {
            first.accounts.clone()
        } else {
            second.accounts.clone()
        };
        let stream = stream.clone();
        let at = app.clock.now();
        tokio::spawn(async move {
            for _ in 0..20 {
                let hold_id = Uuid::now_v7();
                for command in [
                    AccountCommand::Freeze {
                        hold_id,
                        amount: Amount::whole(1),
                        at,
                    },
                    AccountCommand::ReleaseHold {
                        hold_id,
                        reason: "done".into(),
                        at,
                    },
                ] {
                    if let Err(error) = accounts.execute(&stream, command, metadata("test")).await {
                        return Err(error.to_string());
                    }
                }
            }
            Ok(())
        })
    });
    for outcome in futures::future::join_all(clients).await {
        outcome.unwrap().unwrap();
    }
    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    let row = client
        .query_one(
            "SELECT available, frozen, stream_version FROM accounts WHERE user_id = $1",
            &[&user.as_uuid()],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Decimal>(0), Decimal::new(100_000_000, 2));
    assert_eq!(row.get::<_, Decimal>(1), Decimal::ZERO);
    assert_eq!(row.get::<_, i64>(2), 64 * 20 * 2);
}

#[tokio::test]
async fn a_projection_killed_between_applying_and_committing_counts_nothing_twice() {
    let app = spawn_app().await;
    let services = app.services();
    let user = UserId::from_uuid(Uuid::now_v7());
    for _ in 0..10 {
        services
            .accounts
            .execute(
                &account_stream(user),
                AccountCommand::Grant {
                    operation_id: Uuid::now_v7(),
                    amount: Amount::whole(7),
                    reason: "test".into(),
                    at: app.clock.now(),
                },
                metadata("test"),
            )
            .await
            .unwrap();
    }
    let projector = app.projector(ProjectionName::Ledger);
    let applied = projector
        .project_batch_killed_before_commit()
        .await
        .unwrap();
    assert_eq!(applied, 10);
    // A restarted runner starts from the old checkpoint and applies everything exactly once.
    assert_eq!(projector.catch_up().await.unwrap(), 10);
    let client = crate::helpers::connect(&app.settings).await;
    let row = client
        .query_one(
            "SELECT a.available, (SELECT count(*) FROM ledger_entries), c.events_applied
               FROM accounts a, projection_checkpoints c
              WHERE a.user_id = $1 AND c.projection = 'ledger'",
            &[&user.as_uuid()],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Decimal>(0), Decimal::new(7000, 2));
    assert_eq!(row.get::<_, i64>(1), 10);
    assert_eq!(row.get::<_, i64>(2), 10);
}

#[tokio::test]
async fn a_poison_event_stops_the_projection_naming_it_and_nothing_after_it_is_applied() {
    let app = spawn_app().await;
    let services = app.services();
    let user = UserId::from_uuid(Uuid::now_v7());
    let stream = account_stream(user);
    let grant = |n: i64| AccountCommand::Grant {
        operation_id: Uuid::now_v7(),
        amount: Amount::whole(n),
        reason: "test".into(),
        at: app.clock.now(),
    };
    services
        .accounts
        .execute(&stream, grant(1), metadata("test"))
        .await
        .unwrap();
    // A stored event this build cannot read (a bug, or a newer writer).
    use zhihui::platform::event_store::EventStore;
    services
        .event_store
        .append(
            &stream,
            zhihui::platform::event_store::ExpectedVersion::Exact(0),
            vec![zhihui::platform::event_store::NewEvent {
                id: Uuid::now_v7(),
                event_type: "PointsGranted".into(),
                schema_version: 1,
                payload: json!({"operation_id": "not a uuid"}).into(),
                metadata: metadata("test"),
            }],
        )
        .await
        .unwrap();
    let other_user = UserId::from_uuid(Uuid::now_v7());
    services
        .accounts
        .execute(&account_stream(other_user), grant(2), metadata("test"))
        .await
        .unwrap();

    let projector = app.projector(ProjectionName::Ledger);
    let error = projector.catch_up().await.unwrap_err().to_string();
    assert!(error.contains("stopped"), "{error}");
    assert!(error.contains(&format!("#1 of stream {stream}")), "{error}");
    // It stays stopped, and the event after the poison one was not applied.
    assert!(projector.catch_up().await.is_err());
    let client = crate::helpers::connect(&app.settings).await;
    let entries: i64 = client
        .query_one("SELECT count(*) FROM ledger_entries", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(entries, 1);
    let reason = crate::helpers::stopped_reason(&client, "ledger").await;
    assert!(reason.unwrap().contains("PointsGranted"));
}

#[tokio::test]
async fn audit_verify_passes_on_projected_read_models_and_fails_on_a_tampered_row() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let admin = app.admin_token("root").await;
    assert_eq!(grant(&app, &admin, &alice, "50", None).await.status(), 201);
    let services = app.services();
    let user = UserId::from_uuid(Uuid::parse_str(&alice).unwrap());
    let hold_id = Uuid::now_v7();
    for command in [
        AccountCommand::Freeze {
            hold_id,
            amount: Amount::whole(20),
            at: app.clock.now(),
        },
        AccountCommand::SettleHold {
            hold_id,
            at: app.clock.now(),
        },
    ] {
        services
            .accounts
            .execute(&account_stream(user), command, metadata("test"))
            .await
            .unwrap();
    }
    app.project().await;

    let run_cli = || app.cli(&["audit", "verify"]);
    let output = run_cli();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("0 difference(s)"), "{stdout}");

    let client = crate::helpers::connect(&app.settings).await;
    client
        .execute(
            "UPDATE accounts SET available = available + 1 WHERE user_id = $1",
            &[&user.as_uuid()],
        )
        .await
        .unwrap();
    client
        .execute(
            "DELETE FROM ledger_entries WHERE user_id = $1 AND stream_version = 1",
            &[&user.as_uuid()],
        )
        .await
        .unwrap();
    let output = run_cli();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(!output.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "DIFFERENCE accounts {alice}: row says available 31.00"
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "DIFFERENCE ledger_entries {alice} #1: event without an entry"
        )),
        "{stdout}"
    );
    assert!(stdout.contains("2 difference(s)"), "{stdout}");
}

#[tokio::test]
async fn a_worker_that_resigns_releases_its_lead_to_other_processes() {
    let app = spawn_app().await;
    let (ours, theirs) = (app.services().pg_pool, app.services().pg_pool);
    let name = format!("test-lead-{}", Uuid::now_v7());
    let lead = zhihui::platform::leader::try_lead(&ours, &name)
        .await
        .unwrap()
        .unwrap();
    assert!(
        zhihui::platform::leader::try_lead(&theirs, &name)
            .await
            .unwrap()
            .is_none()
    );
    zhihui::platform::leader::resign(lead);
    // Our pool keeps idle connections; none of them may still hold the lock.
    let _busy = ours.get().await.unwrap();
    let theirs_now = zhihui::platform::leader::try_lead(&theirs, &name)
        .await
        .unwrap();
    assert!(
        theirs_now.is_some(),
        "the lock stayed with a pooled connection"
    );
}

/// Answers that hold a person's data are never kept by a cache (a shared computer, a proxy):
/// `no-store` on the API's JSON, its errors and the pages alike, unless an answer sets its own
/// rule (assets, images).
#[tokio::test]
async fn answers_with_a_persons_data_are_never_stored_by_a_cache() {
    let app = spawn_app().await;
    app.register("xiaocun", "a long password").await;
    let token = app.login("xiaocun", "a long password").await;
    for path in [
        "/api/v1/me",
        "/api/v1/account",
        "/api/v1/account/ledger",
        "/api/v1/tasks",
        "/api/v1/tasks/00000000-0000-0000-0000-000000000000",
    ] {
        let response = app.get_as(&token, path).await;
        assert!(
            response.status().is_success() || response.status() == 404,
            "{path}: {}",
            response.status()
        );
        assert_eq!(
            response.headers()["cache-control"],
            "no-store",
            "{path} answered {}",
            response.status()
        );
    }
}
