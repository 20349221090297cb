//! Users and authentication over HTTP: registration, password and phone-code login, sliding
//! token expiry, logout, every limit exactly at its threshold, roles and ownership. Time moves by
//! the app's manual clock, never by sleeping.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{Value, json};
use zhihui::platform::event_store::{EventFilter, EventStore, NewEvent};
use zhihui_domain::DomainEvent;
use zhihui_domain::claim::{ClaimEvent, IdentifierClaimed};
use zhihui_domain::user::UserId;

use crate::helpers::{TestApp, spawn_app, spawn_app_with};

const PHONE: &str = "+8613800138000";

pub(crate) async fn problem_of(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    assert_eq!(content_type, "application/problem+json", "status {status}");
    (status, response.json().await.unwrap())
}

async fn send_code(app: &TestApp, phone: &str) -> reqwest::Response {
    app.post("/api/v1/auth/code", None, &json!({ "phone": phone }))
        .await
}

async fn code_login(app: &TestApp, phone: &str, code: &str) -> reqwest::Response {
    app.post(
        "/api/v1/auth/login",
        None,
        &json!({ "phone": phone, "code": code }),
    )
    .await
}

fn wrong_code_for(code: &str) -> String {
    let digit = (code.as_bytes()[0] - b'0' + 1) % 10;
    format!("{digit}{}", &code[1..])
}

#[tokio::test]
async fn register_login_and_read_ones_profile_without_ever_seeing_the_hash() {
    let app = spawn_app().await;
    let id = app.register("Alice", "correct horse battery").await;
    let response = app
        .post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "alice", "password": "correct horse battery"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["token_type"], "Bearer");
    assert_eq!(body["idle_timeout_s"], 1800);
    assert_eq!(body["user"]["id"], id.as_str());
    let token = body["token"].as_str().unwrap();

    let me = app.get_as(token, "/api/v1/me").await;
    assert_eq!(me.status(), 200);
    let text = me.text().await.unwrap();
    let me: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(me["username"], "alice");
    assert_eq!(me["role"], "user");
    assert!(!text.contains("argon2"), "{text}");
    assert!(!body.to_string().contains("argon2"));
}

#[tokio::test]
async fn wrong_passwords_and_unknown_users_get_the_same_answer() {
    let app = spawn_app().await;
    app.register("alice", "correct horse battery").await;
    for body in [
        json!({"username": "alice", "password": "wrong horse battery"}),
        json!({"username": "nobody", "password": "correct horse battery"}),
        json!({"username": "x", "password": "correct horse battery"}),
    ] {
        let (status, problem) = problem_of(app.post("/api/v1/auth/login", None, &body).await).await;
        assert_eq!(status, 401);
        assert_eq!(problem["type"], "/problems/wrong-credentials");
        assert_eq!(problem["detail"], "wrong username or password");
    }
}

#[tokio::test]
async fn invalid_registrations_name_the_field() {
    let app = spawn_app().await;
    for (body, field) in [
        (
            json!({"username": "al", "password": "long enough"}),
            "username",
        ),
        (
            json!({"username": "alice", "password": "short"}),
            "password",
        ),
        // A field missing is named too.
        (json!({"username": "alice"}), "password"),
    ] {
        let (status, problem) =
            problem_of(app.post("/api/v1/auth/register", None, &body).await).await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(problem["field"], field, "{problem}");
    }
    let (status, problem) = problem_of(
        app.post("/api/v1/auth/login", None, &json!({"username": "alice"}))
            .await,
    )
    .await;
    assert_eq!((status, problem["field"].as_str()), (422, Some("password")));
}

#[tokio::test]
async fn the_token_expiry_slides_with_each_use_and_then_ends() {
    let app = spawn_app().await;
    app.register("alice", "correct horse battery").await;
    let token = app.login("alice", "correct horse battery").await;
    let idle = Duration::from_secs(30 * 60);

    // Used just before it would expire, three times in a row: 87 minutes after login, still alive.
    for _ in 0..3 {
        app.clock.advance(idle - Duration::from_millis(1));
        assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 200);
    }
    // Then left alone for exactly the idle timeout: dead, and it stays dead.
    app.clock.advance(idle);
    let (status, problem) = problem_of(app.get_as(&token, "/api/v1/me").await).await;
    assert_eq!(status, 401);
    assert_eq!(problem["type"], "/problems/invalid-token");
    app.clock.advance(Duration::from_secs(1));
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 401);
}

#[tokio::test]
async fn logout_revokes_the_token_and_only_that_token() {
    let app = spawn_app().await;
    app.register("alice", "correct horse battery").await;
    let first = app.login("alice", "correct horse battery").await;
    let second = app.login("alice", "correct horse battery").await;
    let response = app
        .post("/api/v1/auth/logout", Some(&first), &json!({}))
        .await;
    assert_eq!(response.status(), 204);
    assert_eq!(app.get_as(&first, "/api/v1/me").await.status(), 401);
    assert_eq!(
        app.post("/api/v1/auth/logout", Some(&first), &json!({}))
            .await
            .status(),
        401
    );
    assert_eq!(app.get_as(&second, "/api/v1/me").await.status(), 200);
}

