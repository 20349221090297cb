//! Redeem codes: batches issued in pages (resumable, never a serial twice), exported, revoked;
//! redemption exactly once across processes, with Redis flushed or unreachable; forged codes
//! refused without a lookup; every refusal named; the credit repaired when its request died.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::platform::event_store::{Direction, EventMetadata, EventStore, ReadFrom};
use zhihui::points::codes::RedeemError;
use zhihui::points::codes::issuer::CodeIssuer;
use zhihui_domain::points::Amount;
use zhihui_domain::redeem::{
    BatchEvent, CodeRedemption, RedemptionCommand, SERIAL_MAX, batch_stream, code_stream,
};
use zhihui_domain::user::UserId;

use crate::helpers::{TestApp, flush_redis, spawn_app_with, test_epoch};
use crate::tasks::project_and_verify;

/// Cheap password hashing (many users per test) and small pages (several per batch).
async fn spawn_codes_app() -> TestApp {
    spawn_codes_app_with(|_| {}).await
}

async fn spawn_codes_app_with(
    customise: impl FnOnce(&mut zhihui::platform::configuration::Settings),
) -> TestApp {
    spawn_app_with(|settings| {
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
        settings.codes.page_size = 10;
        customise(settings);
    })
    .await
}

fn hours(n: i64) -> chrono::Duration {
    chrono::Duration::hours(n)
}

fn metadata() -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: "test".into(),
    }
}

async fn create_batch(
    app: &TestApp,
    admin: &str,
    count: u32,
    points: &str,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Uuid {
    let response = app
        .post(
            "/api/v1/admin/code-batches",
            Some(admin),
            &json!({"count": count, "points": points, "valid_from": from, "valid_until": until, "note": "test"}),
        )
        .await;
    assert_eq!(response.status(), 202, "{:?}", response.text().await);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], "issuing");
    assert_eq!(body["issued"], 0);
    Uuid::parse_str(body["batch_id"].as_str().unwrap()).unwrap()
}

/// Issue every page of `batch` in another process (its generator).
async fn issue(app: &TestApp, batch: Uuid) -> u32 {
    Box::pin(CodeIssuer::new(app.services().codes).issue_batch(batch, None))
        .await
        .unwrap()
}

/// The batch's codes from the admin CSV export: (serial, code).
async fn export(app: &TestApp, admin: &str, batch: Uuid) -> Vec<(u32, String)> {
    let response = app
        .get_as(
            admin,
            &format!("/api/v1/admin/code-batches/{batch}/codes.csv"),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv")
    );
    let text = response.text().await.unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next().unwrap(),
        "serial,code,points,valid_from,valid_until,redeemed_by,redeemed_at"
    );
    lines
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            assert_eq!(fields.len(), 7, "{line}");
            (fields[0].parse().unwrap(), fields[1].to_owned())
        })
        .collect()
}

/// A batch created over HTTP, issued by another process, and its codes from the export.
pub(crate) async fn issued_batch(
    app: &TestApp,
    admin: &str,
    count: u32,
    points: &str,
    window: (DateTime<Utc>, DateTime<Utc>),
) -> (Uuid, Vec<(u32, String)>) {
    let batch = create_batch(app, admin, count, points, window.0, window.1).await;
    issue(app, batch).await;
    (batch, export(app, admin, batch).await)
}

async fn redeem(app: &TestApp, token: &str, code: &str) -> reqwest::Response {
    app.post("/api/v1/codes/redeem", Some(token), &json!({"code": code}))
        .await
}

async fn problem_type(response: reqwest::Response) -> (u16, String, Value) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (status, body["type"].as_str().unwrap_or("").to_owned(), body)
}

async fn user(app: &TestApp, name: &str) -> (UserId, String) {
    let id = app.register(name, "a long password").await;
    let token = app.login(name, "a long password").await;
    (UserId::from_uuid(Uuid::parse_str(&id).unwrap()), token)
}

