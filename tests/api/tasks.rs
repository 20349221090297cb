//! Text-to-image tasks end to end: submit (price, freeze, translate, render, queue), the Redis
//! queue and its rebuild, prioritise, cancel, queries, ownership, crashes between streams, and
//! the cancel / prioritise / claim race.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::platform::event_store::{Direction, EventMetadata, EventStore, ReadFrom};
use zhihui::tasks::catalog::RequestedTask;
use zhihui::tasks::service::{CrashPoint, TaskServiceError};
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{Account, HoldStatus, account_stream};
use zhihui_domain::points::Points;
use zhihui_domain::task::{Task, TaskCommand, TaskEvent, TaskStatus, task_stream};
use zhihui_domain::user::UserId;

use crate::fake_ollama::OllamaMode;
use crate::helpers::{TestApp, spawn_app};

const PREFIX: &str = "(8k, best quality, masterpiece),(high detailed skin),";
const SUFFIX: &str = ",bad face,naked,bad finger,bad arm,bad leg,bad eye";

pub(crate) fn metadata() -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: "test".into(),
    }
}

/// A user with `points` granted; returns (user id, token).
pub(crate) async fn funded_user(app: &TestApp, name: &str, points: &str) -> (String, String) {
    let user = app.register(name, "correct horse battery").await;
    let token = app.login(name, "correct horse battery").await;
    let admin = app.admin_token(&format!("admin-{name}")).await;
    let granted = app
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(&admin),
            &json!({"amount": points, "reason": "test"}),
        )
        .await;
    assert_eq!(granted.status(), 201);
    (user, token)
}

pub(crate) async fn submit(
    app: &TestApp,
    token: &str,
    body: &Value,
    key: Option<&str>,
) -> reqwest::Response {
    let mut request = app
        .http
        .post(format!("{}/api/v1/tasks", app.address))
        .bearer_auth(token)
        .json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap()
}

/// The answers to concurrent retries of one keyed submit: every one 201 with the same task,
/// exactly one of them the submit that created it. Returns that task's id.
pub(crate) async fn one_task_from_retries(answers: Vec<reqwest::Response>) -> String {
    let mut task_ids = Vec::new();
    let mut created = 0;
    for response in answers {
        assert_eq!(response.status(), 201);
        let answer: Value = response.json().await.unwrap();
        task_ids.push(answer["task_id"].as_str().unwrap().to_owned());
        if answer["submitted_now"] == true {
            created += 1;
        }
    }
    task_ids.dedup();
    assert_eq!(task_ids.len(), 1, "one task for every retry: {task_ids:?}");
    assert_eq!(created, 1, "one retry created it");
    task_ids.remove(0)
}

pub(crate) async fn submitted_id(app: &TestApp, token: &str, prompt: &str) -> String {
    let response = submit(app, token, &json!({"prompt": prompt}), None).await;
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    body["task_id"].as_str().unwrap().to_owned()
}

async fn post_as(app: &TestApp, token: &str, path: &str, key: Option<&str>) -> reqwest::Response {
    let mut request = app
        .http
        .post(format!("{}{path}", app.address))
        .bearer_auth(token);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap()
}

/// `POST /api/v1/tasks/{task}/{action}` with no key.
pub(crate) async fn act(app: &TestApp, token: &str, action: &str, task: &str) -> reqwest::Response {
    post_as(app, token, &format!("/api/v1/tasks/{task}/{action}"), None).await
}

/// The account as its events say (available, frozen).
pub(crate) async fn account_of(app: &TestApp, user: &str) -> zhihui_domain::account::AccountState {
    let services = app.services();
    let user = UserId::from_uuid(Uuid::parse_str(user).unwrap());
    zhihui::platform::command::load::<Account>(&services.event_store, &account_stream(user))
        .await
        .unwrap()
        .state
}

pub(crate) async fn task_events(app: &TestApp, task_id: &str) -> Vec<TaskEvent> {
    let services = app.services();
    services
        .event_store
        .read_stream(
            &task_stream(Uuid::parse_str(task_id).unwrap()),
            Direction::Forwards,
            ReadFrom::Start,
            1000,
        )
        .await
        .unwrap()
        .iter()
        .map(|recorded| {
            TaskEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .unwrap()
        })
        .collect()
}

