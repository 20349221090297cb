//! Daily check-in and daily active users: a bonus once per user per day (UTC+8 by default) across
//! processes, streaks across month ends, the month view rebuilt from the events after Redis lost
//! it, lost bonuses credited by the retry or the reconciler, `audit verify` on bonuses; active
//! users counted once per day per process and reported per day and over a range.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::platform::command::RetryPolicy;
use zhihui::platform::event_store::{Direction, EventMetadata, EventStore, ReadFrom};
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountCommand, AccountEvent, CreditKind, account_stream};
use zhihui_domain::checkin::{CheckIn, CheckInCommand, bonus_reference, checkin_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

use crate::helpers::{TestApp, flush_redis, spawn_app_with};
use crate::tasks::project_and_verify;

/// Cheap password hashing, and sessions that outlive the days the clock moves through.
async fn spawn_checkin_app() -> TestApp {
    spawn_app_with(|settings| {
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
        settings.auth.session_idle_ttl_ms = 40 * 24 * 3_600_000;
    })
    .await
}

fn metadata() -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: "test".into(),
    }
}

async fn user(app: &TestApp, name: &str) -> (UserId, String) {
    let id = app.register(name, "a long password").await;
    let token = app.login(name, "a long password").await;
    (UserId::from_uuid(Uuid::parse_str(&id).unwrap()), token)
}