#[tokio::test]
async fn a_batch_is_issued_in_pages_exported_and_each_code_redeemed_once() {
    let app = spawn_codes_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let batch = create_batch(&app, &admin, 25, "50", now - hours(1), now + hours(24)).await;

    // Nothing issued until the generator runs; then in pages of 10, 10 and 5.
    let codes_before = export(&app, &admin, batch).await;
    assert!(codes_before.is_empty());
    assert_eq!(issue(&app, batch).await, 3);
    let shown: Value = app
        .get_as(&admin, &format!("/api/v1/admin/code-batches/{batch}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (shown["status"].as_str(), shown["issued"].as_u64()),
        (Some("issued"), Some(25))
    );

    let codes = export(&app, &admin, batch).await;
    assert_eq!(codes.len(), 25);
    let serials: BTreeSet<u32> = codes.iter().map(|(serial, _)| *serial).collect();
    let first = *serials.first().unwrap();
    assert_eq!(serials, (first..first + 25).collect());
    let texts: HashSet<&str> = codes.iter().map(|(_, code)| code.as_str()).collect();
    assert_eq!(texts.len(), 25);

    // Alice redeems through one process, retries through the other: one credit.
    let (_alice, alice) = user(&app, "alice").await;
    let (_bob, bob) = user(&app, "bob").await;
    let code = &codes[3].1;
    let first_try: Value = redeem(&app, &alice, code).await.json().await.unwrap();
    assert_eq!(first_try["redeemed_now"], true, "{first_try}");
    assert_eq!(first_try["available"], "50.00");
    let lowercase_with_hyphen = format!("{}-{}", &code[..5], &code[5..]).to_lowercase();
    let retry = redeem(&other, &alice, &lowercase_with_hyphen).await;
    assert_eq!(retry.status(), 200);
    let retry: Value = retry.json().await.unwrap();
    assert_eq!(
        (retry["redeemed_now"].as_bool(), retry["available"].as_str()),
        (Some(false), Some("50.00"))
    );
    // Bob, through either process: taken.
    for instance in [&app, &other] {
        let (status, rule, _) = problem_type(redeem(instance, &bob, code).await).await;
        assert_eq!((status, rule.as_str()), (409, "/problems/code-redeemed"));
    }
    // Bob redeems two others, one through each process.
    for (instance, (_, code)) in [&other, &app].into_iter().zip(&codes[10..12]) {
        assert_eq!(redeem(instance, &bob, code).await.status(), 200);
    }
    let balance: Value = app
        .get_as(&bob, "/api/v1/account")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(balance["available"], "100.00");
    let ledger: Value = other
        .get_as(&bob, "/api/v1/account/ledger")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(ledger["entries"][0]["kind"], "redeem_code");

    app.project().await;
    let shown: Value = app
        .get_as(&admin, &format!("/api/v1/admin/code-batches/{batch}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(shown["redeemed"], 3);
    let exported = app
        .get_as(
            &admin,
            &format!("/api/v1/admin/code-batches/{batch}/codes.csv"),
        )
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(
        exported
            .lines()
            .filter(|line| !line.ends_with(",,"))
            .count(),
        1 + 3
    );
    project_and_verify(&app).await;
}

#[tokio::test]
async fn a_hundred_concurrent_redemptions_of_one_code_on_two_processes_give_one_success() {
    let app = spawn_codes_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let batch = create_batch(&app, &admin, 3, "25", now - hours(1), now + hours(1)).await;
    issue(&app, batch).await;
    let code = export(&app, &admin, batch).await[1].1.clone();

    let mut users = Vec::new();
    for n in 0..100 {
        users.push(user(&app, &format!("user{n}")).await);
    }
    let attempts = users.iter().enumerate().map(|(n, (_, token))| {
        let instance = if n % 2 == 0 { &app } else { &other };
        let code = code.clone();
        async move { redeem(instance, token, &code).await.status().as_u16() }
    });
    let statuses = futures::future::join_all(attempts).await;
    let ok = statuses.iter().filter(|status| **status == 200).count();
    let taken = statuses.iter().filter(|status| **status == 409).count();
    assert_eq!((ok, taken), (1, 99), "{statuses:?}");

    // One event: the credit, stored under the code's id; no stream of the code's own.
    let serial = app.services().codes.keys().decode(&code).unwrap().serial();
    let redemptions = app
        .services()
        .event_store
        .read_stream(
            &code_stream(serial),
            Direction::Forwards,
            ReadFrom::Start,
            10,
        )
        .await
        .unwrap();
    assert!(redemptions.is_empty(), "{redemptions:?}");
    let client = crate::helpers::connect(&app.settings).await;
    let credits: Vec<Uuid> = client
        .query(
            "SELECT event_id FROM events WHERE event_type = 'PointsCredited' AND payload->>'reference' LIKE $1",
            &[&format!("code:{batch}:{serial}")],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(credits, [zhihui_domain::redeem::credit_event_id(serial)]);
    project_and_verify(&app).await;
}

#[tokio::test]
async fn redis_flushed_before_and_during_redemptions_never_redeems_a_code_twice_nor_refuses_a_valid_one()
 {
    // Losing a race for a code is a failure; here users lose many on purpose.
    let app = spawn_codes_app_with(|settings| settings.codes.failures_max = 1_000).await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let (_batch, codes) =
        issued_batch(&app, &admin, 20, "10", (now - hours(1), now + hours(1))).await;
    let (_, first) = user(&app, "first").await;
    let (_, second) = user(&app, "second").await;

    // Flushed between issuing and redeeming: the batch is loaded from the store again.
    flush_redis(&app).await;
    for (n, (_, code)) in codes.iter().enumerate().take(10) {
        let instance = if n % 2 == 0 { &app } else { &other };
        assert_eq!(redeem(instance, &first, code).await.status(), 200);
    }
    // A burst over all 20 codes by both users, one on each process, with Redis flushed before it
    // and again while it runs: the markers are gone; the code streams still say who redeemed.
    flush_redis(&app).await;
    let attempts = codes.iter().enumerate().flat_map(|(n, (_, code))| {
        [(&app, &second), (&other, &first)].map(|(instance, token)| {
            let code = code.clone();
            async move { (n, redeem(instance, token, &code).await.status().as_u16()) }
        })
    });
    let (outcomes, ()) = tokio::join!(futures::future::join_all(attempts), async {
        tokio::task::yield_now().await;
        flush_redis(&app).await;
    });
    for (n, status) in outcomes {
        if n < 10 {
            // Second is refused (first had it); first's retry is a 200 repeat.
            assert!(status == 409 || status == 200, "code {n}: {status}");
        } else {
            assert!(status == 200 || status == 409, "code {n}: {status}");
        }
    }
    let balance_of = |token: &str| {
        let app = &app;
        let token = token.to_owned();
        async move {
            let body: Value = app
                .get_as(&token, "/api/v1/account")
                .await
                .json()
                .await
                .unwrap();
            body["available"].as_str().unwrap().to_owned()
        }
    };
    // Every code credited exactly once overall: 20 codes of 10 points.
    let first_points: f64 = balance_of(&first).await.parse().unwrap();
    let second_points: f64 = balance_of(&second).await.parse().unwrap();
    assert_eq!(first_points + second_points, 200.0);
    assert!(first_points >= 100.0, "first kept its ten: {first_points}");
    project_and_verify(&app).await;
}

/// A batch revoked through one instance is refused through the other, whose cache had the
/// batch as valid from a redemption a moment before; a revocation with a reason that shows
/// nothing is refused and revokes nothing. Consecutive requests alternate between the two;
/// the balance counts the one code redeemed before, and `audit verify` is clean.
#[tokio::test]
async fn a_batch_revoked_through_one_instance_is_refused_through_the_other() {
    let app = spawn_codes_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let (batch, codes) = issued_batch(&app, &admin, 3, "5", (now - hours(1), now + hours(3))).await;
    let (_, ann) = user(&app, "ann").await;
    assert_eq!(redeem(&other, &ann, &codes[0].1).await.status(), 200);

    let path = format!("/api/v1/admin/code-batches/{batch}/revoke");
    let (blank, reason) = (
        json!({"reason": "\u{200B} "}),
        json!({"reason": "泄露在论坛上"}),
    );
    let (status, rule, problem) = problem_type(app.post(&path, Some(&admin), &blank).await).await;
    assert_eq!(status, 422, "{rule} {problem}");
    assert_eq!(problem["field"], "reason", "{problem}");
    assert_eq!(redeem(&other, &ann, &codes[1].1).await.status(), 200);

    assert_eq!(app.post(&path, Some(&admin), &reason).await.status(), 200);
    let (status, rule, _) = problem_type(redeem(&other, &ann, &codes[2].1).await).await;
    assert_eq!((status, rule.as_str()), (409, "/problems/code-revoked"));
    let (status, rule, _) = problem_type(redeem(&app, &ann, &codes[2].1).await).await;
    assert_eq!((status, rule.as_str()), (409, "/problems/code-revoked"));

    for instance in [&app, &other] {
        let balance: Value = instance
            .get_as(&ann, "/api/v1/account")
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(balance["available"], "10.00");
    }
    project_and_verify(&app).await;
}

#[tokio::test]
async fn forged_codes_are_refused_without_postgres_or_redis_and_limited_per_user() {
    // Both dependencies unreachable: a lookup would fail with a store error, not `Invalid`.
    let app = spawn_codes_app().await;
    let mut settings = app.settings.clone();
    crate::helpers::one_redis_at(
        &mut settings,
        format!("redis://127.0.0.1:{}/0", crate::helpers::dead_port()),
    );
    settings.database.url = secrecy::SecretString::from(format!(
        "postgres://zhihui@127.0.0.1:{}/nothing",
        crate::helpers::dead_port()
    ));
    settings.database.connect_timeout_ms = 200;
    settings.database.pool_wait_timeout_ms = 200;
    settings.redis.connect_timeout_ms = 200;
    let pool = zhihui::platform::postgres::build_pool(&settings.database).unwrap();
    let cut_off = zhihui::state::AppState::build(&settings, pool, Default::default()).unwrap();
    let keys = cut_off.codes.keys().clone();

    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let mut refused = 0;
    for n in 0..10_000u32 {
        let text: String = (0..10)
            .map(|_| char::from(ALPHABET[rng.random_range(0..32)]))
            .collect();
        if keys.decode(&text).is_ok() {
            continue; // a 1-in-4-million chance: such a code is not a forgery of this test
        }
        // A user per 10 attempts: within the limit, so each refusal is the signature's.
        let user = UserId::from_uuid(Uuid::from_u128(u128::from(n / 10) + 1));
        match cut_off.codes.redeem(user, &text, &metadata()).await {
            Err(RedeemError::Invalid) => refused += 1,
            other => panic!("{text}: {other:?}"),
        }
    }
    assert!(refused >= 9_990, "{refused}");

    // The 11th failure of one user within the hour: limited, still without IO.
    let user = UserId::from_uuid(Uuid::from_u128(999_999));
    for _ in 0..10 {
        assert!(matches!(
            cut_off.codes.redeem(user, "0000000000", &metadata()).await,
            Err(RedeemError::Invalid)
        ));
    }
    assert!(matches!(
        cut_off.codes.redeem(user, "0000000000", &metadata()).await,
        Err(RedeemError::Limited { .. })
    ));
    // Sanity: a genuine code does need the store, and says so.
    let genuine = keys.encode(keys.active_slot(), 5).unwrap().to_string();
    let other_user = UserId::from_uuid(Uuid::from_u128(1_000_001));
    assert!(matches!(
        cut_off
            .codes
            .redeem(other_user, &genuine, &metadata())
            .await,
        Err(RedeemError::Store(_))
    ));
}

#[tokio::test]
async fn every_refusal_is_named_and_guessing_is_limited() {
    let app = spawn_codes_app().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let later = create_batch(&app, &admin, 2, "5", now + hours(2), now + hours(3)).await;
    let revoked = create_batch(&app, &admin, 2, "5", now - hours(1), now + hours(3)).await;
    issue(&app, later).await;
    issue(&app, revoked).await;
    let later_codes = export(&app, &admin, later).await;
    let revoked_codes = export(&app, &admin, revoked).await;
    let (_, token) = user(&app, "carol").await;

    let (status, rule, _) = problem_type(redeem(&app, &token, "not a code").await).await;
    assert_eq!((status, rule.as_str()), (422, "/problems/invalid-code"));
    // A mistyped code: one character changed.
    let mut typo = later_codes[0].1.clone().into_bytes();
    typo[4] = if typo[4] == b'Z' { b'Y' } else { b'Z' };
    let (status, rule, _) =
        problem_type(redeem(&app, &token, std::str::from_utf8(&typo).unwrap()).await).await;
    assert_eq!((status, rule.as_str()), (422, "/problems/invalid-code"));

    let (status, rule, body) = problem_type(redeem(&app, &token, &later_codes[0].1).await).await;
    assert_eq!(
        (status, rule.as_str()),
        (409, "/problems/code-not-valid-now")
    );
    let from: DateTime<Utc> = body["valid_from"].as_str().unwrap().parse().unwrap();
    assert_eq!(from, now + hours(2));

    let revoke = app
        .post(
            &format!("/api/v1/admin/code-batches/{revoked}/revoke"),
            Some(&admin),
            &json!({"reason": "leaked on a forum"}),
        )
        .await;
    assert_eq!(revoke.status(), 200);
    let (status, rule, _) = problem_type(redeem(&app, &token, &revoked_codes[0].1).await).await;
    assert_eq!((status, rule.as_str()), (409, "/problems/code-revoked"));
    // Redis flushed: the batch comes back from the store, revoked.
    flush_redis(&app).await;
    let (status, rule, _) = problem_type(redeem(&app, &token, &revoked_codes[1].1).await).await;
    assert_eq!((status, rule.as_str()), (409, "/problems/code-revoked"));

    // A revocation marked in Redis whose event never made it (the process died between the
    // two): a refusal needs the batch's latest version, so the code still redeems.
    let (stale, stale_codes) =
        issued_batch(&app, &admin, 2, "5", (now - hours(1), now + hours(3))).await;
    let (_, dan) = user(&app, "dan").await;
    assert_eq!(redeem(&app, &dan, &stale_codes[0].1).await.status(), 200);
    let services = app.services();
    let mut connection = services.redis.connection().await.unwrap();
    let cached: String = redis::cmd("GET")
        .arg(services.codes.batch_key(stale))
        .query_async(&mut connection)
        .await
        .unwrap();
    let mut fields: Vec<String> = cached.split(' ').map(str::to_owned).collect();
    fields[6] = "1".into();
    fields[7] = (fields[7].parse::<u64>().unwrap() + 1).to_string();
    let _: () = redis::cmd("SET")
        .arg(services.codes.batch_key(stale))
        .arg(fields.join(" "))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(redeem(&app, &dan, &stale_codes[1].1).await.status(), 200);

    // A revocation the store has and Redis lost (it failed over to a replica that had not
    // received the mark, or restarted losing its last second): Redis says "not revoked", as it
    // said before; the batch's last event refuses, and the cache is corrected.
    let (lost, lost_codes) =
        issued_batch(&app, &admin, 2, "5", (now - hours(1), now + hours(3))).await;
    let before_revocation: String = redis::cmd("GET")
        .arg(services.codes.batch_key(lost))
        .query_async(&mut connection)
        .await
        .unwrap();
    let revoke = app
        .post(
            &format!("/api/v1/admin/code-batches/{lost}/revoke"),
            Some(&admin),
            &json!({"reason": "泄露在论坛上"}),
        )
        .await;
    assert_eq!(revoke.status(), 200);
    let _: () = redis::cmd("SET")
        .arg(services.codes.batch_key(lost))
        .arg(&before_revocation)
        .query_async(&mut connection)
        .await
        .unwrap();
    let (_, fay) = user(&app, "fay").await;
    let (status, rule, _) = problem_type(redeem(&app, &fay, &lost_codes[0].1).await).await;
    assert_eq!((status, rule.as_str()), (409, "/problems/code-revoked"));
    let corrected: String = redis::cmd("GET")
        .arg(services.codes.batch_key(lost))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(corrected.split(' ').nth(6), Some("1"), "{corrected}");

    // A genuine signature on a serial no batch holds.
    let keys = app.services().codes.keys().clone();
    let unknown = keys
        .encode(keys.active_slot(), SERIAL_MAX)
        .unwrap()
        .to_string();
    let (status, _, _) = problem_type(redeem(&app, &token, &unknown).await).await;
    assert_eq!(status, 404);

    // Failures counted since the flush: the revoked code, the unknown serial. Eight more
    // lookups fail; the next attempt is limited, whatever the code.
    for _ in 0..8 {
        assert_eq!(redeem(&app, &token, &unknown).await.status(), 404);
    }
    let limited = redeem(&app, &token, &later_codes[1].1).await;
    assert_eq!(limited.status(), 429);
    assert!(limited.headers().contains_key("retry-after"));
    // After the window, the user may try again.
    app.clock.advance(Duration::from_millis(
        app.settings.codes.failures_window_ms + 1,
    ));
    let token = app.login("carol", "a long password").await;
    let (status, rule, _) = problem_type(redeem(&app, &token, &later_codes[1].1).await).await;
    assert_eq!(
        (status, rule.as_str()),
        (409, "/problems/code-not-valid-now")
    );

    // Forged attempts are counted in the process's memory (no IO) and join the user's shared
    // counter on their next lookup: nine forgeries here, one unknown serial, and the other
    // process limits them.
    let other = app.another_instance().await;
    let (_, eve) = user(&app, "eve").await;
    for _ in 0..9 {
        assert_eq!(redeem(&app, &eve, "ZZZZZZZZZZ").await.status(), 422);
    }
    assert_eq!(redeem(&app, &eve, &unknown).await.status(), 404);
    let (status, rule, _) = problem_type(redeem(&other, &eve, &later_codes[1].1).await).await;
    assert_eq!(
        (status, rule.as_str()),
        (429, "/problems/too-many-failed-redemptions")
    );
}

#[tokio::test]
async fn a_generator_stopped_mid_batch_is_resumed_without_a_repeated_or_skipped_serial() {
    let app = spawn_codes_app().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let batch = create_batch(&app, &admin, 95, "1", now - hours(1), now + hours(1)).await;

    // The first process issues three pages and dies.
    let dying = CodeIssuer::new(app.services().codes);
    assert_eq!(dying.issue_batch(batch, Some(3)).await.unwrap(), 3);
    drop(dying);
    // Two others pick it up from the read model at once; they race page by page.
    app.project().await;
    let a = CodeIssuer::new(app.services().codes);
    let b = CodeIssuer::new(app.services().codes);
    let (pages_a, pages_b) = tokio::join!(a.issue_pending_once(), b.issue_pending_once());
    assert_eq!(pages_a.unwrap() + pages_b.unwrap(), 7);

    let events = app
        .services()
        .event_store
        .read_stream(
            &batch_stream(batch),
            Direction::Forwards,
            ReadFrom::Start,
            100,
        )
        .await
        .unwrap();
    let events = events
        .iter()
        .map(|r| {
            zhihui_domain::DomainEvent::from_stored(&r.event_type, r.schema_version, &r.payload)
                .unwrap()
        })
        .collect::<Vec<BatchEvent>>();
    let BatchEvent::Created(created) = &events[0] else {
        panic!("{:?}", events[0])
    };
    let mut next = created.first_serial;
    for event in &events[1..] {
        let BatchEvent::Issued(page) = event else {
            panic!("{event:?}")
        };
        assert_eq!(page.from_serial, next, "pages are contiguous");
        next += page.count;
    }
    assert_eq!(next, created.first_serial + 95);
    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    let row = client
        .query_one(
            "SELECT count(*), count(DISTINCT serial), min(serial), max(serial) FROM redeem_codes WHERE batch_id = $1",
            &[&batch],
        )
        .await
        .unwrap();
    let first = i32::try_from(created.first_serial).unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i32>(2),
            row.get::<_, i32>(3)
        ),
        (95, 95, first, first + 94)
    );
    project_and_verify(&app).await;
}

/// Redemptions recorded as earlier versions did (and as KurrentDB still does): the code's own
/// stream names its redeemer, then the account is credited in a second append.
#[tokio::test]
async fn a_redemption_in_its_codes_stream_whose_credit_was_lost_is_credited_by_the_retry_or_the_reconciler()
 {
    let app = spawn_codes_app().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let (batch, codes) =
        issued_batch(&app, &admin, 2, "30", (now - hours(1), now + hours(1))).await;
    let (dave_id, dave) = user(&app, "dave").await;
    let (erin_id, erin) = user(&app, "erin").await;

    // Both requests died after the code's stream and before the account.
    let services = app.services_on_app_clock();
    for ((serial, _), user_id) in codes.iter().zip([dave_id, erin_id]) {
        zhihui::platform::command::execute::<CodeRedemption>(
            &services.event_store,
            &code_stream(*serial),
            &RedemptionCommand::Redeem {
                serial: *serial,
                batch_id: batch,
                user_id,
                points: Amount::whole(30),
                at: now,
            },
            &metadata(),
            zhihui::platform::command::RetryPolicy::default(),
        )
        .await
        .unwrap();
    }
    // Dave's code is his, though neither Redis nor his account knows it yet: the code's stream
    // says so, on either process.
    let other = app.another_instance().await;
    for instance in [&app, &other] {
        let (status, problem, _) = problem_type(redeem(instance, &erin, &codes[0].1).await).await;
        assert_eq!((status, problem.as_str()), (409, "/problems/code-redeemed"));
    }
    // Dave retries: the repeat credits him (once).
    let retry: Value = redeem(&app, &dave, &codes[0].1).await.json().await.unwrap();
    assert_eq!(
        (retry["redeemed_now"].as_bool(), retry["available"].as_str()),
        (Some(false), Some("30.00"))
    );

    // Erin never comes back: owed, pending within the bound, then repaired.
    app.project().await;
    let verified = app.verify(None).await;
    assert_eq!(
        (verified.differences.len(), verified.pending_settlements),
        (0, 1),
        "{:?}",
        verified.differences
    );
    let reconciler = zhihui::points::settlements::SettlementReconciler::new(
        services.tasks.clone(),
        services.codes.clone(),
        services.checkins.clone(),
        services.promotions.clone(),
        services.pg_pool.clone(),
        services.clock.clone(),
    );
    assert!(
        reconciler
            .reconcile_once()
            .await
            .unwrap()
            .repairs
            .is_empty()
    );
    app.clock.advance(Duration::from_millis(
        app.settings.tasks.settlement_after_ms + 1,
    ));
    let pass = reconciler.reconcile_once().await.unwrap();
    assert_eq!(pass.repairs.len(), 1);
    assert_eq!(pass.repairs[0].code_serial, Some(codes[1].0));
    assert_eq!(pass.repairs[0].user_id, erin_id.as_uuid());
    // Nothing more to do, and nothing credited twice.
    app.project().await;
    assert!(
        reconciler
            .reconcile_once()
            .await
            .unwrap()
            .repairs
            .is_empty()
    );
    let repairs = app.cli(&["audit", "repairs"]);
    assert!(String::from_utf8_lossy(&repairs.stdout).contains("code_credited"));
    project_and_verify(&app).await;

    let life = app.cli(&["audit", "code", &codes[1].1]);
    let text = String::from_utf8_lossy(&life.stdout);
    assert!(
        life.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&life.stderr)
    );
    assert!(
        text.contains(&erin_id.to_string()) && text.contains("credited     30"),
        "{text}"
    );
}

#[tokio::test]
async fn audit_verify_finds_a_code_credited_twice_or_without_redemption() {
    let app = spawn_codes_app().await;
    let admin = app.admin_token("admin").await;
    let now = test_epoch();
    let (batch, codes) =
        issued_batch(&app, &admin, 2, "30", (now - hours(1), now + hours(1))).await;
    let (_, frank) = user(&app, "frank").await;
    let (grace_id, _) = user(&app, "grace").await;
    assert_eq!(redeem(&app, &frank, &codes[0].1).await.status(), 200);

    let services = app.services();
    let credit = |serial: u32| zhihui_domain::account::AccountCommand::Credit {
        operation_id: zhihui_domain::redeem::credit_operation_id(serial),
        kind: zhihui_domain::account::CreditKind::RedeemCode,
        amount: Amount::whole(30),
        reference: zhihui_domain::redeem::credit_reference(batch, serial),
        at: now,
    };
    let grace_account = zhihui_domain::account::account_stream(grace_id);
    // Crediting grace frank's code the way every path does is refused by the store itself.
    let refused = services
        .accounts
        .execute(&grace_account, credit(codes[0].0), metadata())
        .await;
    assert!(
        matches!(
            &refused,
            Err(zhihui::platform::command::CommandError::Store(error))
                if error.to_string().contains("already used by a different append")
        ),
        "{refused:?}"
    );

    // Sabotage: what a bug writing credits under fresh ids would store: grace credited frank's
    // code, and a code nobody redeemed.
    for (serial, _) in &codes {
        let loaded = zhihui::platform::command::load::<zhihui_domain::account::Account>(
            &services.event_store,
            &grace_account,
        )
        .await
        .unwrap();
        let events = <zhihui_domain::account::Account as zhihui_domain::Decider>::decide(
            &loaded.state,
            &credit(*serial),
        )
        .unwrap();
        let mut stored = zhihui::platform::command::to_new_events(&events, &metadata());
        stored[0].id = Uuid::now_v7();
        services
            .event_store
            .append(
                &grace_account,
                loaded.version.map_or(
                    zhihui::platform::event_store::ExpectedVersion::NoStream,
                    zhihui::platform::event_store::ExpectedVersion::Exact,
                ),
                stored,
            )
            .await
            .unwrap();
    }
    app.project().await;
    let verified = app.verify(None).await;
    let found: Vec<String> = verified
        .differences
        .iter()
        .map(ToString::to_string)
        .collect();
    let serial_0 = codes[0].0;
    let serial_1 = codes[1].0;
    assert!(
        found
            .iter()
            .any(|d| d.contains(&format!("serial {serial_0}")) && d.contains("credited 2 times")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|d| d.contains(&format!("serial {serial_0}")) && d.contains("redeemed by")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|d| d.contains(&format!("serial {serial_1}")) && d.contains("never redeemed")),
        "{found:?}"
    );
}

#[tokio::test]
async fn the_cli_issues_shows_exports_and_revokes_a_batch_and_tells_a_codes_life() {
    let app = spawn_codes_app().await;
    let until = (test_epoch() + hours(24)).to_rfc3339();
    let from = (test_epoch() - hours(1)).to_rfc3339();
    let issued = app.cli(&[
        "codes",
        "issue",
        "--count",
        "12",
        "--points",
        "7.5",
        "--valid-from",
        &from,
        "--valid-until",
        &until,
        "--note",
        "support",
    ]);
    let text = String::from_utf8_lossy(&issued.stdout).to_string();
    assert!(
        issued.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&issued.stderr)
    );
    assert!(
        text.contains("12 issued of 12") && text.contains("7.5"),
        "{text}"
    );
    let batch = text
        .lines()
        .find_map(|line| line.strip_prefix("batch"))
        .unwrap()
        .trim()
        .to_owned();

    let export = app.cli(&["codes", "export", &batch]);
    let csv = String::from_utf8_lossy(&export.stdout).to_string();
    assert!(export.status.success());
    let codes: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|line| line.split(',').nth(1).unwrap())
        .collect();
    assert_eq!(codes.len(), 12);

    let (_, token) = user(&app, "cli_user").await;
    let redeemed: Value = redeem(&app, &token, codes[0]).await.json().await.unwrap();
    assert_eq!(redeemed["available"], "7.50");
    app.project().await;
    let show = app.cli(&["codes", "show", &batch]);
    assert!(String::from_utf8_lossy(&show.stdout).contains("1 redeemed"));
    let revoke = app.cli(&["codes", "revoke", &batch, "--reason", "campaign over"]);
    assert!(String::from_utf8_lossy(&revoke.stdout).contains("revoked"));
    let (status, rule, _) = problem_type(redeem(&app, &token, codes[1]).await).await;
    assert_eq!((status, rule.as_str()), (409, "/problems/code-revoked"));

    let life = app.cli(&["audit", "code", codes[0]]);
    let text = String::from_utf8_lossy(&life.stdout).to_string();
    assert!(
        text.contains("redeemed     by") && text.contains("credited     7.5"),
        "{text}"
    );
    let forged = app.cli(&["audit", "code", "ZZZZZZZZZZ"]);
    assert!(!forged.status.success());
    project_and_verify(&app).await;
}