#[tokio::test]
async fn a_submit_freezes_its_price_translates_renders_and_queues() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "alice", "10").await;

    let response = submit(
        &app,
        &token,
        &json!({"prompt": "一只猫", "negative_prompt": "blurry", "images": 2, "resolution": "512x768",
                "steps": 30, "cfg": "7.5", "sampler": "euler", "seed": 42}),
        None,
    )
    .await;
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], "queued");
    assert_eq!(body["position"], 1);
    assert_eq!(body["price"], "2.00");
    let task_id = body["task_id"].as_str().unwrap().to_owned();

    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.available, Points::whole(8));
    assert_eq!(account.balance.frozen, Points::whole(2));
    // The Chinese prompt went to Ollama, the English negative prompt did not.
    assert_eq!(app.ollama.calls(), 1);

    let events = task_events(&app, &task_id).await;
    let TaskEvent::Submitted(submitted) = &events[0] else {
        panic!("first event {:?}", events[0]);
    };
    assert_eq!(submitted.prompt_used, format!("{PREFIX}EN(一只猫)"));
    assert_eq!(submitted.negative_prompt_used, format!("blurry{SUFFIX}"));
    let workflow = &submitted.workflow.to_value();
    assert_eq!(workflow["6"]["inputs"]["text"], submitted.prompt_used);
    assert_eq!(workflow["5"]["inputs"]["height"], 768);
    assert_eq!(workflow["5"]["inputs"]["batch_size"], 2);
    assert_eq!(workflow["3"]["inputs"]["seed"], 42);
    assert_eq!(workflow["3"]["inputs"]["cfg"], 7.5);
    assert_eq!(
        workflow["9"]["inputs"]["filename_prefix"],
        format!("zhihui/{task_id}")
    );
    assert!(matches!(events[1], TaskEvent::Queued(_)));

    // Readable at once (from the events), and from the read model once projected.
    for projected in [false, true] {
        if projected {
            app.project().await;
        }
        let view: Value = app
            .get_as(&token, &format!("/api/v1/tasks/{task_id}"))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(view["status"], "queued", "projected: {projected}");
        assert_eq!(view["position"], 1);
        assert_eq!(view["prompt"], "一只猫");
        assert_eq!(view["cfg"], "7.5");
        assert_eq!(view["image_count"], 2);
    }
    // The same text again comes from the cache.
    submitted_id(&app, &token, "一只猫").await;
    assert_eq!(app.ollama.calls(), 1);
}

#[tokio::test]
async fn a_hostile_prompt_renders_the_same_graph_with_the_text_inside_its_string() {
    let app = spawn_app().await;
    let (_user, token) = funded_user(&app, "mallory", "10").await;
    let hostile =
        "cat\" \\ \n}, \"99\": {\"class_type\": \"SaveImage\", \"inputs\": {}}, \"x\": {\"";
    let plain = submitted_id(&app, &token, "cat").await;
    let nasty = submitted_id(&app, &token, hostile).await;
    let workflow_of = |events: Vec<TaskEvent>| match &events[0] {
        TaskEvent::Submitted(submitted) => submitted.workflow.to_value(),
        other => panic!("first event {other:?}"),
    };
    let plain = workflow_of(task_events(&app, &plain).await);
    let nasty_workflow = workflow_of(task_events(&app, &nasty).await);
    let keys = |graph: &Value| {
        graph
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&nasty_workflow), keys(&plain));
    assert_eq!(
        nasty_workflow["6"]["inputs"]["text"],
        format!("{PREFIX}{}", hostile.trim())
    );
    assert!(nasty_workflow.get("99").is_none());
}

#[tokio::test]
async fn bad_fields_are_each_named_and_insufficient_points_change_nothing() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "bob", "1").await;
    let response = submit(
        &app,
        &token,
        &json!({"prompt": "", "images": 9, "model": "nope.safetensors", "steps": 0,
                "sampler": "ddim", "resolution": "100x100"}),
        None,
    )
    .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    let fields: Vec<&str> = problem["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|error| error["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        [
            "prompt",
            "images",
            "model",
            "resolution",
            "steps",
            "sampler"
        ]
    );
    let unknown = submit(
        &app,
        &token,
        &json!({"prompt": "cat", "colour": "red"}),
        None,
    )
    .await;
    assert_eq!(unknown.status(), 422);
    // A prompt of a zero-width space alone shows nothing: empty, and nothing is frozen for it.
    let invisible = submit(&app, &token, &json!({"prompt": "\u{200B}\u{FEFF}"}), None).await;
    assert_eq!(invisible.status(), 422);
    let problem: Value = invisible.json().await.unwrap();
    assert_eq!(
        (problem["field"].as_str(), problem["rule"].as_str()),
        (Some("prompt"), Some("not_empty")),
        "{problem}"
    );

    let poor = submit(&app, &token, &json!({"prompt": "cat", "images": 2}), None).await;
    assert_eq!(poor.status(), 409);
    let problem: Value = poor.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/insufficient-points");
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.available, Points::whole(1));
    assert!(account.holds.is_empty());
    assert_eq!(app.services().tasks.queue.len().await.unwrap(), 0);
}

#[tokio::test]
async fn a_retried_submit_creates_one_task_and_one_freeze() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "carol", "10").await;
    let body = json!({"prompt": "a lighthouse", "images": 2});
    let attempts =
        futures::future::join_all((0..8).map(|_| submit(&app, &token, &body, Some("submit-1"))))
            .await;
    one_task_from_retries(attempts).await;
    let account = account_of(&app, &user).await;
    assert_eq!(account.holds.len(), 1);
    assert_eq!(account.balance.frozen, Points::whole(2));
    assert_eq!(app.services().tasks.queue.len().await.unwrap(), 1);

    let other = submit(&app, &token, &json!({"prompt": "a mill"}), Some("submit-1")).await;
    assert_eq!(other.status(), 409);
    let problem: Value = other.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/idempotency-key-reused");
}

