//! Webhooks: endpoints registered with a secret shown once; deliveries signed as the
//! Standard Webhooks specification says (checked by its reference library, not by our code);
//! retried on schedule, honouring `Retry-After`; disabled by a 410 or a run of failures, with
//! the reason shown to the owner; a log per endpoint and redelivery; a new leader sends what the
//! last one had not; never to an inner address, at registration or at connect.
//!
//! The process manager is driven step by step (`route_all`, `send_due_once`) on a manual clock;
//! the receiver is a real HTTP server in the test.

#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use chrono::Utc;
use serde_json::{Value, json};
use zhihui::platform::clock::{Clock, ManualClock};
use zhihui::platform::configuration::WebhookSettings;
use zhihui::state::{AppState, Overrides};
use zhihui::webhooks::delivery::Deliveries;
use zhihui::webhooks::signing;

use crate::dispatch::{drive_until, drive_until_connected, drive_until_idle, harness_configured};
use crate::helpers::{TestApp, dead_port, spawn_app, spawn_app_with};
use crate::tasks::funded_user;

// -------------------------------------------------------------------------------------------
// The receiver.

#[derive(Debug, Clone)]
struct Received {
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Received {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }

    fn id(&self) -> &str {
        self.header("webhook-id")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// What the receiver answers next (200 "ok" when nothing is scripted).
#[derive(Debug, Clone)]
enum Reply {
    Status(u16),
    RetryAfter(u16, &'static str),
    Redirect(&'static str),
    Slow(Duration),
    Large(usize),
}

#[derive(Debug, Clone, Default)]
struct Inbox {
    received: Arc<Mutex<Vec<Received>>>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
}

impl Inbox {
    fn script(&self, replies: &[Reply]) {
        self.replies.lock().unwrap().extend(replies.iter().cloned());
    }

    fn all(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }
}

async fn hook(request: HttpRequest, body: web::Bytes, inbox: web::Data<Inbox>) -> HttpResponse {
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in request.headers() {
        headers.append(
            reqwest::header::HeaderName::from_bytes(name.as_str().as_bytes()).unwrap(),
            reqwest::header::HeaderValue::from_bytes(value.as_bytes()).unwrap(),
        );
    }
    inbox.received.lock().unwrap().push(Received {
        headers,
        body: body.to_vec(),
    });
    let reply = inbox.replies.lock().unwrap().pop_front();
    match reply {
        None => HttpResponse::Ok().body("ok"),
        Some(Reply::Status(status)) => {
            HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap())
                .body(format!("answered {status}"))
        }
        Some(Reply::RetryAfter(status, after)) => {
            HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap())
                .insert_header(("Retry-After", after))
                .body("busy")
        }
        Some(Reply::Redirect(to)) => HttpResponse::Found()
            .insert_header(("Location", to))
            .finish(),
        Some(Reply::Slow(pause)) => {
            // The receiver (not the test) is slow: the sender's timeout must cut it.
            tokio::time::sleep(pause).await;
            HttpResponse::Ok().body("too late")
        }
        Some(Reply::Large(bytes)) => HttpResponse::Ok().body("收".repeat(bytes / 3)),
    }
}

/// A receiver on loopback: its URL (`/hook`) and what it received.
async fn receiver() -> (String, Inbox) {
    let inbox = Inbox::default();
    let data = web::Data::new(inbox.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .default_service(web::to(hook))
    })
    .workers(1)
    .listen(listener)
    .unwrap()
    .run();
    tokio::spawn(server);
    (format!("http://127.0.0.1:{port}/hook"), inbox)
}

// -------------------------------------------------------------------------------------------
// The app side.

/// An app whose webhooks may go to loopback (the receiver).
async fn app_allowing_loopback() -> TestApp {
    spawn_app_with(allow_loopback).await
}

fn allow_loopback(settings: &mut zhihui::platform::configuration::Settings) {
    settings.webhooks.allowed_networks = vec!["127.0.0.0/8".into(), "::1/128".into()];
    settings.webhooks.retry_jitter_ratio = 0.0;
}

/// The webhook process manager of another process on the app's database, on `clock`, with its
/// settings changed by `customise`.
fn deliveries_on(
    app: &TestApp,
    clock: Clock,
    customise: impl FnOnce(&mut WebhookSettings),
) -> Deliveries {
    let mut settings = app.settings.clone();
    customise(&mut settings.webhooks);
    let pool = zhihui::platform::postgres::build_pool(&settings.database).unwrap();
    let state = AppState::build(
        &settings,
        pool,
        Overrides {
            clock,
            code_sender: None,
        },
    )
    .unwrap();
    Deliveries::new(
        state.webhooks.clone(),
        state.event_store.clone(),
        state.pg_pool.clone(),
        state.clock.clone(),
        100,
    )
    .unwrap()
}

/// The process manager of another process, on a clock of its own starting at the app's time
/// (the test moves it for retries; the app's sessions stay young).
fn deliveries(app: &TestApp) -> (Deliveries, ManualClock) {
    let clock = ManualClock::starting_at(app.clock.now());
    (
        deliveries_on(app, Clock::Manual(clock.clone()), |_| {}),
        clock,
    )
}

async fn register(app: &TestApp, token: &str, url: &str, types: &[&str]) -> reqwest::Response {
    app.post(
        "/api/v1/me/webhooks",
        Some(token),
        &json!({"url": url, "event_types": types}),
    )
    .await
}

/// Register and return (endpoint id, secret).
async fn endpoint(app: &TestApp, token: &str, url: &str, types: &[&str]) -> (String, String) {
    let response = register(app, token, url, types).await;
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    let body: Value = response.json().await.unwrap();
    (
        body["endpoint_id"].as_str().unwrap().to_owned(),
        body["secret"].as_str().unwrap().to_owned(),
    )
}

async fn grant(app: &TestApp, admin: &str, user: &str, amount: &str, reason: &str) {
    let granted = app
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(admin),
            &json!({"amount": amount, "reason": reason}),
        )
        .await;
    assert_eq!(granted.status(), 201, "{:?}", granted.text().await);
}