#[tokio::test]
async fn a_missing_or_forged_token_gets_401() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let token = app.login("alice", "correct horse battery").await;

    let response = app.get("/api/v1/me").await;
    assert_eq!(
        response.headers()["www-authenticate"],
        "Bearer error=\"missing-token\""
    );
    let (status, problem) = problem_of(response).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/missing-token"))
    );

    // A token of the right shape naming alice's id, but with other random bytes.
    use base64::Engine as _;
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut bytes = engine.decode(&token).unwrap();
    bytes[40] ^= 0xff;
    let forged = engine.encode(&bytes);
    // And garbage, and a token with its last character changed.
    let mut tampered = token.clone();
    let last = tampered.pop().unwrap();
    tampered.push(if last == 'A' { 'B' } else { 'A' });
    for bad in [forged.as_str(), "garbage", tampered.as_str(), &alice] {
        let (status, problem) = problem_of(app.get_as(bad, "/api/v1/me").await).await;
        assert_eq!(status, 401, "{bad}");
        assert_eq!(problem["type"], "/problems/invalid-token");
    }
    let response = app
        .http
        .get(format!("{}/api/v1/me", app.address))
        .header("Authorization", format!("Basic {token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 200);
}

#[tokio::test]
async fn admin_endpoints_refuse_users_with_403_and_serve_admins() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let user_token = app.login("alice", "correct horse battery").await;
    let admin_token = app.admin_token("root").await;
    let path = format!("/api/v1/admin/users/{alice}");

    let (status, problem) = problem_of(app.get_as(&user_token, &path).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (403, Some("/problems/admin-only"))
    );
    assert_eq!(app.get("/api/v1/admin/users/x").await.status(), 401);

    let response = app.get_as(&admin_token, &path).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["username"], "alice");

    // Promote alice: her sessions end, and her next login carries the admin role.
    let response = app
        .put(
            &format!("{path}/role"),
            Some(&admin_token),
            &json!({"role": "admin"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(app.get_as(&user_token, "/api/v1/me").await.status(), 401);
    let promoted = app.login("alice", "correct horse battery").await;
    assert_eq!(app.get_as(&promoted, &path).await.status(), 200);
}

#[tokio::test]
async fn another_users_resource_is_404_never_403() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let bob = app.register("bob", "correct horse battery").await;
    let alice_token = app.login("alice", "correct horse battery").await;

    assert_eq!(
        app.get_as(&alice_token, &format!("/api/v1/users/{alice}"))
            .await
            .status(),
        200
    );
    for other in [
        bob.as_str(),
        "00000000-0000-0000-0000-000000000000",
        "not-a-uuid",
    ] {
        let (status, problem) = problem_of(
            app.get_as(&alice_token, &format!("/api/v1/users/{other}"))
                .await,
        )
        .await;
        assert_eq!(status, 404, "{other}");
        assert!(!problem.to_string().contains("bob"));
    }
}

#[tokio::test]
async fn a_hundred_concurrent_registrations_of_one_name_give_one_user() {
    let app = spawn_app().await;
    let attempts = (0..100).map(|i| {
        let app = &app;
        async move {
            app.post(
                "/api/v1/auth/register",
                None,
                &json!({"username": "popular", "password": format!("password {i}")}),
            )
            .await
            .status()
            .as_u16()
        }
    });
    let statuses = futures::future::join_all(attempts).await;
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 409).count(),
        99,
        "{statuses:?}"
    );

    let store = app.services().event_store;
    let registered = store
        .read_all(
            None,
            1_000,
            &EventFilter::EventTypes(vec!["UserRegistered".into()]),
        )
        .await
        .unwrap();
    assert_eq!(registered.events.len(), 1);
    assert_eq!(
        registered.events[0].payload.to_value()["username"],
        "popular"
    );
    let claim = store
        .read_stream(
            "user-name-popular",
            zhihui::platform::event_store::Direction::Forwards,
            zhihui::platform::event_store::ReadFrom::Start,
            100,
        )
        .await
        .unwrap();
    assert_eq!(claim.len(), 1, "one claim event, no release");
}

#[tokio::test]
async fn redis_down_answers_503_naming_it_and_never_lets_anyone_in() {
    let app = spawn_app_with(|settings| {
        crate::helpers::one_redis_at(
            settings,
            format!("redis://127.0.0.1:{}/0", crate::helpers::dead_port()),
        );
    })
    .await;
    // Registration needs no Redis; login (sessions, limits) does.
    app.register("alice", "correct horse battery").await;
    let (status, problem) = problem_of(
        app.post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "alice", "password": "correct horse battery"}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 503);
    assert_eq!(problem["dependencies"], json!(["redis"]));
    let fake = "A".repeat(64);
    let (status, _) = problem_of(app.get_as(&fake, "/api/v1/me").await).await;
    assert_eq!(status, 503);
}