/// Where a prioritise puts a task, from the queue's scores alone: the full jump when its gap has
/// an integer, fewer places when it has none, the front when the jump reaches it, and no room
/// when every gap ahead is spent. The plain read (by the score the task's events give it)
/// answers the common cases in one round trip and agrees with the script wherever it answers;
/// the script answers the rest, and whenever the queue holds the task at another score.
#[tokio::test]
async fn a_prioritise_target_jumps_as_far_as_the_scores_ahead_allow() {
    use zhihui::tasks::queue::{FRONT_STEP, PrioritiseTarget};
    let app = spawn_app().await;
    let queue = &app.services().tasks.queue;
    let queued = |scores: &[i64]| {
        let scores = scores.to_vec();
        async move {
            let mut ids = Vec::new();
            for score in scores {
                let id = Uuid::now_v7();
                queue.enqueue(id, score, None).await.unwrap();
                ids.push((id, score));
            }
            ids
        }
    };
    // The target by the script, checked to be the same with the task's score known, and with a
    // wrong score known (the queue disagrees: the script decides).
    let target = |(id, score): (Uuid, i64)| async move {
        let by_rank = queue.prioritise_target(id, None, 10).await.unwrap();
        assert_eq!(
            queue.prioritise_target(id, Some(score), 10).await.unwrap(),
            by_rank
        );
        assert_eq!(
            queue
                .prioritise_target(id, Some(score + 1), 10)
                .await
                .unwrap(),
            by_rank
        );
        assert_eq!(
            queue
                .prioritise_target_by_score(id, score + 1, 10)
                .await
                .unwrap(),
            None
        );
        by_rank
    };
    let plain = |(id, score): (Uuid, i64)| async move {
        queue
            .prioritise_target_by_score(id, score, 10)
            .await
            .unwrap()
    };
    let emptied = || async {
        for (id, _) in queue.entries().await.unwrap() {
            queue.remove(id).await.unwrap();
        }
    };

    // Twelve ahead, spaced: ten places, between the scores of ranks 1 and 2, read plainly.
    let spaced: Vec<i64> = (1..=13).map(|n| n * 100).collect();
    let ids = queued(&spaced).await;
    let ten_places = PrioritiseTarget::Ahead {
        to_score: 250,
        places: 10,
    };
    assert_eq!(target(ids[12]).await, ten_places);
    assert_eq!(plain(ids[12]).await, Some(ten_places));
    assert_eq!(target(ids[0]).await, PrioritiseTarget::AlreadyFirst);
    assert_eq!(plain(ids[0]).await, None);
    let stranger = Uuid::now_v7();
    for known in [None, Some(500)] {
        assert_eq!(
            queue.prioritise_target(stranger, known, 10).await.unwrap(),
            PrioritiseTarget::NotQueued
        );
    }
    assert_eq!(
        plain((stranger, 500)).await,
        Some(PrioritiseTarget::NotQueued)
    );
    // Exactly ten ahead: the jump reaches the front, read plainly.
    let to_front = PrioritiseTarget::Ahead {
        to_score: 100 - FRONT_STEP,
        places: 10,
    };
    assert_eq!(target(ids[10]).await, to_front);
    assert_eq!(plain(ids[10]).await, Some(to_front));
    // Three ahead: fewer than the jump, which only the script's rank tells; the front.
    assert_eq!(
        target(ids[3]).await,
        PrioritiseTarget::Ahead {
            to_score: 100 - FRONT_STEP,
            places: 3
        }
    );
    assert_eq!(plain(ids[3]).await, None);
    emptied().await;

    // No integer between ranks 1 and 2, nor 2 and 3: eight places, between ranks 3 and 4, which
    // only the script finds.
    let ids = queued(&[
        100, 200, 201, 202, 300, 400, 500, 600, 700, 800, 900, 1000, 1100,
    ])
    .await;
    assert_eq!(
        target(ids[12]).await,
        PrioritiseTarget::Ahead {
            to_score: 251,
            places: 8
        }
    );
    assert_eq!(plain(ids[12]).await, None);
    emptied().await;

    // Every gap ahead spent.
    let ids = queued(&(100..=112).collect::<Vec<i64>>()).await;
    assert_eq!(target(ids[12]).await, PrioritiseTarget::NoRoom);
    assert_eq!(plain(ids[12]).await, None);
}