async fn check_in(app: &TestApp, token: &str) -> Value {
    let response = app.post("/api/v1/checkins", Some(token), &json!({})).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

async fn month(app: &TestApp, token: &str, month: &str) -> Value {
    let response = app
        .get_as(token, &format!("/api/v1/checkins?month={month}"))
        .await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// Move the manual clock to `at` (forwards only).
fn set_clock(app: &TestApp, at: chrono::DateTime<chrono::Utc>) {
    let by = at - app.clock.now();
    app.clock.advance(by.to_std().unwrap());
}

/// The bonus credits on a user's account: (reference, amount).
async fn bonus_credits(app: &TestApp, user_id: UserId) -> Vec<(String, String)> {
    let records = app
        .services()
        .event_store
        .read_stream(
            &account_stream(user_id),
            Direction::Forwards,
            ReadFrom::Start,
            1_000,
        )
        .await
        .unwrap();
    records
        .iter()
        .filter_map(|record| {
            match AccountEvent::from_stored(
                &record.event_type,
                record.schema_version,
                &record.payload,
            )
            .unwrap()
            {
                AccountEvent::Credited(e) if e.kind == CreditKind::CheckInBonus => {
                    Some((e.reference, e.amount.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

fn days(view: &Value) -> Vec<String> {
    view["days"]
        .as_array()
        .unwrap()
        .iter()
        .map(|day| day.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn the_last_and_the_first_millisecond_of_a_day_are_two_days_and_a_streak_of_two() {
    let app = spawn_checkin_app().await;
    let (alice_id, alice) = user(&app, "alice").await;
    // 23:59:59.999 on 15 January at UTC+8.
    set_clock(
        &app,
        "2027-01-15T15:59:59.999Z"
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap(),
    );
    let first = check_in(&app, &alice).await;
    assert_eq!(
        (
            &first["day"],
            &first["streak"],
            &first["bonus"],
            &first["checked_in_now"]
        ),
        (
            &json!("2027-01-15"),
            &json!(1),
            &json!("5.00"),
            &json!(true)
        )
    );
    // The same day again: nothing more.
    let again = check_in(&app, &alice).await;
    assert_eq!(again["checked_in_now"], false);
    assert_eq!(again["available"], "5.00");

    // 00:00:00.000 on 16 January: a new day.
    app.clock.advance(Duration::from_millis(1));
    let second = check_in(&app, &alice).await;
    assert_eq!(
        (&second["day"], &second["streak"], &second["checked_in_now"]),
        (&json!("2027-01-16"), &json!(2), &json!(true))
    );
    assert_eq!(second["available"], "10.00");
    let view = month(&app, &alice, "2027-01").await;
    assert_eq!(days(&view), ["2027-01-15", "2027-01-16"]);
    assert_eq!(
        (&view["streak"], &view["checked_in_today"], &view["today"]),
        (&json!(2), &json!(true), &json!("2027-01-16"))
    );
    assert_eq!(
        bonus_credits(&app, alice_id).await,
        [
            (
                bonus_reference("2027-01-15".parse().unwrap()),
                "5.00".into()
            ),
            (
                bonus_reference("2027-01-16".parse().unwrap()),
                "5.00".into()
            ),
        ]
    );

    // A missed day: the streak shown falls to 0, and the next check-in starts at 1.
    app.clock.advance(Duration::from_secs(2 * 86_400));
    let view = month(&app, &alice, "2027-01").await;
    assert_eq!(
        (&view["streak"], &view["checked_in_today"]),
        (&json!(0), &json!(false))
    );
    assert_eq!(check_in(&app, &alice).await["streak"], 1);

    // A month that is not YYYY-MM is named.
    let response = app.get_as(&alice, "/api/v1/checkins?month=2027-1").await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["field"], "month");
    project_and_verify(&app).await;
}

#[tokio::test]
async fn fifty_concurrent_check_ins_of_one_user_on_two_processes_credit_one_bonus() {
    let app = spawn_checkin_app().await;
    let other = app.another_instance().await;
    let (bob_id, bob) = user(&app, "bob").await;
    let answers = futures::future::join_all((0..50).map(|index| {
        let instance = if index % 2 == 0 { &app } else { &other };
        check_in(instance, &bob)
    }))
    .await;
    let now: Vec<&Value> = answers
        .iter()
        .filter(|answer| answer["checked_in_now"] == true)
        .collect();
    assert_eq!(now.len(), 1, "{answers:?}");
    assert!(answers.iter().all(|answer| answer["day"] == "2027-01-15"
        && answer["streak"] == 1
        && answer["bonus"] == "5.00"));
    assert_eq!(bonus_credits(&app, bob_id).await.len(), 1);
    let stream = app
        .services()
        .event_store
        .read_stream(
            &checkin_stream(bob_id),
            Direction::Forwards,
            ReadFrom::Start,
            100,
        )
        .await
        .unwrap();
    assert_eq!(stream.len(), 1);
    let balance: Value = app
        .get_as(&bob, "/api/v1/account")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(balance["available"], "5.00");
    project_and_verify(&app).await;
}

#[tokio::test]
async fn a_ten_day_streak_across_a_month_end_survives_a_redis_flush() {
    let app = spawn_checkin_app().await;
    let other = app.another_instance().await;
    let (carol_id, carol) = user(&app, "carol").await;
    // Noon at UTC+8 on 26 January, then every day to 4 February, alternating processes.
    set_clock(
        &app,
        "2027-01-26T04:00:00Z"
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap(),
    );
    let mut bonuses = Vec::new();
    for day in 0..10 {
        let instance = if day % 2 == 0 { &app } else { &other };
        let answer = check_in(instance, &carol).await;
        assert_eq!(answer["streak"], day + 1);
        bonuses.push(answer["bonus"].as_str().unwrap().to_owned());
        if day < 9 {
            app.clock.advance(Duration::from_secs(86_400));
        }
    }
    // The 7th consecutive day earns the streak reward.
    assert_eq!(bonuses[6], "20.00");
    assert_eq!(bonuses.iter().filter(|b| *b == "5.00").count(), 9);
    let january = month(&app, &carol, "2027-01").await;
    let february = month(&other, &carol, "2027-02").await;
    assert_eq!(
        days(&january),
        (26..=31)
            .map(|d| format!("2027-01-{d}"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        days(&february),
        (1..=4).map(|d| format!("2027-02-0{d}")).collect::<Vec<_>>()
    );
    assert_eq!(february["streak"], 10);

    // Redis loses everything (but sessions): the same answers, rebuilt from the events.
    flush_redis(&app).await;
    assert_eq!(month(&other, &carol, "2027-01").await, january);
    assert_eq!(month(&app, &carol, "2027-02").await, february);
    // And the months are back in Redis, complete.
    let services = app.services();
    let mut redis = services.redis.connection().await.unwrap();
    for key in ["2027-01", "2027-02"] {
        let bytes: Vec<u8> = redis::cmd("GET")
            .arg(
                services
                    .redis
                    .tagged(&format!("u:{carol_id}"), &format!("checkins:{key}")),
            )
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(bytes[0] & 0x80, 0x80, "{key} written complete");
    }

    // Flushed again, rebuilt for everyone by the CLI: the keys are there before any read.
    flush_redis(&app).await;
    app.project().await;
    let rebuilt = app.cli(&["checkins", "rebuild"]);
    assert!(rebuilt.status.success(), "{rebuilt:?}");
    assert!(
        String::from_utf8_lossy(&rebuilt.stdout).contains("2 month(s) of check-ins for 1 user(s)"),
        "{rebuilt:?}"
    );
    let exists: i64 = redis::cmd("EXISTS")
        .arg(
            services
                .redis
                .tagged(&format!("u:{carol_id}"), "checkins:2027-01"),
        )
        .arg(
            services
                .redis
                .tagged(&format!("u:{carol_id}"), "checkins:2027-02"),
        )
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(exists, 2);
    assert_eq!(month(&app, &carol, "2027-02").await, february);

    // A partial month in Redis (a lone bit set after a flush, no "complete" mark) is not trusted.
    flush_redis(&app).await;
    let _: i64 = redis::cmd("SETBIT")
        .arg(
            services
                .redis
                .tagged(&format!("u:{carol_id}"), "checkins:2027-02"),
        )
        .arg(4)
        .arg(1)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(month(&app, &carol, "2027-02").await, february);
    project_and_verify(&app).await;
}

#[tokio::test]
async fn a_bonus_lost_between_the_streams_is_credited_by_the_retry_or_the_reconciler() {
    let app = spawn_checkin_app().await;
    let (dave_id, dave) = user(&app, "dave").await;
    let (erin_id, _erin) = user(&app, "erin").await;
    // Both requests died after the check-in stream and before the account.
    let services = app.services_on_app_clock();
    let rule = app.settings.checkins.rule().unwrap();
    for user_id in [dave_id, erin_id] {
        zhihui::platform::command::execute::<CheckIn>(
            &services.event_store,
            &checkin_stream(user_id),
            &CheckInCommand::CheckIn {
                user_id,
                day: "2027-01-15".parse().unwrap(),
                rule: rule.clone(),
                at: app.clock.now(),
            },
            &metadata(),
            RetryPolicy::default(),
        )
        .await
        .unwrap();
    }
    app.project().await;
    // Within the bound the audit calls them pending; past it, differences.
    let verified = app.verify(None).await;
    assert_eq!(
        (verified.differences.len(), verified.pending_settlements),
        (0, 2),
        "{:?}",
        verified.differences
    );
    let late = app.verify(Some(chrono::Duration::zero())).await;
    assert_eq!(late.differences.len(), 2, "{:?}", late.differences);
    assert!(late.differences[0].detail.contains("never credited"));

    // Dave checks in again: already checked in today, and his bonus is credited now.
    let again = check_in(&app, &dave).await;
    assert_eq!(
        (&again["checked_in_now"], &again["available"]),
        (&json!(false), &json!("5.00"))
    );
    // Erin's is credited by the reconciler once it is owed.
    app.project().await;
    app.clock.advance(Duration::from_millis(
        app.settings.tasks.settlement_after_ms + 1,
    ));
    let reconciler = zhihui::points::settlements::SettlementReconciler::new(
        services.tasks.clone(),
        services.codes.clone(),
        services.checkins.clone(),
        services.promotions.clone(),
        services.pg_pool.clone(),
        services.clock.clone(),
    );
    let report = reconciler.reconcile_once().await.unwrap();
    assert_eq!(report.repairs.len(), 1, "{report:?}");
    let repair = &report.repairs[0];
    assert_eq!(
        (repair.kind.as_str(), repair.user_id, repair.checkin_day),
        (
            "bonus_credited",
            erin_id.as_uuid(),
            Some("2027-01-15".parse().unwrap())
        )
    );
    app.project().await;
    assert!(
        reconciler
            .reconcile_once()
            .await
            .unwrap()
            .repairs
            .is_empty()
    );
    assert_eq!(bonus_credits(&app, erin_id).await.len(), 1);
    assert_eq!(bonus_credits(&app, dave_id).await.len(), 1);
    let repairs = app.cli(&["audit", "repairs"]);
    assert!(
        String::from_utf8_lossy(&repairs.stdout).contains("check-in 2027-01-15"),
        "{repairs:?}"
    );
    project_and_verify(&app).await;
}

#[tokio::test]
async fn audit_verify_finds_a_second_bonus_on_one_day_and_a_bonus_without_a_check_in() {
    let app = spawn_checkin_app().await;
    let (frank_id, frank) = user(&app, "frank").await;
    check_in(&app, &frank).await;
    let services = app.services();
    // A second credit for the same day (another operation id), and one for a day never checked in.
    for (day, amount) in [("2027-01-15", 5), ("2027-01-10", 7)] {
        services
            .accounts
            .execute(
                &account_stream(frank_id),
                AccountCommand::Credit {
                    operation_id: Uuid::now_v7(),
                    kind: CreditKind::CheckInBonus,
                    amount: Amount::whole(amount),
                    reference: bonus_reference(day.parse().unwrap()),
                    at: app.clock.now(),
                },
                metadata(),
            )
            .await
            .unwrap();
    }
    app.project().await;
    let verified = app.verify(None).await;
    let details: HashSet<String> = verified
        .differences
        .iter()
        .filter(|d| d.read_model == "checkins")
        .map(|d| d.detail.clone())
        .collect();
    assert!(details.contains("2 bonuses on one day"), "{details:?}");
    assert!(
        details.contains("a bonus without a check-in"),
        "{details:?}"
    );
}

#[tokio::test]
async fn active_users_are_counted_once_per_day_per_process_and_reported() {
    let app = spawn_checkin_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let mut users = Vec::new();
    for name in ["gina", "hank", "ivan"] {
        users.push(user(&app, name).await.1);
    }
    for token in &users {
        for _ in 0..3 {
            assert_eq!(app.get_as(token, "/api/v1/me").await.status(), 200);
        }
    }
    let report = |from: &'static str, to: &'static str| {
        let app = &app;
        let admin = admin.clone();
        async move {
            let response = app
                .get_as(
                    &admin,
                    &format!("/api/v1/admin/stats/active-users?from={from}&to={to}"),
                )
                .await;
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    };
    let today = report("2027-01-15", "2027-01-15").await;
    // Three users and the admin.
    assert_eq!(today["days"][0]["active_users"], 4, "{today}");

    // This process remembers whom it counted: with the day's key gone, its users' further
    // requests add nothing (no Redis call); another process counts them once.
    let services = app.services();
    let mut redis = services.redis.connection().await.unwrap();
    let keys = services
        .active_users
        .day_keys("2027-01-15".parse().unwrap());
    assert_eq!(keys.len(), 16);
    for key in &keys {
        let ttl: i64 = redis::cmd("TTL")
            .arg(key)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(
            ttl == -2 || ttl > 399 * 86_400,
            "kept for the retention: {ttl}"
        );
    }
    let _: i64 = redis::cmd("DEL")
        .arg(&keys)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(app.get_as(&users[0], "/api/v1/me").await.status(), 200);
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&keys)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(exists, 0, "a remembered user costs no Redis call");
    assert_eq!(other.get_as(&users[0], "/api/v1/me").await.status(), 200);
    // A user is in one shard: the shards' counts add up (one PFCOUNT of all the keys would
    // span slots of a cluster).
    let mut count = 0;
    for key in &keys {
        let shard: i64 = redis::cmd("PFCOUNT")
            .arg(key)
            .query_async(&mut redis)
            .await
            .unwrap();
        count += shard;
    }
    assert_eq!(count, 1);

    // The next day two of them come back (the admin's report counts the admin too).
    app.clock.advance(Duration::from_secs(86_400));
    for token in &users[..2] {
        assert_eq!(app.get_as(token, "/api/v1/me").await.status(), 200);
    }
    let range = report("2027-01-15", "2027-01-16").await;
    assert_eq!(range["days"][1]["day"], "2027-01-16");
    assert_eq!(range["days"][1]["active_users"], 3, "{range}");
    assert_eq!(range["distinct_users"], 3, "{range}");

    // The CLI prints the same.
    let printed = app.cli(&[
        "stats",
        "active-users",
        "--from",
        "2027-01-15",
        "--to",
        "2027-01-16",
        "--json",
    ]);
    assert!(printed.status.success(), "{printed:?}");
    let printed: Value = serde_json::from_slice(&printed.stdout).unwrap();
    assert_eq!(printed["days"], range["days"]);
    assert_eq!(printed["distinct_users"], range["distinct_users"]);

    // Ranges are checked, naming the field.
    for (query, field) in [
        ("from=2027-01-16&to=2027-01-15", "from"),
        ("from=2027-01-01&to=16-01-2027", "to"),
        ("from=2025-01-01&to=2027-01-15", "from"),
    ] {
        let response = app
            .get_as(&admin, &format!("/api/v1/admin/stats/active-users?{query}"))
            .await;
        assert_eq!(response.status(), 422, "{query}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], field, "{query}");
    }
    let user_asks = app
        .get_as(&users[0], "/api/v1/admin/stats/active-users")
        .await;
    assert_eq!(user_asks.status(), 403);
}