async fn delivery_log(app: &TestApp, token: &str, endpoint_id: &str) -> Vec<Value> {
    let response = app
        .get_as(
            token,
            &format!("/api/v1/me/webhooks/{endpoint_id}/deliveries"),
        )
        .await;
    assert_eq!(response.status(), 200);
    response
        .json::<Value>()
        .await
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

async fn endpoints_of(app: &TestApp, token: &str) -> Vec<Value> {
    let response = app.get_as(token, "/api/v1/me/webhooks").await;
    assert_eq!(response.status(), 200);
    response
        .json::<Value>()
        .await
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// Our verifier, at the sender's `now`.
fn verified_by_us(secret: &str, received: &Received, now: i64) -> bool {
    signing::verify(
        secret,
        received.id(),
        received.header("webhook-timestamp"),
        received.header("webhook-signature"),
        &received.body,
        now,
    )
    .is_ok()
}

fn seconds(count: u64) -> Duration {
    Duration::from_secs(count)
}

// -------------------------------------------------------------------------------------------
// Signed deliveries.

#[tokio::test]
async fn deliveries_are_signed_as_the_specification_says_and_its_reference_library_verifies_them() {
    let app = app_allowing_loopback().await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "shop", "10").await;
    let admin = app.admin_token("boss").await;
    let (endpoint_id, secret) =
        endpoint(&app, &token, &url, &["task.cancelled", "points.credited"]).await;
    assert!(secret.starts_with("whsec_"), "{secret}");
    // Lists never show the secret.
    let listed = app
        .get_as(&token, "/api/v1/me/webhooks")
        .await
        .text()
        .await
        .unwrap();
    assert!(!listed.contains(&secret) && !listed.contains(secret.trim_start_matches("whsec_")));

    grant(&app, &admin, &user, "5", "春节活动赠送").await;
    let submitted = app
        .post(
            "/api/v1/tasks",
            Some(&token),
            &json!({"prompt": "雪地里的红狐狸"}),
        )
        .await;
    let task_id = submitted.json::<Value>().await.unwrap()["task_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let cancelled = app
        .post(
            &format!("/api/v1/tasks/{task_id}/cancel"),
            Some(&token),
            &json!({}),
        )
        .await;
    assert_eq!(cancelled.status(), 200);

    // The sender's clock is now: the reference library checks timestamps against the system's.
    let clock = ManualClock::starting_at(Utc::now());
    let deliveries = deliveries_on(&app, Clock::Manual(clock.clone()), |_| {});
    // The grant made before the endpoint existed is not sent; the two after it are.
    assert_eq!(deliveries.route_all().await.unwrap(), 2);
    let report = deliveries.send_due_once().await.unwrap();
    assert_eq!((report.attempted, report.delivered), (2, 2), "{report:?}");
    let received = inbox.all();
    assert_eq!(received.len(), 2);

    let reference = standardwebhooks::Webhook::new(&secret).unwrap();
    for delivery in &received {
        reference
            .verify(&delivery.body, &delivery.headers)
            .unwrap_or_else(|error| panic!("the reference library refuses: {error:?}"));
        assert!(verified_by_us(&secret, delivery, clock.now().timestamp()));
        assert_eq!(delivery.header("content-type"), "application/json");
        // A changed body, or another endpoint's secret, does not verify.
        let mut tampered = delivery.body.clone();
        tampered[10] ^= 1;
        assert!(reference.verify(&tampered, &delivery.headers).is_err());
    }
    let (_, other_secret) = endpoint(&app, &token, &url, &["task.failed"]).await;
    assert!(
        standardwebhooks::Webhook::new(&other_secret)
            .unwrap()
            .verify(&received[0].body, &received[0].headers)
            .is_err()
    );

    let by_type = |kind: &str| {
        received
            .iter()
            .find(|delivery| delivery.json()["type"] == kind)
            .unwrap()
            .clone()
    };
    let credit = by_type("points.credited").json();
    assert_eq!(credit["data"]["amount"], "5.00");
    assert_eq!(credit["data"]["reason"], "春节活动赠送");
    assert_eq!(credit["data"]["available"], "15.00");
    assert_eq!(credit["data"]["user_id"], user);
    let task = by_type("task.cancelled").json();
    assert_eq!(task["data"]["task_id"], task_id);
    assert_eq!(task["data"]["status"], "cancelled");
    assert_eq!(task["data"]["prompt"], "雪地里的红狐狸");

    // The log shows each message delivered at its first attempt, by the same ids.
    let log = delivery_log(&app, &token, &endpoint_id).await;
    assert_eq!(log.len(), 2);
    for message in &log {
        assert_eq!(message["status"], "delivered");
        assert_eq!(message["attempts"][0]["status"], 200);
        assert_eq!(message["attempts"][0]["response"], "ok");
        assert!(
            received
                .iter()
                .any(|delivery| delivery.id() == message["message_id"].as_str().unwrap())
        );
    }
    // Nothing more to route or to send: each event is sent once.
    assert_eq!(deliveries.route_all().await.unwrap(), 0);
    assert_eq!(deliveries.send_due_once().await.unwrap().attempted, 0);
    assert_eq!(inbox.count(), 2);
}

#[tokio::test]
async fn a_succeeded_task_is_delivered_with_image_links_a_key_can_fetch() {
    let harness = harness_configured(1, Default::default(), allow_loopback).await;
    let app = &harness.app;
    let (url, inbox) = receiver().await;
    let (_, token) = funded_user(app, "bot", "10").await;
    let (_, secret) = endpoint(app, &token, &url, &["task.succeeded"]).await;
    let key: Value = app
        .post(
            "/api/v1/me/keys",
            Some(&token),
            &json!({"name": "图片机器人", "scopes": ["tasks:write", "tasks:read"]}),
        )
        .await
        .json()
        .await
        .unwrap();
    let key = key["key"].as_str().unwrap();
    let submitted: Value = app
        .post(
            "/api/v1/tasks",
            Some(key),
            &json!({"prompt": "一只戴帽子的柴犬", "images": 2, "steps": 2}),
        )
        .await
        .json()
        .await
        .unwrap();
    let task_id = submitted["task_id"].as_str().unwrap().to_owned();
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task_id),
        &[zhihui_domain::task::TaskStatus::Succeeded],
    )
    .await;
    drive_until_idle(&mut saga).await;

    let (deliveries, _) = deliveries(app);
    assert_eq!(deliveries.route_all().await.unwrap(), 1);
    assert_eq!(deliveries.send_due_once().await.unwrap().delivered, 1);
    let delivery = &inbox.all()[0];
    assert!(verified_by_us(
        &secret,
        delivery,
        app.clock.now().timestamp()
    ));
    let body = delivery.json();
    assert_eq!(body["type"], "task.succeeded");
    assert_eq!(body["data"]["status"], "succeeded");
    let images = body["data"]["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);
    let base = &app.settings.webhooks.public_base_url;
    for image in images {
        let link = image["url"].as_str().unwrap();
        assert!(
            link.starts_with(&format!("{base}/api/v1/images/")),
            "{link}"
        );
        // The program fetches it with its key (here, from the test app's own address).
        let path = link.trim_start_matches(base.as_str());
        let fetched = app.get_as(key, path).await;
        assert_eq!(fetched.status(), 200);
        assert_eq!(fetched.headers()["content-type"], "image/png");
    }
}

#[tokio::test]
async fn a_rotation_signs_with_both_secrets_until_the_overlap_ends() {
    let app = app_allowing_loopback().await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "rotor", "1").await;
    let admin = app.admin_token("boss").await;
    let (endpoint_id, old) = endpoint(&app, &token, &url, &["points.credited"]).await;
    let rotated = app
        .post(
            &format!("/api/v1/me/webhooks/{endpoint_id}/rotate"),
            Some(&token),
            &json!({}),
        )
        .await;
    assert_eq!(rotated.status(), 200);
    let rotated: Value = rotated.json().await.unwrap();
    let new = rotated["secret"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    assert_eq!(rotated["secret_generation"], 2);

    let (deliveries, clock) = deliveries(&app);
    grant(&app, &admin, &user, "1", "first").await;
    deliveries.route_all().await.unwrap();
    deliveries.send_due_once().await.unwrap();
    let during = &inbox.all()[0];
    assert_eq!(during.header("webhook-signature").split(' ').count(), 2);
    let now = clock.now().timestamp();
    assert!(verified_by_us(&old, during, now) && verified_by_us(&new, during, now));

    // After the overlap only the new secret signs.
    clock.advance(Duration::from_millis(
        app.settings.webhooks.rotation_overlap_ms + 1000,
    ));
    grant(&app, &admin, &user, "1", "second").await;
    deliveries.route_all().await.unwrap();
    deliveries.send_due_once().await.unwrap();
    let after = &inbox.all()[1];
    let now = clock.now().timestamp();
    assert_eq!(after.header("webhook-signature").split(' ').count(), 1);
    assert!(verified_by_us(&new, after, now) && !verified_by_us(&old, after, now));
}

// -------------------------------------------------------------------------------------------
// Retries, disabling, the log, redelivery.

#[tokio::test]
async fn a_failing_endpoint_is_retried_on_schedule_and_a_longer_retry_after_wins() {
    let app = app_allowing_loopback().await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "retry", "1").await;
    let admin = app.admin_token("boss").await;
    let (endpoint_id, secret) = endpoint(&app, &token, &url, &["points.credited"]).await;
    inbox.script(&[
        Reply::Status(500),
        Reply::RetryAfter(503, "3600"),
        Reply::Status(200),
    ]);
    grant(&app, &admin, &user, "2", "补偿").await;
    let (deliveries, clock) = deliveries(&app);
    deliveries.route_all().await.unwrap();

    let first = deliveries.send_due_once().await.unwrap();
    assert_eq!((first.attempted, first.failed), (1, 1));
    let log = delivery_log(&app, &token, &endpoint_id).await;
    assert_eq!(log[0]["status"], "pending");
    assert_eq!(log[0]["attempts"][0]["status"], 500);
    assert_eq!(log[0]["attempts"][0]["response"], "answered 500");
    let next =
        chrono::DateTime::parse_from_rfc3339(log[0]["next_attempt_at"].as_str().unwrap()).unwrap();
    // The schedule's first pause (5 s; the test turned jitter off).
    assert_eq!((next.with_timezone(&Utc) - clock.now()).num_seconds(), 5);

    // Not before its time.
    clock.advance(seconds(4));
    assert_eq!(deliveries.send_due_once().await.unwrap().attempted, 0);
    clock.advance(seconds(1));
    let second = deliveries.send_due_once().await.unwrap();
    assert_eq!(second.failed, 1);
    // The schedule says 5 min; the receiver asked for an hour: an hour it is.
    clock.advance(seconds(300));
    assert_eq!(deliveries.send_due_once().await.unwrap().attempted, 0);
    clock.advance(seconds(3300));
    let third = deliveries.send_due_once().await.unwrap();
    assert_eq!(third.delivered, 1);

    let received = inbox.all();
    assert_eq!(received.len(), 3);
    // One message, three attempts: the same id, each signed at its own time.
    assert!(
        received
            .iter()
            .all(|delivery| delivery.id() == received[0].id())
    );
    assert_ne!(
        received[0].header("webhook-timestamp"),
        received[2].header("webhook-timestamp")
    );
    assert!(verified_by_us(
        &secret,
        &received[2],
        clock.now().timestamp()
    ));
    let log = delivery_log(&app, &token, &endpoint_id).await;
    assert_eq!(log[0]["status"], "delivered");
    let statuses: Vec<Value> = log[0]["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|attempt| attempt["status"].clone())
        .collect();
    assert_eq!(statuses, [json!(500), json!(503), json!(200)]);
    // A success resets the run of failures.
    assert_eq!(
        endpoints_of(&app, &token).await[0]["consecutive_failures"],
        0
    );
}

#[tokio::test]
async fn gone_disables_the_endpoint_its_owner_sees_why_and_a_redelivery_sends_what_it_missed() {
    let app = app_allowing_loopback().await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "gone", "1").await;
    let admin = app.admin_token("boss").await;
    let (endpoint_id, _) = endpoint(&app, &token, &url, &["points.credited"]).await;
    let (deliveries, _) = deliveries(&app);
    inbox.script(&[Reply::Status(410)]);
    grant(&app, &admin, &user, "1", "一").await;
    deliveries.route_all().await.unwrap();
    deliveries.send_due_once().await.unwrap();
    // While disabled: messages are kept, not sent.
    grant(&app, &admin, &user, "1", "二").await;
    deliveries.route_all().await.unwrap();
    assert_eq!(deliveries.send_due_once().await.unwrap().attempted, 0);
    assert_eq!(inbox.count(), 1);

    let listed = endpoints_of(&app, &token).await;
    let reason = listed[0]["disabled_reason"].as_str().unwrap();
    assert!(reason.contains("410"), "{reason}");
    let log = delivery_log(&app, &token, &endpoint_id).await;
    let statuses: Vec<&str> = log.iter().map(|m| m["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["skipped", "failed"], "newest first");

    // The owner enables it again: new events are sent...
    let enabled = app
        .post(
            &format!("/api/v1/me/webhooks/{endpoint_id}/enable"),
            Some(&token),
            &json!({}),
        )
        .await;
    assert_eq!(enabled.status(), 200);
    grant(&app, &admin, &user, "1", "三").await;
    deliveries.route_all().await.unwrap();
    assert_eq!(deliveries.send_due_once().await.unwrap().delivered, 1);
    assert!(endpoints_of(&app, &token).await[0]["disabled_reason"].is_null());
    // ...and a redelivery of one message sends it, by its id.
    let missed = log[0]["message_id"].as_str().unwrap();
    let redelivered = app
        .post(
            &format!("/api/v1/me/webhooks/{endpoint_id}/redeliver"),
            Some(&token),
            &json!({"message_id": missed}),
        )
        .await;
    assert_eq!(redelivered.status(), 202);
    assert_eq!(redelivered.json::<Value>().await.unwrap()["queued"], 1);
    assert_eq!(deliveries.send_due_once().await.unwrap().delivered, 1);
    assert_eq!(inbox.all().last().unwrap().id(), missed);
    assert_eq!(inbox.all().last().unwrap().json()["data"]["reason"], "二");

    // A time range sends every message of it again (same ids: a receiver drops repeats).
    // The range is of when the events happened, as the log shows them.
    let log = delivery_log(&app, &token, &endpoint_id).await;
    let occurred = |message: &Value| {
        chrono::DateTime::parse_from_rfc3339(message["occurred_at"].as_str().unwrap()).unwrap()
    };
    let since = occurred(log.last().unwrap()).to_rfc3339();
    let until = (occurred(&log[0]) + chrono::Duration::milliseconds(1)).to_rfc3339();
    let range = app
        .post(
            &format!("/api/v1/me/webhooks/{endpoint_id}/redeliver"),
            Some(&token),
            &json!({"since": since, "until": until}),
        )
        .await;
    assert_eq!(range.json::<Value>().await.unwrap()["queued"], 3);
    assert_eq!(deliveries.send_due_once().await.unwrap().delivered, 3);
    let mut ids: Vec<String> = inbox.all().iter().map(|r| r.id().to_owned()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "three messages, some sent twice");

    // Bad redelivery requests name the field.
    for (body, field) in [
        (json!({}), "message_id"),
        (json!({"since": until, "until": since}), "until"),
    ] {
        let refused = app
            .post(
                &format!("/api/v1/me/webhooks/{endpoint_id}/redeliver"),
                Some(&token),
                &body,
            )
            .await;
        assert_eq!(refused.status(), 422);
        assert_eq!(refused.json::<Value>().await.unwrap()["field"], field);
    }
}

#[tokio::test]
async fn a_long_run_of_failures_disables_the_endpoint_and_its_owner_sees_why() {
    let app = spawn_app_with(|settings| {
        allow_loopback(settings);
        settings.webhooks.disable_after_failures = 3;
        settings.webhooks.disable_after_failing_ms = 60_000;
    })
    .await;
    let (user, token) = funded_user(&app, "down", "1").await;
    let admin = app.admin_token("boss").await;
    let nobody = format!("http://127.0.0.1:{}/hook", dead_port());
    let (endpoint_id, _) = endpoint(&app, &token, &nobody, &["points.credited"]).await;
    let (healthy_url, inbox) = receiver().await;
    endpoint(&app, &token, &healthy_url, &["points.credited"]).await;
    grant(&app, &admin, &user, "1", "x").await;
    let (deliveries, clock) = deliveries(&app);
    deliveries.route_all().await.unwrap();
    // t=0, t=5 s: two failures, not yet a minute: still enabled.
    assert_eq!(deliveries.send_due_once().await.unwrap().failed, 1);
    clock.advance(seconds(5));
    deliveries.send_due_once().await.unwrap();
    let down = |list: Vec<Value>| {
        list.into_iter()
            .find(|endpoint| endpoint["endpoint_id"] == endpoint_id.as_str())
            .unwrap()
    };
    let listed = down(endpoints_of(&app, &token).await);
    assert!(listed["disabled_reason"].is_null());
    assert_eq!(listed["consecutive_failures"], 2);
    // t=305 s: the third, a minute and more of failing: disabled, saying why.
    clock.advance(seconds(300));
    deliveries.send_due_once().await.unwrap();
    deliveries.route_all().await.unwrap();
    let listed = down(endpoints_of(&app, &token).await);
    let reason = listed["disabled_reason"].as_str().unwrap();
    assert!(
        reason.starts_with("3 attempts in a row failed since"),
        "{reason}"
    );
    let log = delivery_log(&app, &token, &endpoint_id).await;
    let error = log[0]["attempts"][0]["error"].as_str().unwrap();
    assert!(error.contains("onnect"), "the attempt says why: {error}");
    // The owner's other endpoint was served all along.
    assert_eq!(inbox.count(), 1);
}

#[tokio::test]
async fn a_slow_or_chatty_receiver_is_cut_by_the_timeout_and_the_read_cap() {
    let app = spawn_app_with(|settings| {
        allow_loopback(settings);
        settings.webhooks.timeout_ms = 300;
        settings.webhooks.response_bytes_max = 64;
    })
    .await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "slow", "1").await;
    let admin = app.admin_token("boss").await;
    let (endpoint_id, _) = endpoint(&app, &token, &url, &["points.credited"]).await;
    inbox.script(&[Reply::Slow(Duration::from_secs(5)), Reply::Large(100_000)]);
    grant(&app, &admin, &user, "1", "x").await;
    let (deliveries, clock) = deliveries(&app);
    deliveries.route_all().await.unwrap();
    let started = std::time::Instant::now();
    assert_eq!(deliveries.send_due_once().await.unwrap().failed, 1);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the total timeout cut it"
    );
    clock.advance(seconds(5));
    assert_eq!(deliveries.send_due_once().await.unwrap().delivered, 1);
    let log = delivery_log(&app, &token, &endpoint_id).await;
    let attempts = log[0]["attempts"].as_array().unwrap();
    assert!(attempts[0]["status"].is_null());
    let error = attempts[0]["error"].as_str().unwrap();
    assert!(
        error.contains("timed out") || error.contains("timeout"),
        "{error}"
    );
    // 64 bytes read (a character cut in two is replaced, not kept).
    let response = attempts[1]["response"].as_str().unwrap();
    assert!(
        response.len() <= 64 + 3 && response.starts_with("收收收"),
        "{response}"
    );
}