#[tokio::test]
async fn prioritise_moves_ahead_of_ten_and_charges_once() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "dave", "100").await;
    let (_eve, eve_token) = funded_user(&app, "eve", "100").await;
    let mut tasks = Vec::new();
    for n in 0..12 {
        let token = if n % 2 == 0 { &token } else { &eve_token };
        tasks.push(submitted_id(&app, token, &format!("task {n}")).await);
    }
    let last = tasks[11].clone(); // eve's, at position 12
    let first = tasks[0].clone(); // dave's, at position 1

    let moved = post_as(
        &app,
        &eve_token,
        &format!("/api/v1/tasks/{last}/prioritise"),
        Some("p-1"),
    )
    .await;
    assert_eq!(moved.status(), 200);
    let moved: Value = moved.json().await.unwrap();
    assert_eq!(moved["position"], 2, "ahead of 10 of the 11 before it");
    assert_eq!(moved["charged_now"], true);
    assert_eq!(moved["fee"], "5.00");
    let retried: Value = post_as(
        &app,
        &eve_token,
        &format!("/api/v1/tasks/{last}/prioritise"),
        Some("p-1"),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(retried["charged_now"], false);
    assert_eq!(retried["position"], 2);
    let eve_account = account_of(&app, &_eve).await;
    // 100 - 6 tasks - one fee.
    assert_eq!(eve_account.balance.available, Points::whole(89));

    // Already first: refused, nothing charged.
    let refused = post_as(
        &app,
        &token,
        &format!("/api/v1/tasks/{first}/prioritise"),
        None,
    )
    .await;
    assert_eq!(refused.status(), 409);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/already-first");
    let dave = account_of(&app, &user).await;
    assert_eq!(dave.balance.available, Points::whole(94));
    assert_eq!(dave.operations.len(), 1, "only the grant");

    // Twice more to the front: ahead of the first task, the queue order follows.
    let again: Value = post_as(
        &app,
        &eve_token,
        &format!("/api/v1/tasks/{last}/prioritise"),
        None,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(again["position"], 1);
    let order: Vec<String> = app
        .services()
        .tasks
        .queue
        .entries()
        .await
        .unwrap()
        .iter()
        .map(|(task_id, _)| task_id.to_string())
        .collect();
    assert_eq!(order[0], last);
    assert_eq!(order[1..], tasks[..11]);
}

#[tokio::test]
async fn another_users_task_is_not_found_everywhere() {
    let app = spawn_app().await;
    let (_alice, alice) = funded_user(&app, "alice", "10").await;
    let (_bob, bob) = funded_user(&app, "bob", "10").await;
    submitted_id(&app, &alice, "first").await;
    let task = submitted_id(&app, &alice, "second").await;
    for projected in [false, true] {
        if projected {
            app.project().await;
        }
        let seen = app.get_as(&bob, &format!("/api/v1/tasks/{task}")).await;
        assert_eq!(seen.status(), 404);
        let listed: Value = app
            .get_as(&bob, "/api/v1/tasks")
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(listed["tasks"], json!([]));
    }
    for action in ["prioritise", "cancel"] {
        let response = post_as(&app, &bob, &format!("/api/v1/tasks/{task}/{action}"), None).await;
        assert_eq!(response.status(), 404, "{action}");
    }
    let missing = app
        .get_as(&alice, &format!("/api/v1/tasks/{}", Uuid::now_v7()))
        .await;
    assert_eq!(missing.status(), 404);
    // Nothing happened to alice's task or bob's points.
    assert_eq!(
        app.services()
            .tasks
            .queue
            .rank(Uuid::parse_str(&task).unwrap())
            .await
            .unwrap(),
        Some(1)
    );
    assert_eq!(
        account_of(&app, &_bob).await.balance.available,
        Points::whole(10)
    );
}

/// The read model trails the streams by a projection's batch. What a task's stream says has
/// happened (here a cancel, told to the socket already) is what the list says, before the
/// projection has run; a finished task is read from its row alone.
#[tokio::test]
async fn a_task_list_read_before_the_projection_caught_up_shows_what_the_stream_says() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "xiaoyu", "10").await;
    let waiting = submitted_id(&app, &token, "雨后的石板路").await;
    let ended = submitted_id(&app, &token, "石桥与乌篷船").await;
    let hurried = submitted_id(&app, &token, "赶早班车的人").await;
    assert_eq!(act(&app, &token, "cancel", &ended).await.status(), 200);
    app.project().await;
    // Prioritised and cancelled with no projection after: the rows still say queued, as they
    // were.
    assert_eq!(
        act(&app, &token, "prioritise", &hurried).await.status(),
        200
    );
    let listed: Value = app
        .get_as(&token, "/api/v1/tasks")
        .await
        .json()
        .await
        .unwrap();
    let hurried_view = listed["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|view| view["task_id"] == hurried.as_str())
        .unwrap()
        .clone();
    assert_eq!(hurried_view["prioritised"], 1, "{listed}");
    assert_eq!(hurried_view["position"], 1, "{listed}");
    let alone: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{hurried}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(alone["prioritised"], 1, "{alone}");
    assert_eq!(act(&app, &token, "cancel", &waiting).await.status(), 200);
    let listed = app.get_as(&token, "/api/v1/tasks").await;
    assert_eq!(listed.status(), 200);
    let listed: Value = listed.json().await.unwrap();
    let status_of = |task: &str| {
        listed["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|view| view["task_id"] == task)
            .map(|view| view["status"].clone())
    };
    assert_eq!(status_of(&waiting), Some(json!("cancelled")), "{listed}");
    assert_eq!(status_of(&ended), Some(json!("cancelled")), "{listed}");
    let filtered: Value = app
        .get_as(&token, "/api/v1/tasks?status=queued")
        .await
        .json()
        .await
        .unwrap();
    // The filter runs on the read model (its index): a task that has left that status since
    // is not listed.
    let queued: Vec<&Value> = filtered["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|view| &view["task_id"])
        .collect();
    assert_eq!(queued, [&json!(hurried)], "{filtered}");
}

#[tokio::test]
async fn cancel_returns_a_queued_tasks_points_and_asks_the_dispatcher_for_a_running_one() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "frank", "10").await;
    let queued = submitted_id(&app, &token, "queued").await;
    let cancelled = post_as(
        &app,
        &token,
        &format!("/api/v1/tasks/{queued}/cancel"),
        None,
    )
    .await;
    assert_eq!(cancelled.status(), 200);
    let body: Value = cancelled.json().await.unwrap();
    assert_eq!(body["status"], "cancelled");
    let again = post_as(
        &app,
        &token,
        &format!("/api/v1/tasks/{queued}/cancel"),
        None,
    )
    .await;
    assert_eq!(again.status(), 200);
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.available, Points::whole(10));
    assert_eq!(account.balance.frozen, Points::whole(0));
    assert_eq!(app.services().tasks.queue.len().await.unwrap(), 0);

    let running = submitted_id(&app, &token, "running").await;
    let services = app.services();
    let dispatched = services
        .tasks
        .claim_next("gpu-1", 0, &metadata())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dispatched.task_id.to_string(), running);
    let requested = post_as(
        &app,
        &token,
        &format!("/api/v1/tasks/{running}/cancel"),
        None,
    )
    .await;
    assert_eq!(requested.status(), 202);
    let body: Value = requested.json().await.unwrap();
    assert_eq!(body["cancel_requested"], true);
    assert_eq!(body["status"], "dispatched");
    // The points stay frozen until the dispatcher confirms.
    assert_eq!(
        account_of(&app, &user).await.balance.frozen,
        Points::whole(1)
    );

    // A finished task cannot be cancelled.
    zhihui::platform::command::execute::<Task>(
        &services.event_store,
        &task_stream(dispatched.task_id),
        &TaskCommand::Fail {
            reason: "out of memory".into(),
            fencing_token: 0,
            at: app.clock.now(),
        },
        &metadata(),
        zhihui::platform::command::RetryPolicy::default(),
    )
    .await
    .unwrap();
    let finished = post_as(
        &app,
        &token,
        &format!("/api/v1/tasks/{running}/cancel"),
        None,
    )
    .await;
    assert_eq!(finished.status(), 409);
    let problem: Value = finished.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/task-finished");
}