#[tokio::test]
async fn an_orphan_name_claim_is_released_after_its_bound_and_not_before() {
    let app = spawn_app().await;
    // Simulate a crash between the claim and the registration: the claim exists, the user not.
    let store = app.services().event_store;
    let orphan = ClaimEvent::Claimed(IdentifierClaimed {
        owner: UserId::from_uuid(uuid::Uuid::now_v7()),
        claimed_at: app.clock.now(),
    });
    store
        .append(
            "user-name-carol",
            zhihui::platform::event_store::ExpectedVersion::NoStream,
            vec![NewEvent {
                id: uuid::Uuid::now_v7(),
                event_type: orphan.event_type().into(),
                schema_version: 1,
                payload: orphan.to_payload(),
                metadata: zhihui::platform::event_store::EventMetadata {
                    correlation_id: uuid::Uuid::now_v7(),
                    causation_id: None,
                    actor: "test".into(),
                },
            }],
        )
        .await
        .unwrap();
    let body = json!({"username": "carol", "password": "correct horse battery"});
    app.clock.advance(Duration::from_millis(59_999));
    let (status, problem) = problem_of(app.post("/api/v1/auth/register", None, &body).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (409, Some("/problems/username-taken"))
    );
    app.clock.advance(Duration::from_millis(1));
    assert_eq!(
        app.post("/api/v1/auth/register", None, &body)
            .await
            .status(),
        201
    );
    app.login("carol", "correct horse battery").await;
}