// -------------------------------------------------------------------------------------------
// Leading: a crash loses nothing.

#[tokio::test]
async fn a_new_leader_sends_what_the_last_one_routed_but_never_sent() {
    let app = app_allowing_loopback().await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "lead", "1").await;
    let admin = app.admin_token("boss").await;
    endpoint(&app, &token, &url, &["points.credited"]).await;
    for reason in ["一", "二", "三"] {
        grant(&app, &admin, &user, "1", reason).await;
    }
    // The first leader routes, then dies before sending.
    let (first, _) = deliveries(&app);
    assert_eq!(first.route_all().await.unwrap(), 3);
    drop(first);
    // A Redis flush on top: nothing of webhooks lives there.
    crate::helpers::flush_redis(&app).await;
    // Another process takes over: nothing is routed twice, everything is sent once.
    let (second, _) = deliveries(&app);
    assert_eq!(second.route_all().await.unwrap(), 0);
    assert_eq!(second.send_due_once().await.unwrap().delivered, 3);
    grant(&app, &admin, &user, "1", "四").await;
    assert_eq!(second.route_all().await.unwrap(), 1);
    assert_eq!(second.send_due_once().await.unwrap().delivered, 1);
    let reasons: Vec<String> = inbox
        .all()
        .iter()
        .map(|delivery| {
            delivery.json()["data"]["reason"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    // The first three went out in one sending step, concurrently (`webhooks.concurrency`): each
    // once, in whatever order they arrived; the fourth after them.
    let mut first_three = reasons[..3].to_vec();
    first_three.sort();
    let mut expected = vec!["一", "二", "三"];
    expected.sort_unstable();
    assert_eq!(first_three, expected, "{reasons:?}");
    assert_eq!(reasons[3..], ["四"], "{reasons:?}");
}

// -------------------------------------------------------------------------------------------
// Safe sending.

#[tokio::test]
#[allow(clippy::print_stdout)] // the closing note's table (`--no-capture`)
async fn inner_addresses_are_refused_at_registration_naming_the_address_and_why() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "probe", "1").await;
    let mut table = Vec::new();
    for (url, expected) in [
        ("http://127.0.0.1:8080/hook", "loopback"),
        ("http://2130706433/", "loopback"),
        ("http://0x7f.1/", "loopback"),
        ("http://localhost:8080/hook", "loopback"),
        ("http://[::1]/hook", "loopback"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://10.0.0.5/hook", "private"),
        ("http://172.16.3.4/", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://[::ffff:10.0.0.1]/", "private"),
        (
            "http://169.254.169.254/latest/meta-data/",
            "link-local (cloud metadata)",
        ),
        (
            "http://[64:ff9b::a9fe:a9fe]/",
            "link-local (cloud metadata)",
        ),
        ("http://[fd00:ec2::254]/", "unique local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://100.64.0.1/", "shared address space"),
        ("http://0.0.0.0/", "unspecified"),
        // IPv4 inside IPv6: compatible, translated (SIIT), 6to4, Teredo, local-use NAT64.
        ("http://[::127.0.0.1]/", "loopback"),
        ("http://[::ffff:0:7f00:1]/", "loopback"),
        ("http://[2002:7f00:1::1]/", "loopback"),
        ("http://[2002:a9fe:a9fe::1]/", "link-local (cloud metadata)"),
        ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/", "loopback"),
        ("http://[64:ff9b:1::a00:1]/", "local-use NAT64"),
        // Not globally reachable.
        ("http://192.0.2.10/", "documentation"),
        ("http://198.51.100.7/", "documentation"),
        ("http://203.0.113.9/", "documentation"),
        ("http://198.18.0.1/", "benchmarking"),
        ("http://240.0.0.1/", "reserved"),
        ("http://[2001:db8::1]/", "documentation"),
        ("http://[100::1]/", "discard-only"),
        ("http://[fec0::1]/", "site-local"),
        ("ftp://example.com/", "not an http(s) URL"),
        ("http://user:pass@example.com/", "credentials"),
        ("not a url", "not an http(s) URL"),
    ] {
        let response = register(&app, &token, url, &["task.succeeded"]).await;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        let detail = body["detail"].as_str().unwrap_or("").to_owned();
        table.push(format!("{url:45} {status} {detail}"));
        assert_eq!(status, 422, "{url}: {body}");
        assert_eq!(body["field"], "url", "{url}");
        assert!(detail.contains(expected), "{url}: {detail}");
    }
    // The closing note prints this table (`--no-capture`).
    println!("{}", table.join("\n"));
    assert!(endpoints_of(&app, &token).await.is_empty());

    // Unknown event types are named.
    let response = register(&app, &token, "https://example.com/", &["task.started"]).await;
    assert_eq!(response.status(), 422);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["field"], "event_types");
    assert!(body["detail"].as_str().unwrap().contains("task.succeeded"));
}

/// Addresses that carry an inner IPv4 address inside IPv6, and ranges that are not globally
/// reachable: registered while an operator allowed every network, then refused at connect by a
/// process whose operator allows none, each naming why, and never sent.
#[tokio::test]
async fn at_connect_ipv4_inside_ipv6_and_unroutable_ranges_are_refused() {
    let app = spawn_app_with(|settings| {
        settings.webhooks.allowed_networks = vec!["0.0.0.0/0".into(), "::/0".into()];
        settings.webhooks.endpoints_per_user_max = 20;
    })
    .await;
    let (user, token) = funded_user(&app, "biandi", "1").await;
    let admin = app.admin_token("boss").await;
    let port = dead_port();
    let addresses = [
        ("[::127.0.0.1]", "loopback"),
        ("[::ffff:0:7f00:1]", "loopback"),
        ("[2002:7f00:1::1]", "loopback"),
        ("[2001:0:4136:e378:8000:63bf:80ff:fffe]", "loopback"),
        ("[64:ff9b:1::a00:1]", "local-use NAT64"),
        ("192.0.2.10", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("[2001:db8::1]", "documentation"),
        ("[100::1]", "discard-only"),
        ("[fec0::1]", "site-local"),
    ];
    let mut ids = Vec::new();
    for (address, _) in addresses {
        let url = format!("http://{address}:{port}/hook");
        ids.push(endpoint(&app, &token, &url, &["points.credited"]).await.0);
    }
    grant(&app, &admin, &user, "1", "x").await;
    let strict = deliveries_on(&app, Clock::Manual(app.clock.clone()), |webhooks| {
        webhooks.allowed_networks.clear();
    });
    strict.route_all().await.unwrap();
    let report = strict.send_due_once().await.unwrap();
    assert_eq!(
        (report.attempted, report.failed),
        (addresses.len(), addresses.len())
    );
    for ((address, reason), id) in addresses.iter().zip(&ids) {
        let log = delivery_log(&app, &token, id).await;
        let error = log[0]["attempts"][0]["error"].as_str().unwrap();
        assert!(
            error.contains(reason) && error.contains("where webhooks never go"),
            "{address}: {error}"
        );
    }
}

#[tokio::test]
#[allow(clippy::print_stdout)] // the closing note's lines (`--no-capture`)
async fn at_connect_an_inner_address_is_refused_again_and_a_redirect_is_not_followed() {
    let app = app_allowing_loopback().await;
    let (url, inbox) = receiver().await;
    let (user, token) = funded_user(&app, "later", "1").await;
    let admin = app.admin_token("boss").await;
    // Registered while the operator allowed loopback...
    let by_name = url.replace("127.0.0.1", "localhost");
    let (literal_id, _) = endpoint(&app, &token, &url, &["points.credited"]).await;
    let (name_id, _) = endpoint(&app, &token, &by_name, &["points.credited"]).await;
    grant(&app, &admin, &user, "1", "x").await;
    // ...sent by a process whose operator allows nothing: refused at connect, never sent.
    let strict = deliveries_on(&app, Clock::Manual(app.clock.clone()), |webhooks| {
        webhooks.allowed_networks.clear();
    });
    strict.route_all().await.unwrap();
    let report = strict.send_due_once().await.unwrap();
    assert_eq!((report.attempted, report.failed), (2, 2));
    assert_eq!(inbox.count(), 0);
    let literal = delivery_log(&app, &token, &literal_id).await;
    let error = literal[0]["attempts"][0]["error"].as_str().unwrap();
    assert!(
        error.contains("127.0.0.1 (loopback) is where webhooks never go"),
        "{error}"
    );
    let named = delivery_log(&app, &token, &name_id).await;
    let error = named[0]["attempts"][0]["error"].as_str().unwrap();
    assert!(
        error.contains("localhost resolves only to addresses webhooks never go to"),
        "{error}"
    );
    println!("at connect, {url}: {}", literal[0]["attempts"][0]["error"]);
    println!("at connect, {by_name}: {error}");

    // A redirect (to the metadata service) is an answer, a failed one: never followed.
    let (redirecting, inbox) = receiver().await;
    inbox.script(&[Reply::Redirect("http://169.254.169.254/latest/meta-data/")]);
    let (redirect_id, _) = endpoint(&app, &token, &redirecting, &["points.credited"]).await;
    grant(&app, &admin, &user, "1", "y").await;
    let (allowing, clock) = deliveries(&app);
    allowing.route_all().await.unwrap();
    clock.advance(seconds(3600));
    allowing.send_due_once().await.unwrap();
    assert_eq!(inbox.count(), 1);
    let log = delivery_log(&app, &token, &redirect_id).await;
    assert_eq!(log[0]["attempts"][0]["status"], 302);
    assert_eq!(log[0]["status"], "pending", "retried later, as any failure");
    println!("redirect to 169.254.169.254: attempt status 302, not followed");
}

// -------------------------------------------------------------------------------------------
// Ownership and the document.

#[tokio::test]
async fn one_users_endpoints_are_invisible_and_untouchable_to_another() {
    let app = app_allowing_loopback().await;
    let (url, _) = receiver().await;
    let (_, owner) = funded_user(&app, "owner", "1").await;
    let (_, stranger) = funded_user(&app, "stranger", "1").await;
    let (endpoint_id, _) = endpoint(&app, &owner, &url, &["task.succeeded"]).await;
    assert!(endpoints_of(&app, &stranger).await.is_empty());
    for (method, path) in [
        ("POST", format!("/api/v1/me/webhooks/{endpoint_id}/rotate")),
        ("POST", format!("/api/v1/me/webhooks/{endpoint_id}/disable")),
        ("POST", format!("/api/v1/me/webhooks/{endpoint_id}/enable")),
        (
            "GET",
            format!("/api/v1/me/webhooks/{endpoint_id}/deliveries"),
        ),
        ("DELETE", format!("/api/v1/me/webhooks/{endpoint_id}")),
    ] {
        let response = app
            .http
            .request(method.parse().unwrap(), format!("{}{path}", app.address))
            .bearer_auth(&stranger)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404, "{method} {path}");
    }
    let redeliver = app
        .post(
            &format!("/api/v1/me/webhooks/{endpoint_id}/redeliver"),
            Some(&stranger),
            &json!({"message_id": uuid::Uuid::now_v7()}),
        )
        .await;
    assert_eq!(redeliver.status(), 404);
    // Still there for its owner; the owner removes it.
    deliveries(&app).0.route_all().await.unwrap();
    assert_eq!(endpoints_of(&app, &owner).await.len(), 1);
    let removed = app
        .http
        .delete(format!("{}/api/v1/me/webhooks/{endpoint_id}", app.address))
        .bearer_auth(&owner)
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 204);
    deliveries(&app).0.route_all().await.unwrap();
    assert!(endpoints_of(&app, &owner).await.is_empty());

    // A key needs the `webhooks` scope.
    let key: Value = app
        .post(
            "/api/v1/me/keys",
            Some(&owner),
            &json!({"name": "reader", "scopes": ["tasks:read"]}),
        )
        .await
        .json()
        .await
        .unwrap();
    let refused = app
        .get_as(key["key"].as_str().unwrap(), "/api/v1/me/webhooks")
        .await;
    assert_eq!(refused.status(), 403);
    let body: Value = refused.json().await.unwrap();
    assert!(body["detail"].as_str().unwrap().contains("webhooks"));
}