#[tokio::test]
async fn the_queue_is_rebuilt_from_the_events_in_the_same_order() {
    let app = spawn_app().await;
    let (_user, token) = funded_user(&app, "grace", "100").await;
    let mut tasks = Vec::new();
    for n in 0..6 {
        tasks.push(submitted_id(&app, &token, &format!("task {n}")).await);
    }
    act(&app, &token, "prioritise", &tasks[5]).await;
    act(&app, &token, "cancel", &tasks[2]).await;
    // Half of it projected, half only in the log: the rebuild needs both.
    app.project().await;
    act(&app, &token, "prioritise", &tasks[4]).await;
    act(&app, &token, "cancel", &tasks[1]).await;
    let services = app.services();
    let before = services.tasks.queue.entries().await.unwrap();
    assert_eq!(before.len(), 4);

    // Redis loses everything of this deployment (FLUSHALL, scoped to the test's key prefix so
    // that tests running beside it keep their keys).
    flush_prefix(&app).await;
    assert_eq!(services.tasks.queue.len().await.unwrap(), 0);
    // Sessions lived in Redis too: log in again.
    let token = app.login("grace", "correct horse battery").await;
    let report = services.tasks.rebuild_queue().await.unwrap();
    assert_eq!(report.queued, 4);
    assert_eq!(services.tasks.queue.entries().await.unwrap(), before);

    // New tasks still queue behind the restored ones.
    let newest = submitted_id(&app, &token, "after the flush").await;
    let after = services.tasks.queue.entries().await.unwrap();
    assert_eq!(after.last().unwrap().0.to_string(), newest);

    // The admin endpoint does the same, and removes what has left the queue.
    let admin = app.admin_token("root").await;
    let rebuilt: Value = post_as(&app, &admin, "/api/v1/admin/queue/rebuild", None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(rebuilt["queued"], 5);
}

pub(crate) async fn flush_prefix(app: &TestApp) {
    let mut connection = crate::helpers::redis_of(&app.settings).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", app.settings.redis.key_prefix))
        .query_async(&mut connection)
        .await
        .unwrap();
    if !keys.is_empty() {
        let () = redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
}

/// Requests that end their intents together share one `DELETE`, and each end returns only once
/// its own row is gone: the sweeper, `audit` and other processes see what they saw when every
/// request deleted its own.
#[tokio::test]
async fn intents_ended_together_share_one_statement_and_each_end_waits_for_its_row() {
    let app = spawn_app().await;
    let client = crate::helpers::connect(&app.settings).await;
    let remaining = async |ids: &[Uuid]| -> i64 {
        client
            .query_one(
                "SELECT count(*) FROM task_intents WHERE intent_id = ANY($1)",
                &[&ids],
            )
            .await
            .unwrap()
            .get(0)
    };
    let ids: Vec<Uuid> = (0..21).map(|_| Uuid::now_v7()).collect();
    for id in &ids {
        client
            .execute(
                "INSERT INTO task_intents (intent_id, kind, task_id, user_id, created_at) \
                 VALUES ($1, 'submit', $2, $3, now())",
                &[id, &Uuid::now_v7(), &Uuid::now_v7()],
            )
            .await
            .unwrap();
    }
    let ends = zhihui::tasks::intent_ends::IntentEnds::new(
        zhihui::platform::postgres::build_pool(&app.settings.database).unwrap(),
    );

    // One alone: its own statement, and its row is gone when it returns.
    ends.end(ids[0]).await.unwrap();
    assert_eq!(ends.statements(), 1);
    assert_eq!(remaining(&ids[..1]).await, 0);
    assert_eq!(remaining(&ids[1..]).await, 20);
    // Twenty at once. This test's runtime has one thread, so all twenty are handed over before
    // the deleting task runs: one statement for all of them, each gone when its end returns.
    futures::future::join_all(ids[1..].iter().map(async |id| {
        ends.end(*id).await.unwrap();
        assert_eq!(
            remaining(&[*id]).await,
            0,
            "returned before its row was gone"
        );
    }))
    .await;
    assert_eq!(ends.statements(), 2);
    assert_eq!(remaining(&ids).await, 0);
    // An intent already gone (its request raced the sweeper): nothing to do, no error.
    ends.end(ids[0]).await.unwrap();
    assert_eq!(ends.statements(), 3);
}

#[tokio::test]
async fn a_crash_after_freezing_leaves_an_orphan_hold_that_the_sweeper_releases() {
    let app = spawn_app().await;
    let (user, _token) = funded_user(&app, "heidi", "10").await;
    let user_id = UserId::from_uuid(Uuid::parse_str(&user).unwrap());
    let services = app.services_on_app_clock();
    let request = RequestedTask {
        prompt: "a crash".into(),
        images: Some(3),
        ..RequestedTask::default()
    };
    let crashed = services
        .tasks
        .crashing_at(CrashPoint::AfterFreeze)
        .submit(user_id, &request, Some("k-1"), &metadata())
        .await;
    assert!(matches!(
        crashed,
        Err(TaskServiceError::Crashed(CrashPoint::AfterFreeze))
    ));
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.frozen, Points::whole(3), "the orphan hold");

    // Too young: a request still in flight is never robbed.
    let early = services.tasks.sweep_once().await.unwrap();
    assert_eq!(early.intents_resolved, 0);
    app.clock.advance(Duration::from_millis(
        app.settings.tasks.intent_resolve_after_ms + 1,
    ));
    let swept = services.tasks.sweep_once().await.unwrap();
    assert_eq!(swept.intents_resolved, 1);
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.frozen, Points::whole(0));
    assert_eq!(account.balance.available, Points::whole(10));
    let hold = account.holds.values().next().unwrap();
    assert_eq!(hold.status, HoldStatus::Released);
    // The task id is fenced: the retry of that request cannot record the task any more.
    let retry = services
        .tasks
        .submit(user_id, &request, Some("k-1"), &metadata())
        .await;
    assert!(
        matches!(retry, Err(TaskServiceError::RolledBack)),
        "{retry:?}"
    );
    assert_eq!(
        account_of(&app, &user).await.balance.frozen,
        Points::whole(0)
    );
    // Sweeping again changes nothing.
    assert_eq!(
        services.tasks.sweep_once().await.unwrap().intents_resolved,
        0
    );
    project_and_verify(&app).await;
}