#[tokio::test]
async fn registration_can_be_switched_off() {
    let app = spawn_app_with(|settings| settings.auth.registration_enabled = false).await;
    let (status, problem) = problem_of(
        app.post(
            "/api/v1/auth/register",
            None,
            &json!({"username": "alice", "password": "correct horse battery"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (403, Some("/problems/registration-closed"))
    );
    // Admins are still created out of band.
    app.admin_token("root").await;
}

#[tokio::test]
async fn a_first_code_login_creates_the_user_and_the_next_finds_it() {
    let app = spawn_app().await;
    let response = send_code(&app, "138 0013 8000").await;
    assert_eq!(response.status(), 202);
    let code = app.codes.last(PHONE).unwrap();
    assert_eq!(code.len(), 6);
    let response = code_login(&app, "13800138000", &code).await;
    assert_eq!(response.status(), 200);
    let first: Value = response.json().await.unwrap();
    assert_eq!(first["user"]["phone"], PHONE);

    // A used code is gone.
    let (status, problem) = problem_of(code_login(&app, PHONE, &code).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/code-expired"))
    );

    app.clock.advance(Duration::from_secs(60));
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let response = code_login(&app, PHONE, &app.codes.last(PHONE).unwrap()).await;
    let second: Value = response.json().await.unwrap();
    assert_eq!(second["user"]["id"], first["user"]["id"]);
}

#[tokio::test]
async fn a_code_expires_exactly_after_two_minutes() {
    let app = spawn_app().await;
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    app.clock.advance(Duration::from_millis(119_999));
    let code = app.codes.last(PHONE).unwrap();
    assert_eq!(code_login(&app, PHONE, &code).await.status(), 200);

    app.clock.advance(Duration::from_secs(60));
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    app.clock.advance(Duration::from_millis(120_000));
    let (status, problem) =
        problem_of(code_login(&app, PHONE, &app.codes.last(PHONE).unwrap()).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/code-expired"))
    );
}

#[tokio::test]
async fn one_send_per_minute_exactly() {
    let app = spawn_app().await;
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let sent_at = app.clock.now();
    app.clock.advance(Duration::from_millis(59_999));
    let response = send_code(&app, PHONE).await;
    assert_eq!(response.headers()["retry-after"], "1");
    let (status, problem) = problem_of(response).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/too-many-sends"))
    );
    let retry_at: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(problem["retry_at"].clone()).unwrap();
    assert_eq!(retry_at, sent_at + chrono::Duration::seconds(60));
    app.clock.advance(Duration::from_millis(1));
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    assert_eq!(app.codes.count(PHONE), 2);
    // Another phone is not affected.
    assert_eq!(send_code(&app, "+14155550100").await.status(), 202);
}

#[tokio::test]
async fn ten_sends_a_day_exactly_then_the_next_day() {
    let app = spawn_app().await;
    for _ in 0..10 {
        assert_eq!(send_code(&app, PHONE).await.status(), 202);
        app.clock.advance(Duration::from_secs(60));
    }
    let (status, problem) = problem_of(send_code(&app, PHONE).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/daily-send-limit"))
    );
    assert_eq!(app.codes.count(PHONE), 10);
    // The test clock started at 09:00 UTC+8; the day ends at 16:00 UTC.
    let retry_at: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(problem["retry_at"].clone()).unwrap();
    assert_eq!(retry_at.to_rfc3339(), "2027-01-15T16:00:00+00:00");
    let until_midnight = (retry_at - app.clock.now()).to_std().unwrap();
    app.clock.advance(until_midnight - Duration::from_millis(1));
    assert_eq!(send_code(&app, PHONE).await.status(), 429);
    app.clock.advance(Duration::from_millis(1));
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
}

#[tokio::test]
async fn five_wrong_codes_lock_the_phone_for_ten_minutes_exactly() {
    let app = spawn_app().await;
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let code = app.codes.last(PHONE).unwrap();
    let wrong = wrong_code_for(&code);
    for attempts_left in (1..=4).rev() {
        let (status, problem) = problem_of(code_login(&app, PHONE, &wrong).await).await;
        assert_eq!(
            (status, problem["type"].as_str()),
            (401, Some("/problems/wrong-code"))
        );
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains(&format!("{attempts_left} more")),
            "{problem}"
        );
    }
    let locked_at = app.clock.now();
    let (status, problem) = problem_of(code_login(&app, PHONE, &wrong).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/phone-locked"))
    );
    let until: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(problem["retry_at"].clone()).unwrap();
    assert_eq!(until, locked_at + chrono::Duration::minutes(10));

    // While locked, even the right code and a new send are refused.
    assert_eq!(code_login(&app, PHONE, &code).await.status(), 429);
    app.clock.advance(Duration::from_millis(599_999));
    let (status, problem) = problem_of(send_code(&app, PHONE).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/phone-locked"))
    );
    app.clock.advance(Duration::from_millis(1));
    // The lock voided the old code; a new one works.
    assert_eq!(code_login(&app, PHONE, &code).await.status(), 401);
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let fresh = app.codes.last(PHONE).unwrap();
    assert_eq!(code_login(&app, PHONE, &fresh).await.status(), 200);
}

#[tokio::test]
async fn ten_wrong_passwords_lock_the_username_and_the_lock_ends() {
    let app = spawn_app().await;
    app.register("alice", "correct horse battery").await;
    let wrong = json!({"username": "alice", "password": "wrong horse battery"});
    for _ in 0..9 {
        assert_eq!(
            app.post("/api/v1/auth/login", None, &wrong).await.status(),
            401
        );
    }
    let (status, problem) = problem_of(app.post("/api/v1/auth/login", None, &wrong).await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/username-locked"))
    );
    let right = json!({"username": "alice", "password": "correct horse battery"});
    assert_eq!(
        app.post("/api/v1/auth/login", None, &right).await.status(),
        429
    );
    app.clock.advance(Duration::from_secs(15 * 60));
    assert_eq!(
        app.post("/api/v1/auth/login", None, &right).await.status(),
        200
    );
}

#[tokio::test]
async fn a_password_change_needs_the_current_one_and_ends_every_session() {
    let app = spawn_app().await;
    app.register("alice", "correct horse battery").await;
    let token = app.login("alice", "correct horse battery").await;
    let other = app.login("alice", "correct horse battery").await;
    let (status, problem) = problem_of(
        app.put(
            "/api/v1/me/password",
            Some(&token),
            &json!({"current_password": "nope nope nope", "new_password": "new horse battery"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/wrong-credentials"))
    );
    // The same password again would end every session for nothing: refused, naming the field.
    let (status, problem) = problem_of(
        app.put(
            "/api/v1/me/password",
            Some(&token),
            &json!({"current_password": "correct horse battery", "new_password": "correct horse battery"}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert!(
        problem.to_string().contains("password_unchanged"),
        "{problem}"
    );
    assert!(problem.to_string().contains("new_password"), "{problem}");
    assert_eq!(app.get_as(&other, "/api/v1/me").await.status(), 200);
    let response = app
        .put(
            "/api/v1/me/password",
            Some(&token),
            &json!({"current_password": "correct horse battery", "new_password": "new horse battery"}),
        )
        .await;
    assert_eq!(response.status(), 204);
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 401);
    assert_eq!(app.get_as(&other, "/api/v1/me").await.status(), 401);
    app.login("alice", "new horse battery").await;
}

#[tokio::test]
async fn a_phone_bound_to_one_user_cannot_be_bound_to_another() {
    let app = spawn_app().await;
    app.register("alice", "correct horse battery").await;
    app.register("bob", "correct horse battery").await;
    let alice = app.login("alice", "correct horse battery").await;
    let bob = app.login("bob", "correct horse battery").await;
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let response = app
        .post(
            "/api/v1/me/phone",
            Some(&alice),
            &json!({"phone": PHONE, "code": app.codes.last(PHONE).unwrap()}),
        )
        .await;
    assert_eq!(response.status(), 200);
    app.clock.advance(Duration::from_secs(60));
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let (status, problem) = problem_of(
        app.post(
            "/api/v1/me/phone",
            Some(&bob),
            &json!({"phone": PHONE, "code": app.codes.last(PHONE).unwrap()}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (409, Some("/problems/phone-taken"))
    );
    // And a code login of that phone is alice.
    app.clock.advance(Duration::from_secs(60));
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let body: Value = code_login(&app, PHONE, &app.codes.last(PHONE).unwrap())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["user"]["username"], "alice");
}

#[tokio::test]
async fn the_openapi_document_lists_the_auth_endpoints() {
    let app = spawn_app().await;
    let response = app.get("/api/openapi.json").await;
    assert_eq!(response.status(), 200);
    let document: Value = response.json().await.unwrap();
    for path in [
        "/api/v1/auth/register",
        "/api/v1/auth/login",
        "/api/v1/auth/code",
        "/api/v1/auth/logout",
        "/api/v1/auth/password-reset",
        "/api/v1/me",
        "/api/v1/admin/users/{id}/role",
    ] {
        assert!(document["paths"][path].is_object(), "{path} missing");
    }
    assert_eq!(
        document["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    assert!(document["components"]["schemas"]["LoginRequest"].is_object());
}

#[tokio::test]
async fn users_create_bootstraps_an_admin_from_the_command_line() {
    let app = spawn_app().await;
    use secrecy::ExposeSecret;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_zhihui"))
        .args(["users", "create", "root", "--admin", "--password-stdin"])
        .env(
            "ZHIHUI_DATABASE__URL",
            app.settings.database.url.expose_secret(),
        )
        .env("ZHIHUI_REDIS__URL", app.settings.redis.url.expose_secret())
        .env(
            "ZHIHUI_REDIS__CLUSTER_NODES",
            app.settings.redis.cluster_nodes.expose_secret(),
        )
        .env("ZHIHUI_REDIS__KEY_PREFIX", &app.settings.redis.key_prefix)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "root password 1").unwrap();
    }
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("created admin root ("));
    let token = app.login("root", "root password 1").await;
    let me: Value = app.get_as(&token, "/api/v1/me").await.json().await.unwrap();
    assert_eq!(me["role"], "admin");
}

#[tokio::test]
async fn the_users_read_model_follows_registrations_roles_and_phones() {
    let app = spawn_app().await;
    let alice = app.register("alice", "correct horse battery").await;
    let admin = app.admin_token("root").await;
    let token = app.login("alice", "correct horse battery").await;
    assert_eq!(send_code(&app, PHONE).await.status(), 202);
    let response = app
        .post(
            "/api/v1/me/phone",
            Some(&token),
            &json!({"phone": PHONE, "code": app.codes.last(PHONE).unwrap()}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let response = app
        .put(
            &format!("/api/v1/admin/users/{alice}/role"),
            Some(&admin),
            &json!({"role": "admin"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    let rows = client
        .query(
            "SELECT username, phone, role FROM users ORDER BY username",
            &[],
        )
        .await
        .unwrap();
    let rows: Vec<(Option<String>, Option<String>, String)> = rows
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(
        rows,
        [
            (Some("alice".into()), Some(PHONE.into()), "admin".into()),
            (Some("root".into()), None, "admin".into()),
        ]
    );
}

/// A login racing a password change: it began (read the credentials epoch) and checked the old
/// password, then the password changed and every session was revoked; its session is refused
/// (the login answers 409 `credentials-changed`), so nothing checked against the old password
/// survives the change. Another user's logins are not disturbed; a login begun after works.
#[tokio::test]
async fn a_login_that_began_before_a_password_change_gets_no_session() {
    use zhihui_domain::user::Role;
    let app = spawn_app().await;
    let racer = app.register("racer", "correct horse battery").await;
    let other = app.register("bystander", "correct horse battery").await;
    let token = app.login("racer", "correct horse battery").await;
    let services = app.services_on_app_clock();
    let racer = UserId::from_uuid(uuid::Uuid::parse_str(&racer).unwrap());
    let other = UserId::from_uuid(uuid::Uuid::parse_str(&other).unwrap());
    // The racing logins begin (and, say, have checked the old password)...
    let begun = services.sessions.login_epoch().await.unwrap();
    // ...then the password changes.
    let changed = app
        .put(
            "/api/v1/me/password",
            Some(&token),
            &json!({"current_password": "correct horse battery", "new_password": "new horse battery"}),
        )
        .await;
    assert_eq!(changed.status(), 204);
    assert!(
        services
            .sessions
            .create(racer, Role::User, begun)
            .await
            .unwrap()
            .is_none(),
        "a session checked against the old password survived the change"
    );
    assert!(
        services
            .sessions
            .create(other, Role::User, begun)
            .await
            .unwrap()
            .is_some(),
        "another user's login was refused"
    );
    let after = services.sessions.login_epoch().await.unwrap();
    assert!(
        services
            .sessions
            .create(racer, Role::User, after)
            .await
            .unwrap()
            .is_some()
    );
    app.login("racer", "new horse battery").await;
}

/// A login from `address` (as a proxy in front says it, `X-Forwarded-For`), with the browser's
/// device cookie when given.
async fn login_from(
    app: &TestApp,
    address: &str,
    device: Option<&str>,
    username: &str,
    password: &str,
) -> (u16, Value) {
    let mut request = app
        .http
        .post(format!("{}/api/v1/auth/login", app.address))
        .header("X-Forwarded-For", address)
        .json(&json!({"username": username, "password": password}));
    if let Some(device) = device {
        request = request.header("Cookie", format!("zhihui_device={device}"));
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_guesser_is_stopped_and_cannot_lock_the_owner_out() {
    let app = spawn_app_with(|settings| {
        settings.http.client_ip_from_forwarded = true;
        settings.auth.password_failures_max = 5;
        settings.auth.password_failures_max_all_sources = 20;
    })
    .await;
    let (name, right) = ("xiaoming", "正确的马电池订书钉");
    app.register(name, right).await;
    // The owner logs in once at their own browser (the login page): it is known from then on.
    let page_login = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{}/login", app.address))
        .header("Origin", app.address.as_str())
        .header("X-Forwarded-For", "198.51.100.2")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(
            url::form_urlencoded::Serializer::new(String::new())
                .append_pair("method", "password")
                .append_pair("username", name)
                .append_pair("password", right)
                .finish(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(page_login.status(), 303);
    let device_cookie = page_login
        .headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .find(|cookie| cookie.starts_with("zhihui_device="))
        .expect("a device cookie after a password login")
        .to_owned();
    let device = device_cookie["zhihui_device=".len()..]
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    assert!(device_cookie.contains("HttpOnly"), "{device_cookie}");
    assert!(device_cookie.contains("SameSite=Strict"), "{device_cookie}");

    // A guesser at one address: five wrong passwords, and that address is stopped, even with
    // the right password.
    for _ in 0..4 {
        assert_eq!(
            login_from(&app, "203.0.113.7", None, name, "猜一猜")
                .await
                .0,
            401
        );
    }
    let (status, problem) = login_from(&app, "203.0.113.7", None, name, "猜一猜").await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/username-locked"))
    );
    assert_eq!(
        login_from(&app, "203.0.113.7", None, name, right).await.0,
        429
    );
    // The owner elsewhere, even at a browser that never logged in, gets in.
    assert_eq!(
        login_from(&app, "198.51.100.9", None, name, right).await.0,
        200
    );

    // Guessers spread over twenty addresses: every unknown browser is stopped...
    for n in 0..20 {
        let address = format!("192.0.2.{}", n + 1);
        let (status, _) = login_from(&app, &address, None, name, "再猜一次").await;
        assert!(status == 401 || status == 429, "{status}");
    }
    let (status, problem) = login_from(&app, "192.0.2.200", None, name, right).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/username-locked"))
    );
    // ...and the owner at their own browser still gets in, from any address.
    assert_eq!(
        login_from(&app, "192.0.2.201", Some(&device), name, right)
            .await
            .0,
        200
    );
    // A device cookie is no key to another username.
    app.register("xiaohong", right).await;
    for _ in 0..5 {
        login_from(&app, "192.0.2.202", Some(&device), "xiaohong", "猜").await;
    }
    assert_eq!(
        login_from(&app, "192.0.2.202", Some(&device), "xiaohong", right)
            .await
            .0,
        429
    );
    // A known browser has its own count: five wrong passwords there stop it too.
    for _ in 0..5 {
        login_from(&app, "192.0.2.203", Some(&device), name, "猜").await;
    }
    assert_eq!(
        login_from(&app, "192.0.2.203", Some(&device), name, right)
            .await
            .0,
        429
    );
    // And every lock ends.
    app.clock.advance(Duration::from_secs(15 * 60));
    assert_eq!(
        login_from(&app, "203.0.113.7", None, name, right).await.0,
        200
    );
}

/// A forgotten password is set again with a code sent to the account's phone: rules are checked
/// before the code is used up; a wrong code is refused; the reset ends every session, lifts the
/// lock wrong passwords put on the username, and the new password logs in. A phone nobody has
/// bound and an account with no password are each told so by name.
#[tokio::test]
async fn a_forgotten_password_is_set_again_with_a_code_sent_to_the_bound_phone() {
    let app = spawn_app().await;
    const PHONE: &str = "+8613800138001";
    app.register("wangji", "correct horse battery").await;
    let token = app.login("wangji", "correct horse battery").await;
    send_code(&app, PHONE).await;
    let bound = app
        .post(
            "/api/v1/me/phone",
            Some(&token),
            &json!({"phone": PHONE, "code": app.codes.last(PHONE).unwrap()}),
        )
        .await;
    assert_eq!(bound.status(), 200);
    // Wrong passwords lock the username.
    for _ in 0..10 {
        app.post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "wangji", "password": "not the one at all"}),
        )
        .await;
    }
    let (status, problem) = problem_of(
        app.post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "wangji", "password": "correct horse battery"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (429, Some("/problems/username-locked"))
    );

    app.clock.advance(Duration::from_secs(60));
    send_code(&app, PHONE).await;
    let code = app.codes.last(PHONE).unwrap();
    let reset = |code: String, password: &'static str| {
        let app = &app;
        async move {
            problem_of(
                app.post(
                    "/api/v1/auth/password-reset",
                    None,
                    &json!({"phone": PHONE, "code": code, "new_password": password}),
                )
                .await,
            )
            .await
        }
    };
    // A password breaking its rule: refused by name, and the code is still good.
    let (status, problem) = reset(code.clone(), "short").await;
    assert_eq!(status, 422);
    assert!(problem.to_string().contains("new_password"), "{problem}");
    let (status, problem) = reset(wrong_code_for(&code), "a brand new battery").await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/wrong-code"))
    );
    let done = app
        .post(
            "/api/v1/auth/password-reset",
            None,
            &json!({"phone": PHONE, "code": code, "new_password": "a brand new battery"}),
        )
        .await;
    assert_eq!(done.status(), 204);
    // Used up: the same code again is refused.
    let (status, _) = reset(code, "a brand new battery").await;
    assert_eq!(status, 401);
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 401);
    let old = app
        .post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "wangji", "password": "correct horse battery"}),
        )
        .await;
    assert_eq!(old.status(), 401);
    app.login("wangji", "a brand new battery").await;

    // A phone nobody has bound; an account that only logs in with codes.
    for (phone, status, rule) in [
        ("+8613800138002", 404, "/problems/phone-not-bound"),
        ("+8613800138003", 409, "/problems/no-password-account"),
    ] {
        if status == 409 {
            send_code(&app, phone).await;
            let login = code_login(&app, phone, &app.codes.last(phone).unwrap()).await;
            assert_eq!(login.status(), 200);
            app.clock.advance(Duration::from_secs(60));
        }
        send_code(&app, phone).await;
        let (got, problem) = problem_of(
            app.post(
                "/api/v1/auth/password-reset",
                None,
                &json!({"phone": phone, "code": app.codes.last(phone).unwrap(), "new_password": "a brand new battery"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (got, problem["type"].as_str()),
            (status, Some(rule)),
            "{problem}"
        );
    }
}

/// A user made by a first code login of `phone` (11 digits): (id, token).
async fn phone_user(app: &TestApp, phone: &str) -> (String, String) {
    assert_eq!(send_code(app, phone).await.status(), 202);
    let code = app.codes.last(&format!("+86{phone}")).unwrap();
    let body: Value = code_login(app, phone, &code).await.json().await.unwrap();
    (
        body["user"]["id"].as_str().unwrap().to_owned(),
        body["token"].as_str().unwrap().to_owned(),
    )
}

async fn set_username(app: &TestApp, token: &str, username: &str) -> reqwest::Response {
    app.put(
        "/api/v1/me/username",
        Some(token),
        &json!({"username": username, "password": "西湖 correct horse"}),
    )
    .await
}

#[tokio::test]
async fn a_phone_user_sets_a_username_and_password_and_logs_in_with_either_on_both_processes() {
    let app = spawn_app().await;
    let second = app.another_instance().await;
    let (user, token) = phone_user(&app, "13800138001").await;
    let creator = format!("/api/v1/gallery/creators/{user}");
    for process in [&app, &second] {
        let profile: Value = process.get(&creator).await.json().await.unwrap();
        assert!(
            profile["handle"].as_str().unwrap().starts_with("user#"),
            "{profile}"
        );
    }
    // Without a username there is no password, so none is right.
    let (status, problem) = problem_of(
        app.put(
            "/api/v1/me/password",
            Some(&token),
            &json!({"current_password": "whatever it is", "new_password": "西湖 correct horse"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/wrong-credentials"))
    );

    // Both fields are checked, and named, before the name is claimed.
    let (status, problem) = problem_of(
        app.put(
            "/api/v1/me/username",
            Some(&token),
            &json!({"username": "xiaoyu", "password": "short"}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "password", "{problem}");
    app.register("xiaoyu2", "correct horse battery").await;

    let body: Value = set_username(&app, &token, "XiaoYu")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&body["username"], &body["phone"]),
        (&json!("xiaoyu"), &json!("+8613800138001"))
    );
    let login = app.login("xiaoyu", "西湖 correct horse").await;
    let me: Value = second.get_json(&login, "/api/v1/me").await;
    assert_eq!(me["id"], user.as_str());
    // The old session lives on; the code still logs in to the same user.
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 200);
    // The gallery's short id gave way to the username, on both processes.
    for process in [&second, &app] {
        crate::gallery::within_a_second(process, &creator, |profile| profile["handle"] == "xiaoyu")
            .await;
    }

    // Sent again: done already. Another name: refused, the first stays.
    assert_eq!(set_username(&second, &token, "xiaoyu").await.status(), 200);
    let (status, problem) = problem_of(set_username(&second, &token, "xiaoyu3").await).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (409, Some("/problems/username-already-set"))
    );
    // A name someone has is taken, for phone users as for anyone.
    let (_, other) = phone_user(&app, "13800138002").await;
    for taken in ["xiaoyu", "XIAOYU", "xiaoyu2"] {
        let (status, problem) = problem_of(set_username(&app, &other, taken).await).await;
        assert_eq!(
            (status, problem["type"].as_str()),
            (409, Some("/problems/username-taken")),
            "{taken}"
        );
    }
    // The one refused for another name did not block it: anyone can register it.
    assert_eq!(
        app.post(
            "/api/v1/auth/register",
            None,
            &json!({"username": "xiaoyu3", "password": "correct horse battery"}),
        )
        .await
        .status(),
        201
    );

    // Two phone users race for one name through both processes: one has it, the other may
    // pick another at once.
    let (first_id, first) = phone_user(&app, "13800138003").await;
    let (second_id, other_racer) = phone_user(&app, "13800138004").await;
    let (a, b) = tokio::join!(
        set_username(&app, &first, "tongming"),
        set_username(&second, &other_racer, "tongming")
    );
    let mut statuses = [a.status().as_u16(), b.status().as_u16()];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 409]);
    let winner = app.login("tongming", "西湖 correct horse").await;
    let me: Value = app.get_json(&winner, "/api/v1/me").await;
    let loser = if me["id"] == first_id.as_str() {
        &other_racer
    } else {
        &first
    };
    assert!(me["id"] == first_id.as_str() || me["id"] == second_id.as_str());
    assert_eq!(set_username(&app, loser, "butong").await.status(), 200);

    // One account sends two names at once through both processes: it gets one, and the other
    // is nobody's at once (not held for the orphan bound).
    for round in 0..4 {
        let (_, racer) = phone_user(&app, &format!("1380013802{round}")).await;
        let names = [format!("liangge{round}a"), format!("liangge{round}b")];
        let (a, b) = tokio::join!(
            set_username(&app, &racer, &names[0]),
            set_username(&second, &racer, &names[1])
        );
        let mut statuses = [a.status().as_u16(), b.status().as_u16()];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409]);
        let me: Value = app.get_json(&racer, "/api/v1/me").await;
        let lost = names
            .iter()
            .find(|name| me["username"] != name.as_str())
            .unwrap();
        let registered = app
            .post(
                "/api/v1/auth/register",
                None,
                &json!({"username": lost, "password": "correct horse battery"}),
            )
            .await;
        assert_eq!(registered.status(), 201, "{lost}");
    }

    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    let row = client
        .query_one(
            "SELECT username FROM users WHERE user_id = $1",
            &[&uuid::Uuid::parse_str(&user).unwrap()],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("xiaoyu"));
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}

#[tokio::test]
async fn a_name_claimed_for_an_account_that_never_recorded_it_logs_nobody_in_and_is_freed_later() {
    let app = spawn_app().await;
    let (user, token) = phone_user(&app, "13800138005").await;
    // Simulate a crash between claiming a name for this account and recording it there.
    let claimed = ClaimEvent::Claimed(IdentifierClaimed {
        owner: UserId::from_uuid(uuid::Uuid::parse_str(&user).unwrap()),
        claimed_at: app.clock.now(),
    });
    app.services()
        .event_store
        .append(
            "user-name-banlu",
            zhihui::platform::event_store::ExpectedVersion::NoStream,
            vec![NewEvent {
                id: uuid::Uuid::now_v7(),
                event_type: claimed.event_type().into(),
                schema_version: 1,
                payload: claimed.to_payload(),
                metadata: zhihui::platform::event_store::EventMetadata {
                    correlation_id: uuid::Uuid::now_v7(),
                    causation_id: None,
                    actor: "test".into(),
                },
            }],
        )
        .await
        .unwrap();
    // The account then takes another name, with a password.
    assert_eq!(set_username(&app, &token, "zhenming").await.status(), 200);
    // The half-taken name logs nobody in, not even with that account's password.
    let (status, problem) = problem_of(
        app.post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "banlu", "password": "西湖 correct horse"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("/problems/wrong-credentials"))
    );
    // Held for the bound (its append might still have been under way), then anyone's.
    let body = json!({"username": "banlu", "password": "correct horse battery"});
    app.clock.advance(Duration::from_millis(59_999));
    let (status, _) = problem_of(app.post("/api/v1/auth/register", None, &body).await).await;
    assert_eq!(status, 409);
    app.clock.advance(Duration::from_millis(1));
    assert_eq!(
        app.post("/api/v1/auth/register", None, &body)
            .await
            .status(),
        201
    );
    app.login("banlu", "correct horse battery").await;
    app.login("zhenming", "西湖 correct horse").await;
}