#[tokio::test]
async fn the_openapi_document_states_both_schemes_each_scope_and_the_webhook_payloads() {
    let app = spawn_app().await;
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let schemes = &document["components"]["securitySchemes"];
    assert_eq!(schemes["bearer"]["scheme"], "bearer");
    assert_eq!(schemes["api_key"]["scheme"], "bearer");
    let scope_of = |path: &str, method: &str| {
        document["paths"][path][method]["security"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|scheme| scheme.get("api_key"))
            .cloned()
    };
    assert_eq!(
        scope_of("/api/v1/tasks", "post"),
        Some(json!(["tasks:write"]))
    );
    assert_eq!(
        scope_of("/api/v1/tasks/{id}", "get"),
        Some(json!(["tasks:read"]))
    );
    assert_eq!(
        scope_of("/api/v1/account", "get"),
        Some(json!(["account:read"]))
    );
    assert_eq!(
        scope_of("/api/v1/me/webhooks", "post"),
        Some(json!(["webhooks"]))
    );
    assert_eq!(
        scope_of("/api/v1/me/keys", "post"),
        None,
        "a person's session only"
    );
    // A key's scopes are named in the document, every one the server grants.
    let scopes = &document["components"]["schemas"]["CreateKeyRequest"]["properties"]["scopes"];
    assert_eq!(scopes["minItems"], 1, "{scopes}");
    assert_eq!(
        scopes["items"]["enum"],
        json!([
            "tasks:write",
            "tasks:read",
            "account:read",
            "codes:redeem",
            "webhooks",
            "gallery:write",
            "admin"
        ])
    );
    let event_types =
        &document["components"]["schemas"]["RegisterEndpointRequest"]["properties"]["event_types"];
    assert_eq!(event_types["minItems"], 1);
    assert_eq!(
        event_types["items"]["enum"],
        json!([
            "task.succeeded",
            "task.failed",
            "task.cancelled",
            "points.credited"
        ])
    );
    let webhooks = document["webhooks"].as_object().unwrap();
    let mut names: Vec<&String> = webhooks.keys().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "points.credited",
            "task.cancelled",
            "task.failed",
            "task.succeeded"
        ]
    );
    let succeeded = &webhooks["task.succeeded"]["post"];
    let reference = succeeded["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        .as_str()
        .unwrap();
    let schema = reference.trim_start_matches("#/components/schemas/");
    assert!(document["components"]["schemas"][schema]["properties"]["data"].is_object());
    let headers: Vec<&str> = succeeded["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|parameter| parameter["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        headers,
        ["webhook-id", "webhook-timestamp", "webhook-signature"]
    );
}