#[tokio::test]
async fn crashes_after_charging_a_fee_or_recording_a_cancel_are_completed_by_the_sweeper() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "ivan", "20").await;
    let user_id = UserId::from_uuid(Uuid::parse_str(&user).unwrap());
    let first = submitted_id(&app, &token, "first").await;
    let second = submitted_id(&app, &token, "second").await;
    let second_id = Uuid::parse_str(&second).unwrap();
    let services = app.services_on_app_clock();

    let crashed = services
        .tasks
        .crashing_at(CrashPoint::AfterCharge)
        .prioritise(user_id, second_id, None, &metadata())
        .await;
    assert!(matches!(crashed, Err(TaskServiceError::Crashed(_))));
    assert_eq!(
        account_of(&app, &user).await.balance.available,
        Points::whole(13)
    );
    let crashed = services
        .tasks
        .crashing_at(CrashPoint::AfterCancelRecorded)
        .cancel(user_id, Uuid::parse_str(&first).unwrap(), &metadata())
        .await;
    assert!(matches!(crashed, Err(TaskServiceError::Crashed(_))));

    app.clock.advance(Duration::from_millis(
        app.settings.tasks.intent_resolve_after_ms + 1,
    ));
    let swept = services.tasks.sweep_once().await.unwrap();
    assert_eq!(swept.intents_resolved, 2);
    let account = account_of(&app, &user).await;
    // The fee came back (the move never happened), the cancelled task's point came back.
    assert_eq!(account.balance.available, Points::whole(19));
    assert_eq!(account.balance.frozen, Points::whole(1));
    let entries = services.tasks.queue.entries().await.unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].0, second_id);
    let events = task_events(&app, &second).await;
    assert!(
        events
            .iter()
            .any(|event| matches!(event, TaskEvent::PrioritisationAbandoned(_)))
    );
    project_and_verify(&app).await;
}