#[tokio::test]
async fn twenty_registrations_at_once_on_two_processes_make_the_most_and_no_more() {
    let app = spawn_app_with(|settings| {
        allow_loopback(settings);
        settings.webhooks.endpoints_per_user_max = 5;
    })
    .await;
    let other = app.another_instance().await;
    let (url, _) = receiver().await;
    let (_, token) = funded_user(&app, "duoge", "1").await;
    let answers = futures::future::join_all((0..20).map(|n| {
        let instance = if n % 2 == 0 { &app } else { &other };
        let token = token.clone();
        let url = format!("{url}?n={n}");
        async move {
            register(instance, &token, &url, &["task.succeeded"])
                .await
                .status()
        }
    }))
    .await;
    let made = answers
        .iter()
        .filter(|status| status.as_u16() == 201)
        .count();
    let refused = answers
        .iter()
        .filter(|status| status.as_u16() == 409)
        .count();
    assert_eq!((made, refused), (5, 15), "{answers:?}");
    // The endpoints refused were never made (or removed at once): five live, whatever is listed.
    let (router, _) = deliveries(&app);
    router.route_all().await.unwrap();
    assert_eq!(endpoints_of(&app, &token).await.len(), 5);
    // One removed: one more fits, and only one.
    let listed = endpoints_of(&app, &token).await;
    let first = listed[0]["endpoint_id"].as_str().unwrap().to_owned();
    let removed = app
        .http
        .delete(format!("{}/api/v1/me/webhooks/{first}", other.address))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 204);
    router.route_all().await.unwrap();
    let again = futures::future::join_all((0..4).map(|n| {
        let token = token.clone();
        let url = format!("{url}?again={n}");
        let app = &app;
        async move { register(app, &token, &url, &["task.failed"]).await.status() }
    }))
    .await;
    assert_eq!(
        again.iter().filter(|status| status.as_u16() == 201).count(),
        1,
        "{again:?}"
    );
}