/// A cancel recorded by a process whose Redis is away (a failover) answers what happened: the
/// task is cancelled. Its follow-up (the queue entry, the hold's release) is the intent sweeper's
/// to finish, as after a crash; nothing is lost or returned twice.
#[tokio::test]
async fn a_cancel_recorded_while_redis_is_away_answers_done_and_the_sweeper_finishes_it() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "xiaowu", "10").await;
    let user_id = UserId::from_uuid(Uuid::parse_str(&user).unwrap());
    let task = submitted_id(&app, &token, "雨夜的小巷").await;
    let task_id = Uuid::parse_str(&task).unwrap();
    // Another process, on the same database, whose Redis does not answer.
    let mut settings = app.settings.clone();
    crate::helpers::one_redis_at(
        &mut settings,
        format!("redis://127.0.0.1:{}", crate::helpers::dead_port()),
    );
    let cut_off = app.services_with(&settings);
    let outcome = cut_off
        .tasks
        .cancel(user_id, task_id, &metadata())
        .await
        .expect("a recorded cancel is answered as done");
    assert_eq!(outcome.status, TaskStatus::Cancelled);
    // Recorded, not yet released: the hold is still frozen, the queue still names the task.
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.frozen, Points::whole(1));
    let services = app.services_on_app_clock();
    assert!(services.tasks.queue.rank(task_id).await.unwrap().is_some());

    app.clock.advance(Duration::from_millis(
        app.settings.tasks.intent_resolve_after_ms + 1,
    ));
    let swept = services.tasks.sweep_once().await.unwrap();
    assert_eq!(swept.intents_resolved, 1);
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.available, Points::whole(10));
    assert_eq!(account.balance.frozen, Points::ZERO);
    assert!(services.tasks.queue.rank(task_id).await.unwrap().is_none());
    // Swept again: nothing more moves.
    assert_eq!(
        services.tasks.sweep_once().await.unwrap().intents_resolved,
        0
    );
    assert_eq!(
        account_of(&app, &user).await.balance.available,
        Points::whole(10)
    );
    project_and_verify(&app).await;
}

#[tokio::test]
async fn ollama_down_slow_or_answering_garbage_never_fails_a_submit() {
    for mode in [
        None,
        Some(OllamaMode::Error),
        Some(OllamaMode::Garbage),
        Some(OllamaMode::Slow),
    ] {
        let app = crate::helpers::spawn_app_with(|settings| {
            if mode.is_none() {
                settings.translation.ollama_url =
                    format!("http://127.0.0.1:{}", crate::helpers::dead_port());
            }
        })
        .await;
        if let Some(mode) = mode {
            app.ollama.set_mode(mode);
        }
        let (_user, token) = funded_user(&app, "judy", "10").await;
        let task = submitted_id(&app, &token, "一只猫在月光下").await;
        let events = task_events(&app, &task).await;
        let TaskEvent::Submitted(submitted) = &events[0] else {
            panic!("first event {:?}", events[0]);
        };
        assert_eq!(
            submitted.prompt_used,
            format!("{PREFIX}一只猫在月光下"),
            "mode {mode:?}: the original text is used"
        );
    }
}

#[tokio::test]
async fn the_task_list_is_newest_first_with_a_cursor() {
    let app = spawn_app().await;
    let (_user, token) = funded_user(&app, "kim", "10").await;
    let mut tasks = Vec::new();
    for n in 0..3 {
        tasks.push(submitted_id(&app, &token, &format!("task {n}")).await);
        app.clock.advance(Duration::from_secs(1));
    }
    app.project().await;
    let page: Value = app
        .get_as(&token, "/api/v1/tasks?limit=2")
        .await
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = page["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|task| task["task_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [tasks[2].as_str(), tasks[1].as_str()]);
    assert_eq!(page["tasks"][0]["position"], 3);
    let cursor = page["next_cursor"].as_str().unwrap();
    let rest: Value = app
        .get_as(&token, &format!("/api/v1/tasks?limit=2&cursor={cursor}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(rest["tasks"][0]["task_id"], tasks[0].as_str());
    assert!(rest["next_cursor"].is_null());
    let bad = app.get_as(&token, "/api/v1/tasks?cursor=nope").await;
    assert_eq!(bad.status(), 422);
}

/// Cancel, prioritise and two claims race on a queue of two tasks, a thousand times. Each time
/// the second task ends either cancelled (its point returned) or dispatched (its point frozen),
/// never both; the fee is charged (net) exactly when the move was recorded; the queue ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_prioritise_and_claim_races_keep_the_invariants() {
    const ITERATIONS: usize = 1_000;
    let app = spawn_app_with_big_queue().await;
    let (user, _token) = funded_user(&app, "race", "100000").await;
    let user_id = UserId::from_uuid(Uuid::parse_str(&user).unwrap());
    let services = app.services_on_app_clock();
    let tasks = &services.tasks;
    let request = RequestedTask {
        prompt: "race".into(),
        ..RequestedTask::default()
    };
    let (mut cancelled, mut dispatched, mut moved) = (0, 0, 0);
    for _ in 0..ITERATIONS {
        let first = tasks
            .submit(user_id, &request, None, &metadata())
            .await
            .unwrap();
        let second = tasks
            .submit(user_id, &request, None, &metadata())
            .await
            .unwrap();
        let target = second.task_id;
        // Each on its own task of a multi-threaded runtime: a real race. Prioritise does the most
        // work before it appends, so the others start after a random number of Redis round
        // trips (work, not a timer) to give every ordering its chance.
        let (cancel_offset, claim_offset) = (rand::random_range(0..16), rand::random_range(0..48));
        let cancel = tokio::spawn({
            let tasks = tasks.clone();
            async move {
                round_trips(&tasks, cancel_offset).await;
                tasks.cancel(user_id, target, &metadata()).await
            }
        });
        let prioritise = tokio::spawn({
            let tasks = tasks.clone();
            async move { tasks.prioritise(user_id, target, None, &metadata()).await }
        });
        let claims = ["gpu-1", "gpu-2"].map(|backend| {
            let tasks = tasks.clone();
            tokio::spawn(async move {
                round_trips(&tasks, claim_offset).await;
                tasks.claim_next(backend, 0, &metadata()).await
            })
        });
        let cancel = cancel.await.unwrap();
        let prioritise = prioritise.await.unwrap();
        let [claim_a, claim_b] = claims;
        let claimed: Vec<Uuid> = [
            claim_a.await.unwrap().unwrap(),
            claim_b.await.unwrap().unwrap(),
        ]
        .into_iter()
        .flatten()
        .map(|claimed| claimed.task_id)
        .collect();
        let state = tasks.load(target).await.unwrap();
        match state.status {
            TaskStatus::Cancelled => {
                cancelled += 1;
                assert!(!claimed.contains(&target));
                // A cancel racing a claim that lost leaves the task cancelled, not dispatched.
                assert!(
                    matches!(cancel, Ok(ref outcome) if outcome.status == TaskStatus::Cancelled)
                );
            }
            TaskStatus::Dispatched => {
                dispatched += 1;
                assert!(claimed.contains(&target));
            }
            other => panic!("the raced task ended {other:?}"),
        }
        let recorded_move = !state.prioritisations.is_empty()
            && state
                .prioritisations
                .values()
                .all(|outcome| *outcome == zhihui_domain::task::PrioritisationOutcome::Moved);
        if recorded_move {
            moved += 1;
        }
        assert_eq!(prioritise.is_ok(), recorded_move, "{prioritise:?}");
        assert!(
            claimed.contains(&first.task_id),
            "the first task is always claimed"
        );
        assert_eq!(tasks.queue.len().await.unwrap(), 0);
        for task_id in claimed {
            tasks.queue.release_lease(task_id).await.unwrap();
        }
    }
    // Money: every dispatched task still holds its point, cancelled ones returned theirs, and
    // exactly one fee per recorded move.
    let account = account_of(&app, &user).await;
    let iterations = i64::try_from(ITERATIONS).unwrap();
    let dispatched_total = iterations + dispatched;
    assert_eq!(account.balance.frozen, Points::whole(dispatched_total));
    assert_eq!(
        account.balance.available,
        Points::whole(100_000 - dispatched_total - 5 * moved)
    );
    assert_eq!(cancelled + dispatched, iterations);
    // The race is real: each outcome happened (the counts name them if not).
    assert!(
        cancelled > 0 && dispatched > 0 && moved > 0,
        "cancelled {cancelled}, dispatched {dispatched}, moved {moved}"
    );
    project_and_verify(&app).await;
}

/// Project everything, then `zhihui audit verify` must find no difference.
pub(crate) async fn project_and_verify(app: &TestApp) {
    app.project().await;
    let verify = app.cli(&["audit", "verify"]);
    assert!(
        verify.status.success(),
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
}

async fn round_trips(tasks: &zhihui::tasks::service::TaskService, count: usize) {
    for _ in 0..count {
        tasks.queue.len().await.unwrap();
    }
}

async fn spawn_app_with_big_queue() -> TestApp {
    crate::helpers::spawn_app_with(|settings| {
        settings.tasks.queued_per_user_max = 1_000_000;
    })
    .await
}

/// A task submitted a moment ago is read from its stream (the tasks read model rarely has it
/// yet), any other from the read model. Told apart by a read model row changed by hand after
/// both were projected: the fresh task's view does not show the change, the keyed task's (its id
/// a UUIDv5, which carries no time, so never fresh) does. Another user gets 404 for either.
#[tokio::test]
async fn a_task_just_submitted_is_read_from_its_stream_and_an_older_one_from_the_read_model() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "xiaoming", "100").await;
    let (_, stranger) = funded_user(&app, "xiaohong", "10").await;
    let keyed = submit(
        &app,
        &token,
        &json!({"prompt": "月光下的竹林"}),
        Some("bamboo-1"),
    )
    .await;
    assert_eq!(keyed.status(), 201);
    let keyed: Value = keyed.json().await.unwrap();
    let keyed = keyed["task_id"].as_str().unwrap().to_owned();
    let client = crate::helpers::connect(&app.settings).await;
    let changed = "读模型里改过的提示词";
    // The fresh task's reads must come within the window of its submission: a machine too busy
    // for that tries again with a new task.
    let mut attempts = 0;
    loop {
        attempts += 1;
        let submitted_at = std::time::Instant::now();
        let fresh = submitted_id(&app, &token, "一只在雪山上的白猫").await;
        app.project().await;
        client
            .execute("UPDATE tasks SET prompt = $1", &[&changed])
            .await
            .unwrap();
        let view: Value = app
            .get_as(&token, &format!("/api/v1/tasks/{fresh}"))
            .await
            .json()
            .await
            .unwrap();
        // The window is `FRESH_TASK_MS` in `src/http/tasks.rs`, one second.
        let within = submitted_at.elapsed() < Duration::from_millis(900);
        if !within {
            assert!(attempts < 5, "five attempts each slower than the window");
            continue;
        }
        assert_eq!(view["prompt"], "一只在雪山上的白猫", "{view}");
        assert_eq!(view["status"], "queued");
        let other = app
            .get_as(&stranger, &format!("/api/v1/tasks/{fresh}"))
            .await;
        assert_eq!(other.status(), 404);
        break;
    }
    let view: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{keyed}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(view["prompt"], changed, "{view}");
    let other = app
        .get_as(&stranger, &format!("/api/v1/tasks/{keyed}"))
        .await;
    assert_eq!(other.status(), 404);
}