#[tokio::test]
async fn slots_a_crash_left_taken_are_freed_once_their_endpoints_are_known_gone() {
    use zhihui_domain::webhook_slots::{EndpointSlots, SlotCommand, slots_stream};
    let app = spawn_app_with(|settings| {
        allow_loopback(settings);
        settings.webhooks.endpoints_per_user_max = 2;
    })
    .await;
    let (url, _) = receiver().await;
    let (user, token) = funded_user(&app, "bengkui", "1").await;
    let user_id = zhihui_domain::user::UserId::from_uuid(uuid::Uuid::parse_str(&user).unwrap());
    // Two slots taken by registrations that died before their endpoints were recorded.
    let services = app.services();
    for _ in 0..2 {
        zhihui::platform::command::execute::<EndpointSlots>(
            &services.event_store,
            &slots_stream(user_id),
            &SlotCommand::Take {
                endpoint_id: uuid::Uuid::now_v7(),
                listed: vec![],
                max: 2,
                at: app.clock.now(),
            },
            &crate::tasks::metadata(),
            Default::default(),
        )
        .await
        .unwrap();
    }
    // While they are young, their registrations may be under way: refused.
    assert_eq!(
        register(&app, &token, &url, &["task.failed"])
            .await
            .status(),
        409
    );
    // A minute on, their endpoints are known never to have come: freed, and it fits.
    app.clock.advance(Duration::from_secs(61));
    assert_eq!(
        register(&app, &token, &url, &["task.failed"])
            .await
            .status(),
        201
    );
    assert_eq!(
        register(&app, &token, &url, &["task.succeeded"])
            .await
            .status(),
        201
    );
    assert_eq!(
        register(&app, &token, &url, &["task.cancelled"])
            .await
            .status(),
        409
    );
}
